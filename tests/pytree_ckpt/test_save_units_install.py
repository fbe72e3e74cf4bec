"""How save units install onto a model: what a kept method wraps (an instance's own patch, a
static or class method), and which re-applications are refused. Loss and gradients are
compared with an unwrapped eager twin, exactly in fp32; what is kept is counted in the replay."""

from __future__ import annotations

import copy
import pickle
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import (CheckpointConfigError, KeptCallables, RecomputeConfig, ReuseError,
                         SaveUnit, apply_recompute_config, remove_activation_checkpointing)
from tests.conftest import assert_same_grads
from tests.pytree_ckpt.test_save_units import OpCounter


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    @staticmethod
    def weigh(logits: torch.Tensor) -> torch.Tensor:
        return logits.exp()

    @classmethod
    def squash(cls, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.squash(self.weigh(self.project(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.mix = Router(), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.router(x))


def _halved(router: Router) -> None:
    """An instance-level patch of the kept method (as a user's, or another library's)."""
    original = router.project
    router.project = lambda x: 0.5 * original(x)  # type: ignore[method-assign]


def _step(layers: nn.ModuleList, x: torch.Tensor, counter: OpCounter | None = None
          ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for p in layers.parameters():
        p.grad = None
    with counter or OpCounter():
        h = x
        for layer in layers:
            h = layer(h)
        loss = h.square().sum()
        loss.backward()
    return loss.detach(), [p.grad for p in layers.parameters()]


def _apply(layers: nn.ModuleList, *targets: str, ratio: float = 1.0) -> None:
    apply_recompute_config(layers, RecomputeConfig(ratio, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables(*targets)})


def test_a_kept_method_patched_on_the_instance_runs_the_patch_and_removal_puts_it_back() -> None:
    # The wrapper used to call the class's method: the patch was silently skipped (the loss
    # changed), and removing checkpointing deleted it.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    for layer in (*eager, *ours):  # after the copy: a lambda copies as itself
        _halved(layer.router)
    patches = [layer.router.__dict__["project"] for layer in ours]
    _apply(ours, "Router.project")
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # the patch's projection (an addmm) is kept; the mix Linear's is recomputed
    assert counter.counts["recompute", "aten.addmm"] == 2
    for layer in ours:
        remove_activation_checkpointing(layer)
    assert [layer.router.__dict__["project"] for layer in ours] == patches
    assert torch.equal(_step(ours, x)[0], expected_loss)


def test_a_kept_method_bound_on_the_instance_follows_a_deepcopy_to_the_copy() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList([Layer()])
    router = layers[0].router
    router.project = types.MethodType(  # type: ignore[method-assign]
        lambda self, x: 2 * self.gate(x), router)
    _apply(layers, "Router.project")
    twin = copy.deepcopy(layers)
    with torch.no_grad():
        twin[0].router.gate.weight.zero_()
    assert twin[0].router.__dict__["project"].inner.__self__ is twin[0].router
    x = torch.randn(3, 8)
    assert torch.equal(twin[0].router.project(x),
                       2 * twin[0].router.gate.bias.expand(3, 4))


class FSDPRouter(Router):
    """What FSDP2's fully_shard makes of a Router's class (module level: pickled by name)."""


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_kept_method_stays_kept_after_its_modules_class_is_swapped_and_the_layer_copied(
        how: str) -> None:
    # FSDP2's fully_shard, applied after checkpointing, swaps each sharded module's class for a
    # subclass (FSDPRouter): the kept region must still be the one the policy lists, in a copy
    # made either way (a pickled one rebuilds its wrapper from __reduce__).
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, "Router.project")
    for layer in ours:
        layer.router.__class__ = FSDPRouter
    ours = copy.deepcopy(ours) if how == "deepcopy" else pickle.loads(pickle.dumps(ours))
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # the router's projection is kept; the mix Linear's is recomputed
    assert counter.counts["recompute", "aten.addmm"] == 2


@pytest.mark.parametrize("method", ["weigh", "squash"], ids=["staticmethod", "classmethod"])
def test_a_kept_static_or_class_method_is_called_without_the_module(method: str) -> None:
    # The module was passed as an extra first argument: TypeError in the layer.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, f"Router.{method}")
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    kept = OpCounter()
    loss, got = _step(ours, x, kept)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    op = "aten.exp" if method == "weigh" else "aten.tanh"
    assert kept.counts["forward", op] == 2 and kept.counts["recompute", op] == 0


def test_a_second_config_keeping_other_methods_is_refused_and_the_same_one_is_a_no_op() -> None:
    # Both used to be "the same options": the second config's methods were wrapped too, and
    # more was kept than either config said.
    layers = nn.ModuleList(Layer() for _ in range(2))
    _apply(layers, "Router.project")
    _apply(layers, "Router.project")
    with pytest.raises(CheckpointConfigError, match="already checkpointed with other options"
                       ) as refused:
        _apply(layers, "Router.weigh")
    assert "weigh" not in layers[0].router.__dict__
    # both sides named by what they keep (they read the same by unit name: moe_gate)
    assert "as installed: keep=KeepPolicy(moe_gate: everything ['Router.project'] dispatch)" \
        in str(refused.value)
    assert "as requested now: keep=KeepPolicy(moe_gate: everything ['Router.weigh'] dispatch)" \
        in str(refused.value)


def test_keeping_a_checkpointed_layers_own_forward_is_refused() -> None:
    layers = nn.ModuleList([Layer()])
    with pytest.raises(CheckpointConfigError, match="the forward of checkpointed layer 0"):
        _apply(layers, "Layer.forward")
    assert not pytree_ckpt.is_checkpointed(layers[0])


def test_keeping_the_forward_of_a_submodule_checkpointed_on_its_own_is_refused() -> None:
    layers = nn.ModuleList([Layer()])
    pytree_ckpt.apply_activation_checkpointing(layers[0].router)
    with pytest.raises(CheckpointConfigError, match="checkpointed on its own"):
        _apply(layers, "Router.forward")
    assert pytree_ckpt.is_checkpointed(layers[0].router)
    assert not pytree_ckpt.is_checkpointed(layers[0])


def test_keeping_a_compiled_instance_method_is_refused() -> None:
    layers = nn.ModuleList([Layer()])
    router = layers[0].router
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled: Any = torch.compile(router.project)  # compiles nothing until called
    router.project = compiled  # type: ignore[method-assign]
    with pytest.raises(CheckpointConfigError, match="torch.compile'd callable"):
        _apply(layers, "Router.project")
    assert router.__dict__["project"] is compiled


def test_keeping_a_method_compiled_on_the_class_is_refused() -> None:
    class CompiledRouter(Router):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            project = torch.compile(Router.project)  # compiles nothing until called

    layers = nn.ModuleList([Layer()])
    layers[0].router = CompiledRouter()
    with pytest.raises(CheckpointConfigError, match="a compiled class attribute"):
        _apply(layers, "Router.project")  # a subclass of Router: matched through its MRO
    assert not pytree_ckpt.is_checkpointed(layers[0])


def test_a_lower_ratio_over_layers_checkpointed_by_a_higher_one_is_refused() -> None:
    # The layers past the new count stayed checkpointed, and the returned indices said not.
    layers = nn.ModuleList(Layer() for _ in range(4))
    assert apply_recompute_config(layers, RecomputeConfig(1.0), {}) == [0, 1, 2, 3]
    with pytest.raises(CheckpointConfigError, match=r"layers\[2\] .* is checkpointed, but ratio=0.5"):
        apply_recompute_config(layers, RecomputeConfig(0.5), {})
    for layer in layers:
        remove_activation_checkpointing(layer)
    assert apply_recompute_config(layers, RecomputeConfig(0.5), {}) == [0, 1]
    assert [pytree_ckpt.is_checkpointed(layer) for layer in layers] == [True, True, False, False]


@pytest.mark.parametrize("patched", [False, True], ids=["class method", "instance patch"])
@pytest.mark.parametrize("first", [0, 1], ids=["first removed first", "second removed first"])
def test_a_kept_method_of_a_submodule_two_layers_share_stays_kept_until_both_are_removed(
        first: int, patched: bool) -> None:
    # One router instance inside two layers (shared MTP weights, a shared gate). Removing
    # checkpointing from one layer unwrapped the router's kept method: the other layer, still
    # checkpointed with the unit, silently recomputed the projection in its replay.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    eager[1].router = eager[0].router
    ours = copy.deepcopy(eager)  # shares its router too
    router = ours[0].router
    assert ours[1].router is router
    if patched:  # after the copy: a lambda copies as itself
        _halved(eager[0].router)
        _halved(router)
    before = dict(router.__dict__)
    _apply(ours, "Router.project")
    remove_activation_checkpointing(ours[first])
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # one replay (the layer still checkpointed): its mix Linear's addmm; the projection is kept
    assert counter.counts["recompute", "aten.addmm"] == 1
    remove_activation_checkpointing(ours[1 - first])
    # the last layer keeping it removed: the router's attributes are what they were before
    assert router.__dict__.keys() == before.keys()
    assert all(router.__dict__[name] is value for name, value in before.items())
    assert ("project" in router.__dict__) == patched  # else the class's method, as before
    assert torch.equal(_step(ours, x)[0], expected_loss)


def test_a_kept_method_of_a_shared_submodule_stays_kept_when_the_layers_were_applied_apart() -> None:
    # The same, with each layer given the config by its own apply (a model and its MTP head).
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    eager[1].router = eager[0].router
    ours = copy.deepcopy(eager)
    _apply(ours[:1], "Router.project")
    _apply(ours[1:], "Router.project")
    remove_activation_checkpointing(ours[0])
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    assert counter.counts["recompute", "aten.addmm"] == 1
    remove_activation_checkpointing(ours[1])
    assert "project" not in ours[0].router.__dict__


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router.project(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.mix = Inner(), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.inner(x))


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_a_kept_method_inside_a_nested_boundary_goes_with_the_last_layer_keeping_it(
        first: str) -> None:
    # The outer layer's unit keeps the router's projection inside a submodule checkpointed on
    # its own (the outer replay takes it from the record). Removing the outer left the wrapper
    # on the router for good (it was not among the outer's own submodules); removing the inner
    # unwrapped it while the outer still kept it, whose replay then recomputed it, silently.
    torch.manual_seed(0)
    eager = nn.ModuleList([Outer()])
    ours = copy.deepcopy(eager)
    router = ours[0].inner.router
    pytree_ckpt.apply_activation_checkpointing(ours[0].inner)
    _apply(ours, "Router.project")
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    if first == "outer":
        remove_activation_checkpointing(ours[0])
        assert "project" not in router.__dict__  # no layer keeps it any more
        assert pytree_ckpt.is_checkpointed(ours[0].inner)
        recomputed = 1  # the inner replay's projection
    else:
        remove_activation_checkpointing(ours[0].inner)
        assert "project" in router.__dict__  # the outer layer still keeps it
        recomputed = 1  # the outer replay's mix Linear; the projection is kept
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    assert counter.counts["recompute", "aten.addmm"] == recomputed
    remove_activation_checkpointing(ours[0].inner if first == "outer" else ours[0])
    assert "project" not in router.__dict__


def test_a_kept_method_of_a_submodule_assigned_after_applying_is_kept() -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, "Router.project")
    fresh = Router()  # between steps: the second layer's router replaced by a new instance
    eager[1].router, ours[1].router = copy.deepcopy(fresh), fresh
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # two replays: each mix Linear's addmm; both projections kept, as before the replacement
    assert counter.counts["recompute", "aten.addmm"] == 2


class _SubRouter(Router):
    """A router of a subclass of the kept class (a noisy router replacing a plain one)."""


def test_a_kept_method_of_a_subclass_instance_assigned_after_applying_is_kept() -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, "Router.project")
    fresh = _SubRouter()  # apply_recompute_config would keep its project (Router in its MRO)
    eager[1].router, ours[1].router = copy.deepcopy(fresh), fresh
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # two replays: each mix Linear's addmm; both projections kept
    assert counter.counts["recompute", "aten.addmm"] == 2


def test_a_kept_method_assigned_into_a_copy_of_a_called_model_is_kept() -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, "Router.project")
    x = torch.randn(3, 8)
    _step(eager, x)
    _step(ours, x)  # a first step: each layer notes the structure generation
    eager, ours = copy.deepcopy(eager), copy.deepcopy(ours)  # e.g. a fine-tune from a run's model
    fresh = Router()  # an adapter injected into the copy, before its first call
    eager[1].router, ours[1].router = copy.deepcopy(fresh), fresh
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    # two replays: each mix Linear's addmm; both projections kept
    assert counter.counts["recompute", "aten.addmm"] == 2


