"""The hooks a call's forward ran with, put back for its replay.

NOTE [the replay runs the forward's hooks]: a module hook inside a boundary (a forward hook or
pre-hook that rewrites what a submodule returns or receives, a full backward hook that scales
a gradient, a global module hook) runs in the original pass and again in the replay, where
backward differentiates what it computed. Eager backpropagates through what the hooks did at
the forward, and a full backward hook registered then runs in backward even if removed since
(torch gives its graph the hooks of that moment). A hook removed between the forward and its
backward (an activation-patching or clipping context, ``with model.hooks(...)``, that exits
before ``loss.backward()``) would be missing from the replay, and one added in between would
run in it, and either gave other gradients, silently (helper EU: 0.41 on a weight). So the
boundary reads, at each call, whether any module inside it (or the process, for global hooks)
has a user hook; the usual call has none, and that read is all it costs (a few dict lookups
per submodule). A call that has some keeps a copy of each such module's hook tables, taken
before fn runs (a hook that removes itself in the forward ran there), joined after it by the
user hooks the forward registered (a first call installing one before its submodule runs:
``registered()`` moved). At the replay the user
hooks are read again; where they differ from the forward's, the forward's are put in the
tables for the replay (in the forward's order) and the tables are put back as they were
after it. Hooks of torch and of this library (FSDP's, a ``FlopCounterMode``'s module tracker,
the recorder) are left as they are now: they follow the modes and wrappers in force, not the
user's forward. Global hooks are the process's: a replay that puts them back changes them for
its own duration for every thread (only when they changed between a forward and its backward).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from .hook_outputs import is_library_hook

__all__ = ["HookTables", "backward_or_global_hooks", "registered"]

# Tables of hooks, each with the tables of flags by hook key that belong to it.
_TABLES = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_backward_pre_hooks": (),
    "_backward_hooks": (),
}
_NAMES = (*_TABLES, *(flags for tables in _TABLES.values() for flags in tables))
_FORWARD_PRE, _FORWARD, _BACKWARD_PRE, _BACKWARD = map(operator.itemgetter, _TABLES)
_FULL_FLAG = "_is_full_backward_hook"  # which kind of backward hooks the tables hold


class _Tables:
    """The hook tables of one module (its ``__dict__``) or of the process (``d`` ``None``:
    module-level in torch.nn.modules.module, named with ``_global``)."""

    __slots__ = ("d", "key")

    def __init__(self, d: dict[str, Any] | None, /) -> None:
        self.d = d
        self.key = id(d) if d is not None else 0

    def table(self, name: str, /) -> Any:
        if self.d is not None:
            return self.d.get(name)
        return getattr(_nn_module, "_global" + name, None)  # no global pre-hook kwargs table

    def flag(self) -> Any:
        if self.d is not None:
            return self.d.get(_FULL_FLAG)
        return _nn_module._global_is_full_backward_hook

    def set_flag(self, value: Any, /) -> None:
        if self.d is None:
            _nn_module._global_is_full_backward_hook = value
        elif _FULL_FLAG in self.d:
            self.d[_FULL_FLAG] = value

    def hooked(self) -> bool:
        return any(self.table(name) for name in _TABLES)


def _places(dicts: Sequence[dict[str, Any]], /) -> list[_Tables]:
    return [*map(_Tables, dicts), _Tables(None)]


def backward_or_global_hooks(dicts: Sequence[dict[str, Any]], /) -> bool:
    """Whether any of the modules (``dicts``: each a module's ``__dict__``) has a backward
    hook, or the process a hook of any kind: the usual answer is no, in C-level passes. (The
    boundary reads their forward hooks anyway: hooked_modules in hook_outputs.py.)"""
    return bool(any(map(_BACKWARD, dicts)) or any(map(_BACKWARD_PRE, dicts)) or
                _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks or
                _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)


def _any_hooks(dicts: Sequence[dict[str, Any]], /) -> bool:
    return bool(any(map(_FORWARD, dicts)) or any(map(_FORWARD_PRE, dicts)) or
                backward_or_global_hooks(dicts))


def registered() -> int:
    """A count that moves whenever a hook table may have gained a hook: each registration
    (torch numbers hooks) and each fill of tables by a replay (which puts hooks back without
    registering them: an inner boundary's forward ran inside an outer replay that had taken a
    hook out; helper EX)."""
    return RemovableHandle.next_id + _FILLS[0]


_FILLS = [0]  # fills of hook tables by replays, for registered()
# NOTE [one replay fills tables at a time]: a replay fills the tables, runs the forward and puts
# back what it found. Two overlapping on two threads (backwards of two layers; a submodule or
# global hooks both reach) each found the other's filled tables and put them back, leaving a
# removed hook registered for good (helper EX): the fills are serialized. The lock is held
# while a replay's forward runs only, not its backward (where nested replays run), and only
# where the hooks changed between a forward and its backward; a replay's forward that waits for
# another thread which needs it blocks (helper FA; documented in limits.md).
_FILLING = threading.RLock()


def _user_keys(dicts: Sequence[dict[str, Any]], /) -> tuple[int, ...]:
    """The keys of the user hooks (neither torch's nor this library's) of the modules and of
    the process, sorted; torch numbers hooks uniquely across tables."""
    return tuple(sorted(key for place in _places(dicts) for name in _TABLES
                        for key, hook in (place.table(name) or {}).items()
                        if not is_library_hook(hook)))


class HookTables:
    """NOTE [the replay runs the forward's hooks]: the hook tables of a call's modules (and
    of the process) as the forward began, taken only when some module has a user hook."""

    __slots__ = ("dicts", "keys", "copies")

    def __init__(self, dicts: Sequence[dict[str, Any]], /) -> None:
        self.dicts = dicts
        self.keys = _user_keys(dicts)
        # Copies of the tables (flags included) of each place with a hook, by place; empty
        # when there is no user hook.
        self.copies: dict[int, dict[str, Any]] = {}
        if self.keys:
            self.copies = {place.key: _copied(place) for place in _places(dicts)
                           if place.hooked()}

    @classmethod
    def none(cls, dicts: Sequence[dict[str, Any]], /) -> HookTables:
        """The tables of a forward that had no user hook."""
        tables = cls.__new__(cls)
        tables.dicts, tables.keys, tables.copies = dicts, (), {}
        return tables

    @classmethod
    def replay(cls, forward: HookTables | None, dicts: Sequence[dict[str, Any]], epoch: int,
               /) -> AbstractContextManager[None] | None:
        """What puts the forward's user hooks back for the replay, or ``None`` where the user
        hooks now are the forward's (``forward`` ``None``: a forward without any hook; ``dicts``
        the modules' then; ``epoch``: ``registered()`` then)."""
        if forward is None:
            # The usual case: no hook then, and none registered or put back anywhere since (a
            # removal cannot add one), or none now.
            if registered() == epoch or not _any_hooks(dicts) or not _user_keys(dicts):
                return None
            forward = cls.none(dicts)
        elif _user_keys(dicts) == forward.keys:
            return None
        return forward.reinstated()

    def joined(self, dicts: Sequence[dict[str, Any]], /) -> HookTables:
        """These tables (taken before the forward) with the user hooks the forward registered
        (and kept): a hook a first call installs before its submodule runs ran in the forward,
        so it runs in the replay too (helper EX); one a hook removed while the forward ran is
        in these already. Which hooks ran is not recorded: one registered after its module ran
        joins too, and a hook that removes and registers itself again runs twice in the replay
        (helper FA; documented)."""
        after = HookTables(dicts)
        if not after.keys:
            return self
        joined = HookTables.__new__(HookTables)
        joined.dicts = dicts
        joined.keys = tuple(sorted({*self.keys, *after.keys}))
        joined.copies = dict(after.copies)
        for key, before in self.copies.items():
            later = after.copies.get(key)
            joined.copies[key] = before if later is None else _united(before, later)
        return joined

    @contextmanager
    def reinstated(self, /) -> Iterator[None]:
        """The forward's user hooks in place for the block, the tables put back after it."""
        with _FILLING:  # NOTE [one replay fills tables at a time]
            now = [(place, _copied(place)) for place in _places(self.dicts)
                   if place.key in self.copies or place.hooked()]
            for place, current in now:
                _fill(place, _merged(self.copies.get(place.key), current))
            try:
                yield
            finally:
                for place, current in now:
                    _fill(place, current)


def _united(before: dict[str, Any], after: dict[str, Any], /) -> dict[str, Any]:
    """Tables holding the hooks of ``before`` in their order, then those ``after`` added."""
    united: dict[str, Any] = {}
    for name in {*before, *after} - {_FULL_FLAG}:
        table = OrderedDict(before.get(name, {}))
        for key, value in after.get(name, {}).items():
            table.setdefault(key, value)
        united[name] = table
    united[_FULL_FLAG] = after.get(_FULL_FLAG) or before.get(_FULL_FLAG)
    return united


def _copied(place: _Tables, /) -> dict[str, Any]:
    copies: dict[str, Any] = {name: OrderedDict(table) for name in _NAMES
                              if (table := place.table(name)) is not None}
    copies[_FULL_FLAG] = place.flag()
    return copies


def _merged(forward: dict[str, Any] | None, now: dict[str, Any], /) -> dict[str, Any]:
    """Tables holding the user hooks of ``forward`` (in its order) and the hooks of torch and
    this library of ``now``, with the flags of each hook kept."""
    was_all = forward or {}
    merged: dict[str, Any] = {}
    for name, flag_tables in _TABLES.items():
        if name not in now:
            continue
        was, current = was_all.get(name, {}), now[name]
        table = OrderedDict((key, hook) for key, hook in was.items()
                            if not is_library_hook(hook) or key in current)
        for key, hook in current.items():
            if key not in table and is_library_hook(hook):
                table[key] = hook
        merged[name] = table
        for flags in flag_tables:
            if flags in now:
                both = {**was_all.get(flags, {}), **now[flags]}
                merged[flags] = OrderedDict((key, both[key]) for key in table if key in both)
    merged[_FULL_FLAG] = now[_FULL_FLAG] if forward is None else forward[_FULL_FLAG]
    return merged


def _fill(place: _Tables, tables: dict[str, Any], /) -> None:
    """Fill ``place``'s tables in place: torch's handles hold the table objects, and so may
    compiled code's guards."""
    _FILLS[0] += 1  # under _FILLING
    for name, table in tables.items():
        if name == _FULL_FLAG:
            place.set_flag(table)
        else:
            target = place.table(name)
            target.clear()
            target.update(table)
