"""The plain values a call's forward sets on its modules (numbers, flags, keys), put back as the
forward began for the replay: NOTE [numbers and flags as the forward began].

Buffers the forward changes are ``state_changes.py``'s; the modes and entries of the modules,
``forward_modules.py``'s; the warning for a number changed again where nothing was saved,
``stored_state.py``'s.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import enum
import functools
import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .eager import user_stacklevel
from .function_reach import unwrap_partials
from .module_state import ModuleDicts, torch_nn_class
from .state_changes import REPLAY_COPY_MARK
from .tree import dunder, instance_dict

__all__ = ["ArgumentContents", "ChangedNumbers", "MadeContents", "MadeNumbers", "NumbersGlance",
           "NumbersWatch", "argument_contents", "glanced_dicts", "numbers_read", "plain_entries",
           "value_differs", "with_reused_calls"]

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
                         collections.OrderedDict, collections.deque})
_MOST_ENTRIES = 64


def _immutable(value: Any, /, depth: int = 0) -> bool:
    kind = type(value)
    if kind in _PLAIN or isinstance(value, enum.Enum):
        return True
    if kind is tuple:
        return depth < 4 and all(_immutable(v, depth + 1) for v in value)
    # A NumPy scalar (np.bool_, np.float32; an array is unhashable), without importing NumPy.
    return kind.__module__ == "numpy" and dunder(kind, "__hash__") is not None


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

    def __init__(self, held: Any, /, entries: Any = None) -> None:
        self.held = held
        self.entries = _entries(held) if entries is None else entries

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


# NOTE [what the replay writes into is put back after it]: the replay makes again what a
# skipped reused call left by writing into the objects it bound or filled (the call's own:
# eager's objects, which others may hold too: a router's shared namespace, a trainer's log of
# records, helper HS), so each such object gets what it held when the replay began back once
# the replay is done (``as_forward_began`` runs these, last written first).
_AFTER_REPLAY: contextvars.ContextVar[list[tuple[Any, Any]] | None] = \
    contextvars.ContextVar("pytree_ckpt_after_replay", default=None)


def _restore_after_replay(held: Any, /) -> bool:
    """Whether ``held`` gets what it holds now back after the replay (``False`` where no
    replay's put-back runs, or for an object with nothing to snapshot)."""
    pending = _AFTER_REPLAY.get()
    if pending is not None and (snapshot := _snapshot(held)) is not None:
        pending.append((held, snapshot))
        return True
    return False


class _Object:
    """An object a reused call bound on its module, or changed in place (NOTE [an object a
    reused call leaves where a value was]), and what it held as the call left it (``_snapshot``:
    ``None`` for an object with nothing to snapshot, bound as it is)."""

    __slots__ = ("held", "entries")

    def __init__(self, held: Any, /) -> None:
        self.held = held
        self.entries = _snapshot(held)

    def put_back(self) -> None:
        """The object with what it held when the call left it (the rest of the forward may
        have added to it: a projection memoised there, helpers HL, HR)."""
        if self.entries is not None:
            _put(self.held, self.entries)


def _snapshot(held: Any, /) -> Any:
    """What ``_Object.put_back`` restores (``_entries``): a dict's, list's or set's entries
    (subclasses too), else the attributes in the object's ``__dict__``; ``None`` for anything
    else (slots, a tensor, a module: rebound as it is)."""
    if isinstance(held, (torch.Tensor, nn.Module)) or \
            not isinstance(held, (dict, list, set, collections.deque)) and \
            type(instance_dict(held)) is not dict:
        return None
    return _entries(held)


class _Refilled:
    """A container read by its entries that the forward filled in place with something else
    (tensors it collects, a cache of projections): its entries as read are put back for the
    replay all the same (a cache the caller empties each step must be empty there, or the
    replay reuses the original pass's tensor, which has no gradient), but the container is
    known by id and type only, so the tensors it holds are not kept alive until the replay
    once the caller lets go of it. A container the caller put in its place since is left as
    it is: the replay gets a new one with the entries read, and the caller's after it (helper
    HR: the caller's fresh dict was filled by the replay). (An id reused by a container the
    caller put in its place gets the entries read during the replay, and its own back after
    it.)"""

    __slots__ = ("ident", "kind", "entries", "factory", "maxlen")

    def __init__(self, contents: _Contents, /) -> None:
        self.ident, self.kind = id(contents.held), type(contents.held)
        self.entries = contents.entries
        self.factory = getattr(contents.held, "default_factory", None)  # a defaultdict's
        self.maxlen = getattr(contents.held, "maxlen", None)  # a deque's

    def holds(self, held: Any, /) -> bool:
        return id(held) == self.ident and type(held) is self.kind

    def fresh(self) -> Any:
        """A new container of the kind read, with the entries read: for a name the caller
        rebound since (the replay must not change the caller's object, and must start from
        what the forward read: helper HR)."""
        made = self.kind(self.factory) if self.kind is collections.defaultdict else \
            collections.deque(maxlen=self.maxlen) if self.kind is collections.deque else \
            self.kind()
        _put(made, self.entries)
        return made


def _entries(held: Any, /) -> Any:
    """A copy of a container's entries: a list, a deque (as a list), a set, or a dict's items
    in their order (a round robin that only moves an entry to the end, ``move_to_end``,
    changes the order); of another object (a reused call's watch reads plain objects too:
    ``_Mixed``), the items of its ``__dict__``."""
    if isinstance(held, (list, collections.deque)):  # a window of recent loads (helper HZ)
        return list(held)
    if isinstance(held, set):
        return set(held)
    if isinstance(held, dict):
        return list(held.items())
    return list(instance_dict(held).items())


def _put(held: Any, entries: Any, /) -> None:
    """``held`` given ``entries`` in place."""
    if isinstance(held, list):
        held[:] = entries
    elif isinstance(held, collections.deque):  # in place: its maxlen stays
        held.clear()
        held.extend(entries)
    elif isinstance(held, set):
        held.clear()
        held.update(entries)
    elif isinstance(held, dict):  # each kind's own item assignment (a Counter's update
        held.clear()              # would add counts)
        for key, value in entries:
            held[key] = value
    else:  # a plain object's attributes
        own = instance_dict(held)
        own.clear()
        own.update(entries)


def plain_entries(value: Any, /) -> Any:
    """A copy of the entries of a small container of plain values (NOTE [numbers and flags as
    the forward began]), ``None`` for anything else: for the 'changed again' warning."""
    return _entries(value) if _plain_container(value) else None


def value_differs(now: Any, before: Any) -> bool:
    """By value (``self.seq_len = x.shape[1]`` stores an equal new int each call), NaN
    equal to NaN; another type (a tensor where a number was) differs."""
    if type(now) is not type(before):
        return True
    return bool(now != before) and not (now != now and before != before)


def _plain_container(value: Any, /, most: float = _MOST_ENTRIES) -> bool:
    if type(value) not in _CONTAINERS or len(value) > most:
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
    set, defaultdict, Counter, OrderedDict or deque of at most 64 entries: a count per expert,
    the lengths seen, a window of recent loads) by its entries, tensors by weak reference,
    others by id. Those the forward set anew, deleted, or changed from such a value (to
    another value or to an object: a number replaced by a tensor) are put back as the forward
    began for the replay, and get what they held when the replay began back after it (a
    later micro-batch's forward, or the caller, may have changed them since). A container is the
    same object throughout: one changed in place (a dict's order too: a round robin's
    ``move_to_end``) gets its entries put back, in place, and its entries at the replay's start back
    after it (so entries only the replay adds, a log it appends to, are dropped, as eager never made
    them; but a dict's key only the replay changes: NOTE [a key only the replay changes]); one the
    forward rebound or deleted is put back as a new container holding the entries
    read (the object read may have other holders, and stays as it is). One the forward filled in
    place with anything else (tensors it collects, a cache of projections the caller empties each
    step) gets its entries put back all the same, but is known by id only (``_Refilled``): held
    until the replay, it would keep those tensors alive after the caller let go of it.
    Those holding another object that the
    forward rebound (a cache kept as a plain tensor attribute, rebuilt with its length; a
    tensor it consumed, set to None) are read by the replay as they are (no tensor over 64
    KiB is held from the forward to the replay; a smaller one without a graph is put back:
    NOTE [small tensor attributes as the forward read them]), and after the replay, one the
    replay rebound again gets
    back what it held when the replay began: otherwise an earlier micro-batch's replay, run
    last, left its shorter rebuild paired with the later micro-batch's length (a table
    computed from a parameter too), or its stored output in place of the last one's. A leaf
    requiring grad that the replay stored stays, for the made-leaf check to refuse. One only
    the replay changes keeps its change, as for buffers.

    Read at a module's first calls until its first replay and at every call once a forward of
    it changed state (``snapshots_wanted``), for all of a call's modules; at other calls, for
    those holding buffers (their forward may rebuild them with the number that decides it, at
    any step). A change makes the module stateful. Not read: containers of more than 64
    entries (one growing past 64 in the forward is still put back), or holding anything else
    before the forward (a tensor, a nested list), ``__slots__``, a small container first
    changed in place after the module's first replay in a module with no buffer (changed
    twice, warned only at a first replay with a new switch: ``warn_changed_numbers``); a
    number first changed then is seen by a glance (NOTE [a number first changed after the
    first replay]). Not put back for a call whose forward changed a
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

    def __init__(self, dicts: Sequence[dict[str, Any]], /, *, clone: bool = False,
                 mixed: bool = False) -> None:
        # ``clone``: the small tensor attributes' values are cloned too (NOTE [small tensor
        # attributes as the forward read them]), where small buffers are (snapshots_wanted).
        # ``mixed``: a reused call's watch (made()) reads small containers holding anything by
        # their entries too (NOTE [an object a reused call leaves where a value was]).
        self.dicts = dicts
        # One clone per tensor: submodules holding one tensor (a step count they share) read
        # one copy in the replay, as they read one tensor in the forward (helper FG).
        clones: dict[int, torch.Tensor] | None = {} if clone else None
        self.before = [_read(d, clones, mixed=mixed) for d in dicts]

    def changed(self) -> ChangedNumbers | None:
        """The entries the forward changed, each with what it held before the forward;
        ``None`` when it changed none."""
        found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = []
        ends: dict[int, Any] = {}  # NOTE [a key only the replay changes]
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
                    if type(was[1]) is _TensorHeld and (kept := was[1].as_read()) is not None:
                        # NOTE [small tensor attributes as the forward read them]
                        values.append((name, kept))
                    elif type(was[1]) is not _Contents:
                        rebound.append(name)  # an object rebound (or consumed): read as it is
                    elif type(entry[1]) is _Contents or d[name] is not was[1].held or \
                            _plain_container(d[name], most=float("inf")):
                        values.append((name, was[1]))  # its entries changed, or rebound
                        if type(entry[1]) is _Contents and entry[1].held is was[1].held:
                            ends[id(was[1])] = entry[1].entries  # as the forward left it
                    else:  # filled in place with something else (tensors): not held
                        values.append((name, _Refilled(was[1])))
            for name, was in before.items():
                if name not in now:  # deleted by the forward
                    if was[0] or type(was[1]) is _Contents:
                        values.append((name, was[1]))
                    elif type(was[1]) is _TensorHeld and (kept := was[1].as_read()) is not None:
                        values.append((name, kept))
                    else:
                        rebound.append(name)
            if values or rebound:
                found.append((d, values, rebound))
        return ChangedNumbers(found, ends=ends) if found else None

    def made(self) -> MadeNumbers | None:
        """What the call changed of the values and small containers of the one ``__dict__``
        read (NOTE [state a reused call changes] in frozen.py); ``None`` when nothing."""
        d, before = self.dicts[0], self.before[0]
        now = _read(d, mixed=True)
        if now == before:
            return None
        made: list[tuple[str, Any, Any]] = []
        for name in [*before, *(name for name in now if name not in before)]:
            was, entry = before.get(name), now.get(name)
            if entry == was:
                continue
            if entry is not None and not _plain_entry(entry) and \
                    type(entry[1]) is not _TensorHeld:
                # NOTE [an object a reused call leaves where a value was]: the replay skips
                # the call, so it must be given what the call left (helper HI: a count beside
                # logged ids read 0 where eager read 1; a cache the caller empties each step
                # raised): an object the call bound (`self.cache = {"ids": ids}`) is bound
                # again in the replay, with what it held when the call left it (a container's
                # entries, another object's attributes: the rest of the forward may add to
                # it, a projection memoised there, which the replay must compute with its
                # graph, helpers HL, HR), whatever was there (an object, or a container
                # holding tensors, is not put back as the forward began: it held the last
                # call's, helper HP); a container the call filled in place gets those entries
                # where the name holds what the call found (read by entries, a tensor by
                # identity: `_Mixed` in a reused call's watch): in place where it is the
                # call's own container, else in a new one (the caller's, put there since, is
                # left as they changed it: helpers HP, HR). So the next call of the same
                # forward finds what the last one left (a router called once per chunk,
                # helper HL). A plain object the call changes in place (a namespace a router
                # counts in) is read by its attributes, as such a container. What the replay
                # writes into gets what it held when the replay began back after it (NOTE
                # [what the replay writes into is put back after it]). Read one level deep:
                # a tensor memoised deeper, in slots, or as a dict subclass's attribute is not
                # put back (documented). Held from the call to the replay: the object and what
                # it held.
                value = d[name]
                filled = was is not None and type(was[1]) in (_Contents, _Mixed) and \
                    was[1].held is value
                made.append((name, was, _Contents(value) if filled and
                             type(value) in _CONTAINERS else _Object(value)))
                continue
            if was is not None and not _plain_entry(was):
                continue  # an object before: read as it is (the forward's put-back skips it)
            if was is not None and entry is not None and type(was[1]) is _TensorHeld and \
                    type(entry[1]) is _TensorHeld and \
                    (tensor := entry[1].ref()) is not None and tensor is was[1].ref():
                # A small tensor attribute the call changed in place (DeepSeek-V3's token
                # count per expert kept as a plain attribute: `self.counts += bincount(ids)`,
                # helper HV): the replay reads its own copy of the values the forward began
                # with (NOTE [small tensor attributes as the forward read them]), and gets the
                # call's values written into that copy; the caller's tensor is left alone.
                made.append((name, was, _InPlace(tensor.detach().clone())))
                continue
            # A tensor stored where a value was (`self.last = scores`, None before) by weak
            # reference: the replay, which skips the call, gets it while someone holds it
            # (the module, until the replay puts back the value; the frame, a result).
            made.append((name, was, _ABSENT if entry is None else entry[1]))
        return MadeNumbers(d, made) if made else None


