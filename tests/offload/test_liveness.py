"""The storages a manager let go of while still alive (offload/liveness.py): the record of
suspects stays bounded at an amortized cost."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.liveness import Liveness
from tests.offload.blocks import manager


class CountingRef(StorageWeakRef):
    """A storage weak reference that counts the ``expired()`` checks made on it."""

    __slots__ = ()
    checks = 0

    def expired(self) -> bool:
        CountingRef.checks += 1
        return super().expired()


class APass:
    def over(self) -> bool:
        return False  # its forward still runs: nothing is judged


def test_suspects_of_live_storages_are_pruned_at_a_limit_that_doubles_so_each_costs_amortized_o1(
) -> None:
    # Guards against: Liveness.suspect setting its limit to the entries kept (not twice that):
    # with every suspect alive, each new one walks the whole record again (quadratic).
    liveness = Liveness({"alive_elsewhere_bytes": 0, "discarded_bytes": 0})
    first_limit = liveness.limit
    count = 4 * first_limit
    pass_ = APass()
    pass_ref = weakref.ref(pass_)
    tensors = [torch.zeros(4) for _ in range(count)]  # all alive: none is pruned
    CountingRef.checks = 0
    for tensor in tensors:
        liveness.suspect(CountingRef(tensor.untyped_storage()), tensor.nbytes, pass_ref)
    assert len(liveness) == count
    # Pruned when the record reaches first_limit, 2 * first_limit, ...: each check a walk over
    # the entries then, fewer than 2 * count in all (a doubling series below count).
    assert CountingRef.checks < 2 * count


def test_a_table_two_threads_offload_counts_for_the_first_backward_though_freed_before_the_second(
) -> None:
    # Guards against: Liveness.suspect keying its record by storage only (not storage and
    # pass): the first thread's entry for a table both threads' windows let go while the caller
    # held it was merged into the second thread's, whose forward still ran, so it waited for
    # that pass; the caller dropped the table before the second backward, and the offload that
    # saved nothing at the first backward (docs/offload.md, alive_elsewhere_bytes) was never
    # counted.
    m = manager()
    tables = [torch.randn(16, 32)]  # the caller's; a list, to let go of it below
    nbytes = tables[0].untyped_storage().nbytes()

    def forward() -> torch.Tensor:
        x = torch.randn(16, 32, requires_grad=True)
        with m.window([tables[0]]):
            out = (x * tables[0]).sum()  # saves the table: copied, then let go at the next window
        y = torch.randn(16, 32, requires_grad=True) * 1.0
        with m.window([y]):
            return out + (y * y).sum()

    first = forward()
    second: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: second.append(forward()))
    worker.start()
    worker.join()
    m.stats(reset=True)  # neither backward began: nothing judged yet
    first.backward()  # the first pass is over; the table is alive: it saved nothing there
    tables.clear()
    second[0].backward()  # the table is gone by the second pass's backward
    assert m.stats()["alive_elsewhere_bytes"] == nbytes
