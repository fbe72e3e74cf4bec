"""frozen.py's bookkeeping, pinned by helper MA's mutation round: the values a reused call
leaves for the replay (NOTE [state a reused call changes]) and when a function storing floats
on its module is probed (NOTE [floats a reused fn stores on its module])."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import frozen, reuse_during_recompute

D, E, T = 16, 8, 12


def _forget_stored_floats(monkeypatch: pytest.MonkeyPatch) -> None:
    for learned in ("_OPEN", "_JUDGED", "_PROBED", "_WARNED_STORED"):
        monkeypatch.setattr(frozen, learned, type(getattr(frozen, learned))())


def _route_counting(h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    ids = h.topk(2, dim=-1).indices
    counts += torch.bincount(ids.flatten(), minlength=4)
    return ids


def test_an_int_argument_the_layer_changes_again_after_the_call_is_replayed_as_the_call_left_it(
        ) -> None:
    # Mutant MA14 (state_after kept the argument without its clone): the value kept for the
    # replay was the layer's own tensor, which the layer changed again after the call in the
    # same forward, so the replay was given the later value: other gradients than eager's.
    proj = nn.Linear(4, 4)

    def layer(x: torch.Tensor) -> torch.Tensor:
        h = proj(x)
        counts = torch.zeros(4, dtype=torch.long)  # made by the layer: the replay's own
        ids = reuse_during_recompute(_route_counting, h.detach(), counts)
        seen = counts.clone()
        counts += 100  # changed again after the call
        return (torch.gather(h, -1, ids).sum(-1, keepdim=True) * h * seen.float()).sum()

    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    layer(x).backward()
    eager = (x.grad.clone(), proj.weight.grad.clone())
    x.grad, proj.weight.grad = None, None
    pytree_ckpt.checkpoint(layer, x).backward()
    assert torch.equal(x.grad, eager[0]) and torch.equal(proj.weight.grad, eager[1])


class _RouterKeepingItsProbs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        self.probs = self.gate(x).softmax(-1)
        return self.probs.topk(2, dim=-1).indices


class _ProbsLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router, self.out = nn.LayerNorm(D), _RouterKeepingItsProbs(), \
            nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        ids = reuse_during_recompute(self.router.select, h)
        return x + self.out(h) * self.router.probs.gather(-1, ids).sum(-1, keepdim=True)


def test_a_storing_router_without_backward_is_probed_exactly_eight_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Mutant MA24 (stores_floats's bound `<` made `<=`): nine probed calls, one more than
    # _MAX_PROBED, in a grad-enabled loop that never runs backward.
    _forget_stored_floats(monkeypatch)
    torch.manual_seed(0)
    ours = pytree_ckpt.apply_activation_checkpointing(nn.Sequential(_ProbsLayer()))
    x = torch.randn(T, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(12):
            ours(x.clone().requires_grad_()).sum().item()
    fn = ours[0].router.select
    assert frozen._PROBED.get(frozen.warned_key(fn)) == frozen._MAX_PROBED == 8
    assert not frozen.stores_floats(fn)


def test_a_float_argument_changed_in_place_is_not_kept_for_the_replay() -> None:
    # Mutant MA13 (state_after kept float arguments too): logits-sized scores kept twice; a
    # float changed in place is warned about instead (NOTE [a reused fn changes no argument]).
    scores, counts = torch.randn(6, 4), torch.zeros(4, dtype=torch.long)
    call, before = frozen.argument_versions((scores, counts), {})
    scores[:, 0] = -float("inf")
    assert frozen.state_after(call, before, None, None) is None
    counts += 1
    changes = frozen.state_after(call, before, None, None)
    assert changes is not None and [(kind, key) for kind, key, _, _ in changes] == [
        ("argument", 1)]


class _RouterWithAuxUnderEnableGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            self.aux = self.gate.weight.square().sum()  # has its graph: kept as eager's
        return self.gate(x).topk(2, dim=-1).indices


class _AuxLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router = nn.LayerNorm(D), _RouterWithAuxUnderEnableGrad()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(self.router.select, self.norm(x))
        return x * ids.float().sum(-1, keepdim=True)


def test_a_float_a_reused_call_stores_with_its_graph_does_not_open_the_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Mutant MA25 (stored_floats counted a stored float that requires grad): a tensor with a
    # graph is no value computed under the boundary's no-grad, yet opened the function to the
    # probe (a Python call per op at its next calls).
    _forget_stored_floats(monkeypatch)
    ours = pytree_ckpt.apply_activation_checkpointing(nn.Sequential(_AuxLayer()))
    ours(torch.randn(T, D, requires_grad=True)).sum().backward()
    fn = ours[0].router.select
    assert not frozen.stores_floats(fn) and frozen.warned_key(fn) not in frozen._OPEN


def _mask_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    scores[:, 0] = -float("inf")
    return scores.topk(k, dim=-1).indices


def _mask_last(scores: torch.Tensor, k: int) -> torch.Tensor:
    scores[:, -1] = -float("inf")
    return scores.topk(k, dim=-1).indices


def test_two_partials_of_two_functions_changing_their_argument_are_each_warned_about() -> None:
    # Mutant MA31 (warned_key unwrapped no partial): every partial had one key, its type, so
    # the second function was never told.
    import functools

    first, last = functools.partial(_mask_first, k=2), functools.partial(_mask_last, k=2)
    assert frozen.warned_key(first) is _mask_first.__code__
    proj = nn.Linear(4, 4)

    def layer(x: torch.Tensor) -> torch.Tensor:
        h = proj(x)
        a = reuse_during_recompute(first, h.detach().clone())
        b = reuse_during_recompute(last, h.detach().clone())
        return torch.gather(h, -1, a).sum() + torch.gather(h, -1, b).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(5, 4, requires_grad=True)).backward()
    told = [str(w.message) for w in caught if "in place" in str(w.message)]
    assert len(told) == 2
    # Each named by its function (callable_name named both "partial": helper MA).
    assert "partial(_mask_first)" in told[0] and "partial(_mask_last)" in told[1]
