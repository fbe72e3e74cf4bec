"""A pool of host buffers, bucketed by size class and reused across steps.

Pinned host allocation costs milliseconds per call (torchtune's offload went from 22% to 50%
overhead without a pool), so buffers are never freed while the pool lives: a released buffer
goes back to its size class and the next request of that class reuses it. After a warm-up
step with the same shapes the pool does not grow (with inputs of several sizes, which free
buffer of a larger class serves a smaller request can differ between steps: a second or third
step may still add one; a step that allocates nothing is followed by none that does).

NOTE [host buffer lifetime]: a buffer is checked out from ``acquire`` until ``release``. A buffer
that a pending device copy still reads or writes is released together with that copy's event;
``acquire`` only hands out buffers whose event has completed (waiting on it if it must). Of a
class's free buffers it hands out the one released first: the one released last carries the
latest copy (backward lets go of a step's windows in turn, each after its copy back), the
likeliest to be still running on a GPU behind the host, and waiting for it would block the
host (the next step's first window) while a buffer whose copy is done sits beside it.
Where pinning is unavailable (CPU-only torch) buffers are ordinary host memory.

NOTE [release never waits]: buffers are released by a copy's ``__del__``, which the garbage
collector runs wherever an allocation happens to start a collection (an offloaded graph in a
reference cycle), including inside this pool's own locked sections, on the thread that holds
the lock. ``release`` therefore takes no lock: it takes the buffer out of those checked out
and appends it to a deque (one atomic call each), and the locked sections move what was
returned to the free lists before they read them.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections import defaultdict, deque
from typing import Any

import torch

from pytree_ckpt.errors import CheckpointConfigError, validate_bool
from pytree_ckpt.tree import describe_leaf

__all__ = ["HostPool", "size_class"]

log = logging.getLogger(__name__)

_MIN_CLASS = 512
_NOT_HANDED = object()  # what release finds for a buffer the pool did not hand out


def _require_size(nbytes: Any, where: str, /, *, index: int | None = None) -> int:
    """``nbytes`` as an int if it is a byte count (an integer, not a bool, not negative), else
    a ``CheckpointConfigError`` naming ``where`` (and ``index``, its place in a list)."""
    count = -1
    if not isinstance(nbytes, bool):  # an int to Python, not a size
        try:
            count = operator.index(nbytes)  # numpy's and torch's ints too
        except TypeError:  # a float, a str
            pass
    if count < 0:
        raise CheckpointConfigError(
            f"{where} takes a number of bytes" if index is None
            else f"{where} takes numbers of bytes: nbytes_list[{index}] is not one",
            expected="an int >= 0", got=describe_leaf(nbytes),
            tip="pass a tensor's byte count: t.untyped_storage().nbytes() or "
                "t.numel() * t.element_size()")
    return count


def size_class(nbytes: int, /, *, pinned: bool = False) -> int:
    """Round up to a size class: powers of two split in quarters (at most 25% waste),
    at least ``512`` bytes (the smallest class).

    Pinned buffers come from torch's caching host allocator, which rounds every request up to
    a power of two: there the classes are the powers of two, so ``host_bytes`` counts what is
    really pinned and two requests of one power share buffers.
    """
    return _size_class(_require_size(nbytes, "size_class"), pinned)


def _size_class(nbytes: int, pinned: bool, /) -> int:
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (nbytes - 1).bit_length()   # next power of two >= nbytes
    if pinned:
        return top
    quarter = top // 8                     # classes at 4/8, 5/8, 6/8, 7/8, 8/8 of `top`
    return -(-nbytes // quarter) * quarter


class HostPool:
    """Host buffers (``uint8`` tensors) by size class, pinned when ``pin_memory``."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = validate_bool(pin_memory, name="pin_memory", default=None)
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self._returned: deque[tuple[torch.Tensor, Any]] = deque()  # NOTE [release never waits]
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.host_bytes = 0
        # Checked out, by id (held, so no other object takes the id): release takes only these.
        self._handed: dict[int, torch.Tensor] = {}

    @property
    def checked_out(self) -> int:
        """Buffers acquired and not yet released."""
        with self._lock:
            self._take_returned()
            return len(self._handed)

    def _take_returned(self) -> None:
        """Move released buffers to their free lists (the caller holds the lock).

        Each is on its free list before it leaves the returned ones: a KeyboardInterrupt raised
        as a call returns (helper JW: after ``popleft``) found it in neither, and the pool
        allocated another for good. Interrupted after the append, the next move finds it there
        already, last on its list: nothing takes from or adds to a free list before the returned
        ones are moved. Only the last is looked at (helper LK: a scan of the whole list made a
        step's take-back quadratic in its buffers, 0.18 s for 3,072)."""
        while self._returned:
            entry = self._returned[0]
            free = self._free[entry[0].numel()]
            if not free or free[-1] is not entry:
                free.append(entry)
            self._returned.popleft()

    def reserve(self, nbytes_list: list[int], /) -> None:
        """Allocate buffers up front (e.g. one step's worth) so the first step hits too."""
        # All checked first: a refused size leaves nothing half reserved.
        sizes = [_require_size(nbytes, "HostPool.reserve", index=index)
                 for index, nbytes in enumerate(nbytes_list)]
        for nbytes in sizes:
            cls = _size_class(nbytes, self.pin_memory)
            buffer = self._allocate(cls)
            with self._lock:
                self._take_returned()  # first (_take_returned says why)
                self.host_bytes += cls
                self._free[cls].append((buffer, None))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            # device= always: under torch's default device (set_default_device("cuda")), a
            # device-less empty would be a GPU buffer, and offload would move nothing off it
            buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                 pin_memory=self.pin_memory)
        except RuntimeError as error:
            if not self.pin_memory or torch.cuda.is_available():
                raise  # out of host memory, say: torch's message says so
            # Checked here, not when the config is made: a model saved on a GPU with its
            # manager must still load where there is none.
            raise CheckpointConfigError(
                "OffloadConfig(pin_memory=True) needs CUDA to pin host memory",
                expected="pin_memory=None (pins where CUDA is available) or False",
                got=f"pin_memory=True with torch.cuda.is_available() False ({error})",
                tip="leave pin_memory at None") from error
        return buffer  # counted in host_bytes by the caller, as the pool takes it in

    def acquire(self, nbytes: int, /, *, into: Any = None) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes, checked out until ``release``: the pool holds
        it until then, so a buffer never released stays allocated.

        ``into``: an object whose ``host`` attribute gets the buffer as it is checked out, with
        no call between. NOTE [a buffer handed out under an interrupt]: a KeyboardInterrupt is
        raised right after a call returns; one raised as this returns found the caller's
        attribute unset, and the buffer stayed checked out for good (helper EJ). With
        ``into``, whoever holds the buffer can give it back."""
        cls = _size_class(_require_size(nbytes, "HostPool.acquire"), self.pin_memory)
        # NOTE [a buffer taken but not handed out]: from the moment a free buffer leaves its
        # list until it is among those checked out, an interrupt (raised as any call returns)
        # would lose it: neither free nor checked out, the pool allocated another for good
        # (helper LM: after free.pop returned). It is taken with no call between the read and
        # the delete, and the handler below gives it back, its event with it, unless the
        # assignment marking it handed out ran. A new buffer is counted in host_bytes only
        # there, so one lost before is no byte held.
        entry: tuple[torch.Tensor, Any] | None = None
        handed_out = False
        try:
            with self._lock:
                self._take_returned()
                free = self._free.get(cls)
                if not free:
                    # Lengths that vary from step to step would otherwise add buffers in every
                    # class they touch: a free buffer of a larger class, up to twice this one,
                    # serves too (copies use its front; it goes back to its own class).
                    larger = [c for c, buffers in self._free.items()
                              if buffers and cls < c <= 2 * cls]
                    free = self._free[min(larger)] if larger else None
                if free:
                    entry = free[0]  # released first: NOTE [host buffer lifetime]
                    del free[0]
            if entry is None:
                log.debug("host pool miss: allocating %d bytes (pinned=%s)", cls, self.pin_memory)
                buffer = self._allocate(cls)
            else:
                buffer, event = entry
                if event is not None:
                    event.synchronize()  # the copy that last used it is done (backward ran)
            with self._lock:  # checked out only once the caller gets it
                self._handed[id(buffer)] = buffer
                handed_out = True
                if entry is None:
                    self.misses += 1
                    self.host_bytes += cls
                else:
                    self.hits += 1
                if into is not None:
                    into.host = buffer
            return buffer
        except BaseException:
            if entry is not None and not handed_out:
                self._returned.append(entry)  # as release does: the next acquire takes it back
            raise

    def release(self, buffer: torch.Tensor, /, *, event: Any = None) -> None:
        """Give ``buffer`` back; ``event`` marks the last device copy that uses it.

        Takes no lock (NOTE [release never waits]).
        """
        if self._handed.pop(id(buffer), _NOT_HANDED) is not buffer:  # None is no buffer too
            # Taken in, it would join a free list (a float buffer among uint8 ones, or an object
            # the next acquire fails on) and leave checked_out one short.
            raise CheckpointConfigError(
                "HostPool.release takes back only buffers this pool handed out",
                expected="a buffer from this pool's acquire(), not released since",
                got=describe_leaf(buffer) + (" (not this pool's, or released already)"
                                             if isinstance(buffer, torch.Tensor) else ""),
                tip="release each buffer acquire() returned exactly once, to the pool it came "
                    "from; a tensor of your own needs no release")
        self._returned.append((buffer, event))
