"""``KeptOps``: a save unit that keeps ops by identity, and which of the ops it names this torch
build has and can keep.

A name this build lacks is skipped (a v2/v3 pair of kernel names resolves), one close to an op
that exists is warned of naming it, and an op the keep rules never keep (``never_kept`` in
keep.py) or that this build decomposes before dispatch is skipped with a warning naming why.
``apply_recompute_config`` (save_units.py) resolves each unit when it applies it.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .eager import user_stacklevel
from .errors import CheckpointConfigError
from .keep import never_kept, op_name

__all__ = ["KeptOps", "RecomputeTarget"]


class RecomputeTarget:
    """What a save unit keeps: the base of ``KeptOps`` and ``KeptCallables``, the values of a
    ``RecomputeTargetMap``, for annotations (a dict holding both is typed by it, where their
    common type was ``object``: helper LJ). Not made itself."""

    __slots__ = ()


class KeptOps(RecomputeTarget):
    """Keep the outputs of ops, by qualified name (``"aten::mm"``, ``"glm_dsa::topk"``), one
    overload (``"aten::addmm.default"``, as torch's selective checkpoint and torchtitan list
    ops), or op object (``torch.ops.aten.mm``, ``torch.ops.aten.mm.default``, or the function
    ``@torch.library.custom_op`` returns).

    Names this torch build lacks are skipped (so a v2/v3 pair of kernel names resolves);
    a unit none of whose names exists warns once when applied, and a missing name close to one
    that exists warns naming it. An op the keep rules never keep (views, clones, collectives:
    docs/save_units.md) is skipped with a warning naming why.
    """

    def __init__(self, *ops: str | torch._ops.OpOverload | torch._ops.OpOverloadPacket |
                 torch._library.custom_ops.CustomOpDef) -> None:
        names = [op_name(op) for op in ops]
        # A list, not next(..., None): None itself is a bad argument.
        bad_ops = [op for op, n in zip(ops, names) if not (isinstance(n, str) and "::" in n)]
        if not names or bad_ops:
            bad: Any = bad_ops[0] if bad_ops else None
            higher_order = isinstance(bad, torch._ops.HigherOrderOperator)
            raise CheckpointConfigError(
                "KeptOps takes one or more op names of the form 'namespace::name' (or "
                "'namespace::name.overload'), or torch.ops objects",
                expected="e.g. KeptOps('aten::mm', 'glm_dsa::sparse_mla_attention') or "
                         "KeptOps(torch.ops.aten.addmm.default)",
                got=(f"the higher-order op {bad.name()!r}" if higher_order else repr(bad))
                if names else "nothing",
                tip="a higher-order op is no single op the mode that keeps ops sees: keep the "
                    "method that calls it with KeptCallables('Class.method'); but not "
                    "flex_attention, which may run in no layer that keeps units (torch 2.13 "
                    "compiles its call, and dynamo compiles nothing under that mode): "
                    "recompute its layers in full" if higher_order else
                    "unpack a list of ops (torch's selective checkpointing list): "
                    "KeptOps(*ops)" if isinstance(bad, (list, tuple)) else
                    "op identity is the namespace and the op's name")
        self.op_names = tuple(names)

    def __repr__(self) -> str:
        return f"KeptOps{self.op_names!r}"

    def resolve(self) -> list[Any]:
        """The ops (``OpOverloadPacket``s, or ``OpOverload``s for names with an overload) that
        exist in this build and reach dispatch.

        An op that this build decomposes before dispatch (only a ``CompositeImplicitAutograd``
        kernel: ``aten::linear``, ``aten::scaled_dot_product_attention``) never reaches the
        mode that keeps ops: it is skipped with a warning naming the fix, like a missing name
        (a build with a kernel of its own for it, e.g. CUDA's ``aten::_fused_rms_norm``, keeps
        it).
        """
        return self._resolve()[0]

    def _resolve(self) -> tuple[list[Any], list[str]]:
        """``resolve``'s ops, and the names skipped with a warning (decomposed before
        dispatch, ops the keep rules never keep, missing names close to existing ones)."""
        found, warned = [], []
        for name in self.op_names:
            namespace, qualified = name.split("::", 1)
            op_name, _, overload = qualified.partition(".")
            try:
                packet = getattr(getattr(torch.ops, namespace), op_name)
                target = getattr(packet, overload) if overload else packet
            except (AttributeError, RuntimeError):
                close = _near_op_names(name, self.op_names)
                if close:
                    warnings.warn(f"KeptOps({name!r}) names no op in this build; did you mean "
                                  f"{' or '.join(map(repr, close))}?", stacklevel=user_stacklevel())
                    warned.append(name)
                continue
            reason = never_kept(namespace, packet, overload or None)
            if reason is not None:
                warnings.warn(f"KeptOps({name!r}) keeps nothing: {reason}",
                              stacklevel=user_stacklevel())
                warned.append(name)
                continue
            base = f"{namespace}::{op_name}"
            if _decomposed_before_dispatch(base, packet, overload or None):
                example = _BECOMES.get(base, "e.g. aten::addmm for aten::linear")
                warnings.warn(
                    f"KeptOps({name!r}) keeps nothing in this build: torch decomposes {name} "
                    "into other ops (a CompositeImplicitAutograd kernel) before the mode that "
                    "keeps ops sees it; name the ops it becomes (list them by running the layer "
                    "under torch.utils.flop_counter.FlopCounterMode or a TorchDispatchMode), "
                    f"{example}, or keep the method that calls it with "
                    "KeptCallables('Class.method')", stacklevel=user_stacklevel())
                warned.append(name)
                continue
            found.append(target)
        return found, warned


# What the usual decomposed ops become, named in the warning for them.
_BECOMES = {
    "aten::scaled_dot_product_attention":
        "for aten::scaled_dot_product_attention: "
        "aten::_scaled_dot_product_flash_attention_for_cpu on CPU, and "
        "aten::_scaled_dot_product_flash_attention, _efficient_attention and "
        "_cudnn_attention on CUDA (docs/save_units.md, 'Declaring targets for your model')",
    "aten::linear": "for aten::linear: aten::addmm (aten::mm without a bias)",
}


def _near_op_names(name: str, named: Sequence[str]) -> list[str]:
    """Ops close to ``name`` that this build has and ``named`` does not name: a typo, not a
    kernel version this build lacks (a v2/v3 pair names both; a namespace not loaded, e.g.
    flash-attn not installed, has none). For an existing op with another overload, its
    overloads. Compared without spaces and case: a space makes another namespace, with no ops,
    and difflib is case-sensitive (``" aten::mm"`` and ``"aten::MM"`` mean ``aten::mm``)."""
    namespace, qualified = "".join(name.split()).split("::", 1)
    op_name, _, overload = qualified.partition(".")
    bases = {n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.lower().startswith(namespace.lower() + "::")}
    folded = {b.lower(): b for b in bases}  # no two ops of a namespace differ only by case
    base = folded.get(f"{namespace}::{op_name}".lower(), f"{namespace}::{op_name}")
    if overload and base in bases:
        packet = getattr(getattr(torch.ops, base.split("::")[0]), base.split("::")[1])
        return [f"{base}.{o}" for o in packet.overloads()
                if not getattr(packet, o)._schema.is_mutable]  # out= variants are never kept
    # The other names (this one's own op is what it means when off only by case or spaces).
    taken = {"".join(n.split()).split(".", 1)[0] for n in named if n != name}
    if any(base != other and (base.startswith(other) or other.startswith(base))
           for other in taken):
        return []  # a version of a named op (_efficient_attention_forward_v2)
    if base in bases:  # off only by case or spaces
        return [] if base in taken else [base]
    close = [folded[c] for c in difflib.get_close_matches(base.lower(), sorted(folded), n=3,
                                                          cutoff=0.85)]
    # Not suggested: in-place variants (addmm_, never kept), and backward kernels.
    return [c for c in close if c not in taken and not c.endswith(("_", "_backward"))]


# A kernel under any of these keys runs the op itself on that device: the mode that keeps ops
# sees it there (``aten::_fused_rms_norm`` has CUDA kernels and a composite fallback).
_OWN_KERNEL_KEYS = ("CPU", "CUDA", "XPU", "MPS", "PrivateUse1", "CompositeExplicitAutograd",
                    "CompositeExplicitAutogradNonFunctional")


def _decomposed_before_dispatch(name: str, packet: Any, only: str | None = None) -> bool:
    """Every functional overload of ``packet`` (or the one named ``only``) has a
    CompositeImplicitAutograd kernel and no kernel of its own on any device (the out=
    overloads are never what a forward calls)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    decomposed = None
    for overload in [only] if only else packet.overloads():
        qualified = name if overload == "default" else f"{name}.{overload}"
        try:
            if getattr(packet, overload)._schema.is_mutable:
                continue
            composite_only = has(qualified, "CompositeImplicitAutograd") and not any(
                has(qualified, key) for key in _OWN_KERNEL_KEYS)
        except RuntimeError:  # listed, but unknown to the dispatcher (aten::einsum.sublist)
            continue
        if not composite_only:
            return False
        decomposed = True
    return bool(decomposed)
