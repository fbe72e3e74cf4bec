"""Forced interleavings for the thread tests: what another thread could do at each point where
CPython may switch threads (between two bytecodes), done there, deterministically."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import pytest


def reenable_tracing() -> None:
    """NOTE: Python 3.12+ trace through ``sys.monitoring``, whose instrumentation belongs to
    the code object, for every thread: a thread running traced code untraced (the other
    thread of a forced interleaving) gets ``DISABLE`` back from ``settrace``'s callbacks, which
    switches those events off for the traced thread too, until restarted. (No-op before
    3.12.)"""
    if hasattr(sys, "monitoring"):
        sys.monitoring.restart_events()


@functools.cache
def _opcode_events_arrive() -> bool:
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "opcode"
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace = local
        frame.f_trace_opcodes = True
        return local

    def probe() -> int:
        return len([1])

    previous = sys.gettrace()
    reenable_tracing()
    sys.settrace(on_call)
    try:
        probe()
    finally:
        sys.settrace(previous)
    return count > 0


def require_opcode_tracing() -> None:
    """Skip the calling test where ``settrace`` gets no opcode events (CPython 3.12.1 sends
    none; 3.11 and 3.13 do): it could not stop at any switch point."""
    if not _opcode_events_arrive():
        pytest.skip(f"Python {sys.version.split()[0]} sends sys.settrace no opcode events")


def at_each_switch_point(run: Callable[[], None], at: Callable[[int], None], /, *,
                         within: CodeType | None = None) -> int:
    """Run ``run()``, calling ``at(i)`` between every two bytecodes of each Python frame it
    runs (``i`` counts them from 0); returns how many there were. With ``within``, only of the
    frames running that code and what they call (a ``__del__`` the garbage collector runs, say).
    Tracing is off inside ``at`` (CPython does not trace a trace function): it runs as another
    thread would, between two of ours."""
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            at(count)
            count += 1
            reenable_tracing()  # ``at`` ran code untraced
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if within is not None:
            caller = frame
            while caller is not None and caller.f_code is not within:
                caller = caller.f_back
            if caller is None:
                return None
        # f_trace first: Python 3.13 switches a code's opcode events on when f_trace_opcodes is
        # set on a frame that already has its f_trace (3.11 also traces through the local
        # function returned here); CPython 3.12.1 sends none either way.
        frame.f_trace = local
        frame.f_trace_opcodes = True
        return local

    require_opcode_tracing()
    previous = sys.gettrace()
    reenable_tracing()
    sys.settrace(on_call)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count