def _plain_entry(entry: tuple[Any, ...], /) -> bool:
    return entry[0] or type(entry[1]) is _Contents or \
        (type(entry[1]) is _TensorHeld and entry[1].kept is not None)


def _same_as(entry: tuple[Any, ...] | None, was: tuple[Any, ...] | None, /) -> bool:
    """Whether a value is as read (``None``: absent); a container by its entries alone."""
    if entry is None or was is None:
        return entry is was
    if type(was[1]) is _Contents:
        return type(entry[1]) is _Contents and type(entry[1].held) is type(was[1].held) and \
            entry[1].entries == was[1].entries
    if type(was[1]) is _TensorHeld:  # a small tensor, held: the same object
        return entry[1] == was[1]
    if type(was[1]) is _Mixed:  # a container holding tensors too: by kind and entries
        # (a copy the replay's put-back made holds them as well: helper HP)
        return type(entry[1]) in (_Contents, _Mixed) and \
            type(entry[1].held) is type(was[1].held) and \
            _same_entries(entry[1].entries, was[1].entries)
    if not was[0]:  # an object by id: one an earlier reused call left, held by its record
        return entry == was
    return entry[0] and not value_differs(entry[1], was[1])


class MadeNumbers:
    """The plain values and small containers a reused call changed on its module, each with
    what it held as the call began and what the call left (NOTE [state a reused call
    changes] in frozen.py)."""

    __slots__ = ("d", "made")

    def __init__(self, d: dict[str, Any], made: list[tuple[str, tuple[Any, ...] | None, Any]],
                 /) -> None:
        self.d = d
        self.made = made

    def make_again(self) -> None:
        """Each change made again where the value is as the call found it (the replay,
        skipping the call, reads what the call left); one changed otherwise since is left."""
        d = self.d
        for name, was, after in self.made:
            # An object the call found (by identity, or a container holding tensors) and
            # replaced by another: the forward's put-back leaves such a name as the forward
            # left it (with_reused_calls too), so the call's object is bound whatever is there
            # (helper HP: a dict bound anew at each call, never emptied, was read as the
            # forward's last from the second step).
            rebinds = type(after) is _Object and was is not None and not was[0] and \
                type(was[1]) in (int, _Mixed) or type(after) is _InPlace
            if not rebinds and \
                    not _same_as(_entry(d[name], mixed=True) if name in d else None, was):
                continue
            if after is _ABSENT:
                del d[name]
            elif type(after) is _TensorHeld:
                if (tensor := after.ref()) is not None:
                    d[name] = tensor
            elif type(after) is _InPlace:
                after.write_into(d.get(name))
            elif type(after) is _Object:  # bound by the call, with what it left in it
                d[name] = after.held
                _restore_after_replay(after.held)
                after.put_back()
            elif type(after) is not _Contents:
                d[name] = after
            elif d.get(name) is after.held:  # filled in place by the call: in place again
                _restore_after_replay(after.held)
                _put(after.held, after.entries)
            else:
                # The name holds another container (the replay's copy, or one the caller put
                # there since: theirs is left as they changed it, helpers HP, HR): a new one,
                # the name's own put back after the replay (it is among the forward's changes)
                d[name] = after.fresh()


