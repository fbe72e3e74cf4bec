"""Hooks a forward registers on what exists outside its call: its parameters, its inputs, its
modules (NOTE [hooks the forward registers on its parameters and inputs])."""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .parameter_hooks import ParameterHook, SkipsNoGradient
from .tree import dunder

__all__ = ["ForwardHooks", "handles_made"]

# NOTE [hooks the forward registers on its parameters and inputs]: a forward may register a
# gradient hook on its own parameter (an OGD-style projection registered once behind a flag, or at
# every call with the handle kept for removal after the step; a post-accumulate hook), on its
# input (a gradient reversal, `h.register_hook(lambda g: -0.5 * g)`), or a module hook on a
# submodule (`register_full_backward_hook` behind a flag). Eager registers it once. The original
# pass registers it too, on the same parameter, module and caller's tensor: there it runs as
# eager's. The replay (and an output discard's rebuild) runs the forward again, with the flags as
# the forward began, and registered each a second time (on the parameter or module; on its input's
# alias, whose gradient then reached the caller's tensor through the boundary's node and its hook
# again): a projection applied twice, a reversal undone (helper PU: gradients 0.5x eager's, -0.5x
# upstream; helper PW: a module hook), and a handle the replay's code kept in a list the replay's
# end rolls back, so one hook leaked a step (0.5x, 0.25x, 0.125x). Every hook handle torch makes
# takes the next number of one counter (``RemovableHandle.next_id``), also its key in the hook
# dict: two reads of it around the original pass tell, at no other cost, whether anything was
# registered, and the keys in between which hooks the pass registered where. Each is kept by its
# key, the dict it is in, and what it runs: its function's code with the plain values it is given
# (a partial's arguments, its closure and defaults, a hook object's or a bound method's instance's
# attributes; a tensor or module among them by identity: helpers PY, QA, QC found `partial(scale,
# 3.0)` and `partial(scale, 0.5)`, `lambda g, k=k`, `partial(mul, self.a)` and `partial(mul,
# self.b)` taken for one). Right after the replay's forward, the replay's registrations that
# repeat the original pass's are removed, one for each: those giving the same values first, then
# by code alone (a value bound anew in each pass, a call number, still finds its repeat: helper
# QA). The replay's forward leaves no hook removed either: a forward replacing its previous call's
# hook through the handle it kept reads, in the replay, the handle the latest forward stored, and
# removed that hook (helper PX; a layer called twice a step, the later call's: helper PY; on the
# caller's input tensor: helper QA), so the registrations an original pass made (``_MADE``, by
# holder and key, kept while in use: helpers QE, QH) that the replay's forward removed from the
# dicts the original pass registered in are put back (not a caller's own hook the forward removes
# under grad only, as eager's forward does: helper QC), in their places (helper QA: hooks that do
# not commute) and with a module's options, under their keys, which the handles kept on the module
# remove at the next call. A hook the original pass did not make (registered only `if
# torch.is_grad_enabled()`) is the replay's alone, and stays (after the original pass's in the
# dict: where hooks that do not commute are mixed so, they run in another order than eager's,
# docs/limits.md). Hooks torch's own tools and this library register (FSDP, module trackers, the
# boundary's own recorders) are theirs to manage, and never touched. Not covered (docs/limits.md):
# a hook on an input's node (`x.grad_fn.register_prehook`), whose dict Python cannot read; the
# original pass's hook still on a parameter while the replay's forward runs, seen by a gradient
# the forward takes of that parameter itself; a module hook the replay's forward registers, which
# the submodule's call in that replay takes with the original pass's (both run there).

_TENSOR_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_MODULE_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# Where nn.Module keeps a hook's options, by the same key (RemovableHandle's extra dicts).
_MODULE_EXTRAS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called")
_NOT_USERS = ("torch.", "pytree_ckpt.", "offload.")

