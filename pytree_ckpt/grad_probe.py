"""The grad probe: a reused call's fn run with grad on in the original pass, where the static
look (grad_reach.py) finds nothing trainable, so that a graph it missed is seen.

NOTE [the grad probe]: rule 3 (NOTE [differentiable results are refused where grad is on] in
frozen.py) reads fn's code for what it reaches, and Python hides reach in too many ways to find
every one (another object's method, ``super()``, a computed ``getattr``, a metaclass: each
review round found another, and the gate silently got no gradient under checkpointing where
eager refuses). So where the look finds nothing, the original pass runs fn with grad on, as
eager does at a call with grad on (the boundary's original pass runs only where grad was on at
its entry): a float leaf the call computes with a graph then shows it, the recorded value is
detached (the original pass goes on without a graph, as under the boundary's no-grad), and
the replay, which sees the grad mode at the call, refuses it where grad is on there, as eager
does. Where the look finds something, fn runs under the boundary's no-grad as before: a router
with a trainable gate returning only its top-k ids (the usual replay) builds no graph there.
Costs: none where nothing fn reads requires grad (no graph is built); otherwise the graph of
the call, freed when it returns (kept, with the frame, only for a tensor in a plain object the
bridge does not open). fn also sees ``torch.is_grad_enabled()`` true, as eager does at a call
with grad on; where eager's call has grad off, what fn then does differs (an in-place update
of a parameter it reaches raises, a ``.numpy()`` of a tensor computed from one too): such an
error gets a note naming the probe and the fix (``@torch.no_grad()`` on fn).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .grad_reach import grad_reach
from .notes import add_note
from .tree import FlatTree, flatten, hidden_tensor, leaf_paths, unflatten

__all__ = ["note_probe", "probe_grad", "probed_graph"]


def probe_grad(fn: Callable[..., Any], call: FlatTree, /) -> AbstractContextManager[Any] | None:
    """``torch.enable_grad()`` to run ``fn`` under in the original pass, or ``None`` where the
    static look finds what gives its floats a graph (refused in the replay by rule 3)."""
    return torch.enable_grad() if grad_reach(fn, call) is None else None


def note_probe(error: BaseException, name: str, /) -> None:
    """Tell, on an error ``fn`` raised while probed, that it ran with grad on, and why."""
    add_note(error, f"pytree_ckpt: reuse_during_recompute({name}) ran it with grad on in the "
             "checkpoint's original pass, as eager runs it at a call with grad on (the grad "
             "probe: the static look found nothing trainable it reaches, docs/replay.md, 'What "
             "may be replayed'). If eager's call has grad off and fn relies on it (an in-place "
             "update of a parameter, .numpy()), decorate fn with @torch.no_grad(), or do that "
             "part under its own torch.no_grad()")


def probed_graph(result: Any, /) -> tuple[Any, str | None]:
    """``result`` with every leaf the probed call computed with grad detached, and where the
    first float one is (``None``: none), with what gave it the graph."""
    flat = flatten(result)
    leaves = list(flat.leaves)
    found: str | None = None
    paths: list[str] | None = None
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.grad_fn is None:
                continue
            leaves[i] = leaf.detach()
            if found is None and (leaf.is_floating_point() or leaf.is_complex()):
                paths = paths or leaf_paths(flat.spec, root="result")
                found = f"{paths[i]} ({_source(leaf)})"
        elif found is None:
            # NOTE [leaves that hold tensors] (tree.py): left as it is (the bridge does not
            # open it), graph and all, until the frame is released.
            hidden = hidden_tensor(leaf, _with_graph)
            if hidden is not None:
                paths = paths or leaf_paths(flat.spec, root="result")
                found = f"{paths[i]}{hidden[0]} ({_source(hidden[1])})"
    if all(a is b for a, b in zip(leaves, flat.leaves)):
        return result, found
    return unflatten(flat.spec, leaves), found


def _with_graph(tensor: torch.Tensor, /) -> bool:
    return tensor.grad_fn is not None and (tensor.is_floating_point() or tensor.is_complex())


def _source(tensor: torch.Tensor, /) -> str:
    """What gave ``tensor`` its graph: the first tensor that requires grad its graph reaches
    (a parameter, named by its shape; the look walks at most 256 nodes)."""
    stack = [tensor.grad_fn]
    seen: set[int] = set()
    while stack and len(seen) < 256:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            kind = "a parameter" if isinstance(variable, torch.nn.Parameter) else \
                "a tensor that requires grad"
            return f"computed with grad from {kind} of shape {tuple(variable.shape)}"
        stack += [next_node for next_node, _ in node.next_functions]
    return "computed with grad"
