"""The DSA lightning indexer: which keys each query attends to.

Its result is *frozen*: int ids, no gradient, computed under no-grad from detached inputs. That
is what lets a checkpoint replay take it from the original pass
(``pytree_ckpt.reuse_during_recompute``) instead of computing it again, where top-k ties or a
non-deterministic kernel could pick other keys and silently change the gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import GlmDsaConfig
from .kernels import indexer_topk

__all__ = ["DsaIndexer"]


class DsaIndexer(nn.Module):
    """``qI = WqI.cq`` per index head, ``kI = LayerNorm(WkI.a)`` one head, ``w = Ww.a``.

    ``forward(hidden_states, q_latent, cu_seqlens)`` returns int64 ids ``[T, index_topk]``
    (``-1`` where a query has fewer allowed keys than slots). Its parameters get no gradient
    from the language-model loss (GLM-5 trains them with a separate distillation loss, which
    this example leaves out).
    """

    def __init__(self, config: GlmDsaConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.wq = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_latent: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        hidden_states, q_latent = hidden_states.detach(), q_latent.detach()
        q_index = self.wq(q_latent).unflatten(-1, (self.n_heads, self.head_dim))
        k_index = self.k_norm(self.wk(hidden_states))
        weights = self.weights_proj(hidden_states)
        return indexer_topk(q_index, k_index, weights, cu_seqlens, self.topk)
