"""The reference model with checkpoint + frozen-result replay + offload, against its eager twin."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import pytree_ckpt
from examples.glm_dsa import make_packed_batch
from examples.glm_dsa.decoder import DecoderLayer
from examples.glm_dsa.mlp import SwiGLU
from offload import OffloadConfig, OffloadManager
from tests.examples.test_glm_dsa_model import (SEQ_LENS, _one_thread, assert_same_grads, build,
                                               grads, train_step)

__all__ = ["_one_thread"]  # the module-scoped one-thread fixture applies here too


def offloaded_twin(model: Any, **config: Any) -> tuple[Any, OffloadManager]:
    manager = OffloadManager(OffloadConfig(**{"min_bytes": 0, **config}), device="cpu")
    twin = copy.deepcopy(model)
    twin.checkpoint_layers(1.0, offload=manager)
    return twin, manager


@pytest.mark.parametrize("overrides", [{}, {"moe": True, "dropout": 0.2}])
def test_checkpoint_replay_and_offload_give_bit_identical_loss_and_grads(
        overrides: dict[str, Any]) -> None:
    config, eager = build(**overrides)
    model, manager = offloaded_twin(eager)
    batch = make_packed_batch(config, SEQ_LENS)
    assert torch.equal(train_step(eager, batch), train_step(model, batch))
    assert_same_grads(grads(eager), grads(model))
    stats = manager.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] > 0
    # Both ways back ran: copies from host, and the last window's bytes reused as they were.
    assert stats["restored_bytes"] > stats["reused_bytes"] > 0
    assert stats["host_buffers_in_use"] == 0


def test_top_k_ids_and_mtp_depths_are_offloaded_once_and_restored_exactly() -> None:
    config, eager = build()
    model, manager = offloaded_twin(eager)
    batch = make_packed_batch(config, SEQ_LENS)
    total = sum(SEQ_LENS)
    offloaded: list[torch.Tensor] = []
    copies: dict[int, torch.Tensor] = {}  # one entry per host copy
    restored: list[torch.Tensor] = []
    pack, unpack = manager._pack, manager._unpack

    def spy_pack(window: Any, t: torch.Tensor) -> Any:
        out = pack(window, t)
        if out is not t:
            offloaded.append(t.detach().clone())
            copies.setdefault(id(out.copy), t)
        return out

    def spy_unpack(handle: Any) -> torch.Tensor:
        out = unpack(handle)
        restored.append(out.detach().clone())
        return out

    manager._pack, manager._unpack = spy_pack, spy_unpack  # type: ignore[method-assign]
    seen_ids: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}
    original = DecoderLayer.forward

    def recording_forward(self: DecoderLayer, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("dsa_topk_ids")
        if ids is not None:
            seen_ids[pytree_ckpt.current_phase().value].append(ids.clone())
        return original(self, *args, **kwargs)

    DecoderLayer.forward = recording_forward  # type: ignore[method-assign]
    try:
        train_step(model, batch)
    finally:
        DecoderLayer.forward = original  # type: ignore[method-assign]
    ids_saved = [t for t in offloaded if t.dtype == torch.int64 and t.shape == (total, 8)]
    ids_copied = [t for t in copies.values() if t.dtype == torch.int64 and t.dim() == 2]
    # the frames of the 5 computing passes (layers 0, 1, 2, 6, MTP depth 1) offload the ids
    # they recorded; consumers (layers 3, 4, 5 take layer 2's, 7 takes 6's, MTP depth 2 takes
    # depth 1's) save them again: 10 offloads, but each distinct ids storage is copied once
    assert len(ids_saved) == 10 and len(ids_copied) == 5
    # every consumer's replay received exactly the ids its forward did, from the host copy
    assert len(seen_ids["recompute"]) == len(seen_ids["forward"]) == 5
    for before, after in zip(seen_ids["forward"], reversed(seen_ids["recompute"])):
        assert torch.equal(before, after)
    # hidden states of all 8 decoder layers and both MTP depths went out and came back
    hidden = [t for t in offloaded if t.dtype == torch.float32 and t.shape == (total, 64)]
    assert len(hidden) >= 8 + 2
    assert len(restored) >= len(offloaded)
    assert all(any(torch.equal(r, o) for r in restored) for o in offloaded)


def test_rope_tables_and_cu_seqlens_are_copied_once_per_step_not_once_per_layer() -> None:
    config, eager = build()
    model, manager = offloaded_twin(eager)
    batch = make_packed_batch(config, SEQ_LENS)
    train_step(model, batch)
    total = sum(SEQ_LENS)
    stats = manager.stats()
    per_hidden = total * config.hidden_size * 4
    per_ids = total * config.index_topk * 8
    rope = 2 * total * config.qk_rope_head_dim * 4   # cos and sin
    cu = (len(SEQ_LENS) + 1) * 4
    # 8 decoder layer inputs + 2 MTP depth inputs (hidden) and token embeddings for 2 depths;
    # the ids of the 5 computing passes (held by their frames, received by the consumers)
    expected = (8 + 2) * per_hidden + 2 * per_hidden + 5 * per_ids + rope + cu
    assert stats["offloaded_bytes"] == expected
    assert stats["windows"] == 8 + 2


def test_a_micro_batch_that_raises_mid_layer_in_a_pipeline_schedule_leaves_the_others_eagers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-forward-one-backward step whose second micro-batch raises inside layer 2's MoE
    # (after reuse_during_recompute recorded that layer's top-k ids and its kept ops ran), caught by
    # the loop, which goes on: every feature on (offload, every save unit, MoE routing and
    # top-k replay, shared MTP depths, dropout). Eager's twin raises at the same point, so the
    # RNG draws match; the other micro-batches' losses and the accumulated gradients must be
    # eager's bit for bit, and nothing of the failed one may stay held.
    config, eager = build(moe=True, dropout=0.2)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    model = copy.deepcopy(eager)
    model.checkpoint_layers(1.0, offload=manager, save=True)
    batches = [make_packed_batch(config, (9 + i, 7 + 2 * i), seed=i) for i in range(4)]
    failing: set[int] = set()
    forward = SwiGLU.forward

    def raising(self: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        if id(self) in failing:
            failing.clear()
            raise RuntimeError("a bad micro-batch")
        return forward(self, x)

    monkeypatch.setattr(SwiGLU, "forward", raising)

    def step(twin: Any, census: pytree_ckpt.ActivationCensus | None = None) -> list[torch.Tensor]:
        torch.manual_seed(3)  # once: the failed forward's draws must match eager's too
        first = twin(**batches[0])["loss"]
        failing.add(id(twin.layers[2].mlp.experts[1]))
        with pytest.raises(RuntimeError, match="a bad micro-batch"):
            twin(**batches[1])
        first.backward()
        third = twin(**batches[2])["loss"]
        fourth = twin(**batches[3])["loss"]
        third.backward()
        fourth.backward()
        return [first.detach(), third.detach(), fourth.detach()]

    expected = step(eager)
    with pytree_ckpt.ActivationCensus(model) as census:
        got = step(model)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_same_grads(grads(eager), grads(model))
    gc.collect()
    assert census.total_bytes == 0
    stats = manager.stats()
    assert stats["host_buffers_in_use"] == 0
    # The three finished micro-batches came back whole; the failed one's windows never did.
    assert stats["offloaded_bytes"] > stats["restored_bytes"] + stats["reused_bytes"] > 0


def test_ids_held_by_a_replay_frame_leave_the_device_with_offload() -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    config, eager = build()
    model, manager = offloaded_twin(eager)
    source = model.layers[2]
    refs: list[StorageWeakRef] = []
    source.register_forward_hook(
        lambda m, a, out: refs.append(StorageWeakRef(out["dsa_topk_ids"].untyped_storage())))
    loss = model(**make_packed_batch(config, SEQ_LENS))["loss"]
    manager.stats()  # device copies are released one window late; this collects the last
    # layer 2's frame and its consumers (3, 4, 5) all hold handles: the device ids are gone
    assert len(refs) == 1 and refs[0].expired()
    loss.backward()


def _max_difference(expected: dict[str, Any], got: dict[str, Any]) -> float:
    return max((float((a - got[name]).abs().max()) for name, a in expected.items()
                if a is not None), default=0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_replay_and_offload_match_eager_and_offload_what_they_offload_on_cpu() -> None:
    from examples.glm_dsa.bench_measure import deterministic

    config, eager = build(moe=True)
    batch = make_packed_batch(config, SEQ_LENS)
    cpu_model, cpu_manager = offloaded_twin(eager)
    train_step(cpu_model, batch)
    eager = eager.cuda()
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    model = copy.deepcopy(eager)
    model.checkpoint_layers(1.0, offload=manager)
    batch = {key: value.cuda() for key, value in batch.items()}
    with deterministic(torch.device("cuda")):  # CUDA's index_add_ adds with atomics otherwise
        loss = train_step(eager, batch)
        reference = {n: None if g is None else g.clone() for n, g in grads(eager).items()}
        eager.zero_grad(set_to_none=True)
        assert torch.equal(train_step(eager, batch), loss)
        noise = _max_difference(reference, grads(eager))
        assert torch.equal(train_step(model, batch), loss)
    if noise == 0.0:
        assert_same_grads(reference, grads(model))
    else:  # a kernel without a deterministic version: no worse than eager against itself
        assert _max_difference(reference, grads(model)) <= 4 * noise
    stats = manager.stats()
    # The same windows as on CPU: layer inputs, and the top-k ids and MTP depths' frames.
    assert stats["offloaded_bytes"] == cpu_manager.stats()["offloaded_bytes"] > 0
    assert stats["restored_bytes"] == stats["offloaded_bytes"]
    assert stats["host_buffers_in_use"] == 0
