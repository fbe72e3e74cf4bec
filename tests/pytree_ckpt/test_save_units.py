"""Selective save units inside the reentrant boundary: what runs in the replay, and what errs."""

from __future__ import annotations

import collections
import io
import copy
import gc
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode

import offload
import pytree_ckpt
from pytree_ckpt import (ActivationCensus, CheckpointConfigError, CheckpointError, KeptCallables,
                         KeptOps, RecomputeConfig, ReuseError, SaveUnit, apply_recompute_config,
                         current_phase)
from tests.conftest import assert_same_grads, grads_of, grads_per_model
from tests.pytree_ckpt.models import DictSettings


class OpCounter(TorchDispatchMode):
    """Counts the ops that really execute, per phase (entered outside the boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[current_phase().value, str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def accumulate(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(self.proj(x).exp())  # in place on a tensor from outside the kept region
        return total


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.gate = Gate()
        self.mix = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.mm(x, self.attn.weight.t()))  # aten.mm: "attention"
        return x + h * self.mix(self.gate.project(h)).sigmoid()


TARGETS = {SaveUnit.ATTN: KeptOps("aten::mm", "nonexistent_ns::attention_v3"),
           SaveUnit.MOE_GATE: KeptCallables("Gate.project")}


def run(save: Any, *, ratio: float = 1.0, layers: int = 3, seed: int = 0,
        counter: OpCounter | None = None, targets: Any = None
        ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    torch.manual_seed(seed)
    stack = nn.ModuleList(Block() for _ in range(layers))
    if save != "eager":
        apply_recompute_config(stack, RecomputeConfig(ratio, save=save), targets or TARGETS)
    x = torch.randn(5, 8, requires_grad=True)
    if counter is None:
        counter = OpCounter()
    with counter:
        h = x
        for layer in stack:
            h = layer(h)
        loss = h.square().sum()
        loss.backward()
    return loss.detach(), [p.grad for p in stack.parameters()] + [x.grad]


@pytest.mark.parametrize("save", [None, False, ["attn"], ["moe_gate"], True])
def test_loss_and_grads_are_bit_identical_whatever_is_kept(save: Any) -> None:
    eager_loss, eager = run("eager")
    loss, got = run(save)
    assert torch.equal(eager_loss, loss)
    assert_same_grads(eager, got)


def test_a_kept_op_runs_zero_times_in_the_replay_and_others_run_again() -> None:
    full = OpCounter()
    run(None, counter=full)
    kept = OpCounter()
    run(["attn"], counter=kept)
    assert full.counts["recompute", "aten.mm"] == 3      # one per layer, recomputed
    assert kept.counts["recompute", "aten.mm"] == 0      # kept: not run again
    assert kept.counts["recompute", "aten.tanh"] == full.counts["recompute", "aten.tanh"] == 3
    gate = OpCounter()
    run(["moe_gate"], counter=gate)
    # the gate's projection (an addmm under nn.Linear) is kept; the mix Linear's is not
    assert full.counts["recompute", "aten.addmm"] == 6
    assert gate.counts["recompute", "aten.addmm"] == 3
    assert gate.counts["recompute", "aten.mm"] == 3
    # the method given as a function object keeps exactly what its qualified name keeps
    by_function = OpCounter()
    run(["moe_gate"], counter=by_function,
        targets={**TARGETS, SaveUnit.MOE_GATE: KeptCallables(Gate.project)})
    assert by_function.counts == gate.counts


def test_without_save_units_no_dispatch_mode_is_active_in_forward_or_replay() -> None:
    seen: list[Any] = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((current_phase().value, _get_current_dispatch_mode()))
            return self.lin(x)

    for save in (None, False):
        seen.clear()
        spy = Spy()
        apply_recompute_config([spy], RecomputeConfig(1.0, save=save), TARGETS)
        spy(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert seen == [("forward", None), ("recompute", None)]


def test_the_census_shows_kept_bytes_under_the_save_unit_mechanism() -> None:
    stack = nn.ModuleList(Block() for _ in range(2))
    apply_recompute_config(stack, RecomputeConfig(1.0, save=["attn"]), TARGETS)
    x = torch.randn(5, 8, requires_grad=True)
    with ActivationCensus(stack) as census:
        h = x
        for layer in stack:
            h = layer(h)
    # each layer keeps its mm output: 5 x 8 fp32
    assert census.bytes_by("mechanism")["save unit"] == 2 * 5 * 8 * 4
    h.sum().backward()
    assert "save unit" not in census.bytes_by("mechanism")


def test_a_kept_output_mutated_before_the_replay_raises_naming_the_op() -> None:
    class Returning(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.mm(x, self.w)
            return h.tanh() * 2, h

    layer = Returning()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]), TARGETS)
    out, h = layer(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        h.mul_(3)  # the kept output changes after the original pass, before the replay
    # Refused before the replay runs, naming the output (NOTE [outputs on a kept storage]).
    with pytest.raises(CheckpointError, match=r"output\[1\] of Returning shares its memory with "
                       r"the result of aten.mm.default that a save unit keeps"):
        out.sum().backward()


def test_an_empty_kept_output_changed_in_place_by_the_caller_gives_eager_gradients() -> None:
    # Guards against (helper NB) an empty batch's output viewing a kept op's result, changed
    # in place by the caller (`out += residual`), being refused in backward as a kept output
    # mutated: it has no element a change could have changed, and eager passes.
    residual = torch.randn(0, 3, 8)

    def use(out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out += residual
        return out.sum(), []

    _empty_batch_through_a_kept_linear_gives_eager_gradients(use)


def _empty_batch_through_a_kept_linear_gives_eager_gradients(use: Any) -> None:
    """An ``nn.Linear`` on an empty batch, eager and with its ``addmm``/``mm`` kept by a save
    unit; ``use(out)`` gives the loss and more tensors to compare: the gradients of the input
    and the parameters, and those tensors, bit for bit."""
    torch.manual_seed(0)
    eager = nn.Linear(8, 8)
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::addmm", "aten::mm")})
    x = torch.randn(0, 3, 8, requires_grad=True)
    grads = []
    for model in (eager, layer):
        loss, more = use(model(x))
        loss.backward()
        grads.append([*grads_of([x, *model.parameters()]), *more])
        x.grad = None
    assert_same_grads(*grads)


def test_the_in_place_op_warning_inside_a_kept_callable_names_the_users_line() -> None:
    class Scaling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def project(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            h.mul_(0.5)                                  # in place, inside the kept method
            return h

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.project(x)

    from pytree_ckpt import keep

    keep._WARNED_MUTATING.discard("aten.mul_.Tensor")  # said once per process
    layer = Scaling()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables(Scaling.project)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(3, 8, requires_grad=True)).sum().backward()
    told = [w for w in caught if "mutates its inputs" in str(w.message)]
    assert len(told) == 1 and "aten.mul_" in str(told[0].message)
    assert told[0].filename == __file__, told[0].filename


def test_an_in_place_op_inside_a_kept_callable_is_recomputed_with_one_warning() -> None:
    class Accumulating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate.accumulate(x, torch.ones(x.shape[0], 4)) * 2

    from pytree_ckpt import keep

    keep._WARNED_MUTATING.discard("aten.add_.Tensor")  # said once per process
    layer, other = Accumulating(), Accumulating()
    twin = copy.deepcopy(layer)
    for each in (layer, other):  # two policies: still one warning
        apply_recompute_config([each], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("Gate.accumulate")})
    counter = OpCounter()
    x = torch.randn(3, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with counter:
            layer(x).sum().backward()
            layer(x).sum().backward()
        other(x).sum().backward()
    told = [str(w.message) for w in caught if "mutates its inputs" in str(w.message)]
    assert len(told) == 1 and "aten.add_.Tensor mutates its inputs" in told[0]
    # The filter the message gives silences it (helper DF: it said nothing of what to do).
    silence = re.search(r"warnings\.filterwarnings\('ignore', '([^']*)'\)", told[0])
    assert silence is not None and re.match(silence.group(1), told[0])
    assert counter.counts["recompute", "aten.add_"] == 2  # recomputed each replay
    assert counter.counts["recompute", "aten.exp"] == 0   # the rest of the region is kept
    assert counter.counts["recompute", "aten.addmm"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op: no second warning
        layer(x).sum().backward()
    for _ in range(3):
        twin(x).sum().backward()
    assert_same_grads([p.grad for p in twin.parameters()], [p.grad for p in layer.parameters()])


@pytest.mark.filterwarnings("ignore:RecomputeConfig.ratio=0")  # inert: warned, tested below
@pytest.mark.parametrize(("ratio", "expected"), [(0, []), (0.5, [0, 1]), (1, [0, 1, 2, 3])])
def test_ratio_checkpoints_the_first_int_n_times_ratio_layers(ratio: float,
                                                              expected: list[int]) -> None:
    stack = nn.ModuleList(Block() for _ in range(4))
    chosen = apply_recompute_config(stack, RecomputeConfig(ratio, save=["attn"]), TARGETS)
    assert chosen == expected
    assert [pytree_ckpt.is_checkpointed(b) for b in stack] == [i in expected for i in range(4)]


@pytest.mark.parametrize("config", [RecomputeConfig(), RecomputeConfig(0.5, save=True),
                                    RecomputeConfig(1.0, save=False),
                                    RecomputeConfig(0.25,
                                                    save=["attn", SaveUnit.MOE_GATE, "attn"])])
def test_recompute_config_round_trips_through_json(config: RecomputeConfig) -> None:
    assert RecomputeConfig.from_json(config.to_json()) == config
    assert config.save is None or isinstance(config.save, (bool, tuple))


def test_a_unit_listed_twice_is_one_unit_of_the_config() -> None:
    # save lists what stays resident: a unit named twice (a list merged from two configs) is
    # the same config as naming it once; kept twice, the two compared unequal and to_json
    # wrote it twice.
    twice = RecomputeConfig(1.0, save=["attn", SaveUnit.ATTN, "moe_gate"])
    assert twice.save == (SaveUnit.ATTN, SaveUnit.MOE_GATE)
    assert twice == RecomputeConfig(1.0, save=["attn", "moe_gate"])
    assert twice.to_json() == '{"ratio": 1.0, "save": ["attn", "moe_gate"]}'

def test_recompute_config_refuses_bad_values_with_a_tip() -> None:
    with pytest.raises(CheckpointConfigError, match="unknown save unit 'atn'") as err:
        RecomputeConfig(1.0, save=["atn"])
    assert "'dsa_indexer'" in str(err.value)
    with pytest.raises(CheckpointConfigError, match="wrap a single unit in a list"):
        RecomputeConfig(1.0, save="attn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0, 1\]"):
        RecomputeConfig(1.5)
    with pytest.raises(TypeError, match="positional"):  # save is an option: keyword-only
        RecomputeConfig(1.0, ["attn"])  # type: ignore[misc]
    with pytest.raises(CheckpointConfigError, match="unknown keys"):
        RecomputeConfig.from_json('{"ratio": 1.0, "keep": []}')


def test_an_undeclared_unit_is_refused_listing_what_the_model_supports() -> None:
    with pytest.raises(ValueError, match=r"\['dsa_indexer'\] are not declared") as err:
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["dsa_indexer"]), TARGETS)
    assert "['attn', 'moe_gate']" in str(err.value)
    assert "choose among the units" in str(err.value)
    # With no targets at all, the tip shows how to declare one (it said to choose among none).
    with pytest.raises(ValueError, match=r"(?s)\['attn'\] are not declared.*expected: \[\]"
                                         r".*declare what each unit keeps in the targets, the "
                                         r"third argument: \{'attn': KeptOps\("):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]), {})


def test_inert_selections_warn() -> None:
    with pytest.warns(UserWarning, match="declares no save units"):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=True), {})
    with pytest.warns(UserWarning, match=r"'attn' keeps nothing: the ops \['x::y'\] do not"):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("x::y")})
    with pytest.warns(UserWarning, match="'moe_gate' keeps nothing: no checkpointed layer"):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("Router.project")})
    # A mistyped target names what is missing and the nearest method there is
    with pytest.warns(UserWarning, match=r"'Gat.acumulate': no class 'Gat' in the checkpointed "
                                         r"layers; did you mean 'Gate.accumulate'\?"):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("Gat.acumulate")})
    # The class is there, the method is not: nothing matches (no wrapper of a missing method)
    with pytest.warns(UserWarning, match=r"keeps nothing.*'Gate\.acumulate': did you mean "
                                         r"'Gate\.accumulate'\?"):
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("Gate.acumulate")})
    with warnings.catch_warnings():  # one missing name of a pair is skipped quietly
        warnings.simplefilter("error")
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]), TARGETS)


def test_each_inert_selection_warns_once_naming_its_own_cause() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::linear")})
    assert [str(w.message)[:40] for w in caught] == ["KeptOps('aten::linear') keeps nothing in"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([Block(), Block()], RecomputeConfig(0.0, save=True), TARGETS)
    assert [str(w.message) for w in caught] == [
        "RecomputeConfig(ratio=0.0) checkpoints none of the 2 layers: the save units "
        "['attn', 'moe_gate'] keep nothing"]


def test_a_ratio_of_zero_without_save_units_checkpoints_nothing_and_warns_nothing() -> None:
    # Nothing is selected, so nothing is inert: only a ratio 0 with save units warns.
    for save in (None, False):
        stack = nn.ModuleList(Block() for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert apply_recompute_config(stack, RecomputeConfig(0.0, save=save), TARGETS) == []
        assert not any(pytree_ckpt.is_checkpointed(b) for b in stack)


@pytest.mark.parametrize("name", ["aten::linear", "aten::scaled_dot_product_attention"])
def test_an_op_this_build_decomposes_before_dispatch_warns_and_the_rest_is_kept(
        name: str) -> None:
    # Such an op never reaches the keeping mode: naming it alone would keep nothing, silently.
    with pytest.warns(UserWarning, match=f"KeptOps\\('{name}'\\) keeps nothing in this build"
                      ) as caught:
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps(name, "aten::mm")})
    assert "KeptCallables" in str(caught[0].message)
    # ops with a kernel of their own are kept; listed-but-unknown overloads do not crash
    with pytest.warns(UserWarning, match="aten::einsum"):
        kept = KeptOps("aten::mm", "aten::einsum", "aten::native_channel_shuffle").resolve()
    assert kept == [torch.ops.aten.mm, torch.ops.aten.native_channel_shuffle]


def test_an_op_only_some_of_whose_overloads_decompose_is_kept_without_a_warning() -> None:
    # aten::max's 'other' overload and aten::var's 'default' and 'dim' are composite (decomposed
    # before dispatch), their other overloads kernels of their own (max.dim, var.correction,
    # what the composite ones become): such an op reaches the keeping mode and is kept. Only
    # an op all of whose functional overloads decompose keeps nothing; one decomposing
    # overload was enough to skip max and var with a "keeps nothing" warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = KeptOps("aten::max", "aten::var").resolve()
    assert kept == [torch.ops.aten.max, torch.ops.aten.var]
    with pytest.warns(UserWarning, match=r"KeptOps\('aten::var.dim'\) keeps nothing"):
        assert KeptOps("aten::var.dim", "aten::var.correction").resolve() == \
            [torch.ops.aten.var.correction]


@pytest.mark.parametrize("op", ["aten::mm.default", torch.ops.aten.mm.default, torch.ops.aten.mm],
                         ids=["overload name", "OpOverload", "OpOverloadPacket"])
def test_an_op_named_as_torch_and_torchtitan_list_it_keeps_what_its_plain_name_keeps(
        op: Any) -> None:
    # Guards against: 'aten::addmm.default' (how torch's selective checkpoint policies and
    # torchtitan's op list name ops) resolves to nothing and is skipped silently next to a
    # valid name: the port keeps less than the torch policy it came from.
    by_name = OpCounter()
    run(["attn"], counter=by_name, targets={SaveUnit.ATTN: KeptOps("aten::mm")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ported = OpCounter()
        loss, grads = run(["attn"], counter=ported, targets={SaveUnit.ATTN: KeptOps(op)})
    assert ported.counts["recompute", "aten.mm"] == 0 and ported.counts == by_name.counts
    eager_loss, eager = run("eager")
    assert torch.equal(loss, eager_loss)
    assert_same_grads(eager, grads)


def test_a_named_overload_keeps_that_overload_only() -> None:
    policy = pytree_ckpt.keep.KeepPolicy(KeptOps("aten::add.Tensor").resolve(), callables=(),
                                         description="t")
    assert policy.keeps(torch.ops.aten.add.Tensor)
    assert not policy.keeps(torch.ops.aten.add.Scalar)


def test_a_higher_order_op_given_to_keptops_is_refused_naming_it_and_the_fix() -> None:
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    if flex is None:
        pytest.skip("this build has no flex_attention")
    with pytest.raises(CheckpointConfigError, match=r"(?s)got: +the higher-order op "
                                                    r"'flex_attention'.*KeptCallables"):
        KeptOps("aten::mm", flex)


@pytest.mark.parametrize(("name", "suggested"), [
    ("aten::adddmm", "'aten::addmm' or 'aten::addbmm'?"),
    ("aten::addmm.defualt", "'aten::addmm.default' or 'aten::addmm.dtype'?")])
def test_a_mistyped_op_name_next_to_a_valid_one_warns_naming_the_op_it_is_close_to(
        name: str, suggested: str) -> None:
    # Guards against: a missing name is skipped quietly when another name of the unit resolves
    # (meant for a v2/v3 pair of kernel names), so a typo kept less than asked, silently.
    # Only overloads a unit can keep are suggested: not addmm.out or addmm.dtype_out, out=
    # variants the keep rules never keep (the name would be skipped with another warning).
    with pytest.warns(UserWarning, match=rf"KeptOps\('{name}'\) names no op in this build; did "
                                         rf"you mean {re.escape(suggested)}$"):
        assert KeptOps(name, "aten::mm").resolve() == [torch.ops.aten.mm]
    with warnings.catch_warnings():  # a kernel version this build lacks, beside its pair
        warnings.simplefilter("error")
        assert KeptOps("aten::mm", "aten::mm_v3", "nonexistent_ns::mm").resolve() == \
            [torch.ops.aten.mm]
        # a version beside its pair, close to a backward kernel: still a version
        assert KeptOps("aten::_efficient_attention_forward",
                       "aten::_efficient_attention_forward_v2").resolve() == \
            [torch.ops.aten._efficient_attention_forward]


@pytest.mark.parametrize(("name", "why"), [("aten::clone", "clones are never kept"),
                                           ("aten::transpose", "views are never kept"),
                                           # views beside an overload on lists or strings
                                           # (split.str, slice.t): silent before
                                           ("aten::split", "views are never kept"),
                                           ("aten::slice", "views are never kept"),
                                           ("aten::addmm_", "in-place and out= ops are never"),
                                           ("aten::addmm.out", "in-place and out= ops are "),
                                           ("_c10d_functional::all_reduce",
                                            "collectives are never kept")])
def test_naming_an_op_the_keep_rules_never_keep_warns_instead_of_keeping_nothing_silently(
        name: str, why: str) -> None:
    if name.startswith("_c10d") and not hasattr(torch.ops._c10d_functional, "all_reduce"):
        pytest.skip("this build has no functional collectives")
    with pytest.warns(UserWarning, match=f"KeptOps\\('{name}'\\) keeps nothing: {why}"):
        kept = KeptOps(name, "aten::mm").resolve()
    assert kept == [torch.ops.aten.mm]


def test_collectives_are_never_kept() -> None:
    policy = pytree_ckpt.keep.KeepPolicy([torch.ops.aten.mm], callables=["M.f"], description="t")
    token = pytree_ckpt.keep.IN_KEPT_CALLABLE.set(frozenset({"M.f"}))
    try:
        assert not policy.keeps(torch.ops._c10d_functional.all_reduce.default)
        assert policy.keeps(torch.ops.aten.mm.default)
    finally:
        pytree_ckpt.keep.IN_KEPT_CALLABLE.reset(token)


def test_save_units_compose_with_nested_boundaries() -> None:
    inner = Block()
    outer_lin = nn.Linear(8, 8)
    apply_recompute_config([inner], RecomputeConfig(1.0, save=["attn"]), TARGETS)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.lin = inner, outer_lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(torch.mm(x, self.lin.weight))

    outer = Outer()
    x = torch.randn(5, 8, requires_grad=True)
    outer(x).square().sum().backward()
    eager = [None if p.grad is None else p.grad.clone() for p in outer.parameters()]
    outer.zero_grad(set_to_none=True)
    apply_recompute_config([outer], RecomputeConfig(1.0, save=["attn"]), TARGETS)
    outer(x).square().sum().backward()
    assert_same_grads(eager, [p.grad for p in outer.parameters()])


def test_applying_the_same_config_twice_is_a_no_op() -> None:
    stack = nn.ModuleList(Block() for _ in range(2))
    config = RecomputeConfig(1.0, save=["attn", "moe_gate"])
    apply_recompute_config(stack, config, TARGETS)
    apply_recompute_config(stack, config, TARGETS)
    with pytest.raises(CheckpointConfigError, match="already checkpointed"):
        apply_recompute_config(stack, RecomputeConfig(1.0, save=["attn"]), TARGETS)


def test_removing_the_boundary_also_unwraps_kept_methods() -> None:
    block = Block()
    apply_recompute_config([block], RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)
    assert "project" in block.gate.__dict__
    pytree_ckpt.remove_activation_checkpointing(block)
    assert "project" not in block.gate.__dict__ and not pytree_ckpt.is_checkpointed(block)


class KeptCoinFlips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        mask = torch.bernoulli(torch.full_like(h, 0.5))  # kept below: draws random numbers
        return nn.functional.dropout(h * mask, 0.5, training=True)


def test_a_kept_op_that_drew_random_numbers_keeps_later_dropout_masks_in_step() -> None:
    # NOTE [skipped work keeps the RNG in step] (frames.py): the replay takes the kept op's output
    # instead of running it; the dropout after it must still draw the original pass's mask.
    torch.manual_seed(0)
    eager = KeptCoinFlips()
    wrapped = copy.deepcopy(eager)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::bernoulli")}, offload=False)
    x = torch.randn(4, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([eager, wrapped], x, seed=1))


class InPlaceGate(nn.Module):
    """A kept region whose outputs are then changed in place (rule 3 of keep.py)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Linear(8, 4)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.w(x)
        if self.how == "scatter_add_":
            ids = logits.topk(2, -1).indices
            mask = torch.zeros_like(logits).scatter_add_(1, ids, torch.ones_like(logits))
        elif self.how == "relu_":
            logits = logits * 1.0
            logits.relu_()
            mask = torch.ones_like(logits)
        elif self.how == "out=":  # an out= argument: written, passed by name
            mask = torch.full_like(logits, 2.0)
            torch.mul(mask, 3, out=mask)
        elif self.how == "_foreach_mul_":  # a list of tensors, each written
            mask = torch.full_like(logits, 2.0)
            torch._foreach_mul_([mask], 3)
        else:
            mask = torch.full_like(logits, 2.0)
            mask.mul_(3)
        return logits * mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x) * 2


