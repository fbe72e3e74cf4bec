"""Reading and writing the plain state a forward or a reused call changes: values that cannot
change in place by value, small containers by their entries, tensor attributes by weak
reference (NOTE [small tensor attributes as the forward read them]), and what the replay writes
into put back after it (NOTE [what the replay writes into is put back after it]).

``forward_numbers.py`` watches the modules' ``__dict__`` with these; ``changed_numbers.py``
puts what a forward changed back for its replay; ``reused_numbers.py`` records what a reused
call changed.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import enum
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .state_changes import is_replay_copy, mark_replay_copy
from .tree import dunder, instance_dict

__all__ = ["ABSENT", "AFTER_REPLAY", "CHANGED_BY_A_CALL", "CONTAINERS", "NOT_STATE", "OURS",
           "BoundObject", "Contents", "InPlace", "Mixed", "Refilled", "ReplacedNames", "Rewritten",
           "TensorHeld", "TupleHeld", "ValuesRead", "entries_of", "entry_of", "fresh_values",
           "immutable", "plain_container", "plain_entries", "plain_entry", "put_entries",
           "read_by_entries", "read_entries", "restore_after_replay", "same_as", "same_entries",
           "same_entry", "small_detached", "small_tuple", "tuple_tensors", "value_differs"]

# Values that cannot change in place, by exact type (a subclass may carry state); also enum
# members, tuples and namedtuples of such values (a shape key) and NumPy scalars (immutable).
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype,
                    torch.device})

# Not the forward's own state: nn.Module's bookkeeping (its hook flags are torch's; but its
# training flag, which a forward may switch: forward_modules.py puts back the modes the forward
# left), and this library's marks.
NOT_STATE = frozenset(nn.Module().__dict__) - {"training"}
OURS = "_pytree_ckpt"
# In a module's ``__dict__``: the names of the small tensor attributes a checkpointed call's
# forward replaced there (NOTE [values read, then changed by a later call] in
# forward_numbers.py), and of the entries watched replays changed, by when, as
# ``ReplacedNames``: an object, not a set, which the watches of plain values would read as one
# of the module's containers.
CHANGED_BY_A_CALL = OURS + "_replaced_by_a_call"


class ReplacedNames:
    """NOTE [values read, then changed by a later call] (forward_numbers.py): ``names``; and
    NOTE [a key read beside a table given back] (changed_numbers.py): ``count``, the watched
    replays that changed (and kept) a plain value of this dict, and ``stamps``, by name, the
    count at the last replay that changed it."""

    __slots__ = ("names", "count", "stamps")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.count = 0
        self.stamps: dict[str, int] = {}

    def note(self, names: Sequence[str], /) -> None:
        """A watched replay changed ``names``."""
        self.count += 1
        for name in names:
            self.stamps[name] = self.count

    def __deepcopy__(self, memo: dict[int, Any], /) -> ReplacedNames:
        copied = ReplacedNames()
        copied.names = set(self.names)
        copied.count, copied.stamps = self.count, dict(self.stamps)
        return copied

# Containers of such values read by their contents (a count per expert, a set of lengths seen),
# by exact type; up to _MOST_ENTRIES entries, so that a read stays a small copy (a history
# that grows every step is left alone once past it).
CONTAINERS = frozenset({list, dict, set, collections.defaultdict, collections.Counter,
                         collections.OrderedDict, collections.deque})
_MOST_ENTRIES = 64


def immutable(value: Any, /, depth: int = 0) -> bool:
    kind = type(value)
    if kind in _PLAIN or isinstance(value, enum.Enum):
        return True
    # A namedtuple too (a `__slots__ = ()` class: it holds nothing more; helper NJ: one of
    # numbers the forward rebinds, `self.cfg = Scale(self.cfg.scale + 1, ...)`, was read by
    # each replay as the last call left it).
    if kind is tuple or isinstance(value, tuple) and _plain_tuple_class(kind):
        return depth < 4 and all(immutable(v, depth + 1) for v in value)
    # A NumPy scalar (np.bool_, np.float32; an array is unhashable), without importing NumPy.
    return kind.__module__ == "numpy" and dunder(kind, "__hash__") is not None


class _Absent:
    """A name the forward set that was not there when it began: the replay runs without it."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()


class Contents:
    """A container of values that cannot change in place (``CONTAINERS``), with a copy of its
    entries: equal to another only for the same container with equal entries, so a count
    changed in place is seen as a change of the container's entries."""

    __slots__ = ("held", "entries")

    def __init__(self, held: Any, /, entries: Any = None) -> None:
        self.held = held
        self.entries = entries_of(held) if entries is None else entries

    def __eq__(self, other: object) -> bool:
        return type(other) is Contents and other.held is self.held and \
            other.entries == self.entries

    __hash__ = None  # type: ignore[assignment]

    def fresh(self) -> Any:
        """A new container of the held one's kind with the entries read (for a name the
        forward rebound or deleted: the replay must not change the object read)."""
        made = copy.copy(self.held)
        put_entries(made, self.entries)
        return made


# NOTE [what the replay writes into is put back after it]: the replay makes again what a
# skipped reused call left by writing into the objects it bound or filled (the call's own:
# eager's objects, which others may hold too: a router's shared namespace, a trainer's log of
# records, helper HS), so each such object gets what it held when the replay began back once
# the replay is done (``as_forward_began`` runs these, last written first).
AFTER_REPLAY: contextvars.ContextVar[list[tuple[Any, Any]] | None] = \
    contextvars.ContextVar("pytree_ckpt_after_replay", default=None)


def restore_after_replay(held: Any, /) -> bool:
    """Whether ``held`` gets what it holds now back after the replay (``False`` where no
    replay's put-back runs, or for an object with nothing to snapshot)."""
    pending = AFTER_REPLAY.get()
    if pending is not None and (snapshot := _snapshot(held)) is not None:
        pending.append((held, snapshot))
        return True
    return False


class BoundObject:
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
            put_entries(self.held, self.entries)


def _snapshot(held: Any, /) -> Any:
    """What ``BoundObject.put_back`` restores (``entries_of``): a dict's, list's or set's entries
    (subclasses too), else the attributes in the object's ``__dict__`` and slots; ``None`` for
    anything else (a tensor, a module, an object of neither: rebound as it is)."""
    if isinstance(held, (torch.Tensor, nn.Module)) or \
            not isinstance(held, (dict, list, set, collections.deque)) and \
            type(instance_dict(held)) is not dict and not _slots(type(held)):
        return None
    return entries_of(held)


class Refilled:
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

    def __init__(self, contents: Contents, /) -> None:
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
        put_entries(made, self.entries)
        return made


def entries_of(held: Any, /) -> Any:
    """A copy of a container's entries: a list, a deque (as a list), a set, or a dict's items
    in their order (a round robin that only moves an entry to the end, ``move_to_end``,
    changes the order); of another object (a reused call's watch reads plain objects too:
    ``Mixed``), the items of its ``__dict__``, then its set slots (a ``@dataclass(slots=True)``,
    helper IR)."""
    if isinstance(held, (list, collections.deque)):  # a window of recent loads (helper HZ)
        return list(held)
    if isinstance(held, set):
        return set(held)
    if isinstance(held, dict):
        return list(held.items())
    own = instance_dict(held)
    found = list(own.items()) if type(own) is dict else []
    for name in _slots(type(held)):
        try:  # the slot itself: not a __getattr__ the class may have for an unset one
            found.append((name, object.__getattribute__(held, name)))
        except AttributeError:
            pass  # unset
    return found


def put_entries(held: Any, entries: Any, /) -> None:
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
    else:  # a plain object's attributes, as __dict__ entries and slots do it (not through a
        # __setattr__ that validates, or a frozen dataclass's, which refuses)
        slots = _slots(type(held))
        own = instance_dict(held)
        if type(own) is dict:
            own.clear()
            own.update((name, value) for name, value in entries if name not in slots)
        given = dict(entries)
        for name in slots:
            if name in given:
                object.__setattr__(held, name, given[name])
            else:
                try:
                    object.__delattr__(held, name)
                except AttributeError:
                    pass  # unset already


# By class: the slots its Python classes declare (their member descriptors: a name mangled as
# Python stores it), or () for none. Not step state: a class's slots never change.
_SLOTS: dict[type, tuple[str, ...]] = {}


def _slots(kind: type, /) -> tuple[str, ...]:
    names = _SLOTS.get(kind)
    if names is None:
        names = _SLOTS[kind] = tuple(
            name for cls in kind.__mro__ if "__slots__" in vars(cls)
            for name, attribute in vars(cls).items()
            if isinstance(attribute, types.MemberDescriptorType))
    return names


