"""Multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA).

NOTE [one indexer call site]: a layer that computes its top-k calls its indexer in exactly one
place, :meth:`MlaAttention.select_keys`, through ``pytree_ckpt.reuse_during_recompute``: inside
a checkpoint boundary the original pass records the ids and the replay returns the recorded
tensor without running the indexer. ``reuse_indexer = False`` calls it directly instead (the
replay then recomputes it), which exists only to show what reuse protects against.

NOTE [ids in, same ids out]: a layer given ``dsa_topk_ids`` (a consumer) runs no indexer and
returns the very tensor object it received, so every consumer downstream of a source sees the
source's storage; nothing is cached on the module or on a context object.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypedDict

import pytree_ckpt
import torch
import torch.nn.functional as F
from torch import nn

from .common import RMSNorm, apply_rope
from .config import GlmDsaConfig
from .indexer import DsaIndexer
from .kernels import sparse_mla_attention

__all__ = ["AttentionOutput", "MlaAttention", "MlaProjection"]


class AttentionOutput(TypedDict):
    hidden_states: torch.Tensor
    dsa_topk_ids: torch.Tensor


class MlaProjection(NamedTuple):
    """Per-head queries, keys and values (``[T, H, *]``) and the query latent ``cq``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_latent: torch.Tensor


def _call_directly(fn: Any, /, *args: Any) -> Any:
    return fn(*args)


class MlaAttention(nn.Module):
    """MLA whose softmax runs over the DSA-selected keys only.

    ``cq = RMSNorm(Wqa.a)``, ``q = Wqb.cq`` split per head into no-RoPE and RoPE parts;
    ``ckv, kpe = split(Wkva.a)``, ``ckv`` normed, ``kpe`` RoPE'd and shared by all heads;
    ``k_nope, v = split(Wkvb.ckv)``. Softmax scale ``(qk_nope + qk_rope) ** -0.5``.
    """

    def __init__(self, config: GlmDsaConfig, *, has_indexer: bool) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.dropout = config.dropout
        self.reuse_indexer = config.reuse_indexer
        hidden, heads = config.hidden_size, config.num_heads
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * config.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.indexer = DsaIndexer(config) if has_indexer else None

    def project(self, hidden_states: torch.Tensor, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor) -> MlaProjection:
        """Queries, keys and values of the normed input ``a`` (``[T, hidden]``)."""
        heads = self.num_heads
        q_latent = self.q_a_norm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_latent).unflatten(-1, (heads, self.nope_dim + self.rope_dim))
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        ckv, k_pe = self.kv_a_proj(hidden_states).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(ckv)).unflatten(-1, (heads, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_pe = apply_rope(q_pe, rope_cos, rope_sin)
        k_pe = apply_rope(k_pe, rope_cos, rope_sin)  # one RoPE head shared by every head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
        return MlaProjection(q, k, v.contiguous(), q_latent)

    def select_keys(self, hidden_states: torch.Tensor, q_latent: torch.Tensor,
                    cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Run this layer's indexer; see NOTE [one indexer call site]."""
        if self.indexer is None:
            raise ValueError("this attention layer consumes DSA top-k ids and has no indexer; "
                             "tip: pass dsa_topk_ids from the nearest earlier computing layer "
                             "(config.topk_source_layers tells which layers compute)")
        call = pytree_ckpt.reuse_during_recompute if self.reuse_indexer else _call_directly
        return call(self.indexer, hidden_states.detach(), q_latent.detach(), cu_seqlens)

    def forward(self, hidden_states: torch.Tensor, *, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, cu_seqlens: torch.Tensor,
                dsa_topk_ids: torch.Tensor | None = None) -> AttentionOutput:
        proj = self.project(hidden_states, rope_cos, rope_sin)
        if dsa_topk_ids is None:
            dsa_topk_ids = self.select_keys(hidden_states, proj.q_latent, cu_seqlens)
        out = sparse_mla_attention(proj.q, proj.k, proj.v, dsa_topk_ids, self.softmax_scale)
        out = self.o_proj(out.flatten(1))
        out = F.dropout(out, p=self.dropout, training=self.training)
        return AttentionOutput(hidden_states=out, dsa_topk_ids=dsa_topk_ids)
