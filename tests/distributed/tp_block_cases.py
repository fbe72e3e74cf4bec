"""Attention + MLP transformer blocks under torchtitan's tensor and sequence parallel plan,
checkpointed in several ways, two ranks (after helper KL's harness).

    python tests/distributed/tp_block_cases.py OUT CASE [CASE ...]

The model: two blocks, each an attention (wq/wk/wv ColwiseParallel, wo RowwiseParallel to
Shard(1), SDPA) and a SwiGLU MLP (w1/w3 ColwiseParallel, w2 RowwiseParallel to Shard(1)), each
behind an RMSNorm under SequenceParallel and PrepareModuleInput(Shard(1) -> Replicate); then a
final norm (SequenceParallel) and an output head (ColwiseParallel from Shard(1)), a 1-D mesh of
both ranks. A case is ``<stream>-<ckpt>[-<extra>...]``:

- ``stream``: ``local`` (the TP hooks' default, a plain residual stream of each rank's sequence
  shard) or ``dt`` (``use_local_output=False`` on the norms and on wo/w2: the residual stream
  and the blocks' inputs are DTensors, Shard(1)).
- ``ckpt``: ``plain`` (apply_activation_checkpointing on each block); ``save``
  (apply_recompute_config keeping the attention unit: KeptOps on SDPA's CPU ops, or with
  ``kc`` KeptCallables("Attention.forward")); ``reuse`` (each block's attention freezes a top-k
  mask computed from its DTensor input with reuse_during_recompute: the first block's a
  Replicate DTensor, the second's a Shard(1) one after a redistribute); ``sub`` (the attention
  and MLP modules checkpointed, not the blocks: their outputs are what the TP hooks hand back,
  an AsyncCollectiveTensor or a DTensor).
- extras: ``off`` offload (OffloadConfig(min_bytes=0)); ``vr`` verify_replay=True; ``head``
  the output head (final norm, output projection to vocabulary-sharded logits, cross-entropy)
  checkpointed too, the loss computed inside it under ``loss_parallel`` (its backward too;
  the unwrapped twin computes it in the same head); ``fsdp`` tensor parallelism on the ``tp``
  dimension of a (dp 1, tp 2) mesh, then fully_shard on ``dp`` (blocks, then the root), on
  gloo.

Each rank trains the same TP model twice, unwrapped (``eager``) and checkpointed (``ckpt``),
STEPS AdamW steps, and writes ``OUT/<case>.rank<r>.pt``: per step the loss, the input's
gradient, every parameter's full gradient, the ops that ran by phase and name, the top-k calls
by phase, the offload stats; after the steps every full parameter and AdamW state tensor; the
attention outputs' types and the warnings the checkpointed run raised; or the traceback.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from tests.distributed.rank_cases import run_cases

WORLD = 2
STEPS = 2
DIM, HEADS, HIDDEN, BATCH, SEQ, VOCAB = 8, 2, 16, 2, 6, 10
TOPK = 3
SDPA_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_attention_math")
KEPT_OPS = {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps(*SDPA_OPS)}
KEPT_CALLABLES = {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptCallables("Attention.forward")}


class Record:
    """What one run's forward and backward did, per step (reset by ``run``)."""

    topk: Counter[str] = Counter()  # topk_mask's calls by phase
    attention_types: set[str] = set()  # the attention modules' output types


def topk_mask(scores: torch.Tensor) -> torch.Tensor:
    Record.topk[pytree_ckpt.current_phase().value] += 1
    ids = scores.topk(TOPK, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ids, True)


