"""What a reused call's fn reaches past its first place: attributes its code reads.

Rule 3 of reuse_during_recompute (NOTE [what fn reaches with grad] in frozen.py) refuses a
float result where fn reaches a trainable module or a tensor that requires grad. Before this
file's change the look stopped one value in, so a router a closure reached as
``holder.cfg.gate`` replayed its gate weights without their graph under checkpointing: the
gate got no gradient, silently, where eager refuses the result (it requires grad).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import ReuseError, checkpoint, current_phase, reuse_during_recompute
from tests.conftest import assert_same_grads, run_twice
from tests.pytree_ckpt.models import Log


class _Holder:
    """A plain object holding a config that holds the gate (not a module: nothing registers
    the gate as a submodule of anything fn is)."""

    def __init__(self, gate: nn.Module) -> None:
        self.cfg = types.SimpleNamespace(gate=gate, k=2)
        self.unused = nn.Linear(8, 8)  # trainable, never read by the router


class _FrozenRouter(nn.Module):
    """A module without trainable parameters whose method routes with what it holds plainly."""

    def __init__(self, gate: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["plain"] = types.SimpleNamespace(gate=gate)  # not a submodule
        self.scale = scale  # a tensor attribute, not a parameter or buffer

    def by_gate(self, x: torch.Tensor) -> Any:
        return self.plain.gate(x).softmax(-1).topk(2, dim=-1)

    def by_scale(self, x: torch.Tensor) -> Any:
        return (x[:, :4] * self.scale).softmax(-1).topk(2, dim=-1)


_REGISTRY = types.SimpleNamespace(routers={})


def _route_registry(x: torch.Tensor) -> Any:
    return _REGISTRY.routers["gate"](x).softmax(-1).topk(2, dim=-1)


def _router(how: str, gate: nn.Linear) -> Any:
    if how == "closure over a holder":
        holder = _Holder(gate)
        return lambda x: holder.cfg.gate(x).softmax(-1).topk(holder.cfg.k, dim=-1)
    if how == "frozen module's plain attribute":
        return _FrozenRouter(gate, torch.ones(4)).by_gate
    if how == "frozen module's tensor attribute":
        return _FrozenRouter(nn.Identity(), gate.weight[0, :4]).by_scale
    if how == "bound method in a closure":
        score = gate.forward
        return lambda x: score(x).softmax(-1).topk(2, dim=-1)
    _REGISTRY.routers["gate"] = gate
    if how == "callable object reading a global":
        return _RegistryRouter()
    return _route_registry


class _RegistryRouter:
    """A callable object holding nothing: its __call__ reads the global registry."""

    def __call__(self, x: torch.Tensor) -> Any:
        return _REGISTRY.routers["gate"](x).softmax(-1).topk(2, dim=-1)


@pytest.mark.parametrize("how, place", [
    ("closure over a holder", "closure variable 'holder', at .cfg.gate"),
    ("frozen module's plain attribute", "its module, at .plain.gate"),
    ("frozen module's tensor attribute", "its module, at .scale"),
    ("global registry object", "global '_REGISTRY', at .routers['gate']"),
    ("callable object reading a global", "global '_REGISTRY', at .routers['gate']"),
    ("bound method in a closure", "closure variable 'score'"),
])
def test_a_router_reached_through_attributes_fn_reads_is_refused_as_in_eager(
        how: str, place: str) -> None:
    gate = nn.Linear(8, 4)
    route = _router(how, gate)  # made once, as a layer holds it

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x[:, :2] * weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="returned result.values, which requires grad"):
        layer(x)  # eager: the weights carry the gate's graph
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError) as refused:
        out.sum().backward()  # before: passed, and the gate got no gradient
    assert place in str(refused.value) and "float result.values" in str(refused.value)
    assert gate.weight.grad is None  # refused before anything was accumulated


def test_a_trainable_module_the_code_does_not_read_refuses_nothing() -> None:
    # Only attributes whose names fn's code reads are looked in: the holder's trainable
    # `unused` and a frozen gate give floats without a graph in eager too.
    holder = _Holder(nn.Linear(8, 4).requires_grad_(False))
    route = lambda x: holder.cfg.gate(x).softmax(-1).topk(holder.cfg.k, dim=-1)  # noqa: E731
    calls = Log()

    def layer(x: torch.Tensor) -> torch.Tensor:
        calls.append(current_phase())
        weights, ids = reuse_during_recompute(route, x.detach())
        return holder.unused(x).gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(  # eager, then checkpointed
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(),
        [x, *holder.unused.parameters()]))
    assert len(calls) == 3  # eager, the original pass and the replay


def test_a_holder_that_refers_to_itself_is_looked_at_once_and_its_floats_replay() -> None:
    # A cycle (node.next is node) ends the look: each value is looked at once.
    node = types.SimpleNamespace(k=2)
    node.next = node

    def route(x: torch.Tensor) -> Any:
        return x.softmax(-1).topk(node.next.next.k, dim=-1)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x.gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(), [x]))
