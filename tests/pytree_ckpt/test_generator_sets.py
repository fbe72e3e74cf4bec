"""A forward that sets a default generator's state (NOTE [a forward that sets a default
generator's state] in generator_sets.py).

Helper DF: Megatron-Core's and DeepSpeed's RNG trackers run dropout inside
``get_cuda_rng_tracker().fork()``, which loads the tracker's state into the default generator.
The replay loaded the state the original pass had already advanced, drew another mask, and
the gradients differed from eager's, silently; the tracker also ended the step elsewhere.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt


class _Tracker:
    """Megatron's CudaRNGStatesTracker, on the CPU generator: named states, fork() loads one
    into the default generator, stores it back advanced, and puts the default state back."""

    def __init__(self, seed: int) -> None:
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states = {"model-parallel-rng": torch.get_rng_state()}
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _Attention(nn.Module):
    """Attention-probability dropout under the tracker (Megatron's DotProductAttention), a
    hidden dropout on the default stream after it."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.tracker = tracker  # a list: the tracker is made per run, as a global would be

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with self.tracker[0].fork():
            h = nn.functional.dropout(h.softmax(-1), 0.5)
        return x + nn.functional.dropout(h, 0.2)


def _run(model: nn.Module, tracker: list[_Tracker], *, steps: int = 3,
         retain: bool = False) -> list[torch.Tensor]:
    """Steps of training; what each leaves: every grad, the tracker's state and the default
    generator's."""
    tracker[:] = [_Tracker(123)]
    torch.manual_seed(5)
    seen = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8, requires_grad=True)).square().sum()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()  # the replay runs again: the tracker must not move
        seen += [p.grad.clone() for p in model.parameters()]
        seen += [tracker[0].states["model-parallel-rng"].clone(), torch.get_rng_state()]
        model.zero_grad(set_to_none=True)
    return seen


def _twins() -> tuple[nn.Module, nn.Module, list[_Tracker]]:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(_Attention(tracker), _Attention(tracker), _Attention(tracker))
    return eager, copy.deepcopy(eager), tracker


@pytest.mark.parametrize("retain", [False, True])
def test_dropout_under_an_rng_tracker_fork_replays_as_eager_and_the_tracker_ends_as_eager(
        retain: bool) -> None:
    eager, ours, _ = _twins()
    tracker = ours[0].tracker  # the copies share one list, as they would a global
    pytree_ckpt.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, _Attention))
    expected = _run(eager, eager[0].tracker, retain=retain)
    got = _run(ours, tracker, retain=retain)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), i


def test_a_fork_in_a_checkpointed_plain_function_replays_as_eager() -> None:
    eager, ours, _ = _twins()
    tracker = ours[0].tracker

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.inner:  # Megatron's "uniform" chunk, as a closure
                x = pytree_ckpt.checkpoint(lambda h, layer=layer: layer(h), x)
            return x

    expected = _run(eager, eager[0].tracker)
    got = _run(Checkpointed(ours), tracker)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), i


# The profile function each call of _Plain ran under (a global: a list the module held would
# be module state, put back as the forward began for the replay).
_PROFILES: list[Any] = []


class _Plain(nn.Module):
    """Sets no generator's state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _PROFILES.append(sys.getprofile())
        return nn.functional.dropout(self.lin(x), 0.5)


def test_a_layer_whose_first_call_sets_no_state_is_not_watched_again() -> None:
    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(_Plain())
    for _ in range(2):
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    # original pass, replay; original pass, replay: only the first pass is watched
    assert [p is not None for p in _PROFILES] == [True, False, False, False]


def test_a_users_profiler_is_left_in_place_and_still_called() -> None:
    # A foreign profile function cannot be known to chain: nothing is watched while it is on
    # (docs/limits.md), and it sees every call.
    events: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        events.append(event)

    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(_Plain())
    sys.setprofile(profiler)
    try:
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    finally:
        sys.setprofile(None)
    assert _PROFILES == [profiler, profiler] and "c_call" in events


class _DiscardedDropout(nn.Module):
    """Megatron's pattern: the dropout under the tracker is an output discard's function, its
    output rebuilt in backward."""

    def __init__(self, tracker: list[_Tracker], *, discard: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)
        self.tracker, self.discard = tracker, discard

    def dropped(self, h: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork():
            return nn.functional.dropout(h, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.discard:
            return self.down(self.dropped(self.up(x)))
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        d = ckpt.checkpoint(self.dropped, self.up(x))
        out = self.down(d)
        ckpt.discard_output_and_register_recompute(out)
        return out


def test_a_fork_in_an_output_discards_function_rebuilds_as_eager() -> None:
    torch.manual_seed(0)
    eager_tracker: list[_Tracker] = []
    ours_tracker: list[_Tracker] = []
    eager = nn.Sequential(*(_DiscardedDropout(eager_tracker, discard=False) for _ in range(2)))
    ours = copy.deepcopy(eager)
    for layer in ours:
        layer.tracker, layer.discard = ours_tracker, True
    expected = _run(eager, eager_tracker)
    got = _run(ours, ours_tracker)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), i


def test_dynamos_own_sets_while_compiling_a_body_are_not_the_forwards() -> None:
    # Dynamo keeps the RNG state around its tracing (get, then set, deep inside torch): a
    # compiled body's first call was taken for a forward that sets a state, and every later
    # pass was watched.
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.lin(x), 0.5)

    class Compiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.body.forward = torch.compile(self.body.forward, backend="aot_eager")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _PROFILES.append(sys.getprofile())
            return self.body(x)

    torch.manual_seed(0)
    eager = Compiled()
    torch.manual_seed(0)  # not a deepcopy: the copy's compiled forward would be eager's
    ours = pytree_ckpt.apply_activation_checkpointing(Compiled())
    _PROFILES.clear()
    grads = []
    for model in (eager, ours):
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert [p is not None for p in _PROFILES[2:]] == [True, False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
