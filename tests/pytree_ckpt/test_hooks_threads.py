"""Parameter hooks while another thread runs a backward through the same parameters (NOTE
[parameter hooks run once], pytree_ckpt/parameter_hooks.py): the replay's pause of a
parameter's hooks must hold for its own gradient call only. The threads are made to overlap
deterministically: a gate in the layer's backward (before the parameter's gradient is
reached) stops one thread's replay until the other has done what it must do meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import checkpoint
from tests.switch_points import at_each_switch_point

# thread name -> (event to set on reaching the gate, event to wait for there)
_GATES: dict[str, tuple[threading.Event, threading.Event]] = {}


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        gate = _GATES.get(threading.current_thread().name)
        if gate is not None:
            reached, wait = gate
            reached.set()
            assert wait.wait(10)
        return grad


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(4.0).reshape(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gate.apply(x @ self.weight)


def _in_two_threads(a: Callable[[], Any], b: Callable[[], Any]) -> None:
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
        return body

    threads = [threading.Thread(target=run(a), name="A"), threading.Thread(target=run(b), name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    _GATES.clear()
    assert not errors, errors


def _eager_gradient() -> torch.Tensor:
    layer = _Layer()
    layer.weight.register_hook(lambda g: g * 2)
    return torch.autograd.grad(layer(torch.ones(1, 2)).sum(), layer.weight)[0]


def test_a_plain_backward_in_another_thread_during_a_replay_runs_the_parameter_hook() -> None:
    # Guards against: the pause swapped the hooks for no-ops in the parameter's shared hooks
    # dict, so thread B's plain backward, run while thread A's replay held them, skipped the
    # user's hook (a gradient half of eager's, silently).
    layer = _Layer()
    layer.weight.register_hook(lambda g: g * 2)
    pytree_ckpt.apply_activation_checkpointing(layer)
    a_replaying, b_done = threading.Event(), threading.Event()
    grads: dict[str, torch.Tensor] = {}
    x = torch.ones(1, 2)

    def a() -> None:
        _GATES["A"] = (a_replaying, b_done)
        grads["A"] = torch.autograd.grad(layer(x).sum(), layer.weight)[0]

    def b() -> None:
        assert a_replaying.wait(10)
        try:
            grads["B"] = torch.autograd.grad((x @ layer.weight).sum(), layer.weight)[0]
        finally:
            b_done.set()

    _in_two_threads(a, b)
    eager = _eager_gradient()
    assert torch.equal(grads["A"], eager)
    assert torch.equal(grads["B"], eager)


def test_two_threads_replaying_one_layer_each_run_the_parameter_hook_once() -> None:
    # Guards against: B's pause started while A's held the hooks and so paused nothing; A's
    # put them back while B's replay still ran, and B's replay ran the hook on what it
    # captured, then its outer backward again (a gradient twice eager's, silently).
    layer = _Layer()
    layer.weight.register_hook(lambda g: g * 2)
    pytree_ckpt.apply_activation_checkpointing(layer)
    a_replaying, b_replaying, a_done = threading.Event(), threading.Event(), threading.Event()
    grads: dict[str, torch.Tensor] = {}
    x = torch.ones(1, 2)

    def a() -> None:
        _GATES["A"] = (a_replaying, b_replaying)
        try:
            grads["A"] = torch.autograd.grad(layer(x).sum(), layer.weight)[0]
        finally:
            a_done.set()

    def b() -> None:
        assert a_replaying.wait(10)
        _GATES["B"] = (b_replaying, a_done)  # B's replay goes on once A's is over
        grads["B"] = torch.autograd.grad(layer(x).sum(), layer.weight)[0]

    _in_two_threads(a, b)
    eager = _eager_gradient()
    assert torch.equal(grads["A"], eager)
    assert torch.equal(grads["B"], eager)


def test_hooks_of_a_parameter_the_layer_returns_as_an_output_run_once_as_in_eager() -> None:
    # The replay's output is the parameter itself (a leaf, no node to mark the replay's
    # gradient call by): the pause takes the gradient of a view of it, and the hooks, its
    # own and a multi-grad hook (torch's, called with None too), still run once per backward.
    class ReturnsItsBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.arange(4.0).reshape(2, 2))
            self.bias = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x @ self.weight, "bias": self.bias}

    def run(wrap: bool) -> tuple[list[torch.Tensor], list[str]]:
        layer = ReturnsItsBias()
        calls: list[str] = []
        for name, p in layer.named_parameters():
            p.register_hook(lambda g, name=name: calls.append(name) or g * 2)
        torch.autograd.graph.register_multi_grad_hook(
            (layer.weight, layer.bias), lambda grads: calls.append("both"))
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        for _ in range(2):
            out = layer(torch.ones(1, 2))
            (out["y"].sum() + out["bias"].square().sum()).backward()
        return [p.grad for p in layer.parameters()], sorted(calls)

    (eager, eager_calls), (wrapped, wrapped_calls) = run(False), run(True)
    assert all(map(torch.equal, eager, wrapped))
    assert wrapped_calls == eager_calls == ["bias", "bias", "both", "both", "weight", "weight"]


def test_a_replay_leaves_no_graph_task_marked_as_paused() -> None:
    from pytree_ckpt import parameter_hooks

    layer = _Layer()
    layer.weight.register_hook(lambda g: g * 2)
    checkpoint(layer, torch.ones(1, 2)).sum().backward()
    assert parameter_hooks._REPLAYS == set()


@pytest.mark.parametrize("wrap", ["parameter", "input"])
def test_a_hook_registered_by_another_thread_while_hooks_are_wrapped_stays_registered(
        wrap: str) -> None:
    # Guards against: the hooks were wrapped while iterating the dict itself; a hook that
    # another thread registered in between made the wrapping thread raise "OrderedDict
    # mutated during iteration" (its backward failed).
    from pytree_ckpt.parameter_hooks import ParameterHooksPaused, skip_no_gradient


    def wrap_switching_at(point: int) -> bool:
        weight = nn.Parameter(torch.ones(2))
        handles = [weight.register_hook(lambda g: g * 2) for _ in range(3)]
        added: list[Any] = []

        def other_thread(at: int) -> None:
            if at == point:
                added.append(weight.register_hook(lambda g: g * 3))

        run = (lambda: ParameterHooksPaused([weight])) if wrap == "parameter" else \
            (lambda: skip_no_gradient(weight))
        at_each_switch_point(run, other_thread)
        if not added:
            return False  # past the wrapping's last switch point
        hooks = weight._backward_hooks
        assert hooks is not None
        assert list(hooks) == [*(h.id for h in handles), added[0].id], f"switch point {point}"
        return True

    points = 0
    while wrap_switching_at(points):
        points += 1
    assert points > 3
