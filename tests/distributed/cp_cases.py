"""Context parallelism (ring attention, Ulysses all-to-all, all-gathered keys and values)
inside checkpointed attention layers, two CPU ranks (gloo; helper NI).

    python tests/distributed/cp_cases.py OUT CASE [CASE ...]

The model: two residual attention layers (q, k, v, o Linears, 2 heads of 4, non-causal, fp32)
over a sequence of 2 * TOKENS positions split in halves across the ranks. A case is
``<how>-<option>``: ``how`` the way a layer sees the other rank's half:

- ``ring_sendrecv`` / ``ring_isend`` / ``ring_batch``: ring attention, the keys and values
  swapped with the peer by ``dist.send``/``dist.recv``, ``isend``/``irecv`` + ``wait``, or
  ``dist.batch_isend_irecv`` in an autograd Function whose backward swaps the gradient back,
  merged block by block with the online softmax;
- ``ulysses`` / ``ulysses_fn``: ``all_to_all_single`` from sequence to head sharding before
  attention and back after it (``torch.distributed.nn.functional``'s, or ``dist``'s in an
  autograd Function of our own);
- ``allgather_nn`` / ``allgather_fc``: the keys and values all-gathered with autograd
  (``torch.distributed.nn.functional.all_gather``, ``_functional_collectives
  .all_gather_tensor_autograd``);
- ``ulysses_fc``: ``_functional_collectives.all_to_all_single_autograd``, the layer returning
  the all-to-all's output as it is (an AsyncCollectiveTensor; ``Post`` projects it);
- ``allreduce_fc``: allgather_fc, then a functional ``all_reduce`` (a global normalisation);
  ``allreduce_inplace``: a ``dist.all_reduce`` in place on a clone with a graph;
- ``ring_drop``: ring_isend with a dropout after it; ``group_arg``: ring_isend, the process
  group given to each layer as a keyword; ``actin``: ring_isend, the first layer's input an
  all-to-all still in flight (an AsyncCollectiveTensor);
- ``topk`` / ``topk_empty``: ring_isend, plus a global top-k over both ranks' scores (a
  ``dist.all_gather`` in a plain function) frozen with ``reuse_during_recompute``: the
  positions kept count twice (``topk_empty``: rank 1 keeps none); ``stats``: a global max
  (``all_reduce(MAX)`` of detached scores) frozen so, a float the layer scales by.

``option``: ``plain``, ``offload`` (an OffloadManager, min_bytes 0), ``verify``
(``verify_replay=True``), ``both``; ``accum``: both, two micro-batches a step; ``keep`` /
``keepv``: the ``attn`` save unit keeps the attention core methods (``KeptCallables``),
without / with verify_replay; ``keepops`` / ``keepopsv``: it keeps ``aten::bmm``,
``aten::_softmax`` and ``aten::exp`` (``KeptOps``); ``nested``: the attention core in an inner
``checkpoint`` inside each checkpointed layer; ``core``: only that inner boundary.

Each rank returns, for the uncheckpointed model (``eager``) and the checkpointed one
(``ckpt``), per SGD step the all-reduced loss, the input's gradient (per micro-batch) and every
parameter's gradient (summed over ranks), and the collectives each layer ran by phase; what a
third checkpointed step holds by mechanism (an ActivationCensus, ``held``); and both models'
output and collectives in a no_grad evaluation forward (``evals``).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnnf
from torch import nn

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from tests.distributed.rank_cases import run_cases

WORLD = 2
TOKENS = 6  # a rank's positions
DIM = 8
HEADS = 2
HD = DIM // HEADS
STEPS = 2
SEEN: Counter[str] = Counter()


def _note(what: str) -> None:
    SEEN[f"{what}|{pytree_ckpt.current_phase()}"] += 1


def _swap(t: torch.Tensor, how: str) -> torch.Tensor:
    """The peer's tensor for ours (two ranks)."""
    rank = dist.get_rank()
    peer = 1 - rank
    t = t.contiguous()
    got = torch.empty_like(t)
    if how == "ring_sendrecv":
        if rank == 0:
            dist.send(t, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(t, peer)
    elif how == "ring_batch":
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer),
                                            dist.P2POp(dist.irecv, got, peer)]):
            work.wait()
    else:
        works = [dist.isend(t, peer), dist.irecv(got, peer)]
        for work in works:
            work.wait()
    return got


class Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, how: str) -> torch.Tensor:
        ctx.how = how
        _note("swap")
        return _swap(t.detach(), how)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _note("swap_back")
        return _swap(grad, ctx.how), None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        _note("a2a")
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t.detach().contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _note("a2a_back")
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous())
        return out


def global_max(scores: torch.Tensor) -> torch.Tensor:
    """A float statistic over both ranks (no grad: detached scores)."""
    _note("max")
    top = scores.amax().clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top


