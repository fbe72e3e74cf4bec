"""Module state of checkpointed layers under FSDP2 and DDP: NOTE [state a kernel writes]
(kernel_written.py) and NOTE [state read, then changed by a later call] (state_changes.py),
two CPU ranks (gloo), against eager on one process (``state_cases.reference``).

Bit for bit (NOTE [why bit for bit] in test_fsdp.py): losses, the full gradients and each
rank's buffers after every step. FSDP2 shards parameters only: each rank's buffers follow its
own batches. DDP (broadcast_buffers, its default) copies rank 0's buffers into every rank's, in
place, before each forward: between an eval micro-batch's forward and its replay, and before a
layer's first calls, whose small buffers are compared by value; the replay must read what the
forward read, and a broadcast must not count as a change the forward made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from . import state_cases
from .common import assert_tree_equal
from .launch import rank_results

pytestmark = pytest.mark.distributed

CASES = [f"{wrapper}-{kind}" for wrapper in ("fsdp", "ddp") for kind in ("bn", "fq")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return rank_results(str(Path(state_cases.__file__)), CASES, state_cases.WORLD,
                        tmp_path_factory.mktemp("module_state"))




@pytest.mark.parametrize("name", CASES)
def test_checkpointed_layers_with_module_state_train_as_eager_data_parallel_bit_for_bit(
        ranks: dict[str, list[Any]], name: str) -> None:
    # bn: an eval micro-batch, then a train one, before one backward; the reference's eval
    # micro-batches run on clones of the buffers (what the forward read, also in backward).
    # fq: two train micro-batches a step, two steps (the fused kernel moves no version).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: tiny tensors, and one summation order
    try:
        expected = state_cases.reference(*name.split("-"))
    finally:
        torch.set_num_threads(threads)
    for rank, result in enumerate(ranks[name]):
        assert_tree_equal(expected[rank], result["steps"], f"{name} rank {rank}")
    if name.startswith("ddp"):
        # The broadcast matters here (it writes rank 1's buffers with no version moving,
        # measured on torch 2.13): without it rank 1's buffers and the gradients would differ.
        kind = name.split("-")[1]
        buffer = "1.state.scale" if kind == "fq" else "1.state.running_mean"
        unsynced = state_cases.reference("fsdp", kind)  # the same steps, no broadcast
        assert not torch.equal(unsynced[1][-1]["buffers"][buffer],
                               expected[1][-1]["buffers"][buffer])
