"""Small diffusion models (a UNet with a skip list, DiT blocks with adaLN) for the tests
comparing them against their eager twins (helper MU)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attn", "DiT", "DiTBlock", "Down", "ResBlock", "UNet", "Up", "grads", "noised_loss"]


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int, p: float = 0.1) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.drop = nn.GroupNorm(4, cout), nn.Dropout(p)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(temb))[:, :, None, None]
        return self.skip(x) + self.c2(self.drop(F.silu(self.n2(h))))


class Attn(nn.Module):
    """Self-attention over the flattened spatial tokens."""

    def __init__(self, c: int, heads: int = 2) -> None:
        super().__init__()
        self.n, self.qkv, self.o = nn.GroupNorm(4, c), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        t = self.n(x).flatten(2).transpose(1, 2)
        qkv = self.qkv(t).view(b, hh * ww, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, hh * ww, c)
        return x + self.o(a).transpose(1, 2).reshape(b, c, hh, ww)


class Down(nn.Module):
    """Returns the downsampled tensor and a list of skip tensors."""

    def __init__(self, cin: int, cout: int, tdim: int, attn: bool = False) -> None:
        super().__init__()
        self.r1, self.r2 = ResBlock(cin, cout, tdim), ResBlock(cout, cout, tdim)
        self.attn = Attn(cout) if attn else nn.Identity()
        self.down = nn.Conv2d(cout, cout, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.r1(x, temb)
        skips = [x]
        x = self.attn(self.r2(x, temb))
        skips.append(x)
        return self.down(x), skips


class Up(nn.Module):
    """Consumes a list of skip tensors, upsampling with ``F.interpolate``."""

    def __init__(self, cin: int, cskip: int, cout: int, tdim: int, attn: bool = False) -> None:
        super().__init__()
        self.r1, self.r2 = ResBlock(cin + cskip, cout, tdim), ResBlock(cout + cskip, cout, tdim)
        self.attn = Attn(cout) if attn else nn.Identity()

    def forward(self, x: torch.Tensor, skips: list[torch.Tensor], temb: torch.Tensor
                ) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = self.r1(torch.cat([x, skips[1]], 1), temb)
        return self.attn(self.r2(torch.cat([x, skips[0]], 1), temb))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    a = t[:, None].float() * freqs[None]
    return torch.cat([a.cos(), a.sin()], -1)


class UNet(nn.Module):
    def __init__(self, ch: int = 8, tdim: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.cemb, self.classes, self.tdim = nn.Embedding(classes + 1, tdim), classes, tdim
        self.d1, self.d2 = Down(ch, 16, tdim), Down(16, 16, tdim, attn=True)
        self.mid, self.mattn = ResBlock(16, 16, tdim), Attn(16)
        self.u2, self.u1 = Up(16, 16, 16, tdim, attn=True), Up(16, 16, ch, tdim)
        self.out = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        temb = self.temb(timestep_embedding(t, self.tdim)) + self.cemb(y)
        h, s1 = self.d1(self.inp(x), temb)
        h, s2 = self.d2(h, temb)
        h = self.u2(self.mattn(self.mid(h, temb)), s2, temb)
        return self.out(self.u1(h, s1, temb))


class DiTBlock(nn.Module):
    """adaLN-Zero style: the conditioning vector gives shift, scale and gate chunks."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.n1 = nn.LayerNorm(d, elementwise_affine=False)
        self.n2 = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv, self.proj, self.heads, self.p = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, p
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sm, scm, gm, sf, scf, gf = self.ada(c).chunk(6, dim=-1)
        b, n, d = x.shape
        h = self.n1(x) * (1 + scm[:, None]) + sm[:, None]
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        x = x + gm[:, None] * self.proj(a.transpose(1, 2).reshape(b, n, d))
        h = self.n2(x) * (1 + scf[:, None]) + sf[:, None]
        return x + gf[:, None] * F.dropout(self.mlp(h), self.p, self.training)


class DiT(nn.Module):
    def __init__(self, d: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 2, stride=2)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02)
        self.t = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.y, self.classes, self.d = nn.Embedding(classes + 1, d), classes, d
        self.blocks = nn.ModuleList(DiTBlock(d) for _ in range(depth))
        self.fin = nn.Linear(d, 12)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t(timestep_embedding(t, self.d)) + self.y(y)   # shared by every block
        for block in self.blocks:
            h = block(h, c)
        b, s = x.shape[0], x.shape[-1] // 2
        patches = self.fin(h).view(b, s, s, 3, 2, 2)
        return patches.permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


def noised_loss(net: Any, x0: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A training step's loss: classifier-free guidance drops the label with ``torch.rand``,
    the noise is drawn with ``torch.randn_like``, both inside whatever calls this."""
    drop = torch.rand(y.shape) < 0.3
    y = torch.where(drop, torch.full_like(y, net.classes), y)
    noise = torch.randn_like(x0)
    a = (1 - t.float() / 1000)[:, None, None, None]
    return F.mse_loss(net(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, y), noise)


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
