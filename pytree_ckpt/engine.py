"""The replay's gradients, straight from autograd's engine.

NOTE [the replay calls the engine directly]: ``torch.autograd.grad`` checks and normalises its
arguments in Python before it reaches the engine: tensor-or-sequence conversion, ``_make_grads``
(a shape comparison through symbolic-shape helpers, per output), batched-gradient and
materialisation options. A replay passes what those checks would only confirm: the
gradients autograd itself handed the boundary's node for its outputs, and replayed outputs
already checked to have the original pass's shapes and dtypes (``BoundaryCall.check_replay``),
as tuples. The checks cost about 70,000 instructions a layer call at the small size of
``examples.bench_instructions``, a seventh of what the boundary added there over torch's
reentrant checkpoint, so the replay calls ``torch.autograd.graph._engine_run_backward`` (what
``torch.autograd.grad`` itself calls last, with its logging hooks and the context it stashes
for device threads) with the arguments ``grad`` would pass. What ``grad`` does before its
checks, handing the call to a ``TorchFunctionMode`` or to a tensor subclass's
``__torch_function__``, changes nothing in a replay: no ``TorchFunctionMode`` is active inside
backward; a backward started from a subclass loss runs with subclass handling off; and
otherwise a subclass's ``__torch_function__`` is handed ``grad`` itself, which torch's default
runs unchanged (only a subclass overriding ``torch.autograd.grad`` would see a difference;
tests/pytree_ckpt/test_engine.py). A torch without that private function gets
``torch.autograd.grad`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["input_grads"]

_engine_run_backward: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)


def input_grads(outputs: Sequence[Any], grads: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor], /, retain: bool = False
                ) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=retain, allow_unused=True)``,
    for ``grads`` of the outputs' own shapes and dtypes (none ``None``). ``retain``: NOTE
    [a replay kept between restricted backwards] (kept_replay.py). An output may be a node's
    ``GradientEdge`` (NOTE [a weight pass from captured gradients] in kept_weights.py)."""
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain,
                                   allow_unused=True)
    # (outputs, grad_outputs, retain_graph, create_graph, inputs, allow_unused), as grad passes.
    return _engine_run_backward(tuple(outputs), tuple(grads), retain, False, tuple(inputs),
                                True, accumulate_grad=False)
