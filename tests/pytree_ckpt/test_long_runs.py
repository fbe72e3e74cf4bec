"""Long runs: what a process keeps across many steps and many models must not grow with them.

A training run is hundreds of thousands of steps, a sweep or an eval loop builds a model per
trial or checkpoint: a record, registry entry or cycle left per step or per model is a leak.
Each test compares what is kept after a few steps (or models) with what is kept after more.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import (ActivationCensus, CheckpointWithoutOutput, KeptCallables,
                         RecomputeConfig, apply_recompute_config, checkpoint_layers,
                         reuse_during_recompute)

WIDTH = 16
LENGTHS = (8, 24, 40, 56, 72)  # varying lengths: fresh addresses each step


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        discard = CheckpointWithoutOutput()
        out = self.proj(discard.checkpoint(self.norm, h)).relu()
        discard.discard_output_and_register_recompute(out)
        return h + out


def _route(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class _AllFeatures(_Layer):
    """A kept method (a save unit by callable), a frozen result replayed, an output discard."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 2)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn(h).tanh()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = super().forward(h) + self.attention(h)
        ids = reuse_during_recompute(_route, self.gate(h).detach())
        return h * (ids.unsqueeze(1) + 1)


def _all_features(manager: OffloadManager) -> nn.Sequential:
    model = nn.Sequential(*(_AllFeatures() for _ in range(3)))
    apply_recompute_config(model, RecomputeConfig(1.0, save=["attn"]),
                           {"attn": KeptCallables("_AllFeatures.attention")}, offload=manager)
    return model


def _live_tensors() -> int:
    # type(), not isinstance: that reads __class__, which a deprecated torch alias warns on
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def _model(manager: OffloadManager | None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Layer() for _ in range(3)))
    checkpoint_layers(model, offload=manager if manager is not None else False)
    return model


def _step(model: nn.Module, step: int) -> None:
    x = torch.randn(LENGTHS[step % len(LENGTHS)], WIDTH, requires_grad=True)
    model(x).square().mean().backward()


def test_a_census_open_for_many_steps_keeps_records_only_for_what_is_still_held() -> None:
    # A census kept open over a training run (a monitor reading it between steps) kept one
    # record per storage ever saved: keyed by address, a record was replaced only when a new
    # storage came to the same address, and a discarded output's record never (it is filed
    # under a key of its own), so the records grew with every step (about 30 a step here, a
    # few thousand a step in an LLM) and _note_refilled, which reads them all, slowed down.
    model = _model(OffloadManager(OffloadConfig(min_bytes=0), device="cpu"))
    records = []
    with ActivationCensus(model) as census:
        for step in range(20):
            _step(model, step)
            assert census.total_bytes == 0 and not census.discarded_bytes
            records.append(len(census._entries))
    one_step = records[0]
    # Bounded by what one step saves (records of dead storages are dropped in batches, once
    # they reach as many again as the records left after the last drop).
    assert max(records[-5:]) <= 2 * one_step + 64, records


def test_models_made_one_after_another_leave_nothing_alive_once_deleted() -> None:
    # A sweep or an eval loop builds a model per trial: the library's registries (kept-method
    # owners, boundaries, frames, a manager's passes) must hold none of a deleted model,
    # whether it was made on the CPU or on the meta device and materialised with to_empty.
    def trial(step: int) -> list[weakref.ref[object]]:
        manager = OffloadManager(OffloadConfig(min_bytes=0, prefetch=1), device="cpu")
        if step % 2:  # made on the meta device, checkpointed, then materialised
            with torch.device("meta"):
                model = _all_features(manager)
            model.to_empty(device="cpu")
            for parameter in model.parameters():
                nn.init.normal_(parameter, std=0.2)
        else:
            model = _all_features(manager)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(LENGTHS[step % len(LENGTHS)], WIDTH, requires_grad=True)
        with ActivationCensus(model) as census:
            for _ in range(2):
                model(x).square().mean().backward()
                sgd.step()
            dropped = model(x)  # a graph dropped without backward
        assert census.total_bytes > 0 and manager.stats()["offloaded_bytes"] > 0
        del dropped
        return [weakref.ref(model), weakref.ref(model[0].attn.weight), weakref.ref(x),
                weakref.ref(manager), weakref.ref(census)]

    counts = []
    for step in range(6):
        refs = trial(step)
        gc.collect()
        assert [ref() for ref in refs] == [None] * len(refs)
        counts.append(_live_tensors())
    assert counts[2:] == [counts[2]] * 4, counts


def test_a_checkpointed_step_leaves_no_reference_cycle_to_collect() -> None:
    # A cycle made per step that reaches activations frees them only at the collector's
    # next run: on a GPU, held longer than eager holds them. With the collector off, each
    # step must free what eager frees, and leave nothing for it.
    model = _all_features(OffloadManager(OffloadConfig(min_bytes=0, prefetch=1), device="cpu"))
    for step in range(2):  # warm-up: first-call caches
        _step(model, step)
    gc.collect()
    gc.disable()
    try:
        counts = []
        for step in range(8):
            _step(model, step)
            with torch.no_grad():
                model(torch.randn(4, WIDTH))
            dropped = model(torch.randn(LENGTHS[step % len(LENGTHS)], WIDTH))
            del dropped
            counts.append(_live_tensors())
        collected = gc.collect()
    finally:
        gc.enable()
    assert counts[5:] == [counts[5]] * 3, counts  # after every length was seen once
    assert collected == 0


