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


def test_a_fake_tensor_memory_estimate_counts_the_offload_the_real_device_counts() -> None:
    # census.md: a census on meta is a memory estimate; its fake-tensor twin (FakeTensorMode,
    # what torch's MemTracker estimates run under) must see offload as the real run does.
    import contextlib
    import warnings

    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytree_ckpt import ActivationCensus

    counted = {}
    for fake in (False, True):
        with warnings.catch_warnings(), (FakeTensorMode() if fake else contextlib.nullcontext()):
            warnings.simplefilter("ignore", UserWarning)  # test_debug_tools' xfail's warning
            torch.manual_seed(0)
            layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.Tanh(),
                                                 nn.Linear(128, 64)) for _ in range(2))
            m = manager()
            for layer in layers:
                pytree_ckpt.apply_activation_checkpointing(layer, offload=m)
            x = torch.randn(32, 64, requires_grad=True)
            with ActivationCensus(layers) as census:
                h = x * 1.0
                for layer in layers:
                    h = layer(h)
                counted[fake] = census.bytes_by("mechanism")
            h.sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
    assert counted[False].get("offloaded to host")  # both layers' inputs, copied to host
    assert counted[True] == counted[False]
