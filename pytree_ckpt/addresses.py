"""Where a tensor's storage begins, read without FakeTensorMode's warning: the key the
boundary, save units, output discard, the census and offload file storages by."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # loaded with torch: no import cost

__all__ = ["data_pointer", "without_values"]

# NOTE [a fake tensor's address]: under FakeTensorMode (a memory estimate, torch's MemTracker,
# shape propagation) every tensor is a FakeTensor whose storage lives on the meta device: its
# data pointer is 0, as every meta storage's, and reading it warns "Accessing the data pointer
# of FakeTensor is deprecated ... almost definitely a bug in your code" (helper QK: each
# boundary's backward warned so, where eager and torch's checkpoint warn nothing). Such a
# pointer is 0 here without asking. A plain tensor or parameter, every call of a real run,
# costs one type test more; another class, a look at its storage's device.


def data_pointer(tensor: torch.Tensor, /, storage: torch.UntypedStorage | None = None) -> int:
    """``tensor``'s storage's data pointer (``storage``, where the caller holds it); 0 where
    it has no memory of its own (the meta device's, a fake tensor's)."""
    if storage is None:
        storage = tensor.untyped_storage()
    if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter and \
            storage.device.type == "meta":
        return 0
    return storage.data_ptr()


def without_values(tensor: torch.Tensor, /) -> bool:
    """Whether ``tensor`` has no values to read: a meta tensor, or a fake one (NOTE [a fake
    tensor's address]: comparing its values raises torch's DataDependentOutputException)."""
    if tensor.device.type == "meta":
        return True
    if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
        return False
    # A wrapper subclass (a DTensor, TwoTensor) over fake inner tensors too (helper QQ)
    try:
        return bool(is_fake(tensor))
    except Exception:  # a subclass torch's walk fails on (an inner attribute unset: QR)
        return False
