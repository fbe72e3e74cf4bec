"""Module state on CUDA: the value compare of NOTE [state a kernel writes] over CUDA storages
(kernel_written.py: ``set_`` of an untyped storage, ``torch.equal``, a sync), the snapshots of
NOTE [state read, then changed by a later call] and the census's Mechanism.MODULE_STATE over
them. The CPU tests (test_foreign_mechanisms.py, test_census_state.py) cover the logic; these
check that it holds on CUDA tensors and streams. Skipped cleanly without CUDA;
scripts/gpu_check.sh runs them (each well under a second on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import ActivationCensus, checkpoint_layers
from pytree_ckpt.kernel_written import remembered
from tests.conftest import assert_same_grads, grads_of
from tests.pytree_ckpt.models import CounterBesideEma, NormedLayer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


_STATEFUL: dict[str, Callable[[], nn.Module]] = {
    "fused fake-quant": tq.FusedMovingAvgObsFakeQuantize,  # the kernel moves no version
    "counter beside an ema through .data": CounterBesideEma,
}


class _Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.extra, self.bn = nn.Linear(8, 8), _STATEFUL[kind](), nn.BatchNorm1d(8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.bn(torch.tanh(self.extra(self.lin(h))))


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(kind), _Block(kind), nn.Linear(8, 2)).cuda()


def _steps(model: nn.Sequential, run: Callable[[torch.Tensor], torch.Tensor]) -> list[Any]:
    """Per SGD step (3): the loss, the gradients of the input and parameters, the buffers."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step)).cuda()
        x.requires_grad_()
        loss = run(x).square().sum()
        loss.backward()
        seen.append((loss.detach(), grads_of([x, *model.parameters()]),
                     [b.clone() for b in model.buffers()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("kind, how", [
    ("fused fake-quant", "module"), ("fused fake-quant", "function, offload"),
    ("counter beside an ema through .data", "module")])
def test_buffers_a_cuda_kernel_writes_are_found_and_each_step_is_eagers(kind: str,
                                                                        how: str) -> None:
    # NOTE [state a kernel writes]: the first calls compare each CUDA buffer's bytes with its
    # clone (a uint8 view set_ over the CUDA storage, torch.equal). Unseen, the replay would
    # update the fake-quant's observer (or the EMA) a second time: the second step's gradients
    # and the buffers would differ from eager's.
    eager = _model(kind)
    expected = _steps(eager, eager)
    model = _model(kind)
    blocks = [model[0], model[1]]
    if how == "module":
        for block in blocks:
            pytree_ckpt.apply_activation_checkpointing(block, offload=False)
        run: Callable[[torch.Tensor], torch.Tensor] = model
    else:
        calls = [pytree_ckpt.checkpointed(block, offload=offload.OffloadManager(
            offload.OffloadConfig(min_bytes=0), device="cuda")) for block in blocks]
        run = lambda h: model[2](calls[1](calls[0](h)))  # noqa: E731
    got = _steps(model, run)
    torch.cuda.synchronize()
    for step, ((loss, grads, buffers), (loss2, grads2, buffers2)) in enumerate(
            zip(expected, got)):
        assert torch.equal(loss, loss2), step
        assert_same_grads(grads, grads2)
        assert all(torch.equal(a, b) for a, b in zip(buffers, buffers2)), step
    assert all(remembered([block]) for block in blocks)  # found by value, on CUDA


def test_an_eval_micro_batch_before_a_train_one_on_cuda_replays_what_it_read() -> None:
    # NOTE [state read, then changed by a later call]: the eval call's snapshots (CUDA clones
    # made on the current stream before its forward) are what its replay reads after the train
    # call changed the statistics; the census counts them (snapshots(): tensors set_ over the
    # CUDA storages) until the replay, and they are freed after backward.
    torch.manual_seed(0)
    eager = nn.Sequential(NormedLayer()).cuda()
    model = nn.Sequential(NormedLayer()).cuda()
    model.load_state_dict(eager.state_dict())
    checkpoint_layers(model, offload=False)
    warm = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).cuda()
    for m in (eager, model):  # a first step: the forward changes state, the replay verifies
        m.train()
        m(warm).sum().backward()
        m.zero_grad()
    x1, x2 = torch.randn(8, 16).cuda(), torch.randn(8, 16).cuda()
    state = sum(b.untyped_storage().nbytes() for b in model.buffers())
    with ActivationCensus(model) as census:
        model.eval()
        first = model(x1).sum()
        model.train()
        second = model(x2).sum()
        assert census.bytes_by("mechanism") == {
            "checkpoint boundary": 2 * x1.untyped_storage().nbytes(), "module state": 2 * state}
        (first + second).backward()
        assert census.total_bytes == 0
    eager.eval()  # on clones: plain eager's backward would read the train call's statistics
    clones = {name: b.clone() for name, b in eager.named_buffers()}
    eager_first = torch.func.functional_call(eager, clones, (x1,)).sum()
    eager.train()
    (eager_first + eager(x2).sum()).backward()
    torch.cuda.synchronize()
    assert torch.equal(first, eager_first)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name
