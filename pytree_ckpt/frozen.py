"""Which results ``reuse_during_recompute`` may replay: frozen ones, never a gradient's path.

NOTE [differentiable results are refused where grad is on]: the replay hands back the recorded
result instead of calling fn, so a float leaf that eager computes with grad (router gate
weights or probabilities) would silently lose its gradient under checkpointing. Whether eager
computes it with grad cannot be seen in the original pass: it runs under the boundary's
no-grad, so neither the caller's grad mode at the call nor what requires grad among the
layer's own tensors shows there; and fn must run there exactly as eager runs it (under the
caller's no_grad: numpy calls, in-place updates, the kernels torch picks by grad mode). The
replay sees both, as eager does, but does not call fn. So the rules are static (but for the
probe behind rule 3, which only watches), and the same in eager and in the replay, so that a
model that checkpoints only some of its layers fails alike in every one.
Where grad is enabled at the call, a float (or complex) result leaf is refused when

1. it requires grad itself (eager: computed with grad), or
2. a tensor argument of the call requires grad (logits the layer computed, passed to a
   top-k that returns its values), or
3. fn is a module, or a method of one, with a parameter that requires grad (a router whose
   gate computes the weights it returns); or fn reaches such a module, or a tensor that
   requires grad, among the call's arguments, bound by a ``functools.partial``, as an attribute
   of a plain callable object (or a classmethod's class), as an argument default, in a closure
   cell or as a global its code reads, or from there through the attributes its code reads
   and the functions of the user's it reaches (NOTE [what fn reaches with grad] in
   grad_reach.py); or, where that look finds nothing, the original pass's ops computed it
   from a tensor that requires grad (NOTE [the grad probe] in grad_probe.py: what the look
   misses, the probe sees, but for a tensor that has a graph in the replay only).

Rules 2 and 3 do not apply to a function decorated with ``torch.no_grad()`` (or
``inference_mode()``, ``set_grad_enabled(False)``), nor to one whose whole body runs in such a
block (NOTE [a body under its own no-grad] in grad_blocks.py): eager computes its results
without grad.

Frozen floats therefore come from inputs passed detached, and from a plain function, not a
method of a trainable module (or are computed outside the reused call). Whatever the grad
mode, a leaf that requires grad when recorded (fn enabled grad itself, or returned a
parameter or an input as it is) is refused at once, and so, in the replay, is a float leaf
that was one of the call's tensor arguments if that argument requires grad (eager would hand
back the tensor, graph and all).
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .eager import user_stacklevel
from .errors import ReuseError
from .forward_numbers import NumbersWatch
from .function_reach import cell_contents, code_reading, unwrap_partials
from .grad_blocks import body_without_grad
from .grad_reach import Reach, argument_path, grad_reach, reach_short, reach_words
from .module_state import owning_module
from .reused_numbers import ArgumentContents, MadeContents
from .state_changes import is_replay_copy, mark_replay_copy
from .tree import FlatTree, dunder, flatten, flatten_call, hidden_tensor, leaf_paths

__all__ = ["AsRecorded", "StateAfter", "apply_state_after", "argument_versions", "as_recorded",
           "buffer_versions", "numbers_watch", "refuse_in_plain_call", "refuse_in_replay",
           "held_tensors", "state_after", "stored_floats", "stores_floats", "switches_grad_off",
           "warn_changed_arguments", "warn_grad_mode_read"]

_SPLIT_TIP = ("return only the frozen part (the top-k ids) from the reused call and compute "
              "the differentiable part outside it, from those ids (MoE gate weights: gather "
              "the softmax of the router's scores at the replayed ids, as "
              "examples/glm_dsa/mlp.py does)")
# Detaching is for floats that must get no gradient; said second, as following it for gate
# weights makes them silently lose theirs.
_DETACH_TIP = ("; only floats that must get no gradient (statistics) may come back: pass fn "
               "its inputs detached then (reuse_during_recompute(fn, logits.detach()))")
_MODULE_TIP = ("; a module's trainable parameters give its floats a graph, so detaching the "
               "inputs does not help: frozen statistics can come from a plain function given "
               "detached inputs, from a function decorated with @torch.no_grad() (a module "
               "whose forward is decorated so: pass module.forward, as a module's call runs "
               "its hooks too), or be computed outside the call")
# The grad probe cannot see grad switched off inside fn (NOTE [the grad probe]); a block
# around the whole body is read from the source (NOTE [a body under its own no-grad]).
_PROBE_TIP = ("; where eager computes that float without grad though fn reads a parameter "
              "(under a torch.no_grad() block around part of fn's body, or an op torch runs "
              "so: a distribution's sample()), detach what it reads there (scores.detach()), "
              "or decorate fn with @torch.no_grad()")

class AsRecorded(NamedTuple):
    """What the replay checks of a recorded result: its float leaves that were tensor arguments
    of the call (their key paths, and their indexes among the call's flattened leaves), and
    where the grad probe saw a float leaf eager computes with grad (NOTE [the grad probe] in
    grad_probe.py)."""

    arguments: tuple[tuple[str, int], ...] = ()
    graph: tuple[str, str] | None = None  # (key path, what it came from)
    # NOTE [floats a reused fn stores on its module]: (attribute, what the probe saw it
    # computed from, or None where it did not watch or saw nothing), and whether it watched
    stored: tuple[tuple[str, str | None], ...] = ()
    probed: bool = False


def as_recorded(name: str, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any], /, *,
                graph: tuple[str, str] | None = None,
                stored: tuple[tuple[str, str | None], ...] = (),
                probed: bool = False) -> AsRecorded:
    """Check ``result`` as the original pass records it; what the replay checks of it."""
    flat = flatten(result)
    if not flat.tensor_index:
        return AsRecorded((), graph, stored, probed)
    for i in flat.tensor_index:
        if flat.leaves[i].requires_grad:  # fn enabled grad itself, or an outside tensor
            _refuse_differentiable(name, leaf_paths(flat.spec, root="result")[i], replay=False)
    call = flatten_call(args, kwargs)
    given = {id(call.leaves[j]): j for j in call.tensor_index}
    passed = [(i, given[id(flat.leaves[i])]) for i in flat.tensor_index
              if id(flat.leaves[i]) in given and _is_float(flat.leaves[i])]
    if not passed:
        return AsRecorded((), graph, stored, probed)
    paths = leaf_paths(flat.spec, root="result")
    return AsRecorded(tuple((paths[i], j) for i, j in passed), graph, stored, probed)


# A module's __dict__ and the ids of the tensors held in it, read before a reused call.
Held = tuple[dict[str, Any], dict[str, int]]


def held_tensors(fn: Callable[..., Any], /) -> Held | None:
    """The tensors ``fn``'s module holds as plain attributes (in its ``__dict__``; not its
    children's), by name and id, read before ``fn`` runs (NOTE [floats a reused fn stores on
    its module])."""
    module = owning_module(fn)
    if module is None:
        return None
    d = module.__dict__
    return d, {name: id(value) for name, value in tuple(d.items())
               if isinstance(value, torch.Tensor)}


def stored_floats(fn: Callable[..., Any], held: Held, probe: Any, /
                  ) -> tuple[tuple[str, str | None], ...]:
    """NOTE [floats a reused fn stores on its module]: a reused call that binds a float tensor
    on its module (``self.probs = self.gate(x).softmax(-1)``, an aux loss) while returning only
    ids escapes the checks on its result, and the layer reading that attribute after the call
    is silently wrong under checkpointing: the replay skips the call, so it reads what the
    original pass stored, computed under its no-grad, where eager's has a graph (the gate gets
    no gradient from it). What the call bound anew (a float tensor without a graph) is kept by
    name, with what the grad probe saw it computed from. A function seen storing one is
    probed at its next calls until one of them is replayed (helper GO: a watched call whose
    graph was dropped, a dry run, a skipped step, left the function unwatched for good), eight
    at most without one (a grad-enabled evaluation loop: helper GP), counted anew once an
    unwatched call of it is replayed (helper GQ), and again once it stores an attribute no
    replayed probed call did (an aux loss switched on later), unless told (``stores_floats``;
    where the static look finds a trainable module too, or a tensor argument requires grad,
    unlike for its results, which rules 2 and 3 judge without the probe): neither the look nor the
    arguments tell gate weights from a statistic (``bincount(ids).float()``, ``scores.detach()``:
    helper GN, warned falsely when they stood as evidence), the probe can. The replay, which
    sees the grad mode, warns once
    per function where the probe saw a stored float computed from a tensor that requires
    grad (``warn_stored_floats``); a call the probe did not watch (the function's first, a
    compiled function's: a documented limit) is not told. A warning, not a refusal, and none
    for a function whose code
    (or a helper's of the user's it calls) switches grad off itself (``with torch.no_grad():``,
    ``inference_mode``, ``set_grad_enabled``): a statistic computed under such a block from a
    parameter cannot be told from gate weights (the probe does not see grad switched off
    inside fn), and routers storing one are common (a function decorated with
    ``@torch.no_grad()`` has no graph in eager, and is not told either). Not seen: a float
    stored by such a function that eager does give a graph, by a function that is no method
    of a module, on another module than fn's own (a child's), or in a container, or stored
    only in calls the probe does not watch. Cost: two reads of the module's ``__dict__`` per
    reused call in the original pass, and the probe's (a Python call per op) in one replayed
    call of a function that stores floats (more where graphs are dropped); a
    ``torch.compile``d helper such a call runs is compiled once more under the probe's mode
    (dynamo guards on the mode stack: one more graph, helper GN)."""
    d, before = held
    # By the module's class and name (`Router.probs`): the replay, which warns, has the call's
    # function only, whose module may be one it was given (helper JX: "NoneType.probs").
    owner = type(owning_module(fn)).__name__
    found = tuple((f"{owner}.{name}", None if probe is None else probe.source(value))
                  for name, value in tuple(d.items())
                  if isinstance(value, torch.Tensor) and before.get(name) != id(value) and
                  _is_float(value) and not value.requires_grad)
    try:
        key = warned_key(fn)
        if probe is not None:
            _PROBED[key] = _PROBED.get(key, 0) + 1
        elif found and key not in _OPEN and key not in _WARNED_STORED and \
                not {name for name, _ in found} <= _JUDGED.get(key, frozenset()):
            _OPEN.add(key)  # a first store, or an attribute no replayed probed call stored
            _PROBED[key] = 0
    except TypeError:  # a builtin takes no weak reference (and stores nothing)
        pass
    return found


def switches_grad_off(fn: Callable[..., Any], /) -> bool:
    """Whether ``fn`` runs under its own no-grad (decorated, a whole body in a block) or its
    code (or a helper's of the user's) switches grad off: what it computes may have no graph in
    eager either (hook_outputs.py's warning of hooked modules inside a reused call asks)."""
    return _without_grad(fn) or _switches_grad_off(fn)


def _switches_grad_off(fn: Callable[..., Any], /) -> bool:
    """fn's code, or a helper or method of the user's it calls, reads ``torch.no_grad``,
    ``inference_mode`` or ``set_grad_enabled``: floats it stores may be statistics computed
    with grad off inside it, which the probe cannot tell from gate weights (NOTE [floats a
    reused fn stores on its module]); not warned of."""
    return any(code_reading(fn, name) is not None
               for name in ("no_grad", "inference_mode", "set_grad_enabled"))


# By warned_key (NOTE [floats a reused fn stores on its module]; facts about the code, not step
# state): the functions whose next calls are probed, and the attributes the replayed probed
# calls of each stored, all of them.
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_JUDGED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
# Probed calls since the function was last (re)opened: at most _MAX_PROBED without a replay (a
# grad-enabled evaluation loop that never runs backward: helper GP, every call probed).
_PROBED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_MAX_PROBED = 8


def stores_floats(fn: Callable[..., Any], /) -> bool:
    """Whether ``fn``'s next call is probed for the floats it stores on its module (NOTE
    [floats a reused fn stores on its module]): it stored one no replayed probed call of it
    did, and fewer than _MAX_PROBED calls were probed since."""
    try:
        key = warned_key(fn)
        return key in _OPEN and _PROBED.get(key, 0) < _MAX_PROBED
    except TypeError:
        return False


# Functions warned about by warn_stored_floats, by warned_key (a warning's dedupe, not step
# state; weak: a class or code gone takes its entry with it).
_WARNED_STORED: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_stored_floats(fn: Callable[..., Any], name: str, recorded: AsRecorded, /) -> None:
    """NOTE [floats a reused fn stores on its module], in the replay, where grad is on."""
    key = warned_key(fn)
    try:
        if recorded.probed:  # judged: its next calls are not probed, until it stores another
            _JUDGED[key] = _JUDGED.get(key, frozenset()) | \
                frozenset(attribute for attribute, _ in recorded.stored)
            _OPEN.discard(key)
        elif key in _OPEN:
            # An unprobed call replayed: backward runs now (training began after a
            # grad-enabled evaluation spent the probes: helper GQ), the next call is probed.
            _PROBED[key] = 0
    except TypeError:
        pass
    if not recorded.stored or key in _WARNED_STORED or _without_grad(fn) or \
            _switches_grad_off(fn):
        return
    seen = next(((attribute, source) for attribute, source in recorded.stored
                 if source is not None), None)
    if seen is None:
        return  # statistics, or a call the probe did not watch (the function's first)
    attribute, why = seen
    try:
        _WARNED_STORED.add(key)
    except TypeError:  # a builtin takes no weak reference (and lives as long)
        return
    where = attribute
    warnings.warn(
        f"pytree_ckpt: reuse_during_recompute({name}) stored the float tensor {where} on its "
        f"module in the original pass ({why}): eager gives it a graph there. The replay "
        "does not call the function, so code after the call reads the value the original "
        "pass stored, computed under its no-grad: a gradient through it (gate weights the "
        "layer multiplies by, an aux loss) is lost, silently. Tip: return it from the "
        "function instead (its results are checked; compute the differentiable part after "
        "the call, from the replayed ids); for a statistic or a log that needs no gradient, "
        "store it detached (self.last = scores.detach()) or decorate the function with "
        "@torch.no_grad(), either of which also silences this (docs/replay.md, 'What may be "
        "replayed')",
        stacklevel=user_stacklevel())


def argument_versions(args: tuple[Any, ...], kwargs: dict[str, Any], /
                      ) -> tuple[FlatTree, list[int | None]]:
    """The call's flattened arguments and their tensors' versions, read before ``fn`` runs."""
    call = flatten_call(args, kwargs)
    return call, [None if (t := call.leaves[j]).is_inference() else t._version
                  for j in call.tensor_index]


def warned_key(fn: Any, /) -> Any:
    """What a warning about ``fn`` is told once for: the code it runs (a function's, through
    partials and bound methods), or the class of a module or callable object. Not its name:
    two routers of one class name in two model families, or two top-level lambdas, are other
    functions (helper EG: the second was never told)."""
    function = fn
    for _ in range(4):  # through partials and bound methods, in any nesting (`MethodType(
        # partial(route, router), router)` from with_its_module: helper JZ, all partials one key)
        function = unwrap_partials(function)[0]
        inner = dunder(function, "__func__")
        if inner is None:
            break
        function = inner
    code = dunder(function, "__code__")
    if code is not None:
        return code
    # A builtin (torch.relu_) is itself, not its type, which all builtins share (helper EL).
    return function if isinstance(function, _BUILTINS) else type(function)


_BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType, torch._ops.OpOverload,
             torch._ops.OpOverloadPacket)


