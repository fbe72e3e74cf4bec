"""Shared test helpers: an eager twin to compare against, bit for bit."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is importable from the repository root
    sys.path.insert(0, str(ROOT))


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products that run (aten.mm, aten.addmm) while entered: what a replay
    or a restricted backward computes, where FlopCounterMode's module tracker cannot follow
    (it raises in eager's torch.autograd.grad of a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += str(func.overloadpacket) in ("aten.mm", "aten.addmm")
        return func(*args, **(kwargs or {}))


class GradIntoSaved(torch.autograd.Function):
    """y = x * x; its backward builds the gradient in the saved tensor's memory (a memory trick
    of fused kernels), which changes the saved tensor in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x.mul_(2).mul_(grad)


def lines_run(folder: str, call: Callable[[], Any], /) -> tuple[int, Any]:
    """The Python lines ``call()`` runs in files under ``folder`` (a path fragment such as
    ``"offload/pool.py"`` or ``"pytree_ckpt"``), and what it returns: work counted, not
    timed, for tests of how a cost scales."""
    lines = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if folder not in frame.f_code.co_filename:
            return None
        if event == "line":
            lines[0] += 1
        return trace

    sys.settrace(trace)
    try:
        result = call()
    finally:
        sys.settrace(None)
    return lines[0], result


def interrupted_at(files: Iterable[str], index: int, call: Callable[[], Any], /) -> bool:
    """``call()`` with a KeyboardInterrupt raised as the ``index``-th call made from the code of
    ``files`` (module ``__file__`` paths) returns: where CPython delivers a pending signal (a
    Ctrl-C). True if it was raised, False if ``call`` returned first."""
    ours = set(files)
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and frame.f_code.co_filename in ours:
            calls[0] += 1
            if calls[0] == index + 1:
                raise KeyboardInterrupt("Ctrl-C")

    try:
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
    except KeyboardInterrupt:
        return True
    return False


def grads_of(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def zero_grads(tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def assert_same_grads(expected: list[torch.Tensor | None], got: list[torch.Tensor | None]) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        if a is None or b is None:
            assert a is None and b is None, f"grad #{i}: {a} vs {b}"
        else:
            assert torch.equal(a, b), f"grad #{i} differs: max |d| = {(a - b).abs().max()}"


def grads_per_model(models: Sequence[nn.Module], x: torch.Tensor, *,
                    seed: int) -> list[list[torch.Tensor | None]]:
    """Per model, from the same seed: ``model(x).sum().backward()``, then the gradients of its
    parameters and of ``x`` (reset between models)."""
    grads = []
    for model in models:
        torch.manual_seed(seed)
        model(x).sum().backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    return grads


def run_twice(step: Callable[[bool], Any], leaves: list[torch.Tensor], *,
              seed: int = 0) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Run ``step(checkpointed)`` eagerly then checkpointed from the same seed; return grads."""
    torch.manual_seed(seed)
    step(False)
    eager = grads_of(leaves)
    zero_grads(leaves)
    torch.manual_seed(seed)
    step(True)
    ckpt = grads_of(leaves)
    zero_grads(leaves)
    return eager, ckpt


@pytest.fixture(autouse=True)
def _fresh_seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _no_ambient_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite must not depend on the caller's shell (XTUNER_ACTIVATION_OFFLOAD=1 would turn
    # offload on for every wrapped layer), nor tests on each other's process-wide default
    # managers: each test starts with none.
    import offload.defaults

    monkeypatch.delenv("XTUNER_ACTIVATION_OFFLOAD", raising=False)
    monkeypatch.setattr(offload.defaults, "_default_managers", {})
