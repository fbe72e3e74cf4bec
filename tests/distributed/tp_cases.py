"""Tensor parallelism (``parallelize_module``) inside checkpointed blocks, two ranks.

    python tests/distributed/tp_cases.py OUT CASE [CASE ...]

A case is ``<plan>-<offload>[-late]``: offload ``off`` or ``on`` (a manager with
``min_bytes=0``); ``late``: tensor parallelism applied after checkpointing (else before); and
the plan applied to each of three blocks (an RMSNorm, then a SwiGLU MLP w1/w3/w2) on a 1-D mesh
of both ranks, as torchtitan applies it before activation checkpointing:

- ``mlp``: ColwiseParallel on w1 and w3, RowwiseParallel on w2; the residual stream is a plain
  tensor, the same on both ranks.
- ``sp``: sequence parallelism as torchtitan: SequenceParallel on the norm,
  PrepareModuleInput(Shard(1) -> Replicate) on the MLP (its all-gather), w2 RowwiseParallel to
  Shard(1) (a reduce-scatter); the residual stream is each rank's plain local sequence shard.
- ``drop``: ``sp`` with an nn.Dropout on the MLP's hidden (a plain local tensor).
- ``dt``: ``sp`` whose w2 keeps its DTensor output (``use_local_output=False``), so the residual
  stream, the blocks' inputs and outputs, are DTensors (Shard(1)), with an nn.Dropout on the
  MLP's DTensor output. (On CPU a DTensor random op draws from the CPU generator: torch's
  offset-based RNG tracker is CUDA-only, so it is not exercised here.)

Each rank runs STEPS SGD steps of the same TP model twice, unwrapped (``eager``) and with every
block checkpointed (``ckpt``), each under an ActivationCensus, and writes
``OUT/<case>.rank<r>.pt``: per step the loss, the output, the input's gradient, every parameter's
full gradient, the census's bytes by mechanism after the forward, the DTensor collectives by
part (forward, backward) and phase, and the blocks' forward calls; or the traceback it raised.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from tests.distributed.rank_cases import run_cases

WORLD = 2
STEPS = 2
DIM, HIDDEN, BATCH, SEQ = 8, 16, 2, 6
PLANS = ("mlp", "sp", "drop", "dt")
# What DTensor's redistributions call: the _single forms on torch 2.13; before them (2.11,
# 2.9) the _tensor ones.
COLLECTIVES = ("all_reduce",
               "all_gather_single" if hasattr(funcol, "all_gather_single") else
               "all_gather_tensor",
               "reduce_scatter_single" if hasattr(funcol, "reduce_scatter_single") else
               "reduce_scatter_tensor")


class MLP(nn.Module):
    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.drop = nn.Dropout(0.25) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(nn.functional.silu(self.w1(x)) * self.w3(x)))


class CallCount(Counter[int]):
    """The blocks' forward calls, the replay's included: a subclass, which the boundary reads
    by identity (an exact Counter a module holds is read by its entries and gets them back
    after the replay: NOTE [numbers and flags as the forward began], forward_numbers.py)."""


class Block(nn.Module):
    def __init__(self, plan: str, calls: Counter[int], index: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.mlp = MLP(plan == "drop")
        self.drop = nn.Dropout(0.25) if plan == "dt" else nn.Identity()
        self.calls, self.index = calls, index  # a CallCount: counts the replay too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[self.index] += 1
        return x + self.drop(self.mlp(self.norm(x)))


def make_model(plan: str, mesh: DeviceMesh, calls: Counter[int],
               before_tp: Callable[[nn.ModuleList], Any] | None = None) -> nn.ModuleList:
    """Three blocks under ``plan``; ``before_tp(blocks)`` runs before it is applied."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(plan, calls, i) for i in range(3))
    if before_tp is not None:
        before_tp(blocks)
    for block in blocks:
        if plan == "mlp":
            layout: dict[str, Any] = {"mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                                      "mlp.w2": RowwiseParallel()}
        else:
            layout = {"norm": SequenceParallel(),
                      "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
                      "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                      "mlp.w2": RowwiseParallel(output_layouts=Shard(1),
                                                use_local_output=plan != "dt")}
        parallelize_module(block, mesh, layout)
    return blocks


def local_input(plan: str, rank: int, step: int) -> torch.Tensor:
    """This rank's part of the step's input: all of it (``mlp``), else its sequence shard."""
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(step))
    return x if plan == "mlp" else x.chunk(WORLD, dim=1)[rank].contiguous()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Collectives:
    """DTensor's functional collectives, counted by (name, part, phase) while installed."""

    def __init__(self) -> None:
        self.part = "forward"
        self.seen: Counter[str] = Counter()
        self.originals = {name: getattr(funcol, name) for name in COLLECTIVES}
        for name, original in self.originals.items():
            setattr(funcol, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.seen[f"{name}|{self.part}|{pytree_ckpt.current_phase()}"] += 1
            return original(*args, **kwargs)
        return counted

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(funcol, name, original)


def run(blocks: nn.ModuleList, plan: str, rank: int, mesh: DeviceMesh, calls: Counter[int],
        manager: OffloadManager | None) -> list[dict[str, Any]]:
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # the dropout masks: the same stream for both runs
        x = local_input(plan, rank, step).requires_grad_()
        h: torch.Tensor = DTensor.from_local(x, mesh, [Shard(1)]) if plan == "dt" else x
        calls.clear()
        counted = Collectives()
        try:
            with pytree_ckpt.ActivationCensus(blocks) as census:
                for block in blocks:
                    h = block(h)
            held = census.bytes_by("mechanism")
            out = h.to_local() if isinstance(h, DTensor) else h
            loss = out.square().sum()
            counted.part = "backward"
            loss.backward()
        finally:
            counted.remove()
        steps.append({"loss": loss.detach(), "out": out.detach().clone(),
                      "input_grad": x.grad.clone(), "out_type": type(h).__name__,
                      "grads": {n: _full(p.grad) for n, p in blocks.named_parameters()},
                      "grad_types": sorted({type(p.grad).__name__ for p in blocks.parameters()}),
                      "census": held, "collectives": dict(counted.seen),
                      "calls": [calls[i] for i in range(len(blocks))],
                      "offload": None if manager is None else manager.stats()})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def case(name: str, rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    plan, offload, *order = name.split("-")
    calls: Counter[int] = CallCount()
    eager = run(make_model(plan, mesh, calls), plan, rank, mesh, calls, None)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu") if offload == "on" \
        else None

    def checkpoint(blocks: nn.ModuleList) -> None:
        pytree_ckpt.checkpoint_layers(blocks, offload=manager if manager is not None else False)

    if order == ["late"]:  # tensor parallelism applied to blocks already checkpointed
        blocks = make_model(plan, mesh, calls, before_tp=checkpoint)
    else:
        blocks = make_model(plan, mesh, calls)
        checkpoint(blocks)
    return {"eager": eager, "ckpt": run(blocks, plan, rank, mesh, calls, manager)}


def main(out: Path, names: list[str]) -> None:
    meshes: list[DeviceMesh] = []

    def with_mesh(name: str, rank: int) -> dict[str, Any]:
        if not meshes:  # after run_cases made the group; every rank makes it at its first case
            meshes.append(init_device_mesh("cpu", (WORLD,)))
        return case(name, rank, meshes[0])

    run_cases(out, names, with_mesh)

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
