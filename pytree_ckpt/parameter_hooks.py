"""Gradient hooks of a replay's parameters and inputs, around its gradient call (NOTE
[parameter hooks run once], NOTE [unused parameters get no hook call], NOTE [inputs without a
gradient]); the boundary's replay and output discard's rebuild both take their parameters'
gradients with ``torch.autograd.grad``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.autograd.graph import Node

from .tree import alias, dunder

__all__ = ["ParameterHook", "ParameterHooksPaused", "SkipsNoGradAccumulated",
           "SkipsNoGradient", "accumulated_nothing", "put_first", "skip_no_gradient"]


class ParameterHooksPaused:
    """NOTE [parameter hooks run once]: ``torch.autograd.grad`` runs a leaf's tensor hooks
    (``param.register_hook``) on the gradient it captures, and autograd runs them again when
    the returned gradient reaches the parameter in the outer backward: a hook that scales or
    masks would apply twice. Paused for the replay's gradient call, they run once, where eager
    runs them.

    Paused for that call only, not for the parameter: other threads may run a backward through
    the same parameters meanwhile (two threads training one model, DataParallel-style thread
    parallelism, a backward on another device thread), and theirs must run the hooks (swapped
    for no-ops in the shared dict and put back after, they ran in neither the other thread's
    plain backward, nor its replay that started while ours held them, and ran twice in a
    replay still running after ours put them back: tests/pytree_ckpt/test_hooks_threads.py).
    So each hook is wrapped once, in place (``ParameterHook``), and the wrapper skips it while
    the graph task running it (``torch._C._current_graph_task_id()``, the same on whichever
    thread autograd runs a node of that task) is a replay's gradient call: a prehook on the
    grad_fn of each output of the replay records that task before any leaf is reached (a
    leaf output gets a view, with a node to hook). A handle removed meanwhile (a one-shot hook
    inside the replay's backward) removes the wrapper; a hook registered meanwhile is wrapped
    at the next call (registered inside the replay's call, it runs there too: docs/limits.md,
    "Gradient hooks and DDP"). (A plain class: entered once per layer call; nothing to do, not even
    the prehooks, when no parameter has a hook.) The prehooks are removed when the call is
    over: each output holds its node, the node its prehook (a bound method of the pause),
    and the pause its outputs, a cycle through autograd's C++ nodes that Python's collector
    cannot see (left in place, every replay's outputs stayed alive for good); and a node of
    a graph kept past the call can mark no later task.

    NOTE [unused parameters get no hook call]: a parameter the forward did not use (an MoE
    expert that got no token, a bias a layer skips) gets ``None`` from the replay, and autograd
    runs a leaf's hooks even for a ``None`` gradient a Function returns: ``lambda g: g * 2``
    raised ``TypeError`` in backward, where eager never calls it. The wrapper skips a
    ``None`` gradient (a defined one calls the hook as it is; torch's own hooks, which count
    their ``None`` calls, get every call). Its post-accumulate-grad hooks
    (``register_post_accumulate_grad_hook``: an optimizer step in backward) run too, after an
    accumulation of nothing: ``accumulated_nothing`` wraps them to skip while its ``.grad`` is
    ``None``. (One whose ``.grad`` is already set, by an earlier micro-batch or
    ``zero_grad(set_to_none=False)``, cannot be told apart: its hook runs again, where eager's
    does not.)
    """

    __slots__ = ("outputs", "hooked", "tasks", "marks", "shared")

    def __init__(self, params: Sequence[torch.Tensor], /,
                 outputs: Sequence[torch.Tensor] = (), *, shared: bool = False) -> None:
        hooked = False
        for p in params:
            hooks = p._backward_hooks
            if hooks:
                hooked = True
                _wrap_parameter_hooks(hooks)
        self.outputs, self.hooked = outputs, hooked
        # Outputs of a graph other gradient calls may run at once (a kept replay: NOTE [a
        # replay kept between restricted backwards] in kept_replay.py): their nodes' prehooks
        # would mark those calls' tasks too, and this pause's exit unmark them while they run.
        # Each output gets a view, a node of this call's own.
        self.shared = shared
        self.tasks: list[int] = []
        self.marks: list[Any] = []  # the prehooks' handles

    def __enter__(self) -> Sequence[torch.Tensor]:
        """The outputs to take the gradient of (a leaf one as a view of itself)."""
        if not self.hooked:
            return self.outputs
        with torch.enable_grad():  # (backward runs without)
            outputs = [out if out.grad_fn is not None and not self.shared else alias(out)
                       for out in self.outputs]  # NOTE [tensors of other layouts] (tree.py)
        # (Each has a node: it requires grad, or is a view of a leaf output that does.)
        self.marks = [cast(Node, out.grad_fn).register_prehook(self._mark) for out in outputs]
        return outputs

    def _mark(self, grads: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self.tasks:
            self.tasks.append(task)
            _REPLAYS.add(task)

    def __exit__(self, *exc: object) -> None:
        for mark in self.marks:  # the cycle through the outputs' nodes, broken
            mark.remove()
        self.marks.clear()
        for task in self.tasks:
            _REPLAYS.discard(task)
        self.tasks.clear()


# The graph tasks of the replays' gradient calls running now (any thread), in which parameter
# hooks are skipped (NOTE [parameter hooks run once]). A set's add and discard are atomic.
_REPLAYS: set[int] = set()


def _wrap_parameter_hooks(hooks: dict[Any, Any], /) -> None:
    """Each hook of a parameter's ``hooks`` not yet wrapped, wrapped in place (the same key,
    which torch's handle holds). Read whole first (one C call: another thread may register a
    hook meanwhile); a hook removed since is not brought back but in the instant between the
    check and the write, once per hook, where another thread removes it there."""
    for key, hook in list(hooks.items()):
        if type(hook) is not ParameterHook and hooks.get(key) is hook:
            own = _torch_own(hook)
            if isinstance(hook, SkipsNoGradient):  # an input's hook earlier (skip_no_gradient)
                hook = hook.hook
            hooks[key] = ParameterHook(hook, not own)


def _torch_own(hook: Any) -> bool:
    """A hook torch itself registered, which expects its ``None`` calls (a multi-grad hook in
    "all" mode counts them: wrapped, it would never fire)."""
    return (dunder(hook, "__module__") or "").startswith("torch.")


class ParameterHook:
    """A parameter's gradient hook, not called inside a replay's gradient call (NOTE
    [parameter hooks run once]), nor, unless it is torch's own, without a gradient (NOTE
    [unused parameters get no hook call])."""

    __slots__ = ("hook", "skips_none")

    def __init__(self, hook: Callable[[torch.Tensor | None], Any], skips_none: bool, /
                 ) -> None:
        self.hook = hook  # (torch's own get None too)
        self.skips_none = skips_none

    def __call__(self, grad: torch.Tensor | None, /) -> Any:
        if (grad is None and self.skips_none) or \
                (_REPLAYS and torch._C._current_graph_task_id() in _REPLAYS):
            return None  # leaves the gradient as it is
        return self.hook(grad)

    def __repr__(self) -> str:
        return f"ParameterHook({self.hook!r})"


class SkipsNoGradient:
    """A parameter's gradient hook that is not called without a gradient (NOTE [unused
    parameters get no hook call])."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], Any], /) -> None:
        self.hook = hook

    def __call__(self, grad: torch.Tensor | None, /) -> Any:
        return None if grad is None else self.hook(grad)

    def __repr__(self) -> str:
        return f"SkipsNoGradient({self.hook!r})"


