"""The feed-forward blocks: a SwiGLU MLP, and a tiny routed MoE of SwiGLU experts.

NOTE [frozen routing, differentiable gates]: the MoE splits its router in two. The scores come
from :meth:`Router.project` (only the projection, differentiable). The expert choice is
:meth:`Router.select`, a no-grad top-k returning int ids, called through
``pytree_ckpt.reuse_during_recompute``: a checkpoint replay reuses the original assignment, so
every expert sees the same tokens (the same shapes) as in the original pass. The combine weights
are gathered from the softmax of the *replayed-pass* projection at those ids, so the router
still receives its gradient.
"""

from __future__ import annotations

import pytree_ckpt
import torch
import torch.nn.functional as F
from torch import nn

from .config import GlmDsaConfig

__all__ = ["MoE", "Router", "SwiGLU"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Token-to-expert scores (:meth:`project`) and the frozen expert choice (:meth:`select`)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.proj = nn.Linear(hidden_size, n_experts, bias=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]``; encloses the projection and nothing else."""
        return self.proj(x)

    @torch.no_grad()
    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``top_k`` experts of each token (int64 ``[T, top_k]``, no grad)."""
        return logits.detach().topk(self.top_k, dim=-1).indices


class MoE(nn.Module):
    """Routed SwiGLU experts combined with renormalised softmax gates."""

    def __init__(self, config: GlmDsaConfig) -> None:
        super().__init__()
        self.router = Router(config.hidden_size, config.n_routed_experts,
                             config.num_experts_per_tok)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.n_routed_experts))

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per expert: the tokens routed to it, their top-k slots, and their hidden states.

        The save unit ``moe_dispatch`` keeps what this returns (the token permutation, an
        all-to-all's output in expert-parallel training) instead of recomputing it.
        """
        routed = []
        for e in range(len(self.experts)):
            # Data-dependent shapes: exactly what differs if a replay re-routed the tokens.
            token, slot = (expert_ids == e).nonzero(as_tuple=True)
            routed.append((token, slot, x[token]))
        return routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.project(x)
        expert_ids = pytree_ckpt.reuse_during_recompute(self.router.select, logits.detach())
        gates = logits.softmax(dim=-1).gather(-1, expert_ids)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for expert, (token, slot, tokens) in zip(self.experts, self.dispatch(x, expert_ids)):
            out = out.index_add(0, token, expert(tokens) * gates[token, slot, None])
        return out
