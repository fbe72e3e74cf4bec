"""What only a GPU can show: pinned host buffers, side streams, peak device memory.

Skipped cleanly without CUDA; `scripts/gpu_check.sh` runs them (with the GPU bench preset).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import checkpoint_layers
from tests.conftest import assert_same_grads

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def stack(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def test_host_buffers_are_pinned_and_copies_run_on_side_streams() -> None:
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    assert manager.device.index is not None  # "cuda" must match tensors on "cuda:0"
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    h = x * 2
    with manager.window([h]):
        loss = (h * h).sum()
    copy_ = next(iter(manager._pass[-1]().copies.values()))  # type: ignore[union-attr]
    assert copy_.host.is_pinned()
    assert copy_.d2h_event is not None
    assert manager.engine.d2h_stream != torch.cuda.current_stream()
    assert manager.engine.h2d_stream != torch.cuda.current_stream()
    loss.backward()
    assert torch.equal(x.grad, 8 * x.detach())
    assert manager.stats()["host_buffers_in_use"] == 0


def test_offload_gives_bit_identical_gradients_on_cuda() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(256) for _ in range(6)).cuda()
    twin = copy.deepcopy(layers)
    checkpoint_layers(twin, offload=OffloadManager(OffloadConfig(min_bytes=0), device="cuda"))
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    for model in (layers, twin):
        stack(model, x).square().mean().backward()
    assert_same_grads([p.grad for p in layers.parameters()], [p.grad for p in twin.parameters()])


def test_peak_memory_with_offload_drops_by_all_but_two_layer_inputs() -> None:
    torch.manual_seed(0)
    num_layers, tokens, width = 8, 8192, 1024
    layers = nn.ModuleList(Block(width) for _ in range(num_layers)).cuda()
    plain = copy.deepcopy(layers)
    checkpoint_layers(plain, offload=False)
    offloaded = copy.deepcopy(layers)
    manager = OffloadManager(OffloadConfig(min_bytes=1 << 20), device="cuda")
    checkpoint_layers(offloaded, offload=manager)
    input_bytes = tokens * width * 4

    def held_after_forward(model: nn.ModuleList) -> int:
        x = torch.randn(tokens, width, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = stack(model, x)
        manager.stats()  # releases device copies whose events completed
        torch.cuda.synchronize()
        manager.stats()
        held = torch.cuda.memory_allocated() - base
        out.sum().backward()
        return held

    held_after_forward(offloaded)  # warm the pool
    ckpt_bytes = held_after_forward(plain)
    off_bytes = held_after_forward(offloaded)
    assert ckpt_bytes - off_bytes >= (num_layers - 2) * input_bytes, (ckpt_bytes, off_bytes)
