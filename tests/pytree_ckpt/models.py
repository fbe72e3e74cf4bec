"""Small modules and outputs that several of the package's test files use."""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn

from pytree_ckpt import CheckpointWithoutOutput, reuse_during_recompute

__all__ = ["DictSettings", "Dropped", "Gate", "JitteredOnly", "Log", "MappingOutput", "Stack",
           "UsesOwnWeight", "jittered_topk", "project_norm"]


class DictSettings:
    """Settings kept in a dict and read by ``__getattr__``, which raises KeyError (not
    AttributeError) for any other name, as config classes do: eager never asks such an object
    for ``__self__`` or ``__name__``, and the boundary must not fail where it does (tree.dunder;
    helpers HF, HG). Subclasses add ``__call__``."""

    def __init__(self, **settings: object) -> None:
        self.__dict__["_settings"] = settings

    def __getattr__(self, name: str) -> object:
        return self._settings[name]


class Log(list):  # type: ignore[type-arg]
    """A record a module keeps of its calls, the replay's included. A plain ``list`` of plain
    values on a module is read before the forward and gets its entries back after the replay
    (NOTE [numbers and flags as the forward began] in pytree_ckpt/forward_numbers.py), which
    drops what the replay appends, as eager never ran it; a subclass is read by identity only,
    so a test sees each pass."""


class Stack(nn.Module):
    """Two linear layers in a ModuleList: a tree that tests edit (insert, delete, swap)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Gate(nn.Module):
    """A module with a method (``project``) that a save unit can name as ``Gate.project``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 8)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x).tanh()


class MappingOutput(collections.OrderedDict):  # how transformers' ModelOutput is built
    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


def jittered_topk(h: torch.Tensor) -> torch.Tensor:
    return torch.topk(h + torch.rand_like(h) * 1e-3, 2, dim=-1).indices  # draws random numbers


class JitteredOnly(nn.Module):
    """Jittered routing, no other random op: gradients depend only on the replayed ids."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        ids = reuse_during_recompute(jittered_topk, h.detach())
        return torch.gather(h, -1, ids).sum(-1, keepdim=True) * h


class UsesOwnWeight(nn.Module):
    """Uses its own weight and a weight argument: called with ``self.lin.weight``, one weight
    is used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) @ w


class Dropped(nn.Module):
    """Dropout and a BatchNorm: both read their module's training flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(torch.tanh(self.lin(x))))


class RmsNorm(nn.Module):
    """An RMS norm with a weight (what output discard usually frees the output of)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


def project_norm(project: nn.Module, norm: nn.Module, x: torch.Tensor, /, *,
                 discard: bool) -> torch.Tensor:
    """``project(norm(x))``; with ``discard``, the norm's output is discarded once ``project``
    has used it and rebuilt in backward (output discard, as a checkpointed twin runs it)."""
    if not discard:
        return project(norm(x))
    ckpt = CheckpointWithoutOutput()
    out = project(ckpt.checkpoint(norm, x))
    ckpt.discard_output_and_register_recompute(out)
    return out


class CounterBesideEma(nn.Module):
    """A step counter (its version moves) and an EMA written through ``.data`` (none moves),
    in one buffer dict: NOTE [state a kernel writes] must compare the EMA although the dict's
    counter already marks it changed."""

    def __init__(self) -> None:
        super().__init__()
        self.step: torch.Tensor
        self.ema: torch.Tensor
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.step += 1
        self.ema.data.mul_(0.5).add_(h.mean(0).detach() * 0.5)
        return h * self.ema


class NormedLayer(nn.Module):
    """A BatchNorm beside a buffer the forward only reads (NOTE [state read, then changed by a
    later call]: both are snapshotted once the layer's forward changed state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("scale", torch.full((16,), 0.5))  # only read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale
