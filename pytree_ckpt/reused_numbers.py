"""What a reused call (``reuse_during_recompute``) changed of its module's plain values and of
the containers it is given, made again where the replay skips the call (NOTE [state a reused
call changes] in frozen.py; NOTE [a container a reused call is given and counts in]).
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Sequence
from typing import Any


from .changed_numbers import ChangedNumbers, EndedAfterACall
from .errors import ReuseError
from .function_reach import unwrap_partials
from .module_state import owning_module
from .plain_values import (ABSENT, CONTAINERS, NOT_STATE, BoundObject, Contents, InPlace, Mixed,
                           Refilled, TensorHeld, entries_of, entry_of, immutable, plain_container,
                           put_entries, read_by_entries, restore_after_replay, same_as,
                           same_entries, same_entry)
from .tree import ITERATOR, leaf_kind

__all__ = ["ArgumentContents", "MadeContents", "MadeNumbers", "argument_contents",
           "argument_places", "refuse_iterator_arguments", "with_reused_calls"]


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
            rebinds = type(after) is BoundObject and was is not None and not was[0] and \
                type(was[1]) in (int, Mixed) or type(after) is InPlace
            if not rebinds and \
                    not same_as(entry_of(d[name], mixed=True) if name in d else None, was):
                continue
            if after is ABSENT:
                del d[name]
            elif type(after) is TensorHeld:
                if (tensor := after.ref()) is not None:
                    d[name] = tensor
            elif type(after) is InPlace:
                after.write_into(d.get(name))
            elif type(after) is BoundObject:  # bound by the call, with what it left in it
                d[name] = after.held
                restore_after_replay(after.held)
                after.put_back()
            elif type(after) is not Contents:
                d[name] = after
            elif d.get(name) is after.held:  # filled in place by the call: in place again
                restore_after_replay(after.held)
                put_entries(after.held, after.entries)
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
# arguments, keyword arguments and the values a ``functools.partial`` binds (``CONTAINERS``,
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
# told: replay.md). Also read: the plain object a reused bound method belongs to (a tracker
# counting on itself, `reuse_during_recompute(self.tracker.route, h)`: the same object in the
# replay, as a value a partial binds), the plain objects of the module a reused call runs
# (``_objects_of_its_module``), and two levels down, the containers and plain objects such
# a container or object holds (an MoE router's stats dataclass holding a load per expert, a
# namespace in a list: helper IR; its list of counts per expert, helper JG), found in the
# replay by the same path, what a function made once closes over (helper JG), a dict subclass
# keeping dict's item methods as a dict, a tuple's items as
# arguments of their own (``_unpacked``) and a set's members by identity; an attribute or key
# the call rebinds to a new small container of plain values gets a copy of it in the replay.
# Python's own iterators among or in them are refused (``refuse_iterator_arguments``).
ArgumentContents = list[tuple[tuple[Any, ...], Any, Any]]


def argument_contents(fn: Any, watched: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      /) -> ArgumentContents | None:
    """The small containers and plain objects among a reused call's top-level arguments and
    two levels down in them, each with its path (its argument's place: ``None`` for one a
    partial binds or the method's object, the same object in the replay; then the key, index
    or attribute name where it is held) and a copy of its entries, read before the call (NOTE
    above); with the plain objects of ``watched``'s module (``with_its_module``: NOTE [a module
    given to a reused call] in module_state.py)."""
    read: ArgumentContents = []
    seen: set[int] = set()  # one read per object, at the first path found (the same object)
    places = [(key, value) for key, value, _ in argument_places(fn, args, kwargs)]
    for key, value in [*places, *((None, value) for value in _objects_of_its_module(watched))]:
        for path, held in _unpacked((key,), value):
            _read_into(read, seen, path, held)  # each with a budget of its own (helper JK)
    return read or None


_MOST_ITEMS = 64  # as for containers (plain_values.py)


def _unpacked(path: tuple[Any, ...], value: Any, /, depth: int = 0
              ) -> list[tuple[tuple[Any, ...], Any]]:
    """A tuple's items (a namedtuple's too, and a tuple's in a tuple, four deep) as arguments
    of their own (`fn(h, (stats, config))`, helpers IX, JA, JE): a tuple cannot change, what it
    holds may; a frozenset's members by identity, as a set's (``_read_into``); anything else
    as it is."""
    if isinstance(value, tuple) and len(value) <= _MOST_ITEMS and depth < 4:
        return [found for i, v in enumerate(value)
                for found in _unpacked((*path, i), v, depth + 1)]
    if type(value) is frozenset and len(value) <= _MOST_ITEMS:
        return [((None,), v) for v in value]
    return [(path, value)]


_DEEPEST = 2  # levels below an argument: a router's stats.per_expert.counts (helper JG)
_MOST_READ = 256  # objects read for one argument, at most


def _read_into(read: ArgumentContents, seen: set[int], path: tuple[Any, ...], value: Any,
               /) -> None:
    """``value`` (a container, or a plain object by its attributes) and, two levels down,
    the containers and plain objects it holds, each read once (``seen``), nearest first."""
    level, most = [(path, value)], len(read) + _MOST_READ
    for depth in range(_DEEPEST + 1):
        below: list[tuple[tuple[Any, ...], Any]] = []
        for at, held in level:
            if id(held) in seen or immutable(held) or not readable(held) or \
                    len(read) >= most:
                continue
            seen.add(id(held))
            entries = entries_of(held)
            read.append((at, held, entries))
            if depth < _DEEPEST:
                # A set's members have no place to be found by in the replay: by identity,
                # as a value a partial binds (a set of trackers a call counts in, helper IY).
                below += [((None,), inner) for inner in entries] if type(entries) is set \
                    else [((*at, name), inner) for name, inner in
                          (entries if _keyed(held) else enumerate(entries))]
        level = below


def readable(value: Any, /) -> bool:
    """``read_by_entries``, and a dict subclass that keeps dict's own item methods (a typed
    stats dict, an attribute dict: helper JG), read and written as a dict."""
    return read_by_entries(value) or isinstance(value, dict) and \
        type(value) not in CONTAINERS and len(value) <= _MOST_ITEMS and \
        all(getattr(type(value), name) is getattr(dict, name) for name in _DICT_WRITES)


_DICT_WRITES = ("__setitem__", "__delitem__", "clear", "update", "pop")


def argument_places(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], /
                    ) -> list[tuple[int | str | None, Any, str]]:
    """A reused call's top-level arguments, each with its place (``None`` for a value a
    partial binds and a bound method's object, the same objects in the replay) and a name for
    messages."""
    places: list[tuple[int | str | None, Any, str]] = [
        *((i, value, f"args[{i}]") for i, value in enumerate(args)),
        *((key, value, f"kwargs[{key!r}]") for key, value in kwargs.items())]
    inner = fn
    if isinstance(fn, functools.partial):
        inner, bound = unwrap_partials(fn)
        places += [(None, value, name) for name, value in bound]
    if isinstance(inner, types.MethodType):  # a module's is the module watch's (not read here)
        places.append((None, inner.__self__, _METHODS_OBJECT))
    elif isinstance(inner, types.FunctionType) and inner.__closure__:
        # What a lambda or nested function made once closes over (`lambda h: count(h,
        # stats)`): the same objects in the replay, as a partial's (helper JG).
        for name, cell in zip(inner.__code__.co_freevars, inner.__closure__):
            try:
                places.append((None, cell.cell_contents, f"{_CLOSURES}{name}"))
            except ValueError:  # a cell not yet filled
                continue
    return places


_METHODS_OBJECT = "the object of the bound method"
_CLOSURES = "the closure's "


def _objects_of_its_module(fn: Any, /) -> list[Any]:
    """The plain objects (not containers: the module watch reads those by their entries) the
    module a reused call runs holds (its forward, or a method of it): a stats dataclass a
    router counts in, holding a load per expert (helper IR). The module watch reads such an
    object by its attributes, one level deep; read here as an argument, the containers it
    holds are read too (NOTE above)."""
    owner = owning_module(fn)  # a method bound by a partial too (with_its_module)
    if owner is None:
        return []
    return [value for name, value in tuple(vars(owner).items())
            if name not in NOT_STATE and type(value) not in CONTAINERS and
            not immutable(value) and not _ours(value) and readable(value)]


def _ours(value: Any, /) -> bool:
    """This package's own objects on a module (its checkpointed forward): not the user's."""
    return type(value).__module__.partition(".")[0] == __name__.partition(".")[0]


def refuse_iterator_arguments(fn: Any, name: str, args: tuple[Any, ...],
                              kwargs: dict[str, Any], /) -> None:
    """An iterator among a reused call's arguments, or held by one, is a ``ReuseError``: the
    replay skips the call, so the items the call took are not taken there, and the code after
    it reads others than eager's (helper IR), as the boundary refuses an iterator among its
    inputs. Told in
    the original pass, before the call."""
    for _, given, place in argument_places(fn, args, kwargs):
        if place == _METHODS_OBJECT or place.startswith(_CLOSURES):
            # Not given: only the function reads it (a private `itertools.count()` for call
            # ids, helper JK), the code after the call does not.
            continue
        # Where argument_contents looks: in tuples, and two levels down in a container or a
        # plain object (`fn(h, (widths,))`, `fn(h, {"src": it})`, a namespace holding one: not
        # refused before, helpers JE, JF).
        found = [(f"a member of {place}" if path[-1:] == (None,) else
                  place + "".join(f"[{i}]" for i in path), value)
                 for path, value in _unpacked((), given)]
        level = found
        for _ in range(_DEEPEST):
            below: list[tuple[str, Any]] = []
            for where, value in level:
                if immutable(value) or not readable(value):
                    continue
                entries = entries_of(value)
                below += [(f"a member of {where}", inner) for inner in entries] \
                    if type(entries) is set else \
                    [(f"{where}[{name!r}]" if isinstance(value, dict) else f"{where}.{name}",
                      inner) for name, inner in entries] if _keyed(value) else \
                    [(f"{where}[{i}]", inner) for i, inner in enumerate(entries)]
            found += below
            level = below
        for where, value in found:
            # Python's own iterators and generators only, given to the call (not a bound
            # method's object): a file or StringIO the call logs to, a proxy or mock, is an
            # iterator by its methods and is rarely iterated (helper IW: refused, where eager
            # and the replay agree); an iterator class of the user's is read by its attributes
            # (argument_contents).
            if leaf_kind(value) is not ITERATOR or \
                    type(value).__module__ not in ("builtins", "itertools"):
                continue
            raise ReuseError(
                f"reuse_during_recompute({name}, ...) was given an iterator at {where}; the "
                "call may take items from it, and the replay in backward, which skips the "
                "call, would not, so the code after the call would read other items than "
                "eager's",
                expected="arguments the replay can find as the call left them (a list, a "
                         "tuple, tensors, a container or object the call counts in)",
                got=f"{type(value).__name__} {value!r:.60}",
                tip="take the items the call needs before it and pass those "
                    "(reuse_during_recompute(fn, h, next(widths))), or pass a list")


def _plain_inside(value: Any, /) -> bool:
    """A container or plain object read by its entries, holding plain values only."""
    if not readable(value):
        return False
    entries = entries_of(value)
    return all(immutable(v) for v in ([v for kv in entries for v in kv] if _keyed(value)
                                      else entries))


def _keyed(held: Any, /) -> bool:
    """Whether ``entries_of(held)`` are (key, value) items: a dict's, an object's."""
    return not isinstance(held, (list, set, collections.deque))


def _at(path: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], /) -> Any:
    """What the replay's call holds at ``path`` (``argument_contents``), else ``None``."""
    key = path[0]
    found = kwargs.get(key) if isinstance(key, str) else args[key] if key < len(args) else None
    for name in path[1:]:
        if isinstance(found, tuple):
            found = found[name] if name < len(found) else None
            continue
        if not readable(found):
            return None
        entries = entries_of(found)
        if _keyed(found):
            found = dict(entries).get(name)
        else:
            found = entries[name] if name < len(entries) else None
    return found