def _a2a(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "ulysses_fn":
        return AllToAll.apply(t)
    if how == "ulysses_fc":
        import torch.distributed._functional_collectives as fc
        _note("a2a")
        return fc.all_to_all_single_autograd(t.contiguous(), None, None, dist.group.WORLD)
    _note("a2a")
    return dnnf.all_to_all_single(torch.empty_like(t), t.contiguous())


def global_topk(scores: torch.Tensor, k: int, skew: float = 0.0) -> torch.Tensor:
    """The k positions of the highest score over both ranks, as local positions; ``skew``
    lowers rank 1's scores (it then keeps none)."""
    _note("topk")
    scores = scores - skew * dist.get_rank()
    parts = [torch.empty_like(scores) for _ in range(WORLD)]
    dist.all_gather(parts, scores.contiguous())
    top = torch.cat(parts).topk(k).indices
    local = top - dist.get_rank() * scores.shape[0]
    return local[(local >= 0) & (local < scores.shape[0])].sort().values


class Attention(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.score = nn.Linear(DIM, 1)
        self.inner = False

    def forward(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        if self.how == "group_arg":
            assert group is dist.group.WORLD or group is not None
        s = x.shape[0]
        q, k, v = (lin(x).view(s, HEADS, HD).transpose(0, 1) for lin in (self.q, self.k, self.v))
        how = self.how
        if self.inner:  # the attention core in a boundary of its own
            out = pytree_ckpt.checkpoint(self._core, q, k, v)
        else:
            out = self._core(q, k, v)
        if how == "ulysses_fc":  # the all-to-all's output, returned as it is (an ACT)
            return out
        if how == "allreduce_fc":  # a global normalisation: a sum over both ranks
            import torch.distributed._functional_collectives as fc
            _note("all_reduce")
            den = fc.all_reduce(out.square().sum(), "sum", dist.group.WORLD)
            out = out / den.sqrt()
        h = self.o(out.transpose(0, 1).reshape(s, DIM))
        if how.startswith("topk"):
            keep = pytree_ckpt.reuse_during_recompute(
                global_topk, self.score(x).squeeze(-1).detach(), TOKENS,
                100.0 if how == "topk_empty" else 0.0)
            h = h.index_add(0, keep, h[keep])  # the kept positions count twice
        if how == "stats":
            top = pytree_ckpt.reuse_during_recompute(global_max, self.score(x).detach())
            h = h * (self.score(x) - top).exp()
        if how == "allreduce_inplace":
            total = h.sum(0, keepdim=True).clone()
            _note("all_reduce")
            dist.all_reduce(total)
            h = h + 1e-3 * total
        return x + h

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        how = self.how
        if how.startswith("ring") or how.startswith("topk") or how in ("stats", "group_arg", "actin"):
            out = self._ring(q, k, v, how if how.startswith("ring_") else "ring_isend")
            if how == "ring_drop":
                out = torch.nn.functional.dropout(out, 0.3, training=True)
            return out
        if how.startswith("ulysses"):
            return self._ulysses(q, k, v, how)
        return self._gathered(q, k, v, how)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              how: str) -> torch.Tensor:
        scale = HD ** -0.5
        m = l = acc = None
        blocks = [(k, v)]
        kv = torch.cat([k, v])
        other = Swap.apply(kv, how)
        blocks.append((other[:HEADS], other[HEADS:]))
        if dist.get_rank() == 1:  # the same block order on both ranks: rank 0's half first
            blocks.reverse()
        for kb, vb in blocks:
            s = q @ kb.transpose(-1, -2) * scale
            mb = s.amax(-1, keepdim=True)
            if m is None:
                m = mb
                p = torch.exp(s - m)
                l, acc = p.sum(-1, keepdim=True), p @ vb
            else:
                new = torch.maximum(m, mb)
                a = torch.exp(m - new)
                p = torch.exp(s - new)
                l = l * a + p.sum(-1, keepdim=True)
                acc = acc * a + p @ vb
                m = new
        return acc / l

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 how: str) -> torch.Tensor:
        s = q.shape[1]
        local = HEADS // WORLD

        def to_heads(t: torch.Tensor) -> torch.Tensor:  # [H, s, hd] -> [H/W, W*s, hd]
            t = _a2a(t.reshape(WORLD, local, s, HD), how)  # [src rank, H/W, s, hd]
            return t.transpose(0, 1).reshape(local, WORLD * s, HD)

        qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
        out = torch.softmax(qh @ kh.transpose(-1, -2) * HD ** -0.5, -1) @ vh
        back = out.reshape(local, WORLD, s, HD).transpose(0, 1)  # [dst rank, H/W, s, hd]
        back = _a2a(back.contiguous(), how)
        return back if how == "ulysses_fc" else back.reshape(HEADS, s, HD)

    def _gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  how: str) -> torch.Tensor:
        _note("gather")
        if how == "allgather_nn":
            ks = torch.cat(dnnf.all_gather(k.contiguous()), 1)
            vs = torch.cat(dnnf.all_gather(v.contiguous()), 1)
        else:
            import torch.distributed._functional_collectives as fc
            group = dist.group.WORLD
            ks = fc.all_gather_tensor_autograd(k.transpose(0, 1).contiguous(), 0, group)
            vs = fc.all_gather_tensor_autograd(v.transpose(0, 1).contiguous(), 0, group)
            ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
        return torch.softmax(q @ ks.transpose(-1, -2) * HD ** -0.5, -1) @ vs