class OpCounter(TorchDispatchMode):
    """The ops that really run, by phase and name (entered outside the boundary; a DTensor op
    counts once, not its local op)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[f"{pytree_ckpt.current_phase().value}|{func.overloadpacket}"] += 1
        return func(*args, **(kwargs or {}))


class Attention(nn.Module):
    def __init__(self, reuse: str | None) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.reuse = reuse  # None, "replicate" or "shard": the frozen mask's placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)
        mask = None
        if self.reuse is not None:  # x is a Replicate DTensor (PrepareModuleInput)
            scores = (x @ x.transpose(-1, -2)).detach()
            if self.reuse == "shard":  # rows sharded: each rank's top-k of its rows
                scores = scores.redistribute(scores.device_mesh, [Shard(1)])
            frozen = pytree_ckpt.reuse_during_recompute(topk_mask, scores)
            mask = frozen.full_tensor()[:, None]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, reuse: str | None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention(reuse)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.attention_norm(x))
        Record.attention_types.add(type(a).__name__)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(placement if reuse else None)
                                    for placement in ("replicate", "shard"))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.output_head
        self.loss_in_head = False

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The logits, or with ``loss_in_head`` the loss."""
        for layer in self.layers:
            h = layer(h)
        return self.head(h, labels)

    def output_head(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        return cross_entropy(logits, labels) if self.loss_in_head else logits


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_model(stream: str, ckpt: str, extras: list[str], mesh: DeviceMesh) -> Model:
    torch.manual_seed(0)
    model = Model(reuse=ckpt == "reuse")
    local = stream == "local"
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(use_local_output=local),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
            "ffn_norm": SequenceParallel(use_local_output=local),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
        })
    lp = "head" in extras  # loss_parallel: logits sharded on the vocabulary
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(use_local_output=local),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if lp else Replicate(),
                                  use_local_output=not lp)})
    model.loss_in_head = lp
    return model


def checkpoint(model: Model, ckpt: str, extras: list[str],
               manager: OffloadManager | None) -> None:
    offload: OffloadManager | bool = manager if manager is not None else False
    verify = "vr" in extras
    if ckpt == "save":
        pytree_ckpt.apply_recompute_config(
            model.layers, pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
            KEPT_CALLABLES if "kc" in extras else KEPT_OPS, offload=offload,
            verify_replay=verify)
    elif ckpt == "sub":  # the attention and MLP modules, not the blocks
        pytree_ckpt.apply_activation_checkpointing(
            model, offload=offload, verify_replay=verify,
            check_fn=lambda m: isinstance(m, (Attention, MLP)))
    else:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=offload,
                                                       verify_replay=verify)
    if "head" in extras:
        model.head = pytree_ckpt.checkpointed(model.output_head, offload=offload,
                                              verify_replay=verify)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run(model: Model, stream: str, extras: list[str], rank: int, mesh: DeviceMesh,
        manager: OffloadManager | None) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    Record.attention_types.clear()
    steps = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, SEQ, DIM, generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        local_x = x.chunk(WORLD, dim=1)[rank].contiguous().requires_grad_()
        h = DTensor.from_local(local_x, mesh, [Shard(1)]) if stream == "dt" else local_x
        Record.topk.clear()
        with OpCounter() as ops:
            if model.loss_in_head:
                with loss_parallel():  # forward, backward and so the replay
                    loss = model(h, labels)
                    loss.backward()
            else:
                logits = model(h, labels)
                loss = cross_entropy(logits, labels)  # Replicate, a local tensor
                loss.backward()
        steps.append({"loss": _full(loss), "loss_type": type(loss).__name__,
                      "input_grad": local_x.grad.clone(),
                      "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
                      "grad_types": sorted({type(p.grad).__name__
                                            for p in model.parameters()}),
                      "ops": dict(ops.counts), "topk": dict(Record.topk),
                      "offload": None if manager is None else manager.stats()})
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": steps,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "adamw": {n: {k: _full(v) for k, v in optimizer.state[p].items()}
                      for n, p in model.named_parameters()},
            "attention_types": sorted(Record.attention_types)}


def case(name: str, rank: int, meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    stream, ckpt, *extras = name.split("-")
    mesh = meshes["tp"] if "fsdp" in extras else meshes["1d"]

    def build(checkpointed: bool) -> tuple[Model, OffloadManager | None]:
        model = make_model(stream, ckpt, extras, mesh)
        manager = None
        if checkpointed:
            if "off" in extras:
                manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
            checkpoint(model, ckpt, extras, manager)
        if "fsdp" in extras:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=meshes["dp"])
            fully_shard(model, mesh=meshes["dp"])
        return model, manager

    eager, _ = build(False)
    result = {"eager": run(eager, stream, extras, rank, mesh, None)}
    ckpt_model, manager = build(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["ckpt"] = run(ckpt_model, stream, extras, rank, mesh, manager)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def main(out: Path, names: list[str]) -> None:
    meshes: dict[str, DeviceMesh] = {}

    def with_mesh(name: str, rank: int) -> dict[str, Any]:
        if not meshes:  # after run_cases made the group; every rank makes them at its first case
            meshes["1d"] = init_device_mesh("cpu", (WORLD,))
            mesh2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
            meshes["dp"], meshes["tp"] = mesh2d["dp"], mesh2d["tp"]
        return case(name, rank, meshes)

    run_cases(out, names, with_mesh)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
