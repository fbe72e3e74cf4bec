"""The boundary mixed with torch's own mechanisms inside a checkpointed layer: modules whose
forward changes their buffers in ways users do not think of (QAT fake-quantization and
observers, spectral norm's power iteration), against an unwrapped eager twin, bit for bit in
fp32."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations

import offload
import pytree_ckpt
from tests.conftest import assert_same_grads, grads_of


def _manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


class _EmaThroughData(nn.Module):
    """An EMA written through ``.data``: no version counter moves."""

    def __init__(self) -> None:
        super().__init__()
        self.ema: torch.Tensor
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.ema.data.mul_(0.5).add_(h.mean(0).detach() * 0.5)
        return h * self.ema


def _batch_norm_without_counter() -> nn.Module:
    norm = nn.BatchNorm1d(8, momentum=0.1)
    norm.num_batches_tracked = None  # only the kernel writes the running statistics
    return norm


# What each block puts after its Linear: modules whose forward changes their buffers.
_STATEFUL: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "fused fake-quant": lambda lin: tq.FusedMovingAvgObsFakeQuantize(),
    "fake-quant": lambda lin: tq.FakeQuantize(observer=tq.MovingAverageMinMaxObserver,
                                              quant_min=0, quant_max=255),
    "observer": lambda lin: tq.MinMaxObserver(),
    "ema through .data": lambda lin: _EmaThroughData(),
    "batch norm without its counter": lambda lin: _batch_norm_without_counter(),
}


# Forward calls per block (not on the module: a number the replay changes is warned of).
_CALLS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


class _Block(nn.Module):
    """Linear (or QAT Linear), a stateful module, LayerNorm, dropout, BatchNorm, residual."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = torch.ao.nn.qat.Linear(8, 8, qconfig=tq.get_default_qat_qconfig("fbgemm")) \
            if kind == "qat linear" else nn.Linear(8, 8)
        if kind == "spectral norm":
            parametrizations.spectral_norm(self.lin)  # u, v: a power iteration per forward
        elif kind == "weight norm":
            parametrizations.weight_norm(self.lin)
        self.extra = _STATEFUL[kind](self.lin) if kind in _STATEFUL else nn.Identity()
        self.norm, self.drop, self.bn = nn.LayerNorm(8), nn.Dropout(0.25), nn.BatchNorm1d(8)

    @property
    def calls(self) -> int:
        return _CALLS.get(self, 0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _CALLS[self] = self.calls + 1
        return h + self.bn(self.drop(torch.tanh(self.norm(self.extra(self.lin(h))))))


def _model(kind: str = "plain") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(kind), _Block(kind), nn.Linear(8, 2))


def _blocks(model: nn.Sequential) -> list[_Block]:
    blocks = [model[0], model[1]]
    assert all(isinstance(block, _Block) for block in blocks)
    return blocks  # type: ignore[return-value]


def _steps(model: nn.Sequential, run: Callable[[torch.Tensor], torch.Tensor], *,
           steps: int = 3, cached: bool = False) -> list[Any]:
    """Per SGD step: the loss, the gradients of the input and parameters, the buffers."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step), requires_grad=True)
        torch.manual_seed(10 + step)  # dropout's masks
        with parametrize.cached() if cached else torch.enable_grad():
            loss = run(x).square().sum()
            loss.backward()
        seen.append((loss.detach(), grads_of([x, *model.parameters()]),
                     [b.clone() for b in model.buffers()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


def _checkpointed(model: nn.Sequential, how: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model``'s blocks checkpointed: wrapped in place, or called through checkpointed(),
    with offload on or off."""
    managers = [_manager() if how.endswith("offload") else False for _ in range(2)]
    if how.startswith("module"):
        for block, manager in zip(_blocks(model), managers):
            pytree_ckpt.apply_activation_checkpointing(block, offload=manager)
        return model
    calls = [pytree_ckpt.checkpointed(block, offload=manager)
             for block, manager in zip(_blocks(model), managers)]
    return lambda h: model[2](calls[1](calls[0](h)))  # type: ignore[no-any-return]


def _assert_same_steps(expected: list[Any], got: list[Any]) -> None:
    for step, ((loss, grads, buffers), (loss2, grads2, buffers2)) in enumerate(
            zip(expected, got)):
        assert torch.equal(loss, loss2), step
        assert_same_grads(grads, grads2)
        assert len(buffers) == len(buffers2)
        assert all(torch.equal(a, b) for a, b in zip(buffers, buffers2)), step


@pytest.mark.parametrize("kind, how", [
    ("fused fake-quant", "module"), ("fused fake-quant", "function, offload"),
    ("qat linear", "module, offload"), ("ema through .data", "function"),
    ("batch norm without its counter", "module"),
    ("fake-quant", "module, offload"), ("observer", "function"), ("spectral norm", "module")])
def test_buffers_a_forward_changes_end_each_step_as_in_eager_with_eager_gradients(
        kind: str, how: str) -> None:
    # QAT's default fake-quant (FusedMovingAvgObsFakeQuantize, also a QAT Linear's weight
    # fake-quant) writes its min/max, scale and zero point in a kernel that moves no version
    # counter, as do writes through .data and a batch norm's kernel without its counter: the
    # replay updated them a second time and read them one update ahead, so from the second
    # step on the gradients and the buffers were not eager's, silently (NOTE [state a kernel
    # writes]). The last three move versions, and pin what worked.
    eager = _model(kind)
    expected = _steps(eager, eager)
    model = _model(kind)
    _assert_same_steps(expected, _steps(model, _checkpointed(model, how)))
    assert [block.calls for block in _blocks(model)] == [6, 6]  # forward and replay, 3 steps


def test_a_weight_norm_cached_around_each_step_gives_eager_steps() -> None:
    eager = _model("weight norm")
    expected = _steps(eager, eager, cached=True)
    model = _model("weight norm")
    _assert_same_steps(expected, _steps(model, _checkpointed(model, "module"), cached=True))


def test_a_kernel_written_buffer_found_at_the_first_micro_batch_stays_found() -> None:
    # Two micro-batches a step: the first calls (before any replay) compare values, the later
    # ones read what they found.
    def micro_batches(model: nn.Sequential, run: Callable[[torch.Tensor], torch.Tensor]
                      ) -> list[Any]:
        return _steps(model, lambda x: torch.cat([run(x[:3]), run(x[3:])]), steps=2)

    eager = _model("fused fake-quant")
    expected = micro_batches(eager, eager)
    model = _model("fused fake-quant")
    _assert_same_steps(expected, micro_batches(model, _checkpointed(model, "module")))