class Post(nn.Module):
    """After a layer that returns the all-to-all's output itself: its projection (no residual:
    an input used inside and outside a call gets its gradient summed in another order,
    docs/limits.md)."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.attn(x)
        return self.attn.o(out.reshape(HEADS, x.shape[0], HD).transpose(0, 1)
                               .reshape(x.shape[0], DIM))


def _model(how: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(how), Attention(how))


def _train(model: nn.Sequential, rank: int, micro: int = 1) -> list[dict[str, Any]]:
    """STEPS SGD steps of ``micro`` micro-batches each (gradients accumulated)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run: Any = model
    if model[0].how == "ulysses_fc":
        run = lambda x: Post(model[1])(Post(model[0])(x))  # noqa: E731
    elif model[0].how == "actin":  # the first layer's input: an all-to-all still in flight
        import torch.distributed._functional_collectives as fc
        run = lambda x: model(fc.all_to_all_single_autograd(  # noqa: E731
            x, None, None, dist.group.WORLD))
    elif model[0].how == "group_arg":  # the process group passed to each layer
        run = lambda x: model[1](model[0](x, group=dist.group.WORLD),  # noqa: E731
                                 group=dist.group.WORLD)
    steps = []
    for step in range(STEPS):
        SEEN.clear()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        x_grads = []
        for m in range(micro):
            gen = torch.Generator().manual_seed(100 + 10 * step + m)
            full = torch.randn(WORLD * TOKENS, DIM, generator=gen)
            x = full[rank * TOKENS:(rank + 1) * TOKENS].clone().requires_grad_(True)
            loss = run(x).square().sum()
            loss.backward()
            total = total + loss.detach()
            x_grads.append(x.grad.clone())
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[name] = g
        steps.append({"loss": total, "x_grad": x_grads, "grads": grads, "seen": dict(SEEN)})
        opt.step()
    return steps


def case(name: str, rank: int) -> dict[str, Any]:
    how, option = name.split("-")
    micro = 2 if option == "accum" else 1
    twin = _model(how)
    eager = _train(twin, rank, micro)
    model = _model(how)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu") \
        if option in ("offload", "both", "accum") else False
    if option in ("nested", "core"):
        for layer in model:
            layer.inner = True
    if option == "core":
        return {"eager": eager, "ckpt": _train(model, rank), "held": {}}
    verify = option in ("verify", "both", "accum", "keepv", "keepopsv")
    if option.startswith("keep"):  # save units: the attention core kept, by method or by op
        target = pytree_ckpt.KeptOps("aten::bmm", "aten::_softmax", "aten::exp") \
            if option.startswith("keepops") else \
            pytree_ckpt.KeptCallables("Attention._ring", "Attention._ulysses",
                                      "Attention._gathered")
        pytree_ckpt.apply_recompute_config(
            list(model), pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
            {pytree_ckpt.SaveUnit.ATTN: target}, offload=manager, verify_replay=verify)
    else:
        for layer in model:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=manager,
                                                       verify_replay=verify)
    ckpt = _train(model, rank, micro)
    # One more step under a census: what the checkpointed layers hold, by mechanism.
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    run = model if model[0].how not in ("ulysses_fc", "group_arg", "actin") else None
    held: dict[str, int] = {}
    evals: list[Any] = []
    if run is not None:
        # An evaluation forward under no_grad: each model's output and collectives.
        for net in (twin, model):
            SEEN.clear()
            torch.manual_seed(5)  # the same dropout masks for both
            with torch.no_grad():
                evals.append((net(x.detach()), dict(SEEN)))
        with pytree_ckpt.ActivationCensus(model) as census:
            loss = run(x).square().sum()
        held = dict(census.bytes_by("mechanism"))
        loss.backward()
    return {"eager": eager, "ckpt": ckpt, "held": held, "evals": evals}


if __name__ == "__main__":
    run_cases(Path(sys.argv[1]), sys.argv[2:], case)
