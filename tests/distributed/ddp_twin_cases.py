"""DDP around pytree-ckpt layers against the same DDP around the eager twin, two ranks.

    python tests/distributed/ddp_twin_cases.py OUT [CASE ...]

Each case trains a fresh copy of one model (seed 0) twice under DDP on the same per-rank
batches, STEPS SGD steps with momentum: plain, and checkpointed; it compares every step's
gradients and the final parameters and buffers bit for bit (``torch.equal``) and writes
``OUT/rank<r>.json``: case -> ``"OK"``, ``"DIFF ..."`` or ``"RAISE ..."`` (helper RE, session
47). The cases cover, with layers checkpointed, offloaded (a manager with ``min_bytes=0``) or
keeping a save unit's ``addmm``:

- gradient accumulation under ``no_sync`` (also only from the second step on, under
  ``static_graph``), ``find_unused_parameters`` with LayerDrop, an early exit on rank 1 only,
  an output rank 1 drops, an MoE expert no token reaches (on one rank or both) and routing that
  varies by step, micro-batch and rank;
- ``static_graph``, ``gradient_as_bucket_view``, tiny buckets, the fp16 compression hook and an
  all-reduce hook of our own, ``ZeroRedundancyOptimizer``, gradients zeroed instead of set to
  ``None``;
- a weight tied inside and outside a checkpointed block, BatchNorm with and without
  ``broadcast_buffers``, a block called twice in one forward;
- checkpointing applied after the DDP wrap (to the inner model, or through ``check_fn`` to
  the DDP module), Join with one more step on rank 1, ``verify_replay``;
- ``pytree_ckpt.checkpoint`` of a block and of a closure over it, and ``checkpointed(block)``,
  called in the forward where the eager twin calls the block;
- output discard (``CheckpointWithoutOutput``) of the tanh inside each block, alone and with
  the blocks also checkpointed (a wrap the forward bypasses: it calls the blocks' submodules).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, get_type_hints

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import offload
import pytree_ckpt
from pytree_ckpt import KeptOps, RecomputeConfig, SaveUnit

STEPS = 3
DIM = 8
BATCH = 6

Grads = dict[str, torch.Tensor | None]
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class MoE(nn.Module):
    """Two experts; a token goes to the second where its first feature exceeds ``threshold``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        high = x[:, 0] > self.threshold
        for k, expert in enumerate(self.experts):
            chosen = high if k else ~high
            if chosen.any():
                out = out.index_add(0, chosen.nonzero()[:, 0], expert(x[chosen]))
        return x + out


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.a(x)))


class Net(nn.Module):
    """Three blocks and a head; the forward skips the blocks whose index is in ``skip``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        return self.head(x)


class DeadOutputNet(Net):
    """Runs every block; while ``dead``, the second block's output is not used."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            y = layer(x)
            if not (i == 1 and self.dead):
                x = y
        return self.head(x)


class DiscardNet(Net):
    """Calls each block's submodules itself (not the block's forward); while ``discard``, it
    discards the tanh between them."""

    def __init__(self) -> None:
        super().__init__()
        self.discard = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            assert isinstance(layer, Block)
            if not self.discard:
                x = x + layer.b(torch.tanh(layer.a(x)))
                continue
            discard = pytree_ckpt.CheckpointWithoutOutput()
            h = discard.checkpoint(torch.tanh, layer.a(x))
            y = layer.b(h)
            discard.discard_output_and_register_recompute(y)
            x = x + y
        return self.head(x)


LayerCall = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class CallingNet(Net):
    """Calls each block through ``call``: the plain call, or one of pytree_ckpt's functions."""

    def __init__(self) -> None:
        super().__init__()
        self.call: LayerCall = plain_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.call(layer, x)
        return self.head(x)


