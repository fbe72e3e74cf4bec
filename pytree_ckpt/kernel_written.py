"""Buffers a kernel writes without moving their version counters (NOTE [state a kernel
writes]): found by value at a module's first calls, then counted as changed at every call.

``state_changes.StateWatch`` asks ``differs`` at a module's first calls and keeps the answer
on the module (``remember``, ``remembered``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["differs", "remember", "remembered"]

# NOTE [state a kernel writes]: the watch of NOTE [state the forward changes] sees a change in
# place through a version counter, and a batch norm's whole dict through its counter. Some
# kernels write their outputs into buffers without moving any version: QAT's fused
# observer-and-fake-quantize (torch.fused_moving_avg_obs_fake_quant, in
# FusedMovingAvgObsFakeQuantize, the default QAT qconfig's weight and activation fake-quant)
# writes min_val, max_val, scale and zero_point so. Unseen, the replay updated them a second
# time and read them one update ahead: from the second step on, the layer's gradients and its
# buffers were not eager's, silently. So at a module's first calls (before its first replay,
# when the small buffers are saved anyway) each dict that no version shows changed is
# compared by value with what was saved (a device sync, at first calls only); one that
# changed is remembered on the module, by its place among the tree's buffer dicts, and is
# counted as changed wholly at every later call, as a batch norm's is: the replay runs on
# copies of its buffers as they were before the forward. The places hold while the tree
# does: a changed tree is verified again, and compared again (a stale place only costs a
# copy of the buffers there). Compared: buffers up to the small size; a larger one is not
# saved, and stays unseen (documented).
_KERNEL_WRITTEN = "_pytree_ckpt_kernel_written"


def remembered(owner: nn.Module, /) -> frozenset[int]:
    """The places of the buffer dicts of ``owner``'s tree that a kernel wrote."""
    found: frozenset[int] = owner.__dict__.get(_KERNEL_WRITTEN, frozenset())
    return found


def remember(owner: nn.Module, places: frozenset[int], /) -> None:
    if places:
        owner.__dict__[_KERNEL_WRITTEN] = places
    else:
        owner.__dict__.pop(_KERNEL_WRITTEN, None)


def differs(tensors: Sequence[torch.Tensor | None], before: dict[int, tuple[Any, Any]],
            storages: dict[Any, torch.UntypedStorage], /) -> bool:
    """Whether one of ``tensors`` holds other bytes than were saved before the forward (see
    ``StateWatch._save``: a storage clone by key, or the tensor's own clone)."""
    for t in tensors:
        saved = None if t is None else before.get(id(t))
        if saved is None:
            continue
        assert t is not None
        key, value = saved
        if key is None:  # the tensor alone (NaN compares unequal: counted changed, harmless)
            if not torch.equal(value, t):
                return True
        elif not torch.equal(_bytes(storages[key]), _bytes(t.untyped_storage())):
            return True
    return False


def _bytes(storage: torch.UntypedStorage, /) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
