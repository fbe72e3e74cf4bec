"""Small two-rank FSDP2 cases, one per ``python tests/distributed/fsdp_cases.py OUT CASE``.

Each case writes ``OUT/<case>.rank<r>.json``: ``{"ok": true, ...}`` or the error it raised.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import pytree_ckpt


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Pair(nn.Module):
    """Two blocks, each to be its own FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _error_of_a_step(model: nn.Module, rank: int) -> dict[str, Any]:
    """One forward and backward of ``model``; the CheckpointError it raised, if any."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    try:
        model(x).sum().backward()
    except pytree_ckpt.CheckpointError as error:
        return {"error_type": type(error).__name__, "error": str(error)}
    return {"error_type": None}


def checkpointed_pair_of_fsdp_units(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Pair(), nn.Linear(8, 1))
    pair = model[1]
    pytree_ckpt.apply_activation_checkpointing(pair, offload=False)
    fully_shard(pair.first)  # the units sit inside the checkpointed module
    fully_shard(pair.second)
    fully_shard(model)
    return _error_of_a_step(model, rank)


class UsesOutsideTensor(Block):
    """A block whose forward uses a tensor that requires grad and is none of its own."""

    outside = torch.ones(8, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.outside


def checkpointed_fsdp_unit_using_an_outside_tensor(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), UsesOutsideTensor(), nn.Linear(8, 1))
    pytree_ckpt.apply_activation_checkpointing(model[1], offload=False)
    fully_shard(model[1])  # the checkpointed module is itself the unit: the usual layout
    fully_shard(model)
    return _error_of_a_step(model, rank)


def checkpointed_pair_of_fsdp_units_kept_unsharded(rank: int) -> dict[str, Any]:
    # reshard_after_forward=False leaves the unsharded parameters in the modules after the
    # original pass: they were taken for known tensors, and got no gradient, silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Pair(), nn.Linear(8, 1))
    pair = model[1]
    pytree_ckpt.apply_activation_checkpointing(pair, offload=False)
    fully_shard(pair.first, reshard_after_forward=False)
    fully_shard(pair.second, reshard_after_forward=False)
    fully_shard(model)
    return _error_of_a_step(model, rank)


class CheckpointsItsBlock(nn.Module):
    """Calls pytree_ckpt.checkpoint(block, x) on a block that is an FSDP unit itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 8), Block(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(pytree_ckpt.checkpoint(self.block, self.inp(x)))


def _fsdp_unit_given_to_checkpoint(rank: int, reshard: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = CheckpointsItsBlock()
    fully_shard(model.block, reshard_after_forward=reshard)
    fully_shard(model)
    return _error_of_a_step(model, rank)


def _grads_of_a_step(order: str, rank: int) -> dict[str, torch.Tensor]:
    """Full gradients after one bf16-parameter step of two blocks, each its own FSDP unit,
    checkpointed before sharding, after it, or not at all."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 1))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (model[1], model[2]):
        if order == "checkpoint first":
            pytree_ckpt.apply_activation_checkpointing(block, offload=False)
        fully_shard(block, mp_policy=policy)
        if order == "shard first":
            pytree_ckpt.apply_activation_checkpointing(block, offload=False)
        assert pytree_ckpt.is_checkpointed(block) == (order != "eager")
    fully_shard(model, mp_policy=policy)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    model(x).float().square().sum().backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def checkpointed_before_or_after_sharding(rank: int) -> dict[str, Any]:
    eager = _grads_of_a_step("eager", rank)
    return {order: [name for name, grad in _grads_of_a_step(order, rank).items()
                    if not torch.equal(grad, eager[name])]
            for order in ("checkpoint first", "shard first")}


CASES = {"checkpointed_before_or_after_sharding": checkpointed_before_or_after_sharding,"checkpointed_pair_of_fsdp_units": checkpointed_pair_of_fsdp_units,
         "checkpointed_pair_of_fsdp_units_kept_unsharded":
             checkpointed_pair_of_fsdp_units_kept_unsharded,
         "checkpointed_fsdp_unit_using_an_outside_tensor":
             checkpointed_fsdp_unit_using_an_outside_tensor,
         "fsdp_unit_given_to_checkpoint":
             lambda rank: _fsdp_unit_given_to_checkpoint(rank, True),
         "fsdp_unit_kept_unsharded_given_to_checkpoint":
             lambda rank: _fsdp_unit_given_to_checkpoint(rank, False)}


def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for name in names:
        try:
            result = {"ok": True, **CASES[name](rank)}
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()
    # Each case stops a step with an error in backward, which can leave a gloo worker thread
    # of FSDP's collectives alive: at interpreter exit its destructor then aborted the process
    # now and then ("terminate called without an active exception", exit -6), after the
    # results were written. Exit without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
