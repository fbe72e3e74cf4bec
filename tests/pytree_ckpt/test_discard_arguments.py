"""What an output discard takes as arguments (NOTE [an output discard's arguments]): modules
held inside arguments are the call's modules, tensors anywhere but as plain positional
arguments are refused, named by their path. Each accepted case against its eager twin."""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import CheckpointConfigError, CheckpointError, CheckpointWithoutOutput


@dataclasses.dataclass
class Holder:
    m: Any = None
    t: Any = None


# How each case holds the module, and how the op reads it back.
HOLDERS: dict[str, tuple[Callable[[nn.Module], Any], Callable[[Any], nn.Module]]] = {
    "list": (lambda m: [m], lambda c: c[0]),
    "tuple": (lambda m: (3, m), lambda c: c[1]),
    "dict": (lambda m: {"m": m}, lambda c: c["m"]),
    "namespace": (lambda m: types.SimpleNamespace(m=m), lambda c: c.m),
    "dataclass": (lambda m: Holder(m=m), lambda c: c.m),
    "nested": (lambda m: types.SimpleNamespace(blocks=[{"m": m}]), lambda c: c.blocks[0]["m"]),
}


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.25))


def _step(block: nn.Module, hold: str, *, discard: bool, restricted: bool = False
          ) -> list[torch.Tensor]:
    """One step of ``tanh(block(x)) * 2``: x's gradient, the block's gradients and buffers."""
    wrap, read = HOLDERS[hold]
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = list(block.parameters())
    torch.manual_seed(7)  # the dropout's draw
    fn = lambda a, c: torch.tanh(read(c)(a))  # noqa: E731 - the op given the holder
    if discard:
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(fn, x, wrap(block))
        z = y * 2
        ckpt.discard_output_and_register_recompute(z)
    else:
        z = fn(x, wrap(block)) * 2
    loss = (z * z).sum()
    if restricted:  # a restricted backward: torch.autograd.grad to chosen tensors
        grads = list(torch.autograd.grad(loss, [x, *params]))
    else:
        loss.backward()
        grads = [x.grad, *(p.grad for p in params)]
    return [*grads, *(b.clone() for b in block.buffers())]


@pytest.mark.parametrize("hold", sorted(HOLDERS))
def test_a_module_held_in_an_argument_gives_eager_gradients_and_updates_its_state_once(
        hold: str) -> None:
    block = _block()
    eager_block, ours_block = copy.deepcopy(block), copy.deepcopy(block)
    eager = _step(eager_block, hold, discard=False)
    ours = _step(ours_block, hold, discard=True)
    # Running statistics and num_batches_tracked: updated once, as in eager (a list's module
    # was an unknown callable's, updated again by the rebuild).
    assert len(ours) == len(eager) == 1 + 4 + 3
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))


@pytest.mark.parametrize("hold", ["list", "dataclass"])
def test_a_module_held_in_an_argument_gets_its_gradients_from_a_restricted_backward(
        hold: str) -> None:
    block = _block()
    eager = _step(copy.deepcopy(block), hold, discard=False, restricted=True)
    ours = _step(copy.deepcopy(block), hold, discard=True, restricted=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))


def test_the_same_module_passed_and_held_in_an_argument_gives_eager_gradients() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    fn = lambda a, m, c: torch.tanh(m(a) + c[0](a))  # noqa: E731
    (fn(x, lin, [lin]) * 2).sum().backward()
    eager = [x.grad.clone(), *(p.grad.clone() for p in lin.parameters())]
    x.grad = None
    lin.zero_grad(set_to_none=True)
    ckpt = CheckpointWithoutOutput()
    z = ckpt.checkpoint(fn, x, lin, [lin]) * 2
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    ours = [x.grad, *(p.grad for p in lin.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))


