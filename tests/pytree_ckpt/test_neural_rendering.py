"""NeRF-style rendering, hash-grid and tri-plane encodings, mesh convolutions and a soft
rasteriser, written in plain torch and checkpointed, compared with their eager twins bit for
bit in fp32: loss, every parameter's gradient, buffers and the default generator after the
step (helper OW)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
import pytree_ckpt
from pytree_ckpt import (KeptOps, RecomputeConfig, SaveUnit, apply_recompute_config,
                         reuse_during_recompute)


def _posenc(x: torch.Tensor, levels: int) -> torch.Tensor:
    xb = x[..., None] * 2.0 ** torch.arange(levels)
    return torch.cat([x, xb.sin().flatten(-2), xb.cos().flatten(-2)], -1)


class _Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(27, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, pts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(_posenc(pts, 4))
        return out[..., :3].sigmoid(), F.softplus(out[..., 3])


def _render(rgb: torch.Tensor, sigma: torch.Tensor, z: torch.Tensor, d: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    delta = torch.cat([z[..., 1:] - z[..., :-1], torch.full_like(z[..., :1], 1e10)], -1)
    alpha = 1 - torch.exp(-sigma * delta * d.norm(dim=-1, keepdim=True))
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha + 1e-10], -1),
                          -1)[..., :-1]
    w = alpha * trans
    return (w[..., None] * rgb).sum(-2), w


def _sample_pdf(bins: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    pdf = (weights + 1e-5) / (weights + 1e-5).sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[..., :1]), torch.cumsum(pdf, -1)], -1)
    u = torch.rand(*cdf.shape[:-1], n)
    inds = torch.searchsorted(cdf, u, right=True)
    g = torch.stack([(inds - 1).clamp(min=0), inds.clamp(max=cdf.shape[-1] - 1)], -1)
    shape = [*g.shape[:-1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(-2).expand(shape), -1, g)
    bins_g = torch.gather(bins.unsqueeze(-2).expand(shape), -1, g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    return bins_g[..., 0] + (u - cdf_g[..., 0]) / denom * (bins_g[..., 1] - bins_g[..., 0])


class NeRF(nn.Module):
    """Stratified sampling (``torch.rand``), a coarse field, inverse-transform sampling
    (``cumsum``, ``searchsorted``, ``torch.rand``) for a fine field, volume rendering; a step
    counter on ``self`` and a small occupancy buffer updated in forward every second call."""

    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        self.coarse, self.fine = _Field(), _Field()
        self.register_buffer("grid", torch.ones(4, 4, 4))
        self.calls, self.reuse = 0, reuse

    def forward(self, o: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls % 2 == 0:
            with torch.no_grad():
                self.grid.mul_(0.9).add_(torch.rand(4, 4, 4) * 0.1)
        t = torch.linspace(0, 1, 10)
        z = (2.0 * (1 - t) + 6.0 * t).expand(o.shape[0], 10)
        mids = .5 * (z[..., 1:] + z[..., :-1])
        lower, upper = torch.cat([z[..., :1], mids], -1), torch.cat([mids, z[..., -1:]], -1)
        z = lower + (upper - lower) * torch.rand(z.shape)
        pts = o[:, None] + d[:, None] * z[..., None]
        cell = ((pts.detach() + 4) / 2).long().clamp(0, 3)
        rgb, sigma = self.coarse(pts)
        coarse, w = _render(rgb, sigma * self.grid[cell[..., 0], cell[..., 1], cell[..., 2]], z, d)
        bins = .5 * (z[..., 1:] + z[..., :-1])
        if self.reuse:
            zs = reuse_during_recompute(_sample_pdf, bins, w[..., 1:-1].detach(), 10)
        else:
            zs = _sample_pdf(bins, w[..., 1:-1].detach(), 10)
        zf = torch.sort(torch.cat([z, zs], -1), -1).values
        rgb, sigma = self.fine(o[:, None] + d[:, None] * zf[..., None])
        return {"coarse": coarse, "fine": _render(rgb, sigma, zf, d)[0]}


def _nerf_steps(model: nn.Module, call: Callable[..., Any], chunks: tuple[int, ...]
                ) -> list[torch.Tensor]:
    taken: list[torch.Tensor] = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        n = sum(chunks)
        o = torch.randn(n, 3, generator=g) * .1
        d = F.normalize(torch.randn(n, 3, generator=g), dim=-1)
        target = torch.rand(n, 3, generator=g)
        torch.manual_seed(100 + step)
        loss = torch.zeros(())
        for ro, rd, rt in zip(o.split(chunks), d.split(chunks), target.split(chunks)):
            out = call(model, ro, rd)                     # rays rendered chunk by chunk
            loss = loss + (out["coarse"] - rt).square().sum() + (out["fine"] - rt).square().sum()
        loss.backward()
        taken += [loss.detach(), *(p.grad for p in model.parameters()), model.grid.clone(),
                  torch.rand(3)]
        model.zero_grad(set_to_none=True)
    return taken


def _offload() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


@pytest.mark.parametrize("reuse", [False, True], ids=["samples_redrawn", "samples_reused"])
@pytest.mark.parametrize("how", ["whole_verify", "whole_offload", "fields", "checkpoint_fn",
                                 "kept_searchsorted"])
def test_chunked_nerf_rendering_with_hierarchical_sampling_gives_eager_numbers(
        how: str, reuse: bool) -> None:
    torch.manual_seed(0)
    eager = NeRF(reuse)
    ours = copy.deepcopy(eager)
    call: Callable[..., Any] = lambda m, o, d: m(o, d)
    if how == "whole_verify":
        pytree_ckpt.apply_activation_checkpointing(ours, verify_replay=True)
    elif how == "whole_offload":
        pytree_ckpt.apply_activation_checkpointing(ours, offload=_offload())
    elif how == "fields":                                  # nested: the fields inside the whole
        pytree_ckpt.checkpoint_layers([ours.coarse, ours.fine], verify_replay=True)
        pytree_ckpt.apply_activation_checkpointing(ours, verify_replay=True)
    elif how == "checkpoint_fn":
        call = lambda m, o, d: pytree_ckpt.checkpoint(m, o, d)
    else:
        apply_recompute_config([ours], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::searchsorted", "aten::cumprod",
                                                       "aten::rand")}, verify_replay=True)
    chunks = (6, 6, 3)                                     # the last chunk short
    assert all(torch.equal(a, b) for a, b in zip(_nerf_steps(eager, call, chunks),
                                                 _nerf_steps(ours, call, chunks), strict=True))


_PRIMES = torch.tensor([1, 2654435761, 805459861])


class HashGrid(nn.Module):
    """Instant-NGP's multiresolution hash encoding: a big table indexed by hashed integer
    corners computed under no_grad inside the layer, trilinear weights with grad."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.size = 2 ** 12
        self.table = nn.Embedding(3 * self.size, 2, sparse=sparse)
        nn.init.uniform_(self.table.weight, -0.1, 0.1)
        self.mlp = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        corners = torch.stack(torch.meshgrid(*[torch.arange(2)] * 3, indexing="ij"), -1).view(8, 3)
        feats = []
        for level in range(3):
            xs = x * 4 * 2 ** level
            with torch.no_grad():
                h = ((xs.floor().long()[:, None] + corners) * _PRIMES).unbind(-1)
                idx = (h[0] ^ h[1] ^ h[2]) % self.size + level * self.size
            frac = xs - xs.floor()
            w = torch.where(corners.bool(), frac[:, None], 1 - frac[:, None]).prod(-1)
            feats.append((self.table(idx) * w[..., None]).sum(1))
        return self.mlp(torch.cat(feats, -1))


