"""A simulated asynchronous GPU for the offload manager: deferred, stream-ordered copies.

``SimulatedStreams`` stands in for ``offload.streams.CopyEngine``. A copy is queued on its
stream and runs when its event completes, either because the simulated device made progress (at
random points, from a seeded generator; never, with ``seed=None``) or because someone must wait
for it (``wait``, ``event.synchronize``). Until a copy has run its destination holds poison
bytes (NaN in every float dtype). Mistakes the manager could make are recorded in
``violations``: a device-to-host copy whose source the manager no longer holds (rule 1), and a
host buffer handed out again while a restore that reads it is still queued (rule 3). Streams
other than the two copy streams are names only; which one waits is recorded in ``waits``, and
which one reads a restored buffer allocated on another in ``used_on`` (rule 4).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from typing import Any

import torch

from offload import OffloadConfig, OffloadManager

__all__ = ["POISON", "SimEvent", "SimulatedStreams", "simulated"]

POISON = 0xFF  # 0xFFFF... is a NaN in float16, bfloat16, float32 and float64


def _ran() -> None:
    pass


class SimEvent:
    def __init__(self, streams: SimulatedStreams, stream: str, run: Callable[[], None]) -> None:
        self.streams, self.stream, self.run, self.done = streams, stream, run, False

    def query(self) -> bool:
        self.streams.progress()
        return self.done

    def synchronize(self) -> None:
        self.streams.complete(self)


class SimulatedStreams:
    """A stand-in for ``offload.streams.CopyEngine`` with deferred, stream-ordered copies."""

    cuda = False  # no timing events to report

    def __init__(self, device: torch.device, *, seed: int | None, progress: float = 0.5) -> None:
        self.device = device
        self.rng = random.Random(seed)
        self.chance = 0.0 if seed is None else progress  # seed None: the device never runs ahead
        self.queues: dict[str, list[SimEvent]] = {"d2h": [], "h2d": []}
        self.violations: list[str] = []
        self.writes: dict[int, int] = {}  # host buffer address -> copies to host queued into it
        self.current = "compute"  # the name current_stream() gives
        self.waits: list[tuple[str, str]] = []  # (copy's stream, waiting stream)
        self.used_on: list[tuple[str, str]] = []  # (allocating stream, reading stream): rule 4

    # -- the device --------------------------------------------------------------------------
    def complete(self, event: SimEvent) -> None:
        """Run ``event``'s stream up to and including ``event`` (streams run in order)."""
        queue = self.queues[event.stream]
        while not event.done:
            head = queue.pop(0)
            head.run()
            head.done = True
            head.run = _ran  # a real event holds no buffer once done (the pool keeps events)

    def progress(self) -> None:
        """The device gets ahead on its own, by a random amount."""
        for queue in self.queues.values():
            while queue and self.rng.random() < self.chance:
                self.complete(queue[0])

    def finish(self) -> None:
        for queue in self.queues.values():
            while queue:
                self.complete(queue[-1])

    def _enqueue(self, stream: str, run: Callable[[], None]) -> SimEvent:
        event = SimEvent(self, stream, run)
        self.queues[stream].append(event)
        self.progress()
        return event

    # -- the CopyEngine interface --------------------------------------------------------------
    def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> SimEvent:
        target = host[: device_bytes.numel()]
        target.fill_(POISON)  # undefined until the copy ran (and catches a reader still on it)
        self.writes[host.data_ptr()] = self.writes.get(host.data_ptr(), 0) + 1
        source = weakref.ref(device_bytes)  # the real engine holds no reference either

        def run() -> None:
            alive = source()
            if alive is None:
                self.violations.append("rule 1: device bytes dropped before the copy to host ran")
                return
            target.copy_(alive)
        return self._enqueue("d2h", run)

    def to_device(self, host: torch.Tensor, nbytes: int, after: Any) -> tuple[torch.Tensor, Any]:
        buffer = torch.full((nbytes,), POISON, dtype=torch.uint8)
        writes = self.writes.get(host.data_ptr(), 0)

        def run() -> None:
            if after is not None:
                self.complete(after)  # the h2d stream waits on the copy to host
            if self.writes.get(host.data_ptr(), 0) != writes:
                self.violations.append("rule 3: a host buffer was reused before the restore "
                                       "that reads it ran")
            buffer.copy_(host[:nbytes])
        return buffer, self._enqueue("h2d", run)

    def current_stream(self) -> str:
        return self.current  # a name only: every simulated stream is ordered the same way

    def use_here(self, buffer: torch.Tensor, *, allocated_on: Any) -> None:
        if allocated_on is not None and allocated_on != self.current:
            self.used_on.append((allocated_on, self.current))

    def wait(self, event: Any, *, stream: Any = None) -> None:
        if event is not None:
            self.waits.append((event.stream, stream if stream is not None else self.current))
            self.complete(event)  # the waiting stream is ordered after it

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def waited_ms(self) -> float:
        return 0.0

    def reset_waits(self) -> None:
        pass


def simulated(seed: int | None, **config: Any) -> tuple[OffloadManager, SimulatedStreams]:
    manager = OffloadManager(OffloadConfig(**{"min_bytes": 0, **config}), device="cpu")
    streams = SimulatedStreams(manager.device, seed=seed)
    manager.engine = streams  # type: ignore[assignment]
    return manager, streams
