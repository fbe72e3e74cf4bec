"""Copies between device and host, on side streams where the device has them.

NOTE [stream rules]:
1. Device-to-host: the d2h stream first waits for the compute stream (the tensor's producer
   may still be running), copies with ``non_blocking``, and records an event. The device tensor
   must stay alive until that event completes, or until ``wait(event, stream=...)`` has put
   the stream that was current when the tensor was saved behind it (the caching allocator
   could otherwise hand the memory to a new tensor while the copy still reads it; the memory
   belongs to that stream, whose later kernels are ordered after the copy). The manager drops
   its reference on ``done(event)``, or after ``wait(event)`` two windows later (NOTE [copies
   in flight]); bytes backward reused, when backward is done with them (NOTE [reuse at the
   turn]). ``record_stream`` also marks the source as used on the d2h stream: memory freed
   while the copy is queued, by a holder other than the manager (an output discard's
   ``resize_(0)`` of a layer input) or allocated on another stream than the one that saved
   it, is not handed out again before the copy is done.
2. Host-to-device: the destination is allocated on the compute stream, the h2d stream waits for
   the compute stream (the allocation is ordered) and for the d2h event (the host copy is
   complete), copies, and records an event; ``record_stream`` tells the allocator the buffer is
   in use on the h2d stream. The compute stream waits on that event before any use.
3. A host buffer goes back to the pool with the event of the last copy that uses it.
4. A restored buffer (or reused bytes) read on another stream than the one its memory came
   from (a prefetch allocates on the stream of the layer whose backward runs; the layer that
   reads it may have run on another) is marked as used there with ``record_stream``: its
   memory goes back to the allocating stream's pool, which would otherwise hand it out while
   the reading stream's kernels are still queued.
5. A restore given up (a prefetch that ran out of device memory: NOTE [a prefetch that runs
   out of memory] in prefetch.py) drops its buffer at once: rule 2's ``record_stream`` keeps
   that memory from being handed out before its queued copy is done, nothing waits on its
   event, and its event stays the host buffer's last until a later restore replaces it
   (rule 3). The allocation that failed queued nothing.
On a device without streams (CPU) every copy is synchronous and every event is ``None``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["CopyEngine"]


class CopyEngine:
    """Device<->host byte copies; CUDA side streams, or synchronous copies elsewhere."""

    def __init__(self, device: torch.device, /) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._waits: list[tuple[Any, Any]] = []  # (before, after) timing events around waits
        # Backward (autograd's thread) appends waits while stats() (the caller's) may fold them:
        # folding holds this lock; listing a wait never takes it (NOTE [waits never block]).
        self._waits_lock = threading.Lock()
        self._waited_ms = 0.0
        # Made at the first copy, not here: a manager unpickled where there is no CUDA (a
        # model saved on a GPU, loaded on a CPU machine) must not fail before it is used.
        self._streams: tuple[Any, Any] | None = None

    @property
    def d2h_stream(self) -> Any:
        return self._side_streams()[0]

    @property
    def h2d_stream(self) -> Any:
        return self._side_streams()[1]

    def _side_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor, /) -> Any:
        """Copy ``device_bytes`` into the front of ``host``; returns the event (rule 1)."""
        target = host[: device_bytes.numel()]
        if not self.cuda:
            target.copy_(device_bytes)
            return None
        stream = self.d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            target.copy_(device_bytes, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        device_bytes.record_stream(stream)  # rule 1, for memory freed by someone else
        return event

    def to_device(self, host: torch.Tensor, nbytes: int, after: Any, /
                  ) -> tuple[torch.Tensor, Any]:
        """A new device buffer filled from ``host[:nbytes]``; returns it and its event (rule 2)."""
        buffer = self.allocate(nbytes)  # first: out of memory here, nothing is queued yet
        if not self.cuda:
            buffer.copy_(host[:nbytes])
            return buffer, None
        stream = self.h2d_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            buffer.copy_(host[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        buffer.record_stream(stream)
        return buffer, event

    def allocate(self, nbytes: int, /) -> torch.Tensor:
        """The device buffer of one restore, on the current stream: the one allocation a
        restore makes, so the one place it runs out of device memory (``torch.OutOfMemoryError``:
        NOTE [a prefetch that runs out of memory] in prefetch.py)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def use_here(self, buffer: torch.Tensor, /, *, allocated_on: Any) -> None:
        """Rule 4: mark ``buffer`` as used on the current stream if its memory came from another."""
        if not self.cuda or allocated_on is None:
            return
        current = torch.cuda.current_stream(self.device)
        if current != allocated_on:
            buffer.record_stream(current)

    def current_stream(self) -> Any:
        """The stream work is queued on now (``None`` without streams)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def wait(self, event: Any, /, *, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for ``event`` (no host blocking)."""
        if event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if event.query():
            stream.wait_event(event)
            return
        # Not done yet: time the compute stream's wait with a pair of timing events.
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        # NOTE [waits never block]: a copy's __del__ waits here (bytes backward reused, NOTE
        # [reuse at the turn]), and the garbage collector runs it wherever an allocation starts
        # a collection, inside the fold's locked section too, on the thread that holds the
        # lock: so no wait takes the lock. One append is atomic, and a fold swaps the list
        # before reading it: a wait listed meanwhile is counted by that fold or the next (one
        # that races the swap itself may go uncounted: a statistic, never a hang). Folding
        # when many are listed (nobody read stats()) is skipped while the lock is held.
        self._waits.append((before, after))
        if len(self._waits) > 256 and self._waits_lock.acquire(blocking=False):
            try:
                self._fold_waits()
            finally:
                self._waits_lock.release()

    def waited_ms(self) -> float:
        """Milliseconds the compute stream spent waiting on copies (completed waits only).

        Completed waits are folded into a running total, so the event list stays short.
        """
        with self._waits_lock:
            self._fold_waits()
            return self._waited_ms

    def _fold_waits(self) -> None:
        """Add the completed waits to the total, keep the others (the caller holds the lock)."""
        waits, self._waits = self._waits, []  # NOTE [waits never block]
        still = []
        for before, after in waits:  # one query each: a wait is counted once
            if after.query():
                self._waited_ms += before.elapsed_time(after)
            else:
                still.append((before, after))
        self._waits.extend(still)

    def reset_waits(self) -> None:
        """Start a new total; waits still running are kept and count in it once done."""
        with self._waits_lock:
            self._waited_ms = 0.0

    def done(self, event: Any, /) -> bool:
        return event is None or event.query()
