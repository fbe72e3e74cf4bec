"""A weight pass that computes only the parameters' gradients from a kept replay's graph, from
the gradients its input pass left at the nodes that feed the parameters, as eager's weight pass
does. ``recompute.py`` captures (``WeightCapture.of``, around the input pass's gradient call)
and reads (``WeightCapture.weights``, in a later run of the node).

NOTE [a weight pass from captured gradients]: torch's zero-bubble schedules split a stage's
backward (NOTE [a replay kept between restricted backwards] in kept_replay.py). In the input
pass, torch.distributed.pipelining's ``stage_backward_input`` puts prehooks on the graph's
*intermediates* (the nodes on the paths to the stage input that a parameter's own subgraph
first meets, going up from its accumulator) and keeps the gradients they receive; its
``stage_backward_weight`` then runs, per group of parameters sharing intermediates,
``torch.autograd.grad`` from those nodes (``GradientEdge`` outputs) with the kept gradients:
each intermediate computes only its parameters' share (a linear's dW product, not its dX).
The boundary's node is one such intermediate, so its weight pass is handed back the very
tensors it was handed in the input pass. A kept graph read from its outputs instead ran the
whole input-gradient path inside the block again (for lin1 -> norm -> gelu -> lin2, the product
through lin2 that lin1's dW needs). So the input pass that keeps the replay's graph does inside
it what torch does outside: prehooks on the replay graph's intermediates (found from the
wanted inputs' and the remaining parameters' nodes) keep the gradients they receive, and a
later run that is handed the same gradient tensors (identity and version, checked per place)
and asks parameters only takes each group's gradients from its intermediate, one gradient call
a group (one call for all would run the path from one intermediate down to another, and count
its gradient twice there).

The same tensors also reach the node in a plain second gradient call that is handed the
output gradient the input pass was (``torch.autograd.grad(out, params, g)``, through a
residual add): nothing here tells it from torch's weight pass, so it too takes the fast path,
and the hooks and Python Functions inside the replay between its outputs and the
intermediates run once, as under torch's weight pass, where eager's plain second call runs
them again (docs/limits.md, Gradient hooks and DDP; gradients are equal).

Everything else reads the kept graph from its outputs as before (kept_replay.py): other
gradients (``torch.autograd.grad(loss, params)`` after the input pass: equal, but not the same
tensors), an input asked again, a parameter whose subgraph meets the input paths at more than
one node (a weight tied twice in the block: each consumer's gradient would have to be clamped
by a prehook on nodes other threads may be running, as torch's weight pass clamps them), a
parameter with a gradient hook (``register_hook``: autograd runs it on the captured gradient,
and pausing it marks the call's task by a prehook on a node of the call's own, which a
``GradientEdge`` root has not), a replay whose output is a leaf, and an asked input of a layout
with no view (sparse: its accumulator is reached through a view, as torch does). A parameter
whose accumulator the replay's graph never reaches gets ``None``, as in eager. The captured
gradients are held by the ``KeptReplay`` and go with it (as torch's captures go with its weight
pass); an input pass whose later passes are of the other kind (``torch.autograd.grad(loss, [x],
retain_graph=True)``, then ``loss.backward()``) holds them to no use until then: a layer's
gradients at its few parameter-feeding nodes, on top of the kept graph. Finding the
intermediates walks the replay's graph once, in Python, in each input pass that keeps it. The
prehooks are removed when the input pass's gradient call returns (or raises), so the kept
graph's nodes carry none: other threads' gradient calls through it see nothing, and the fast
path itself registers nothing.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from .engine import input_grads

__all__ = ["WeightCapture"]


# Layouts whose leaves have a view to reach their accumulator through (``_node``); a sparse
# input's gradient is read from the kept graph's outputs (NOTE [a weight pass from captured
# gradients]).
_VIEWED = (torch.strided, torch.jagged)


def _node(tensor: torch.Tensor) -> Node:
    """The node a gradient of ``tensor`` reaches: its grad_fn, or a leaf's accumulator (made
    through a view, as torch's ``_get_grad_fn_or_grad_acc``; backward runs without grad)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    with torch.enable_grad():
        view = tensor.view_as(tensor)
    assert view.grad_fn is not None
    node = view.grad_fn.next_functions[0][0]
    assert node is not None
    return node


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Each node reachable from ``roots``, with the nodes that hand it a gradient."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    queue = deque(consumers)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _above(starts: Iterable[Node], consumers: dict[Node, list[Node]],
           stop: set[Node] | frozenset[Node] = frozenset()) -> tuple[set[Node], set[Any]]:
    """The nodes above ``starts`` (towards the roots), not going past ``stop``: those found,
    and those of ``stop`` met (``None`` for a root reached outside ``stop``)."""
    found = set(starts)
    met: set[Any] = set()
    queue = deque(found)
    while queue:
        parents = consumers[queue.popleft()]
        if not parents:  # a root: a gradient the outputs hand it, not through ``stop``
            met.add(None)
        for parent in parents:
            if parent in stop:
                met.add(parent)
            elif parent not in found:
                found.add(parent)
                queue.append(parent)
    return found, met