# NOTE [a container a reused call is given and counts in]: a reused call may count in a small
# container it is given (`fn(h, self.stats)`, `stats["n"] += 1`: the fix limits.md gives for
# state off the call's module), and the forward read it after the call. The replay skips the
# call, and the forward's put-back gives the layer's container the entries it held as the
# forward began: the replay read the count before the call (helper HZ: every gradient 0; a key
# the call adds first, a KeyError). So the containers among a reused call's top-level
# arguments, keyword arguments and the values a ``functools.partial`` binds (``_CONTAINERS``,
# at most 64 entries, holding anything: a count beside a tensor, helper IJ; and plain objects,
# a namespace or dataclass of counts, by their attributes, as a dict by its items) are read by
# their entries before the call and after it (a tensor by identity). One the call changed is given,
# in the replay, at the call, what the call left, as eager's held it after the call: a dict
# the keys the call changed, and its order where the call changed that (a round robin's
# `move_to_end`, helper ID), whatever the replay's forward did to them before (a key the
# forward logs in changed again, helper IC), its other keys as the replay has them (a count
# made only under grad, in the replay, helper IJ); another container, all its entries. And it
# gets what it held when the replay began back after it (NOTE [what the replay writes into is
# put back after it]; where none of that runs, nothing is written: the caller's list kept the
# replay's append, helper IE). One the boundary does not read (a global passed in) is put back
# for the replay as the first such call found it, as a module outside the call's is
# (``with_reused_calls``), so code before the call reads what the call found (but what the
# forward itself changed there, which the replay changes again). A tensor the call puts in one
# is given to the replay as it is: a float one has no graph (as a float a reused fn stores, not
# told: replay.md).
ArgumentContents = list[tuple[int | str | None, Any, Any]]


