"""What a forward changed of its modules' plain values, put back as the forward began for its
replay and as the replay began after it (``ChangedNumbers``, made by ``forward_numbers.py``'s
watch): NOTE [a key only the replay changes], NOTE [a graph tensor kept on a module].
"""

from __future__ import annotations

import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .eager import user_stacklevel
from .errors import CheckpointError
from .forward_modules import REINSTATED
from .kernel_written import WrittenThroughData, sums_moved
from .plain_values import (ABSENT, AFTER_REPLAY, CHANGED_BY_A_CALL, OURS, Contents, Refilled,
                           ReplacedNames, Rewritten, ValuesRead, entries_of, fresh_values,
                           put_entries, same_entry, tuple_tensors)

__all__ = ["ChangedNumbers", "EndedAfterACall", "with_written"]

# NOTE [a key read beside a table given back]: a cache keyed by a plain value (ultralytics'
# Detect head rebuilds `self.anchors` where `self.shape != p.shape`; a position table keyed by
# `self.hw`, as a small attribute or a buffer) that one call only reads and a later call, before
# the first one's backward, rebuilds for another size: the first call's replay is given back the
# table it read (NOTE [values read, then changed by a later call] in forward_numbers.py; a
# buffer bound anew since, by NOTE [the replay sees the forward's modules] in
# forward_modules.py), but it read the key as the later call left it, rebuilt the table, and
# kept its rebinding of the key (a change only the replay makes), while the table got what it
# held as the replay began back after it: key and table ended the step apart, and the next step
# used a table of another size (a wrong loss, or a size mismatch; helper OX). So where a replay
# is given back a small tensor the forward only read, reads a buffer bound anew since, or is
# given back a value its forward changed in that ``__dict__`` (a warm-up count, beside the
# freeze flag it sets: helper PK), the plain values the forward read and left in that
# ``__dict__`` (kept by value from the forward) are given back too where they changed since, but
# not where a replay changed them (``ReplacedNames.stamps``, noted after each watched replay: a
# count only replays make, under grad, is the module's own, and was dropped where a streaming
# state buffer is bound anew each call: helper PA; a change by a call outside any boundary, a
# head using the table or a rollout under no_grad, is given back: helper PF), and get what they
# held as the replay began back after it; a number given back that the replay changed (a count
# made only under grad, which a direct call changed too) gets the replay's change on top of that
# (helper PI; a number a replay alone assigns is taken so too, and a float's sums come in
# another order: documented, helper PL).


_COUNTS = (int, float)  # by exact type: not a bool flag


class EndedAfterACall:
    """What a container or object a reused call counts in held as the forward ended, where it
    was read from the call on (``with_reused_calls``), not as the forward began (NOTE [a key
    only the replay changes])."""

    __slots__ = ("entries",)

    def __init__(self, entries: Any, /) -> None:
        self.entries = entries


