"""Attention + MLP blocks under torchtitan's tensor and sequence parallel plan, checkpointed as
a block, by its save unit, with a frozen DTensor result, module by module, with the output head
and ``loss_parallel``, and under fully_shard on a (1, 2) mesh: two CPU ranks (gloo), one launch
for all cases (``tp_block_cases.py``; the MLP-only plans are ``test_tensor_parallel.py``'s).

The reference is the same TP model on the same rank, unwrapped: the checkpointed run must give
its losses, input gradients and full parameter gradients at each of two AdamW steps, then its
full parameters and AdamW state, bit for bit. Where a case is about a mechanism, the test also
shows that it ran: the ops the replay did not run, the frozen call's phases, the offloaded
bytes, verify_replay's silence on the TP layers' outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import tp_block_cases as cases
from .common import assert_tree_equal
from .launch import rank_results

pytestmark = pytest.mark.distributed

# <stream>-<ckpt>[-<extra>...], as tp_block_cases.py's docstring says.
CASES = ["local-save-fsdp", "dt-save-kc-off", "dt-reuse-off", "local-sub-vr", "dt-sub-vr",
         "local-plain-head-off-vr"]
LAYERS = 2
SHARD = cases.BATCH * cases.SEQ // cases.WORLD * cases.DIM * 4  # a block's fp32 input shard
MASK = cases.BATCH * cases.SEQ * cases.SEQ  # the frozen bool mask, all of it
LABELS = cases.BATCH * cases.SEQ * 8  # int64
# Offloaded (and restored) bytes per step: each block's local input shard (the DTensor's
# local tensor under ``dt``), the frozen masks (the first block's Replicate: all of it; the
# second's Shard(1): this rank's half), the checkpointed head's input shard and its labels.
OFFLOADED = {"dt-save-kc-off": (LAYERS * SHARD, LAYERS),
             "dt-reuse-off": (LAYERS * SHARD + MASK + MASK // cases.WORLD, LAYERS),
             "local-plain-head-off-vr": ((LAYERS + 1) * SHARD + LABELS, LAYERS + 1)}
# One block's forward: wq, wk, wv, wo, w1, w3, w2 (mm on the DTensors), SDPA once.
ATTENTION_MM, BLOCK_MM = 4, 7


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return rank_results(str(Path(cases.__file__)), CASES, cases.WORLD,
                        tmp_path_factory.mktemp("tensor_parallel_blocks"))


def _ops(step: dict[str, Any], phase: str, op: str) -> int:
    return int(step["ops"].get(f"{phase}|aten.{op}", 0))


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_tp_attention_blocks_train_as_the_unwrapped_tp_model_bit_for_bit(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    for rank, result in enumerate(ranks[name]):
        eager, ckpt = result["eager"], result["ckpt"]
        where = f"{name} rank {rank}"
        assert len(eager["steps"]) == len(ckpt["steps"]) == cases.STEPS
        for step, (want, got) in enumerate(zip(eager["steps"], ckpt["steps"])):
            assert_tree_equal({k: want[k] for k in ("loss", "input_grad", "grads")},
                              {k: got[k] for k in ("loss", "input_grad", "grads")},
                              f"{where} step {step}")
            assert "DTensor" in got["grad_types"]  # TP really is on
            # loss_parallel's loss, computed inside the checkpointed head, is a DTensor.
            assert got["loss_type"] == want["loss_type"] == \
                ("DTensor" if "-head" in name else "Tensor")
        assert_tree_equal(eager["params"], ckpt["params"], f"{where} parameters")
        assert_tree_equal(eager["adamw"], ckpt["adamw"], f"{where} AdamW state")
        assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"}
                   for state in ckpt["adamw"].values())
        # The attention hands back what the plan makes of wo's output.
        assert ckpt["attention_types"] == eager["attention_types"] == \
            (["DTensor"] if name.startswith("dt") else ["AsyncCollectiveTensor"])
        assert not [w for w in result["warnings"] if "not compared" in w]


@pytest.mark.parametrize("name", [name for name in CASES if "-save" in name])
def test_the_save_unit_keeps_the_attention_so_the_replay_does_not_rerun_it(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    # KeptOps keeps SDPA's output: the replay reruns every projection but no SDPA op.
    # KeptCallables("Attention.forward") keeps the whole call: no projection either.
    kept_mm = ATTENTION_MM if "-kc" in name else 0
    for result in ranks[name]:
        for step in result["ckpt"]["steps"]:
            assert _ops(step, "forward", "mm") == LAYERS * BLOCK_MM
            assert _ops(step, "forward", "_scaled_dot_product_flash_attention_for_cpu") == LAYERS
            assert _ops(step, "recompute", "mm") == LAYERS * (BLOCK_MM - kept_mm)
            assert not [op for op in step["ops"]
                        if op.startswith("recompute|") and "scaled_dot_product" in op]
        for step in result["eager"]["steps"]:
            assert _ops(step, "plain", "_scaled_dot_product_flash_attention_for_cpu") == LAYERS


@pytest.mark.parametrize("name", [name for name in CASES if "-reuse" in name])
def test_the_reused_call_freezing_a_dtensor_runs_once_per_forward_and_not_in_the_replay(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    for result in ranks[name]:
        for eager, ckpt in zip(result["eager"]["steps"], result["ckpt"]["steps"]):
            assert eager["topk"] == {"plain": LAYERS}
            assert ckpt["topk"] == {"forward": LAYERS}
            # The replay does rerun the blocks around it: the projections, SDPA.
            assert _ops(ckpt, "recompute", "mm") == LAYERS * BLOCK_MM


@pytest.mark.parametrize("name", list(OFFLOADED))
def test_offload_copies_each_local_shard_and_frozen_result_to_host_once(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    per_step, windows = OFFLOADED[name]
    for result in ranks[name]:
        for step, stats in enumerate(step["offload"] for step in result["ckpt"]["steps"]):
            assert stats["windows"] == windows * (step + 1)
            assert stats["offloaded_bytes"] == stats["restored_bytes"] == per_step * (step + 1)
            assert stats["host_buffers_in_use"] == 0


@pytest.mark.parametrize("name", [name for name in CASES if "-vr" in name])
def test_verify_replay_compares_the_tp_layers_outputs_without_a_warning(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    # Since d6eb445 a DTensor or AsyncCollectiveTensor output is compared by its shard
    # (NOTE [tensor parallel outputs are compared by their shards]): with the attention and MLP
    # modules checkpointed (``sub``) their outputs are those; the head returns a DTensor loss.
    for result in ranks[name]:
        assert result["warnings"] == []
        for step in result["ckpt"]["steps"]:
            assert _ops(step, "recompute", "mm") == _ops(step, "forward", "mm")

