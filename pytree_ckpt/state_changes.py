"""What the original pass of a call changes of its modules' state: the buffers and frozen
parameters it changed, copied for the replay to change (NOTE [state the forward changes], NOTE
[the replay changes copies], NOTE [small state as it was before the forward]).

Which modules and tensors a call uses is in ``module_state.py``; the modes and entries of its
modules, put back for the replay, in ``forward_modules.py``; its trainable parameters'
versions, in ``changed_in_place.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .forward_writes import note_forward_write, written_by_a_forward_since, written_since
from .kernel_written import differs, sparse_parts, view_of
from .module_state import ModuleDicts, ever_verified, graph_reaches

__all__ = ["ChangedState", "StateWatch", "is_replay_copy", "mark_replay_copy", "mark_stateful",
           "refuse_graph_read", "registered_state", "snapshots_wanted", "versions"]


def versions(tensors: Sequence[torch.Tensor], /) -> list[int | None]:
    # Inference tensors keep no version counter (and cannot be changed outside inference mode):
    # asking raises, and only then is each one asked whether it is one (read several times per
    # call: an is_inference() call per tensor costs as much as its version).
    found: list[int | None] = []
    try:
        for t in tensors:  # NOTE [loops on the per-call path] (boundary.py)
            found.append(t._version)
        return found
    except RuntimeError:
        return [None if t.is_inference() else t._version for t in tensors]


_Buffers = dict[str, "torch.Tensor | None"]  # a module's _buffers dict

# On the storage of each copy a replay runs on (NOTE [the replay changes copies]).
_REPLAY_COPY_MARK = "_pytree_ckpt_replay_copy"


def mark_replay_copy(copy: torch.Tensor, /) -> None:
    """Mark ``copy`` as the replay's own: its storage (its views are the replay's too), or, for
    a tensor without one (a sparse adjacency a graph layer keeps as a buffer: helper JS), the
    tensor itself."""
    if copy.layout is torch.strided:
        setattr(copy.untyped_storage(), _REPLAY_COPY_MARK, True)
    else:
        setattr(copy, _REPLAY_COPY_MARK, True)


def is_replay_copy(t: torch.Tensor, /) -> bool:
    """Whether ``t`` is (a view of) a tensor ``mark_replay_copy`` marked."""
    return bool(getattr(t.untyped_storage() if t.layout is torch.strided else t,
                        _REPLAY_COPY_MARK, False))


_STATEFUL = "_pytree_ckpt_stateful"


def mark_stateful(module: nn.Module, /) -> None:
    """Note that a forward of ``module`` changed its state (NOTE [small state as it was
    before the forward])."""
    module.__dict__[_STATEFUL] = True


def snapshots_wanted(module: nn.Module, /) -> bool:
    """Whether the next forward of ``module`` clones its small buffers first: at its first
    calls (until its first replay; a buffer registered since under a new name, anywhere,
    starts these again: NOTE [a new buffer is new state] in module_state.py), and once a
    forward of it changed state."""
    return bool(module.__dict__.get(_STATEFUL)) or not ever_verified(module)


class StateWatch:
    """NOTE [state the forward changes]: the replay runs ``fn`` again, and with it every change
    ``fn`` makes to its modules' buffers (BatchNorm's running statistics, a step counter, an
    EMA reassigned) and frozen parameters, which eager never repeats. The original pass notes
    which buffers changed, in place (a version counter moved), by reassignment (another object
    under a name) or by registration (a new name: every submodule's dict is watched, empty
    ones too), and which frozen parameters changed in place or were reassigned. The replay
    then runs on copies (NOTE [the replay changes copies]). A batch norm's buffers count as a
    whole, since its kernel updates the running statistics without moving their versions
    (only ``num_batches_tracked`` moves). Changes through ``.data`` (or a kernel's) move no
    version: seen only by value, at a module's first calls (NOTE [state a kernel writes] in
    kernel_written.py). The common case, nothing changed, costs one version read and one
    identity check per buffer (and, with frozen parameters, one identity check per parameter).
    """

    __slots__ = ("watched", "empty", "frozen", "frozen_versions", "trees", "frozen_entries",
                 "before", "storages", "compare", "written", "kernel_written")

    def __init__(self, dicts: Sequence[dict[str, torch.Tensor | None]],
                 frozen: Sequence[torch.Tensor], trees: Sequence[ModuleDicts], /, *,
                 snapshot: bool, compare: bool = False,
                 written: frozenset[tuple[int, int]] = frozenset()) -> None:
        # NOTE [state a kernel writes] (kernel_written.py): with ``compare`` (a module's first
        # calls; ``snapshot`` too then), dicts no version shows changed are compared by value,
        # and the places of those that changed end in ``kernel_written``; the dicts at the
        # places in ``written`` count as changed wholly. A place is (index in ``trees``, index
        # in that tree's buffer dicts); ``dicts`` are the trees' buffer dicts, in order.
        self.compare, self.written = compare, written
        self.kernel_written: frozenset[tuple[int, int]] = frozenset()
        # Most submodules have no buffer: for those only a new entry can happen, a length
        # check (about 0.05 us per submodule; 7 of them cost 0.3 us more than none).
        self.watched: list[tuple[_Buffers, tuple[tuple[str, torch.Tensor | None], ...],
                                 list[int | None]]] = []
        self.empty: list[_Buffers] = []
        # NOTE [small state as it was before the forward]: with ``snapshot`` (a module's
        # first calls, and every call once a forward of it changed state: snapshots_wanted),
        # each small buffer and frozen parameter (at most _SMALL_BYTES: a step counter,
        # running statistics, an EMA vector, spectral norm's power-iteration vectors, a MoE
        # router's correction bias kept as a frozen nn.Parameter, which the replay's top-k
        # must read as the forward's did) is saved before the forward, with
        # where it lay: its storage is cloned (once, however many buffers view it) when that
        # storage is small too, else the buffer alone. The replay's copies of the buffers the
        # forward changed are made from these, as they lay before the forward (a resize_ or
        # a t_ in the forward does not move them), sharing one storage where the buffers
        # did (tied, or views of one another), so the replay makes the forward's decisions
        # again (a periodic update keyed on a counter) and its output reads what the
        # forward's read (an EMA updated, then used). What nothing changed is dropped after
        # the forward, unless the call keeps what it read for its replay (changed(read=True):
        # NOTE [state read, then changed by a later call]). A larger buffer's copy is made
        # from what the forward left (documented); so is a small one whose module first
        # changed state after its first replay (nothing was saved).
        self.before: dict[int, tuple[Any, Any]] = {}  # by buffer id: (storage key, view_of)
        self.storages: dict[Any, torch.UntypedStorage] = {}
        if not any(dicts):  # the usual layer: no buffer at all (one C-level pass)
            self.empty = list(dicts)
        else:
            for d in dicts:
                if d:
                    items = tuple(d.items())
                    self.watched.append((d, items, _object_versions(items)))
                    if snapshot:
                        for _, t in items:
                            if t is not None and id(t) not in self.before:
                                self._save(t)
                else:
                    self.empty.append(d)
        self.frozen = frozen
        self.frozen_versions = versions(frozen) if frozen else []
        if snapshot:  # NOTE [small state as it was before the forward]: frozen parameters
            for t in frozen:
                if id(t) not in self.before:
                    self._save(t)
        self.trees = trees  # where the frozen parameters are, read only if one changed
        # Where each frozen parameter is (a forward may reassign one: an EMA kept as a frozen
        # nn.Parameter); read only when there are frozen parameters.
        self.frozen_entries = [(d, name, t) for tree in trees for d in tree.parameters
                               for name, t in d.items()
                               if t is not None and not t.requires_grad] if frozen else []

    def _save(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is not None and key[2] <= _SMALL_BYTES:
            if key not in self.storages:
                self.storages[key] = t.untyped_storage().clone()
            # Its view as well as its bytes: `.data = .data.view(...)` moves no version and
            # leaves the bytes as they were (helper MW's :118; NOTE [state a kernel writes]).
            self.before[id(t)] = (key, view_of(t))
        elif t.layout == torch.strided and not t.is_nested and not t.requires_grad and \
                not t.is_inference() and t.numel() * t.element_size() <= _SMALL_BYTES:
            # A small view of a large storage, or a conjugate or negative view (set_ would
            # drop the bit): the buffer alone, its values resolved.
            self.before[id(t)] = (None, t.detach().clone())
        elif (parts := sparse_parts(t)) is not None and not t.requires_grad and \
                sum(p.numel() * p.element_size() for p in parts) <= _SMALL_BYTES:
            self.before[id(t)] = (None, t.detach().clone())  # compared by its parts

    def _with_kernel_written(self, buffers: list[tuple[_Buffers, _Moved | None]], /
                             ) -> list[tuple[_Buffers, _Moved | None]]:
        """``buffers`` (the dicts a version or an entry shows changed) with the watched dicts
        a kernel wrote counted as changed wholly: those it found alone, and those where it
        wrote one buffer while a version moved on another (a step counter beside an EMA
        written through ``.data``: all its names get copies, the moved ones as they moved)."""
        places = {id(d): (i, place) for i, tree in enumerate(self.trees)
                  for place, d in enumerate(tree.buffers)}
        moved_in = {id(d): moved for d, moved in buffers}
        found: list[_Buffers] = []
        for d, items, _ in self.watched:
            moved = moved_in.get(id(d), [])
            if moved is None:  # a batch norm's: counted wholly already
                continue
            names = {name for name, _ in moved}
            if places[id(d)] in self.written or (self.compare and differs(
                    [t for name, t in items if name not in names], self.before,
                    self.storages)):
                found.append(d)
                rest = [(name, None) for name, t in d.items()
                        if t is not None and name not in names]
                if id(d) in moved_in:
                    moved.extend(rest)
                else:
                    buffers.append((d, None))
        if self.compare:
            self.kernel_written = frozenset(places[id(d)] for d in found)
        return buffers

    def unchanged_in_place(self, tensor: torch.Tensor, /) -> bool:
        """Whether ``tensor``, a watched buffer or frozen parameter, has the version it had
        before the forward (read for an output that is one, or a view of one: rare)."""
        for _, items, before in self.watched:
            for (_, obj), version in zip(items, before):
                if obj is tensor:
                    return version is None or tensor._version == version
        for obj, version in zip(self.frozen, self.frozen_versions):
            if obj is tensor:
                return version is None or tensor._version == version
        return True

    def buffer_viewing(self, base: torch.Tensor, /) -> torch.Tensor | None:
        """The watched buffer that is a view of ``base``, if one is: a buffer registered as a
        slice of a temporary (``emb.cos()[None, None]``), whose views have that as their base."""
        for _, items, _ in self.watched:
            for _, obj in items:
                if obj is not None and obj._base is base:
                    return obj
        return None

    def changed(self, *, read: bool = False) -> ChangedState | None:
        """What the original pass changed; with ``read``, also the snapshots of the watched
        dicts it left unchanged (NOTE [state read, then changed by a later call])."""
        if not (self.watched or self.frozen or any(self.empty)):
            return None  # no buffer nor frozen parameter, and none registered by the forward
        buffers: list[tuple[_Buffers, _Moved | None]] = []
        for d, items, before in self.watched:
            # Reassigned, or changed in place (both can happen: self.ema = ...; self.step += 1).
            if len(d) != len(items) or any(d.get(name) is not obj for name, obj in items) or \
                    _object_versions(items) != before:
                buffers.append((d, _moved(d, items, before)))
        if self.compare or self.written:  # NOTE [state a kernel writes] (kernel_written.py)
            buffers = self._with_kernel_written(buffers)
        # A buffer registered by the forward in a dict that had none.
        buffers += [(d, [(name, _ABSENT) for name in d]) for d in self.empty if d]
        in_place = {id(p) for p, v in zip(self.frozen, self.frozen_versions)
                    if not p.is_inference() and p._version != v}
        parameters: dict[int, tuple[_Buffers, _Moved]] = {}
        if in_place:
            for tree in self.trees:
                for d in tree.parameters:
                    for name, t in d.items():
                        if id(t) in in_place:
                            parameters.setdefault(id(d), (d, []))[1].append((name, None))
        for d, name, t in self.frozen_entries:
            if d.get(name) is not t:  # reassigned: the replay starts from the one before
                parameters.setdefault(id(d), (d, []))[1].append((name, t))
        # NOTE [state read, then changed by a later call]: the dicts the forward left as they
        # were, with their snapshots, for the replay to read them as the forward did.
        # So are the buffers a changed dict's forward left alone beside those it changed (an
        # eval micro-batch reads a scale changed only in training, beside a call counter:
        # helper EY), as entries of their own, copied only if a later forward changes them.
        unchanged: list[_Read] = []
        if read and self.before:
            moved_in = {id(d): moved for d, moved in buffers}
            for d, items, before in self.watched:
                if id(d) not in moved_in:
                    if any(id(t) in self.before for _, t in items):
                        unchanged.append((d, items, before, True))
                    continue
                moved = moved_in[id(d)]
                if moved is None:  # a batch norm's: copied wholly already
                    continue
                names = {name for name, _ in moved}
                kept = [(item, version) for item, version in zip(items, before)
                        if item[0] not in names and id(item[1]) in self.before]
                if kept:
                    unchanged.append((d, tuple(item for item, _ in kept),
                                      [version for _, version in kept], False))
        if not (buffers or parameters or unchanged):
            return None
        # Only the clones of what changed are kept (the forward's own, or the one it replaced),
        # and of what it read unchanged where asked.
        changed = {id(obj) for d, moved in buffers
                   for name, previous in ([(n, None) for n in d] if moved is None else moved)
                   for obj in (d.get(name), previous) if obj is not None}
        changed.update(id(obj) for d, moved in parameters.values() for name, previous in moved
                       for obj in (d.get(name), previous) if obj is not None)
        changed.update(id(t) for _, items, _, _ in unchanged for _, t in items)
        for d, moved in buffers:  # NOTE [state read, then changed by a later call]
            for name in d if moved is None else (name for name, _ in moved):
                t = d.get(name)
                if t is not None and not t.is_inference():
                    note_forward_write(t)
        saved = {i: value for i, value in self.before.items() if i in changed}
        storages = {key: self.storages[key] for key, _ in saved.values() if key is not None}
        return ChangedState(buffers, list(parameters.values()), saved, storages, unchanged)


def registered_state(dicts: Sequence[dict[str, torch.Tensor | None]], /
                     ) -> ChangedState | None:
    """``StateWatch(dicts, [], ...).changed()`` for buffer dicts that were all empty before
    the forward, and no frozen parameter: the buffers the forward registered (the boundary
    builds no watch for such a tree; this is read after the call only when one dict is no
    longer empty)."""
    buffers: list[tuple[_Buffers, _Moved | None]] = [
        (d, [(name, _ABSENT) for name in d]) for d in dicts if d]
    return ChangedState(buffers, [], {}, {}) if buffers else None


# The size limit of NOTE [small state as it was before the forward] (StateWatch.__init__):
# buffers (and their storages) up to it are saved before a forward.
_SMALL_BYTES = 64 * 1024


def _small(t: torch.Tensor, /) -> bool:
    """Small state, as ``StateWatch._save`` copies it: a strided tensor's own bytes, or a
    sparse one's parts (one first changed late was not warned of: helper NX)."""
    if t.layout == torch.strided:
        return t.numel() * t.element_size() <= _SMALL_BYTES
    parts = sparse_parts(t)
    return parts is not None and sum(p.numel() * p.element_size() for p in parts) <= _SMALL_BYTES


