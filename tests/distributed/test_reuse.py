"""Reused calls given a module, a plain function given a list, offload of an input carrying a
Python attribute, and a save unit's changed output, under FSDP2 and DDP (two CPU ranks, gloo):
each case against the same model without checkpointing under the same wrapper, bit for bit
(NOTE [why bit for bit] in test_fsdp.py), per rank (``reuse_cases``; helper KF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import reuse_cases
from .common import assert_tree_equal
from .launch import rank_results

pytestmark = pytest.mark.distributed

# count: reuse_during_recompute(route, self.router, h), the router (a token count buffer)
# shared by both layers; _shared: one layer called twice; _kw: the router given by keyword;
# _chunks: two calls a layer, the count read after each; _accum: two micro-batches a step.
EXACT = ["fsdp-count", "ddp-count", "fsdp-count_shared", "ddp-count_shared", "fsdp-count_kw",
         "ddp-count_chunks", "fsdp-count_accum", "ddp-count_accum", "fsdp-hooked",
         "ddp-hooked", "fsdp-router_unit", "ddp-plainfn", "fsdp-offload", "ddp-offload"]
CASES = EXACT + ["fsdp-kept_changed"]
HOOKED_IN_REUSE = "pytree_ckpt: GateRouter has forward hooks and ran inside reuse_during_recompute"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return rank_results(str(Path(reuse_cases.__file__)), CASES, reuse_cases.WORLD,
                        tmp_path_factory.mktemp("reuse"))




@pytest.mark.parametrize("name", EXACT)
def test_checkpointed_layers_train_as_their_uncheckpointed_twin_under_the_same_wrapper(
        ranks: dict[str, list[Any]], name: str) -> None:
    for rank, result in enumerate(ranks[name]):
        assert result["error"] is None, result["error"]
        assert_tree_equal(result["eager"], result["ckpt"], f"{name} rank {rank}")


def test_a_hooked_router_a_reused_call_runs_is_warned_of_once_per_class_per_rank(
        ranks: dict[str, list[Any]]) -> None:
    for wrapper in ("fsdp", "ddp"):
        for result in ranks[f"{wrapper}-hooked"]:
            told = [w for w in result["warnings"] if "ran inside reuse_during_recompute" in w]
            # Two layers share the router, two steps: once (FSDP2's class is FSDPGateRouter).
            assert len(told) == 1, told
            prefix = HOOKED_IN_REUSE if wrapper == "ddp" else \
                HOOKED_IN_REUSE.replace("GateRouter", "FSDPGateRouter")
            assert told[0].startswith(prefix) and "gets no gradient" in told[0]
            assert "reuse_during_recompute(topk_ids, logits.detach())" in told[0]
    # FSDP2's own hooks on a router unit are not the user's: nothing warned.
    for result in ranks["fsdp-router_unit"]:
        assert result["warnings"] == []


# Guards against (helper KF), as it was found: the two warnings contradicted each other.
def test_a_hooked_router_run_only_inside_a_reused_call_is_told_the_hooks_warning_does_not_hold(
        ranks: dict[str, list[Any]]) -> None:
    # The router runs only inside reuse_during_recompute: not again in backward, and what its
    # hook keeps has no gradient. The layer's generic hooks warning (told before the original
    # pass, when nothing says where the router will run) names the same hook and calls keeping
    # its output fine; the router's own warning says that does not hold for it.
    for result in ranks["ddp-hooked"]:
        own = [w for w in result["warnings"] if "ran inside reuse_during_recompute" in w]
        assert len(own) == 1 and "'forward hooks inside' warning" in own[0] and \
            "does not hold" in own[0]


def test_a_returned_input_keeps_the_attribute_the_caller_set_under_offload(
        ranks: dict[str, list[Any]]) -> None:
    for wrapper in ("fsdp", "ddp"):
        for result in ranks[f"{wrapper}-offload"]:
            # (back is h, back.meta) per layer call, two steps: a new object (docs/limits.md:
            # a returned input comes from the boundary's node) carrying the caller's meta.
            assert [meta for _, meta in result["metas"]] == [0.5, 0.25] * 2


def test_a_kept_method_output_changed_in_place_under_fsdp2_is_refused_naming_the_method(
        ranks: dict[str, list[Any]]) -> None:
    for result in ranks["fsdp-kept_changed"]:
        assert result["error"] is not None and result["error"].startswith("CheckpointError")
        tip = result["error"].split("tip:")[1]
        assert "keep another method than Projecting.project" in tip
        assert "drop aten" not in tip
