"""What the replay must see as the original pass saw it: RNG streams, autocast state, the
kernel switches (NOTE [the replay picks the forward's kernels]), the torch-function state, the
default device and dtype and dynamo's stance (NOTE [the replay sees the forward's default
device]); and what each pass must not share with the caller (a parametrization cache) or
choose by grad mode (attention's fast path)."""

from __future__ import annotations

import functools
import sys
import threading
import types
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._device import DeviceContext  # what set_default_device and torch.device push

from .tree import object_children

__all__ = ["GeneratorStates", "IsolatedPass", "ReplayEnvironment", "Replaying", "RngState",
           "generators_moved", "rng_changed", "rng_state", "set_rng_state"]

# The CPU generator's state and, by device index, CUDA generators' states.
RngState = tuple[torch.Tensor, dict[int, torch.Tensor]]
# Generators passed in, each with a state (NOTE [generators passed in]).
GeneratorStates = tuple[tuple[torch.Generator, torch.Tensor], ...]


# The CPU generator, read and set directly: torch.get_rng_state() and torch.set_rng_state() are
# Python wrappers of its get_state() and set_state(), and the boundary calls them three times
# per layer call (twice around each replay).
_cpu_generator = torch.default_generator


def rng_state(devices: tuple[int, ...], /) -> RngState:
    return _cpu_generator.get_state(), \
        {d: torch.cuda.get_rng_state(d) for d in devices} if devices else {}


def rng_changed(before: RngState, after: RngState, /) -> bool:
    return not torch.equal(before[0], after[0]) or any(
        not torch.equal(state, after[1][d]) for d, state in before[1].items())


def set_rng_state(state: RngState, /, *, devices: tuple[int, ...]) -> None:
    """Set the CPU generator and those of ``devices`` (only: others the replay does not
    restore afterwards, so changing them would leak out of it)."""
    _cpu_generator.set_state(state[0])
    for device in devices:
        if device in state[1]:
            torch.cuda.set_rng_state(state[1][device], device)


def generators_moved(before: GeneratorStates, /) -> GeneratorStates:
    """Those of ``before``'s generators whose state changed since, each with its state now."""
    moved = []
    for generator, state in before:
        now = generator.get_state()
        if not torch.equal(state, now):
            moved.append((generator, now))
    return tuple(moved)


_AUTOCAST_DEVICES = ("cpu", "cuda")
# Not in torch's type stubs (torch/csrc/utils/disable_torch_function.cpp).
_get_torch_function_state: Any = torch._C._get_torch_function_state  # type: ignore[attr-defined]
_set_torch_function_state: Any = torch._C._set_torch_function_state  # type: ignore[attr-defined]
_TF_ENABLED: Any = torch._C._TorchFunctionState.ENABLED  # type: ignore[attr-defined]
_is_torch_function_enabled: Any = torch._C._is_torch_function_enabled
_len_function_stack: Any = torch._C._len_torch_function_stack
_function_stack: Any = torch.overrides._get_current_function_mode_stack
_is_grad_enabled = torch.is_grad_enabled
_get_default_dtype = torch.get_default_dtype
_modules = sys.modules
_set_grad_enabled: Any = torch._C._set_grad_enabled


_cuda = torch.cuda
# Read at every layer call (the autocast state twice): kept, not looked up in torch each time.
_is_autocast_enabled: Any = torch.is_autocast_enabled
_get_autocast_dtype: Any = torch.get_autocast_dtype
_is_autocast_cache_enabled: Any = torch.is_autocast_cache_enabled


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    # NOTE: "cuda" is only read once CUDA is initialised, so a CPU run never touches it. Read
    # as the flag torch.cuda.is_initialized() reads (twice per layer call; that function's
    # check for a forked child is moot here: reading the autocast state does not touch CUDA).
    if _cuda._initialized:
        return tuple((d, _is_autocast_enabled(d), _get_autocast_dtype(d))
                     for d in _AUTOCAST_DEVICES)
    # Spelled out (read twice per layer call): no generator.
    return (("cpu", _is_autocast_enabled("cpu"), _get_autocast_dtype("cpu")),)


