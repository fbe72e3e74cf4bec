"""Parameter gradient hooks around a replay's gradient call (NOTE [parameter hooks run once],
NOTE [unused parameters get no hook call]); the boundary's replay and output discard's rebuild
both take their parameters' gradients with ``torch.autograd.grad``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ParameterHooksPaused", "SkipsNoGradient"]


class ParameterHooksPaused:
    """NOTE [parameter hooks run once]: ``torch.autograd.grad`` runs a leaf's tensor hooks
    (``param.register_hook``) on the gradient it captures, and autograd runs them again when
    the returned gradient reaches the parameter in the outer backward: a hook that scales or
    masks would apply twice. Paused for the replay's ``grad``, they run once, where eager runs
    them. Each hook in the dict is swapped for a no-op and put back after, in place: autograd's
    hook object reads the dict at call time, and a handle removed meanwhile (a one-shot hook
    inside the replay's backward) still finds its key, so it stays removed; a hook registered
    meanwhile stays too. (A plain class: entered once per layer call.)

    NOTE [unused parameters get no hook call]: a parameter the forward did not use (an MoE
    expert that got no token, a bias a layer skips) gets ``None`` from the replay, and autograd
    runs a leaf's hooks even for a ``None`` gradient a Function returns: ``lambda g: g * 2``
    raised ``TypeError`` in backward, where eager never calls it. Each hook is put back
    wrapped, so that a ``None`` gradient skips it (a defined one calls it as it is).
    """

    __slots__ = ("stash",)

    def __init__(self, params: Sequence[torch.Tensor], /) -> None:
        # Not hooks an enclosing pause holds (a nested boundary's replay runs inside the outer
        # one's grad): that pause puts them back.
        self.stash = [(hooks, paused) for p in params if (hooks := p._backward_hooks)
                      if (paused := {key: hook for key, hook in hooks.items()
                                     if hook is not _no_hook})]

    def __enter__(self) -> None:
        for hooks, paused in self.stash:
            for key in paused:
                hooks[key] = _no_hook

    def __exit__(self, *exc: object) -> None:
        for hooks, paused in self.stash:
            for key, hook in paused.items():
                if hooks.get(key) is _no_hook:  # not removed (or replaced) meanwhile
                    hooks[key] = hook if isinstance(hook, SkipsNoGradient) \
                        else SkipsNoGradient(hook)


def _no_hook(grad: torch.Tensor) -> None:
    return None  # leaves the gradient as it is


class SkipsNoGradient:
    """A parameter's gradient hook that is not called without a gradient (NOTE [unused
    parameters get no hook call])."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], Any], /) -> None:
        self.hook = hook

    def __call__(self, grad: torch.Tensor | None) -> Any:
        return None if grad is None else self.hook(grad)

    def __repr__(self) -> str:
        return f"SkipsNoGradient({self.hook!r})"
