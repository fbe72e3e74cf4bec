"""put_first (NOTE [hooks put first in place], pytree_ckpt/parameter_hooks.py) as another
thread sees it: a thread switch can come between any two bytecodes of the thread running it
(that is where the GIL changes hands), so these tests stop at each of those points and do
there what another thread could: run the hooks (a module's forward, a parameter's gradient
accumulation), register a hook, remove one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt.parameter_hooks import put_first
from tests.switch_points import at_each_switch_point


def _c_order(hooks: dict[Any, Any]) -> list[Any]:
    """The keys in the order torch's C++ hooks walk them (an OrderedDict's own iteration
    order can differ: ``move_to_end`` changes only that one)."""
    return list(dict.keys(hooks))


def test_a_forward_in_another_thread_during_put_first_runs_every_forward_hook() -> None:
    # Guards against: put_first emptied the dict and refilled it; a forward another thread
    # ran in between (DataParallel's replicas share their modules' hook dicts, and the
    # recorder is put first at the first call) skipped the user's hooks, silently.
    module = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    ran: list[str] = []
    for name in ("a", "b", "c"):
        module.register_forward_hook(lambda m, args, out, name=name: ran.append(name))
    hooks = module._forward_hooks
    recorder_key = module.register_forward_hook(lambda m, args, out: ran.append("first")).id
    missed: list[tuple[int, list[str]]] = []

    def forward_there(point: int) -> None:
        ran.clear()
        module(x)
        if sorted(name for name in ran if name != "first") != ["a", "b", "c"]:
            missed.append((point, list(ran)))

    points = at_each_switch_point(lambda: put_first(hooks, recorder_key, hooks[recorder_key]),
                                   forward_there)
    assert points > 0
    assert missed == []
    ran.clear()
    module(x)
    assert ran == ["first", "a", "b", "c"]
    assert _c_order(hooks) == list(hooks) and _c_order(hooks)[0] == recorder_key


def test_an_accumulation_in_another_thread_during_put_first_runs_every_hook() -> None:
    # The same for a parameter's post-accumulate-grad hooks, which torch's C++ hook walks
    # (the post-accumulate gate is put first when a replay gives a parameter no gradient).
    weight = nn.Parameter(torch.randn(3))
    ran: list[str] = []
    for name in ("a", "b"):
        weight.register_post_accumulate_grad_hook(lambda p, name=name: ran.append(name))
    hooks = weight._post_accumulate_grad_hooks
    assert hooks is not None
    missed: list[tuple[int, list[str]]] = []

    def accumulate_there(point: int) -> None:
        ran.clear()
        (weight * 2).sum().backward()
        if sorted(name for name in ran if name != "gate") != ["a", "b"]:
            missed.append((point, list(ran)))

    at_each_switch_point(lambda: put_first(hooks, "gate", lambda p: ran.append("gate")),
                          accumulate_there)
    assert missed == []
    ran.clear()
    (weight * 2).sum().backward()
    assert ran == ["gate", "a", "b"]


@pytest.mark.parametrize("action", ["register", "remove"])
@pytest.mark.parametrize("key_registered", [True, False], ids=["registered", "new"])
def test_a_hook_registered_or_removed_by_another_thread_during_put_first_stays_so(
        action: str, key_registered: bool) -> None:
    # Guards against: put_first read the hooks, emptied the dict and put back what it had
    # read; a hook registered in between was lost for good (its handle found nothing to
    # remove), one removed in between came back and kept running, and one registered while
    # the hooks were read made put_first raise "OrderedDict mutated during iteration".
    def put_first_switching_at(point: int) -> bool:
        module = nn.Linear(2, 2)
        handles = [module.register_forward_hook(lambda m, a, o: None) for _ in range(3)]
        hooks = module._forward_hooks
        # The recorder's case (registered, then put first) and the gate's (a new key).
        key: Any = module.register_forward_hook(lambda m, a, o: None).id \
            if key_registered else "first"
        hook = hooks[key] if key_registered else (lambda m, a, o: None)
        changed: list[Any] = []

        def other_thread(at: int) -> None:
            if at != point:
                return
            if action == "register":
                changed.append(module.register_forward_hook(lambda m, a, o: None).id)
            else:
                handles[1].remove()
                changed.append(handles[1].id)

        at_each_switch_point(lambda: put_first(hooks, key, hook), other_thread)
        if not changed:
            return False  # past put_first's last switch point
        expected = {key, *(handle.id for handle in handles)}
        expected = expected | set(changed) if action == "register" else expected - set(changed)
        assert set(hooks) == expected, f"switch point {point}"
        assert _c_order(hooks)[0] == key and list(hooks)[0] == key, f"switch point {point}"
        return True

    points = 0
    while put_first_switching_at(points):
        points += 1
    assert points > 3
