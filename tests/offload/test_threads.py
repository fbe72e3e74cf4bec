"""One manager shared by threads: each forward and backward of its own, each thread's windows in
passes of its own (numbered, prefetched, logged and let go of as with a manager of its own), and
the shared state (copies in flight, restores, counters) changed by one thread at a time."""

from __future__ import annotations

import contextlib
import copy
import dis
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from offload import OffloadManager
from offload.in_flight import InFlight
from offload.packing import pack_saved
from offload.pool import HostPool, size_class
from offload.unpacking import unpack_handle
from offload.window import Copy
from tests.offload.blocks import manager
from tests.offload.simulated import simulated
from tests.switch_points import reenable_tracing, require_opcode_tracing


def test_two_threads_restoring_one_copy_copy_it_back_once() -> None:
    # Two threads whose backwards share a manager reach one copy together (one restores the
    # window, the other prefetches it as a window of its own pass). Both saw "not restored
    # yet": two copies back, restored_bytes above offloaded_bytes, and on CUDA the second
    # could read the first's buffer before its copy event was even set.
    m = manager()
    x = torch.randn(64, 32)
    with m.window([x]) as window:
        pass
    handle = m.offload_into(window, x)
    m.stats()  # lets go of the device bytes: the restore copies back from host
    to_device = m.engine.to_device
    calls: list[str] = []
    first_inside, second_inside = threading.Event(), threading.Event()

    def slow_to_device(*args: Any) -> Any:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            first_inside.set()
            second_inside.wait(0.5)  # the other thread gets its chance to restore too
        else:
            second_inside.set()
        return to_device(*args)

    m.engine.to_device = slow_to_device  # type: ignore[method-assign]
    restored: dict[str, torch.Tensor] = {}

    def restore(name: str) -> None:
        restored[name] = m.restore(handle)

    first = threading.Thread(target=restore, args=("first",), name="first")
    first.start()
    assert first_inside.wait(5)
    second = threading.Thread(target=restore, args=("second",), name="second")
    second.start()
    first.join(5)
    second.join(5)
    assert calls == ["first"]
    assert torch.equal(restored["first"], x) and torch.equal(restored["second"], x)
    stats = m.stats()
    assert stats["restored_bytes"] == stats["offloaded_bytes"] == x.untyped_storage().nbytes()


class TableLayer(nn.Module):
    """A residual layer that also gets a table made per forward (a RoPE table, cu_seqlens)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * table


class Turns:
    """Steps of several threads in a fixed order: ``with turns(name):`` waits for that name's
    turn, and hands the turn on when the block ends (also when it raises)."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.at = 0
        self.cond = threading.Condition()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with self.cond:
            assert self.cond.wait_for(
                lambda: self.at < len(self.order) and self.order[self.at] == name, 10), (
                f"{name} never got its turn {self.at} of {self.order}")
        try:
            yield
        finally:
            with self.cond:
                self.at += 1
                self.cond.notify_all()


def run_threads(targets: dict[str, Callable[[], None]]) -> None:
    """Run each target on a thread of its name; re-raise the first failure here."""
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:  # handed to the main thread, which raises it
                failures.append(error)
        return run

    threads = [threading.Thread(target=guarded(target), name=name)
               for name, target in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), f"{thread.name} hung"
    if failures:
        raise failures[0]


