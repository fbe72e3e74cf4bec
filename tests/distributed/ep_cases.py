"""Expert parallelism (all-to-all MoE) inside checkpointed blocks, two CPU ranks (gloo).

    python tests/distributed/ep_cases.py OUT CASE [CASE ...]

The model: a Linear embedding, two MoE blocks, a Linear head. A block routes each of its
rank's tokens to the top 2 of 4 experts (a router Linear), dispatches the (token, slot) pairs
to the ranks holding their experts (2 experts a rank, capacity: every token) with
``dist.all_to_all_single`` in an autograd Function whose backward is the inverse all-to-all,
runs them through the local experts, and combines them back, weighted by the renormalised
softmax of the router's logits at the chosen ids (so the router gets its gradient). fp32.

A case is ``<routing>-<offload>``; routing:

- ``frozen``: the expert choice goes through ``reuse_during_recompute`` (the replay reuses it);
- ``plain``: it is recomputed in the replay (a deterministic top-k: the same choice);
- ``jitter_frozen`` / ``jitter_plain``: the choice adds noise drawn from a generator the
  block holds as an attribute (not an argument of the block; the boundary restores it for the
  replay: NOTE [generators held as attributes] in pytree_ckpt/held_generators.py): frozen, the
  replay reuses the original choice; plain, it draws the original pass's noise again.

Offload ``on``: an ``OffloadManager`` (min_bytes 0) on each block. Each rank writes
``OUT/<case>.rank<r>.pt``: for the unwrapped EP model (``eager``) and the checkpointed one
(``ckpt``), per SGD step the loss, every gradient, block calls and collectives by phase, the
expert ids each block chose by phase, the state of each block's noise generator after the
step, and offload stats; or the traceback it raised.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from tests.distributed.rank_cases import run_cases

WORLD = 2
EXPERTS = 4
LOCAL = EXPERTS // WORLD  # experts a rank
TOP_K = 2
DIM = 8
TOKENS = 6  # a rank's tokens a step
STEPS = 2
ROUTINGS = ("frozen", "plain", "jitter_frozen", "jitter_plain")


class Counts:
    """What ran, by ``what|part|phase``: ``part`` is the step's forward or backward, ``phase``
    pytree_ckpt.current_phase() where it ran."""

    def __init__(self) -> None:
        self.part = "forward"
        self.seen: Counter[str] = Counter()
        self.ids: list[tuple[int, str, torch.Tensor]] = []

    def add(self, what: str) -> None:
        self.seen[f"{what}|{self.part}|{pytree_ckpt.current_phase()}"] += 1


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with the inverse all-to-all as its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                counts: Counts, what: str) -> torch.Tensor:
        ctx.splits, ctx.counts, ctx.what = (out_splits, in_splits), counts, what
        counts.add(what)
        received = x.new_empty(sum(out_splits), *x.shape[1:])
        # gloo's worker thread lets go of a finished work (and its tensors) only after the
        # caller has gone on. Given x itself (its graph: a replay's input behind it) or
        # returning the buffer it wrote (autograd gives the returned tensor this node), the
        # work held that graph a moment past backward's last use, and under CPU load the
        # offload manager judged the input alive elsewhere (alive_elsewhere_bytes 192). So
        # gloo gets tensors without a graph: x detached, and a buffer returned as a copy.
        dist.all_to_all_single(received, x.detach().contiguous(), out_splits, in_splits)
        return received.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        ctx.counts.add(f"{ctx.what}_grad")
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None, None, None


class MoEBlock(nn.Module):
    def __init__(self, index: int, rank: int, routing: str, counts: Counts) -> None:
        super().__init__()
        self.index, self.routing, self.counts = index, routing, counts
        self.router = nn.Linear(DIM, EXPERTS)
        experts = [nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, DIM))
                   for _ in range(EXPERTS)]  # built on every rank: the same weights
        self.experts = nn.ModuleList(experts[rank * LOCAL:(rank + 1) * LOCAL])
        # Router noise from a generator of its own, held as an attribute: the boundary
        # restores it for the replay, as torch's default generators and those passed in.
        self.noise = torch.Generator().manual_seed(1000 + 10 * rank + index)

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        if self.routing.startswith("jitter"):
            logits = logits + torch.randn(logits.shape, generator=self.noise)
        return logits.topk(TOP_K, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counts.add(f"block{self.index}")
        logits = self.router(x)
        if self.routing.endswith("frozen"):
            ids = pytree_ckpt.reuse_during_recompute(self.select, logits.detach())
        else:
            ids = self.select(logits.detach())
        self.counts.ids.append((self.index, str(pytree_ckpt.current_phase()), ids.clone()))
        gates = logits.softmax(-1).gather(-1, ids)
        gates = gates / gates.sum(-1, keepdim=True)

        # Dispatch: the (token, slot) pairs sorted by expert, so by the rank holding it.
        experts = ids.reshape(-1)
        order = experts.argsort(stable=True)
        experts = experts[order]
        send = torch.bincount(experts // LOCAL, minlength=WORLD)
        recv = torch.empty_like(send)
        self.counts.add("splits")
        dist.all_to_all_single(recv, send)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        local_ids = torch.empty(sum(recv_splits), dtype=experts.dtype)
        self.counts.add("expert_ids")
        dist.all_to_all_single(local_ids, (experts % LOCAL).contiguous(), recv_splits,
                               send_splits)
        pairs = x.repeat_interleave(TOP_K, dim=0)[order]
        routed = AllToAll.apply(pairs, recv_splits, send_splits, self.counts, "dispatch")

        computed = torch.zeros_like(routed)
        for j, expert in enumerate(self.experts):
            rows = (local_ids == j).nonzero().squeeze(1)
            computed = computed.index_copy(0, rows, expert(routed[rows]))

        # Combine: back to the ranks the pairs came from, then to token order.
        back = AllToAll.apply(computed, send_splits, recv_splits, self.counts, "combine")
        back = torch.zeros_like(back).index_copy(0, order, back)
        return x + (back.view(-1, TOP_K, DIM) * gates.unsqueeze(-1)).sum(1)


class Model(nn.Module):
    def __init__(self, rank: int, routing: str, counts: Counts) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(MoEBlock(i, rank, routing, counts) for i in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def run(model: Model, counts: Counts, rank: int,
        manager: OffloadManager | None) -> list[dict[str, Any]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        counts.part, counts.seen, counts.ids = "forward", Counter(), []
        loss = model(batch(rank, step)).square().mean()
        counts.part = "backward"
        loss.backward()
        steps.append({"loss": loss.detach(),
                      "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                      "counts": dict(counts.seen), "ids": list(counts.ids),
                      "noise": [block.noise.get_state() for block in model.blocks],
                      "offload": None if manager is None else manager.stats()})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def case(name: str, rank: int) -> dict[str, Any]:
    routing, offload = name.split("-")
    counts = Counts()
    eager = run(Model(rank, routing, counts), counts, rank, None)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu") if offload == "on" \
        else None
    model = Model(rank, routing, counts)
    for block in model.blocks:
        pytree_ckpt.apply_activation_checkpointing(
            block, offload=manager if manager is not None else False)
    result: dict[str, Any] = {"ok": True, "eager": eager}
    try:
        result["ckpt"] = run(model, counts, rank, manager)
    except Exception:
        result["ckpt_error"] = traceback.format_exc()
    return result


def main(out: Path, names: list[str]) -> None:
    run_cases(out, names, case)

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
