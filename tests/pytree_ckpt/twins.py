"""A module and its checkpointed twin, stepped alike, their gradients compared bit for bit:
the helpers test_forward_numbers.py, test_reused_numbers.py, test_dynamic_compute.py and
test_late_state_mutants.py share."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import pytree_ckpt

__all__ = ["grads", "grads_after_a_step", "late_change_steps", "same", "step_alike",
           "twin_steps", "twins"]


def twins(eager: nn.Module) -> tuple[Any, Any]:
    """``eager`` and a checkpointed copy of it (``Any``: the tests read their attributes)."""
    return eager, pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))


def grads(module: nn.Module) -> list[torch.Tensor]:
    """The gradients ``module``'s parameters hold (cloned), then its gradients reset."""
    taken = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return taken


def grads_after_a_step(models: tuple[nn.Module, ...], x: torch.Tensor, /
                       ) -> list[list[torch.Tensor]]:
    """Per model: ``model(x).sum().backward()``, then its parameters' gradients (reset)."""
    per_model = []
    for model in models:
        model(x).sum().backward()
        per_model.append(grads(model))
    return per_model


def twin_steps(eager: nn.Module, ours: nn.Module, /, *, steps: int, rows: int = 4,
               before: Callable[[Any], Any], check: Callable[[Any], bool]) -> None:
    """``steps`` steps of both twins on one random input each: ``before(model)`` ahead of the
    forward, ``check(model)`` true once its backward ran, their gradients equal at each step."""
    for step in range(steps):
        x = torch.randn(rows, 8)
        per_model = []
        for model in (eager, ours):
            before(model)
            model(x).sum().backward()
            per_model.append(grads(model))
            assert check(model), f"step {step}"
        assert same(*per_model), f"step {step}"


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists of gradients are of one length and equal, tensor by tensor."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def step_alike(eager: nn.Module, ours: nn.Module) -> None:
    """One step of each twin on the same input: their gradients must be equal."""
    x = torch.randn(4, 8)
    for module in (eager, ours):
        module(x).square().sum().backward()
    assert same(grads(eager), grads(ours))


def late_change_steps(make: Callable[[], nn.Module], xs: list[torch.Tensor], /, *,
                      wrap: Callable[[nn.Module], Any] = pytree_ckpt.apply_activation_checkpointing,
                      no_grad_from: int = 99) -> tuple[bool, list[str]]:
    """Whether ``make()`` and a copy ``wrap`` checkpoints give the same gradients (of the
    parameters and input) and state bit for bit over steps ``xs`` (from step ``no_grad_from``
    on, forwards under no-grad), and the late-first-change warnings given (NOTE [a small
    buffer first changed after the first replay] in stored_state.py)."""
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager)
    wrap(ours)
    found: list[list[torch.Tensor | None]] = [[], []]
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for i, model in enumerate((eager, ours)):
            for step, x in enumerate(xs):
                model.zero_grad(set_to_none=True)
                x = x.clone().requires_grad_(True)
                if step >= no_grad_from:
                    with torch.no_grad():
                        model(x)
                    continue
                model(x).square().sum().backward()
                found[i] += [p.grad for p in model.parameters()] + [x.grad]
    alike = all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                for a, b in zip(*found)) and \
        all(torch.equal(_dense(a), _dense(b)) for a, b in zip(eager.state_dict().values(),
                                                             ours.state_dict().values()))
    return alike, [str(w.message) for w in told if "first time after" in str(w.message)]


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t
