"""Which of a model's module calls were already running when an ``ActivationCensus`` was
entered: read from the entering thread's frames (NOTE [entered inside])."""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

from torch import nn

__all__ = ["running_module", "running_modules"]

# NOTE [entered inside]: a census learns which module runs from its forward pre-hooks and
# forward hooks, registered when it is entered. Entered inside the model's forward (a
# framework measuring part of a model, a profiler's pre-hook), it never saw the pre-hooks of the
# modules already running: their own saves were filed as outside any module. Those are known
# from the entering thread's frames: each running module call has a frame of
# ``nn.Module._call_impl`` whose ``self`` is the module (a call that bypasses ``__call__``
# runs no hooks either, and is no module call to the census in any case). They are not pushed
# onto the stack: a module called without hooks (none were registered when it was called)
# never runs the census's forward hook that would pop it. So a save made while no module
# entered since is running looks them up among the frames running then, innermost first: the
# cost is the frame walk of such saves only, in a census entered inside a module only. Other
# threads (autograd's, NOTE [where a census records] in census_threads.py) have no frames of
# those calls.
_CALL_IMPL = nn.Module._call_impl.__code__


def running_modules(paths: dict[int, Any]) -> list[int]:
    """The ids (keys of ``paths``) of the modules whose calls run in this thread's frames."""
    found = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        # Reading f_locals of a running frame snapshots its locals into a dict that goes with
        # the frame (Python < 3.13): references the call holds anyway while it runs.
        if frame.f_code is _CALL_IMPL:
            key = id(frame.f_locals.get("self"))
            if key in paths:
                found.append(key)
        frame = frame.f_back
    return found


def running_module(running: dict[int, tuple[weakref.ref[nn.Module], str]]) -> str:
    """The innermost of ``running`` whose call is still running here, or outside any module."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            known = running.get(id(module))
            if known is not None and known[0]() is module:
                return known[1]
        frame = frame.f_back
    return "<outside any module>"