@pytest.mark.parametrize("how", ["scatter_add_", "relu_", "mul_", "out=", "_foreach_mul_"])
def test_a_kept_output_changed_in_place_later_in_the_forward_is_recomputed_not_kept_twice(
        how: str) -> None:
    # Keeping it would hand the replay the changed value, and the replay would change it again
    # (x2, x3 gradients) or refuse with a misleading error.
    torch.manual_seed(0)
    eager = InPlaceGate(how)
    wrapped = copy.deepcopy(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "mutates its inputs inside a kept unit": expected
        apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("InPlaceGate.project")},
                               offload=False)
        grads = grads_per_model([eager, wrapped], torch.randn(3, 8, requires_grad=True), seed=0)
    assert_same_grads(*grads)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: apply_recompute_config([nn.Linear(2, 2)], {"ratio": 1.0}, {}),  # type: ignore
     "takes a RecomputeConfig"),
    (lambda: apply_recompute_config([nn.Linear(2, 2)], RecomputeConfig(1.0, save=["attn"]),
                                    {SaveUnit.ATTN: "aten::mm"}),  # type: ignore[dict-item]
     "neither KeptOps nor KeptCallables"),
    (lambda: RecomputeConfig.from_json("[1, null]"), "must be an object"),
    (lambda: RecomputeConfig.from_json("ratio=1"), "does not parse"),
    (lambda: RecomputeConfig(1.0, save=b"attn"), "a list of save units"),  # type: ignore[arg-type]
])
def test_malformed_configs_are_refused_with_a_config_error(call: Any, message: str) -> None:
    with pytest.raises(CheckpointConfigError, match=message):
        call()