# NOTE [a container a reused call left as it was]: is not put back for the replay. Put back as
# the call found it, a tracker several layers share was read by an earlier layer's replay as
# the call found it (helper JG: a later layer raised the peak); but a count the layer makes in
# it under grad after the call then had nothing to be told from (a list changed in place was
# reset, every count 0; a dict two layers count in kept one layer's count: helper JK), where
# leaving it as the replay finds it is exact. Documented: a container a call only reads is read
# as it is when the replay runs (docs/limits.md, Module state).
class MadeContents:
    """The argument containers a reused call changed, each with its place, its kind, the
    container and what it held as the call began where it held plain values only (for
    ``with_reused_calls``; else ``None`` twice: one holding tensors is not held until the
    replay, helper IK, but for one a partial binds, which the partial holds anyway), and the
    call's change (NOTE [a container a reused call is given and counts in])."""

    __slots__ = ("changed",)

    def __init__(self, changed: list[tuple[tuple[Any, ...], type, Any, Any, _Change]], /
                 ) -> None:
        self.changed = changed

    @staticmethod
    def of(read: ArgumentContents, /) -> MadeContents | None:
        """What the call changed of the containers ``read`` before it; ``None`` for nothing
        (the usual case)."""
        changed = []
        for path, held, before in read:
            after = entries_of(held)
            # Plain values only, one level down too (an object holding a load dict beside its
            # counts, helper IX): nothing held until the replay holds a tensor (helper IK).
            plain = all(immutable(v) or _plain_inside(v)
                        for v in ([v for kv in before for v in kv] if _keyed(held) else before))
            if same_entries(after, before):
                # NOTE [a container a reused call left as it was]
                continue
            change = _Change.of(held, before, after)
            if change is not None:
                changed.append((path, type(held), held if plain or path[0] is None else None,
                                before if plain else None, change))
        return MadeContents(changed) if changed else None

    def make_again(self, args: tuple[Any, ...], kwargs: dict[str, Any], /) -> None:
        """In the replay's arguments at the same places, each container given what the call
        left (NOTE above), where it gets what it holds back after the replay."""
        for path, kind, held, _, change in self.changed:
            target = held if path[0] is None else _at(path, args, kwargs)
            if type(target) is kind and restore_after_replay(target):
                change.write_into(target)


