"""Module buffers a checkpointed layer's forward reads or writes, under FSDP2 and DDP (two ranks).

    python tests/distributed/state_cases.py OUT CASE [CASE ...]

A case is ``<wrapper>-<layer>``: wrapper ``fsdp`` (fully_shard on each layer, then the root)
or ``ddp`` (DistributedDataParallel around the model, broadcast_buffers on: rank 0's buffers
are copied into every rank's, in place, before each forward); layer ``bn`` (a BatchNorm1d,
an eval micro-batch then a train one before each backward) or ``fq`` (QAT's fused
fake-quant, whose kernel writes its buffers without moving their versions). Every case
checkpoints both its layers. Each rank writes ``OUT/<case>.rank<r>.pt``: per step the losses,
the full gradients and the buffers (``run``), or the traceback it raised. ``reference`` runs
the same steps on one process, unsharded and unwrapped, one model per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pytree_ckpt
from tests.distributed.rank_cases import run_cases

WORLD = 2
STEPS = 2
# Per step, the mode of each micro-batch (True: train); all forwards, then one backward.
MODES = {"bn": (False, True), "fq": (True, True)}


class Layer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.state = nn.BatchNorm1d(8) if kind == "bn" else \
            torch.ao.quantization.FusedMovingAvgObsFakeQuantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.state(self.lin(x)))


def make_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Layer(kind), Layer(kind), nn.Linear(8, 1))


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * rank + 10 * step
                                                                       + micro))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor under FSDP2
    return (full() if full is not None else t).detach().clone()


def run(model: nn.Module, kind: str, rank: int, *, read_clones: bool = False,
        before_forward: Any = None) -> list[dict[str, Any]]:
    """STEPS SGD steps of MODES[kind]'s micro-batches: per step the losses, full gradients and
    buffers after the step. With ``read_clones`` an eval micro-batch runs on clones of the
    buffers (its backward reads what its forward read); ``before_forward()`` runs before each
    micro-batch's forward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = getattr(model, "module", model)  # DDP's wrapped model
    steps = []
    for step in range(STEPS):
        losses = []
        for micro, training in enumerate(MODES[kind]):
            if before_forward is not None:
                before_forward()
            inner.train(training)
            x = batch(rank, step, micro)
            if read_clones and not training:
                buffers = {name: b.clone() for name, b in inner.named_buffers()}
                losses.append(torch.func.functional_call(inner, buffers, (x,)).square().mean())
            else:
                losses.append(model(x).square().mean())
        inner.train()
        sum(losses).backward()
        steps.append({"losses": [loss.detach() for loss in losses],
                      "grads": {n: _full(p.grad) for n, p in inner.named_parameters()},
                      "buffers": {n: b.clone() for n, b in inner.named_buffers()}})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def reference(wrapper: str, kind: str) -> list[list[dict[str, Any]]]:
    """What each rank should see: eager on one process, one model per rank, the gradients
    averaged as data parallelism does ((g0 + g1) / 2: exact, NOTE [why bit for bit] in
    test_fsdp.py); under DDP rank 0's buffers copied into rank 1's before each forward."""
    models = [make_model(kind) for _ in range(WORLD)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    results: list[list[dict[str, Any]]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        losses: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]
        for micro, training in enumerate(MODES[kind]):
            if wrapper == "ddp":  # broadcast_buffers: rank 0's, in place, before each forward
                with torch.no_grad():
                    for mine, rank0 in zip(models[1].buffers(), models[0].buffers()):
                        mine.copy_(rank0)
            for rank, model in enumerate(models):
                model.train(training)
                x = batch(rank, step, micro)
                if training:
                    losses[rank].append(model(x).square().mean())
                else:  # what its forward read, in its backward too
                    buffers = {name: b.clone() for name, b in model.named_buffers()}
                    losses[rank].append(
                        torch.func.functional_call(model, buffers, (x,)).square().mean())
        for rank, model in enumerate(models):
            model.train()
            sum(losses[rank]).backward()
        named = [dict(m.named_parameters()) for m in models]
        grads = {n: (p.grad + named[1][n].grad) / WORLD for n, p in named[0].items()}
        for rank, model in enumerate(models):
            for name, p in model.named_parameters():
                p.grad = grads[name].clone()
            results[rank].append({"losses": [loss.detach() for loss in losses[rank]],
                                  "grads": {n: g.clone() for n, g in grads.items()},
                                  "buffers": {n: b.clone() for n, b in model.named_buffers()}})
            optimizers[rank].step()
            optimizers[rank].zero_grad()
    return results


def case(name: str, rank: int) -> list[dict[str, Any]]:
    wrapper, kind = name.split("-")
    model = make_model(kind)
    for layer in (model[1], model[2]):
        pytree_ckpt.apply_activation_checkpointing(layer, offload=False)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[1])
        fully_shard(model[2])
        fully_shard(model)
        return run(model, kind, rank)
    from torch.nn.parallel import DistributedDataParallel

    return run(DistributedDataParallel(model), kind, rank)


def main(out: Path, names: list[str]) -> None:
    run_cases(out, names, lambda name, rank: {"steps": case(name, rank)})

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
