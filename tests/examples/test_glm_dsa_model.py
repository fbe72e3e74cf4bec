"""The GLM-5-style reference model under pytree-ckpt: exactness, call counts and invariants.

Every comparison is against an uncheckpointed twin, bit for bit in fp32 (``torch.equal``),
and every claim about the indexer or the router is checked by counting the calls.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch

import pytree_ckpt
from examples.glm_dsa import (DsaIndexer, GlmDsaConfig, GlmDsaForCausalLM, make_packed_batch,
                              topk_source_layers)
from examples.glm_dsa import attention as attention_module
from examples.glm_dsa import kernels, train
from examples.glm_dsa.common import position_ids, rope_tables
from examples.glm_dsa.mlp import Router, SwiGLU
from examples.glm_dsa.mtp import mtp_labels
from pytree_ckpt import Phase, SaveUnit

SEQ_LENS = (20, 12)  # T = 32 > index_topk = 8, so the attention really is sparse
SOURCES = [0, 1, 2, 6]  # topk_source_layers of the default config, worked out by hand


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # These tensors are tiny: intra-op threads only add sync, and on a busy 2-core CI box
    # spinning OpenMP workers made this file 20x slower (5 s vs 120 s measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(**overrides: Any) -> tuple[GlmDsaConfig, GlmDsaForCausalLM]:
    config = GlmDsaConfig(**overrides)
    torch.manual_seed(0)
    return config, GlmDsaForCausalLM(config)


def checkpointed_twin(model: GlmDsaForCausalLM, ratio: float = 1.0) -> GlmDsaForCausalLM:
    twin = copy.deepcopy(model)
    twin.checkpoint_layers(ratio)
    return twin


def grads(model: GlmDsaForCausalLM) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_grads(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        if grad is None:
            assert got[name] is None, name
        else:
            diff = (grad - got[name]).abs().max()
            assert torch.equal(grad, got[name]), f"{name}: max |d| = {diff}"


def differing_grads(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [name for name, grad in expected.items()
            if grad is not None and not torch.equal(grad, got[name])]


def indexers(model: GlmDsaForCausalLM) -> dict[str, DsaIndexer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, DsaIndexer)}


class CallLog:
    """Counts calls per (name, step part), where the test sets the part around each pass."""

    def __init__(self) -> None:
        self.part = "forward"
        self.calls: Counter[tuple[str, str]] = Counter()
        self.phases: list[Phase] = []

    def hook(self, name: str) -> Any:
        def record(module: Any, args: Any) -> None:
            self.calls[name, self.part] += 1
            self.phases.append(pytree_ckpt.current_phase())
        return record

    def in_backward(self) -> int:
        return sum(n for (_, part), n in self.calls.items() if part == "backward")


def train_step(model: GlmDsaForCausalLM, batch: dict[str, torch.Tensor], *,
               seed: int = 7, log: CallLog | None = None) -> torch.Tensor:
    """One forward and backward; ``log`` (if any) is told which of the two is running."""
    log = log or CallLog()
    torch.manual_seed(seed)  # the same dropout masks for both twins
    log.part = "forward"
    loss = model(**batch)["loss"]
    log.part = "backward"
    loss.backward()
    log.part = "forward"
    return loss.detach()


def count_indexer_calls(model: GlmDsaForCausalLM) -> CallLog:
    log = CallLog()
    for name, indexer in indexers(model).items():
        indexer.register_forward_pre_hook(log.hook(name))
    return log


# --------------------------------------------------------------------------- 1. exactness


@pytest.mark.parametrize("overrides, ratio", [
    ({}, 1.0),
    ({"moe": True}, 1.0),
    ({"dropout": 0.2, "moe": True}, 1.0),  # dropout: the replay must redraw the same masks
    ({"dropout": 0.2}, 0.5),               # half the decoder layers checkpointed, MTP too
])
def test_checkpointed_model_gives_bit_identical_loss_and_grads_to_its_eager_twin(
        overrides: dict[str, Any], ratio: float) -> None:
    config, eager = build(**overrides)
    ckpt = checkpointed_twin(eager, ratio)
    assert all(pytree_ckpt.is_checkpointed(m) for m in ckpt.mtp_layers)
    batch = make_packed_batch(config, SEQ_LENS)
    assert torch.equal(train_step(eager, batch), train_step(ckpt, batch))
    expected = grads(eager)
    # Indexers are trained by a separate loss in GLM-5; the LM loss gives them no gradient.
    assert {n for n, g in expected.items() if g is None} == {
        n for n in expected if ".indexer." in n}
    assert_same_grads(expected, grads(ckpt))


def test_two_mtp_layers_serve_the_depths_in_turn_each_trained_as_in_eager() -> None:
    # mtp_depth depths share mtp_num_layers physical layers, in turn: with two layers and two
    # depths each layer serves one depth, so each gets a gradient of its own (depth 1's layer
    # serving both left the second without any).
    config, eager = build(mtp_num_layers=2)
    ckpt = checkpointed_twin(eager)
    batch = make_packed_batch(config, SEQ_LENS)
    assert torch.equal(train_step(eager, batch), train_step(ckpt, batch))
    expected = grads(eager)
    for index in range(2):
        trained = [g for n, g in expected.items()
                   if n.startswith(f"mtp_layers.{index}.") and ".indexer." not in n]
        assert trained and all(g is not None and g.abs().sum() > 0 for g in trained)
    assert_same_grads(expected, grads(ckpt))


# --------------------------------------------------------------------------- 2. call counts


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # counting hooks
def test_each_computing_indexer_runs_once_per_micro_batch_and_never_during_recompute() -> None:
    config, eager = build()
    model = checkpointed_twin(eager)
    assert [i for i, s in enumerate(topk_source_layers(config)) if s] == SOURCES
    # Consumers own no indexer at all; the one shared MTP layer owns one.
    assert [layer.self_attn.indexer is not None for layer in model.layers] == \
        topk_source_layers(config)
    assert set(indexers(model)) == {f"layers.{i}.self_attn.indexer" for i in SOURCES} | {
        "mtp_layers.0.block.self_attn.indexer"}
    log = count_indexer_calls(model)
    first = make_packed_batch(config, SEQ_LENS, seed=1)
    second = make_packed_batch(config, (9, 23), seed=2)
    train_step(model, first, log=log)
    assert log.calls == Counter({(name, "forward"): 1 for name in indexers(model)})
    train_step(model, second, log=log)  # a second micro-batch accumulates into the grads
    assert log.calls == Counter({(name, "forward"): 2 for name in indexers(model)})
    assert set(log.phases) == {Phase.FORWARD}  # only ever in an original pass
    # ...and the accumulated grads are those of the eager twin, bit for bit, the shared MTP
    # layer (used at two depths) included: the boundary returns parameter gradients to
    # autograd instead of adding them to .grad itself, so the sums associate as in eager.
    train_step(eager, first)
    train_step(eager, second)
    assert_same_grads(grads(eager), grads(model))


# --------------------------------------------------------------------------- 3. storage


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks")  # they only read (see boundary)
def test_a_consumer_receives_the_storage_its_source_produced_in_forward_and_in_replay() -> None:
    config, model = build()
    model.checkpoint_layers(1.0)
    seen: dict[tuple[str, str, Phase], list[int]] = defaultdict(list)

    def watch(name: str, attn: torch.nn.Module) -> None:
        def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if kwargs["dsa_topk_ids"] is not None:
                ptr = kwargs["dsa_topk_ids"].untyped_storage().data_ptr()
                seen[name, "in", pytree_ckpt.current_phase()].append(ptr)

        def after(module: Any, args: Any, kwargs: Any, output: dict[str, Any]) -> None:
            ptr = output["dsa_topk_ids"].untyped_storage().data_ptr()
            seen[name, "out", pytree_ckpt.current_phase()].append(ptr)

        attn.register_forward_pre_hook(before, with_kwargs=True)
        attn.register_forward_hook(after, with_kwargs=True)

    for i, layer in enumerate(model.layers):
        watch(str(i), layer.self_attn)
    watch("mtp", model.mtp_layers[0].block.self_attn)
    train_step(model, make_packed_batch(config, SEQ_LENS))

    for phase in (Phase.FORWARD, Phase.RECOMPUTE):
        for consumer, source in {3: 2, 4: 2, 5: 2, 7: 6}.items():
            produced = seen[str(source), "out", Phase.FORWARD]
            assert seen[str(consumer), "in", phase] == produced, (consumer, phase)
            assert seen[str(consumer), "out", phase] == produced, (consumer, phase)
        for source in SOURCES:
            assert (str(source), "in", phase) not in seen
            assert seen[str(source), "out", phase] == seen[str(source), "out", Phase.FORWARD]
        # MTP: depth 1 computes, depth 2 receives depth 1's ids (the replay runs depth 2 first).
        depth1 = seen["mtp", "out", Phase.FORWARD][0]
        assert seen["mtp", "in", phase] == [depth1]
        assert seen["mtp", "out", phase] == [depth1, depth1]
    distinct = {seen[str(s), "out", Phase.FORWARD][0] for s in SOURCES}
    assert len(distinct) == len(SOURCES)  # the sources really produce separate tensors


# --------------------------------------------------------------------------- 4. why reuse


class ErraticIndexers:
    """Makes every DsaIndexer pick other keys on every call (as ties or a racy kernel could):
    the n-th call since ``restart()`` adds noise seeded n."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = itertools.count()
        original = DsaIndexer.forward

        def erratic(indexer: DsaIndexer, hidden_states: torch.Tensor, q_latent: torch.Tensor,
                    cu_seqlens: torch.Tensor) -> torch.Tensor:
            generator = torch.Generator().manual_seed(next(self.calls))
            noise = torch.randn(hidden_states.shape, generator=generator)
            return original(indexer, hidden_states + 10 * noise, q_latent, cu_seqlens)

        monkeypatch.setattr(DsaIndexer, "forward", erratic)

    def restart(self) -> None:
        self.calls = itertools.count()


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # counting hooks
def test_reuse_keeps_grads_exact_under_a_nondeterministic_indexer_and_a_direct_call_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    erratic = ErraticIndexers(monkeypatch)
    config, eager = build()
    batch = make_packed_batch(config, SEQ_LENS)
    indexer = eager.layers[0].self_attn.indexer
    args = (torch.randn(32, config.hidden_size), torch.randn(32, config.q_lora_rank),
            batch["cu_seqlens"])
    assert not torch.equal(indexer(*args), indexer(*args)), "the indexer must be erratic"

    erratic.restart()
    eager_loss = train_step(eager, batch)
    expected = grads(eager)
    results = {}
    for reuse in (True, False):
        model = checkpointed_twin(eager)
        model.zero_grad(set_to_none=True)
        for attn in (m for m in model.modules() if isinstance(m, attention_module.MlaAttention)):
            attn.reuse_indexer = reuse
        log = count_indexer_calls(model)
        erratic.restart()  # the original pass sees the same ids as the eager run
        assert torch.equal(train_step(model, batch, log=log), eager_loss)
        results[reuse] = (differing_grads(expected, grads(model)), log)

    differing, log = results[True]
    assert differing == []
    assert log.in_backward() == 0
    # Direct calls rerun every source indexer in replay, pick other keys, and the gradients
    # silently change: no error, same shapes, different numbers.
    differing, log = results[False]
    assert log.in_backward() == len(SOURCES) + 1
    assert any(name.startswith("layers.0.self_attn.") for name in differing)
    # The head's gradient reads the original pass's outputs: only what a replay rebuilds changed.
    assert "lm_head.weight" not in differing and "norm.weight" not in differing


