"""Buffers a kernel writes without moving their version counters (NOTE [state a kernel
writes]): found by value at a module's first calls, then counted as changed at every call.

``state_changes.StateWatch`` asks ``differs`` at a module's first calls; the boundary's
original pass (``boundary_function.py``) and an output discard (``discard_function.py``, with
``compared`` and ``mark_compared``) keep the answer on the module (``remember``) and hand it to
the next calls' watches (``remembered``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .addresses import without_values
from .errors import CheckpointError
from .module_state import structure_generation

__all__ = ["WrittenThroughData", "compared", "differs", "mark_compared", "parameter_sums",
           "remember", "remembered", "sparse_parts", "sums_moved", "view_of"]

# NOTE [state a kernel writes]: the watch of NOTE [state the forward changes] sees a change in
# place through a version counter, and a batch norm's whole dict through its counter. Some
# kernels write their outputs into buffers without moving any version: QAT's fused
# observer-and-fake-quantize (torch.fused_moving_avg_obs_fake_quant, in
# FusedMovingAvgObsFakeQuantize, the default QAT qconfig's weight and activation fake-quant)
# writes min_val, max_val, scale and zero_point so. Unseen, the replay updated them a second
# time and read them one update ahead: from the second step on, the layer's gradients and its
# buffers were not eager's, silently. So at a module's first calls (before its first replay,
# when the small buffers are saved anyway) the buffers of each dict that no version shows
# changed, and those whose version did not move in a dict where another's did (a step
# counter beside an EMA written through .data), are compared bit for bit with what was saved
# (a NaN equals itself; a meta buffer has no values: not compared), a device sync at first
# calls only. A dict that changed is remembered on the module whose tree holds it (the
# owner, or a module passed as an argument, whatever it is passed beside), by its place
# among that tree's buffer dicts, and is counted as changed wholly at every later call, as a
# batch norm's is: the replay runs on copies of its buffers as they were before the forward
# (so that module clones its small buffers before every forward, as a batch norm's does).
# The places hold while the tree does: a changed tree is verified again, and compared again
# (a stale place only costs a copy of the buffers there). Compared: buffers up to the small
# size; a larger one is not saved, and stays unseen (documented). Later calls compare
# nothing: a module with no such dict costs what it did before.
_KERNEL_WRITTEN = "_pytree_ckpt_kernel_written"
# A discarded module (CheckpointWithoutOutput) is never verified: its dicts are compared at its
# first discarded call (its small buffers are saved at every one), and again once its tree
# changed (the structure generation it was compared at).
_COMPARED = "_pytree_ckpt_kernel_compared"


def compared(roots: Sequence[nn.Module], /) -> bool:
    """Whether a discarded call of ``roots`` already compared their dicts, for their trees
    as they are."""
    generation = structure_generation()
    return all(root.__dict__.get(_COMPARED) == generation for root in roots)


def mark_compared(roots: Sequence[nn.Module], /) -> None:
    generation = structure_generation()
    for root in roots:
        root.__dict__[_COMPARED] = generation


def remembered(roots: Sequence[nn.Module], /) -> frozenset[tuple[int, int]]:
    """The places (root, dict) of the buffer dicts of ``roots``' trees that a kernel wrote:
    each root keeps those of its own tree, so a module passed as an argument is read right
    whatever it is passed beside, and in whatever order."""
    if len(roots) == 1:  # the usual call: one lookup
        found = roots[0].__dict__.get(_KERNEL_WRITTEN)
        return frozenset((0, place) for place in found) if found else frozenset()
    return frozenset((i, place) for i, root in enumerate(roots)
                     for place in root.__dict__.get(_KERNEL_WRITTEN, ()))


def remember(roots: Sequence[nn.Module], places: frozenset[tuple[int, int]], /) -> None:
    for i, root in enumerate(roots):
        own = frozenset(place for at, place in places if at == i)
        if own:
            root.__dict__[_KERNEL_WRITTEN] = own
        else:
            root.__dict__.pop(_KERNEL_WRITTEN, None)


def differs(tensors: Sequence[torch.Tensor | None], before: dict[int, tuple[Any, Any]],
            storages: dict[Any, torch.UntypedStorage], /) -> bool:
    """Whether one of ``tensors`` holds other bytes than were saved before the forward (see
    ``StateWatch._save``: a storage clone by key with the tensor's view of it, or the tensor's
    own clone), or reads its storage another way."""
    for t in tensors:
        saved = None if t is None else before.get(id(t))
        if saved is None:
            continue
        assert t is not None
        if without_values(t):  # meta, fake: nothing to compare (see _same)
            continue
        key, value = saved
        if key is None:  # the tensor alone
            if not _same(value, t):
                return True
        elif value != view_of(t) or t.is_conj() or t.is_neg() or \
                not torch.equal(_bytes(storages[key]), _bytes(t.untyped_storage())):
            return True
    return False


# NOTE [a parameter written through .data]: a write through `.data` moves no version of the
# parameter, so the boundary sees no change in place and puts the forward's plain values
# (flags, counts) back for the replay, as for any call (NOTE [numbers and flags as the forward
# began] in forward_numbers.py), and the replay writes the parameter again. That is right for
# a write that gives the same values when repeated (a PixelCNN or MADE mask applied each call,
# `self.weight.data.mul_(self.mask)`; weight clipping; Glow's ActNorm copying its input's
# statistics): the count beside it must be put back (helper OH: dropping the put-back for it
# gave every gradient off, silently). It is wrong for a one-time initialisation keyed on a
# flag whose write does not repeat so (a rescale by a statistic of the output, `w.data.mul_(1 /
# std(x @ w.t()))`; a random draw with preserve_rng_state=False): the replay initialised a
# second time, silently (helper OE). No copy of the parameters is made to tell the two apart
# (that could cost a layer's weights per call); so at a module's first calls (before its first
# replay, as buffers are compared above), where the forward changed a flag (a plain value or a
# buffer), its trainable parameters' sums (of their elements' bits read as integers: exact and
# moved by a one-bit change) before and after the forward are compared (the sums before are
# taken at every first call: one reduction per parameter; the device sync only where a flag
# changed), and for one whose sum moved, the replay's sum after its forward is compared with
# the forward's: refused in backward where they differ. A write that keeps the bits' sum (a
# permutation) is not seen; a parameter of a tensor subclass with its own dispatch (a DTensor)
# or of another layout is not summed.
def parameter_sums(params: Sequence[torch.Tensor], /) -> list[torch.Tensor | None]:
    """NOTE above: each parameter's sum, where it is a dense one with values whose class has
    no dispatch of its own (a plain ``nn.Parameter`` subclass is summed)."""
    with torch._C.DisableTorchFunctionSubclass():
        return [_bit_sum(p) if type(p).__torch_dispatch__ is _PLAIN_DISPATCH and
                p.layout == torch.strided and p.device.type != "meta" and not p.is_quantized
                else None for p in params]


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_sum(p: torch.Tensor, /) -> torch.Tensor:
    """The sum of ``p``'s elements read as integers of their width: exact, in any order, and
    moved by a change of one bit (a write repeating to values other by rounding, with an
    equal float sum: `F.normalize` applied twice, helper OL)."""
    t = p.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_BITS[t.element_size()]).sum(dtype=torch.int64)


def sums_moved(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None], /
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The parameters whose sum is not what ``parameter_sums`` read, each with its sum now."""
    moved = []
    with torch._C.DisableTorchFunctionSubclass():
        for p, was in zip(params, before):
            if was is not None and not torch.equal(was, now := _bit_sum(p)):
                moved.append((p, now))
    return moved


