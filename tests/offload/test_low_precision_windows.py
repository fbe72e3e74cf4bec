"""Offload windows holding low-precision inputs (helper NR): a packed uint8 4-bit weight, its
float32 block scales, a float8 activation (every float8 dtype this build has) and a strided
float8 view; copied once, restored bit for bit, gradients equal to eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt

FLOAT8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                            "float8_e5m2fnuz", "float8_e8m0fnu")
          if hasattr(torch, name)]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                x8: torch.Tensor, s8: torch.Tensor) -> torch.Tensor:
        hi, lo = (packed >> 4).float() - 8, (packed & 15).float() - 8
        w = (torch.stack([hi, lo], 1).reshape(-1, 16) / 7 * absmax[:, None]).reshape(32, 32)
        return torch.tanh(x @ w.t() + self.lin(x8.to(torch.float32) * s8) + self.lin(x))


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("strided", [False, True])
def test_uint8_and_float8_window_inputs_are_restored_bit_for_bit(dtype: torch.dtype,
                                                                   strided: bool) -> None:
    torch.manual_seed(0)
    eager = Layer()
    ours = copy.deepcopy(eager)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    pytree_ckpt.apply_activation_checkpointing(ours, offload=manager)
    x = torch.randn(8, 32)
    packed = torch.randint(0, 256, (512,), dtype=torch.uint8)
    absmax = torch.rand(64) + 0.5
    wide = torch.randn(8, 64 if strided else 32).to(dtype)
    x8 = wide[:, 16:48] if strided else wide
    s8 = torch.tensor(0.5)
    results = []
    for model in (eager, ours):
        leaves = [t.clone().requires_grad_() for t in (x, absmax, s8)]
        out = model(leaves[0], packed, leaves[1], x8, leaves[2])
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves),
                        *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    stats = manager.stats()
    expected = 8 * 32 * 4 + 512 + 64 * 4 + wide.untyped_storage().nbytes() + 4
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == expected