# --------------------------------------------------------------------------- 5. invariants


def dense_causal_mla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     seq_lens: tuple[int, ...], scale: float) -> torch.Tensor:
    """Dense attention, causal inside each packed sequence (the reference, written here)."""
    total = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


# NOTE: sparse and dense attention sum the same terms in a different order and over a different
# layout (gathered [T, K] keys vs a masked [T, T] matrix), so they agree to about one float32
# ulp (1.2e-7 measured) rather than bit for bit; 1e-6 is a few ulps at these magnitudes.
ATOL = 1e-6


def test_sparse_attention_with_topk_covering_every_key_equals_dense_causal_attention(
        monkeypatch: pytest.MonkeyPatch) -> None:
    total = sum(SEQ_LENS)
    config, model = build(index_topk=total)
    batch = make_packed_batch(config, SEQ_LENS)
    cu_seqlens = batch["cu_seqlens"]
    cos, sin = rope_tables(position_ids(cu_seqlens, total), config.qk_rope_head_dim,
                           config.rope_theta)
    layer = model.layers[0]
    a = layer.input_layernorm(model.embed_tokens(batch["input_ids"][0]))
    proj = layer.self_attn.project(a, cos, sin)
    ids = layer.self_attn.indexer(a, proj.q_latent, cu_seqlens)
    sparse = kernels.sparse_mla_attention(proj.q, proj.k, proj.v, ids, config.softmax_scale)
    dense = dense_causal_mla(proj.q, proj.k, proj.v, SEQ_LENS, config.softmax_scale)
    torch.testing.assert_close(sparse, dense, atol=ATOL, rtol=0)

    # The whole model, with every layer attending densely instead: the same loss and grads.
    sparse_loss = train_step(model, batch)
    sparse_grads = grads(model)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(attention_module, "sparse_mla_attention",
                        lambda q, k, v, ids, scale: dense_causal_mla(q, k, v, SEQ_LENS, scale))
    torch.testing.assert_close(train_step(model, batch), sparse_loss, atol=ATOL, rtol=0)
    for name, grad in grads(model).items():
        if grad is not None:
            torch.testing.assert_close(grad, sparse_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_in_float64_sparse_attention_over_every_key_is_dense_causal_attention_to_1e_12() -> None:
    # The float32 test above needs a few ulps; in float64 the two orders of summation agree
    # to ~1e-15, so "equals dense attention" is checked to rounding, the whole model included.
    total = sum(SEQ_LENS)
    config, model = build(index_topk=total)
    model.double()
    batch = make_packed_batch(config, SEQ_LENS)
    positions = position_ids(batch["cu_seqlens"], total)
    dim = config.qk_rope_head_dim
    cos, sin = rope_tables(positions, dim, config.rope_theta, torch.float64)
    angles = positions.double()[:, None] / config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # tables in float64 too (float32 tables are off by ~1e-7)
    torch.testing.assert_close(cos, torch.cat([angles, angles], dim=-1).cos(), atol=1e-14, rtol=0)
    layer = model.layers[0]
    a = layer.input_layernorm(model.embed_tokens(batch["input_ids"][0]))
    proj = layer.self_attn.project(a, cos, sin)
    ids = layer.self_attn.indexer(a, proj.q_latent, batch["cu_seqlens"])
    sparse = kernels.sparse_mla_attention(proj.q, proj.k, proj.v, ids, config.softmax_scale)
    dense = dense_causal_mla(proj.q, proj.k, proj.v, SEQ_LENS, config.softmax_scale)
    torch.testing.assert_close(sparse, dense, atol=1e-12, rtol=0)


def test_indexer_ids_are_the_top_scores_causal_in_their_sequence_padded_with_minus_one() -> None:
    seq_lens = (20, 5, 7)  # the 5-token sequence has fewer keys than index_topk = 8
    config, model = build()
    batch = make_packed_batch(config, seq_lens)
    total = sum(seq_lens)
    indexer = model.layers[0].self_attn.indexer
    hidden = torch.randn(total, config.hidden_size)
    q_latent = torch.randn(total, config.q_lora_rank)
    ids = indexer(hidden, q_latent, batch["cu_seqlens"])
    assert ids.dtype == torch.int64 and ids.shape == (total, config.index_topk)
    assert not ids.requires_grad

    # The score, from the formula: I[t,s] = sum_j w[t,j] H^-.5 d^-.5 relu(qI[t,j] . kI[s]).
    with torch.no_grad():
        heads, dim = config.index_n_heads, config.index_head_dim
        q_index = indexer.wq(q_latent).view(total, heads, dim)
        k_index = indexer.k_norm(indexer.wk(hidden))
        w = indexer.weights_proj(hidden)
        scores = (w[:, :, None] * heads ** -0.5 * dim ** -0.5
                  * (q_index @ k_index.T).relu()).sum(dim=1)
    starts = [s for s, n in zip(itertools.accumulate((0,) + seq_lens), seq_lens) for _ in range(n)]
    for t, start in enumerate(starts):
        row = ids[t].tolist()
        keys = min(config.index_topk, t - start + 1)
        chosen, padding = row[:keys], row[keys:]
        assert padding == [-1] * (config.index_topk - keys), (t, row)
        assert all(start <= s <= t for s in chosen), (t, row)
        # The test's formula sums in another order than the op: compare the chosen keys'
        # scores with the best scores (equal scores may be chosen either way here; the tie
        # rule has its own test).
        best = scores[t, start:t + 1].sort(descending=True).values[:keys]
        torch.testing.assert_close(scores[t, chosen], best, atol=1e-6, rtol=0, msg=str((t, row)))


def test_indexer_ties_go_to_the_earliest_key_wherever_the_sequence_is_packed() -> None:
    # Scores are relu'd: a key whose dot products with every index head are <= 0 scores
    # exactly 0, so ties are common. Here every key of a sequence ties (k_index = 0).
    heads, dim, topk = 2, 4, 3
    q_index = torch.randn(12, heads, dim)
    weights = torch.randn(12, heads)
    alone = kernels.indexer_topk(q_index[7:], torch.zeros(5, dim), weights[7:],
                                 torch.tensor([0, 5], dtype=torch.int32), topk)
    packed = kernels.indexer_topk(q_index, torch.zeros(12, dim), weights,
                                  torch.tensor([0, 7, 12], dtype=torch.int32), topk)
    earliest = [[s for s in range(min(t + 1, topk))] + [-1] * (topk - min(t + 1, topk))
                for t in range(5)]
    assert alone.tolist() == earliest
    assert (packed[7:] - 7).clamp(min=-1).tolist() == earliest  # the same keys, 7 later


def test_a_query_without_any_valid_id_gets_zeros_and_sends_no_gradient_elsewhere() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.tensor([[0, -1], [0, 1], [-1, -1], [2, 3]])
    out = kernels.sparse_mla_attention(q, k, v, ids, 0.5)
    assert torch.equal(out[2], torch.zeros(2, 3, dtype=torch.float64))
    out.sum().backward()
    # Row 2 left out: the gradients must be those of the other rows alone.
    grads_all = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    rows = [0, 1, 3]
    kernels.sparse_mla_attention(q[rows], k, v, ids[rows], 0.5).sum().backward()
    assert torch.equal(grads_all[0], q.grad) and not grads_all[0][2].any()
    assert torch.equal(grads_all[1], k.grad) and torch.equal(grads_all[2], v.grad)


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # counting hooks
def test_moe_expert_assignment_is_replayed_even_when_routing_is_erratic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = itertools.count()
    log = CallLog()

    def erratic_select(self: Router, logits: torch.Tensor) -> torch.Tensor:
        log.calls["select", log.part] += 1
        log.phases.append(pytree_ckpt.current_phase())
        g = torch.Generator().manual_seed(next(calls))
        return torch.rand(logits.shape, generator=g).topk(self.top_k, dim=-1).indices

    monkeypatch.setattr(Router, "select", erratic_select)
    config, eager = build(moe=True)
    model = checkpointed_twin(eager)
    batch = make_packed_batch(config, SEQ_LENS)
    tokens_per_expert: dict[Phase, Counter[tuple[int, int]]] = defaultdict(Counter)
    for index, expert in enumerate(m for m in model.modules() if isinstance(m, SwiGLU)):
        def count(module: Any, args: Any, index: int = index) -> None:
            tokens_per_expert[pytree_ckpt.current_phase()][index, args[0].shape[0]] += 1
        expert.register_forward_pre_hook(count)

    calls = itertools.count()
    eager_loss = train_step(eager, batch)
    log.calls.clear()
    calls = itertools.count()  # the original pass routes as the eager run did
    assert torch.equal(train_step(model, batch, log=log), eager_loss)
    # 8 decoder layers + 2 MTP depths route once each, in forward only.
    assert log.calls == Counter({("select", "forward"): config.num_layers + config.mtp_depth})
    assert tokens_per_expert[Phase.RECOMPUTE] == tokens_per_expert[Phase.FORWARD]
    assert_same_grads(grads(eager), grads(model))
    assert all(model.layers[i].mlp.router.proj.weight.grad.abs().sum() > 0 for i in range(8))


def test_positions_restart_per_sequence_and_mtp_labels_never_cross_a_sequence_end() -> None:
    config, model = build()
    batch = make_packed_batch(config, (5, 3))
    cu_seqlens, labels = batch["cu_seqlens"], batch["labels"][0]
    assert position_ids(cu_seqlens, 8).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    tokens = batch["input_ids"][0].tolist()
    assert labels.tolist() == tokens[1:5] + [-100] + tokens[6:8] + [-100]
    # Depth k predicts token t + k + 1 of t's own sequence, or nothing.
    assert mtp_labels(labels, cu_seqlens, 1).tolist() == tokens[2:5] + [-100] * 2 + [
        tokens[7], -100, -100]
    assert mtp_labels(labels, cu_seqlens, 2).tolist() == tokens[3:5] + [-100] * 6
    out = model(**batch)
    assert len(out["mtp_losses"]) == config.mtp_depth and out["logits"].shape == (1, 8, 256)
    assert torch.equal(out["loss"], out["main_loss"] + config.mtp_loss_weight
                       * torch.stack(out["mtp_losses"]).mean())


def test_an_mtp_depth_with_no_target_left_adds_zero_to_the_loss_not_nan() -> None:
    # Two 3-token sequences: depth 1 still has one target per sequence, depth 2 none at all.
    config, model = build()
    batch = make_packed_batch(config, (3, 3))
    assert (mtp_labels(batch["labels"][0], batch["cu_seqlens"], 2) == -100).all()
    out = model(**batch)
    assert out["mtp_losses"][1].item() == 0.0 and out["mtp_losses"][0].item() > 0
    assert torch.equal(out["loss"], out["main_loss"] + config.mtp_loss_weight
                       * torch.stack(out["mtp_losses"]).mean())
    out["loss"].backward()
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())