def warn_changed_arguments(fn: Any, name: str, call: FlatTree, before: list[int | None], /
                           ) -> None:
    """NOTE [a reused fn changes no argument]: the replay skips ``fn``, so a change ``fn``
    made in place to a floating argument (a mask written into the scores it is given:
    ``logits.detach()`` shares the logits' storage) is not made again, and what reads that
    storage after the call in the replay (the softmax of those logits) computes another
    function than eager's. Whether anything reads it cannot be seen (a temporary
    ``scorer(x).detach()`` masked in place is fine), so this is a warning, once per function.
    Integer arguments are not told: a token count the function adds to counts once, as in
    eager, since the replay skips the call."""
    key = warned_key(fn)
    if key in _WARNED_CHANGED or key in _WARNED_BUILTINS:
        return
    for j, version in zip(call.tensor_index, before):
        t = call.leaves[j]
        if version is not None and t._version != version and _is_float(t):
            try:
                _WARNED_CHANGED.add(key)
            except TypeError:  # a builtin takes no weak reference (and lives as long)
                _WARNED_BUILTINS.add(key)
            warnings.warn(
                f"pytree_ckpt: reuse_during_recompute({name}) changed its "
                f"{argument_path(call, j)} in place; the replay skips the call, so the "
                "change is not made again there: if anything reads that tensor's storage "
                "after the call (the logits a logits.detach() argument shares it with), the "
                "replay computes another function than eager's, silently. Tip: change a "
                "clone inside the function (scores = scores.clone())",
                stacklevel=user_stacklevel())
            return