class _Absent:
    """An entry the forward registered: the replay runs without it, as the forward began."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()
# A buffer registered as None that the forward filled (helper EX: taken for a change in place,
# the replay read the forward's result): the replay starts from None, as the forward did.
_WAS_NONE: Any = _Absent()


def _storage_key(t: Any, /) -> Any:
    """What identifies ``t``'s storage while it is alive, for a plain strided tensor with
    bytes of its own; ``None`` for anything else (copied as it is)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested or \
            t.is_quantized or t.device.type == "meta" or t.requires_grad or \
            t.is_inference() or t.is_conj() or t.is_neg() or \
            type(t) not in (torch.Tensor, nn.Parameter):
        return None
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None


# Per changed dict: the names the replay gets copies for, each with what the name held before
# the forward: ``None`` when it was changed in place, the replaced tensor when reassigned, set
# to None or deleted (the replay starts from that one), ``_ABSENT`` when the forward
# registered it.
_Moved = list[tuple[str, Any]]
# NOTE [state read, then changed by a later call]: a dict's entries a forward read and left
# unchanged, their versions after it, and whether they are all of the dict's entries (else the
# names a changed dict's forward left alone).
_Read = tuple[_Buffers, tuple[tuple[str, "torch.Tensor | None"], ...], list[int | None], bool]


