"""Tensor parallelism (``parallelize_module``, DTensor parameters and activations) inside
checkpointed blocks, two CPU ranks (gloo), one launch for all cases (``tp_cases.py``).

The reference is the same TP model on the same rank, unwrapped: the checkpointed run must give
its losses, outputs, input gradients and full parameter gradients bit for bit over two SGD
steps (one process's kernels, the same collectives on the same values: nothing licenses a
tolerance), with and without offload. Each block runs twice per step (original pass and
replay); the replay reruns exactly the forward's collectives, in backward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from . import tp_cases
from .launch import rank_results

pytestmark = pytest.mark.distributed

# ``-late``: parallelize_module applied to blocks already checkpointed (the other order).
CASES = [f"{plan}-{offload}" for plan in tp_cases.PLANS for offload in ("off", "on")] + \
    ["dt-on-late"]
FLOAT = 4  # fp32


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return rank_results(str(Path(tp_cases.__file__)), CASES, tp_cases.WORLD,
                        tmp_path_factory.mktemp("tensor_parallel"))


def _local_input_bytes(plan: str) -> int:
    """One block input on one rank: the whole input (mlp), else its sequence shard."""
    seq = tp_cases.SEQ if plan == "mlp" else tp_cases.SEQ // tp_cases.WORLD
    return tp_cases.BATCH * seq * tp_cases.DIM * FLOAT


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_tensor_parallel_blocks_train_as_the_unwrapped_tp_model_bit_for_bit(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    plan = name.split("-")[0]
    for rank, result in enumerate(ranks[name]):
        for step, (eager, ckpt) in enumerate(zip(result["eager"], result["ckpt"])):
            where = f"{name} rank {rank} step {step}"
            for key in ("loss", "out", "input_grad"):
                assert torch.equal(eager[key], ckpt[key]), \
                    f"{where} {key}: max |d| = {(eager[key] - ckpt[key]).abs().max().item()}"
            assert list(ckpt["grads"]) == list(eager["grads"])
            for param, want in eager["grads"].items():
                assert torch.equal(want, ckpt["grads"][param]), \
                    f"{where} {param}: max |d| = {(want - ckpt['grads'][param]).abs().max()}"
            # TP really is on: sharded parameters, and DTensor activations between the blocks
            # where the plan keeps them.
            assert "DTensor" in ckpt["grad_types"]
            assert ckpt["out_type"] == eager["out_type"] == \
                ("DTensor" if plan == "dt" else "Tensor")
            assert eager["calls"] == [1, 1, 1] and ckpt["calls"] == [2, 2, 2]


@pytest.mark.parametrize("name", CASES)
def test_the_replay_reruns_each_forward_collective_once_in_backward(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    for result in ranks[name]:
        for eager, ckpt in zip(result["eager"], result["ckpt"]):
            forward = {key.split("|")[0]: n for key, n in eager["collectives"].items()
                       if key.endswith("|forward|plain")}
            backward = {key.split("|")[0]: n for key, n in eager["collectives"].items()
                        if key.endswith("|backward|plain")}
            assert forward and set(eager["collectives"]) == \
                {f"{c}|forward|plain" for c in forward} | {f"{c}|backward|plain" for c in backward}
            assert ckpt["collectives"] == {
                **{f"{c}|forward|forward": n for c, n in forward.items()},  # original pass
                **{f"{c}|backward|recompute": n for c, n in forward.items()},  # the replay
                **{f"{c}|backward|plain": n for c, n in backward.items()}}


@pytest.mark.parametrize("plan", tp_cases.PLANS)
def test_the_census_counts_each_blocks_input_by_its_local_shard(
        ranks: dict[str, list[dict[str, Any]]], plan: str) -> None:
    # Three checkpointed blocks hold their three inputs: this rank's bytes, not the global
    # tensor's (a sequence shard is half), also where the inputs are DTensors (dt).
    local = _local_input_bytes(plan)
    for result in ranks[f"{plan}-off"]:
        for step in result["ckpt"]:
            assert step["census"] == {"checkpoint boundary": 3 * local}


@pytest.mark.parametrize("name", [name for name in CASES if "-on" in name])
def test_offload_copies_each_local_input_shard_to_host_once(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    # Also where the inputs are DTensors (dt): their local shards are copied, and the DTensors
    # rebuilt around the restored shards in backward (they stayed on the device before).
    local = _local_input_bytes(name.split("-")[0])
    for result in ranks[name]:
        for step, stats in enumerate(step["offload"] for step in result["ckpt"]):
            assert stats["windows"] == 3 * (step + 1)
            assert stats["offloaded_bytes"] == stats["restored_bytes"] == 3 * local * (step + 1)
            assert stats["host_buffers_in_use"] == 0
            # Only the last block's input is still alive when its window is let go (backward's
            # first restore reuses it): the others' device shards were freed, DTensors' too.
            assert stats["alive_elsewhere_bytes"] == local * (step + 1)
        for step in result["ckpt"]:
            census = step["census"]
            # Host copies of the three inputs (rounded up to the pool's size classes), and the
            # last block's device input, which backward's first restore reuses (NOTE [reuse at
            # the turn] in offload/window.py).
            assert set(census) == {"offloaded to host", "offload in flight"}
            assert census["offloaded to host"] >= 3 * local
            assert census["offload in flight"] == local


class _ScaledBlock(nn.Module):
    """An MLP whose output is what tensor parallelism hands back: a DTensor (RowwiseParallel
    with ``use_local_output=False``) or a reduction still in flight (an AsyncCollectiveTensor),
    scaled by a module-level list the library does not watch (a stale read in the replay)."""

    def __init__(self, returns: str, mesh: Any) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.returns, self.mesh = returns, mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        out = self.down(torch.relu(self.up(x)) * _SCALE[0])
        if self.returns == "dtensor of one in flight":  # a DTensor whose local is in flight
            from torch.distributed.tensor import DTensor, Replicate

            return DTensor.from_local(funcol.all_reduce(out, "sum", self.mesh), self.mesh,
                                      [Replicate()], run_check=False)
        if self.returns == "half of a dtensor":  # rank 0's half, as of a two-rank mesh
            from torch.distributed.tensor import DTensor, Shard

            local = out.to_local() if isinstance(out, DTensor) else out
            return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                      shape=(2 * local.shape[0], *local.shape[1:]),
                                      stride=local.stride())
        return funcol.all_reduce(out, "sum", self.mesh) if self.returns == "in flight" else out


_SCALE = [1.0]


@contextlib.contextmanager
def _one_rank() -> Iterator[Any]:
    """A one-rank gloo group in this process and its 1-D mesh; ``_SCALE`` put back after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one process: loopback only
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        _SCALE[0] = 1.0
        dist.destroy_process_group()