# One change a reused call made: ("argument", leaf index, ...), ("buffer", name, ...) for a
# buffer changed in place or ("reassigned", name, ...) for one reassigned, with
# the storage the original pass left it on (weakly) and its value after the call (NOTE
# [state a reused call changes]).
StateAfter = tuple[tuple[str, Any, "weakref.ref[torch.UntypedStorage] | None", Any], ...]
Buffers = tuple[dict[str, Any], list[tuple[str, Any, int | None]]]


def buffer_versions(fn: Callable[..., Any], /) -> Buffers | None:
    """The own buffers of ``fn``'s module (if any; not its children's: a walk per call), with
    their versions, read before ``fn`` runs: its ``_buffers`` dict, and (name, tensor,
    version) per entry."""
    module = owning_module(fn)
    if module is None:
        return None
    # Read where it holds none too: the call may register one (a lazy load EMA, NOTE [state a
    # reused call changes]).
    held = module._buffers
    return held, [(name, b, None if b is None or b.is_inference() else b._version)
                  for name, b in held.items()]


def numbers_watch(fn: Callable[..., Any], /) -> NumbersWatch | None:
    """The plain values of ``fn``'s module (if any; not its children's), read before ``fn``
    runs (NOTE [state a reused call changes])."""
    module = owning_module(fn)
    return None if module is None else NumbersWatch([module.__dict__], mixed=True)


