"""Output-discard replay: freed storages, exact gradients, forward-order block replay, plans."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import (ActivationCensus, CheckpointConfigError, CheckpointError,
                         CheckpointWithoutOutput, CheckpointWithoutOutputManager,
                         build_residual_stream_recompute_plan, checkpoint, current_phase)
from tests.conftest import assert_same_grads


class Norm(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(current_phase().value if torch.is_grad_enabled() else "no-grad")
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """``h + proj(norm(h))``, with the norm's output optionally discarded."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = Norm(width)
        self.proj = nn.Linear(width, width)
        self.last_norm_out: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, discard: bool = False) -> torch.Tensor:
        if not discard:
            return h + self.proj(self.norm(h))
        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(self.norm, h)
        out = self.proj(normed)  # the consumer saves `normed`
        ckpt.discard_output_and_register_recompute(out)
        self.last_norm_out = normed
        return h + out


def test_discarded_outputs_hold_no_bytes_and_backward_gives_eager_gradients() -> None:
    block = Block()
    x = torch.randn(8, 16, requires_grad=True)
    block(x).square().sum().backward()
    eager = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad(set_to_none=True)
    x.grad = None
    out = block(x, discard=True)
    normed = block.last_norm_out
    assert normed is not None and normed.untyped_storage().nbytes() == 0
    saved = out.grad_fn.next_functions[1][0]  # AddmmBackward of the projection
    assert saved._saved_mat1.untyped_storage().nbytes() == 0  # a valid object, no memory
    out.square().sum().backward()
    # parameters exactly; x (used by the norm and by the residual) up to float association,
    # see NOTE [exactness] in pytree_ckpt/discard.py
    assert_same_grads(eager[:-1], [p.grad for p in block.parameters()])
    torch.testing.assert_close(x.grad, eager[-1], rtol=1e-6, atol=1e-6)
    assert block.norm.calls == ["plain", "no-grad", "plain"]  # eager, discard fwd, replay
    assert normed.untyped_storage().nbytes() == 8 * 16 * 4     # refilled in place


def test_a_manager_replays_its_block_once_in_forward_order() -> None:
    norms = [Norm() for _ in range(3)]
    x = torch.randn(4, 16, requires_grad=True)
    manager = CheckpointWithoutOutputManager()
    h = x
    outs = []
    for norm in norms:  # chained: each takes the previous discarded output
        h = manager.checkpoint(norm, h)
        outs.append(h)
    y = h * 3
    manager.discard_all_outputs_and_register_unified_recompute(y)
    assert all(o.untyped_storage().nbytes() == 0 for o in outs)
    y.sum().backward()
    assert manager.replay_order == [0, 1, 2]
    assert [n.calls for n in norms] == [["no-grad", "plain"]] * 3
    got = x.grad.clone()
    x.grad = None
    h = x
    for norm in norms:
        h = norm(h)
    (h * 3).sum().backward()
    assert torch.equal(got, x.grad)


def test_an_output_that_aliases_its_input_is_kept() -> None:
    x = torch.randn(6, requires_grad=True) * 1.0
    ckpt = CheckpointWithoutOutput()
    view = ckpt.checkpoint(lambda t: t[:3], x)
    y = view * 2
    ckpt.discard_output_and_register_recompute(y)
    assert view.untyped_storage().nbytes() == 6 * 4  # not freed: the input needs it
    y.sum().backward()


def test_discarding_before_checkpointing_twice_and_replaying_twice_raise() -> None:
    x = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(CheckpointError, match="(?s)before checkpoint\\(\\).*tip"):
        ckpt.discard_output_and_register_recompute(x * 2)
    out = ckpt.checkpoint(torch.tanh, x)
    y = out * 2
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(CheckpointError, match="already discarded"):
        ckpt.discard_output_and_register_recompute(y)
    loss = (y * y).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(CheckpointError, match="already replayed"):
        loss.backward()


def test_a_replay_of_another_shape_raises() -> None:
    x = torch.randn(4, requires_grad=True)
    calls = []

    def unstable(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(t) if len(calls) == 1 else torch.tanh(t)[:2]

    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(unstable, x) * 2
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(CheckpointError, match="another shape or dtype"):
        y.sum().backward()


def test_the_census_drop_equals_the_discarded_bytes() -> None:
    norm, proj = Norm(), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCensus() as census:
        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(norm, x)
        out = proj(normed)  # saves normed
        before = census.total_bytes
        ckpt.discard_output_and_register_recompute(out)
        after = census.total_bytes
    assert before - after == census.discarded_bytes == 8 * 16 * 4
    out.sum().backward()


def test_discard_works_inside_a_checkpoint_boundary_and_with_offload() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(8, 16, requires_grad=True)
    h = x
    for block in blocks:
        h = block(h)
    h.square().sum().backward()
    eager = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    h = x
    with manager.window([x]):
        for block in blocks:
            # the replay of each boundary discards its norm output again, inside the replay
            h = checkpoint(block, h, True)
    h.square().sum().backward()
    got = [p.grad for p in blocks.parameters()] + [x.grad]
    # The last block's parameters exactly. Upstream of it, each residual input's gradient is a
    # sum associated differently (NOTE [exactness] in discard.py), so earlier blocks match to
    # float rounding only.
    assert_same_grads(eager[-4:-1], got[-4:-1])  # norm.weight, proj.weight, proj.bias
    for want, have in zip(eager, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    assert manager.stats()["offloaded_bytes"] == x.untyped_storage().nbytes()
    # eager; the boundary's original pass (no grad: nothing to discard); the replay's discard
    # checkpoint (no-grad forward); its rebuild when the projection's gradient arrived
    assert [b.norm.calls for b in blocks] == [["plain", "no-grad", "no-grad", "plain"]] * 3


@pytest.mark.parametrize(("num_layers", "block_size", "pairs", "blocks"), [
    (4, 3, [(0, 1), (2, 3)], [[0, 1], [2, 3]]),       # the seed's example
    (4, None, [], [[0, 1, 2, 3]]),                   # the whole stack
    (4, 1, [(1, 2)], [[0], [1, 2], [3]]),            # a pair beats block_size=1
    (5, 2, [], [[0, 1], [2, 3], [4]]),
])
def test_residual_plans_group_layers_into_blocks_without_splitting_pairs(
        num_layers: int, block_size: int | None, pairs: list[tuple[int, int]],
        blocks: list[list[int]]) -> None:
    plan = build_residual_stream_recompute_plan(num_layers, block_size,
                                                atomic_layer_pairs=pairs)
    assert [c.layer_index for c in plan] == list(range(num_layers))
    got: dict[int, list[int]] = {}
    for c in plan:
        got.setdefault(c.block_index, []).append(c.layer_index)
    assert list(got.values()) == blocks
    for block in blocks:
        managers = {id(plan[i].manager) for i in block}
        assert len(managers) == 1
        assert [plan[i].is_block_end for i in block] == [i == block[-1] for i in block]


@pytest.mark.parametrize(("args", "match"), [((4, 0), "block_size"), ((0, 2), "num_layers"),
                                             ((4, 2, [(2, 1)]), "pair of layer indices")])
def test_bad_plans_are_refused(args: tuple[Any, ...], match: str) -> None:
    pairs = args[2] if len(args) > 2 else ()
    with pytest.raises(ValueError, match=match):
        build_residual_stream_recompute_plan(args[0], args[1], atomic_layer_pairs=pairs)


def test_an_output_aliasing_its_input_is_kept_even_inside_an_offload_window() -> None:
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    x = torch.randn(6, requires_grad=True) * 1.0
    with manager.window([x]):
        ckpt = CheckpointWithoutOutput()
        view = ckpt.checkpoint(lambda t: t[:3], x)
        y = view * 2
        ckpt.discard_output_and_register_recompute(y)
    assert x.untyped_storage().nbytes() == 6 * 4  # the input was not freed
    assert manager.events() == []                 # and nothing was restored in forward
    y.sum().backward()


def test_a_hook_tensor_that_needs_no_grad_is_refused_before_anything_is_freed() -> None:
    x = torch.randn(4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    out = ckpt.checkpoint(torch.tanh, x)
    with pytest.raises(ValueError, match="must be a tensor that requires grad"):
        ckpt.discard_output_and_register_recompute(out.detach())
    assert out.untyped_storage().nbytes() == 4 * 4 and not ckpt.discarded


def test_structured_arguments_are_refused_with_a_tip() -> None:
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(ValueError, match="(?s)container of tensors.*tip"):
        ckpt.checkpoint(lambda xs: xs[0] * 2, [torch.randn(2, requires_grad=True)])


def test_a_backward_with_create_graph_through_a_discarded_output_is_refused() -> None:
    norm, proj = nn.LayerNorm(16), nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    out = proj(ckpt.checkpoint(norm, x))
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(CheckpointError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


class Positions(nn.Module):
    """Returns a view of its own state: learned positions, or a rotary-style buffer."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        table = torch.randn(16, 8)
        if learned:
            self.table = nn.Parameter(table)
        else:
            self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[: x.shape[0]]


@pytest.mark.parametrize("learned", [True, False])
def test_an_output_that_is_a_view_of_module_state_is_kept_not_freed(learned: bool) -> None:
    # NOTE [discard frees only fn's own storages]: freeing it would destroy the parameter or
    # buffer for every later step.
    torch.manual_seed(0)
    positions, proj = Positions(learned), nn.Linear(8, 8)
    before = positions.table.detach().clone()
    x = torch.randn(4, 8, requires_grad=True)
    eager_out = proj(positions(x))
    eager_out.sum().backward()
    expected = [t.grad.clone() for t in (*positions.parameters(), *proj.parameters())]
    for t in (*positions.parameters(), *proj.parameters()):
        t.grad = None
    ckpt = CheckpointWithoutOutput()
    out = proj(ckpt.checkpoint(positions, x))
    ckpt.discard_output_and_register_recompute(out)
    assert positions.table.untyped_storage().nbytes() == 16 * 8 * 4  # intact
    out.sum().backward()
    assert torch.equal(positions.table, before)
    assert_same_grads(expected, [t.grad for t in (*positions.parameters(), *proj.parameters())])


def test_a_view_of_a_tensor_a_lambda_closes_over_is_kept() -> None:
    table = torch.randn(16, 8)
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    rows = ckpt.checkpoint(lambda t: table[: t.shape[0]], x)
    out = (x * rows).sum()
    ckpt.discard_output_and_register_recompute(out)
    assert table.untyped_storage().nbytes() == 16 * 8 * 4


GLOBAL_TABLE = torch.randn(16, 8)


def _rows_of_the_global_table(t: torch.Tensor) -> torch.Tensor:
    return GLOBAL_TABLE[: t.shape[0]]


def _rows_of(t: torch.Tensor, table: torch.Tensor | nn.Module) -> torch.Tensor:
    table = table.get_buffer("table") if isinstance(table, nn.Module) else table
    return table[: t.shape[0]]


@pytest.mark.parametrize("reach", ["global", "partial", "module argument"])
def test_a_view_of_state_reached_as_a_global_a_partial_or_a_module_argument_is_kept(
        reach: str) -> None:
    # Plain tensors (a buffer, not parameters, which are always kept): only finding them
    # where fn can reach them keeps them.
    holder = nn.Module()
    holder.register_buffer("table", torch.randn(16, 8))
    fn, args, state = {
        "global": (_rows_of_the_global_table, (), GLOBAL_TABLE),
        "partial": (functools.partial(_rows_of, table=holder.table), (), holder.table),
        "module argument": (_rows_of, (holder,), holder.table),
    }[reach]
    before = state.clone()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    rows = ckpt.checkpoint(fn, x, *args)
    out = (x * rows).sum()
    ckpt.discard_output_and_register_recompute(out)
    nbytes = state.untyped_storage().nbytes()  # (a freed tensor must not reach a repr)
    assert nbytes == 16 * 8 * 4
    out.backward()
    assert torch.equal(state, before) and torch.equal(x.grad, before[:4])


def test_an_op_with_only_integer_outputs_is_refused_when_checkpointed() -> None:
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(CheckpointConfigError, match="floating output"):
        CheckpointWithoutOutput().checkpoint(lambda t: t.argmax(-1), x)


def test_a_view_of_a_tensor_in_a_dict_a_lambda_closes_over_is_kept() -> None:
    caches = {"cos": torch.randn(16, 8)}
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    rows = ckpt.checkpoint(lambda t: caches["cos"][: t.shape[0]], x)
    ckpt.discard_output_and_register_recompute((x * rows).sum())
    assert caches["cos"].untyped_storage().nbytes() == 16 * 8 * 4
