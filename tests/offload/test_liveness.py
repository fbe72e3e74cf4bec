"""The storages a manager let go of while still alive (offload/liveness.py): the record of
suspects stays bounded at an amortized cost."""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.liveness import Liveness


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
