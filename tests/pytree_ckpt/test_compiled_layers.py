"""torch.compile around and inside checkpointed layers (pytree_ckpt/compiled_layers.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pytree_ckpt


# Guards against (helper JU), as it was found:
def test_torch_compile_of_a_sequential_around_checkpointed_layers_names_the_sequential() -> None:
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        eager = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)))
        model = copy.deepcopy(eager)
        for layer in model:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=False)
        x = torch.randn(4, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(model, backend="eager")(x).sum().backward()
        eager(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad)
                   for a, b in zip(eager.parameters(), model.parameters()))
        told = [str(w.message) for w in caught if "called inside torch.compile(" in str(w.message)]
        assert len(told) == 2  # once per layer
        assert all("called inside torch.compile(Sequential)" in message for message in told), told
    finally:
        torch._dynamo.reset()


# Guards against (helper JU), as it was found:
def test_a_checkpointed_forward_excluded_with_compiler_disable_is_not_told_it_was_compiled(
        ) -> None:
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        layer = copy.deepcopy(eager)
        pytree_ckpt.apply_activation_checkpointing(layer, offload=False)
        layer.forward = torch.compiler.disable(layer.forward)  # keep it out of any compile
        x = torch.randn(4, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x).sum().backward()
        eager(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad)
                   for a, b in zip(eager.parameters(), layer.parameters()))
        told = [str(w.message) for w in caught if "compiled after checkpointing" in str(w.message)]
        assert told == [], told
        # Still the boundary behind dynamo's wrapper: a copy would share it, and is refused.
        assert pytree_ckpt.is_checkpointed(layer)
        with pytest.raises(pytree_ckpt.CheckpointError, match="torch.compiler.disable"):
            copy.deepcopy(layer)
    finally:
        torch._dynamo.reset()