@pytest.mark.parametrize(("make", "path"), [
    (lambda t: {t: 1.0}, "args[1].keys()[0]"),
    (lambda t: [1, Holder(t=t)], "args[1][1].t"),
    (lambda t: types.SimpleNamespace(scale=2.0, inner={"w": t}), "args[1].inner['w']"),
    (lambda t: Holder(m={0: [None, t]}), "args[1].m[0][1]"),
])
def test_a_tensor_held_in_a_positional_argument_is_refused_naming_its_path(
        make: Callable[[torch.Tensor], Any], path: str) -> None:
    w = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(CheckpointConfigError) as info:
        ckpt.checkpoint(lambda a, c: torch.tanh(a), torch.randn(4, requires_grad=True), make(w))
    message = str(info.value)
    assert "got a container of tensors at args[1]" in message
    assert f"holding a tensor at {path}" in message
    assert "ckpt.checkpoint(lambda a, b: torch.cat([a, b], -1), a, b)" in message
    assert ckpt.fn is None  # a refused call leaves the object unused, to retry


@pytest.mark.parametrize(("value", "path"), [
    (lambda t, m: types.SimpleNamespace(t=t), "kwargs['c'].t"),
    (lambda t, m: types.SimpleNamespace(m=m), "kwargs['c'].m"),
    (lambda t, m: {t: "key"}, "kwargs['c'].keys()[0]"),
])
def test_a_tensor_or_module_held_in_a_keyword_argument_is_refused_naming_its_path(
        value: Callable[[torch.Tensor, nn.Module], Any], path: str) -> None:
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(CheckpointConfigError) as info:
        ckpt.checkpoint(lambda a, c=None: torch.tanh(a), torch.randn(4, requires_grad=True),
                        c=value(torch.randn(4, requires_grad=True), nn.Linear(4, 4)))
    message = str(info.value)
    assert "got one as keyword 'c'" in message and f"holding one at {path}" in message
    assert "pass it positionally" in message


def test_a_tensor_free_namespace_keyword_is_passed_as_it_is_with_eager_gradients() -> None:
    x = torch.randn(4, requires_grad=True)
    options = types.SimpleNamespace(scale=3.0, names={"a": (1, 2)})
    fn = lambda a, o=None: torch.tanh(a * o.scale)  # noqa: E731
    (fn(x, o=options) * 2).sum().backward()
    eager = x.grad.clone()
    x.grad = None
    ckpt = CheckpointWithoutOutput()
    z = ckpt.checkpoint(fn, x, o=options) * 2
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    assert torch.equal(x.grad, eager)


# Helper RI: regressions of 65a6c24 (a module held in an argument is one of the call's
# modules) and what was checked around it.

def _closure_step(discard: bool, hold: Callable[[nn.Module], Any]) -> list[torch.Tensor | None]:
    """``tanh(proj(x) * c.scale)``: a lambda closing over ``proj``, given a config that holds
    another module it does not call."""
    torch.manual_seed(0)
    norm, proj = nn.LayerNorm(8), nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    config = hold(norm)
    fn = lambda a, c: torch.tanh(proj(a) * 2.0)  # noqa: E731 - reaches proj's parameters
    if discard:
        ckpt = CheckpointWithoutOutput()
        z = ckpt.checkpoint(fn, x, config) * 2
        ckpt.discard_output_and_register_recompute(z)
    else:
        z = fn(x, config) * 2
    (z * z).sum().backward()
    return [x.grad, *(p.grad for p in proj.parameters()), *(p.grad for p in norm.parameters())]


@pytest.mark.parametrize("hold", ["namespace", "list"])
def test_a_lambda_closing_over_a_module_given_a_config_holding_another_gives_eager_gradients(
        hold: str) -> None:
    wrap = {"namespace": lambda m: types.SimpleNamespace(scale=2.0, norm=m),
            "list": lambda m: [m]}[hold]
    eager = _closure_step(False, wrap)
    ours = _closure_step(True, wrap)
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(ours, eager, strict=True))