# (where: a slot of the call's inputs, or the parameter or module itself; the dict's name;
# each registration there: its key, what it runs and the hook; the dict it is in; its holder,
# weakly: an input's is the caller's tensor)
_Found = tuple[Any, str, list[tuple[int, Any, Any]], dict[Any, Any], weakref.ref[Any]]
# (a hook dict, its entries, a module's option dicts with their entries, the holder or None
# once gone, the dict's name, and the keys this call registered there)
_Held = tuple[dict[Any, Any], dict[Any, Any], list[tuple[dict[Any, Any], dict[Any, Any]]],
              Any, str, set[int]]


def handles_made() -> int:
    """The number of hook handles torch has made so far (NOTE above)."""
    return RemovableHandle.next_id


_PLAIN = (int, float, bool, str, bytes, type(None))


def _plain(values: Iterable[Any], /) -> tuple[Any, ...]:
    """The plain values among ``values``, in order; a tensor or module by identity (a
    parameter, or a buffer, bound by a partial is the same object in both passes: helper QC);
    other objects by kind."""
    return tuple(v if type(v) in _PLAIN else
                 (type(v), id(v)) if isinstance(v, (torch.Tensor, nn.Module)) else type(v)
                 for v in values)


def _named(items: Any, /) -> tuple[Any, ...]:
    """``_plain`` of a mapping's values, with their names, in name order."""
    return tuple((name, *_plain((value,))) for name, value in sorted(items.items()))


# The registrations the original passes made, by the id of the tensor or module holding the
# hook dict (with a weak reference to it, which drops the entry with it): each by its dict's
# name and its key, which no other registration ever has (``RemovableHandle.next_id`` only
# grows). The only hooks a replay puts back where its forward removed them: a hook the caller
# registered, which the forward removes only under grad (eager's forward does; the original
# pass, under no-grad, does not), stays removed, even where it runs the very function the
# forward registers (helpers QC, QE: kept by the hook object, an equal one counted; one that
# cannot be referenced weakly or hashed was never put back). A key is kept while its hook is in
# the dict, or while a replay that found it there (``before_replay``) has not decided on it
# (``drop_repeated``): its pin. No count bounds it (helpers QG, QH: the latest 256, then 4x a
# record, lost a hook still in use on a weight shared by layers called hundreds of times a
# step), nor the dict alone (helper QF: a key out of the dict for an instant while a nested
# block's replay ran was dropped). Under a re-entrant lock: two threads' first steps record on
# one shared parameter (helper QF: "Set changed size during iteration"), and a finalizer the
# collector runs inside the lock may run a checkpointed forward on the same thread (helper QG:
# a plain lock hung). A replay whose forward raises settles them all the same (a ``finally``).
_MADE: dict[int, _Registrations] = {}
_MADE_LOCK = threading.RLock()


class _Registrations:
    """NOTE above: one holder's recorded registrations, and the pins of pending replays."""

    __slots__ = ("ref", "keys", "pins")

    def __init__(self, ref: weakref.ref[Any], /) -> None:
        self.ref = ref
        self.keys: set[tuple[str, int]] = set()
        self.pins: dict[tuple[str, int], int] = {}


def _unwrapped(hook: Any, /) -> Any:
    while type(hook) in (ParameterHook, SkipsNoGradient):  # our wrappers, in place
        hook = hook.hook
    return hook


def _record(holder: Any, name: str, keys: Iterable[int], /) -> None:
    """``keys`` of ``holder``'s ``name`` dict were registered by an original pass."""
    ident = id(holder)

    def gone(ref: weakref.ref[Any], /) -> None:  # (no lock: the collector may run it anywhere)
        if (now := _MADE.get(ident)) is not None and now.ref is ref:
            _MADE.pop(ident, None)

    with _MADE_LOCK:
        entry = _MADE.get(ident)
        if entry is None or entry.ref() is not holder:
            entry = _MADE[ident] = _Registrations(weakref.ref(holder, gone))
        entry.keys = {e for e in entry.keys
                      if e in entry.pins or e[1] in (getattr(holder, e[0], None) or ())}
        entry.keys.update((name, key) for key in keys)