def test_the_census_stops_counting_a_kept_output_once_it_is_taken_back() -> None:
    class ReluInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.mm(x, self.w)
            h.relu_()  # takes the kept mm output back (keep.py, rule 3)
            return h * 2

    layer = ReluInPlace()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]), TARGETS, offload=False)
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationCensus(layer) as census, \
            pytest.warns(UserWarning, match="save unit 'attn' kept nothing"):  # nor is it told so
        out = layer(x)
    assert "save unit" not in census.bytes_by("mechanism")
    out.sum().backward()


class TokenMixing(nn.Module):
    """A weight-normed Linear over a transposed 3-D input: its weight is computed in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.tok(x.transpose(1, 2))).transpose(1, 2)


def test_a_kept_op_torch_dispatches_differently_in_the_replay_is_refused_naming_the_cause() -> None:
    # NOTE [kept ops dispatched differently] (frames.py): the computed weight requires no grad in
    # the no-grad original pass (torch.matmul runs aten::bmm) and requires grad in the replay
    # (aten::mm). Refused in backward, with a tip naming torch's choice, not the user's code.
    layers = nn.ModuleList([TokenMixing()])
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    with pytest.warns(UserWarning, match="'attn' kept nothing"):  # bmm ran in the forward
        loss = layers[0](torch.randn(2, 16, 16, requires_grad=True)).square().sum()
    with pytest.raises(ReuseError, match="(?s)aten.mm.*torch itself chooses.*weight_norm"
                       ) as raised:
        loss.backward()
    # The library's own error says what happened: no note about a changed argument added.
    assert not getattr(raised.value, "__notes__", None)


class ReusingRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 4)

    def topk(self, h: torch.Tensor) -> torch.Tensor:
        return h.topk(2, -1).indices

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # the kept method
        logits = self.w(h)
        return logits, pytree_ckpt.reuse_during_recompute(self.topk, logits.detach())


class ReusingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = ReusingRouter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, ids = self.router.project(x)
        return logits.gather(-1, ids)


def test_a_reused_call_inside_a_kept_method_gives_eager_gradients() -> None:
    # The reuse's own RNG comparison (torch.equal) dispatched inside the kept method, was kept
    # by the unit, and the replay (which skips the call) was refused for not asking for it.
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layers = nn.ModuleList([ReusingLayer()])
        if wrap:
            apply_recompute_config(layers, RecomputeConfig(1.0, save=["moe_gate"]),
                                   {SaveUnit.MOE_GATE: KeptCallables("ReusingRouter.project")})
        x = torch.randn(4, 8, requires_grad=True)
        layers[0](x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in layers.parameters())])
    assert_same_grads(*grads)


class ReshapingGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        # reshape of a transposed tensor is no view: aten.clone, then aten._unsafe_view of the
        # clone (a new tensor on the clone's storage, not a view by its schema); clones are
        # never kept, so one kept record is on that storage
        return (x @ self.w).t().reshape(-1).view(-1, 4)


class ReshapedInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = ReshapingGate()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate.project(x)
        y.mul_(2)  # changes the storage of the kept _unsafe_view
        return self.out(y * y)


class BatchedGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        # A 3-D input by a 2-D weight: aten.mm of the folded input, then aten._unsafe_view of
        # its output (a new tensor on mm's storage, with a version counter of its own): two
        # kept records on one storage, now that clones are never kept.
        return x @ self.w


class BatchedInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = BatchedGate()
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate.project(x)
        y.mul_(2)  # changes the storage of both kept outputs
        return self.out(y * y)


@pytest.mark.parametrize("model, shape", [(ReshapedInPlace, (4, 8)), (BatchedInPlace, (2, 3, 8))],
                         ids=["one record", "two records"])
def test_kept_outputs_on_a_storage_changed_in_place_later_are_all_recomputed(
        model: type[nn.Module], shape: tuple[int, ...]) -> None:
    # Rule 3 must take back every record on the written storage: taking back only the last
    # one (the _unsafe_view) left mm's record handing the replay the doubled values, which
    # the replay doubled again, silently (mm's version counter never moved).
    torch.manual_seed(0)
    eager = model()
    wrapped = copy.deepcopy(eager)
    gate = type(eager.gate).__name__
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables(f"{gate}.project")}, offload=False)
    with warnings.catch_warnings():
        # With two records both are taken back, and the unit is told it kept nothing
        # (test_unit_use.py tests that warning).
        warnings.filterwarnings("ignore", "pytree_ckpt: save unit 'moe_gate' kept nothing")
        grads = grads_per_model([eager, wrapped], torch.randn(*shape, requires_grad=True),
                                seed=0)
    assert_same_grads(*grads)


class SquareGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class TwiceProjected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = SquareGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate.project(x) * self.gate.project(x).tanh()


@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_a_kept_callable_under_autocast_gives_the_gradients_of_keeping_nothing(
        backward_under_autocast: bool) -> None:
    # Autocast caches its casts of leaves that require grad (the weight; the input x here) for
    # the whole autocast region, so which aten._to_copy a pass dispatches depends on the cache,
    # not on the code: the original pass cast w and x once each; the replay (x is a view there)
    # cast x twice and asked for a third record, or (backward inside the region) found w cached
    # and took w's kept cast for x: silently wrong gradients.
    # Under autocast the boundary is not bit-identical to eager (autocast sums the two uses of
    # x's cached cast in bf16, the replay's two casts of a view of x in fp32): the twin is the
    # same boundary keeping nothing, as "bit-identical whatever is kept" promises.
    torch.manual_seed(0)
    unkept = TwiceProjected()
    wrapped = copy.deepcopy(unkept)
    pytree_ckpt.apply_activation_checkpointing(unkept, offload=False)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("SquareGate.project")},
                           offload=False)
    x = torch.randn(8, 8, requires_grad=True)  # square: w's cast fits where x's belongs
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


class CopiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.out = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate.project(x).tanh())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_layer_with_a_kept_callable_computes_with_its_own_weights(how: str) -> None:
    # The kept method was a function closing over a weak reference to the original module:
    # copy.deepcopy shared it, so the copy's gate ran on the original's weights (an EMA or
    # teacher copy silently computed with the live model's gate); pickling failed.
    torch.manual_seed(0)
    original = CopiedBlock()
    apply_recompute_config([original], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")}, offload=False)
    if how == "deepcopy":
        twin = copy.deepcopy(original)
    else:
        buffer = io.BytesIO()
        torch.save(original, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        twin.gate.proj.weight.mul_(-1)  # the copy's gate is not the original's any more
    eager = CopiedBlock()
    eager.load_state_dict(twin.state_dict())
    x = torch.randn(3, 8, requires_grad=True)
    grads = grads_per_model([eager, twin], x, seed=0)
    assert_same_grads(*grads)
    assert original.gate.proj.weight.grad is None
    with torch.no_grad():
        assert torch.equal(twin(x), eager(x))


def test_a_layer_with_a_kept_callable_pickled_before_save_units_was_split_still_loads() -> None:
    # Guards against: a pickle names the kept method's class by its module; moving _KeptMethod
    # out of save_units.py without leaving its name there made every model with a kept callable
    # pickled before fail to load. Protocol 2 names a class as text ("c<module>\n<name>\n"), so
    # a pickle made then is one made now with the old module name in its place.
    import pickle

    torch.manual_seed(0)
    original = CopiedBlock()
    apply_recompute_config([original], RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")}, offload=False)
    now = pickle.dumps(original, protocol=2)
    where = b"cpytree_ckpt.kept_callables\n_KeptMethod\n"
    assert now.count(where) == 1
    twin = pickle.loads(now.replace(where, b"cpytree_ckpt.save_units\n_KeptMethod\n"))
    assert getattr(twin.gate.__dict__["project"], "_pytree_ckpt_kept", False)
    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([original, twin], x, seed=0))


def test_a_refused_second_config_leaves_the_layers_methods_as_they_were() -> None:
    stack = nn.ModuleList(Block() for _ in range(2))
    apply_recompute_config(stack, RecomputeConfig(1.0, save=["attn"]), TARGETS)
    with pytest.raises(CheckpointConfigError, match="already checkpointed with other options"):
        apply_recompute_config(stack, RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)
    # The gate's method was not wrapped on the way to the refusal: the first config holds.
    assert all("project" not in layer.gate.__dict__ for layer in stack)
    pytree_ckpt.remove_activation_checkpointing(stack[0])
    pytree_ckpt.remove_activation_checkpointing(stack[1])
    assert all("forward" not in layer.__dict__ for layer in stack)


def test_applying_one_config_twice_wraps_each_kept_method_once_and_removing_unwraps_it() -> None:
    block = Block()
    apply_recompute_config([block], RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)
    first = block.gate.__dict__["project"]
    apply_recompute_config([block], RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)  # a no-op
    assert block.gate.__dict__["project"] is first
    pytree_ckpt.remove_activation_checkpointing(block)
    assert "project" not in block.gate.__dict__ and not pytree_ckpt.is_checkpointed(block)


def test_a_config_refused_by_a_later_layer_leaves_the_earlier_layers_unchanged() -> None:
    # Only the second layer is checkpointed already (with other options): every chosen layer
    # is checked before any is changed, so the first is left as it was too.
    stack = nn.ModuleList(Block() for _ in range(2))
    pytree_ckpt.apply_activation_checkpointing(stack[1])
    with pytest.raises(CheckpointConfigError, match="already checkpointed with other options"):
        apply_recompute_config(stack, RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)
    assert all("project" not in layer.gate.__dict__ for layer in stack)
    assert not pytree_ckpt.is_checkpointed(stack[0])


class NormalizingRouter(nn.Module):
    """transformers' MoE routers (Mixtral, Qwen3-MoE, OlmoE): the top-k weights are
    normalized in place, so in the replay (grad on) autograd clones them before the division."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(h, self.weight)
        top, ids = torch.topk(logits.softmax(-1), 2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, ids


class RoutedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gate = nn.Linear(8, 8), NormalizingRouter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        logits, top, _ = self.gate(h)
        return h * top.sum(-1, keepdim=True) + logits.square().sum(-1, keepdim=True)


def test_a_kept_router_that_normalizes_its_top_k_in_place_gets_eager_gradients() -> None:
    # The replay asked for a kept aten.clone the original pass (no grad) never dispatched:
    # ReuseError "kept output #1 of aten.clone.default, but the original pass recorded 0".
    torch.manual_seed(0)
    eager = RoutedLayer()
    wrapped = copy.deepcopy(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the in-place division is recomputed, with a warning
        apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["moe_gate"]),
                               {SaveUnit.MOE_GATE: KeptCallables("NormalizingRouter.forward")},
                               offload=False)
        grads = grads_per_model([eager, wrapped], torch.randn(5, 8, requires_grad=True), seed=0)
    assert_same_grads(*grads)


