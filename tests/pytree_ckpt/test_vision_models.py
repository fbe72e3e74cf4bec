"""Vision models against eager twins (helper NQ): Swin blocks (window partition, shifted
windows with torch.roll, a lazily filled attention-mask dict keyed by resolution, a relative
position bias table indexed by a buffer, DropPath, padding to a window multiple, image sizes
changing between steps), ViTDet (an interpolated absolute position embedding, a simple feature
pyramid, checkpoint(fn) on a stage returning a dict of feature maps), a DETR decoder (learned
queries, auxiliary losses from every layer, greedy matching on detached outputs), Mask R-CNN-style
heads over lists of variable-size (and empty) box tensors with grid_sample / gather ROI pooling,
output discard on LayerNorms, save units around window attention, offload, channels_last."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import CheckpointWithoutOutput, KeptCallables, RecomputeConfig, SaveUnit

D = 16


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws * ws, C)


def window_reverse(w, ws, H, W):
    B = int(w.shape[0] / (H * W / ws / ws))
    x = w.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        m = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * m / keep


class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.ws, self.heads = ws, heads
        self.table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.02)
        c = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(
            1
        )
        r = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0).contiguous()
        r[:, :, 0] += ws - 1
        r[:, :, 1] += ws - 1
        r[:, :, 0] *= 2 * ws - 1
        self.register_buffer("rel_index", r.sum(-1), persistent=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.table[self.rel_index.view(-1)].view(N, N, -1).permute(2, 0, 1).contiguous()
        a = a + bias.unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            a = a.view(B_ // nW, nW, self.heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            a = a.view(-1, self.heads, N, N)
        a = self.drop(a.softmax(-1))
        return self.proj((a @ v).transpose(1, 2).reshape(B_, N, C))


class SwinBlock(nn.Module):
    def __init__(self, dim=D, ws=4, shift=2, heads=2, dp=0.2):
        super().__init__()
        self.ws, self.shift = ws, shift
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.dp = DropPath(dp)
        self.masks = {}

    def mask_for(self, Hp, Wp, device):
        key = (Hp, Wp)
        if key not in self.masks:
            img = torch.zeros(1, Hp, Wp, 1, device=device)
            cnt = 0
            s = (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None))
            for h in s:
                for w in s:
                    img[:, h, w, :] = cnt
                    cnt += 1
            mw = window_partition(img, self.ws).squeeze(-1)
            m = mw.unsqueeze(1) - mw.unsqueeze(2)
            self.masks[key] = m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0)
        return self.masks[key]

    def forward(self, x, H, W):
        B, L, C = x.shape
        sc = x
        x = self.n1(x).view(B, H, W, C)
        ph, pw = (-H) % self.ws, (-W) % self.ws
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
        Hp, Wp = H + ph, W + pw
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
            mask = self.mask_for(Hp, Wp, x.device)
        else:
            mask = None
        w = self.attn(window_partition(x, self.ws), mask)
        x = window_reverse(w, self.ws, Hp, Wp)
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), (1, 2))
        x = x[:, :H, :W, :].contiguous().view(B, H * W, C)
        x = sc + self.dp(x)
        return x + self.dp(self.mlp(self.n2(x)))


class Swin(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.ModuleList([SwinBlock(shift=0), SwinBlock(shift=2)])
        self.head = nn.Linear(D, 5)

    def forward(self, img):
        x = self.embed(img)
        B, C, H, W = x.shape
        x = x.flatten(2).transpose(1, 2)
        for b in self.blocks:
            x = b(x, H, W)
        return self.head(x.mean(1))


def compare(eager, ours, steps, make_input, loss_fn):
    """returns list of mismatch descriptions"""
    bad = []
    for s in range(steps):
        inp = make_input(s)
        res = []
        for m in (eager, ours):
            torch.manual_seed(100 + s)
            loss = loss_fn(m, inp)
            loss.backward()
            g = [
                (n, p.grad.clone() if p.grad is not None else None) for n, p in m.named_parameters()
            ]
            m.zero_grad(set_to_none=True)
            res.append((loss.detach(), g, [b.clone() for b in m.buffers()], torch.get_rng_state()))
        (la, ga, ba, ra), (lb, gb, bb, rb) = res
        if not torch.equal(la, lb):
            bad.append(f"step {s} loss {la} vs {lb}")
        for (n, x), (_, y) in zip(ga, gb):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                bad.append(
                    f"step {s} grad {n}: {None if x is None else x.norm()} vs "
                    f"{None if y is None else y.norm()}"
                )
        if len(ba) != len(bb) or not all(torch.equal(x, y) for x, y in zip(ba, bb)):
            bad.append(f"step {s} buffers")
        if not torch.equal(ra, rb):
            bad.append(f"step {s} rng")
    return bad


class ViTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.dp = DropPath(0.2)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(B, N, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.dp(self.proj(a.transpose(1, 2).reshape(B, N, C)))
        return x + self.dp(self.mlp(self.n2(x)))


class ViTDet(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.embed = nn.Conv2d(3, D, 4, 4)
        self.pos = nn.Parameter(torch.randn(1, D, 4, 4) * 0.02)
        self.stage1 = nn.ModuleList([ViTBlock(), ViTBlock()])
        self.stage2 = nn.ModuleList([ViTBlock(), ViTBlock()])
        self.up = nn.ConvTranspose2d(D, D, 2, 2)
        self.lat = nn.Conv2d(D, D, 1)
        self.head = nn.Conv2d(D, 3, 3, padding=1)

    def stage(self, blocks, x, H, W, tag):
        for b in blocks:
            x = b(x)
        fm = x.transpose(1, 2).reshape(x.shape[0], D, H, W)
        return {"tokens": x, tag: fm, "hw": (H, W)}

    def forward(self, img):
        x = self.embed(img)
        B, C, H, W = x.shape
        pos = F.interpolate(self.pos, size=(H, W), mode="bicubic", align_corners=False)
        x = (x + pos).flatten(2).transpose(1, 2)
        if self.mode == "fn":
            o1 = pytree_ckpt.checkpoint(self.stage, self.stage1, x, H, W, "c4")
            o2 = pytree_ckpt.checkpoint(self.stage, self.stage2, o1["tokens"], *o1["hw"], tag="c5")
        else:
            o1 = self.stage(self.stage1, x, H, W, "c4")
            o2 = self.stage(self.stage2, o1["tokens"], H, W, "c5")
        c5 = o2["c5"]
        p = {"p3": self.up(c5), "p4": self.lat(c5), "p5": F.max_pool2d(c5, 2, 2), "c4": o1["c4"]}
        return sum(self.head(v).square().mean() for v in p.values())


class DecLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa = nn.MultiheadAttention(D, 2, dropout=0.1, batch_first=True)
        self.ca = nn.MultiheadAttention(D, 2, dropout=0.1, batch_first=True)
        self.n1, self.n2, self.n3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, D))

    def forward(self, tgt, memory, query_pos, pos):
        q = k = tgt + query_pos
        tgt = self.n1(tgt + self.sa(q, k, tgt, need_weights=False)[0])
        tgt = self.n2(tgt + self.ca(tgt + query_pos, memory + pos, memory, need_weights=False)[0])
        return self.n3(tgt + self.ff(tgt))


class DETR(nn.Module):
    def __init__(self, nq=6, ncls=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, D, 4, 4), nn.ReLU())
        self.query = nn.Parameter(torch.randn(nq, D))
        self.pos = nn.Parameter(torch.randn(1, 64, D) * 0.02)
        self.layers = nn.ModuleList([DecLayer() for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.cls = nn.Linear(D, ncls + 1)
        self.box = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 4))

    def forward(self, img):
        mem = self.backbone(img).flatten(2).transpose(1, 2)
        B, N, _ = mem.shape
        qp = self.query.unsqueeze(0).expand(B, -1, -1)
        tgt = torch.zeros_like(qp)
        pos = self.pos[:, :N].expand(B, -1, -1)
        inter = []
        for l in self.layers:
            tgt = l(tgt, mem, qp, pos)
            inter.append(self.norm(tgt))
        return [(self.cls(h), self.box(h).sigmoid()) for h in inter]


def greedy_match(logits, boxes, tl, tb):
    # on detached outputs
    cost = -logits.softmax(-1)[:, tl] + torch.cdist(boxes, tb, p=1)
    used, pairs = set(), []
    for j in range(len(tl)):
        order = cost[:, j].argsort()
        for i in order.tolist():
            if i not in used:
                used.add(i)
                pairs.append((i, j))
                break
    src = torch.tensor([p[0] for p in pairs])
    tgt = torch.tensor([p[1] for p in pairs])
    return src, tgt


def det_loss(outs, targets, ncls=4):
    total = 0
    for logits, boxes in outs:  # aux losses
        for b, (tl, tb) in enumerate(targets):
            with torch.no_grad():
                src, tj = greedy_match(logits[b].detach(), boxes[b].detach(), tl, tb)
            tcls = torch.full((logits.shape[1],), ncls, dtype=torch.long)
            tcls[src] = tl[tj]
            total = total + F.cross_entropy(logits[b], tcls)
            total = total + F.l1_loss(boxes[b].index_select(0, src), tb.index_select(0, tj))
    return total


def roi_grid_sample(fm, boxes, out=4):
    # fm [C,H,W], boxes [n,4] in [0,1] xyxy -> [n,C,out,out]
    n = boxes.shape[0]
    t = torch.linspace(0, 1, out)
    x0, y0, x1, y1 = boxes.unbind(-1)
    xs = x0[:, None] + (x1 - x0)[:, None] * t[None]
    ys = y0[:, None] + (y1 - y0)[:, None] * t[None]
    grid = torch.stack(torch.broadcast_tensors(xs[:, None, :], ys[:, :, None]), -1) * 2 - 1
    return F.grid_sample(fm.unsqueeze(0).expand(n, -1, -1, -1), grid, align_corners=False)


def roi_gather(fm, boxes, out=4):
    C, H, W = fm.shape
    t = torch.linspace(0, 1, out)
    x0, y0, x1, y1 = boxes.unbind(-1)
    xs = (x0[:, None] + (x1 - x0)[:, None] * t) * (W - 1)
    ys = (y0[:, None] + (y1 - y0)[:, None] * t) * (H - 1)
    xf, yf = xs.floor().clamp(0, W - 2), ys.floor().clamp(0, H - 2)
    wx, wy = (xs - xf), (ys - yf)
    xi, yi = xf.long(), yf.long()
    flat = fm.flatten(1)  # C, HW

    def g(yy, xx):
        idx = (yy[:, :, None] * W + xx[:, None, :]).flatten()  # n*out*out
        return flat.gather(1, idx.unsqueeze(0).expand(C, -1)).view(C, boxes.shape[0], out, out)

    v = (
        g(yi, xi) * (1 - wy)[None, :, :, None] * (1 - wx)[None, :, None, :]
        + g(yi, xi + 1) * (1 - wy)[None, :, :, None] * wx[None, :, None, :]
        + g(yi + 1, xi) * wy[None, :, :, None] * (1 - wx)[None, :, None, :]
        + g(yi + 1, xi + 1) * wy[None, :, :, None] * wx[None, :, None, :]
    )
    return v.permute(1, 0, 2, 3)


class RoIHead(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(D * 16, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)
        self.reg = nn.Linear(32, 4 * 4)
        self.mask = nn.Sequential(
            nn.Conv2d(D, D, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(D, 4, 2, 2)
        )

    def forward(self, feats, proposals, labels):
        scores, deltas, masks = [], [], []
        for fm, b, lab in zip(feats, proposals, labels):
            r = (roi_grid_sample if self.pool == "gs" else roi_gather)(fm, b)
            h = self.fc(r)
            scores.append(self.cls(h))
            d = self.reg(h).view(-1, 4, 4)
            deltas.append(d[torch.arange(len(lab)), lab])
            mk = self.mask(r)
            masks.append(mk[torch.arange(len(lab)), lab])
        return {"scores": scores, "deltas": deltas, "masks": masks, "labels": labels}


class MaskRCNN(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, D, 3, 2, 1), nn.ReLU(), nn.Conv2d(D, D, 3, 1, 1))
        self.head = RoIHead(pool)

    def forward(self, imgs, proposals, labels):
        feats = [self.backbone(i.unsqueeze(0))[0] for i in imgs]
        out = self.head(feats, proposals, labels)
        loss = 0
        for s, d, m, lab, gt in zip(
            out["scores"], out["deltas"], out["masks"], out["labels"], proposals
        ):
            loss = loss + F.cross_entropy(s, lab) + F.smooth_l1_loss(d, gt) + m.sigmoid().mean()
        return loss


class MR0(MaskRCNN):
    def forward(self, imgs, proposals, labels):
        feats = [self.backbone(i.unsqueeze(0))[0] for i in imgs]
        out = self.head(feats, proposals, labels)
        loss = 0
        for s, d, m, lab, gt in zip(
            out["scores"], out["deltas"], out["masks"], out["labels"], proposals
        ):
            if len(lab):
                loss = loss + F.cross_entropy(s, lab) + F.smooth_l1_loss(d, gt)
            loss = loss + m.sigmoid().sum() + s.sum() * 0
        return loss


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(D, D, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(D)
        self.c2 = nn.Conv2d(D, D, 3, stride=2, padding=1)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x))) + x
        z = self.c2(y)
        return {"res": y, "down": z, "flat": z.flatten(2), "same": x}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 3, padding=1)
        self.s1, self.s2 = Stage(), Stage()

    def forward(self, img):
        x = self.stem(img)
        o1 = self.s1(x)
        o2 = self.s2(o1["down"])
        return (
            o1["res"].square().mean()
            + o2["flat"].mean()
            + o2["res"].abs().mean()
            + o1["same"].mean()
            + o2["same"].std()
        )


class DSwin(SwinBlock):
    def forward(self, x, H, W):
        B, L, C = x.shape
        sc = x
        c1 = CheckpointWithoutOutput()
        x = c1.checkpoint(self.n1, x).view(B, H, W, C)
        ph, pw = (-H) % self.ws, (-W) % self.ws
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
        Hp, Wp = H + ph, W + pw
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
            mask = self.mask_for(Hp, Wp, x.device)
        else:
            mask = None
        w = self.attn(window_partition(x, self.ws), mask)
        c1.discard_output_and_register_recompute(w)
        x = window_reverse(w, self.ws, Hp, Wp)
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), (1, 2))
        x = x[:, :H, :W, :].contiguous().view(B, H * W, C)
        x = sc + self.dp(x)
        c2 = CheckpointWithoutOutput()
        n = c2.checkpoint(self.n2, x)
        h = self.mlp[0](n)
        c2.discard_output_and_register_recompute(h)
        return x + self.dp(self.mlp[2](self.mlp[1](h)))


class DS(Swin):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([DSwin(shift=0), DSwin(shift=2)])


def _manager():
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=1), device="cpu")


OPTIONS = {
    "plain": dict,
    "verify_replay": lambda: dict(verify_replay=True),
    "offload": lambda: dict(offload=_manager()),
}
SWIN_SIZES = [(16, 16), (12, 20), (16, 16)]


def _swin_input(s):
    g = torch.Generator().manual_seed(s)
    return torch.randn(2, 3, *SWIN_SIZES[s], generator=g)


def _swin_loss(m, x):
    return F.cross_entropy(m(x), torch.tensor([1, 3]))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_swin_blocks_with_shifted_windows_and_a_mask_cache_give_eager_gradients(option) -> None:
    torch.manual_seed(0)
    eager = Swin()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, SwinBlock), **OPTIONS[option]()
    )
    assert compare(eager, ours, 3, _swin_input, _swin_loss) == []
    assert list(ours.blocks[1].masks) == list(eager.blocks[1].masks) == [(8, 8), (8, 12)]


def test_swin_micro_batches_of_two_sizes_before_one_backward_give_eager_gradients() -> None:
    def two(m, x):
        x2 = F.interpolate(x, scale_factor=0.75)
        return _swin_loss(m, x) + F.cross_entropy(m(x2), torch.tensor([0, 2]))

    torch.manual_seed(0)
    eager = Swin()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager),
        check_fn=lambda m: isinstance(m, SwinBlock),
        verify_replay=True,
        offload=_manager(),
    )
    assert compare(eager, ours, 2, _swin_input, two) == []


def test_swin_channels_last_patch_embedding_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Swin().to(memory_format=torch.channels_last)
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, SwinBlock)
    )
    assert (
        compare(
            eager,
            ours,
            2,
            lambda s: _swin_input(s).to(memory_format=torch.channels_last),
            _swin_loss,
        )
        == []
    )


def test_swin_attention_kept_as_a_save_unit_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Swin()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config(
        ours.blocks,
        RecomputeConfig(1.0, save=["attn"]),
        {SaveUnit.ATTN: KeptCallables("WindowAttention.forward")},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pytree_ckpt: .* mutates its inputs")
        assert compare(eager, ours, 2, _swin_input, _swin_loss) == []


@pytest.mark.parametrize("checkpointed", [False, True])
def test_swin_layer_norm_outputs_discarded_give_eager_gradients(checkpointed) -> None:
    torch.manual_seed(0)
    eager = Swin()
    ours = Swin()
    ours.blocks = nn.ModuleList([DSwin(shift=0), DSwin(shift=2)])
    ours.load_state_dict(eager.state_dict())
    if checkpointed:
        pytree_ckpt.apply_activation_checkpointing(
            ours, check_fn=lambda m: isinstance(m, SwinBlock)
        )
    assert compare(eager, ours, 2, _swin_input, _swin_loss) == []


def test_vitdet_checkpointed_stages_returning_feature_map_dicts_give_eager_gradients() -> None:
    sizes = [(16, 16), (20, 12)]

    def make(s):
        return torch.randn(2, 3, *sizes[s], generator=torch.Generator().manual_seed(s))

    torch.manual_seed(0)
    eager = ViTDet("eager")
    ours = copy.deepcopy(eager)
    ours.mode = "fn"
    assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []
    blocks = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, ViTBlock), verify_replay=True
    )
    assert compare(eager, blocks, 2, make, lambda m, x: m(x)) == []


def _detr_input(s):
    g = torch.Generator().manual_seed(s)
    img = torch.randn(2, 3, 16, 16 + 4 * s, generator=g)
    tg = [
        (torch.randint(0, 4, (n,), generator=g), torch.rand(n, 4, generator=g))
        for n in (2, 3 + s % 2)
    ]
    return img, tg


@pytest.mark.parametrize("option", list(OPTIONS))
def test_detr_decoder_layers_with_aux_losses_give_eager_decoder_gradients(option) -> None:
    # The memory and the learned queries are read by every layer, several times each: their
    # gradients (and the backbone's) are eager's to float rounding (docs/limits.md's row on an
    # input used several times in the call and also outside it); every layer's are exact.
    torch.manual_seed(0)
    eager = DETR()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, DecLayer), **OPTIONS[option]()
    )
    bad = compare(eager, ours, 2, _detr_input, lambda m, i: det_loss(m(i[0]), i[1]))
    assert bad and all(" grad query" in b or " grad backbone." in b for b in bad), bad
    for name, p in ours.named_parameters():
        ep = dict(eager.named_parameters())[name]
        assert (ep.grad is None) == (p.grad is None)


def _rcnn_input(s):
    g = torch.Generator().manual_seed(s)
    imgs = [torch.randn(3, 16 + 4 * k, 16 + 8 * s, generator=g) for k in range(3)]
    props, labs = [], []
    for n in (3 + s, 0, 1):
        a = torch.rand(n, 2, generator=g) * 0.5
        props.append(torch.cat([a, a + 0.3 + torch.rand(n, 2, generator=g) * 0.2], 1))
        labs.append(torch.randint(0, 4, (n,), generator=g))
    return imgs, props, labs


@pytest.mark.parametrize("pool", ["gs", "gather"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_mask_rcnn_head_over_lists_of_variable_size_boxes_gives_eager_gradients(
    pool, option
) -> None:
    torch.manual_seed(0)
    eager = MR0(pool)
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, RoIHead), **OPTIONS[option]()
    )
    assert compare(eager, ours, 2, _rcnn_input, lambda m, i: m(*i)) == []


@pytest.mark.parametrize("option", list(OPTIONS))
def test_batch_norm_stages_on_channels_last_returning_aliased_dicts_give_eager_numbers(
    option,
) -> None:
    torch.manual_seed(0)
    eager = Net().to(memory_format=torch.channels_last)
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, Stage), **OPTIONS[option]()
    )
    make = lambda s: torch.randn(2, 3, 8 + 4 * s, 8, generator=torch.Generator().manual_seed(s)).to(
        memory_format=torch.channels_last
    )
    assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class AttnMlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = WindowAttention(D, 4, 2), Mlp()

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


def test_a_mistyped_kept_callable_beside_a_matching_one_is_told_as_a_mistyped_kept_op_is() -> None:
    # Guards against (helper NQ): KeptOps("aten::bmm", "aten::_sofmax") warns "did you mean
    # 'aten::_softmax'"; the same typo in a method name ("Mlp.foward": class Mlp is in the
    # layer, it has no method foward) was told only when no name of the unit matched anything:
    # beside "WindowAttention.forward" the MLP was silently recomputed, not kept.
    with warnings.catch_warnings(record=True) as ops_told:
        warnings.simplefilter("always")
        pytree_ckpt.apply_recompute_config(
            [AttnMlpBlock()],
            RecomputeConfig(1.0, save=["attn"]),
            {SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::bmm", "aten::_sofmax")},
        )
    assert any("did you mean" in str(w.message) for w in ops_told)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        pytree_ckpt.apply_recompute_config(
            [AttnMlpBlock()],
            RecomputeConfig(1.0, save=["attn"]),
            {SaveUnit.ATTN: KeptCallables("WindowAttention.forward", "Mlp.foward")},
        )
    assert any(
        "Mlp.foward" in str(w.message) and "did you mean 'Mlp.forward'" in str(w.message)
        for w in told
    ), [str(w.message) for w in told]


# ---- more twins (helper NQ): deformable attention, hooked FPN features, cascades, GFNet, ConvNeXt


class DeformAttn(nn.Module):
    def __init__(self, L=2, P=2):
        super().__init__()
        self.L, self.P = L, P
        self.off = nn.Linear(D, L * P * 2)
        self.w = nn.Linear(D, L * P)
        self.vp = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.ff = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.box = nn.Linear(D, 2)

    def forward(self, q, ref, value_flat, value_list, shapes, start):
        B, Q, _ = q.shape
        off = self.off(q).view(B, Q, self.L, self.P, 2).tanh() * 0.1
        w = self.w(q).view(B, Q, self.L * self.P).softmax(-1).view(B, Q, self.L, self.P)
        acc = 0
        for l, v in enumerate(value_list):
            H, W = shapes[l].tolist()
            vm = self.vp(v).transpose(1, 2).reshape(B, D, H, W)
            loc = (ref[:, :, None, :] + off[:, :, l]) * 2 - 1
            s = F.grid_sample(vm, loc, align_corners=False)  # B, D, Q, P
            acc = acc + (s * w[:, None, :, l]).sum(-1)
        h = q + self.out(acc.transpose(1, 2)) + value_flat[:, start[1] : start[1] + 1].mean()
        h = h + self.ff(h)
        new_ref = (torch.logit(ref.clamp(1e-4, 1 - 1e-4)) + self.box(h)).sigmoid()
        return h, new_ref


class DDETR(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, D, 4, 4)
        self.enc2 = nn.Conv2d(D, D, 2, 2)
        self.query = nn.Parameter(torch.randn(5, D))
        self.ref = nn.Linear(D, 2)
        self.layers = nn.ModuleList([DeformAttn() for _ in range(3)])

    def forward(self, img):
        f1 = self.enc(img)
        f2 = self.enc2(f1)
        shapes = torch.tensor([f1.shape[-2:], f2.shape[-2:]])
        flat = torch.cat([f1.flatten(2), f2.flatten(2)], 2).transpose(1, 2)
        sizes = [int(a * b) for a, b in shapes.tolist()]
        start = torch.tensor([0, sizes[0]])
        vlist = list(flat.split(sizes, 1))
        q = self.query.unsqueeze(0).expand(img.shape[0], -1, -1)
        ref = self.ref(self.query).sigmoid().unsqueeze(0).expand(img.shape[0], -1, -1)
        loss = 0
        for l in self.layers:
            q, ref2 = l(q, ref, flat, vlist, shapes, start)
            loss = loss + ref2.square().mean() + q.tanh().mean()
            ref = ref2.detach()
        return loss


class HookedStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(ViTBlock(), ViTBlock(), ViTBlock())

    def forward(self, x):
        return self.blocks(x)


class HookNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.stage = HookedStage()
        self.feats = {}
        self.fpn = nn.ModuleList([nn.Linear(D, 4) for _ in range(3)])
        for i, b in enumerate(self.stage.blocks):
            b.register_forward_hook(lambda mod, inp, out, i=i: self.feats.__setitem__(i, out))

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x)], 1)
        out = self.stage(x)
        loss = out[:, 0].square().sum()
        for i, f in sorted(self.feats.items()):
            loss = loss + self.fpn[i](f[:, 1:]).tanh().mean()
        self.feats.clear()
        return loss


class CascadeStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D * 16, 4)
        self.cls = nn.Linear(D * 16, 3)

    def forward(self, feats, boxes):
        out_boxes, scores = [], []
        for fm, b in zip(feats, boxes):
            r = roi_grid_sample(fm, b).flatten(1)
            out_boxes.append((b + 0.05 * self.fc(r).tanh()).clamp(0, 1))
            scores.append(self.cls(r))
        return {"boxes": out_boxes, "scores": scores, "in": boxes}


class Cascade(nn.Module):
    def __init__(self, detach):
        super().__init__()
        self.bb = nn.Conv2d(3, D, 3, 2, 1)
        self.init = nn.Linear(4, 4)
        self.stages = nn.ModuleList([CascadeStage(), CascadeStage(), CascadeStage()])
        self.detach = detach

    def forward(self, imgs, props):
        feats = [self.bb(i[None])[0] for i in imgs]
        boxes = [(p + 0.01 * self.init(p)).clamp(0, 1) for p in props]
        loss = 0
        for st in self.stages:
            o = st(feats, boxes)
            loss = (
                loss
                + sum(
                    b.square().sum() + s.logsumexp(-1).sum()
                    for b, s in zip(o["boxes"], o["scores"])
                )
                + sum(x.sum() for x in o["in"])
            )
            boxes = [b.detach() for b in o["boxes"]] if self.detach else o["boxes"]
        return loss


class GF(nn.Module):
    def __init__(self, h=8, w=5):
        super().__init__()
        self.cw = nn.Parameter(torch.randn(h, w, D, 2) * 0.02)
        self.n = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)
        self.cp = nn.Parameter(torch.randn(D, dtype=torch.cfloat) * 0.1)

    def forward(self, x):
        B, H, W, C = x.shape
        y = torch.fft.rfft2(self.n(x), dim=(1, 2), norm="ortho")
        wt = torch.view_as_complex(self.cw)
        if wt.shape[:2] != y.shape[1:3]:
            wt = torch.view_as_complex(
                F.interpolate(
                    self.cw.permute(2, 3, 0, 1).reshape(1, -1, *self.cw.shape[:2]),
                    size=y.shape[1:3],
                    mode="bilinear",
                )
                .reshape(C, 2, *y.shape[1:3])
                .permute(2, 3, 0, 1)
                .contiguous()
            )
        y = y * wt * self.cp
        y = torch.fft.irfft2(y, s=(H, W), dim=(1, 2), norm="ortho")
        return (
            x + self.mlp(y),
            y.abs().mean() * torch.zeros(1, dtype=torch.cfloat) + (y[..., 0] * 1j).sum(),
        )


class LN2d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c) + torch.randn(c) * 0.1)
        self.bias = nn.Parameter(torch.randn(c) * 0.1)

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class CNBlock(nn.Module):
    def __init__(self, discard, perm):
        super().__init__()
        self.dw = nn.Conv2d(D, D, 7, padding=3, groups=D)
        self.ln = LN2d(D)
        self.ln2 = nn.LayerNorm(D)
        self.pw1 = nn.Conv2d(D, 4 * D, 1)
        self.pw2 = nn.Linear(4 * D, D)
        self.gamma = nn.Parameter(torch.full((D,), 0.5))
        self.discard, self.perm = discard, perm

    def forward(self, x):
        inp = x
        x = self.dw(x)
        if self.perm:  # torchvision ConvNeXt: permute to NHWC, nn.LayerNorm, Linear
            x = x.permute(0, 2, 3, 1)
            if self.discard:
                c = CheckpointWithoutOutput()
                n = c.checkpoint(self.ln2, x)
            else:
                n = self.ln2(x)
            h = F.linear(n, self.pw1.weight.view(4 * D, D), self.pw1.bias)
        else:
            if self.discard:
                c = CheckpointWithoutOutput()
                n = c.checkpoint(self.ln, x)
            else:
                n = self.ln(x)
            h = self.pw1(n).permute(0, 2, 3, 1)
        if self.discard:
            c.discard_output_and_register_recompute(h)
        h = self.pw2(F.gelu(h)) * self.gamma
        return inp + h.permute(0, 3, 1, 2)


class CN(nn.Module):
    def __init__(self, discard, perm):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.Sequential(CNBlock(discard, perm), CNBlock(discard, perm))

    def forward(self, x):
        return self.blocks(self.stem(x)).square().mean()


class GFNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e, self.b = nn.Linear(3, D), nn.ModuleList([GF(), GF()])

    def forward(self, x):
        x, tot = self.e(x), 0
        for b in self.b:
            x, c = b(x)
            tot = tot + c.abs().sum()
        return x.square().mean() + tot


@pytest.mark.parametrize("option", list(OPTIONS))
def test_deformable_attention_over_split_value_maps_with_detached_references_gives_eager_gradients(
    option,
) -> None:
    torch.manual_seed(0)
    eager = DDETR()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, DeformAttn), **OPTIONS[option]()
    )
    make = lambda s: torch.randn(2, 3, 16, 16 + 8 * s, generator=torch.Generator().manual_seed(s))
    assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []


@pytest.mark.parametrize("option", list(OPTIONS))
def test_feature_maps_kept_by_forward_hooks_inside_a_checkpointed_stage_give_eager_gradients(
    option,
) -> None:
    torch.manual_seed(0)
    eager, ours = HookNet(), HookNet()  # the hooks close over their own model
    ours.load_state_dict(eager.state_dict())
    pytree_ckpt.apply_activation_checkpointing(ours.stage, **OPTIONS[option]())
    make = lambda s: torch.randn(2, 5 + s, 8, generator=torch.Generator().manual_seed(s))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pytree_ckpt: forward hooks inside")
        assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("option", ["plain", "offload"])
def test_cascade_heads_taking_and_returning_box_lists_with_gradients_give_eager_gradients(
    detach, option
) -> None:
    def make(s):
        g = torch.Generator().manual_seed(s)
        imgs = [torch.randn(3, 16, 16 + 4 * k, generator=g) for k in range(2)]
        props = []
        for n in (3, 2):
            a = torch.rand(n, 2, generator=g) * 0.5
            props.append(torch.cat([a, a + 0.3], 1))
        return imgs, props

    torch.manual_seed(0)
    eager = Cascade(detach)
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, CascadeStage), **OPTIONS[option]()
    )
    assert compare(eager, ours, 2, make, lambda m, i: m(*i)) == []


@pytest.mark.parametrize("option", list(OPTIONS))
def test_global_filter_blocks_with_complex_weights_and_outputs_give_eager_gradients(option) -> None:
    torch.manual_seed(0)
    eager = GFNet()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, GF), **OPTIONS[option]()
    )
    make = lambda s: torch.randn(2, 8 + 4 * s, 8, 3, generator=torch.Generator().manual_seed(s))
    assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_convnext_norms_discarded_on_channels_last_give_eager_gradients(perm, checkpointed) -> None:
    torch.manual_seed(0)
    eager = CN(False, perm).to(memory_format=torch.channels_last)
    ours = CN(True, perm).to(memory_format=torch.channels_last)
    ours.load_state_dict(eager.state_dict())
    if checkpointed:
        pytree_ckpt.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, CNBlock))
    make = lambda s: torch.randn(2, 3, 8, 8 + 4 * s, generator=torch.Generator().manual_seed(s)).to(
        memory_format=torch.channels_last
    )
    assert compare(eager, ours, 2, make, lambda m, x: m(x)) == []


@pytest.mark.parametrize("whole", [False, True])
def test_adversarial_steps_taking_the_image_gradient_give_eager_numbers(whole) -> None:
    # FGSM-style: autograd.grad with respect to the image, then a step on the perturbed image.
    def step(m, x):
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(_swin_loss(m, x), x)
        loss = _swin_loss(m, (x + 0.1 * g.sign()).detach())
        loss.backward()
        return loss.detach(), g

    torch.manual_seed(0)
    eager = Swin()
    ours = copy.deepcopy(eager)
    if whole:
        pytree_ckpt.apply_activation_checkpointing(ours)
    else:
        pytree_ckpt.apply_activation_checkpointing(
            ours, check_fn=lambda m: isinstance(m, SwinBlock)
        )
    for s in range(2):
        torch.manual_seed(10 + s)
        la, ga = step(eager, _swin_input(s))
        torch.manual_seed(10 + s)
        lb, gb = step(ours, _swin_input(s))
        assert torch.equal(la, lb) and torch.equal(ga, gb)
        for p, q in zip(eager.parameters(), ours.parameters()):
            assert torch.equal(p.grad, q.grad)
        eager.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)


class VGGBlock(nn.Module):
    """torchvision VGG's pattern: every conv output is changed in place by a ReLU(inplace=True)
    (or a residual `+=`) right after it."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(D, D, 3, padding=1), nn.Conv2d(D, D, 3, padding=1)
        self.r = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.c2(self.r(self.c1(x)))
        h += x
        return self.r(h)


class VGGNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.blocks = nn.Conv2d(3, D, 3, padding=1), nn.ModuleList(
            [VGGBlock(), VGGBlock()]
        )

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "target",
    [pytree_ckpt.KeptOps("aten::convolution"), KeptCallables("Conv2d.forward")],
    ids=["ops", "callables"],
)
def test_a_unit_whose_kept_conv_outputs_a_relu_changes_in_place_says_so_when_it_keeps_nothing(
    target,
) -> None:
    torch.manual_seed(0)
    eager = VGGNet()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config(
        ours.blocks, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: target}
    )
    make = lambda s: torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        assert compare(eager, ours, 1, make, lambda m, x: m(x)) == []  # the numbers are eager's
    kept_nothing = [str(w.message) for w in told if "kept nothing" in str(w.message)]
    assert kept_nothing  # warned, as docs/save_units.md says
    # Guards against (helper NQ) the reasons it gave: "not dispatched; or only as views,
    # clones, in-place ops, ..." (ops) or "not called inside a checkpointed layer, or
    # dispatching no op that can be kept" (callables), where convolution was dispatched, by
    # Conv2d.forward, inside the layer: what took the records back is the in-place change
    # after it, which it names now, with the fix.
    assert "changed in place" in kept_nothing[0], kept_nothing[0]
    assert "use ReLU(inplace=False)" in kept_nothing[0]
    # The cause itself, not only the tip, in both branches (helper NX's UU2).
    assert "changed in place later in the forward" in kept_nothing[0], kept_nothing[0]
