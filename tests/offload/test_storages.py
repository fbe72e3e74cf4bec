"""Which storages a window offloads (offload/storages.py): the storage keys of its tensors, less
parameters and resident storages, each with the index of the first window tensor on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

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


# helper QN: c4202d1 keyed a storage without an address by the storage object (storage_key and
# _resident_keys): real CPU tensors keep their keys; an empty storage (address 0) is no longer
# every parameter's, nor every other empty one's.
class _QnResident(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.w = weight
        self.e = nn.Parameter(torch.randn(0, 8))  # an empty parameter: its storage at 0

    def forward(self, x: torch.Tensor, empty: torch.Tensor, alias: torch.Tensor,
                v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ self.w) * alias.sum() + torch.cat([empty, x]).sum() + self.e.sum()
        return y * torch.sin(v1).sum() * torch.cos(v2).sum()


class _QnParameter(nn.Parameter):
    pass


@pytest.mark.parametrize("kind", [nn.Parameter, _QnParameter])
def test_a_window_with_empty_views_and_parameter_aliases_offloads_the_rest_with_eager_grads(
        kind: type) -> None:
    def run(ours: bool) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
        torch.manual_seed(0)
        model = _QnResident(kind(torch.randn(8, 8)))
        x = torch.randn(4, 8, requires_grad=True)
        empty = torch.zeros(0, 8, requires_grad=True)
        shared = torch.randn(16, requires_grad=True) * 1.0  # two views of one storage
        args = (x, empty, model.w.detach(), shared[:8], shared[8:])
        m = manager() if ours else None
        out = pytree_ckpt.checkpointed(model, offload=m)(*args) if ours else model(*args)
        out.sum().backward()
        return [x.grad, empty.grad, model.w.grad, model.e.grad], \
            (m.stats() if m is not None else None)

    expected, _ = run(False)
    got, stats = run(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # x's and the shared storage's bytes, once each; never the parameter's alias
    assert stats is not None and stats["offloaded_bytes"] == 4 * 8 * 4 + 16 * 4
