"""NOTE [the replay calls the engine directly] (engine.py): the replay's gradients skip
``torch.autograd.grad``'s Python checks, and are eager's whichever way they are computed."""

from __future__ import annotations

import copy
import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

import pytree_ckpt
from pytree_ckpt import engine


def _twins() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    wrapped = copy.deepcopy(block)
    pytree_ckpt.apply_activation_checkpointing(wrapped)
    return block, wrapped, torch.randn(4, 8)


def _grads(module: nn.Module, data: torch.Tensor) -> list[torch.Tensor]:
    x = data.clone().requires_grad_()
    module(x).square().sum().backward()
    return [x.grad, *(p.grad for p in module.parameters())]


def _assert_equal(eager: list[torch.Tensor], ckpt: list[torch.Tensor]) -> None:
    assert len(eager) == len(ckpt)
    for a, b in zip(eager, ckpt):
        assert torch.equal(a, b)


class _Tagged(torch.Tensor):
    """A tensor subclass with torch's default ``__torch_function__`` (results stay tagged)."""


def _counting_grad(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad",
                        lambda *args, **kwargs: calls.append(1) or grad(*args, **kwargs))
    return calls


def test_the_replay_of_a_module_reaches_the_engine_without_torch_autograd_grad(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block, wrapped, data = _twins()
    calls = _counting_grad(monkeypatch)
    _assert_equal(_grads(block, data), _grads(wrapped, data))
    assert calls == []


@pytest.mark.parametrize("plain_loss", [False, True])
def test_a_tensor_subclass_input_gets_eager_gradients_on_the_direct_path(
        monkeypatch: pytest.MonkeyPatch, plain_loss: bool) -> None:
    # torch.autograd.grad would first offer the call to the subclass's __torch_function__. A
    # backward started from a subclass loss runs with subclass handling off; from a plain loss
    # it runs with it on, and torch's default __torch_function__ runs grad unchanged: either
    # way the direct path skips nothing a replay would have done.
    block, wrapped, data = _twins()
    calls = _counting_grad(monkeypatch)

    def grads(module: nn.Module) -> list[torch.Tensor]:
        x = data.clone().as_subclass(_Tagged).requires_grad_()
        out = module(x)
        (out.as_subclass(torch.Tensor) if plain_loss else out).square().sum().backward()
        return [x.grad, *(p.grad for p in module.parameters())]

    eager, ckpt = grads(block), grads(wrapped)
    assert calls == []
    _assert_equal(eager, ckpt)


class _SeesGrad(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.grad_calls = 0

    def __torch_function__(self, func: object, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        self.grad_calls += func is torch.autograd.grad
        return func(*args, **(kwargs or {}))  # type: ignore[operator]


def test_a_torch_function_mode_around_backward_is_not_active_inside_the_replay() -> None:
    # So it never saw the replay's torch.autograd.grad: the direct path hides nothing from it.
    block, wrapped, data = _twins()
    eager = _grads(block, data)
    x = data.clone().requires_grad_()
    loss = wrapped(x).square().sum()
    with _SeesGrad() as mode:
        loss.backward()
    assert mode.grad_calls == 0
    _assert_equal(eager, [x.grad, *(p.grad for p in wrapped.parameters())])


def test_a_torch_without_the_engine_entry_still_gives_eager_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block, wrapped, data = _twins()
    monkeypatch.setattr(engine, "_engine_run_backward", None)
    calls = _counting_grad(monkeypatch)
    _assert_equal(_grads(block, data), _grads(wrapped, data))
    assert calls == [1]


class _Saves(nn.Module):
    """exp and cos both save exp's result; a hook on the projection's output, registered in
    the replay, runs after their backward and notes whether that storage is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.freed: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.proj(x)
        c = a.sin().exp()
        if torch.is_grad_enabled():  # the replay (the original pass runs under no-grad)
            storage = StorageWeakRef(c.untyped_storage())
            a.register_hook(lambda g: self.freed.append(storage.expired()))
        return c.cos()


def test_the_replay_frees_each_ops_saved_tensors_once_its_backward_ran() -> None:
    # As eager's backward (retain_graph=False): by the time the gradient reaches the
    # projection's output, exp's saved result is freed, not held until the layer's backward
    # ends (a replay that retained its graph kept a whole layer's activations at once).
    layer = pytree_ckpt.apply_activation_checkpointing(_Saves())
    layer(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert layer.freed == [True]


# NOTE [the Function is applied in C] (boundary_function.py): the boundary applies its Function
# without torch.autograd.Function.apply's Python wrapper, and does that wrapper's steps itself.


def test_an_input_that_escaped_a_torch_func_transform_reaches_the_function_unwrapped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [the Function is applied in C]: Function.apply unwraps a tensor that escaped a
    # torch.func transform before the Function's forward sees it; the C path must too (without
    # it the forward got the dead wrapper, a difference no gradient here shows).
    from pytree_ckpt import boundary_function

    torch.manual_seed(1)
    leaked: list[torch.Tensor] = []

    def keeps(x: torch.Tensor) -> torch.Tensor:
        leaked.append(x * 1)  # a functorch wrapper, dead once grad returns
        return x.sum()

    torch.func.grad(keeps)(torch.randn(8))
    escaped = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(escaped)
    wrapped_seen: list[tuple[str, bool]] = []
    given: list[bool] = []  # whether the Function's forward got a wrapper
    forward = boundary_function._BoundaryFunction.forward

    def spy(ctx: object, call: object, anchor: object, *inputs: torch.Tensor) -> object:
        given.append(torch._C._functorch.is_functorch_wrapped_tensor(inputs[0]))
        return forward(ctx, call, anchor, *inputs)

    monkeypatch.setattr(boundary_function._BoundaryFunction, "forward", staticmethod(spy))

    class Records(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wrapped_seen.append((str(pytree_ckpt.current_phase()),
                                 torch._C._functorch.is_functorch_wrapped_tensor(x)))
            return self.lin(x)

    eager = Records()
    grads = []
    for in_c in (True, False):
        if not in_c:
            monkeypatch.setattr(boundary_function, "_apply_in_c", None)  # Function.apply itself
        wrapped = copy.deepcopy(eager)
        pytree_ckpt.apply_activation_checkpointing(wrapped)
        wrapped(escaped).square().sum().backward()
        grads.append([p.grad for p in wrapped.parameters()])
    eager(escaped).square().sum().backward()
    # The layer's forward gets the caller's own tensor; the Function and the replay, the
    # unwrapped one, on either path.
    assert given == [False, False]
    assert wrapped_seen == [("forward", True), ("recompute", False)] * 2 + [("plain", True)]
    for grads_of_path in grads:
        _assert_equal(grads_of_path, [p.grad for p in eager.parameters()])


class _Records(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: object, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))  # type: ignore[operator]


def test_a_torch_function_mode_and_a_subclass_see_what_function_apply_would_show_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards the NOTE's claim that nothing of Function.apply's Python wrapper is skipped that
    # a torch-function mode around the call, or a __torch_function__ input, would see: the
    # calls they see, the output's type and the gradients are those of Function.apply's path.
    from pytree_ckpt import boundary_function

    def run() -> tuple[list[str], type, list[torch.Tensor]]:
        block, wrapped, data = _twins()
        x = data.clone().as_subclass(_Tagged).requires_grad_()
        with _Records() as mode:
            out = wrapped(x)
        out.square().sum().backward()
        return mode.calls, type(out), [x.grad, *(p.grad for p in wrapped.parameters())]

    in_c = run()
    monkeypatch.setattr(boundary_function, "_apply_in_c", None)  # Function.apply itself
    in_python = run()
    assert in_c[:2] == in_python[:2] and in_c[1] is _Tagged
    _assert_equal(in_c[2], in_python[2])


def test_a_full_backward_asks_the_engine_about_no_node_and_a_restricted_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: used_by_this_backward (recompute.py) asking
    # torch._C._will_engine_execute_node about every wanted gradient in a full backward too
    # (torch's checkpoint-valid flag on: every gradient is used), once per input and
    # parameter at every replay; a restricted one must still ask, and both give eager's
    # gradients.
    asked: list[object] = []
    real = torch._C._will_engine_execute_node
    monkeypatch.setattr(torch._C, "_will_engine_execute_node",
                        lambda node: asked.append(node) or real(node))
    block, wrapped, data = _twins()
    assert all(torch.equal(a, b) for a, b in zip(_grads(block, data), _grads(wrapped, data)))
    assert asked == []
    bias, twin_bias = block[2].bias, wrapped[2].bias
    expected = torch.autograd.grad(block(data).square().sum(), [bias])
    got = torch.autograd.grad(wrapped(data).square().sum(), [twin_bias])
    assert torch.equal(expected[0], got[0])
    assert len(asked) == 4  # the two weights and two biases of the layer (the input needs none)