def test_a_kept_method_assigned_deeper_after_applying_is_kept_and_looked_for_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Mutation testing (helper EK) on NOTE [kept methods of modules added later]: an instance
    # assigned below a direct child (a router wrapped in a Sequential) was untested (a look at
    # the layer's children alone passed), and so was the look's cost: one compare a call once
    # the layer's tree is unchanged (looking at every call passed).
    from pytree_ckpt import save_units

    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(2))
    ours = copy.deepcopy(eager)
    _apply(ours, "Router.project")
    fresh = Router()
    eager[1].router, ours[1].router = nn.Sequential(copy.deepcopy(fresh)), nn.Sequential(fresh)
    x = torch.randn(3, 8)
    expected_loss, expected = _step(eager, x)
    counter = OpCounter()
    loss, got = _step(ours, x, counter)
    assert torch.equal(expected_loss, loss)
    assert_same_grads(expected, got)
    assert counter.counts["recompute", "aten.addmm"] == 2  # each mix Linear's: both kept
    looks = []
    original = save_units.install_kept

    def counted(*args: Any, **kwargs: Any) -> None:
        looks.append(args)
        original(*args, **kwargs)

    monkeypatch.setattr(save_units, "install_kept", counted)
    _step(ours, x)
    assert looks == []


def test_a_kept_class_instance_checkpointed_on_its_own_assigned_after_applying_is_refused(
) -> None:
    # Mutation testing (helper EK): install_kept's refusal for a module added later (NOTE [kept
    # methods of modules added later]) was untested: dropping it passed the suite. Refused
    # as at apply time (test_save_units_install's refusals of a nested boundary).
    layers = nn.ModuleList(Layer() for _ in range(2))
    _apply(layers, "Router.forward")
    fresh = Router()
    pytree_ckpt.apply_activation_checkpointing(fresh)
    layers[1].router = fresh
    with pytest.raises(CheckpointConfigError, match=r"(?s)Router\.forward is kept by a save "
                       r"unit, but Router is checkpointed on its own"):
        _step(layers, torch.randn(3, 8))


