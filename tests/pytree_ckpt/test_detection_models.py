"""Detection and segmentation heads (DETR, Deformable DETR, Mask2Former, FPN, YOLO) behind the
boundary, each against an eager twin bit for bit in fp32 (loss, every gradient, buffers and the
default generator's state after each step), with images of two sizes accumulated in one step
(helper OX). The shape-keyed caches that differ: test_forward_numbers.py and
test_discard_state.py (strict xfails)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import KeptCallables, KeptOps, RecomputeConfig, apply_recompute_config


def _steps(make: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any],
           run: Callable[[nn.Module, int], torch.Tensor], steps: int = 2) -> list[str]:
    """The differences between ``make()`` and a copy ``wrap`` checkpoints over ``steps``."""
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager)
    wrap(ours)
    diffs = []
    for step in range(steps):
        got = []
        for model in (eager, ours):
            torch.manual_seed(100 + step)
            loss = run(model, step)
            loss.backward()
            got.append((loss.detach(), [(n, p.grad) for n, p in model.named_parameters()],
                        {k: v.clone() for k, v in model.state_dict().items()},
                        torch.get_rng_state()))
            model.zero_grad(set_to_none=True)
        (le, ge, be, re), (lo, go, bo, ro) = got
        diffs += [f"{step} loss"] * (not torch.equal(le, lo))
        diffs += [f"{step} {n}" for (n, a), (_, b) in zip(ge, go)
                  if (a is None) != (b is None) or a is not None and not torch.equal(a, b)]
        diffs += [f"{step} {k}" for k in be if not torch.equal(be[k], bo[k])]
        diffs += [f"{step} rng"] * (not torch.equal(re, ro))
    return diffs


# -- YOLO heads: grids cached on the module, keyed by the feature map's size -----------------

class GridHead(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.conv, self.mode, self.cache = nn.Conv2d(3, 6, 3, padding=1), mode, {}

    @staticmethod
    def grid(h: int, w: int) -> torch.Tensor:
        ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32),
                                torch.arange(w, dtype=torch.float32), indexing="ij")
        return torch.stack([xs, ys], -1)[None]

    @functools.lru_cache(maxsize=4)
    def cached_grid(self, h: int, w: int) -> torch.Tensor:
        return self.grid(h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.conv(x).permute(0, 2, 3, 1)
        h, w = p.shape[1:3]
        if self.mode == "dict":
            if (h, w) not in self.cache:
                self.cache[(h, w)] = self.grid(h, w)
            g = self.cache[(h, w)]
        elif self.mode == "lru_cache":
            g = self.cached_grid(h, w)
        else:  # YOLOv5: one grid, rebuilt when its own shape differs
            if not hasattr(self, "g") or self.g.shape[1:3] != (h, w):
                self.g = self.grid(h, w)
            g = self.g
        return torch.cat([(p[..., :2].sigmoid() * 2 - 0.5 + g) * 8, p[..., 2:4].exp(), p[..., 4:]], -1)


@pytest.mark.parametrize("mode", ["dict", "lru_cache", "own_shape"])
def test_yolo_grids_cached_by_size_over_micro_batches_of_two_sizes_give_eager_numbers(mode) -> None:
    sizes = [[(8, 8), (6, 10)], [(6, 10), (4, 4)], [(8, 8), (6, 10)]]

    def run(model: nn.Module, step: int) -> torch.Tensor:
        return sum(model(torch.randn(2, 3, *hw)).square().mean() for hw in sizes[step])

    wrap = lambda m: pytree_ckpt.apply_activation_checkpointing(m, verify_replay=True)
    assert _steps(lambda: GridHead(mode), wrap, run, steps=3) == []


# -- Deformable DETR: FPN, grid_sample with predicted offsets, iterative box refinement -------

def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class FPN(nn.Module):
    def __init__(self, interp: str) -> None:
        super().__init__()
        self.c = nn.ModuleList([nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 8, 3, 2, 1),
                                nn.Conv2d(8, 8, 3, 2, 1)])
        self.lat = nn.ModuleList([nn.Conv2d(8, 16, 1) for _ in range(3)])
        self.interp = interp

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        feats = []
        for c in self.c:
            x = c(x).relu()
            feats.append(x)
        outs = [self.lat[2](feats[2])]
        for i in (1, 0):
            lat, top = self.lat[i](feats[i]), outs[0]
            if self.interp == "nearest_scale_factor":
                up = F.interpolate(top, scale_factor=2.0, mode="nearest")[..., :lat.shape[-2], :lat.shape[-1]]
                up = F.pad(up, (0, lat.shape[-1] - up.shape[-1], 0, lat.shape[-2] - up.shape[-2]))
            else:
                mode, corners = self.interp.split("_")
                up = F.interpolate(top, size=lat.shape[-2:], mode=mode,
                                   align_corners=None if mode == "nearest" else corners == "corners")
            outs.insert(0, lat + up)
        return {"p3": outs[0], "p4": outs[1], "p5": outs[2]}


class DeformAttn(nn.Module):
    def __init__(self, mode: str, corners: bool, d: int = 16, levels: int = 3, points: int = 4) -> None:
        super().__init__()
        self.off, self.attw = nn.Linear(d, levels * points * 2), nn.Linear(d, levels * points)
        self.val, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.levels, self.points, self.mode, self.corners = levels, points, mode, corners

    def forward(self, q: torch.Tensor, ref: torch.Tensor, feats: list[torch.Tensor]) -> torch.Tensor:
        B, Q, d = q.shape
        off = self.off(q).view(B, Q, self.levels, self.points, 2)
        w = self.attw(q).view(B, Q, -1).softmax(-1).view(B, Q, self.levels, self.points)
        shapes = [f.shape[-2:] for f in feats]
        # one value projection over all levels (a weight used once per call: exact)
        values = self.val(torch.cat([f.flatten(2).transpose(1, 2) for f in feats], 1))
        out = 0
        for lvl, v in enumerate(values.split([h * w_ for h, w_ in shapes], 1)):
            H, W = shapes[lvl]
            loc = ref[:, :, None] + off[:, :, lvl] / torch.tensor([W, H], dtype=q.dtype)
            s = F.grid_sample(v.transpose(1, 2).reshape(B, d, H, W), loc * 2 - 1, mode=self.mode,
                              padding_mode="zeros", align_corners=self.corners)
            out = out + (s * w[:, :, lvl][:, None]).sum(-1).transpose(1, 2)
        return self.out(out)


class DecoderLayer(nn.Module):
    def __init__(self, mode: str, corners: bool, d: int = 16) -> None:
        super().__init__()
        self.sa = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ca = DeformAttn(mode, corners, d)
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, d))
        self.box, self.cls, self.drop = nn.Linear(d, 4), nn.Linear(d, 5), nn.Dropout(0.1)

    def forward(self, q, ref, feats):
        q = self.n1(q + self.drop(self.sa(q, q, q)[0]))
        q = self.n2(q + self.ca(q, ref[..., :2], feats))
        q = self.n3(q + self.ff(q))
        new_ref = (self.box(q) + inverse_sigmoid(ref)).sigmoid()
        return q, new_ref, [{"logits": self.cls(q), "boxes": new_ref}]


class DeformableDETR(nn.Module):
    def __init__(self, interp: str = "bilinear_edges", mode: str = "bilinear",
                 corners: bool = False) -> None:
        super().__init__()
        self.fpn = FPN(interp)
        self.query, self.level = nn.Parameter(torch.randn(6, 16)), nn.Parameter(torch.randn(3, 16))
        self.ref = nn.Linear(16, 4)
        self.layers = nn.ModuleList([DecoderLayer(mode, corners) for _ in range(2)])

    def forward(self, img: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        f = self.fpn(img)
        feats = [f[k] + self.level[i, :, None, None] for i, k in enumerate(("p3", "p4", "p5"))]
        q = self.query[None].expand(img.shape[0], -1, -1)
        ref, aux = self.ref(q).sigmoid(), []
        for layer in self.layers:
            q, new_ref, out = layer(q, ref, feats)
            aux += out
            ref = new_ref.detach()  # iterative refinement: no gradient through the references
        return aux


def _greedy_match(logits: torch.Tensor, boxes: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A matching outside the model, on ``.detach().cpu()`` copies."""
    cost = torch.cdist(boxes.detach().cpu(), target) - logits.detach().cpu().softmax(-1)[..., :1]
    return cost.argmin(-1)