def plain_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def checkpoint_module(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pytree_ckpt.checkpoint(layer, x)


def checkpoint_closure(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pytree_ckpt.checkpoint(lambda t: layer(t), x)


def call_checkpointed(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pytree_ckpt.checkpointed(layer)(x)


class TiedBlock(nn.Module):
    def __init__(self, embedding: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.shared = embedding.weight  # registered here too: one parameter, two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) @ self.shared)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(DIM, DIM, bias=False)
        self.blk = TiedBlock(self.emb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blk(self.emb(x))
        return (h @ self.emb.weight).sum(-1, keepdim=True)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = Block()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(self.blk(x)))


def moe_net(threshold: float = 10.0) -> Net:
    """``Net`` with an MoE second block; at the default threshold no token reaches expert 1."""
    net = Net()
    net.layers[1] = MoE(threshold)
    return net


def moe_net_rank0_reaches_both() -> Net:
    return moe_net(0.0 if dist.get_rank() == 0 else 10.0)


def bn_net() -> Net:
    net = Net()
    net.layers[1] = BNBlock()
    return net


# What the checkpointed run applies to its model (the eager run gets none of them).
def layers_checkpointed(model: nn.Module) -> None:
    assert isinstance(model, Net)
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=False)


def layers_checkpointed_verified(model: nn.Module) -> None:
    assert isinstance(model, Net)
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=False, verify_replay=True)


def cpu_offload() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


def layers_offloaded(model: nn.Module) -> None:
    assert isinstance(model, Net)
    pytree_ckpt.checkpoint_layers(model.layers, ratio=1.0, offload=cpu_offload())


def layers_keep_addmm(model: nn.Module) -> None:
    assert isinstance(model, Net)
    pytree_ckpt.apply_recompute_config(model.layers, RecomputeConfig(1.0, save=["attn"]),
                                       {SaveUnit.ATTN: KeptOps("aten::addmm")}, offload=False)


def blocks_by_check_fn(model: nn.Module) -> None:
    pytree_ckpt.apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, (Block, MoE, BNBlock, TiedBlock)), offload=False)


def blocks_by_check_fn_offloaded(model: nn.Module) -> None:
    pytree_ckpt.apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, (Block, MoE)), offload=cpu_offload())


def twice_block_checkpointed(model: nn.Module) -> None:
    assert isinstance(model, Twice)
    pytree_ckpt.apply_activation_checkpointing(model.blk, offload=False)


def blocks_of_ddp_by_check_fn(ddp: nn.Module) -> None:
    pytree_ckpt.apply_activation_checkpointing(
        ddp, check_fn=lambda m: isinstance(m, Block), offload=False)


def outputs_discarded(model: nn.Module) -> None:
    assert isinstance(model, DiscardNet)
    model.discard = True


def outputs_discarded_and_layers_checkpointed(model: nn.Module) -> None:
    outputs_discarded(model)
    layers_checkpointed(model)


def calls_through(call: LayerCall) -> Callable[[nn.Module], None]:
    def checkpoint(model: nn.Module) -> None:
        assert isinstance(model, CallingNet)
        model.call = call

    return checkpoint


def unchanged(model: nn.Module) -> None:
    """For a case that checkpoints through ``Case.checkpoint_ddp`` instead."""


# Called before each micro-batch's forward, with (model, step, micro-batch, rank).
def layerdrop(model: nn.Module, step: int, micro: int, rank: int) -> None:
    assert isinstance(model, Net)
    model.skip = {1} if step == 1 else set()


def rank1_exits_early(model: nn.Module, step: int, micro: int, rank: int) -> None:
    assert isinstance(model, Net)
    model.skip = {2} if rank == 1 and step != 0 else set()


def route_by_step_micro_and_rank(model: nn.Module, step: int, micro: int, rank: int) -> None:
    assert isinstance(model, Net)
    moe = model.layers[1]
    assert isinstance(moe, MoE)
    moe.threshold = 10.0 if (step + micro + rank) % 2 == 0 else 0.0


def rank1_drops_an_output(model: nn.Module, step: int, micro: int, rank: int) -> None:
    assert isinstance(model, DeadOutputNet)
    model.dead = rank == 1 and step >= 1


def own_allreduce_hook(state: Any, bucket: dist.GradBucket
                       ) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP refuses a hook whose annotations are not GradBucket and Future[Tensor] themselves, and
# `from __future__ import annotations` leaves them strings.
own_allreduce_hook.__annotations__.update(get_type_hints(own_allreduce_hook))


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    checkpoint: Callable[[nn.Module], None]
    ddp: dict[str, Any] = dataclasses.field(default_factory=dict)
    micro: int = 1  # micro-batches a step, all but the last under no_sync
    first_step_micro: int | None = None  # the first step's, where it differs
    before_micro: Callable[[nn.Module, int, int, int], None] | None = None
    comm_hook: CommHook | None = None
    zero: bool = False  # ZeroRedundancyOptimizer around the SGD
    join: bool = False  # under Join, rank 1 one step more
    set_to_none: bool = True
    checkpoint_after_ddp: bool = False
    checkpoint_ddp: Callable[[nn.Module], None] | None = None  # applied to the DDP module


FIND_UNUSED: dict[str, Any] = {"find_unused_parameters": True}
STATIC: dict[str, Any] = {"static_graph": True}
BUCKET_VIEW: dict[str, Any] = {"gradient_as_bucket_view": True}

