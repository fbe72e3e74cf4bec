"""What output discard refuses, and how it says so: an op that changes its inputs in place or
returns something other than tensors, or switches requires_grad of an argument or a frozen
parameter (found in the forward), a hook tensor that cannot fire the
rebuild, and Megatron-Core's ``fp8=``. Each raises before anything is freed, naming the op,
both sides and a tip. discard.py, discard_function.py and discard_manager.py call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from .changed_in_place import parameter_path
from .discard_aliases import root_key
from .errors import CheckpointConfigError, CheckpointError
from .tree import describe_leaf

if TYPE_CHECKING:  # discard.py imports this module
    from .discard import CheckpointWithoutOutput

__all__ = ["check_hook_tensor", "refuse_discarded_hook", "refuse_fp8", "refuse_grad_switched",
           "refuse_input_changed", "refuse_output"]


def refuse_input_changed(name: str, args: tuple[Any, ...], tensor: torch.Tensor) -> None:
    # As at the boundary (refusals.raise_input_changed): the inputs are saved after fn ran, so
    # autograd's version check cannot see it, and the rebuild would run fn on the changed
    # tensor, changing the caller's tensor again in backward.
    position = next(i for i, a in enumerate(args) if a is tensor)
    raise CheckpointError(
        f"{name} changed its input args[{position}] in place; the rebuild in backward would "
        "run it on the changed tensor (and change it again) and give wrong gradients",
        expected="inputs left as they are",
        got="a version counter moved by the op (mul_, relu_, an inplace=True module)",
        tip="make the op out of place (nn.ReLU() rather than nn.ReLU(inplace=True); "
            "x = x * s rather than x.mul_(s)); for an embedding lookup with max_norm, "
            "torch.embedding_renorm_(table, ids, max_norm, norm_type) under torch.no_grad() "
            "before it, and the lookup without max_norm; or call it without discarding its "
            "output")


def refuse_grad_switched(name: str, args: tuple[Any, ...], tensors: list[torch.Tensor],
                         needs: list[bool], frozen: Any, modules: Sequence[nn.Module]
                         ) -> NoReturn:
    """As at the boundary (NOTE [requires_grad switched inside the call] in
    changed_in_place.py): the op's node takes whether each argument and parameter requires
    grad when it is called; one the op switches would get no gradient, or could not be
    stopped in the rebuild. Called once ``grad_switched`` found one."""
    switched = [t for t, need in zip(tensors, needs) if t.requires_grad != need]
    unfrozen = [p for p in frozen if p.requires_grad]
    if switched:
        position = next(i for i, a in enumerate(args) if a is switched[0])
        what = (f"argument args[{position}] "
                f"{'require' if switched[0].requires_grad else 'stop requiring'} grad")
    else:
        what = f"parameter {parameter_path(modules, unfrozen[0])!r} require grad"
    raise CheckpointError(
        f"{name} made its {what} (requires_grad_) while it ran; output discard takes whether "
        "each argument and parameter requires grad when the op is called, so its gradient "
        "would differ from eager's",
        expected="requires_grad as it was when the op was called",
        got=f"switched by the op ({len(switched) + len(unfrozen)} tensor"
            f"{'s' if len(switched) + len(unfrozen) > 1 else ''})",
        tip="set requires_grad before calling the op; to stop a gradient inside, use "
            "x.detach()")


def refuse_output(name: str, got: Any, where: str = "output", /) -> None:
    """Refuse what ``name`` returned: ``got``, at ``where`` (``output[1]`` for an element)."""
    what = "None" if got is None else "an empty " + type(got).__name__ if \
        isinstance(got, (tuple, list)) and not got else type(got).__name__
    raise CheckpointConfigError(
        f"CheckpointWithoutOutput needs {name} to return a tensor or a tuple of tensors",
        expected="Tensor | tuple[Tensor, ...] | list[Tensor]",
        got=f"{where}: {what}",
        tip="discard only ops that return tensors (for a fused op returning (out, None), a "
            "method of its module that returns out alone); wrap structured outputs in "
            "pytree_ckpt.checkpoint instead")


def refuse_fp8(fp8: object, /) -> None:
    """Megatron-Core's ``fp8=`` keyword: off (``False``, or ``None``, what Megatron passes
    from a config with FP8 off) only. The rebuild in backward would not run under the
    forward's FP8 autocast (Transformer Engine's state is not captured). An op given here
    is told where it goes: ``CheckpointWithoutOutput(norm)``, written as ``checkpoint(fn, x)``
    is, was told of FP8 autocast (helper PT)."""
    if callable(fp8):
        raise CheckpointConfigError(
            "CheckpointWithoutOutput() takes no op: the op and its inputs go to its "
            ".checkpoint()",
            expected="ckpt = CheckpointWithoutOutput(); out = ckpt.checkpoint(norm, x)",
            got=f"an op given to the constructor: {describe_leaf(fp8)}",
            tip="the constructor's one positional argument is Megatron-Core's fp8 flag "
                "(False): make one CheckpointWithoutOutput per discarded call, then call "
                "its .checkpoint(op, *inputs)")
    if fp8 is not None and fp8 is not False:
        raise CheckpointConfigError(
            "output discard does not rebuild under FP8 autocast",
            expected="fp8=False (or None)",
            got=f"fp8={fp8!r}",
            tip="run the discarded op outside fp8_autocast (a norm usually is), or leave it "
                "undiscarded")


def check_hook_tensor(hook_tensor: Any, name: str) -> None:
    if not isinstance(hook_tensor, torch.Tensor) or not hook_tensor.requires_grad:
        raise CheckpointConfigError(
            f"the hook tensor for {name} must be a tensor that requires grad",
            expected="a later tensor in the graph (the consumer's output)",
            got=type(hook_tensor).__name__ if not isinstance(hook_tensor, torch.Tensor)
            else "a tensor with requires_grad=False",
            tip="pass the output of the op that consumes the discarded output; nothing was "
                "freed")


def refuse_discarded_hook(hook_tensor: torch.Tensor,
                          checkpoints: list[CheckpointWithoutOutput]) -> None:
    """The hook tensor must outlive the discard: one on a storage being freed could never be
    read by the backward that fires the hook (nothing was freed yet when this raises)."""
    key = root_key(hook_tensor)
    for ckpt in checkpoints:
        for out, outside in zip(ckpt.outputs, ckpt.made_outside):
            if key is not None and not outside and root_key(out) == key:
                raise CheckpointError(
                    f"the hook tensor is an output of {ckpt._name()}, which is being discarded",
                    expected="a later tensor: the output of the op that consumes the "
                             "discarded one", got="the discarded output itself (or a view)",
                    tip="register on the consumer's result; a block's final output (the next "
                        "block's input) must stay outside the discarded ops")
