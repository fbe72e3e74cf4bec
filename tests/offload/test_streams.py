"""``CopyEngine``'s bookkeeping of the compute stream's waits (the ``wait_ms`` statistic).

The waits themselves need CUDA (``test_cuda.py``); the accounting is plain Python, checked here
with stand-in timing events.
"""

from __future__ import annotations

import torch

from offload.streams import CopyEngine


class TimingEvent:
    """A stand-in for a CUDA timing event: done or not, and a fixed elapsed time."""

    def __init__(self, done: bool, ms: float = 0.0) -> None:
        self.done, self.ms = done, ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: TimingEvent) -> float:
        return end.ms


def test_a_wait_still_running_at_a_reset_counts_once_in_the_next_total() -> None:
    engine = CopyEngine(torch.device("cpu"))
    finished = (TimingEvent(True), TimingEvent(True, ms=2.0))
    running = (TimingEvent(False), TimingEvent(False, ms=3.0))
    engine._waits = [finished, running]
    assert engine.waited_ms() == 2.0  # only the finished wait
    engine.reset_waits()               # stats(reset=True)
    assert engine.waited_ms() == 0.0   # the running one is not counted yet ...
    running[1].done = True
    assert engine.waited_ms() == 3.0   # ... but once done, in the new total
    assert engine.waited_ms() == 3.0   # and only once
