"""A 2-D mesh, FSDP2 on dim 0 and tensor parallelism on dim 1, checkpointed or not: four ranks.

    python -m tests.distributed.mesh2d_cases          # launches 4 gloo ranks, checks, prints

Not in the suite: four ranks take about 20 s on a 2-core machine, one case as long as six
(the launch dominates). The blocks are ``tp_cases.py``'s under its ``mlp``, ``sp`` and ``drop``
plans, built on the ``tp`` dimension of a (2, 2) mesh, then, as docs/scaling.md's "Tensor
parallelism" says, checkpointed (offload off or on), then ``fully_shard`` on the ``dp``
dimension (each block, then the root). Each ``dp`` rank trains on its own batch, split by
sequence over its ``tp`` pair under ``sp``/``drop``. The reference is the same model without
the boundary: per rank and SGD step (two), the loss, the input's gradient and every
parameter's full gradient must be equal bit for bit, and each block must run twice a step.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from tests.distributed import tp_cases
from tests.distributed.launch import run_ranks
from tests.distributed.rank_cases import run_cases

WORLD = 4
CASES = [f"{plan}-{offload}" for plan in ("mlp", "sp", "drop") for offload in ("off", "on")]


class Stack(nn.Module):
    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


def build(plan: str, mesh: DeviceMesh, calls: Counter[int],
          manager: OffloadManager | None, checkpoint: bool) -> Stack:
    blocks = tp_cases.make_model(plan, mesh["tp"], calls)        # 1. tensor parallelism
    if checkpoint:                                                # 2. the boundary
        pytree_ckpt.checkpoint_layers(blocks, offload=manager if manager is not None else False)
    for block in blocks:                                          # 3. FSDP2 on dim 0
        fully_shard(block, mesh=mesh["dp"])
    model = Stack(blocks)
    fully_shard(model, mesh=mesh["dp"])
    return model


def run(model: Stack, plan: str, mesh: DeviceMesh, calls: Counter[int]) -> list[dict[str, Any]]:
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(tp_cases.STEPS):
        torch.manual_seed(100 + step)  # the dropout masks: the same stream for both runs
        x = torch.randn(tp_cases.BATCH, tp_cases.SEQ, tp_cases.DIM,
                        generator=torch.Generator().manual_seed(10 * dp + step))
        if plan != "mlp":
            x = x.chunk(2, dim=1)[tp].contiguous()
        x.requires_grad_()
        calls.clear()
        loss = model(x).square().sum()
        loss.backward()
        steps.append({"loss": loss.detach(), "input_grad": x.grad.clone(),
                      "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                      "calls": [calls[i] for i in range(3)]})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def rank_main(out: Path) -> None:
    meshes: list[DeviceMesh] = []

    def case(name: str, rank: int) -> dict[str, Any]:
        if not meshes:  # after run_cases made the group; every rank makes it at its first case
            meshes.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        mesh = meshes[0]
        plan, offload = name.split("-")
        calls: Counter[int] = Counter()
        eager = run(build(plan, mesh, calls, None, False), plan, mesh, calls)
        manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu") \
            if offload == "on" else None
        ckpt = run(build(plan, mesh, calls, manager, True), plan, mesh, calls)
        return {"eager": eager, "ckpt": ckpt}

    run_cases(out, CASES, case)


def mismatches(out: Path) -> list[str]:
    found = []
    for name in CASES:
        for rank in range(WORLD):
            result = torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)
            if not result["ok"]:
                found.append(f"{name} rank {rank}: {result['error']}")
                continue
            for step, (eager, ckpt) in enumerate(zip(result["eager"], result["ckpt"])):
                where = f"{name} rank {rank} step {step}"
                if eager["calls"] != [1, 1, 1] or ckpt["calls"] != [2, 2, 2]:
                    found.append(f"{where}: calls {eager['calls']} / {ckpt['calls']}")
                for key in ("loss", "input_grad"):
                    if not torch.equal(eager[key], ckpt[key]):
                        found.append(f"{where}: {key}")
                for param, grad in eager["grads"].items():
                    if not torch.equal(grad, ckpt["grads"][param]):
                        found.append(f"{where}: {param}")
    return found


def launch() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        ran = run_ranks(["-m", "tests.distributed.mesh2d_cases", str(out)], WORLD,
                        timeout=300.0, log_dir=out)
        took = time.perf_counter() - start
        if not ran.ok:
            sys.stderr.write(ran.output() + "\n")
            return 1
        found = mismatches(out)
    for line in found:
        sys.stderr.write(line + "\n")
    sys.stdout.write(f"{len(CASES)} cases on a (dp 2, tp 2) mesh, {took:.1f} s: "
                     f"{'bit for bit' if not found else f'{len(found)} mismatches'}\n")
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(Path(sys.argv[1]))
    else:
        sys.exit(launch())
