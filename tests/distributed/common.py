"""Shared by the scale-out tests: the worker's results, the eager reference, comparisons."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, make_packed_batch

SEQ_LENS = (20, 12)
WORLD = 2
SCENARIOS = ("fsdp", "ddp", "fsdp_compile")
WORKER_LR = 1e-3  # the worker's AdamW step before its distributed checkpoint
LAYERS = [f"layers.{i}" for i in range(8)]
# How often each FSDP group / hooked module is called in one forward: the MTP layer is shared
# by both depths.
CALLS_PER_FORWARD = {**{name: 1 for name in LAYERS}, "mtp_layers.0": 2, "<root>": 1}


class WorkerRun:
    """What the two ranks of ``worker.py`` recorded, scenario by scenario."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def result(self, scenario: str, rank: int) -> dict[str, Any]:
        result = json.loads((self.out / f"{scenario}.rank{rank}.json").read_text())
        if not result["ok"]:
            pytest.fail(f"scenario {scenario!r} failed on rank {rank}:\n{result['error']}")
        return result

    def results(self, scenario: str) -> list[dict[str, Any]]:
        return [self.result(scenario, rank) for rank in range(WORLD)]

    def grads(self, scenario: str) -> dict[str, torch.Tensor | None]:
        self.result(scenario, 0)
        return torch.load(self.out / f"{scenario}.grads.pt")


def events(step: dict[str, Any], kind: str) -> Counter[tuple[str, ...]]:
    """The ``kind|what...|part|phase`` events of one recorded step, as tuples without kind."""
    found: Counter[tuple[str, ...]] = Counter()
    for key, count in step["events"].items():
        fields = tuple(key.split("|"))
        if fields[0] == kind:
            found[fields[1:]] += count
    return found


def build() -> tuple[GlmDsaConfig, GlmDsaForCausalLM]:
    config = GlmDsaConfig()
    torch.manual_seed(0)
    return config, GlmDsaForCausalLM(config)


class Reference:
    """Single-process eager runs of the plain model on each rank's batch."""

    def __init__(self) -> None:
        config, model = build()
        self.losses: list[float] = []
        per_rank: list[dict[str, torch.Tensor | None]] = []
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            loss = model(**make_packed_batch(config, SEQ_LENS, seed=rank))["loss"]
            loss.backward()
            self.losses.append(loss.item())
            per_rank.append({n: None if p.grad is None else p.grad.clone()
                             for n, p in model.named_parameters()})
        # What data parallelism computes: the mean of the ranks' gradients.
        self.grads: dict[str, torch.Tensor | None] = {
            name: None if grad is None else (grad + per_rank[1][name]) / WORLD
            for name, grad in per_rank[0].items()}


def assert_grads_equal(expected: dict[str, Any], got: dict[str, Any], *,
                       rtol: float = 0.0, atol: float = 0.0) -> None:
    """Same names, ``None`` exactly where expected; equal bit for bit unless a tolerance."""
    assert list(got) == list(expected)
    for name, want in expected.items():
        if want is None:
            assert got[name] is None, f"{name}: expected no gradient"
            continue
        assert got[name] is not None, f"{name}: no gradient"
        if rtol == atol == 0.0:
            assert torch.equal(want, got[name]), \
                f"{name}: max |d| = {(want - got[name]).abs().max().item()}"
        else:
            torch.testing.assert_close(got[name], want, rtol=rtol, atol=atol,
                                       msg=lambda m, _name=name: f"{_name}: {m}")


def assert_tree_equal(expected: Any, got: Any, where: str) -> None:
    """``got`` holds what ``expected`` does, dicts and lists by their keys and items, tensors
    bit for bit (``torch.equal``), ``None`` as ``None``; ``where`` names the place."""
    if isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_tree_equal(expected[key], got[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_tree_equal(a, b, f"{where}[{i}]")
    elif expected is None:
        assert got is None, where
    else:
        assert got is not None and torch.equal(expected, got), \
            f"{where}: max |d| = {(expected.float() - got.float()).abs().max().item()}"
