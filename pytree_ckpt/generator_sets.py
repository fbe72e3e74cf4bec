"""The states a checkpointed call's forward sets a default generator to, recorded in the
original pass and set again in the replay.

NOTE [a forward that sets a default generator's state]: Megatron-Core's and DeepSpeed's RNG
trackers run a dropout inside ``get_cuda_rng_tracker().fork()``, which loads the tracker's
state for that stream into the default generator (``torch.cuda.set_rng_state(states[name])``),
draws, stores the advanced state back in the tracker and puts the default state back. The
boundary restores the default generators for the replay as the forward began, but the state
the replay's fork loads is the tracker's, which the original pass already advanced: the
replay drew another mask, and the gradients differed from eager's, silently (helper DF; so
does torch's checkpoint, which is why Megatron's own saves the tracker's states). The tracker
is an object the boundary cannot know, so the sets themselves are watched: in the original
pass, the state each ``set_state`` of a default generator (CPU, or a CUDA device's) leaves it
in is recorded, in order; in the replay, after the set at the same place, the generator is set
to the recorded state where it differs, so the replay draws the forward's numbers. What the
replay reads back of that generator until its next set (the fork storing the advanced state
in the tracker) is the state the replay's set loaded: the tracker ends each replay as it
began it, and the step as in eager (the replays run in reverse order: otherwise the tracker
would end where the first layer's fork left it). Sets and reads made by this library's own
code (the jumps of NOTE [skipped work keeps the RNG in step]) are not counted, nor torch's own
(dynamo keeps the state around its tracing): ``_users``.

Seen through ``sys.setprofile`` (a C method's call shows there with the generator it is bound
to): each layer (each module, partial or callable object by identity, forgotten with it; a
plain function by its code, a closure by its code and the objects it closes over; one that
takes no weak reference is watched always) and method is
watched in its original passes until one made in training mode (a closure's, a partial's: with
a trainable module it holds in training mode) sets no state; from then on,
one cheap lookup per call. Any pass that set a state has it watched at every pass after. An
output discard's function is watched alike, for its rebuild. Not seen: a layer that first
sets a state after a training pass that set none, any pass that runs while a profiler other
than this one is on (``torch.profiler`` with ``with_stack=True``, cProfile up to Python
3.11: a C profile function cannot be chained; cProfile from 3.12 runs on ``sys.monitoring``
and sets none), and ``graphsafe_set_state`` (Megatron-Core's CUDA-graph-safe tracker).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
import weakref
from typing import Any

import torch
from torch import nn

from .keep import IN_REUSE
from .tree import dunder

__all__ = ["GeneratorSets", "forward_watch", "learned", "replay_watch"]

# This package's and the offload package's folders: their own sets are not the forward's.
_OURS = (os.path.dirname(__file__) + os.sep,
         os.path.join(os.path.dirname(os.path.dirname(__file__)), "offload") + os.sep)
_cpu_generator = torch.default_generator
_NoDispatch: Any = torch._C._DisableTorchDispatch
_cuda = torch.cuda

# By a layer (its id and class; None's for a plain function) and the code that runs: whether
# its first training pass set a default generator's state (then each pass is watched). Learned
# once per key, not step state.
_SETS: dict[Any, bool] = {}


def _is_default(generator: Any, /) -> bool:
    return generator is _cpu_generator or _cuda._initialized and \
        any(generator is g for g in _cuda.default_generators)


class GeneratorSets:
    """A profile function around one pass of fn: records the states each set leaves a
    default generator in (``recorded`` None: an original pass), or sets those ``recorded``
    again after the sets at the same places (a replay). Calls the watch of an enclosing
    boundary's pass too (a nested call's sets are the outer call's as well)."""

    __slots__ = ("states", "pinning", "position", "outer", "loaded", "reading")

    def __init__(self, recorded: list[tuple[torch.Generator, torch.Tensor]] | None, /) -> None:
        self.pinning = recorded is not None
        self.states = recorded if recorded is not None else []
        self.position = 0
        self.outer: Any = None
        # A replay's generators set to another state than the forward's, each with the state
        # the replay's set gave it (the tracker's now), and one being read meanwhile.
        self.loaded: dict[torch.Generator, torch.Tensor] = {}
        self.reading: tuple[torch.Generator, torch.Tensor] | None = None

    def __enter__(self) -> None:
        if not _skipped_by_dynamo:
            _skip_by_dynamo()
        self.outer = sys.getprofile()
        sys.setprofile(self)

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.outer)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.outer is not None:
            self.outer(frame, event, arg)
        if event != "c_return" and event != "c_call":
            return
        # (getattr, not tree.dunder: arg is a C function, and a Python call here is a frame
        # dynamo would compile inside a compiled body: NOTE in _skip_by_dynamo)
        name = getattr(arg, "__name__", None)
        if name != "set_state" and name != "get_state":
            return
        generator: Any = getattr(arg, "__self__", None)
        if not _is_default(generator) or IN_REUSE.get() or not _users(frame):
            # A reused call's sets: the replay skips the call (and jumps the generators past
            # it, NOTE [skipped work keeps the RNG in step]), so they have no place to match.
            return
        if name == "get_state":
            if self.pinning:
                self._read(generator, event)
            return
        if event == "c_call":
            return
        if not self.pinning:
            self.states.append((generator, generator.get_state()))
            return
        self.loaded.pop(generator, None)
        if self.position < len(self.states):
            recorded, state = self.states[self.position]
            now = generator.get_state()
            # No dispatch mode sees the comparison (a save unit's KeepMode took it for a kept
            # op of the replay the original pass never made).
            with _NoDispatch():
                differs = not torch.equal(now, state)
            if recorded is generator and differs:
                self.loaded[generator] = now
                generator.set_state(state)  # made inside a profile function: not seen again
        self.position += 1

    def _read(self, generator: torch.Generator, event: str, /) -> None:
        """NOTE: a replay leaves what it reads back as it found it. The tracker's fork stores
        the state after its draw back into the tracker; in a replay set to the forward's state,
        that is the forward's state after the draw, and the replays run in reverse: the
        tracker would end the step where the first layer's fork left it, not the last. So a
        read after such a set gives the state the set loaded (the tracker's now); the
        generator itself goes on from where it was."""
        if event == "c_call" and generator in self.loaded:
            self.reading = (generator, generator.get_state())
            generator.set_state(self.loaded[generator])
        elif event == "c_return" and self.reading is not None and self.reading[0] is generator:
            generator.set_state(self.reading[1])
            self.reading = None