def state_after(call: FlatTree, before: list[int | None], buffers: Buffers | None,
                numbers: NumbersWatch | None, contents: ArgumentContents | None = None, /
                ) -> StateAfter | None:
    """NOTE [state a reused call changes]: the replay skips a reused call, so a change it made
    in place to an integer argument (a token count it adds to), or to a buffer of its own
    module, in place or by reassignment (a router's load EMA), is not made again there, and
    what reads that tensor after the call in the replay read it as it was before the call:
    other gradients than eager's, at every step. The original pass keeps the changed
    tensors' values after the call (small state); the replay, skipping the call, writes them
    (``apply_state_after``) into its own tensors only: a buffer when the replay runs on its
    copy (NOTE [the replay changes copies] in state_changes.py marks their storages), an
    argument unless it is on the very storage the original pass changed (a plain tensor
    attribute, or a view of it: the caller's, which later code may have changed since; an
    argument the layer makes itself is the replay's own). State with no copy is read as the
    caller left it (docs/limits.md, the micro-batch row). Floating arguments are warned
    about instead (NOTE [a reused fn changes no argument]): logits-sized scores would be
    kept twice. A buffer the call reassigned is reassigned in the replay, one it changed in
    place is changed in place there (``"reassigned"``, ``"buffer"``), as eager did each: a
    graph that saved the tensor before the call finds it as eager's did. Plain values and
    small containers of its module (a count per expert, ``self.load[e] += 1``; NOTE [numbers
    and flags as the forward began] in forward_numbers.py) likewise: the replay puts them
    back as the forward began and runs the code before the call again, so it finds them as
    the call did, and gets what the call left (``"numbers"``; a tensor it stored where a value
    was, ``self.last = scores``, by weak reference: while the module or the frame holds it;
    an object it bound or changed in place, with what it held then: NOTE [an object a reused
    call leaves where a value was]; a buffer it registered, or gave a tensor where None was,
    as a reassigned one);
    one found otherwise (changed since) is left; the call's values are put back as it found
    them for the replay even on a module outside the boundary's (``with_reused_calls`` in
    reused_numbers.py). Cost: two reads of the module's ``__dict__`` per reused call in the
    original pass (on the 2-core CI machine 9 to 11 us for a Linear; helper CP measured 64 us
    for a module holding 30 ints and a list the call changes). ``None`` when nothing changed
    (the usual case)."""
    changed: list[tuple[str, Any, weakref.ref[torch.UntypedStorage] | None, Any]] = [
        ("argument", j, weakref.ref(t.untyped_storage()), t.detach().clone())
        for j, version in zip(call.tensor_index, before)
        if version is not None and (t := call.leaves[j])._version != version
        and not _is_float(t)]
    if buffers is not None:
        held, entries = buffers
        for name, b, version in entries:
            now = held.get(name)
            if isinstance(now, torch.Tensor) and not now.is_inference() and (
                    now is not b or now._version != version):
                changed.append(("buffer" if now is b else "reassigned", name,
                                _storage_ref(now), now.detach().clone()))
        if len(held) > len(entries):  # registered by the call: made again as reassigned
            known = {name for name, _, _ in entries}
            changed += [("reassigned", name, _storage_ref(now),
                         now.detach().clone()) for name, now in held.items()
                        if name not in known and isinstance(now, torch.Tensor)
                        and not now.is_inference()]
    if numbers is not None and (made := numbers.made()) is not None:
        changed.append(("numbers", None, None, made))
    if contents is not None and (given := MadeContents.of(contents)) is not None:
        # NOTE [a container a reused call is given and counts in] (reused_numbers.py)
        changed.append(("contents", None, None, given))
    return tuple(changed) if changed else None