def _moved(d: _Buffers, items: tuple[tuple[str, torch.Tensor | None], ...],
           before: list[int | None]) -> _Moved | None:
    """The names in a changed buffer dict whose tensor the forward changed, reassigned or
    registered; ``None`` for all of them in a batch norm's (its kernel writes the running
    statistics without moving their versions; ``num_batches_tracked`` moves)."""
    if "num_batches_tracked" in d:
        return None
    old = {name: (obj, version) for (name, obj), version in zip(items, before)}
    # Set to None or deleted by the forward (a one-time init): the replay gets it back.
    moved: _Moved = [(name, obj) for name, (obj, _) in old.items()
                     if obj is not None and d.get(name) is None]
    for name, t in d.items():
        was = old.get(name)
        if t is None:
            continue
        if was is None:  # registered by the forward
            moved.append((name, _ABSENT))
        elif was[0] is None:  # registered as None, filled by the forward (a reset state)
            moved.append((name, _WAS_NONE))
        elif was[0] is not t:
            moved.append((name, was[0]))
        elif not t.is_inference() and t._version != was[1]:
            moved.append((name, None))
    return moved


def _one_entry_a_dict(dicts: list[tuple[_Buffers, _Moved | None]], /
                      ) -> list[tuple[_Buffers, _Moved | None]]:
    """``dicts`` with the names of a dict listed twice (a changed dict, and its names the
    forward left alone and a later forward changed) in one entry."""
    merged: dict[int, tuple[_Buffers, _Moved | None]] = {}
    for d, moved in dicts:
        seen = merged.get(id(d))
        if seen is None:
            merged[id(d)] = (d, None if moved is None else list(moved))
        elif seen[1] is not None:
            merged[id(d)] = (d, None if moved is None else seen[1] + moved)
    return list(merged.values())