# --------------------------------------------------------------------------- kernels, config


def test_custom_ops_pass_opcheck_and_the_backward_matches_autograd_in_float64() -> None:
    total, heads = 12, 2
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    ids = kernels.indexer_topk(torch.randn(total, heads, 4), torch.randn(total, 4),
                               torch.randn(total, heads), cu_seqlens, 4)
    q, k = (torch.randn(total, heads, 6, dtype=torch.float64, requires_grad=True) for _ in "qk")
    v = torch.randn(total, heads, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, k, v: kernels.sparse_mla_attention(q, k, v, ids, 0.4),
                             (q, k, v))
    torch.library.opcheck(kernels.sparse_mla_attention, (q, k, v, ids, 0.4))
    torch.library.opcheck(kernels.indexer_topk, (torch.randn(total, heads, 4),
                                                 torch.randn(total, 4), torch.randn(total, heads),
                                                 cu_seqlens, 4))


def test_the_registered_flop_formulas_count_what_the_torch_backend_itself_multiplies() -> None:
    # FlopCounterMode sees a custom op as one node: the formula registered for it is all the
    # bench's recompute and indexer FLOPs rest on. Forward: it must equal what the counter
    # finds when the torch backend's body (plain einsums, not the op) runs under it. Backward:
    # autograd's backward of that body plus the recomputed probabilities (the body scatters
    # outer products with index_add_, which the counter does not see as matmuls). Every size
    # differs, so a formula that drops or swaps a dimension shows.
    from torch.utils.flop_counter import FlopCounterMode

    def flops(fn: Any, *args: Any) -> int:
        with FlopCounterMode(display=False) as counter:
            fn(*args)
        return counter.get_total_flops()

    torch.manual_seed(0)
    total, heads, dim, topk = 12, 3, 5, 4
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    index_args = (torch.randn(total, heads, dim), torch.randn(total, dim),
                  torch.randn(total, heads), cu_seqlens, topk)
    assert flops(kernels.indexer_topk, *index_args) == \
        flops(kernels._torch_indexer_topk, *index_args) > 0
    ids = kernels.indexer_topk(*index_args)
    q, k, v = (torch.randn(total, 2, d, requires_grad=True) for d in (6, 6, 7))
    args = (q, k, v, ids, 0.4)
    assert flops(kernels.sparse_mla_attention, *args) == \
        flops(kernels._torch_sparse_attention, *args) > 0
    grad_out = torch.randn(total, 2, 7)
    out = kernels._torch_sparse_attention(*args)
    k_sel, _, valid, _ = kernels._gather_keys(k.detach(), v.detach(), ids)
    expected = (flops(out.backward, grad_out)
                + flops(kernels._probs, q.detach(), k_sel, valid, 0.4))
    detached = (grad_out, q.detach(), k.detach(), v.detach(), ids, 0.4)
    assert flops(kernels.sparse_mla_attention_backward, *detached) == expected > 0

