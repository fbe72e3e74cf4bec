"""Output-discard behaviours that a mutation audit of pytree_ckpt/discard.py (since split into
discard*.py) found unguarded.

Each test compares against an unwrapped eager twin with exact equality in fp32, counts calls,
or measures bytes.
"""

from __future__ import annotations

import copy
import gc
import re
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import (CheckpointConfigError, CheckpointError, CheckpointWithoutOutput,
                         CheckpointWithoutOutputManager, ReplayMismatchError,
                         build_residual_stream_recompute_plan)
from tests.conftest import assert_same_grads, grads_of
from tests.pytree_ckpt.models import RmsNorm as _Norm


def _nbytes(*tensors: torch.Tensor) -> list[int]:
    """Bytes of each tensor's storage (a freed tensor must never reach an assertion's repr)."""
    return [t.untyped_storage().nbytes() for t in tensors]


def _discarded(fn: Any, *args: Any) -> tuple[CheckpointWithoutOutput, Any]:
    ckpt = CheckpointWithoutOutput()
    return ckpt, ckpt.checkpoint(fn, *args)


def test_a_discarded_dropout_replays_the_mask_of_its_forward_after_the_rng_moved_on() -> None:
    # The rebuild must restore the RNG state of the forward, not draw a fresh mask.
    torch.manual_seed(0)
    drop, proj = nn.Dropout(0.5), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    proj(drop(x)).square().sum().backward()
    expected = grads_of([x, *proj.parameters()])
    x.grad = None
    proj.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ckpt, dropped = _discarded(drop, x)
    out = proj(dropped)
    ckpt.discard_output_and_register_recompute(out)
    torch.rand(16)  # the RNG moves on before backward, as the rest of a model makes it
    out.square().sum().backward()
    assert_same_grads(expected, grads_of([x, *proj.parameters()]))


