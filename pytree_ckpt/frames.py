"""Replay frames: frozen results recorded in a boundary's original pass, replayed in its replay.

NOTE [frame semantics]: every boundary invocation owns one ``Frame``: a FIFO of results per
callable (keyed by the callable object; bound methods of one object compare equal). When
``reuse_during_recompute(fn, ...)`` runs, the active invocations are walked from the innermost
outwards:

1. the invocations in their original pass (phase ``forward``) up to the first one that is
   replaying are the *recorders*; each appends the result to its own frame, so each of their
   replays finds it;
2. if a replaying invocation (phase ``recompute``) encloses them, the result is taken from its
   frame, without calling ``fn``; otherwise ``fn`` is called.

So a nested boundary whose original pass runs inside an enclosing replay reads the enclosing
frame (its results were recorded the first time round) and records them again for its own
replay: ``fn`` runs once per top-level original pass, however deep the nesting.

NOTE [frame lifetime]: a frame lives on its invocation, which lives on the autograd node; it is
cleared as soon as the node's own backward is done, in a backward without ``retain_graph``
(autograd frees the node's saved tensors then; ``replay_backward`` (recompute.py) clears the
frame), or when the graph is garbage collected without a backward. Cursors are reset at the
start of each replay, so ``backward(retain_graph=True)`` can replay twice. A restricted
backward with ``retain_graph`` keeps its replay's graph (NOTE [a replay kept between restricted
backwards] in kept_replay.py): the node's next run reads no frame, and a backward without
``retain_graph`` still clears it (from the kept path); the frame outlives the kept graph under
``retain_graph``, for a later full replay.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar, cast

import optree
import torch

from .eager import REUSE_REASON, runs_eagerly
from .errors import ReuseError, require_callable
from .frozen import (AsRecorded, StateAfter, apply_state_after, argument_versions, as_recorded,
                     buffer_versions, held_tensors, numbers_watch, refuse_in_plain_call,
                     refuse_in_replay, state_after, stored_floats, stores_floats,
                     warn_changed_arguments, warn_grad_mode_read)
from .grad_probe import probe_for
from .keep import IN_REUSE, RECOMPUTE
from .module_state import with_its_module
from .phase import ACTIVE, Phase
from .reused_numbers import argument_contents, refuse_iterator_arguments
from .rng import GeneratorStates, RngState, generators_moved, rng_changed, rng_state, set_rng_state
from .saved import Unchanged
from .tree import NAMESPACE, dunder, flatten, leaf_paths, unflatten

__all__ = ["Frame", "callable_name", "reuse_during_recompute"]

T = TypeVar("T")
_UNCHECKED = AsRecorded()  # a save unit's kept outputs: checked by the keep mode


def callable_name(fn: Callable[..., Any], /) -> str:
    """A readable name for ``fn`` in messages (``DsaIndexer.forward``, ``aten.mm.default``)."""
    if isinstance(fn, torch._ops.OpOverload):
        return str(fn)
    if isinstance(fn, functools.partial):  # its function's name, not "partial" (helper MA)
        return f"partial({callable_name(fn.func)})"
    owner = dunder(fn, "__self__")
    func = dunder(fn, "__func__", fn)
    name = dunder(func, "__qualname__") or type(func).__name__
    if name.startswith("_VariableFunctionsClass."):  # torch.topk's own qualname
        return "torch." + name.partition(".")[2]
    if isinstance(owner, types.ModuleType):  # a builtin of torch's C namespaces (F.gelu)
        return _public_name(fn, owner, name)
    if owner is not None and not isinstance(owner, type):
        return f"{type(owner).__name__}.{getattr(func, '__name__', name)}"
    return name


# Where torch's builtins bound to a C module are public (read only for a message).
_TORCH_NAMESPACES = {"torch._C._nn": "torch.nn.functional", "torch._C._special": "torch.special",
                     "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft"}


def _public_name(fn: Any, owner: types.ModuleType, name: str, /) -> str:
    """``torch.nn.functional.logsigmoid`` for ``torch._C._nn.log_sigmoid``: the name under
    which the public namespace holds that very object, else the C module's own."""
    public = sys.modules.get(_TORCH_NAMESPACES.get(owner.__name__, ""))
    if public is not None:
        for attribute, value in vars(public).items():
            if value is fn:
                return f"{public.__name__}.{attribute}"
    return f"{owner.__name__}.{name}"


