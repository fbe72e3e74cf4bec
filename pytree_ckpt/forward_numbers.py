"""The plain numbers and flags a call's forward sets on its modules, put back as the forward
began for the replay: NOTE [numbers and flags as the forward began].

Buffers the forward changes are ``state_changes.py``'s; the modes and entries of the modules,
``forward_modules.py``'s; the warning for a number changed again where nothing was saved,
``stored_state.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from .stored_state import value_differs

__all__ = ["ChangedNumbers", "NumbersWatch"]

# What counts as a plain number or flag: exact types (a subclass, an enum, may carry state).
_PLAIN = frozenset({int, float, bool, str, type(None)})

# Not the forward's own state: nn.Module's bookkeeping (its training flag is put back by
# forward_modules.py, its hook flags are torch's), and this library's marks.
_NOT_STATE = frozenset(nn.Module().__dict__)
_OURS = "_pytree_ckpt"


class _Absent:
    """A name the forward set that was not there when it began: the replay runs without it."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


def _plain(d: dict[str, Any], /) -> dict[str, Any]:
    return {name: value for name, value in d.items()
            if type(value) in _PLAIN and name not in _NOT_STATE and not name.startswith(_OURS)}


class NumbersWatch:
    """NOTE [numbers and flags as the forward began]: a forward may set plain attributes on its
    modules (an int, float, bool, str or None in a module's ``__dict__``) that decide what it
    computes: the length a rotary cache was built for (``if seq_len >
    self.max_seq_len_cached: rebuild``, transformers' older rotary modules), a flag keying a
    lazy registration (``if not self.ready: self.register_buffer(...); self.ready = True``), a
    call count. Eager runs the forward once; the replay runs it again, and read as the forward
    left them, those attributes make it decide otherwise: the rotary replay sliced the old,
    shorter table (the buffer is put back as the forward began: NOTE [the replay changes
    copies] in state_changes.py) and backward failed with a size mismatch; the flag skipped
    the registration the replay needed; a count ended a step ahead.

    So where the boundary saves small state before a forward (``snapshots_wanted``: a module's
    first calls, until its first replay, and every call once a forward of it changed state),
    it saves these attributes too, and those the forward changed, set or deleted are put back
    as it began for the replay, and get the values they had when the replay began back after
    it (a later micro-batch's forward may have changed them since). One that held or now
    holds something else (a tensor cache set where None was) is not touched, nor is one only
    the replay changes (its change stays, as for buffers). A change makes the module
    stateful, so its later calls save them too. A module whose forward first changes one
    after its first replay has nothing saved: its replay reads the value the forward left
    (warned of at a first replay, ``warn_changed_numbers``; documented).

    Cost: a pass over each module's ``__dict__`` before and after such a forward (about 1 us
    per module); nothing at other calls.
    """

    __slots__ = ("dicts", "before", "names")

    def __init__(self, dicts: Sequence[dict[str, Any]], /) -> None:
        self.dicts = dicts
        self.before = [_plain(d) for d in dicts]
        self.names = [set(d) for d in dicts]  # a name set anew was absent, not a tensor

    def changed(self) -> ChangedNumbers | None:
        """The attributes the forward changed, set anew or deleted, each with its value before
        the forward; ``None`` when it changed none."""
        found: list[tuple[dict[str, Any], list[tuple[str, Any]]]] = []
        for d, before, names in zip(self.dicts, self.before, self.names):
            moved = [(name, before[name] if name in before else _ABSENT)
                     for name, value in _plain(d).items()
                     if name in before and value_differs(value, before[name])
                     or name not in names]
            moved += [(name, value) for name, value in before.items()
                      if name not in d]  # deleted by the forward (a one-time setting)
            if moved:
                found.append((d, moved))
        return ChangedNumbers(found) if found else None


class ChangedNumbers:
    """What a forward changed of its modules' plain attributes (NOTE [numbers and flags as the
    forward began]), for its replay."""

    __slots__ = ("found",)

    def __init__(self, found: list[tuple[dict[str, Any], list[tuple[str, Any]]]], /) -> None:
        self.found = found

    def names(self) -> list[str]:
        return [name for _, moved in self.found for name, _ in moved]

    @contextmanager
    def as_forward_began(self) -> Iterator[None]:
        """The changed attributes as the forward began, for the block; as the block began
        after it. A name holding something else by then (a tensor) is left alone."""
        found = [(d, [(name, value) for name, value in moved
                      if name not in d or type(d[name]) in _PLAIN]) for d, moved in self.found]
        at_start = [(d, [(name, d.get(name, _ABSENT)) for name, _ in moved])
                    for d, moved in found]
        for d, moved in found:
            _set(d, moved)
        try:
            yield
        finally:
            for d, values in at_start:
                _set(d, values)


def _set(d: dict[str, Any], values: list[tuple[str, Any]], /) -> None:
    for name, value in values:
        if value is _ABSENT:
            d.pop(name, None)
        else:
            d[name] = value
