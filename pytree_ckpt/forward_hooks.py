"""Hooks a forward registers on what exists outside its call: its parameters, its inputs, its
modules (NOTE [hooks the forward registers on its parameters and inputs])."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .parameter_hooks import ParameterHook, SkipsNoGradient
from .tree import dunder

__all__ = ["ForwardHooks", "handles_made"]

# NOTE [hooks the forward registers on its parameters and inputs]: a forward may register a
# gradient hook on its own parameter (an OGD-style projection registered once behind a flag,
# or at every call with the handle kept for removal after the step; a post-accumulate hook),
# on its input (a gradient reversal, `h.register_hook(lambda g: -0.5 * g)`), or a module hook
# on a submodule (`register_full_backward_hook` behind a flag). Eager registers it once. The
# original pass registers it too, on the same parameter, module and caller's tensor: there
# it runs as eager's. The replay (and an output discard's rebuild) runs the forward again,
# with the flags as the forward began, and registered each a second time (on the parameter
# or module; on its input's alias, whose gradient then reached the caller's tensor through
# the boundary's node and its hook again): a projection applied twice, a reversal undone
# (helper PU: gradients 0.5x eager's, -0.5x upstream; helper PW: a module hook), and a
# handle the replay's code kept in a list the replay's end rolls back, so one hook leaked a
# step (0.5x, 0.25x, 0.125x). Every hook handle torch makes takes the next number of one
# counter (``RemovableHandle.next_id``), also its key in the hook dict: two reads of it
# around the original pass tell, at no other cost, whether anything was registered, and the
# keys in between which hooks the pass registered where. Each is kept by its key and what
# it runs (its function's code: a lambda made anew at each call has one), and right after
# the replay's forward, the replay's registrations there that run the same code are removed,
# one for each of the original pass's: those run once, where the original pass put them. One
# the replay's forward removed itself (a forward replacing its previous call's hook through
# the handle it kept: the replay reads the handle the original pass stored, helper PX) is put
# back under its own key, which that handle, kept on the module as the forward left it,
# removes at the next call. A hook the original pass did
# not make (registered only `if torch.is_grad_enabled()`) is the replay's alone, and stays
# (after the original pass's in the dict: where hooks that do not commute are mixed so, they
# run in another order than eager's, docs/limits.md). Hooks torch's own tools and this library register (FSDP, module
# trackers, the boundary's own recorders) are theirs to manage, and never touched. Not
# covered (docs/limits.md): a hook on an input's node (`x.grad_fn.register_prehook`), whose
# dict Python cannot read; and the original pass's hook still on a parameter while the
# replay's forward runs, seen by a gradient the forward takes of that parameter itself.

_TENSOR_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_MODULE_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# Where nn.Module keeps a hook's options, by the same key (RemovableHandle's extra dicts).
_MODULE_EXTRAS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called")
_NOT_USERS = ("torch.", "pytree_ckpt.", "offload.")

# (where: a slot of the call's inputs, or the parameter or module itself; the dict's name;
# each registration there: its key, what it runs and the hook)
_Found = tuple[Any, str, list[tuple[int, Any, Any]]]


def handles_made() -> int:
    """The number of hook handles torch has made so far (NOTE above)."""
    return RemovableHandle.next_id


def _runs(hook: Any, /) -> Any:
    """What ``hook`` runs, to tell a repeat of it: its function's code (a partial's, a bound
    method's), or its class; None for torch's and this library's own."""
    while type(hook) in (ParameterHook, SkipsNoGradient):  # our wrappers, in place
        hook = hook.hook
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    if (dunder(hook, "__module__") or "").startswith(_NOT_USERS):
        return None
    code = dunder(hook, "__code__")
    return code if code is not None else type(hook)


def _registered(hooks: Any, since: int, until: int, /) -> list[tuple[int, Any, Any]]:
    """The user's hooks in ``hooks`` registered between handle numbers ``since`` and
    ``until``: each key, what it runs, and the hook."""
    if not hooks:
        return []
    found = [(key, _runs(hook), hook) for key, hook in tuple(hooks.items())
             if type(key) is int and since <= key < until]
    return [entry for entry in found if entry[1] is not None]


class ForwardHooks:
    """NOTE above: what the original pass registered, on the call's inputs (by slot) and on
    its parameters and modules (held: the call holds them until its replay anyway)."""

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
                if registered := _registered(getattr(holder, name, None), since, until):
                    found.append((where, name, registered))
        return ForwardHooks(found) if found else None

    def drop_repeated(self, since: int, inputs: Sequence[torch.Tensor], /) -> None:
        """After the replay's forward (``inputs``: the aliases it gave the forward, by slot):
        its registrations since handle ``since`` that repeat the original pass's, removed."""
        until = RemovableHandle.next_id
        if until == since:
            return
        for where, name, originals in self.found:
            if type(where) is int:
                if where >= len(inputs):
                    continue
                holder: Any = inputs[where]
                # The original pass's are on the caller's tensor, not this alias: each repeats.
                left = [(what, None) for _, what, _ in originals]
            else:
                holder = where
                held = getattr(holder, name, None) or {}
                # (what it runs, and the original to put back where the replay removed it)
                left = [(what, None if key in held else (key, hook))
                        for key, what, hook in originals]
            hooks = getattr(holder, name, None)
            for key, what, _ in _registered(hooks, since, until):
                match = next((entry for entry in left if entry[0] == what), None)
                if match is None:
                    continue
                left.remove(match)
                del hooks[key]
                extras = [getattr(holder, extra, {}) for extra in _MODULE_EXTRAS] \
                    if isinstance(holder, nn.Module) else []
                if match[1] is not None:
                    original, hook = match[1]
                    hooks[original] = hook
                    for extra in extras:
                        if key in extra:
                            extra[original] = extra[key]
                for extra in extras:
                    extra.pop(key, None)