def _users(frame: Any, /) -> bool:
    """Whether a set or read is the user's code's: made there, or in torch's functions (and
    contextlib's) it called (``torch.cuda.set_rng_state`` is three frames deep in torch). Not
    this library's (its jumps), nor torch's own work (dynamo keeps the RNG state around its
    tracing, many frames inside torch and contextlib)."""
    for _ in range(_THROUGH):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name.startswith(_OURS):
            return False
        if not name.startswith(_TRANSPARENT):
            return True
        frame = frame.f_back
    return False


_TRANSPARENT = (os.path.dirname(torch.__file__) + os.sep, contextlib.__file__)
_THROUGH = 5  # frames of torch's and contextlib's looked through


_skipped_by_dynamo = False


def _skip_by_dynamo() -> None:
    """NOTE: a profile function runs in the frame being evaluated, so inside a compiled body
    dynamo took the watch's own frames for user code and compiled them (each event a new
    variant: the recompile limit hit, a test's compile counted). Its code objects are marked
    skipped once dynamo is loaded (it loads with the first compile; not imported here)."""
    global _skipped_by_dynamo
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.eval_frame import skip_code
    for code in (GeneratorSets.__call__.__code__, GeneratorSets._read.__code__,
                 _is_default.__code__, _users.__code__):
        skip_code(code)
    _skipped_by_dynamo = True


def _watchable() -> bool:
    # Only this library's watches chain: a C profiler (cProfile up to 3.11) cannot be called
    # from here.
    outer = sys.getprofile()
    return outer is None or isinstance(outer, GeneratorSets)


def _key(fn: Any, owner: Any, /) -> tuple[int, Any, Any]:
    # Per layer, not per class (helper DH: a Sequential checkpointed without a fork left every
    # other one unwatched), and the code that runs (two checkpointed methods of one layer
    # differ). A layer's entry goes with it (learned: its id may be reused). A module or other
    # callable is keyed by its class, not by attributes: getattr on a module for a name it
    # lacks runs nn.Module.__getattr__ and raises (about 16k instructions a call).
    kind = type(fn)
    if kind is _Function or kind is _Method:
        code = fn.__code__
        if owner is None and kind is _Method:
            owner = fn.__self__  # an output discard of a module's method
        elif owner is None and fn.__closure__:
            # A closure: its code and the objects it closes over (helper EK: by code alone, a
            # quiet closure of one factory stood for another that forks its own tracker). A
            # lambda made anew each step over the same layer is still learned once.
            return id(None), tuple(map(id, _closed_over(fn))), code
    else:
        code = kind
        if owner is None:
            # An output discard of a module, a functools.partial, a callable object: by
            # identity, as a layer is (helper EG: keyed by class alone, one partial that set
            # no state left every later partial unwatched).
            owner = fn
    return id(owner), type(owner), code