# NOTE [the replay picks the forward's kernels]: backend switches that choose a kernel, which
# users set around the forward only (`with sdpa_kernel(SDPBackend.MATH): loss = model(x)`,
# then `loss.backward()` outside; `torch.backends.mkldnn.flags(enabled=False)`,
# `torch.backends.cudnn.flags(...)`), are read with the autocast state and set again for the
# replay where backward's differ: eager's backward uses what the forward's kernels saved, and
# a replay on other kernels gave other gradients. Also NNPACK's switch (convolutions) and the
# math attention's fp16/bf16 reduction (`allow_fp16_bf16_reduction_math_sdp`), and, where the
# opt_einsum package is installed, torch.backends.opt_einsum's `enabled` and `strategy` (the
# order an einsum of three operands or more contracts in: helper GK, other fp32 gradients).
# Settings meant for a whole run (TF32, matmul precision, torch.use_deterministic_algorithms,
# flush-denormal, which has no getter) are not read (per call, each costs). The
# switches are process-global, like the fast-path setting
# (NOTE [passes in several threads]): replays that run at once on several GPUs' device
# threads, each setting switches that differ from backward's, may see each other's.
_KERNEL_SWITCHES = (
    ("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    ("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    ("_get_math_sdp_enabled", "_set_sdp_use_math"),
    ("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    ("_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
    ("_get_sdp_priority_order", "_set_sdp_priority_order"),
    ("_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    ("_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    ("_get_cudnn_enabled", "_set_cudnn_enabled"),
    ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    ("_get_nnpack_enabled", "_set_nnpack_enabled"),
    ("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"))


def _absent() -> None:
    return None  # a switch this torch build lacks: always None, never set


(_flash, _efficient, _math, _cudnn_sdp, _overrideable, _priority, _mkldnn,
 _mkldnn_deterministic, _cudnn, _cudnn_deterministic, _cudnn_benchmark, _nnpack,
 _math_reduction) = (getattr(torch._C, get, _absent) for get, _ in _KERNEL_SWITCHES)

# torch.backends.opt_einsum: torch's einsum reads `enabled` and `strategy` as attributes of
# the module object sys.modules holds (a wrapper), which finds one assigned on it
# (`torch.backends.opt_einsum.strategy = "greedy"`: torch 2.13's wrapper class declares no
# property, so the assignment lands there) before the global of the module it wraps, which
# `flags()` sets. Read, and set for the replay, where each lives now, without a Python call
# (the wrapper's fallback is one; its setters refuse a strategy while disabled, a state
# `flags(enabled=False)` makes). Only where the opt_einsum package is installed: without it,
# torch's einsum reads neither.
_einsum_own: dict[str, Any] | None = None
_einsum_globals: dict[str, Any] = {}
if torch.backends.opt_einsum.is_available():
    _einsum_own = torch.backends.opt_einsum.__dict__
    _einsum_globals = torch.backends.opt_einsum._get_enabled.__globals__
_EINSUM_FLAGS = ("enabled", "strategy")


def _einsum() -> Any:
    own = _einsum_own
    if own is None:
        return None
    held = _einsum_globals  # spelled out: read twice per layer call (no generator)
    return (own["enabled"] if "enabled" in own else held["enabled"],
            own["strategy"] if "strategy" in own else held["strategy"])


def _set_einsum(value: Any) -> None:
    own = _einsum_own
    assert own is not None
    for name, flag in zip(_EINSUM_FLAGS, value):
        (own if name in own else _einsum_globals)[name] = flag


_KERNEL_SETTERS = (*(getattr(torch._C, put, None) for _, put in _KERNEL_SWITCHES), _set_einsum)


def _kernel_state() -> tuple[Any, ...]:
    # Spelled out: read twice per layer call, and a loop over the getters costs twice as much.
    return (_flash(), _efficient(), _math(), _cudnn_sdp(), _overrideable(), _priority(),
            _mkldnn(), _mkldnn_deterministic(), _cudnn(), _cudnn_deterministic(),
            _cudnn_benchmark(), _nnpack(), _math_reduction(), _einsum())


def _set_kernel_state(state: tuple[Any, ...], now: tuple[Any, ...]) -> None:
    for put, value, current in zip(_KERNEL_SETTERS, state, now):
        if value != current and put is not None:
            put(value)


def _default_device() -> torch.device | None:
    """The device of the innermost ``torch.device`` context (or ``torch.set_default_device``),
    ``None`` with none (NOTE [the replay sees the forward's default device])."""
    for mode in reversed(_function_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


class ReplayEnvironment:
    """RNG states, autocast settings, kernel switches, the torch-function state, the default
    device and dtype, and dynamo's stance, captured at the start of an original pass."""

    __slots__ = ("cpu_rng", "cuda_rng", "autocast", "autocast_cache", "torch_function",
                 "kernels", "generators", "device", "dtype", "stance", "parametrize_cached")

    def __init__(self, cpu_rng: torch.Tensor | None, cuda_rng: dict[int, torch.Tensor],
                 autocast: tuple[tuple[str, bool, torch.dtype], ...], autocast_cache: bool,
                 torch_function: Any, kernels: tuple[Any, ...], /) -> None:
        self.cpu_rng = cpu_rng
        # NOTE [generators passed in]: a torch.Generator among the call's arguments (a dropout
        # given its own generator; a boundary's call or an output discard's) is one the replay
        # can see, unlike one a closure holds; so is one the call's modules hold as an
        # attribute (NOTE [generators held as attributes] in held_generators.py). Its state at
        # the start of the original pass is restored for each replay, and the state backward
        # found is put back after it: the replay draws the forward's numbers, and the generator
        # ends the step where eager leaves it. Where a reused call or a kept op drew from it,
        # the replay skips the draw and jumps it past, as the default ones (NOTE [skipped work
        # keeps the RNG in step] in frames.py: Frame.generators are these).
        # Also one a plain object argument holds (an attribute or a slot: a SimpleNamespace
        # config, which optree leaves unopened), one a function argument holds (its closure,
        # its defaults, a bound method's instance), and one bound in a functools.partial (or a
        # subclass) that is the call's function (transformers' `partial(forward, self,
        # generator=g)`): the replay drew other numbers from those (helpers FE, FH, FL). Not
        # one deeper in an object.
        # Only with preserve_rng_state, as for the default generators: without it, none is
        # restored or jumped, and the replay draws the next numbers of each.
        self.generators: GeneratorStates = ()
        self.kernels = kernels  # NOTE [the replay picks the forward's kernels]
        self.cuda_rng = cuda_rng
        self.autocast = autocast
        self.autocast_cache = autocast_cache
        # NOTE [the replay sees tensor subclasses as the forward did]: a backward started from a
        # tensor subclass (loss.backward() on a __torch_function__ subclass goes through its
        # __torch_function__, which switches subclass handling off) runs every node with it
        # off, so the replay's inputs would reach fn as plain tensors, and fn would compute
        # another function than in the forward (isinstance checks, the subclass's overrides).
        # The replay runs under the forward's torch-function state.
        self.torch_function = torch_function  # None: enabled
        # NOTE [the replay sees the forward's default device]: torch's default device
        # (torch.set_default_device("cuda"), `with torch.device("cuda"):`) is a TorchFunctionMode,
        # and none is active inside backward, so a replay without it made every tensor the
        # forward makes without a device (a causal mask, torch.arange's positions) on the CPU:
        # another device than the forward's, an error in backward. The replay runs under a
        # DeviceContext of its own for the forward's device, as torch's non-reentrant
        # checkpoint does (a new one: entering the forward's own object again would overwrite
        # what its still-open `with` restores at its exit), entered only where backward runs
        # under another default device. Other TorchFunctionModes are not re-entered
        # (docs/limits.md, "Random numbers and modes around the call").
        self.device = _default_device() if _len_function_stack() else None
        # Likewise torch's default dtype (torch.set_default_dtype around the forward only: a
        # table the forward makes with torch.arange in float64) and dynamo's stance
        # (torch.compiler.set_stance("force_eager") around the forward only: the replay
        # compiled and ran a body the forward ran eagerly): helper GK, other gradients than
        # eager's. Both are process-global, set for the replay where backward's differ and
        # put back after it. The stance is read only once dynamo is imported (set_stance
        # imports it).
        self.dtype = _get_default_dtype()
        frame = _modules.get("torch._dynamo.eval_frame")
        self.stance = None if frame is None else frame._stance
        # NOTE [the replay caches parametrizations as the forward did] (IsolatedPass)
        self.parametrize_cached = bool(parametrize._cache_enabled)

    @classmethod
    def capture(cls, tensors: tuple[torch.Tensor, ...], /, *, preserve_rng: bool,
                leaves: list[Any] | None = None, fn: Any = None,
                held: tuple[torch.Generator, ...] = ()) -> ReplayEnvironment:
        """The environment now; ``leaves``, the call's other leaves, and ``fn``, where it is
        a ``functools.partial``, may hold generators (NOTE [generators passed in]); ``held``:
        those its modules hold as attributes (NOTE [generators held as attributes] in
        held_generators.py), restored alike."""
        cpu_rng = None
        cuda_rng: dict[int, torch.Tensor] = {}
        if preserve_rng:
            cpu_rng = _cpu_generator.get_state()
            # As torch's checkpoint: the CUDA generators of the devices the inputs live on
            # (none before CUDA is initialised: a CUDA tensor's making initialises it).
            if _cuda._initialized:
                for device in {t.device.index for t in tensors if t.is_cuda}:
                    cuda_rng[device] = torch.cuda.get_rng_state(device)
        # None: enabled, the usual state (read cheaply; the state object costs ~10x more).
        torch_function = None if _is_torch_function_enabled() else \
            _get_torch_function_state()
        env = cls(cpu_rng, cuda_rng, _autocast_state(), _is_autocast_cache_enabled(),
                  torch_function, _kernel_state())
        if preserve_rng and (leaves or held or isinstance(fn, functools.partial)):
            generators = _passed_generators(leaves or (), fn)
            for g in held:  # one passed in and held too is restored once
                generators[id(g)] = g
            env.generators = tuple((g, g.get_state()) for g in generators.values())
        return env

    def rng_devices(self) -> tuple[int, ...] | None:
        """The CUDA devices whose generators the replay restores (and the CPU one); ``None``
        when it restores none (``preserve_rng_state=False``)."""
        return None if self.cpu_rng is None else tuple(sorted(self.cuda_rng))

    def replaying(self) -> Replaying:
        """A context in which a replay sees the original pass's environment, grad enabled."""
        return Replaying(self)


def _passed_generators(leaves: Any, fn: Any, /) -> dict[int, torch.Generator]:
    """NOTE [generators passed in]: the generators among ``leaves``, what those that are plain
    objects hold (attributes, slots) or functions hold (closure variables, defaults), and the
    arguments ``fn`` binds where it is a partial, by id."""
    found: dict[int, torch.Generator] = {}
    while isinstance(fn, functools.partial):  # a subclass too (helper FL)
        leaves = [*leaves, *fn.args, *fn.keywords.values()]
        fn = fn.func
    for leaf in leaves:
        if isinstance(leaf, torch.Generator):
            found[id(leaf)] = leaf
        elif leaf is not None and not isinstance(leaf, (torch.Tensor, nn.Module, type, str,
                                                         int, float)):
            children = object_children(leaf)  # attributes and slots (helper FH)
            if isinstance(leaf, types.MethodType) and not isinstance(leaf.__self__, nn.Module):
                children += object_children(leaf.__self__)  # `sampler.draw` (helper FL)
            for _, value in children:
                if isinstance(value, torch.Generator):
                    found[id(value)] = value
    return found


class Replaying:
    """Entered around one replay: sets the recorded RNG states (the ambient ones are put back
    after it), the recorded autocast settings, kernel switches and torch-function state where
    backward's differ, and enables grad.

    One plain class rather than an ``ExitStack`` of three contexts: it is entered once per
    layer call in backward, and the stack's bookkeeping cost more than the work."""

    __slots__ = ("env", "saved_rng", "autocast", "grad", "torch_function", "kernels",
                 "generators", "device", "dtype", "stance")

    def __init__(self, env: ReplayEnvironment, /) -> None:
        self.env = env
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []  # as backward found them
        self.kernels: tuple[Any, ...] | None = None  # backward's kernel switches, if they differ
        self.saved_rng: RngState | None = None
        self.autocast: ExitStack | None = None
        self.grad: bool | None = None  # the caller's grad mode, once set
        self.torch_function: Any = None  # backward's torch-function state, where it differs
        self.device: Any = None  # the DeviceContext entered for the replay, if any
        self.dtype: torch.dtype | None = None  # backward's default dtype, where it differs
        self.stance: Any = None  # backward's dynamo stance, where it differs

    def __enter__(self) -> None:
        env = self.env
        if env.generators:  # NOTE [generators passed in]: all read before any is set (one
            # may be a default one)
            self.generators = [(generator, generator.get_state())
                               for generator, _ in env.generators]
        if env.cpu_rng is not None:
            if env.cuda_rng:
                devices = tuple(env.cuda_rng)
                self.saved_rng = rng_state(devices)
                set_rng_state((env.cpu_rng, env.cuda_rng), devices=devices)
            else:  # the CPU generator only: rng_state and set_rng_state, spelled out
                self.saved_rng = _cpu_generator.get_state(), {}
                _cpu_generator.set_state(env.cpu_rng)
        for generator, state in env.generators:
            generator.set_state(state)
        # Backward may run under another autocast state than forward did: set only what differs.
        if _autocast_state() != env.autocast:
            try:
                with ExitStack() as stack:
                    for device, enabled, dtype in env.autocast:
                        stack.enter_context(torch.autocast(device, enabled=enabled, dtype=dtype,
                                                           cache_enabled=env.autocast_cache))
                    self.autocast = stack.pop_all()
            except BaseException:
                self.__exit__(None, None, None)  # the RNG states go back as they were
                raise
        kernels = _kernel_state()
        if kernels != env.kernels:  # NOTE [the replay picks the forward's kernels]
            self.kernels = kernels
            _set_kernel_state(env.kernels, kernels)
        # NOTE [the replay sees the forward's default device], continued
        dtype = _get_default_dtype()
        if dtype != env.dtype:
            self.dtype = dtype
            torch.set_default_dtype(env.dtype)
        if env.stance is not None:
            frame = _modules["torch._dynamo.eval_frame"]
            now = frame._stance  # the same object unless set_stance ran: no dataclass compare
            if now is not env.stance and now != env.stance:
                try:
                    self.stance = frame._set_stance(env.stance)
                except RuntimeError:  # inside a compiled region (compiled autograd): as it is
                    pass
        self.grad = _is_grad_enabled()
        _set_grad_enabled(True)
        # NOTE [the replay sees tensor subclasses as the forward did]
        if env.torch_function is None:
            if not _is_torch_function_enabled():
                self.torch_function = _get_torch_function_state()
                _set_torch_function_state(_TF_ENABLED)
        else:
            state = _get_torch_function_state()
            if state != env.torch_function:
                self.torch_function = state
                _set_torch_function_state(env.torch_function)
        # NOTE [the replay sees the forward's default device]; last in, first out.
        if env.device is not None and (not _len_function_stack() or
                                       _default_device() != env.device):
            context = DeviceContext(env.device)
            try:
                context.__enter__()
            except BaseException:
                self.__exit__(None, None, None)
                raise
            self.device = context

    def __exit__(self, *exc: Any) -> None:
        if self.device is not None:
            self.device.__exit__(*exc)
            self.device = None
        if self.torch_function is not None:
            _set_torch_function_state(self.torch_function)
        if self.stance is not None:
            _modules["torch._dynamo.eval_frame"]._set_stance(self.stance)
            self.stance = None
        if self.dtype is not None:
            torch.set_default_dtype(self.dtype)
            self.dtype = None
        if self.grad is not None:
            _set_grad_enabled(self.grad)
        if self.kernels is not None:
            _set_kernel_state(self.kernels, self.env.kernels)
        if self.autocast is not None:
            self.autocast.__exit__(*exc)
        if self.saved_rng is not None:
            # Only the devices it set: others the replay does not restore (set_rng_state).
            if self.saved_rng[1]:
                set_rng_state(self.saved_rng, devices=tuple(self.saved_rng[1]))
            else:
                _cpu_generator.set_state(self.saved_rng[0])
        for generator, state in self.generators:
            generator.set_state(state)
        self.generators = []


_mha = torch.backends.mha
# The fast-path setting is a global of torch.backends.mha, which get_fastpath_enabled() (after
# asking torch.jit.is_scripting(), never true here) and set_fastpath_enabled() read and write:
# read and written directly (three Python calls less per pass), where this torch has it.
_MHA_FLAG = "_is_fastpath_enabled"
_mha_flag_direct = isinstance(getattr(_mha, _MHA_FLAG, None), bool)


_is_fwd_grad_enabled: Any = torch._C._is_fwd_grad_enabled
_set_fwd_grad_enabled: Any = torch._C._set_fwd_grad_enabled


class IsolatedPass:
    """A context for one pass (the original one, or a replay) of a checkpointed call: what it
    must not share with the caller, or let grad mode choose. One plain class, not two
    generator contexts: it is entered twice per layer call.

    NOTE [each pass caches its own parametrizations]: inside ``parametrize.cached()`` a
    parametrized weight (``parametrizations.weight_norm``, ``orthogonal``, a custom one) is
    computed at its first use and read from a process-wide cache until the block ends. The
    original pass runs under no-grad: the weight it would cache has no graph, and the replay,
    or a use after the boundary in the same block (a head tied to it), would read it and its
    parametrization would silently get no gradient. Each pass therefore computes and caches
    its weights in a cache of its own, as eager computes them once per block; the caller's
    cache is put back after the pass. Within one call the gradients stay eager's; a weight
    used by several calls (or also outside them) gets one gradient per call, equal to eager's
    to float rounding, as for any parameter used several times within calls
    (docs/boundary.md, invariant 4).

    NOTE [the replay caches parametrizations as the forward did]: the replay runs in backward,
    and torch's own example opens ``cached()`` around the forward only (an RNN loop over a
    parametrized recurrent kernel): backward runs after the block, so the replay ran
    uncached, computed the weight again at each use (a spectral norm's power iteration
    stepped once per timestep: other weights than the forward's, gradients off by up to 0.3;
    helper KJ), and backpropagated each use through its own copy of the parametrization. So a
    replay (``cached=`` the original pass's setting, read by ``ReplayEnvironment``) caches
    iff its original pass did: with a cache of its own where backward runs outside any block,
    and with caching off where backward runs inside one the forward was outside of. The
    process-wide count is moved for the pass (up by one, or down to 0) and put back after it,
    with the cache the caller's block had (a cached() the layer opens itself, inside a replay
    run with the count down, emptied it at its exit: helper KP), or none where no block is
    open any more (another thread's ended meanwhile). Other threads' parametrizations see
    caching on or off meanwhile, as with the fast path below.

    NOTE [no fast path by grad mode]: ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` (and ``TransformerEncoder``'s nested tensors) in eval mode
    take a fused fast path when grad is disabled, which the original pass always is; eager,
    with an input or weight that requires grad, takes the composite path. The fast path rounds
    differently (and zeroes padded positions), so the layer's output was not eager's, and the
    replay (composite, grad enabled) backpropagated through another function than the one
    that ran. Both passes therefore run with ``torch.backends.mha``'s fast path off, and agree
    with each other always, and with eager whenever something in the attention requires grad.
    A frozen attention fed a frozen input takes the fast path in eager: equal to rounding,
    but a ``TransformerEncoder`` given a padding mask then returns zeros at padded positions
    where the composite path returns values (docs/limits.md, "Float rounding and other
    kernels": the original pass cannot tell whether eager's inputs would require grad).
    The caller's setting is put back after the passes.

    NOTE [passes in several threads]: both settings are process-global, and passes of two
    threads overlap without nesting: on CUDA autograd replays on one device thread per GPU,
    concurrently, and a thread-parallel forward runs original passes side by side. Saved and
    put back per pass, the last pass to end put back what it found: another pass's cache
    (the caller kept it) and, for the fast path, the setting of whichever pass entered first,
    leaving a pass still running with the fast path on. So the fast path is off while any pass
    runs, in every thread (a plain inference beside a training step takes the composite path
    meanwhile, documented), and the caller's setting comes back when the last one ends (a
    depth under a lock);
    and a pass that ends while a later one still runs hands its outer cache to the pass that
    swapped its own cache out, so the caller's comes back last. Overlapping passes still share
    whichever cache is current (one process-wide dict): keys are per parametrization object,
    so only threads running one module at once can see each other's weights.
    """

    __slots__ = ("outer_cache", "inner_cache", "fwd_grad_off", "counted", "cached",
                 "count_moved", "lowered_cache")

    def __init__(self, *, cached: bool | None = None) -> None:
        # None: as the caller runs (an original pass); a replay passes its original pass's
        # setting (NOTE [the replay caches parametrizations as the forward did]).
        self.cached = cached

    _swapped: list[IsolatedPass] = []  # passes running with a cache of their own

    # NOTE [a pass interrupted at any point]: a KeyboardInterrupt is raised where CPython next
    # looks for a pending signal, right after a call returns. A pass interrupted after taking
    # the lock but before its try (helper EJ) left the lock held, and every later pass in the
    # process waited on it for ever; one interrupted between its changes and the count of them
    # left the fast path off for good. So the lock is taken by a with statement (its enter is
    # no call a signal can follow); each change is recorded on the pass, with no call between
    # the two, before the next call; __exit__ undoes what is recorded, and __enter__ calls it
    # when interrupted itself. The parametrize count a replay moved comes back first (left
    # moved, it outlives every block), then the count of passes and the fast path, then the
    # parametrization cache (a call: interrupted after it, a cache swapped inside
    # parametrize.cached() stays swapped until that block ends).

    def __enter__(self) -> None:
        self.fwd_grad_off = False
        self.outer_cache: dict[Any, Any] | None = None
        self.inner_cache: dict[Any, Any] | None = None
        self.counted = False
        self.count_moved = 0
        self.lowered_cache: dict[Any, Any] | None = None
        try:
            with _passes_lock:  # NOTE [the lock of passes]
                passes = _passes
                first = passes.depth == 0
                if first:
                    passes.fast_path_outer = _mha._is_fastpath_enabled if _mha_flag_direct \
                        else _mha.get_fastpath_enabled()
                passes.depth += 1
                self.counted = True
                if first and passes.fast_path_outer:
                    if _mha_flag_direct:
                        _mha._is_fastpath_enabled = False
                    else:
                        _mha.set_fastpath_enabled(False)
                cached = self.cached
                if cached is not None and cached != bool(parametrize._cache_enabled):
                    # NOTE [the replay caches parametrizations as the forward did]
                    moved = 1 if cached else -parametrize._cache_enabled
                    if moved < 0:  # the caller's, apart from what the body's own blocks cache
                        self.lowered_cache = parametrize._cache
                        parametrize._cache = {}
                    parametrize._cache_enabled += moved
                    self.count_moved = moved
                if parametrize._cache_enabled:  # usually off: nothing to isolate
                    self.outer_cache = parametrize._cache
                    self.inner_cache = parametrize._cache = {}
                    IsolatedPass._swapped.append(self)
            # NOTE [forward-mode AD inside a pass]: torch turns forward grad off inside a
            # custom Function's forward, where the original pass runs, so a dual_level() the
            # layer opens itself got no tangent (None, or 0.0 where the code guarded against
            # None), where eager gets it. On for the pass (a thread's own setting); no dual
            # level is open around a boundary (NOTE [when there is no boundary] in
            # boundary.py). Recorded before the call: turned off again even if it never ran.
            if not _is_fwd_grad_enabled():
                self.fwd_grad_off = True
                _set_fwd_grad_enabled(True)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self.fwd_grad_off:
                self.fwd_grad_off = False
                _set_fwd_grad_enabled(False)
        finally:
            with _passes_lock:
                moved = self.count_moved
                if moved:
                    # Put back first, before any call (NOTE [a pass interrupted at any point]:
                    # interrupted after the fast path's setter or the list's remove below, a
                    # count left raised kept every parametrization in the process cached for
                    # good, helper KW). As torch's cached() at its exit: no block open, no
                    # cache kept (a block of another thread's that ended meanwhile left its
                    # weights); else the cache of the block the replay ran in, which a
                    # cached() inside the replay replaced at its exit.
                    parametrize._cache_enabled -= moved
                    self.count_moved = 0
                    if not parametrize._cache_enabled:
                        parametrize._cache = {}
                    elif moved < 0 and self.lowered_cache is not None:
                        parametrize._cache = self.lowered_cache
                    self.lowered_cache = None
                passes = _passes
                if self.counted:
                    self.counted = False
                    passes.depth -= 1
                    if passes.depth == 0 and passes.fast_path_outer:
                        if _mha_flag_direct:
                            _mha._is_fastpath_enabled = True
                        else:
                            _mha.set_fastpath_enabled(True)
                if self.inner_cache is not None:
                    assert self.outer_cache is not None  # both set together in __enter__
                    inner, self.inner_cache = self.inner_cache, None
                    if parametrize._cache is inner:
                        parametrize._cache = self.outer_cache
                    else:  # a later pass swapped ours out and still runs: it puts our outer back
                        for later in IsolatedPass._swapped:
                            if later.outer_cache is inner:
                                later.outer_cache = self.outer_cache
                    IsolatedPass._swapped.remove(self)


class _Passes:
    """How many passes run, in all threads, and the fast-path setting when the first of them
    began (NOTE [passes in several threads]); kept on an instance, not on IsolatedPass: a class
    attribute written twice per pass made Python drop its cached lookups of the class's
    methods each time."""

    __slots__ = ("depth", "fast_path_outer")

    def __init__(self) -> None:
        self.depth = 0
        self.fast_path_outer = False


_passes = _Passes()
# NOTE [the lock of passes]: guards _passes and IsolatedPass._swapped (NOTE [passes in several
# threads]). Taken twice per pass, four times per layer call, from a module global (about 1,200
# instructions a use less than from a class attribute, callgrind), by a with statement: NOTE
# [a pass interrupted at any point].
_passes_lock = threading.Lock()
