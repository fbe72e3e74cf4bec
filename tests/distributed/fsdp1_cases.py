"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) around checkpointed layers, two
ranks, each case against the same FSDP1 model without checkpointing (its twin).

    python tests/distributed/fsdp1_cases.py OUT CASE [CASE ...]

A case is ``<layout>-<params>``: params ``flat`` (``use_orig_params=False``) or ``orig``
(``True``); layout ``whole`` (one FSDP1 unit, the model; its layers checkpointed before
wrapping), ``layer`` (every layer an FSDP1 unit, then the inner layers chosen with
``check_fn``, as torch's recipe applies its wrapper after wrapping), ``before`` (every layer
checkpointed, then wrapped as a unit each), ``unit`` (every layer an FSDP1 unit, then the
FSDP-wrapped layers chosen with ``check_fn``) or ``inside`` (a stack of two layers
checkpointed, each layer an FSDP1 unit inside it) or ``method`` (a module holding the layers, each
an FSDP1 unit, checkpoints a method of its own that calls only its head). Each rank writes
``OUT/<case>.rank<r>.pt``: the twin's and the checkpointed model's losses and local gradients
over two SGD steps (``error``: the checkpointed run's exception, type and message).
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import pytree_ckpt
from tests.distributed.rank_cases import run_cases

WORLD = 2
CASES = ["whole-flat", "whole-orig", "layer-flat", "layer-orig", "before-flat", "before-orig",
         "unit-flat", "unit-orig", "inside-flat", "inside-orig", "method-flat", "method-orig",
         "call-flat", "call-orig", "partial-flat", "partial-orig"]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Layer(), Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class Headed(nn.Module):
    """Holds the stack (its layers FSDP1 units) and a head; checkpoints only its own method
    calling the head (a chunked loss, say), which calls no unit."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.body, self.head, self.checkpointed = Stack(), nn.Linear(8, 1), checkpointed

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return pytree_ckpt.checkpoint(self.project, h) if self.checkpointed else self.project(h)


class Calling(nn.Module):
    """Holds a stack (its layers FSDP1 units) and checkpoints its whole forward through its
    ``__call__`` (transformers' gradient checkpointing passes ``layer.__call__``) or a
    ``functools.partial`` of it: the same layout as ``inside``."""

    def __init__(self, how: str, checkpointed: bool) -> None:
        super().__init__()
        self.stack, self.how, self.checkpointed = Stack(), how, checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return self.stack(x)
        fn = self.stack.__call__ if self.how == "call" else functools.partial(self.stack)
        return pytree_ckpt.checkpoint(fn, x)


def _build(layout: str, params: str, checkpointed: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Headed(checkpointed)) if layout == "method" else \
        nn.Sequential(nn.Linear(4, 8), Calling(layout, checkpointed), nn.Linear(8, 1)) \
        if layout in ("call", "partial") else \
        nn.Sequential(nn.Linear(4, 8), Stack(), nn.Linear(8, 1))
    if checkpointed and layout in ("whole", "before"):
        pytree_ckpt.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    if checkpointed and layout == "inside":
        pytree_ckpt.apply_activation_checkpointing(model[1])
    model = FSDP(model, auto_wrap_policy=None if layout == "whole" else ModuleWrapPolicy({Layer}),
                 use_orig_params=params == "orig", device_id=torch.device("cpu"))
    if checkpointed and layout == "unit":
        pytree_ckpt.apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, FSDP) and isinstance(m.module, Layer))
    if checkpointed and layout == "layer":
        pytree_ckpt.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    return model


def _train(model: nn.Module, rank: int) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        # None: a use_orig_params parameter with no element on this rank
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return {"losses": losses, "grads": grads}


def case(name: str, rank: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    layout, params = name.split("-")
    result: dict[str, Any] = {"twin": _train(_build(layout, params, False), rank)}
    try:
        result["checkpointed"] = _train(_build(layout, params, True), rank)
        result["error"] = None
    except Exception as error:  # what the checkpointed run raised, for the test to judge
        result["error"] = (type(error).__name__, str(error))
    return result


if __name__ == "__main__":
    run_cases(Path(sys.argv[1]), sys.argv[2:], case)