_Function = types.FunctionType
_Method = types.MethodType
_Module = nn.Module


def _closed_over(fn: Any, /) -> list[Any]:
    """The objects ``fn``'s closure cells hold that may set a generator's state (modules,
    trackers, functions) and take weak references. Not numbers, strings nor tensors: data,
    made anew each step, they would make a new key, and a new watch, every time."""
    held = []
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
            if isinstance(value, torch.Tensor):
                continue
            weakref.ref(value)
        except (ValueError, TypeError):  # an empty cell, or no weak reference
            continue
        held.append(value)
    return held


def forward_watch(fn: Any, owner: Any, /) -> GeneratorSets | None:
    """The watch for an original pass of ``fn`` (a layer's ``owner``), or None: its first
    training pass set no default generator's state, or a foreign profiler is on."""
    if _SETS.get(_key(fn, owner)) is False or not _watchable():
        return None
    return GeneratorSets(None)


def learned(fn: Any, owner: Any, watch: GeneratorSets, /) -> list[tuple[torch.Generator,
                                                                          torch.Tensor]] | None:
    """After an original pass under ``watch``: the states its sets left (for the replay), or
    None. A pass that set one has the layer watched from then on; one that set none decides
    so only in training mode (a forward may fork only then: an eval pass with grad on, the
    first one, would have the layer never watched)."""
    key = _key(fn, owner)
    if key not in _SETS:
        holder = owner if owner is not None else dunder(fn, "__self__", fn)
        if watch.states or _in_training(fn, holder):
            # Forgotten with what the key names by id, whose id may be reused (helper EG: a
            # plain object's method kept an entry, and a new object at its address inherited
            # "sets no state"); one that takes no weak reference is not remembered: watched at
            # every pass. A plain function is keyed by its code, which outlives a lambda made
            # anew each step (helper EL: tied to the function, each step's was watched again).
            try:
                if key[0] == id(None) and type(key[1]) is tuple:  # a closure's
                    for part in (key[2], *_closed_over(fn)):
                        weakref.finalize(part, _SETS.pop, key, None)
                else:
                    weakref.finalize(key[2] if key[0] == id(None) else holder, _SETS.pop,
                                     key, None)
            except TypeError:
                return watch.states or None
            _SETS[key] = bool(watch.states)
    return watch.states or None


def _in_training(fn: Any, holder: Any, /) -> bool:
    """Whether a pass of ``fn`` that set no state may decide so: a module in training mode; a
    closure, partial or method of a plain object with a *trainable* module it holds (in its
    cells, bound arguments or instance: one with a parameter that requires grad) in training
    mode (helper GJ: Megatron-Core's ``custom(start, end)`` closure over its block, first run
    in eval mode with grad on, was learned as setting none, and its layers' training forks
    went unwatched; helper GN: with *every* module asked, a closure over a student and its
    frozen eval-mode teacher was watched at every pass; helper GO: with *any* module asked, a
    loss module left in training mode beside eval-mode layers decided at a validation pass).
    One holding no trainable module asks the modules it holds that have parameters (helper
    GP: a frozen base whose dropout forks in training; helper GQ: not a parameterless loss
    module beside it, left in training mode), else any it holds; one holding no module
    decides at once. One holding only frozen modules kept in eval mode is watched at every
    pass (a profile function each: documented)."""
    if isinstance(holder, _Module):
        return holder.training
    held: list[Any] = []
    while isinstance(fn, functools.partial):
        held += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    if isinstance(fn, _Method):
        held.append(fn.__self__)
        fn = fn.__func__
    if type(fn) is _Function and fn.__closure__:
        held += _closed_over(fn)
    modules = [value for value in held if isinstance(value, _Module)]
    weighted = [(module, [p.requires_grad for p in module.parameters()]) for module in modules]
    trainable = [module for module, flags in weighted if any(flags)]
    with_parameters = [module for module, flags in weighted if flags]
    asked = trainable or with_parameters or modules
    return not modules or any(module.training for module in asked)


def replay_watch(recorded: list[tuple[torch.Generator, torch.Tensor]] | None, /
                 ) -> GeneratorSets | None:
    """The watch for a replay of a pass whose sets were ``recorded``, or None."""
    if recorded is None or not _watchable():
        return None
    return GeneratorSets(recorded)