def _storage_ref(t: torch.Tensor, /) -> weakref.ref[torch.UntypedStorage] | None:
    """A buffer's storage, weakly (read for an argument's only); none for a sparse one."""
    return weakref.ref(t.untyped_storage()) if t.layout is torch.strided else None


def apply_state_after(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                      changes: StateAfter, /) -> None:
    """Make, in the replay, the changes a skipped reused call made in the original pass, in
    the replay's own tensors only (NOTE [state a reused call changes])."""
    call = flatten_call(args, kwargs)
    module = owning_module(fn)
    held = module._buffers if module is not None else {}
    with torch.no_grad():
        for kind, key, original, value in changes:
            if kind == "argument":
                target = call.leaves[key] if key < len(call.leaves) else None
                ours = isinstance(target, torch.Tensor) and original is not None and \
                    target.untyped_storage() is not original()
            elif kind == "numbers":
                value.make_again()  # in the dict of the module the original pass read
                continue
            elif kind == "contents":
                value.make_again(args, kwargs)  # in the replay's own arguments
                continue
            elif kind == "reassigned":
                # NOTE [a reassigned buffer is reassigned in the replay]: eager put a new
                # tensor in the dict and left the one it replaced as it was; an op before
                # the call may have saved that one (h * router.scale), and a copy into it
                # moved its version: the replay's backward failed where eager's ran. The
                # dict gets the forward's entries back when the replay's fn returns. One the
                # call made (None, or not registered, before it: a lazy EMA) is as the
                # forward began there (NOTE [the replay changes copies]): given its copy.
                target = held.get(key)
                if target is None or isinstance(target, torch.Tensor) and \
                        is_replay_copy(target):
                    copy = value.clone()
                    mark_replay_copy(copy)
                    held[key] = copy
                continue
            else:
                target = held.get(key)
                ours = isinstance(target, torch.Tensor) and is_replay_copy(target)
            if ours and isinstance(target, torch.Tensor) and target.shape == value.shape and \
                    target.dtype == value.dtype and (target.layout is not torch.strided or
                                                     not torch.equal(target, value)):
                target.copy_(value)


