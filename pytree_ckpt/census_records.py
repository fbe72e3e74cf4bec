"""What the census records of one storage: why it is held (``Mechanism``), by whom, and when
it counts as held, flagged or over; and which storage a tensor is filed under.

The census (census.py) keeps one such record per storage and reads them (census_reading.py).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .addresses import data_pointer

__all__ = ["Holder", "Mechanism", "storage_key"]


class Mechanism(str, enum.Enum):
    """Why a storage is held for backward."""

    BOUNDARY = "checkpoint boundary"    # inputs saved by a checkpoint boundary
    REPLAY_FRAME = "replay frame"       # frozen results held for a replay
    SAVE_UNIT = "save unit"             # op outputs a save unit keeps instead of recomputing
    OFFLOADED = "offloaded to host"     # host copies of offloaded storages
    OFFLOAD_IN_FLIGHT = "offload in flight"  # device storages the manager holds until copied
    OFFLOAD_RESTORED = "restored for backward"  # device copies back from host, until dropped
    AUTOGRAD = "autograd"               # saved by ordinary autograd outside any boundary
    MODULE_STATE = "module state"       # small buffers as before the forward, for the replay

    def __str__(self) -> str:
        return self.value


# Mechanisms whose release is meant to free the storage.
_FREEING = frozenset({Mechanism.REPLAY_FRAME, Mechanism.OFFLOAD_IN_FLIGHT})


class Holder(Protocol):
    """What a mechanism gives so the census can tell whether it let go."""

    @property
    def released(self) -> bool: ...



# NOTE [what an offload swap replaces]: a window that copies a storage to host swaps the saved
# reference of the boundary that saved it (its input) or of the frame that held it (a frozen
# result given to ``offload_into``): those holders let go (``report_held(replace=True)``). Two
# kinds hold the tensor itself whatever the window does, and so keep it resident: another
# autograd node's save, and a save unit's record (a kept op's output that the next layer's
# window copies as its input: the record keeps it on the device until the replay). While one
# of them holds the storage, it is filed under that one, never under a freeing mechanism; when
# both do (a kept output the model also saves outside the layer), under the save unit, as
# everywhere a plain autograd save never takes a storage from a mechanism (docs/census.md).
_RESIDENT = (Mechanism.SAVE_UNIT, Mechanism.AUTOGRAD)


def _holds(keeper: weakref.ref[Any]) -> bool:
    obj = keeper()
    return obj is not None and not getattr(obj, "released", False)


@dataclass
class _Entry:
    storage: StorageWeakRef  # is the storage still alive at all?
    # The graph's handles and the mechanisms' holders, each with the mechanism it holds for.
    keepers: list[tuple[weakref.ref[Any], Mechanism | None]]
    nbytes: int
    device: str
    module: str
    mechanism: Mechanism
    discarded: bool = False  # its storage was freed by output discard (until refilled)
    # The freeing mechanism a resident holder took the storage from (NOTE [what an offload
    # swap replaces]): filed under it again once no resident holder holds it.
    displaced: Mechanism | None = None

    def held(self) -> bool:
        return any(_holds(keeper) for keeper, _ in self.keepers)

    def resident_holder(self) -> Mechanism | None:
        """The first mechanism of NOTE [what an offload swap replaces] still holding it."""
        holding = {mechanism for keeper, mechanism in self.keepers if _holds(keeper)}
        return next((mechanism for mechanism in _RESIDENT if mechanism in holding), None)

    def filed_under(self) -> Mechanism:
        """The mechanism the storage is filed under now: a resident holder only while it holds
        it (a plain graph that saved a frame's result, then was dropped, keeps nothing)."""
        if self.displaced is not None and self.resident_holder() is None:
            return self.displaced
        return self.mechanism

    def flagged(self) -> bool:
        # A mechanism that frees memory let go, yet the storage lives on: something else keeps
        # it. (A boundary letting go of its inputs frees nothing by itself: never flagged.)
        return (self.filed_under() in _FREEING and not self.held() and
                not self.storage.expired()
                and not self.discarded)  # freed in place by output discard: nothing lives on



def storage_key(tensor: torch.Tensor, /) -> tuple[str, int]:
    """``(device, storage data_ptr)``: which storage a tensor lives on, while it is alive; by
    the storage object itself where it has no memory of its own (the meta device's, a fake
    tensor's: every pointer is 0, NOTE [a fake tensor's address])."""
    storage = tensor.untyped_storage()
    return str(tensor.device), data_pointer(tensor, storage) or storage._cdata


def _record_key(tensor: torch.Tensor, /) -> tuple[Any, ...]:
    """Which storage the census files ``tensor`` under: ``storage_key``, except for storages
    without memory of their own to tell them apart (the meta device: every data_ptr is 0),
    filed by the storage object itself (NOTE [one address, one storage] in census.py keeps that
    apart from a later one at its place)."""
    storage = tensor.untyped_storage()
    pointer = data_pointer(tensor, storage)
    if pointer == 0:
        return str(tensor.device), "storage", storage._cdata
    return str(tensor.device), pointer