def argument_contents(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], /
                      ) -> ArgumentContents | None:
    """The small containers among a reused call's top-level arguments (the place ``None``: one
    a partial binds, the same object in the replay), each with its place and a copy of its
    entries, read before the call (NOTE above)."""
    places: list[tuple[int | str | None, Any]] = [*enumerate(args), *kwargs.items()]
    if isinstance(fn, functools.partial):
        places += [(None, value) for _, value in unwrap_partials(fn)[1]]
    read = [(key, value, _entries(value)) for key, value in places
            if _read_by_entries(value)]  # a container, or a plain object by its attributes
    return read or None


class MadeContents:
    """The argument containers a reused call changed, each with its place, its kind, the
    container and what it held as the call began where it held plain values only (for
    ``with_reused_calls``; else ``None`` twice: one holding tensors is not held until the
    replay, helper IK, but for one a partial binds, which the partial holds anyway), and the
    call's change (NOTE [a container a reused call is given and counts in])."""

    __slots__ = ("changed",)

    def __init__(self, changed: list[tuple[int | str | None, type, Any, Any, _Change]], /
                 ) -> None:
        self.changed = changed

    @staticmethod
    def of(read: ArgumentContents, /) -> MadeContents | None:
        """What the call changed of the containers ``read`` before it; ``None`` for nothing
        (the usual case)."""
        changed = []
        for key, held, before in read:
            after = _entries(held)
            if _same_entries(after, before):
                continue
            keyed = isinstance(held, dict) or type(held) not in _CONTAINERS  # items
            plain = all(_immutable(v) for v in ([v for kv in before for v in kv] if keyed
                                                else before))
            change = _Change.of(held, before, after)
            if change is not None:
                changed.append((key, type(held), held if plain or key is None else None,
                                before if plain else None, change))
        return MadeContents(changed) if changed else None

    def make_again(self, args: tuple[Any, ...], kwargs: dict[str, Any], /) -> None:
        """In the replay's arguments at the same places, each container given what the call
        left (NOTE above), where it gets what it holds back after the replay."""
        for key, kind, held, _, change in self.changed:
            target = held if key is None else kwargs.get(key) if isinstance(key, str) else \
                args[key] if key < len(args) else None
            if type(target) is kind and _restore_after_replay(target):
                change.write_into(target)


class _Change:
    """What a reused call changed of a container, without holding a tensor it put there (one
    the caller lets go of would live until backward): a dict's keys it deleted, the plain
    values it set, and its order where the call changed that; another container's entries,
    where they are all plain."""

    __slots__ = ("deleted", "written", "order", "entries")

    def __init__(self, deleted: list[Any], written: list[tuple[Any, Any]],
                 order: list[Any] | None, entries: Any, /) -> None:
        self.deleted, self.written, self.order, self.entries = deleted, written, order, entries

    @staticmethod
    def of(held: Any, before: Any, after: Any, /) -> _Change | None:
        if type(held) in _CONTAINERS and not isinstance(held, dict):
            plain = all(map(_immutable, after))
            return _Change([], [], None, after) if plain else None
        # A dict's items, or a plain object's attributes (a namespace a router counts in).
        found, left = dict(before), dict(after)
        deleted = [k for k in found if k not in left]
        written = [(k, v) for k, v in after if (k not in found or not _same_entry(v, found[k]))
                   and _immutable(v)]
        moved = isinstance(held, dict) and \
            [k for k, _ in after if k in found] != [k for k, _ in before if k in left]
        if not (deleted or written or moved):
            return None  # it put tensors there only: not made again
        return _Change(deleted, written, list(left) if moved else None, None)

    def write_into(self, target: Any, /) -> None:
        if self.entries is not None:
            _put(target, self.entries)
            return
        own = target if isinstance(target, dict) else instance_dict(target)
        for k in self.deleted:
            own.pop(k, None)
        for k, value in self.written:
            own[k] = value
        for k in self.order or ():  # each to the end, in the order the call left them
            if k in own:
                own[k] = own.pop(k)