# Functions warned about by warn_changed_arguments, by warned_key (a warning's dedupe, not step
# state; weak: a class or code gone takes its entry with it).
_WARNED_CHANGED: weakref.WeakSet[Any] = weakref.WeakSet()
_WARNED_BUILTINS: set[Any] = set()


def warn_grad_mode_read(fn: Callable[..., Any], name: str, /) -> None:
    """NOTE [a reused fn that reads the grad mode]: the original pass runs fn under the
    boundary's no-grad, and the replay, where eager's grad mode holds again, does not call it.
    So what fn does only ``if torch.is_grad_enabled()`` never happens under checkpointing
    (Megatron-Core's router counts tokens per expert so, for its expert bias: the count stays
    0, the bias drifts from eager's from the next step, silently). Whether eager had grad on
    at the call is known only in the replay, so it is told there, once per function, when grad
    is on and fn's code, or a method or helper of the user's it calls (up to four calls
    deep), reads is_grad_enabled (``function_reach.code_reading``; a read in a branch not
    taken is told too). Not
    refused: what it guards may not matter (a log)."""
    if name in _WARNED_GRAD_MODE or not torch.is_grad_enabled():
        return
    where = code_reading(fn, "is_grad_enabled")
    if where is None:
        return
    _WARNED_GRAD_MODE.add(name)
    warnings.warn(
        f"pytree_ckpt: reuse_during_recompute({name}): {where} reads torch.is_grad_enabled(). "
        "Eager runs it here with grad on; under checkpointing the original pass ran it under "
        "the boundary's no-grad and the replay hands back its result without calling it, so "
        "what it does only with grad on (a token count per expert for a load-balancing bias) "
        "never happens. Move that part out of the reused call, after it, on the ids it "
        "returns: the layer's own code runs again in the replay with grad on, once, as under "
        "torch's checkpoint (docs/replay.md, 'What may be replayed')",
        stacklevel=user_stacklevel())


# Functions warned about by warn_grad_mode_read (a warning's dedupe, not step state).
_WARNED_GRAD_MODE: set[str] = set()


