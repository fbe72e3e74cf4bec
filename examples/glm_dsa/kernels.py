"""The DSA kernels as ``torch.library`` custom ops, and the backends that run them.

NOTE [why custom ops for every backend]: the indexer top-k and the sparse attention are
registered operators (``glm_dsa::indexer_topk``, ``glm_dsa::sparse_mla_attention`` and its
backward) whatever backend computes them. A registered op is visible by *op identity* (a
selective-checkpoint policy, a dispatch mode or a compiler sees one node, not the Python body),
and its fake implementation lets ``torch.compile`` trace through it without running it. A
plain-Python backend would be invisible to all three.

NOTE [backends]: each op's implementation asks :func:`select_backend` for the tensors' device.
The registry holds only ``"torch"`` (pure torch, any device). A fused kernel (flash-attn,
tilelang, ...) plugs in with :func:`register_backend`, naming the package it needs in
``requires``; that package is imported lazily, the first time a tensor on the backend's device
type asks for it, never at module import and never for a CPU tensor. Nothing else is
registered here because nothing else is implemented here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import torch

from .common import sequence_ids

__all__ = ["Backend", "available_backends", "indexer_topk", "register_backend",
           "select_backend", "sparse_mla_attention", "sparse_mla_attention_backward"]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the three DSA ops.

    ``device_type`` is the device it runs on (``None``: any); ``requires`` the package it
    imports, checked lazily (``None``: nothing to import).
    """

    name: str
    device_type: str | None
    requires: str | None
    indexer_topk: Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]
    sparse_attention: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]
    sparse_attention_backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float],
                                        tuple[Tensor, Tensor, Tensor]]


# --------------------------------------------------------------------------- torch backend