class NumbersGlance:
    """NOTE [a number first changed after the first replay]: once a module's first replay is
    done and no forward of it changed state, ``NumbersWatch`` reads only the dicts of modules
    holding buffers. A plain value a forward first changes later (a count that LayerDrop
    skipped at the first calls, a training-only step count after a first backward in eval
    mode, as classifier guidance takes before training) was then changed again by every
    replay, silently, and the replay computed with it: the module never showed a change, so
    it was never read again. So those calls glance at the other dicts of their modules, keys
    and values compared as tuples (identity, then equality: an equal value of another type,
    ``1`` rebound to ``True``, passes as unchanged), around the forward: those of modules not
    of torch.nn's own
    classes, whose forwards rebind no plain attribute (under a microsecond a dict; a full
    read of a ten-module layer takes about twenty). A value the forward rebound (an int
    counted up, a flag set, an object replaced) makes its module stateful, read in full from
    then on, and this call gets what a full read would have given for it: a value that cannot
    change in place is put back as the forward began for the replay (and a small tensor
    without a graph: NOTE [small tensor attributes as the forward read them]), another object
    the forward rebound is read as it is. A container changed in place keeps its identity and is not
    seen (a count per expert first changed so after the first replay: changed twice)."""

    __slots__ = ("dicts", "keys", "values")

    def __init__(self, dicts: Sequence[dict[str, Any]], /) -> None:
        self.dicts = dicts
        self.keys = [tuple(d) for d in dicts]
        self.values = [tuple(d.values()) for d in dicts]

    def changed(self) -> ChangedNumbers | None:
        """What the forward rebound, set anew or deleted, as ``NumbersWatch.changed`` gives
        it; ``None`` when nothing."""
        found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = []
        for d, keys, values in zip(self.dicts, self.keys, self.values):
            try:  # the usual case, compared in C (identity first), by name too
                if tuple(d.values()) == values and tuple(d) == keys:  # (`del a; self.b = a`)
                    continue
            except Exception:  # noqa: BLE001 (an __eq__ that raises: a tensor rebound, an array)
                pass  # looked at by name below
            before = dict(zip(keys, values))
            changed: list[tuple[str, Any]] = []
            rebound: list[str] = []
            for name in (d.keys() | before.keys()) - _NOT_STATE:
                if name.startswith(_OURS):
                    continue
                was, now = before.get(name, _ABSENT), d.get(name, _ABSENT)
                if was is now:
                    continue
                if was is _ABSENT:
                    changed.append((name, _ABSENT))  # set anew: the replay runs without it
                elif _immutable(was):
                    if now is _ABSENT or not _immutable(now) or value_differs(now, was):
                        changed.append((name, was))
                elif isinstance(was, torch.Tensor) and _small_detached(was):
                    # NOTE [small tensor attributes as the forward read them]
                    changed.append((name, was))
                else:
                    rebound.append(name)  # an object rebound or deleted: read as it is
            if changed or rebound:
                found.append((d, changed, rebound))
        return ChangedNumbers(found) if found else None


def glanced_dicts(roots: Sequence[nn.Module], trees: Sequence[ModuleDicts], /
                  ) -> list[dict[str, Any]]:
    """The dicts a ``NumbersGlance`` looks at: those of the modules not of torch.nn's own
    classes."""
    return [*(m.__dict__ for m in roots if not torch_nn_class(m)),
            *(d for tree in trees for d in tree.own)]


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
    same live tensor (and a small one held, at the same version). Not by id: a cache dropped
    before its rebuild (`self.table = None; self.table = build(n)`) is freed, and the new one
    may take its address.

    NOTE [small tensor attributes as the forward read them]: a small one without a graph (its
    storage at most 64 KiB, as for buffers: NOTE [small state as it was before the forward] in
    state_changes.py) is held too, ``kept``: a forward that replaces it (a streaming
    recurrent state carried detached, ``self.h = out.detach()``; a short memory, ``self.mem =
    torch.cat([self.mem, out.detach()])``) gets it put back for its replay, which read the
    last call's state before (gradients off by up to 0.25, silently: helper ES). A larger
    one is read by the replay as it is then, as before: holding it from every forward to its
    replay could cost what checkpointing saves (an attention map kept for logging); a buffer
    holds any size (documented). One the forward changes in place (a step count kept as a
    plain tensor, ``self.steps += 1``, which the replay counted again and computed with:
    helper EY) is told by its version, and where its values were cloned before the forward
    (``clone``: at the calls where small buffers are, a module's first calls and every call
    once a forward of it changed state), the replay reads a fresh copy of those values in its
    place, whose changes are dropped with it; the attribute holds its own tensor again after
    the replay (cost: a clone of each small tensor attribute of the call's modules at those
    calls, about 2.6 us each on this machine's CPU; nothing for modules keeping none, the
    usual case). Where they were not cloned (first changed in place after the module's first
    replay, as for buffers; or under the glance, which keeps no version) it is read as it
    is then (documented)."""

    __slots__ = ("ref", "kept", "version", "values")

    def __init__(self, tensor: torch.Tensor, /,
                 clones: dict[int, torch.Tensor] | None = None) -> None:
        self.ref = weakref.ref(tensor)
        self.kept = tensor if _small_detached(tensor) else None
        self.version = tensor._version if self.kept is not None else 0
        self.values: torch.Tensor | None = None
        if clones is not None and self.kept is not None:  # one clone per tensor
            self.values = clones.get(id(tensor))
            if self.values is None:
                self.values = clones[id(tensor)] = tensor.clone()

    def as_read(self) -> torch.Tensor | _ValuesRead | None:
        """The small tensor held, where nothing changed it in place since it was read; else
        its values as read, where they were cloned (else they are gone: read as it is, as a
        larger one; helper EX)."""
        kept = self.kept
        if kept is None:
            return None
        if kept._version == self.version:
            return kept
        return None if self.values is None else _ValuesRead(self.values)

    def __eq__(self, other: object) -> bool:
        return type(other) is _TensorHeld and (held := self.ref()) is not None and \
            held is other.ref() and self.version == other.version

    __hash__ = None  # type: ignore[assignment]


def _fresh(read: _ValuesRead, fresh: dict[int, torch.Tensor], /) -> torch.Tensor:
    copy = fresh.get(id(read.values))
    if copy is None:
        copy = fresh[id(read.values)] = read.values.clone()
        setattr(copy.untyped_storage(), REPLAY_COPY_MARK, True)  # the replay's own (_InPlace)
    return copy


class _InPlace:
    """The values a reused call left in a small tensor attribute it changed in place, for the
    replay's copy of it (NOTE in ``NumbersWatch.made``)."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor, /) -> None:
        self.values = values

    def write_into(self, target: Any, /) -> None:
        """Into ``target`` where it is the replay's own copy, of the same shape and dtype;
        another tensor (the caller's: no copy was made) is left as it is."""
        if isinstance(target, torch.Tensor) and \
                getattr(target.untyped_storage(), REPLAY_COPY_MARK, False) and \
                target.shape == self.values.shape and target.dtype == self.values.dtype:
            with torch.no_grad():
                target.copy_(self.values)


