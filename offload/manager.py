"""The offload manager: storage windows, one host copy per storage, bounded prefetch.

``with manager.window(tensors):`` installs saved-tensor hooks for its duration. A tensor that
autograd saves inside it is offloaded when its untyped storage is the storage of one of the
window's tensors and that storage reaches ``min_bytes``; anything else (parameters and views
of them always, tensors without a plain storage too) is saved as usual.

NOTE [passes, window ids and prefetch]: a pass is one forward's windows; one planner (the
manager) numbers them densely from 0 in call order, per thread (NOTE [a pass per forward
thread] in lanes.py). A window opens a new pass when no window of its thread's current pass is
alive, or when backward has begun on that pass (pipeline schedules run the next micro-batch's
forward while earlier graphs are still alive). The pass's state (its window list, event log,
shared-storage registry) hangs off its windows and goes with them, so schedules that always
keep some graph alive do not accumulate it. In backward, the first unpack from window ``i``
restores it (if no prefetch did) and starts restoring windows ``i-1 .. i-prefetch`` of the
same pass, which backward needs next.

Beside it: what a save in a window becomes (packing.py), what backward's unpack sets off
(unpacking.py), the device tensors held for copies in flight (in_flight.py), which storages a
window takes (storages.py), the storages let go while still alive and the verdicts on them
(liveness.py), the objects a window is made of (window.py), the copy streams (streams.py), the
host pool (pool.py), ``OffloadConfig`` (config.py), and what ``offload=True`` and
XTUNER_ACTIVATION_OFFLOAD mean (defaults.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from pytree_ckpt.census import Mechanism, census_active, report_held
from pytree_ckpt.eager import runs_eagerly
from pytree_ckpt.errors import CheckpointConfigError, require_callable, validate_bool
from pytree_ckpt.phase import ACTIVE, REBUILDING
from pytree_ckpt.recording import proxy_tracing, tracer_records
from pytree_ckpt.saved import Unchanged, note_hooks_disabled
from pytree_ckpt.subclass import rebuilt_parts
from pytree_ckpt.tree import describe_leaf

from .config import OffloadConfig, refuse_torchtune_options
from .lanes import Lanes
# default_manager: also what a manager pickled before the split names (``offload.manager``).
from .defaults import default_manager, is_default_for
from .in_flight import InFlight
from .liveness import Liveness
from .packing import pack_saved
from .pool import HostPool
from .prefetch import Prefetch
from .storages import plain_kind, plain_storage_key, refuse_non_tensors, window_keys
from .streams import CopyEngine
from .unpacking import unpack_handle
from .window import Flattened, Handle, OffloadHandle, Pass, Window

__all__ = ["OffloadManager"]

log = logging.getLogger(__name__)

# stats()'s counters, in the order it gives them.
_COUNTERS = ("offloaded_bytes", "restored_bytes", "reused_bytes", "prefetch_hits",
             "prefetch_oom", "alive_elsewhere_bytes", "discarded_bytes", "below_min_bytes",
             "other_device_bytes", "windows")


# NOTE [a window in compiled code]: dynamo would trace a window opened inside a compiled
# function, and its pack hook, and replay their side effects with the weak references a copy
# holds rebuilt as the objects (backward raised TypeError: helper JI). The window is opened and
# closed eagerly instead: a graph break, after which dynamo runs the rest of that frame eagerly.
WINDOW_REASON = (
    "offload's OffloadManager.window opens and closes eagerly: it installs saved-tensor hooks "
    "that copy to host memory, outside any graph. Open the window outside the compiled "
    "function, or compile the block inside it, to avoid the graph break. To export a model "
    "that opens one, use torch.export's default strict=False, where the window copies "
    "nothing (docs/offload.md)")


def _device(device: object, /) -> torch.device:
    """``device=`` as torch reads it; what torch cannot read (``"gpu"``, a list, an index
    without an accelerator) is refused in the library's terms."""
    try:
        read = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as error:
        raise CheckpointConfigError(
            f"OffloadManager(device={device!r}) is not a device torch can use here",
            expected="a torch.device or its string ('cuda', 'cuda:1', 'cpu'), or None",
            got=f"{device!r}: {str(error).splitlines()[0]}",
            tip="leave device out (the current CUDA device, or the CPU without one)") from error
    # Tensors on the CPU say `cpu`, never `cpu:0`: an indexed one ("cpu:0", which code built as
    # f"{kind}:{index}" gives) matched no tensor, and nothing was offloaded (helper HY).
    return torch.device("cpu") if read.type == "cpu" else read


