"""Stateful normalization layers as users write them (plain torch), inside checkpointed
blocks: two train micro-batches around an eval one under no_grad, backwards in reversed order,
an SGD step, two steps; loss, every gradient, every buffer and plain attribute compared bit for
bit with an eager twin (helper PK)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import pytree_ckpt

D = 8


class _BatchRenorm(nn.Module):
    """r/d clipped from the running statistics, r_max/d_max keyed on a plain int step count."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.register_buffer("rm", torch.zeros(D))
        self.register_buffer("rv", torch.ones(D))
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return (x - self.rm) / (self.rv + 1e-5).sqrt() * self.w + self.b
        m, v = x.mean(0), x.var(0, unbiased=False)
        std, rstd = (v + 1e-5).sqrt(), (self.rv + 1e-5).sqrt()
        r_max, d_max = 1.0 + min(self.steps, 5) * 0.4, min(self.steps, 5) * 0.5
        r = (std.detach() / rstd).clamp(1 / r_max, r_max)
        d = ((m.detach() - self.rm) / rstd).clamp(-d_max, d_max)
        with torch.no_grad():
            self.rm += 0.1 * (m - self.rm)
            self.rv += 0.1 * (v - self.rv)
        self.steps += 1
        return ((x - m) / std * r + d) * self.w + self.b


class _EvoNormB0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g, self.b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.v = nn.Parameter(torch.ones(D))
        self.register_buffer("running_var", torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            var = x.var(0, unbiased=False)
            with torch.no_grad():
                self.running_var.mul_(0.9).add_(0.1 * var)
        else:
            var = self.running_var
        inst = (x.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt()
        return x / torch.maximum((var + 1e-5).sqrt(), self.v * x + inst) * self.g + self.b


class _SwitchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.mw, self.vw = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        self.register_buffer("rm", torch.zeros(1, D))
        self.register_buffer("rv", torch.zeros(1, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mln, vln = x.mean(1, keepdim=True), x.var(1, keepdim=True)
        if self.training:
            mbn, vbn = x.mean(0, keepdim=True), x.var(0, keepdim=True)
            with torch.no_grad():
                self.rm.mul_(0.9).add_(0.1 * mbn)
                self.rv.mul_(0.9).add_(0.1 * vbn)
        else:
            mbn, vbn = self.rm, self.rv
        mw, vw = self.mw.softmax(0), self.vw.softmax(0)
        m, v = mw[0] * mln + mw[1] * mbn, vw[0] * vln + vw[1] * vbn
        return (x - m) / (v + 1e-5).sqrt() * self.w + self.b


class _RunningMeanStd(nn.Module):
    """An observation normalizer keeping count, mean and var as plain floats."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            bm, bv, bc = float(x.detach().mean()), float(x.detach().var()), x.numel()
            delta, total = bm - self.mean, self.count + bc
            m2 = self.var * self.count + bv * bc + delta ** 2 * self.count * bc / total
            self.mean, self.var, self.count = self.mean + delta * bc / total, m2 / total, total
        return (x - self.mean) / math.sqrt(self.var + 1e-8)


class _GhostBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return torch.cat([self.bn(c) for c in x.chunk(2, 0)])
        return self.bn(x)


class _InstanceNormTracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = nn.InstanceNorm1d(2, affine=True, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(x.view(x.shape[0], 2, D // 2)).view(x.shape[0], D)


NORMS: dict[str, Callable[[], nn.Module]] = {
    "batch_norm_cumulative": lambda: nn.BatchNorm1d(D, momentum=None),
    "batch_norm_no_running_stats": lambda: nn.BatchNorm1d(D, track_running_stats=False),
    "instance_norm_tracked": _InstanceNormTracked,
    "batch_renorm": _BatchRenorm,
    "evonorm_b0": _EvoNormB0,
    "switchable_norm": _SwitchNorm,
    "running_mean_std": _RunningMeanStd,
    "ghost_batch_norm": _GhostBatchNorm,
}


class _Block(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(D, D), norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


def _state(model: nn.Module) -> list[object]:
    out: list[object] = []
    for module in model.modules():
        out += [b.clone() for b in module.buffers(recurse=False)]
        out += [v for k, v in sorted(vars(module).items())
                if not k.startswith("_") and type(v) in (int, float, bool)]
    out += [p.detach().clone() for p in model.parameters()]
    return out


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(NORMS))
def test_a_stateful_norm_with_an_eval_micro_batch_between_train_ones_matches_eager(
        name: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_Block(NORMS[name]()), _Block(NORMS[name]()), nn.Linear(D, 1))
    ours = copy.deepcopy(eager)
    for block in ours[:2]:
        pytree_ckpt.apply_activation_checkpointing(block)
    steps = [[torch.randn(6, D) for _ in range(3)] for _ in range(2)]
    per_model = []
    for model in (eager, ours):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen: list[object] = []
        for xs in steps:
            losses = []
            for mode, x in zip("tet", xs):
                model.train(mode == "t")
                if mode == "e":
                    with torch.no_grad():
                        seen.append(model(x))
                else:
                    losses.append(model(x).square().mean())
            for loss in reversed(losses):
                loss.backward()
            seen += [loss.detach() for loss in losses]
            seen += [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            model.train()
            seen += _state(model)
        per_model.append(seen)
    assert len(per_model[0]) == len(per_model[1])
    assert all(_equal(a, b) for a, b in zip(*per_model))


def test_functional_call_with_fresh_buffers_per_micro_batch_matches_eager() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_Block(nn.BatchNorm1d(D)), _Block(_BatchRenorm()), nn.Linear(D, 1))
    ours = copy.deepcopy(eager)
    for block in ours[:2]:
        pytree_ckpt.apply_activation_checkpointing(block)
    xs = [torch.randn(6, D) for _ in range(2)]
    per_model = []
    for model in (eager, ours):
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        losses = []
        for x in xs:
            buffers = {k: v.clone() for k, v in buffers.items()}
            losses.append(torch.func.functional_call(model, {**params, **buffers}, (x,))
                          .square().mean())
        for loss in reversed(losses):
            loss.backward()
        per_model.append([p.grad for p in params.values()] + list(buffers.values()))
    assert all(torch.equal(a, b) for a, b in zip(*per_model))