class _ValuesRead:
    """A small tensor attribute's values as the forward read them, changed in place since
    (NOTE [small tensor attributes as the forward read them]): each replay gets a fresh copy."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor, /) -> None:
        self.values = values


_SMALL_BYTES = 64 * 1024  # NOTE [small tensor attributes as the forward read them]


def _small_detached(t: torch.Tensor, /) -> bool:
    """A strided tensor without a graph whose whole storage is small (a view of a large
    output would keep that output); not an inference tensor (it has no version to check, and
    cannot change outside inference mode: helper FA); a plain ``torch.Tensor`` only: a
    subclass may hold more than its storage shows (a wrapper subclass's storage is empty or
    not its data, so its size says nothing, and its clone may not be a copy of its state)."""
    return not t.requires_grad and t.layout == torch.strided and type(t) is torch.Tensor \
        and not t.is_inference() and t.untyped_storage().nbytes() <= _SMALL_BYTES


def _read(d: dict[str, Any], clones: dict[int, torch.Tensor] | None = None, /, *,
          mixed: bool = False) -> dict[str, tuple[Any, ...]]:
    """By name: (True, the value, its type) for a value that cannot change in place (the type
    too: a number rebound to an equal one of another type, 4 to 4.0 or 1 to True, compared
    equal and was not put back for the replay: helper FD), (False, a weak reference) for a
    tensor, (False, its entries) for a small container of such values, (False, its id) for
    another object. nn.Module's own entries are left out by one set difference (a module's
    ``__dict__`` holds about 17 of them and a few of its own)."""
    found: dict[str, tuple[Any, ...]] = {}
    for name in d.keys() - _NOT_STATE:
        if not name.startswith(_OURS):
            value = d[name]
            found[name] = (True, value, type(value)) \
                if type(value) in _PLAIN or _immutable(value) else \
                _object_entry(value, clones, mixed=mixed)
    return found


def _object_entry(value: Any, clones: dict[int, torch.Tensor] | None = None, /, *,
                  mixed: bool = False) -> tuple[Any, ...]:
    return (False, _TensorHeld(value, clones) if isinstance(value, torch.Tensor) else
            _Contents(value) if _plain_container(value) else
            _Mixed(value) if mixed and _read_by_entries(value) else id(value))


def _read_by_entries(value: Any, /) -> bool:
    """A reused call's watch reads a small container holding anything, and a plain object by
    the attributes in its ``__dict__`` (a namespace a router counts in), by their entries."""
    if type(value) in _CONTAINERS:
        return len(value) <= _MOST_ENTRIES
    if isinstance(value, _NOT_PLAIN_OBJECTS):
        return False
    own = instance_dict(value)
    return type(own) is dict and len(own) <= _MOST_ENTRIES


# Objects a reused call's watch does not read by their attributes: modules and tensors (state
# of their own kinds), functions, classes and Python modules (code, not state), containers.
_NOT_PLAIN_OBJECTS = (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType,
                      types.ModuleType, dict, list, set, tuple, collections.deque)


def _entry(value: Any, /, *, mixed: bool = False) -> tuple[Any, ...]:
    """One value as ``_read`` reads it."""
    return (True, value, type(value)) if _immutable(value) else \
        _object_entry(value, mixed=mixed)


class _Mixed:
    """A small container holding more than plain values (a tensor a reused call logged beside
    a count), or a plain object by the attributes in its ``__dict__``, as a reused call's
    watch reads it (NOTE [an object a reused call leaves where a value was]): equal to another
    only for the same object holding the same entries, a tensor by identity (its ``==`` is
    elementwise)."""

    __slots__ = ("held", "entries")

    def __init__(self, held: Any, /) -> None:
        self.held = held
        self.entries = _entries(held)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Mixed and other.held is self.held and \
            _same_entries(self.entries, other.entries)

    __hash__ = None  # type: ignore[assignment]


def _same_entries(a: Any, b: Any, /) -> bool:
    """Two containers' entries (``_entries``) alike, a tensor by identity."""
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if type(a) is set:
        return bool(a == b)  # hashed: a tensor by identity
    return all(_same_entry(x, y) for x, y in zip(a, b))