# NOTE [kept ops dispatched differently]: the original pass runs under no-grad, the replay with
# grad, and torch picks some kernels by whether an operand requires grad. A tensor computed in
# the forward (a weight_norm or merged LoRA weight) requires none in the original pass and does
# in the replay: torch.matmul of a non-contiguous 3-D input by it dispatches aten::bmm in one
# and aten::mm in the other, and a save unit keeping either op sees different calls.
KEPT_OP_TIP = ("the replay must dispatch the same kept ops, in the same order, as the original "
               "pass; branch on inputs, not on current_phase() or grad mode. torch itself "
               "chooses some kernels by whether an operand requires grad, which differs for a "
               "tensor computed inside the layer (torch.matmul: aten::mm or aten::bmm for a "
               "weight_norm or merged LoRA weight): compute such a weight outside the "
               "checkpointed layer and pass it in, make the input 2-D or contiguous before the "
               "product, or keep that code by another unit")


class _Offloaded:
    """A frame result's tensor leaf that lives on host until the replay takes it, and (weakly)
    the tensor it was: the caller may hold it still, and change it in place (``ids += 1``), a
    change ``_check_unmodified`` names as for a result left on the device, before the handle's
    own check would (which names offload's internals, not the reused call)."""

    __slots__ = ("packed", "source")

    def __init__(self, packed: Any, source: torch.Tensor) -> None:
        self.packed = packed
        # A view's base shares its version counter and outlives a view the caller drops
        # (the result was a slice of a table it keeps), as offload's handle watches it.
        base = source._base
        self.source = weakref.ref(base if base is not None else source)


