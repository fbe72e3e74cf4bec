"""Checkpointed pipeline stages (torch.distributed.pipelining) on two CPU ranks (gloo), against
eager on one process (``pipeline_cases.reference``) and the unwrapped model under the same
schedule.

Schedules: 1F1B (one stage a rank, two checkpointed blocks a stage, one full backward per
micro-batch), ZBV zero bubble (two stages a rank, V-shaped: every backward of a stage other than
the first is split in an input pass, ``torch.autograd.grad`` to the stage input with the graph
kept, and a later weight pass from the graph's nodes to the parameters) and DualPipeV (both
kinds). Bit for bit (fp32, torch.equal): the losses and every parameter's gradient at both
steps; the second step's forward calls and matrix products (the first also infers shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from . import pipeline_cases
from .launch import rank_results

pytestmark = [
    pytest.mark.distributed,
    # torch 2.9 and 2.11's pipelining exchanges the stages' shapes over gloo with mismatched
    # sizes (a rank aborts: "Received data size doesn't match expected size"; with the shapes
    # given, the multi-stage schedules still time out in _initialize_stages), without this
    # library: the unwrapped "plain" cases fail the same. Checked on 2.13.
    pytest.mark.skipif(torch.__version__ < "2.13",
                       reason="torch.distributed.pipelining over gloo fails before torch 2.13"),
]

SCHEDULES = ("1f1b", "zbv", "dualpipev")
WRAPPED = ["1f1b-ckpt", "zbv-ckpt", "zbv-offload", "dualpipev-offload"]
CASES = [f"{schedule}-plain" for schedule in SCHEDULES] + WRAPPED
MICRO = pipeline_cases.MICRO


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict[str, Any]]]]:
    results = rank_results(str(Path(pipeline_cases.__file__)), CASES, pipeline_cases.WORLD,
                           tmp_path_factory.mktemp("pipelining"))
    return {name: [result["steps"] for result in per_rank] for name, per_rank in results.items()}


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_pipeline_stages_train_as_eager_bit_for_bit(
        ranks: dict[str, list[list[dict[str, Any]]]], name: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: tiny tensors, and one summation order
    try:
        expected = pipeline_cases.reference(name.split("-")[0])
    finally:
        torch.set_num_threads(threads)
    for step, want in enumerate(expected):
        # The last stage's rank has the losses; each rank the gradients of its blocks.
        losses = [loss for steps in ranks[name] for loss in steps[step]["losses"]]
        assert len(losses) == MICRO
        assert all(torch.equal(a, b) for a, b in zip(want["losses"], losses)), f"step {step}"
        grads = {n: g for steps in ranks[name] for n, g in steps[step]["grads"].items()}
        assert sorted(grads) == sorted(want["grads"])
        for param, grad in want["grads"].items():
            assert grads[param] is not None, f"step {step}: {param} has no gradient"
            assert torch.equal(grad, grads[param]), \
                f"step {step}: {param}: max |d| = {(grad - grads[param]).abs().max().item()}"


def _split(schedule: str, block: int) -> int:
    """How many of a step's micro-batches take a split backward (input pass, then weight pass)
    through ``block``: every one in a zero-bubble stage other than the first (the first stage's
    input needs no gradient: torch runs its backward whole in the weight pass), one (the
    overlapped micro-batch) in DualPipeV's."""
    if block == 0:
        return 0
    return {"1f1b": 0, "zbv": MICRO, "dualpipev": 1}[schedule]


@pytest.mark.parametrize("name", WRAPPED)
def test_a_checkpointed_block_replays_once_per_micro_batch_split_backward_or_not(
        ranks: dict[str, list[list[dict[str, Any]]]], name: str) -> None:
    # Each block runs forward once a micro-batch unwrapped; checkpointed, once more: twice a
    # micro-batch, also where the schedule splits its backward. The input pass keeps the
    # replay's graph, and the weight pass takes the parameters' gradients from it (NOTE [a
    # replay kept between restricted backwards] in pytree_ckpt/kept_replay.py); before that, it
    # replayed the block again: three forwards a micro-batch.
    schedule = name.split("-")[0]
    plain = ranks[f"{schedule}-plain"]
    split = 0
    for rank, steps in enumerate(ranks[name]):
        calls, plain_calls = steps[1]["calls"], plain[rank][1]["calls"]
        assert plain_calls == {block: MICRO for block in calls}
        assert calls == {block: 2 * MICRO for block in calls}
        split += sum(_split(schedule, block) for block in calls)
        # Products: two in each block's forward, so two in each replay (no more replays in the
        # weight pass: it took two), and nothing else: each weight pass computes only the dW
        # products eager's does, from the gradients the replay's own nodes got in the input
        # pass (NOTE [a weight pass from captured gradients] in pytree_ckpt/kept_weights.py;
        # torch's weight pass hands the boundary's node the very tensors it got then). Read
        # from the kept graph's outputs, it ran the product to the second linear's input again,
        # one a weight pass. None for a dW in the input pass (NOTE [a leaf
        # torch.autograd.grad captures] in recompute.py).
        replays = sum(calls[block] - plain_calls[block] for block in calls)
        assert steps[1]["products"] - plain[rank][1]["products"] == 2 * replays
    assert split == {"1f1b": 0, "zbv": 3 * MICRO, "dualpipev": 3}[schedule]  # passes were split