def _pin(holder: Any, name: str, keys: Iterable[int], by: int, /) -> None:
    """A replay found ``keys`` in ``holder``'s ``name`` dict (``by`` 1), or has decided on
    them (``by`` -1): NOTE above."""
    with _MADE_LOCK:
        entry = _MADE.get(id(holder))
        if entry is None or entry.ref() is not holder:
            return
        for key in keys:
            if (name, key) in entry.keys:
                count = entry.pins.get((name, key), 0) + by
                if count > 0:
                    entry.pins[name, key] = count
                else:
                    entry.pins.pop((name, key), None)


def _was_made(holder: Any, name: str, key: int, /) -> bool:
    with _MADE_LOCK:
        entry = _MADE.get(id(holder))
        return entry is not None and entry.ref() is holder and (name, key) in entry.keys


def _runs(hook: Any, /) -> tuple[Any, tuple[Any, ...]] | None:
    """What ``hook`` runs, to tell a repeat of it: its function's code (a partial's, a bound
    method's) or its class, and the plain values it is given (a partial's arguments, its
    closure and defaults, a hook object's or a bound method's instance's attributes); None
    for torch's and this library's own."""
    hook = _unwrapped(hook)
    given: tuple[Any, ...] = ()
    while isinstance(hook, functools.partial):
        given += _plain(hook.args) + _named(hook.keywords)
        hook = hook.func
    if isinstance(hook, types.MethodType):  # its instance's plain attributes, as an object's
        held = dunder(hook.__self__, "__dict__")
        given += _named(held) if isinstance(held, dict) else ()
        hook = hook.__func__
    if (dunder(hook, "__module__") or "").startswith(_NOT_USERS):
        return None
    code = dunder(hook, "__code__")
    if code is None:  # a hook object: its class and its plain attributes
        held = dunder(hook, "__dict__")
        return type(hook), given + (_named(held) if isinstance(held, dict) else ())
    cells = tuple(_cell(c) for c in dunder(hook, "__closure__") or ())
    kwdefaults = dunder(hook, "__kwdefaults__")
    return code, given + _plain(cells) + _plain(dunder(hook, "__defaults__") or ()) + (
        _named(kwdefaults) if isinstance(kwdefaults, dict) else ())


def _cell(cell: Any, /) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _registered(hooks: Any, since: int, until: int, /) -> list[tuple[int, Any, Any]]:
    """The user's hooks in ``hooks`` registered between handle numbers ``since`` and
    ``until``: each key, what it runs (``_runs``), and the hook."""
    if not hooks:
        return []
    found = [(key, _runs(hook), hook) for key, hook in tuple(hooks.items())
             if type(key) is int and since <= key < until]
    return [entry for entry in found if entry[1] is not None]