def test_a_kept_method_called_after_its_module_was_freed_is_refused_naming_the_fix() -> None:
    # The method holds its module weakly (no cycle); a bare assert fired before.
    stack = nn.ModuleList([Block()])
    apply_recompute_config(stack, RecomputeConfig(1.0, save=["moe_gate"]), TARGETS)
    project = stack[0].gate.project
    x = torch.randn(5, 8)
    assert torch.equal(project(x), stack[0].gate.proj(x))
    del stack
    gc.collect()
    with pytest.raises(CheckpointError, match=r"kept method project no longer exists") as error:
        project(x)
    assert "module.project(...)" in str(error.value)


def test_a_layer_keeping_ops_by_name_and_overload_survives_torch_save_and_keeps_them() -> None:
    # torch's op objects cannot be pickled: torch.save of a layer given KeptOps raised
    # "function_record ... is not pickleable". The policy travels by op name now.
    torch.manual_seed(0)
    targets = {SaveUnit.ATTN: KeptOps("aten::mm", torch.ops.aten.tanh.default),
               SaveUnit.MOE_GATE: KeptCallables("Gate.project")}
    original = Block()
    eager = copy.deepcopy(original)
    apply_recompute_config([original], RecomputeConfig(1.0, save=["attn", "moe_gate"]), targets)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)
    assert pytree_ckpt.is_checkpointed(twin)
    x = torch.randn(5, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([eager, twin], x, seed=0))
    counter = OpCounter()
    with counter:
        twin(x).sum().backward()
    # Kept, as in the original: the replay runs neither mm nor tanh again.
    assert counter.counts["recompute", "aten.mm"] == 0
    assert counter.counts["recompute", "aten.tanh"] == 0
    assert counter.counts["recompute", "aten.sigmoid"] == 1  # the rest is recomputed


def test_a_loaded_layer_keeping_one_overload_takes_the_same_config_again() -> None:
    # A policy travels by op names (KeepPolicy.__reduce__): the name of one overload
    # ('aten::tanh.default') must come back as that overload alone. Loaded as the whole op,
    # the policy kept every overload of it, and applying the same config again to the loaded
    # model (a resumed run setting up as the first did) was refused as other options.
    targets = {SaveUnit.ATTN: KeptOps("aten::mm", torch.ops.aten.tanh.default)}
    config = RecomputeConfig(1.0, save=["attn"])
    original = Block()
    apply_recompute_config([original], config, targets)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)
    assert apply_recompute_config([twin], config, targets) == [0]  # the same options: no-op


def test_a_pickled_layer_keeping_an_op_this_process_lacks_is_refused_naming_it() -> None:
    from pytree_ckpt.keep import KeepPolicy
    policy = KeepPolicy([torch.ops.aten.mm], callables=(), description="attn")
    name, args = policy.__reduce__()
    with pytest.raises(CheckpointError, match="(?s)keeps the op no_such_ns::op.*tip: import"):
        name(("no_such_ns::op",), *args[1:])
    assert name(*args) == policy


@pytest.mark.parametrize("make", [lambda: KeptOps(None), lambda: KeptOps("aten::mm", None),
                                  lambda: KeptCallables(None),
                                  lambda: KeptCallables("Attn.forward", None)])
def test_a_none_target_is_refused_when_the_unit_is_made(make: Any) -> None:
    # A None argument is the bad one; it once read as "no bad one" (next(..., None)).
    with pytest.raises(CheckpointConfigError,
                       match=r"(?s)takes .*expected: e\.g\. Kept.*got:      None.*tip: "):
        make()


@pytest.mark.parametrize("targets", [None, [KeptOps("aten::mm")]])
def test_targets_that_are_not_a_mapping_are_refused_naming_the_fix(targets: Any) -> None:
    # Once "'NoneType' object has no attribute 'items'", before any check.
    layer = nn.Linear(2, 2)
    with pytest.raises(CheckpointConfigError) as caught:
        apply_recompute_config([layer], RecomputeConfig(1.0), targets)
    assert str(caught.value) == (
        "apply_recompute_config takes the model's targets: a mapping from each save unit it "
        "declares to what the unit keeps\n"
        "  expected: e.g. {SaveUnit.ATTN: KeptOps('aten::mm')}, or {} (no units declared)\n"
        f"  got:      {type(targets).__name__} {targets!r}\n"
        "  tip: pass {} for a model that declares no save units; put each target in a dict "
        "under the unit it serves ({SaveUnit.ATTN: KeptOps(...)})")
    assert not pytree_ckpt.is_checkpointed(layer)  # refused before any change
    assert apply_recompute_config([layer], RecomputeConfig(1.0), {}) == [0]  # the tip's fix


@pytest.mark.parametrize("typo", ["aten::MM", " aten::mm", "aten::mm ", "aten::m m"])
def test_a_kept_op_name_off_by_case_or_spaces_is_warned_with_the_op_it_means(typo: str) -> None:
    # Beside a name that resolves, "aten::MM" and " aten::mm" were skipped without a word
    # (difflib is case-sensitive; the space made a namespace " aten", with no ops).
    layers = nn.ModuleList([nn.Linear(4, 4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config(layers, RecomputeConfig(1.0, save=True),
                               {SaveUnit.ATTN: KeptOps("aten::addmm", typo)})
    assert [str(w.message) for w in caught] == [
        f"KeptOps({typo!r}) names no op in this build; did you mean 'aten::mm'?"]
    # Named exactly as it resolves, the op needs no warning (and one the unit names in full
    # beside it, none either).
    for names in [("aten::addmm", "aten::mm"), ("aten::mm", typo)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [str(op) for op in KeptOps(*names).resolve()] == [
                f"aten.{n.split('::')[1]}" for n in names if n != typo]
        assert not caught


@pytest.mark.parametrize("typo, meant", [
    ("ATEN::mm", "'aten::mm'"),  # the namespace off by case
    ("aten::MM.default", "'aten::mm.default'"),  # an overload named (then the op's others)
])
def test_a_kept_op_name_off_by_case_in_its_namespace_or_with_an_overload_is_warned_with_the_op(
        typo: str, meant: str) -> None:
    # The namespace is compared without case too, and an overload of an op off by case is
    # looked up under the op's own name (not getattr(torch.ops.aten, 'MM'), which fails).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [str(op) for op in KeptOps("aten::addmm", typo).resolve()] == ["aten.addmm"]
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"KeptOps({typo!r}) names no op in this build; did you mean {meant}")


@pytest.mark.parametrize("make, shown", [
    (lambda: KeptOps(None, 3), "None"), (lambda: KeptOps("aten::mm", 3, None), "3"),
    (lambda: KeptCallables(None, 3), "None"),
    (lambda: KeptCallables("Attn.forward", "nodot", None), "'nodot'")])
def test_of_several_bad_targets_the_first_is_named(make: Any, shown: str) -> None:
    with pytest.raises(CheckpointConfigError) as caught:
        make()
    assert f"\n  got:      {shown}\n" in str(caught.value)


def test_a_kept_op_name_off_by_case_and_by_a_letter_is_warned_with_the_op_it_means() -> None:
    # The close matches are looked for without case too: "aten::MMM" is "aten::mmm", close to
    # aten::mm (case-sensitive, nothing is close to it, and it was skipped without a word).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [str(op) for op in KeptOps("aten::addmm", "aten::MMM").resolve()] == [
            "aten.addmm"]
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "KeptOps('aten::MMM') names no op in this build; did you mean 'aten::mm'")


def test_save_units_after_the_readme_loop_are_refused_naming_the_one_call_that_does_both() -> None:
    # Guards against (helper DX): a user who wrapped layers with offload as the README shows,
    # then added save units, was told only to remove and apply again; the one call that takes
    # both (apply_recompute_config(..., offload=...)) is named now, and gives eager's grads.
    torch.manual_seed(0)
    stack = nn.ModuleList(Block() for _ in range(2))
    eager = copy.deepcopy(stack)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    for layer in stack:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    with pytest.raises(CheckpointConfigError, match="keep differ") as raised:
        apply_recompute_config(stack, RecomputeConfig(1.0, save=["attn"]), TARGETS,
                               offload=manager)
    assert "apply_recompute_config(layers, config, targets, offload=...)" in str(raised.value)
    for layer in stack:
        pytree_ckpt.remove_activation_checkpointing(layer)
    apply_recompute_config(stack, RecomputeConfig(1.0, save=["attn"]), TARGETS, offload=manager)
    x = torch.randn(3, 8, requires_grad=True)
    grads = []
    for model in (eager, stack):
        h = x
        for layer in model:
            h = layer(h)
        h.sum().backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)
    assert manager.stats()["offloaded_bytes"] > 0


