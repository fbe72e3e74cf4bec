"""Tensor subclasses and tensor attributes through the boundary (pytree_ckpt/subclass.py),
each test an eager twin compared bit for bit: the cases a mutation round (helper MB) found no
other test to pin."""

from __future__ import annotations

import torch
from torch import nn

import pytree_ckpt


def test_an_attribute_reassigned_on_a_plain_tensor_input_after_the_forward_is_not_replayed(
        ) -> None:
    # NOTE [a subclass's attributes as the forward began], for a plain tensor: the replay sees
    # the attribute the original pass read (a copy of the instance dict), not the value the
    # caller assigned between forward and backward (a scale updated after the step's forward).
    torch.manual_seed(0)
    proj = nn.Linear(4, 4)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(proj(x) * x.scale)  # type: ignore[attr-defined]

    grads = []
    for call in (layer, lambda t: pytree_ckpt.checkpoint(layer, t)):
        x = torch.randn(3, 4, requires_grad=True)
        x.data.copy_(torch.arange(12.).reshape(3, 4) / 10)
        x.scale = 2.0  # type: ignore[attr-defined]
        out = call(x)
        x.scale = 3.0  # type: ignore[attr-defined]  # after the forward, before backward
        out.square().sum().backward()
        grads.append([x.grad, *(p.grad for p in proj.parameters())])
        proj.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
