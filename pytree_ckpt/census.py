"""The activation census: what is held for backward, by which module, through which mechanism.

NOTE [how the census sees tensors]: two sources, merged per storage.

1. Its own saved-tensor pack hook, installed for the ``with`` block. It *chains* to the hooks
   that were active when the census was entered (so a user's or an outer offload hook still
   runs), and records every tensor ordinary autograd saves while it is the innermost hook.
2. Explicit reports from the library's mechanisms (``report_held``), to the censuses recording
   on the thread (NOTE [where a census records] in census_threads.py): the checkpoint boundary
   reports the inputs it saves, replay frames the results they hold, its module state the
   buffers' snapshots it keeps for the replay (state_changes.py), and later mechanisms
   (offload, save units, output discard) what they hold or moved. Hooks pushed *inside* the
   census (an offload window) shadow its pack hook, which is why mechanisms report explicitly;
   a report wins over the generic record.

Each storage is counted once, with its whole size (a saved view keeps its whole storage alive),
for as long as it is held: by the graph (the census's pack hook hands autograd a small handle
and watches it) or by the reporting mechanism (the tensor itself is watched). Besides those
handles, which hold what autograd would, the census holds weak references only, so it does not
change what is freed (but for a saved activation swapped through ``.data``: docs/census.md),
and reading it after backward shows what is still held. Parameters and
buffers are not activations and are left out. A mechanism that means to release a storage (a
frame after its replay) gives a ``holder`` whose ``released`` turns true; a storage still alive
after its holder released it is *flagged*: something else keeps it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .census_reading import CensusReading
from .census_records import _FREEING, _RESIDENT, Holder, Mechanism, _Entry, _record_key
from .census_threads import _ACTIVE, _OPEN, _OPEN_LOCK, _recording, _set_recording
from .errors import CheckpointConfigError, CheckpointError
from .running_modules import running_module, running_modules
from .saved import Unchanged, note_hooks_disabled
from .subclass import plain_parts

__all__ = ["ActivationCensus", "Holder", "Mechanism", "active_census", "census_active",
           "report_held"]

_compiling = torch.compiler.is_compiling  # read once: the hooks run at every module call


class _Packed:
    """What the census's pack hook hands autograd: alive exactly as long as the graph holds it.
    ``inner`` is the tensor in an ``Unchanged`` (NOTE [hooks switch off the in-place check] in
    saved.py), or what an outer hook made of it."""

    __slots__ = ("inner", "__weakref__")

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def active_census() -> ActivationCensus | None:
    """The census recording here, if any (for mechanisms that report after the block ends)."""
    return _recording()


def census_active() -> bool:
    """Whether a census is recording here (lets mechanisms skip building their reports)."""
    return _recording() is not None


def report_held(tensors: Iterable[torch.Tensor], mechanism: Mechanism, /, *,
                holder: Holder, replace: bool = False) -> None:
    """Tell the censuses recording here (if any) that ``mechanism`` holds ``tensors`` through
    ``holder``.

    The census treats them as held while ``holder`` is alive and not ``holder.released``.
    ``replace``: earlier holders of these storages no longer hold them (the saved reference
    was swapped, as offload does).
    """
    tensors = list(tensors)
    census = _recording()
    while census is not None:  # a census nested in another: both see it
        for tensor in tensors:
            census._note(tensor, mechanism, holder, replace=replace)
        census = census._parent


def _stored_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors an outer saved-tensor hook stored: the object, or those in a tuple/list."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [x for x in obj if isinstance(x, torch.Tensor)]
    return []


# NOTE [one lock per census]: one census is fed by several threads at once when autograd
# runs a backward on its device threads, one per GPU (NOTE [where a census records] in
# census_threads.py), and can be read from a hook on one of them meanwhile: its records
# change under a (reentrant: a finalizer run by the collector in the middle of a change may
# report) lock, and are read from a copy taken under it. The lock is the innermost one:
# nothing is called while it is held but storage and weakref lookups and the holders'
# ``released``.


# NOTE [records of dead storages]: a census open over a long run (a monitor read between
# steps) sees a new storage at every save. A record whose storage is gone and that nothing
# holds any more counts in no reading (not alive, not flagged, not discarded bytes held), and
# no later save can join it (NOTE [one address, one storage]): such records are dropped, in
# one pass once the records reach twice what the last pass left (at least _PRUNE_FLOOR), so
# that a save costs O(1) amortised and the records stay bounded by twice the storages held
# at once, however many steps run. A record still held, or whose storage lives on (flagged,
# or kept by the caller), stays.
_PRUNE_FLOOR = 64


def _end_refused(*, later: bool) -> CheckpointError:
    """NOTE [ended as entered]: why a census may not end here."""
    return CheckpointError(
        "an ActivationCensus must end after every census entered after it",
        expected="censuses ended in the reverse order they were entered, each in the thread "
                 "and context that entered it",
        got="a census entered after it is still open" if later
        else "its end in another thread or context",
        tip="use with-blocks, or end the census entered last first")


class ActivationCensus(CensusReading):
    """Count the activations a forward pass leaves held for backward.

    ``with ActivationCensus(model) as census: loss = model(batch)``; then ``census.total_bytes``,
    ``census.report()`` (a table) or ``census.to_dict()``. ``model`` (optional) gives module
    paths and the parameters and buffers to leave out.
    """

    def __init__(self, model: nn.Module | None = None, /) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise CheckpointConfigError(
                "ActivationCensus takes the model whose modules name what is held",
                expected="an nn.Module or None", got=type(model).__name__,
                tip="pass the model itself (ActivationCensus(model)), or nothing to record "
                    "without module paths")
        self._model = model
        # NOTE: weak once the block ended: a census kept for its report must not keep the
        # model (and every parameter) alive; while it is alive, its parameters are left out.
        self._model_ref: weakref.ref[nn.Module] | None = None
        self._entries: dict[tuple[Any, ...], _Entry] = {}  # by _record_key
        self._prune_at = _PRUNE_FLOOR  # NOTE [records of dead storages]
        self._local = threading.local()  # each thread's stack of running module paths
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._token: Any = None
        self._parent: ActivationCensus | None = None  # the census this one is nested in
        self._thread: int | None = None  # the thread that entered it
        # The model's modules already running when it was entered: NOTE [entered inside].
        self._running: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        # The model's modules by id, with their paths (NOTE [the census in a compiled body]).
        self._paths: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        self._lock = threading.RLock()  # NOTE [one lock per census]
        self._ended = False  # its with-block is over (for the message of a second one)
        self._counted = False  # counted in _OPEN by an _enter not undone (NOTE [an entry undone])
        self._active_before: ActivationCensus | None = None  # _ACTIVE's value it replaced

    # -- recording ---------------------------------------------------------------------------
    def __enter__(self) -> ActivationCensus:
        if self._token is not None:
            raise CheckpointError(
                "an ActivationCensus cannot be entered twice", expected="one with-block per "
                "census", got=("a second __enter__ after its block ended" if self._ended
                               else "a second __enter__ while the first is open"),
                tip="make a new ActivationCensus for each measurement")
        try:
            return self._enter()
        except BaseException:
            self._undo_enter()
            raise

    def _undo_enter(self) -> None:
        """Undo what an ``_enter`` that raised had done.

        NOTE [an entry undone]: torch can refuse the saved-tensor hooks, and an interrupt is
        raised as any call returns: each step of ``_enter`` done by then is undone here, found
        by the state it left, not by a mark set after it (the interrupt can come between the
        two). Left as it was, the model kept the census's module hooks, the thread its pack
        hook (every later save recorded into a census never ended) and ``_OPEN`` its count.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()
        self._paths = {}
        if self._counted:
            if _recording() is self:
                _set_recording(self._parent)
            with _OPEN_LOCK:
                _OPEN[0] -= 1
            self._counted = False
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        elif _ACTIVE.get() is self:  # set, and interrupted before its token was stored
            _ACTIVE.set(self._active_before)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self._hooks is not None and top is not None and top[0] is self._hooks.pack_hook:
            self._hooks.__exit__(None, None, None)
        self._hooks = None

    def _enter(self) -> ActivationCensus:
        if self._model is not None:
            paths = {}
            for path, module in self._model.named_modules():
                paths[id(module)] = (weakref.ref(module), path or "<root>")
            self._paths = paths
            # NOTE [the census in a compiled body]
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._push))
            self._handles.append(nn.modules.module.register_module_forward_hook(
                self._pop, always_call=True))
            self._running = {key: paths[key] for key in running_modules(paths)}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            if outer_pack is None:
                # Held as autograd holds it, and checked for in-place changes (saved.py).
                packed = _Packed(Unchanged(tensor))
                self._note(tensor, Mechanism.AUTOGRAD, packed)
                return packed
            # An outer hook that keeps a copy (save_on_cpu, a compression) holds that copy,
            # not the tensor: count what it stored where it shows (a tensor, or tensors in a
            # tuple); an opaque handle is counted as the tensor it stands for.
            packed = _Packed(outer_pack(tensor))
            for stored in _stored_tensors(packed.inner) or [tensor]:
                self._note(stored, Mechanism.AUTOGRAD, packed)
            return packed

        def unpack(packed: _Packed) -> torch.Tensor:
            if outer_unpack is not None:  # its own business, as without a census
                return outer_unpack(packed.inner)
            return packed.inner.get()

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        try:
            self._hooks.__enter__()
        except RuntimeError as error:
            note_hooks_disabled(error, "an ActivationCensus", "enter the census outside that "
                                "context (around the whole step)")
            raise
        self._thread = threading.get_ident()
        with _OPEN_LOCK:
            _OPEN[0] += 1
            self._counted = True  # no call between: NOTE [an entry undone]
        self._parent = _recording()
        _set_recording(self)
        self._active_before = _ACTIVE.get()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        # NOTE [ended as entered]: refused before anything changes unless this census is the
        # one entered last, in this context and on this thread. Ended while a later one is
        # open, it would pop that one's saved-tensor hooks, and that one's end would make this
        # one record again, every later step; ended on another thread, it would pop that
        # thread's hooks and leave its own thread recording.
        if self._ended:
            # Refused as a second __enter__ is: its token is spent (ContextVar.reset raised a
            # bare RuntimeError), and nothing of it is left to undo.
            raise CheckpointError(
                "an ActivationCensus cannot be ended twice", expected="one end per census",
                got="a second __exit__ after its block ended",
                tip="end each census once (a with-block does); make a new ActivationCensus "
                    "for each measurement")
        if self._token is None:
            # Told as such: the refusal below would say it was ended in another thread.
            raise CheckpointError(
                "an ActivationCensus cannot end before it is entered",
                expected="__enter__, then __exit__ (a with-block)",
                got="__exit__ of a census never entered",
                tip="use it as a with-block: with ActivationCensus(model) as census: "
                    "loss = model(batch)")
        here = threading.get_ident() == self._thread
        recording = _recording()
        if _ACTIVE.get() is not self or not here or recording is not self:
            raise _end_refused(later=here and (self._opened_later()
                                               or recording not in (None, self)))
        try:
            _ACTIVE.reset(self._token)
        except ValueError:
            # A copy of its own context on its own thread shows it as the one entered last,
            # but the token is the other context's: refused too, before anything changes.
            raise _end_refused(later=False) from None
        self._ended = True
        _set_recording(self._parent)
        with _OPEN_LOCK:
            _OPEN[0] -= 1
        self._running.clear()
        self._paths = {}
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        if self._model is not None:
            self._model_ref = weakref.ref(self._model)
            self._model = None

    def _opened_later(self) -> bool:
        census = _ACTIVE.get()
        while census is not None and census is not self:
            census = census._parent
        return census is self

    @property
    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # NOTE [the census in a compiled body]: the model's module paths are kept by two global
    # module hooks, not by a pair of hooks on each module. Dynamo traces the hooks of a
    # compiled body's submodules and guards on each module's own hook ids (and would on each
    # hook's path), so with hooks per module every layer compiled its own graphs and reached
    # dynamo's recompile limit: the bodies then ran eagerly for the rest of the run, census
    # or not. The global hooks are the same for every module, and traced they do nothing: a
    # compiled body's saved tensors are packed when its graph runs, under the path of the
    # module called eagerly around it, where the census files them anyway. Other modules
    # (another model's, while the census is open) pass through at the cost of a dict lookup.
    def _path_of(self, module: nn.Module, /) -> str | None:
        entry = self._paths.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def _push(self, module: nn.Module, *_: Any) -> None:
        if _compiling():
            return
        path = self._path_of(module)
        if path is not None:
            self._stack.append(path)

    def _pop(self, module: nn.Module, *_: Any) -> None:
        if _compiling() or self._path_of(module) is None:
            return
        if self._stack:
            self._stack.pop()

    def _module_now(self) -> str:
        """The module a save made now is filed under: the innermost whose forward runs."""
        stack = self._stack
        if stack:
            return stack[-1]
        if self._running and threading.get_ident() == self._thread:
            return running_module(self._running)  # NOTE [entered inside]
        return "<outside any module>"

    def _note(self, tensor: torch.Tensor, mechanism: Mechanism, keeper: Any, *,
              replace: bool = False) -> None:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return  # parameters, and their views (a Linear saves weight.t()): not activations
        parts = plain_parts(tensor)  # NOTE [a wrapper subclass's bytes are its inner tensors']
        if len(parts) != 1 or parts[0] is not tensor:
            for part in parts:
                self._note(part, mechanism, keeper, replace=replace)
            return
        if tensor.layout is not torch.strided:
            return  # sparse: no storage to count (a limit, see docs/census.md)
        try:
            if tensor.untyped_storage().nbytes() == 0:
                return
            key = _record_key(tensor)
        except RuntimeError:  # another subclass without a storage of its own: not counted
            return
        with self._lock:  # NOTE [one lock per census]
            # A storage is held while one of its keepers is: the graph's handle of a saved tensor
            # (alive while the graph holds it), or a mechanism's holder until it is released.
            known = self._entries.get(key)
            # NOTE [one address, one storage]: a record whose storage died describes no storage at
            # this address any more, even while one of its keepers lives on (an outer hook's opaque
            # handle that did not keep the tensor, a frame whose input offload freed): the
            # allocator hands freed memory out again at once, and a tensor there now is a new
            # storage with its own size. Merged into the dead record it was counted as nothing.
            # And a record none of whose keepers holds it any more is over (its backward ran, or
            # its graph was dropped): a new save of that storage is a new record, filed under its
            # own mechanism and module, not the ones of the step before.
            if known is not None and not known.storage.expired() and known.held():
                if replace:  # NOTE [what an offload swap replaces] (census_records.py)
                    known.keepers = [(k, m) for k, m in known.keepers if m in _RESIDENT]
                known.keepers.append((weakref.ref(keeper), mechanism))
                if mechanism is not Mechanism.AUTOGRAD:  # a mechanism's report is more specific
                    known.mechanism = mechanism
                resident = known.resident_holder()
                if resident is not None and known.mechanism in _FREEING:
                    # A plain autograd save or a save unit's record holds it too: that, not the
                    # freeing mechanism, is what keeps it (and what the census files it under,
                    # while it holds it: _Entry.filed_under).
                    known.displaced, known.mechanism = known.mechanism, resident
                return
            module = self._module_now()
            if known is not None and known.flagged() and mechanism is not Mechanism.AUTOGRAD:
                # The same storage, which a freeing mechanism let go of but lives on, held again
                # by a mechanism (a RoPE table every layer receives, copied to host by the first
                # layer's window): it stays filed, and flagged, under the module that first held
                # it, not the latest one. A plain autograd save of it is a save of its own.
                module = known.module
            self._entries[key] = _Entry(StorageWeakRef(tensor.untyped_storage()),
                                        [(weakref.ref(keeper), mechanism)],
                                        tensor.untyped_storage().nbytes(), str(tensor.device),
                                        module, mechanism)
            if len(self._entries) >= self._prune_at:
                self._prune()

    def _prune(self) -> None:
        """Drop the records of NOTE [records of dead storages]; called under the lock."""
        self._entries = {key: entry for key, entry in self._entries.items()
                         if not entry.storage.expired() or entry.held()}
        self._prune_at = max(_PRUNE_FLOOR, 2 * len(self._entries))

    # -- output discard ----------------------------------------------------------------------
    def _note_discarded(self, tensor: torch.Tensor, /, *, keeper: Any = None) -> None:
        """Output discard is about to free ``tensor``'s storage: stop counting it as resident.
        ``keeper`` (the discard) holds it for backward from now on, whoever else lets go."""
        with self._lock:
            entry = self._entries.pop(_record_key(tensor), None)
            if entry is not None:
                entry.discarded = True
                if keeper is not None:  # it holds no mechanism's bytes
                    entry.keepers.append((weakref.ref(keeper), None))
                # Freed memory gets reused at once: file it under a key no new storage can have.
                self._entries[("discarded", id(entry))] = entry
        if self._parent is not None:
            self._parent._note_discarded(tensor, keeper=keeper)

    def _note_refilled(self, tensor: torch.Tensor, /) -> None:
        """A discarded storage was rebuilt for backward: resident again."""
        cdata = StorageWeakRef(tensor.untyped_storage()).cdata
        for entry in self._recorded():
            if entry.discarded and entry.storage.cdata == cdata:
                entry.discarded = False
        if self._parent is not None:
            self._parent._note_refilled(tensor)