class MeshConv(nn.Module):
    """A mesh convolution: a normalised sparse COO adjacency buffer (``torch.sparse.mm``) and
    a ``scatter_reduce`` plus ``index_add_`` aggregation over the edges."""

    def __init__(self, faces: torch.Tensor, n: int, reduce: str, include_self: bool) -> None:
        super().__init__()
        e = torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
        e = torch.cat([e, e.flip(1)]).T
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adj = torch.sparse_coo_tensor(e, torch.ones(e.shape[1]), (n, n)).coalesce()
        deg = torch.sparse.sum(adj, 1).to_dense()
        self.register_buffer("adj", torch.sparse_coo_tensor(
            adj.indices(), adj.values() / deg[adj.indices()[0]], (n, n)).coalesce())
        self.register_buffer("edges", e)
        self.lin, self.msg = nn.Linear(8, 8), nn.Linear(8, 8)
        self.reduce, self.include_self = reduce, include_self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, dst = self.edges
        m = self.msg(x)[src]
        agg = torch.full_like(x, 0.5).scatter_reduce(0, dst[:, None].expand_as(m), m,
                                                     self.reduce, include_self=self.include_self)
        return torch.tanh(torch.sparse.mm(self.adj, self.lin(x)) + agg
                          + torch.zeros_like(x).index_add_(0, dst, m * 0.5)) + x


