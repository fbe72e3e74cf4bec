"""Checkpointed stages under torch.distributed.pipelining's schedules (two ranks, gloo).

    python tests/distributed/pipeline_cases.py OUT CASE [CASE ...]

A case is ``<schedule>-<wrap>``: schedule a key of ``SCHEDULES``; wrap ``plain`` (no
checkpoint), ``ckpt`` (each block through ``pytree_ckpt.checkpoint_layers``, offload off) or
``offload`` (the same, offload on). The model is ``BLOCKS`` residual blocks; a schedule with one
stage a rank gives each rank two consecutive blocks, one with two stages a rank gives each stage
one block (rank r holds stages r and r + 2, or r and 3 - r for the V-shaped ones). Each rank
writes ``OUT/<case>.rank<r>.pt``: per step its losses (last stage only), the gradients of its
blocks' parameters (named as in the whole model), how many times each of its blocks ran
forward and how many matrix products ran; or the traceback it raised. ``reference`` runs the
same steps in eager on one process.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pytree_ckpt
from tests.conftest import MatrixProducts
from tests.distributed.rank_cases import run_cases

WORLD = 2
BLOCKS = 4
MICRO = 4  # micro-batches a step
STEPS = 2
WIDTH = 8
# name: (class name in torch.distributed.pipelining, stages a rank, V-shaped)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved": ("ScheduleInterleaved1F1B", 2, False),
    "loopedbfs": ("ScheduleLoopedBFS", 2, False),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, False),
    "zbv": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}
CALLS: Counter[int] = Counter()  # forward calls of each block on real (not meta) tensors


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.norm = nn.LayerNorm(2 * WIDTH)
        self.lin2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # the stage's shape inference runs forward on meta tensors
            CALLS[self.index] += 1
        return x + self.lin2(nn.functional.gelu(self.norm(self.lin1(x))))


def make_model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(i) for i in range(BLOCKS))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(2 * MICRO, WIDTH, generator=generator),
            torch.randn(2 * MICRO, WIDTH, generator=generator))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def rank_stages(schedule: str, rank: int) -> list[tuple[int, list[int]]]:
    """The stages this rank holds: each its stage index and its blocks."""
    _, per_rank, v_shaped = SCHEDULES[schedule]
    if per_rank == 1:
        return [(rank, [2 * rank, 2 * rank + 1])]
    stages = [rank, 2 * WORLD - 1 - rank] if v_shaped else [rank, rank + WORLD]
    return [(s, [s]) for s in stages]


def reference(schedule: str) -> list[dict[str, Any]]:
    """Eager on one process: the micro-batches' losses backpropagated one by one in the order
    the schedule accumulates them in (LoopedBFS: last micro-batch first), the gradients scaled
    by 1 / MICRO as the schedules' ``scale_grads`` does (exact: a power of two)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        CALLS.clear()
        x, target = batch(step)
        losses = []
        for xs, ts in zip(x.chunk(MICRO), target.chunk(MICRO)):
            h = xs
            for block in model:
                h = block(h)
            losses.append(loss_fn(h, ts))
        for loss in reversed(losses) if schedule == "loopedbfs" else losses:
            loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(MICRO)
        steps.append({"losses": [loss.detach() for loss in losses],
                      "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                      "calls": dict(CALLS)})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def case(name: str, rank: int) -> list[dict[str, Any]]:
    import torch.distributed.pipelining as pipelining

    schedule, wrap = name.split("-")
    class_name, per_rank, _ = SCHEDULES[schedule]
    model = make_model()
    if wrap != "plain":
        pytree_ckpt.checkpoint_layers(model, offload=wrap == "offload")
    held = rank_stages(schedule, rank)
    num_stages = WORLD * per_rank
    stages = [pipelining.PipelineStage(nn.Sequential(*(model[i] for i in blocks)), index,
                                       num_stages, torch.device("cpu"))
              for index, blocks in held]
    ours = {i for _, blocks in held for i in blocks}
    params = {n: p for n, p in model.named_parameters() if int(n.split(".")[0]) in ours}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    cls = getattr(pipelining, class_name)
    runner = cls(stages[0] if per_rank == 1 else stages, MICRO, loss_fn=loss_fn)
    first = any(index == 0 for index, _ in held)
    last = any(index == num_stages - 1 for index, _ in held)
    steps = []
    for step in range(STEPS):
        CALLS.clear()
        x, target = batch(step)
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if last else {}
        with MatrixProducts() as products:
            runner.step(*args, **kwargs)
        steps.append({"losses": [loss.detach() for loss in losses],
                      "products": products.count,
                      "grads": {n: None if p.grad is None else p.grad.clone()
                                for n, p in params.items()},
                      "calls": dict(CALLS)})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def main(out: Path, names: list[str]) -> None:
    run_cases(out, names, lambda name, rank: {"steps": case(name, rank)})

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
