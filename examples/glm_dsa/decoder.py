"""One pre-norm decoder block: MLA + DSA attention, then a SwiGLU MLP or a tiny MoE."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from .attention import MlaAttention
from .common import RMSNorm
from .config import GlmDsaConfig
from .mlp import MoE, SwiGLU

__all__ = ["DecoderLayer", "DecoderLayerOutput"]


class DecoderLayerOutput(TypedDict):
    """What a decoder layer returns: its output and the top-k ids it attended with."""

    hidden_states: torch.Tensor
    dsa_topk_ids: torch.Tensor


class DecoderLayer(nn.Module):
    """``h += attn(norm(h))``, ``h += mlp(norm(h))``.

    A layer built with ``computes_topk=True`` owns a ``DsaIndexer`` and runs it when it is given
    ``dsa_topk_ids=None``; a consumer (``computes_topk=False``) has none and must be given the
    ids, which it returns unchanged (the very tensor object). Every input is a keyword except
    ``hidden_states``, so a checkpoint boundary sees the whole call as one PyTree.
    """

    def __init__(self, config: GlmDsaConfig, layer_idx: int, *, computes_topk: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.computes_topk = computes_topk
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MlaAttention(config, has_indexer=computes_topk)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (MoE(config) if config.moe
                               else SwiGLU(config.hidden_size, config.intermediate_size))

    def forward(self, hidden_states: torch.Tensor, *, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, cu_seqlens: torch.Tensor,
                dsa_topk_ids: torch.Tensor | None = None) -> DecoderLayerOutput:
        attn = self.self_attn(self.input_layernorm(hidden_states), rope_cos=rope_cos,
                              rope_sin=rope_sin, cu_seqlens=cu_seqlens,
                              dsa_topk_ids=dsa_topk_ids)
        hidden_states = hidden_states + attn["hidden_states"]
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return DecoderLayerOutput(hidden_states=hidden_states, dsa_topk_ids=attn["dsa_topk_ids"])
