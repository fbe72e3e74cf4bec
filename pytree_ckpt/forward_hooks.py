"""Gradient hooks a forward registers on tensors from outside the call: its parameters, its
inputs (NOTE [hooks the forward registers on its parameters and inputs])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardHooks", "handles_made"]

# NOTE [hooks the forward registers on its parameters and inputs]: a forward may register a
# gradient hook on its own parameter (an OGD-style projection registered once behind a flag,
# or at every call with the handle kept for removal after the step; a post-accumulate hook)
# or on its input (a gradient reversal, `h.register_hook(lambda g: -0.5 * g)`). Eager
# registers it once. The original pass registers it too, on the same parameter and on the
# caller's tensor: there it runs as eager's. The replay runs the forward again, with the
# flags as the forward began, and registered each a second time (on the parameter; on its
# input's alias, whose gradient then reached the caller's tensor through the boundary's node
# and its hook again): a projection applied twice, a reversal undone (helper PU: gradients
# 0.5x eager's, -0.5x upstream), and a handle the replay's code kept in a list the replay's
# end rolls back, so one hook leaked per step (0.5x, 0.25x, 0.125x). Every hook handle torch
# makes takes the next number of one counter (``RemovableHandle.next_id``), also its key in
# the tensor's hook dict: two reads of it around the original pass tell, at no other cost,
# whether anything was registered, and the keys in between which hooks the pass registered
# on which tensor. The replay removes, right after its forward, as many of its own
# registrations on each such tensor as the original pass made there: those run once, where
# the original pass put them. A hook the original pass did not make (registered only `if
# torch.is_grad_enabled()`) is left to the replay, as before. A hook registered on a tensor
# the forward makes is the replay's own and stays (the original pass, under no-grad, cannot
# register one unless the tensor requires grad).


def handles_made() -> int:
    """The number of hook handles torch has made so far (NOTE above)."""
    return RemovableHandle.next_id


def _dicts(t: torch.Tensor, /) -> tuple[Any, Any]:
    return t._backward_hooks, t._post_accumulate_grad_hooks if t.grad_fn is None else None


def _keys_between(hooks: Any, since: int, until: int, /) -> list[int]:
    return [key for key in hooks if since <= key < until] if hooks else []


class ForwardHooks:
    """NOTE above: by slot of the tensors (the call's saved inputs, then its parameters) and
    kind (0: gradient hooks, 1: post-accumulate hooks), how many the original pass
    registered."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[tuple[int, int], int], /) -> None:
        self.counts = counts

    @staticmethod
    def found(tensors: Sequence[torch.Tensor], since: int, /) -> ForwardHooks | None:
        """After the original pass: the hooks it registered on ``tensors`` since handle
        ``since``, or None (the usual case: no handle made at all)."""
        until = RemovableHandle.next_id
        if until == since:
            return None
        counts = {}
        for slot, t in enumerate(tensors):
            for kind, hooks in enumerate(_dicts(t)):
                if n := len(_keys_between(hooks, since, until)):
                    counts[slot, kind] = n
        return ForwardHooks(counts) if counts else None

    def drop_repeated(self, tensors: Sequence[torch.Tensor], since: int, /) -> None:
        """After the replay's forward: its registrations on ``tensors`` (the replay's aliases
        of the saved inputs, then the parameters) since handle ``since``, as many per tensor
        and kind as the original pass made, removed (the earliest first)."""
        until = RemovableHandle.next_id
        if until == since:
            return
        for (slot, kind), n in self.counts.items():
            if slot < len(tensors):
                hooks = _dicts(tensors[slot])[kind]
                for key in _keys_between(hooks, since, until)[:n]:
                    del hooks[key]
