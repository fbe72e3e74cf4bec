"""Feature combinations against an eager twin, bit for bit (fp32, and bf16 autocast on CPU).

A sweep over every boundary kind x offload x output discard x frozen-result replay x census x
model feature x training schedule found each combination exact (apart from the cases
docs/limits.md lists). This file pins the combinations no other test covers: each case turns
on many features of one small layer at once (dropout, a batch norm, in-place ops, transposed
outputs, a PyTree output with non-tensor leaves, a data-dependent MoE branch with replayed
routing, a discarded norm output) and checks the loss, every gradient, the buffers and the
parameters after the optimizer, how many times the layers ran, what offload moved, and that
nothing is left held or warned.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import (ActivationCensus, KeptCallables, KeptOps, RecomputeConfig,
                         apply_recompute_config, reuse_during_recompute)
from tests.pytree_ckpt.models import project_norm

WIDTH, BATCH, LAYERS = 16, 8, 4
# Layer calls by id(layer): outside the module, since a number on it would be changed again by
# the replay (warned: docs/limits.md, 'State the forward changes').
RUNS: collections.Counter[int] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Features:
    tied: bool = True  # layer 1 uses layer 0's projection
    frozen: bool = False  # LoRA-like: the input projection and the norm take no gradient
    inputs_need_grad: bool = True
    autocast: bool = False


def route(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class Layer(nn.Module):
    def __init__(self, features: Features, shared: nn.Linear | None) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = shared if shared is not None else nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.gate = nn.Linear(WIDTH, 2)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        if features.frozen:
            self.inp.requires_grad_(False)
            self.norm.requires_grad_(False)
        self.discard = False  # the checkpointed twin discards the norm's output

    def mix(self, a: torch.Tensor) -> torch.Tensor:
        return project_norm(self.proj, self.norm, a, discard=self.discard)

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        RUNS[id(self)] += 1
        h = x["h"].t()  # received transposed: a non-contiguous input
        out = self.drop(self.mix(self.inp(h).relu_()))
        out = self.bn(out.mul_(0.5))
        logits = self.gate(out)
        ids = reuse_during_recompute(route, logits.detach())  # frozen routing
        probs = logits.softmax(-1)
        moe = torch.zeros_like(out)
        for e, expert in enumerate(self.experts):
            chosen = (ids == e).nonzero().squeeze(1)
            if chosen.numel():  # an expert that got no token takes no gradient
                moe = moe.index_add(0, chosen, expert(out[chosen]) * probs[chosen, e:e + 1])
        out = out + moe
        out = out + self.inner(out)
        return {"h": (h + out).t(), "tag": x["tag"], "meta": ("layer", 2), "ids": ids}


class Net(nn.Module):
    def __init__(self, features: Features) -> None:
        super().__init__()
        first = Layer(features, None)
        self.layers = nn.ModuleList(
            [first, *(Layer(features, first.proj if features.tied and i == 1 else None)
                      for i in range(1, LAYERS))])
        self.call: Callable[[nn.Module, Any], Any] = lambda layer, x: layer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tree: dict[str, Any] = {"h": x.t(), "tag": "input"}
        for layer in self.layers:
            tree = self.call(layer, tree)
        return tree["h"].t().float().square().mean()


def manager(prefetch: int) -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=prefetch),
                                  device="cpu")


# Each wraps the twin's layers one way and returns how many of them are checkpointed.
def nested(model: Net, mgr: Any) -> int:
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=mgr)
        pytree_ckpt.apply_activation_checkpointing(layer.inner, offload=mgr)
    return LAYERS


def kept_method_with_discard(model: Net, mgr: Any) -> int:
    # The kept method runs the output discard: kept in the original pass, not replayed.
    return len(apply_recompute_config(model.layers, RecomputeConfig(1.0, save=["attn"]),
                                      {"attn": KeptCallables("Layer.mix")}, offload=mgr))


def kept_ops(model: Net, mgr: Any) -> int:
    return len(apply_recompute_config(model.layers, RecomputeConfig(1.0, save=["attn"]),
                                      {"attn": KeptOps("aten::addmm")}, offload=mgr))


def half_the_layers(model: Net, mgr: Any) -> int:
    return len(pytree_ckpt.checkpoint_layers(model.layers, ratio=0.5, offload=mgr))


def functional(model: Net, mgr: Any) -> int:
    wrapped = {id(layer): pytree_ckpt.checkpointed(layer, offload=mgr) for layer in model.layers}
    model.call = lambda layer, x: wrapped[id(layer)](x)
    return LAYERS


def inputs(features: Features, step: int) -> torch.Tensor:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
    return x.requires_grad_(features.inputs_need_grad)


def forward(model: Net, features: Features, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs(features, step)
    torch.manual_seed(100 + step)  # the same dropout masks for both twins
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=features.autocast):
        return model(x), x


def grads(model: Net, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in (*model.parameters(), x)]


def train(model: Net, features: Features, schedule: str) -> list[Any]:
    """What the twins must agree on: losses, gradients, buffers, parameters after SGD."""
    seen: list[Any] = []
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if schedule == "three steps":
        for step in range(3):
            sgd.zero_grad(set_to_none=True)
            loss, x = forward(model, features, step)
            loss.backward()
            seen += [loss.detach(), *grads(model, x)]
            sgd.step()
    elif schedule == "two micro-batches, backwards in reverse":
        (first, x0), (second, x1) = forward(model, features, 0), forward(model, features, 1)
        (second / 2).backward()
        (first / 2).backward()
        seen += [first.detach(), second.detach(), *grads(model, x0), x1.grad]
        sgd.step()
    elif schedule == "backward twice with retain_graph":
        loss, x = forward(model, features, 0)
        loss.backward(retain_graph=True)
        seen += grads(model, x)
        loss.backward()
        seen += [loss.detach(), *grads(model, x)]
    elif schedule == "autograd.grad of the trainable parameters":
        loss, x = forward(model, features, 0)
        wanted = [p for p in model.parameters() if p.requires_grad]
        seen += [loss.detach(), *torch.autograd.grad(loss, wanted, allow_unused=True)]
    elif schedule == "an eval forward between forward and backward":
        loss, x = forward(model, features, 0)
        model.eval()
        with torch.no_grad():
            seen.append(forward(model, features, 5)[0])
        model.train()
        loss.backward()
        seen += [loss.detach(), *grads(model, x)]
        sgd.step()
    else:
        raise AssertionError(schedule)
    return [*seen, *(b.clone() for b in model.buffers()), *(p.detach().clone()
                                                             for p in model.parameters())]


CASES = [  # (wrap, prefetch or None for no offload, features, schedule, census)
    (nested, 2, Features(), "two micro-batches, backwards in reverse", True),
    (kept_method_with_discard, 0, Features(), "backward twice with retain_graph", True),
    (kept_ops, 1, Features(tied=False, autocast=True), "three steps", False),
    (half_the_layers, None, Features(inputs_need_grad=False), "three steps", True),
    (nested, 1, Features(frozen=True, inputs_need_grad=False),
     "autograd.grad of the trainable parameters", True),
    (functional, 2, Features(), "an eval forward between forward and backward", True),
]


@pytest.mark.parametrize("wrap, prefetch, features, schedule, census", CASES,
                         ids=[f"{c[0].__name__}-{c[3]}" for c in CASES])
def test_many_features_at_once_match_the_eager_twin_exactly(
        wrap: Callable[[Net, Any], int], prefetch: int | None, features: Features,
        schedule: str, census: bool) -> None:
    RUNS.clear()
    torch.manual_seed(0)
    eager = Net(features)
    twin = copy.deepcopy(eager)
    mgr = manager(prefetch) if prefetch is not None else False
    checkpointed = wrap(twin, mgr)
    # Output discard outside a boundary refuses a second backward (docs/discard.md): only
    # checkpointed layers discard.
    for layer in twin.layers[:checkpointed]:
        layer.discard = True
    expected = train(eager, features, schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these combinations warns
        if census:
            with ActivationCensus(twin) as counted:
                got = train(twin, features, schedule)
            assert counted.total_bytes == 0 and not counted.flagged()
        else:
            got = train(twin, features, schedule)
    assert len(expected) == len(got)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert (want is None) == (have is None), i
        if want is not None:
            assert torch.equal(want, have), f"#{i}: max |d| = {(want - have).abs().max()}"
    # How many times each layer ran: eager once per forward; a checkpointed one once more per
    # backward that reached it (its replay).
    forwards = [RUNS[id(layer)] for layer in eager.layers]
    backwards = {"three steps": 3, "two micro-batches, backwards in reverse": 2,
                 "backward twice with retain_graph": 2,
                 "autograd.grad of the trainable parameters": 1,
                 "an eval forward between forward and backward": 1}[schedule]
    assert [RUNS[id(layer)] for layer in twin.layers] == [
        n + (backwards if i < checkpointed else 0) for i, n in enumerate(forwards)]
    if mgr:
        stats = mgr.stats()
        assert stats["offloaded_bytes"] > 0 and stats["host_buffers_in_use"] == 0
        if schedule != "backward twice with retain_graph":  # restored once per backward
            assert stats["restored_bytes"] == stats["offloaded_bytes"]