class Frame:
    """The recorded frozen results of one boundary invocation."""

    __slots__ = ("results", "versions", "checks", "rng_jumps", "rng_devices", "generators",
                 "generator_jumps", "cursors", "released", "restore", "state_after",
                 "threads", "__weakref__")

    def __init__(self) -> None:
        self.results: dict[Callable[..., Any], list[Any]] = {}
        # The version counters of each recorded result's tensors, when recorded: the replay
        # hands back those very tensors, so a change made to them since would count twice.
        self.versions: dict[Callable[..., Any], list[dict[int, int]]] = {}
        # What the replay checks of each recorded result (NOTE [differentiable results are
        # refused where grad is on] in frozen.py).
        self.checks: dict[Callable[..., Any], list[AsRecorded]] = {}
        # NOTE [skipped work keeps the RNG in step]: a recorded call that drew random numbers
        # (router jitter, a kept dropout) is skipped in the replay, so the generators would
        # stay behind and every later random op (dropout) would draw other numbers than in
        # the original pass. The states after such a call are recorded; the replay jumps to
        # them when it takes the result. Only with the boundary's RNG preserved (its replay
        # restores these generators, and puts the ambient ones back after it), and only for
        # generators its replay restores: the default ones of ``rng_devices``, and those passed
        # in or held by its modules (``generators``, NOTE [generators passed in] in rng.py, NOTE
        # [generators held as attributes] in held_generators.py); jumping another would
        # move it outside the replay for good. A nested boundary's first run inside an
        # enclosing replay records the jumps that replay took, for the generators it restores.
        self.rng_jumps: dict[Callable[..., Any], list[RngState | None]] = {}
        self.rng_devices: tuple[int, ...] | None = None  # set by the boundary's original pass
        # The generators passed in that the replay restores (NOTE [generators passed in] in
        # rng.py; set by the boundary's original pass) jump too: by (fn, position), the states
        # after the calls that moved one of them (made at the first: none per call otherwise).
        self.generators: tuple[torch.Generator, ...] = ()
        self.generator_jumps: dict[tuple[Callable[..., Any], int], GeneratorStates] | None = None
        # NOTE [state a reused call changes] (frozen.py): by (fn, position), only for the calls
        # that changed an integer argument or a buffer of their module.
        self.state_after: dict[tuple[Callable[..., Any], int], StateAfter] = {}
        self.cursors: dict[Callable[..., Any], int] = {}
        # The thread each callable was recorded from (NOTE [records from one thread]).
        self.threads: dict[Callable[..., Any], threading.Thread] = {}
        self.released = False  # set once cleared after its last replay (read by the census)
        # Set when the frame's tensors were offloaded: turns a handle back into a tensor.
        self.restore: Callable[[Any], torch.Tensor] | None = None

    def offload(self, pack: Callable[[torch.Tensor], Any],
                restore: Callable[[Any], torch.Tensor], /) -> None:
        """Swap every frozen-result tensor for ``pack(tensor)`` (an offload handle).

        NOTE: a frame holds the ids its layer computed until the replay; without this, the
        consumers' offloaded copies of those ids would free nothing (the frame keeps them).
        """
        self.restore = restore
        for fn, recorded in self.results.items():
            if isinstance(fn, torch._ops.OpOverload):
                continue  # save units keep their outputs resident by definition
            for i, result in enumerate(recorded):
                self._check_unmodified(fn, i)  # the handles check from here on
                flat = flatten(result)
                leaves = list(flat.leaves)
                for j in flat.tensor_index:
                    leaves[j] = _Offloaded(pack(leaves[j]), leaves[j])
                recorded[i] = unflatten(flat.spec, leaves)

    def record(self, fn: Callable[..., Any], result: Any, /, *,
               rng_after: RngState | None = None, checks: AsRecorded = _UNCHECKED,
               state_after: StateAfter | None = None,
               generators_after: GeneratorStates = ()) -> None:
        if state_after is not None:
            self.state_after[fn, len(self.results.get(fn, ()))] = state_after
        if generators_after:  # only the generators this frame's replay restores
            mine = tuple((g, state) for g, state in generators_after
                         if any(g is h for h in self.generators))
            if mine:
                if self.generator_jumps is None:
                    self.generator_jumps = {}
                self.generator_jumps[fn, len(self.results.get(fn, ()))] = mine
        if not isinstance(fn, torch._ops.OpOverload):  # save units check their own
            # NOTE [records from one thread]: a callable's records are taken in call order.
            # Worker threads that copied the caller's context (experts on a pool, run with
            # contextvars.copy_context(), as asyncio.to_thread does) reach this frame too,
            # in the scheduler's order, which the replay does not meet again: each expert
            # got another's top-k ids, silently (helper EV). Refused at the second thread,
            # calls made one after another on two threads too (their order is fixed, but
            # nothing cheap tells them from overlapping ones: documented).
            me = threading.current_thread()  # held: a finished thread's ident is reused
            if self.threads.setdefault(fn, me) is not me:
                raise ReuseError(
                    f"reuse_during_recompute({callable_name(fn)}, ...) was called from two "
                    "threads within one checkpointed call: its results are replayed in the "
                    "order they were recorded, and threads reach it in the scheduler's order, "
                    "which the replay would not meet again (each call could get another's "
                    "result)", expected="every call of it on one thread",
                    got="calls from two threads (workers that copied the caller's context)",
                    tip="make every call of it on one thread: the one that calls the "
                        "layer, before handing work to a pool (or run the work there)")
            flat = flatten(result)
            # NOTE [recorded containers are the frame's own]: the caller may change the
            # containers it got (r["ids"] = ..., r.pop("ids")), which the replay would see
            # and change again: the frame keeps containers of its own, and hands out fresh
            # ones (inference tensors keep no version to check).
            result = unflatten(flat.spec, list(flat.leaves))
            self.versions.setdefault(fn, []).append(
                {i: flat.leaves[i]._version for i in flat.tensor_index
                 if not flat.leaves[i].is_inference()})
        self.results.setdefault(fn, []).append(result)
        self.rng_jumps.setdefault(fn, []).append(rng_after)
        self.checks.setdefault(fn, []).append(checks)

    def unkeep(self, op: Callable[..., Any], position: int, /) -> None:
        """Take back a save unit's record: the replay runs ``op`` again (keep.py, rule 3)."""
        self.results[op][position] = RECOMPUTE
        self.rng_jumps[op][position] = None  # the op draws its own random numbers again
        if self.generator_jumps:
            self.generator_jumps.pop((op, position), None)

    def upcoming(self, fn: Callable[..., Any], /) -> tuple[int, Any] | None:
        """The position and record ``take(fn)`` returns next, without taking it (``None`` once
        every record was taken: ``take`` then raises)."""
        recorded = self.results.get(fn, ())
        position = self.cursors.get(fn, 0)
        return (position, recorded[position]) if position < len(recorded) else None

    def _check_unmodified(self, fn: Callable[..., Any], position: int) -> None:
        flat = flatten(self.results[fn][position])
        for i, before in self.versions[fn][position].items():
            leaf = flat.leaves[i]
            if isinstance(leaf, _Offloaded):
                # Left on the device by offload, or copied: the tensor itself, if it lives (one
                # nothing holds any more cannot have been changed through itself).
                leaf = leaf.packed.tensor if isinstance(leaf.packed, Unchanged) else \
                    leaf.source()
            if isinstance(leaf, torch.Tensor) and leaf._version != before:
                path = leaf_paths(flat.spec, root="result")[i]
                raise ReuseError(
                    f"{path} of {callable_name(fn)}, recorded by reuse_during_recompute, was "
                    "modified in place after it was returned",
                    expected=f"version {before} (when recorded)", got=f"version {leaf._version}",
                    tip="the replay hands back the recorded tensor, so the change would be made "
                        "twice: change a clone (ids = ids.clone(); ids += 1)")

    def take(self, fn: Callable[..., Any], /) -> Any:
        return self.take_with_rng(fn)[0]

    def take_with_rng(self, fn: Callable[..., Any], /
                      ) -> tuple[Any, RngState | None, AsRecorded]:
        """The next recorded result for ``fn``, the RNG states recorded after it if this replay
        jumped to them, and what the replay checks of it (a nested boundary recording it again
        needs both too)."""
        recorded = self.results.get(fn, ())
        position = self.cursors.get(fn, 0)
        if position >= len(recorded):
            kept_op = isinstance(fn, torch._ops.OpOverload)
            what = "a save unit for kept output" if kept_op else "reuse_during_recompute for result"
            remade = not recorded and not kept_op and _made_anew(fn, self.results)
            raise ReuseError(
                f"the replay asked {what} #{position + 1} of {callable_name(fn)}, but the "
                f"original pass recorded {len(recorded)}" + (
                    ": the original pass recorded another callable of the same code, so a new "
                    "one is made at each call" if remade else ""),
                expected=f"at most {len(recorded)} call(s)", got=f"call #{position + 1}",
                tip=KEPT_OP_TIP if kept_op else
                "make the callable once (a method, a module-level function, or one stored in "
                "__init__) and pass that object each time: results are recorded per callable "
                "object" if remade else
                "the replay must make the same calls, in the same order, as the original pass; "
                "branch on inputs, not on current_phase() or grad mode; and pass the same "
                "callable object each time (a new lambda or functools.partial per call is "
                "another callable)")
        self.cursors[fn] = position + 1
        result = recorded[position]
        jump = self.rng_jumps[fn][position]
        if jump is not None and self.rng_devices is not None:
            set_rng_state(jump, devices=self.rng_devices)
        else:
            # NOTE: a replay that restores no generator (preserve_rng_state=False) does not
            # jump either; a nested boundary whose first run this is must then not jump in its
            # own replay, or its random ops would draw other numbers than in that first run.
            jump = None
        if self.generator_jumps:  # recorded only for the generators this replay restores
            for generator, state in self.generator_jumps.get((fn, position), ()):
                generator.set_state(state)
        if not isinstance(fn, torch._ops.OpOverload):  # offload handles check their copies
            self._check_unmodified(fn, position)
        if self.restore is not None and not isinstance(fn, torch._ops.OpOverload):
            restore = self.restore
            result = optree.tree_map(
                lambda leaf: restore(leaf.packed) if isinstance(leaf, _Offloaded) else leaf,
                result, namespace=NAMESPACE)
        elif not isinstance(fn, torch._ops.OpOverload):  # fresh containers (NOTE above)
            flat = flatten(result)
            if not (len(flat.leaves) == 1 and flat.leaves[0] is result):  # not a bare leaf
                result = unflatten(flat.spec, list(flat.leaves))
        checks = _UNCHECKED if isinstance(fn, torch._ops.OpOverload) else \
            self.checks[fn][position]
        return result, jump, checks

    def taken_generator_jump(self, fn: Callable[..., Any], /) -> GeneratorStates:
        """The generators passed in that ``take_with_rng(fn)`` just jumped, with their states
        (a nested boundary recording the result again jumps them too)."""
        return self.generator_jumps.get((fn, self.cursors[fn] - 1), ()) \
            if self.generator_jumps else ()

    def taken_state_after(self, fn: Callable[..., Any], /) -> StateAfter | None:
        """What the call whose result ``take_with_rng(fn)`` just returned changed (NOTE
        [state a reused call changes] in frozen.py)."""
        return self.state_after.get((fn, self.cursors[fn] - 1)) if self.state_after else None

    def start_replay(self) -> None:
        self.cursors.clear()

    def check_consumed(self) -> None:
        for fn, recorded in self.results.items():
            used = self.cursors.get(fn, 0)
            if used != len(recorded):
                by = ("a save unit" if isinstance(fn, torch._ops.OpOverload)
                      else "reuse_during_recompute")
                raise ReuseError(
                    f"the replay consumed {used} of the {len(recorded)} results recorded for "
                    f"{callable_name(fn)} by {by}",
                    expected=f"{len(recorded)} call(s)", got=f"{used} call(s)",
                    tip=KEPT_OP_TIP if isinstance(fn, torch._ops.OpOverload) else
                    "the replay must make the same reuse_during_recompute calls as the "
                    "original pass; a result left over means the replay took another path")

    def tensors(self) -> list[torch.Tensor]:
        """Every frozen-result tensor the frame holds (kept op outputs excluded)."""
        found: list[torch.Tensor] = []
        for fn, recorded in self.results.items():
            if isinstance(fn, torch._ops.OpOverload):
                continue  # a save unit's kept outputs: reported as such by the keep mode
            for result in recorded:
                flat = flatten(result)
                found.extend(flat.leaves[i] for i in flat.tensor_index)
        return found

    def clear(self) -> None:
        self.results.clear()
        self.versions.clear()
        self.checks.clear()
        self.rng_jumps.clear()
        self.generator_jumps = None
        self.state_after.clear()
        self.cursors.clear()
        self.released = True