class OffloadManager:
    """Offloads saved activations by storage windows to a pooled host buffer."""

    def __init__(self, config: OffloadConfig | None = None, /, *,
                 device: torch.device | str | None = None, min_offload_size: None = None,
                 use_pin_memory: None = None, use_streams: None = None,
                 max_fwd_stash_size: None = None, min_bytes: None = None,
                 prefetch: None = None, pin_memory: None = None) -> None:
        # torchtune's OffloadActivations options, refused with what each is here.
        refuse_torchtune_options("OffloadManager", {
            "min_offload_size": min_offload_size, "use_pin_memory": use_pin_memory,
            "use_streams": use_streams, "max_fwd_stash_size": max_fwd_stash_size})
        # OffloadConfig's own fields, the likelier slip: refused naming the config (helper JT:
        # Python's bare "unexpected keyword argument" named no fix).
        fields = {name: value for name, value in (("min_bytes", min_bytes),
                  ("prefetch", prefetch), ("pin_memory", pin_memory)) if value is not None}
        if fields:
            given = ", ".join(f"{name}={value!r}" for name, value in fields.items())
            raise CheckpointConfigError(
                f"OffloadManager takes {' and '.join(fields)} in its OffloadConfig",
                expected="OffloadManager(OffloadConfig(...), device=...)",
                got=f"OffloadManager({given})",
                tip=f"OffloadManager(OffloadConfig({given}))")
        if config is not None and not isinstance(config, OffloadConfig):
            raise CheckpointConfigError(
                "OffloadManager takes an OffloadConfig", expected="OffloadConfig or None",
                got=type(config).__name__,
                tip="OffloadManager(OffloadConfig(min_bytes=0, prefetch=2))")
        self.config = config if config is not None else OffloadConfig()
        self.device = _device(device) if device is not None else (
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
        # Copies to host in flight, whose device tensors it still holds (in_flight.py).
        self._pending = InFlight()
        # Tallies of passes that died unchecked (``Pass.__del__``), for the "offloaded nothing"
        # warning; appended to without the lock, taken out under it.
        self._ended: deque[tuple[int, int]] = deque()
        # Each thread's passes: the one its new windows join, and the one whose backward began
        # last (for ``events()``). Older passes are held only by their windows (NOTE [passes,
        # window ids and prefetch]), and a thread's by nothing once it ends (lanes.py).
        self._lanes = Lanes(self._ended)
        # Reset in place, never replaced: the liveness verdicts and the copies count into it.
        self._counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._reset_counters()
        # Warned of a pass that offloaded nothing; some pass offloaded something (a short batch
        # among long ones is below min_bytes, and says nothing about the setting).
        self._warned_nothing = False
        self._ever_offloaded = False
        self._warned_device = False
        self._warned_plain = False
        # Storages let go while still alive: judged when backward begins (liveness.py).
        self._liveness = Liveness(self._counters)
        # Which windows backward restores ahead, and a prefetch given up (prefetch.py).
        self._prefetch = Prefetch(self.config.prefetch, self.device, self._counters)
        # NOTE [one thread at a time]: threads may share a manager (each its own forward and
        # backward; on CUDA autograd unpacks on a device thread while a forward may pack on
        # another). Each thread's forward has passes of its own (NOTE [a pass per forward
        # thread] in lanes.py), but they share the pool, the counters, the copies in flight
        # and the storages let go while alive, and two threads may reach one copy (a storage
        # passed to both, a handle of ``offload_into`` restored twice). Every entry point
        # (opening a window, each save, each unpack, offload_into, stats, events) holds this
        # lock: two restores of one copy, each seeing "not restored yet", copied it back twice
        # (on CUDA the second could read the first's buffer before its event was set).
        # Re-entrant: a saved-tensor hook or census code run from inside (reading stats(),
        # say) must not block its own thread. Copy.__del__ never takes it: the garbage
        # collector may run it on a thread that holds the pool's lock, which this lock's holder
        # may be waiting for; what it counts waits in a queue that stats() empties under this
        # lock (NOTE [counted late] in liveness.py; so do passes that die unchecked).
        self._lock = threading.RLock()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # NOTE: a pickled model (its wrapped layers' options hold the manager) comes back with
        # a manager of the same config and device and none of the run-time state (host pool,
        # streams, counters, graphs' windows); layers that shared one share the new one
        # (pickle memoizes it). The process's default manager comes back as the loading
        # process's default_manager() (its current device: a rank loads onto its own GPU).
        device = str(self.device)
        if is_default_for(self, device):
            return default_manager, ()
        return _new_manager, (self.config, device)

    # -- statistics --------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self._counters.update(dict.fromkeys(_COUNTERS, 0))  # one call: no key is ever missing
        self._pool_base = (self.pool.hits, self.pool.misses)
        self.engine.reset_waits()

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """Counters since the last reset: bytes, pool hits/misses, prefetch hits, waits."""
        validate_bool(reset, name="reset", default=False)
        with self._lock:  # NOTE [one thread at a time]
            return self._stats(reset=reset)

    def _stats(self, *, reset: bool) -> dict[str, float]:
        self._pending.let_go(self.engine, None, everyone=True)
        # NOTE [judged once the forward is over]: while a pass's forward may still run (alive,
        # no backward yet) what it let go may be alive for the forward itself (a RoPE table or
        # cu_seqlens every layer gets, the next layer's input): judged now, a stats() read
        # from a hook between layers counted them as alive elsewhere. They wait for its
        # backward, the next pass, or a stats() after the graph is gone (judge_all leaves
        # them; another thread's forward may be the one still running).
        self._liveness.judge_all()
        for lane in self._lanes:
            if not lane.current.alive():  # the pass is over
                self._check_pass_offloaded(lane.current)
        self._check_ended()
        self._liveness.count_late()
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
        """``("restore" | "prefetch" | "prefetch_hit" | "prefetch_oom", window id)`` in order
        (``prefetch_oom``: a prefetch given up, out of device memory), for the pass whose
        backward began last among those whose forward ran on the calling thread (wherever the
        backward ran); empty before any backward, and on a thread that opened no window."""
        with self._lock:
            lane = self._lanes.mine_if_any()
            return list(lane.recent.events) if lane is not None else []

    # -- forward -----------------------------------------------------------------------------

    def _open(self, tensors: Sequence[torch.Tensor], name: Callable[[int], str] | None,
              resident: Sequence[torch.Tensor] = (), changed_tip: str | None = None
              ) -> Window:
        # The window opening now is the lane's number ``lane.opened``; its predecessor's copy
        # may still run (it overlaps this window's compute), older ones must be done.
        lane = self._lanes.mine()
        self._pending.let_go(self.engine, lane, force_before=lane.opened - 1)
        if lane.current.over():
            # A new pass: ids restart at 0, the shared-storage registry and event log too.
            self._check_pass_offloaded(lane.turn())
            self._check_ended()
            self._liveness.judge_all()
        keys = window_keys(tensors, resident, self._plain_storage_key)
        self._counters["windows"] += 1
        lane.opened += 1
        return Window(lane.current, keys, name, seq=lane.opened - 1, changed_tip=changed_tip)

    def _check_pass_offloaded(self, pass_: Pass) -> None:
        self._check_offloaded(pass_.offloaded, pass_.largest_small)
        pass_.offloaded = pass_.largest_small = 0  # stats() after the next window: no repeat

    def _check_ended(self) -> None:
        """Check the passes that died before they were checked (``Pass.__del__``)."""
        while self._ended:
            self._check_offloaded(*self._ended.popleft())

    def _check_offloaded(self, offloaded: int, largest_small: int) -> None:
        if offloaded:
            self._ever_offloaded = True
        elif largest_small > 0 and not self._ever_offloaded and not self._warned_nothing:
            self._warned_nothing = True
            log.warning(
                "offload is on, but the last pass offloaded nothing: the window storages on %s "
                "were below OffloadConfig.min_bytes=%d (the largest had %d bytes); lower "
                "min_bytes to offload them (a manager of your own, passed as offload=: "
                "offload.OffloadManager(offload.OffloadConfig(min_bytes=...)); the one "
                "offload=True or XTUNER_ACTIVATION_OFFLOAD=1 makes keeps the default), or turn "
                "offload off (if your batches vary in length, longer ones may reach it)",
                self.device,
                self.config.min_bytes, largest_small)

    def _pack(self, window: Window, tensor: torch.Tensor) -> Any:
        """What autograd holds for ``tensor``, saved in ``window`` (packing.py)."""
        return pack_saved(self, window, tensor)

    def _plain_storage_key(self, tensor: torch.Tensor, /) -> tuple[str, int] | None:
        """``plain_storage_key`` (storages.py) of a window tensor: one without a plain storage
        stays on the device, logged once."""
        key = plain_storage_key(tensor)
        if key is None and not self._warned_plain:
            self._warned_plain = True
            log.warning(
                "offload is on, but a window tensor (%s, layout %s) has no plain storage to copy: "
                "it stays on the device (offload copies strided storages, and a DTensor's local "
                "shard)", plain_kind(tensor), tensor.layout)
        return key

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

    def offload_into(self, window: Window, tensor: torch.Tensor, /) -> OffloadHandle:
        """Offload ``tensor`` (not saved by autograd: a replay frame's result) in ``window``.

        Returns an opaque handle: always pass it to ``restore``. Where the window rule says no
        (below ``min_bytes``, another device, a parameter) it holds ``tensor`` itself, and
        ``restore`` checks that it was not changed in place since; an inference tensor, which
        has no version to check, it holds as it is.
        """
        if type(window) is not Window or not isinstance(tensor, torch.Tensor):
            wrong = "window" if type(window) is not Window else "tensor"
            raise CheckpointConfigError(
                f"OffloadManager.offload_into takes a window and a tensor: its {wrong} is not one",
                expected="manager.offload_into(window, t), window bound by `with "
                         "manager.window(tensors) as window:`",
                got=f"window: a {type(window).__name__}, tensor: a {type(tensor).__name__}",
                tip="pass the window first, then the tensor; keep the handle it returns for "
                    "restore()")
        with self._lock:  # NOTE [one thread at a time]
            if tensor.is_inference():
                # Made under inference_mode: no version counter for a copy to check, and
                # autograd would not save it either (a boundary input made so stays on the
                # device too): held as it is, uncounted.
                return Unchanged(tensor)
            for part in rebuilt_parts(tensor):  # a DTensor: its local shard
                key = self._plain_storage_key(part)
                if key is not None:
                    window.keys.setdefault(key, None)
            return self._pack(window, tensor)

    def restore(self, packed: OffloadHandle, /) -> torch.Tensor:
        """The tensor behind a handle from ``offload_into`` (restoring it if needed)."""
        if not isinstance(packed, (Handle, Unchanged, Flattened)):
            raise CheckpointConfigError(
                "OffloadManager.restore takes a handle that offload_into returned",
                expected="handle = manager.offload_into(window, t); t = manager.restore(handle)",
                got=describe_leaf(packed),
                tip="keep what offload_into returned and pass that, not the tensor itself")
        return self._unpack(packed)

    @runs_eagerly(WINDOW_REASON)
    def window(self, tensors: Sequence[torch.Tensor], /, *,
               name: Callable[[int], str] | None = None,
               resident: Sequence[torch.Tensor] = ()) -> _WindowContext:
        """Offload what autograd saves on the storages of ``tensors`` while the block runs.

        ``name(i)``, if given, says where ``tensors[i]`` came from in error messages (the
        boundary passes the input's key path, e.g. ``args[0]``). ``resident``: tensors whose
        storages stay on the device even when a window tensor shares them (the boundary passes
        its module's parameters, so that a ``.detach()`` alias of one is not copied).
        """
        return _WindowContext(self.eager_window(tensors, name=name, resident=resident))

    @contextmanager
    def eager_window(self, tensors: Sequence[torch.Tensor], /, *,
                     name: Callable[[int], str] | None = None,
                     resident: Sequence[torch.Tensor] = (),
                     changed_tip: str | None = None) -> Iterator[Window]:
        """``window`` for a caller that runs eagerly already (the boundary: no wrapper).

        ``changed_tip``: the tip for a window tensor changed in place after its save (the
        boundary gives its own: it keeps every input for the replay)."""
        if tracer_records() or proxy_tracing():
            # NOTE [a tracer records the plain forward] and NOTE [make_fx records storages
            # nowhere] (pytree_ckpt/recording.py): the program
            # holds the block's ops, not the window's hooks (helper LI: fx's proxies refused as
            # "not tensors"; a non-strict export and jit.trace opened real windows over fake or
            # traced tensors). Before the refusals, which a Proxy would fail.
            with self._lock:  # NOTE [one thread at a time]
                traced = Window(Pass(self._lanes.mine(), deque()), {}, name, seq=-1)
            yield traced
            return
        refuse_non_tensors(tensors)
        refuse_non_tensors(resident, name="resident")
        if name is not None:
            # Checked now: its first use is in the message of a refused backward, which a
            # TypeError from calling it would replace.
            require_callable(name, "OffloadManager.window's name=", "name=lambda i: "
                             "f'block.args[{i}]', or leave it out ('window tensor #i')",
                             role="a function from a tensor's index to its name in messages")
        if ACTIVE.get() is not None or REBUILDING.get():
            # NOTE [a window in a replay copies nothing]: a window() of the layer's own, opened
            # again as a boundary's replay reruns the layer in backward, where what it saves is
            # read back at once by the replay's own backward: copied to host and straight back
            # (helper KM: a host round trip per layer, and each replay's window turned the
            # pass, its events lost). Likewise in a boundary's original pass, where only an
            # enable_grad region saves anything, for a backward of its own before the pass ends
            # (helper KY), and in an output discard's rebuild (NOTE [a discard's rebuild opens
            # no window] in pytree_ckpt/phase.py). The pass runs it with no hooks, as a
            # boundary nested in another opens no window; the window bound is one of no pass
            # of the manager's.
            with self._lock:  # NOTE [one thread at a time]
                idle = Window(Pass(self._lanes.mine(), deque()), {}, name, seq=-1)
            yield idle
            return
        with self._lock:  # NOTE [one thread at a time]
            window = self._open(tensors, name, resident, changed_tip)

        # NOTE [a window in compiled code]: a partial of a method dynamo skips, not a closure
        # (a closure wrapped per window was kept alive by dynamo's wrapper).
        hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack_saved, window), self._unpack)
        try:
            hooks.__enter__()
        except RuntimeError as error:
            note_hooks_disabled(error, "offload", "run this call outside that context, or "
                                "without offload (offload=False when wrapping the layer)")
            raise
        try:
            yield window
        finally:
            hooks.__exit__()
            window.open_copies = None  # the graph's handles hold them from here on
        # NOTE: device tensors are released one window late (at the next window, the first
        # restore in backward, or stats()), or with the graph if it is dropped first (NOTE [a
        # copy nobody needs is not held] in in_flight.py): by then the copy has usually
        # completed, and the caller has dropped its own reference to the window's inputs, so
        # "still alive elsewhere" means something really keeps them.

    @runs_eagerly(WINDOW_REASON)
    def _pack_saved(self, window: Window, tensor: torch.Tensor, /) -> Any:
        """The window's pack hook."""
        with self._lock:
            packed = self._pack(window, tensor)
        if type(packed) in (Unchanged, Flattened) and census_active():
            # Left on the device, held as autograd holds it. These hooks shadow an
            # ActivationCensus's own: it hears of the save from here, as a plain autograd
            # save (a boundary's input it already has under the boundary stays filed
            # there); a wrapper copied in part, of the inner tensors it left. What
            # offload_into leaves, its caller reports (a replay frame).
            for held in ([packed] if type(packed) is Unchanged else packed.left_on_device()):
                report_held([held.tensor], Mechanism.AUTOGRAD, holder=held)
        return packed

    # -- backward ----------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Flattened):
            return packed.rebuild({name: self._unpack(inner)
                                   for name, inner in packed.inner.items()})
        if not isinstance(packed, Handle):
            return packed.get()  # Unchanged
        with self._lock:  # NOTE [one thread at a time]
            return unpack_handle(self, packed)


class _WindowContext:
    """What ``OffloadManager.window`` returns: its context, entered and left eagerly (NOTE
    [a window in compiled code])."""

    __slots__ = ("_inner", "_entered")

    def __init__(self, inner: AbstractContextManager[Window], /) -> None:
        self._inner = inner
        self._entered = False

    @runs_eagerly(WINDOW_REASON)
    def __enter__(self) -> Window:
        if self._entered:  # a window is one block: its storages and ids are that block's
            raise CheckpointConfigError(
                "an OffloadManager.window(...) was entered a second time",
                expected="a new window for each block: with manager.window(tensors): ...",
                got="the object one window(...) call returned, used in a second with",
                tip="call manager.window(tensors) again for the next block")
        self._entered = True
        return self._inner.__enter__()

    @runs_eagerly(WINDOW_REASON)
    def __exit__(self, *raised: Any) -> bool | None:
        return self._inner.__exit__(*raised)


def _new_manager(config: OffloadConfig, device: str) -> OffloadManager:
    # Named by every pickled manager (``__reduce__``): it stays here, under this name.
    return OffloadManager(config, device=device)
