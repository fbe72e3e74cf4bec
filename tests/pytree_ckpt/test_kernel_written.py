"""A parameter written through .data (docs/limits.md, the paragraph near "Glow's ActNorm";
kernel_written.py WrittenThroughData.refuse_written_again)."""
import copy

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError


class _ActNorm(nn.Module):
    def __init__(self, by_output: bool) -> None:
        super().__init__()
        self.loc, self.scale = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(4))
        self.initialized, self.by_output = False, by_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                if self.by_output:  # a rescale by a statistic of the output
                    self.scale.data.mul_(1 / ((x + self.loc) * self.scale).std(0))
                else:  # Glow's: a copy of the input's statistics
                    self.scale.data.copy_(1 / x.std(0))
            self.initialized = True
        return (x + self.loc) * self.scale


def _steps(by_output: bool, warm: bool) -> bool:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), _ActNorm(by_output), nn.Linear(4, 1))
    model = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(model[1])
    if warm:  # the refusal's tip: initialise with one forward under no_grad
        x0 = torch.randn(8, 4)
        with torch.no_grad():
            eager(x0), model(x0)
    opts = [torch.optim.SGD(m.parameters(), 0.1) for m in (eager, model)]
    for _ in range(3):
        x = torch.randn(8, 4)
        for m, opt in zip((eager, model), opts):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    return all(torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters()))


def test_glow_actnorm_initialised_through_data_gives_eager_parameters() -> None:
    assert _steps(by_output=False, warm=False)


def test_actnorm_rescaled_by_its_output_through_data_is_refused_and_the_tip_gives_eager() -> None:
    with pytest.raises(CheckpointError, match="scale through .data again"):
        _steps(by_output=True, warm=False)
    assert _steps(by_output=True, warm=True)


class _Momentum(nn.Module):
    """A key encoder updated through .data at every call beside a call count."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.k.requires_grad_(False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
        self.calls += 1
        return (self.q(x) * self.k(x)).sum(-1)


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, State the forward "
                   "changes: a buffer written with no version moving; a frozen parameter's "
                   ".data write is state, not summed) (helper OP)")
def test_a_frozen_key_encoder_written_through_data_gives_eager_numbers_or_is_refused() -> None:
    torch.manual_seed(0)
    eager = _Momentum()
    model = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(model)
    opts = [torch.optim.SGD(m.q.parameters(), 0.1) for m in (eager, model)]
    try:
        for _ in range(2):
            x = torch.randn(8, 4)
            for m, opt in zip((eager, model), opts):
                opt.zero_grad()
                m(x).pow(2).sum().backward()
                opt.step()
    except CheckpointError:
        return
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(),
                                                 model.state_dict().values()))
