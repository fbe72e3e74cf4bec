"""Long runs: what a process keeps across many steps and many models must not grow with them.

A training run is hundreds of thousands of steps, a sweep or an eval loop builds a model per
trial or checkpoint: a record, registry entry or cycle left per step or per model is a leak.
Each test compares what is kept after a few steps (or models) with what is kept after more.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import ActivationCensus, CheckpointWithoutOutput, checkpoint_layers

WIDTH = 16
LENGTHS = (8, 24, 40, 56, 72)  # varying lengths: fresh addresses each step


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        discard = CheckpointWithoutOutput()
        out = self.proj(discard.checkpoint(self.norm, h)).relu()
        discard.discard_output_and_register_recompute(out)
        return h + out


def _model(manager: OffloadManager | None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Layer() for _ in range(3)))
    checkpoint_layers(model, offload=manager if manager is not None else False)
    return model


def _step(model: nn.Module, step: int) -> None:
    x = torch.randn(LENGTHS[step % len(LENGTHS)], WIDTH, requires_grad=True)
    model(x).square().mean().backward()


def test_a_census_open_for_many_steps_keeps_records_only_for_what_is_still_held() -> None:
    # A census kept open over a training run (a monitor reading it between steps) kept one
    # record per storage ever saved: keyed by address, a record was replaced only when a new
    # storage came to the same address, and a discarded output's record never (it is filed
    # under a key of its own), so the records grew with every step (about 30 a step here, a
    # few thousand a step in an LLM) and note_refilled, which reads them all, slowed down.
    model = _model(OffloadManager(OffloadConfig(min_bytes=0), device="cpu"))
    records = []
    with ActivationCensus(model) as census:
        for step in range(20):
            _step(model, step)
            assert census.total_bytes == 0 and not census.discarded_bytes
            records.append(len(census._entries))
    one_step = records[0]
    # Bounded by what one step saves (records of dead storages are dropped in batches, once
    # they reach as many again as the records left after the last drop).
    assert max(records[-5:]) <= 2 * one_step + 64, records