def test_a_cpu_run_never_tries_to_import_an_optional_cuda_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    imports: list[str] = []
    monkeypatch.setattr(kernels, "_importable", lambda package: imports.append(package) or True)
    fused = kernels.Backend("fused", "cuda", "some_fused_kernels", *(lambda *a: None,) * 3)
    monkeypatch.setattr(kernels, "_REGISTRY", list(kernels._REGISTRY))
    kernels.register_backend(fused)
    assert kernels.available_backends("cpu") == ["torch"]
    config, model = build()
    train_step(model, make_packed_batch(config, SEQ_LENS))
    assert imports == []
    assert kernels.available_backends("cuda") == ["fused", "torch"]  # only now: a CUDA ask
    assert imports == ["some_fused_kernels"]


@pytest.mark.parametrize("field, value", [("index_skip_topk_offset", 0), ("dropout", 1.0),
                                          ("num_experts_per_tok", 5), ("qk_rope_head_dim", 7)])
def test_an_invalid_config_names_its_field_and_gives_a_tip(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"GlmDsaConfig\.{field} .*tip:"):
        GlmDsaConfig(**{field: value})


# --------------------------------------------------------------------------- 6. train.py


def test_the_training_script_learns_and_its_first_loss_is_the_eager_models(
        capsys: pytest.CaptureFixture[str]) -> None:
    losses = train.main(["--steps", "2", "--seed", "3", "--ratio", "1.0"])
    printed = capsys.readouterr().out
    assert [line.split()[:2] for line in printed.splitlines() if line.startswith("step")] == [
        ["step", "1"], ["step", "2"]]
    assert len(losses) == 2 and losses[1] < losses[0]  # same batch: only the parameters moved
    config = GlmDsaConfig()
    torch.manual_seed(3)  # the script's documented initialisation
    eager = GlmDsaForCausalLM(config)
    batch = make_packed_batch(config, seed=3)
    with torch.no_grad():
        assert eager(**batch)["loss"].item() == losses[0]


