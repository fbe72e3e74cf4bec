"""What one window is made of: host copies of its storages, the handles autograd holds
instead of the saved tensors, and the pass the window belongs to. The manager (manager.py)
creates them and moves them between forward and backward.

NOTE [lifetimes]: the copies hang off the handles that the autograd graph holds. A copy lives
while a handle to it does; when the last handle goes (after the node's backward, or when a
graph is dropped without backward, or an exception unwinds it) the host buffer returns to the
pool. The manager holds windows, passes, shared copies and the copies whose device tensor it
has not yet released weakly (``_pending``: at most the last two windows' of each thread after
a window opens, none of a pass's thread after its backward's first restore; see NOTE [copies
in flight] and NOTE [a copy nobody needs is not held] in in_flight.py); strongly only its pool
and counters. Each thread that opened a window
holds two passes of its own (the one its new windows join, the one whose backward began last),
dropped when the thread ends (NOTE [a pass per forward thread] in lanes.py).
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pytree_ckpt.addresses import data_pointer
from pytree_ckpt.census import Mechanism, census_active, report_held
from pytree_ckpt.discard import DISCARDED_MARK
from pytree_ckpt.errors import CheckpointConfigError, CheckpointError
from pytree_ckpt.saved import Unchanged
from pytree_ckpt.subclass import SubclassKind, as_kind, kind_of

if TYPE_CHECKING:  # the manager builds these objects; they only read and count into it
    from .lanes import Lane
    from .manager import OffloadManager

__all__ = ["Copy", "Handle", "HostHolder", "OffloadHandle", "Pass", "Window"]


class Copy:
    """One window storage copied to host; shared by every handle on that storage."""

    __slots__ = ("manager", "pass_ref", "seq", "stream", "host", "nbytes", "device", "version",
                 "storage_ref", "data_ptr", "device_bytes", "alias", "d2h_event", "restored",
                 "reused", "restored_on", "h2d_event", "host_holder", "restored_holder",
                 "seen_version", "source", "watch", "restored_version", "reuse", "__weakref__")

    def __init__(self, manager: OffloadManager, window: Window, tensor: torch.Tensor, /) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() and DISCARDED_MARK in storage.__dict__:
            # NOTE [discarded storages are marked]: left by a discard that was rebuilt since,
            # and so not this copy's (an output rebuilt in an earlier step, then kept and given
            # to a layer): a discard after this copy marks it anew.
            del storage.__dict__[DISCARDED_MARK]
        self.manager = manager
        # Not the window: a copy still in flight must not keep its window (and pass) alive.
        # Its pass, weakly: whose copies a window or a backward lets go of (NOTE [copies in
        # flight]), and when a storage let go while alive is judged (liveness.py).
        self.pass_ref = window.pass_.ref
        self.seq = window.seq
        # The stream current when the tensor is saved: the one that must wait before its
        # memory is let go (NOTE [copies in flight]); None without streams.
        self.stream = manager.engine.current_stream()
        self.nbytes = storage.nbytes()
        self.device = tensor.device
        self.version = tensor._version
        self.storage_ref = StorageWeakRef(storage)
        self.data_ptr = data_pointer(tensor, storage)  # NOTE [a fake tensor's address]
        self.restored: torch.Tensor | None = None
        self.restored_holder: RestoredHolder | None = None  # for the census, while restored
        self.reused = False  # restored is the device storage itself (NOTE [reuse at the turn])
        self.reuse: Reused | None = None  # held while reused, judged when the last one goes
        self.restored_on: Any = None  # the stream whose pool ``restored``'s memory came from
        # ``restored``'s version once its bytes landed (NOTE [a change in backward through a
        # restored alias]): the copy back moves it, when it runs.
        self.restored_version: int | None = None
        self.d2h_event: Any = None
        self.h2d_event: Any = None
        # NOTE [stream rules] 1: we keep the device bytes until the copy's event completes, or
        # until ``self.stream`` waits on it.
        self.device_bytes: torch.Tensor | None = torch.empty(
            0, dtype=torch.uint8, device=tensor.device).set_(storage)
        # NOTE [in-place check], continued: an alias that shares the saved tensor's version
        # counter (device_bytes has a counter of its own), held as long as the device bytes
        # are: a change after the save, by a caller who then dropped the tensor, is still
        # seen, and reused bytes are never changed ones.
        self.alias: torch.Tensor | None = tensor.detach()
        # The alias's version when the copy let go of it: a change seen while it was held is
        # still refused after (NOTE [in-place check]).
        self.seen_version = self.version
        # The caller's tensor (a view's base), weakly, and once the device bytes are let go
        # while it lives, the weak reference whose callback lets go of the alias when it dies.
        base = tensor._base
        self.source = weakref.ref(base if base is not None else tensor)
        self.watch: weakref.ref[torch.Tensor] | None = None
        self.host: torch.Tensor | None = None
        try:
            # NOTE [a buffer handed out under an interrupt] (pool.py): set as it is handed out.
            manager.pool.acquire(self.nbytes, into=self)
            assert self.host is not None
            self.d2h_event = manager.engine.to_host(self.host, self.device_bytes)
        except BaseException:
            if self.host is not None:  # the copy failed: nothing reads the buffer
                manager.pool.release(self.host)
                self.host = None
            raise
        self.host_holder: HostHolder = HostHolder()  # lives as long as this copy (for the census)
        manager._counters["offloaded_bytes"] += self.nbytes
        window.pass_.offloaded += self.nbytes
        manager._pending.append(self)

    def holds(self, tensor: torch.Tensor, /) -> bool:
        """Whether this copy is of ``tensor``'s storage as it is now. NOTE: the very storage
        object, not only its address: a storage whose memory was freed in place (output
        discard's ``resize_(0)``) stays alive, and a new tensor the allocator places at the
        same address must not be taken for it."""
        return (self.version == tensor._version and not self.storage_ref.expired()
                and self.storage_ref.cdata == tensor.untyped_storage()._cdata)

    def same_counter(self, tensor: torch.Tensor, /) -> bool:
        """Whether ``tensor`` is known to count its versions on the counter the copied tensor
        did: it is that tensor (or its view's base), or a view of that base (views share their
        base's counter). NOTE [one counter per shared copy]: ``holds`` compares version
        numbers, which mean nothing across counters: a ``.data`` alias (a counter of its own,
        at 0) made after an in-place write on the tensor (counted on the tensor's) read 0
        like the alias copied before the write, and took its stale copy: backward read bytes
        its forward never used. So another tensor on the storage (a ``.data`` alias, a tensor
        ``set_`` on it, or a ``.detach()`` alias or a dtype view, ``x.view(torch.int32)``,
        which share the counter without a ``_base`` and cannot be told from them: helper GY)
        gets a copy of its own. Views and the very tensor, as
        RoPE tables and ``cu_seqlens`` passed to every layer are, still share one."""
        source = self.source()
        return source is not None and (tensor is source or tensor._base is source)

    @property
    def released(self) -> bool:
        """This copy no longer holds the device storage (read by the census)."""
        return self.device_bytes is None and not self.reused

    def drop_device_copy(self) -> None:
        if self.device_bytes is None:
            return
        storage = self.device_bytes.untyped_storage()
        freed = storage.nbytes() == 0  # in place, by a discard
        self.device_bytes = None
        if not self.reused:
            # Reused, backward reads the very bytes: keep checking them. Otherwise the alias
            # goes when the caller's tensor does, which holds the same memory until then, and
            # the version it saw is kept (NOTE [in-place check]).
            source = self.source()
            if source is None:
                self._let_go_of_alias()
            else:
                self.watch = weakref.ref(source, functools.partial(_source_died,
                                                                  weakref.ref(self)))
        # Still alive now may be a later layer's input or a table every layer gets: it counts
        # as alive elsewhere only if still alive when backward begins (liveness.py). A
        # reused storage is checked when backward is done with it (``__del__``).
        if freed:
            if getattr(storage, DISCARDED_MARK, False):  # NOTE [discarded storages are marked]
                self.manager._liveness.copied_and_discarded(self.nbytes)
        elif not self.reused and not self.storage_ref.expired():
            self.manager._liveness.suspect(self.storage_ref, self.nbytes, self.pass_ref)

    def _let_go_of_alias(self) -> None:
        # One attribute read and two stores, no lock: the garbage collector may run this on
        # any thread (NOTE [counted late] in liveness.py).
        alias = self.alias
        if alias is not None:
            self.seen_version = alias._version
            self.alias = None

    def restore(self) -> None:
        if self.restored is not None:
            return
        counters = self.manager._counters
        device_bytes = self.device_bytes
        if device_bytes is not None and self._storage_intact(device_bytes) and \
                self.alias is not None and self.alias._version == self.version:
            # NOTE [reuse at the turn]: the device bytes were not let go yet (the last
            # windows of a forward, at backward's first restore): backward takes them as they
            # are, with no copy back. They are the saved tensor's own storage, exactly what
            # eager autograd would read: every handle still checks its version when unpacked
            # (NOTE [in-place check]); a storage resized since (freed, regrown elsewhere or to
            # another size) is copied back from host instead. The copy to host may still be
            # reading the bytes, which is harmless. The manager lets go of its reference as for
            # any copy in flight, after the saving stream waited on the copy to host (stream
            # rule 1), so the memory is reused only after that copy; whether it was alive
            # elsewhere is known once backward is done with it (``__del__``).
            self.restored = device_bytes
            self.restored_on = self.stream
            self.reused = True
            self.reuse = Reused.joined(self)
            counters["reused_bytes"] += self.nbytes
        else:
            assert self.host is not None
            self.restored_on = self.manager.engine.current_stream()  # allocates on it
            self.restored, self.h2d_event = self.manager.engine.to_device(
                self.host, self.nbytes, self.d2h_event)
        counters["restored_bytes"] += self.nbytes
        self.restored_version = None  # read once the copy back landed (unpack_handle)
        if census_active() and not self.reused:
            # Held for backward from now until the handles are dropped (a retained graph's
            # second backward reads them: helper FM, the census counted none of them). Bytes
            # reused stay filed as in flight: flagged if alive elsewhere once let go.
            self.restored_holder = RestoredHolder()
            report_held([self.restored], Mechanism.OFFLOAD_RESTORED, holder=self.restored_holder)

    def give_up_restore(self) -> None:
        """Let go of the device buffer a prefetch restored, before backward read it: the next
        ``restore`` copies back again (NOTE [a prefetch that runs out of memory] in
        prefetch.py). Bytes reused (NOTE [reuse at the turn]) stay: they took no new memory.

        ``h2d_event`` stays: the copy back it marks may still read the host buffer, which goes
        back to the pool with it (stream rules 3 and 5); a later restore replaces it with an
        event on the same stream, after it."""
        if self.restored is None or self.reused:
            return
        self.restored = self.restored_on = None
        if self.restored_holder is not None:
            self.restored_holder.released = True
        self.manager._counters["restored_bytes"] -= self.nbytes  # brought back once, counted once

    def _storage_intact(self, device_bytes: torch.Tensor) -> bool:
        storage = device_bytes.untyped_storage()
        return storage.nbytes() == self.nbytes and \
            data_pointer(device_bytes, storage) == self.data_ptr

    # NOTE [the host buffer goes back whatever is raised here]: Python prints and drops what a
    # destructor raises (a KeyboardInterrupt landing in it), and skips the rest: the host
    # buffer, given back last, stayed checked out for good, and the pool grew by one (helper
    # JW). It goes back in a ``finally``, after the waits that precede it where they ran.
    def __del__(self) -> None:
        try:  # NOTE [the host buffer goes back whatever is raised here]
            manager = getattr(self, "manager", None)
            if manager is None:
                return
            device_bytes = getattr(self, "device_bytes", None)
            # A copy whose copy to host failed (its __init__ raised: no host buffer) offloaded
            # nothing, and tells nothing (helper GO: counted alive elsewhere).
            if device_bytes is not None and not getattr(self, "reused", False) and \
                    getattr(self, "host", None) is not None:
                # NOTE [a copy nobody needs is not held] (in_flight.py): its handles went while the
                # manager still held its device bytes (a forward dropped without backward). Stream
                # rule 1: the saving stream waits for the copy to host, which may still read them
                # (no wait on the host). Then what drop_device_copy tells the liveness record, told
                # late (NOTE [counted late] in liveness.py): a storage still alive once ours go.
                if not manager.engine.done(self.d2h_event):
                    manager.engine.wait(self.d2h_event, stream=self.stream)
                storage = device_bytes.untyped_storage()
                freed = storage.nbytes() == 0  # in place, by a discard
                discarded = freed and getattr(storage, DISCARDED_MARK, False)
                self.device_bytes = self.alias = device_bytes = storage = None  # ours go first
                if discarded:
                    manager._liveness.copied_and_discarded(self.nbytes, late=True)
                elif not freed and not self.storage_ref.expired():
                    manager._liveness.suspect_late(self.storage_ref, self.nbytes, self.pass_ref)
            if getattr(self, "reused", False):
                # Stream rule 1, for bytes backward reused (NOTE [reuse at the turn]): the saving
                # stream waits for the copy to host before the memory is let go. Long done by
                # now, the copy is not waited for at all.
                if not manager.engine.done(self.d2h_event):
                    manager.engine.wait(self.d2h_event, stream=self.stream)
                # Ours: anything still holding the storage after these is someone else's,
                # judged once every copy that reused it is gone (``Reused``).
                self.restored = self.alias = self.reuse = None
        finally:
            # The last handle is gone: the host buffer goes back with the last copy that used it.
            host, manager = getattr(self, "host", None), getattr(self, "manager", None)
            if host is not None and manager is not None:
                last = self.h2d_event if self.h2d_event is not None else self.d2h_event
                manager.pool.release(host, event=last)


class Reused:
    """NOTE [reuse at the turn], continued: a device storage that copies of one pass reused
    at backward's turn, judged alive elsewhere or not when the last of them is gone. Two
    copies reuse one storage where a tensor and its `.detach()` (or `.data`) alias were saved
    in one window (a stop-gradient branch: NOTE [one counter per shared copy]); each judged
    it when it died, and the first found it held by the other, counted as alive elsewhere
    (helper PV). Held by the copies only: its ``__del__`` runs where the last one's does (on
    any thread: NOTE [counted late] in liveness.py)."""

    __slots__ = ("liveness", "storage_ref", "nbytes", "__weakref__")

    def __init__(self, copy: Copy, /) -> None:
        self.liveness = copy.manager._liveness
        self.storage_ref = copy.storage_ref
        self.nbytes = 0

    @staticmethod
    def joined(copy: Copy, /) -> Reused:
        """The record of ``copy``'s storage in its pass (made by its first reuse), with its
        bytes added; under the manager's lock, as every restore is."""
        pass_ = copy.pass_ref()
        key = copy.storage_ref.cdata
        found = pass_.reused.get(key) if pass_ is not None else None
        if found is None or found.storage_ref.expired():
            found = Reused(copy)
            if pass_ is not None:
                pass_.reused[key] = found
        found.nbytes += copy.nbytes
        return found

    def __del__(self) -> None:
        liveness = getattr(self, "liveness", None)
        if liveness is not None:
            liveness.judge(self.storage_ref, self.nbytes, late=True)


def _source_died(copy_ref: weakref.ref[Copy], _: Any, /) -> None:
    copy = copy_ref()
    if copy is not None:
        copy._let_go_of_alias()


class RestoredHolder:
    """Stands for "this copy holds a device copy restored for backward" in the census: held
    until the copy dies, or gives the restored buffer up (a prefetch out of memory)."""

    __slots__ = ("released", "__weakref__")

    def __init__(self) -> None:
        self.released = False


class HostHolder:
    """Stands for "this copy still holds its host buffer" in the census: held while alive."""

    __slots__ = ("__weakref__",)

    @property
    def released(self) -> bool:
        return False  # the host buffer goes back exactly when this (with the copy) dies


class Handle:
    """What autograd holds instead of an offloaded tensor: the copy plus this alias's layout.

    NOTE [in-place check]: autograd skips its "modified by an inplace operation" check for a
    tensor whose saving was hooked, so the handle does it: it remembers the tensor's version
    and, weakly (so the tensor can still be freed), the tensor, or the base of a view (views
    share their base's version counter, and a view made inside an op has no Python object of
    its own that outlives the save). ``_unpack`` refuses a tensor modified since. Once the
    tensor is gone, the copy's own ``detach()`` alias (sharing its version counter) serves,
    for as long as the copy holds the device bytes, and after that while the caller's tensor
    (``Copy.source``) lives, which holds the same memory; then the version that alias had when
    the copy let go of it (``seen_version``): a change made before that is refused whenever
    backward comes (helper DJ: a prefetch or a ``stats()`` read let go of the alias first, and
    the change was read from host silently; helper DK: a change made after that, through the
    caller's tensor, then dropped). A change through an alias the caller made with
    ``detach()`` (which shares the counter without being a view), made once the copy let go
    of the device bytes and the saved tensor itself is gone, is not seen: backward reads the
    bytes copied to host when the tensor was saved. On a GPU that copy is ordered before any
    write queued after the copy let go (the copy had completed, or the saving stream waited
    on it: stream rule 1), so no unseen change on that stream races with it.
    """

    __slots__ = ("copy", "window", "key", "dtype", "size", "stride", "offset", "conj", "neg",
                 "subclass", "source", "version")

    def __init__(self, copy: Copy, window: Window, key: tuple[str, int],
                 tensor: torch.Tensor, /) -> None:
        self.copy = copy
        self.window = window  # the window that saved this alias (the copy may be older)
        self.key = key
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        # NOTE [lazy bits]: a conjugate or negative view (``x.conj()`` of a complex tensor,
        # ``torch._neg_view``) shares its storage's bytes unchanged and says so only with a
        # bit on the tensor; offset, size and stride do not carry it. The restore sets them
        # back, or backward reads x where it saved conj(x).
        self.conj = tensor.is_conj()
        self.neg = tensor.is_neg()
        # NOTE [subclasses come back as themselves] in pytree_ckpt/subclass.py: a
        # __torch_function__ subclass is restored as that class, with its attributes (a
        # wrapper subclass is packed by its inner tensors instead: Flattened). Not a plain
        # tensor's attributes: torch hands backward a new object for it whatever the unpack
        # returns (docs/offload.md), and holding them would keep what they hold alive.
        self.subclass: SubclassKind | None = \
            kind_of(tensor) if type(tensor) is not torch.Tensor else None
        base = tensor._base
        self.source = weakref.ref(base if base is not None else tensor)
        self.version = tensor._version

    def rebuild(self, restored: torch.Tensor, /) -> torch.Tensor:
        """This alias, on ``restored`` (its copy's storage, back on the device): a view of
        it, so that every alias restored from one copy counts its versions on one counter
        (NOTE [a change in backward through a restored alias])."""
        try:
            whole = restored if restored.dtype == self.dtype else restored.view(self.dtype)
            tensor = whole.as_strided(self.size, self.stride, self.offset)
        except RuntimeError:  # bytes not a whole number of elements: an alias of its own
            tensor = torch.empty(0, dtype=self.dtype, device=self.copy.device).set_(
                restored.untyped_storage(), self.offset, self.size, self.stride)
        # NOTE [lazy bits]: the layout does not carry a conj or neg bit.
        if self.conj:
            tensor = tensor.conj()
        if self.neg:
            tensor = torch._neg_view(tensor)
        return as_kind(tensor, self.subclass)  # NOTE [subclasses come back as themselves]

    def check_unmodified(self) -> None:
        # NOTE [a change in backward through a restored alias]: a backward that writes into
        # a tensor it saved (a custom Function's memory trick) changes it for every later
        # reader, whom eager refuses ("modified by an inplace operation": the saved tensor's
        # counter moved). Restored aliases are views of their copy's restored bytes, so such a
        # write moves that counter, read here (helper JI: each alias had a counter of its
        # own, and a second node, or a retained graph's second backward, read the written
        # bytes silently).
        copy = self.copy
        if copy.restored is not None and copy.restored_version is not None and \
                copy.restored._version != copy.restored_version:
            window = self.window
            raise CheckpointError(
                f"{window.describe(self.key)} (offload window {window.id}, "
                f"{self.dtype}{list(self.size)}) was modified in place in backward, through a "
                "restored tensor, after it was restored (a backward writing into what it saved)",
                expected=f"its version when restored ({copy.restored_version}: the restore's "
                         "own copy)",
                got=f"version {copy.restored._version} "
                    f"({copy.restored._version - copy.restored_version} change(s) since)",
                tip="write into a clone in the backward that changes it (x.clone().mul_(2)), "
                    "or keep the tensor out of the offload window")
        source = self.source()
        if source is None:  # dropped by the caller: the copy's alias shares its counter
            source = self.copy.alias
        now = self.copy.seen_version if source is None else source._version
        if now == self.version:
            return
        window = self.window
        from_input = window.keys.get(self.key) is not None
        raise CheckpointError(
            f"{window.describe(self.key)} (offload window {window.id}, "
            f"{self.dtype}{list(self.size)}) was modified in place after it was saved for "
            "backward", expected=f"version {self.version} (when saved)", got=f"version {now}",
            tip=(self.window.changed_tip or _CHANGED_AFTER_SAVE_TIP) if from_input else
                "a tensor given to offload_into must stay as it was until restore(): change "
                "a clone instead")


# A manual window's: eager refuses such a change too, where an op saved the tensor (helper JT:
# the boundary's tip, about the inputs it keeps for the replay, was given here).
_CHANGED_AFTER_SAVE_TIP = ("change a clone after the block (h = h + 1, not h += 1), or make the "
                           "change before it, as eager needs where an op saved the tensor")


class Pass:
    """One forward's windows, numbered from 0, and what backward did with them.

    ``lane``: the thread whose forward opens its windows (NOTE [a pass per forward thread] in
    lanes.py), held weakly; ``ended``: where the pass leaves its tallies if it dies before the
    manager checked them (``__del__``)."""

    __slots__ = ("lane", "ref", "ended", "windows", "next_id", "events", "prefetched", "shared",
                 "reused", "backward", "prefetch_off", "offloaded", "largest_small",
                 "__weakref__")

    def __init__(self, lane: Lane, ended: deque[tuple[int, int]], /) -> None:
        self.lane = weakref.ref(lane)
        self.ref = weakref.ref(self)  # one object for every copy of the pass (a stable key)
        self.ended = ended
        # Weak, by id: a dead window's entry goes at once, so a pass that never reaches
        # backward (grad-enabled evaluation holding its last output) stays small.
        self.windows: weakref.WeakValueDictionary[int, Window] = weakref.WeakValueDictionary()
        self.next_id = 0
        self.events: list[tuple[str, int]] = []
        self.prefetched: set[int] = set()
        # Storages offloaded by an earlier window of this pass (RoPE tables): copied once.
        # By storage key and the id of the tensor (a view's base) whose counter it checks.
        self.shared: weakref.WeakValueDictionary[tuple[str, int, int], Copy] = (
            weakref.WeakValueDictionary())
        # Device storages its copies reused at backward's turn, by storage (``Reused``).
        self.reused: weakref.WeakValueDictionary[int, Reused] = weakref.WeakValueDictionary()
        self.backward = False  # a window was restored: new windows belong to a new pass
        # A prefetch ran out of device memory: the rest of the pass restores on demand (NOTE
        # [a prefetch that runs out of memory] in prefetch.py).
        self.prefetch_off = False
        # Offloaded bytes and the largest storage left below min_bytes: a pass that offloaded
        # nothing because of the floor is logged (once per manager), not silently accepted.
        self.offloaded = 0
        self.largest_small = 0

    def alive(self) -> bool:
        return len(self.windows) > 0

    def over(self) -> bool:
        """Its forward is over: its backward began, or no window of it is alive."""
        return self.backward or not self.alive()

    def __del__(self) -> None:
        # A pass the manager did not check before it died (its thread ended, the graph went):
        # its tallies wait for the manager's next check, for the "offloaded nothing" warning.
        # One append (atomic): the garbage collector may run this on any thread, holding any
        # lock (NOTE [counted late] in liveness.py).
        if getattr(self, "offloaded", 0) or getattr(self, "largest_small", 0):
            self.ended.append((self.offloaded, self.largest_small))


class Window:
    """The storages of one ``manager.window(...)`` call, and the copies made for them.

    Exported for type annotations: ``with manager.window(tensors) as window`` gives one; it is
    not built directly (its pass belongs to the manager)."""

    __slots__ = ("pass_", "id", "seq", "keys", "name", "changed_tip", "copies", "open_copies",
                 "restored", "small", "__weakref__")

    def __init__(self, pass_: Pass, keys: dict[tuple[str, int], int | None],
                 name: Callable[[int], str] | None, /, *, seq: int,
                 changed_tip: str | None = None) -> None:
        self.pass_ = pass_  # strong: the pass lives as long as one of its windows
        self.id = pass_.next_id
        pass_.next_id += 1
        pass_.windows[self.id] = self
        self.seq = seq  # opening order across passes, for NOTE [copies in flight]
        self.keys = keys  # storage key -> index of the first window tensor on it (None: frames)
        self.name = name
        self.changed_tip = changed_tip  # for a window tensor changed after its save
        # Weak: handles hold their window and copy; the window holds no copy (no cycle). By
        # storage key and the id of the tensor (or view base) copied: a `.detach()` alias
        # saved beside its tensor has a copy of its own (packing.py).
        self.copies: weakref.WeakValueDictionary[tuple[str, int, int], Copy] = (
            weakref.WeakValueDictionary())
        # Strong while the window is open (its ``with`` block), then None: a storage saved
        # again in the window after the graph of its first save was dropped (a metric logged
        # mid-forward, ``loss.item()``) finds its copy, copied once per window (helper GO;
        # NOTE [a copy nobody needs is not held] in in_flight.py). The latest copy per entry
        # only: an older one (of an input changed in place since) is never taken again
        # (helper GP: one host buffer per version held to the window's exit).
        self.open_copies: dict[tuple[str, int, int], Copy] | None = {}
        self.restored = False
        self.small: set[tuple[str, int]] = set()  # left alone: below min_bytes, or elsewhere

    def __enter__(self) -> None:
        # What `with manager.window(t) as window` binds is no block of its own: refused naming
        # the fix (helper JQ: Python's TypeError said nothing of the cause).
        raise CheckpointConfigError(
            "an offload Window (what `with manager.window(tensors) as window` binds) was "
            "used in a `with` of its own",
            expected="a new window for each block: with manager.window(tensors): ...",
            got=f"window {self.id} itself in a with statement",
            tip="call manager.window(tensors) again for the next block")

    def __exit__(self, *raised: Any) -> None:  # with needs both; __enter__ refuses first
        return None

    def describe(self, key: tuple[str, int], /) -> str:
        """Where a storage of this window came from, for messages (e.g. ``args[0]``)."""
        index = self.keys.get(key)
        if index is None:
            return "a tensor given to offload_into (a replay frame's frozen result)"
        return self.name(index) if self.name is not None else f"window tensor #{index}"


class Flattened:
    """What autograd holds instead of a wrapper subclass (a DTensor) a window copied the inner
    tensors of: each inner tensor packed (a Handle, or an Unchanged one left on the device),
    and what rebuilds the wrapper around them in backward (NOTE [a wrapper subclass's bytes
    are its inner tensors'] in pytree_ckpt/subclass.py): its class, flatten context, outer
    size and stride, the flattened attributes that are no tensors (a DTensor's mesh), and
    those it does not flatten, given back as NOTE [subclasses come back as themselves] says
    (``kind``: an attribute a custom backward reads off the saved wrapper)."""

    __slots__ = ("cls", "inner", "others", "context", "size", "stride", "kind")

    def __init__(self, tensor: torch.Tensor, inner: dict[str, Any],
                 others: dict[str, Any], context: Any, /) -> None:
        self.cls = type(tensor)
        self.inner = inner
        self.others = others
        self.context = context
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.kind = kind_of(tensor)  # less its inner tensors: those are restored

    def rebuild(self, restored: dict[str, torch.Tensor], /) -> torch.Tensor:
        """The wrapper, around the restored inner tensors, with its other attributes."""
        rebuilt = self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {**self.others, **restored}, self.context, self.size, self.stride)
        return as_kind(rebuilt, self.kind)

    def left_on_device(self) -> list[Unchanged]:
        """What of this save stays on the device: the inner tensors that were not copied (one
        not on a window storage, or below ``min_bytes``), through nested wrappers."""
        return [held for inner in self.inner.values()
                for held in ([inner] if isinstance(inner, Unchanged) else
                             inner.left_on_device() if isinstance(inner, Flattened) else [])]


# What OffloadManager.offload_into returns and restore takes, named for a type checker (helper
# RL: typed Any, `restore(tensor)` passed one, and the library refused it at run time).
OffloadHandle: TypeAlias = Handle | Unchanged | Flattened