class ChangedNumbers:
    """What a forward changed of its modules' plain values and attributes (NOTE [numbers and
    flags as the forward began]), for its replay."""

    __slots__ = ("found", "ends", "read", "written", "gave_back", "given_plain")

    def __init__(self, found: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]],
                 /, *, ends: dict[int, Any] | None = None,
                 read: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
                 written: WrittenThroughData | None = None) -> None:
        self.found = found
        # By the id of a dict's entries as the forward began, its entries as the forward left
        # it (NOTE [a key only the replay changes]); ``EndedAfterACall`` where the entries
        # were read at a reused call (with_reused_calls).
        self.ends = {} if ends is None else ends
        # NOTE [values read, then changed by a later call] (forward_numbers.py): each dict
        # with the small tensors the forward read there.
        self.read = [] if read is None else read
        # NOTE [a parameter written through .data] (kernel_written.py)
        self.written = written
        self.gave_back = False  # whether a replay was given back a value only read
        # The plain values the last replay was given back, by dict id and name (NOTE [a key
        # read beside a table given back])
        self.given_plain: dict[tuple[int, str], Any] = {}

    def joined(self, other: ChangedNumbers | None, /) -> ChangedNumbers:
        """This and ``other`` (changes of other dicts) as one."""
        return self if other is None else ChangedNumbers(
            [*self.found, *other.found], ends={**self.ends, **other.ends},
            read=[*self.read, *other.read], written=self.written or other.written)

    def snapshots(self) -> list[torch.Tensor]:
        """The small tensor attributes held from the forward to the replay, alone or in a
        tuple (NOTE [small tensor attributes as the forward read them]; TupleHeld), and the
        copies of the values of those changed in place, for the census
        (Mechanism.MODULE_STATE)."""
        found: list[torch.Tensor] = []
        # (Not those only read: the module holds them too, as the call ends.)
        for _, values, _ in self.found:
            for _, value in values:
                if type(value) is ValuesRead:
                    found.append(value.values)
                elif isinstance(value, torch.Tensor):
                    found.append(value)
                elif isinstance(value, tuple):  # a tuple of them (TupleHeld)
                    found.extend(tuple_tensors(value))
        return found

    def _found(self) -> list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]]:
        """``found``, with the small tensors (or tuples of them) the forward only read where
        the attribute holds another object by now: NOTE [values read, then changed by a later
        call] in forward_numbers.py; and beside them the plain values read there: NOTE [a key
        read beside a table given back]."""
        if not self.read:
            return self.found
        covered = {(id(d), name) for d, values, rebound in self.found
                   for name in [*(name for name, _ in values), *rebound, None]}
        given: list[tuple[dict[str, Any], list[tuple[str, Any]], list[str]]] = []
        self.given_plain = {}
        for d, before in self.read:
            values = []
            plain = []
            marks = d.get(CHANGED_BY_A_CALL)
            for name, was in before.items():
                if (id(d), name) in covered:
                    continue
                elif name == CHANGED_BY_A_CALL:  # how many replays had changed the dict
                    continue
                elif was[0]:  # a plain value, by value: not one a replay changed since
                    if marks is None or \
                            marks.stamps.get(name, 0) <= before[CHANGED_BY_A_CALL][1]:
                        plain.append((name, was[1]))
                # (Else a TensorHeld or TupleHeld: NumbersWatch.read keeps no other entry.)
                elif (kept := was[1].as_read()) is not None and d.get(name) is not kept:
                    values.append((name, kept))
            # A buffer bound anew since: the replay reads the forward's (REINSTATED); or a
            # value the forward changed there, put back as it began: the flag it read beside
            # it too (helper PK: a warm-up count put back, its freeze flag read as a later
            # micro-batch flipped it).
            if values or plain and (id(d.get("_buffers")) in REINSTATED.get() or
                                    (id(d), None) in covered):
                for name, value in plain:
                    if not same_entry(d.get(name, ABSENT), value):
                        values.append((name, value))
                        self.given_plain[(id(d), name)] = value
            if values:
                given.append((d, values, []))
        if not given:
            return self.found
        # The layer is watched from then on, whoever rebound it (an unwrapped call, as a
        # RevIN's normalisation outside the layer, helper OH; or a logging hook, whose cost
        # that is: helper OL)
        self.gave_back = True
        return [*self.found, *given]

    def _counted(self, d: dict[str, Any], name: str, at_start: Any, /) -> Any:
        """What ``name`` gets after the replay: its value at the replay's start, or, for a
        number given back that the replay changed (a count made only under grad, beside a
        direct call of the module that changed it too: helper PI), the replay's change on top
        of it, as the replay made it on the value given (NOTE [a key read beside a table
        given back])."""
        given = self.given_plain.get((id(d), name), ABSENT) if self.given_plain else ABSENT
        end = d.get(name, ABSENT)
        if given is ABSENT or type(end) not in _COUNTS or type(given) not in _COUNTS or \
                type(at_start) not in _COUNTS or end == given:
            return at_start
        return at_start + (end - given)

    @contextmanager
    def as_forward_began(self, where: str = "the layer", roots: Sequence[nn.Module] = (), /
                         ) -> Iterator[None]:
        """The changed values as the forward began, for the block; the values, and the objects
        the forward rebound, as the block began, after it. ``where`` names the call for
        NOTE [a graph tensor kept on a module], and ``roots`` (the call's modules) the paths
        of attributes in refusals. A small tensor the forward only read, replaced since, is
        given back too (NOTE [values read, then changed by a later call] in forward_numbers.py);
        one still as read is left alone, so a change only the replay makes stays (NOTE [a key
        only the replay changes]). After the block: NOTE [a parameter written through .data]
        in kernel_written.py."""
        changes = self._found()
        at_start = [(d, [(name, d.get(name, ABSENT))
                         for name in [*(name for name, _ in values), *rebound]])
                    for d, values, rebound in changes]
        # NOTE [a key read beside a table given back]: the plain values read, as the replay
        # begins, to tell which the replay changes (and keeps).
        plain_at_start = [(d, [(name, d.get(name, ABSENT)) for name, was in before.items()
                               if was[0]])
                          for d, before in self.read if CHANGED_BY_A_CALL in before]
        # A container the forward changed in place also gets its entries back after the block
        # (the object is the same, so putting it back as an object would not), with what it
        # held as the forward began: a dict's keys the forward left alone keep what the block
        # made of them (NOTE [a key only the replay changes]).
        entries_at_start: list[tuple[Any, Any, Any]] = []
        for d, values, _ in changes:
            for name, value in values:
                held = d.get(name)
                if (type(value) is Contents and held is value.held) or \
                        (type(value) is Refilled and value.holds(held)):
                    ended = self.ends.get(id(value))
                    entries_at_start.append((held, entries_of(held), None if ended is None
                                             else (value.entries, ended)))
        # A small tensor attribute changed in place: a fresh copy of its values as read, for
        # this block alone (NOTE [small tensor attributes as the forward read them]), one per
        # tensor, whatever number of modules hold it.
        fresh: dict[int, torch.Tensor] = {}
        # One changed in place that was not held: a copy of its values as they are now, for
        # this block alone too (NOTE [a tensor attribute changed in place, not held] in
        # plain_values.py).
        copies: dict[int, torch.Tensor] = {}
        for d, values, _ in changes:
            for name, value in values:
                if type(value) is Rewritten and (why := value.graph_read(d.get(name))):
                    _refuse_a_graph_rewritten(where, _path(roots, d, name), why)
        found = [(d, [(name, fresh_values(value, fresh) if type(value) is ValuesRead else
                       value.for_replay(d.get(name, ABSENT), copies) if type(value) is Rewritten
                       else value)
                      for name, value in values]) for d, values, _ in changes]
        # One new container per container read, whatever number of names held it (a log a
        # layer shares with its submodule stays one list in the replay: helper HS).
        made: dict[int, Any] = {}
        for d, values in found:
            _set(d, values, made)
        put = {(id(d), name): value for d, values in found for name, value in values
               if isinstance(value, torch.Tensor)}
        pending: list[tuple[Any, Any]] = []
        outer = AFTER_REPLAY.get()
        try:
            AFTER_REPLAY.set(pending)  # NOTE [context variables set inside the try] (keep.py)
            yield
            if self.written is not None:
                self.written.refuse_written_again(where)
        finally:
            AFTER_REPLAY.set(outer)
            restored = {id(held) for held, _, _ in entries_at_start}
            for held, snapshot in reversed(pending):  # the NOTE at AFTER_REPLAY (plain_values.py)
                if id(held) not in restored:
                    put_entries(held, snapshot)
            at_calls: dict[int, Any] = {}  # what each held at the replay's first call
            for held, snapshot in pending:
                at_calls.setdefault(id(held), snapshot)
            done: set[int] = set()
            for held, entries, forward in entries_at_start:
                # Each object once, by its first entry: a plain object of a reused call's module
                # is read as an argument too (with_reused_calls puts that entry first), and a
                # second, unmerged put-back after it dropped a count only the replay made
                # (helper IW)
                if id(held) in done:
                    continue
                done.add(id(held))
                ended = forward[1] if forward is not None else None
                at_call = None
                if type(ended) is EndedAfterACall:
                    ended, at_call = ended.entries, at_calls.get(id(held))
                    if at_call is None:  # no call found it in the replay: nothing to tell by
                        ended = None
                if ended is not None and not isinstance(held, (list, set, deque)):
                    # a dict's items, or a plain object's attributes (helper IR)
                    factory = held.default_factory if isinstance(held, defaultdict) else None
                    put_entries(held, _merged(entries, forward[0], ended, entries_of(held),
                                              factory, at_call))
                elif ended is not None and _only_added(
                        entries, forward[0], ended, entries_of(held), at_call,
                        held.maxlen if isinstance(held, deque) else None):
                    pass  # the replay's additions kept (NOTE [a key only the replay changes])
                elif not _holds_a_leaf_it_made(held, entries):
                    put_entries(held, entries)
            # What the replay read there: a small tensor put back, else what it held.
            _warn_graph_tensors_kept([(d, [(name, put.get((id(d), name), left))
                                           for name, left in named])
                                      for d, named in at_start], where)
            for d, named in at_start:
                # A leaf requiring grad that the replay stored stays (`self.last = leaf`, made
                # in the forward): the check that reads it once the replay's graph is gone
                # (NOTE [leaves the call makes] in refusals.py) must find it held, and refuse.
                _set(d, [(name, self._counted(d, name, value)) for name, value in named
                         if not (isinstance(now := d.get(name), torch.Tensor) and
                                 now.requires_grad and now.grad_fn is None)])
            for d, named in plain_at_start:  # what the replay changed and kept: its own
                moved = [name for name, value in named
                         if not same_entry(d.get(name, ABSENT), value)]
                if moved:
                    d.setdefault(CHANGED_BY_A_CALL, ReplacedNames()).note(moved)