# Opaque to dynamo (eager.py): a compiled body graph-breaks here, since the frame lives in a
# ContextVar that traced code would not follow (the replay then found nothing recorded).
# Typed Callable[..., T] as checkpoint is (functional.py says why).
@runs_eagerly(REUSE_REASON)
def reuse_during_recompute(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` once per step and replay its result during recompute.

    Outside any boundary this is a plain call. In a boundary's original pass the result (any
    PyTree of frozen tensors and objects) is recorded in the invocation's frame; in the replay
    the recorded result is returned *without calling* ``fn``. See NOTE [frame semantics].
    A result that eager would compute with grad is refused with ``ReuseError`` (NOTE
    [differentiable results are refused where grad is on] in frozen.py).
    """
    require_callable(fn, "reuse_during_recompute", "reuse_during_recompute(indexer, h) or "
                     "reuse_during_recompute(fn, h, ...): the function first, then its arguments",
                     role="the function whose result the replay reuses", factory=True)
    invocation = ACTIVE.get()
    if IN_REUSE.get():
        # NOTE [reuse inside reuse]: a call made while another reused fn runs is a plain call.
        # The replay skips the enclosing call, so it never asks for this one: recorded, its
        # result would be left over and backward refused. (The enclosing result is checked.)
        return fn(*args, **kwargs)
    if invocation is None:
        result = fn(*args, **kwargs)
        # NOTE [differentiable results are refused where grad is on] in frozen.py
        refuse_in_plain_call(fn, callable_name(fn), result, args, kwargs)
        return result
    if isinstance(fn, torch._ops.OpOverload):
        raise ReuseError(
            f"reuse_during_recompute takes a Python callable, not the op {fn}: save units "
            "record ops by their identity in the same frame, and a result recorded under the "
            "op would be mistaken for theirs (its checks skipped)",
            expected="a function, a bound method or a module", got=f"the op {fn}",
            tip="wrap it once in a function of your own: def topk_ids(h): return "
                f"torch.ops.{fn}(h, ...), then reuse_during_recompute(topk_ids, h)")
    if getattr(type(fn), "__hash__", None) is None:
        raise ReuseError(
            f"reuse_during_recompute needs a hashable callable: its results are recorded by "
            f"callable, and {callable_name(fn)} ({type(fn).__name__}) is not hashable",
            expected="a function, a bound method, a module or another hashable callable",
            got=f"{type(fn).__name__} with __hash__ = None",
            tip="pass a function or a method that does the call, or give the class a __hash__")
    recorders = []
    while invocation is not None and invocation.phase is Phase.FORWARD:
        recorders.append(invocation)
        invocation = invocation.parent
    rng_after = None
    generators_after: GeneratorStates = ()
    raised: BaseException | None = None  # NOTE [a reused call that raises]
    if invocation is None:
        refuse_iterator_arguments(fn, callable_name(fn), args, kwargs)
        devices, generators = _restored_by(recorders)
        # The replay will not run these ops, nor the RNG comparison (torch.equal dispatches
        # aten::equal): a save unit keeping everything a callable dispatches must not keep them.
        outer = IN_REUSE.get()
        try:
            # Set inside the try, put back as it was (NOTE [context variables set inside the
            # try] in keep.py).
            IN_REUSE.set((fn,))
            call, versions = argument_versions(args, kwargs)
            watched = with_its_module(fn, args, kwargs)  # NOTE [a module given to a reused call]
            buffers = buffer_versions(watched)
            numbers = numbers_watch(watched)
            contents = argument_contents(fn, watched, args, kwargs)  # NOTE in reused_numbers.py
            # NOTE [floats a reused fn stores on its module] (frozen.py)
            held = held_tensors(watched)
            before = rng_state(devices) if devices is not None else None
            generators_before = tuple((g, g.get_state()) for g in generators) \
                if generators else ()
            # NOTE [the grad probe] (grad_probe.py), and NOTE [floats a reused fn stores on
            # its module] (frozen.py)
            probe = probe_for(fn, call, stores=held is not None and stores_floats(watched))
            with probe if probe is not None else nullcontext():
                try:
                    result = fn(*args, **kwargs)
                except Exception as error:  # NOTE [a reused call that raises]
                    raised, result = error, cast(T, _Raised(error))
            if before is not None and devices is not None:
                # NOTE [skipped work keeps the RNG in step]
                after = rng_state(devices)
                rng_after = after if rng_changed(before, after) else None
            if generators_before:
                generators_after = generators_moved(generators_before)
        finally:
            IN_REUSE.set(outer)
        warn_changed_arguments(fn, callable_name(fn), call, versions)  # NOTE in frozen.py
        # NOTE [state a reused call changes] (frozen.py)
        changes = state_after(call, versions, buffers, numbers, contents)
        # NOTE [differentiable results are refused where grad is on] in frozen.py
        checks = _UNCHECKED if raised is not None else as_recorded(
            callable_name(fn), result, args, kwargs,
            graph=None if probe is None else probe.found(result),
            stored=() if held is None else stored_floats(watched, held, probe),
            probed=probe is not None)
    else:  # a nested boundary's original pass inside a replay records the jump it took too
        result, rng_after, checks = invocation.frame.take_with_rng(fn)
        if recorders:
            generators_after = invocation.frame.taken_generator_jump(fn)
        changes = invocation.frame.taken_state_after(fn)
        if changes is not None:  # made here as the skipped call made them in the forward
            outer = IN_REUSE.get()
            try:
                IN_REUSE.set((fn,))  # NOTE [context variables set inside the try] (keep.py)
                apply_state_after(with_its_module(fn, args, kwargs), args, kwargs, changes)
            finally:
                IN_REUSE.set(outer)
        if not recorders and type(result) is not _Raised:  # the replay itself (a nested
            # original pass checks in its replay)
            refuse_in_replay(fn, callable_name(fn), checks, result, args, kwargs)
            warn_grad_mode_read(fn, callable_name(fn))  # NOTE in frozen.py
        if isinstance(result, _Raised):
            raised = result.again(refuse_floats=torch.is_grad_enabled() and not recorders)
    for recorder in recorders:
        recorder.frame.record(fn, result, rng_after=rng_after, checks=checks,
                              state_after=changes, generators_after=generators_after)
    if raised is not None:
        raise raised
    return result


def _holds_float(value: Any, depth: int, /) -> bool:
    """``value`` is, or holds within ``depth`` levels, a floating (or complex) tensor."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    if depth == 0 or isinstance(value, (str, bytes, int, float, type)):
        return False
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        own = dunder(value, "__dict__")  # not through a user's __getattr__
        items = own.values() if type(own) is dict else ()
    return any(_holds_float(item, depth - 1) for item in list(items)[:64])


def _member_names(kind: type, /) -> list[str]:
    """The attributes the classes of ``kind`` keep outside a ``__dict__`` (``__slots__``, a
    built-in type's members), but the exception's context flag, set apart."""
    return [name for cls in kind.__mro__ for name, attribute in vars(cls).items()
            if isinstance(attribute, types.MemberDescriptorType)
            and name != "__suppress_context__"]


class _Raised:
    """NOTE [a reused call that raises]: a layer may catch what its reused function raises
    and fall back (`except CapacityError: ids = fallback(h)`), after the function changed what
    it was given (a count). Nothing was recorded for such a call, so the replay asked for a
    result the original pass never recorded and was refused, where eager runs (helper IJ).
    The call is recorded as raised: the exception's type, arguments and attributes (the handler may
    read `e.tokens`), and its cause and context so recorded (`raise X from Y`, helper IK), three
    deep; not the exception itself, whose traceback holds the forward's frames and their tensors
    until backward (what its attributes hold is held until then). With what the call changed and the
    random numbers it drew, the replay, skipping the call, makes those again and raises an exception
    so made again (without calling its ``__init__``, which may take other arguments than it keeps),
    for the layer to catch as in eager. One that cannot be made so is a ``ReuseError`` naming it."""

    __slots__ = ("kind", "args", "attributes", "slots", "cause", "context", "suppress", "name")

    def __init__(self, error: BaseException, /, depth: int = 0) -> None:
        self.kind, self.args, self.name = type(error), error.args, repr(error)
        self.attributes = dict(dunder(error, "__dict__", {}))  # __notes__ too
        # Those a subclass keeps in __slots__ (helper IL: the handler read another value), and
        # those a built-in type's __init__ sets (`AttributeError.name`, `OSError.filename`,
        # `StopIteration.value`: helper IN): member descriptors both.
        self.slots = [(name, getattr(error, name)) for name in _member_names(type(error))
                      if hasattr(error, name)]
        deeper = depth < 2
        self.cause = _Raised(error.__cause__, depth + 1) \
            if deeper and error.__cause__ is not None else None
        self.context = _Raised(error.__context__, depth + 1) \
            if deeper and error.__context__ is not None else None
        self.suppress = error.__suppress_context__

    def again(self, *, refuse_floats: bool = False) -> BaseException:
        """The exception made again; ``refuse_floats``: a ``ReuseError`` instead where it holds
        a floating tensor (``_float_held``): eager's may carry a
        graph (`e.probs = h.softmax(-1)`), which the original pass, under no-grad, did not make
        (helper IO: the handler's gradient through it was missing, silently), as a float result
        is refused (NOTE [differentiable results are refused where grad is on] in frozen.py)."""
        if refuse_floats and (where := self._float_held()) is not None:
            return ReuseError(
                f"the original pass's call raised {self.name}, which holds a floating tensor "
                f"({where}); the replay skips the call and raises it again with that tensor "
                "as the original pass, under no-grad, made it: without a graph, where eager's "
                "may have had one (a detached statistic would not: one is not told apart)",
                expected="an exception holding no floating tensor", got=where,
                tip="keep floats out of the exception (ids, counts, Python numbers), and "
                    "compute what the handler needs from the layer's own tensors after "
                    "catching it")
        try:
            error = self.kind.__new__(self.kind, *self.args)
            error.args = self.args
            error.__dict__.update(self.attributes)
            for name, value in self.slots:
                try:
                    setattr(error, name, value)
                except AttributeError:  # read-only: an ExceptionGroup's exceptions (helper IO)
                    if getattr(error, name, None) != value:  # set by __new__ from the args
                        raise
        except Exception:  # a type whose __new__ takes other arguments, or without a __dict__
            return ReuseError(
                f"the original pass's call raised {self.name}, and the replay, which skips the "
                "call, cannot raise it again: its type cannot be made from the arguments and "
                "attributes it keeps", expected=f"{self.kind.__name__}.__new__(*error.args)",
                got="an error",
                tip="raise an exception of a plain type (a ValueError with a message, or a "
                    "subclass keeping what it needs as attributes), or return a flag the layer "
                    "checks instead of raising")
        error.__cause__ = self.cause.again() if self.cause is not None else None
        error.__context__ = self.context.again() if self.context is not None else None
        error.__suppress_context__ = self.suppress
        return error

    def _float_held(self) -> str | None:
        """Where the exception, its cause or its context holds a floating tensor: in an
        argument or attribute, or inside one (a container, an object's attributes), three
        levels deep (helper IP: `e.info = {"probs": ...}`, `raise X from Y(probs)`); ``None``:
        nowhere."""
        named = [*((f"args[{i}]", v) for i, v in enumerate(self.args)),
                 *self.attributes.items(), *self.slots]
        for name, value in named:
            if _holds_float(value, 3):
                return name
        for link, raised in (("__cause__", self.cause), ("__context__", self.context)):
            if raised is not None and (where := raised._float_held()) is not None:
                return f"{link}: {where}"
        return None


def _restored_by(invocations: list[Any], /
                 ) -> tuple[tuple[int, ...] | None, tuple[torch.Generator, ...]]:
    """The CUDA devices whose generators any of ``invocations`` restores in its replay (``None``
    when none restores RNG at all), and the generators passed in that any of them restores."""
    if len(invocations) == 1:  # the usual case: one boundary records
        frame = invocations[0].frame
        return frame.rng_devices, frame.generators
    devices = [i.frame.rng_devices for i in invocations if i.frame.rng_devices is not None]
    generators = {id(g): g for i in invocations for g in i.frame.generators}
    return (None if not devices else tuple(sorted({d for ds in devices for d in ds})),
            tuple(generators.values()))


def _made_anew(fn: Any, recorded: Any, /) -> bool:
    """Whether the original pass recorded another callable of ``fn``'s code (a lambda or nested
    function made again, or a ``functools.partial`` of the same function made again)."""
    def code(f: Any) -> Any:
        partial = isinstance(f, functools.partial)
        while isinstance(f, functools.partial):
            f = f.func
        # A plain function, or a partial of any function: not a bound method (another
        # object's method of the same code is another call, not one made anew).
        return f.__code__ if isinstance(f, types.FunctionType) else \
            f if partial else None

    mine = code(fn)
    return mine is not None and any(code(other) == mine for other in recorded)
