"""The reference model's save units: declared names resolve, numbers never change, ops are kept."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, make_packed_batch
from examples.glm_dsa.mlp import MoE, Router
from pytree_ckpt import ActivationCensus, KeptCallables, KeptOps, SaveUnit
from tests.examples.test_glm_dsa_model import (SEQ_LENS, _one_thread, assert_same_grads, build,
                                               grads, train_step)
from tests.pytree_ckpt.test_save_units import OpCounter

__all__ = ["_one_thread"]  # the module-scoped one-thread fixture applies here too


def test_every_declared_name_resolves() -> None:
    targets = GlmDsaForCausalLM.recompute_targets
    assert set(targets) == set(SaveUnit)  # the reference model declares every unit
    attn, indexer, gate, dispatch = targets[SaveUnit.ATTN], targets[SaveUnit.DSA_INDEXER], \
        targets[SaveUnit.MOE_GATE], targets[SaveUnit.MOE_DISPATCH]
    assert isinstance(attn, KeptOps) and isinstance(indexer, KeptOps)
    assert torch.ops.glm_dsa.sparse_mla_attention in attn.resolve()
    assert indexer.resolve() == [torch.ops.glm_dsa.indexer_topk]
    # flash-attn names resolve only where flash-attn is installed (a CUDA extra)
    assert isinstance(gate, KeptCallables)
    assert gate.matches(Router(8, 4, 2)) == ["project"]
    assert isinstance(dispatch, KeptCallables)
    assert dispatch.matches(MoE(GlmDsaConfig(moe=True))) == ["dispatch"]


def twin(eager: GlmDsaForCausalLM, **kwargs: Any) -> GlmDsaForCausalLM:
    model = copy.deepcopy(eager)
    model.checkpoint_layers(1.0, **kwargs)
    return model


@pytest.mark.parametrize("save", [None, ["attn"], ["dsa_indexer"], ["moe_gate"],
                                  ["moe_dispatch"], True])
def test_loss_and_grads_are_bit_identical_to_eager_whatever_is_kept(save: Any) -> None:
    config, eager = build(moe=True, dropout=0.1)
    model = twin(eager, save=save)
    batch = make_packed_batch(config, SEQ_LENS)
    assert torch.equal(train_step(eager, batch), train_step(model, batch))
    assert_same_grads(grads(eager), grads(model))


def count_replay_ops(model: GlmDsaForCausalLM, batch: dict[str, torch.Tensor]) -> OpCounter:
    counter = OpCounter()
    with counter:
        train_step(model, batch)
    return counter


def test_kept_attention_and_gate_ops_run_zero_times_in_the_replay() -> None:
    config, eager = build(moe=True)
    batch = make_packed_batch(config, SEQ_LENS)
    full = count_replay_ops(twin(eager), batch)
    kept = count_replay_ops(twin(eager, save=["attn", "moe_gate"]), batch)
    layers = config.num_layers + config.mtp_depth
    assert full.counts["recompute", "glm_dsa.sparse_mla_attention"] == layers
    assert kept.counts["recompute", "glm_dsa.sparse_mla_attention"] == 0
    # the router projection (one addmm or mm per MoE layer) is kept; experts recompute
    proj = lambda c: c.counts["recompute", "aten.mm"] + c.counts["recompute", "aten.addmm"]  # noqa: E731
    assert proj(kept) == proj(full) - layers
    assert kept.counts["recompute", "aten.silu"] == full.counts["recompute", "aten.silu"] > 0


def test_a_kept_moe_dispatch_does_not_group_tokens_again_in_the_replay() -> None:
    config, eager = build(moe=True)
    batch = make_packed_batch(config, SEQ_LENS)
    full = count_replay_ops(twin(eager), batch)
    kept = count_replay_ops(twin(eager, save=["moe_dispatch"]), batch)
    calls = (config.num_layers + config.mtp_depth) * config.n_routed_experts  # one per expert
    for op in ("aten.nonzero", "aten.eq"):
        assert full.counts["recompute", op] == calls and kept.counts["recompute", op] == 0
    # x[token] is the dispatch's; gates[token, slot] is not, and reruns
    assert kept.counts["recompute", "aten.index"] == full.counts["recompute", "aten.index"] - calls
    assert kept.counts["recompute", "aten.silu"] == full.counts["recompute", "aten.silu"] > 0


def test_the_indexer_is_kept_out_of_the_replay_by_op_identity_or_by_reuse() -> None:
    config, eager = build(reuse_indexer=False)
    batch = make_packed_batch(config, SEQ_LENS)
    computing = 4 + 1  # decoder layers 0, 1, 2, 6 and MTP depth 1
    recomputed = count_replay_ops(twin(eager), batch)
    assert recomputed.counts["recompute", "glm_dsa.indexer_topk"] == computing
    by_op = count_replay_ops(twin(eager, save=["dsa_indexer"]), batch)
    assert by_op.counts["recompute", "glm_dsa.indexer_topk"] == 0
    assert by_op.counts["forward", "glm_dsa.indexer_topk"] == computing
    config, eager = build(reuse_indexer=True)
    by_reuse = count_replay_ops(twin(eager), batch)
    assert by_reuse.counts["recompute", "glm_dsa.indexer_topk"] == 0


def test_the_census_shows_what_each_unit_keeps() -> None:
    config, eager = build()
    batch = make_packed_batch(config, SEQ_LENS)
    model = twin(eager, save=["attn"])
    with ActivationCensus(model) as census:
        loss = model(**batch)["loss"]
    total = sum(SEQ_LENS)
    per_layer = total * config.num_heads * config.v_head_dim * 4  # the attention output
    assert census.bytes_by("mechanism")["save unit"] == (config.num_layers + 2) * per_layer
    loss.backward()
    assert "save unit" not in census.bytes_by("mechanism")


def test_save_true_on_the_dense_reference_model_keeps_only_its_declared_units_silently() -> None:
    import warnings

    torch.manual_seed(0)
    model = GlmDsaForCausalLM(GlmDsaConfig())            # dense: moe=False, the default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.checkpoint_layers(1.0, offload=False, save=True)
        model(**make_packed_batch(model.config, SEQ_LENS, seed=0))["loss"].backward()
    assert [str(w.message) for w in caught if "keeps nothing" in str(w.message)] == []
