"""DDP around the whole checkpointed, offloaded model: two CPU ranks (gloo), own batch each.

Bit for bit against single-process eager, for the reason given in test_fsdp.py (NOTE [why bit
for bit]): a two-rank mean is one commutative fp32 addition and an exact halving.
"""

from __future__ import annotations

import pytest

from .common import CALLS_PER_FORWARD, Reference, WorkerRun, assert_grads_equal, build, events

pytestmark = pytest.mark.distributed


def test_ddp_with_checkpoint_replay_and_offload_matches_single_process_eager_bit_for_bit(
        worker_run: WorkerRun, reference: Reference) -> None:
    results = worker_run.results("ddp")
    for rank, result in enumerate(results):
        for step in result["steps"]:
            assert step["loss"] == reference.losses[rank]
            stats = step["offload"]
            assert stats["windows"] == 10
            assert stats["offloaded_bytes"] == stats["restored_bytes"] > 0
        # Needed for eager's None on the indexers' gradients (see wrap_ddp); a second step would
        # raise "Expected to have finished reduction" had a bucket of the first stayed unreduced.
        assert result["find_unused_parameters"] is True
        assert result["second_pass_grads_equal"]
    # The indexers get no gradient from this loss: None, as in eager, not zeros.
    assert_grads_equal(reference.grads, worker_run.grads("ddp"))


def test_ddp_runs_each_layer_once_per_forward_and_the_indexer_never_in_the_replay(
        worker_run: WorkerRun) -> None:
    for result in worker_run.results("ddp"):
        for step in result["steps"]:
            hooks = events(step, "pre_hook")
            assert {name: n for (name, *_), n in hooks.items()} == CALLS_PER_FORWARD
            assert {(part, phase) for (_, part, phase) in hooks} == {("forward", "plain")}
            assert events(step, "op") == {("indexer_topk", "forward", "forward"): 5,
                                          ("sparse_attention", "forward", "forward"): 10,
                                          ("sparse_attention", "backward", "recompute"): 10}


def test_ddp_keeps_the_plain_models_state_dict_keys(worker_run: WorkerRun) -> None:
    plain = list(build()[1].state_dict())
    for result in worker_run.results("ddp"):
        assert result["state_dict_keys"] == plain
