"""Each forward thread's own passes: the manager's per-thread state.

NOTE [a pass per forward thread]: threads may share a manager (``offload=True`` gives one per
device per process: two models trained in two threads, replicas run by a thread each), each
running forwards and backwards of its own. A pass belongs to the thread that opens its windows
(its *lane*): each thread numbers its windows densely from 0, and a backward prefetches only
the windows of its own pass, never another thread's, whose backward may be far off (their
device memory would come back long before it is needed). The pass-turn rule (a new pass when
no window of the current one is alive, or its backward began) is applied per lane. Backward
need not run on that thread (CUDA's autograd unpacks on its device threads; a model's forward
may run in a worker thread and its backward in the main thread): an unpack finds its pass
through its handle's window, and the lane through the pass, never through the thread it runs
on. A lane is held by its thread only (thread-local storage, dropped when the thread ends) and
weakly by everything else, so a thread that ends leaves no pass held by the manager; its passes
live on only as long as their windows (the graph).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator

from .window import Pass

__all__ = ["Lane", "Lanes"]


class Lane:
    """One thread's passes: the one its new windows join, the one whose backward began last
    (for ``events()``), and how many windows it opened (for NOTE [copies in flight])."""

    __slots__ = ("ended", "current", "recent", "opened", "__weakref__")

    def __init__(self, ended: deque[tuple[int, int]], /) -> None:
        self.ended = ended
        self.current = self.recent = Pass(self, ended)
        self.opened = 0

    def turn(self) -> Pass:
        """Start a new pass (ids from 0) and return the one it replaces."""
        old, self.current = self.current, Pass(self, self.ended)
        return old


class Lanes:
    """A manager's lanes: the calling thread's, and every thread's still alive."""

    __slots__ = ("_local", "_all", "_ended")

    def __init__(self, ended: deque[tuple[int, int]], /) -> None:
        # ``ended``: the tallies of passes that died before the manager checked them (see
        # ``Pass.__del__``); shared by every lane's passes.
        self._ended = ended
        self._local = threading.local()
        self._all: weakref.WeakSet[Lane] = weakref.WeakSet()

    def mine(self) -> Lane:
        """The calling thread's lane, made at its first window."""
        lane: Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            lane = self._local.lane = Lane(self._ended)
            self._all.add(lane)
        return lane

    def mine_if_any(self) -> Lane | None:
        """The calling thread's lane; None where it opened no window."""
        return getattr(self._local, "lane", None)

    def __iter__(self) -> Iterator[Lane]:
        return iter(list(self._all))  # a snapshot: a thread may end meanwhile