# NOTE [a key only the replay changes]: a dict the forward changed in place (or a plain object
# a reused call counts in, by its attributes: helper IR) gets what it held when the replay began
# back after it; but code run only under grad (`if
# torch.is_grad_enabled(): self.stats["steps"] += 1`, as written for torch's reentrant
# checkpoint) changes it in the replay alone, as eager's forward did, and that change was
# dropped with the rest (helper IJ: the step count stayed 0, other gradients from the second
# step). So a key the forward left as it began, and the replay changed, keeps what the replay
# made of it, as a name only the replay sets does, where nothing changed it since the forward
# began (the caller, another micro-batch's replay, a first backward of a retained graph: a
# change made on top of theirs counted twice, helper IL). Any other key gets its value at the
# replay's start back; so a key both the forward and the replay change keeps the forward's
# change only, and a second micro-batch's replay-only change is dropped (documented). One a
# reused call counts in that no module's entry holds (a global, an object argument) was read
# from the call on, not as the forward began (``EndedAfterACall``): a key the replay changed
# before the call is the forward's change made again (a log line, helper IC), so the replay's
# change is kept only for a key the replay left as the call found it until the call.
def _merged(at_start: list[tuple[Any, Any]], began: list[tuple[Any, Any]],
            ended: list[tuple[Any, Any]], after: list[tuple[Any, Any]],
            factory: Any = None, at_call: list[tuple[Any, Any]] | None = None, /
            ) -> list[tuple[Any, Any]]:
    """A dict's items after the replay (NOTE above), from its items at the replay's start, as
    the forward began (or a reused call found them) and left it, and as the replay left it;
    ``factory``: a defaultdict's; ``at_call``: what it held when the replay reached the call."""
    start, first, last, now = dict(at_start), dict(began), dict(ended), dict(after)
    call = None if at_call is None else dict(at_call)
    # A defaultdict's key the forward only read is made holding the default (helper IO: a
    # count under grad in a defaultdict(int) read by the no-grad forward stayed 0): as absent.
    default = ABSENT
    if factory in (int, float, bool, str, list, dict, set, tuple):  # a plain default only: a
        default = factory()  # factory of the user's may have side effects, or raise

    def same(a: Any, b: Any) -> bool:
        if a is ABSENT or b is ABSENT:
            other = b if a is ABSENT else a
            return other is ABSENT or default is not ABSENT and same_entry(other, default)
        return same_entry(a, b)

    merged = []
    for k in [*start, *(k for k in now if k not in start)]:
        s, b, r = start.get(k, ABSENT), first.get(k, ABSENT), now.get(k, ABSENT)
        # the replay's change alone, on the value the forward began with
        value = r if same(b, last.get(k, ABSENT)) and same(s, b) and \
            (call is None or same(call.get(k, ABSENT), b)) else s
        if value is not ABSENT:
            merged.append((k, value))
    # Its order too, where only the replay changed it (a `move_to_end` under grad: helper IO).
    order = [k for k, _ in at_start]
    if order == [k for k, _ in began] == [k for k, _ in ended]:
        replayed = [k for k, _ in after if k in start]
        if replayed != [k for k in order if k in now]:
            rank = {k: i for i, k in enumerate(k for k, _ in after)}
            merged.sort(key=lambda item: rank.get(item[0], len(rank)))
    return merged


