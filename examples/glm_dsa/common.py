"""Small building blocks shared by the layers: RMSNorm, RoPE and packed-sequence bookkeeping.

A packed batch is one row of ``T`` tokens holding several sequences back to back;
``cu_seqlens = [0, len_0, len_0 + len_1, ..., T]`` (int32) marks where each one starts. Every
helper here is pure tensor code (no ``.tolist()``), so it stays on the device and in a graph.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "apply_rope", "default_cu_seqlens", "position_ids", "rope_tables",
           "sequence_ids", "validate_cu_seqlens"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def default_cu_seqlens(total: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` for a row that holds a single sequence."""
    return torch.tensor([0, total], dtype=torch.int32, device=device)


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is ``[0, ..., total]``, non-decreasing int32.

    This reads the values on the host (one small copy); it runs once per model forward.
    """
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [0, ..., T], got "
                         f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}; tip: "
                         "data.make_packed_batch builds one")
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at T={total} and never decrease, got "
                         f"{values}; tip: it is the running sum of the packed sequence lengths")


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """For each of the ``total`` positions, the index of the packed sequence it belongs to."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


def position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Positions that restart at 0 at every packed sequence start (int64, shape ``[T]``)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return positions - cu_seqlens.long()[sequence_ids(cu_seqlens, total)]


def rope_tables(positions: torch.Tensor, dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``[T, dim]`` for the rotate-half RoPE convention (computed
    in float32, or in ``dtype`` when that is wider)."""
    wide = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device,
                                            dtype=wide) / dim)
    angles = positions.to(wide)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, ..., dim]``) by the per-position angles ``cos``/``sin`` ``[T, dim]``."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    # In x's dtype: fp32 tables must not promote a bf16 (autocast) q or k above v's dtype.
    cos, sin = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
