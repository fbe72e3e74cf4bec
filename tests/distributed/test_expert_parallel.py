"""Expert parallelism (an all-to-all MoE) inside checkpointed blocks, two CPU ranks (gloo), one
launch for all cases (``ep_cases.py``).

The reference is the same EP model on the same ranks, unwrapped: the checkpointed run must
give its losses and every gradient bit for bit over two SGD steps (one process's kernels, the
same collectives on the same values), with and without offload. Each block runs twice per
step; the replay reruns the dispatch and combine all-to-alls (and the split and expert-id
exchanges before them) once, in backward, on both ranks in the same order. The routing must be
the original pass's: frozen with ``reuse_during_recompute``, or recomputable exactly. Router
noise from a generator the block holds as an attribute is restored for the replay (NOTE
[generators held as attributes] in pytree_ckpt/held_generators.py): exact frozen or not, the
generator ending each step where eager leaves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from . import ep_cases
from .launch import rank_results

pytestmark = pytest.mark.distributed

EXACT = [f"{routing}-{offload}" for routing in ep_cases.ROUTINGS for offload in ("off", "on")]
CASES = EXACT
PAIRS = ("splits", "expert_ids", "dispatch", "combine")  # forward collectives, per block


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    results = rank_results(str(Path(ep_cases.__file__)), CASES, ep_cases.WORLD,
                           tmp_path_factory.mktemp("expert_parallel"))
    for name, per_rank in results.items():
        for rank, result in enumerate(per_rank):
            assert "ckpt_error" not in result, f"{name} rank {rank}:\n{result['ckpt_error']}"
    return results


def _steps(result: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return list(zip(result["eager"], result["ckpt"], strict=True))


@pytest.mark.parametrize("name", EXACT)
def test_checkpointed_expert_parallel_blocks_train_as_the_unwrapped_ep_model_bit_for_bit(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    for rank, result in enumerate(ranks[name]):
        assert len(result["ckpt"]) == ep_cases.STEPS
        for step, (eager, ckpt) in enumerate(_steps(result)):
            where = f"{name} rank {rank} step {step}"
            assert torch.equal(eager["loss"], ckpt["loss"]), where
            assert list(ckpt["grads"]) == list(eager["grads"])
            for param, grad in eager["grads"].items():
                assert torch.equal(grad, ckpt["grads"][param]), \
                    f"{where} {param}: max |d| = {(grad - ckpt['grads'][param]).abs().max()}"
            # The replay routed every token as the original pass did.
            original = [ids for _, phase, ids in ckpt["ids"] if phase == "forward"]
            replayed = [ids for _, phase, ids in reversed(ckpt["ids"]) if phase == "recompute"]
            assert len(original) == len(replayed) == 2
            assert all(torch.equal(a, b) for a, b in zip(original, replayed))


@pytest.mark.parametrize("name", EXACT)
def test_each_block_runs_twice_and_its_replay_reruns_dispatch_and_combine_once_in_backward(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    blocks = {f"block{i}|forward|forward": 1 for i in range(2)} | \
        {f"block{i}|backward|recompute": 1 for i in range(2)}
    expected = blocks | {f"{what}|forward|forward": 2 for what in PAIRS} | \
        {f"{what}|backward|recompute": 2 for what in PAIRS} | \
        {"dispatch_grad|backward|plain": 2, "combine_grad|backward|plain": 2}
    eager_expected = {f"block{i}|forward|plain": 1 for i in range(2)} | \
        {f"{what}|forward|plain": 2 for what in PAIRS} | \
        {"dispatch_grad|backward|plain": 2, "combine_grad|backward|plain": 2}
    for result in ranks[name]:
        for eager, ckpt in _steps(result):
            assert eager["counts"] == eager_expected
            assert ckpt["counts"] == expected


@pytest.mark.parametrize("name", [name for name in EXACT if name.endswith("-on")])
def test_offload_copies_each_block_input_and_its_frozen_ids_to_host_once(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    block_input = ep_cases.TOKENS * ep_cases.DIM * 4  # fp32
    frozen_ids = ep_cases.TOKENS * ep_cases.TOP_K * 8 if "frozen" in name else 0  # int64
    for result in ranks[name]:
        for step, (_, ckpt) in enumerate(_steps(result)):
            stats = ckpt["offload"]
            per_step = 2 * (block_input + frozen_ids)
            assert stats["offloaded_bytes"] == stats["restored_bytes"] == per_step * (step + 1)
            assert stats["alive_elsewhere_bytes"] == 0
            assert stats["host_buffers_in_use"] == 0


def test_router_noise_from_a_generator_the_block_holds_is_the_original_passs_in_the_replay(
        ranks: dict[str, list[dict[str, Any]]]) -> None:
    # Guards against: the boundary restored torch's default generators and those passed as
    # arguments, not one the router holds: the recomputed choice drew new noise, routed the
    # replay's tokens to other experts and gave other gradients (~0.12 off), every shape the
    # same, no error. Now the replay draws the forward's noise (the exact tests above, for
    # jitter_plain too), and the generator ends each step where eager's does.
    for name in ("jitter_plain-off", "jitter_plain-on", "jitter_frozen-off"):
        for rank, result in enumerate(ranks[name]):
            for step, (eager, ckpt) in enumerate(_steps(result)):
                where = f"{name} rank {rank} step {step}"
                original = [ids for _, phase, ids in ckpt["ids"] if phase == "forward"]
                replayed = [ids for _, phase, ids in reversed(ckpt["ids"])
                            if phase == "recompute"]
                assert all(torch.equal(a, b) for a, b in zip(original, replayed)), where
                assert len(eager["noise"]) == len(ckpt["noise"]) == 2
                for before, after in zip(eager["noise"], ckpt["noise"]):
                    assert torch.equal(before, after), where