def test_the_training_scripts_save_argument_names_the_units_and_needs_checkpointed_layers(
        capsys: pytest.CaptureFixture[str]) -> None:
    # What --save and --discard-norms do is counted in the next test; here, what they accept.
    with pytest.raises(SystemExit):
        train.parse_args(["--save", "attention"])
    assert "the units are attn, dsa_indexer" in capsys.readouterr().err
    assert train.parse_args(["--save", "all"]).save is True
    assert train.parse_args(["--save", "attn, moe_gate", "--moe"]).save == [
        SaveUnit.ATTN, SaveUnit.MOE_GATE]
    with pytest.raises(SystemExit):  # save units live inside checkpointed layers: none at 0
        train.parse_args(["--save", "attn", "--ratio", "0"])
    assert "--save needs --ratio > 0" in capsys.readouterr().err


def test_the_training_script_refuses_a_moe_save_unit_without_moe_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Guards against (helper HE), as it was found:
    # --help lists moe_gate and moe_dispatch among --save's units with no word that they need
    # --moe. Without it the model declares attn and dsa_indexer only: parse_args accepts the
    # unit, the model is built, and apply_recompute_config's CheckpointConfigError ("save units
    # ['moe_gate'] are not declared by this model ... tip: choose among the units the model's
    # RecomputeTargetMap declares") ends the run in a traceback, as --ratio 2 once did.
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--save", "moe_gate"])
    assert info.value.code == 2 and "--moe" in capsys.readouterr().err
    assert train.parse_args(["--save", "moe_gate", "--moe"]).save == [SaveUnit.MOE_GATE]


