"""Replay frames at the edges: names in errors, consumption checks, RNG jumps of records taken
back or skipped, save units under offload, what the census counts of a frame."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from pytree_ckpt import (ActivationCensus, KeptOps, RecomputeConfig, ReuseError, SaveUnit,
                         apply_recompute_config, checkpoint, current_phase, reuse_during_recompute)
from tests.conftest import assert_same_grads, grads_of, grads_per_model
from tests.pytree_ckpt.models import JitteredOnly


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Router:
    calls = 0

    @classmethod
    def topk(cls, h: torch.Tensor) -> torch.Tensor:
        cls.calls += 1
        return torch.topk(h.detach(), 2, dim=-1).indices


def test_a_classmethod_is_named_by_its_class_in_a_reuse_error() -> None:
    # callable_name: the owner of a classmethod is the class itself, not an instance of `type`.
    def fn(x: torch.Tensor) -> torch.Tensor:
        reuse_during_recompute(Router.topk, x)
        if current_phase() == "recompute":
            reuse_during_recompute(Router.topk, x)
        return x * 2

    out = checkpoint(fn, torch.randn(3, 5, requires_grad=True))
    with pytest.raises(ReuseError, match=r"result #2 of Router\.topk, but the original pass "
                                         r"recorded 1"):
        out.sum().backward()


class TwoRoutings(nn.Module):
    """Calls one frozen callable twice per forward: the largest and the smallest entries."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls = 0

    def topk(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.topk(h.detach(), 3, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        largest = reuse_during_recompute(self.topk, h)
        smallest = reuse_during_recompute(self.topk, -h)
        return (torch.gather(h, -1, largest).exp().sum(-1, keepdim=True)
                + 3 * torch.gather(h, -1, smallest).exp().sum(-1, keepdim=True)) * h


@pytest.mark.filterwarnings("ignore:pytree_ckpt.*changed the number")  # its call counter
def test_the_census_counts_every_result_a_frame_holds_for_one_callable() -> None:
    # Frame.tensors(): two results recorded for one callable are two storages the frame holds.
    layer = TwoRoutings()
    x = torch.randn(5, 8, requires_grad=True)
    with ActivationCensus(layer) as census:
        out = checkpoint(layer, x)
    assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x),
                                            "replay frame": 2 * 5 * 3 * 8}
    out.sum().backward()
    assert census.total_bytes == 0 and layer.calls == 2


def test_a_callable_the_replay_never_asks_for_is_reported_as_left_over() -> None:
    # Frame.check_consumed: a callable with no cursor at all consumed 0 of its results.
    def frozen_ids(x: torch.Tensor) -> torch.Tensor:
        return x.detach().argsort()

    def fn(x: torch.Tensor) -> torch.Tensor:
        if current_phase() == "forward":  # the replay takes another path: no call at all
            reuse_during_recompute(frozen_ids, x)
        return x * 2

    out = checkpoint(fn, torch.randn(4, requires_grad=True))
    with pytest.raises(ReuseError, match=r"consumed 0 of the 1 results recorded for "
                                         r".*frozen_ids by reuse_during_recompute") as raised:
        out.sum().backward()
    # the tip for a callable's results, not the kept ops' (torch's dispatch is not the cause)
    assert "same reuse_during_recompute calls" in str(raised.value)
    assert "torch itself chooses" not in str(raised.value)