class WrittenThroughData:
    """NOTE above: the parameters a forward wrote through ``.data`` at a first call where it
    changed a flag, each with its bits' sum after the forward and its name."""

    __slots__ = ("moved", "names")

    def __init__(self, moved: list[tuple[torch.Tensor, torch.Tensor]], names: list[str],
                 /) -> None:
        self.moved, self.names = moved, names

    def refuse_written_again(self, where: str, /) -> None:
        """After the replay's forward: refuse where it left a parameter other values than the
        forward did."""
        with torch._C.DisableTorchFunctionSubclass():
            for (p, was), name in zip(self.moved, self.names):
                if torch.equal(was, _bit_sum(p)):
                    continue
                raise CheckpointError(
                    f"the replay of {where} wrote its parameter {name} through .data again, "
                    "with other values than its forward left there: the replay runs the "
                    "forward from the flags and numbers it began with, so a write made once "
                    "and keyed on a flag (a one-time initialisation: a rescale by a statistic "
                    "of the output) or one made at every call that does not repeat to the "
                    "same values (a momentum encoder's update) is made a second time; the "
                    "layer's gradients would not be eager's, and the parameter would end "
                    "written twice",
                    expected="a write through .data that repeats to the same values (a mask, "
                             "a clip, a copy of the input's statistics: exact), or none",
                    got=f"{name} written again (its elements' bits summed: "
                        f"{_bit_sum(p).item()} where the forward left {was.item()})",
                    tip="make such a write outside the checkpointed call: a one-time "
                        "initialisation before the first training step (one forward under "
                        "torch.no_grad(), which runs the layer without a boundary), an update "
                        "made at every call before or after the layer's call; or keep a "
                        "module that takes no gradient frozen (requires_grad_(False)) and "
                        "update it in place under torch.no_grad(), not through .data "
                        "(`p.mul_(m).add_(q, alpha=1 - m)`): the replay then updates a copy")


