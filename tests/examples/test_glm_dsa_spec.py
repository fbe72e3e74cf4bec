"""The reference model against CONTEXT.md section 5, item by item.

The centrepiece is an independent reimplementation of the spec written here from its formulas
(none of the model's functions is called: only its parameter tensors are read), run in float64
against the model on a packed batch of three sequences: the same top-k ids in every layer and
MTP depth, the same losses and the same gradients to rounding. It pins what the other tests
take from the model itself: the MLA projections and scale, the indexer's LayerNorm and score,
the sharing rule inside the model loop, the MTP fusion and each depth's label alignment, and
the loss weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, kernels, make_packed_batch
from examples.glm_dsa import indexer as indexer_module
from examples.glm_dsa.common import position_ids, rope_tables
from examples.glm_dsa.config import topk_source_layers
from examples.glm_dsa.mlp import MoE
from tests.examples.test_glm_dsa_model import _one_thread

__all__ = ["_one_thread"]  # the module-scoped one-thread fixture applies here too


# --------------------------------------------------------------------------- the spec, by hand


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _layernorm(x: torch.Tensor, mod: torch.nn.LayerNorm) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias


def _bounds(cu_seqlens: torch.Tensor, total: int) -> tuple[list[int], list[int]]:
    cu = [int(c) for c in cu_seqlens]
    start, end = [0] * total, [0] * total
    for a, b in zip(cu, cu[1:]):
        for t in range(a, b):
            start[t], end[t] = a, b
    return start, end


def _rope(x: torch.Tensor, pos: list[int], theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1).to(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d,)
    cos, sin = ang.cos().reshape(shape), ang.sin().reshape(shape)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _indexer(ix: Any, a: torch.Tensor, cq: torch.Tensor, start: list[int], k: int) -> torch.Tensor:
    # I[t,s] = sum_j w[t,j] H^-.5 d^-.5 relu(qI[t,j].kI[s]), start(t) <= s <= t,
    # topk(min(K, keys)) (equal scores: earliest key), -1 in the slots left over.
    with torch.no_grad():
        heads, dim, total = ix.n_heads, ix.head_dim, a.shape[0]
        q_i = (cq @ ix.wq.weight.T).reshape(total, heads, dim)
        k_i = _layernorm(a @ ix.wk.weight.T, ix.k_norm)
        w = a @ ix.weights_proj.weight.T
        ids = torch.full((total, k), -1, dtype=torch.int64)
        for t in range(total):
            keys = range(start[t], t + 1)
            score = {s: sum(float(w[t, j]) * heads ** -0.5 * dim ** -0.5
                            * max(float(q_i[t, j] @ k_i[s]), 0.0) for j in range(heads))
                     for s in keys}
            best = sorted(keys, key=lambda s: (-score[s], s))[:min(k, len(keys))]
            ids[t, :len(best)] = torch.tensor(best)
    return ids


def _attention(attn: Any, cfg: GlmDsaConfig, a: torch.Tensor, pos: list[int], start: list[int],
               ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    total, heads = a.shape[0], cfg.num_heads
    dn, dr, dv, rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    cq = _rms(a @ attn.q_a_proj.weight.T, attn.q_a_norm.weight, cfg.rms_norm_eps)
    q = (cq @ attn.q_b_proj.weight.T).reshape(total, heads, dn + dr)
    ckv_kpe = a @ attn.kv_a_proj.weight.T
    ckv, kpe = ckv_kpe[:, :rank], ckv_kpe[:, rank:]
    kv = (_rms(ckv, attn.kv_a_norm.weight, cfg.rms_norm_eps)
          @ attn.kv_b_proj.weight.T).reshape(total, heads, dn + dv)
    q = torch.cat([q[..., :dn], _rope(q[..., dn:], pos, cfg.rope_theta)], -1)
    kpe = _rope(kpe, pos, cfg.rope_theta)  # one RoPE head, shared by every head
    k = torch.cat([kv[..., :dn], kpe[:, None, :].expand(total, heads, dr)], -1)
    v = kv[..., dn:]
    if ids is None:
        ids = _indexer(attn.indexer, a, cq, start, cfg.index_topk)
    scale = (dn + dr) ** -0.5
    rows = []
    for t in range(total):
        keys = [int(s) for s in ids[t] if s >= 0]  # the selected keys and nothing else
        scores = torch.einsum("hd,khd->hk", q[t], k[keys]) * scale
        rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[keys]))
    return torch.stack(rows).reshape(total, heads * dv) @ attn.o_proj.weight.T, ids


def _block(layer: Any, cfg: GlmDsaConfig, h: torch.Tensor, pos: list[int], start: list[int],
           ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    eps = cfg.rms_norm_eps
    out, ids = _attention(layer.self_attn, cfg, _rms(h, layer.input_layernorm.weight, eps), pos,
                          start, ids)
    h = h + out
    x = _rms(h, layer.post_attention_layernorm.weight, eps)
    m = layer.mlp  # SwiGLU: down(silu(gate x) * up x)
    mlp = (F.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return h + mlp, ids


def _ce(logits: torch.Tensor, targets: list[int | None]) -> torch.Tensor:
    valid = [t for t, y in enumerate(targets) if y is not None]
    logp = logits.log_softmax(-1)
    return -sum(logp[t, targets[t]] for t in valid) / len(valid)


def spec_forward(model: GlmDsaForCausalLM, tokens: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> dict[str, Any]:
    cfg = model.config
    total = tokens.shape[0]
    start, end = _bounds(cu_seqlens, total)
    pos = [t - start[t] for t in range(total)]
    embed, eps, tok = model.embed_tokens.weight, cfg.rms_norm_eps, tokens.tolist()
    h, ids, layer_ids = embed[tokens], None, []
    for i, layer in enumerate(model.layers):
        computes = max(i - cfg.index_skip_topk_offset + 1, 0) % cfg.index_topk_freq == 0
        h, ids = _block(layer, cfg, h, pos, start, None if computes else ids)
        layer_ids.append(ids)
    logits = _rms(h, model.norm.weight, eps) @ model.lm_head.weight.T
    main = _ce(logits, [tok[t + 1] if t + 1 < end[t] else None for t in range(total)])
    mtp, mtp_ids = [], None
    layer = model.mtp_layers[0]
    for k in range(1, cfg.mtp_depth + 1):
        e = _rms(embed[torch.roll(tokens, -k)], layer.enorm.weight, eps)
        fused = torch.cat([e, _rms(h, layer.hnorm.weight, eps)], -1) @ layer.eh_proj.weight.T
        h, mtp_ids = _block(layer.block, cfg, fused, pos, start, None if k == 1 else mtp_ids)
        depth_logits = _rms(h, layer.final_norm.weight, eps) @ model.lm_head.weight.T
        # depth k at position t predicts token t + k + 1 of t's own sequence
        mtp.append(_ce(depth_logits, [tok[t + k + 1] if t + k + 1 < end[t] else None
                                      for t in range(total)]))
    loss = main + 0.1 * torch.stack(mtp).mean()
    return {"loss": loss, "main": main, "mtp": mtp, "ids": layer_ids, "mtp_ids": mtp_ids}


# --------------------------------------------------------------------------- tests


def test_the_defaults_are_the_cpu_reference_sizes() -> None:
    cfg = GlmDsaConfig()
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_n_heads,
            cfg.index_head_dim, cfg.index_topk, cfg.mtp_depth, cfg.mtp_loss_weight,
            cfg.index_topk_freq, cfg.index_skip_topk_offset) == (
        64, 8, 4, 32, 32, 16, 8, 16, 4, 16, 8, 2, 0.1, 4, 3)
    assert cfg.softmax_scale == (16 + 8) ** -0.5
    batch = make_packed_batch(cfg)
    lens = batch["cu_seqlens"].diff().tolist()
    assert len(lens) >= 2 and max(lens) > cfg.index_topk
    assert len(GlmDsaForCausalLM(cfg).mtp_layers) == 1  # one physical layer for both depths


def test_the_whole_model_is_the_spec_reimplemented_independently_in_float64() -> None:
    cfg = GlmDsaConfig()
    torch.manual_seed(0)
    model = GlmDsaForCausalLM(cfg).double()
    with torch.no_grad():  # norms away from 1 and 0, so a missing or misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
    batch = make_packed_batch(cfg, (20, 5, 11), seed=3)  # 5 < top-k: -1 slots in every layer
    seen: dict[Any, list[torch.Tensor]] = {}
    for key, module in [*enumerate(model.layers), ("mtp", model.mtp_layers[0])]:
        module.register_forward_hook(
            lambda m, a, kw, out, key=key: seen.setdefault(key, []).append(out["dsa_topk_ids"]),
            with_kwargs=True)
    out = model(**batch)
    ref = spec_forward(model, batch["input_ids"][0], batch["cu_seqlens"])

    for i in range(cfg.num_layers):
        assert torch.equal(seen[i][0], ref["ids"][i]), i
    assert (ref["ids"][0] == -1).any()
    assert [torch.equal(ids, ref["mtp_ids"]) for ids in seen["mtp"]] == [True, True]
    torch.testing.assert_close(out["main_loss"], ref["main"], atol=1e-12, rtol=0)
    for depth, (got, want) in enumerate(zip(out["mtp_losses"], ref["mtp"]), start=1):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"depth {depth}")
    torch.testing.assert_close(out["loss"], ref["loss"], atol=1e-12, rtol=0)
    params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    for got, want in zip(torch.autograd.grad(out["loss"], params),
                         torch.autograd.grad(ref["loss"], params)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _expected_sources(n: int, freq: int, offset: int) -> tuple[list[bool], list[int]]:
    computes = [max(i - offset + 1, 0) % freq == 0 for i in range(n)]
    sources, last = [], -1
    for i, c in enumerate(computes):
        last = i if c else last
        sources.append(last)
    return computes, sources


@pytest.mark.parametrize("layers, freq, offset", [
    (8, 4, 3), (12, 4, 3), (9, 2, 1), (10, 3, 5), (7, 5, 2), (4, 1, 1)])
def test_each_consumer_gets_the_ids_of_the_nearest_earlier_computing_layer(
        layers: int, freq: int, offset: int) -> None:
    cfg = GlmDsaConfig(num_layers=layers, index_topk_freq=freq,
                       index_skip_topk_offset=offset, mtp_depth=0)
    torch.manual_seed(0)
    model = GlmDsaForCausalLM(cfg)
    computes, sources = _expected_sources(layers, freq, offset)
    assert topk_source_layers(cfg) == computes
    ins: dict[int, Any] = {}
    outs: dict[int, Any] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: ins.__setitem__(i, kw["dsa_topk_ids"]), with_kwargs=True)
        layer.register_forward_hook(
            lambda m, a, kw, o, i=i: outs.__setitem__(i, o), with_kwargs=True)
    model(**make_packed_batch(cfg, (20, 12)))
    for i in range(layers):
        assert set(outs[i]) == {"hidden_states", "dsa_topk_ids"}, i
        if computes[i]:
            assert ins[i] is None and model.layers[i].self_attn.indexer is not None, i
        else:
            assert model.layers[i].self_attn.indexer is None, i
            assert ins[i] is outs[sources[i]]["dsa_topk_ids"] is outs[i]["dsa_topk_ids"], i


def test_the_indexer_runs_under_no_grad_on_detached_inputs_in_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GlmDsaConfig()
    torch.manual_seed(0)
    model = GlmDsaForCausalLM(cfg)
    calls: list[tuple[bool, ...]] = []
    inputs: list[tuple[Any, ...]] = []
    original = indexer_module.indexer_topk

    def spy(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cu: torch.Tensor,
            topk: int) -> torch.Tensor:
        calls.append((torch.is_grad_enabled(), q.requires_grad, k.requires_grad, w.requires_grad))
        return original(q, k, w, cu, topk)

    monkeypatch.setattr(indexer_module, "indexer_topk", spy)
    for m in model.modules():
        if isinstance(m, indexer_module.DsaIndexer):
            m.register_forward_pre_hook(
                lambda m, a: inputs.append((a[0].grad_fn, a[1].grad_fn, a[0].requires_grad)))
    model(**make_packed_batch(cfg))["loss"].backward()
    assert len(calls) == 5 and set(calls) == {(False, False, False, False)}
    assert set(inputs) == {(None, None, False)}


def test_a_consumer_attends_with_the_ids_it_is_given_and_no_module_caches_a_tensor() -> None:
    cfg = GlmDsaConfig()
    torch.manual_seed(0)
    model = GlmDsaForCausalLM(cfg)
    batch = make_packed_batch(cfg)
    total, cu = 32, batch["cu_seqlens"]
    cos, sin = rope_tables(position_ids(cu, total), cfg.qk_rope_head_dim, cfg.rope_theta)
    kw = dict(rope_cos=cos, rope_sin=sin, cu_seqlens=cu)
    h = torch.randn(total, cfg.hidden_size)
    ids = model.layers[2](h, **kw)["dsa_topk_ids"]
    itself = torch.full_like(ids, -1)
    itself[:, 0] = torch.arange(total)
    consumer = model.layers[3]
    first = consumer(h, **kw, dsa_topk_ids=ids)["hidden_states"]
    assert not torch.equal(consumer(h, **kw, dsa_topk_ids=itself)["hidden_states"], first)
    assert torch.equal(consumer(h, **kw, dsa_topk_ids=ids)["hidden_states"], first)
    with pytest.raises(ValueError, match="consumes DSA top-k ids"):
        consumer(h, **kw)
    model(**batch)
    assert [(n, k) for n, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor)] == []


def test_the_sparse_attention_backward_op_passes_opcheck_and_every_op_runs_on_fakes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    ids = kernels.indexer_topk(torch.randn(12, 2, 4), torch.randn(12, 4), torch.randn(12, 2),
                               cu, 4)
    q, k = (torch.randn(12, 2, 6, dtype=torch.float64) for _ in "qk")
    v = torch.randn(12, 2, 3, dtype=torch.float64)
    grad = torch.randn(12, 2, 3, dtype=torch.float64)
    torch.library.opcheck(kernels.sparse_mla_attention_backward, (grad, q, k, v, ids, 0.4))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (grad, q, k, v, ids)]
        out = kernels.sparse_mla_attention(*fake[1:], 0.4)
        dq, dk, dv = kernels.sparse_mla_attention_backward(*fake, 0.4)
        top = kernels.indexer_topk(mode.from_tensor(torch.randn(12, 2, 4)),
                                   mode.from_tensor(torch.randn(12, 4)),
                                   mode.from_tensor(torch.randn(12, 2)), mode.from_tensor(cu), 4)
    assert out.shape == (12, 2, 3) and (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert top.shape == (12, 4) and top.dtype == torch.int64


def test_the_moe_combines_its_top_k_experts_with_renormalised_softmax_gates() -> None:
    cfg = GlmDsaConfig(moe=True)
    torch.manual_seed(0)
    moe = MoE(cfg).double()
    x = torch.randn(32, cfg.hidden_size, dtype=torch.float64)
    logits = x @ moe.router.proj.weight.T
    chosen = logits.topk(cfg.num_experts_per_tok, dim=-1).indices
    want = torch.zeros_like(x)
    for t in range(32):
        gates = logits[t].softmax(-1)[chosen[t]]
        for e, g in zip(chosen[t].tolist(), gates / gates.sum()):
            ex = moe.experts[e]
            want[t] += g * ((F.silu(x[t] @ ex.gate_proj.weight.T) * (x[t] @ ex.up_proj.weight.T))
                            @ ex.down_proj.weight.T)
    torch.testing.assert_close(moe(x), want, atol=1e-12, rtol=0)
