"""The tensors a boundary call returns, for the outputs that existed before the call.

NOTE [outputs made before the call]: the original pass runs under no-grad, so an output that
requires grad (a parameter, or a graph tensor fn closed over) existed before fn ran. Returned
as it is, autograd would attach the boundary's node to that very tensor (a parameter would
stop being a leaf, and a later backward would loop through it). It leaves as an alias instead.
Inputs returned as they are, autograd aliases itself.

An output that requires no grad and existed before the call (an input, a frozen parameter or
a buffer of the module, taken before ``fn`` ran), or is a view of one, comes back untouched, as
eager hands it back: marked non-differentiable, autograd neither gives it the node nor makes
it require grad (a buffer would otherwise join every step's graph, and keep it alive; a RoPE
table's rows, ``self.cos[:seq_len]``, cached by the caller at the first step, would
backpropagate into a freed graph at the next). The snapshot must predate ``fn``: a result
``fn`` stores into a buffer slot and returns is fresh, and needs its gradient. So does a
buffer ``fn`` writes a result into in place (``self.buf[:n].copy_(h)``), and a view of it: in
eager it requires grad after the write. The no-grad pass cannot tell that write from one
without a gradient (an EMA updated under ``torch.no_grad()``): a floating buffer changed in
place leaves with the node either way (docs/limits.md); an integer one (a
call counter) cannot carry a gradient and comes back as itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .state_changes import StateWatch
from .tree import alias, alias_all

__all__ = ["leaving_tensors", "unviewed"]


def _of_an_input(root: torch.Tensor, inputs: Sequence[torch.Tensor], /) -> bool:
    """Whether ``root`` is an input that requires no grad, or the base of one (a loop: NOTE
    [loops on the per-call path] in boundary.py)."""
    for x in inputs:
        if not x.requires_grad and (root is x or root is x._base):
            return True
    return False


def leaving_tensors(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    before: dict[int, torch.Tensor] | None, watch: StateWatch | None, /
                    ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[int]]:
    """The tensors the boundary's Function returns for ``outputs`` (fn's tensor leaves), those
    of them to mark non-differentiable as made before the call (NOTE [outputs made before the
    call]), and the positions of views of a tensor none of those (NOTE [outputs that view
    fn's own results]). ``before``: the frozen parameters and buffers by id, taken before fn
    ran; ``watch`` says which of them fn changed in place."""
    out = list(alias_all(outputs))
    as_is = []
    views = []
    for position, t in enumerate(out):
        if t.requires_grad:
            continue
        base = t._base
        root = t if base is None else base
        if _of_an_input(root, inputs):
            as_is.append(t)  # changed in place, an input is refused (raise_input_changed)
            continue
        if before is None:
            if base is not None and not root.requires_grad:
                views.append(position)
            continue
        known = before.get(id(root))
        if known is not root:
            # A buffer registered as a view (emb.cos()[None, None]) has the temporary it was
            # sliced from as its base, as its views do: itself if returned whole (its base may
            # be another buffer's too: k and v of one cache), else asked of the buffers.
            if base is None:
                continue
            known = before.get(id(t))
            if known is not t:
                known = watch.buffer_viewing(root) if watch is not None else None
                if known is None:
                    if not root.requires_grad:  # (an input's or a parameter's view does)
                        views.append(position)
                    continue
        if known.requires_grad:
            continue
        # A view shares its base's version counter: the buffer's says whether fn wrote to it.
        if watch is None or watch.unchanged_in_place(known):
            as_is.append(t)
        elif t is known and (t.is_floating_point() or t.is_complex()):
            out[position] = alias(t)  # the buffer itself gets no node: an alias does
    return tuple(out), as_is, views


def unviewed(outputs: tuple[torch.Tensor, ...], views: list[int],
             others: Sequence[torch.Tensor], /) -> tuple[torch.Tensor, ...]:
    """NOTE [outputs that view fn's own results]: ``nn.Linear`` on a 3-D input returns a view
    of its 2-D matmul, so a layer (or an MLP, an attention block) ending in a projection
    returns a view of a tensor fn made. Left a view, it leaves the boundary's Function as one,
    and torch refuses a caller's in-place change of it ("Output 0 of _BoundaryFunction is a
    view and is being modified inplace": ``out += residual``, timm's ``LayerScale(inplace=
    True)``), where eager and torch's non-reentrant checkpoint allow it. The tensor it views is
    fn's own and dropped after the call, so the output leaves as a ``detach()`` alias of the
    same bytes, which is no view; it shares the version counter, so a kept op's or a frozen
    result's tensor changed through it is still refused at the replay. Not where another
    output, a hooked output or a frozen result (``others``) shares its storage: two outputs
    viewing one tensor must stay views of one another for autograd to follow a change through
    either (torch refuses it, documented)."""
    shared = [t.untyped_storage().data_ptr() for t in (*outputs, *others)]
    out = list(outputs)
    for position in views:
        t = outputs[position]
        if type(t) is torch.Tensor and t.layout is torch.strided and \
                t.untyped_storage().nbytes() and shared.count(shared[position]) == 1:
            out[position] = t.detach()
    return tuple(out)
