"""Whether torch's own checkpoint (``torch.utils.checkpoint``) runs around the current call.

transformers' gradient checkpointing (the flag on the model in 4.x, on each layer in 5.x),
torchtune's and torchtitan's wrappers and ``checkpoint_wrapper`` all call it. Told from the
autograd state alone, with no walk of the stack:

- its non-reentrant form runs the body under saved-tensor hooks of its module, in forward
  (``_checkpoint_hook``) and in the recompute inside backward (``_recomputation_hook``); hooks
  of another kind opened inside the body hide them;
- its reentrant form runs the body under no-grad in forward, and with grad again inside its
  node's backward (``CheckpointFunctionBackward``), the node autograd is running then.
"""

from __future__ import annotations

import torch

from .tree import dunder

__all__ = ["inside_torchs_checkpoint", "torchs_checkpoint_around"]

_TORCHS_MODULE = "torch.utils.checkpoint"


def inside_torchs_checkpoint() -> bool:
    """The call runs under the saved-tensor hooks of torch's non-reentrant checkpoint, in its
    forward or in its recompute."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and dunder(hooks[0], "__module__") == _TORCHS_MODULE


def torchs_checkpoint_around() -> bool:
    """Torch's checkpoint, of either form, runs the current call: under its non-reentrant
    hooks, or as the recompute of its reentrant node's backward."""
    if inside_torchs_checkpoint():
        return True
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ == "CheckpointFunctionBackward"