# No PowerSGD hook case: its hook hangs under gloo on CPU.
CASES: dict[str, Case] = {
    "layers_checkpointed": Case(Net, layers_checkpointed),
    "layers_offloaded": Case(Net, layers_offloaded),
    "layers_keep_addmm": Case(Net, layers_keep_addmm),
    "no_sync_offloaded": Case(Net, layers_offloaded, micro=3),
    "no_sync_find_unused": Case(Net, layers_checkpointed, FIND_UNUSED, micro=3),
    "layerdrop_find_unused": Case(Net, layers_checkpointed, FIND_UNUSED, before_micro=layerdrop),
    "rank1_exits_early_find_unused": Case(Net, layers_checkpointed, FIND_UNUSED,
                                          before_micro=rank1_exits_early),
    "moe_expert_never_reached_find_unused": Case(moe_net, blocks_by_check_fn, FIND_UNUSED),
    "moe_expert_reached_on_rank0_only_find_unused": Case(moe_net_rank0_reaches_both,
                                                         blocks_by_check_fn, FIND_UNUSED),
    "moe_expert_never_reached_no_sync_find_unused": Case(moe_net, blocks_by_check_fn,
                                                         FIND_UNUSED, micro=2),
    "moe_expert_never_reached_static_graph": Case(moe_net, blocks_by_check_fn, STATIC),
    "static_graph": Case(Net, layers_checkpointed, STATIC),
    "gradient_as_bucket_view": Case(Net, layers_checkpointed, BUCKET_VIEW),
    "gradient_as_bucket_view_no_sync": Case(Net, layers_checkpointed, BUCKET_VIEW, micro=2),
    "fp16_compress_hook": Case(Net, layers_checkpointed,
                               comm_hook=default_hooks.fp16_compress_hook),
    "own_allreduce_hook": Case(Net, layers_checkpointed, comm_hook=own_allreduce_hook),
    "zero_redundancy_optimizer": Case(Net, layers_checkpointed, zero=True),
    "tied_weight": Case(Tied, blocks_by_check_fn),
    "tied_weight_find_unused": Case(Tied, blocks_by_check_fn, FIND_UNUSED),
    "batchnorm": Case(bn_net, blocks_by_check_fn),
    "batchnorm_without_broadcast_buffers": Case(bn_net, blocks_by_check_fn,
                                                {"broadcast_buffers": False}),
    "checkpointed_after_ddp_wrap": Case(Net, layers_checkpointed, checkpoint_after_ddp=True),
    "checkpointed_after_ddp_wrap_find_unused": Case(Net, layers_checkpointed, FIND_UNUSED,
                                                    checkpoint_after_ddp=True),
    "join_uneven_inputs": Case(Net, layers_checkpointed, join=True),
    "join_uneven_inputs_offloaded": Case(Net, layers_offloaded, join=True),
    "tiny_buckets": Case(Net, layers_checkpointed, {"bucket_cap_mb": 0.0001}),
    "block_called_twice": Case(Twice, twice_block_checkpointed),
    "block_called_twice_find_unused": Case(Twice, twice_block_checkpointed, FIND_UNUSED),
    "block_called_twice_static_graph": Case(Twice, twice_block_checkpointed, STATIC),
    "output_discard": Case(DiscardNet, outputs_discarded),
    "output_discard_beside_bypassed_checkpointed_blocks": Case(
        DiscardNet, outputs_discarded_and_layers_checkpointed),
    "join_uneven_inputs_layerdrop_find_unused": Case(Net, layers_checkpointed, FIND_UNUSED,
                                                     before_micro=layerdrop, join=True),
    "static_graph_no_sync_from_step_1": Case(Net, layers_checkpointed, STATIC, micro=2,
                                             first_step_micro=1),
    "moe_routing_varies_no_sync_find_unused": Case(
        moe_net, blocks_by_check_fn, FIND_UNUSED, micro=3,
        before_micro=route_by_step_micro_and_rank),
    "moe_routing_varies_no_sync_find_unused_grads_zeroed": Case(
        moe_net, blocks_by_check_fn, FIND_UNUSED, micro=3,
        before_micro=route_by_step_micro_and_rank, set_to_none=False),
    "moe_routing_varies_no_sync_find_unused_offloaded": Case(
        moe_net, blocks_by_check_fn_offloaded, FIND_UNUSED, micro=3,
        before_micro=route_by_step_micro_and_rank),
    "moe_routing_varies_join_find_unused": Case(
        moe_net, blocks_by_check_fn, FIND_UNUSED, before_micro=route_by_step_micro_and_rank,
        join=True),
    "moe_routing_varies_bucket_view_no_sync_find_unused": Case(
        moe_net, blocks_by_check_fn, {**FIND_UNUSED, **BUCKET_VIEW}, micro=2,
        before_micro=route_by_step_micro_and_rank),
    "moe_routing_varies_zero_redundancy_optimizer_find_unused": Case(
        moe_net, blocks_by_check_fn, FIND_UNUSED, before_micro=route_by_step_micro_and_rank,
        zero=True),
    "rank1_drops_an_output_find_unused": Case(DeadOutputNet, layers_checkpointed, FIND_UNUSED,
                                              before_micro=rank1_drops_an_output),
    "verify_replay_no_sync": Case(Net, layers_checkpointed_verified, micro=2),
    "checkpoint_module_no_sync": Case(CallingNet, calls_through(checkpoint_module), micro=2),
    "checkpoint_module_find_unused": Case(CallingNet, calls_through(checkpoint_module),
                                          FIND_UNUSED),
    "checkpoint_closure_no_sync": Case(CallingNet, calls_through(checkpoint_closure), micro=2),
    "checkpoint_closure_static_graph": Case(CallingNet, calls_through(checkpoint_closure),
                                            STATIC),
    "checkpointed_static_graph": Case(CallingNet, calls_through(call_checkpointed), STATIC),
    "check_fn_on_the_ddp_module_find_unused": Case(Net, unchanged, FIND_UNUSED,
                                                   checkpoint_ddp=blocks_of_ddp_by_check_fn),
}


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return (torch.randn(BATCH, DIM, generator=generator),
            torch.randn(BATCH, 1, generator=generator))


