"""The plain values a call's forward sets on its modules (numbers, flags, keys), put back as the
forward began for the replay: NOTE [numbers and flags as the forward began].

Buffers the forward changes are ``state_changes.py``'s; the modes and entries of the modules,
``forward_modules.py``'s; the warning for a number changed again where nothing was saved,
``stored_state.py``'s.
"""

from __future__ import annotations

import collections
import copy
import enum
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .module_state import ModuleDicts
from .stored_state import value_differs

__all__ = ["ChangedNumbers", "NumbersWatch", "numbers_read"]

# Values that cannot change in place, by exact type (a subclass may carry state); also enum
# members, tuples of such values (a shape key) and NumPy scalars (_immutable).
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype,
                    torch.device})

# Not the forward's own state: nn.Module's bookkeeping (its hook flags are torch's; but its
# training flag, which a forward may switch: forward_modules.py puts back the modes the forward
# left), and this library's marks.
_NOT_STATE = frozenset(nn.Module().__dict__) - {"training"}
_OURS = "_pytree_ckpt"

# Containers of such values read by their contents (a count per expert, a set of lengths seen),
# by exact type; up to _MOST_ENTRIES entries, so that a read stays a small copy (a history
# that grows every step is left alone once past it).
_CONTAINERS = frozenset({list, dict, set, collections.defaultdict, collections.Counter,
                         collections.OrderedDict})
_MOST_ENTRIES = 64


def _immutable(value: Any, /, depth: int = 0) -> bool:
    kind = type(value)
    if kind in _PLAIN or isinstance(value, enum.Enum):
        return True
    if kind is tuple:
        return depth < 4 and all(_immutable(v, depth + 1) for v in value)
    # A NumPy scalar (np.bool_, np.float32; an array is unhashable), without importing NumPy.
    return kind.__module__ == "numpy" and getattr(kind, "__hash__", None) is not None


class _Absent:
    """A name the forward set that was not there when it began: the replay runs without it."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


class _Contents:
    """A container of values that cannot change in place (``_CONTAINERS``), with a copy of its
    entries: equal to another only for the same container with equal entries, so a count
    changed in place is seen as a change of the container's entries."""

    __slots__ = ("held", "entries")

    def __init__(self, held: Any, /) -> None:
        self.held = held
        self.entries = _entries(held)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Contents and other.held is self.held and \
            other.entries == self.entries

    __hash__ = None  # type: ignore[assignment]

    def fresh(self) -> Any:
        """A new container of the held one's kind with the entries read (for a name the
        forward rebound or deleted: the replay must not change the object read)."""
        made = copy.copy(self.held)
        _put(made, self.entries)
        return made


def _entries(held: Any, /) -> Any:
    """A copy of a container's entries: a list, a set or a plain dict."""
    kind = type(held)
    return list(held) if kind is list else set(held) if kind is set else dict(held)


def _put(held: Any, entries: Any, /) -> None:
    """``held`` given ``entries`` in place."""
    if type(held) is list:
        held[:] = entries
    else:  # a set or a dict of any kind; cleared first, so a Counter's update sets too
        held.clear()
        held.update(entries)


def _plain_container(value: Any, /) -> bool:
    if type(value) not in _CONTAINERS or len(value) > _MOST_ENTRIES:
        return False
    if isinstance(value, dict):
        return all(map(_immutable, value)) and all(map(_immutable, value.values()))
    return all(map(_immutable, value))


