"""Counters a copy's ``__del__`` adds to without the manager's lock (NOTE [waits never block],
NOTE [counted late], offload/liveness.py): another thread may read, reset or add to them at any
bytecode of it. The tests stop at each of those points and do there what that thread could."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.liveness import Liveness
from offload.window import Copy
from pytree_ckpt.discard import DISCARDED_MARK
from tests.offload.blocks import manager, offloaded_stack
from tests.switch_points import at_each_switch_point


def test_a_reset_while_a_copy_counts_its_storage_alive_elsewhere_is_not_undone() -> None:
    # Guards against: Copy.__del__ added to alive_elsewhere_bytes unlocked (a read, an add, a
    # store); a stats(reset=True) another thread ran between its read and its store was
    # undone: the bytes counted before the reset came back after it (and an add another
    # thread made there, under the lock, was lost).
    def run_resetting_at(point: int) -> tuple[bool, dict[str, float]]:
        torch.manual_seed(0)
        m = manager()
        layers = offloaded_stack(m, 2)
        h = torch.randn(8, 32, requires_grad=True)
        kept = []  # every layer input: each is alive elsewhere, the last one judged at __del__
        for layer in layers:
            kept.append(h)
            h = layer(h)
        loss = h.sum()
        reset: list[int] = []

        def other_thread(at: int) -> None:
            if at == point:
                m.stats(reset=True)
                reset.append(at)

        at_each_switch_point(loss.backward, other_thread, within=Copy.__del__.__code__)
        return bool(reset), m.stats()

    per = 8 * 32 * 4
    points = 0
    while True:
        was_reset, stats = run_resetting_at(points)
        if not was_reset:
            break
        assert stats["offloaded_bytes"] == 0
        # The last window's, judged when backward let go of it: before the reset or after.
        assert stats["alive_elsewhere_bytes"] in (0, per), f"switch point {points}"
        points += 1
    assert points > 3


@pytest.mark.parametrize("discarded", [False, True], ids=["alive elsewhere", "discarded"])
def test_a_late_verdict_waits_for_the_managers_lock_to_be_counted(discarded: bool) -> None:
    # Guards against: Liveness._count adding a verdict judged late (by a copy's __del__, no
    # lock) to the counters itself, or Liveness.judge dropping ``late`` for a storage freed by
    # output discard (NOTE [discarded storages are marked]): the read-add-store race the test
    # above forces. Judged late, nothing counts until the manager adds the verdicts up under
    # its lock (``count_late``, NOTE [counted late]); then each counts once, where it belongs.
    counters = {"alive_elsewhere_bytes": 0, "discarded_bytes": 0}
    liveness = Liveness(counters)
    storage = torch.randn(8, 32).untyped_storage()  # still alive: kept by this test
    if discarded:
        setattr(storage, DISCARDED_MARK, "a discard")  # as CheckpointWithoutOutput marks it
    liveness.judge(StorageWeakRef(storage), storage.nbytes(), late=True)
    assert counters == {"alive_elsewhere_bytes": 0, "discarded_bytes": 0}
    liveness.count_late()
    key = "discarded_bytes" if discarded else "alive_elsewhere_bytes"
    assert counters == {"alive_elsewhere_bytes": 0, "discarded_bytes": 0, key: storage.nbytes()}