@pytest.mark.parametrize("returns", ["dtensor", "in flight"])
def test_verify_replay_compares_a_tensor_parallel_layers_output_by_its_shard(
        returns: str) -> None:
    # NOTE [tensor parallel outputs are compared by their shards] (helper KL): both kinds were
    # only warned about, "not compared", with a tip to return a tensor torch made, not the user.
    import warnings

    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import pytree_ckpt

    with _one_rank() as mesh:
        torch.manual_seed(0)
        blocks = [_ScaledBlock(returns, mesh) for _ in range(2)]
        blocks[1].load_state_dict(blocks[0].state_dict())
        for block in blocks:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(
                use_local_output=returns != "dtensor")})
        checked = pytree_ckpt.checkpointed(blocks[1], verify_replay=True)
        x = torch.randn(2, 8)

        def loss(out: torch.Tensor) -> torch.Tensor:
            return (out.full_tensor() if returns == "dtensor" else out).pow(2).sum()

        _SCALE[0] = 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "not compared" warning
            out = checked(x)
        assert type(out).__name__ == ("DTensor" if returns == "dtensor"
                                      else "AsyncCollectiveTensor")
        loss(out).backward()
        loss(blocks[0](x)).backward()
        for (name, want), got in zip(blocks[0].named_parameters(), blocks[1].parameters()):
            assert torch.equal(want.grad.full_tensor(), got.grad.full_tensor()), name

        out = checked(x)
        _SCALE[0] = 2.0  # read again by the replay: other values than the forward's
        with pytest.raises(pytree_ckpt.ReplayMismatchError, match="other values"):
            loss(out).backward()



