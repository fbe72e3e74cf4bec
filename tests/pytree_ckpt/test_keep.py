"""What a save unit keeps, and only that: function targets, op names, kept regions of nested
layers (also after an outer boundary is removed), RNG of kept ops outside aten, ``save=True``."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import (CheckpointConfigError, KeptCallables, KeptOps, RecomputeConfig, SaveUnit,
                         apply_recompute_config, current_phase)
from tests.conftest import assert_same_grads, grads_of, grads_per_model
from tests.pytree_ckpt.models import Gate
from tests.pytree_ckpt.test_save_units import OpCounter


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # same method name, another class
        return self.w(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x).sigmoid()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.router = Gate(), Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + self.router(x)


def test_removing_an_outer_boundary_leaves_a_nested_layers_save_units() -> None:
    # Guards against: _own_submodules descends into submodules behind their own boundary and
    # removes their kept methods: the inner layer silently stops keeping what its config says.
    inner = Inner()
    apply_recompute_config([inner], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    outer = pytree_ckpt.apply_activation_checkpointing(nn.Sequential(inner, nn.Linear(8, 8)))
    pytree_ckpt.remove_activation_checkpointing(outer)
    assert not pytree_ckpt.is_checkpointed(outer) and pytree_ckpt.is_checkpointed(inner)
    assert "project" in inner.gate.__dict__


def test_a_function_object_keeps_only_its_own_class_method_not_a_namesake() -> None:
    # Guards against: KeptCallables.matches compares a function target by name only: Router.project
    # is wrapped (and kept) although only Gate.project was named.
    inner = Inner()
    apply_recompute_config([inner], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables(Gate.project)})
    assert "project" in inner.gate.__dict__
    assert "project" not in inner.router.__dict__


@pytest.mark.parametrize("name", ["mm", "aten.mm", ""])
def test_an_op_name_without_a_namespace_is_refused_when_the_unit_is_built(name: str) -> None:
    # Guards against: KeptOps accepts any string; the mistake surfaces later as a bare unpacking
    # ValueError from resolve() with no tip.
    with pytest.raises(CheckpointConfigError, match="'namespace::name'"):
        KeptOps(name)


def test_a_unit_naming_no_op_at_all_is_refused_when_it_is_built() -> None:
    # KeptOps() (an op list spliced in empty: KeptOps(*names) with names from a config) would
    # keep nothing, silently: the unit would apply with no warning at all, since no name of it
    # is missing from the build either.
    with pytest.raises(CheckpointConfigError, match=r"(?s)one or more op names.*got:\s+nothing"):
        KeptOps()


@pytest.mark.parametrize("target", ["project", "Gate.", ".project", 42])
def test_a_method_target_not_of_the_form_class_dot_method_is_refused_when_the_unit_is_built(
        target: Any) -> None:
    # Guards against: KeptCallables accepted any target, and applying it only warned that it
    # keeps nothing ("no class ''" for a bare method name; nothing at all for 42).
    with pytest.raises(CheckpointConfigError, match="'Class.method'"):
        KeptCallables(target)


@torch.library.custom_op("pytree_ckpt_proposed::noise_like", mutates_args=())
def noise_like(x: torch.Tensor) -> torch.Tensor:
    """A kernel outside aten that draws random numbers (as flash-attn's dropout does)."""
    return torch.rand_like(x)


@noise_like.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class NoisyThenDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        noise = torch.ops.pytree_ckpt_proposed.noise_like(h.detach())  # kept below
        return nn.functional.dropout(h * noise, 0.5, training=True)


def test_a_kept_op_outside_aten_that_draws_random_numbers_keeps_dropout_masks_in_step() -> None:
    # Guards against: _may_draw_random trusts only aten's nondeterministic_seeded tag: the RNG jump
    # of a kept non-aten op is not recorded, the replay skips the op, and the dropout after it
    # draws another mask than the original pass (wrong gradients).
    torch.manual_seed(0)
    eager = NoisyThenDropout()
    wrapped = copy.deepcopy(eager)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("pytree_ckpt_proposed::noise_like")},
                           offload=False)
    x = torch.randn(4, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([eager, wrapped], x, seed=1))


class GatedInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + x


class AttnOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.inner = GatedInner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.mm(x, self.w))


