"""Which storages a window offloads: the storage keys of its tensors, less parameters, less
storages there are no plain bytes of to copy, less the storages the caller says stay resident.

The manager applies the rest of the window rule when autograd saves a tensor (its device, the
``min_bytes`` floor; docs/offload.md, "The window rule"), and warns once of what it leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pytree_ckpt.addresses import data_pointer
from pytree_ckpt.census_records import storage_key
from pytree_ckpt.errors import CheckpointConfigError
from pytree_ckpt.subclass import rebuilt_parts

__all__ = ["is_parameter", "plain_kind", "plain_storage_key", "refuse_non_tensors",
           "window_keys"]

Key = tuple[str, int]


def refuse_non_tensors(tensors: Any, /, *, name: str = "tensors") -> None:
    """``window``'s argument ``name`` (``tensors``, its first, or ``resident``): a sequence of
    tensors (iterating one tensor would give its rows, each a view of its storage)."""
    first = name == "tensors"
    where = "OffloadManager.window" if first else f"OffloadManager.window's {name}="
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise CheckpointConfigError(
            f"{where} takes a list or tuple of tensors",
            expected="Sequence[torch.Tensor]", got=type(tensors).__name__,
            tip="wrap one tensor in a list: "
                + ("manager.window([x])" if first else
                   f"manager.window(tensors, {name}=[x]); or leave {name} out (the default, ())"))
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            storages = ("the block's saves should go to host from" if first
                        else "should stay on the device")
            raise CheckpointConfigError(
                f"{where} takes tensors: {name}[{index}] is not one",
                expected="torch.Tensor", got=type(tensor).__name__,
                tip=f"pass only the tensors whose storages {storages} (leave out None and other "
                    "values)")


def is_parameter(tensor: torch.Tensor, /) -> bool:
    """A parameter or a view of one: never offloaded (its storage stays resident anyway, and
    restoring it would allocate a second copy of the whole parameter)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def plain_storage_key(tensor: torch.Tensor, /) -> Key | None:
    """The tensor's storage key, or ``None`` where it has no plain storage to copy: sparse
    layouts, nested tensors, and wrapper subclasses (DTensor and the like) whose bytes live
    in inner tensors; quantized tensors too (a restore from bytes would lose their scale
    and zero point)."""
    if tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_quantized:
        try:
            return storage_key(tensor)
        except RuntimeError:  # "invalid python storage": a wrapper subclass
            pass
    return None


def plain_kind(tensor: torch.Tensor, /) -> str:
    """What a tensor without a plain storage is, for the manager's warning."""
    if _functorch_wrapped(tensor):
        # Its class is Tensor and its layout strided: named by those, the warning said nothing;
        # named vmap's under every transform, it misled under jvp (helper KM).
        return "a torch.func transform's wrapper (" + (
            "vmap's BatchedTensor" if _batched(tensor) else
            "a jvp, grad or vjp transform's tensor wrapper" if _grad_tracking(tensor) else
            "a functionalized tensor") + ")"
    return ("nested tensor" if tensor.is_nested else "quantized tensor"
            if tensor.is_quantized else type(tensor).__name__)


_functorch = getattr(torch._C, "_functorch", None)
_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", lambda tensor: False)
_batched = getattr(_functorch, "is_batchedtensor", lambda tensor: False)
_grad_tracking = getattr(_functorch, "is_gradtrackingtensor", lambda tensor: False)


def window_keys(tensors: Sequence[torch.Tensor], resident: Sequence[torch.Tensor],
                key_of: Callable[[torch.Tensor], Key | None], /) -> dict[Key, int | None]:
    """The storages a window over ``tensors`` offloads, each with the index of the first of
    ``tensors`` on it (for messages). ``key_of`` is ``plain_storage_key``, or one that also
    warns of a tensor without a plain storage. A DTensor's storage is its local shard's (NOTE
    [a wrapper subclass's bytes are its inner tensors'] in pytree_ckpt/subclass.py)."""
    keys: dict[Key, int | None] = {}
    for index, tensor in ((i, part) for i, t in enumerate(tensors) if not is_parameter(t)
                          for part in rebuilt_parts(t)):
        key = key_of(tensor)
        if key is not None:
            keys.setdefault(key, index)
    if resident and keys:
        # A .detach() or .data alias of a parameter (a leaf, or a view of one, requiring grad
        # or not) is neither a Parameter nor a view of one, and neither is a custom
        # autograd.Function's output that returns such an alias (a non-leaf): only the storage
        # tells, so every window storage is checked, whatever made its tensor.
        for key in _resident_keys(resident, {pointer for _, pointer in keys}):
            keys.pop(key, None)
    return keys


def _resident_keys(resident: Sequence[torch.Tensor], pointers: set[int], /) -> list[Key]:
    """The storage keys of ``resident`` whose data pointer is among ``pointers``.

    NOTE: run at every window (a layer's parameters, each window of each step), so a plain
    parameter costs a data pointer and a set lookup (about 0.1 us); the full key (its device
    as a string) is read only on a match, and a wrapper subclass (a DTensor parameter) is
    taken apart as the window's tensors are."""
    found = []
    for tensor in resident:
        for part in ((tensor,) if type(tensor) is nn.Parameter else rebuilt_parts(tensor)):
            try:
                storage = part.untyped_storage()
                # As storage_key reads it: a storage with no memory of its own (meta, fake)
                # by the storage object (helper QK: every pointer 0 matched every window
                # storage, so under FakeTensorMode nothing was offloaded).
                pointer = data_pointer(part, storage) or storage._cdata
            except (RuntimeError, NotImplementedError):  # no plain storage: no window key
                continue
            if pointer in pointers and (key := plain_storage_key(part)) is not None:
                found.append(key)
    return found
