"""What a reused call (``reuse_during_recompute``) changed of its module's plain values and of
the containers it is given, made again where the replay skips the call (NOTE [state a reused
call changes] in frozen.py; NOTE [a container a reused call is given and counts in]).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .changed_numbers import ChangedNumbers
from .function_reach import unwrap_partials
from .plain_values import (ABSENT, CONTAINERS, BoundObject, Contents, InPlace, Mixed, Refilled,
                           TensorHeld, entries_of, entry_of, immutable, put_entries,
                           read_by_entries, restore_after_replay, same_as, same_entries,
                           same_entry)
from .tree import instance_dict

__all__ = ["ArgumentContents", "MadeContents", "MadeNumbers", "argument_contents",
           "with_reused_calls"]


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
    read = [(key, value, entries_of(value)) for key, value in places
            if read_by_entries(value)]  # a container, or a plain object by its attributes
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
            after = entries_of(held)
            if same_entries(after, before):
                continue
            keyed = isinstance(held, dict) or type(held) not in CONTAINERS  # items
            plain = all(immutable(v) for v in ([v for kv in before for v in kv] if keyed
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
            if type(target) is kind and restore_after_replay(target):
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
        if type(held) in CONTAINERS and not isinstance(held, dict):
            plain = all(map(immutable, after))
            return _Change([], [], None, after) if plain else None
        # A dict's items, or a plain object's attributes (a namespace a router counts in).
        found, left = dict(before), dict(after)
        deleted = [k for k in found if k not in left]
        written = [(k, v) for k, v in after if (k not in found or not same_entry(v, found[k]))
                   and immutable(v)]
        moved = isinstance(held, dict) and \
            [k for k, _ in after if k in found] != [k for k, _ in before if k in left]
        if not (deleted or written or moved):
            return None  # it put tensors there only: not made again
        return _Change(deleted, written, list(left) if moved else None, None)

    def write_into(self, target: Any, /) -> None:
        if self.entries is not None:
            put_entries(target, self.entries)
            return
        own = target if isinstance(target, dict) else instance_dict(target)
        for k in self.deleted:
            own.pop(k, None)
        for k, value in self.written:
            own[k] = value
        for k in self.order or ():  # each to the end, in the order the call left them
            if k in own:
                own[k] = own.pop(k)


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
                found[id(d)] = (d, [("argument", Contents(held, before))], [])
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
                (name, ABSENT if was is None else was[1].kept
                 if type(was[1]) is TensorHeld else
                 # a container holding tensors too: its entries put back, as a plain one's
                 Contents(was[1].held, was[1].entries) if type(was[1]) is Mixed
                 else was[1]))
    if not found and (changed is not None or not contents):
        return changed
    return ChangedNumbers([*(changed.found if changed is not None else ()), *found.values()],
                          ends=changed.ends if changed is not None else None)