def _detr_step(model: nn.Module, step: int) -> torch.Tensor:
    loss = 0
    for hw in [(32, 32), (24, 40)]:  # two image sizes before one backward
        target = torch.rand(4, 4)
        for out in model(torch.randn(2, 3, *hw)):
            for b in range(2):
                idx = _greedy_match(out["logits"][b], out["boxes"][b], target)
                loss = loss + (out["boxes"][b] - target[idx]).abs().mean() \
                    + F.cross_entropy(out["logits"][b], idx.clamp(max=4))
    return loss


def _layers_and_fpn(**options: Any) -> Callable[[nn.Module], None]:
    def wrap(model: nn.Module) -> None:
        for module in [*model.layers, model.fpn]:
            pytree_ckpt.apply_activation_checkpointing(module, **options)
    return wrap


@pytest.mark.parametrize("mode,corners", [("bilinear", False), ("bilinear", True),
                                          ("nearest", False), ("nearest", True)])
def test_deformable_grid_sample_with_predicted_offsets_over_two_image_sizes_gives_eager_numbers(
        mode, corners) -> None:
    make = lambda: DeformableDETR(mode=mode, corners=corners)
    assert _steps(make, _layers_and_fpn(verify_replay=True), _detr_step) == []


@pytest.mark.parametrize("interp", ["nearest_scale_factor", "nearest_size", "bilinear_edges",
                                    "bilinear_corners"])
