"""Whether each save unit kept anything once the layers ran: a unit that names ops the layers
never dispatch keeps nothing, and the replay recomputes what the user asked to keep.

NOTE [a unit that keeps nothing at run time]: ``apply_recompute_config`` warns when a unit's
ops do not exist in the build or no layer has its methods. What it cannot see is what the
layers dispatch: SDPA on CPU with dropout (and on CUDA for some masks and dtypes) takes its
math path (``aten::bmm``, a softmax), so a unit naming the fused kernels keeps nothing, and the
numbers stay exact while the memory and time the unit was chosen for are lost, silently
(helper CV). So each policy watches its layers' first original passes: once every checkpointed
layer has run one, a unit none of whose ops was kept there, and none of whose methods kept
anything, is warned about, once. An op counts as kept at the end of its pass: a record a later
in-place change took back (rule 3 in keep.py: DSA ids masked in place) keeps nothing. A unit
that keeps in some layers only (the MoE gate of a model whose first layers are dense) keeps
something: not warned. Nor is one whose ops run
inside ``reuse_during_recompute`` (the DSA indexer's top-k, reused): never kept (rule 4 in
keep.py), but the replay hands back their results without running them, which is what the
unit asks for. A policy loaded from a pickle (``torch.load``) does not know its layers and
says nothing; a model's deepcopy shares the policy, whose watch waits for the original's
layers (the copy's count towards its units, not its layers).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from .eager import user_stacklevel

__all__ = ["UnitUse"]


class UnitUse:
    """One policy's watch over its units (name, op names, kept methods) until each of its
    layers (by id) ran an original pass; then ``settled``, and nothing more is counted."""

    def __init__(self, units: Iterable[tuple[str, Iterable[str], Iterable[str]]],
                 layers: Iterable[Any], /) -> None:
        self.units = tuple((name, frozenset(ops), frozenset(methods))
                           for name, ops, methods in units)
        self._waiting = {id(layer) for layer in layers}
        self._kept: set[str] = set()
        self.settled = not (self.units and self._waiting)

    def kept(self, op_names: tuple[str, str], regions: frozenset[str], /) -> None:
        """An op was kept (or run by a reused call): the units naming it (as a whole op or
        this overload) or a method running now (``regions``) kept something."""
        for name, ops, methods in self.units:
            if name not in self._kept and (not ops.isdisjoint(op_names)
                                           or not methods.isdisjoint(regions)):
                self._kept.add(name)

    def pass_ended(self, layer: Any, /) -> None:
        self._waiting.discard(id(layer))
        if self._waiting:
            return
        self.settled = True
        for name, ops, methods in self.units:
            if name in self._kept:
                continue
            what = (f"none of its ops {sorted(ops)} was kept there (not dispatched; or its "
                    "results changed in place later in the forward, by a ReLU(inplace=True) "
                    "or `h += x`, which takes a kept result back; or only as views, clones, "
                    "in-place ops, under inference_mode, or casts under autocast, never kept; "
                    "or an op that makes what its backward needs only with grad on, oneDNN's "
                    "LSTM: aten::mkldnn_rnn_layer, run again)"
                    if ops else
                    f"the methods {sorted(methods)} kept nothing there (not called inside a "
                    "checkpointed layer; dispatching no op that can be kept; or their results "
                    "changed in place later in the forward, by a ReLU(inplace=True) or `h += "
                    "x`, which takes a kept result back)")
            warnings.warn(
                f"pytree_ckpt: save unit {name!r} kept nothing in the first forward of its "
                f"checkpointed layers: {what}. The replay recomputes that part: the numbers "
                "are unchanged, but the memory and time the unit is for are lost. SDPA takes "
                "its math path (aten::bmm and a softmax, not the fused kernels) on CPU with "
                "dropout, and on CUDA for some masks and dtypes. Tip: an op whose result is "
                "changed in place after it (a conv before ReLU(inplace=True)) cannot be kept: "
                "use ReLU(inplace=False) or `h = h + x`; name the ops the layer "
                "dispatches (list them with torch.utils.flop_counter.FlopCounterMode or a "
                "TorchDispatchMode), or keep the method instead: KeptCallables('Attn.forward') "
                "keeps whatever it dispatches (docs/save_units.md)",
                stacklevel=user_stacklevel())