def _object_versions(items: tuple[tuple[str, torch.Tensor | None], ...]) -> list[int | None]:
    """The version of each object in ``items`` (the objects themselves, wherever they are now)."""
    return [None if t is None or t.is_inference() else t._version for _, t in items]


class ChangedState:
    """What the original pass changed (NOTE [state the forward changes]).

    NOTE [the replay changes copies]: around the replay's call of ``fn``, each buffer (and
    frozen parameter) the original pass changed in place or reassigned (every buffer of a
    batch norm, whose kernel writes its running statistics without moving their versions) is
    replaced in its dict by a copy, and one it registered is taken out; the dicts get their
    entries back when ``fn`` returns, but for a name only the replay registered, reassigned or
    deleted (under ``torch.is_grad_enabled()``), where the original pass left it alone (any
    of a batch norm's counts as changed), which keeps the replay's change, as eager's forward
    made it. A small one's copy is of its value before the forward
    (NOTE [small state as it was before the forward]); a reassigned one's, of the tensor it
    replaced (still held); a larger one changed in place, of what the forward left. Copies
    of one storage share one copy of it. So the replay computes what the forward did
    (exactly so for small state; not for a layer whose output reads a larger buffer it
    changed in place, documented), and whatever it changes (a second running-statistics
    update, a reassignment, a new name) goes to the copies, which its graph saves if it
    saves anything: the tensors the forward left are not changed again, and a graph of
    another call that saved them (BatchNorm called outside the boundary in the same step)
    still finds them as it saved them. State the forward left unchanged is not copied (unless
    changed since: NOTE [state read, then changed by a later call]): a
    change only the replay makes (a count kept only where grad is enabled, so that it counts
    once under reentrant checkpointing) is the module's own. One the replay still reached
    and changed another way (a buffer a hook or a list holds too, a view of it, a buffer that
    requires grad and so is not swapped) gets its value back when ``fn`` returns, from a
    copy taken before it, and its version counter back too where it covers its whole
    storage (the copy back must not look like a change to a graph that saved it; a view's
    counter is its base's, and the rest of the base may have changed). Not around the
    replay's gradients: a backward hook that changes the state then changes the module's own
    (its change was lost in the copies).
    """

    __slots__ = ("buffers", "parameters", "before", "storages", "read", "graph_read")

    def __init__(self, buffers: list[tuple[_Buffers, _Moved | None]],
                 parameters: list[tuple[_Buffers, _Moved]], before: dict[int, tuple[Any, Any]],
                 storages: dict[Any, torch.UntypedStorage],
                 read: list[_Read] | None = None, /) -> None:
        self.buffers = buffers        # the changed buffer dicts, and what changed (None: all)
        self.parameters = parameters  # the parameter dicts with a frozen parameter changed
        self.before = before          # small changed (or read) buffers before the forward, by id
        self.storages = storages      # their storages then, by key
        # The dicts the forward read and left unchanged, and the names it left alone in those
        # it changed: entries and versions after it, and whether the entries are the dict's.
        self.read = read or []
        # The graph tensors a replay read as the forward did (NOTE [a graph tensor a forward
        # replaced]), by name: set by on_copies, checked once the replay's graph is made.
        self.graph_read: list[tuple[str, torch.Tensor]] = []

    def snapshots(self) -> list[torch.Tensor]:
        """A tensor over each saved storage and each buffer saved alone: what this keeps from
        the forward to the replay, for the census (Mechanism.MODULE_STATE)."""
        found = [torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                 for storage in self.storages.values()]
        found += [value for key, value in self.before.values() if key is None]
        return found

    @property
    def changes(self) -> bool:
        """Whether the original pass changed anything (not only read state)."""
        return bool(self.buffers or self.parameters)

    def small_unsaved(self) -> list[tuple[_Buffers, str]]:
        """The small buffers and frozen parameters the forward changed in place with nothing
        saved of them (its module's small state was not cloned before this call: NOTE [a
        small buffer first changed after the first replay] in stored_state.py), by dict and
        name; a batch norm's dict (all of it counted changed) with its running statistics."""
        return [(d, name) for d, moved in (*self.buffers, *self.parameters)
                for name, previous in ([(n, None) for n in d] if moved is None else moved)
                if previous is None and (t := d.get(name)) is not None and
                id(t) not in self.before and _small(t)]

    def _changed_since(self) -> list[tuple[_Buffers, _Moved | None]]:
        """NOTE [state read, then changed by a later call]: a call may read state it leaves
        unchanged (a BatchNorm in eval mode reads its running statistics) that a later call
        changes before this call's backward (a train micro-batch after an eval one, of one step).
        Eager's backward uses what its forward read; the replay reads the module's buffers as they
        are then. So where small buffers were saved before the forward (snapshots_wanted: a
        module's first calls, and every call once a forward of it changed state; an output
        discard's, at every call), the boundary (and the discard, for its rebuild) keeps the saved
        ones of the dicts the forward left unchanged, and of the names a changed dict's forward
        left alone (a scale changed only in training, beside a call counter: helper EY), with
        their entries and versions, until the replay (memory: at most _SMALL_BYTES a buffer, per
        call, from the forward to its replay, which drops them; a census counts them as
        Mechanism.MODULE_STATE, as it does those of changed dicts: snapshots()). The replay
        compares their versions (their entries are the forward's again by then: NOTE [the
        replay sees the forward's modules]): a dict an
        original pass changed in place since (forward_writes.py holds the buffers each one
        changed, with their versions then: NOTE [forward writes, by id]) runs the replay on
        copies of it as the forward read it, as a changed one does (NOTE [the replay changes
        copies]). One only replays changed (a count kept where grad is enabled, so once per call
        under reentrant checkpointing) stays the module's own, as for a call that read it before
        any change. Not seen: a change that moves no version (through ``.data``, a batch norm
        without ``num_batches_tracked``), one made outside any boundary or discard (the module
        called plainly: no original pass of ours), state of a module with no snapshot (its first
        change since its first replay, documented), frozen parameters."""
        found: list[tuple[_Buffers, _Moved | None]] = []
        for d, items, before, whole in self.read:
            if _object_versions(items) != before and written_by_a_forward_since(items, before):
                # A whole unchanged dict, or some of a changed dict's names (the others are
                # copied already): only changed in place since, and only those a forward
                # changed (one only another call's replay moved, a count kept where grad is
                # enabled, stays the module's own: helper FD); a batch norm's wholly (its
                # kernel moves no version of its running statistics).
                found.append((d, None if whole and "num_batches_tracked" in d else
                              [(name, None) for name in written_since(items, before)]))
        return found

    @contextmanager
    def on_copies(self) -> Iterator[None]:
        dicts = [*self.buffers, *self.parameters, *(self._changed_since() if self.read else ())]
        if len(dicts) > len(self.buffers) + len(self.parameters):
            dicts = _one_entry_a_dict(dicts)
        if not dicts:  # only read, and unchanged since
            yield
            return
        self.graph_read = []
        entries = [(d, dict(d)) for d, _ in dicts]
        # Each tensor copied, as the forward left it, with its version: one the replay still
        # reaches another way (a list or a hook holding it, a view of it, one that requires
        # grad and so is not swapped) and changes gets its value back after the replay.
        kept: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        storages: dict[Any, torch.UntypedStorage] = {}  # this replay's, one per storage
        for d, moved in dicts:
            for name, previous in [(n, None) for n in d] if moved is None else moved:
                t = d.get(name)
                if t is None:  # the forward set it to None or deleted it: back, as it was
                    if isinstance(previous, torch.Tensor):
                        d[name] = self._copy(previous, storages)
                    continue
                if t.is_inference():
                    continue
                kept.append((t, t._version, t.detach().clone()))
                if previous is _ABSENT:
                    del d[name]
                elif previous is _WAS_NONE:  # filled by the forward: None, as it began
                    d[name] = None
                elif isinstance(previous, torch.Tensor):  # replaced by the forward
                    # Read as the forward read it, whatever the forward put there: its own
                    # output (`self.h = out`) gets the boundary's node, and read so, the
                    # replay backpropagated into itself, and backward hung (helper ES).
                    if previous.requires_grad:
                        # NOTE [a graph tensor a forward replaced]: itself, not a copy (which
                        # has no graph: a learned initial state put there got no gradient,
                        # silently); refused after the replay if its graph reaches it.
                        d[name] = previous
                        self.graph_read.append((name, previous))
                    else:
                        d[name] = self._copy(previous, storages)
                elif not t.requires_grad:  # one that does stays: the replay's gradient reaches it
                    d[name] = self._copy(t, storages)
        # Per dict, the names the original pass changed (all of a batch norm's), and the
        # entries the replay starts from.
        starts = [(set(entries_before) if moved is None else {n for n, _ in moved}, dict(d))
                  for (d, moved), (_, entries_before) in zip(dicts, entries)]
        try:
            yield
        except AttributeError as error:
            _refuse_a_read_of_what_was_taken_out(error, dicts)
            raise
        finally:
            for (d, entries_before), (on, at_start) in zip(entries, starts):
                # A change only the replay makes (under `torch.is_grad_enabled()`, which the
                # original pass never is) is kept, as eager's forward made it: a name the
                # original pass left alone that the replay registers or reassigns, and one
                # the replay deletes that the original pass left holding a tensor.
                own = [(n, t) for n, t in d.items() if n not in on and at_start.get(n) is not t]
                gone = [n for n in at_start if n not in d and entries_before.get(n) is not None]
                d.clear()
                d.update(entries_before)
                d.update(own)
                for n in gone:
                    del d[n]
            restored = [(tensor, version, value) for tensor, version, value in kept
                        if tensor._version != version]
            if restored:
                with torch.no_grad():
                    for tensor, _, value in restored:
                        tensor.copy_(value)
                whole = [(t, v) for t, v, _ in restored if _covers_its_storage(t)]
                if whole:
                    torch._C._autograd._unsafe_set_version_counter(
                        tuple(t for t, _ in whole), tuple(v for _, v in whole))

    def _copy(self, source: torch.Tensor, storages: dict[Any, torch.UntypedStorage]
              ) -> torch.Tensor:
        """The replay's copy of ``source`` as it was before the forward, over this replay's
        copy of its storage then; of what the forward left where nothing was saved. Its
        storage is marked as the replay's own (NOTE [state a reused call changes] in
        frozen.py writes only into such)."""
        saved = self.before.get(id(source))
        if saved is None:
            copy = source.detach().clone()
        elif saved[0] is None:
            copy = saved[1].clone()  # the buffer alone
        else:
            key, (offset, size, stride, dtype) = saved
            storage = storages.get(key)
            if storage is None:
                storage = storages[key] = self.storages[key].clone()
            copy = torch.empty(0, dtype=dtype, device=source.device)
            copy.set_(storage, offset, size, stride)
        mark_replay_copy(copy)
        return copy


