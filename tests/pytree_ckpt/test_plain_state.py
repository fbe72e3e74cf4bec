"""Module state a plain function changes (``plain_state.py``): a lambda or closure over a
module, or given one as an argument, whose forward changes that module's buffers is warned
once per function (the replay changes them again, as torch's reentrant checkpoint does); a
known callable, a module without buffers or with buffers left unchanged is not. Gradients are
compared bit for bit with an unwrapped eager twin."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import checkpoint, plain_state
from tests.conftest import assert_same_grads, grads_of


@pytest.fixture(autouse=True)
def _not_warned_yet() -> None:
    # Warned once per code object, for the process: each test starts as a fresh process would
    # (the lambdas below are shared by the parametrized cases, and a rerun would see none).
    plain_state._HELD.clear()
    plain_state.NOTHING_HELD.clear()


def _block(*, norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8) if norm else nn.ReLU())


def _steps(run: Callable[[nn.Module, torch.Tensor], torch.Tensor], block: nn.Module, *,
           steps: int = 3) -> tuple[list[warnings.WarningMessage], list[torch.Tensor | None]]:
    """``steps`` forward and backward calls of ``run(block, x)``; the warnings they gave (the
    library's) and the gradients of the block's parameters and of the last ``x``."""
    block.zero_grad(set_to_none=True)
    eager = copy.deepcopy(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step),
                            requires_grad=True)
            x_eager = x.detach().clone().requires_grad_(True)
            run(block, x).square().sum().backward()
            eager(x_eager).square().sum().backward()
    assert_same_grads(grads_of([*eager.parameters(), x_eager]),
                      grads_of([*block.parameters(), x]))
    return [w for w in caught if "pytree_ckpt" in str(w.message)], \
        grads_of([*block.parameters(), x])


def _as_argument(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda m, h: m(h), block, x)  # type: ignore[no-any-return]


def _in_closure(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda h: block(h), x)  # type: ignore[no-any-return]


def _as_default(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda h, m=block: m(h), x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("run", [_as_argument, _in_closure, _as_default],
                         ids=["argument", "closure", "default"])
def test_a_plain_function_that_updates_a_batch_norm_is_warned_once_naming_it(run: Any) -> None:
    # Guards against: a lambda over a BatchNorm (passed in, closed over, or a bound default)
    # updating its running statistics twice a step, silently (the replay runs it again).
    caught, _ = _steps(run, _block())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for part in ("BatchNorm1d", "running_mean", "num_batches_tracked", "'1'", "again",
                 "reentrant", "checkpoint(block, h)"):
        assert part in message, (part, message)
    assert caught[0].category is UserWarning
    assert caught[0].filename == __file__  # the user's call, not the library's


def test_the_warning_names_where_the_function_reached_the_module() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = _block()
        checkpoint(lambda h, m: m(h), torch.randn(4, 8, requires_grad=True), m=block)
        shared = _block()
        checkpoint(lambda h: shared(h), torch.randn(4, 8, requires_grad=True))
    messages = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert len(messages) == 2, messages
    assert "kwargs['m']" in messages[0], messages[0]
    assert "closure variable 'shared'" in messages[1], messages[1]


def test_a_step_counter_buffer_a_closure_changes_is_warned() -> None:
    class Counting(nn.Module):
        step: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.step += 1
            return self.lin(x)

    torch.manual_seed(0)
    counting = Counting()
    model = nn.Sequential(counting)
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: model(h), x), model, steps=2)
    assert len(caught) == 1
    assert "closure variable 'model' submodule '0' (Counting): step." in str(caught[0].message)
    assert int(counting.step) == 4  # two steps, each counted twice: what the warning says


@pytest.mark.parametrize("case", ["no buffers", "eval mode"])
def test_a_plain_function_whose_modules_keep_their_buffers_is_not_warned(case: str) -> None:
    block = _block(norm=case != "no buffers")
    if case == "eval mode":
        block.eval()
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: block(h), x), block)
    assert caught == []
    caught, _ = _steps(lambda m, x: checkpoint(lambda mm, h: mm(h), m, x), block)
    assert caught == []


def test_checkpointing_the_block_itself_is_not_warned_and_counts_once() -> None:
    block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(m, x), block, steps=2)
    assert caught == []
    assert int(block.get_submodule("1").get_buffer("num_batches_tracked")) == 2


def test_a_plain_function_over_no_module_is_not_watched() -> None:
    # The check costs nothing for such functions: each code object is looked at once, and
    # a function over tensors alone is then skipped with one lookup (measured in the commit).
    from pytree_ckpt import plain_state

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * scale

    scale = torch.tensor(2.0)
    x = torch.randn(3, requires_grad=True)
    checkpoint(double, x).sum().backward()
    assert plain_state.modules_held(double.__code__) == ((), ())
