"""Notes on errors raised by others (torch, dynamo, the user's forward) inside a boundary: what
the boundary was doing and a tip, added without changing the error's type or message."""

from __future__ import annotations

import logging

__all__ = ["add_note"]

_LOG = logging.getLogger(__name__)

# NOTE [notes on Python 3.10]: ``BaseException.add_note`` is Python 3.11+ (PEP 678). On 3.10
# the note is appended to ``__notes__`` as PEP 678 defines it (pytest and the exceptiongroup
# backport's tracebacks show it; the boundary's own checks for an inner boundary's note read
# it), and logged as a warning, because 3.10's own traceback printing ignores ``__notes__``: the
# tip would otherwise reach no one.
_NATIVE = hasattr(BaseException, "add_note")


def add_note(error: BaseException, note: str, /) -> None:
    """Add ``note`` to ``error``, shown under its traceback (logged as well on Python 3.10)."""
    if _NATIVE:
        error.add_note(note)
        return
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        error.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)
    # A string, not the error, in the record: a handler that keeps records (pytest's, a
    # memory handler) would keep the error's traceback, and with it the step's tensors.
    _LOG.warning("%s", f"{type(error).__name__}: {error}\n{note}")
