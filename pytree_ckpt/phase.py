"""The explicit phase of the checkpoint boundary.

NOTE [phase is state, not grad mode]: which pass is running is recorded by the boundary itself
in a ``ContextVar`` stack of active invocations, one entry per boundary call being executed. It
is never inferred from ``torch.is_grad_enabled()``: user code may enable grad inside an original
pass, and a replay may run with grad disabled regions. A ``ContextVar`` keeps two threads (and
two asyncio tasks) from seeing each other's invocations.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch

from .eager import PHASE_REASON, runs_eagerly

if TYPE_CHECKING:
    from .frames import Frame

__all__ = ["Invocation", "Phase", "current_phase", "outside_inference_mode"]


class Phase(str, enum.Enum):
    """Where code is running relative to checkpoint boundaries (compares equal to its value)."""

    PLAIN = "plain"          # outside every boundary
    FORWARD = "forward"      # the original pass of a boundary (grad disabled)
    RECOMPUTE = "recompute"  # the replay of a boundary during backward (grad enabled)

    def __str__(self) -> str:
        return self.value


class Invocation:
    """One boundary call being executed: its phase and its replay frame."""

    __slots__ = ("phase", "frame", "parent", "discarded")

    def __init__(self, phase: Phase, frame: Frame, parent: Invocation | None, /) -> None:
        self.phase = phase
        self.frame = frame
        self.parent = parent
        # An output discard was made inside it (NOTE [a replay kept between restricted
        # backwards] in kept_replay.py: such a replay's graph is one-shot).
        self.discarded = False


# The innermost active invocation; each one links to its enclosing invocation.
ACTIVE: ContextVar[Invocation | None] = ContextVar("pytree_ckpt_active_invocation", default=None)

# NOTE [a discard's rebuild opens no window]: an output discard rebuilds its output in backward
# (discard.py ``_replay``), outside every boundary pass (``ACTIVE`` unset there: its phase, as
# ``current_phase()`` reads it, is the caller's). What a checkpointed block or a window() of the
# user's own saves there is read back by the rebuild's own backward at once: an offload window
# would copy it to host and straight back, and turn its manager's pass (helper KY). Set while
# a rebuild runs; read where a window would open (boundary.py, offload's eager_window).
REBUILDING: ContextVar[bool] = ContextVar("pytree_ckpt_discard_rebuilding", default=False)


@contextmanager
def rebuilding() -> Iterator[None]:
    """Within: an output discard's rebuild runs (NOTE [a discard's rebuild opens no window])."""
    outer = REBUILDING.get()
    try:
        REBUILDING.set(True)  # NOTE [context variables set inside the try] (keep.py)
        yield
    finally:
        REBUILDING.set(outer)


def current_phase() -> Phase:
    """The phase of the innermost active boundary: ``"plain"``, ``"forward"`` or ``"recompute"``."""
    if _is_compiling():
        if _is_exporting():  # no boundary is built while torch.export records (boundary.py)
            return Phase.PLAIN
        # Opaque to dynamo, with the reason, where it traces: a fullgraph body failed with
        # dynamo's bare "does not know how to trace method get of class ContextVar" and a
        # plea to report it. Not in eager, where the opaque wrapper would cost about 3 us.
        return _phase_opaque()
    return _phase()


def _phase() -> Phase:
    invocation = ACTIVE.get()
    return Phase.PLAIN if invocation is None else invocation.phase


_phase_opaque = runs_eagerly(PHASE_REASON)(_phase)
_is_compiling = torch.compiler.is_compiling
_is_exporting = torch.compiler.is_exporting


@contextmanager
def outside_inference_mode() -> Iterator[None]:
    """NOTE [a backward run under inference mode]: eager's ``loss.backward()`` called inside
    ``torch.inference_mode()`` computes every gradient (autograd's engine runs the recorded
    graph whatever the mode); a replay run so recorded no graph, so the layer's parameters
    and everything before it got ``None``, silently, and offload's unpacking raised on
    inference tensors (helper NW). A boundary's backward and a discard's rebuild run outside
    inference mode, in the grad mode they were called in (a ``create_graph`` backward's on)."""
    grad = torch.is_grad_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(grad):
        yield