def train(case: Case, model: nn.Module, ddp: DistributedDataParallel, rank: int
          ) -> list[Grads]:
    """Each step's gradients of ``model`` (DDP's module), after all its micro-batches."""
    if case.comm_hook is not None:
        ddp.register_comm_hook(None, case.comm_hook)
    optimizer: torch.optim.Optimizer
    if case.zero:
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                            lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    steps = STEPS + (1 if case.join and rank == 1 else 0)
    grads = []
    with Join([ddp]) if case.join else contextlib.nullcontext():
        for step in range(steps):
            optimizer.zero_grad(set_to_none=case.set_to_none)
            micro = case.micro
            if step == 0 and case.first_step_micro is not None:
                micro = case.first_step_micro
            for m in range(micro):
                if case.before_micro is not None:
                    case.before_micro(model, step, m, rank)
                x, y = batch(rank, step, m)
                with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    ((ddp(x) - y) ** 2).mean().backward()
            grads.append({name: None if p.grad is None else p.grad.clone()
                          for name, p in model.named_parameters()})
            optimizer.step()
    return grads


def differences(where: str, expected: Mapping[str, torch.Tensor | None],
                got: Mapping[str, torch.Tensor | None]) -> list[str]:
    if list(got) != list(expected):
        return [f"{where}: names {list(expected)} vs {list(got)}"]
    found = []
    for name, want in expected.items():
        have = got[name]
        if want is None or have is None:
            if (want is None) != (have is None):
                found.append(f"{where} {name}: None eager={want is None} "
                             f"checkpointed={have is None}")
        elif not torch.equal(want, have):
            found.append(f"{where} {name}: max |d| = "
                         f"{(want.float() - have.float()).abs().max().item():.3g}")
    return found


def compare(case: Case, rank: int) -> list[str]:
    torch.manual_seed(0)
    base = case.build()
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    eager_grads = train(case, eager, DistributedDataParallel(eager, **case.ddp), rank)
    if not case.checkpoint_after_ddp:
        case.checkpoint(model)
    ddp = DistributedDataParallel(model, **case.ddp)
    if case.checkpoint_after_ddp:
        case.checkpoint(model)
    if case.checkpoint_ddp is not None:
        case.checkpoint_ddp(ddp)
    grads = train(case, model, ddp, rank)
    found = []
    if len(grads) != len(eager_grads):
        found.append(f"steps: eager {len(eager_grads)}, checkpointed {len(grads)}")
    for step, (want, have) in enumerate(zip(eager_grads, grads)):
        found += differences(f"step {step} grad", want, have)
    found += differences("param", dict(eager.named_parameters()), dict(model.named_parameters()))
    found += differences("buffer", dict(eager.named_buffers()), dict(model.named_buffers()))
    return found


def main(out: Path, names: list[str]) -> None:
    # batchnorm_without_broadcast_buffers means it: the suggested forward_sync_buffers=False
    # still syncs the buffers at init.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated",
                            category=FutureWarning)
    torch.set_num_threads(1)  # tiny tensors, and one summation order
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    results = {}
    for name, case in CASES.items():
        if names and name not in names:
            continue
        try:
            found = compare(case, rank)
            results[name] = "OK" if not found else "DIFF " + "; ".join(found[:4])
        except Exception as error:
            results[name] = f"RAISE {type(error).__name__}: {str(error)[:400]}"
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
