"""What a tensor saved in a window becomes: a handle to its storage's one host copy, or the
tensor itself, held as autograd holds it (the manager's pack hook, and ``offload_into``).

NOTE [one copy per storage]: the unit is the *storage*, not the tensor. The first saved tensor
on a window storage copies the whole storage to a host buffer; every other saved alias (a view,
a slice with an offset, a transposed stride) gets a handle to the same copy, and each is rebuilt
in backward from one restored device storage with its own offset, size and stride. A storage
offloaded by an earlier window of the same pass that is still alive and unmodified (same version)
is not copied again: RoPE tables or ``cu_seqlens`` passed to every layer cost one copy. Both
only for tensors counting their versions on the copied one's counter (NOTE [one counter per
shared copy] in window.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pytree_ckpt.census import Mechanism, census_active, report_held
from pytree_ckpt.saved import Unchanged
from pytree_ckpt.subclass import rebuilt_by_parts

from .storages import is_parameter, plain_storage_key
from .window import Copy, Flattened, Handle, Window

if TYPE_CHECKING:  # the manager imports this module
    from .manager import OffloadManager

__all__ = ["pack_saved"]


def pack_saved(manager: OffloadManager, window: Window, tensor: torch.Tensor, /) -> Any:
    """What the manager's pack hook gives autograd for ``tensor``, saved in ``window``."""
    # What stays on the device is still checked for in-place changes when unpacked: NOTE
    # [hooks switch off the in-place check] in pytree_ckpt/saved.py.
    if is_parameter(tensor):
        return Unchanged(tensor)
    if rebuilt_by_parts(tensor):
        return _pack_inner(manager, window, tensor)
    # Not a window tensor's storage, or none to copy (warned of when the window opened).
    key = plain_storage_key(tensor)
    if key is None or key not in window.keys:
        return Unchanged(tensor)
    if tensor.device != manager.device:
        manager._other_device(window, key, tensor)
        return Unchanged(tensor)
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes == 0:
        # A zero-size storage (an empty micro-batch, the top-k ids of no token) has no
        # bytes to copy; a Copy would still take a host buffer of the smallest size class,
        # which the census would count as offloaded bytes.
        return Unchanged(tensor)
    if nbytes < manager.config.min_bytes:
        if key not in window.small:
            window.small.add(key)
            manager._counters["below_min_bytes"] += nbytes
            window.pass_.largest_small = max(window.pass_.largest_small, nbytes)
        return Unchanged(tensor)
    # By storage and the tensor whose counter the copy checks (NOTE [one counter per shared
    # copy] in window.py): a table every window gets, saved beside a `.detach()` alias of it,
    # kept one copy for the pass, where one entry per storage let the alias's copy replace the
    # table's, copied again in every window (helper JI); and the window lists both copies, so
    # its restore brings back (and its first unpack keeps) each, where the alias's replaced
    # the other there, which was copied back from host beside the device bytes it could reuse
    # and counted as alive elsewhere (helper PV).
    base = tensor._base if tensor._base is not None else tensor
    slot = (*key, id(base))
    copy = window.copies.get(slot)
    if copy is None or not copy.holds(tensor) or not copy.same_counter(tensor):
        copy = window.pass_.shared.get(slot)
        if copy is None or not copy.holds(tensor) or not copy.same_counter(tensor):
            copy = Copy(manager, window, tensor)
            window.pass_.shared[slot] = copy
            _report_offload(copy, tensor)
        else:
            # This window's boundary has just reported the storage as its input; what
            # holds it for backward is the earlier window's copy (the census filed it as a
            # resident boundary input, never flagged when the caller keeps it).
            _report_shared(copy, tensor)
        window.copies[slot] = copy
        if window.open_copies is not None:
            window.open_copies[slot] = copy
    return Handle(copy, window, key, tensor)

def _pack_inner(manager: OffloadManager, window: Window, tensor: torch.Tensor, /
                ) -> Any:
    """A wrapper subclass (a DTensor): its inner tensors packed as any saved tensor, the
    wrapper rebuilt around them when unpacked (NOTE [a wrapper subclass's bytes are its
    inner tensors'] in pytree_ckpt/subclass.py); held as it is where none is copied."""
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    attributes = {name: getattr(tensor, name) for name in names}
    inner = {name: manager._pack(window, value) for name, value in attributes.items()
             if isinstance(value, torch.Tensor)}
    if all(type(packed) is Unchanged for packed in inner.values()):
        return Unchanged(tensor)
    others = {name: value for name, value in attributes.items() if name not in inner}
    return Flattened(tensor, inner, others, context)


def _report_offload(copy: Copy, tensor: torch.Tensor) -> None:
    if census_active():
        # The device storage is held (by us) until its copy completed, then flagged if it is
        # still alive; the host copy is held while the copy object lives.
        report_held([tensor], Mechanism.OFFLOAD_IN_FLIGHT, holder=copy, replace=True)
        assert copy.host is not None  # set for as long as the copy is in use
        report_held([copy.host], Mechanism.OFFLOADED, holder=copy.host_holder)


def _report_shared(copy: Copy, tensor: torch.Tensor) -> None:
    if census_active():  # its host copy was reported with the copy
        report_held([tensor], Mechanism.OFFLOAD_IN_FLIGHT, holder=copy, replace=True)
