"""The offload manager: storage windows, one host copy per storage, bounded prefetch.

``with manager.window(tensors):`` installs saved-tensor hooks for its duration. A tensor that
autograd saves inside it is offloaded when its untyped storage is the storage of one of the
window's tensors and that storage reaches ``min_bytes``; anything else (parameters and views
of them always, tensors without a plain storage too) is saved as usual.

NOTE [one copy per storage]: the unit is the *storage*, not the tensor. The first saved tensor
on a window storage copies the whole storage to a host buffer; every other saved alias (a view,
a slice with an offset, a transposed stride) gets a handle to the same copy, and each is rebuilt
in backward from one restored device storage with its own offset, size and stride. A storage
offloaded by an earlier window of the same pass that is still alive and unmodified (same version)
is not copied again: RoPE tables or ``cu_seqlens`` passed to every layer cost one copy.

NOTE [saved reference, not the live tensor]: autograd keeps the handle instead of the tensor;
the live tensor is never resized or freed by us, so other holders keep valid data. We keep the
device tensor until its copy completed, or the compute stream waits for it (stream rule 1), and
drop our reference at least one window late; if the storage is still alive when backward
begins (the forward that passed it from layer to layer is over by then), something else holds
it and the bytes are reported as ``alive_elsewhere_bytes`` (and flagged by an active census,
unless autograd also saves it): that offload saved nothing.

NOTE [passes, window ids and prefetch]: a pass is one forward's windows; one planner (the
manager) numbers them densely from 0 in call order. A window opens a new pass when no window of
the current pass is alive, or when backward has begun on the current pass (pipeline schedules
run the next micro-batch's forward while earlier graphs are still alive). The pass's state (its
window list, event log, shared-storage registry) hangs off its windows and goes with them, so
schedules that always keep some graph alive do not accumulate it. In backward, the first
unpack from window ``i`` restores it (if no prefetch did) and starts restoring windows
``i-1 .. i-prefetch`` of the same pass, which backward needs next.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from pytree_ckpt.census import Mechanism, census_active, report_held, storage_key
from pytree_ckpt.discard import DISCARDED_MARK
from pytree_ckpt.errors import CheckpointConfigError
from pytree_ckpt.saved import Unchanged
from pytree_ckpt.subclass import as_kind

from .pool import HostPool
from .streams import CopyEngine
from .window import Copy, Handle, Pass, Window

__all__ = ["OffloadConfig", "OffloadManager", "Window", "default_manager", "env_flag",
           "is_default_manager"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How the manager offloads.

    ``min_bytes``: storages smaller than this stay where they are (copies of tiny tensors cost
    more than they save). ``prefetch``: how many windows ahead backward restores (0: restore on
    demand). ``pin_memory``: pinned host buffers; ``None`` pins when CUDA is available.
    """

    min_bytes: int = 1 << 16
    prefetch: int = 1
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        for name in ("min_bytes", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointConfigError(
                    f"OffloadConfig.{name} must be an int >= 0", expected="an int >= 0",
                    got=repr(value), tip="min_bytes=0 offloads every window storage; "
                                         "prefetch=0 restores on demand")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise CheckpointConfigError(
                "OffloadConfig.pin_memory must be None or a bool", expected="None | bool",
                got=repr(self.pin_memory), tip="None pins host buffers when CUDA is available")


class OffloadManager:
    """Offloads saved activations by storage windows to a pooled host buffer."""

    def __init__(self, config: OffloadConfig | None = None, /, *,
                 device: torch.device | str | None = None) -> None:
        if config is not None and not isinstance(config, OffloadConfig):
            raise CheckpointConfigError(
                "OffloadManager takes an OffloadConfig", expected="OffloadConfig or None",
                got=type(config).__name__,
                tip="OffloadManager(OffloadConfig(min_bytes=0, prefetch=2))")
        self.config = config if config is not None else OffloadConfig()
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            # NOTE: an indexed CUDA device (a pickled manager's) is not checked here: a model
            # saved on a GPU must load on a CPU machine (see __reduce__, CopyEngine).
            if not torch.cuda.is_available():
                raise CheckpointConfigError(
                    f"OffloadManager(device={device!r}) needs CUDA, which this torch cannot "
                    "use", expected="a device this process has", got=f"{device!r} with "
                    f"torch.cuda.is_available() False (torch {torch.__version__})",
                    tip="leave device out (the current CUDA device, or the CPU without one), "
                        "or install a CUDA build of torch")
            # Saved tensors carry an indexed device: compare like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())
        pin = self.config.pin_memory
        if pin is None:
            pin = torch.cuda.is_available()
        elif not pin and self.device.type == "cuda":
            # A non-blocking copy into pageable memory returns only once it is done, and the
            # copy stream waits on the whole compute queue first: each save syncs the device.
            log.warning("OffloadConfig(pin_memory=False) on %s: every copy to host waits for "
                        "the device to finish its queued work (pageable memory); correct, but "
                        "slow. Leave pin_memory unset to pin host buffers", self.device)
        self.pool = HostPool(pin_memory=pin)
        self.engine = CopyEngine(self.device)
        self._pending: list[Copy] = []
        # The pass new windows join, and the one whose backward ran last (for ``events()``).
        # Older passes are held only by their windows (NOTE [passes, window ids and prefetch]).
        self._pass = self._recent = Pass()
        self._counters: dict[str, int] = {}
        self._reset_counters()
        # Warned of a pass that offloaded nothing; some pass offloaded something (a short batch
        # among long ones is below min_bytes, and says nothing about the setting).
        self._warned_nothing = False
        self._ever_offloaded = False
        self._warned_device = False
        self._warned_plain = False
        self._warned_discarded = False
        # Storages let go while still alive: judged when backward begins (``_judge_alive``),
        # by storage (``StorageWeakRef.cdata``) with the bytes of every copy of it let go.
        self._suspects: dict[int, tuple[StorageWeakRef, int]] = {}
        self._suspects_limit = 64  # NOTE [suspects stay bounded]
        self._opened = 0  # windows opened so far, in all passes (NOTE [copies in flight])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # NOTE: a pickled model (its wrapped layers' options hold the manager) comes back with
        # a manager of the same config and device and none of the run-time state (host pool,
        # streams, counters, graphs' windows); layers that shared one share the new one
        # (pickle memoizes it). The process's default manager comes back as the loading
        # process's default_manager() (its current device: a rank loads onto its own GPU).
        device = str(self.device)
        if _default_managers.get(device) is self:
            return default_manager, ()
        return _new_manager, (self.config, device)

    # -- statistics --------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self._counters = {"offloaded_bytes": 0, "restored_bytes": 0, "reused_bytes": 0,
                          "prefetch_hits": 0, "alive_elsewhere_bytes": 0, "discarded_bytes": 0,
                          "below_min_bytes": 0, "other_device_bytes": 0, "windows": 0}
        self._pool_base = (self.pool.hits, self.pool.misses)
        self.engine.reset_waits()

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """Counters since the last reset: bytes, pool hits/misses, prefetch hits, waits."""
        self._collect_finished()
        # NOTE [judged once the forward is over]: while a pass's forward may still run (alive,
        # no backward yet) what it let go may be alive for the forward itself (a RoPE table or
        # cu_seqlens every layer gets, the next layer's input): judged now, a stats() read
        # from a hook between layers counted them as alive elsewhere. They wait for its
        # backward, the next pass, or a stats() after the graph is gone.
        if self._pass.backward or not self._pass.alive():
            self._judge_alive()
        if not self._pass.alive():  # the pass is over
            self._check_pass_offloaded(self._pass)
        out: dict[str, float] = dict(self._counters)
        out["pool_hits"] = self.pool.hits - self._pool_base[0]
        out["pool_misses"] = self.pool.misses - self._pool_base[1]
        out["host_bytes"] = self.pool.host_bytes
        out["host_buffers_in_use"] = self.pool.checked_out
        if self.engine.cuda:
            out["wait_ms"] = self.engine.waited_ms()
        if reset:
            self._reset_counters()
        return out

    def events(self) -> list[tuple[str, int]]:
        """``("restore" | "prefetch" | "prefetch_hit", window id)`` in order, for the pass whose
        backward ran last (empty before any backward)."""
        return list(self._recent.events)

    def _judge_alive(self) -> None:
        """Count the storages let go while still alive that are alive still.

        Called when backward begins, at ``stats()`` and when a new pass opens: by then the
        forward that held them is over (a RoPE table made per forward, a layer input that is
        also the next layer's, are gone), so what is still alive is kept by something else,
        and its copy saved nothing.
        """
        # Taken before reading: on CUDA backward (this, from _unpack) runs on a device thread
        # while another thread's forward may let go of more storages (a dict must not grow
        # while it is read). Those land in the fresh dict, judged next time.
        suspects, self._suspects = self._suspects, {}
        for ref, nbytes in suspects.values():
            self._judge(ref, nbytes)

    def _judge(self, ref: StorageWeakRef, nbytes: int, /) -> None:
        """One storage let go while still alive, now that the forward holding it is over."""
        if ref.expired():
            return
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        if getattr(storage, DISCARDED_MARK, False):  # NOTE [discarded storages are marked]
            self._copied_and_discarded(nbytes)
            return
        self._counters["alive_elsewhere_bytes"] += nbytes
        log.debug("offloaded storage of %d bytes is still alive elsewhere", nbytes)

    def _copied_and_discarded(self, nbytes: int) -> None:
        """A window storage freed in place after its copy to host: output discard's
        ``resize_(0)`` (``CheckpointWithoutOutput``, ``ResidualStreamRecomputeContext``) of an
        output a boundary took as input. Both give the same bytes back for backward, so the
        numbers are exact, but the work is done twice: copied to host and back, and
        recomputed."""
        self._counters["discarded_bytes"] += nbytes
        if not self._warned_discarded:
            self._warned_discarded = True
            log.warning(
                "offload copied to host %d bytes of a boundary input that output discard then "
                "freed: they are copied back and also recomputed for backward (exact, but done "
                "twice; stats()['discarded_bytes'] counts them). Keep one of the two for such "
                "tensors: do not discard outputs that a checkpointed layer takes as input "
                "(offload moves them to host already), or leave those layers' offload off",
                nbytes)

    def _suspect(self, ref: StorageWeakRef, nbytes: int) -> None:
        """Note a storage let go while still alive, for ``_judge_alive``.

        NOTE [suspects stay bounded]: they are judged when a backward or a new pass begins, or
        at ``stats()``; forwards that never reach backward while some graph stays alive
        (grad-enabled evaluation that keeps its last output until the next forward) do neither,
        so the record must not grow per forward: one entry per storage (our weak reference
        keeps its ``cdata`` from being reused), and entries of storages gone since are
        dropped as new ones come.
        """
        entry = self._suspects.get(ref.cdata)
        if entry is not None and not entry[0].expired():
            self._suspects[ref.cdata] = (entry[0], entry[1] + nbytes)
            return
        if len(self._suspects) >= self._suspects_limit:  # amortized: the limit doubles
            self._suspects = {key: value for key, value in self._suspects.items()
                              if not value[0].expired()}
            self._suspects_limit = max(64, 2 * len(self._suspects))
        self._suspects[ref.cdata] = (ref, nbytes)

    # -- forward -----------------------------------------------------------------------------
    def _collect_finished(self, *, force_before: int | None = None,
                          keep: Sequence[Window] = ()) -> None:
        """Let go of device tensors whose copy to host completed, and of those from windows
        opened before ``force_before``, once the compute stream waits for their copy.

        NOTE [copies in flight]: a host running ahead of the device (the usual case with large
        layers) would otherwise find no copy complete and keep every layer input on the device
        until backward: the peak would not drop. So a window's device tensors are released
        two windows later at the latest: the stream that was current when the tensor was
        saved (not the host, and not whatever stream is current now) waits on the copy's
        event; the freed memory belongs to that stream, so the allocator reuses it only for
        kernels ordered after the wait. The copy of window ``k`` overlaps window ``k+1``'s
        compute; window ``k+2`` waits for it. Backward's first restore releases every copy
        still in flight the same way, those of the windows it restores now (``keep``) last:
        it reuses their device bytes (NOTE [reuse at the turn]).
        """
        kept = {id(copy) for window in keep for copy in window.copies.values()}
        still = []
        for copy in self._pending:
            if id(copy) in kept:
                still.append(copy)
            elif copy.reused or self.engine.done(copy.d2h_event):
                # NOTE [reuse at the turn] (window.py): a reused copy's storage is held by its
                # restore, which backward reads (as the copy to host does): backward need not wait
                # for that copy. Stream rule 1 is applied when backward lets go (Copy.__del__).
                copy.drop_device_copy()
            elif force_before is not None and copy.seq < force_before:
                # Stream rule 1: the stream current at the save, which owns the memory, waits.
                self.engine.wait(copy.d2h_event, stream=copy.stream)
                copy.drop_device_copy()
            else:
                still.append(copy)
        self._pending = still

    def _open(self, tensors: Sequence[torch.Tensor], name: Callable[[int], str] | None,
              resident: Sequence[torch.Tensor] = ()) -> Window:
        # The window opening now is number ``self._opened``; its predecessor's copy may still
        # run (it overlaps this window's compute), older ones must be done.
        self._collect_finished(force_before=self._opened - 1)
        if self._pass.backward or not self._pass.alive():
            # A new pass: ids restart at 0, the shared-storage registry and event log too.
            self._check_pass_offloaded(self._pass)
            self._judge_alive()
            self._pass = Pass()
        keys: dict[tuple[str, int], int | None] = {}
        resident_keys: set[tuple[str, int]] | None = None
        for index, tensor in enumerate(tensors):
            if _is_parameter(tensor):
                continue
            key = self._plain_storage_key(tensor)
            if key is None:
                continue
            # A .detach() or .data alias of a parameter is a leaf (requiring grad or not, as
            # after .requires_grad_()), or a view of one, and neither a Parameter nor a view of
            # one: only its storage tells. Activations are rarely leaves or views of leaves
            # (a model input is), so the resident keys are read only for those that are.
            base = tensor._base
            if resident and (tensor.is_leaf or (base is not None and base.is_leaf)):
                if resident_keys is None:
                    resident_keys = {k for t in resident
                                     if (k := self._plain_storage_key(t, warn=False))}
                if key in resident_keys:
                    continue
            keys.setdefault(key, index)
        self._counters["windows"] += 1
        self._opened += 1
        return Window(self._pass, keys, name, seq=self._opened - 1)

    def _check_pass_offloaded(self, pass_: Pass) -> None:
        if pass_.offloaded:
            self._ever_offloaded = True
        elif (pass_.largest_small > 0 and not self._ever_offloaded
                and not self._warned_nothing):
            self._warned_nothing = True
            log.warning(
                "offload is on, but the last pass offloaded nothing: the window storages on %s "
                "were below OffloadConfig.min_bytes=%d (the largest had %d bytes); lower "
                "min_bytes to offload them, or turn offload off (if your batches vary in "
                "length, longer ones may reach it)", self.device,
                self.config.min_bytes, pass_.largest_small)
        pass_.offloaded = pass_.largest_small = 0  # stats() after the next window: no repeat

    def _pack(self, window: Window, tensor: torch.Tensor) -> Any:
        # What stays on the device is still checked for in-place changes when unpacked: NOTE
        # [hooks switch off the in-place check] in pytree_ckpt/saved.py.
        if _is_parameter(tensor):
            return Unchanged(tensor)
        # Not a window tensor's storage, or none to copy (warned of when the window opened).
        key = self._plain_storage_key(tensor, warn=False)
        if key is None or key not in window.keys:
            return Unchanged(tensor)
        if tensor.device != self.device:
            self._other_device(window, key, tensor)
            return Unchanged(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes < self.config.min_bytes:
            if key not in window.small:
                window.small.add(key)
                self._counters["below_min_bytes"] += nbytes
                window.pass_.largest_small = max(window.pass_.largest_small, nbytes)
            return Unchanged(tensor)
        copy = window.copies.get(key)
        if copy is None or not copy.holds(tensor):
            copy = window.pass_.shared.get(key)
            if copy is None or not copy.holds(tensor):
                copy = Copy(self, window, tensor)
                window.pass_.shared[key] = copy
                _report_offload(copy, tensor)
            else:
                # This window's boundary has just reported the storage as its input; what
                # holds it for backward is the earlier window's copy (the census filed it as a
                # resident boundary input, never flagged when the caller keeps it).
                _report_shared(copy, tensor)
            window.copies[key] = copy
        return Handle(copy, window, key, tensor)

    def _plain_storage_key(self, tensor: torch.Tensor, *,
                           warn: bool = True) -> tuple[str, int] | None:
        """The tensor's storage key, or ``None`` where it has no plain storage to copy: sparse
        layouts, nested tensors, and wrapper subclasses (DTensor and the like) whose bytes live
        in inner tensors; quantized tensors too (a restore from bytes would lose their scale
        and zero point). Window tensors of that kind stay on the device, logged once."""
        if tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_quantized:
            try:
                return storage_key(tensor)
            except RuntimeError:  # "invalid python storage": a wrapper subclass
                pass
        if warn and not self._warned_plain:
            self._warned_plain = True
            log.warning(
                "offload is on, but a window tensor (%s, layout %s) has no plain storage to copy: "
                "it stays on the device (offload copies strided storages; a DTensor's local "
                "shard, DTensor.to_local(), is one)",
                "nested tensor" if tensor.is_nested else "quantized tensor"
                if tensor.is_quantized else type(tensor).__name__, tensor.layout)
        return None

    def _other_device(self, window: Window, key: tuple[str, int], tensor: torch.Tensor) -> None:
        # Not silent: the usual cause is a manager built (or a default one picked) before
        # torch.cuda.set_device(local_rank), so every rank but one would offload nothing.
        if key in window.small:
            return
        window.small.add(key)  # counted once per window storage, like the size floor
        self._counters["other_device_bytes"] += tensor.untyped_storage().nbytes()
        if not self._warned_device:
            self._warned_device = True
            log.warning(
                "offload is on for %s, but a window's tensors are on %s: they stay there, "
                "nothing of theirs is offloaded; build the manager with device=%r, or call "
                "torch.cuda.set_device() before applying checkpointing with offload=True or "
                "XTUNER_ACTIVATION_OFFLOAD=1", self.device, tensor.device, str(tensor.device))

    def offload_into(self, window: Window, tensor: torch.Tensor, /) -> Any:
        """Offload ``tensor`` (not saved by autograd: a replay frame's result) in ``window``.

        Returns an opaque handle: always pass it to ``restore``. Where the window rule says no
        (below ``min_bytes``, another device, a parameter) it holds ``tensor`` itself, and
        ``restore`` checks that it was not changed in place since.
        """
        key = self._plain_storage_key(tensor)
        if key is not None:
            window.keys.setdefault(key, None)
        return self._pack(window, tensor)

    def restore(self, packed: Any, /) -> torch.Tensor:
        """The tensor behind a handle from ``offload_into`` (restoring it if needed)."""
        return self._unpack(packed)

    @contextmanager
    def window(self, tensors: Sequence[torch.Tensor], /, *,
               name: Callable[[int], str] | None = None,
               resident: Sequence[torch.Tensor] = ()) -> Iterator[Window]:
        """Offload what autograd saves on the storages of ``tensors`` while the block runs.

        ``name(i)``, if given, says where ``tensors[i]`` came from in error messages (the
        boundary passes the input's key path, e.g. ``args[0]``). ``resident``: tensors whose
        storages stay on the device even when a window tensor shares them (the boundary passes
        its module's parameters, so that a ``.detach()`` alias of one is not copied).
        """
        _refuse_non_tensors(tensors)
        window = self._open(tensors, name, resident)

        def pack(tensor: torch.Tensor) -> Any:
            packed = self._pack(window, tensor)
            if type(packed) is Unchanged and census_active():
                # Left on the device, held as autograd holds it. These hooks shadow an
                # ActivationCensus's own: it hears of the save from here, as a plain autograd
                # save (a boundary's input it already has under the boundary stays filed
                # there). What offload_into leaves, its caller reports (a replay frame).
                report_held([tensor], Mechanism.AUTOGRAD, holder=packed)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield window
        # NOTE: device tensors are released one window late (at the next window, the first
        # restore in backward, or stats()): by then the copy has usually completed, and the
        # caller has dropped its own reference to the window's inputs, so "still alive
        # elsewhere" means something really keeps them.

    # -- backward ----------------------------------------------------------------------------
    def _restore_window(self, window: Window, *, kind: str) -> None:
        for copy in list(window.copies.values()):
            copy.restore()
        # Only now: a restore that failed (out of memory) is retried at the next unpack.
        window.restored = True
        window.pass_.events.append((kind, window.id))
        if kind == "prefetch":
            window.pass_.prefetched.add(window.id)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return packed.get()  # Unchanged
        packed.check_unmodified()
        copy = packed.copy
        window = packed.window  # not copy.window: a shared copy may come from an earlier one
        pass_ = window.pass_
        # The first unpack from a window restores it, or records that a prefetch did; either
        # way backward has moved on to it, so the windows before it are prefetched.
        restore_now = not window.restored
        moved_on = restore_now or window.id in pass_.prefetched
        if restore_now:
            pass_.backward = True
            self._recent = pass_
        elif moved_on:
            pass_.prefetched.discard(window.id)
            pass_.events.append(("prefetch_hit", window.id))
            self._counters["prefetch_hits"] += 1
        ahead = self._prefetch_targets(window) if moved_on else []
        # Backward began: nothing from forward stays on the device, but what is restored now
        # reuses the device bytes still held for it (NOTE [reuse at the turn]). The rest is
        # let go first, before any restore allocates; the reused ones once restored.
        if self._pending:
            self._collect_finished(force_before=self._opened,
                                   keep=[window, *ahead] if restore_now else ahead)
        if restore_now:
            self._restore_window(window, kind="restore")
        for earlier in ahead:
            self._restore_window(earlier, kind="prefetch")
        if self._pending:
            self._collect_finished(force_before=self._opened)
        if self._suspects and restore_now:
            self._judge_alive()
        copy.restore()  # no-op unless the window no longer lists it (replaced after a change)
        self.engine.wait(copy.h2d_event)
        assert copy.restored is not None
        self.engine.use_here(copy.restored, allocated_on=copy.restored_on)
        restored = torch.empty(0, dtype=packed.dtype, device=copy.device).set_(
            copy.restored.untyped_storage(), packed.offset, packed.size, packed.stride)
        # NOTE [lazy bits] in window.py: the layout does not carry a conj or neg bit.
        if packed.conj:
            restored = restored.conj()
        if packed.neg:
            restored = torch._neg_view(restored)
        return as_kind(restored, packed.subclass)  # NOTE [subclasses come back as themselves]

    def _prefetch_targets(self, window: Window) -> list[Window]:
        """The windows before ``window`` to restore now, nearest first (backward needs it
        first): up to ``prefetch`` windows back that have something to restore, those of its
        pass alive and not restored yet.

        NOTE [empty windows take no prefetch slot]: a window that copied nothing (every storage
        below ``min_bytes``, on another device, or a parameter) stays alive with its graph
        (autograd keeps the hooks) but no handle of its ever unpacks, so no prefetch hit on it
        would move the prefetch on. Counted as a slot, it would end the chain: the window
        before it would be restored on demand, an exposed copy. It is passed over instead.
        """
        windows = window.pass_.windows
        targets = []
        budget = self.config.prefetch
        earlier_id = window.id - 1
        while budget > 0 and earlier_id >= 0:
            earlier = windows.get(earlier_id)
            earlier_id -= 1
            if earlier is None or not earlier.copies:
                continue
            budget -= 1
            if not earlier.restored:
                targets.append(earlier)
        return targets


def _refuse_non_tensors(tensors: Any, /) -> None:
    """``window``'s argument: a sequence of tensors (iterating one tensor would give its
    rows, each a view of its storage)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise CheckpointConfigError(
            "OffloadManager.window takes a list or tuple of tensors",
            expected="Sequence[torch.Tensor]", got=type(tensors).__name__,
            tip="wrap one tensor in a list: manager.window([x])")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointConfigError(
                f"OffloadManager.window takes tensors: tensors[{index}] is not one",
                expected="torch.Tensor", got=type(tensor).__name__,
                tip="pass only the tensors whose storages the block's saves should go to host "
                    "from (leave out None and other values)")


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one: never offloaded (its storage stays resident anyway, and
    restoring it would allocate a second copy of the whole parameter)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _new_manager(config: OffloadConfig, device: str) -> OffloadManager:
    return OffloadManager(config, device=device)


_default_managers: dict[str, OffloadManager] = {}
_default_lock = threading.Lock()


def is_default_manager(manager: OffloadManager, /) -> bool:
    """Whether ``manager`` is a default one (``offload=True``); creates none."""
    with _default_lock:
        return any(m is manager for m in _default_managers.values())


def default_manager() -> OffloadManager:
    """The process's manager for ``offload=True`` / XTUNER_ACTIVATION_OFFLOAD=1, one per device.

    The device is the current CUDA device when this is called (when checkpointing is
    applied): call ``torch.cuda.set_device(local_rank)`` first. Windows and copies live on the
    autograd graph; across steps it keeps its host pool (the point of a pool) and counters.
    """
    device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    with _default_lock:
        manager = _default_managers.get(device)
        if manager is None:
            manager = _default_managers[device] = OffloadManager(device=device)
    return manager


def _report_offload(copy: Copy, tensor: torch.Tensor) -> None:
    if census_active():
        # The device storage is held (by us) until its copy completed, then flagged if it is
        # still alive; the host copy is held while the copy object lives.
        report_held([tensor], Mechanism.OFFLOAD_IN_FLIGHT, holder=copy, replace=True)
        assert copy.host is not None  # set for as long as the copy is in use
        report_held([copy.host], Mechanism.OFFLOADED, holder=copy.host_holder)


def _report_shared(copy: Copy, tensor: torch.Tensor) -> None:
    if census_active():  # its host copy was reported with the copy
        report_held([tensor], Mechanism.OFFLOAD_IN_FLIGHT, holder=copy, replace=True)


def env_flag(name: str, /) -> bool:
    """Parse an on/off environment variable: ``1``/``true`` on, ``0``/``false``/unset off."""
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "0", "false"):
        return False
    if raw.strip().lower() in ("1", "true"):
        return True
    raise CheckpointConfigError(
        f"{name}={raw!r} is not understood; accepted values: 1, true (on), 0, false or unset "
        "(off)", expected="1 | true | 0 | false | unset", got=repr(raw),
        tip=f"unset {name}, or set it to 1 or 0")