def test_a_lambda_reaching_a_trainable_module_beside_a_held_frozen_one_is_not_logged_as_untrainable(
        caplog: pytest.LogCaptureFixture) -> None:
    norm, proj = nn.LayerNorm(8), nn.Linear(8, 8)
    norm.requires_grad_(False)
    x = torch.randn(3, 8)  # needs no grad: nothing to rebuild from
    fn = lambda a, c: torch.tanh(c[0](a) + proj(a))  # noqa: E731 - proj is trainable
    z = proj(fn(x, [norm]))
    eager = torch.autograd.grad((z * z).sum(), list(proj.parameters()))
    with caplog.at_level("WARNING", logger="pytree_ckpt.discard"):
        ckpt = CheckpointWithoutOutput()
        z = proj(ckpt.checkpoint(fn, x, [norm]))
        ckpt.discard_output_and_register_recompute(z)
    ours = torch.autograd.grad((z * z).sum(), list(proj.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "frees nothing" in message
    assert "no trainable parameters" not in message  # proj's are trainable, and reached


@pytest.mark.parametrize("make", [
    lambda b: ([b, b],),                                       # the same module twice
    lambda b: ([b, b[1]],),                                    # a module and its child
    lambda b: (collections.OrderedDict(m=b),),
    lambda b: (collections.defaultdict(list, m=b),),
    lambda b: (collections.namedtuple("Pair", "m k")(b, 3),),
    lambda b: (nn.ModuleList([b]),),
], ids=["twice", "parent-and-child", "ordereddict", "defaultdict", "namedtuple", "modulelist"])
def test_a_module_held_in_other_holders_updates_its_state_once_over_micro_batches(
        make: Callable[[nn.Module], tuple[Any, ...]]) -> None:
    def first(c: Any) -> nn.Module:
        return c["m"] if isinstance(c, dict) else c[0]

    def step(discard: bool) -> list[torch.Tensor | None]:
        block = _block()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(7)
        fn = lambda a, c: torch.tanh(first(c)(a))  # noqa: E731
        losses = []
        for i in range(2):  # two micro-batches' forwards, then their backwards
            if discard:
                ckpt = CheckpointWithoutOutput()
                z = ckpt.checkpoint(fn, x * (i + 1), *make(block)) * 2
                ckpt.discard_output_and_register_recompute(z)
            else:
                z = fn(x * (i + 1), *make(block)) * 2
            losses.append((z * z).sum())
        for loss in losses:
            loss.backward()
        return [x.grad, *(p.grad for p in block.parameters()),
                *(b.clone() for b in block.buffers())]

    eager, ours = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))


def test_a_held_module_swapped_in_its_list_before_backward_is_refused_not_rebuilt_with_it() -> None:
    block, other = _block(), _block()
    holder = [block]
    x = torch.randn(6, 8, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    z = ckpt.checkpoint(lambda a, c: torch.tanh(c[0](a)), x, holder) * 2
    ckpt.discard_output_and_register_recompute(z)
    holder[0] = other  # the rebuild would run `other`: eager's graph ran `block`
    with pytest.raises(CheckpointError, match="neither an input nor a parameter"):
        z.sum().backward()


class _CountingNorm(nn.Module):
    """A module whose forward rebinds a buffer (a counter) and reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        self.n = self.n + 1
        return self.lin(a) * (1 + 0.01 * self.n)


class _HoldingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = _CountingNorm(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(lambda a, c: torch.tanh(c.norm(a)), x,
                            types.SimpleNamespace(norm=self.norm))
        z = self.out(y)
        ckpt.discard_output_and_register_recompute(z)
        return z


def test_a_module_held_by_a_discard_in_a_checkpointed_layer_gives_eager_state_over_micro_batches(
        ) -> None:
    from pytree_ckpt import apply_activation_checkpointing

    def step(ours: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), _HoldingLayer())
        if ours:
            apply_activation_checkpointing(model[1])
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
              for i in range(2)]
        losses = [(model(x) ** 2).sum() for x in xs]
        model.eval()  # between the forwards and the backwards
        for loss in losses:
            loss.backward()
        return [*(x.grad for x in xs), *(p.grad for p in model.parameters()),
                *(b.clone() for b in model.buffers())]

    eager, ours = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))