def test_keeping_sdpa_by_its_public_name_is_told_the_kernels_it_becomes() -> None:
    # Guards against (helper DX): the decomposed-op warning suggested aten::addmm whatever the
    # op; for scaled_dot_product_attention it names the kernels save_units.md lists.
    with pytest.warns(UserWarning, match="keeps nothing in this build") as caught:
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::scaled_dot_product_attention")})
    (told,) = [str(w.message) for w in caught if "decomposes" in str(w.message)]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu on CPU" in told
    assert "aten::addmm" not in told


def test_kept_callables_with_nothing_to_keep_is_refused() -> None:
    # Coverage audit (helper EA): the message ran in no test.
    with pytest.raises(CheckpointConfigError) as err:
        KeptCallables()
    assert str(err.value).splitlines() == [
        "KeptCallables needs at least one callable", "  expected: a method or 'Class.method'",
        "  got:      nothing", "  tip: e.g. KeptCallables('Router.project')"]


class QuantFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        y, = ctx.saved_tensors
        return grad * (1 - y * y)


class QuantBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantFn.apply(self.lin(x))


def test_kept_callable_near_miss_never_suggests_the_layers_own_forward() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([QuantBlock()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables("QuantFn.forward")})
    # A refused target was suggested (helper EU); the hint says what to keep instead.
    told = " ".join(str(w.message) for w in caught)
    assert "keeps nothing" in told
    assert "did you mean 'QuantBlock.forward'" not in told
    assert ("'QuantFn.forward': 'QuantFn' is a torch.autograd.Function, whose methods autograd "
            "calls, not a module: keep the module method that calls QuantFn.apply") in told


@pytest.mark.parametrize("given", [QuantFn.apply, QuantFn.forward], ids=["apply", "forward"])
def test_a_functions_own_method_given_as_a_kept_callable_is_told_what_to_keep_instead(
        given: Any) -> None:
    # Helper LQ: KeptCallables(QuantFn.apply) warned "keeps nothing" with no hint, where the
    # same method named as a string gets the one above.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([QuantBlock()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables(given)})
    told = " ".join(str(w.message) for w in caught)
    assert "keeps nothing" in told
    assert (f"QuantFn.{given.__name__}: 'QuantFn' is a torch.autograd.Function, whose methods "
            "autograd calls, not a module: keep the module method that calls QuantFn.apply "
            "(KeptCallables('Class.method'))") in told


class _Scripted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class _BlockWithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.post = torch.jit.script(_Scripted())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.lin(x))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("given", [lambda x: x, torch.tanh, "_BlockWithScripted.helpr"],
                         ids=["lambda", "builtin", "mistyped name"])
def test_a_callable_that_keeps_nothing_only_warns_when_a_layer_holds_a_scripted_submodule(
        given: Any) -> None:
    # Guards against (helper LZ) the Function hint of the 'keeps nothing' warning reading
    # every module's type(m).forward, which a RecursiveScriptModule's _CachedForward
    # descriptor answers with AttributeError, raised out of apply_recompute_config (for a
    # mistyped "Class.method" name too, before efbfb13).
    layer, twin = _BlockWithScripted(), _BlockWithScripted()
    twin.load_state_dict(layer.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables(given)})
    assert "keeps nothing" in " ".join(str(w.message) for w in caught)
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), twin(x))


def test_a_method_of_a_class_named_like_a_function_is_not_called_a_functions_method() -> None:
    # Guards against (helper LZ) a class QuantFn of another file (an nn.Module helper), not
    # the torch.autograd.Function QuantFn that QuantBlock.forward calls, told it is that
    # Function's method: the callable is at hand, its owner need not be guessed by name.
    namespace: dict[str, Any] = {}
    exec("class QuantFn(nn.Module):\n    def scale(self, x):\n        return x * 2\n",
         {"nn": nn, "__name__": "other_file"}, namespace)
    given = namespace["QuantFn"].scale
    assert given.__qualname__ == "QuantFn.scale"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([QuantBlock()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables(given)})
    told = " ".join(str(w.message) for w in caught)
    assert "keeps nothing" in told
    assert "is a torch.autograd.Function" not in told


def test_kept_callable_near_miss_suggests_no_checkpointed_layers_forward() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([QuantBlock()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables("QuantBlok.forward")})
    told = " ".join(str(w.message) for w in caught)
    assert "'QuantBlok.forward': no class 'QuantBlok' in the checkpointed layers; no method " \
        "'forward' close to it" in told


# A decorator defined in another module (transformers decorates forwards so: @deprecate_kwarg,
# @can_return_tuple): the wrapper's __globals__ are that module's.
_OTHER_MODULE: dict[str, Any] = {}
exec(compile("import functools\n"
             "def logged(f):\n"
             "    @functools.wraps(f)\n"
             "    def wrapper(*args, **kwargs):\n"
             "        return f(*args, **kwargs)\n"
             "    return wrapper\n", "other_module.py", "exec"), _OTHER_MODULE)


class _DecoratedQuantBlock(QuantBlock):
    @_OTHER_MODULE["logged"]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantFn.apply(self.lin(x))


def test_kept_callable_naming_an_autograd_function_is_told_so_under_a_decorated_forward() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([_DecoratedQuantBlock()], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables("QuantFn.forward")})
    told = " ".join(str(w.message) for w in caught)
    assert "'QuantFn' is a torch.autograd.Function" in told


class QuantBlockV2(QuantBlock):
    """A layer whose forward is its base class's."""


class QuantOps:
    Fn = QuantFn


class NestedQuant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantOps.Fn.apply(self.lin(x))


def _told(layer: nn.Module, target: str) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptCallables(target)})
    return " ".join(str(w.message) for w in caught)


def test_kept_callable_near_miss_suggests_no_forward_a_layer_inherits() -> None:
    told = _told(QuantBlockV2(), "QuantBlok.forward")
    assert "keeps nothing" in told and "did you mean 'QuantBlock.forward'" not in told


def test_kept_callable_naming_an_autograd_function_gets_that_hint_alone() -> None:
    told = _told(QuantBlock(), "QuantFn.forward")
    assert told.count("'QuantFn.forward':") == 1  # no near-miss hint beside it


def test_kept_callable_naming_an_autograd_function_through_a_class_attribute_says_so() -> None:
    told = _told(NestedQuant(), "QuantOps.Fn.forward")
    assert "'QuantOps.Fn' is a torch.autograd.Function" in told


def test_kept_callable_naming_an_autograd_function_a_submodule_applies_says_so() -> None:
    # The Function is a global of the submodule's code, not of the layer's.
    space: dict[str, Any] = {"nn": nn, "torch": torch, "HiddenFn": QuantFn}
    exec("class Inner(nn.Module):\n"  # noqa: S102 - a class defined under other globals
         "    def forward(self, x):\n"
         "        return HiddenFn.apply(x)\n", space)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.inner = nn.Linear(8, 8), space["Inner"]()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.lin(x))

    told = _told(Outer(), "HiddenFn.forward")
    assert "'HiddenFn' is a torch.autograd.Function" in told


class _FlexLayer(nn.Module):
    """An attention layer on ``flex_attention`` with an ALiBi ``score_mod`` over a buffer,
    its attention kept by callable, as KeptOps's refusal of the higher-order op tells."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention
        slopes = self.slopes
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s - slopes[h] * (qi - kv).abs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return x + self.o(self.attend(q, k, v).transpose(1, 2).reshape(2, 8, 16))


_FLEX_UNDER_UNITS = pytest.mark.skipif(
    torch.__version__ < "2.13", reason="documented (docs/save_units.md): on torch 2.11 a layer "
    "calling flex_attention fails under save units with torch's own errors")


def _refused_or_eager(kept: nn.Module, eager: nn.Module, x: torch.Tensor, /) -> bool:
    """Run ``kept`` (a stack keeping units) and ``eager`` on ``x``: where flex_attention
    compiles its own call (torch 2.13), the layer is refused naming it, with the tip (True);
    else its loss and gradients are eager's (False)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile()"
        expected = eager(x).square().sum()
        expected.backward()
        try:
            got = kept(x).square().sum()
        except CheckpointConfigError as refused:
            assert re.match(r"\w+ runs code compiled with fullgraph=True \(flex_attention "
                            r"compiles its own call", str(refused)), str(refused)
            assert "tip: apply the save units to layers without such code" in str(refused)
            torch._dynamo.reset()  # it remembers the failed compile and would not try again
            return True
        got.backward()
    assert torch.equal(expected, got)
    assert_same_grads(grads_of(eager.parameters()), grads_of(kept.parameters()))
    return False


@_FLEX_UNDER_UNITS
def test_flex_attention_kept_by_callable_is_refused_naming_the_layer_or_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [higher-order ops pass through our modes] (discarded_reads.py): flex_attention
    # compiles its own call (fullgraph=True), which dynamo refuses under the mode units keep
    # ops through; torch raised "no rule registered for HigherOrderOperator", then "found no
    # compiled frames" (helper FC). Refused naming the layer, with the tip that works.
    import torch.nn.attention.flex_attention as flex
    # torch refuses flex_attention's backward on CPU in this check only; the unfused eager
    # implementation behind it differentiates (stands in for CUDA, where it is allowed).
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    with pytest.raises(CheckpointConfigError, match="but not flex_attention, which may run in "
                                                    "no layer that keeps units"):
        KeptOps(torch.ops.higher_order.flex_attention)
    torch.manual_seed(0)
    eager = nn.Sequential(_FlexLayer(), _FlexLayer())
    kept = copy.deepcopy(eager)
    apply_recompute_config(kept, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_FlexLayer.attend")})
    _refused_or_eager(kept, eager, torch.randn(2, 8, 16, requires_grad=True))


class _FlexRouted(_FlexLayer):
    """The same attention, not kept, in a layer that keeps only its MoE-style gate."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h * self.router.project(h[..., :8])[..., :1]


@_FLEX_UNDER_UNITS
def test_flex_attention_beside_a_kept_gate_is_refused_and_recomputed_in_full_is_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.flex_attention as flex
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)  # as above
    torch.manual_seed(0)
    eager = nn.Sequential(_FlexRouted(), _FlexRouted())
    kept, full, twin = copy.deepcopy(eager), copy.deepcopy(eager), copy.deepcopy(eager)
    apply_recompute_config(kept, RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    apply_recompute_config(full, RecomputeConfig(1.0), {})  # what the tip says: no unit
    x = torch.randn(2, 8, 16, requires_grad=True)
    _refused_or_eager(kept, twin, x)
    _refused_or_eager(full, eager, x)  # never refused: no unit


class _ControlFlowLayer(nn.Module):
    """A gate projection (an addmm the unit keeps) beside a control-flow higher-order op whose
    body reads a parameter of the layer."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.gate, self.inner = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.gate(x)
        if self.op == "cond":
            y = torch.cond(x.sum() > 0, lambda t: torch.tanh(self.inner(t)),
                           lambda t: torch.sigmoid(self.inner(t)), (x,))
        else:
            from torch._higher_order_ops import while_loop
            _, y = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, torch.tanh(self.inner(v))),
                              (torch.tensor(0), x))
        return y * r


