"""FSDP units where a boundary cannot serve them, refused in FSDP's terms with the ways out:
FSDP2 units (``fully_shard``) inside a checkpointed module (NOTE [FSDP units inside a
boundary]), and FSDP1 units (``FullyShardedDataParallel``) inside one or checkpointed
themselves, or an FSDP1 unit's flat parameter read by a checkpointed layer inside it (NOTE
[FSDP1 around a boundary])."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from .errors import CheckpointConfigError
from .tree import dunder

__all__ = ["refuse_flat_parameter", "refuse_fsdp1_units", "refuse_fsdp_units_inside"]


def refuse_fsdp_units_inside(owner: nn.Module, *, own: bool) -> None:
    """NOTE [FSDP units inside a boundary]: a submodule that is an FSDP2 unit of its own swaps
    its parameters in its hooks, which run *inside* the boundary: the boundary collects its
    sharded parameters (DTensors, which the replay never uses) and the replay all-gathers
    unsharded ones that ``torch.autograd.grad`` would leave without gradient. Found as a
    foreign leaf at the first replay; said here in FSDP's terms, with the two ways out.
    ``own``: the owner's own hooks run inside too (``checkpoint(unit, x)``)."""
    fsdp = getattr(torch.distributed, "fsdp", None) if torch.distributed.is_available() else None
    unit_type = getattr(fsdp, "FSDPModule", None)
    if unit_type is None:
        return
    name = type(owner).__name__
    if own and isinstance(owner, unit_type):
        raise CheckpointConfigError(
            f"checkpoint() was given the FSDP unit {name} itself: its hooks all-gather its "
            "parameters inside the boundary, so the replay's gradients for them would be lost",
            expected="the unit's hooks outside the boundary",
            got=f"pytree_ckpt.checkpoint({name}, ...) on a fully_shard()ed module",
            tip=f"apply_activation_checkpointing on the {name} before fully_shard() (its hooks "
                "then run around the boundary), and call the module itself")
    units = [path for path, sub in owner.named_modules()
             if sub is not owner and isinstance(sub, unit_type)]
    if not units:
        return
    raise CheckpointConfigError(
        f"the checkpointed {name} contains separate FSDP units {units}: their hooks all-gather "
        "their parameters inside the boundary, so the replay's gradients for them would be lost",
        expected=f"no fully_shard()ed submodule inside the checkpointed {name}",
        got=f"fully_shard() applied to {', '.join(repr(u) for u in units)}",
        tip=f"checkpoint each unit instead (apply_activation_checkpointing on {units[0]!r}, "
            f"...), or make {name} itself the FSDP unit (fully_shard it, not its children)")


# NOTE [FSDP1 around a boundary]: an FSDP1 unit (torch.distributed.fsdp.FullyShardedDataParallel)
# all-gathers its flat parameter in its own forward and, with use_orig_params=False, hands its
# modules views of it as plain attributes, not parameters. A checkpointed layer that is its own
# unit's wrapped module (one unit per layer, checkpointed before or after wrapping, the inner
# layer chosen by check_fn) runs inside the unit's forward, on parameters gathered before the
# boundary: exact (helper GM, both use_orig_params settings). Three layouts are not served, and
# failed in backward with torch's "SplitWithSizesBackward0 returned an invalid gradient" or a
# message that named neither FSDP nor the fix (helper GM; torch's non-reentrant checkpoint trains
# them): the unit itself checkpointed (check_fn choosing the FullyShardedDataParallel modules),
# and a checkpointed module holding units (a size-based wrap policy making a layer's Linears
# units), refused at the module's calls until its first replay, before the forward runs
# (``refuse_fsdp1_units``); and a layer checkpointed inside one larger unit with flat parameters
# (FSDP(model) with no wrap policy), whose flat parameter the replay reaches as a leaf that is no
# input, refused at its first replay (``refuse_flat_parameter``). FSDP1 is looked for only once
# torch.distributed.fsdp is imported (no import here).