def _only_added(at_start: Any, began: Any, ended: Any, after: Any, at_call: Any,
                maxlen: int | None, /) -> bool:
    """Whether a list, deque or set, as the replay left it (``after``), is as the forward left
    it (``ended``) with entries the replay alone added after it (a list appended to, a set
    added to: the replay's grad-gated `window.append(-1)` after a reused call, helper JG),
    where nothing changed it since the forward ended (``at_start``) and the replay reached the
    call as the call found it (``at_call``, NOTE [a key only the replay changes])."""
    if at_start != ended or after == ended or at_call is not None and at_call != began:
        return False
    if isinstance(after, set):
        return after > ended
    if len(after) > len(ended) and after[:len(ended)] == ended:
        return True
    # A full rolling window (a deque with a maxlen): the additions pushed its first entries
    # out (helper JK).
    return maxlen is not None and len(after) == maxlen and any(
        after[:maxlen - added] == ended[len(ended) - (maxlen - added):]
        for added in range(max(1, maxlen - len(ended) + 1), maxlen + 1))


def with_written(numbers: ChangedNumbers | None, params: Sequence[torch.Tensor],
                 sums: Sequence[torch.Tensor | None], name: Callable[[torch.Tensor], str], /
                 ) -> ChangedNumbers | None:
    """NOTE [a parameter written through .data] (kernel_written.py): ``numbers`` recording the
    parameters whose bits' sum moved from ``sums`` (each named by ``name``), where any did;
    the boundary's original pass and an output discard's forward both record so."""
    moved = sums_moved(params, sums)
    if not moved:
        return numbers
    numbers = numbers or ChangedNumbers([])
    numbers.written = WrittenThroughData(moved, [name(p) for p, _ in moved])
    return numbers


