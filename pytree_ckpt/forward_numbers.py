"""The plain values a call's forward sets on its modules (numbers, flags, keys), put back as the
forward began for the replay: NOTE [numbers and flags as the forward began].

How values are read and written is ``plain_values.py``'s; what a forward changed, put back for
its replay, ``changed_numbers.py``'s; what a reused call changed, ``reused_numbers.py``'s.
Buffers the forward changes are ``state_changes.py``'s; the modes and entries of the modules,
``forward_modules.py``'s; the warning for a number changed again where nothing was saved,
``stored_state.py``'s.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .changed_numbers import ChangedNumbers
from .module_state import ModuleDicts, torch_nn_class
from .plain_values import (ABSENT, CHANGED_BY_A_CALL, CONTAINERS, NOT_STATE, OURS, BoundObject,
                           Contents, InPlace, Mixed, Refilled, ReplacedNames, Rewritten,
                           TensorHeld, TupleHeld, immutable, plain_container, plain_entry,
                           read_entries, same_entry, small_detached, small_tuple,
                           value_differs)
from .reused_numbers import MadeNumbers

__all__ = ["NumbersGlance", "NumbersWatch", "glanced_dicts", "numbers_read",
           "reads_changed_state"]

_HELD = (TensorHeld, TupleHeld)  # put back for the replay as the forward read them


# NOTE [values read, then changed by a later call]: a call that only reads a small tensor
# attribute (RevIN's denormalisation reading the `self.mean` and `self.stdev` its normalisation
# call set) changes nothing of it, so nothing was put back for its replay; with two
# micro-batches before one backward, the first one's replay read the second one's statistics,
# every gradient off, silently (helpers OD, OH; a buffer is snapshotted there: NOTE [state
# read, then changed by a later call] in state_changes.py). So a watched call keeps the small
# tensors (and tuples of them) its forward read, by reference (``ChangedNumbers.read``: already
# read, nothing copied; at most 64 KiB kept alive per tensor the module lets go), and its replay
# is given back each that the attribute no longer holds by then, with what the attribute held
# then back after the replay (one changed in place since is read as it is: the clone of its
# values taken at such calls is not kept, it would hold a copy of every small tensor a call
# only read, helper OL). A layer whose replay was given one back (whoever rebound it: a head
# reading statistics an unwrapped call sets, helper OH; a forward hook logging a norm there,
# which costs that layer its small buffers' clones at every call, helper OL), or that read one
# a checkpointed call replaced (``CHANGED_BY_A_CALL``: a rotary table one layer rebuilds, which
# the others only read, helper OK), is watched at every call from then on, as a stateful one:
# before that, only at its first calls (a table first rebuilt after them is read as it is
# then). Not numbers (a float statistic): giving back one that changed since the forward would
# undo a later replay's own change (a count made only under grad: NOTE [a key only the replay
# changes] in changed_numbers.py); read as it is (documented), but where it sits beside a
# tensor or buffer given back (the key of a table) or a value the forward changed (NOTE [a key
# read beside a table given back] in changed_numbers.py).
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
    (``immutable``: an int, float, bool, str, None, an enum member, a ``torch.Size`` or a
    tuple or namedtuple of such, a NumPy scalar) by value, a small container of such values
    (a list, dict, set, defaultdict, Counter, OrderedDict or deque of at most 64 entries: a
    count per expert, the lengths seen, a window of recent loads) by its entries, tensors by
    weak reference, others by id. Those the forward set anew, deleted, or changed from such a
    value (to another value or to an object: a number replaced by a tensor) are put back as the
    forward began for the replay, and get what they held when the replay began back after it (a
    later micro-batch's forward, or the caller, may have changed them since). A container is the
    same object throughout: one changed in place (a dict's order too: a round robin's
    ``move_to_end``) gets its entries put back, in place, and its entries at the replay's start back
    after it (so entries only the replay adds, a log it appends to, are dropped, as eager never made
    them; but a dict's key only the replay changes: NOTE [a key only the replay changes] in
    changed_numbers.py); one the forward rebound or deleted is put back as a new container
    holding the entries read (the object read may have other holders, and stays as it is).
    One the forward filled in place with anything else (tensors it collects, a cache of projections
    the caller empties each step) gets its entries put back all the same, but is known by id only
    (``Refilled``): held until the replay, it would keep those tensors alive after the caller let go
    of it. Those holding another object that the forward rebound (a cache kept as a plain tensor
    attribute, rebuilt with its length; a tensor it consumed, set to None) are read by the replay as
    they are (no tensor over 64 KiB is held from the forward to the replay; a smaller one without a
    graph is put back: NOTE [small tensor attributes as the forward read them] in plain_values.py),
    and after the replay, one the replay rebound again gets back what it held when the replay began:
    otherwise an earlier micro-batch's replay, run last, left its shorter rebuild paired with the
    later micro-batch's length (a table computed from a parameter too), or its stored output in
    place of the last one's. A leaf requiring grad that the replay stored stays, for the made-leaf
    check to refuse. One only the replay changes keeps its change, as for buffers.

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

    __slots__ = ("dicts", "before", "changed_dicts")

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
        self.before = [read_entries(d, clones, mixed=mixed) for d in dicts]
        self.changed_dicts: set[int] = set()  # those changed() found changed, by id

    def changed(self) -> ChangedNumbers | None:
        """The entries the forward changed, each with what it held before the forward;
        ``None`` when it changed none."""
        found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = []
        ends: dict[int, Any] = {}  # NOTE [a key only the replay changes] (changed_numbers.py)
        for d, before in zip(self.dicts, self.before):
            now = read_entries(d)
            if now == before:  # the usual case: one C-level comparison
                continue
            values: list[tuple[str, Any]] = []
            rebound: list[str] = []
            for name, entry in now.items():
                was = before.get(name)
                if was is None:
                    values.append((name, ABSENT))  # set anew: the replay runs without it
                elif was[0]:
                    if not entry[0] or value_differs(entry[1], was[1]):
                        values.append((name, was[1]))  # a value changed, or replaced
                elif entry != was:
                    if type(was[1]) in _HELD and (kept := was[1].as_read()) is not None:
                        # NOTE [small tensor attributes as the forward read them]; a tuple of
                        # them (TupleHeld)
                        values.append((name, kept))
                        # NOTE [values read, then changed by a later call]
                        d.setdefault(CHANGED_BY_A_CALL, ReplacedNames()).names.add(name)
                    elif type(was[1]) in _HELD and was[1].moved():
                        # NOTE [a tensor attribute changed in place, not held] (plain_values.py)
                        values.append((name, Rewritten(was[1].tensors())))
                    elif type(was[1]) is not Contents:
                        rebound.append(name)  # an object rebound (or consumed): read as it is
                    elif type(entry[1]) is Contents or d[name] is not was[1].held or \
                            plain_container(d[name], most=float("inf")):
                        values.append((name, was[1]))  # its entries changed, or rebound
                        if type(entry[1]) is Contents and entry[1].held is was[1].held:
                            ends[id(was[1])] = entry[1].entries  # as the forward left it
                    else:  # filled in place with something else (tensors): not held
                        values.append((name, Refilled(was[1])))
            for name, was in before.items():
                if name not in now:  # deleted by the forward
                    if was[0] or type(was[1]) is Contents:
                        values.append((name, was[1]))
                    elif type(was[1]) in _HELD and (kept := was[1].as_read()) is not None:
                        values.append((name, kept))
                    else:
                        rebound.append(name)
            if values or rebound:
                found.append((d, values, rebound))
                self.changed_dicts.add(id(d))  # read() keeps its plain values then
        return ChangedNumbers(found, ends=ends) if found else None

    def read(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """NOTE [values read, then changed by a later call]: each dict with the small tensors
        (and tuples of them) the forward read there; with them, where the module holds
        buffers, or where the forward changed that dict, the plain values it read and left as
        they were, by value, and the count of replays that changed that dict by then (NOTE [a
        key read beside a table given back] in changed_numbers.py). Nothing else of what was
        read is kept (a list the forward fills, which the caller replaces, is not held: helper
        CN)."""
        found = []
        for d, before in zip(self.dicts, self.before):
            changed = id(d) in self.changed_dicts
            held: dict[str, Any] = {name: (False, _without_clone(was[1]))
                                    for name, was in before.items()
                                    if not was[0] and type(was[1]) in _HELD}
            if held or d.get("_buffers") or changed:
                # Not one the forward changed (helper PA: a one-time init flag given back
                # where the forward's changes were dropped ran the init again).
                plain = [(name, was) for name, was in before.items()
                         if was[0] and same_entry(d.get(name, ABSENT), was[1])]
                if plain:
                    marks = d.get(CHANGED_BY_A_CALL)
                    held.update(plain)
                    held[CHANGED_BY_A_CALL] = (None, 0 if marks is None else marks.count)
            if held:
                found.append((d, held))
        return found

    def made(self) -> MadeNumbers | None:
        """What the call changed of the values and small containers of the one ``__dict__``
        read (NOTE [state a reused call changes] in frozen.py); ``None`` when nothing."""
        d, before = self.dicts[0], self.before[0]
        now = read_entries(d, mixed=True)
        if now == before:
            return None
        made: list[tuple[str, Any, Any]] = []
        for name in [*before, *(name for name in now if name not in before)]:
            was, entry = before.get(name), now.get(name)
            if entry == was:
                continue
            if entry is not None and not plain_entry(entry) and \
                    type(entry[1]) is not TensorHeld:
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
                # identity: `Mixed` in a reused call's watch): in place where it is the
                # call's own container, else in a new one (the caller's, put there since, is
                # left as they changed it: helpers HP, HR). So the next call of the same
                # forward finds what the last one left (a router called once per chunk,
                # helper HL). A plain object the call changes in place (a namespace a router
                # counts in) is read by its attributes, as such a container. What the replay
                # writes into gets what it held when the replay began back after it (NOTE
                # [what the replay writes into is put back after it] in plain_values.py). Read
                # one level deep: a tensor memoised deeper, in slots, or as a dict subclass's
                # attribute is not put back (documented). Held from the call to the replay: the
                # object and what it held.
                value = d[name]
                filled = was is not None and type(was[1]) in (Contents, Mixed) and \
                    was[1].held is value
                made.append((name, was, Contents(value) if filled and
                             type(value) in CONTAINERS else BoundObject(value)))
                continue
            if was is not None and not plain_entry(was):
                continue  # an object before: read as it is (the forward's put-back skips it)
            if was is not None and entry is not None and type(was[1]) is TensorHeld and \
                    type(entry[1]) is TensorHeld and \
                    (tensor := entry[1].ref()) is not None and tensor is was[1].ref():
                # A small tensor attribute the call changed in place (DeepSeek-V3's token
                # count per expert kept as a plain attribute: `self.counts += bincount(ids)`,
                # helper HV): the replay reads its own copy of the values the forward began
                # with (NOTE [small tensor attributes as the forward read them]), and gets the
                # call's values written into that copy; the caller's tensor is left alone.
                made.append((name, was, InPlace(tensor.detach().clone())))
                continue
            # A tensor stored where a value was (`self.last = scores`, None before) by weak
            # reference: the replay, which skips the call, gets it while someone holds it
            # (the module, until the replay puts back the value; the frame, a result).
            made.append((name, was, ABSENT if entry is None else entry[1]))
        return MadeNumbers(d, made) if made else None


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
            for name in (d.keys() | before.keys()) - NOT_STATE:
                if name.startswith(OURS):
                    continue
                was, now = before.get(name, ABSENT), d.get(name, ABSENT)
                if was is now:
                    continue
                if was is ABSENT:
                    changed.append((name, ABSENT))  # set anew: the replay runs without it
                elif immutable(was):
                    if now is ABSENT or not immutable(now) or value_differs(now, was):
                        changed.append((name, was))
                elif (isinstance(was, torch.Tensor) and small_detached(was)) or small_tuple(was):
                    # NOTE [small tensor attributes as the forward read them] (TupleHeld)
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


def reads_changed_state(read: list[tuple[dict[str, Any], dict[str, Any]]], /) -> bool:
    """Whether a call read a small tensor attribute that some checkpointed call's forward
    replaced (NOTE [values read, then changed by a later call]: a rotary table one layer
    rebuilds, which another layer only reads, helper OK)."""
    return any((replaced := d.get(CHANGED_BY_A_CALL)) is not None and
               not replaced.names.isdisjoint(held) for d, held in read)


def _without_clone(held: Any, /) -> Any:
    """A ``TensorHeld`` without the clone of its values (taken at calls where small buffers
    are cloned): kept from the forward to the replay, it would hold a copy of every small
    tensor the call only read, uncounted (helper OL); one changed in place since is then
    read as it is. A ``TupleHeld`` holds no copy."""
    if type(held) is not TensorHeld or held.values is None:
        return held
    light = copy.copy(held)
    light.values = None
    return light
