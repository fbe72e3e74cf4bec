"""One pre-norm decoder block: MLA + DSA attention, then a SwiGLU MLP or a tiny MoE."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from pytree_ckpt import CheckpointWithoutOutput

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
        self.discard_norm_outputs = config.discard_norm_outputs
        # The norms' discards compare each rebuild with the forward's output, bit for bit
        # (CheckpointWithoutOutput(verify_replay=True)): set by the model's checkpoint_layers.
        self.verify_discards = False
        self.computes_topk = computes_topk
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MlaAttention(config, has_indexer=computes_topk)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (MoE(config) if config.moe
                               else SwiGLU(config.hidden_size, config.intermediate_size))

    def forward(self, hidden_states: torch.Tensor, *, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, cu_seqlens: torch.Tensor,
                dsa_topk_ids: torch.Tensor | None = None) -> DecoderLayerOutput:
        if not self.discard_norm_outputs:
            attn = self.self_attn(self.input_layernorm(hidden_states), rope_cos=rope_cos,
                                  rope_sin=rope_sin, cu_seqlens=cu_seqlens,
                                  dsa_topk_ids=dsa_topk_ids)
            hidden_states = hidden_states + attn["hidden_states"]
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
            return DecoderLayerOutput(hidden_states=hidden_states,
                                      dsa_topk_ids=attn["dsa_topk_ids"])
        # Output discard: each norm's output is freed once its consumers saved it, and rebuilt
        # when the gradient of the consumer's output arrives (inside a checkpoint boundary this
        # happens in the replay; the original pass runs without grad and discards nothing).
        norm = CheckpointWithoutOutput(verify_replay=self.verify_discards)
        attn = self.self_attn(norm.checkpoint(self.input_layernorm, hidden_states),
                              rope_cos=rope_cos, rope_sin=rope_sin, cu_seqlens=cu_seqlens,
                              dsa_topk_ids=dsa_topk_ids)
        norm.discard_output_and_register_recompute(attn["hidden_states"])
        hidden_states = hidden_states + attn["hidden_states"]
        post_norm = CheckpointWithoutOutput(verify_replay=self.verify_discards)
        mlp_out = self.mlp(post_norm.checkpoint(self.post_attention_layernorm, hidden_states))
        post_norm.discard_output_and_register_recompute(mlp_out)
        return DecoderLayerOutput(hidden_states=hidden_states + mlp_out,
                                  dsa_topk_ids=attn["dsa_topk_ids"])