def plain_entries(value: Any, /) -> Any:
    """A copy of the entries of a small container of plain values (NOTE [numbers and flags as
    the forward began]), ``None`` for anything else: for the 'changed again' warning."""
    return entries_of(value) if plain_container(value) else None


def value_differs(now: Any, before: Any) -> bool:
    """By value (``self.seq_len = x.shape[1]`` stores an equal new int each call), NaN
    equal to NaN; another type (a tensor where a number was) differs."""
    if type(now) is not type(before):
        return True
    return bool(now != before) and not (now != now and before != before)


def plain_container(value: Any, /, most: float = _MOST_ENTRIES) -> bool:
    if type(value) not in CONTAINERS or len(value) > most:
        return False
    if isinstance(value, dict):
        return all(map(immutable, value)) and all(map(immutable, value.values()))
    return all(map(immutable, value))


def plain_entry(entry: tuple[Any, ...], /) -> bool:
    return entry[0] or type(entry[1]) is Contents or \
        (type(entry[1]) is TensorHeld and entry[1].kept is not None)


def same_as(entry: tuple[Any, ...] | None, was: tuple[Any, ...] | None, /) -> bool:
    """Whether a value is as read (``None``: absent); a container by its entries alone."""
    if entry is None or was is None:
        return entry is was
    if type(was[1]) is Contents:
        return type(entry[1]) is Contents and type(entry[1].held) is type(was[1].held) and \
            entry[1].entries == was[1].entries
    if type(was[1]) is TensorHeld:  # a small tensor, held: the same object
        return entry[1] == was[1]
    if type(was[1]) is Mixed:  # a container holding tensors too: by kind and entries
        # (a copy the replay's put-back made holds them as well: helper HP)
        return type(entry[1]) in (Contents, Mixed) and \
            type(entry[1].held) is type(was[1].held) and \
            same_entries(entry[1].entries, was[1].entries)
    if not was[0]:  # an object by id: one an earlier reused call left, held by its record
        return entry == was
    return entry[0] and not value_differs(entry[1], was[1])


