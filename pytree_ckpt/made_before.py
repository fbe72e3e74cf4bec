"""The tensors a boundary call returns: for the outputs that existed before the call, and
for those that view fn's own results (NOTE [outputs that view fn's own results], below).

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

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .discard_aliases import reachable_objects, root_key
from .errors import CheckpointError
from .refusals import fn_name
from .state_changes import StateWatch
from .tree import alias, alias_all

__all__ = ["leaving_tensors", "on_kept_storages", "refuse_changed_kept",
           "refuse_changed_views", "unviewed"]


def _no_grad_inputs(inputs: Sequence[torch.Tensor], /) -> set[int]:
    """The ids of the inputs that require no grad and of their bases (a loop: NOTE [loops on
    the per-call path] in boundary.py), held alive by the call. One set per call, not a scan
    of the inputs per output: that was quadratic in a PyTree passed through a layer (helper
    LK: 101 ms a call for 1,000 leaves)."""
    found = set()
    for x in inputs:
        if not x.requires_grad:
            found.add(id(x))
            if x._base is not None:
                found.add(id(x._base))
    return found


def leaving_tensors(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    before: dict[int, torch.Tensor] | None, watch: StateWatch | None, /
                    ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[int],
                               list[int]]:
    """The tensors the boundary's Function returns for ``outputs`` (fn's tensor leaves), those
    of them to mark non-differentiable as made before the call (NOTE [outputs made before the
    call]), and the positions of views of a tensor none of those (NOTE [outputs that view
    fn's own results]), and the positions of those returned untouched that are module state
    (a buffer, a frozen parameter, or a view of one), to watch for a change in place after the
    call as those views are. ``before``: the frozen parameters and buffers by id, taken before
    fn ran; ``watch`` says which of them fn changed in place."""
    out = list(alias_all(outputs))
    as_is = []
    views = []
    state = []
    no_grad_inputs: set[int] | None = None  # made at the first output that needs it
    for position, t in enumerate(out):
        if t.requires_grad:
            continue
        base = t._base
        root = t if base is None else base
        if no_grad_inputs is None:
            no_grad_inputs = _no_grad_inputs(inputs)
        if id(root) in no_grad_inputs:
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
            state.append(position)
        elif t is known and (t.is_floating_point() or t.is_complex()):
            out[position] = alias(t)  # the buffer itself gets no node: an alias does
    return tuple(out), as_is, views, state


def unviewed(outputs: tuple[torch.Tensor, ...], views: list[int],
             others: Sequence[torch.Tensor], /
             ) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, Any, int]] | None]:
    """NOTE [outputs that view fn's own results]: ``nn.Linear`` on a 3-D input returns a view
    of its 2-D matmul (before torch 2.15), so a layer (or an MLP, an attention block) ending
    in a projection returns a view of a tensor fn made. Left a view, it leaves the boundary's
    Function as one, and torch refuses a caller's in-place change of it ("Output 0 of
    _BoundaryFunction is a view and is being modified inplace": ``out += residual``, timm's
    ``LayerScale(inplace=True)``), where eager and torch's non-reentrant checkpoint allow it.
    So the output leaves as a ``detach()`` alias of the same bytes, which is no view; it shares
    the version counter, so a kept op's or a frozen result's tensor changed through it is still
    refused at the replay. Not where another output, a hooked output or a frozen result
    (``others``) shares its storage: two outputs viewing one tensor must stay views of one
    another for autograd to follow a change through either (torch refuses it, documented); nor
    where anything but the boundary holds the output object (``_unheld``: a hook that kept it,
    a module attribute), nor for a sparse tensor or a subclass: those stay views, as before.

    The tensor it views may also be one that existed before the call (a table in a closure or
    on a module, ``t[:n]`` returned), which nothing cheap tells from fn's own: changed through
    the output, the replay would read the changed table, silently, where eager refuses it at
    backward when an op saved it. So each alias is noted with its version (returned, by weak
    reference: a dropped output cannot be changed), and a replay that finds one moved looks for
    state the call reaches on the same storage, and refuses (``refuse_changed_views``); one of
    fn's own, the usual case, passes."""
    shared = [_storage_key(t) for t in (*outputs, *others)]
    # Counted before anything here holds the outputs.
    replaced = [position for position in views
                if shared[position] is not None and shared.count(shared[position]) == 1 and
                _references(outputs, position) <= _UNHELD]
    if not replaced:
        return outputs, None
    out = list(outputs)
    noted = []
    for position in replaced:
        out[position] = alias = outputs[position].detach()
        noted.append((position, weakref.ref(alias), alias._version))
    return tuple(out), noted


def _storage_key(t: torch.Tensor, /) -> object:
    """The address of a plain strided tensor's storage (``None`` for others: a sparse tensor
    has none, and a subclass is left as it is). An empty storage shares no element with any
    other, whatever its address: a key equal to no other (helper MW: an output with no
    elements, `nn.Linear` of an empty batch, stayed a view, and `out += residual` raised where
    eager's passes). A storage without an address (the meta device's) by the storage itself,
    as keep.py's ``_storage_id`` files kept results (helper PM: a meta estimate ran a step
    the real device refuses)."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided:
        return None
    storage = t.untyped_storage()
    return (storage.data_ptr() or storage._cdata) if storage.nbytes() else object()


def _references(outputs: tuple[Any, ...], position: int, /) -> int:
    """References to ``outputs[position]`` (the same code measures ``_UNHELD``)."""
    return sys.getrefcount(outputs[position])


def _unheld() -> int:
    """What ``_references`` gives for an output nothing but the boundary holds: NOTE [outputs
    that view fn's own results]. Autograd gives its node to the very object the Function
    returns, so an output object someone else holds (a forward hook that kept the module's
    output, a module attribute the forward stored it in, a list it appended it to) must stay
    that object, or the holder keeps the original pass's tensor, without a graph, and a loss
    built from it silently loses its gradient. While the boundary replaces it, an output is
    held by fn's output structure, the flattened leaves and the tuple of outputs: a probe held
    so, measured once on this interpreter (the tests pin both sides: an unheld view is
    replaced, a hook's is not)."""
    probe = object()
    structure, leaves, outputs = (probe,), [probe], (probe,)
    del probe
    count = _references(outputs, 0)
    del structure, leaves
    return count


_UNHELD = _unheld()


def refuse_changed_views(fn: Callable[..., Any], noted: list[tuple[int, Any, int]],
                         modules: Sequence[nn.Module], names: Callable[[int], str], /
                         ) -> None:
    """NOTE [outputs that view fn's own results]: refuse an output the caller changed in place
    that views state the call reaches (``fn``'s closures, defaults and globals, ``modules``
    and their submodules' parameters, buffers and plain tensor attributes). ``names`` gives
    an output's path by its position."""
    moved = [(position, alias, version) for position, ref, version in noted
             if (alias := ref()) is not None and alias._version != version]
    if not moved:
        return
    # Rare (an output changed in place), so read everything the call reaches.
    objects = reachable_objects(fn, ())
    found: list[Any] = [obj for obj in objects if isinstance(obj, torch.Tensor)]
    for module in [*modules, *(obj for obj in objects if isinstance(obj, nn.Module))]:
        for sub in module.modules():
            found += [*sub._parameters.values(), *sub._buffers.values(),
                      *(v for v in tuple(sub.__dict__.values()) if isinstance(v, torch.Tensor))]
    keys = {root_key(t) for t in found if isinstance(t, torch.Tensor)} - {None}
    for position, alias, version in moved:
        if root_key(alias) in keys:
            raise CheckpointError(
                f"{names(position)} of {fn_name(fn)} views a tensor that existed before the "
                "call (a table in a closure or on a module), and was changed in place after it: "
                "a replay that reads it would read the changed tensor, and compute another "
                "function than the forward did (whether the call reads it is not known here)",
                expected="an output viewing the call's own result, or left unchanged",
                got=f"its version {alias._version}, {version} when the call returned",
                tip="clone it before changing it (`rows = rows.clone()`), or return a clone "
                    "from the call")


def on_kept_storages(outputs: Sequence[torch.Tensor], kept: dict[int, list[tuple[Any, int]]],
                     what_to_drop: Callable[[Any, int], str], /
                     ) -> list[tuple[int, Any, int, str, str]] | None:
    """NOTE [outputs on a kept storage]: an output may share its storage with a result a save
    unit keeps without sharing its version counter: ``aten._unsafe_view`` makes a new tensor
    (a counter of its own) on its argument's storage, and torch returns ``nn.Linear`` on a 3-D
    input so from 2.15 on (a view of the kept ``addmm`` before), ``torch.matmul`` of a 3-D
    input by a matrix on every version. A caller's change in place of that output (``out +=
    residual``) then changes the kept bytes unseen: the kept record's version check passes,
    and the replay computes on with the changed result, silently (a ``relu`` of it saved
    another mask). So each output on a kept storage is noted, by a ``detach()`` alias of it
    (which shares its version counter: a change through another alias the caller kept, the
    output object dropped, shows too; helper EQ) with its version and the op kept there, and
    a replay that finds one moved is refused (``refuse_changed_kept``); an output whose
    version did not move, the usual case, passes. The alias holds the kept storage, which the
    record holds anyway. Noted whatever its counter: a view sharing the record's counter is
    refused here too, before the record's own check would refuse it in the replay."""
    noted = []
    for position, t in enumerate(outputs):
        key = _storage_key(t)
        records = kept.get(key) if isinstance(key, int) else None
        if records:
            op, at = records[0]
            noted.append((position, t.detach(), t._version, str(op), what_to_drop(op, at)))
    return noted or None


def refuse_changed_kept(fn: Callable[..., Any], noted: list[tuple[int, Any, int, str, str]],
                        names: Callable[[int], str], /) -> None:
    """NOTE [outputs on a kept storage]: refuse an output changed in place since the call
    whose storage a save unit's record holds. ``names`` gives an output's path by position."""
    for position, out, version, op, drop in noted:
        if out._version != version:
            raise CheckpointError(
                f"{names(position)} of {fn_name(fn)} shares its memory with the result of "
                f"{op} that a save unit keeps for the replay, and was changed in place after "
                "the call: the replay would compute on with the changed result (Tensor cached "
                "during selective activation checkpoint has been mutated)",
                expected="an output left unchanged until backward, or no unit keeping that op",
                got=f"its version {out._version}, {version} when the call returned",
                tip="change a clone (`out = out.clone()`, or `out = out + residual` instead "
                    f"of `out += residual`), or {drop}")