def test_fpn_upsampling_by_size_or_scale_factor_over_two_image_sizes_gives_eager_numbers(
        interp) -> None:
    make = lambda: DeformableDETR(interp=interp)
    assert _steps(make, _layers_and_fpn(), _detr_step, steps=1) == []


def test_deformable_detr_with_offload_and_kept_grid_samples_gives_eager_numbers() -> None:
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0))
    assert _steps(DeformableDETR, _layers_and_fpn(offload=manager), _detr_step, steps=1) == []
    for target in (KeptCallables("DeformAttn.forward"), KeptOps("aten::grid_sampler_2d")):
        wrap = lambda m: apply_recompute_config(m.layers, RecomputeConfig(1.0, save=["attn"]),
                                                {"attn": target})
        assert _steps(DeformableDETR, wrap, _detr_step, steps=1) == [], target


# -- Mask2Former: attention masked by the previous layer's mask prediction ---------------------

class FrozenBatchNorm2d(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.rand(n) + 0.5)
        self.register_buffer("bias", torch.randn(n))
        self.register_buffer("running_mean", torch.randn(n))
        self.register_buffer("running_var", torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        return x * scale[:, None, None] + (self.bias - self.running_mean * scale)[:, None, None]


class MaskedLayer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ca = nn.MultiheadAttention(d, 2, batch_first=True, dropout=0.1)
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.norm, self.mask_embed, self.cls = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, q, mem, mask_logits):
        attn_mask = mask_logits.sigmoid() < 0.5  # a boolean decided from floats, inside
        attn_mask[attn_mask.all(-1)] = False
        q = q + self.ca(q, mem, mem, attn_mask=attn_mask.repeat_interleave(2, 0))[0]
        q = self.norm(q + self.ff(q))
        masks = torch.einsum("bqd,bnd->bqn", self.mask_embed(q), mem)
        return q, masks, [{"pred_logits": self.cls(q), "pred_masks": masks}]


class Mask2Former(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        bn = {"frozen": FrozenBatchNorm2d, "batch": nn.BatchNorm2d}[norm]
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), bn(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, 2, 1, bias=False), bn(16), nn.ReLU())
        self.query, self.init_mask = nn.Parameter(torch.randn(5, 16)), nn.Linear(16, 16)
        self.layers = nn.ModuleList([MaskedLayer() for _ in range(3)])

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        mem = self.backbone(img).flatten(2).transpose(1, 2)
        q = self.query[None].expand(img.shape[0], -1, -1)
        masks = torch.einsum("bqd,bnd->bqn", self.init_mask(q), mem)
        outs = []
        for layer in self.layers:
            q, masks, out = layer(q, mem, masks)
            outs += out
        return sum(o["pred_masks"].sigmoid().mean() + o["pred_logits"].logsumexp(-1).mean()
                   for o in outs)


@pytest.mark.parametrize("norm", ["frozen", "batch", "sync"])
def test_mask2former_masked_attention_from_the_previous_layer_gives_eager_numbers(norm) -> None:
    # the whole model in one boundary: the backbone's output, read by every layer, would
    # otherwise sum its gradient per call (docs/limits.md, float rounding)
    def make() -> nn.Module:
        model = Mask2Former("batch" if norm == "sync" else norm)
        return nn.SyncBatchNorm.convert_sync_batchnorm(model) if norm == "sync" else model

    def run(model: nn.Module, step: int) -> torch.Tensor:
        model.train()
        model.layers[1].eval()  # one head in eval mode while the others train
        return sum(model(torch.randn(2, 3, *hw)) for hw in [(32, 32), (16, 24)])

    wrap = lambda m: pytree_ckpt.apply_activation_checkpointing(m, verify_replay=True)
    assert _steps(make, wrap, run) == []
    layers_only = lambda m: [pytree_ckpt.apply_activation_checkpointing(layer) for layer in m.layers]
    assert [d for d in _steps(make, layers_only, run) if "backbone" not in d] == []


