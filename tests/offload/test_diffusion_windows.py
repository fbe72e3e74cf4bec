"""Offload windows of diffusion models (helper MU): the conditioning tensor every DiT block
gets is copied once per pass, a UNet's skip tensors once each, and gradients stay eager's."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import offload
import pytree_ckpt
from tests.pytree_ckpt.diffusion_models import DiTBlock, ResBlock, grads


def manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


def test_conditioning_shared_by_dit_blocks_is_copied_once_with_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(DiTBlock() for _ in range(3))
    ours, man = copy.deepcopy(eager), manager()
    pytree_ckpt.apply_activation_checkpointing(
        ours, check_fn=lambda m: isinstance(m, DiTBlock), offload=man)
    x, cond, first = torch.randn(2, 16, 16), torch.randn(2, 16), nn.Linear(16, 16)
    result = []
    for blocks in (eager, ours):
        embed = copy.deepcopy(first)
        torch.manual_seed(1)   # the blocks' dropout
        c, h = embed(cond), x   # c: shared by every block, held by no op outside them
        for block in blocks:
            h = block(h, c)
        h.square().mean().backward()
        assert embed.weight.grad is not None
        result.append((grads(blocks), embed.weight.grad))
    (ge, we), (go, wo) = result
    assert ge.keys() == go.keys() and all(torch.equal(ge[k], go[k]) for k in ge)
    assert torch.equal(we, wo)
    stats = man.stats()
    hidden, c_bytes = 2 * 16 * 16 * 4, 2 * 16 * 4
    assert stats["windows"] == 3
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 3 * hidden + c_bytes
    assert stats["host_buffers_in_use"] == 0


class DownBlock(nn.Module):
    """Appends its output to the running skip list it is given and returns the list."""

    def __init__(self) -> None:
        super().__init__()
        self.r = ResBlock(8, 8, 16)

    def forward(self, h: torch.Tensor, hs: list[torch.Tensor], temb: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.r(h, temb)
        return h, hs + [h]


class UpBlock(nn.Module):
    """Pops the last skip of the list it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.r = ResBlock(16, 8, 16)

    def forward(self, h: torch.Tensor, hs: list[torch.Tensor], temb: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        *rest, skip = hs
        return self.r(torch.cat([h, skip], 1), temb), rest


def test_running_skip_list_passed_through_blocks_copies_each_skip_once_with_eager_gradients(
        ) -> None:
    torch.manual_seed(0)
    eager: Any = nn.ModuleDict({"inp": nn.Conv2d(3, 8, 3, padding=1),
                           "down": nn.ModuleList(DownBlock() for _ in range(3)),
                           "up": nn.ModuleList(UpBlock() for _ in range(3))})
    ours: Any = copy.deepcopy(eager)
    man = manager()
    pytree_ckpt.apply_activation_checkpointing(
        ours, check_fn=lambda m: isinstance(m, (DownBlock, UpBlock)), offload=man)
    x, temb = torch.randn(2, 3, 8, 8), torch.randn(2, 16)
    result = []
    for model in (eager, ours):
        torch.manual_seed(4)   # the res blocks' dropout
        h = model["inp"](x)
        hs = [h]
        for block in model["down"]:
            h, hs = block(h, hs, temb)
        for block in model["up"]:
            h, hs = block(h, hs, temb)
        (h.square().mean() + hs[0].mean()).backward()
        result.append(grads(model))
    ge, go = result
    assert ge.keys() == go.keys() and all(torch.equal(ge[k], go[k]) for k in ge)
    stats = man.stats()
    # six distinct 2x8x8x8 window tensors (the stem's and five blocks' outputs), temb once
    assert stats["windows"] == 6
    assert stats["offloaded_bytes"] == 6 * 2 * 8 * 8 * 8 * 4 + 2 * 16 * 4


def test_self_conditioning_and_no_grad_teacher_calls_before_backward_give_eager_gradients(
        ) -> None:
    """Self-conditioning (a no-grad call of the same blocks before the trained one) and a
    consistency target (a no-grad call after it, before backward), with offload on."""
    torch.manual_seed(0)
    eager = nn.ModuleList(DiTBlock() for _ in range(2))
    ours, man = copy.deepcopy(eager), manager()
    pytree_ckpt.apply_activation_checkpointing(
        ours, check_fn=lambda m: isinstance(m, DiTBlock), offload=man)
    x, c = torch.randn(2, 16, 16), torch.randn(2, 16)

    def run(blocks: Any, h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h, c)
        return h

    result = []
    for blocks in (eager, ours):
        torch.manual_seed(1)
        noisy = x + torch.randn_like(x)
        with torch.no_grad():
            self_cond = run(blocks, noisy)
        out = run(blocks, noisy + 0.1 * self_cond)
        with torch.no_grad():
            target = run(blocks, 0.9 * noisy)
        loss = (out - target).square().mean()
        loss.backward()
        result.append((loss, grads(blocks)))
    (le, ge), (lo, go) = result
    assert torch.equal(le, lo) and ge.keys() == go.keys()
    assert all(torch.equal(ge[k], go[k]) for k in ge)
    stats = man.stats()
    assert stats["windows"] == 2 and stats["host_buffers_in_use"] == 0
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 2 * 2 * 16 * 16 * 4 + 2 * 16 * 4