def refuse_graph_read(graph_read: list[tuple[str, torch.Tensor]], outs: Sequence[Any],
                      /) -> None:
    """NOTE [a graph tensor a forward replaced]: a buffer holding a tensor with a graph (a
    recurrent state carried with its gradient from the last call, ``self.h = out``; a learned
    initial state put there, ``self.h = h0.expand(...)``) that the forward replaced is put back
    itself for the replay. Where the replay's graph (``outs``) reaches it, eager
    backpropagates through it into the graph that made it, but module state is no input of
    the boundary's node, so that graph gets no gradient (a copy, put back before, gave the
    learned state none, silently; the forward's own output read so hung backward: helper ES):
    refused before the replay's backward. A buffer only overwritten, never read (the last
    output kept for logging), is not reached and passes (helper EX)."""
    for name, previous in graph_read:
        if graph_reaches([out.grad_fn for out in outs], previous, most=100_000):
            _refuse_a_graph_replaced(name, previous)


def _refuse_a_graph_replaced(name: str, previous: torch.Tensor, /) -> None:
    raise CheckpointError(
        f"the forward replaced the buffer {name!r}, which held a tensor with a graph (a state "
        "carried with its gradient from an earlier call, or a trainable initial state put "
        "there), and the replay cannot backpropagate into that graph: module state is not an "
        "input of the checkpointed call",
        expected=f"{name!r} holding a tensor without a graph (detached) when the call begins",
        got=f"Tensor(shape={tuple(previous.shape)}, dtype={previous.dtype}, "
            f"grad_fn={type(previous.grad_fn).__name__ if previous.grad_fn else None})",
        tip="pass the state as an argument and return the new one (`out, h = cell(x, h)`), "
            f"or keep it detached (`self.{name} = out.detach()`: truncated backpropagation)")