def refuse_in_plain_call(fn: Callable[..., Any], name: str, result: Any,
                         args: tuple[Any, ...], kwargs: dict[str, Any], /) -> None:
    """The rules outside any boundary, where the result and the grad mode are eager's."""
    flat = flatten(result)
    if len(flat.tensor_index) < len(flat.leaves) and torch.is_grad_enabled():
        _refuse_hidden(fn, name, flat, args, kwargs)
    if not flat.tensor_index:
        return
    for i in flat.tensor_index:
        if flat.leaves[i].requires_grad:
            _refuse_differentiable(name, leaf_paths(flat.spec, root="result")[i], replay=False,
                                   reach=grad_reach(fn, flatten_call(args, kwargs)))
    if torch.is_grad_enabled():
        _refuse_floats(fn, name, flat, args, kwargs, replay=False)


def refuse_in_replay(fn: Callable[..., Any], name: str, recorded: AsRecorded, result: Any,
                     args: tuple[Any, ...], kwargs: dict[str, Any], /) -> None:
    """The rules in the replay, which sees eager's grad mode and arguments."""
    if recorded.arguments:
        call = flatten_call(args, kwargs)
        for path, j in recorded.arguments:
            if call.leaves[j].requires_grad:
                argument = argument_path(call, j)
                raise ReuseError(
                    f"reuse_during_recompute({name}) returned {path}, which is {argument} as it "
                    "is, and that requires grad: eager hands back the tensor itself, graph and "
                    "all, and the replay the value recorded in the original pass, which has none",
                    expected="frozen results computed by fn",
                    got=f"{path} is {argument}, with requires_grad=True",
                    tip="use the tensor itself outside the reused call; if no gradient is "
                        "wanted, pass it detached")
    if torch.is_grad_enabled():
        flat = flatten(result)
        if len(flat.tensor_index) < len(flat.leaves):
            _refuse_hidden(fn, name, flat, args, kwargs)
        if flat.tensor_index:
            _refuse_floats(fn, name, flat, args, kwargs, replay=True)
        if recorded.stored or recorded.probed:
            warn_stored_floats(fn, name, recorded)
        if recorded.graph is not None and not _without_grad(fn):
            # NOTE [the grad probe] (grad_probe.py)
            path, source = recorded.graph
            raise ReuseError(
                f"reuse_during_recompute({name}) returned {path} ({source}): eager gives that "
                "float a graph here (unless fn switches grad off inside it: see the tip), and "
                "the replay hands back the value recorded in the original pass without calling "
                "fn, so its gradient would be lost (eager refuses such a result)",
                expected="frozen results only: int ids, or floats computed without grad",
                got=f"{path}, which the original pass's ops computed from a tensor that "
                    "requires grad",
                tip=_SPLIT_TIP + _MODULE_TIP + _PROBE_TIP)


def _is_float(tensor: torch.Tensor, /) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _refuse_floats(fn: Callable[..., Any], name: str, flat: FlatTree, args: tuple[Any, ...],
                   kwargs: dict[str, Any], /, *, replay: bool) -> None:
    floats = [i for i in flat.tensor_index if _is_float(flat.leaves[i])]
    if not floats or _without_grad(fn):
        return
    result = leaf_paths(flat.spec, root="result")[floats[0]]
    why = ("the replay hands back the value recorded in the original pass without calling fn"
           if replay else "under checkpointing the replay would hand back a recorded value "
           "without calling fn")
    call = flatten_call(args, kwargs)
    # What fn reaches first: detaching the inputs cannot help there.
    reach = grad_reach(fn, call)
    if reach is not None:
        raise ReuseError(
            f"reuse_during_recompute({name}) returned the float {result}, and {name} "
            f"{reach_words(fn, reach)}: {why}, so it cannot tell whether eager computes it "
            "with grad from them",
            expected="float results only from plain functions given detached inputs (or int "
                     "results only)",
            got=f"a float {result} from {reach_short(reach)}",
            tip=_SPLIT_TIP + _MODULE_TIP)
    # NOTE [leaves that hold tensors] (tree.py): logits in a plain object passed in (a
    # SimpleNamespace, a class with __slots__) are an argument too (helper GE: accepted, the
    # gate got no gradient, where eager refuses)
    for j, leaf in enumerate(call.leaves):
        if isinstance(leaf, torch.Tensor):
            where = "" if leaf.requires_grad else None
        else:
            hidden = hidden_tensor(leaf, lambda t: t.requires_grad)
            where = None if hidden is None else hidden[0]
        if where is not None:
            argument = argument_path(call, j) + where
            raise ReuseError(
                f"reuse_during_recompute({name}) returned the float {result} for {argument}, "
                f"which requires grad: {why}, so it cannot tell whether eager computes it with "
                "grad", expected="int results only (or floats from inputs passed detached)",
                got=f"{argument}.requires_grad=True and a float {result}",
                tip=_SPLIT_TIP + _DETACH_TIP)


