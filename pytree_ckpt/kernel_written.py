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

from .module_state import structure_generation

__all__ = ["compared", "differs", "mark_compared", "parameter_sums", "remember", "remembered",
           "sparse_parts", "sums_moved", "view_of"]

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
        key, value = saved
        if key is None:  # the tensor alone
            if not _same(value, t):
                return True
        elif value != view_of(t) or t.is_conj() or t.is_neg() or \
                not torch.equal(_bytes(storages[key]), _bytes(t.untyped_storage())):
            return True
    return False


# NOTE [a parameter written through .data]: a one-time initialisation keyed on a flag (Glow's
# ActNorm as most ports write it: `self.loc.data.copy_(-mean)`, `w.data.mul_(scale)`, `w.data =
# w.data * s`) moves no version of the parameter, so the flag was put back for the replay
# (NOTE [numbers and flags as the forward began] in forward_numbers.py: not for a call whose
# forward changed a trainable parameter in place) and the replay initialised again: a rescale
# applied twice, a random draw made twice, silently (helper OE). So at a module's first calls
# (before its first replay, as buffers are compared above), where the forward changed a plain
# value, its trainable parameters' sums before and after the forward are compared bit for bit
# (one reduction per parameter, and a device sync, then only): a parameter whose sum moved
# counts as changed in place. A write that keeps the sum (a permutation) is not seen; a
# parameter of a tensor subclass (a DTensor) or another layout is not summed.
def parameter_sums(params: Sequence[torch.Tensor], /) -> list[torch.Tensor | None]:
    """NOTE above: each parameter's sum, where it is a plain dense one with values."""
    return [p.detach().sum() if type(p) in (torch.Tensor, nn.Parameter) and
            p.layout == torch.strided and p.device.type != "meta" and not p.is_quantized
            else None for p in params]


def sums_moved(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None], /
               ) -> bool:
    """Whether a parameter's sum is not what ``parameter_sums`` read (a NaN equals itself)."""
    return any(was is not None and not _same(was, p.detach().sum())
               for p, was in zip(params, before))


def view_of(t: torch.Tensor, /) -> tuple[Any, torch.Size, tuple[int, ...], torch.dtype]:
    """How ``t`` reads its storage: saved beside a storage's clone, compared with it, and
    made again over the replay's copy of that storage. (Saved so, ``t`` had neither the
    conjugate nor the negative bit: ``differs`` counts one set since as a change.)"""
    return t.storage_offset(), t.size(), t.stride(), t.dtype


def _same(value: torch.Tensor, t: torch.Tensor, /) -> bool:
    """Whether ``t`` holds what its clone ``value`` does, bit for bit where its bytes can be
    read: a NaN equals itself (torch.equal says it differs: the dict would be counted as
    changed at every call, a clone and a copy per call for nothing), -0.0 differs from 0.0. A
    meta tensor has no values to compare (torch.equal raises on one); a subclass or a
    quantized tensor is compared by its own torch.equal."""
    if t.device.type == "meta":
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
