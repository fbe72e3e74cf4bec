"""Multi-token prediction (DeepSeek-V3 style), one physical layer shared by every depth.

Depth ``k`` (1..D) predicts token ``t + k + 1`` at position ``t`` from
``h'_k = eh_proj(cat[enorm(Embed(roll(ids, -k))), hnorm(h_{k-1})])`` passed through a decoder
block; ``h_0`` is the main model's last hidden state (before its final norm). The model applies
the shared output head to ``final_norm`` of the block output.

NOTE [rolling a packed row]: ``roll(ids, -k)`` is a plain ``torch.roll`` over the whole packed
row, so near the end of a sequence the rolled tokens come from the next sequence (or wrap around
the row). Those positions are exactly the ones :func:`mtp_labels` sets to ``-100``, so they never
reach the loss; they only cost a few wasted rows of compute.
"""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from .common import RMSNorm, sequence_ids
from .config import GlmDsaConfig
from .decoder import DecoderLayer

__all__ = ["MtpLayer", "MtpLayerOutput", "mtp_labels"]

IGNORE_INDEX = -100


class MtpLayerOutput(TypedDict):
    """``hidden_states`` feeds the next depth; ``final_hidden_states`` feeds the output head."""

    hidden_states: torch.Tensor
    final_hidden_states: torch.Tensor
    dsa_topk_ids: torch.Tensor


class MtpLayer(nn.Module):
    """Embedding/hidden fusion, a decoder block with its own indexer, and a final norm."""

    def __init__(self, config: GlmDsaConfig, *, computes_topk: bool) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = DecoderLayer(config, config.num_layers, computes_topk=computes_topk)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, *, token_embeds: torch.Tensor,
                rope_cos: torch.Tensor, rope_sin: torch.Tensor, cu_seqlens: torch.Tensor,
                dsa_topk_ids: torch.Tensor | None = None) -> MtpLayerOutput:
        fused = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden_states)],
                                       dim=-1))
        out = self.block(fused, rope_cos=rope_cos, rope_sin=rope_sin, cu_seqlens=cu_seqlens,
                         dsa_topk_ids=dsa_topk_ids)
        return MtpLayerOutput(hidden_states=out["hidden_states"],
                              final_hidden_states=self.final_norm(out["hidden_states"]),
                              dsa_topk_ids=out["dsa_topk_ids"])


def mtp_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor, depth: int) -> torch.Tensor:
    """Labels of MTP depth ``depth`` for a packed row of labels ``[T]``.

    ``labels`` rolled by ``-depth``; a position whose shifted target lies past the end of its
    own sequence (including a wrap around the row) becomes ``-100``.
    """
    total = labels.shape[-1]
    ends = cu_seqlens.long()[1:][sequence_ids(cu_seqlens, total)]
    inside = torch.arange(total, device=labels.device) + depth < ends
    return torch.where(inside, torch.roll(labels, -depth, dims=-1), IGNORE_INDEX)
