"""FSDP2 (``fully_shard`` on every checkpointed layer, then the root) with replay and offload.

Two CPU ranks (gloo), each on its own batch; expected values are single-process eager runs.

NOTE [why bit for bit]: with two ranks, the gradient reduction is one fp32 addition per element
(commutative, so the order of the two ranks cannot matter) and a division by 2, which is exact.
Sharding itself only moves bytes. So nothing licenses a tolerance: loss and unsharded
gradients must equal ``(grad(batch 0) + grad(batch 1)) / 2`` of the eager model exactly.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from .common import (CALLS_PER_FORWARD, LAYERS, WORKER_LR, WORLD, Reference, WorkerRun,
                     assert_grads_equal, build, events)

pytestmark = pytest.mark.distributed


def test_fsdp2_with_checkpoint_replay_and_offload_matches_single_process_eager_bit_for_bit(
        worker_run: WorkerRun, reference: Reference) -> None:
    results = worker_run.results("fsdp")
    for rank, result in enumerate(results):
        assert result["sharded"] == ["DTensor"]  # every parameter really is sharded
        for step in result["steps"]:
            assert step["loss"] == reference.losses[rank]
            stats = step["offload"]
            # 8 decoder layers + 2 MTP depths, each a window; what went out came back.
            assert stats["windows"] == 10
            assert stats["offloaded_bytes"] == stats["restored_bytes"] > 0
            assert stats["host_buffers_in_use"] == 0
        assert result["second_pass_grads_equal"]  # the steady state gives the same gradients
    assert_grads_equal(reference.grads, worker_run.grads("fsdp"))


def test_fsdp_unshards_each_layer_once_per_call_in_forward_and_never_inside_a_replay(
        worker_run: WorkerRun) -> None:
    for result in worker_run.results("fsdp"):
        for step in result["steps"]:
            fsdp = events(step, "fsdp")
            pre_forward = {name: n for (method, name, part, phase), n in fsdp.items()
                           if method == "pre_forward"}
            assert pre_forward == CALLS_PER_FORWARD
            assert {(part, phase) for (method, _, part, phase) in fsdp
                    if method == "pre_forward"} == {("forward", "plain")}
            # ... and each all-gathers the layer's parameters exactly once (reshard after).
            assert {name: n for (method, name, part, _), n in fsdp.items()
                    if method == "unshard" and part == "forward"} == CALLS_PER_FORWARD
            # Nothing of FSDP's runs inside a boundary: not in an original pass, not in a replay.
            assert {phase for (*_, phase) in fsdp} == {"plain"}
            # Backward all-gathers again, in FSDP's pre-backward hook, before each replay.
            pre_backward = {name for (method, name, part, _) in fsdp
                            if method == "pre_backward" and part == "backward"}
            assert pre_backward == set(CALLS_PER_FORWARD)
            # A forward pre-hook registered after fully_shard runs once per call, never again.
            hooks = events(step, "pre_hook")
            assert {name: n for (name, *_), n in hooks.items()} == CALLS_PER_FORWARD
            assert {(part, phase) for (_, part, phase) in hooks} == {("forward", "plain")}
            # ... while the layers did replay: each attention ran once more, in the replay.
            ops = events(step, "op")
            assert ops[("sparse_attention", "forward", "forward")] == 10
            assert ops[("sparse_attention", "backward", "recompute")] == 10


def test_the_indexer_runs_once_per_computing_layer_per_step_under_fsdp_and_never_in_the_replay(
        worker_run: WorkerRun) -> None:
    for result in worker_run.results("fsdp"):
        for step in result["steps"]:
            topk = {(part, phase): n for (op, part, phase), n in events(step, "op").items()
                    if op == "indexer_topk"}
            # Layers 0, 1, 2, 6 and MTP depth 1 compute their ids; the replay reuses them.
            assert topk == {("forward", "forward"): 5}


def test_the_sharded_checkpointed_model_keeps_the_plain_state_dict_and_dcp_keys(
        worker_run: WorkerRun) -> None:
    plain = list(build()[1].state_dict())
    for result in worker_run.results("fsdp"):
        assert result["plain_keys"] == plain
        assert result["state_dict_keys"] == plain  # no wrapper prefix from checkpoint or FSDP
        assert result["dcp_keys"] == plain


def test_a_distributed_checkpoint_after_a_sharded_adamw_step_loads_exactly_into_the_plain_model(
        worker_run: WorkerRun, reference: Reference) -> None:
    worker_run.results("fsdp")
    _, expected = build()
    initial = {name: value.clone() for name, value in expected.state_dict().items()}
    for name, param in expected.named_parameters():
        param.grad = reference.grads[name]
    torch.optim.AdamW(expected.parameters(), lr=WORKER_LR).step()
    _, plain = build()
    state = plain.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(worker_run.out / "fsdp.dcp"), no_dist=True)
    want = expected.state_dict()
    assert list(state) == list(want)
    for name, value in state.items():
        # AdamW is elementwise: on a shard it computes exactly what it computes on the whole.
        assert torch.equal(value, want[name]), name
    assert any(not torch.equal(state[name], initial[name]) for name in state), \
        "the checkpoint holds the initial weights: the step was not saved"


def test_fsdp2_with_compiled_bodies_matches_eager_and_compiles_nothing_after_the_first_step(
        worker_run: WorkerRun, reference: Reference) -> None:
    for rank, result in enumerate(worker_run.results("fsdp_compile")):
        assert result["fullgraph"] == {**{name: False for name in LAYERS},
                                       **{f"layers.{i}": True for i in (3, 4, 5, 7)},
                                       "mtp_layers.0": False}
        first, *later = result["steps"]
        assert first["compiled_in_forward"] > 0 and first["compiled_in_backward"] > 0
        for step in later:
            assert step["compiled_in_forward"] == step["compiled_in_backward"] == 0
        for step in result["steps"]:
            assert step["loss"] == reference.losses[rank]
            fsdp = events(step, "fsdp")
            assert {name: n for (method, name, *_), n in fsdp.items()
                    if method == "pre_forward"} == CALLS_PER_FORWARD
            assert {phase for (*_, phase) in fsdp} == {"plain"}
            ops = events(step, "op")
            assert ops == {("indexer_topk", "forward", "forward"): 5,
                           ("sparse_attention", "forward", "forward"): 10,
                           ("sparse_attention", "backward", "recompute"): 10}
    # aot_eager traces the backward through decomposed ops, which round differently from
    # eager autograd (max |d| ~1e-8 measured on gradients of order 1e-3..1); rtol 1e-5 is
    # ~100 ulp, far below any missing, doubled or misrouted gradient term.
    assert_grads_equal(reference.grads, worker_run.grads("fsdp_compile"), rtol=1e-5, atol=1e-7)


def _error_case_results(tmp_path: Path, *cases: str) -> list[dict[str, Any]]:
    """Run ``cases`` of fsdp_cases.py on every rank, in one launch; each case's and rank's
    result (the error it caught)."""
    from .launch import run_ranks

    run = run_ranks([str(Path(__file__).with_name("fsdp_cases.py")), str(tmp_path), *cases],
                    WORLD, timeout=120.0, log_dir=tmp_path)
    assert run.ok, run.output()
    results = [json.loads((tmp_path / f"{case}.rank{rank}.json").read_text())
               for case in cases for rank in range(WORLD)]
    for result in results:
        assert result["ok"], result["error"]
    return results


def test_checkpointing_a_module_whose_children_are_separate_fsdp_units_names_the_units_and_the_fix(
        tmp_path: Path) -> None:
    # The children's parameters are sharded DTensors when the boundary collects them, and
    # all-gathered inside it: their unsharded parameters would get no gradient. The boundary
    # catches it at the first replay; the message must say why (FSDP units inside it), not call
    # a registered parameter "neither an input nor a parameter of the module".
    # With reshard_after_forward=False too: the unsharded parameters the units leave in the
    # modules were taken for known tensors, and got no gradient, silently.
    for result in _error_case_results(tmp_path, "checkpointed_pair_of_fsdp_units",
                                      "checkpointed_pair_of_fsdp_units_kept_unsharded"):
        assert result["error_type"] == "CheckpointConfigError", result
        message = result["error"]
        assert "Pair" in message and "'first'" in message and "'second'" in message
        assert "fully_shard" in message and "apply_activation_checkpointing" in message


def test_an_fsdp_unit_given_to_checkpoint_is_refused_naming_the_wrapping_order(
        tmp_path: Path) -> None:
    # checkpoint(block, x) runs the unit's own hooks inside the boundary. Kept unsharded after
    # forward, its parameters silently got no gradient; resharded, the message called them
    # "neither an input nor a parameter of the module".
    for result in _error_case_results(tmp_path, "fsdp_unit_given_to_checkpoint",
                                      "fsdp_unit_kept_unsharded_given_to_checkpoint"):
        assert result["error_type"] == "CheckpointConfigError", result
        assert "was given the FSDP unit FSDPBlock itself" in result["error"], result
        assert "apply_activation_checkpointing on the FSDPBlock before fully_shard()" in \
            result["error"]


def test_a_checkpointed_module_that_is_itself_an_fsdp_unit_gets_the_foreign_tensor_message(
        tmp_path: Path) -> None:
    # Guards against the FSDP-units refusal counting the checkpointed module itself (the usual
    # layout: each layer its own unit) among the units inside it: a genuine foreign tensor in
    # its forward was then blamed on FSDP, with a tip to undo the layout that is right.
    for result in _error_case_results(tmp_path, "checkpointed_fsdp_unit_using_an_outside_tensor"):
        assert result["error_type"] == "CheckpointError", result
        assert "neither an input nor a parameter" in result["error"], result


def test_checkpointing_before_or_after_fully_shard_gives_the_eager_fsdp_gradients_bit_for_bit(
        tmp_path: Path) -> None:
    # docs/scaling.md applies the boundary first; fully_shard first works as well (FSDP's
    # hooks are the module's, outside the boundary either way), with bf16 parameters too.
    for result in _error_case_results(tmp_path, "checkpointed_before_or_after_sharding"):
        assert result["checkpoint first"] == [] and result["shard first"] == [], result