def test_a_layer_keeping_only_ops_does_not_keep_a_nested_layers_kept_callable() -> None:
    # Guards against: KeepPolicy.keeps honours the kept-callable region flag even when the policy
    # keeps no callables: the outer layer (save=['attn']) also keeps everything the inner layer's
    # Gate.project dispatches, holding memory its config never asked for.
    outer = AttnOuter()
    apply_recompute_config([outer.inner], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    apply_recompute_config([outer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    x = torch.randn(5, 8, requires_grad=True)
    with pytree_ckpt.ActivationCensus(outer) as census:
        out = outer(x)
    assert census.bytes_by("mechanism")["save unit"] == 5 * 8 * 4  # the mm output alone
    out.sum().backward()


class RoutedOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.inner = GatedInner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.router.project(x).sigmoid())


def test_a_layer_keeping_a_callable_does_not_keep_a_nested_layers_other_kept_callable() -> None:
    # Guards against: the kept-callable region flag was one flag for every kept method, so an
    # outer layer keeping Router.project also kept everything the inner layer's Gate.project
    # dispatches (held from forward to backward, memory its config never asked for).
    torch.manual_seed(0)
    eager = RoutedOuter()
    outer = copy.deepcopy(eager)
    apply_recompute_config([outer.inner], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    apply_recompute_config([outer], RecomputeConfig(1.0, save=["moe_dispatch"]),
                           {SaveUnit.MOE_DISPATCH: KeptCallables("Router.project")})
    x = torch.randn(5, 8, requires_grad=True)
    with pytree_ckpt.ActivationCensus(outer) as census:
        out = outer(x)
    assert census.bytes_by("mechanism")["save unit"] == 5 * 8 * 4  # Router.project's addmm alone
    counter = OpCounter()
    with counter:
        out.sum().backward()
    # The outer replay runs the inner layer's original pass, Gate.project included (kept there
    # for the inner replay); neither kept method runs in a replay.
    assert counter.counts["forward", "aten.addmm"] == 1
    assert counter.counts["recompute", "aten.addmm"] == 0
    eager(x.detach().requires_grad_()).sum().backward()
    assert_same_grads(grads_of(eager.parameters()), grads_of(outer.parameters()))


class CountReplayOps:
    """Counts the ops that really execute while a replay runs (a dispatch mode entered outside)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                if current_phase() == "recompute":
                    name = str(func.overloadpacket)
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Mode()


class MmThenGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.mm(x, self.w).tanh())


def test_save_true_keeps_every_declared_unit_out_of_the_replay() -> None:
    # Guards against: save=True selects no unit: nothing is kept, every op is recomputed, and the
    # loss and gradients stay identical, so only what runs in the replay shows it.
    torch.manual_seed(0)
    eager = MmThenGate()
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=True),
                           {SaveUnit.ATTN: KeptOps("aten::mm"),
                            SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    counter = CountReplayOps()
    x = torch.randn(5, 8, requires_grad=True)
    with counter.mode:
        layer(x).sum().backward()
    assert counter.counts.get("aten.mm", 0) == 0 and counter.counts.get("aten.addmm", 0) == 0
    assert counter.counts["aten.tanh"] == 2  # what no unit keeps is recomputed
    eager(x).sum().backward()
    assert_same_grads(grads_of(eager.parameters()), grads_of(layer.parameters()))


def test_a_kept_op_run_under_inference_mode_inside_a_layer_runs_again_and_matches_eager(
) -> None:
    # Its output is an inference tensor: no version to record (it raised), nothing saved.
    class TopkUnderInference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            with torch.inference_mode():
                ids = torch.topk(h.detach(), 2, -1).indices
            return h * torch.zeros(4, 8).scatter(-1, ids.clone(), 1.0)

    torch.manual_seed(0)
    eager = TopkUnderInference()
    kept = copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["dsa_indexer"]),
                           {"dsa_indexer": KeptOps("aten::topk")})
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for model in (eager, kept):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).square().sum().backward()
        grads.append(grads_of([x, *model.parameters()]))
        x.grad = None
    assert_same_grads(*grads)
    # The unit held nothing, and says so (NOTE [a unit that keeps nothing at run time]).
    assert [str(w.message)[:48] for w in caught] == \
        ["pytree_ckpt: save unit 'dsa_indexer' kept nothin"]
    assert "under inference_mode" in str(caught[0].message)


class EndsInKeptMm(nn.Module):
    """Returns a kept op's output itself: the boundary's output is the tensor the record holds."""

    def __init__(self, hooks: list[int] | None = None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.hooks = hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x.tanh(), self.w)
        if self.hooks is not None and h.requires_grad:  # eager's pass, and the replay
            h.register_hook(lambda g: self.hooks.append(1))  # type: ignore[union-attr]
        return h


def _keeping_mm(layer: nn.Module) -> nn.Module:
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    return layer


def test_an_output_dropped_without_backward_is_freed_by_reference_counting_as_in_eager() -> None:
    # Guards against: the record holds the kept op's output itself, not an alias of it. When
    # the layer returns that output, the boundary's node gives it its grad_fn, and the record
    # (on the node's frame) holds it back: a cycle, so an output dropped without backward (an
    # evaluation, a skipped step) and everything its frame keeps wait for the garbage collector.
    layer = _keeping_mm(EndsInKeptMm())
    x = torch.randn(4, 8, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        out = layer(x)
        freed = weakref.ref(out)
        del out
        assert freed() is None
    finally:
        gc.enable()


def test_a_hook_the_replay_puts_on_a_kept_output_runs_once_per_backward_as_in_eager() -> None:
    # Guards against: the replay hands autograd the record's own alias rather than a fresh one:
    # the second replay of a retained graph attaches its history to the tensor the first one
    # hooked, and the layer's gradient hook ran once over two backwards, where eager runs twice.
    calls = []
    for wrap in (False, True):
        hooks: list[int] = []
        torch.manual_seed(0)
        layer = EndsInKeptMm(hooks)
        if wrap:
            _keeping_mm(layer)
        loss = layer(torch.randn(4, 8, requires_grad=True)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        calls.append(len(hooks))
    assert calls == [2, 2]


class Mixer(nn.Module):
    """Its kept method ``mix`` calls ``Gate.project``, which another layer's unit keeps."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate.project(x).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x) * x


def test_a_kept_method_keeps_what_a_method_another_layer_keeps_dispatches_inside_it() -> None:
    # Guards against: a kept method's region replaced the names of the kept methods around it
    # instead of adding to them: Gate.project, wrapped for another layer's unit, ran inside
    # Mixer.mix with only its own name in the region, so the Mixer layer's replay recomputed
    # the projection its unit (everything Mixer.mix dispatches) keeps.
    torch.manual_seed(0)
    eager = Mixer(Gate())
    mixer = copy.deepcopy(eager)
    apply_recompute_config([nn.Sequential(mixer.gate)], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    apply_recompute_config([mixer], RecomputeConfig(1.0, save=["moe_dispatch"]),
                           {SaveUnit.MOE_DISPATCH: KeptCallables("Mixer.mix")})
    counter = CountReplayOps()
    x = torch.randn(4, 8, requires_grad=True)
    with counter.mode:
        mixer(x).sum().backward()
    assert counter.counts.get("aten.addmm", 0) == 0 and counter.counts.get("aten.tanh", 0) == 0
    assert counter.counts["aten.mul"] == 1  # what no unit keeps is recomputed
    eager(x).sum().backward()
    assert_same_grads(grads_of(eager.parameters()), grads_of(mixer.parameters()))


class CastsItsInput(nn.Module):
    """Enters autocast in its own forward (a decorated forward, or a bf16 attention block)."""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # reads the layer's input twice
        return self.k(x) * self.v(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.project(x).float()


# Guards against (helper HH), as it was found:
def test_a_kept_callable_under_an_autocast_the_layer_enters_gives_the_gradients_of_keeping_nothing(
) -> None:
    # NOTE [autocast casts are never kept] reads autocast when the pass starts: off here, so
    # the kept method's casts are kept. In the original pass the input is a leaf that requires
    # grad, which autocast casts once and caches for the region; in the replay it is a view,
    # cast at each use: the replay asks for a record the original pass never made (ReuseError,
    # or ReplayMismatchError when another cast's record comes first), where eager and the same
    # boundary keeping nothing run.
    torch.manual_seed(0)
    unkept = CastsItsInput()
    wrapped = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("CastsItsInput.project")},
                           offload=False)
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for model in (unkept, wrapped):
        x.grad = None
        model(x).sum().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert_same_grads(*grads)


_NESTED_INPUT_UNDER_A_KEPT_CALLABLE = """
import copy, torch
from torch import nn
from pytree_ckpt import KeptCallables, RecomputeConfig, SaveUnit, apply_recompute_config

class Projects(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def project(self, h):
        return self.lin(h)
    def forward(self, nt):
        return self.project(nt).relu()

torch.manual_seed(0)
eager = Projects()
kept = copy.deepcopy(eager)
apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                       {SaveUnit.ATTN: KeptCallables("Projects.project")}, offload=False)
values = torch.randn(7, 8)
grads = []
for model in (eager, kept):
    v = values.clone().requires_grad_()
    nt = torch.nested.nested_tensor_from_jagged(v * 1.0, torch.tensor([0, 3, 7]))
    model(nt).values().square().sum().backward()
    grads.append([v.grad, *(p.grad for p in model.parameters())])
print(all(torch.equal(a, b) for a, b in zip(*grads)))
"""


# Guards against (helper JS), as it was found:
def test_a_jagged_nested_input_through_a_kept_callable_gives_eagers_gradients_without_aborting(
) -> None:
    # Jagged nested tensors are documented inputs (limits.md, 'Inputs and outputs of any
    # PyTree'). Under grad (the replay only) autograd dispatches aten.sym_size.default for the
    # nested input inside the kept method; Policy.keeps (keep.py) keeps it as part of the
    # region, so the replay asks for a record the original pass never made: a ReuseError
    # raised from C++ that cannot propagate, and the process ends in std::terminate (SIGABRT,
    # exit status -6). Run in a child process: the abort would take pytest down.
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-c", _NESTED_INPUT_UNDER_A_KEPT_CALLABLE],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-500:]}"
    assert out.stdout.strip() == "True"


class SparseScores(nn.Module):
    """A graph layer whose kept method makes a sparse matrix (scores kept as COO)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h * (h > 0)).to_sparse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.scores(x), x)


# Guards against (helper JS), as it was found:
def test_a_kept_method_returning_a_sparse_tensor_gives_the_gradients_of_keeping_nothing() -> None:
    # The replay takes the kept record and asks whether a discard emptied it (_emptied in
    # keep.py, NOTE [a kept record emptied by a failed replay]): untyped_storage() of a
    # sparse record raises torch's NotImplementedError in backward. Sparse tensors are
    # documented leaves (limits.md, 'Inputs and outputs of any PyTree'); eager, the boundary
    # keeping nothing and offload all run it.
    torch.manual_seed(0)
    unkept = SparseScores()
    wrapped = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("SparseScores.scores")}, offload=False)
    x = torch.randn(4, 4, requires_grad=True)
    grads = []
    for model in (unkept, wrapped):
        x.grad = None
        model(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert_same_grads(*grads)


# Mutation test (helper KE): NOTE [ops that return no tensor are never kept], read per op from
# its schema: an op returning nothing at all (an async assert, not mutable, so the mutating-op
# rule does not catch it) returns no tensor either, as one returning a size does; one
# returning several tensors is keepable.
def test_ops_returning_no_tensor_or_nothing_are_never_kept_by_a_policy_naming_them() -> None:
    from pytree_ckpt.keep import KeepPolicy
    nothing, size = torch.ops.aten._assert_async, torch.ops.aten.sym_size
    norm = torch.ops.aten.native_layer_norm
    policy = KeepPolicy([nothing, size, norm], callables=(), description="t")
    assert not policy.keeps(nothing.msg)  # returns ()
    assert not policy.keeps(size.int)  # returns an int
    assert policy.keeps(norm.default)  # returns three tensors


class KeepsItsLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 8)

    def recur(self, h: torch.Tensor) -> torch.Tensor:
        return self.lstm(h)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.recur(x))


# Mutation round MC: tests that kill mutants of keep.py, kept_ops.py and kept_callables.py that
# no other test killed.


def test_a_kept_output_stashed_on_the_module_and_changed_before_backward_is_refused_at_the_replay(
        ) -> None:
    # Not a layer output (no alias check at the boundary): only the replay's version check
    # (keep.py, rule 3) sees the change; without it the replay used the changed product.
    class Stashing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.mm(x, self.w)
            self.last = h
            return h.tanh()

    layer = Stashing()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    out = layer(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        layer.last.mul_(3)
    with pytest.raises(pytree_ckpt.CheckpointError, match="mutated between the original pass"):
        out.sum().backward()


class _OverloadCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that really execute, per phase and overload."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        key = (current_phase().value, str(func))
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


# An op with a decomposition and a CUDA kernel of its own (as CUDA's aten::_fused_rms_norm):
# registered here so that a CPU build has it too (the kernel is never run).
_LIBRARY = torch.library.Library("keep_tests", "DEF")
_LIBRARY.define("fused_on_cuda(Tensor x) -> Tensor")
_LIBRARY.impl("fused_on_cuda", lambda x: x * 2, "CompositeImplicitAutograd")
_LIBRARY.impl("fused_on_cuda", lambda x: x * 2, "CUDA")
_LIBRARY.define("composite_only(Tensor x) -> Tensor")
_LIBRARY.impl("composite_only", lambda x: x * 2, "CompositeImplicitAutograd")


def test_an_op_with_a_cuda_kernel_of_its_own_is_kept_and_one_only_decomposed_is_skipped() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KeptOps("keep_tests::fused_on_cuda").resolve() == \
            [torch.ops.keep_tests.fused_on_cuda]
    with pytest.warns(UserWarning, match="torch decomposes keep_tests::composite_only"):
        assert KeptOps("keep_tests::composite_only").resolve() == []


@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_a_cast_kept_by_name_under_an_autocast_entered_outside_the_layer_is_not_kept(
        backward_under_autocast: bool) -> None:
    # NOTE [autocast casts are never kept] for KeptOps("aten::_to_copy") (docs/save_units.md,
    # rule 2): autocast caches its casts of x and the weight, so which casts a pass dispatches
    # depends on the cache; kept, the replay asked for another record or took w's cast for x.
    # The twin is the same boundary keeping nothing (bit-identical whatever is kept).
    from tests.pytree_ckpt.test_save_units import TwiceProjected

    torch.manual_seed(0)
    unkept = TwiceProjected()
    wrapped = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::_to_copy", "aten::mm")}, offload=False)
    x = torch.randn(8, 8, requires_grad=True)
    grads = []
    for model in (unkept, wrapped):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
            if backward_under_autocast:
                loss.backward()
        if not backward_under_autocast:
            loss.backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert_same_grads(*grads)


def test_an_output_on_a_kept_product_taken_back_in_the_forward_may_change_in_place_later(
        ) -> None:
    # The layer changes the kept product in place (rule 3: taken back, recomputed), and the
    # caller changes the output after the call, as eager allows: no record holds that storage
    # any more, so nothing is refused (NOTE [outputs on a kept storage] in made_before.py).
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.mm(x, self.w)
            h.mul_(2)
            return h

    torch.manual_seed(0)
    eager = Scaled()
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    x = torch.randn(2, 4)
    grads = []
    for model in (eager, layer):
        with warnings.catch_warnings():  # taken back, the unit kept nothing: warned (rule 3)
            warnings.filterwarnings("ignore", "pytree_ckpt: save unit 'attn' kept nothing")
            out = model(x)
        out.add_(1)
        out.square().sum().backward()
        grads.append(model.w.grad)
    assert torch.equal(*grads)


class _McGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.w)


class _McGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _McGate()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.gate.project(x)
        return h.tanh(), h


def test_a_kept_class_instance_assigned_into_the_layer_after_its_first_call_is_kept_at_the_next(
        ) -> None:
    # NOTE [kept methods of modules added later] (keep.py): the layer's tree changes after the
    # first call (which already marked the layer as looked at): the next call wraps the new
    # gate's method too, or its product is recomputed in the replay.
    torch.manual_seed(0)
    layer = _McGated()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("_McGate.project")})
    x = torch.randn(2, 4, requires_grad=True)
    sum(t.sum() for t in layer(x)).backward()
    layer.gate = _McGate()  # a replaced router, a LoRA adapter injected as peft does
    with _OverloadCounter() as counter:
        out, h = layer(x)
        (out.sum() + h.sum()).backward()
    assert counter.counts[("forward", "aten.mm.default")] == 1
    assert counter.counts.get(("recompute", "aten.mm.default"), 0) == 0  # kept, not recomputed


def test_an_op_whose_output_is_undefined_with_grad_too_is_kept_like_cuda_flash_attention(
) -> None:
    # Guards against (helper MH) a check that took any None in a Tensor return for a workspace
    # made only with grad: torch's CUDA kernels of aten::_scaled_dot_product_flash_attention
    # and _scaled_dot_product_cudnn_attention return Tensor() (None) for cum_seq_q and
    # cum_seq_k whatever the grad mode, so the docs' ATTN unit kept nothing on CUDA (NOTE
    # [outputs made only with grad] in pytree_ckpt/keep.py). Modelled on CPU by an op of the
    # same shape: its kernel runs once, in the original pass only.
    calls: list[bool] = []
    lib = torch.library.Library("keep_tests_undefined", "DEF")
    lib.define("attn(Tensor x) -> (Tensor out, Tensor cum_seq)")

    def kernel(x: torch.Tensor) -> tuple[torch.Tensor, None]:
        calls.append(torch.is_grad_enabled())
        return x.exp(), None  # undefined in both grad modes

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                out, cum_seq = torch.ops.keep_tests_undefined.attn(x)
            ctx.save_for_backward(out)
            return out, cum_seq

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor, _: Any) -> torch.Tensor:
            return grad * ctx.saved_tensors[0]

    lib.impl("attn", kernel, "CPU")
    lib.impl("attn", Attn.apply, "Autograd")

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.keep_tests_undefined.attn(self.lin(x))[0].sum(-1)

    torch.manual_seed(0)
    eager = Layer()
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("keep_tests_undefined::attn")}, offload=False)
    x = torch.randn(2, 8)
    eager(x).sum().backward()
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "save unit 'attn' kept nothing" where it is not kept
        layer(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), layer.parameters()))
    assert calls == [False]  # kept: the replay takes the record, the kernel runs once


def test_a_kept_method_running_an_lstm_with_onednn_gives_the_gradients_of_keeping_nothing(
        ) -> None:
    # Guards against (helper ME) oneDNN's LSTM (CPU's default kernel, torch.backends.mkldnn on)
    # kept from the no-grad original pass: it makes its workspace only with grad on, so the
    # record held None there and the op's backward failed inside torch ("Expected a proper
    # Tensor but got None ... for argument #22 'workspace'"). The call is recomputed (NOTE
    # [outputs made only with grad] in pytree_ckpt/keep.py), as by the same boundary keeping
    # nothing (whose numbers are the no-grad kernel's: docs/limits.md).
    assert torch.backends.mkldnn.enabled  # the default (flags() would warn about TF32)
    torch.manual_seed(0)
    unkept = KeepsItsLstm()
    kept = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("KeepsItsLstm.recur")}, offload=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    grads = []
    for model in (unkept, kept):
        x.grad = None
        loss = model(x).sum()
        with OpCounter() as counter:
            loss.backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert counter.counts["recompute", "aten.mkldnn_rnn_layer"] == 1  # run again, not kept
    assert counter.counts["recompute", "aten.addmm"] == 0  # its other ops were kept
    assert_same_grads(*grads)


def test_a_unit_naming_onednns_lstm_is_told_it_kept_nothing_and_why() -> None:
    # Guards against (helper MH) the "kept nothing" warning giving only reasons that did not
    # apply (not dispatched, views, clones...) to a unit naming aten::mkldnn_rnn_layer, which
    # is never kept (NOTE [outputs made only with grad] in pytree_ckpt/keep.py).
    torch.manual_seed(0)
    model = KeepsItsLstm()
    apply_recompute_config([model], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mkldnn_rnn_layer")}, offload=False)
    assert torch.backends.mkldnn.enabled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 5, 8, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    assert len(told) == 1
    assert "only with grad on, oneDNN's LSTM: aten::mkldnn_rnn_layer, run again" in told[0]


class LstmUnderItsOwnNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a frozen encoder run by the layer itself
            h = self.lstm(x)[0]
        return self.out(h)


# Its unit's one op is run again (NOTE [outputs made only with grad]): told it kept nothing.
@pytest.mark.filterwarnings("ignore:pytree_ckpt. save unit 'attn' kept nothing")
def test_a_kept_lstm_under_the_layers_own_no_grad_gives_eagers_output_and_gradients() -> None:
    # Guards against (helper MJ) a kept op run with grad on in the original pass, a first fix
    # of NOTE [outputs made only with grad] (pytree_ckpt/keep.py): under the layer's own
    # no_grad eager's oneDNN kernel sees grad off, and the record was the training kernel's.
    torch.manual_seed(0)
    _assert_kept_gives_eagers_output_and_gradients(
        LstmUnderItsOwnNoGrad(), KeptOps("aten::mkldnn_rnn_layer"), torch.randn(3, 5, 8))


def _assert_kept_gives_eagers_output_and_gradients(eager: nn.Module, kept_by: Any,
                                                    x: torch.Tensor) -> None:
    """``eager`` and a copy whose ``attn`` unit keeps ``kept_by``: the same output, and the
    same gradients of ``x`` (where it requires grad) and of ``out``'s parameters."""
    kept = copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: kept_by}, offload=False)
    outs, grads = [], []
    for model in (eager, kept):
        x.grad = None
        y = model(x)
        y.sum().backward()
        outs.append(y.detach())
        grads.append([x.grad, model.out.weight.grad, model.out.bias.grad])
    assert torch.equal(*outs)
    assert_same_grads(*grads)


@torch.library.custom_op("keep_tests_mj::encode", mutates_args=())
def _encode(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
            w_ih2: torch.Tensor) -> torch.Tensor:
    """Two stacked LSTM layers (oneDNN's kernel on CPU) behind a custom op."""
    h0 = x.new_zeros(1, x.shape[0], w_hh.shape[1])
    h = torch._VF.lstm(x, (h0, h0), [w_ih, w_hh], False, 1, 0.0, True, False, True)[0]
    return torch._VF.lstm(h, (h0, h0), [w_ih2, w_hh], False, 1, 0.0, True, False, True)[0]


@_encode.register_fake
def _(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
      w_ih2: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w_hh.shape[1])


_encode.register_autograd(lambda ctx, grad: (grad[..., :8].contiguous(), None, None, None),
                          setup_context=lambda ctx, inputs, output: None)


class EncodesByCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_ih = nn.Parameter(torch.randn(64, 8) * 0.3)
        self.w_hh = nn.Parameter(torch.randn(64, 16) * 0.3)
        self.w_ih2 = nn.Parameter(torch.randn(64, 16) * 0.3)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_encode(x, self.w_ih, self.w_hh, self.w_ih2))


