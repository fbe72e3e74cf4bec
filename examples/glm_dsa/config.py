"""The configuration of the example GLM-5-style decoder, and which layers compute DSA top-k.

The defaults are the CPU reference sizes of CONTEXT.md section 5: small enough for a test to
run a full training step in milliseconds, with ``index_topk`` below the sequence lengths used in
tests so that the sparse attention really drops keys.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["GlmDsaConfig", "topk_source_layers"]


def _invalid(field: str, value: object, rule: str, tip: str) -> ValueError:
    return ValueError(f"GlmDsaConfig.{field} must be {rule}, got {value!r}; tip: {tip}")


@dataclasses.dataclass(frozen=True)
class GlmDsaConfig:
    """Sizes and switches of :class:`~examples.glm_dsa.model.GlmDsaForCausalLM`."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 8
    num_heads: int = 4
    # MLA: query and key/value latents, and the per-head split of q/k into no-RoPE and RoPE parts.
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # DSA lightning indexer and index sharing between layers.
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 8
    index_topk_freq: int = 4
    index_skip_topk_offset: int = 3
    # Multi-token prediction: ``mtp_depth`` depths share ``mtp_num_layers`` physical layers.
    mtp_depth: int = 2
    mtp_num_layers: int = 1
    mtp_loss_weight: float = 0.1
    # MLP: dense SwiGLU, or a tiny routed MoE of SwiGLU experts.
    intermediate_size: int = 128
    moe: bool = False
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Attention-output dropout; 0 keeps outputs deterministic, > 0 exercises RNG replay.
    dropout: float = 0.0
    # Call the indexer through pytree_ckpt.reuse_during_recompute (True) or directly (False,
    # which reruns it in every checkpoint replay: only useful to show why reuse exists).
    reuse_indexer: bool = True
    # Run both pre-norms through output-discard replay (pytree_ckpt.CheckpointWithoutOutput):
    # their outputs are freed once the projections saved them, and rebuilt in backward.
    discard_norm_outputs: bool = False

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                    "index_head_dim", "index_topk", "index_topk_freq", "intermediate_size",
                    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _invalid(name, value, "a positive int", "every size and count is >= 1")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise _invalid("qk_rope_head_dim", self.qk_rope_head_dim, "an even int >= 2",
                           "RoPE rotates pairs of channels")
        if self.index_skip_topk_offset < 1:
            raise _invalid("index_skip_topk_offset", self.index_skip_topk_offset, ">= 1",
                           "GLM-5.2 uses 3; with offset >= 1 layer 0 always computes its top-k")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _invalid("num_experts_per_tok", self.num_experts_per_tok,
                           f"<= n_routed_experts ({self.n_routed_experts})",
                           "a token cannot pick more experts than exist")
        if self.mtp_depth < 0:
            raise _invalid("mtp_depth", self.mtp_depth, ">= 0", "use 0 to disable MTP")
        if self.mtp_depth > 0 and self.mtp_num_layers < 1:
            raise _invalid("mtp_num_layers", self.mtp_num_layers, ">= 1 when mtp_depth > 0",
                           "one physical layer shared by all depths is the GLM-5 setup")
        if not (math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0):
            raise _invalid("mtp_loss_weight", self.mtp_loss_weight, "a finite number >= 0",
                           "the MTP loss is added as weight * mean over depths")
        if not 0.0 <= self.dropout < 1.0:
            raise _invalid("dropout", self.dropout, "in [0, 1)", "use 0.0 for no dropout")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            field = "rms_norm_eps" if self.rms_norm_eps <= 0 else "rope_theta"
            raise _invalid(field, getattr(self, field), "> 0", "defaults are 1e-6 and 10000.0")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-RoPE part followed by the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA's softmax scale ``(qk_nope + qk_rope) ** -0.5``."""
        return self.qk_head_dim ** -0.5


def topk_source_layers(config: GlmDsaConfig, /) -> list[bool]:
    """For each decoder layer, whether it computes its own DSA top-k.

    Layer ``i`` computes when ``max(i - offset + 1, 0) % freq == 0``; otherwise it consumes the
    ids of the nearest earlier computing layer. With the defaults (8 layers, freq 4, offset 3)::

        i            0  1  2  3  4  5  6  7
        max(i-2, 0)  0  0  0  1  2  3  4  5
        computes     T  T  T  F  F  F  T  F

    so layers 0, 1, 2 and 6 compute; 3, 4, 5 consume layer 2's ids and 7 consumes layer 6's.
    Layer 0 always computes because ``offset >= 1``.
    """
    offset, freq = config.index_skip_topk_offset, config.index_topk_freq
    return [max(i - offset + 1, 0) % freq == 0 for i in range(config.num_layers)]