def test_a_module_attached_below_a_keeping_layer_before_its_first_call_moves_the_generation(
) -> None:
    # Mutation testing (helper EK): a keeping boundary watches its layer's whole tree from when
    # it is made (kept_owners.keeping_boundary_made, module_state.watch_tree); watching the
    # layer alone passed the suite.
    from pytree_ckpt.module_state import structure_generation

    layers = nn.ModuleList(Layer() for _ in range(2))
    _apply(layers, "Router.project")
    before = structure_generation()
    layers[0].router.extra = nn.Identity()
    assert structure_generation() > before


def test_checkpointing_removed_between_a_forward_and_its_backward_with_kept_methods_is_refused(
        ) -> None:
    # Helper FI: checkpointing turned off mid-accumulation, once memory allows. The removal
    # puts the kept methods (KeptCallables) back at once, so the pending replay of the first
    # micro-batch runs them and takes none of their records: refused, saying so (the generic
    # ReuseError's tip pointed at branches on current_phase()). docs/limits.md says so.
    torch.manual_seed(0)
    ours = nn.ModuleList(Layer() for _ in range(2))
    _apply(ours, "Router.project")
    x = torch.randn(3, 8)
    first = x
    for layer in ours:
        first = layer(first)
    for layer in ours:
        remove_activation_checkpointing(layer)  # the next micro-batch runs plainly
    second = 2 * x
    for layer in ours:
        second = layer(second)
    with pytest.raises(ReuseError, match="^remove_activation_checkpointing ran on Layer between "
                                         "a call's forward and its backward") as refused:
        (first.square().sum() + second.square().sum()).backward()
    assert "tip: remove it after the backward" in str(refused.value)


class _SkipsItsReuseInTheReplay(nn.Module):
    """Keeps exp through a KeptOps unit, and (a user's mistake) makes its reused call only
    outside the replay."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.mix = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).exp()
        if pytree_ckpt.current_phase() != "recompute":
            pytree_ckpt.reuse_during_recompute(lambda t: t.argmax(-1), logits.detach())
        return x + self.mix(logits)


def test_a_kept_ops_layer_whose_replay_skips_a_reused_call_after_removal_is_told_the_skip(
        ) -> None:
    layers = nn.ModuleList([_SkipsItsReuseInTheReplay()])
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: pytree_ckpt.KeptOps(torch.ops.aten.exp)})
    out = layers[0](torch.randn(3, 8))
    remove_activation_checkpointing(layers[0])  # documented exact with KeptOps units
    with pytest.raises(ReuseError, match="^the replay consumed 0 of the 1 results recorded"):
        out.sum().backward()
