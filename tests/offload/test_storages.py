"""Which storages a window offloads (offload/storages.py): the storage keys of its tensors, less
parameters and resident storages, each with the index of the first window tensor on it."""

from __future__ import annotations

import pytest
import torch

import pytree_ckpt
from tests.offload.blocks import manager


def test_a_change_in_place_names_the_first_window_tensor_on_a_storage_two_of_them_share() -> None:
    # Guards against: window_keys records the last window tensor on a storage
    # (``keys[key] = index``) instead of the first (``keys.setdefault(key, index)``).
    m = manager()
    x = torch.randn(8, 16, requires_grad=True)
    h = x * 1.0
    rows = h[2:]  # a view of h's storage, given to the window after it
    with m.window([h, rows], name=lambda i: f"args[{i}]"):
        out = (h * h).sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"^args\[0\] \(offload window 0"):
        out.backward()