class SoftRaster(nn.Module):
    """A soft rasteriser: per-pixel sigmoid coverage of each face, a softmax over depth."""

    def __init__(self, faces: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("faces", faces)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 6), torch.linspace(-1, 1, 6), indexing="ij")
        self.register_buffer("pix", torch.stack([xs, ys], -1).view(-1, 2))
        self.sigma = nn.Parameter(torch.tensor(0.05))

    def forward(self, verts: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
        tri = verts[self.faces]
        d = ((self.pix[:, None] - tri[..., :2].mean(1)[None]) ** 2).sum(-1)
        cover = torch.sigmoid(-(d - 0.1) / self.sigma)
        w = torch.softmax(-tri[..., 2].mean(1) / 0.1 + (cover + 1e-6).log(), -1)
        return w @ colour[self.faces].mean(1)


class MeshNet(nn.Module):
    def __init__(self, faces: torch.Tensor, reduce: str, include_self: bool, sparse: bool
                 ) -> None:
        super().__init__()
        self.enc = HashGrid(sparse)
        self.inp, self.colour, self.offset = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.convs = nn.ModuleList(MeshConv(faces, 30, reduce, include_self) for _ in range(2))
        self.raster = SoftRaster(faces)

    def forward(self, verts: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.enc(verts * 0.5 + 0.5))
        for conv in self.convs:
            h = conv(h)
        return self.raster(verts + 0.1 * self.offset(h), self.colour(h).sigmoid())


@pytest.mark.parametrize("reduce, include_self, sparse", [
    ("amax", True, True), ("amax", False, False), ("amin", False, False), ("mean", True, False),
    ("mean", False, False), ("prod", True, False), ("sum", False, False)])
def test_hash_grid_mesh_convolutions_and_a_soft_rasteriser_give_eager_gradients(
        reduce: str, include_self: bool, sparse: bool) -> None:
    g = torch.Generator().manual_seed(0)
    verts = torch.rand(30, 3, generator=g) * 2 - 1
    faces = torch.stack([torch.randperm(30, generator=g)[:3] for _ in range(40)])
    torch.manual_seed(0)
    eager = MeshNet(faces, reduce, include_self, sparse)
    ours = copy.deepcopy(eager)
    pytree_ckpt.checkpoint_layers([ours.enc, *ours.convs, ours.raster], verify_replay=True,
                                  offload=_offload())
    results = []
    for model in (eager, ours):
        loss = sum(model(v).square().sum() for v in (verts, verts * 0.9 + 0.05))  # 2 micro-batches
        loss.backward()
        results.append([loss.detach(), *(p.grad.to_dense() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


class Triplane(nn.Module):
    def __init__(self, mode: str, padding: str) -> None:
        super().__init__()
        self.planes = nn.Parameter(torch.randn(3, 4, 16, 16))
        self.volume = nn.Parameter(torch.randn(1, 4, 8, 8, 8))
        self.head = nn.Linear(8, 4)
        self.mode, self.padding = mode, padding

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        coords = torch.stack([p[:, [0, 1]], p[:, [1, 2]], p[:, [0, 2]]])[:, None]
        f = F.grid_sample(self.planes, coords, mode=self.mode, padding_mode=self.padding,
                          align_corners=False).sum(0)[:, 0].T
        v = F.grid_sample(self.volume, p[None, None, None], align_corners=False)[0, :, 0, 0].T
        return self.head(torch.cat([f, v], -1))


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_triplane_and_voxel_grid_sample_encodings_give_eager_gradients(mode: str, padding: str
                                                                       ) -> None:
    torch.manual_seed(0)
    eager = Triplane(mode, padding)
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), verify_replay=True)
    results = []
    for model in (eager, ours):
        p = (torch.rand(50, 3, generator=torch.Generator().manual_seed(1)) * 2.2 - 1.1)
        p.requires_grad_()
        model(p).square().sum().backward()
        results.append([p.grad, *(q.grad for q in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


class Voxelize(nn.Module):
    """Points pooled into voxels found with ``torch.unique(return_inverse=True)`` (a
    data-dependent number of voxels), mean and max per voxel, scattered back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(3, 8), nn.Linear(8, 3)

    def forward(self, pts: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        uniq, inv, cnt = torch.unique((pts * 4).floor().long(), dim=0, return_inverse=True,
                                      return_counts=True)
        f = self.lin(feats)
        mean = torch.zeros(uniq.shape[0], 8).index_add_(0, inv, f) / cnt[:, None]
        top = torch.zeros(uniq.shape[0], 8).scatter_reduce(0, inv[:, None].expand(-1, 8), f,
                                                            "amax", include_self=False)
        return self.out((mean + top)[inv]), uniq


def test_voxel_pooling_over_clouds_of_different_sizes_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Voxelize()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), verify_replay=True,
                                                      offload=_offload())
    results = []
    for model in (eager, ours):
        g = torch.Generator().manual_seed(2)
        clouds = [(torch.rand(n, 3, generator=g), torch.randn(n, 3, generator=g).requires_grad_())
                  for n in (60, 41, 77)]                  # accumulated before one backward
        outs = [model(p, f) for p, f in clouds]
        sum(o.square().sum() for o, _ in outs).backward()
        results.append([*(u for _, u in outs), *(f.grad for _, f in clouds),
                        *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