class KeptCoinFlipsChanged(nn.Module):
    """A kept random op whose output is then changed in place: the keep is taken back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        mask = torch.bernoulli(torch.full_like(h, 0.5))  # kept, then taken back (rule 3)
        mask.mul_(2.0)
        return nn.functional.dropout(h * mask, 0.5, training=True)


def _bernoulli_kept_gives_the_eager_twins_grads(eager: nn.Module, wrapped: nn.Module) -> None:
    """``wrapped`` checkpointed keeping ``aten::bernoulli`` (its warnings ignored: the op is
    taken back), then a step of each: gradients bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_recompute_config([wrapped], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::bernoulli")}, offload=False)
        x = torch.randn(4, 8, requires_grad=True)
        assert_same_grads(*grads_per_model([eager, wrapped], x, seed=1))


def test_a_random_op_taken_back_from_a_save_unit_redraws_the_original_numbers() -> None:
    # Frame.unkeep: the replay runs the op again from the restored generator; the jump recorded
    # for it (to the state after it) must be dropped too, or it draws from the state after it.
    torch.manual_seed(0)
    eager = KeptCoinFlipsChanged()
    wrapped = copy.deepcopy(eager)
    _bernoulli_kept_gives_the_eager_twins_grads(eager, wrapped)


class BranchingMm(nn.Module):
    """Takes another path in the replay: one aten.mm fewer than in the original pass."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x, self.w)
        if current_phase() == "forward":
            h = h + torch.mm(x, self.w.t()) * 0.0
        return torch.tanh(h)


def test_a_replay_that_leaves_a_save_units_record_unused_is_refused() -> None:
    # Frame.check_consumed covers save units' records too: a leftover means the replay took
    # another path than the original pass.
    layer = BranchingMm()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")}, offload=False)
    out = layer(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(ReuseError, match=r"consumed 1 of the 2 results recorded for "
                                         r"aten\.mm\.default by a save unit") as raised:
        out.sum().backward()
    # NOTE [kept ops dispatched differently] (frames.py): the tip names torch's dispatch too
    assert "torch itself chooses" in str(raised.value)


def test_a_nested_boundary_without_rng_preservation_ignores_the_outer_jump() -> None:
    # The inner boundary's first run inside the outer replay takes the jittered ids, and their
    # RNG jump, from the outer frame. Its own replay restores no generator, so it must not
    # jump either: backward completes, gradients and the generator end as in eager.
    torch.manual_seed(0)
    inner = JitteredOnly()
    eager_inner = copy.deepcopy(inner)
    x = torch.randn(4, 8, requires_grad=True)
    inner_ckpt = pytree_ckpt.checkpointed(inner, preserve_rng_state=False)

    def outer(t: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():  # the inner boundary is real in the outer's forward too
            return inner_ckpt(t * 2)

    torch.manual_seed(3)
    eager_inner(x * 2).sum().backward()
    eager = grads_of([x, *eager_inner.parameters()])
    eager_rng = torch.get_rng_state()
    x.grad = None
    torch.manual_seed(3)
    checkpoint(outer, x).sum().backward()
    assert_same_grads(eager, grads_of([x, *inner.parameters()]))
    assert torch.equal(torch.get_rng_state(), eager_rng)


class SaveUnitBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.mm(x, self.attn.weight.t()))  # aten.mm: kept
        return x + self.mix(h).sigmoid() * h


def test_save_units_with_offload_keep_their_outputs_resident_and_give_eager_gradients() -> None:
    # Frame.offload moves frozen results to host, never a save unit's kept outputs.
    torch.manual_seed(0)
    eager = nn.ModuleList(SaveUnitBlock() for _ in range(2))
    wrapped = copy.deepcopy(eager)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    apply_recompute_config(wrapped, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::mm")}, offload=manager)
    x = torch.randn(4, 8, requires_grad=True)

    def run(model: nn.Module) -> list[torch.Tensor | None]:
        h = x
        for layer in model:
            h = layer(h)
        h.square().sum().backward()
        grads = grads_of([*model.parameters(), x])
        x.grad = None
        return grads

    assert_same_grads(run(eager), run(wrapped))
    assert manager.stats()["offloaded_bytes"] > 0


def _jittered_ids(x: torch.Tensor) -> torch.Tensor:
    return (x + torch.rand_like(x)).topk(2, -1).indices  # draws random numbers


class MaskRecordingInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.masks: list[tuple[str, torch.Tensor]] = []
        self.factor = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(_jittered_ids, x.detach())
        self.factor = ids.float().sum(-1, keepdim=True) + 1
        h = self.proj(x) * self.factor
        mask = (torch.rand_like(h) > 0.5).float()  # a dropout mask, recorded
        self.masks.append((str(current_phase()), mask))
        return h * mask


def test_a_nested_boundary_replays_the_masks_its_own_first_run_drew_under_an_outer_without_rng(
        ) -> None:
    # The outer boundary restores no generator: its replay, where the inner boundary's first
    # run takes the ids from the outer frame, does not jump to the state after the jittered
    # call either. The inner boundary recorded that jump anyway, and its replay took it: its
    # dropout mask was the outer original pass's, not the one its first run drew, so the
    # gradient was not that of the function the outer replay computed.
    torch.manual_seed(0)
    inner = MaskRecordingInner()
    twin = copy.deepcopy(inner)
    inner_ckpt = pytree_ckpt.checkpointed(inner, preserve_rng_state=True)

    def outer(t: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():  # the inner boundary is real in the outer's forward too
            return inner_ckpt(t * 2)

    x = torch.randn(4, 8, requires_grad=True)
    pytree_ckpt.checkpointed(outer, preserve_rng_state=False)(x).sum().backward()
    phases = [phase for phase, _ in inner.masks]
    assert phases == ["forward", "forward", "recompute"]  # outer original, outer replay, inner
    # the gradient of what the outer replay computed: with the mask its inner run drew
    x_twin = x.detach().requires_grad_()
    (twin.proj(x_twin * 2) * inner.factor * inner.masks[1][1]).sum().backward()
    assert_same_grads(grads_of([x_twin, *twin.parameters()]), grads_of([x, *inner.parameters()]))
    # "dropout masks are identical in the replay": the inner replay draws its first run's
    assert torch.equal(inner.masks[2][1], inner.masks[1][1])


class KeptOwnCoinFlipsChanged(nn.Module):
    """KeptCoinFlipsChanged drawing from a generator of its own, held as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        mask = torch.bernoulli(torch.full_like(h, 0.5), generator=self.gen)  # kept, taken back
        mask.mul_(2.0)
        return h * mask


def test_a_random_op_taken_back_from_a_save_unit_redraws_its_own_generators_numbers() -> None:
    # Frame.unkeep drops the jump of a generator the layer holds too (NOTE [generators held as
    # attributes]), not only the default generators': kept, it set the generator to the state
    # after the op, and the op, run again, drew the numbers after those: another mask.
    torch.manual_seed(0)
    eager = KeptOwnCoinFlipsChanged()
    torch.manual_seed(0)
    wrapped = KeptOwnCoinFlipsChanged()
    _bernoulli_kept_gives_the_eager_twins_grads(eager, wrapped)
    assert torch.equal(torch.rand(4, generator=eager.gen), torch.rand(4, generator=wrapped.gen))


def test_a_reused_call_in_a_nested_boundary_keeps_the_outer_boundarys_generator_in_step(
        ) -> None:
    # The outer boundary is given the generator, the inner one is not: the reused call inside
    # the inner one draws from it, and the outer layer draws from it again after. The jump is
    # recorded for the outer frame (its replay skips the call and must leave the generator
    # where the call left it) and not for the inner one, whose replay does not restore it
    # (a jump there would move it for good). Gradients and the generator's next numbers are
    # eager's.
    results = []
    for checkpointed in (False, True):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def jitter(h: torch.Tensor) -> torch.Tensor:
            return (h + torch.rand(h.shape, generator=g)).topk(2, dim=-1).indices

        def inner(h: torch.Tensor) -> torch.Tensor:
            return torch.gather(h, -1, reuse_during_recompute(jitter, h.detach()))

        def outer(h: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
            picked = checkpoint(inner, h * 2) if checkpointed else inner(h * 2)
            return picked * (torch.rand(picked.shape, generator=gen) > 0.5)

        out = checkpoint(outer, x, g) if checkpointed else outer(x, g)
        out.square().sum().backward()
        results.append([x.grad, torch.rand(8, generator=g)])
    assert_same_grads(*results)
