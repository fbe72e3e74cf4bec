"""Video and efficient-vision-transformer models against eager twins (helper PE): ToMe token
merging (bipartite soft matching with argsort, scatter_reduce merging, a size vector carried
between blocks, proportional attention, tied scores; its schedule popped from a list the blocks
share), EViT top-k token pruning with a keep-rate schedule set between steps, DynamicViT's
Gumbel-softmax hard keep decisions, a temporal shift module (slicing assignment into a new
tensor and into a clone), TimeSformer's divided space-time attention, a causal 3D convolution on
channels_last_3d, VideoMAE tube masking (argsort of torch.rand inside the checkpointed stem),
variable numbers of frames per micro-batch, a timm-style grad_checkpointing flag toggled between
steps; with verify_replay, offload, a save unit keeping attention, output discard of the
LayerNorms and aot_eager-compiled block bodies."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import CheckpointWithoutOutput, KeptCallables, RecomputeConfig, SaveUnit

D = 16


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, size=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (C // 2) ** -0.5
        if size is not None:                              # ToMe's proportional attention
            a = a + size.log()[:, None, None, :, 0]
        a = a.softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(B, N, C)), k.mean(1), a


def bipartite_soft_matching(metric, r):
    r = min(r, (metric.shape[1] - 1) // 2)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., 1::2, :], metric[..., ::2, :]
    node_max, node_idx = (a @ b.transpose(-1, -2)).max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

    def merge(x, mode="sum"):
        src, dst = x[..., 1::2, :], x[..., ::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)], 1)
    return merge


class ToMeBlock(nn.Module):
    def __init__(self, discard: bool = False) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.r, self.discard = 3, discard

    def forward(self, x, size):
        if self.discard:
            c1 = CheckpointWithoutOutput()
            y, metric, _ = self.attn(c1.checkpoint(self.n1, x), size)
            c1.discard_output_and_register_recompute(y)
        else:
            y, metric, _ = self.attn(self.n1(x), size)
        x = x + y
        if self.r > 0:
            merge = bipartite_soft_matching(metric, self.r)
            x = merge(x * size)
            size = merge(size)
            x = x / size
        if self.discard:
            c2 = CheckpointWithoutOutput()
            h = self.mlp(c2.checkpoint(self.n2, x))
            c2.discard_output_and_register_recompute(h)
            return x + h, size
        return x + self.mlp(self.n2(x)), size


class ToMeViT(nn.Module):
    def __init__(self, discard: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToMeBlock(discard) for _ in range(4))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        size = torch.ones_like(x[..., :1])
        for block in self.blocks:
            x, size = block(x, size)
        return self.head(x[:, 0]).square().sum()


class PoppedScheduleViT(ToMeViT):
    """ToMe's schedule as its timm patch keeps it: a list every block pops from."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PoppingBlock() for _ in range(4))

    def forward(self, x):
        schedule = [3, 2, 1, 2]
        for block in self.blocks:
            block.schedule = schedule
        return super().forward(x)


class PoppingBlock(ToMeBlock):
    def forward(self, x, size):
        self.r = self.schedule.pop(0)
        return super().forward(x, size)


class EViTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.keep_rate = 1.0

    def forward(self, x):
        B, N, C = x.shape
        y, _, a = self.attn(self.n1(x))
        x = x + y
        if self.keep_rate < 1:
            cls_attn = a[:, :, 0, 1:].mean(1)
            _, idx = torch.topk(cls_attn, math.ceil(self.keep_rate * (N - 1)), dim=1)
            kept = x[:, 1:].gather(1, idx[..., None].expand(-1, -1, C))
            w = (cls_attn * torch.ones_like(cls_attn, dtype=torch.bool).scatter(1, idx, False))[..., None]
            fused = (x[:, 1:] * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1e-6)
            x = torch.cat([x[:, :1], kept, fused], 1)
        return x + self.mlp(self.n2(x))


class EViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EViTBlock() for _ in range(4))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0]).square().sum()


class DynamicBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pred = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, 2))
        self.n1, self.attn, self.mlp = nn.LayerNorm(D), Attn(), nn.Linear(D, D)

    def forward(self, x, policy):
        hard = F.gumbel_softmax(self.pred(x[:, 1:]).log_softmax(-1), hard=True)[..., :1]
        policy = torch.cat([policy[:, :1], hard * policy[:, 1:]], 1)
        x = x + self.attn(self.n1(x))[0] * policy
        return x + self.mlp(x), policy


class DynamicViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DynamicBlock() for _ in range(3))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        policy = torch.ones(x.shape[0], x.shape[1], 1)
        for block in self.blocks:
            x, policy = block(x, policy)
        return self.head((x * policy).sum(1)).square().sum() + policy.mean()


class TemporalShift(nn.Module):
    def __init__(self, into_clone: bool) -> None:
        super().__init__()
        self.t, self.into_clone = 4, into_clone
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        nt, c, h, w = x.shape
        x5, fold = x.view(nt // self.t, self.t, c, h, w), c // 4
        out = x5.clone() if self.into_clone else torch.zeros_like(x5)
        out[:, :-1, :fold] = x5[:, 1:, :fold]
        out[:, -1, :fold] = 0
        out[:, 1:, fold:2 * fold] = x5[:, :-1, fold:2 * fold]
        out[:, 0, fold:2 * fold] = 0
        if not self.into_clone:
            out[:, :, 2 * fold:] = x5[:, :, 2 * fold:]
        return F.relu(self.bn(self.conv(out.view(nt, c, h, w)))) + x


class TSMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(TemporalShift(True), TemporalShift(False))
        self.fc = nn.Linear(8, 2)

    def forward(self, video):
        b, t = video.shape[:2]
        h = self.blocks(self.stem(video.flatten(0, 1)))
        return self.fc(h.mean((2, 3)).view(b, t, -1).mean(1)).square().sum()


class DividedSpaceTime(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tn, self.ta, self.sn, self.sa = nn.LayerNorm(D), Attn(), nn.LayerNorm(D), Attn()
        self.drop = nn.Dropout(0.2)

    def forward(self, x, t: int):
        b, tn, d = x.shape
        n = tn // t
        xt = x.reshape(b, t, n, d).permute(0, 2, 1, 3).reshape(b * n, t, d)  # (b n) t d
        yt = self.ta(self.tn(xt))[0].reshape(b, n, t, d).permute(0, 2, 1, 3).reshape(b, tn, d)
        x = x + self.drop(yt)
        ys = self.sa(self.sn(x.reshape(b * t, n, d)))[0]                     # (b t) n d
        return x + self.drop(ys.reshape(b, tn, d))


class TimeSformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DividedSpaceTime() for _ in range(2))
        self.head = nn.Linear(D, 2)

    def forward(self, x, t: int):
        for block in self.blocks:
            x = block(x, t)
        return self.head(x.mean(1)).square().sum()


class CausalConv3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv3d(4, 4, 3), nn.GroupNorm(2, 4)

    def forward(self, x):
        padded = F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")   # causal in time
        return x + F.silu(self.norm(self.conv(padded)))


class Causal3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(3, 4, 1)
        self.blocks = nn.Sequential(CausalConv3d(), CausalConv3d())

    def forward(self, video):
        return self.blocks(self.stem(video.to(memory_format=torch.channels_last_3d))).square().sum()


class TubeMaskingStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)

    def forward(self, x, t: int):
        x = self.embed(x)
        B, L, d = x.shape
        n = L // t
        keep = n // 4
        ids_shuffle = torch.argsort(torch.rand(B, n), dim=1)   # one draw per tube
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        kept = x.reshape(B, t, n, d).gather(2, ids_shuffle[:, None, :keep, None].expand(B, t, keep, d))
        mask = torch.ones(B, n)
        mask[:, :keep] = 0
        return {"tokens": kept.reshape(B, t * keep, d), "mask": mask.gather(1, ids_restore),
                "ids_restore": ids_restore}


class EncoderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n, self.attn, self.mlp = nn.LayerNorm(D), Attn(), nn.Linear(D, D)

    def forward(self, x):
        x = x + self.attn(self.n(x))[0]
        return x + self.mlp(x)


class VideoMAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = TubeMaskingStem()
        self.encoder = nn.ModuleList(EncoderBlock() for _ in range(2))
        self.decoder = EncoderBlock()
        self.mask_token = nn.Parameter(torch.randn(1, 1, 1, D))
        self.pred = nn.Linear(D, D)

    def forward(self, x, t: int = 4):
        out = self.stem(x, t)
        h = out["tokens"]
        for block in self.encoder:
            h = block(h)
        B, L, d = x.shape
        n = L // t
        keep = h.shape[1] // t
        toks = torch.cat([h.reshape(B, t, keep, d), self.mask_token.expand(B, t, n - keep, d)], 2)
        toks = toks.gather(2, out["ids_restore"][:, None, :, None].expand(B, t, n, d)).reshape(B, L, d)
        pred = self.pred(self.decoder(toks))
        m = out["mask"][:, None, :].expand(B, t, n).reshape(B, L)
        return (((pred - x) ** 2).mean(-1) * m).sum() / m.sum()


def _wrap(model, kinds, option):
    """Checkpoints the blocks of ``kinds`` in ``model`` with ``option``."""
    if option == "save_unit":
        layers = [m for m in model.modules() if isinstance(m, kinds)]
        pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                                           {SaveUnit.ATTN: KeptCallables("Attn.forward")})
        return model
    if option == "compiled":
        for m in model.modules():
            if isinstance(m, kinds):
                m.forward = torch.compile(m.forward, backend="aot_eager")
    kwargs = {"verify_replay": {"verify_replay": True},
              "offload": {"offload": offload.OffloadManager(offload.OffloadConfig(min_bytes=0),
                                                            device="cpu")}}.get(option, {})
    return pytree_ckpt.apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, kinds), **kwargs)


def _state(model):
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    return grads, buffers


def _same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def _steps_alike(eager, ours, step, steps: int = 2) -> None:
    """``steps`` steps of both twins from one seed each: loss, gradients, buffers, the CPU
    generator's and Python's random state after the step, bit for bit."""
    for s in range(steps):
        seen = []
        for model in (eager, ours):
            torch.manual_seed(10 + s)
            random.seed(10 + s)
            loss = step(model, s)
            loss.backward()
            seen.append((loss.detach(), *_state(model), torch.get_rng_state(), random.getstate()))
        (la, ga, ba, ra, pa), (lb, gb, bb, rb, pb) = seen
        assert torch.equal(la, lb), f"step {s}: loss"
        assert _same(ga, gb), f"step {s}: gradients"
        assert _same(ba, bb), f"step {s}: buffers"
        assert torch.equal(ra, rb) and pa == pb, f"step {s}: random states"


def _twins(make, kinds, option):
    torch.manual_seed(0)
    eager = make()
    return eager, _wrap(copy.deepcopy(eager), kinds, option)


def _tokens_with_ties(s):
    x = torch.randn(2, 17, D)
    if s == 1:                       # tied similarity scores: argsort and max must choose alike
        x[:, 3:9] = x[:, 2:3]
    return x


OPTIONS = ["plain", "verify_replay", "offload", "save_unit"]  # compiled: 35 s of recompiles


@pytest.mark.parametrize("option", OPTIONS)
def test_tome_merging_with_tied_scores_and_proportional_attention_gives_eager_numbers(option):
    eager, ours = _twins(ToMeViT, ToMeBlock, option)
    _steps_alike(eager, ours, lambda m, s: m(_tokens_with_ties(s)))


def test_tome_schedule_popped_from_a_list_the_blocks_share_gives_eager_numbers():
    eager, ours = _twins(PoppedScheduleViT, ToMeBlock, "plain")
    _steps_alike(eager, ours, lambda m, s: m(_tokens_with_ties(s)))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_tome_layer_norm_outputs_discarded_give_the_plain_models_numbers(checkpointed):
    torch.manual_seed(0)
    eager, ours = ToMeViT(), ToMeViT(discard=True)
    ours.load_state_dict(eager.state_dict())
    if checkpointed:
        _wrap(ours, ToMeBlock, "verify_replay")
    _steps_alike(eager, ours, lambda m, s: m(_tokens_with_ties(s)))


