"""``CopyEngine``'s bookkeeping: which stream waits, when a copy counts as done, and the
compute stream's waits (the ``wait_ms`` statistic).

The waits themselves need CUDA (``test_cuda.py``); the bookkeeping is plain Python, checked here
with stand-in events and streams, also through whole training steps of the manager.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch
from torch import nn

from offload.streams import CopyEngine
from tests.conftest import assert_same_grads
from tests.offload.blocks import Layer, manager, offloaded_stack, stack


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


class LoggedStream:
    """A stand-in CUDA stream that logs what is asked of it into a shared list."""

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: LoggedStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def __repr__(self) -> str:
        return self.name


def _logged_cuda(monkeypatch: pytest.MonkeyPatch, running: frozenset[str] = frozenset(),
                 ) -> tuple[CopyEngine, list[tuple[Any, ...]]]:
    """A ``CopyEngine`` that takes its device for CUDA, with every stream, event and
    ``record_stream`` call logged in order (the copies themselves run on the CPU). Events are
    complete, except those recorded on a stream named in ``running`` until synchronized."""
    log: list[tuple[Any, ...]] = []
    compute = LoggedStream("compute", log)
    side = iter([LoggedStream("d2h", log), LoggedStream("h2d", log)])
    names = (f"event{i}" for i in itertools.count())

    class LoggedEvent:
        def __init__(self, **kwargs: Any) -> None:
            self.name = next(names)
            self.done = True

        def record(self, stream: LoggedStream) -> None:
            log.append(("record", self.name, stream.name))
            self.done = stream.name not in running

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            log.append(("synchronize", self.name))
            self.done = True

        def elapsed_time(self, end: Any) -> float:
            return 2.5

    class Entered:
        def __init__(self, stream: LoggedStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            log.append(("enter", self.stream.name))

        def __exit__(self, *exc: Any) -> None:
            log.append(("exit", self.stream.name))

    def record_stream(tensor: torch.Tensor, stream: LoggedStream) -> None:
        log.append(("record_stream", tensor.untyped_storage().data_ptr(), stream.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(side))
    monkeypatch.setattr(torch.cuda, "Event", LoggedEvent)
    monkeypatch.setattr(torch.cuda, "stream", Entered)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    engine = CopyEngine(torch.device("cpu"))
    engine.cuda = True  # the CUDA path, on CPU tensors
    return engine, log


def test_a_copy_to_host_is_queued_after_the_compute_stream_and_marks_its_source_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stream rule 1, as the engine issues it: the d2h stream waits for the compute stream
    # (the producer may still run) before the copy, records its event on the d2h stream, and
    # marks the source as used there (memory freed by another holder while the copy is queued).
    engine, log = _logged_cuda(monkeypatch)
    source = torch.arange(16, dtype=torch.uint8)
    host = torch.zeros(32, dtype=torch.uint8)
    event = engine.to_host(host, source)
    assert torch.equal(host[:16], source)
    assert log == [("wait_stream", "d2h", "compute"), ("enter", "d2h"),
                   ("record", event.name, "d2h"), ("exit", "d2h"),
                   ("record_stream", source.untyped_storage().data_ptr(), "d2h")]


def test_a_copy_back_waits_for_compute_and_the_copy_to_host_and_marks_its_buffer_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stream rule 2: the h2d stream waits for the compute stream (the destination's allocation)
    # and for the copy to host's event before it copies; it records its own event there, and
    # the new buffer is marked as used on the h2d stream.
    engine, log = _logged_cuda(monkeypatch)
    host = torch.arange(32, dtype=torch.uint8)
    to_host_event = engine.to_host(host.clone(), torch.zeros(8, dtype=torch.uint8))
    log.clear()
    buffer, event = engine.to_device(host, 16, to_host_event)
    assert torch.equal(buffer, host[:16])
    assert log == [("wait_stream", "h2d", "compute"),
                   ("wait_event", "h2d", to_host_event.name), ("enter", "h2d"),
                   ("record", event.name, "h2d"), ("exit", "h2d"),
                   ("record_stream", buffer.untyped_storage().data_ptr(), "h2d")]


def test_a_buffer_read_on_another_stream_than_its_own_is_marked_used_there_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stream rule 4: record_stream on the reading (current) stream, and only where it differs
    # from the stream the buffer's memory came from.
    engine, log = _logged_cuda(monkeypatch)
    compute = torch.cuda.current_stream()
    other = LoggedStream("other", log)
    buffer = torch.zeros(4, dtype=torch.uint8)
    engine.use_here(buffer, allocated_on=compute)
    engine.use_here(buffer, allocated_on=None)
    assert log == []
    engine.use_here(buffer, allocated_on=other)
    assert log == [("record_stream", buffer.untyped_storage().data_ptr(), "compute")]


def test_a_wait_for_a_copy_still_running_is_timed_on_the_stream_that_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait_ms statistic: a pair of timing events around the wait, recorded on the stream
    # that waits (the saving stream when the manager lets go of a copy, NOTE [copies in
    # flight]), not the current one: elsewhere they would time another stream's queue.
    engine, log = _logged_cuda(monkeypatch)
    saving = LoggedStream("saving", log)
    running = TimingEvent(False)
    running.name = "copy"  # type: ignore[attr-defined]
    engine.wait(running, stream=saving)
    assert [entry[0] for entry in log] == ["record", "wait_event", "record"]
    assert [entry[2] for entry in log] == ["saving", "copy", "saving"]
    assert engine.waited_ms() == 2.5  # counted once the closing event completed


@pytest.mark.parametrize("listed", [1, 256])
def test_a_wait_run_by_the_garbage_collector_inside_a_locked_section_does_not_deadlock(
        listed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Backward's last handles on reused bytes may go with a graph in a reference cycle, freed by
    # whichever allocation starts a collection: possibly one inside the engine's own locked
    # section (the list waited_ms() folds into, from stats() or from a wait), on the thread
    # holding the lock. The copy's __del__ then makes its saving stream wait on the copy to
    # host, still running: a wait that took the lock (to list itself, or with 256 listed to
    # fold them) would hang the training step forever.
    engine, log = _logged_cuda(monkeypatch)
    running = TimingEvent(False)
    running.name = "copy"  # type: ignore[attr-defined]
    saving = LoggedStream("saving", log)
    for _ in range(listed):
        engine.wait(running, stream=saving)
    done = threading.Event()
    errors: list[BaseException] = []

    def finalizer_inside_the_lock() -> None:
        try:
            with engine._waits_lock:  # where the collector may run a finalizer
                engine.wait(running, stream=saving)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        done.set()

    threading.Thread(target=finalizer_inside_the_lock, daemon=True).start()
    assert done.wait(10), "a wait blocked on the lock its own thread holds"
    assert errors == []
    assert engine.waited_ms() == 2.5 * (listed + 1)  # every wait counted, once


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("running", [frozenset(), frozenset({"d2h"})], ids=["idle", "host_ahead"])
def test_training_steps_through_the_cuda_copy_path_give_eager_gradients_and_keep_the_rules(
        monkeypatch: pytest.MonkeyPatch, running: frozenset[str], prefetch: int) -> None:
    # The manager with the engine's CUDA branches (streams, events, record_stream, timed
    # waits, stats()'s wait_ms): code a CPU run never takes, only the GPU would. With the host
    # ahead, no copy to host completes unless waited for: the manager must wait on the stream
    # that saved each tensor before letting go of it, and backward reuses or copies back.
    engine, log = _logged_cuda(monkeypatch, running)
    m = manager(prefetch=prefetch)
    m.engine = engine
    layers = offloaded_stack(m, 4)
    eager = nn.ModuleList(Layer() for _ in range(4))
    eager.load_state_dict(layers.state_dict())
    x = torch.randn(8, 32)
    for _ in range(2):  # the second step reuses the pool's buffers
        log.clear()
        for model in (eager, layers):
            model.zero_grad(set_to_none=True)
            stack(model, x.clone().requires_grad_()).square().sum().backward()
        assert_same_grads([p.grad for p in eager.parameters()],
                          [p.grad for p in layers.parameters()])
        stats = m.stats(reset=True)
        recorded = {stream: [e[1] for e in log if e[0] == "record" and e[2] == stream]
                    for stream in ("d2h", "h2d")}
        waited = {stream: [e[2] for e in log if e[0] == "wait_event" and e[1] == stream]
                  for stream in ("compute", "h2d")}
        # Rule 1: four copies to host, each source marked used on the d2h stream.
        assert len(recorded["d2h"]) == 4
        assert sum(1 for e in log if e[:1] == ("record_stream",) and e[2] == "d2h") == 4
        # Rule 2: each copy back waits for its copy to host; compute waits for each copy back.
        copied_back = (stats["restored_bytes"] - stats["reused_bytes"]) // x.nbytes
        assert len(recorded["h2d"]) == copied_back > 0
        assert set(waited["h2d"]) <= set(recorded["d2h"])  # one copy to host each
        assert len(set(waited["h2d"])) == len(waited["h2d"]) == copied_back
        assert set(recorded["h2d"]) <= set(waited["compute"])
        assert sum(1 for e in log if e[:1] == ("record_stream",) and e[2] == "h2d") == \
            len(recorded["h2d"])  # each new buffer marked used on the h2d stream
        d2h_waits = [e for e in waited["compute"] if e in recorded["d2h"]]
        if running:  # rule 1 by waiting: every copy let go, reused ones included
            assert sorted(set(d2h_waits)) == sorted(recorded["d2h"])
            assert stats["wait_ms"] == 2.5 * len(d2h_waits)  # each timed, counted once
        else:
            assert d2h_waits == [] and stats["wait_ms"] == 0.0
        assert stats["host_buffers_in_use"] == 0