class WeightCapture:
    """NOTE [a weight pass from captured gradients]: the groups of a kept replay's parameters,
    each with the intermediate that feeds it and the gradients that node received."""

    __slots__ = ("groups", "unreached", "handed", "handles")

    def __init__(self, groups: dict[Node, list[int]], unreached: set[int]) -> None:
        # intermediate -> [its parameters' places in wrt, then (set later) its gradients]
        self.groups: dict[Node, list[Any]] = {node: [places, None]
                                              for node, places in groups.items()}
        self.unreached = unreached  # places in wrt no gradient of the replay's reaches
        # What the node was handed in the input pass, by place: (weak reference, version).
        self.handed: tuple[tuple[Any, int] | None, ...] = ()
        self.handles: list[Any] = []

    @classmethod
    def of(cls, outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor],
           edges: Sequence[tuple[Node | None, int]], wanted: Sequence[int],
           later: Sequence[int]) -> WeightCapture | None:
        """Prehooks on the intermediates of ``outs``'s graph between the inputs of ``wrt`` at
        ``wanted`` (taken now) and the parameters at ``later`` (for a later run); ``None`` when
        none can be captured. ``edges``: the boundary node's, one for each of ``wrt``; a
        parameter's is its accumulator (or grad_fn), which the replay's graph reaches too."""
        if not later or any(out.grad_fn is None for out in outs) or \
                any(wrt[i].layout not in _VIEWED for i in wanted):
            return None  # an input of no view (sparse): its node is not found, nor its paths
        consumers = _consumers([out.grad_fn for out in outs])  # type: ignore[misc]
        inputs = [_node(wrt[i]) for i in wanted]
        paths, _ = _above([node for node in inputs if node in consumers], consumers)
        groups: dict[Node, list[int]] = {}
        unreached = set()
        for i in later:
            node = edges[i][0]
            if node is None or node not in consumers:
                unreached.add(i)
                continue
            if node in paths:  # a parameter that is also on an input's path: read from outs
                continue
            _, met = _above([node], consumers, paths)
            # One intermediate, no root reached past them: else read from the outputs (NOTE
            # [a weight pass from captured gradients])
            if len(met) == 1 and None not in met:
                groups.setdefault(next(iter(met)), []).append(i)
        if not groups:
            return None
        capture = cls(groups, unreached)
        for node, group in capture.groups.items():
            capture.handles.append(node.register_prehook(_Keep(group)))
        return capture

    def done(self, grad_outputs: Sequence[torch.Tensor | None]) -> WeightCapture | None:
        """The prehooks removed after the input pass's gradient call; ``self`` if every group
        got its gradients, with what the node was handed."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if any(group[1] is None for group in self.groups.values()):
            return None
        self.handed = tuple(None if g is None else (weakref.ref(g), g._version)
                            for g in grad_outputs)
        return self

    def covers(self, grad_outputs: Sequence[torch.Tensor | None], wanted: Sequence[int],
               wrt: Sequence[torch.Tensor]) -> bool:
        """Whether this run (``grad_outputs``, asking ``wanted``) is the weight pass the
        capture serves: the same gradient tensors, unchanged; parameters only, each captured
        or unreached (places ``of`` took from ``later``: parameters' only, so an asked input
        is never among them), none with a gradient hook. (As many gradients as handed: both
        are one node's, the boundary's that kept this graph.)"""
        for grad, handed in zip(grad_outputs, self.handed):
            if handed is None:
                if grad is not None:
                    return False
            elif grad is None or handed[0]() is not grad or grad._version != handed[1]:
                return False
        places = {i for group in self.groups.values() for i in group[0]} | self.unreached
        return all(i in places and not wrt[i]._backward_hooks
                   for i in wanted)

    def weights(self, wrt: Sequence[torch.Tensor], wanted: Sequence[int], retain: bool
                ) -> list[torch.Tensor | None]:
        """The gradients of ``wrt`` at ``wanted``, each group's from its intermediate."""
        asked = set(wanted)
        got: dict[int, torch.Tensor | None] = {}
        for node, (places, grads) in self.groups.items():
            places = [i for i in places if i in asked]
            if not places:
                continue
            edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
            if edges:
                # NOTE [the replay calls the engine directly] (engine.py): the gradients are
                # the engine's own, for these very edges.
                got.update(zip(places, input_grads(
                    edges, [g for g in grads if g is not None], [wrt[i] for i in places],
                    retain)))
        return [got.get(i) for i in wanted]


class _Keep:
    """A prehook keeping the gradients its node receives, in its group's slot."""

    __slots__ = ("group",)

    def __init__(self, group: list[Any]) -> None:
        self.group = group

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.group[1] = tuple(grads)
