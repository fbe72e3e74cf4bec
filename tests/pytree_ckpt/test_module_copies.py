"""Wrapped modules copied, pickled and unwrapped: each keeps calling what it should."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError


def test_copying_a_module_whose_forward_is_another_modules_bound_method_is_refused() -> None:
    # Guards against: _bare_for rebinds any bound method to the copy, also one of another module:
    # the copy then runs that other class's forward on itself instead of refusing.
    other = nn.Linear(4, 4)
    layer = nn.Linear(4, 4)
    layer.forward = other.forward  # type: ignore[method-assign]
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(CheckpointError, match="cannot copy a checkpointed Linear"):
        copy.deepcopy(layer)


class TwoForwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def forward_doubled(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def test_a_pickled_copy_keeps_calling_the_bound_method_installed_as_its_forward() -> None:
    # Guards against: __reduce__ drops the method's name: the unpickled copy falls back to the
    # class's forward, and silently computes something else than the original.
    layer = TwoForwards()
    layer.forward = layer.forward_doubled  # type: ignore[method-assign]
    pytree_ckpt.apply_activation_checkpointing(layer)
    twin = pickle.loads(pickle.dumps(layer))
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(twin(x), twin.forward_doubled(x))
    assert torch.equal(twin(x), layer(x))