class ForwardHooks:
    """NOTE above: what the original pass registered, on the call's inputs (by slot) and on
    its parameters and modules (held: the call holds them until its replay anyway), with the
    hook dict it registered in (an input's: the caller's tensor's)."""

    __slots__ = ("found",)

    def __init__(self, found: list[_Found], /) -> None:
        self.found = found

    @staticmethod
    def found_since(since: int, inputs: Sequence[torch.Tensor],
                    params: Sequence[torch.Tensor], roots: Iterable[nn.Module], /
                    ) -> ForwardHooks | None:
        """After the original pass: the hooks it registered since handle ``since`` on
        ``inputs``, ``params`` and the modules of ``roots``' trees, or None (the usual case:
        no handle made at all, two reads)."""
        until = RemovableHandle.next_id
        if until == since:
            return None
        found: list[_Found] = []
        places = [*((slot, t, _TENSOR_DICTS) for slot, t in enumerate(inputs)),
                  *((p, p, _TENSOR_DICTS) for p in params),
                  *((m, m, _MODULE_DICTS) for root in roots for m in root.modules())]
        for where, holder, names in places:
            for name in names:
                hooks = getattr(holder, name, None)
                if registered := _registered(hooks, since, until):
                    assert hooks is not None
                    found.append((where, name, registered, hooks, weakref.ref(holder)))
                    _record(holder, name, [key for key, _, _ in registered])
        return ForwardHooks(found) if found else None

    def before_replay(self) -> list[_Held]:
        """Right before the replay's forward: the hook dicts the original pass registered in
        (and a module's options for them), for ``drop_repeated`` to put back the user's hooks
        the replay removes (NOTE above)."""
        seen: list[_Held] = []
        for where, name, registered, hooks, holder_ref in self.found:
            # This call's own registrations, and (while it lives: an input the caller dropped
            # keeps its dict on its node) the holder, for other calls' (``_was_made``).
            own = {key for key, _, _ in registered}
            same = next((entry for entry in seen if entry[0] is hooks), None)
            if same is not None:
                same[5].update(own)
                continue
            extras = [(d, dict(d)) for extra in _MODULE_EXTRAS
                      if isinstance(d := getattr(where, extra, None), dict)] \
                if isinstance(where, nn.Module) else []
            holder = holder_ref()
            held = dict(hooks)  # one call: another thread may register meanwhile (helper QI)
            if holder is not None:
                _pin(holder, name, held, 1)
            seen.append((hooks, held, extras, holder, name, own))
        return seen

    def drop_repeated(self, since: int, inputs: Sequence[torch.Tensor],
                      before: list[_Held], /) -> None:
        """After the replay's forward (``inputs``: the aliases it gave the forward, by slot;
        ``before``: what ``before_replay`` read): the user's hooks it removed, put back where
        they were; its registrations since handle ``since`` that repeat the original pass's,
        removed (those giving the same plain values first, then by code alone: a value
        that differs per pass, a call number, still finds its repeat)."""
        for hooks, held, extras, holder, name, own in before:
            back = [key for key in held if key not in hooks and (
                key in own or holder is not None and _was_made(holder, name, key))]
            if holder is not None:
                _pin(holder, name, held, -1)
            if not back:
                continue
            for key in back:
                hooks[key] = held[key]
                for extra, options in extras:  # with_kwargs, always_call
                    if key in options:
                        extra[key] = options[key]
            # In their places among the others (helper QA: hooks that do not commute, run
            # in another order than eager's), in the same dict object, which torch holds:
            # the entries from the first one out of place taken out and put in again, each
            # a step of its own (no instant with the dict empty).
            order = [key for key in held if key in hooks] + \
                [key for key in hooks if key not in held]
            now = list(hooks)
            first = next((i for i, (a, b) in enumerate(zip(order, now)) if a != b), len(order))
            for key in order[first:]:
                hooks[key] = hooks.pop(key)
        until = RemovableHandle.next_id
        if until == since:
            return
        for where, name, originals, _, _ in self.found:
            if type(where) is int:
                if where >= len(inputs):
                    continue
                on: Any = inputs[where]  # (the original pass's are on the caller's tensor)
            else:
                on = where
            registered = getattr(on, name, None)
            if not registered:
                continue
            left = [what for _, what, _ in originals]
            made = _registered(registered, since, until)
            repeats = []
            for key, what, _ in made:  # the same values first
                if what in left:
                    left.remove(what)
                    repeats.append(key)
            for key, what, _ in made:  # then by code alone
                if key not in repeats and (
                        match := next((w for w in left if w[0] == what[0]), None)) is not None:
                    left.remove(match)
                    repeats.append(key)
            for key in repeats:
                del registered[key]
                if isinstance(on, nn.Module):
                    for option in _MODULE_EXTRAS:
                        getattr(on, option, {}).pop(key, None)