def _own_dropout(x: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    return x * (torch.rand(x.shape, generator=generator) > 0.5) * 2


@pytest.mark.parametrize("as_keyword", [True, False], ids=["keyword", "positional"])
def test_a_discarded_op_given_its_own_generator_replays_its_mask_and_leaves_it_as_eager(
        as_keyword: bool) -> None:
    # Guards against: NOTE [generators passed in] (rng.py) was applied at the boundary only;
    # the rebuild drew the next numbers of a generator passed to the discarded op: another
    # mask, other gradients, silently, and the generator ended the step two draws on.
    results = []
    for discard in (False, True):
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        fn = _own_dropout if as_keyword else \
            (lambda t, g: _own_dropout(t, generator=g))  # noqa: E731
        if discard:
            ckpt = CheckpointWithoutOutput()
            h = ckpt.checkpoint(fn, x, generator=generator) if as_keyword else \
                ckpt.checkpoint(fn, x, generator)
            out = h @ w
            ckpt.discard_output_and_register_recompute(out)
        else:
            out = (fn(x, generator=generator) if as_keyword else fn(x, generator)) @ w
        out.square().sum().backward()
        results.append([*grads_of([x, w]), torch.rand(8, generator=generator)])
    assert_same_grads(*results)


def test_an_output_that_is_an_offset_slice_of_its_input_is_kept() -> None:
    # The slice starts 16 bytes into its input's storage: the storage, not the data pointer,
    # tells that they share memory.
    x = torch.randn(6, requires_grad=True)
    h = x * 1.0
    ckpt, tail = _discarded(lambda t: t[2:], h)
    y = tail * 2
    ckpt.discard_output_and_register_recompute(y)
    nbytes = _nbytes(h)
    assert nbytes == [6 * 4]  # the input was not freed
    before = h.detach().clone()
    (y.sum() + h.sum()).backward()
    assert torch.equal(h, before)
    assert torch.equal(x.grad, torch.tensor([1.0, 1.0, 3.0, 3.0, 3.0, 3.0]))


def test_a_view_of_a_table_in_a_list_a_lambda_closes_over_is_kept() -> None:
    tables = [torch.randn(16, 8)]
    before = tables[0].clone()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt, rows = _discarded(lambda t: tables[0][: t.shape[0]], x)
    out = (x * rows).sum()
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(tables[0])
    assert nbytes == [16 * 8 * 4]
    out.backward()
    assert torch.equal(tables[0], before) and torch.equal(x.grad, before[:4])


class _DetachedRows(nn.Module):
    """Returns detached rows of its own parameter (frozen or not): the same storage, but no
    ``_base`` leading back to the Parameter."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8), requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[: x.shape[0]].detach()


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_detached_rows_of_a_module_parameter_are_kept(trainable: bool) -> None:
    rows_of = _DetachedRows(trainable)
    before = rows_of.table.detach().clone()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt, rows = _discarded(rows_of, x)
    out = (x * rows).sum()
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(rows_of.table)
    assert nbytes == [16 * 8 * 4]
    out.backward()
    assert torch.equal(rows_of.table.detach(), before) and torch.equal(x.grad, before[:4])


def test_a_slice_of_a_parameter_reached_through_a_plain_object_is_kept() -> None:
    # The search cannot see an attribute of a plain object, but a view of a Parameter is always
    # kept: freeing it would destroy the parameter.
    class Holder:
        pass

    holder = Holder()
    holder.table = nn.Parameter(torch.randn(16, 8), requires_grad=False)
    before = holder.table.detach().clone()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt, rows = _discarded(lambda t: holder.table[: t.shape[0]], x)
    out = (x * rows).sum()
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(holder.table)
    assert nbytes == [16 * 8 * 4]
    out.backward()
    assert torch.equal(holder.table.detach(), before) and torch.equal(x.grad, before[:4])


def test_a_callable_closing_over_a_parameter_gives_eager_gradients() -> None:
    # Not a module: its parameter is unknown, so the replay backpropagates into .grad
    # (reentrant-style) and returns its inputs' gradients from the detached replay inputs.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8))
    proj = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t * w)

    proj(scaled(x)).square().sum().backward()
    expected = grads_of([x, w, *proj.parameters()])
    for t in (x, w, *proj.parameters()):
        t.grad = None
    ckpt, h = _discarded(scaled, x)
    assert ckpt.params is None  # the unknown-callable path
    out = proj(h)
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(h)
    assert nbytes == [0]
    out.square().sum().backward()
    assert_same_grads(expected, grads_of([x, w, *proj.parameters()]))


def test_a_callable_with_unknown_parameters_under_autograd_grad_is_refused() -> None:
    # torch.autograd.grad cannot deliver the replay's parameter gradients: refused, not silent.
    w = nn.Parameter(torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    ckpt, h = _discarded(lambda t: torch.tanh(t * w), x)
    out = (h * 3).sum()
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(CheckpointError, match="reached by a restricted backward"):
        torch.autograd.grad(out, x)
    assert w.grad is None


def test_a_gradient_hook_on_a_discarded_modules_parameter_runs_once() -> None:
    calls: list[int] = []

    def doubled(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad * 2

    torch.manual_seed(0)
    norm, proj = _Norm(), nn.Linear(8, 8)
    twin = copy.deepcopy(norm)
    norm.weight.register_hook(doubled)
    twin.weight.register_hook(doubled)
    x = torch.randn(4, 8, requires_grad=True)
    proj(norm(x)).square().sum().backward()
    assert len(calls) == 1
    expected = norm.weight.grad.clone()
    ckpt, h = _discarded(twin, x)
    out = proj(h)
    ckpt.discard_output_and_register_recompute(out)
    out.square().sum().backward()
    assert len(calls) == 2  # once more, not twice more
    assert torch.equal(twin.weight.grad, expected)


def test_a_discarded_modules_parameter_it_did_not_use_gets_no_hook_call_as_in_eager() -> None:
    # Guards against: the rebuild's backward returned None for a parameter fn did not use (a
    # gate the call skips), and autograd then ran its post-accumulate-grad hook (an optimizer
    # step in backward) after accumulating nothing, where eager, with no edge to it, runs none.
    class SkipsItsGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.rand(8) + 0.5)
            self.gate = nn.Parameter(torch.ones(8))  # unused by this call

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x) * self.scale

    def run(discard: bool) -> tuple[list[str], list[torch.Tensor | None]]:
        calls: list[str] = []
        torch.manual_seed(0)
        op, proj = SkipsItsGate(), nn.Linear(8, 8)
        op.gate.register_hook(lambda g: calls.append("hook") or g * 2)
        op.gate.register_post_accumulate_grad_hook(lambda t: calls.append("accumulated"))
        x = torch.randn(4, 8, requires_grad=True)
        if discard:
            ckpt = CheckpointWithoutOutput()
            out = proj(ckpt.checkpoint(op, x))
            ckpt.discard_output_and_register_recompute(out)
        else:
            out = proj(op(x))
        out.square().sum().backward()
        return calls, grads_of([x, *op.parameters(), *proj.parameters()])

    (eager_calls, eager), (calls, got) = run(False), run(True)
    assert calls == eager_calls == []
    assert_same_grads(eager, got)


def test_a_trainable_norm_on_an_input_that_needs_no_grad_still_frees_its_output() -> None:
    # The first layer after a frozen embedding: only the norm's own weight needs a gradient,
    # which is enough for a node to rebuild from.
    torch.manual_seed(0)
    norm, proj = _Norm(), nn.Linear(8, 8)
    twin = copy.deepcopy(norm)
    x = torch.randn(4, 8)
    proj(norm(x)).square().sum().backward()
    expected = grads_of([*norm.parameters(), *proj.parameters()])
    proj.zero_grad(set_to_none=True)
    ckpt, h = _discarded(twin, x)
    out = proj(h)
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(h)
    assert nbytes == [0]
    out.square().sum().backward()
    nbytes = _nbytes(h)
    assert nbytes == [4 * 8 * 4]
    assert_same_grads(expected, grads_of([*twin.parameters(), *proj.parameters()]))


def test_a_checkpoint_object_used_twice_is_refused() -> None:
    x = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    ckpt.checkpoint(torch.tanh, x)
    with pytest.raises(CheckpointError, match="already used"):
        ckpt.checkpoint(torch.sigmoid, x)


def _split_alias(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs: a view of the input (kept) and a fresh result (freed)."""
    return t[:2], torch.tanh(t)


def test_an_op_with_a_kept_and_a_freed_output_returns_both_and_rebuilds_each_in_its_place() -> None:
    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    a, b = _split_alias(h)
    (proj(a).sum() + proj(b).square().sum()).backward()
    expected = grads_of([x, *proj.parameters()])
    x.grad = None
    proj.zero_grad(set_to_none=True)
    h = x * 1.0
    ckpt, outs = _discarded(_split_alias, h)
    assert isinstance(outs, tuple) and len(outs) == 2
    a, b = outs
    out = proj(a).sum() + proj(b).square().sum()
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(h, b)
    assert nbytes == [4 * 8 * 4, 0]
    out.backward()
    nbytes = _nbytes(h, b)
    assert nbytes == [4 * 8 * 4, 4 * 8 * 4]
    assert torch.equal(b, torch.tanh(h))
    assert_same_grads(expected, grads_of([x, *proj.parameters()]))


def test_an_output_that_is_a_view_of_the_ops_own_result_is_freed_and_rebuilt_whole() -> None:
    # The view covers half of its storage: the whole storage is freed and refilled.
    torch.manual_seed(0)
    proj = nn.Linear(4, 4)
    x = torch.randn(4, 8, requires_grad=True)

    def left_half(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t)[:, :4]

    proj(left_half(x)).square().sum().backward()
    expected = grads_of([x, *proj.parameters()])
    x.grad = None
    proj.zero_grad(set_to_none=True)
    ckpt, half = _discarded(left_half, x)
    out = proj(half)
    ckpt.discard_output_and_register_recompute(out)
    nbytes = _nbytes(half)
    assert nbytes == [0]
    out.square().sum().backward()
    nbytes = _nbytes(half)
    assert nbytes == [4 * 8 * 4]
    assert torch.equal(half, left_half(x.detach()))
    assert_same_grads(expected, grads_of([x, *proj.parameters()]))


@pytest.mark.parametrize("change", ["count", "dtype"])
def test_a_replay_with_another_number_of_outputs_or_dtype_raises(change: str) -> None:
    x = torch.randn(4, requires_grad=True)
    calls: list[int] = []

    def unstable(t: torch.Tensor) -> Any:
        calls.append(1)
        if len(calls) == 1:
            return torch.tanh(t).half(), torch.sigmoid(t).half()
        if change == "count":
            return (torch.tanh(t).half(),)
        return torch.tanh(t).bfloat16(), torch.sigmoid(t).bfloat16()  # same bytes, other bits

    ckpt, (a, b) = _discarded(unstable, x)
    y = a.float() * b.float()
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(ReplayMismatchError, match="another (number of outputs|shape or dtype)"):
        y.sum().backward()


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_replay_of_another_shape_or_dtype_raises_when_the_output_was_never_discarded(
        change: str) -> None:
    # The backward replays a checkpoint never discarded too; the check read the bytes freed
    # per output, which only a discard records: another shape gave torch's "Mismatch in
    # shape", another dtype went through unnoticed (float64 gradients cast to float32).
    x = torch.randn(4, requires_grad=True)
    calls: list[int] = []

    def unstable(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            return torch.tanh(t)
        return torch.tanh(t)[:2] if change == "shape" else torch.tanh(t.double())

    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(unstable, x) * 2
    with pytest.raises(ReplayMismatchError, match="another shape or dtype at output\\[0\\]"):
        y.sum().backward()
    assert len(calls) == 2


def test_a_discard_whose_graph_is_dropped_frees_its_checkpoint_without_the_garbage_collector(
        ) -> None:
    # The checkpoint keeps detached aliases of its outputs: no reference cycle through the
    # autograd node back to it, so dropping the graph frees it at once.
    norm, proj = _Norm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    gc.disable()
    try:
        ckpt, h = _discarded(norm, x)
        out = proj(h)
        ckpt.discard_output_and_register_recompute(out)
        alive = weakref.ref(ckpt)
        del ckpt, h, out
        assert alive() is None
    finally:
        gc.enable()


def test_a_checkpoint_that_ran_without_grad_still_refuses_a_second_discard() -> None:
    x = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    with torch.no_grad():
        h = ckpt.checkpoint(torch.tanh, x)
    ckpt.discard_output_and_register_recompute(h)  # a no-op: nothing was saved
    with pytest.raises(CheckpointError, match="already discarded"):
        ckpt.discard_output_and_register_recompute(h)


def _chain(n: int, x: torch.Tensor) -> tuple[CheckpointWithoutOutputManager, list[torch.Tensor]]:
    manager = CheckpointWithoutOutputManager()
    outs, h = [], x
    for _ in range(n):
        h = manager.checkpoint(torch.tanh, h)
        outs.append(h)
    return manager, outs


def test_a_manager_refuses_a_hook_tensor_that_needs_no_grad_before_freeing_anything() -> None:
    manager, outs = _chain(2, torch.randn(4, requires_grad=True))
    with pytest.raises(CheckpointConfigError, match="must be a tensor that requires grad"):
        manager.discard_all_outputs_and_register_unified_recompute((outs[-1] * 2).detach())
    nbytes = _nbytes(*outs)
    assert nbytes == [4 * 4, 4 * 4]


def test_a_manager_refuses_one_of_its_discarded_outputs_as_the_hook_tensor() -> None:
    manager, outs = _chain(2, torch.randn(4, requires_grad=True))
    with pytest.raises(CheckpointError, match="the hook tensor is an output of"):
        manager.discard_all_outputs_and_register_unified_recompute(outs[-1])
    nbytes = _nbytes(*outs)
    assert nbytes == [4 * 4, 4 * 4]


def test_a_managers_second_discard_is_refused_and_backward_stays_exact() -> None:
    # The first discard frees both outputs and registers one rebuild; a second one is refused
    # (it would register the rebuild twice), and backward gives the plain chain's gradient.
    x = torch.randn(4, requires_grad=True)
    manager, outs = _chain(2, x)
    y = outs[-1] * 2
    manager.discard_all_outputs_and_register_unified_recompute(y)
    with pytest.raises(CheckpointError) as refused:
        manager.discard_all_outputs_and_register_unified_recompute(y)
    assert str(refused.value).splitlines() == [
        "this manager's outputs were already discarded", "  expected: one discard per manager",
        "  got:      a second discard", "  tip: use one manager per block and forward"]
    y.sum().backward()
    plain = x.detach().requires_grad_()
    (torch.tanh(torch.tanh(plain)) * 2).sum().backward()
    # Output discard's rebuild runs under another grad mode: float rounding at most (the
    # discard row of docs/limits.md); a tanh chain this short is exact.
    assert torch.equal(x.grad, plain.grad)


def test_a_manager_whose_later_checkpoint_was_discarded_alone_frees_nothing_more() -> None:
    manager, outs = _chain(2, torch.randn(4, requires_grad=True))
    y = outs[-1] * 2
    manager.checkpoints[1].discard_output_and_register_recompute(y)
    with pytest.raises(CheckpointError, match="already discarded on its own"):
        manager.discard_all_outputs_and_register_unified_recompute(y * 2)
    nbytes = _nbytes(outs[0])
    assert nbytes == [4 * 4]  # the first was not freed


def test_a_manager_whose_later_output_was_changed_in_place_frees_nothing() -> None:
    # docs/discard.md: the discard raises "before freeing anything". The version check of each
    # checkpoint ran just before freeing it: the first output was freed, then the second's
    # check raised, and no rebuild was registered, so the first stayed empty for good.
    manager, outs = _chain(2, torch.randn(4, requires_grad=True))
    outs[1].mul_(2)  # a consumer changing the block's last output in place
    with pytest.raises(CheckpointError, match=r"^output of torch.tanh was changed in place"):
        manager.discard_all_outputs_and_register_unified_recompute(outs[1] * 2)
    nbytes = _nbytes(*outs)
    assert nbytes == [4 * 4, 4 * 4]


def test_a_manager_inside_a_checkpointed_layer_replays_only_the_replays_checkpoint() -> None:
    # The boundary's original pass checkpoints without grad (nothing saved): the manager forgets
    # those, so its replay sees the one real checkpoint of the boundary's replay.
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = _Norm(), nn.Linear(8, 8)

        def forward(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
            out = h + self.proj(ctx.manager.checkpoint(self.norm, h))
            ctx.manager.discard_all_outputs_and_register_unified_recompute(out)
            return out

    layer = pytree_ckpt.apply_activation_checkpointing(Layer())
    (ctx,) = build_residual_stream_recompute_plan(1, 1)
    layer(torch.randn(4, 8, requires_grad=True), ctx).sum().backward()
    assert len(ctx.manager.checkpoints) == 1 and ctx.manager.replay_order == [0]


@pytest.mark.parametrize(("args", "match"), [
    ((True, 2), "num_layers"),
    ((4, 2, [(-1, 1)]), "pair of layer indices"),
    ((4, 2, [(2, 4)]), "pair of layer indices"),
    ((4, 2, [(1, 1)]), "pair of layer indices"),  # a layer paired with itself: no pair
])
def test_more_bad_plans_are_refused(args: tuple[Any, ...], match: str) -> None:
    pairs = args[2] if len(args) > 2 else ()
    with pytest.raises(CheckpointConfigError, match=match):
        build_residual_stream_recompute_plan(args[0], args[1], atomic_layer_pairs=pairs)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("layer_index", "a", "layer_index must be an int >= 0"),
    ("block_index", -1, "block_index must be an int >= 0"),
    ("layer_index", True, "layer_index must be an int >= 0"),
    ("manager", None, "manager must be a CheckpointWithoutOutputManager"),
    ("is_block_end", 1, "is_block_end must be a bool"),
])
def test_a_plan_context_built_by_hand_with_a_wrong_field_is_refused_when_built(
        field: str, value: Any, match: str) -> None:
    # Helper DO: built directly, a context took any field and failed only at the block's
    # discard or replay. A context built by hand with right fields works as the plan's do.
    from pytree_ckpt import CheckpointWithoutOutputManager, ResidualStreamRecomputeContext
    fields: dict[str, Any] = {"layer_index": 0, "block_index": 0,
                              "manager": CheckpointWithoutOutputManager(), "is_block_end": True}
    ResidualStreamRecomputeContext(**fields)
    with pytest.raises(CheckpointConfigError, match=match) as info:
        ResidualStreamRecomputeContext(**{**fields, field: value})
    assert "build_residual_stream_recompute_plan" in str(info.value) or field == "is_block_end"


def test_a_boundary_nested_in_a_replay_reports_its_own_phase_not_its_parents() -> None:
    # pytree_ckpt/phase.py: the innermost active invocation decides. During the outer
    # boundary's replay the inner boundary runs its own original pass: "forward".
    seen: list[tuple[str, str]] = []

    def inner(t: torch.Tensor) -> torch.Tensor:
        seen.append(("inner", pytree_ckpt.current_phase().value))
        return torch.tanh(t) * 2

    def outer(t: torch.Tensor) -> torch.Tensor:
        seen.append(("outer", pytree_ckpt.current_phase().value))
        return pytree_ckpt.checkpoint(inner, t * 3).sin()

    x = torch.randn(4, requires_grad=True)
    pytree_ckpt.checkpoint(outer, x).sum().backward()
    assert seen == [("outer", "forward"), ("inner", "forward"), ("outer", "recompute"),
                    ("inner", "forward"), ("inner", "recompute")]
    assert pytree_ckpt.current_phase() == "plain"


def test_a_plan_held_through_backward_keeps_no_rebuilt_output_nor_replay_result() -> None:
    # A training loop holds the step's plan (and so its managers and checkpoints) until the
    # step ends: once a layer's backward is done, its discard must let go of the refilled
    # storage and of the replay's own result, or the backward peak grows with every layer.
    replay_results: list[weakref.ref[torch.Tensor]] = []

    class Traced(_Norm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if torch.is_grad_enabled():  # the replay (the forward runs under no-grad)
                replay_results.append(weakref.ref(out))
            return out

    torch.manual_seed(0)
    norms, projs = [Traced() for _ in range(3)], [nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    plan = build_residual_stream_recompute_plan(3, 1)
    gc.disable()
    try:
        with pytree_ckpt.ActivationCensus() as census:
            h = x
            for norm, proj, ctx in zip(norms, projs, plan):
                h = h + proj(ctx.manager.checkpoint(norm, h))
                ctx.manager.discard_all_outputs_and_register_unified_recompute(h)
            assert census.discarded_bytes == 3 * 4 * 8 * 4
            h.sum().backward()
            del h
            assert census.total_bytes == census.discarded_bytes == 0
        assert len(replay_results) == 3 and all(r() is None for r in replay_results)
        assert all(ckpt.released for ctx in plan for ckpt in ctx.manager.checkpoints)
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["restricted backward", "graph dropped"])
def test_a_plan_held_after_its_graph_is_gone_keeps_nothing_its_backward_never_ran_for(
        how: str) -> None:
    # backward(inputs=[weights]) rebuilds every output but runs no discard node's backward (the
    # first input's gradient is not asked for): each checkpoint kept its rebuilt output and
    # the replay's graph for as long as the plan lived (1 MiB here, per layer at scale). Once
    # the graph is freed, eager holds nothing either.
    replay_results: list[weakref.ref[torch.Tensor]] = []

    class Traced(_Norm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if torch.is_grad_enabled():
                replay_results.append(weakref.ref(out))
            return out

    torch.manual_seed(0)
    norms, projs = [Traced() for _ in range(3)], [nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    plan = build_residual_stream_recompute_plan(3, 1)
    gc.disable()
    try:
        with pytree_ckpt.ActivationCensus() as census:
            h = x
            for norm, proj, ctx in zip(norms, projs, plan):
                h = h + proj(ctx.checkpoint(norm, h))
                ctx.finalize(h)
            if how == "restricted backward":
                h.sum().backward(inputs=[p.weight for p in projs])
                assert len(replay_results) == 3  # every output was rebuilt
            del h
            assert census.total_bytes == census.discarded_bytes == 0
        assert all(r() is None for r in replay_results)
        checkpoints = [ckpt for ctx in plan for ckpt in ctx.manager.checkpoints]
        assert all(c.released and c.recomputed is None and c.detached is None
                   for c in checkpoints)
    finally:
        gc.enable()


def test_a_block_op_whose_output_goes_unused_is_not_rebuilt_and_the_rest_match_eager() -> None:
    # An output read only under no-grad (a metric) and dropped: its node is gone when the
    # block's hook fires. Rebuilding it raised "the graph of ... is gone".
    grads = []
    for discard in (False, True):
        torch.manual_seed(0)
        norm0, norm1, proj = _Norm(), _Norm(), nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        manager = CheckpointWithoutOutputManager()
        run = manager.checkpoint if discard else (lambda fn, *args: fn(*args))
        unused = run(norm0, x)
        with torch.no_grad():
            metric = unused.abs().mean().item()
        del unused
        h = x + proj(run(norm1, x))
        if discard:
            manager.discard_all_outputs_and_register_unified_recompute(h)
        h.square().sum().backward()
        grads.append(grads_of([x, *norm1.parameters(), *proj.parameters()]) + [metric])
    assert manager.replay_order == [1]  # only the used op was rebuilt
    assert grads[0][-1] == grads[1][-1]
    assert_same_grads(grads[0][1:-1], grads[1][1:-1])
    # x also feeds the residual: its gradient is summed in another order (NOTE [exactness])
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)


def test_an_output_kept_because_it_views_its_input_may_carry_the_rebuild_hook() -> None:
    # Only storages being freed are refused as the hook tensor: a kept one (here the block's
    # last op, a reshape of the consumer's result) stays readable, and its gradient arrives
    # before the consumer's backward needs the freed output.
    x = torch.randn(4, 8, requires_grad=True)
    squashed = torch.tanh(x * 1.0)
    ((squashed * squashed).view(-1) * 3).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    manager = CheckpointWithoutOutputManager()
    squashed = manager.checkpoint(torch.tanh, x * 1.0)
    flat = manager.checkpoint(lambda t: t.view(-1), squashed * squashed)  # kept
    manager.discard_all_outputs_and_register_unified_recompute(flat)
    nbytes = _nbytes(squashed, flat)
    assert nbytes == [0, 4 * 8 * 4]
    (flat * 3).sum().backward()
    assert manager.replay_order == [0, 1]
    assert torch.equal(x.grad, expected)


def test_a_discarded_output_reaching_the_next_op_only_detached_and_dropped_is_named() -> None:
    # Its op's graph is gone, so nothing can rebuild it; the next op's rebuild read the freed
    # storage and raised torch's "data is not allocated yet".
    norm0, norm1, proj = _Norm(), _Norm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    manager = CheckpointWithoutOutputManager()
    h0 = manager.checkpoint(norm0, x)
    out = proj(manager.checkpoint(norm1, h0.detach()))
    manager.discard_all_outputs_and_register_unified_recompute(out)
    del h0
    with pytest.raises(CheckpointError, match=r"(?s)an input of \S+ is a discarded output that "
                                              r"nothing can rebuild.*not \.detach\(\)"):
        out.sum().backward()


class _HeldDropout(nn.Module):
    """A dropout drawing from a generator of its own, held as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _own_dropout(x, generator=self.gen)


def test_a_discarded_module_holding_its_own_generator_replays_its_mask_and_leaves_it_as_eager(
        ) -> None:
    # NOTE [generators held as attributes] (held_generators.py) at the rebuild: without it the
    # rebuild drew the held generator's next numbers, another mask under the consumer's saved
    # tensor (other gradients, silently), and the generator ended the step two draws on.
    results = []
    for discard in (False, True):
        drop = _HeldDropout()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        if discard:
            ckpt = CheckpointWithoutOutput()
            out = ckpt.checkpoint(drop, x) @ w
            ckpt.discard_output_and_register_recompute(out)
        else:
            out = drop(x) @ w
        out.square().sum().backward()
        results.append([*grads_of([x, w]), torch.rand(8, generator=drop.gen)])
    assert_same_grads(*results)


@pytest.mark.parametrize("through", ["own", "manager"])
def test_without_preserve_rng_state_the_rebuild_draws_the_generators_next_numbers(
        through: str) -> None:
    # As torch's checkpoint with preserve_rng_state=False: nothing is recorded, so the rebuild
    # draws from the default generator as backward finds it (another mask, which the gradients
    # follow) and moves it on. The option must reach the rebuild, through a manager too.
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    torch.manual_seed(1)
    torch.rand(4, 8)  # the forward's mask
    rebuilt = (torch.rand(4, 8) > 0.5) * 2.0
    after = torch.rand(3)
    torch.manual_seed(1)
    fn = lambda t: t * (torch.rand(t.shape) > 0.5) * 2  # noqa: E731
    if through == "own":
        ckpt = CheckpointWithoutOutput(preserve_rng_state=False)
        out = ckpt.checkpoint(fn, x) * w
        ckpt.discard_output_and_register_recompute(out)
    else:
        manager = pytree_ckpt.CheckpointWithoutOutputManager(preserve_rng_state=False)
        out = manager.checkpoint(fn, x) * w
        manager.discard_all_outputs_and_register_unified_recompute(out)
    out.sum().backward()
    assert torch.equal(x.grad, rebuilt * w.detach())
    assert torch.equal(torch.rand(3), after)


class _GradBuffer(nn.Module):
    """Holds a buffer that requires grad (a replay or rebuild gives gradients to inputs and
    parameters only); ``through`` calls another module passed as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 2.0, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def through(self, x: torch.Tensor, other: nn.Module) -> torch.Tensor:
        return other(x)


@pytest.mark.parametrize("whose", ["own", "argument"])
def test_a_buffer_that_requires_grad_on_a_discarded_module_is_refused_by_its_name(
        whose: str) -> None:
    # It would get no gradient from the rebuild (only inputs and parameters get one): the
    # refusal names the buffer, on the op's module or on a module passed as an argument, as
    # the boundary's does, not an anonymous tensor.
    x = torch.randn(4, 8, requires_grad=True)
    module = _GradBuffer()
    ckpt = CheckpointWithoutOutput()
    h = ckpt.checkpoint(module, x) if whose == "own" else \
        ckpt.checkpoint(_GradBuffer().through, x, module)
    out = h * 3
    ckpt.discard_output_and_register_recompute(out)
    name = "scale" if whose == "own" else "(argument _GradBuffer).scale"
    with pytest.raises(CheckpointError, match=f"the buffer {re.escape(name)} requires grad"):
        out.sum().backward()


def test_a_plan_reused_by_a_second_forward_of_one_step_is_refused_with_a_tip_per_forward(
        ) -> None:
    norms = torch.nn.ModuleList(torch.nn.LayerNorm(8) for _ in range(2))

    def forward(plan: list, h: torch.Tensor) -> torch.Tensor:
        for ctx, norm in zip(plan, norms):
            h = h + ctx.checkpoint(norm, h) * 2
            ctx.finalize(h)
        return h

    plan = pytree_ckpt.build_residual_stream_recompute_plan(2, 2)  # one plan for the whole step
    chosen = forward(plan, torch.randn(3, 8))
    with pytest.raises(CheckpointError) as refused:
        forward(plan, torch.randn(3, 8))  # the rejected half of the same step
    tip = str(refused.value).splitlines()[-1]
    assert "per step" not in tip and "per forward" in tip
    chosen.sum().backward()