def _without_grad(fn: Callable[..., Any], /) -> bool:
    """fn (or a function a partial of it calls) is decorated with ``torch.no_grad()``,
    ``torch.inference_mode()`` or ``torch.set_grad_enabled(False)``, or runs its whole body in
    such a block: its results have no graph in eager whatever it reaches, so the static rules
    do not apply (router statistics computed under the function's own no-grad). The decorator
    is seen by the context object it holds in its closure; the block, in fn's source (NOTE [a
    body under its own no-grad] in grad_blocks.py)."""
    inner, _ = unwrap_partials(fn)
    if not isinstance(inner, nn.Module) and body_without_grad(inner):
        return True
    for _ in range(8):
        if dunder(inner, "__wrapped__") is None or isinstance(inner, nn.Module):
            return False
        for cell in dunder(inner, "__closure__") or ():
            ctx = dunder(cell_contents(cell), "__self__")
            if isinstance(ctx, torch.no_grad) or \
                    isinstance(ctx, torch.inference_mode) and getattr(ctx, "mode", False) or \
                    isinstance(ctx, torch.set_grad_enabled) and not getattr(ctx, "mode", True):
                return True
        inner = getattr(inner, "__wrapped__")
    return False


def _refuse_hidden(fn: Callable[..., Any], name: str, flat: FlatTree, args: tuple[Any, ...],
                   kwargs: dict[str, Any], /) -> None:
    """NOTE [leaves that hold tensors] (tree.py), for reused results: a plain object (a
    ``SimpleNamespace``, a class of one's own) is a leaf the bridge does not open, so a float
    in it escapes the float rule below (a router's gate weights, replayed without their graph:
    the gate silently got no gradient), and is neither offloaded nor counted. Refused where
    that rule refuses a float in the open (grad on, and ``fn`` reaching a trainable module or a
    tensor that requires grad, or given inputs that require grad, and not decorated with
    ``torch.no_grad()``), in a plain call as in the replay; one from detached inputs passes, as
    it does in the open."""
    for i, leaf in enumerate(flat.leaves):
        found = None if isinstance(leaf, torch.Tensor) else hidden_tensor(leaf, _is_float)
        if found is None:
            continue
        call = flatten_call(args, kwargs)
        if _without_grad(fn) or grad_reach(fn, call) is None and \
                not any(call.leaves[j].requires_grad for j in call.tensor_index):
            return
        raise ReuseError(
            f"reuse_during_recompute({name}) returned a {type(leaf).__name__} holding a float "
            f"tensor at {leaf_paths(flat.spec, root='result')[i]}{found[0]}, from a function "
            "that may compute it with grad (one that reaches a module with trainable "
            "parameters or a tensor that requires grad, or is given inputs that require "
            "grad): the replay hands the object back as recorded, unopened, so such a tensor "
            "would silently lose its gradient (and is neither checked nor offloaded)",
            expected="results as PyTrees: tensors in dicts, lists, tuples, namedtuples or "
                     "dataclasses", got=f"{type(leaf).__name__} (a leaf the bridge does not open)",
            tip="return a dataclass or a NamedTuple instead, and compute differentiable parts "
                "outside the reused call, from its frozen ids")


def _refuse_differentiable(name: str, path: str, /, *, replay: bool,
                           reach: Reach | None = None) -> None:
    where = ("the replay hands back the value recorded in the original pass, which has no graph"
             if replay else "under checkpointing the replay would hand back a recorded value, "
             "which has no graph")
    raise ReuseError(
        f"reuse_during_recompute({name}) returned {path}, which requires grad: {where}, so "
        "its gradient would be lost",
        expected="frozen results only: int ids, or floats computed without grad (by a "
                 "function decorated with @torch.no_grad(), or from detached inputs)",
        got=f"{path}.requires_grad=True (computed with grad, or a parameter or an input "
            "returned as it is)",
        tip=_SPLIT_TIP + (_MODULE_TIP if reach is not None else _DETACH_TIP))