def test_the_training_script_keeps_every_unit_of_a_repeated_save_or_refuses_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Guards against (helper HE), as it was found:
    # `--save attn --save dsa_indexer` (the form of repeated flags most CLIs merge) trained
    # with dsa_indexer alone: argparse's "store" lets the last value win, and nothing says
    # that attn was dropped. Either keep both or refuse it, naming the comma form.
    try:
        save = train.parse_args(["--save", "attn", "--save", "dsa_indexer"]).save
    except SystemExit:
        assert "--save attn,dsa_indexer" in capsys.readouterr().err
    else:
        assert save == [SaveUnit.ATTN, SaveUnit.DSA_INDEXER]


def test_the_training_script_refuses_save_units_with_compiled_layer_bodies(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Guards against `--save attn --compile` reaching apply_recompute_config after the layer
    # bodies were compiled: refused at the command line, naming both flags, before any model
    # is built. Each alone is accepted.
    with pytest.raises(SystemExit):
        train.parse_args(["--save", "attn", "--compile"])
    assert "--save cannot be combined with --compile" in capsys.readouterr().err
    assert train.parse_args(["--compile"]).compile
    assert train.parse_args(["--save", "attn"]).save == [SaveUnit.ATTN]


def _train_counting_ops(argv: list[str]) -> Any:
    from tests.pytree_ckpt.test_save_units import OpCounter

    counter = OpCounter()
    with counter:
        train.main(argv)
    return counter.counts


def test_the_training_script_keeps_the_named_units_out_of_the_replay_and_rebuilds_the_norms(
        ) -> None:
    # The first loss cannot tell: the forward is the same whatever is kept or discarded. The
    # calls can: a kept attention op never runs in the replay, and each discarded norm (two per
    # layer, one attention call each) is rebuilt once more in backward, outside any replay.
    argv = ["--steps", "1", "--seed", "3", "--moe"]
    plain = _train_counting_ops(argv)
    flagged = _train_counting_ops([*argv, "--save", "attn", "--discard-norms"])
    attention = "glm_dsa.sparse_mla_attention"
    layers = plain["forward", attention]
    assert layers > 0 and plain["recompute", attention] == layers
    assert flagged["forward", attention] == layers and flagged["recompute", attention] == 0
    assert flagged["plain", "aten.rsqrt"] == plain["plain", "aten.rsqrt"] + 2 * layers
    assert flagged["recompute", "aten.rsqrt"] == plain["recompute", "aten.rsqrt"]


def test_the_training_script_reports_the_managers_offload_turns_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from offload import default_manager

    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    train.main(["--steps", "2", "--seed", "3"])
    printed = capsys.readouterr().out.splitlines()
    floor = default_manager().config.min_bytes
    assert f"XTUNER_ACTIVATION_OFFLOAD=1: the default manager moves storages of at least " \
        f"{floor} bytes" in printed[1]
    # one window per checkpointed call a step: every decoder layer and every MTP depth
    config = GlmDsaConfig()
    calls = str(config.num_layers + config.mtp_depth)
    windows = [line.split(" in ")[1].split()[0] for line in printed
               if line.startswith("  offload: ")]
    assert windows == [calls, calls]


@pytest.mark.parametrize("argv", [["--ratio", "2"], ["--ratio", "-0.5"], ["--ratio", "nan"],
                                  ["--mtp-depth", "-1"], ["--steps", "0"], ["--lr", "-1"],
                                  ["--lr", "nan"]])
def test_the_training_script_refuses_an_out_of_range_number_with_a_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # --ratio 2 and --mtp-depth -1 got past the parser and died in a traceback once the model
    # was built; --steps 0 printed the header and trained nothing, silently; --lr -1 and nan
    # died in AdamW's ValueError traceback after the model was built.
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2 and f"{argv[0]} must be" in capsys.readouterr().err


def test_the_training_script_refuses_an_unknown_compile_backend_naming_the_usual_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    # It got past the parser, built the model and died in torch's InvalidBackend traceback at
    # the first layer's torch.compile.
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--compile", "--compile-backend", "inductr"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--compile-backend 'inductr' is not a torch.compile" in err
    assert "tip: inductor (the default), aot_eager or eager" in err
    assert train.parse_args(["--compile", "--compile-backend", "aot_eager"]).compile_backend \
        == "aot_eager"


def test_the_training_script_says_the_environments_offload_has_nothing_to_move_at_ratio_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # --offload --ratio 0 is a usage error; XTUNER_ACTIVATION_OFFLOAD=1 at --ratio 0 trained
    # with no offload line and no word that the variable did nothing.
    from offload import default_manager

    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    manager = default_manager()
    manager.stats(reset=True)
    losses = train.main(["--steps", "1", "--seed", "3", "--ratio", "0"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == ("XTUNER_ACTIVATION_OFFLOAD=1: nothing to offload at --ratio 0 (offload "
                          "works at checkpoint boundaries, and no layer is checkpointed)")
    assert manager.stats(reset=True)["windows"] == 0
    config = GlmDsaConfig()
    torch.manual_seed(3)  # the script's documented initialisation: the eager model's loss
    with torch.no_grad():
        assert GlmDsaForCausalLM(config)(**make_packed_batch(config, seed=3))["loss"].item() \
            == losses[0]


def test_the_training_script_accepts_the_edges_of_every_range_it_checks() -> None:
    # --mtp-depth 0 disables MTP (the usage error's own tip), --ratio 0 and 1 are the ends of
    # [0, 1], one step is the fewest: each is a valid run, not a usage error.
    assert train.parse_args(["--mtp-depth", "0"]).mtp_depth == 0
    assert train.parse_args(["--ratio", "0"]).ratio == 0.0
    assert train.parse_args(["--ratio", "1"]).ratio == 1.0
    assert train.parse_args(["--steps", "1"]).steps == 1
    assert train.parse_args(["--lr", "0"]).lr == 0.0


def test_the_training_script_takes_the_same_adamw_steps_as_a_plain_eager_loop() -> None:
    # Checkpointing changes no number: three steps of the script (--lr, --mtp-depth and --seed
    # as given) are three steps of a hand-written AdamW loop on the eager model, bit for bit.
    losses = train.main(["--steps", "3", "--seed", "3", "--mtp-depth", "1", "--lr", "0.01"])
    config = GlmDsaConfig(mtp_depth=1)
    torch.manual_seed(3)
    model = GlmDsaForCausalLM(config)
    batch = make_packed_batch(config, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    expected = []
    for _ in range(3):
        out = model(**batch)
        assert len(out["mtp_losses"]) == 1
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(out["loss"].item())
    assert losses == expected


def _count_indexer_and_router_calls(monkeypatch: pytest.MonkeyPatch,
                                    argv: list[str]) -> Counter[tuple[str, str]]:
    calls: Counter[tuple[str, str]] = Counter()
    forward, select = DsaIndexer.forward, Router.select

    def counted_forward(self: DsaIndexer, *args: Any) -> Any:
        calls["indexer", pytree_ckpt.current_phase().value] += 1
        return forward(self, *args)

    def counted_select(self: Router, logits: torch.Tensor) -> torch.Tensor:
        calls["router", pytree_ckpt.current_phase().value] += 1
        return select(self, logits)

    with monkeypatch.context() as patch:
        patch.setattr(DsaIndexer, "forward", counted_forward)
        patch.setattr(Router, "select", counted_select)
        train.main(argv)
    return calls


def test_the_training_scripts_no_reuse_and_moe_flags_reach_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 computing passes (layers 0, 1, 2, 6, MTP depth 1) run the indexer; with --no-reuse
    # each replay runs it again. --moe routes in 8 decoder layers and 2 MTP depths, once each.
    plain = _count_indexer_and_router_calls(monkeypatch, ["--steps", "1"])
    assert plain == Counter({("indexer", "forward"): 5})
    flagged = _count_indexer_and_router_calls(monkeypatch, ["--steps", "1", "--no-reuse", "--moe"])
    assert flagged == Counter({("indexer", "forward"): 5, ("indexer", "recompute"): 5,
                               ("router", "forward"): 10})


def _offloaded_bytes(printed: str) -> list[tuple[int, int, int]]:
    # "  offload: N bytes to host in W windows, R restored (...)"
    rows = []
    for line in printed.splitlines():
        if line.startswith("  offload: "):
            words = line.split()
            rows.append((int(words[1]), int(words[6]), int(words[8])))
    return rows


def test_the_training_scripts_offload_flag_moves_the_checkpointed_inputs_above_its_floor(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "1", "--seed", "3"]
    loss = train.main(argv)
    assert _offloaded_bytes(capsys.readouterr().out) == []  # no manager, nothing to report
    assert train.main([*argv, "--offload"]) == loss  # offload changes no number
    [(moved, windows, restored)] = _offloaded_bytes(capsys.readouterr().out)
    # every decoder layer and both MTP depths open a window; the default floor (1024 bytes)
    # lets at least the 10 hidden-state inputs ([32, 64] float32) go
    assert windows == 10 and moved == restored >= 10 * 32 * 64 * 4
    train.main([*argv, "--offload", "--offload-min-bytes", str(1 << 20)])
    assert _offloaded_bytes(capsys.readouterr().out) == [(0, 10, 0)]  # above every storage


def test_with_ratio_0_the_training_script_checkpoints_nothing_not_even_the_mtp_layer(
        capsys: pytest.CaptureFixture[str]) -> None:
    counts = _train_counting_ops(["--steps", "1", "--ratio", "0"])
    assert "checkpointed decoder layers: []" in capsys.readouterr().out
    assert {phase for phase, _ in counts} == {"plain"}  # no original pass, no replay


def test_compiled_checkpointed_reference_model_equals_its_twin_compiled_with_eager_layers(
        ) -> None:
    # docs/scaling.md: around layers called in a loop, torch.compile(model) runs the forward's
    # own code eagerly, and still compiles the functions of the user's it calls (helper FZ: 7
    # graphs in this model, where the page said nothing was compiled), as it does for the
    # unwrapped model whose layers run eagerly.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    config, eager = build()
    model = copy.deepcopy(eager)
    model.checkpoint_layers(1.0, offload=False)
    twin = copy.deepcopy(eager)
    for layer in (*twin.layers, *twin.mtp_layers):
        layer.forward = torch.compiler.disable(layer.forward)
    batch = make_packed_batch(config, SEQ_LENS, seed=0)
    results = []
    for candidate in (twin, model):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(candidate, backend=counter)
        if candidate is model:  # each checkpointed layer says the body is not compiled
            with pytest.warns(UserWarning, match="compiles only the code around it"):
                loss = compiled(**batch)["loss"]
        else:
            loss = compiled(**batch)["loss"]
        loss.backward()
        results.append((loss, counter.frame_count))
    (twin_loss, twin_frames), (loss, frames) = results
    assert frames == twin_frames > 0
    assert torch.equal(loss, twin_loss)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(twin.parameters(), model.parameters())
               if a.grad is not None)

def test_the_models_ratio_0_offload_warning_is_not_given_while_the_mtp_layer_offloads() -> None:
    # Guards against (helper HF), as it was found:
    # checkpoint_layers(ratio, mtp=True) checkpoints the MTP layer whatever the ratio, with the
    # same manager; apply_recompute_config warns for the decoder layers alone (8 of 8 left
    # uncheckpointed) that "offload=an OffloadManager offloads nothing", yet the MTP layer's
    # windows move its inputs to host. warn_offload_unused's promise: no warning where
    # something is offloaded.
    from offload import OffloadConfig, OffloadManager

    config, model = build()
    assert len(model.mtp_layers) > 0
    manager = OffloadManager(OffloadConfig(min_bytes=1024))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model.checkpoint_layers(0.0, offload=manager) == []
    model(**make_packed_batch(config, SEQ_LENS))["loss"].backward()
    assert manager.stats()["offloaded_bytes"] > 0  # the MTP layer did offload
    assert not [w for w in caught if "offloads nothing" in str(w.message)]


def test_a_decoder_layer_checkpointed_at_ratio_1_of_49_keeps_its_offload_and_save_units_with_mtp(
) -> None:
    # Guards against (helper HG), as it was found:
    # 49 * (1 / 49) is 0.9999999999999999: int() gives 0 (the model's "no decoder layer", so
    # quiet), layer_count gives 1 (the library checkpoints layers[0]); Megatron's
    # recompute_num_layers=1 of 49 layers is ratio=1/49, as the library's own tip says.
    from offload import OffloadConfig, OffloadManager
    from pytree_ckpt.module import _installed

    options = {}
    for mtp in (False, True):
        _, model = build(num_layers=49)
        manager = OffloadManager(OffloadConfig(min_bytes=1024))
        assert model.checkpoint_layers(1 / 49, mtp=mtp, offload=manager, save=True) == [0]
        installed = _installed(model.layers[0])
        options[mtp] = (installed.options.offload is manager, installed.options.keep is None)
    assert options[True] == options[False] == (True, False)


# Guards against (helper KC), as it was found:
def test_the_training_script_refuses_a_seed_torch_cannot_take_with_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    # torch.manual_seed takes [-2**63, 2**64); --seed 2**64 passed parse_args and crashed in
    # torch.manual_seed with "Overflow when unpacking long long" (every other range is checked).
    with pytest.raises(SystemExit) as info:
        train.main(["--steps", "1", "--seed", str(2**64)])
    assert info.value.code == 2 and "--seed" in capsys.readouterr().err
