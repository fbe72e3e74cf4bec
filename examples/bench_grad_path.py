"""Where the boundary's small-size cost comes from: how a replay hands back parameter gradients.

    python -m examples.bench_grad_path [--size small] [--layer decoder|moe] [--rounds N]
                                       [--warmup N] [--threads N]

``examples.bench_boundary`` finds this library's boundary a few percent slower than torch's
reentrant checkpoint on tiny layers. The difference (NOTE [parameters are inputs] in
``pytree_ckpt/boundary.py``) is how the replay in backward produces parameter gradients. This
script isolates it: one minimal autograd Function per layer of the same decoder stack, whose
backward replays the layer and produces the parameter gradients in one of four ways:

- ``accumulate``: ``torch.autograd.backward(outputs)`` adds them to ``.grad`` inside the replay;
  the parameters are not inputs of the Function (torch's reentrant checkpoint);
- ``accumulate, params as inputs``: the same, but the parameters are also inputs of the
  Function (it returns no gradient for them): the cost of the extra inputs alone;
- ``backward(inputs=)``: ``torch.autograd.backward(outputs, inputs=[x, *params])`` adds them
  inside the replay, parameters as inputs: autograd's path for explicit inputs;
- ``grad, returned``: ``torch.autograd.grad(outputs, [x, *params])``, returned as the
  Function's gradients for its parameter inputs, so the outer backward adds them (this
  library's boundary).

Two more rows put those in context, in the same interleaved run: ``torch reentrant``
(``torch.utils.checkpoint(..., use_reentrant=True)``: the first path, plus torch's own
bookkeeping) and ``pytree-ckpt`` (``pytree_ckpt.checkpoint(layer, x)``: the last path, plus
this library's bookkeeping: the PyTree bridge, RNG and autocast capture, module state
watches, frames, isolation of parametrizations). Their difference from the minimal paths is
what each library adds per call beyond the gradient path itself.

Before timing, all six rows are checked to give gradients bit-identical to eager (each
parameter is used once, so the order of additions is the same); none is timed otherwise. See NOTE [measurement] in
``examples/timing.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import pytree_ckpt

from examples.bench_boundary import LAYERS, SIZES, DecoderBlock
from examples.glm_dsa.mlp import SwiGLU
from examples.timing import (add_round_options, check_round_options, check_threads_option,
                             summarize_ms, time_interleaved)

__all__ = ["LAYER_KINDS", "PATHS", "MoEBlock", "main"]

ACCUMULATE = "accumulate"
ACCUMULATE_PARAMS_INPUTS = "accumulate, params as inputs"
BACKWARD_INPUTS = "backward(inputs=)"
GRAD_RETURNED = "grad, returned"
TORCH_REENTRANT = "torch reentrant"
PYTREE_CKPT = "pytree-ckpt"
PATHS = (ACCUMULATE, ACCUMULATE_PARAMS_INPUTS, BACKWARD_INPUTS, GRAD_RETURNED, TORCH_REENTRANT,
         PYTREE_CKPT)


class _Replay(torch.autograd.Function):
    """Runs ``layer`` without a graph; its backward replays it and takes ``path``."""

    @staticmethod
    def forward(ctx: Any, layer: nn.Module, path: str, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.layer, ctx.path, ctx.params = layer, path, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (saved,) = ctx.saved_tensors
        x = saved.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.layer(x.view_as(x))
        params = ctx.params
        if ctx.path == GRAD_RETURNED:
            grads = torch.autograd.grad([out], [x, *params], [grad], allow_unused=True)
            return (None, None, *grads)
        inputs = [x, *params] if ctx.path == BACKWARD_INPUTS else None
        torch.autograd.backward([out], [grad], inputs=inputs)
        return (None, None, x.grad, *[None] * len(params))


class MoEBlock(nn.Module):
    """Pre-norm MoE feed-forward as transformers writes it (Qwen3-MoE, Mixtral): a router and
    a ``ModuleList`` of SwiGLU experts, each run on the tokens routed to it (top ``top_k`` of
    ``experts``). Three parameters per expert: 384 of the layer's 386 (a norm and a router hold
    the others), most of them used each step."""

    def __init__(self, hidden: int, experts: int = 128, top_k: int = 8) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, hidden // 2) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x.reshape(-1, x.shape[-1]))
        weights, ids = torch.topk(self.router(flat).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            out = out.index_add(0, rows, self.experts[expert](flat[rows]) * weights[rows, slot, None])
        return x + out.view_as(x)


LAYER_KINDS = ("decoder", "moe")


class Bench:
    """The layer stack at one size, its input, and one timed step per path."""

    def __init__(self, size: str, seed: int = 0, *, layer: str = "decoder") -> None:
        spec = SIZES[size]
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(
            DecoderBlock(spec.hidden, spec.heads) if layer == "decoder" else MoEBlock(spec.hidden)
            for _ in range(LAYERS))
        self.x = torch.randn(spec.batch, spec.seq, spec.hidden, requires_grad=True)
        self.leaves = [self.x, *self.layers.parameters()]
        # Listed once, as the boundary caches them: walking the module tree costs ~8 µs a call.
        self.params = [tuple(layer.parameters()) for layer in self.layers]

    def step(self, path: str | None) -> float:
        """Forward + backward with every layer taking ``path`` (``None``: eager)."""
        for t in self.leaves:
            t.grad = None
        start = time.perf_counter()
        h = self.x
        for layer, params in zip(self.layers, self.params):
            if path is None:
                h = layer(h)
            elif path == ACCUMULATE:
                h = _Replay.apply(layer, path, h)
            elif path == TORCH_REENTRANT:
                h = torch_checkpoint(layer, h, use_reentrant=True)
            elif path == PYTREE_CKPT:
                h = pytree_ckpt.checkpoint(layer, h)
            else:
                h = _Replay.apply(layer, path, h, *params)
        h.square().mean().backward()
        return time.perf_counter() - start

    def grads_equal_eager(self, path: str) -> bool:
        self.step(None)
        eager = [t.grad for t in self.leaves]
        self.step(path)
        # An MoE expert no token reached has no gradient in eager: it must have none here.
        return all((a is None and b is None) or
                   (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(eager, (t.grad for t in self.leaves)))


def run(size: str, rounds: int, warmup: int, layer: str = "decoder") -> dict[str, Any]:
    bench = Bench(size, layer=layer)
    result: dict[str, Any] = {"size": size, "layer": layer, "layers": LAYERS, "rounds": rounds,
                              "warmup": warmup, "torch": torch.__version__,
                              "threads": torch.get_num_threads(),
                              "grads_equal_eager": {p: bench.grads_equal_eager(p)
                                                    for p in PATHS}}
    if not all(result["grads_equal_eager"].values()):
        return result  # timings of paths that compute other gradients mean nothing
    times = time_interleaved(bench.step, PATHS, rounds=rounds, warmup=warmup)
    paths = {path: summarize_ms(t) for path, t in times.items()}
    reference = paths[ACCUMULATE]["median_ms"]
    for stats in paths.values():
        stats["extra_us_per_layer"] = (stats["median_ms"] - reference) * 1e3 / LAYERS
    result["paths"] = paths
    return result


def format_report(result: dict[str, Any]) -> str:
    lines = [f"parameter gradients from a replay, {result['layers']}-layer {result['layer']}, size "
             f"{result['size']}, CPU, torch {result['torch']}, {result['threads']} threads",
             "grads bit-identical to eager: " + ", ".join(
                 f"{p} {'yes' if ok else 'NO'}" for p, ok in result["grads_equal_eager"].items())]
    if "paths" not in result:
        return "\n".join([*lines, "timings not reported: gradients differ"])
    lines += ["", "| path | median ms | p10/p90 ms | extra µs per layer vs accumulate |",
              "|---|---:|---:|---:|"]
    for path, s in result["paths"].items():
        lines.append(f"| {path} | {s['median_ms']:.3f} | {s['p10_ms']:.3f}/{s['p90_ms']:.3f} | "
                     f"{s['extra_us_per_layer']:+.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print the table, return the results (raw times included)."""
    parser = argparse.ArgumentParser(prog="python -m examples.bench_grad_path",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--layer", default="decoder", choices=LAYER_KINDS,
                        help="decoder blocks, or MoE blocks of 128 experts (386 parameters)")
    add_round_options(parser, default_help="500 rounds, 50 warm-up")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: leave as is)")
    args = parser.parse_args(argv)
    check_round_options(parser, args)
    check_threads_option(parser, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(args.size, 500 if args.rounds is None else args.rounds,
                 50 if args.warmup is None else args.warmup, args.layer)
    print(format_report(result))
    return result


if __name__ == "__main__":
    out = main()
    raise SystemExit(0 if all(out["grads_equal_eager"].values()) else 1)
