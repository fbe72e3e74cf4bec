"""Offloaded storages that stay alive elsewhere: an offload that saved nothing.

The manager lets go of a window's device tensor once its copy to host is done (NOTE [copies
in flight] in in_flight.py). A storage still alive then may be alive only for the forward that
is still running (a later layer's input, a RoPE table every layer gets); one still alive once
that forward is over is held by something else, and its copy saved no device memory. This
module keeps the storages let go while alive (``suspect``), and judges them when the manager
says the forward is over (``judge_all``): those still alive count as ``alive_elsewhere_bytes``,
those output discard freed in place as ``discarded_bytes``.

NOTE [verdicts are taken at three points]: the manager calls ``judge_all`` when a backward
begins (a pass's first restore), when a new pass opens, and at ``stats()``; not at every
unpack. A storage whose pass is over but which is let go before the next of those points is
not counted (a micro-batch's forward run inside another's backward, its inputs kept only until
that backward ends: tests/offload/test_stats.py). So the count does not depend on how many
tensors a window saved or the order autograd unpacks them, and an unpack costs no walk over
the suspects. docs/offload.md's ``alive_elsewhere_bytes`` row says the same.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pytree_ckpt.discard import DISCARDED_MARK

if TYPE_CHECKING:
    from .window import Pass

__all__ = ["Liveness"]

# The manager's warnings, under its logger, as they were before this module was split off it.
log = logging.getLogger("offload.manager")


class Liveness:
    """The storages one manager let go of while still alive, and the verdicts on them.

    ``counters`` is the manager's counters dict (reset in place, never replaced): the verdicts
    count into its ``alive_elsewhere_bytes`` and ``discarded_bytes``.
    """

    __slots__ = ("counters", "late", "late_suspects", "suspects", "limit", "warned_discarded")

    def __init__(self, counters: dict[str, int], /) -> None:
        self.counters = counters
        # NOTE [counted late]: verdicts of a copy's ``__del__``, which runs without the
        # manager's lock (NOTE [waits never block] in streams.py: the garbage collector may
        # run it anywhere), on any thread. Added to ``counters`` there (a read, an add and a
        # store), a ``stats(reset=True)`` another thread ran in between was undone (the bytes
        # counted before the reset came back after it), and an add another thread made there
        # was lost (tests/offload/test_counters_unlocked.py). So ``__del__`` only appends
        # (one atomic call), and the manager adds them up under its lock (``count_late``)
        # before it reads the counters.
        self.late: deque[tuple[str, int]] = deque()
        # Storages let go while alive by a copy's ``__del__`` (NOTE [a copy nobody needs is
        # not held] in in_flight.py), appended there, made suspects under the manager's lock
        # (``judge_all``), for the same reason.
        self.late_suspects: deque[tuple[StorageWeakRef, int, weakref.ref[Pass]]] = deque()
        # By storage (``StorageWeakRef.cdata``) and pass (the id of its weak reference, which
        # the entry holds: never reused while it lives), with the bytes of every copy of it
        # let go, and the pass whose forward must be over before it is judged.
        self.suspects: dict[tuple[int, int],
                            tuple[StorageWeakRef, int, weakref.ref[Pass]]] = {}
        self.limit = 64  # NOTE [suspects stay bounded]
        self.warned_discarded = False

    def __len__(self) -> int:
        return len(self.suspects) + len(self.late_suspects)

    def suspect(self, ref: StorageWeakRef, nbytes: int, pass_ref: weakref.ref[Pass], /) -> None:
        """Note a storage let go while still alive by a copy of pass ``pass_ref``, for
        ``judge_all`` once that pass's forward is over.

        NOTE [suspects stay bounded]: they are judged when a backward or a new pass begins, or
        at ``stats()``; forwards that never reach backward while some graph stays alive
        (grad-enabled evaluation that keeps its last output until the next forward) do neither,
        so the record must not grow per forward: one entry per storage and pass (our weak
        reference keeps its ``cdata`` from being reused), and entries of storages gone since
        are dropped as new ones come.
        """
        key = (ref.cdata, id(pass_ref))
        entry = self.suspects.get(key)
        if entry is not None and not entry[0].expired():
            self.suspects[key] = (entry[0], entry[1] + nbytes, pass_ref)
            return
        if len(self.suspects) >= self.limit:  # amortized: the limit doubles
            self.suspects = {key: value for key, value in self.suspects.items()
                             if not value[0].expired()}
            self.limit = max(64, 2 * len(self.suspects))
        self.suspects[key] = (ref, nbytes, pass_ref)

    def suspect_late(self, ref: StorageWeakRef, nbytes: int, pass_ref: weakref.ref[Pass], /
                     ) -> None:
        """``suspect``, from a copy's ``__del__``: one append (NOTE [counted late])."""
        self.late_suspects.append((ref, nbytes, pass_ref))

    def judge_all(self) -> None:
        """Count the storages let go while still alive that are alive still, of the passes
        whose forward is over.

        Called when backward begins, at ``stats()`` and when a new pass opens. Once the
        forward that let a storage go is over (a RoPE table made per forward, a layer input
        that is also the next layer's, are gone by then), what is still alive is kept by
        something else, and its copy saved nothing. Storages of a forward still running
        (another thread's: NOTE [a pass per forward thread] in lanes.py) wait for a later call.
        """
        # Taken before reading. Every caller of this and of ``suspect`` holds the manager's
        # lock (NOTE [one thread at a time] in manager.py), so no other thread adds entries
        # meanwhile; but the lock is re-entrant, and ``judge`` logs: a logging handler that
        # reads the manager's ``stats()`` lets go of the copies in flight on this very thread
        # (``suspect``) and runs a nested ``judge_all``, all inside this loop (a dict must not
        # grow while it is read). Those land in the fresh dict.
        late = self.late_suspects
        while late:  # one taken out at a time: a __del__ meanwhile appends behind them
            self.suspect(*late.popleft())
        suspects, self.suspects = self.suspects, {}
        for key, (ref, nbytes, pass_ref) in suspects.items():
            pass_ = pass_ref()
            if pass_ is None or pass_.over():
                self.judge(ref, nbytes)
            elif key in self.suspects:
                # Only by that re-entry: a second copy of this storage in the same pass (it
                # changed in place between two windows) was let go, and the nested call put
                # it back, its pass's forward still running: one entry, both counts.
                entry = self.suspects[key]
                self.suspects[key] = (entry[0], entry[1] + nbytes, pass_ref)
            else:
                self.suspects[key] = (ref, nbytes, pass_ref)

    def judge(self, ref: StorageWeakRef, nbytes: int, /, *, late: bool = False) -> None:
        """One storage let go while still alive, now that the forward holding it is over;
        ``late`` from a copy's ``__del__`` (NOTE [counted late])."""
        if ref.expired():
            return
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        # NOTE [discarded storages are marked] in pytree_ckpt/discard.py
        if getattr(storage, DISCARDED_MARK, False):
            self.copied_and_discarded(nbytes, late=late)
            return
        self._count("alive_elsewhere_bytes", nbytes, late)
        log.debug("offloaded storage of %d bytes is still alive elsewhere", nbytes)

    def _count(self, key: str, nbytes: int, late: bool) -> None:
        if late:
            self.late.append((key, nbytes))  # NOTE [counted late]
        else:
            self.counters[key] += nbytes

    def count_late(self) -> None:
        """Add up the verdicts counted late (NOTE [counted late]); under the manager's lock.
        One taken out at a time: a ``__del__`` meanwhile appends behind them."""
        late, counters = self.late, self.counters
        while late:
            key, nbytes = late.popleft()
            counters[key] += nbytes

    def copied_and_discarded(self, nbytes: int, /, *, late: bool = False) -> None:
        """A window storage freed in place after its copy to host: output discard's
        ``resize_(0)`` (``CheckpointWithoutOutput``, ``ResidualStreamRecomputeContext``) of an
        output a boundary took as input. Both give the same bytes back for backward, so the
        numbers are exact, but the work is done twice: copied to host and back, and
        recomputed."""
        self._count("discarded_bytes", nbytes, late)
        if not self.warned_discarded:
            self.warned_discarded = True
            log.warning(
                "offload copied to host %d bytes of a boundary input that output discard then "
                "freed: they are copied back and also recomputed for backward (exact, but done "
                "twice; stats()['discarded_bytes'] counts them). Keep one of the two for such "
                "tensors: do not discard outputs that a checkpointed layer takes as input "
                "(offload moves them to host already), or leave those layers' offload off",
                nbytes)