class Model:
    """Three ``TableLayer``s checkpointed with offload through a manager, and their eager twin."""

    def __init__(self, m: OffloadManager, rows: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(TableLayer() for _ in range(3))
        self.eager = copy.deepcopy(self.layers)
        pytree_ckpt.checkpoint_layers(self.layers, offload=m)
        self.m = m
        self.x = torch.randn(rows, 32, requires_grad=True)
        self.table = torch.randn(32)
        self.events: list[list[tuple[str, int]]] = []

    def step(self, turn: Callable[[], Any], then: Callable[[], Any] = lambda: None) -> None:
        """One forward (a turn per layer) and backward (one more turn, which ends with
        ``then()``), checked against the eager twin's gradients."""
        table = self.table.clone()  # made per forward: only the forward holds it
        h = self.x
        for layer in self.layers:
            with turn():
                h = layer(h, table)
        del table  # the forward is over
        with turn():
            h.sum().backward()
            self.events.append(self.m.events())
            then()
        self.assert_eager_grads()

    def assert_eager_grads(self) -> None:
        """The checkpointed layers' and the input's gradients are the eager twin's, bit for
        bit; every gradient is reset after."""
        got = [p.grad for p in self.layers.parameters()] + [self.x.grad]
        self.layers.zero_grad(set_to_none=True)
        self.x.grad = None
        h = self.x
        for layer in self.eager:
            h = layer(h, self.table)
        h.sum().backward()
        expected = [p.grad for p in self.eager.parameters()] + [self.x.grad]
        self.eager.zero_grad(set_to_none=True)
        self.x.grad = None
        assert all(g is not None and torch.equal(g, e) for g, e in zip(got, expected))


_COUNTED = ("offloaded_bytes", "restored_bytes", "reused_bytes", "prefetch_hits",
            "alive_elsewhere_bytes", "discarded_bytes", "below_min_bytes", "other_device_bytes",
            "windows")

# Each thread's own backward, alone: its last window reused, each earlier one prefetched.
_OWN = [("restore", 2), ("prefetch", 1), ("prefetch_hit", 1), ("prefetch", 0),
        ("prefetch_hit", 0)]


def test_threads_sharing_a_manager_prefetch_only_their_own_windows() -> None:
    # Two threads (two models) share one manager, with their forwards interleaved layer by
    # layer; "a" runs its backward while "b" is between its second and third layer. All
    # windows joined one pass: a's backward restored windows 4, 2 and 0 and prefetched b's
    # windows 3 and 1 (holding b's device memory from then on), and judged b's table, which
    # b's forward was still using, as kept by something else. Each forward now has a pass of
    # its own: each backward restores and prefetches exactly its own windows, the counters of
    # both add up to those of each alone, and after the first step the pool does not grow.
    m = manager(prefetch=1)
    models = {"a": Model(m, rows=8, seed=0), "b": Model(m, rows=6, seed=1)}
    steps = 3
    turns = Turns(["a", "b", "a", "b", "a", "a", "b", "b"] * steps)
    first_step: dict[str, float] = {}

    def run(name: str) -> None:
        for step in range(steps):
            # b's backward ends each step: the first step's counters are read there, in its
            # turn (a stats() while a's next forward runs would let go of a's windows early).
            then = (lambda: first_step.update(m.stats(reset=True))) if (
                name, step) == ("b", 0) else (lambda: None)
            models[name].step(lambda: turns(name), then)

    run_threads({name: lambda name=name: run(name) for name in models})
    for model in models.values():
        assert model.events == [_OWN] * steps
    later_steps = m.stats()
    assert later_steps["pool_misses"] == 0 and later_steps["host_buffers_in_use"] == 0

    alone = {key: 0 for key in _COUNTED}
    for name, model in models.items():
        solo = manager(prefetch=1)
        twin = Model(solo, rows=model.x.shape[0], seed=0 if name == "a" else 1)
        twin.step(contextlib.nullcontext)
        assert twin.events == [_OWN]
        for key, value in solo.stats().items():
            if key in alone:
                alone[key] += value
    # Alone, only the inputs the models keep are alive elsewhere (not the tables), and each
    # backward reuses its last window.
    inputs = sum(model.x.untyped_storage().nbytes() for model in models.values())
    assert alone["alive_elsewhere_bytes"] == inputs and alone["reused_bytes"] == inputs
    assert {key: first_step[key] for key in _COUNTED} == alone
    assert {key: later_steps[key] for key in _COUNTED} == {
        key: (steps - 1) * value for key, value in alone.items()}


def test_a_thread_that_ends_leaves_no_pass_held_by_the_manager() -> None:
    # The manager held the pass new windows join and the one whose backward ran last: a thread
    # that ran a forward and ended left its pass (window list, event log) to the manager until
    # another forward came. Each thread's passes are now held for that thread only.
    m = manager()
    passes: list[weakref.ref[Any]] = []
    nbytes = 8 * 32 * 4

    def forward_and_backward() -> None:
        x = torch.randn(8, 32, requires_grad=True)
        with m.window([x]) as window:
            loss = (x * x).sum()
        passes.append(weakref.ref(window.pass_))
        loss.backward()
        assert m.events() == [("restore", 0)]

    run_threads({"worker": forward_and_backward})
    gc.collect()
    assert passes[0]() is None
    stats = m.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == nbytes


def test_a_backward_on_another_thread_counts_for_the_thread_that_ran_its_forward() -> None:
    # As on CUDA, where autograd unpacks on its device threads: the unpack finds its pass
    # through the handle, and events() of the forward's thread shows that backward; a thread
    # that ran no forward on the manager has no pass, and no events.
    m = manager(prefetch=1)
    model = Model(m, rows=4, seed=2)
    forward_done, backward_done = threading.Event(), threading.Event()
    out: list[torch.Tensor] = []
    seen: list[list[tuple[str, int]]] = []

    def forward() -> None:
        h = model.x
        for layer in model.layers:
            h = layer(h, model.table)
        out.append(h)
        forward_done.set()
        assert backward_done.wait(10)
        seen.append(m.events())

    worker = threading.Thread(target=forward)
    worker.start()
    assert forward_done.wait(10)
    out.pop().sum().backward()
    backward_done.set()
    worker.join(10)
    assert seen == [_OWN] and m.events() == []


def test_events_on_a_thread_whose_forward_ran_and_whose_backward_did_not_yet_are_empty() -> None:
    # Mutation testing (helper FP, mutant L3: a new lane's ``recent`` pass left None until its
    # first backward; every other test passed): events() between the first forward and its
    # backward, on the thread that opened the window, raised AttributeError instead of giving
    # the documented empty list.
    m = manager(prefetch=1)
    w = torch.randn(32, requires_grad=True)
    x = torch.randn(32)
    with m.window([x]):
        loss = (w * x).sum()
    assert m.events() == []
    loss.backward()
    assert m.events() == [("restore", 0)] and torch.equal(w.grad, x)


def test_a_pass_that_offloaded_nothing_on_a_thread_that_ended_is_still_warned_of(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: the "offloaded nothing" check looking only at live threads' passes. A
    # worker's pass (replicas run by a thread each) dies with its graph once the thread has
    # ended, before any stats(): it leaves its tallies behind for the check.
    m = manager(min_bytes=1 << 20)
    rows = 8

    def forward_and_backward() -> None:
        x = torch.randn(rows, 32, requires_grad=True)
        with m.window([x]):
            loss = (x * x).sum()
        loss.backward()

    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        run_threads({"worker": forward_and_backward})
        gc.collect()
        assert m.stats()["below_min_bytes"] == rows * 32 * 4
    warnings = [r.getMessage() for r in caplog.records if r.name == "offload.manager"]
    assert len(warnings) == 1 and f"the largest had {rows * 32 * 4} bytes" in warnings[0]


def test_two_worker_forwards_backed_by_the_main_thread_give_eager_gradients_and_return_buffers(
        ) -> None:
    # Guards against: a pass kept per manager rather than per forward thread (Lanes.mine
    # ignoring the thread), or an unpack finding its lane through the thread it runs on rather
    # than its handle's pass. Two workers run their forwards interleaved layer by layer, and
    # the main thread runs both backwards once they are done (a forward in a worker, its
    # backward in the main thread, twice over). With one pass for both, a's backward restored
    # and prefetched b's windows; with the backward's own thread, neither worker's events()
    # showed its backward. Each backward must restore exactly its own windows, the gradients
    # must be the eager twins' bit for bit, and every host buffer must go back to the pool.
    m = manager(prefetch=1)
    models = {"a": Model(m, rows=8, seed=0), "b": Model(m, rows=6, seed=1)}
    turns = Turns(["a", "b"] * 3)
    outs: dict[str, torch.Tensor] = {}
    forwards_done = threading.Barrier(3)
    backwards_done = threading.Event()
    seen: dict[str, list[tuple[str, int]]] = {}
    failures: list[BaseException] = []
    # A new thread starts with torch's default intra-op thread count, not the one the main
    # thread set (tests/distributed's session fixture sets 1): the workers' forwards would sum
    # in another order than the eager twins run here, and differ in the last bits.
    threads = torch.get_num_threads()

    def forward(name: str) -> None:
        try:
            torch.set_num_threads(threads)
            model = models[name]
            h = model.x
            for layer in model.layers:
                with turns(name):
                    h = layer(h, model.table)
            outs[name] = h
            forwards_done.wait(10)
            assert backwards_done.wait(10)
            seen[name] = m.events()  # this thread's pass: the backward the main thread ran
        except BaseException as error:  # handed to the main thread, which raises it
            failures.append(error)
            forwards_done.abort()

    workers = [threading.Thread(target=forward, args=(name,), name=name) for name in models]
    for worker in workers:
        worker.start()
    try:
        forwards_done.wait(10)
        for name in ("b", "a"):  # not in forward order: each backward finds its own pass
            outs.pop(name).sum().backward()
    except threading.BrokenBarrierError:
        pass  # a worker failed: its error is raised below
    finally:
        backwards_done.set()
        for worker in workers:
            worker.join(10)
    if failures:
        raise failures[0]
    assert seen == {"a": _OWN, "b": _OWN}
    for model in models.values():
        model.assert_eager_grads()
    stats = m.stats()
    # Per model: three layer inputs, and the table every layer gets, copied once per pass.
    offloaded = sum(3 * model.x.untyped_storage().nbytes() + model.table.untyped_storage().nbytes()
                    for model in models.values())
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == offloaded
    assert stats["host_buffers_in_use"] == 0 and m.pool.checked_out == 0


# -- forced interleavings --------------------------------------------------------------------
# The tests above run their threads in turns: each step of one thread happens between two of
# the other's, never inside one, so they pass with the manager's lock taken out. These hold one
# thread at each switch point of a critical section in turn (``_SWITCHES``) and run the other
# meanwhile, as far as it gets: to its end, or to a lock it has to wait for (which the held
# thread holds). Deterministic: with the locks, the other always stops at the lock.


class Watched:
    """Stands for a lock, and says (``waiting``) when the thread named ``second`` has to wait
    for it."""

    def __init__(self, lock: Any, waiting: threading.Event) -> None:
        self.lock = lock
        self.waiting = waiting

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(False):
            return True
        if not blocking:
            return False
        if threading.current_thread().name == "second":
            self.waiting.set()
        return bool(self.lock.acquire(True, timeout))

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# Where holding a thread can let another change what it is working on: before a store (after
# the read of a count it adds to), a call (the method's object loaded), a branch (taken on what
# it checked) and the next step of a loop (over a dict another thread may add to). Holding at
# these only (about a third of the bytecodes) keeps the sweeps below short.
_SWITCHES = frozenset(code for name, code in dis.opmap.items() if name in (
    "STORE_ATTR", "STORE_SUBSCR", "CALL", "FOR_ITER") or "JUMP" in name and "IF" in name)


def held_inside(m: OffloadManager, code: CodeType, index: int, first: Callable[[], None],
                second: Callable[[], None], *, call: int = 1) -> bool:
    """Run ``first()`` on a thread and hold it at the ``index``-th switch point (a bytecode of
    ``_SWITCHES``) of its ``call``-th call of ``code``; meanwhile run ``second()`` on another
    thread until it returns or has to wait for the manager's lock or its pool's; then let
    ``first`` go on, and wait for both. False where that call has no ``index``-th switch point
    (``second`` then ran after ``first``)."""
    require_opcode_tracing()
    held, go_on, second_stopped = threading.Event(), threading.Event(), threading.Event()
    m._lock = Watched(m._lock, second_stopped)  # type: ignore[assignment]
    m.pool._lock = Watched(m.pool._lock, second_stopped)  # type: ignore[assignment]
    calls = count = 0
    reached = False

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count, reached
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] in _SWITCHES:
            if count == index:
                reached = True
                held.set()
                assert go_on.wait(30), "second never stopped"
                reenable_tracing()  # second ran this code meanwhile, untraced
            count += 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        nonlocal calls
        if frame.f_code is not code:
            return None
        calls += 1
        if calls != call:
            return None
        frame.f_trace = local  # first: Python 3.13's opcode events (tests/switch_points.py)
        frame.f_trace_opcodes = True
        return local

    def traced() -> None:
        reenable_tracing()  # after earlier sweeps (NOTE in tests/switch_points.py)
        sys.settrace(on_call)
        try:
            first()
        finally:
            sys.settrace(None)
            held.set()  # also when it never got there

    def stopping() -> None:
        try:
            second()
        finally:
            second_stopped.set()

    threads = torch.get_num_threads()  # the eager twins' (see the test above)
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                torch.set_num_threads(threads)
                target()
            except BaseException as error:  # handed to the main thread, which raises it
                failures.append(error)
        return run

    one = threading.Thread(target=guarded(traced), name="first")
    one.start()
    assert held.wait(30)
    two = threading.Thread(target=guarded(stopping), name="second")
    two.start()
    assert second_stopped.wait(30), "second hung while first was held"
    go_on.set()
    for thread in (one, two):
        thread.join(30)
        assert not thread.is_alive(), f"{thread.name} hung"
    if failures:
        raise failures[0]
    return reached


def sweep(code: CodeType, run: Callable[[int], bool], /) -> int:
    """``run(index)`` for each switch point of the call of ``code`` held in, until it says
    there is none (``held_inside``'s answer); how many there were."""
    index = 0
    while run(index):
        index += 1
    assert index > 0, f"{code.co_name} never ran"
    return index


# A critical section of each kind: opening a window, a save (its copy, its pool buffer), the
# copies in flight let go of, backward's unpack and restore.
_CRITICAL = [OffloadManager._open, pack_saved, Copy.__init__, HostPool.acquire, InFlight.let_go,
             unpack_handle, Copy.restore]


def _solo_totals() -> dict[str, float]:
    alone = {key: 0.0 for key in _COUNTED}
    for rows, seed in ((8, 0), (6, 1)):
        solo = manager(prefetch=1)
        Model(solo, rows=rows, seed=seed).step(contextlib.nullcontext)
        for key, value in solo.stats().items():
            if key in alone:
                alone[key] += value
    return alone


@pytest.mark.parametrize("critical", _CRITICAL, ids=lambda f: f.__qualname__)
def test_two_steps_held_inside_each_other_give_eager_gradients_and_the_counts_of_each_alone(
        critical: Callable[..., Any]) -> None:
    # Guards against: a critical section of the manager left unlocked (the manager's lock, or
    # its pool's, taken out of an entry point). Thread "first" runs a's forward and backward
    # and is held at each switch point of one critical section in turn; "second" runs b's whole
    # step meanwhile, until it must wait for the lock first holds. Unlocked, second's step ran
    # inside first's: a counter first had read and not yet stored lost second's bytes and
    # windows, and first's copies in flight, listed anew, dropped second's (whose device
    # bytes then stayed held until its backward reused them). Each step must give its eager
    # twin's gradients bit for bit and each backward its own events, and the counters must be
    # those of both steps alone, every host buffer back in the pool.
    alone = _solo_totals()
    code = critical.__code__

    def run(index: int) -> bool:
        m = manager(prefetch=1)
        a, b = Model(m, rows=8, seed=0), Model(m, rows=6, seed=1)
        reached = held_inside(m, code, index, lambda: a.step(contextlib.nullcontext),
                              lambda: b.step(contextlib.nullcontext))
        assert a.events == b.events == [_OWN], f"held at switch point {index}"
        stats = m.stats()
        assert {key: stats[key] for key in _COUNTED} == alone, f"held at switch point {index}"
        # A host buffer per copy: each model's three layer inputs and its table.
        assert stats["pool_hits"] + stats["pool_misses"] == 8, f"held at switch point {index}"
        assert stats["host_buffers_in_use"] == 0 and m.pool.checked_out == 0
        return reached

    sweep(code, run)


def _solo_a() -> tuple[dict[str, float], Model]:
    solo = manager(prefetch=1)
    model = Model(solo, rows=8, seed=0)
    model.step(contextlib.nullcontext)
    return solo.stats(), model


# Counted the same whenever a stats() runs (which lets go of device bytes early, and so changes
# what backward reuses and what is judged alive elsewhere).
_ANYTIME = ("offloaded_bytes", "restored_bytes", "prefetch_hits", "windows")


@pytest.mark.parametrize(("critical", "call"), [
    (OffloadManager._open, 2), (Copy.__init__, 2), (Copy.restore, 1)],
    ids=lambda v: getattr(v, "__qualname__", f"call{v}"))
def test_a_reset_held_inside_a_step_loses_and_repeats_no_count(
        critical: Callable[..., Any], call: int) -> None:
    # Guards against: stats() reading and resetting the counters without the manager's lock.
    # Run inside a step's count (read, add, store), the reset was undone by the store: the
    # bytes counted before it came back after it. What the reset returned and what is counted
    # after it must add up to the step's counts alone, and the step give eager gradients.
    alone, _ = _solo_a()

    def run(index: int) -> bool:
        m = manager(prefetch=1)
        a = Model(m, rows=8, seed=0)
        before: list[dict[str, float]] = []
        # A count is held in its second call: not 0 by then (a reset that came back as 0 would
        # leave no trace).
        reached = held_inside(m, critical.__code__, index, lambda: a.step(contextlib.nullcontext),
                              lambda: before.append(m.stats(reset=True)), call=call)
        after = m.stats()
        assert {key: before[0][key] + after[key] for key in _ANYTIME} == {
            key: alone[key] for key in _ANYTIME}, f"held at switch point {index}"
        assert before[0]["pool_hits"] + before[0]["pool_misses"] + after["pool_hits"] + after[
            "pool_misses"] == 4, f"held at switch point {index}"
        return reached

    sweep(critical.__code__, run)


def test_an_offload_into_held_inside_a_save_loses_no_count() -> None:
    # Guards against: offload_into (a replay frame's result, offloaded from another thread)
    # copying without the manager's lock. Run inside a save's count of its bytes (read, add,
    # store), its own bytes were lost. Its tensor must come back as it was, and the counts be
    # the step's alone plus its copy's.
    alone, _ = _solo_a()
    y = torch.randn(16, 32)
    nbytes = y.untyped_storage().nbytes()

    def run(index: int) -> bool:
        m = manager(prefetch=1)
        a = Model(m, rows=8, seed=0)
        with m.window([y]) as window:
            pass
        handles: list[Any] = []
        reached = held_inside(m, Copy.__init__.__code__, index,
                              lambda: a.step(contextlib.nullcontext),
                              lambda: handles.append(m.offload_into(window, y)))
        assert torch.equal(m.restore(handles[0]), y)
        stats = m.stats()
        assert stats["offloaded_bytes"] == alone["offloaded_bytes"] + nbytes, (
            f"held at switch point {index}")
        assert stats["windows"] == alone["windows"] + 1
        assert stats["pool_hits"] + stats["pool_misses"] == 5, f"held at switch point {index}"
        return reached

    sweep(Copy.__init__.__code__, run)


def _comprehension_in(function: Callable[..., Any]) -> CodeType:
    """The code ``function``'s list comprehension runs: a function of its own before Python
    3.12, ``function``'s own code from 3.12 on (inlined)."""
    inner = [const for const in function.__code__.co_consts if isinstance(const, CodeType)]
    return inner[0] if inner else function.__code__


@pytest.mark.parametrize(("critical", "warm", "ahead", "ops"), [
    (HostPool.acquire.__code__, True, False, "reserve count take"),
    (HostPool.acquire.__code__, False, False, "reserve count take"),
    (HostPool.acquire.__code__, False, False, "take"),
    (_comprehension_in(HostPool.acquire), False, True, "reserve"),
    (HostPool._allocate.__code__, False, False, "reserve"),
    (HostPool._take_returned.__code__, True, False, "count")],
    ids=lambda v: getattr(v, "co_qualname", getattr(v, "co_name", str(v))))
def test_pool_calls_held_inside_a_steps_pool_lose_no_buffer_and_no_count(
        critical: CodeType, warm: bool, ahead: bool, ops: str) -> None:
    # Guards against: the host pool's lock taken out. Its callers from outside the manager
    # (reserve(), checked_out, a buffer taken and given back) run while a step, under the
    # manager's lock, takes buffers: a count the step had read and not yet stored (host
    # bytes, hits, misses, buffers out) lost theirs, a free list added while the step looked
    # for a larger class (its iteration raised), and the returned buffers it was moving to
    # the free lists were moved twice (an IndexError) or counted back twice. A ``warm``
    # step's buffers come back from the step before; with ``ahead``, the reserved buffer is
    # allocated before (allocating takes the lock on its own), so that reserve's own section
    # runs where the step is held. Every count must be the step's alone plus those of the
    # calls alone (on a class the step does not use, so each pool's counts are its own).
    def pool_counts(pool: HostPool) -> list[int]:
        return [pool.hits, pool.misses, pool.host_bytes]

    def free_buffers(pool: HostPool) -> int:
        assert pool.checked_out == 0  # and the returned ones moved to the free lists
        return sum(map(len, pool._free.values()))

    reserved = 3000

    def calls(pool: HostPool, out: list[int]) -> None:
        for op in ops.split():
            if op == "reserve":
                pool.reserve([reserved])
            elif op == "count":
                out.append(pool.checked_out)
            else:  # take
                pool.release(pool.acquire(reserved))
        out.append(pool.checked_out)

    _, solo = _solo_a()
    first = pool_counts(solo.m.pool)
    solo.step(contextlib.nullcontext)
    second = pool_counts(solo.m.pool)
    expected = [b - a for a, b in zip(first, second)] if warm else first
    alone = HostPool(pin_memory=False)
    calls(alone, [])
    expected = [step + other for step, other in zip(expected, pool_counts(alone))]
    free = free_buffers(solo.m.pool) + free_buffers(alone)
    assert size_class(reserved) > 2 * size_class(solo.x.untyped_storage().nbytes())

    def run(index: int) -> bool:
        m = manager(prefetch=1)
        a = Model(m, rows=8, seed=0)
        if warm:
            a.step(contextlib.nullcontext)  # its buffers wait, returned, for the next step
        base = pool_counts(m.pool)
        if ahead:
            allocate = m.pool._allocate
            made = allocate(size_class(reserved))
            m.pool._allocate = (  # type: ignore[method-assign]
                lambda nbytes: made if nbytes == size_class(reserved) else allocate(nbytes))
        out: list[int] = []
        reached = held_inside(m, critical, index, lambda: a.step(contextlib.nullcontext),
                              lambda: calls(m.pool, out))
        assert all(0 <= n <= 5 for n in out), f"held at switch point {index}: {out}"
        assert [b - a for a, b in zip(base, pool_counts(m.pool))] == expected, (
            f"held at switch point {index}")
        assert free_buffers(m.pool) == free, f"held at switch point {index}"
        return reached

    sweep(critical, run)


@pytest.mark.parametrize("in_flight", [False, True], ids=["copies-done", "copies-in-flight"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_backwards_run_after_their_forward_threads_ended_reuse_and_count_as_each_alone(
        prefetch: int, in_flight: bool) -> None:
    # Guards against: a backward whose forward's thread has ended (its lane gone) not letting
    # go of its own pass's copies in flight (``_belongs`` without ``owner is pass_``: every
    # window was then reused from the device bytes still held), or letting go of another ended
    # thread's pass's (``_belongs`` without ``lane is not None``: b's backward dropped a's
    # device bytes, which a's backward then copied back from host instead of reusing them).
    # Two workers each run a forward and end; the main thread runs both backwards. The
    # counters must add up to those of each model alone on one thread, the gradients must be
    # the eager twins' bit for bit. Without prefetch the second-to-last window is in flight
    # and not restored now at the first unpack (with prefetch=1 it is: kept either way); it is
    # still held there only where copies are in flight (a simulated device that never runs
    # them unless waited for; on the CPU every copy is done when the next window opens).
    def new_manager() -> OffloadManager:
        return simulated(None, prefetch=prefetch)[0] if in_flight else manager(prefetch=prefetch)

    m = new_manager()
    models = {"a": Model(m, rows=8, seed=0), "b": Model(m, rows=6, seed=1)}
    outs: dict[str, torch.Tensor] = {}
    threads = torch.get_num_threads()  # a new thread's own count would sum in another order

    def forward(name: str) -> None:
        torch.set_num_threads(threads)
        model = models[name]
        table = model.table.clone()  # made per forward, as Model.step does
        h = model.x
        for layer in model.layers:
            h = layer(h, table)
        outs[name] = h

    for name in models:  # one after the other: each thread has ended before the backwards
        run_threads({name: lambda name=name: forward(name)})
    for name in ("b", "a"):
        outs.pop(name).sum().backward()
    stats = m.stats()
    for model in models.values():
        model.assert_eager_grads()
    alone = {key: 0.0 for key in _COUNTED}
    for name, model in models.items():
        solo = new_manager()
        twin = Model(solo, rows=model.x.shape[0], seed=0 if name == "a" else 1)
        twin.step(contextlib.nullcontext)
        for key, value in solo.stats().items():
            if key in alone:
                alone[key] += value
    assert alone["reused_bytes"] > 0  # the last windows, at least: reuse is measured
    assert {key: stats[key] for key in _COUNTED} == alone
    assert stats["host_buffers_in_use"] == 0


def test_a_pass_that_offloaded_nothing_on_a_thread_that_ended_is_warned_of_at_the_next_window(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: _open not checking the passes that died unchecked (``_check_ended``),
    # leaving the warning to the next stats() read. docs/offload.md: the warning comes "when
    # the pass is over: at the first stats() after its backward, or when the next pass opens
    # its first window"; a training loop that never reads stats() must still hear of it.
    m = manager(min_bytes=1 << 20)
    rows = 8

    def forward_and_backward() -> None:
        x = torch.randn(rows, 32, requires_grad=True)
        with m.window([x]):
            loss = (x * x).sum()
        loss.backward()

    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        run_threads({"worker": forward_and_backward})
        gc.collect()
        x = torch.randn(rows, 32, requires_grad=True)
        with m.window([x]):  # the main thread's first window: no stats() read before it
            loss = (x * x).sum()
        warnings = [r.getMessage() for r in caplog.records if r.name == "offload.manager"]
        assert len(warnings) == 1 and f"the largest had {rows * 32 * 4} bytes" in warnings[0]
    loss.backward()


def test_threads_sharing_a_manager_and_a_sliced_constant_table_give_eager_gradients() -> None:
    # helper PV: each thread its own model, one manager, one constant table sliced per step
    # (copied whole once per pass and thread), lengths varying by step, prefetch 2.
    from tests.offload.blocks import Gated
    m = manager(prefetch=2)
    table = torch.randn(64, 32)
    results: dict[int, bool] = {}

    def train(seed: int) -> None:
        torch.manual_seed(seed)
        layers = nn.ModuleList(Gated() for _ in range(3))
        eager = nn.ModuleList(Gated() for _ in range(3))
        eager.load_state_dict(layers.state_dict())
        for layer in layers:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=m)
        ok = True
        for step in range(4):
            gate = table[:8 + step % 2]
            x = torch.randn(8 + step % 2, 32, requires_grad=True)
            xe = x.detach().clone().requires_grad_()
            for model, leaf in ((layers, x), (eager, xe)):
                model.zero_grad()
                h = leaf
                for layer in model:
                    h = layer(h, gate)
                h.sum().backward()
            ok &= torch.equal(x.grad, xe.grad) and all(
                torch.equal(a.grad, b.grad) for a, b in zip(layers.parameters(),
                                                             eager.parameters()))
        results[seed] = ok

    threads = [threading.Thread(target=train, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {0: True, 1: True}
    stats = m.stats()
    assert stats["host_buffers_in_use"] == 0
    assert stats["offloaded_bytes"] == stats["restored_bytes"]