def test_the_table_of_buffers_forwards_changed_stays_bounded_and_tells_reused_ids_apart(
        ) -> None:
    # NOTE [forward writes, by id] (forward_writes.py): a batch norm in training writes its
    # three buffers into the table at every call; 400 models made and dropped one after
    # another must not leave 1,200 entries (past the first sweep), and an entry whose tensor died must not count for
    # a new tensor that took its id.
    from pytree_ckpt import forward_writes

    for _ in range(400):
        layer = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
        checkpoint_layers([layer])
        layer(torch.randn(4, WIDTH, requires_grad=True)).sum().backward()
        del layer
    gc.collect()
    alive = sum(1 for ref, _ in forward_writes._WRITES.values() if ref() is not None)
    assert len(forward_writes._WRITES) < max(forward_writes._SWEEP_AT, 2 * alive) + 3, \
        (len(forward_writes._WRITES), alive)
    dead = torch.zeros(3)
    forward_writes.note_forward_write(dead)
    key = id(dead)
    del dead
    # Another tensor at that id (as CPython reuses ids) is not taken for the dead one.
    impostor = torch.zeros(3)
    forward_writes._WRITES[id(impostor)] = forward_writes._WRITES.pop(key)
    assert not forward_writes.written_by_a_forward_since((("b", impostor),), [-1])
    forward_writes.note_forward_write(impostor)
    assert forward_writes.written_by_a_forward_since((("b", impostor),), [-1])


def _picker(scorer: nn.Module):  # type: ignore[no-untyped-def]
    """A routing function made per model (stored in __init__, as the frames ask): it calls a
    helper closing over the model's scorer."""
    def score(t: torch.Tensor) -> torch.Tensor:
        return scorer(t)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return score(t).argmax(-1)
    return pick


class _PickingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scorer = nn.Linear(WIDTH, 4)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.pick = _picker(self.scorer)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(self.pick, h.detach())
        return self.proj(h) * (ids.unsqueeze(-1) + 1)


def test_models_whose_reused_function_calls_a_helper_made_per_model_are_freed_once_deleted(
        ) -> None:
    from pytree_ckpt import function_reach

    scorers = []
    entries = []
    for step in range(6):
        layer = _PickingLayer()
        checkpoint_layers([layer])
        layer(torch.randn(LENGTHS[step % len(LENGTHS)], WIDTH, requires_grad=True)
              ).square().mean().backward()
        assert layer.proj.weight.grad is not None
        scorers.append(weakref.ref(layer.scorer.weight))
        del layer
        gc.collect()
        entries.append(len(function_reach._CODE_READING))
    alive = sum(ref() is not None for ref in scorers)
    assert alive == 0, f"{alive} deleted models' scorer weights alive; entries {entries}"
    assert entries[2:] == [entries[2]] * 4, entries


def test_a_module_built_elsewhere_each_step_does_not_make_every_layer_check_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytree_ckpt import recompute

    checks = []
    original = recompute.is_verified

    def counted(module: nn.Module, switches: object) -> bool:
        verified = original(module, switches)
        checks.append(verified)
        return verified

    monkeypatch.setattr(recompute, "is_verified", counted)
    model = _model(None)
    for step in range(2):  # warm-up: the first calls verify
        _step(model, step)
    unverified = []
    for step in range(4):
        nn.Sequential(nn.Identity(), nn.BatchNorm1d(4))  # unrelated to the model
        checks.clear()
        _step(model, step)
        unverified.append(checks.count(False))
    assert unverified == [0] * 4, unverified


def test_a_deleted_models_code_reading_entry_goes_with_the_helper_it_was_made_for() -> None:
    # Mutation testing (helper EK): with no finalizer on an entry's objects, the entries did
    # not grow (a new model's helper, at the dead one's address, reused the dead one's key and
    # answer), so the test above passed; each entry must go with its helper.
    from pytree_ckpt import function_reach

    gc.collect()
    before = len(function_reach._CODE_READING)
    layer = _PickingLayer()
    checkpoint_layers([layer])
    layer(torch.randn(LENGTHS[0], WIDTH, requires_grad=True)).square().mean().backward()
    assert len(function_reach._CODE_READING) > before
    del layer
    gc.collect()
    assert len(function_reach._CODE_READING) == before


def test_code_reading_reads_a_function_once_while_it_lives(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # Mutation testing (helper EK): the cache lookup in function_reach.code_reading dropped,
    # every call read the code again (and added finalizers), and the suite passed.
    from pytree_ckpt import function_reach

    reads = []
    original = function_reach._code_reading

    def counted(*args: Any) -> Any:
        reads.append(args)
        return original(*args)

    monkeypatch.setattr(function_reach, "_code_reading", counted)

    def scorer(x: torch.Tensor) -> torch.Tensor:
        return x.sigmoid() if torch.is_grad_enabled() else x

    for _ in range(3):
        assert function_reach.code_reading(scorer, "is_grad_enabled") is not None
    assert len(reads) == 1
