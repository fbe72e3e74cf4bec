"""``CopyEngine``'s bookkeeping: which stream waits, when a copy counts as done, and the
compute stream's waits (the ``wait_ms`` statistic).

The waits themselves need CUDA (``test_cuda.py``); the bookkeeping is plain Python, checked here
with stand-in events and streams.
"""

from __future__ import annotations

from typing import Any

import pytest
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


class StandInStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def test_the_engine_reports_a_copy_done_only_when_its_event_has_completed() -> None:
    # Guards against: done() ignores the event (True only for None): on CUDA stats() then never
    # lets go of a landed copy, and the last windows' device tensors stay until backward.
    engine = CopyEngine(torch.device("cpu"))
    assert engine.done(None)
    assert engine.done(TimingEvent(True))
    assert not engine.done(TimingEvent(False))


def test_the_engine_makes_the_given_stream_wait_not_the_current_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: wait() ignores its ``stream`` argument (always the current stream). The
    # manager's rule 1 (the stream that saved a tensor waits before its memory is let go) relies on
    # it.
    current, saving = StandInStream(), StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    engine = CopyEngine(torch.device("cuda", 0))  # makes no stream until the first copy
    event = TimingEvent(True)
    engine.wait(event, stream=saving)
    assert saving.waited == [event] and current.waited == []
    engine.wait(event)
    assert current.waited == [event]


def test_the_engine_names_the_current_cuda_stream_as_the_saving_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: current_stream() returns None on CUDA too, so every copy records no saving
    # stream and the wait lands on whatever stream is current when the manager lets go.
    current = StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    assert CopyEngine(torch.device("cuda", 0)).current_stream() is current
    assert CopyEngine(torch.device("cpu")).current_stream() is None