@pytest.mark.parametrize("op", ["cond", "while_loop"])
def test_a_control_flow_op_in_a_layer_keeping_units_is_refused_and_later_calls_still_run(
        op: str) -> None:
    # NOTE [control flow under save units]: under the mode dynamo did not trace the op's
    # branches, and the parameters they read got no gradient, silently (helper FN); refused in
    # the original pass naming the layer and the op. The refusal leaves no dynamo state behind:
    # the same op in a module keeping no units (and in the layer recomputed in full, what the
    # tip says) gives eager's gradients, with no torch._dynamo.reset() (it raised until then).
    torch.manual_seed(0)
    eager = _ControlFlowLayer(op)
    kept, plain, full = copy.deepcopy(eager), copy.deepcopy(eager), copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::addmm")})
    apply_recompute_config([full], RecomputeConfig(1.0), {})
    x = torch.randn(4, 8).abs()
    with pytest.raises(CheckpointConfigError, match=rf"_ControlFlowLayer calls torch's {op} "
                       r"\(a control-flow operator\) while the layer keeps save units") as raised:
        kept(x)
    assert "recompute these layers in full" in str(raised.value)
    expected, got_plain, got_full = grads_per_model([eager, plain, full], x, seed=0)
    assert_same_grads(expected, got_plain)
    assert_same_grads(expected, got_full)


def test_apply_recompute_configs_warnings_name_the_callers_line() -> None:
    cases = [(RecomputeConfig(0.0, save=True), TARGETS),  # ratio 0: nothing checkpointed
             (RecomputeConfig(1.0, save=True), {}),  # save=True, no unit declared
             (RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: KeptCallables("Nope.f")})]
    for config, targets in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_recompute_config([Block(), Block()], config, targets)
        assert caught and all(w.filename == __file__ for w in caught), \
            [(w.filename, str(w.message)[:40]) for w in caught]


class _GradModeRouter(nn.Module):
    """Megatron-Core's router: the load-balancing term (its aux loss, its token count) is
    computed only ``if self.training and torch.is_grad_enabled()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def route(self, h: torch.Tensor) -> torch.Tensor:
        probs = self.gate(h).softmax(-1)
        if self.training and torch.is_grad_enabled():
            probs = probs + 0.0 * (probs > 0.25).sum(0)
        return probs


class _GradModeMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _GradModeRouter()

    def dispatch(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs.T > 0.25).sum(1)  # tokens per expert

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = self.router.route(h)
        return h * probs.sum(-1, keepdim=True) * self.dispatch(probs).sum()


def test_a_kept_router_branching_on_grad_mode_is_refused_naming_grad_mode() -> None:
    # Helper GJ: kept beside another unit calling the same op, the replay's extra call (the
    # grad-mode branch) meets the other unit's record: the ReplayMismatchError's tip named only
    # state changed between forward and backward, where nothing changed.
    torch.manual_seed(0)
    layer = _GradModeMoE()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["moe_gate", "moe_dispatch"]),
                           {SaveUnit.MOE_GATE: KeptCallables("_GradModeRouter.route"),
                            SaveUnit.MOE_DISPATCH: KeptCallables("_GradModeMoE.dispatch")})
    loss = layer(torch.randn(6, 8, requires_grad=True)).sum()
    with pytest.raises((ReuseError, CheckpointError)) as refused:
        loss.backward()
    message = str(refused.value)
    assert "inside the kept method _GradModeRouter.route" in message
    assert "Usually the code branches on grad mode (`if torch.is_grad_enabled():`" in message
    assert "keep a smaller method: a router's gating projection" in message


class _HalfCall(DictSettings):
    """A callable config object (its __getattr__ raises KeyError for any name it lacks)."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.factor


class _PatchedRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.project(self.lin(h)).tanh()


# Guards against (helper HK), as it was found:
def test_a_kept_method_patched_per_instance_with_a_callable_config_object_keeps_eagers_grads(
        ) -> None:
    # NOTE [kept methods wrap what the instance had]: an instance attribute under the kept
    # name is what eager calls, and is wrapped. _refuse_unkeepable's _compiled(held)
    # (save_units.py:298), then install_kept's getattr(held, "_pytree_ckpt_kept", False)
    # (save_units.py:255), asked the user's object for names it lacks: its KeyError escaped
    # apply_recompute_config.
    def make() -> nn.ModuleList:
        torch.manual_seed(0)
        router = _PatchedRouter()
        router.project = _HalfCall(factor=0.5)  # type: ignore[method-assign]
        return nn.ModuleList([nn.Sequential(router)])

    twin, layers = make(), make()
    apply_recompute_config(layers, RecomputeConfig(1.0, save=[SaveUnit.MOE_GATE]),
                           {SaveUnit.MOE_GATE: KeptCallables("_PatchedRouter.project")})
    x = torch.randn(3, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin[0], layers[0]], x, seed=0))


class _BuiltinActRouter(nn.Module):
    act = torch.tanh  # a builtin as a class attribute: no __get__, so eager calls it unbound

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(h))


# Guards against (helper HK), as it was found:
def test_a_kept_class_attribute_without_get_is_called_unbound_as_eager_calls_it() -> None:
    # _KeptMethod.bound is False only for staticmethod and classmethod, so a kept builtin
    # class attribute (`act = torch.tanh`, called unbound by Python's lookup, as
    # module.py's _class_forward knows for forward) got the module as its first argument:
    # "tanh() takes 1 positional argument but 2 were given" (kept_callables.py:131).
    def make() -> nn.ModuleList:
        torch.manual_seed(0)
        return nn.ModuleList([nn.Sequential(_BuiltinActRouter())])

    twin, layers = make(), make()
    apply_recompute_config(layers, RecomputeConfig(1.0, save=[SaveUnit.MOE_GATE]),
                           {SaveUnit.MOE_GATE: KeptCallables("_BuiltinActRouter.act")})
    x = torch.randn(3, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin[0], layers[0]], x, seed=0))


class _DiscardingProj(nn.Module):
    """A kept method whose body discards its norm's output (LoRA: norms frozen), or
    checkpoints the norm with a boundary of its own."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm = nn.BatchNorm1d(16) if how == "discard a batch norm" else nn.LayerNorm(16)
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "checkpoint":
            return self.lin(pytree_ckpt.checkpoint(self.norm, h))
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        normed = ckpt.checkpoint(self.norm, h)
        out = self.lin(normed)
        ckpt.discard_output_and_register_recompute(out)
        return out


class _DiscardingLayer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj, self.out = _DiscardingProj(how), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(self.proj(h).tanh())


# NOTE [the library's own ops in a kept method's region] (keep.py): the nested discard or
# boundary snapshots the frozen norm's parameters or the batch norm's buffers in the replay
# alone; its copies were taken for the kept method's ops (a ReuseError in backward; helper JJ).
@pytest.mark.filterwarnings("ignore:pytree_ckpt. aten.add_.Tensor mutates")  # the batch norm's count
@pytest.mark.parametrize("how,frozen", [("discard a frozen norm", True),
                                        ("discard a batch norm", False),
                                        ("checkpoint", True)])
def test_a_kept_method_that_discards_or_checkpoints_a_stateful_norm_gets_eager_gradients(
        how: str, frozen: bool) -> None:
    torch.manual_seed(0)
    eager = _DiscardingLayer(how)
    eager.proj.norm.requires_grad_(not frozen)
    kept = copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_DiscardingProj.forward")})
    x = torch.randn(8, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    flops = []
    for model, inp in zip((eager, kept), xs):
        with FlopCounterMode(display=False) as counter:
            model(inp).square().sum().backward()
        flops.append(counter.get_total_flops())
    assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(eager.parameters(), kept.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    for a, b in zip(eager.buffers(), kept.buffers()):
        assert torch.equal(a, b)
    # The kept method's matmul was kept, not run again: the replay adds only the outer
    # Linear's forward, 2 * 8 * 16 * 16 flops.
    assert flops[1] - flops[0] == 2 * 8 * 16 * 16


class _BatchNormProj(nn.Module):
    """A kept method whose body runs a batch norm in train mode (its kernel writes the
    running statistics, though its schema marks no argument as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.back = nn.Linear(16, 24), nn.BatchNorm1d(24), nn.Linear(24, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.back(self.norm(self.lin(h)))


class _BatchNormLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = _BatchNormProj(), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(self.proj(h).tanh())


# Guards against (helper JM), as it was found:
@pytest.mark.filterwarnings("ignore:pytree_ckpt. aten.add_.Tensor mutates")  # the batch norm's count
@pytest.mark.parametrize("target", [KeptCallables("_BatchNormProj.forward"),
                                    KeptOps("aten::native_batch_norm")])
def test_verify_replay_accepts_a_kept_batch_norm_in_train_mode_and_gets_eager_gradients(
        target: Any) -> None:
    # The original pass makes the kept op's argument print after the op ran (keep.py,
    # KeepMode.__torch_dispatch__: arguments_print after func), when native_batch_norm has
    # already moved running_mean and running_var in place; the replay prints them before,
    # as the forward found them (the module's buffers are put back for the replay). Without
    # verify_replay the same layer is exact.
    torch.manual_seed(0)
    eager = _BatchNormLayer()
    kept = copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: target},
                           verify_replay=True)
    x = torch.randn(8, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    for model, inp in zip((eager, kept), xs):
        model(inp).square().sum().backward()  # ReplayMismatchError (tensor argument 4 of 5)
    assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(eager.parameters(), kept.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(eager.buffers(), kept.buffers()):
        assert torch.equal(a, b)


class _VerifiedDiscardProj(nn.Module):
    """A kept method whose body discards its norm's output with verify_replay=True, through a
    CheckpointWithoutOutput or a manager."""

    def __init__(self, manager: bool) -> None:
        super().__init__()
        self.manager = manager
        self.lin, self.norm, self.back = nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = self.lin(h)
        if self.manager:
            manager = pytree_ckpt.CheckpointWithoutOutputManager(verify_replay=True)
            out = self.back(manager.checkpoint(self.norm, p))
            manager.discard_all_outputs_and_register_unified_recompute(out)
            return out
        ckpt = pytree_ckpt.CheckpointWithoutOutput(verify_replay=True)
        out = self.back(ckpt.checkpoint(self.norm, p))
        ckpt.discard_output_and_register_recompute(out)
        return out


class _VerifiedDiscardLayer(nn.Module):
    def __init__(self, manager: bool) -> None:
        super().__init__()
        self.proj, self.out = _VerifiedDiscardProj(manager), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(self.proj(h).tanh())


# NOTE [the library's own ops in a kept method's region] (keep.py): the discard's output
# print (OutputPrints.of in CheckpointWithoutOutput.checkpoint, after DiscardFunction.apply)
# is made in the kept method's region, in the replay alone (the original pass's discard is
# a pass-through): its aten.zeros was taken for the method's op.
# Guards against (helper JM), as it was found:
@pytest.mark.parametrize("manager", [False, True])
def test_a_kept_method_that_discards_with_verify_replay_gets_eager_gradients(
        manager: bool) -> None:
    torch.manual_seed(0)
    eager = _VerifiedDiscardLayer(manager)
    kept = copy.deepcopy(eager)
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_VerifiedDiscardProj.forward")})
    x = torch.randn(8, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    flops = []
    for model, inp in zip((eager, kept), xs):
        with FlopCounterMode(display=False) as counter:
            model(inp).square().sum().backward()  # ReuseError: kept output #1 of aten.zeros
        flops.append(counter.get_total_flops())
    assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(eager.parameters(), kept.parameters()):
        assert torch.equal(p.grad, q.grad)
    # The kept method's matmuls were kept: the replay adds only the outer Linear's forward.
    assert flops[1] - flops[0] == 2 * 8 * 16 * 16


def test_apply_recompute_config_logs_at_info_what_each_selected_unit_keeps(
        caplog: pytest.LogCaptureFixture) -> None:
    # Issue 6: "An info log says what each selection keeps" (helper JR: no test read the log).
    with caplog.at_level("INFO", logger="pytree_ckpt.save_units"):
        apply_recompute_config([Block(), Block()], RecomputeConfig(1.0, save=True), TARGETS)
    infos = [r.getMessage() for r in caplog.records
             if r.name == "pytree_ckpt.save_units" and r.levelname == "INFO"]
    assert len(infos) == 2, infos
    ops_line, = (m for m in infos if m.startswith("save unit attn"))
    assert "aten.mm" in ops_line and "nonexistent_ns" not in ops_line  # resolved ops only
    callables_line, = (m for m in infos if m.startswith("save unit moe_gate"))
    assert "Gate.project" in callables_line
    caplog.clear()
    with caplog.at_level("INFO", logger="pytree_ckpt.save_units"):  # nothing selected: no log
        apply_recompute_config([Block()], RecomputeConfig(1.0, save=None), TARGETS)
    assert not [r for r in caplog.records if r.name == "pytree_ckpt.save_units"]


class _JTAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h).tanh()


class _JTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _JTAttn()
        self.mlp = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.attn(h))


# Guards against (helper JT), as it was found: the tip said "a lower ratio", refused again.
def test_the_tip_for_a_unit_keeping_the_layers_own_forward_names_a_fix_that_works() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(_JTBlock() for _ in range(2))
    eager = copy.deepcopy(layers)
    with pytest.raises(CheckpointConfigError, match="checkpointed layer 0") as refused:
        pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                                           {"attn": KeptCallables("_JTBlock.forward")})
    tip = str(refused.value).split("tip:")[1]
    assert 'KeptCallables("_JTAttn.forward")' in tip
    # Followed: the submodule's method is kept, and the gradients are eager's.
    pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                                       {"attn": KeptCallables("_JTAttn.forward")})
    x = torch.randn(3, 4)
    for model in (eager, layers):
        h = x
        for layer in model:
            h = layer(h)
        h.square().sum().backward()
    for p, q in zip(eager.parameters(), layers.parameters()):
        assert torch.equal(p.grad, q.grad)