class _Change:
    """What a reused call changed of a container, without holding a tensor it put there (one
    the caller lets go of would live until backward): a dict's keys it deleted, the plain
    values it set (a small container of plain values it bound there, as a copy), and its
    order where the call changed that; another container's entries, where they are all
    plain."""

    __slots__ = ("deleted", "written", "order", "entries")

    def __init__(self, deleted: list[Any], written: list[tuple[Any, Any]],
                 order: list[Any] | None, entries: Any, /) -> None:
        self.deleted, self.written, self.order, self.entries = deleted, written, order, entries

    @staticmethod
    def of(held: Any, before: Any, after: Any, /) -> _Change | None:
        if type(held) in CONTAINERS and not isinstance(held, dict):
            plain = all(map(immutable, after))
            return _Change([], [], None, after) if plain else None
        # A dict's items, or a plain object's attributes (a namespace a router counts in).
        found, left = dict(before), dict(after)
        deleted = [k for k in found if k not in left]
        written = [(k, v if immutable(v) else Contents(v)) for k, v in after
                   if (k not in found or not same_entry(v, found[k]))
                   and (immutable(v) or plain_container(v))]
        moved = isinstance(held, dict) and \
            [k for k, _ in after if k in found] != [k for k, _ in before if k in left]
        if not (deleted or written or moved):
            return None  # it put tensors there only: not made again
        return _Change(deleted, written, list(left) if moved else None, None)

    def write_into(self, target: Any, /) -> None:
        if self.entries is not None:
            put_entries(target, self.entries)
            return
        # An object's attributes as a dict, written back whole (its slots too: put_entries).
        own = target if isinstance(target, dict) else dict(entries_of(target))
        for k in self.deleted:
            own.pop(k, None)
        for k, value in self.written:  # a container bound: a copy of its own for each replay
            own[k] = value.fresh() if type(value) is Contents else value
        for k in self.order or ():  # each to the end, in the order the call left them
            if k in own:
                own[k] = own.pop(k)
        if own is not target:
            put_entries(target, list(own.items()))


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
    ends = {} if changed is None else dict(changed.ends)
    if contents:
        held_ids = set() if changed is None else {
            value.ident if type(value) is Refilled else id(value.held)
            for _, values, _ in changed.found for _, value in values
            if type(value) in (Contents, Refilled)}
        for given in contents:
            for _, _, held, before, _ in given.changed:
                # One holding tensors is read as the forward left it (a local one the replay
                # makes again, helper IJ), and gets what it held when the replay began back
                # after it from the replay's own put-back (made below, however empty).
                if before is None or id(held) in held_ids:
                    continue
                held_ids.add(id(held))
                d = {"argument": held}  # its own dict, for the put-back's entries
                read = Contents(held, before)
                found[id(d)] = (d, [("argument", read)], [])
                # As the forward left it (this runs as the forward ends), for NOTE [a key only
                # the replay changes] (changed_numbers.py): a count made only under grad, in
                # the replay, in an object or dict a reused call counts in (helper IR).
                ends[id(read)] = EndedAfterACall(entries_of(held))
    for change in made:
        for name, was, _ in change.made:
            if (id(change.d), name) in covered:
                continue
            covered.add((id(change.d), name))
            if was is not None and not was[0] and type(was[1]) is int:
                # an object by id: read as it is, and what it held when the replay began put
                # back after it (the call's object is bound in the replay: the NOTE in
                # NumbersWatch.made, forward_numbers.py)
                found.setdefault(id(change.d), (change.d, [], []))[2].append(name)
                continue
            found.setdefault(id(change.d), (change.d, [], []))[1].append(
                (name, ABSENT if was is None else was[1].kept
                 if type(was[1]) is TensorHeld else
                 # a container holding tensors too: its entries put back, as a plain one's
                 Contents(was[1].held, was[1].entries) if type(was[1]) is Mixed
                 else was[1]))
    if not found and (changed is not None or not contents):
        return changed
    return ChangedNumbers([*(changed.found if changed is not None else ()), *found.values()],
                          ends=ends, read=None if changed is None else changed.read,
                          written=None if changed is None else changed.written)
