"""Forced interleavings for the thread tests: what another thread could do at each point where
CPython may switch threads (between two bytecodes), done there, deterministically."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType
from typing import Any


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
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if within is not None:
            caller = frame
            while caller is not None and caller.f_code is not within:
                caller = caller.f_back
            if caller is None:
                return None
        frame.f_trace_opcodes = True
        return local

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count