class TensorHeld:
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
    one is read by the replay as it is then: holding it from every forward to its
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
    is then (documented), and the replay writes it on a copy where the change is seen (NOTE
    [a tensor attribute changed in place, not held])."""

    __slots__ = ("ref", "kept", "version", "values")

    def __init__(self, tensor: torch.Tensor, /,
                 clones: dict[int, torch.Tensor] | None = None) -> None:
        self.ref = weakref.ref(tensor)
        self.kept = tensor if small_detached(tensor) else None
        # Of a larger one too: NOTE [a tensor attribute changed in place, not held]
        self.version = 0 if tensor.is_inference() else tensor._version
        self.values: torch.Tensor | None = None
        if clones is not None and self.kept is not None:  # one clone per tensor
            self.values = clones.get(id(tensor))
            if self.values is None:
                self.values = clones[id(tensor)] = tensor.clone()

    def as_read(self) -> torch.Tensor | ValuesRead | None:
        """The small tensor held, where nothing changed it in place since it was read; else
        its values as read, where they were cloned (else they are gone: read as it is, as a
        larger one; helper EX)."""
        kept = self.kept
        if kept is None:
            return None
        if kept._version == self.version:
            return kept
        return None if self.values is None else ValuesRead(self.values)

    def tensors(self) -> list[torch.Tensor]:
        """The tensor read, while it lives."""
        tensor = self.ref()
        return [] if tensor is None else [tensor]

    def moved(self) -> bool:
        """NOTE [a tensor attribute changed in place, not held]: whether the tensor read was
        changed in place since (the attribute may hold another by now: helper NA)."""
        tensor = self.ref()
        return tensor is not None and not tensor.is_inference() and \
            tensor._version != self.version

    def __eq__(self, other: object) -> bool:
        return type(other) is TensorHeld and (held := self.ref()) is not None and \
            held is other.ref() and self.version == other.version

    __hash__ = None  # type: ignore[assignment]


# NOTE [a tensor attribute changed in place, not held]: a plain tensor attribute over 64 KiB
# (or a smaller one whose values were not cloned before the forward: NOTE [small tensor
# attributes as the forward read them]), or a tensor of a tuple attribute (TupleHeld), that the
# forward changes in place (a recurrent state written back, `self.st.copy_(h.detach())`) has
# no copy of what the forward read, so its replay reads it as it is then (documented); but the
# replay wrote it again too, on the module's own tensor: the state ended each step as the
# replay left it, and the next step's forward, its loss included, differed from eager's
# (helper MV). So, as for a buffer the forward changed in place (NOTE [the replay changes
# copies] in state_changes.py), the replay runs on a copy of the values the attribute holds
# when the replay begins (whatever tensor it is then: one the caller reset it to by
# assignment, or the one an outer boundary's replay left: helper MY), one copy per tensor, and
# the attribute holds its own object again after the replay. Told by the version of the tensor
# read, whatever the attribute holds at the forward's end (written, then replaced: helper NA;
# one over 64 KiB, not held, is gone by then), where a module's attributes are read (not by
# the glance, which keeps no version: documented); the copy lives for the replay alone. A
# tensor requiring grad, or of another layout or class, is left as it is; a tuple of another
# class is made with its attributes, not through its constructor (a structseq from its items).
class Rewritten:
    """An attribute whose tensors the forward changed in place (NOTE above)."""

    __slots__ = ("read", "read_grad")

    def __init__(self, read: list[torch.Tensor], /) -> None:
        self.read = [weakref.ref(t) for t in read]  # the attribute's tensor, or its tuple's
        self.read_grad = any(t.requires_grad for t in read)

    def graph_read(self, now: Any, /) -> str | None:
        """Why the replay cannot run on ``now`` (what the attribute holds as the replay
        begins), or ``None``: ``"read"``, the forward read a tensor requiring grad there (a
        state carried with its graph, or set to one before the forward: the original pass
        wrote its values, so no replay reads them as the forward did, and each backpropagates
        into a graph made outside the call: helper NO); ``"set since"``, it holds a tensor
        requiring grad the forward did not read (the caller's learned initial state, ``self.h
        = self.h0 * 1``, set between the forward and backward: the replay backpropagated into
        it, and with one call its parameter got a gradient eager never gives, silently:
        helper NJ's M12; of a tuple too: helper NO)."""
        if self.read_grad:
            return "read"
        read = {id(t) for ref in self.read if (t := ref()) is not None}
        return "set since" if any(t.requires_grad and id(t) not in read
                                  for t in _tensors_of(now)) else None

    def for_replay(self, now: Any, copies: dict[int, torch.Tensor], /, depth: int = 0) -> Any:
        """``now`` (what the attribute holds as the replay begins) with each plain tensor
        without a graph in it, or in a tuple of it, copied (``copies``: one per tensor)."""
        if isinstance(now, torch.Tensor):
            # An inference tensor too (the caller's reset, made under inference_mode: the
            # replay's write into it raised, helper MZ): its clone here is a plain tensor.
            if now.requires_grad or now.layout != torch.strided or type(now) is not torch.Tensor:
                return now
            copy = copies.get(id(now))
            if copy is None:
                with torch.no_grad():
                    copy = copies[id(now)] = now.clone()
            return copy
        if isinstance(now, tuple) and depth < 4:
            items = [self.for_replay(v, copies, depth + 1) for v in now]
            if all(a is b for a, b in zip(items, now)):
                return now
            kind = type(now)
            if kind is tuple:
                return tuple(items)
            if _plain_tuple_class(kind):
                return getattr(kind, "_make")(items)
            # Another tuple class (the caller's, bound since) may take other arguments, or
            # hold attributes (helper NA): made as it is, with its attributes, not through its
            # own constructor; a structseq (torch.return_types.max), which refuses that, from
            # the sequence, as it is made (helper NB).
            try:
                made = tuple.__new__(kind, items)
            except TypeError:
                try:
                    return kind(items)
                except Exception:  # noqa: BLE001 (a class made otherwise: left as it is)
                    return now
            own = instance_dict(now)
            if type(own) is dict:
                made.__dict__.update(own)
            return made
        return now


class TupleHeld:
    """A tuple (or namedtuple) of small tensors without a graph and plain values, held as a
    small tensor is (NOTE [small tensor attributes as the forward read them]): a recurrent
    state kept as a pair, ``self.state = (ssm.detach(), conv.detach())``, read by the next
    chunk (helper MV: by id, it was read by each replay as the last chunk left it, gradients
    off by 4.7, silently). The tuple cannot change; its tensors' versions are read, and one
    changed in place is read as it is then (no clone: documented), and written by the replay
    on a copy (NOTE [a tensor attribute changed in place, not held])."""

    __slots__ = ("kept", "versions")

    def __init__(self, value: tuple[Any, ...], /) -> None:
        self.kept = value
        self.versions = _versions(value)

    def as_read(self) -> tuple[Any, ...] | None:
        """The tuple held, where nothing changed its tensors in place since it was read."""
        return self.kept if _versions(self.kept) == self.versions else None

    def tensors(self) -> list[torch.Tensor]:
        """The tuple's tensors."""
        return tuple_tensors(self.kept)

    def moved(self) -> bool:
        """NOTE [a tensor attribute changed in place, not held]: whether a tensor of the tuple
        read was changed in place since."""
        return _versions(self.kept) != self.versions

    def __eq__(self, other: object) -> bool:
        return type(other) is TupleHeld and other.kept is self.kept and \
            self.versions == other.versions

    __hash__ = None  # type: ignore[assignment]


def small_tuple(value: Any, /, depth: int = 0) -> bool:
    """A tuple or namedtuple (a subclass of one too: helper MY; each class up to ``tuple``
    with ``__slots__ = ()``, so it holds nothing more) of at most 64 entries, each a small
    tensor without a graph (``small_detached``), a value that cannot change in place, or such
    a tuple (4 deep), with a tensor among them."""
    if not isinstance(value, tuple) or len(value) > _MOST_ENTRIES or depth > 3 or \
            type(value) is not tuple and not _plain_tuple_class(type(value)):
        return False
    found = False
    for v in value:
        if isinstance(v, torch.Tensor):
            if not small_detached(v):
                return False
            found = True
        elif isinstance(v, tuple) and small_tuple(v, depth + 1):
            found = True
        elif not immutable(v):
            return False
    return found


def _plain_tuple_class(kind: type, /) -> bool:
    """A namedtuple's class, or a subclass of one, each class up to ``tuple`` with
    ``__slots__ = ()``: it holds nothing more than its entries."""
    return hasattr(kind, "_fields") and callable(getattr(kind, "_make", None)) and all(
        vars(cls).get("__slots__") == () for cls in kind.__mro__[:-2])


def tuple_tensors(value: tuple[Any, ...], /) -> list[torch.Tensor]:
    """The tensors of a tuple (of nested tuples too), in order."""
    return [t for t in _leaves(value) if isinstance(t, torch.Tensor)]


def _tensors_of(value: Any, /, depth: int = 0) -> list[torch.Tensor]:
    """``value`` if a tensor, else the tensors of a tuple of it, 4 deep at most (what
    ``Rewritten.for_replay`` copies)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and depth < 4:
        return [t for v in value for t in _tensors_of(v, depth + 1)]
    return []


def _leaves(value: tuple[Any, ...], /) -> list[Any]:
    return [leaf for v in value for leaf in (_leaves(v) if isinstance(v, tuple) else (v,))]


def _versions(value: tuple[Any, ...], /) -> tuple[int, ...]:
    return tuple(t._version for t in _leaves(value) if isinstance(t, torch.Tensor))


def fresh_values(read: ValuesRead, fresh: dict[int, torch.Tensor], /) -> torch.Tensor:
    copy = fresh.get(id(read.values))
    if copy is None:
        copy = fresh[id(read.values)] = read.values.clone()
        mark_replay_copy(copy)  # the replay's own (InPlace)
    return copy


class InPlace:
    """The values a reused call left in a small tensor attribute it changed in place, for the
    replay's copy of it (NOTE in ``NumbersWatch.made``, forward_numbers.py)."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor, /) -> None:
        self.values = values

    def write_into(self, target: Any, /) -> None:
        """Into ``target`` where it is the replay's own copy, of the same shape and dtype;
        another tensor (the caller's: no copy was made) is left as it is."""
        if isinstance(target, torch.Tensor) and \
                is_replay_copy(target) and \
                target.shape == self.values.shape and target.dtype == self.values.dtype:
            with torch.no_grad():
                target.copy_(self.values)


class ValuesRead:
    """A small tensor attribute's values as the forward read them, changed in place since
    (NOTE [small tensor attributes as the forward read them]): each replay gets a fresh copy."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor, /) -> None:
        self.values = values


_SMALL_BYTES = 64 * 1024  # NOTE [small tensor attributes as the forward read them]


def small_detached(t: torch.Tensor, /) -> bool:
    """A strided tensor without a graph whose whole storage is small (a view of a large
    output would keep that output); not an inference tensor (it has no version to check, and
    cannot change outside inference mode: helper FA); a plain ``torch.Tensor`` only: a
    subclass may hold more than its storage shows (a wrapper subclass's storage is empty or
    not its data, so its size says nothing, and its clone may not be a copy of its state)."""
    return not t.requires_grad and t.layout == torch.strided and type(t) is torch.Tensor \
        and not t.is_inference() and t.untyped_storage().nbytes() <= _SMALL_BYTES


def read_entries(d: dict[str, Any], clones: dict[int, torch.Tensor] | None = None, /, *,
          mixed: bool = False) -> dict[str, tuple[Any, ...]]:
    """By name: (True, the value, its type) for a value that cannot change in place (the type
    too: a number rebound to an equal one of another type, 4 to 4.0 or 1 to True, compared
    equal and was not put back for the replay: helper FD), (False, a weak reference) for a
    tensor, (False, its entries) for a small container of such values, (False, its id) for
    another object. nn.Module's own entries are left out by one set difference (a module's
    ``__dict__`` holds about 17 of them and a few of its own)."""
    found: dict[str, tuple[Any, ...]] = {}
    for name in d.keys() - NOT_STATE:
        if not name.startswith(OURS):
            value = d[name]
            found[name] = (True, value, type(value)) \
                if type(value) in _PLAIN or immutable(value) else \
                _object_entry(value, clones, mixed=mixed)
    return found


def _object_entry(value: Any, clones: dict[int, torch.Tensor] | None = None, /, *,
                  mixed: bool = False) -> tuple[Any, ...]:
    return (False, TensorHeld(value, clones) if isinstance(value, torch.Tensor) else
            TupleHeld(value) if small_tuple(value) else
            Contents(value) if plain_container(value) else
            Mixed(value) if mixed and read_by_entries(value) else id(value))


def read_by_entries(value: Any, /) -> bool:
    """A reused call's watch reads a small container holding anything, and a plain object by
    the attributes in its ``__dict__`` and its slots (a namespace or dataclass a router counts
    in), by their entries."""
    if type(value) in CONTAINERS:
        return len(value) <= _MOST_ENTRIES
    if isinstance(value, _NOT_PLAIN_OBJECTS):
        return False
    own, slots = instance_dict(value), _slots(type(value))
    if type(own) is not dict:
        return bool(slots) and len(slots) <= _MOST_ENTRIES
    return len(own) + len(slots) <= _MOST_ENTRIES


# Objects a reused call's watch does not read by their attributes: modules and tensors (state
# of their own kinds), functions, classes and Python modules (code, not state), containers.
_NOT_PLAIN_OBJECTS = (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType,
                      types.ModuleType, dict, list, set, tuple, collections.deque)


def entry_of(value: Any, /, *, mixed: bool = False) -> tuple[Any, ...]:
    """One value as ``read_entries`` reads it."""
    return (True, value, type(value)) if immutable(value) else \
        _object_entry(value, mixed=mixed)


class Mixed:
    """A small container holding more than plain values (a tensor a reused call logged beside
    a count), or a plain object by the attributes in its ``__dict__``, as a reused call's
    watch reads it (NOTE [an object a reused call leaves where a value was]): equal to another
    only for the same object holding the same entries, a tensor by identity (its ``==`` is
    elementwise)."""

    __slots__ = ("held", "entries")

    def __init__(self, held: Any, /) -> None:
        self.held = held
        self.entries = entries_of(held)

    def __eq__(self, other: object) -> bool:
        return type(other) is Mixed and other.held is self.held and \
            same_entries(self.entries, other.entries)

    __hash__ = None  # type: ignore[assignment]


def same_entries(a: Any, b: Any, /) -> bool:
    """Two containers' entries (``entries_of``) alike, a tensor by identity."""
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if type(a) is set:
        return bool(a == b)  # hashed: a tensor by identity
    return all(same_entry(x, y) for x, y in zip(a, b))


def same_entry(a: Any, b: Any, /) -> bool:
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) == 2:  # a dict's item
        return all(same_entry(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and immutable(a) and not value_differs(a, b)