def view_of(t: torch.Tensor, /) -> tuple[Any, torch.Size, tuple[int, ...], torch.dtype]:
    """How ``t`` reads its storage: saved beside a storage's clone, compared with it, and
    made again over the replay's copy of that storage. (Saved so, ``t`` had neither the
    conjugate nor the negative bit: ``differs`` counts one set since as a change.)"""
    return t.storage_offset(), t.size(), t.stride(), t.dtype


def _same(value: torch.Tensor, t: torch.Tensor, /) -> bool:
    """Whether ``t`` holds what its clone ``value`` does, bit for bit where its bytes can be
    read: a NaN equals itself (torch.equal says it differs: the dict would be counted as
    changed at every call, a clone and a copy per call for nothing), -0.0 differs from 0.0. A
    meta or fake tensor has no values to compare (torch.equal raises on one: helper QN, a
    FakeTensorMode step through a layer holding a buffer it does not change); a subclass or a
    quantized tensor is compared by its own torch.equal."""
    if without_values(t):
        return True
    parts = sparse_parts(t)
    if parts is not None:  # torch.equal has no sparse kernel
        had = sparse_parts(value) if value.layout == t.layout else None
        return had is not None and value.shape == t.shape and all(
            a.dtype == b.dtype and a.shape == b.shape and _same(a, b)
            for a, b in zip(had, parts))
    if type(t) not in (torch.Tensor, nn.Parameter) or t.is_quantized or \
            t.layout != torch.strided:
        return bool(torch.equal(value, t))
    if value.dtype != t.dtype or value.shape != t.shape:
        return False
    a, b = (x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1) for x in (value, t))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# A sparse tensor's parts, by layout: compared one by one, a sparse buffer (a graph layer's
# adjacency) written through ``.data`` is seen as a dense one is (helper JS: never saved, it
# was read one update ahead, silently). Equal values in another layout of parts (uncoalesced)
# count as changed: copies for nothing, never a wrong value.
_SPARSE_PARTS = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def sparse_parts(t: torch.Tensor, /) -> tuple[torch.Tensor, ...] | None:
    """The tensors a sparse ``t`` is made of; ``None`` for any other layout."""
    parts = _SPARSE_PARTS.get(t.layout)
    return None if parts is None else parts(t)


def _bytes(storage: torch.UntypedStorage, /) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