def _torch_indexer_topk(q_index: Tensor, k_index: Tensor, weights: Tensor, cu_seqlens: Tensor,
                        topk: int) -> Tensor:
    """``I[t,s] = sum_j w[t,j] H^-.5 d^-.5 relu(qI[t,j].kI[s])``, masked, then top-k ids."""
    total, heads, dim = q_index.shape
    logits = torch.einsum("thd,sd->ths", q_index, k_index).relu()
    scores = torch.einsum("ths,th->ts", logits, weights * (heads ** -0.5 * dim ** -0.5))
    # start(t) <= s <= t: causal and inside t's own packed sequence.
    seq = sequence_ids(cu_seqlens, total)
    positions = torch.arange(total, device=q_index.device)
    allowed = (seq[:, None] == seq[None, :]) & (positions[None, :] <= positions[:, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Ties go to the earliest key (a stable sort; topk's choice among equal scores depends on
    # the row's length and position, so a sequence would attend to other keys when packed
    # after another). Ties are common: a key whose dot products are all <= 0 scores exactly 0.
    ids = scores.sort(dim=-1, descending=True, stable=True).indices[:, :min(topk, total)]
    # Every allowed score is finite, so allowed keys are picked before any masked one; the
    # masked picks (fewer allowed keys than slots) become -1.
    ids = ids.masked_fill(~allowed.gather(1, ids), -1)
    if topk > total:
        ids = torch.cat([ids, ids.new_full((total, topk - total), -1)], dim=1)
    return ids


def _gather_keys(k: Tensor, v: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    valid = topk_ids >= 0
    safe = topk_ids.clamp(min=0)  # -1 slots read key 0 and are masked out of the softmax
    return k[safe], v[safe], valid, safe


def _probs(q: Tensor, k_sel: Tensor, valid: Tensor, scale: float) -> Tensor:
    scores = torch.einsum("thd,tkhd->thk", q, k_sel) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    # The model's indexer always selects at least the query itself, but ids from elsewhere may
    # leave a row without any valid key: it attends to nothing (zeros, and zero gradients),
    # instead of a NaN softmax whose gradient the backward would add into key 0.
    return probs.masked_fill(~valid.any(dim=-1)[:, None, None], 0.0)


def _torch_sparse_attention(q: Tensor, k: Tensor, v: Tensor, topk_ids: Tensor,
                            scale: float) -> Tensor:
    k_sel, v_sel, valid, _ = _gather_keys(k, v, topk_ids)
    return torch.einsum("thk,tkhd->thd", _probs(q, k_sel, valid, scale), v_sel)


def _torch_sparse_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                     topk_ids: Tensor, scale: float
                                     ) -> tuple[Tensor, Tensor, Tensor]:
    # The softmax is recomputed with the forward's own code (same bits), then the textbook
    # attention backward; gathered-key gradients are scattered back with index_add_.
    k_sel, v_sel, valid, safe = _gather_keys(k, v, topk_ids)
    probs = _probs(q, k_sel, valid, scale)
    d_probs = torch.einsum("thd,tkhd->thk", grad_out, v_sel)
    d_scores = probs * (d_probs - (probs * d_probs).sum(dim=-1, keepdim=True)) * scale
    dq = torch.einsum("thk,tkhd->thd", d_scores, k_sel)
    dk_sel = torch.einsum("thk,thd->tkhd", d_scores, q)
    dv_sel = torch.einsum("thk,thd->tkhd", probs, grad_out)
    flat = safe.flatten()
    dk = torch.zeros_like(k).index_add_(0, flat, dk_sel.flatten(0, 1))
    dv = torch.zeros_like(v).index_add_(0, flat, dv_sel.flatten(0, 1))
    return dq, dk, dv


TORCH_BACKEND = Backend("torch", None, None, _torch_indexer_topk, _torch_sparse_attention,
                        _torch_sparse_attention_backward)

# Most preferred first; "torch" stays last as the fallback that runs everywhere.
_REGISTRY: list[Backend] = [TORCH_BACKEND]


# --------------------------------------------------------------------------- registry


@functools.cache
def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def register_backend(backend: Backend, /) -> None:
    """Prefer ``backend`` over those registered before it (one with its name is replaced)."""
    _REGISTRY[:] = [backend] + [b for b in _REGISTRY if b.name != backend.name]


def _usable(backend: Backend, device_type: str) -> bool:
    # The device test comes first: a CPU tensor never triggers an optional import.
    if backend.device_type is not None and backend.device_type != device_type:
        return False
    return backend.requires is None or _importable(backend.requires)


def available_backends(device: torch.device | str, /) -> list[str]:
    """Names of the backends that can run on ``device``, most preferred first."""
    device_type = torch.device(device).type
    return [b.name for b in _REGISTRY if _usable(b, device_type)]


def select_backend(device: torch.device | str, /) -> Backend:
    """The most preferred backend that can run on ``device`` (``"torch"`` at worst)."""
    device_type = torch.device(device).type
    return next(b for b in _REGISTRY if _usable(b, device_type))


# --------------------------------------------------------------------------- the ops


@torch.library.custom_op("glm_dsa::indexer_topk", mutates_args=())
def indexer_topk(q_index: Tensor, k_index: Tensor, weights: Tensor, cu_seqlens: Tensor,
                 topk: int) -> Tensor:
    """Top-``topk`` key ids per query from the lightning-indexer scores; ``-1`` pads.

    ``q_index`` ``[T, H, d]``, ``k_index`` ``[T, d]``, ``weights`` ``[T, H]``, ``cu_seqlens``
    int32 ``[B + 1]``. Returns int64 ``[T, topk]``, best score first; no id exceeds its query
    position or leaves its packed sequence. Among equal scores the earliest key wins, so a
    sequence selects the same keys wherever it sits in the packed batch.
    """
    return select_backend(q_index.device).indexer_topk(q_index, k_index, weights, cu_seqlens,
                                                       topk)


@indexer_topk.register_fake
def _(q_index: Tensor, k_index: Tensor, weights: Tensor, cu_seqlens: Tensor,
      topk: int) -> Tensor:
    return q_index.new_empty((q_index.shape[0], topk), dtype=torch.int64)


@torch.library.custom_op("glm_dsa::sparse_mla_attention", mutates_args=())
def sparse_mla_attention(q: Tensor, k: Tensor, v: Tensor, topk_ids: Tensor,
                         softmax_scale: float) -> Tensor:
    """Attention of each query ``t`` over the keys ``topk_ids[t]`` (``-1`` slots ignored; a
    query without any valid id gets zeros).

    ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]``, ``topk_ids`` ``[T, K]``; returns
    ``[T, H, Dv]``.
    """
    return select_backend(q.device).sparse_attention(q, k, v, topk_ids, softmax_scale)


@sparse_mla_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, topk_ids: Tensor, softmax_scale: float) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


@torch.library.custom_op("glm_dsa::sparse_mla_attention_backward", mutates_args=())
def sparse_mla_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                  topk_ids: Tensor, softmax_scale: float
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`sparse_mla_attention` with respect to ``q``, ``k`` and ``v``."""
    return select_backend(q.device).sparse_attention_backward(grad_out, q, k, v, topk_ids,
                                                              softmax_scale)


@sparse_mla_attention_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, topk_ids: Tensor,
      softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...],
                   output: Tensor) -> None:
    q, k, v, topk_ids, softmax_scale = inputs
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and \
        isinstance(topk_ids, Tensor)  # the op's schema: four tensors and a float
    ctx.save_for_backward(q, k, v, topk_ids)
    ctx.softmax_scale = softmax_scale  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
              ) -> tuple[Tensor | None, ...]:
    q, k, v, topk_ids = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv = sparse_mla_attention_backward(grad_out.contiguous(), q, k, v, topk_ids,
                                               ctx.softmax_scale)  # type: ignore[attr-defined]
    return dq, dk, dv, None, None


sparse_mla_attention.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- FLOP formulas
#
# NOTE [FLOP formulas]: torch.utils.flop_counter.FlopCounterMode counts only the ops it has a
# formula for, and a custom op is opaque to it (it sees one node, not the einsums inside), so
# without these the DSA kernels would count as free. Each formula counts 2 FLOPs per
# multiply-add of the algorithmic work the shapes imply, masked slots included (the torch
# backend computes them, then masks): T tokens, H heads, K top-k slots. That is what the
# backend's own matmuls count for the two forwards; its backward builds dk_sel and dv_sel as
# outer products scattered with index_add_, which FlopCounterMode does not count, so the
# backward's formula is the work of autograd's backward of the forward plus the recomputed
# probabilities (tests/examples/test_glm_dsa_model.py checks each against FlopCounterMode).
#
# - indexer_topk: logits ``qI . kI`` for every (t, s, head): T*T*H*d mul-adds, then the
#   head-weighted sum: T*T*H mul-adds -> 2*T*T*H*(d + 1). ReLU, masking and top-k are not
#   mul-adds and are not counted (FlopCounterMode counts no elementwise op either).
# - sparse_mla_attention: scores ``q . k_sel`` T*H*K*Dqk, ``probs . v_sel`` T*H*K*Dv
#   -> 2*T*H*K*(Dqk + Dv).
# - sparse_mla_attention_backward: the probabilities are recomputed (T*H*K*Dqk), then
#   dP = dO . v_sel (T*H*K*Dv), dq (T*H*K*Dqk), dk_sel (T*H*K*Dqk), dv_sel (T*H*K*Dv)
#   -> 2*T*H*K*(3*Dqk + 2*Dv).


def indexer_topk_flops(q_index_shape: torch.Size | tuple[int, ...],
                       k_index_shape: torch.Size | tuple[int, ...]) -> int:
    """FLOPs of ``indexer_topk`` for ``q_index`` ``[T, H, d]`` and ``k_index`` ``[S, d]``."""
    total, heads, dim = q_index_shape
    keys = k_index_shape[0]
    return 2 * total * keys * heads * (dim + 1)


def sparse_attention_flops(q_shape: torch.Size | tuple[int, ...],
                           v_shape: torch.Size | tuple[int, ...],
                           ids_shape: torch.Size | tuple[int, ...], *,
                           backward: bool = False) -> int:
    """FLOPs of the sparse attention forward (or ``backward``) for these shapes."""
    total, heads, dqk = q_shape
    dv = v_shape[-1]
    slots = ids_shape[-1]
    per_slot = 3 * dqk + 2 * dv if backward else dqk + dv
    return 2 * total * heads * slots * per_slot


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import register_flop_formula

    def indexer(q_index: torch.Size, k_index: torch.Size, *_: object, **__: object) -> int:
        return indexer_topk_flops(q_index, k_index)

    def attention(q: torch.Size, k: torch.Size, v: torch.Size, topk_ids: torch.Size,
                  *_: object, **__: object) -> int:
        return sparse_attention_flops(q, v, topk_ids)

    def attention_backward(grad_out: torch.Size, q: torch.Size, k: torch.Size, v: torch.Size,
                           topk_ids: torch.Size, *_: object, **__: object) -> int:
        return sparse_attention_flops(q, v, topk_ids, backward=True)

    for op, formula in ((torch.ops.glm_dsa.indexer_topk, indexer),
                        (torch.ops.glm_dsa.sparse_mla_attention, attention),
                        (torch.ops.glm_dsa.sparse_mla_attention_backward, attention_backward)):
        try:
            register_flop_formula(op)(formula)
        except RuntimeError:  # already registered (this module was reloaded)
            pass


_register_flop_formulas()
