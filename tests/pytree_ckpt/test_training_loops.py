"""torch's own training utilities around checkpointed layers: fp16 autocast with a GradScaler
(overflowing steps skipped, unscale and clipping), averaged models (SWA, EMA) with update_bn,
eval and train micro-batches in one step, layers frozen and unfrozen, optimizer hooks and lr
schedulers, state dicts loaded (resume, from an unwrapped model, assign=True) and dtype and
device moves. Each runs a few steps on a small model (Linear, LayerNorm, dropout, one
BatchNorm1d) against its unwrapped eager twin, bit for bit (fp16 too: both run the same
kernels), with offload off and on."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import nn

import offload
import pytree_ckpt


class _Layer(nn.Module):
    calls = 0  # forward calls of every _Layer: the original pass and the replay count each

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.2)
        self.bn = nn.BatchNorm1d(8) if batch_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        h = self.drop(self.norm(self.lin(x)))
        if self.bn is not None:
            h = self.bn(h)
        return x + torch.tanh(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer(batch_norm=True), _Layer()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _batch(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(expected: Any, got: Any) -> None:
    """Equal leaf by leaf, tensors bit for bit with dtype (NaN where eager has NaN)."""
    leaves, spec = optree.tree_flatten(expected, none_is_leaf=True)
    others, other_spec = optree.tree_flatten(got, none_is_leaf=True)
    assert spec == other_spec
    for i, (a, b) in enumerate(zip(leaves, others)):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, i
            assert torch.equal(a.isnan(), b.isnan()), i
            assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), \
                f"leaf #{i} differs: max |d| = {(a - b).abs().nan_to_num(0.0).max()}"
        else:
            assert a == b, i


def _against_eager(body: Callable[[nn.Module], Any], *, offloaded: bool,
                   in_place: bool = False) -> tuple[Any, nn.Module]:
    """``body(model)`` on an eager model and on its checkpointed twin (each layer through
    ``checkpoint_layers``, or ``apply_activation_checkpointing`` with ``in_place``), compared;
    returns the checkpointed run's result and its model."""
    torch.manual_seed(0)
    eager = _Net()
    model = copy.deepcopy(eager)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu") \
        if offloaded else False
    if in_place:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    else:
        pytree_ckpt.checkpoint_layers(model.layers, offload=manager)
    expected = body(eager)
    _Layer.calls = 0
    got = body(model)
    _same(expected, got)
    if offloaded:
        assert isinstance(manager, offload.OffloadManager)
        stats = manager.stats()
        assert stats["offloaded_bytes"] > 0 and stats["host_buffers_in_use"] == 0
    return got, model


_OFFLOAD = pytest.mark.parametrize("offloaded", [False, True], ids=["no-offload", "offload"])


def _micro_batches(model: nn.Module, modes: tuple[bool, ...], *, steps: int = 2,
                   read_clones: bool = False) -> Any:
    """``steps`` SGD steps of one micro-batch per mode (train or eval), all forwards before one
    backward; with ``read_clones``, each eval micro-batch runs on clones of the buffers (what
    it reads, as its forward read it, also in its backward)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(steps):
        losses = []
        for i, training in enumerate(modes):
            model.train(training)
            torch.manual_seed(10 * step + i)
            x = _batch(10 * step + i)
            if read_clones and not training:
                buffers = {name: b.clone() for name, b in model.named_buffers()}
                losses.append(torch.func.functional_call(model, buffers, (x,)))
            else:
                losses.append(model(x))
        model.train()
        sum(losses).backward()
        results.append(([loss.detach() for loss in losses], _grads(model)))
        optimizer.step()
        optimizer.zero_grad()
    return results, _state(model)


_MODES = pytest.mark.parametrize("modes", [(True, False, True), (False, True, True)],
                                 ids=["train-eval-train", "eval-train-train"])


@_OFFLOAD
@_MODES
def test_an_eval_micro_batch_before_a_train_one_gets_the_gradient_of_what_it_read(
        offloaded: bool, modes: tuple[bool, ...]) -> None:
    # An eval micro-batch's BatchNorm reads the running statistics as they are at its call; a
    # later train micro-batch of the same step changes them before backward. The replay must
    # read them as the forward did (it read the later ones). The reference is eager with the
    # eval micro-batches on clones of the buffers: plain eager's backward reads the later
    # ones (the next test), giving a gradient of no function it computed.
    def body(model: nn.Module) -> Any:
        wrapped = pytree_ckpt.is_checkpointed(model.layers[0])
        return _micro_batches(model, modes, read_clones=not wrapped)

    _against_eager(body, offloaded=offloaded)
    assert _Layer.calls == 2 * 2 * 3 * 3  # steps x micro-batches x layers, twice each


class _CountsWithGrad(nn.Module):
    """Counts its calls where grad is enabled: code written for reentrant checkpointing, whose
    replay is the only pass with grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.seen += 1
        return torch.tanh(self.lin(x))


def test_a_count_only_replays_make_is_kept_over_micro_batches() -> None:
    # A later call's replay changes the buffer before an earlier call's replay: no forward
    # changed it, so the earlier replay counts on the module's own (not on a copy of what its
    # forward read, which would lose its count). Guards NOTE [state read, then changed by a
    # later call].
    seen = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _CountsWithGrad()
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        for step in range(2):
            sum(layer(_batch(i)[:, :4]).sum() for i in range(3)).backward()
        seen.append(layer.seen.item())
    assert seen == [6, 6]


@_MODES
def test_eager_itself_reads_the_later_running_statistics_in_an_eval_micro_batchs_backward(
        modes: tuple[bool, ...]) -> None:
    # torch's batch-norm kernel updates the running statistics without moving their version,
    # so an eval-mode call's backward, which reads them, uses the later train micro-batch's
    # update without an error: docs/limits.md says so (the boundary gives the gradient of
    # what was computed instead). If torch changes this, the row and the test above change.
    torch.manual_seed(0)
    plain = _Net()
    clones = copy.deepcopy(plain)
    expected = _micro_batches(clones, modes, steps=1, read_clones=True)
    got = _micro_batches(plain, modes, steps=1)
    _same(expected[0][0][0], got[0][0][0])  # the losses: the forwards read the same
    with pytest.raises(AssertionError, match="differs"):
        _same(expected[0][0][1], got[0][0][1])
