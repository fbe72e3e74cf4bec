"""Generators passed in (NOTE [generators passed in] in rng.py) that a reused call or a kept op
draws from: the replay skips that draw, and must jump the generator past it (NOTE [skipped work
keeps the RNG in step] in frames.py), as it jumps the default generators. Then generators a
module holds as attributes (NOTE [generators held as attributes] in held_generators.py):
restored for the replay, jumped, and left where eager leaves them, as those passed in."""

from __future__ import annotations

import warnings

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import held_generators
from pytree_ckpt import (CheckpointWithoutOutput, KeptCallables, KeptOps, RecomputeConfig,
                         SaveUnit, apply_activation_checkpointing, apply_recompute_config,
                         checkpoint, remove_activation_checkpointing, reuse_during_recompute)
from tests.conftest import assert_same_grads, grads_of

# The generator as the caller passes it: alone, or in a container (the boundary flattens it).
WRAPS = {"alone": lambda g: g, "dict": lambda g: {"dropout": g}, "list": lambda g: [g]}


def _unwrap(rng: Any) -> torch.Generator | None:
    return rng["dropout"] if isinstance(rng, dict) else rng[0] if isinstance(rng, list) else rng


def _dropout(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # nn.functional.dropout takes no generator: the same mask, drawn from the one given.
    return x * (torch.rand(x.shape, generator=generator, device=x.device) > 0.5) * 2


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


# Generators a module holds as attributes (NOTE [generators held as attributes] in
# held_generators.py): restored for the replay and jumped as those passed in.

def _noisy_ids(h: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # Router noise as large as the logits: a replay drawing other noise routes elsewhere.
    return torch.topk(h + torch.randn(h.shape, generator=generator, device=h.device), 2,
                      dim=-1).indices


class Router(nn.Module):
    """An MoE-style router with noise from a generator of its own (``held``: None draws from
    the default generator, as before a generator is assigned)."""

    def __init__(self, *, held: bool = True, how: str = "plain") -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.how = how  # "plain": recomputed; "reused": reuse_during_recompute; "kept": kept op
        if held:
            self.gen = torch.Generator().manual_seed(5)

    def noise(self, h: torch.Tensor) -> torch.Tensor:
        return torch.bernoulli(torch.full_like(h, 0.5), generator=self.__dict__.get("gen"))

    def forward(self, x: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
        generator = rng if rng is not None else self.__dict__.get("gen")
        h = self.proj(x)
        if self.how == "reused":
            ids = reuse_during_recompute(_noisy_ids, h.detach(), generator)
        elif self.how == "kept":  # aten::bernoulli kept: the replay takes its output
            ids = torch.topk(h.detach() + self.noise(h) * 4, 2, dim=-1).indices
        else:
            ids = _noisy_ids(h.detach(), generator)
        y = torch.gather(h, -1, ids).sum(-1, keepdim=True) * h
        return _dropout(y, generator)  # a later draw: in step only if the skipped one jumped


class RoutedBlock(nn.Module):
    """The router as a submodule; ``own``: the block holds a generator too, for its dropout."""

    def __init__(self, *, own: bool = False, held: bool = True, how: str = "plain") -> None:
        super().__init__()
        self.router = Router(held=held, how=how)
        self.out = nn.Linear(8, 8)
        if own:
            self.gen = torch.Generator().manual_seed(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.out(self.router(x)), self.__dict__.get("gen"))


def _held_generators(model: nn.Module) -> list[torch.Generator]:
    found = {id(g): g for m in model.modules() for g in m.__dict__.values()
             if isinstance(g, torch.Generator)}
    return list(found.values())


def _held_step(model: nn.Module) -> list[Any]:
    """One forward and backward; the loss, the gradients, the states the step left the
    model's generators and the default one in."""
    device = next(model.parameters()).device
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)
    x.requires_grad_()
    torch.manual_seed(7)
    loss = model(x).square().sum()
    for g in _held_generators(model):  # the caller draws between forward and backward
        torch.rand(3, generator=g, device=g.device)
    loss.backward()
    out = [loss.detach(), *grads_of([x, *model.parameters()]),
           *(g.get_state() for g in _held_generators(model)), torch.get_rng_state()]
    for p in model.parameters():
        p.grad = None
    return out


def _assert_steps_equal(eager: nn.Module, wrapped: nn.Module, *, steps: int = 3,
                        between: Any = None) -> None:
    for step in range(steps):
        if between is not None:
            between(step, eager)
            between(step, wrapped)
        assert_same_grads(_held_step(eager), _held_step(wrapped))


def _offloaded(layer: nn.Module) -> nn.Module:
    return apply_activation_checkpointing(
        layer, offload=OffloadManager(OffloadConfig(min_bytes=0), device="cpu"))


HELD = {
    "on the layer": lambda: Router(),
    "on a submodule": lambda: RoutedBlock(),
    "on both": lambda: RoutedBlock(own=True),
    "reused call": lambda: RoutedBlock(how="reused"),
    "kept op": lambda: RoutedBlock(how="kept"),
}


@pytest.mark.parametrize("offload", [False, True], ids=["offload off", "offload on"])
@pytest.mark.parametrize("make", HELD.values(), ids=HELD.keys())
def test_router_noise_from_a_generator_the_layer_holds_replays_as_eager_drew_it(
        make: Any, offload: bool) -> None:
    # Guards against: the replay drew the next numbers of a generator held as a module
    # attribute (only the default ones and those passed in were restored): other experts,
    # other gradients and a generator two draws on, silently.
    def wrapping(layer: nn.Module) -> nn.Module:
        if isinstance(layer, RoutedBlock) and layer.router.how == "kept":
            apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                                   {SaveUnit.ATTN: KeptOps("aten::bernoulli")}, offload=offload)
            return layer
        return _offloaded(layer) if offload else apply_activation_checkpointing(layer)

    eager, wrapped = _twins(make, wrapping)
    _assert_steps_equal(eager, wrapped)


@pytest.mark.parametrize("where", ["router", ""], ids=["a submodule", "the layer itself"])
def test_a_generator_assigned_after_some_steps_is_restored_from_the_next(where: str) -> None:
    # The first steps draw from the default generator; then the router gets a generator of
    # its own (a new attribute, once the library's caches on the layer have settled: the
    # cached search must find it). On the layer itself it is told by the size of the layer's
    # own dict, which the cache does not list with the submodules'.
    def assign(step: int, model: nn.Module) -> None:
        if step == 2:
            setattr(model.get_submodule(where), "gen", torch.Generator().manual_seed(11))

    make = (lambda: RoutedBlock(held=False)) if where else (lambda: Router(held=False))
    eager, wrapped = _twins(make, apply_activation_checkpointing)
    _assert_steps_equal(eager, wrapped, steps=4, between=assign)


def test_a_generator_replaced_by_another_under_its_name_is_the_one_restored() -> None:
    def replace(step: int, model: nn.Module) -> None:
        setattr(model.get_submodule("router"), "gen", torch.Generator().manual_seed(20 + step))

    eager, wrapped = _twins(RoutedBlock, apply_activation_checkpointing)
    _assert_steps_equal(eager, wrapped, between=replace)


class LazyRouter(Router):
    """A router whose generator's name holds None from ``__init__`` (the same dict size once
    a generator is put there); ``lazy``: the forward makes it, on the input's device."""

    def __init__(self, *, lazy: bool = False) -> None:
        super().__init__(held=False)
        self.gen: torch.Generator | None = None
        self.lazy = lazy

    def forward(self, x: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
        if self.gen is None and self.lazy:
            self.gen = torch.Generator(device=x.device).manual_seed(9)
        return super().forward(x, rng)


def test_a_generator_put_in_place_of_none_after_some_steps_is_restored_from_the_next() -> None:
    # Guards against: the cached search (NOTE [generators held as attributes]) remembering
    # only names that held a generator, and telling a new attribute by a dict's size: a
    # generator put under a name that held None changes no size and was never restored (the
    # replay drew the next numbers, silently, at every later step).
    def assign(step: int, model: nn.Module) -> None:
        if step == 2:
            model.gen = torch.Generator().manual_seed(11)

    eager, wrapped = _twins(LazyRouter, apply_activation_checkpointing)
    _assert_steps_equal(eager, wrapped, steps=4, between=assign)


class _NoisyOnceSeeded(nn.Module):
    """Draws noise from a generator of its own once one takes the place of a plain setting."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen: object = 0  # a setting, later a generator: no dict changes size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if isinstance(self.gen, torch.Generator):
            h = h * torch.rand(h.shape, generator=self.gen)
        return torch.tanh(h)


@pytest.mark.parametrize("forget", ["drop_caches", "removed and applied again"])
def test_a_generator_set_in_place_of_a_setting_is_restored_once_the_caches_are_forgotten(
        forget: str) -> None:
    # held_generators.py: a generator taking the place of another attribute of the same name
    # is not found until pytree_ckpt.module_state.drop_caches(module) forgets the cache.
    # Guards against: drop_caches leaving the generators' cache (GENERATORS_CACHE) in place:
    # the replay drew other numbers than the forward, silently (a mutant, helper FY).
    from pytree_ckpt.module_state import drop_caches

    torch.manual_seed(0)
    eager = _NoisyOnceSeeded()
    wrapped = copy.deepcopy(eager)
    apply_activation_checkpointing(wrapped)
    x = torch.randn(3, 8, requires_grad=True)
    for model in (eager, wrapped):
        model(x).sum().backward()  # the generators the tree holds cached: none
        model.gen = torch.Generator().manual_seed(5)
        model.zero_grad()
    if forget == "drop_caches":
        drop_caches(wrapped)
    else:
        remove_activation_checkpointing(wrapped)
        apply_activation_checkpointing(wrapped)
    grads = []
    for model in (eager, wrapped):
        x.grad = None
        torch.manual_seed(2)
        model(x).sum().backward()
        grads.append(grads_of([*model.parameters(), x]))
    assert_same_grads(*grads)
    assert torch.equal(eager.gen.get_state(), wrapped.gen.get_state())


def test_a_generator_made_lazily_in_the_forward_is_warned_of_once_naming_the_fix() -> None:
    # Its state before the call that made it was never seen: that call's replay cannot draw
    # the forward's numbers. Silent before; now warned, once per module.
    _, wrapped = _twins(lambda: LazyRouter(lazy=True), apply_activation_checkpointing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _held_step(wrapped)
    told = [w for w in caught if "torch.Generator" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "LazyRouter" in str(told[0].message)
    assert "before the first checkpointed call" in str(told[0].message)
    assert told[0].filename == __file__  # the user's line, not the library's


def test_a_generator_made_lazily_in_the_forward_is_not_warned_of_without_rng_preservation(
        ) -> None:
    # preserve_rng_state=False restores no generator for any replay: that this one's first
    # call cannot is no news, and the warning's fix (make it before the first call) would
    # change nothing.
    _, lazy = _twins(lambda: LazyRouter(lazy=True),
                     lambda m: apply_activation_checkpointing(m, preserve_rng_state=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _held_step(lazy)
    assert lazy.gen is not None  # made in the first forward, and drawn from since


def test_a_generator_shared_by_two_checkpointed_layers_ends_each_step_as_in_eager() -> None:
    def make() -> nn.Module:
        model = nn.Sequential(RoutedBlock(), RoutedBlock())
        # one generator, drawn by both layers
        model.get_submodule("1.router").gen = model.get_submodule("0.router").gen
        return model

    def wrapping(model: nn.Module) -> nn.Module:
        for layer in model.children():
            apply_activation_checkpointing(layer)
        return model

    eager, wrapped = _twins(make, wrapping)
    assert len(_held_generators(wrapped)) == 1
    _assert_steps_equal(eager, wrapped)


class NestedHeld(nn.Module):
    """An inner boundary around the block, inside the outer one around this layer; the router
    (inside both) and this layer (the outer one only) hold generators."""

    def __init__(self) -> None:
        super().__init__()
        self.block = RoutedBlock(how="reused")
        self.proj = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(8)
        self.nested = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x) if self.nested else self.block(x)
        return _dropout(self.proj(h), self.gen)


def test_nested_boundaries_each_restore_the_generators_of_their_own_modules() -> None:
    def nest(layer: NestedHeld) -> nn.Module:
        layer.nested = True
        return apply_activation_checkpointing(layer)

    eager, wrapped = _twins(NestedHeld, nest)
    _assert_steps_equal(eager, wrapped)


class DiscardedNoise(nn.Module):
    """A dropout module with a generator of its own, its output discarded and rebuilt."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(9)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _dropout(h, self.gen)


class DiscardingLayer(nn.Module):
    def __init__(self, *, discard: bool) -> None:
        super().__init__()
        self.proj, self.noise, self.out = nn.Linear(8, 8), DiscardedNoise(), nn.Linear(8, 8)
        self.discard = discard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if not self.discard:
            return self.out(self.noise(h)) + torch.rand(h.shape, generator=self.noise.gen)
        ckpt = CheckpointWithoutOutput()
        out = self.out(ckpt.checkpoint(self.noise, h))
        ckpt.discard_output_and_register_recompute(out)
        # a later draw, before the rebuild: the rebuild must draw the forward's mask anyway
        return out + torch.rand(h.shape, generator=self.noise.gen)


def test_a_discarded_op_drawing_from_its_modules_generator_rebuilds_eagers_mask() -> None:
    torch.manual_seed(0)
    eager = DiscardingLayer(discard=False)
    discarding = copy.deepcopy(eager)
    discarding.discard = True
    _assert_steps_equal(eager, discarding)


@pytest.mark.parametrize("how", ["plain", "reused"])
def test_without_rng_preservation_a_held_generator_moves_as_one_passed_in_does(how: str) -> None:
    # preserve_rng_state=False: nothing restored or jumped, for held generators as for those
    # passed in: the same router, its generator held or given as an argument, gives the same
    # gradients and leaves the generator equally far on (further than eager: the replay drew).
    results = []
    for held in (True, False):
        torch.manual_seed(0)
        layer = Router(held=held, how=how)
        apply_activation_checkpointing(layer, preserve_rng_state=False)
        generator = layer.gen if held else torch.Generator().manual_seed(5)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(7)
        loss = (layer(x) if held else layer(x, rng=generator)).square().sum()
        forward_state = generator.get_state()
        loss.backward()
        assert not torch.equal(generator.get_state(), forward_state)  # the replay drew
        results.append([loss.detach(), *grads_of([x, *layer.parameters()]),
                        generator.get_state()])
    assert_same_grads(*results)


def test_held_generators_are_searched_for_only_when_a_layers_attributes_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-call cost: a layer's attributes are walked at its first calls and when a dict of
    # its tree changes size (a generator assigned), not at every call.
    searched: list[nn.Module] = []
    search = held_generators._search

    def counting(module: nn.Module, tree: Any) -> Any:
        searched.append(module)
        return search(module, tree)

    monkeypatch.setattr(held_generators, "_search", counting)
    model = nn.Sequential(RoutedBlock(held=False), RoutedBlock(held=False))
    for layer in model.children():
        apply_activation_checkpointing(layer)
    for _ in range(3):  # the library's own caches settle in
        _held_step(model)
    searched.clear()
    _held_step(model)
    assert searched == []
    setattr(model.get_submodule("1.router"), "gen", torch.Generator().manual_seed(4))
    _held_step(model)
    _held_step(model)
    assert searched == [model[1]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["plain", "reused"])
def test_a_cuda_generator_the_layer_holds_replays_as_eager_drew_it(how: str) -> None:
    # The same path as a CPU generator (get_state and set_state): a CUDA one on a submodule.
    def make() -> nn.Module:
        torch.manual_seed(0)
        block = RoutedBlock(how=how).cuda()
        block.router.gen = torch.Generator("cuda").manual_seed(5)  # on the submodule
        return block

    _assert_steps_equal(make(), apply_activation_checkpointing(make()))


class RoutesWith(nn.Module):
    """A layer that routes with a router it is handed (not one of its submodules)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, router: Router) -> torch.Tensor:
        return self.proj(router(x))


class HandsItsRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = RoutesWith()
        self.router = Router()  # holds a generator; passed to the checkpointed layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.router)


def test_a_generator_held_by_a_module_passed_as_an_argument_replays_as_eager_drew_it() -> None:
    # Guards against: held_generators reading only the first module of a call (the owner)
    # when modules are passed as arguments too: the argument's generator was not restored,
    # so the replay routed with the numbers drawn after the forward (the caller draws between
    # forward and backward here): other experts, other gradients, silently.
    def wrapping(model: HandsItsRouter) -> nn.Module:
        apply_activation_checkpointing(model.layer)
        return model

    eager, wrapped = _twins(HandsItsRouter, wrapping)
    _assert_steps_equal(eager, wrapped)


def test_a_router_replaced_by_another_of_its_class_is_the_one_whose_generator_is_restored(
        ) -> None:
    # Guards against: the cached search (NOTE [generators held as attributes]) kept after the
    # module tree changed: a new router of the same class leaves every cached dict its size,
    # so the cache read the old router's generator and the replay drew the new one's next
    # numbers (other experts, other gradients, silently, at every later step).
    def replace(step: int, model: nn.Module) -> None:
        if step == 2:
            torch.manual_seed(30)
            model.router = Router()  # the same seeds in both twins: a linear and a generator

    eager, wrapped = _twins(RoutedBlock, apply_activation_checkpointing)
    _assert_steps_equal(eager, wrapped, steps=4, between=replace)


class MakesAnother(Router):
    """A router holding a generator from ``__init__`` that makes a second one during its
    forward: under a name that held None (``second``) or as a new attribute (``new``);
    ``every``: anew at every call, from a fixed seed."""

    def __init__(self, how: str, *, every: bool = False) -> None:
        super().__init__(held=how == "second")
        if how == "second":
            self.other: torch.Generator | None = None
        self.made, self.every = how, every

    def forward(self, x: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
        name = "other" if self.made == "second" else "gen"
        if self.every or self.__dict__.get(name) is None:
            setattr(self, name, torch.Generator(device=x.device).manual_seed(9))
        y = super().forward(x, rng)
        return y if self.made != "second" else _dropout(y, self.other)


def _warned_made(layer: nn.Module, steps: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            _held_step(layer)
    return [str(w.message) for w in caught if "torch.Generator" in str(w.message)]


@pytest.mark.parametrize("how", ["second", "new"],
                         ids=["beside one held before", "as a new attribute of a layer"])
def test_a_generator_made_in_the_forward_is_warned_of_wherever_it_is_made(how: str) -> None:
    # Guards against: warn_made_during looking only at names that held a generator or None
    # (a layer holding none, whose forward adds one as a new attribute, was not looked at:
    # its dict grew), or warning only when no generator of the call was restored (one held
    # since __init__ hid the second one made in the forward). Either way silent, and the
    # first step's gradients differ from eager's.
    _, wrapped = _twins(lambda: MakesAnother(how), apply_activation_checkpointing)
    told = _warned_made(wrapped, 3)
    assert len(told) == 1, told
    assert "MakesAnother" in told[0] and "before the first checkpointed call" in told[0]


def test_a_generator_made_anew_at_every_call_is_warned_of_once() -> None:
    # Guards against: the warning's once-per-module flag unread: a forward that makes its
    # generator at every call (seeded: the replay draws the forward's numbers, so the loss
    # and gradients are eager's; the generator left is the replay's, as the warning says)
    # warned at every step.
    eager, wrapped = _twins(lambda: MakesAnother("new", every=True),
                            apply_activation_checkpointing)
    n = 2 + len(list(eager.parameters()))  # the loss, the input's and parameters' gradients
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_same_grads(_held_step(eager)[:n], _held_step(wrapped)[:n])
    told = [str(w.message) for w in caught if "torch.Generator" in str(w.message)]
    assert len(told) == 1, told


class _SpecAugment(nn.Module):
    """A time mask and a dropout drawn from the generator given as a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        t0 = int(torch.randint(0, x.shape[1] - 3, (), generator=generator))
        keep = torch.ones_like(x)
        keep[:, t0:t0 + 3] = 0
        return self.lin(_dropout(x * keep, generator))


def test_a_generator_bound_in_a_layers_partial_replays_as_eager_drew_it() -> None:
    # docs/limits.md counts `partial(forward, self, **kwargs)` as a module the boundary knows,
    # and restores "a generator passed as an argument (`layer(x, generator=g)`, in any
    # container)"; the keywords transformers binds in that partial are the layer's arguments.
    import functools

    torch.manual_seed(0)
    eager = _SpecAugment()
    wrapped = copy.deepcopy(eager)
    x = torch.randn(2, 14, 10)
    g_eager, g_wrapped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    eager(x, generator=g_eager).square().mean().backward()
    layer_call = functools.partial(type(wrapped).forward, wrapped, generator=g_wrapped)
    checkpoint(layer_call, x).square().mean().backward()
    assert_same_grads([p.grad for p in eager.parameters()],
                      [p.grad for p in wrapped.parameters()])
    assert torch.equal(g_eager.get_state(), g_wrapped.get_state())


def test_a_generator_bound_in_the_inner_of_two_nested_partials_replays_as_eager_drew_it(
        ) -> None:
    # Mutant M35 (helper FH): _passed_generators opening one partial only (if, not while)
    # missed a generator bound in an inner partial Python did not merge into the outer (one
    # that carries an attribute, as functools.update_wrapper gives it): other masks drawn.
    import functools

    torch.manual_seed(0)
    eager = _SpecAugment()
    wrapped = copy.deepcopy(eager)
    x = torch.randn(2, 14, 10)
    g_eager, g_wrapped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    eager(x, generator=g_eager).square().mean().backward()
    inner = functools.partial(type(wrapped).forward, generator=g_wrapped)
    inner.__name__ = "forward"  # an attribute: Python keeps the partial nested
    layer_call = functools.partial(inner, wrapped)
    assert type(layer_call.func) is functools.partial
    checkpoint(layer_call, x).square().mean().backward()
    assert_same_grads([p.grad for p in eager.parameters()],
                      [p.grad for p in wrapped.parameters()])
    assert torch.equal(g_eager.get_state(), g_wrapped.get_state())


class _SpecAugmentFromConfig(_SpecAugment):
    """The same layer, given its generator inside a config object."""

    def forward(self, x: torch.Tensor, cfg: Any = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, generator=cfg.generator)


def test_a_generator_in_a_namespace_argument_replays_as_eager_drew_it() -> None:
    import types

    torch.manual_seed(0)
    eager = _SpecAugmentFromConfig()
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(2, 14, 10)
    g_eager, g_wrapped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    eager(x, types.SimpleNamespace(generator=g_eager)).square().mean().backward()
    wrapped(x, types.SimpleNamespace(generator=g_wrapped)).square().mean().backward()
    assert_same_grads([p.grad for p in eager.parameters()],
                      [p.grad for p in wrapped.parameters()])
    assert torch.equal(g_eager.get_state(), g_wrapped.get_state())


class _SlottedGeneratorConfig:  # a plain config class with __slots__ (no __dict__)
    __slots__ = ("generator",)

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator


def test_a_generator_in_a_slotted_config_argument_replays_as_eager_drew_it() -> None:
    torch.manual_seed(0)
    eager = _SpecAugmentFromConfig()
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(2, 14, 10)
    g_eager, g_wrapped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    eager(x, _SlottedGeneratorConfig(g_eager)).square().mean().backward()
    wrapped(x, _SlottedGeneratorConfig(g_wrapped)).square().mean().backward()
    assert torch.equal(g_eager.get_state(), g_wrapped.get_state())
    assert_same_grads([p.grad for p in eager.parameters()],
                      [p.grad for p in wrapped.parameters()])


class _Sampler:
    """Draws masks from the generator it holds: its bound method is passed to the layer."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def draw(self) -> torch.Generator:
        return self.generator


class _SpecAugmentFromSampler(_SpecAugment):
    def forward(self, x: torch.Tensor, draw: Any = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, generator=draw())


class _Partial(functools.partial):  # type: ignore[type-arg]
    """A functools.partial subclass, as some wrappers make."""


@pytest.mark.parametrize("how", ["bound-method argument", "partial subclass"])
def test_a_generator_behind_a_bound_method_or_a_partial_subclass_replays_as_eager_drew_it(
        how: str) -> None:
    # Helper FL's notes: a generator held by a bound method's instance passed in
    # (`layer(x, sampler.draw)`), and one bound in a functools.partial subclass that is the
    # call's function, were not restored: the replay drew other masks, silently.
    torch.manual_seed(0)
    eager = _SpecAugmentFromSampler() if how == "bound-method argument" else _SpecAugment()
    wrapped = copy.deepcopy(eager)
    x = torch.randn(2, 14, 10)
    g_eager, g_wrapped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    if how == "bound-method argument":
        apply_activation_checkpointing(wrapped)
        eager(x, _Sampler(g_eager).draw).square().mean().backward()
        wrapped(x, _Sampler(g_wrapped).draw).square().mean().backward()
    else:
        eager(x, generator=g_eager).square().mean().backward()
        checkpoint(_Partial(type(wrapped).forward, wrapped, generator=g_wrapped),
                   x).square().mean().backward()
    assert_same_grads([p.grad for p in eager.parameters()],
                      [p.grad for p in wrapped.parameters()])
    assert torch.equal(g_eager.get_state(), g_wrapped.get_state())


def test_an_input_object_with_slots_whose_getattr_raises_key_error_is_passed_on() -> None:
    # Guards against (helper HD), as it was found:
    # A small attribute-access config (slots, and __getattr__ reading a dict, as many config
    # helpers do) passed as an argument: eager reads cfg.scale and runs. The boundary's search
    # for generators among the input objects' attributes (rng.py _passed_generators ->
    # tree.object_children) asks it for __dict__, which it has not (slots): Python then calls
    # its __getattr__('__dict__'), whose KeyError escapes the boundary at the call.
    class Attrs:
        __slots__ = ("_values",)

        def __init__(self, **values: Any) -> None:
            object.__setattr__(self, "_values", values)

        def __getattr__(self, name: str) -> Any:
            return self._values[name]

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def fn(h: torch.Tensor, cfg: Attrs) -> torch.Tensor:
        return lin(h) * cfg.scale

    grads = []
    for wrap in (lambda f: f, lambda f: functools.partial(checkpoint, f)):
        # .backward(): a closure reaching a module is refused under torch.autograd.grad
        wrap(fn)(x, Attrs(scale=2.0)).sum().backward()
        grads.append([t.grad.clone() for t in (x, *lin.parameters())])
        x.grad = None
        lin.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