class _Gate:
    """The first post-accumulate-grad hook of a tensor whose hooks are wrapped: it notes,
    before any of them runs, whether this accumulation left ``.grad`` set (NOTE [unused
    parameters get no hook call]). A hook that clears ``.grad`` (an optimizer step in
    backward, then ``zero_grad()``) must not stop the hooks after it, and a user hook removed
    meanwhile must not take the decision with it."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = True

    def __call__(self, tensor: torch.Tensor) -> None:
        self.open = tensor.grad is not None


_GATE = "pytree_ckpt_gate"  # its key (torch's handles use int keys)


class SkipsNoGradAccumulated:
    """A post-accumulate-grad hook that is not called after an accumulation of nothing, as
    its tensor's ``_Gate`` found it (NOTE [unused parameters get no hook call])."""

    __slots__ = ("hook", "gate")

    def __init__(self, hook: Callable[[torch.Tensor], Any], gate: _Gate, /) -> None:
        self.hook = hook
        self.gate = gate

    def __call__(self, tensor: torch.Tensor, /) -> Any:
        return self.hook(tensor) if self.gate.open else None

    def __repr__(self) -> str:
        return f"SkipsNoGradAccumulated({self.hook!r})"


def _skip_no_grad_accumulated(hooks: dict[Any, Any], /) -> None:
    gate = hooks.get(_GATE)
    if gate is None:
        gate = _Gate()
        put_first(hooks, _GATE, gate)
    for key, hook in list(hooks.items()):
        if key != _GATE and not isinstance(hook, SkipsNoGradAccumulated) and \
                not _torch_own(hook):
            hooks[key] = SkipsNoGradAccumulated(hook, gate)


