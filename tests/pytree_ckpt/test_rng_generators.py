"""Generators passed in (NOTE [generators passed in] in rng.py) that a reused call or a kept op
draws from: the replay skips that draw, and must jump the generator past it (NOTE [skipped work
keeps the RNG in step] in frames.py), as it jumps the default generators."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import (KeptCallables, KeptOps, RecomputeConfig, SaveUnit,
                         apply_activation_checkpointing, apply_recompute_config, checkpoint,
                         reuse_during_recompute)
from tests.conftest import assert_same_grads, grads_of

# The generator as the caller passes it: alone, or in a container (the boundary flattens it).
WRAPS = {"alone": lambda g: g, "dict": lambda g: {"dropout": g}, "list": lambda g: [g]}


def _unwrap(rng: Any) -> torch.Generator | None:
    return rng["dropout"] if isinstance(rng, dict) else rng[0] if isinstance(rng, list) else rng


def _dropout(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # nn.functional.dropout takes no generator: the same mask, drawn from the one given.
    return x * (torch.rand(x.shape, generator=generator) > 0.5) * 2


def _jittered_ids(h: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.topk(h + torch.rand(h.shape, generator=generator) * 1e-3, 2, dim=-1).indices


class ReusedDraw(nn.Module):
    """Jittered routing replayed from the frame, then a dropout: both draw from the caller's
    generator."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, rng: Any) -> torch.Tensor:
        generator = _unwrap(rng)
        h = self.proj(x)
        ids = reuse_during_recompute(_jittered_ids, h.detach(), generator)
        y = torch.gather(h, -1, ids).sum(-1, keepdim=True) * h
        return _dropout(y, generator)


class Coins(nn.Module):
    def flip(self, h: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.bernoulli(torch.full_like(h, 0.5), generator=generator)


class KeptDraw(nn.Module):
    """A kept op (aten::bernoulli, or everything ``Coins.flip`` dispatches) draws from the
    caller's generator, then a dropout does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.coins = Coins()

    def forward(self, x: torch.Tensor, *, rng: Any) -> torch.Tensor:
        generator = _unwrap(rng)
        h = self.proj(x)
        return _dropout(h * self.coins.flip(h, generator), generator)


def _keep(layer: nn.Module, how: str) -> nn.Module:
    unit = KeptOps("aten::bernoulli") if how == "op" else KeptCallables("Coins.flip")
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: unit},
                           offload=False)
    return layer


def _step(model: nn.Module, wrap: Any, *, between: int = 0) -> list[Any]:
    """One forward and backward with a fresh generator; the loss, the gradients, then the state
    the step left the generator in and the default generator's."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(7)
    loss = model(x, rng=wrap(generator)).square().sum()
    torch.rand(between, generator=generator)  # the caller draws between forward and backward
    loss.backward()
    return [loss.detach(), *grads_of([x, *model.parameters()]), generator.get_state(),
            torch.get_rng_state()]


def _twins(make: Any, wrapping: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = make()
    return eager, wrapping(copy.deepcopy(eager))


@pytest.mark.parametrize("wrap", WRAPS.values(), ids=WRAPS.keys())
def test_a_reused_call_drawing_from_a_generator_passed_in_keeps_its_later_draws_in_step(
        wrap: Any) -> None:
    # Guards against: the replay skipped the reused call's draw from the generator passed in
    # (only the default generators jumped past it), so the dropout after it drew the routing's
    # numbers: another mask, other gradients, silently.
    eager, wrapped = _twins(ReusedDraw, apply_activation_checkpointing)
    assert_same_grads(_step(eager, wrap, between=5), _step(wrapped, wrap, between=5))


@pytest.mark.parametrize("wrap", WRAPS.values(), ids=WRAPS.keys())
@pytest.mark.parametrize("how", ["op", "callable"])
def test_a_kept_op_drawing_from_a_generator_passed_in_keeps_its_later_draws_in_step(
        how: str, wrap: Any) -> None:
    # Guards against: as above, for a save unit's kept op (by identity, or in a kept callable),
    # whose output the replay takes instead of drawing again.
    eager, wrapped = _twins(KeptDraw, lambda layer: _keep(layer, how))
    assert_same_grads(_step(eager, wrap, between=5), _step(wrapped, wrap, between=5))


class NestedReusedDraw(nn.Module):
    """The reused draw in an inner boundary, the generator passed to both boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ReusedDraw()
        self.proj = nn.Linear(8, 8)
        self.nested = False

    def forward(self, x: torch.Tensor, *, rng: Any) -> torch.Tensor:
        h = checkpoint(self.inner, x, rng=rng) if self.nested else self.inner(x, rng=rng)
        return _dropout(self.proj(h), _unwrap(rng))


def _nest(layer: NestedReusedDraw) -> NestedReusedDraw:
    layer.nested = True
    return apply_activation_checkpointing(layer)


@pytest.mark.parametrize("wrap", WRAPS.values(), ids=WRAPS.keys())
def test_the_generator_jump_of_a_reused_call_reaches_a_nested_boundary_too(wrap: Any) -> None:
    # The inner boundary's first run is inside the outer replay, which takes the jump from the
    # outer frame; the inner replay needs it again, and the outer dropout after both.
    eager, wrapped = _twins(NestedReusedDraw, _nest)
    assert_same_grads(_step(eager, wrap), _step(wrapped, wrap))


@pytest.mark.parametrize("layer", [ReusedDraw, KeptDraw], ids=["reused", "kept"])
def test_without_rng_preservation_a_generator_passed_in_moves_as_the_default_one_does(
        layer: Any) -> None:
    # preserve_rng_state=False restores no generator for the replay, so none may jump either
    # (a jump would move it to a state recorded in the forward: back, or past draws the replay
    # makes): a generator passed in draws its next numbers in the replay and ends the step as
    # far on as the default generator does in the same layer (both unlike eager).
    def wrapping(model: nn.Module) -> nn.Module:
        if isinstance(model, KeptDraw):
            apply_recompute_config([model], RecomputeConfig(1.0, save=["attn"]),
                                   {SaveUnit.ATTN: KeptOps("aten::bernoulli")}, offload=False,
                                   preserve_rng_state=False)
            return model
        return apply_activation_checkpointing(model, preserve_rng_state=False)

    _, wrapped = _twins(layer, wrapping)
    results = []
    for default in (True, False):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(3)
        generator = torch.Generator().manual_seed(3)
        # None: the layer draws from the default generator, which the boundary cannot see
        loss = wrapped(x, rng=None if default else generator).square().sum()
        drawn = torch.default_generator if default else generator
        torch.rand(5, generator=drawn)  # the caller draws between forward and backward
        loss.backward()
        results.append([loss.detach(), *grads_of([x, *wrapped.parameters()]), drawn.get_state()])
        for p in wrapped.parameters():
            p.grad = None
    assert_same_grads(*results)