def _refuse_a_read_of_what_was_taken_out(error: AttributeError, dicts: Sequence[Any], /
                                         ) -> None:
    """A replay that reads a buffer its original pass registered, without registering it
    again (registered under a flag the original pass set, `if not self.ready:`, where the
    flag was not saved before the forward: its first change came after the layer's first
    replay, NOTE [numbers and flags as the forward began] in forward_numbers.py): the buffer
    was taken out for the replay (NOTE [the replay changes copies]), so the read fails; say
    so, with the fix, instead of torch's bare AttributeError."""
    words = str(error)
    for _, moved in dicts:
        for name, previous in moved or ():
            if previous is _ABSENT and f"'{name}'" in words:
                raise CheckpointError(
                    f"the replay read the buffer {name!r}, which its original pass registered "
                    "and it did not register again: the replay runs as the forward began, "
                    "without the buffers the forward registered (so a registration keyed on "
                    "the buffer's absence registers, and computes, as the forward did), and "
                    "the flag or attribute that chose to register it was left set (its "
                    "forward first set it after the layer's first replay, when the layer's "
                    "numbers and flags were not saved before the forward)",
                    expected=f"the replay registers {name!r} before reading it, as its "
                             "forward did",
                    got=f"AttributeError: {words}",
                    tip=f"key the registration on the buffer itself (`if {name!r} not in "
                        f"self._buffers:` or `if not hasattr(self, {name!r}):`) rather than "
                        "on a separate flag, or register it in __init__") from error


def _covers_its_storage(tensor: torch.Tensor, /) -> bool:
    """Whether ``tensor`` is no view and spans its whole storage (its version counter is then
    about its bytes only)."""
    return tensor._base is None and tensor.storage_offset() == 0 and tensor.is_contiguous() \
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