def _holds_a_leaf_it_made(held: Any, entries: Any, /) -> bool:
    """Whether ``held`` holds a leaf requiring grad that it did not hold as the replay began
    (``entries``): one the replay made and kept there (`self.kept.append(w)`, ``w`` made to
    require grad in the forward). As for a plain attribute (below), the container stays as the
    replay left it, for the made-leaf check to find the leaf held and refuse (NOTE [leaves the
    call makes] in refusals.py): put back, the original pass's leaf, made under no-grad with no
    graph to give it a gradient, would be what the caller reads, and eager's `.grad` silently
    None (helper JT)."""
    def values(found: Any) -> list[Any]:  # a list's, deque's or set's entries; else pairs
        return list(found) if isinstance(held, (list, deque, set)) else [v for _, v in found]

    before = {id(v) for v in values(entries)}
    # Not a parameter (a module's weight put in a list the caller clears: helper JY), which
    # the forward did not make.
    return any(isinstance(v, torch.Tensor) and v.requires_grad and v.grad_fn is None and
               not isinstance(v, nn.Parameter) and id(v) not in before
               for v in values(entries_of(held)))


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


_TOLD_GRAPH = OURS + "_told_graph_"


def _path(roots: Sequence[nn.Module], d: dict[str, Any], name: str, /) -> str:
    """``name`` of the module whose ``__dict__`` is ``d``, by its path from ``roots``."""
    for root in roots:
        for path, module in root.named_modules():
            if vars(module) is d:
                return f"{path}.{name}" if path else name
    return name


def _refuse_a_graph_rewritten(where: str, path: str, why: str, /) -> None:
    """``Rewritten.graph_read``: no replay runs as its forward did."""
    if why == "read":
        what = (f"the forward of {where} read the module attribute {path!r} holding a tensor "
                "requiring grad (a state carried with its graph, or set to one: `self.h = "
                "self.h0 * 1`) and changed it in place: the original pass wrote its values, so "
                "no replay reads them as the forward did, and each replay backpropagates into a "
                "graph made outside the call")
        got = f"{path!r} holding a tensor requiring grad, changed in place by the forward"
    else:
        what = (f"the replay of {where} reads the module attribute {path!r}, which its forward "
                "changed in place without a copy of what it read, and which holds, as the "
                "replay begins, a tensor requiring grad the forward did not read (set between "
                "the forward and backward: a learned initial state, `self.h = self.h0 * 1`): "
                "the replay would backpropagate into it, where eager gives that graph no "
                "gradient from this call")
        got = f"{path!r} holding a tensor requiring grad that the forward did not read"
    raise CheckpointError(
        what, expected="a state with a graph passed in and returned; on the module, only "
                       "tensors without grad",
        got=got,
        tip="pass the state in and return the new one (`out, h = cell(x, h)`; a learned initial "
            "state as an argument: `cell(x, h0.expand(b, -1))`); a state carried between calls "
            "may be kept detached on the module (`.detach()`), but a learned one then gets no "
            "gradient (docs/limits.md, 'State the forward changes')")


def _set(d: dict[str, Any], named: list[tuple[str, Any]],
         made: dict[int, Any] | None = None, /) -> None:
    """``d``'s names given the values read; ``made``: the new containers made so far, by the
    id of the one read (one per container, whatever number of names held it)."""
    made = {} if made is None else made
    for name, value in named:
        if value is ABSENT:
            d.pop(name, None)
        elif type(value) is Contents:
            if d.get(name) is value.held:  # changed in place: its entries as they were read
                put_entries(value.held, value.entries)
            else:  # rebound or deleted: a new one, so the object read is not changed
                key = id(value.held)
                d[name] = made[key] if key in made else made.setdefault(key, value.fresh())
        elif type(value) is Refilled:
            if value.holds(held := d.get(name)):
                put_entries(held, value.entries)
            else:  # the caller replaced it: a new one for the replay, theirs left as it is
                key = value.ident
                d[name] = made[key] if key in made else made.setdefault(key, value.fresh())
        else:
            d[name] = value