def _same_entry(a: Any, b: Any, /) -> bool:
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) == 2:  # a dict's item
        return all(_same_entry(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and _immutable(a) and not value_differs(a, b)


class ChangedNumbers:
    """What a forward changed of its modules' plain values and attributes (NOTE [numbers and
    flags as the forward began]), for its replay."""

    __slots__ = ("found", "ends")

    def __init__(self, found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]],
                 /, *, ends: dict[int, Any] | None = None) -> None:
        self.found = found
        # By the id of a dict's entries as the forward began, its entries as the forward left
        # it (NOTE [a key only the replay changes]).
        self.ends = {} if ends is None else ends

    def joined(self, other: ChangedNumbers | None, /) -> ChangedNumbers:
        """This and ``other`` (changes of other dicts) as one."""
        return self if other is None else ChangedNumbers(
            [*self.found, *other.found], ends={**self.ends, **other.ends})

    def snapshots(self) -> list[torch.Tensor]:
        """The small tensor attributes held from the forward to the replay (NOTE [small
        tensor attributes as the forward read them]), and the copies of the values of those
        changed in place, for the census (Mechanism.MODULE_STATE)."""
        found: list[torch.Tensor] = []
        for _, values, _ in self.found:
            for _, value in values:
                if type(value) is _ValuesRead:
                    found.append(value.values)
                elif isinstance(value, torch.Tensor):
                    found.append(value)
        return found

    @contextmanager
    def as_forward_began(self, where: str = "the layer", /) -> Iterator[None]:
        """The changed values as the forward began, for the block; the values, and the objects
        the forward rebound, as the block began, after it. ``where`` names the call for
        NOTE [a graph tensor kept on a module]."""
        at_start = [(d, [(name, d.get(name, _ABSENT))
                         for name in [*(name for name, _ in values), *rebound]])
                    for d, values, rebound in self.found]
        # A container the forward changed in place also gets its entries back after the block
        # (the object is the same, so putting it back as an object would not), with what it
        # held as the forward began: a dict's keys the forward left alone keep what the block
        # made of them (NOTE [a key only the replay changes]).
        entries_at_start: list[tuple[Any, Any, Any]] = []
        for d, values, _ in self.found:
            for name, value in values:
                held = d.get(name)
                if (type(value) is _Contents and held is value.held) or \
                        (type(value) is _Refilled and value.holds(held)):
                    ended = self.ends.get(id(value))
                    entries_at_start.append((held, _entries(held), None if ended is None
                                             else (value.entries, ended)))
        # A small tensor attribute changed in place: a fresh copy of its values as read, for
        # this block alone (NOTE [small tensor attributes as the forward read them]), one per
        # tensor, whatever number of modules hold it.
        fresh: dict[int, torch.Tensor] = {}
        found = [(d, [(name, _fresh(value, fresh) if type(value) is _ValuesRead else value)
                      for name, value in values]) for d, values, _ in self.found]
        # One new container per container read, whatever number of names held it (a log a
        # layer shares with its submodule stays one list in the replay: helper HS).
        made: dict[int, Any] = {}
        for d, values in found:
            _set(d, values, made)
        put = {(id(d), name): value for d, values in found for name, value in values
               if isinstance(value, torch.Tensor)}
        pending: list[tuple[Any, Any]] = []
        token = _AFTER_REPLAY.set(pending)
        try:
            yield
        finally:
            _AFTER_REPLAY.reset(token)
            restored = {id(held) for held, _, _ in entries_at_start}
            for held, snapshot in reversed(pending):  # the NOTE at _AFTER_REPLAY
                if id(held) not in restored:
                    _put(held, snapshot)
            for held, entries, forward in entries_at_start:
                if forward is not None and isinstance(held, dict):
                    _put(held, _merged(entries, forward[0], forward[1], _entries(held),
                                       getattr(held, "default_factory", None)))
                else:
                    _put(held, entries)
            # What the replay read there: a small tensor put back, else what it held.
            _warn_graph_tensors_kept([(d, [(name, put.get((id(d), name), left))
                                           for name, left in named])
                                      for d, named in at_start], where)
            for d, named in at_start:
                # A leaf requiring grad that the replay stored stays (`self.last = leaf`, made
                # in the forward): the check that reads it once the replay's graph is gone
                # (NOTE [leaves the call makes] in refusals.py) must find it held, and refuse.
                _set(d, [(name, value) for name, value in named
                         if not (isinstance(now := d.get(name), torch.Tensor) and
                                 now.requires_grad and now.grad_fn is None)])


# NOTE [a key only the replay changes]: a dict the forward changed in place gets what it held
# when the replay began back after it; but code run only under grad (`if
# torch.is_grad_enabled(): self.stats["steps"] += 1`, as written for torch's reentrant
# checkpoint) changes it in the replay alone, as eager's forward did, and that change was
# dropped with the rest (helper IJ: the step count stayed 0, other gradients from the second
# step). So a key the forward left as it began, and the replay changed, keeps what the replay
# made of it, as a name only the replay sets does, where nothing changed it since the forward
# began (the caller, another micro-batch's replay, a first backward of a retained graph: a
# change made on top of theirs counted twice, helper IL). Any other key gets its value at the
# replay's start back; so a key both the forward and the replay change keeps the forward's
# change only, and a second micro-batch's replay-only change is dropped (documented).
def _merged(at_start: list[tuple[Any, Any]], began: list[tuple[Any, Any]],
            ended: list[tuple[Any, Any]], after: list[tuple[Any, Any]],
            factory: Any = None, /) -> list[tuple[Any, Any]]:
    """A dict's items after the replay (NOTE above), from its items at the replay's start, as
    the forward began and left it, and as the replay left it; ``factory``: a defaultdict's."""
    start, first, last, now = dict(at_start), dict(began), dict(ended), dict(after)
    # A defaultdict's key the forward only read is made holding the default (helper IO: a
    # count under grad in a defaultdict(int) read by the no-grad forward stayed 0): as absent.
    default = _ABSENT
    if factory in (int, float, bool, str, list, dict, set, tuple):  # a plain default only: a
        default = factory()  # factory of the user's may have side effects, or raise

    def same(a: Any, b: Any) -> bool:
        if a is _ABSENT or b is _ABSENT:
            other = b if a is _ABSENT else a
            return other is _ABSENT or default is not _ABSENT and _same_entry(other, default)
        return _same_entry(a, b)

    merged = []
    for k in [*start, *(k for k in now if k not in start)]:
        s, b, r = start.get(k, _ABSENT), first.get(k, _ABSENT), now.get(k, _ABSENT)
        # the replay's change alone, on the value the forward began with
        value = r if same(b, last.get(k, _ABSENT)) and same(s, b) else s
        if value is not _ABSENT:
            merged.append((k, value))
    # Its order too, where only the replay changed it (a `move_to_end` under grad: helper IO).
    order = [k for k, _ in at_start]
    if order == [k for k, _ in began] == [k for k, _ in ended]:
        replayed = [k for k, _ in after if k in start]
        if replayed != [k for k in order if k in now]:
            rank = {k: i for i, k in enumerate(k for k, _ in after)}
            merged.sort(key=lambda item: rank.get(item[0], len(rank)))
    return merged


