"""Diffusion models (UNet with a skip list, DiT with adaLN) against their eager twins, bit for
bit in fp32: dropout, classifier-free guidance's label drop and the noise drawn inside the
checkpointed region, channels_last, autocast, EMA and gradient accumulation (helper MU)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils._python_dispatch import TorchDispatchMode

import pytree_ckpt
from pytree_ckpt import KeptOps, RecomputeConfig, SaveUnit, apply_recompute_config
from tests.pytree_ckpt.diffusion_models import (Attn, DiT, DiTBlock, Down, UNet, Up, grads,
                                                noised_loss)


class Step(nn.Module):
    """The whole diffusion training step as one module: label drop and noise inside."""

    net: Any

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x0: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return noised_loss(self.net, x0, t, y)


def batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, size, size, generator=g), torch.randint(0, 1000, (2,), generator=g),
            torch.randint(0, 4, (2,), generator=g))


def losses_and_grads(model: nn.Module, size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(123)
    loss = model(*batch(0, size))
    loss.backward()
    return loss, grads(model)


def test_dit_blocks_with_adaln_chunks_dropout_and_guidance_drop_give_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Step(DiT())
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, DiTBlock))
    (le, ge), (lo, go) = losses_and_grads(eager, 8), losses_and_grads(ours, 8)
    assert torch.equal(le, lo) and ge.keys() == go.keys()
    assert all(torch.equal(ge[k], go[k]) for k in ge)


def test_whole_unet_step_channels_last_with_noise_drawn_inside_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Step(UNet()).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    (le, ge), (lo, go) = losses_and_grads(eager, 8), losses_and_grads(ours, 8)
    assert torch.equal(le, lo) and ge.keys() == go.keys()
    assert all(torch.equal(ge[k], go[k]) for k in ge)
    assert all(p.grad.stride() == q.grad.stride()
               for p, q in zip(eager.parameters(), ours.parameters()))


def test_unet_stages_passing_a_skip_list_give_eager_gradients_but_upstream_to_float_rounding(
        ) -> None:
    """Down stages return a list of skips, Up stages take it. The timestep embedding is used
    twice in a stage and by every stage: its upstream gradients are eager's to float rounding
    (docs/limits.md, "an input used several times in the call and also outside it")."""
    torch.manual_seed(0)
    eager = Step(UNet())
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, (Down, Up)))
    (le, ge), (lo, go) = losses_and_grads(eager, 8), losses_and_grads(ours, 8)
    assert torch.equal(le, lo) and ge.keys() == go.keys()
    upstream = {k for k in ge if k.startswith(("net.temb.", "net.cemb."))}
    assert all(torch.equal(ge[k], go[k]) for k in ge.keys() - upstream)
    assert all(torch.allclose(ge[k], go[k], rtol=0, atol=1.5e-8) for k in upstream)  # limits.md


def test_skip_list_through_functional_checkpoint_beside_wrapped_attention_gives_eager_gradients(
        ) -> None:
    torch.manual_seed(0)
    eager = UNet()
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, Attn))
    x0, t, y = batch(0, 16)

    def forward(net: UNet, checkpoint: bool) -> torch.Tensor:
        call = pytree_ckpt.checkpoint if checkpoint else (lambda f, *a, **k: f(*a, **k))
        temb = net.temb(torch.cat([t[:, None].float().cos()] * 16, -1)) + net.cemb(y)
        h, s1 = call(net.d1, net.inp(x0), temb)
        h, s2 = call(net.d2, h, temb)
        h = call(net.u2, net.mattn(net.mid(h, temb)), s2, temb=temb)
        return net.out(call(net.u1, h, skips=s1, temb=temb))

    result = []
    for net, checkpoint in ((eager, False), (ours, True)):
        torch.manual_seed(3)
        forward(net, checkpoint).square().mean().backward()
        result.append(grads(net))
    ge, go = result
    upstream = {k for k in ge if k.startswith(("temb.", "cemb."))}
    assert ge.keys() == go.keys()
    assert all(torch.equal(ge[k], go[k]) for k in ge.keys() - upstream)
    # The timestep embedding every call reads: eager's to float rounding (docs/limits.md)
    assert all(torch.allclose(ge[k], go[k], rtol=0, atol=1.5e-8) for k in upstream)


class CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += "scaled_dot_product" in func.name() and "backward" not in func.name()
        return func(*args, **(kwargs or {}))


def test_dit_keeping_sdpa_under_autocast_runs_attention_once_with_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Step(DiT())
    for block in eager.net.blocks:
        block.p = 0.0   # SDPA's fused CPU kernel (the kept op) runs without dropout
    ours = copy.deepcopy(eager)
    targets = {SaveUnit.ATTN: KeptOps("aten::_scaled_dot_product_flash_attention_for_cpu")}
    assert apply_recompute_config(ours.net.blocks, RecomputeConfig(1.0, save=["attn"]),
                                  targets) == [0, 1, 2]
    result = []
    for model in (eager, ours):
        with CountAttention() as counter:
            torch.manual_seed(123)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*batch(0, 8))
            loss.backward()
        result.append((counter.calls, loss, grads(model)))
    (ce, le, ge), (co, lo, go) = result
    assert ce == co == 3 and torch.equal(le, lo)
    assert ge.keys() == go.keys() and all(torch.equal(ge[k], go[k]) for k in ge)


def test_ema_with_gradient_accumulation_and_autocast_follows_eager() -> None:
    torch.manual_seed(0)
    base = Step(DiT())
    runs = []
    for wrap in (False, True):
        model = copy.deepcopy(base)
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(
                model, check_fn=lambda m: isinstance(m, DiTBlock))
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        losses = []
        for step in range(2):
            for micro in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(*batch(10 * step + micro, 8))
                (loss / 2).backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
        with torch.no_grad():
            sample = ema.module.net(*batch(99, 8))  # type: ignore[operator]
        runs.append((losses, list(model.parameters()), list(ema.parameters()), sample,
                     list(ema.state_dict())))
    (le, pe, ee, se, ke), (lo, po, eo, so, ko) = runs
    assert all(torch.equal(a, b) for a, b in zip(le, lo))
    assert all(torch.equal(a, b) for a, b in zip(pe, po))
    assert all(torch.equal(a, b) for a, b in zip(ee, eo))
    assert torch.equal(se, so) and ke == ko
