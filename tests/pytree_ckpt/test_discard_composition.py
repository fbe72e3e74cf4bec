"""Output-discard replay composed with the rest of training: parameters frozen or unfrozen
between forward and backward, restricted backwards, offload, census.

Each test compares against an unwrapped eager twin with exact equality in fp32. Storage sizes
are read into a local before they are asserted (a freed tensor must never reach a repr)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pytree_ckpt import CheckpointWithoutOutput
from tests.conftest import assert_same_grads, grads_of


class _Norm(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.parametrize("frozen_in_forward", [False, True],
                         ids=["frozen-since-forward", "unfrozen-since-forward"])
def test_a_norm_weight_frozen_or_unfrozen_between_forward_and_backward_gets_eagers_gradient(
        frozen_in_forward: bool) -> None:
    # Eager: the graph was built in the forward; a parameter frozen since still gets nothing
    # (its AccumulateGrad does nothing), one unfrozen since was never in the graph. The
    # discard raised torch's "One of the differentiated Tensors does not require grad" for
    # the first, and a CheckpointError calling the norm's own weight a foreign tensor (tip:
    # "pass it as an argument") for the second.
    torch.manual_seed(0)
    norm, proj = _Norm(), nn.Linear(8, 8)
    twin = copy.deepcopy(norm)
    x = torch.randn(4, 8, requires_grad=True)
    norm.weight.requires_grad_(not frozen_in_forward)
    twin.weight.requires_grad_(not frozen_in_forward)
    out = proj(norm(x))
    norm.weight.requires_grad_(frozen_in_forward)
    out.square().sum().backward()
    expected = grads_of([x, norm.weight, *proj.parameters()])
    x.grad = None
    proj.zero_grad(set_to_none=True)
    ckpt = CheckpointWithoutOutput()
    out = proj(ckpt.checkpoint(twin, x))
    ckpt.discard_output_and_register_recompute(out)
    twin.weight.requires_grad_(frozen_in_forward)
    out.square().sum().backward()
    assert twin.weight.grad is None
    assert_same_grads(expected, grads_of([x, twin.weight, *proj.parameters()]))