# Guards against (helper JT), as it was found:
def test_the_tip_for_a_changed_output_kept_by_a_method_unit_names_the_method_not_an_op() -> None:
    layers = nn.ModuleList([_JTBlockReturningKept()])
    pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                                       {"attn": KeptCallables("_JTProjecting.project")})
    out = layers[0](torch.randn(3, 4))
    out += 1
    with pytest.raises(CheckpointError) as refused:
        out.relu().sum().backward()
    tip = str(refused.value).split("tip:")[1]
    # The unit holds no op to drop: the tip should name what the user can change.
    assert "drop aten.addmm.default" not in tip and \
        "keep another method than _JTProjecting.project" in tip


class _JTProjecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h)


class _JTBlockReturningKept(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _JTProjecting()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn.project(h)


class _JYExpertsFirst(nn.Module):
    """A block whose first submodule is a ModuleList (no forward of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return h + sum(e(h) for e in self.experts)


# Guards against (helper JY), as it was found:
def test_the_tip_for_a_unit_keeping_the_layers_own_forward_names_a_method_that_runs() -> None:
    layers = nn.ModuleList(_JYExpertsFirst() for _ in range(2))
    with pytest.raises(CheckpointConfigError, match="checkpointed layer 0") as refused:
        pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["moe_gate"]),
                                           {"moe_gate": KeptCallables("_JYExpertsFirst.forward")})
    tip = str(refused.value).split("tip:")[1]
    # A container's forward is nn.Module's unimplemented one: never called, nothing kept.
    named = re.search(r'KeptCallables\("(\w+)\.forward"\)', tip)
    assert named is not None, tip
    classes = {type(m).__qualname__: type(m) for m in layers[0].modules()}
    assert classes[named.group(1)].forward is not nn.Module.forward, tip


# Helper NE (an adversarial review of b92ebea's keep.py change: a kept output with no elements
# whose version moved is not refused): empty views of a non-empty kept result, an empty kept
# output beside a non-empty one of the same op, and stashed kept outputs.
class _EmptyAndFull(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.w = mode, nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.mm(x, self.w)
        if self.mode == "slice":  # an empty slice of the output (no columns)
            return h.tanh(), h[:, :0]
        if self.mode == "as_strided":
            return h.tanh(), h.as_strided((0, 8), (8, 1), 8)
        if self.mode == "stashed":
            self.empty, self.full = torch.mm(x[:0], self.w), h
            return (h.tanh(),)
        return h.tanh(), torch.mm(x[:0], self.w), h  # an empty product, then a full one


def _empty_and_full_grads(mode: str, change: Any) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    eager = _EmptyAndFull(mode)
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    x = torch.randn(3, 8, requires_grad=True)
    grads = []
    for model in (eager, layer):
        outs = model(x)
        with torch.no_grad():
            change(model, outs)
        outs[0].square().sum().backward()
        grads.append(grads_of([x, *model.parameters()]))
        x.grad = None
    return grads


@pytest.mark.parametrize("mode", ["slice", "as_strided"])
@pytest.mark.xfail(strict=True, raises=CheckpointError, reason="documented limit "
                   "(docs/limits.md, Inputs and outputs: an output sharing a kept op's result "
                   "changed in place by the caller; save_units.md rule 4) (helper NE)")
def test_an_empty_view_of_a_kept_output_changed_in_place_gives_eager_gradients(mode: str) -> None:
    # b92ebea skips the kept record's check where the kept tensor has no elements; here the
    # kept product has elements and the output viewing it has none: `out += r` changes no
    # element, but moves the shared version counter, and on_kept_storages (made_before.py)
    # and the record's own check (keep.py) read only the counter.
    def change(model: nn.Module, outs: Any) -> None:
        outs[1].add_(1.0)

    assert_same_grads(*_empty_and_full_grads(mode, change))


def test_an_empty_kept_output_beside_a_full_one_of_the_same_op_changed_gives_eager_gradients(
        ) -> None:
    def change(model: nn.Module, outs: Any) -> None:
        outs[1].add_(1.0)  # the empty product's

    assert_same_grads(*_empty_and_full_grads("empty, then full", change))


def test_a_full_kept_output_beside_an_empty_one_changed_in_place_is_still_refused() -> None:
    def change(model: nn.Module, outs: Any) -> None:
        outs[1].add_(1.0)
        outs[2].add_(1.0)

    with pytest.raises(CheckpointError, match=r"output\[2\] of _EmptyAndFull shares its memory "
                       r"with the result of aten.mm.default that a save unit keeps"):
        _empty_and_full_grads("empty, then full", change)


def test_a_stashed_empty_kept_output_changed_passes_and_a_stashed_full_one_is_refused() -> None:
    def empty(model: nn.Module, outs: Any) -> None:
        model.empty.add_(1.0)

    assert_same_grads(*_empty_and_full_grads("stashed", empty))

    def both(model: nn.Module, outs: Any) -> None:
        model.empty.add_(1.0)
        model.full.add_(1.0)

    with pytest.raises(CheckpointError, match=r"an output of aten.mm.default kept by a save unit "
                       r"was mutated between the original pass and the replay \(Tensor cached "
                       r"during selective activation checkpoint has been mutated\)"):
        _empty_and_full_grads("stashed", both)


def test_an_empty_kept_output_resized_and_filled_by_the_caller_gives_eager_gradients() -> None:
    # Helper NE: b92ebea reads the kept tensor's elements at the replay; the caller's resize of
    # the output (through a detached alias: one requiring grad cannot be resized) grows the
    # shared storage and moves the counter, but the record's own tensor keeps its no elements.
    def use(out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        alias = out.detach()
        alias.resize_(2, 3, 8)
        alias.fill_(1.0)
        return out.tanh().sum() + alias.sum(), [alias.clone()]

    _empty_batch_through_a_kept_linear_gives_eager_gradients(use)


class _MatmulOf3D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w)  # the kept mm's product, through aten._unsafe_view


@pytest.mark.parametrize("how", ["in place", "out of place", "on a clone"])
def test_a_residual_added_to_an_output_sharing_a_kept_product_follows_rule_4(how: str) -> None:
    # save_units.md rule 4 and limits.md's Inputs and outputs row: `out += residual` on such an
    # output is refused at the replay naming the output and the op; the tips (add out of place,
    # or change a clone) give eager's gradients bit for bit (helper NG).
    torch.manual_seed(0)
    eager = _MatmulOf3D()
    layer = copy.deepcopy(eager)
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")})
    x = torch.randn(2, 3, 8, requires_grad=True)
    residual = torch.randn(2, 3, 8)
    grads = []
    for model in (eager, layer):
        out = model(x)
        if how == "in place":
            out += residual
        elif how == "out of place":
            out = out + residual
        else:
            out = out.clone()
            out += residual
        loss = out.tanh().square().sum()
        if how == "in place" and model is layer:
            with pytest.raises(CheckpointError, match=r"(?s)output of _MatmulOf3D shares its "
                               r"memory with the result of aten\.mm.*changed in place"):
                loss.backward()
            return
        loss.backward()
        grads.append(grads_of([x, *model.parameters()]))
        x.grad = None
    assert_same_grads(*grads)


@pytest.mark.parametrize("given", ["op", "name", "context_fn"])
def test_torchs_selective_op_list_given_as_save_is_refused_naming_kept_ops(given: str) -> None:
    # docs/boundary.md: torch's context_fn= (selective checkpointing) is RecomputeConfig(
    # save=[...]). Moved over as it reads, the op list (or the context_fn itself) lands in
    # save; the refusal's tip speaks of SaveUnit names and Megatron's recompute_modules, or says
    # "wrap a single unit in a list: save=['attn']", never KeptOps or the target map.
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    ops = [torch.ops.aten.mm.default]
    save: Any = (ops if given == "op" else ["aten::mm"] if given == "name"
                 else functools.partial(create_selective_checkpoint_contexts, ops))
    with pytest.raises(CheckpointConfigError, match="KeptOps"):
        RecomputeConfig(1.0, save=save)


def test_kept_ops_recompute_in_backward_what_torchs_selective_checkpoint_recomputes() -> None:
    # torchtitan's op SAC (create_selective_checkpoint_contexts over an op list, or a policy
    # function saving those ops) moved to KeptOps as docs/boundary.md says: backward runs the
    # ops torch's SAC runs (no mm recomputed, tanh recomputed), with eager's gradients.
    import functools

    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.tanh(self.up(h)))

    torch.manual_seed(0)
    eager = nn.ModuleList(Mlp() for _ in range(2))
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config(
        ours, RecomputeConfig(1.0, save=["attn"]),
        {SaveUnit.ATTN: KeptOps("aten::mm.default")}, offload=False)
    x = torch.randn(3, 5, 8, requires_grad=True)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def backward(layers: nn.ModuleList, call: Any) -> tuple[Any, list[torch.Tensor]]:
        h = x
        for layer in layers:
            h = call(layer, h)
        with Count() as count:
            got = torch.autograd.grad(h.sum(), [x, *layers.parameters()])
        return count.seen, list(got)

    seen_eager, expected = backward(eager, lambda layer, h: layer(h))
    for context in ([torch.ops.aten.mm.default], policy):
        seen_torch, _ = backward(eager, lambda layer, h: checkpoint(
            layer, h, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, context)))
        assert seen_torch["mm"] == seen_eager["mm"] and seen_torch["tanh"] == 2
    seen_ours, got = backward(ours, lambda layer, h: layer(h))
    assert seen_ours["mm"] == seen_eager["mm"] and seen_ours["tanh"] == 2
    assert_same_grads(expected, got)


# helper QN: make_fx (c4202d1's docs: "make_fx of a whole training step ... traces through the
# boundary, replay included, with eager's numbers") in its three tracing modes, the step's
# parameters given as inputs (fake and symbolic tracing need them so).
class _QnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def _qn_traced_step(model: nn.Module, mode: str, x: torch.Tensor,
                    params: list[torch.Tensor]) -> list[torch.Tensor]:
    from torch.fx.experimental.proxy_tensor import make_fx
    names = [n for n, _ in model.named_parameters()]

    def step(x: torch.Tensor, *ps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ps = tuple(p.detach().requires_grad_() for p in ps)
        loss = torch.func.functional_call(model, dict(zip(names, ps)), (x * 1.0,)).sum()
        return (loss, *torch.autograd.grad(loss, [x, *ps]))

    return list(make_fx(step, tracing_mode=mode)(x, *params)(x, *params))


def _qn_make_fx_matches(mode: str, build: Any) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_QnBlock(), _QnBlock())
    ours = copy.deepcopy(eager)
    build(ours)
    x = torch.randn(4, 8, requires_grad=True)
    params = [p.detach() for p in eager.parameters()]
    expected = _qn_traced_step(eager, mode, x, params)
    got = _qn_traced_step(ours, mode, x, params)
    assert len(expected) == len(got)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def _qn_kept(model: nn.Module) -> None:
    apply_recompute_config(list(model), RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::tanh")})


def _qn_nested_offloaded(model: nn.Module) -> None:
    for layer in model:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=offload.OffloadManager(
            offload.OffloadConfig(min_bytes=0), device="cpu"))
    pytree_ckpt.apply_activation_checkpointing(model, offload=False)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("build", [_qn_nested_offloaded], ids=["nested boundaries, offload"])
def test_make_fx_of_a_step_through_nested_offloaded_boundaries_traces_eagers_numbers(
        mode: str, build: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nesting's own warning
        _qn_make_fx_matches(mode, build)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_make_fx_of_a_step_through_save_units_traces_eagers_numbers(mode: str) -> None:
    _qn_make_fx_matches(mode, _qn_kept)


def test_symbolic_make_fx_of_a_step_through_save_units_traces_eagers_numbers() -> None:
    _qn_make_fx_matches("symbolic", _qn_kept)


# helper QQ: make_fx through save units whose kept method discards an output inside it
# (3a11623's _emptied answers False under make_fx: no discard frees a storage there).
class _QqDiscardingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        normed = ckpt.checkpoint(self.norm, x)
        out = self.a(normed)
        ckpt.discard_output_and_register_recompute(out)
        return torch.tanh(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.attend(x))


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_make_fx_of_a_step_through_a_kept_method_with_an_output_discard_traces_eagers_numbers(
        mode: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_QqDiscardingBlock(), _QqDiscardingBlock())
    ours = copy.deepcopy(eager)
    apply_recompute_config(list(ours), RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_QqDiscardingBlock.attend")})
    x = torch.randn(4, 8, requires_grad=True)
    params = [p.detach() for p in eager.parameters()]
    expected = _qn_traced_step(eager, mode, x, params)
    got = _qn_traced_step(ours, mode, x, params)
    assert len(expected) == len(got)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # and the untraced step (the discard frees for real) gives eager's numbers too
    h = x
    for m in (eager, ours):
        m.zero_grad()
        m(h).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), ours.parameters()))


# -- helper QV: error quality of the config readers --------------------------------------------

@pytest.mark.parametrize("parsed", [{"ratio": 0.5, "save": ["attn"]}, None])
def test_recompute_config_from_json_of_a_parsed_config_is_refused_naming_the_fix(parsed):
    # A training config read from YAML/JSON already holds the dict; a missing key gives None.
    with pytest.raises(CheckpointConfigError, match="RecomputeConfig"):
        RecomputeConfig.from_json(parsed)


def test_recompute_config_readers_refuse_bad_values_in_the_library_family():
    for make in (lambda: RecomputeConfig.from_json('{"ratio": "0.5"}'),
                 lambda: RecomputeConfig.from_json('{"ratio": 0.5, "save": [null]}'),
                 lambda: RecomputeConfig(0.5, save={"attn"}),
                 lambda: RecomputeConfig(0.5, save=[["attn"]])):
        with pytest.raises(CheckpointConfigError, match="expected"):
            make()


def test_from_json_of_bytes_that_are_not_utf8_is_refused_as_a_config_error() -> None:
    text = '{"ratio": 0.5, "save": ["caf\u00e9"]}'.encode("latin-1")
    with pytest.raises(CheckpointConfigError, match="RecomputeConfig"):
        RecomputeConfig.from_json(text)


def test_from_json_reads_bytes_and_its_refusal_of_a_path_or_file_has_a_tip_that_runs(
        tmp_path: Any) -> None:
    config = RecomputeConfig(0.5)
    path = tmp_path / "recompute.json"
    path.write_text(config.to_json())
    assert RecomputeConfig.from_json(path.read_bytes()) == config
    assert RecomputeConfig.from_json(bytearray(path.read_bytes())) == config
    for wrong in (path, None):
        with pytest.raises(CheckpointConfigError, match=r"path\.read_text\(\)"):
            RecomputeConfig.from_json(wrong)  # type: ignore[arg-type]
    assert RecomputeConfig.from_json(path.read_text()) == config  # the tip, literally
    with open(path) as file:
        with pytest.raises(CheckpointConfigError,
                           match=r"RecomputeConfig\.from_json\(json\.dumps\(data\)\)"):
            RecomputeConfig.from_json(file)  # type: ignore[arg-type]
        file.seek(0)
        import json
        data = json.load(file)
        assert RecomputeConfig.from_json(json.dumps(data)) == config  # the tip, literally
    with pytest.raises(CheckpointConfigError, match="must be an object"):
        RecomputeConfig.from_json("null")


# Helper RM: f990200 made RecomputeConfig's __init__ explicit (init=False); checked against
# 253654c.

def test_a_dataclass_subclass_of_recompute_config_keeps_its_defaults_and_validation() -> None:
    import dataclasses

    assert [f.default for f in dataclasses.fields(RecomputeConfig)] == [1.0, None]

    @dataclasses.dataclass(frozen=True)
    class Tagged(RecomputeConfig):
        tag: str = "run"

    assert Tagged() == Tagged(1.0, save=None)
    assert Tagged(0.5, save=["attn"]).save == (SaveUnit.ATTN,)
    assert Tagged.from_json('{"ratio": 0.5, "save": ["attn"]}').save == (SaveUnit.ATTN,)
    with pytest.raises(CheckpointConfigError, match="ratio must be a number"):
        Tagged(2.0)


def test_recompute_config_replace_pickle_copy_asdict_hash_and_json_as_at_253654c() -> None:
    import dataclasses
    import pickle

    cfg = RecomputeConfig(0.5, save=["attn", "attn", SaveUnit.MOE_GATE])
    assert cfg.save == (SaveUnit.ATTN, SaveUnit.MOE_GATE)
    assert repr(cfg) == ("RecomputeConfig(ratio=0.5, save=(<SaveUnit.ATTN: 'attn'>, "
                         "<SaveUnit.MOE_GATE: 'moe_gate'>))")
    assert dataclasses.replace(cfg, save=["attn"]).save == (SaveUnit.ATTN,)
    with pytest.raises(CheckpointConfigError, match="ratio must be a number"):
        dataclasses.replace(cfg, ratio=2.0)
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    assert hash(cfg) == hash(RecomputeConfig(0.5, save=("attn", "moe_gate")))
    assert dataclasses.asdict(cfg) == {"ratio": 0.5, "save": (SaveUnit.ATTN, SaveUnit.MOE_GATE)}
    assert RecomputeConfig.from_json("{}") == RecomputeConfig()
    assert RecomputeConfig(ratio=0.25) == RecomputeConfig(0.25, save=None)
    with pytest.raises(TypeError):
        RecomputeConfig(1.0, ["attn"])  # type: ignore[misc]
    with pytest.raises(CheckpointConfigError, match="wrap a single unit in a list"):
        RecomputeConfig(save="attn")  # type: ignore[arg-type]


def test_recompute_config_dataclass_subclasses_validate_as_at_253654c() -> None:
    # Helper RO: 76d1ff0's explicit __init__ beside the fields' defaults and __post_init__.
    import dataclasses
    import inspect

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Tagged(RecomputeConfig):
        tag: str

    @dataclasses.dataclass(frozen=True)
    class Half(RecomputeConfig):
        ratio: float = 0.5

    @dataclasses.dataclass(frozen=True)
    class Checked(RecomputeConfig):
        extra: int = 0

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.extra < 0:
                raise ValueError("extra")

    assert Tagged(0.5, tag="x", save=["attn"]).save == (SaveUnit.ATTN,)
    assert Half() == Half(0.5) and Half(save=["attn"]).save == (SaveUnit.ATTN,)
    assert Checked(0.25, 1, save=["attn"]).save == (SaveUnit.ATTN,)
    for bad in (lambda: Tagged(3.0, tag="x"), lambda: Half(7.0), lambda: Checked(9.0),
                lambda: Checked(save="attn")):
        with pytest.raises(CheckpointConfigError):
            bad()
    with pytest.raises(ValueError, match="extra"):
        Checked(extra=-1)
    made = dataclasses.make_dataclass("Made", [("k", int, dataclasses.field(default=1))],
                                      bases=(RecomputeConfig,), frozen=True)
    assert made(0.5, 2, save=["attn"]).save == (SaveUnit.ATTN,)
    assert RecomputeConfig.__match_args__ == ("ratio",)
    assert str(inspect.signature(RecomputeConfig)).replace("'", "") == (
        "(ratio: float = 1.0, *, save: Sequence[SaveUnit | str] | bool | None = None) -> None")
    with pytest.raises(TypeError):
        RecomputeConfig(0.5, ["attn"])  # type: ignore[misc]