@pytest.mark.parametrize("option", ["plain", "verify_replay", "save_unit"])
def test_evit_top_k_pruning_with_a_keep_rate_schedule_set_between_steps_gives_eager_numbers(option):
    eager, ours = _twins(EViT, EViTBlock, option)

    def step(model, s):
        for block in model.blocks[1::2]:
            block.keep_rate = (1.0, 0.7, 0.5)[s]
        return model(_tokens_with_ties(s % 2))
    _steps_alike(eager, ours, step, steps=3)


@pytest.mark.parametrize("option", ["plain", "offload", "save_unit"])
def test_dynamic_vit_gumbel_hard_keep_decisions_give_eager_numbers(option):
    eager, ours = _twins(DynamicViT, DynamicBlock, option)
    _steps_alike(eager, ours, lambda m, s: m(torch.randn(2, 9, D)))


@pytest.mark.parametrize("option", ["plain", "verify_replay", "offload", "compiled"])
def test_temporal_shift_by_slicing_assignment_gives_eager_numbers(option):
    eager, ours = _twins(TSMNet, TemporalShift, option)
    _steps_alike(eager, ours, lambda m, s: m(torch.randn(2, 4, 3, 6, 6)))


def test_temporal_shift_in_place_on_the_blocks_input_is_refused_naming_the_input():
    class InPlaceShift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            x5 = x.view(2, 4, *x.shape[1:])
            x5[:, :-1, :2] = x5[:, 1:, :2].clone()
            return F.relu(self.conv(x)) + x

    block = pytree_ckpt.apply_activation_checkpointing(InPlaceShift())
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"changed its input args\[0\] in place"):
        block(torch.randn(8, 8, 4, 4, requires_grad=True) * 1.0)


@pytest.mark.parametrize("option", ["plain", "offload", "save_unit"])
def test_timesformer_with_variable_frame_counts_per_micro_batch_gives_eager_numbers(option):
    eager, ours = _twins(TimeSformer, DividedSpaceTime, option)
    video = torch.randn(2, 8, 5, D)

    def step(model, s):
        losses = []
        for _ in range(3):                        # frames sampled outside the model
            t = random.choice([2, 3, 4])
            frames = sorted(random.sample(range(8), t))
            losses.append(model(video[:, frames].reshape(2, t * 5, D), t))
        return sum(losses)                        # one backward over the micro-batches
    _steps_alike(eager, ours, step)


@pytest.mark.parametrize("option", ["plain", "verify_replay", "offload"])
def test_causal_conv3d_on_channels_last_3d_gives_eager_numbers(option):
    eager, ours = _twins(Causal3dNet, CausalConv3d, option)
    _steps_alike(eager, ours, lambda m, s: m(torch.randn(2, 3, 5, 6, 6)))


@pytest.mark.parametrize("option", ["plain", "verify_replay", "offload", "whole"])
def test_video_mae_tube_masking_drawn_inside_the_checkpointed_stem_gives_eager_numbers(option):
    if option == "whole":
        torch.manual_seed(0)
        eager = VideoMAE()
        ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    else:
        eager, ours = _twins(VideoMAE, (TubeMaskingStem, EncoderBlock), option)
    _steps_alike(eager, ours, lambda m, s: m(torch.randn(2, 32, D)))


def test_a_timm_style_grad_checkpointing_flag_toggled_between_steps_gives_eager_numbers():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.bn, self.drop = nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.3)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.bn(self.l(x).transpose(1, 2)).transpose(1, 2)
            return x + self.drop(F.gelu(h)) * (1 + 0.01 * self.calls)

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(3)))
            self.grad_checkpointing = False

        def set_grad_checkpointing(self, enable: bool = True) -> None:
            self.grad_checkpointing = enable

        def forward(self, x):
            if self.grad_checkpointing:
                for block in self.blocks:
                    x = pytree_ckpt.checkpoint(block, x)
            else:
                x = self.blocks(x)
            return x.square().sum()

    torch.manual_seed(0)
    eager = ViT()
    ours = copy.deepcopy(eager)

    def step(model, s):
        if model is ours:
            model.set_grad_checkpointing(s % 2 == 0)
        model.eval()
        with torch.no_grad():                     # a validation pass between steps
            model(torch.randn(2, 6, D))
        model.train()
        return model(torch.randn(2, 6, D))
    _steps_alike(eager, ours, step, steps=4)


