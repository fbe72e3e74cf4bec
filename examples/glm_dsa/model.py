"""The GLM-5-style causal LM: embedding, DSA decoder layers, MTP depths, shared output head.

NOTE [explicit top-k dataflow]: the model loop is the only place that routes DSA ids. A layer
that computes its top-k (``topk_source_layers``) is called with ``dsa_topk_ids=None`` and
returns its ids; each later consumer is called with the latest source's ids, as a keyword
argument, and returns them unchanged. MTP depth 1 computes its own ids and depths 2..D receive
them. Because every layer is called with keywords only (besides ``hidden_states``), a layer
wrapped by ``pytree_ckpt.apply_activation_checkpointing`` sees the whole call, ids included, as
one PyTree crossing its boundary.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

import pytree_ckpt
from offload import OffloadManager
from pytree_ckpt import (KeptCallables, KeptOps, RecomputeConfig, RecomputeTargetMap, SaveUnit,
                         apply_recompute_config)
from pytree_ckpt.apply import layer_count

from .common import (RMSNorm, default_cu_seqlens, position_ids, rope_tables,
                     validate_cu_seqlens)
from .config import GlmDsaConfig, topk_source_layers
from .decoder import DecoderLayer
from .mtp import IGNORE_INDEX, MtpLayer, mtp_labels

__all__ = ["CausalLMOutput", "GlmDsaForCausalLM"]


class CausalLMOutput(TypedDict):
    """``loss = main_loss + mtp_loss_weight * mean(mtp_losses)``; ``logits`` ``[1, T, V]``."""

    loss: torch.Tensor
    main_loss: torch.Tensor
    mtp_losses: list[torch.Tensor]
    logits: torch.Tensor


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Mean over the labelled positions; 0 (not NaN) when a depth has none left.
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


class GlmDsaForCausalLM(nn.Module):
    """A small GLM-5-style decoder with DSA sparse attention and multi-token prediction."""

    # What each save unit keeps in this model (tests resolve every name, so a rename cannot
    # silently make a unit keep nothing). Attention and the indexer top-k by op identity (both
    # are custom ops whatever backend runs them); the MoE gate by the router's projection
    # method, which encloses only the projection (not the in-place-free top-k after it); the
    # MoE dispatch by the method that groups tokens per expert.
    recompute_targets: RecomputeTargetMap = {
        SaveUnit.ATTN: KeptOps("glm_dsa::sparse_mla_attention"),
        SaveUnit.DSA_INDEXER: KeptOps("glm_dsa::indexer_topk"),
        SaveUnit.MOE_GATE: KeptCallables("Router.project"),
        SaveUnit.MOE_DISPATCH: KeptCallables("MoE.dispatch"),
    }

    def __init__(self, config: GlmDsaConfig) -> None:
        super().__init__()
        self.config = config
        self.topk_sources = topk_source_layers(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, computes_topk=computes)
            for i, computes in enumerate(self.topk_sources))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # One physical layer (by default) applied at every depth; only the first computes top-k.
        num_mtp = config.mtp_num_layers if config.mtp_depth > 0 else 0
        self.mtp_layers = nn.ModuleList(
            MtpLayer(config, computes_topk=j == 0) for j in range(num_mtp))

    def declared_targets(self) -> RecomputeTargetMap:
        """The save units this model's layers have: the MoE ones only where ``config.moe`` (a
        dense model's ``save=True`` warned that they keep nothing: helper FZ); a unit it does not
        have is refused by name, listing these."""
        if self.config.moe:
            return self.recompute_targets
        return {unit: target for unit, target in self.recompute_targets.items()
                if unit not in (SaveUnit.MOE_GATE, SaveUnit.MOE_DISPATCH)}

    def checkpoint_layers(self, ratio: float = 1.0, *, mtp: bool = True,
                          offload: bool | OffloadManager | None = None,
                          save: list[SaveUnit | str] | bool | None = None,
                          verify_replay: bool = False) -> list[int]:
        """Checkpoint the first ``ratio`` of the decoder layers and, if ``mtp``, the MTP layers.

        ``save``: the save units to keep resident (``RecomputeConfig.save``). ``offload`` and
        ``verify_replay`` as in ``pytree_ckpt.apply_activation_checkpointing`` (``None`` reads
        XTUNER_ACTIVATION_OFFLOAD); resolved once, so all layers share one manager.
        ``verify_replay`` also reaches every layer's norm discards (``discard_norm_outputs``),
        checkpointed or not. Returns the indices of the checkpointed decoder layers.
        """
        manager = pytree_ckpt.resolve_offload(offload) or False
        targets = self.declared_targets()
        wraps_mtp = mtp and len(self.mtp_layers) > 0
        try:  # the library's count of the layers a ratio takes (helper HG: not int(n * ratio))
            no_decoder_layer = layer_count(len(self.layers), ratio) == 0
        except (TypeError, ValueError):  # refused below, naming the ratio
            no_decoder_layer = False
        # The offload and save units asked for reach the decoder layers as given (None, the
        # environment's switch, resolves to the same default manager), so that at ratio 0
        # the library says they do nothing; but not where the MTP layers, always wrapped,
        # use them (helper HF: a false "offloads nothing").
        quiet = no_decoder_layer and wraps_mtp
        chosen = apply_recompute_config(
            self.layers, RecomputeConfig(ratio, save=None if quiet else save), targets,
            offload=False if quiet else offload, verify_replay=verify_replay)
        if wraps_mtp:
            apply_recompute_config(self.mtp_layers, RecomputeConfig(1.0, save=save), targets,
                                   offload=manager, verify_replay=verify_replay)
        for module in self.modules():  # the norms' output discards, checkpointed or not
            if isinstance(module, DecoderLayer):
                module.verify_discards = verify_replay
        return chosen

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> CausalLMOutput:
        """``input_ids`` and ``labels``: one packed row ``[1, T]``; ``cu_seqlens`` int32."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids and labels must both be one packed row [1, T], got "
                             f"{tuple(input_ids.shape)} and {tuple(labels.shape)}; tip: "
                             "concatenate the sequences and describe them with cu_seqlens")
        tokens, targets = input_ids[0], labels[0]
        total = tokens.shape[0]
        if cu_seqlens is None:
            cu_seqlens = default_cu_seqlens(total, tokens.device)
        validate_cu_seqlens(cu_seqlens, total)
        config = self.config
        cos, sin = rope_tables(position_ids(cu_seqlens, total), config.qk_rope_head_dim,
                               config.rope_theta, self.embed_tokens.weight.dtype)
        rope = dict(rope_cos=cos, rope_sin=sin, cu_seqlens=cu_seqlens)

        hidden = self.embed_tokens(tokens)
        ids: torch.Tensor | None = None
        for layer, computes in zip(self.layers, self.topk_sources):
            out = layer(hidden, **rope, dsa_topk_ids=None if computes else ids)
            hidden, ids = out["hidden_states"], out["dsa_topk_ids"]
        logits = self.lm_head(self.norm(hidden))
        main_loss = _cross_entropy(logits, targets)

        mtp_losses: list[torch.Tensor] = []
        mtp_ids: torch.Tensor | None = None
        for depth in range(1, config.mtp_depth + 1):
            mtp_layer = self.mtp_layers[(depth - 1) % len(self.mtp_layers)]
            embeds = self.embed_tokens(torch.roll(tokens, -depth, dims=-1))
            out_k = mtp_layer(hidden, token_embeds=embeds, **rope, dsa_topk_ids=mtp_ids)
            hidden, mtp_ids = out_k["hidden_states"], out_k["dsa_topk_ids"]
            mtp_logits = self.lm_head(out_k["final_hidden_states"])
            mtp_losses.append(_cross_entropy(mtp_logits, mtp_labels(targets, cu_seqlens, depth)))

        loss = main_loss
        if mtp_losses:
            loss = main_loss + config.mtp_loss_weight * torch.stack(mtp_losses).mean()
        return CausalLMOutput(loss=loss, main_loss=main_loss, mtp_losses=mtp_losses,
                              logits=logits[None])