# The bound methods that run a module's whole forward (its call: transformers passes
# layer.__call__, nn.Module's _wrapped_call_impl).
_WHOLE = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl"})


def _fsdp1_unit() -> Any:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return None if fsdp is None else getattr(fsdp, "FullyShardedDataParallel", None)


def refuse_fsdp1_units(owner: nn.Module, fn: Any, /) -> None:
    """NOTE [FSDP1 around a boundary]: ``owner``, checkpointed, is an FSDP1 unit, or ``fn`` runs
    its whole forward (the module, its ``forward`` or its call, or a partial of one: helper GO)
    and it holds one. A method of it that
    calls none (a head or a chunked loss of a model whose layers are units: helper GN) is not
    looked into: a flat parameter it reads is refused at its first replay, naming
    ``use_orig_params=True``."""
    unit = _fsdp1_unit()
    if unit is None:
        return
    name = type(owner).__name__
    if isinstance(owner, unit):
        inner = type(getattr(owner, "module", owner)).__name__
        raise CheckpointConfigError(
            f"the FSDP1 unit around {inner} (FullyShardedDataParallel) is checkpointed itself: "
            "its forward all-gathers its parameters inside the boundary, so the replay's "
            "gradients for them would be lost",
            expected=f"the module the unit wraps ({inner}) checkpointed, inside the unit",
            got=f"the FullyShardedDataParallel wrapping {inner}, checkpointed",
            tip=f"choose the inner layers: apply_activation_checkpointing(model, check_fn="
                f"lambda m: isinstance(m, {inner})), before or after FSDP wrapping (not "
                "isinstance(m, FullyShardedDataParallel))")
    whole = False
    while isinstance(fn, functools.partial):
        # partial(Layer.forward, layer), transformers' checkpointing layer's form (helper GP)
        whole = whole or bool(fn.args) and fn.args[0] is owner and \
            dunder(fn.func, "__name__") in _WHOLE
        fn = fn.func
    if not whole and fn is not owner and not (dunder(fn, "__self__") is owner and
                                              dunder(fn, "__name__") in _WHOLE):
        return
    units = [path for path, sub in owner.named_modules()
             if sub is not owner and isinstance(sub, unit)]
    if units:
        raise CheckpointConfigError(
            f"the checkpointed {name} contains FSDP1 units {units}: each all-gathers its "
            "parameters in its own forward, inside the boundary, so the replay's gradients for "
            "them would be lost",
            expected=f"no FullyShardedDataParallel submodule inside the checkpointed {name}",
            got=f"FullyShardedDataParallel at {', '.join(repr(u) for u in units)}",
            tip=f"make {name} itself the FSDP1 unit (auto_wrap_policy=ModuleWrapPolicy({{{name}}}) "
                "or transformer_auto_wrap_policy, instead of a size-based policy that wraps its "
                "submodules), or checkpoint the units' inner modules instead")


def refuse_flat_parameter(leaf: torch.Tensor, owner: nn.Module, /) -> None:
    """NOTE [FSDP1 around a boundary]: a foreign leaf that is an FSDP1 flat parameter."""
    flat = sys.modules.get("torch.distributed.fsdp._flat_param")
    kind = None if flat is None else getattr(flat, "FlatParameter", None)
    if kind is None or not isinstance(leaf, kind):
        return
    name = type(owner).__name__
    raise CheckpointConfigError(
        f"the checkpointed {name} sits inside a larger FSDP1 unit with flat parameters "
        "(use_orig_params=False): its forward reads views of the unit's flat parameter, held "
        "as plain attributes, not parameters, so the replay's gradients for them would be lost",
        expected=f"{name} as its own FSDP1 unit, or use_orig_params=True",
        got=f"a FlatParameter of {leaf.numel()} elements reached by the replay of {name}",
        tip=f"wrap each checkpointed layer as its own unit (auto_wrap_policy=ModuleWrapPolicy("
            f"{{{name}}}) or transformer_auto_wrap_policy), or pass use_orig_params=True to "
            "FullyShardedDataParallel")