def _matching(metric, r):
    metric = metric / metric.norm(dim=-1, keepdim=True)
    node_max, node_idx = (metric[..., 1::2, :] @ metric[..., ::2, :].transpose(-1, -2)).max(-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    return {"unm": edge_idx[..., r:, :], "src": edge_idx[..., :r, :],
            "dst": node_idx[..., None].gather(dim=-2, index=edge_idx[..., :r, :])}


class ReusedMatchingBlock(ToMeBlock):
    """ToMe with its matching frozen: reuse_during_recompute replays the int ids."""

    def forward(self, x, size):
        y, metric, _ = self.attn(self.n1(x), size)
        x = x + y
        r = min(self.r, (x.shape[1] - 1) // 2)
        ids = pytree_ckpt.reuse_during_recompute(_matching, metric.detach(), r)

        def merge(t):
            src, dst = t[..., 1::2, :], t[..., ::2, :]
            n, t1, c = src.shape
            unm = src.gather(-2, ids["unm"].expand(n, t1 - r, c))
            moved = src.gather(-2, ids["src"].expand(n, r, c))
            return torch.cat([unm, dst.scatter_reduce(-2, ids["dst"].expand(n, r, c), moved,
                                                      reduce="sum")], 1)
        x, size = merge(x * size), merge(size)
        x = x / size
        return x + self.mlp(self.n2(x)), size


class ReusedMatchingViT(ToMeViT):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReusedMatchingBlock() for _ in range(4))


@pytest.mark.parametrize("option", OPTIONS)
def test_tome_matching_frozen_with_reuse_during_recompute_gives_eager_numbers(option):
    eager, ours = _twins(ReusedMatchingViT, ReusedMatchingBlock, option)
    _steps_alike(eager, ours, lambda m, s: m(_tokens_with_ties(s)))


class _TimmToMeBlock(ToMeBlock):
    """ToMe's timm patch: the sizes and the merge schedule in one dict every block shares."""

    def forward(self, x):  # type: ignore[override]
        size = self._tome_info["size"]
        if size is None:
            size = torch.ones_like(x[..., :1])
        y, metric, _ = self.attn(self.n1(x), size)
        x = x + y
        r = self._tome_info["r"].pop(0)
        if r > 0:
            merge = bipartite_soft_matching(metric, r)
            x = merge(x * size)
            size = merge(size)
            x = x / size
        self._tome_info["size"] = size
        return x + self.mlp(self.n2(x))


class _TimmToMeViT(nn.Module):
    def __init__(self, schedule: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TimmToMeBlock() for _ in range(4))
        self.head, self.info, self.schedule = nn.Linear(D, 3), {}, schedule
        for block in self.blocks:
            block._tome_info = self.info

    def forward(self, x):
        self.info["r"], self.info["size"] = list(self.schedule), None
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0]).square().sum()


@pytest.mark.parametrize("schedule,error,match", [([3, 2, 1, 2], RuntimeError, "size of tensor"),
                                                  ([0, 0, 0, 0], IndexError, "pop from empty")])
def test_tome_timm_patch_state_in_a_shared_dict_fails_in_backward_with_a_note(
        schedule, error, match) -> None:
    # limits.md (helper PO): a shape error or 'pop from empty list', with a note naming such
    # state (an object the forward changed), not silent.
    torch.manual_seed(0)
    model = _TimmToMeViT(schedule)
    for block in model.blocks:
        pytree_ckpt.apply_activation_checkpointing(block)
    with pytest.raises(error, match=match) as raised:
        model(torch.randn(2, 17, D)).backward()
    assert any("an object the forward changed" in note
               for note in getattr(raised.value, "__notes__", []))