def _one_rank_mismatch(returns: str, *, kept: bool, rank: int | None = None) -> str:
    """The message of a verify_replay mismatch of a one-rank tensor-parallel _ScaledBlock
    (its output's, or with ``kept`` its kept down addmm's argument's); ``rank``: what
    torch.distributed.get_rank says while backward runs."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import pytree_ckpt

    with _one_rank() as mesh, contextlib.ExitStack() as stack:
        torch.manual_seed(0)
        block = _ScaledBlock(returns, mesh)
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(
            use_local_output=returns != "dtensor")})
        if kept:
            pytree_ckpt.apply_recompute_config(
                [block], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::addmm")},
                verify_replay=True)
        else:
            block = pytree_ckpt.checkpointed(block, verify_replay=True)
        _SCALE[0] = 1.0
        out = block(torch.randn(2, 8))
        _SCALE[0] = 2.0
        if rank is not None:
            stack.enter_context(mock.patch.object(dist, "get_rank", lambda *_, **__: rank))
        with pytest.raises(pytree_ckpt.ReplayMismatchError) as raised:
            (out.full_tensor() if returns == "dtensor" else out.to_local()
             if returns == "half of a dtensor" else out).pow(2).sum().backward()
    return str(raised.value)


def test_verify_replay_compares_a_tensor_parallel_layers_kept_op_arguments_by_their_shard(
) -> None:
    # NOTE [tensor parallel outputs are compared by their shards], for a kept op's arguments
    # too (NOTE [the kept ops' arguments are verified too]): every Linear of a
    # parallelize_module plan takes DTensor arguments (its input and its sharded parameters).
    # Guards against (helper KP) arguments_print warning "not compared" for them: a stale read
    # reaching the kept addmm's argument passed verify_replay (the kept op gives the forward's
    # output, which compares equal), and the kept op's backward read the replay's argument;
    # and (helper KT's mutant) the message leaving the shard out.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not compared" warning
        message = _one_rank_mismatch("in flight", kept=True)
    assert "tensor argument" in message and "rank 0's shard of a DTensor of shape" in message, \
        message


def test_a_tensor_parallel_layers_output_mismatch_names_the_shard_it_compared() -> None:
    # NOTE [tensor parallel outputs are compared by their shards]. Guards against (helper KP)
    # the message reading "expected: the forward's Tensor(shape=(2, 4), ...)" for a DTensor
    # output of shape (2, 8) sharded over two ranks (rank 1 alone raised, naming (2, 4)), a
    # shape the output does not have, with nothing telling that only this rank's shard
    # differed (another rank went on).
    message = _one_rank_mismatch("dtensor", kept=False)
    assert "DTensor" in message and "shard" in message and "rank 0" in message, message


def test_a_tensor_parallel_mismatch_names_the_rank_torch_distributed_gives() -> None:
    # The rank in the message is this process's (a one-rank group's rank made 1 while backward
    # runs; helper KT's mutant naming rank 0 always passed the one-rank tests).
    message = _one_rank_mismatch("dtensor", kept=False, rank=1)
    assert "rank 1's shard of a DTensor" in message, message


def test_verify_replay_compares_a_dtensor_whose_local_tensor_is_still_in_flight() -> None:
    # NOTE [tensor parallel outputs are compared by their shards]: a DTensor made from_local
    # of a reduction still in flight is unwrapped twice (helper KT's mutant unwrapping once
    # warned "not compared" and let a stale read through).
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not compared" warning
        message = _one_rank_mismatch("dtensor of one in flight", kept=False)
    assert "other values" in message and "rank 0's shard of a DTensor" in message, message


def test_a_tensor_parallel_mismatch_gives_the_shape_of_the_shard_it_compared() -> None:
    # NOTE [tensor parallel outputs are compared by their shards]: "expected" names the shard's
    # shape, the whole DTensor's after it (a DTensor claiming twice its one rank's rows, as
    # rank 0 of two would hold; helper KT's mutant naming the whole shape twice passed).
    message = _one_rank_mismatch("half of a dtensor", kept=False)
    assert "Tensor(shape=(2, 8), dtype=torch.float32), rank 0's shard of a DTensor of shape " \
           "(4, 8)" in message, message