class NumbersWatch:
    """NOTE [numbers and flags as the forward began]: a forward may set plain values on its
    modules that decide what it computes: the length a rotary cache was built for (``if
    seq_len > self.max_seq_len_cached: rebuild``, transformers' older rotary modules), a flag
    keying a lazy registration (``if not self.ready: self.register_buffer(...); self.ready =
    True``), a call count, a shape a mask was built for. Eager runs the forward once; the
    replay runs it again, and read as the forward left them, those values make it decide
    otherwise: the rotary replay sliced the old, shorter table (its buffer is put back as the
    forward began: NOTE [the replay changes copies] in state_changes.py) and backward failed
    with a size mismatch; the flag skipped the registration the replay needed; a count ended a
    step ahead.

    So the boundary (and output discard) reads the entries of its modules' ``__dict__`` before
    a forward (the training flag too: a forward that switches a warm-up dropout off replays
    with it on, as it ran): those holding a value that cannot change in place
    (``_immutable``: an int, float, bool, str, None, an enum member, a ``torch.Size`` or a
    tuple of such, a NumPy scalar) by value, a small container of such values (a list, dict,
    set, defaultdict, Counter or OrderedDict of at most 64 entries: a count per expert, the
    lengths seen) by its entries, tensors by weak reference, others by id. Those the forward
    set anew, deleted, or changed from such a value (to another value or to an object: a
    number replaced by a tensor) are put back as the forward began for the replay, and get
    what they held when the replay began back after it (a later micro-batch's forward, or the
    caller, may have changed them since). A container is the same object throughout: one
    changed in place gets its entries put back, in place, and its entries at the replay's
    start back after it (so entries only the replay adds, a log it appends to, are dropped,
    as eager never made them); one the forward rebound or deleted is put back as a new
    container holding the entries read (the object read may have other holders, and stays as
    it is). Those holding another object that the
    forward rebound (a cache kept as a plain tensor attribute, rebuilt with its length; a
    tensor it consumed, set to None) are read by the replay as they are (no tensor is held
    from the forward to the replay), and after the replay, one the replay rebound again gets
    back what it held when the replay began: otherwise an earlier micro-batch's replay, run
    last, left its shorter rebuild paired with the later micro-batch's length (a table
    computed from a parameter too), or its stored output in place of the last one's. A leaf
    requiring grad that the replay stored stays, for the made-leaf check to refuse. One only
    the replay changes keeps its change, as for buffers.

    Read at a module's first calls until its first replay and at every call once a forward of
    it changed state (``snapshots_wanted``), for all of a call's modules; at other calls, for
    those holding buffers (their forward may rebuild them with the number that decides it, at
    any step). A change makes the module stateful. Not read: containers of more than 64
    entries, or holding anything else (a tensor, a nested list), ``__slots__``, a number first
    changed after the module's first
    replay in a module with no buffer (changed twice, warned only at a first replay with a new
    switch: ``warn_changed_numbers``). Not put back for a call whose forward changed a
    trainable parameter in place (a one-time initialisation keyed on a flag, ActNorm's): the
    replay must not redo what copies cannot undo, so it reads the flag as the forward left it,
    as eager's parameters are.

    Cost: two reads of each such module's ``__dict__`` around the forward, compared in C when
    nothing changed; under callgrind (PYTHONHASHSEED=0, 200 calls and backwards), 45,000
    instructions a call for a layer with one module holding a buffer, 3.2% of a 16-wide
    Linear, LayerNorm and rotary table's call and backward (1.39M: microseconds against a
    real layer's milliseconds), and 192 (0.02%) for a layer without buffers after its first
    replay; a small container adds a copy of its entries to each read (reading them by entry
    left the rotary layer's count unchanged within 0.3%).
    """

    __slots__ = ("dicts", "before")

    def __init__(self, dicts: Sequence[dict[str, Any]], /) -> None:
        self.dicts = dicts
        self.before = [_read(d) for d in dicts]

    def changed(self) -> ChangedNumbers | None:
        """The entries the forward changed, each with what it held before the forward;
        ``None`` when it changed none."""
        found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = []
        for d, before in zip(self.dicts, self.before):
            now = _read(d)
            if now == before:  # the usual case: one C-level comparison
                continue
            values: list[tuple[str, Any]] = []
            rebound: list[str] = []
            for name, entry in now.items():
                was = before.get(name)
                if was is None:
                    values.append((name, _ABSENT))  # set anew: the replay runs without it
                elif was[0]:
                    if not entry[0] or value_differs(entry[1], was[1]):
                        values.append((name, was[1]))  # a value changed, or replaced
                elif entry != was:
                    if type(was[1]) is _Contents:  # its entries changed, or it was rebound
                        values.append((name, was[1]))
                    else:
                        rebound.append(name)  # an object rebound (or consumed): read as it is
            for name, was in before.items():
                if name not in now:  # deleted by the forward
                    if was[0] or type(was[1]) is _Contents:
                        values.append((name, was[1]))
                    else:
                        rebound.append(name)
            if values or rebound:
                found.append((d, values, rebound))
        return ChangedNumbers(found) if found else None