def test_a_kept_custom_op_with_register_autograd_gives_eagers_output_and_gradients() -> None:
    # Guards against (helper MJ) a kept op run with grad on in the original pass: torch's
    # autograd kernel of a custom_op (register_autograd) runs the op's forward under no-grad,
    # so eager's kernel sees grad off, and oneDNN's stacked LSTM inside rounded otherwise.
    torch.manual_seed(0)
    _assert_kept_gives_eagers_output_and_gradients(
        EncodesByCustomOp(), KeptOps("keep_tests_mj::encode"),
        torch.randn(3, 5, 8, requires_grad=True))


class _EncodeByFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lstm: nn.LSTM) -> torch.Tensor:
        return lstm(x)[0]  # autograd runs a Function's forward under no-grad

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., :8].contiguous(), None


class EncodesByFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.Linear(16, 16)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return _EncodeByFunction.apply(x, self.lstm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encode(x))


def test_a_kept_method_calling_an_autograd_function_gives_eagers_output_and_gradients() -> None:
    # Guards against (helper MJ) a kept op run with grad on in the original pass: an
    # autograd.Function's forward runs under no-grad in eager (oneDNN's no-grad kernel).
    torch.manual_seed(0)
    _assert_kept_gives_eagers_output_and_gradients(
        EncodesByFunction(), KeptCallables("EncodesByFunction.encode"),
        torch.randn(3, 5, 8, requires_grad=True))


class KeepsItsDroppedOutLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(8, 8)

    def recur(self, h: torch.Tensor) -> torch.Tensor:
        return self.lstm(h)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.recur(x))


@pytest.mark.filterwarnings("ignore:pytree_ckpt. aten")  # dropout's in-place ops: recomputed
@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Float rounding: nn.LSTM "
                   "on CPU, kept by a save unit) (helper MK): the kept dropout mul between oneDNN "
                   "LSTM layers holds the no-grad kernel's values; the replay's layer 2 reads them")
def test_a_kept_method_running_a_two_layer_lstm_with_dropout_gives_keeping_nothings_grads(
        ) -> None:
    assert torch.backends.mkldnn.enabled
    torch.manual_seed(0)
    unkept = KeepsItsDroppedOutLstm()
    kept = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("KeepsItsDroppedOutLstm.recur")},
                           offload=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    grads = []
    for model in (unkept, kept):
        x.grad = None
        torch.manual_seed(7)
        model(x).sum().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert_same_grads(*grads)


class _Spectrum(nn.Module):
    """Eigenvalues of covariance matrices given as data (no grad), beside a trainable branch."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.lin = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, cov: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.linalg.eigvalsh(cov)) + self.lin(x)


@pytest.mark.xfail(strict=True, reason=(
    "documented limit (docs/limits.md, Float rounding and other kernels: torch.linalg.eigvalsh "
    "with save units, also on one that does not require grad; docs/save_units.md, rule 1) "
    "(helper OW)"))
@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify_replay"])
def test_a_unit_kept_beside_eigenvalues_of_a_data_input_gives_the_eager_twins_numbers(
        verify: bool) -> None:
    torch.manual_seed(0)
    eager = _Spectrum()
    ours = copy.deepcopy(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytree_ckpt.apply_recompute_config([ours], RecomputeConfig(1.0, save=["attn"]),
                                           {SaveUnit.ATTN: KeptOps("aten::addmm")},
                                           verify_replay=verify)
    g = torch.Generator().manual_seed(0)
    points = torch.randn(64, 12, 3, generator=g)
    cov = points.transpose(1, 2) @ points                  # data: requires no grad
    x = torch.randn(64, 3, generator=g)
    results = []
    for model in (eager, ours):
        out = model(cov, x)
        out.square().sum().backward()
        results.append([out.detach(), *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_eigenvalues_of_a_data_input_in_a_layer_without_units_give_the_eager_twins_numbers(
        ) -> None:
    torch.manual_seed(0)
    eager = _Spectrum()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), verify_replay=True)
    g = torch.Generator().manual_seed(0)
    points = torch.randn(64, 12, 3, generator=g)
    cov = points.transpose(1, 2) @ points
    x = torch.randn(64, 3, generator=g)
    results = []
    for model in (eager, ours):
        out = model(cov, x)
        out.square().sum().backward()
        results.append([out.detach(), *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class _EmptyKeptResults(nn.Module):
    """Two empty kept addmm results (data_ptr 0 on CPU, filed by their storages since
    d82b948), one written or resized in place, beside a kept non-empty one resized in place."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.lin, self.lin2, self.mode = nn.Linear(8, 8), nn.Linear(8, 8), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1, e2 = self.lin2(x[:0]), self.lin(x[:0])
        h = self.lin(x)
        if self.mode == "write":
            e1.add_(1)
        elif self.mode == "grow":
            g = e1.detach()
            g.resize_(2, 8).fill_(0.5)
            h = h + g.sum()
        else:
            k = self.lin2(x)
            g = k.detach()
            g.resize_(x.shape[0] * 8 + 8)
            g.zero_()
            h = h + g[:8].sum() + k
        return h.tanh() + e2.sum() + e1.sum()


