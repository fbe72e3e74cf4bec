"""A backward run inside a call's original pass that flows past its inputs, into the graph
that computed them (NOTE [a gradient inside the forward reaching the graph before the call]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .module_state import DroppedOnCopy, structure_generation

__all__ = ["InnerBackwardWatch", "discard_rebuilt", "mark_discard_rebuilt"]

# NOTE [a gradient inside the forward reaching the graph before the call]: a forward may take
# gradients itself under torch.enable_grad() (a physics-informed network's du/dx, a Lagrangian
# network's d2L/dqd2, a test-time-training step on its own weight). The original pass runs on
# the caller's tensors, so such a gradient is eager's total derivative: taken with respect to x,
# it also flows through y when the caller computed y from x (`layer(x, 2 * x)`; a semi-implicit
# rollout's q from qd; the input of a layer called twice, computed from the weight the gradient
# is taken for). The replay runs on the inputs detached, as every reentrant checkpoint does, so
# there y is a leaf of its own: its outputs are other numbers than the forward's and every
# gradient through them is wrong, silently (helper PS: a weight's gradient 11.2 off; an LNN
# rollout's 2%). Such a gradient runs the node that made an input (its grad_fn) inside the
# forward; one that stops at the inputs never does (autograd captures a gradient taken for an
# input at its node without running it). So a pre-hook on each input's node, held for the
# original pass only, finds it, and the call is refused at once, naming the input. A gradient
# that runs such a node only to feed something the outputs never use would give the forward's
# outputs anyway; it is refused too (nothing tells it apart before backward). Cost: watching
# every call measured about 200,000 instructions more a layer call at
# examples.bench_instructions' small size (1.104x torch's reentrant checkpoint instead of
# 1.072x): a node once hooked keeps calling into Python when backward runs it, its hook gone
# (torch keeps the emptied hook dict). So a module's calls are watched until its first replay
# (the calls of the first step: a rollout, a layer called twice), an output discard's module's
# until its first rebuild (``mark_discard_rebuilt``: a second call in the step of its first may
# relate its inputs, helpers QA, QB), a plain function's at every call; a module whose inputs
# become related only in later steps is not refused (docs/limits.md). Another thread's backward
# running an input's node meanwhile (one graph shared by threads at once) is taken for one
# inside this forward.


class InnerBackwardWatch:
    """NOTE above: pre-hooks on the nodes that made ``tensors`` (the call's inputs and the
    attributes saved with them), from construction to ``stop``."""

    __slots__ = ("handles", "reached")

    def __init__(self, tensors: Sequence[torch.Tensor], /) -> None:
        self.reached: list[int] = []
        self.handles: list[Any] = []
        for slot, t in enumerate(tensors):  # NOTE [loops on the per-call path] (boundary.py)
            node = t.grad_fn
            if node is not None:
                self.handles.append(node.register_prehook(
                    functools.partial(_reached, self.reached, slot)))

    def stop(self) -> None:
        """Take the hooks off (before any error of the pass propagates)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def refuse(self, where: str, path: Callable[[int], str], /, *, inputs: int) -> None:
        """After the pass: refuse if a backward inside it ran an input's node. ``path(slot)``
        names the input (``its input args[1]``); ``where`` the call; slots from ``inputs`` on
        are attributes a forward pre-hook set (NOTE [attributes set before the call] in
        boundary.py)."""
        if not self.reached:
            return
        names = list(dict.fromkeys(path(slot) for slot in self.reached))
        attribute = any(slot >= inputs for slot in self.reached)
        which = names[0] if len(names) == 1 else " and ".join(names)
        raise CheckpointError(
            f"{where} took a gradient inside its forward (torch.autograd.grad or backward() "
            f"under torch.enable_grad()) that flowed past {which} into the graph "
            "that computed it: the replay in backward runs on the inputs detached, so the "
            "part of that gradient through what the input was computed from (another input, "
            "a parameter) would be missing, and the replay's outputs and every gradient "
            "through them would not be eager's",
            expected="a gradient inside the forward that stops at the call's inputs",
            got=f"{which} reached by it (the node that computed it ran inside the forward)",
            tip=("compute it inside the call: for the weight the old "
                 "torch.nn.utils.weight_norm or spectral_norm sets, use "
                 "torch.nn.utils.parametrizations' weight_norm (spectral_norm), whose weight "
                 "is computed in the forward; " if attribute else
                 "compute the related tensors inside the call, in its torch.enable_grad() "
                 "block (layer(x) computing y = 2 * x there, not layer(x, 2 * x)); ") +
                "or leave this layer unwrapped (passing .detach() of the input would change "
                "the model: no gradient would flow through it)")


def _reached(reached: list[int], slot: int, grad_outputs: Any, /) -> None:
    reached.append(slot)


_REBUILT = "_pytree_ckpt_discard_rebuilt"


class _Rebuilt(DroppedOnCopy):
    """The mark, for the tree's generation then: a copy carries none, and is watched as a
    fresh module is (helper QC: a deepcopied rebuilt module was never refused)."""

    __slots__ = ("generation",)

    def __init__(self, generation: int, /) -> None:
        self.generation = generation


def discard_rebuilt(roots: Sequence[nn.Module], /) -> bool:
    """Whether an output discard of ``roots`` was rebuilt, for their trees as they are (NOTE
    above: its calls are watched until then)."""
    generation = structure_generation()
    return all(isinstance(mark := root.__dict__.get(_REBUILT), _Rebuilt) and
               mark.generation == generation for root in roots)


def mark_discard_rebuilt(roots: Sequence[nn.Module], /) -> None:
    mark = _Rebuilt(structure_generation())
    for root in roots:
        root.__dict__[_REBUILT] = mark