# -- two-stage proposals and DN-DETR queries drawn inside the forward -------------------------

def _topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(scores, k, dim=1).indices


class TwoStage(nn.Module):
    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.score, self.box, self.dec = nn.Linear(16, 1), nn.Linear(16, 4), nn.Linear(16, 4)
        self.label = nn.Embedding(5, 12)
        self.reuse = reuse

    def forward(self, mem: torch.Tensor, gt: torch.Tensor) -> dict[str, Any]:
        mem = self.enc(mem)
        s = self.score(mem).squeeze(-1)
        idx = pytree_ckpt.reuse_during_recompute(_topk, s.detach(), 4) if self.reuse else \
            torch.topk(s, 4, dim=1).indices
        keep = s > s.mean()  # boolean masking with a data-dependent shape
        props = torch.gather(self.box(mem), 1, idx[..., None].expand(-1, -1, 4)).sigmoid()
        q = torch.gather(mem, 1, idx[..., None].expand(-1, -1, 16))
        boxes = (self.dec(q) + torch.logit(props.detach(), eps=1e-5)).sigmoid()
        noise = (torch.rand_like(gt) * 2 - 1) * 0.4 * gt[..., 2:].repeat(1, 1, 2)  # DN-DETR
        labels = torch.randint(0, 5, gt.shape[:2])
        dn = torch.cat([self.label(labels), (gt + noise).clamp(0, 1)], -1)
        return {"boxes": boxes, "kept": mem[keep].sum(), "dn": dn, "pad_size": gt.shape[1] * 2,
                "order": s.argsort(1, descending=True)}


@pytest.mark.parametrize("reuse", [False, True])
def test_topk_proposals_and_noised_queries_drawn_inside_give_eager_numbers(reuse) -> None:
    def run(model: nn.Module, step: int) -> torch.Tensor:
        loss = 0
        for n in (12, 20):
            out = model(torch.randn(2, n, 16), torch.rand(2, 3, 4))
            assert out["pad_size"] == 6 and out["order"].dtype == torch.int64
            loss = loss + out["boxes"].square().sum() + out["kept"] * 1e-2 + out["dn"].sum()
        return loss

    wrap = lambda m: pytree_ckpt.apply_activation_checkpointing(m, verify_replay=True)
    assert _steps(lambda: TwoStage(reuse), wrap, run) == []


# -- an RPN with NMS inside the forward (a Python loop on .item()) ----------------------------

def _nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    order, keep = scores.argsort(descending=True), []
    while order.numel() > 0:
        i = order[0].item()
        keep.append(i)
        rest = boxes[order[1:]]
        lt = torch.max(boxes[i, :2], rest[:, :2])
        rb = torch.min(boxes[i, 2:], rest[:, 2:])
        inter = (rb - lt).clamp(min=0).prod(-1)
        area = (rest[:, 2:] - rest[:, :2]).prod(-1)
        iou = inter / ((boxes[i, 2:] - boxes[i, :2]).prod() + area - inter)
        order = order[1:][iou <= threshold]
    return torch.tensor(keep, dtype=torch.long)


class RPN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 5, 1)

    def forward(self, f: torch.Tensor) -> dict[str, torch.Tensor]:
        p = self.conv(f).flatten(2).transpose(1, 2)[0]
        xy, wh = p[:, :2].sigmoid() * 10, p[:, 2:4].exp()
        boxes, scores = torch.cat([xy - wh / 2, xy + wh / 2], -1), p[:, 4]
        keep = _nms(boxes.detach(), scores.detach(), 0.5)
        return {"boxes": boxes[keep], "scores": scores[keep], "keep": keep,
                "positive": scores[scores > 0], "where": (scores > 0).nonzero()}


def test_nms_inside_the_forward_with_data_dependent_outputs_gives_eager_numbers() -> None:
    def run(model: nn.Module, step: int) -> torch.Tensor:
        loss = 0
        for hw in [(6, 6), (4, 7)]:
            out = model(torch.randn(1, 4, *hw))
            assert out["keep"].dtype == out["where"].dtype == torch.int64
            loss = loss + out["boxes"].sum() + out["scores"].sigmoid().sum() + out["positive"].sum()
        return loss

    wrap = lambda m: pytree_ckpt.apply_activation_checkpointing(m, verify_replay=True)
    assert _steps(RPN, wrap, run) == []
