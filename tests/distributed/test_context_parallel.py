"""Context parallelism through the boundary, two CPU ranks (gloo; helper NI): ring attention
(``send``/``recv``, ``isend``/``irecv``, ``batch_isend_irecv``), Ulysses all-to-all
(``torch.distributed.nn.functional``'s, ``dist``'s in an autograd Function, and
``_functional_collectives``' returned as it is, an AsyncCollectiveTensor), all-gathered keys
and values with autograd, a functional all-reduce, a global top-k and a global max over both
ranks frozen with ``reuse_during_recompute``; with offload, ``verify_replay``, save units
(kept methods and kept ops), an inner boundary around the attention core, and micro-batches.
Each case against the same 2-rank model without checkpointing, bit for bit, per rank (the
cases are ``cp_cases.py``; one launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from . import cp_cases
from .common import assert_tree_equal
from .launch import rank_results

pytestmark = pytest.mark.distributed

CASES = ["ring_sendrecv-both", "ring_isend-verify", "ring_batch-offload", "ring_drop-both",
         "ulysses-both", "ulysses_fn-both", "ulysses_fc-both", "allgather_nn-both",
         "allgather_fc-both", "allreduce_fc-both", "allreduce_inplace-both", "topk-both",
         "topk_empty-offload", "stats-both", "group_arg-both", "ring_isend-keep",
         "ulysses-keepopsv", "allgather_fc-keepv", "topk-keepv", "ring_batch-nested",
         "ulysses_fn-nested", "topk-nested", "ulysses_fc-core", "ring_isend-accum",
         "topk-accum", "actin-both"]
# The collectives each layer runs in its forward, by what _note records.
FORWARD_COLLECTIVE = {"ring": "swap", "topk": "swap", "stats": "swap", "group": "swap", "actin": "swap",
                      "ulysses": "a2a", "allgather": "gather", "allreduce": "gather"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return rank_results(str(Path(cp_cases.__file__)), CASES, cp_cases.WORLD,
                        tmp_path_factory.mktemp("cp"), timeout=120.0)


def _numbers(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in step.items() if k != "seen"} for step in steps]


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_attention_checkpointed_trains_as_its_uncheckpointed_twin(
        ranks: dict[str, list[Any]], name: str) -> None:
    for rank, result in enumerate(ranks[name]):
        assert_tree_equal(_numbers(result["eager"]), _numbers(result["ckpt"]),
                          f"{name} rank {rank}")


@pytest.mark.parametrize("name", CASES)
def test_each_rank_reruns_the_layers_collectives_once_in_the_replay_and_a_frozen_one_never(
        ranks: dict[str, list[Any]], name: str) -> None:
    how, option = name.split("-")
    what = FORWARD_COLLECTIVE[how.split("_")[0]]
    for result in ranks[name]:
        for eager, ckpt in zip(result["eager"], result["ckpt"]):
            seen = ckpt["seen"]
            ran = eager["seen"][f"{what}|plain"]
            if option == "core":  # only the inner boundary: forward and replay
                assert seen[f"{what}|forward"] == seen[f"{what}|recompute"] == ran
            elif option == "nested":  # the inner forward runs again in the outer replay
                assert seen[f"{what}|forward"] == 2 * ran
                assert seen[f"{what}|recompute"] == ran
            else:
                assert seen[f"{what}|forward"] == seen[f"{what}|recompute"] == ran
            # backward-only collectives (the autograd Functions' backward) run as in eager
            for key, count in eager["seen"].items():
                if key.endswith("_back|plain"):
                    assert seen[key] == count
            # the frozen global top-k / max: run once, in the original pass, never replayed
            for frozen in ("topk", "max"):
                if f"{frozen}|plain" in eager["seen"] and option != "core":
                    assert seen[f"{frozen}|forward"] == eager["seen"][f"{frozen}|plain"]
                    assert f"{frozen}|recompute" not in seen


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith(
    ("ulysses_fc", "group_arg", "actin")) and not n.endswith("core")])
def test_an_evaluation_forward_under_no_grad_gives_the_twins_output_with_one_pass_of_collectives(
        ranks: dict[str, list[Any]], name: str) -> None:
    for result in ranks[name]:
        (eager_out, eager_seen), (ckpt_out, ckpt_seen) = result["evals"]
        assert torch.equal(eager_out, ckpt_out)
        assert {k.split("|")[0]: v for k, v in ckpt_seen.items()} == \
            {k.split("|")[0]: v for k, v in eager_seen.items()}


def test_offload_and_save_units_hold_what_they_say_under_context_parallelism(
        ranks: dict[str, list[Any]]) -> None:
    for result in ranks["ring_batch-offload"]:
        assert result["held"].get("offloaded to host", 0) > 0
    for name in ("ring_isend-keep", "ulysses-keepopsv", "allgather_fc-keepv"):
        for result in ranks[name]:
            assert result["held"].get("save unit", 0) > 0, result["held"]