def put_first(hooks: dict[Any, Any], key: Any, hook: Any, /) -> None:
    """Make ``hook`` the first of ``hooks`` (a hooks dict of torch's), under ``key``.

    NOTE [hooks put first in place]: torch walks a tensor's hooks, and dynamo's guards (before
    torch 2.13) read a module's, in the dict's C-level insertion order, which
    ``OrderedDict.move_to_end`` (``prepend=True``) does not change. So every other key is
    moved behind ``key`` (taken out and put back), in place: the same object, which torch's
    hook handles hold. Other threads may use the dict meanwhile (DataParallel's replicas share
    their modules' hook dicts; two backwards can accumulate into one parameter), so it is
    never emptied, and all the moves are one C call (``update`` over an iterator that takes
    each key out just before it is put back): under the GIL no other thread runs inside it,
    so none sees a hook missing, and a hook another thread registers or removes stays
    registered or removed. Emptied and refilled, the dict made a forward there run none of
    the user's hooks, lost a hook registered there, brought back one removed there, and raised
    "OrderedDict mutated during iteration" at a registration while its keys were read
    (tests/pytree_ckpt/test_put_first.py). Limits: Python 3.10 and 3.11 can run a garbage
    collection, and so finalizers, inside that call, and a free-threaded build has no GIL:
    there a hook can be missing for the moment of its own move (never lost).
    """
    while True:
        others = list(hooks)  # one C call, as the moves are: no other thread runs meanwhile
        if key in others:
            others.remove(key)
        # A key removed (its handle's ``remove()``) since it was read gets a placeholder that
        # does nothing, taken out again below: ``pop`` never fails, nor brings the hook back.
        hooks.update(itertools.chain(((key, hook),), zip(
            others, map(hooks.pop, others, itertools.repeat(_removed_meanwhile)))))
        for gone in [k for k, value in list(hooks.items()) if value is _removed_meanwhile]:
            hooks.pop(gone, None)
        # A key registered between the read and the moves lands before a new ``key``: again.
        # (Each order read whole, in one call: an iterator kept across bytecodes would raise
        # if another thread changed the dict in between.)
        order, c_order = list(hooks), list(dict.keys(hooks))
        if key not in order or (order[0] == key and c_order[0] == key):
            return


def _removed_meanwhile(*args: Any, **kwargs: Any) -> None:
    """Put back by ``put_first`` for a hook removed after its keys were read, and taken out
    again at once: a hook called meanwhile changes nothing."""
    return None


def accumulated_nothing(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                        needs: Sequence[bool], /) -> None:
    """Wrap the post-accumulate-grad hooks of the parameters a replay gives ``None`` though
    autograd has an edge to them (NOTE [unused parameters get no hook call])."""
    for param, grad, need in zip(params, grads, needs):
        if grad is None and need and param._post_accumulate_grad_hooks:
            _skip_no_grad_accumulated(param._post_accumulate_grad_hooks)


def skip_no_gradient(tensor: torch.Tensor, /) -> None:
    """NOTE [inputs without a gradient]: an input that requires grad is an input of the
    boundary's node, so autograd calls its hooks with the gradient the replay returns for it,
    ``None`` where the layer used it only through non-differentiable ops (``enc > 0``), where
    eager, with no edge to it, never calls them: ``lambda g: g * 2`` raised ``TypeError`` in
    backward. Each of its hooks is wrapped as a parameter's is (NOTE [unused parameters get no
    hook call]), in place, when the call saves it; so are its post-accumulate-grad hooks.
    """
    hooks = tensor._backward_hooks
    if hooks:
        for key, hook in list(hooks.items()):  # read whole: NOTE [parameter hooks run once]
            if not (isinstance(hook, (SkipsNoGradient, ParameterHook)) or _torch_own(hook)) \
                    and hooks.get(key) is hook:
                hooks[key] = SkipsNoGradient(hook)
    if tensor._post_accumulate_grad_hooks:
        _skip_no_grad_accumulated(tensor._post_accumulate_grad_hooks)