def numbers_read(roots: Sequence[nn.Module], trees: Sequence[ModuleDicts], /, *, every: bool
                 ) -> list[dict[str, Any]]:
    """The ``__dict__`` of each module of ``roots``' trees (``trees``: their dicts), or with
    ``every`` false only of those holding buffers."""
    if every:
        return [*(m.__dict__ for m in roots), *(d for tree in trees for d in tree.submodules)]
    return [d for root, tree in zip(roots, trees)
            for d, buffers in zip((root.__dict__, *tree.submodules), tree.buffers) if buffers]


class _TensorHeld:
    """A tensor attribute, by weak reference: equal to another only while both refer to the
    same live tensor. Not by id: a cache dropped before its rebuild (`self.table = None;
    self.table = build(n)`) is freed, and the new one may take its address."""

    __slots__ = ("ref",)

    def __init__(self, tensor: torch.Tensor, /) -> None:
        self.ref = weakref.ref(tensor)

    def __eq__(self, other: object) -> bool:
        return type(other) is _TensorHeld and (held := self.ref()) is not None and \
            held is other.ref()

    __hash__ = None  # type: ignore[assignment]


def _read(d: dict[str, Any], /) -> dict[str, tuple[bool, Any]]:
    """By name: (True, the value) for a value that cannot change in place, (False, a weak
    reference) for a tensor, (False, its entries) for a small container of such values,
    (False, its id) for another object. nn.Module's own entries are
    left out by one set difference (a module's ``__dict__`` holds about 17 of them and a few
    of its own)."""
    found: dict[str, tuple[bool, Any]] = {}
    for name in d.keys() - _NOT_STATE:
        if not name.startswith(_OURS):
            value = d[name]
            found[name] = (True, value) if type(value) in _PLAIN or _immutable(value) else \
                (False, _TensorHeld(value) if isinstance(value, torch.Tensor) else
                 _Contents(value) if _plain_container(value) else id(value))
    return found


class ChangedNumbers:
    """What a forward changed of its modules' plain values and attributes (NOTE [numbers and
    flags as the forward began]), for its replay."""

    __slots__ = ("found",)

    def __init__(self, found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]],
                 /) -> None:
        self.found = found

    @contextmanager
    def as_forward_began(self) -> Iterator[None]:
        """The changed values as the forward began, for the block; the values, and the objects
        the forward rebound, as the block began, after it."""
        at_start = [(d, [(name, d.get(name, _ABSENT))
                         for name in [*(name for name, _ in values), *rebound]])
                    for d, values, rebound in self.found]
        # A container the forward changed in place also gets its entries back after the block
        # (the object is the same, so putting it back as an object would not).
        entries_at_start = [(held, _entries(held)) for d, values, _ in self.found
                            for name, value in values if type(value) is _Contents
                            if d.get(name) is (held := value.held)]
        for d, values, _ in self.found:
            _set(d, values)
        try:
            yield
        finally:
            for held, entries in entries_at_start:
                _put(held, entries)
            for d, named in at_start:
                # A leaf requiring grad that the replay stored stays (`self.last = leaf`, made
                # in the forward): the check that reads it once the replay's graph is gone
                # (NOTE [leaves the call makes] in refusals.py) must find it held, and refuse.
                _set(d, [(name, value) for name, value in named
                         if not (isinstance(now := d.get(name), torch.Tensor) and
                                 now.requires_grad and now.grad_fn is None)])


def _set(d: dict[str, Any], named: list[tuple[str, Any]], /) -> None:
    for name, value in named:
        if value is _ABSENT:
            d.pop(name, None)
        elif type(value) is _Contents:
            if d.get(name) is value.held:  # changed in place: its entries as they were read
                _put(value.held, value.entries)
            else:  # rebound or deleted: a new one, so the object read is not changed
                d[name] = value.fresh()
        else:
            d[name] = value