@pytest.mark.parametrize("mode", ["write", "grow", "resize a kept one"])
def test_empty_and_resized_kept_results_written_in_place_give_eager_gradients(mode: str) -> None:
    torch.manual_seed(0)
    eager = _EmptyKeptResults(mode)
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config([twin], RecomputeConfig(1.0, save=["attn"]),
                                       {SaveUnit.ATTN: KeptOps("aten::addmm")}, offload=False)
    x = torch.randn(4, 8)
    results = []
    for model in (eager, twin):
        xx = x.clone().requires_grad_()
        out = model(xx * 1.0)
        out.square().sum().backward()
        results.append([out, xx.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_kept_unit_over_a_hundred_small_ops_gives_eager_gradients() -> None:
    # _on_nested runs on every kept op in both passes: the count of kept ops must agree.
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4) / 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(100):
                x = torch.mm(x, self.w).tanh()
            return x

    torch.manual_seed(0)
    eager = Chain()
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config([twin], RecomputeConfig(1.0, save=["attn"]),
                                       {SaveUnit.ATTN: KeptOps("aten::mm")}, offload=False,
                                       verify_replay=True)
    x = torch.randn(4, 4)
    results = []
    for model in (eager, twin):
        xx = x.clone().requires_grad_()
        out = model(xx)
        out.sum().backward()
        results.append([out, xx.grad, model.w.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
