"""Layers and helpers the offload tests share: a CPU manager, small residual layers, stacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import apply_activation_checkpointing

__all__ = ["Block", "FailingBackward", "Gated", "Layer", "grads_with_last_input_changed", "manager",
           "offloaded_stack", "stack"]


def manager(**config: Any) -> OffloadManager:
    """A CPU manager that offloads every window storage (``min_bytes=0``) unless told not to."""
    return OffloadManager(OffloadConfig(**{"min_bytes": 0, **config}), device="cpu")


class Block(nn.Module):
    """The residual MLP block that the peak-memory tests (CPU and CUDA) stack."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class Layer(nn.Module):
    """A width-32 residual layer: one saved input per call, cheap enough for many steps."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h))


class Gated(nn.Module):
    """A ``Layer`` with a second input, a gate the multiply saves: two storages per window."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * gate


class FailingBackward(torch.autograd.Function):
    """Passes ``h`` on; its backward raises (a step that fails partway through backward)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


def offloaded_stack(m: OffloadManager, n: int, layer: type[nn.Module] = Layer) -> nn.ModuleList:
    """``n`` layers, each checkpointed with offload through ``m``."""
    layers = nn.ModuleList(layer() for _ in range(n))
    for each in layers:
        apply_activation_checkpointing(each, offload=m)
    return layers


def stack(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def grads_with_last_input_changed(m: OffloadManager, change: Callable[[torch.Tensor], Any], *,
                                  layer: type[nn.Module] = Layer, n: int = 3
                                  ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The gradients of an eager twin, and of ``n`` layers offloaded through ``m`` whose last
    layer's input is handed to ``change`` between forward and backward (freed, regrown, ...)."""
    layers = offloaded_stack(m, n, layer)
    eager = nn.ModuleList(layer() for _ in range(n))
    eager.load_state_dict(layers.state_dict())
    x = torch.randn(8, 32, requires_grad=True)
    stack(eager, x).sum().backward()
    expected = [p.grad for p in eager.parameters()] + [x.grad]
    x.grad = None
    h = stack(layers[:-1], x)
    out = layers[-1](h)
    change(h)
    out.sum().backward()
    return expected, [p.grad for p in layers.parameters()] + [x.grad]