def _warn_graph_tensors_kept(at_start: list[tuple[dict[str, Any], list[tuple[str, Any]]]],
                             where: str, /) -> None:
    """NOTE [a graph tensor kept on a module]: a forward that keeps on its module a tensor it
    computed with grad and reads it in a later call (Meta's reference Llama keeps its
    key/value cache so: ``self.kv = torch.cat([self.kv, keys])``) stored it without a graph
    in the original pass, which runs under no-grad, and the later call's replay computes with
    that one: the gradients through it are missing, silently (a small one is put back for
    each replay as its forward read it: NOTE [small tensor attributes as the forward read
    them]; a larger one, read as the last call left it, gives the replay another function
    still: helper ES). Seen after a replay that stored
    there a tensor with a graph larger than the one it read (the one put back, else what the
    attribute held: it extended it, a cache growing or a sliding window not yet full), and
    warned of once per module and
    attribute. A tensor kept for logging (``self.last = out``, the same size each call) or set
    by a pre-hook (a weight-norm's ``weight``) is not told; scalars are told by NOTE [results
    stored on a module] (stored_state.py). Not refused: a cache only read after backward is
    fine."""
    for d, named in at_start:
        for name, left in named:
            now = d.get(name)
            if isinstance(now, torch.Tensor) and now.grad_fn is not None and now.dim() and \
                    isinstance(left, torch.Tensor) and now.numel() > left.numel():
                told = _TOLD_GRAPH + name
                if d.get(told):
                    continue
                d[told] = True
                warnings.warn(
                    f"pytree_ckpt: the forward of {where} extends a tensor it keeps in the "
                    f"module attribute {name!r} with one computed with grad (a key/value cache "
                    "kept on the module); the original pass, which runs under no-grad, stored "
                    "it without a graph, so the gradients through it are missing, silently "
                    "(and one over 64 KiB is read by each replay as the last call left it, not "
                    "as its forward read it). Tip: keep no such cache while grad is enabled "
                    "(use_cache=False in training), or pass it in and return it (`out, cache = "
                    "layer(x, cache)`) (docs/limits.md, 'State the forward changes')",
                    stacklevel=user_stacklevel())


_TOLD_GRAPH = _OURS + "_told_graph_"


def _set(d: dict[str, Any], named: list[tuple[str, Any]],
         made: dict[int, Any] | None = None, /) -> None:
    """``d``'s names given the values read; ``made``: the new containers made so far, by the
    id of the one read (one per container, whatever number of names held it)."""
    made = {} if made is None else made
    for name, value in named:
        if value is _ABSENT:
            d.pop(name, None)
        elif type(value) is _Contents:
            if d.get(name) is value.held:  # changed in place: its entries as they were read
                _put(value.held, value.entries)
            else:  # rebound or deleted: a new one, so the object read is not changed
                key = id(value.held)
                d[name] = made[key] if key in made else made.setdefault(key, value.fresh())
        elif type(value) is _Refilled:
            if value.holds(held := d.get(name)):
                _put(held, value.entries)
            else:  # the caller replaced it: a new one for the replay, theirs left as it is
                key = value.ident
                d[name] = made[key] if key in made else made.setdefault(key, value.fresh())
        else:
            d[name] = value


def with_reused_calls(changed: ChangedNumbers | None, made: Sequence[MadeNumbers],
                      contents: Sequence[MadeContents] = (), /) -> ChangedNumbers | None:
    """``changed`` with the values reused calls changed (``made``, in call order) that it does
    not put back, put back as the first such call found them (NOTE [state a reused call
    changes] in frozen.py): a module outside the call's (a router the layer reaches in a
    closure) is then found by the replay as the call found it, gets what the call left where
    the replay skips it, and after the replay what it held when the replay began, as the
    call's own modules do. Likewise the argument containers the calls changed (``contents``)
    that no module's entry it puts back holds (NOTE [a container a reused call is given and
    counts in])."""
    covered = set() if changed is None else {
        (id(d), name) for d, values, rebound in changed.found
        for name in [*(name for name, _ in values), *rebound]}
    found: dict[int, tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = {}
    if contents:
        held_ids = set() if changed is None else {
            value.ident if type(value) is _Refilled else id(value.held)
            for _, values, _ in changed.found for _, value in values
            if type(value) in (_Contents, _Refilled)}
        for given in contents:
            for _, _, held, before, _ in given.changed:
                # One holding tensors is read as the forward left it (a local one the replay
                # makes again, helper IJ), and gets what it held when the replay began back
                # after it from the replay's own put-back (made below, however empty).
                if before is None or id(held) in held_ids:
                    continue
                held_ids.add(id(held))
                d = {"argument": held}  # its own dict, for the put-back's entries
                found[id(d)] = (d, [("argument", _Contents(held, before))], [])
    for change in made:
        for name, was, _ in change.made:
            if (id(change.d), name) in covered:
                continue
            covered.add((id(change.d), name))
            if was is not None and not was[0] and type(was[1]) is int:
                # an object by id: read as it is, and what it held when the replay began put
                # back after it (the call's object is bound in the replay: the NOTE in made())
                found.setdefault(id(change.d), (change.d, [], []))[2].append(name)
                continue
            found.setdefault(id(change.d), (change.d, [], []))[1].append(
                (name, _ABSENT if was is None else was[1].kept
                 if type(was[1]) is _TensorHeld else
                 # a container holding tensors too: its entries put back, as a plain one's
                 _Contents(was[1].held, was[1].entries) if type(was[1]) is _Mixed
                 else was[1]))
    if not found and (changed is not None or not contents):
        return changed
    return ChangedNumbers([*(changed.found if changed is not None else ()), *found.values()],
                          ends=changed.ends if changed is not None else None)
