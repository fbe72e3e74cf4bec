"""Train the example model for a few AdamW steps on one synthetic packed batch (CPU-fast).

    python -m examples.glm_dsa.train --steps 5 --ratio 1.0 [--no-reuse] [--moe] \\
        [--mtp-depth 2] [--seed 0] [--offload [--offload-min-bytes 1024]]

The model is initialised right after ``torch.manual_seed(seed)`` and trained on
``make_packed_batch(config, seed=seed)`` at every step: one fixed batch, so a falling loss shows
the parameters moving rather than a change of data. ``--ratio`` is the fraction of decoder
layers behind a checkpoint boundary (the MTP layer is checkpointed whenever ``ratio > 0``);
``--no-reuse`` makes the attention call its indexer directly, so every replay reruns it.
``--offload`` copies what the checkpointed layers save (hidden states, top-k ids) to host memory
with an ``offload.OffloadManager`` and prints what it moved per step; without it offload follows
``XTUNER_ACTIVATION_OFFLOAD`` as everywhere else.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from offload import OffloadConfig, OffloadManager

from .config import GlmDsaConfig
from .data import make_packed_batch
from .model import GlmDsaForCausalLM

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--ratio", type=float, default=1.0,
                        help="fraction of decoder layers to checkpoint, in [0, 1] (default 1)")
    parser.add_argument("--no-reuse", action="store_true",
                        help="call the DSA indexer directly instead of replaying its ids")
    parser.add_argument("--moe", action="store_true", help="tiny routed MoE instead of SwiGLU")
    parser.add_argument("--mtp-depth", type=int, default=GlmDsaConfig.mtp_depth,
                        help=f"MTP depths (default {GlmDsaConfig.mtp_depth}; 0 disables MTP)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--offload", action="store_true",
                        help="offload the checkpointed layers' saved inputs to host memory")
    # The manager's default (64 KiB) exceeds every tensor of the CPU-sized model: offload would
    # silently move nothing, so the example lowers it.
    parser.add_argument("--offload-min-bytes", type=int,
                        help="smallest storage --offload moves (default 1024 bytes)")
    args = parser.parse_args(argv)
    if args.offload and args.ratio <= 0:
        parser.error("--offload needs --ratio > 0: offload windows open at checkpoint "
                     "boundaries, and with ratio 0 there are none")
    if args.offload_min_bytes is not None and not args.offload:
        parser.error("--offload-min-bytes only applies with --offload")
    if args.offload_min_bytes is None:
        args.offload_min_bytes = 1024
    if args.offload_min_bytes < 0:
        parser.error(f"--offload-min-bytes must be >= 0, got {args.offload_min_bytes}")
    return args


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the training loop; print and return the loss of every step."""
    args = parse_args(argv)
    config = GlmDsaConfig(mtp_depth=args.mtp_depth, moe=args.moe,
                          reuse_indexer=not args.no_reuse)
    torch.manual_seed(args.seed)
    model = GlmDsaForCausalLM(config)
    manager = (OffloadManager(OffloadConfig(min_bytes=args.offload_min_bytes))
               if args.offload else None)
    # None (no --offload) keeps the XTUNER_ACTIVATION_OFFLOAD behaviour.
    checkpointed = model.checkpoint_layers(args.ratio, mtp=args.ratio > 0, offload=manager)
    batch = make_packed_batch(config, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(f"checkpointed decoder layers: {checkpointed}; tokens per step: "
          f"{batch['input_ids'].shape[1]}")
    losses = []
    for step in range(1, args.steps + 1):
        out = model(**batch)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out["loss"].item())
        mtp = " ".join(f"{x.item():.4f}" for x in out["mtp_losses"])
        print(f"step {step} loss {losses[-1]:.6f} main {out['main_loss'].item():.6f} mtp [{mtp}]")
        if manager is not None:
            stats = manager.stats(reset=True)
            print(f"  offload: {int(stats['offloaded_bytes'])} bytes to host in "
                  f"{int(stats['windows'])} windows, {int(stats['restored_bytes'])} restored, "
                  f"{int(stats['alive_elsewhere_bytes'])} alive elsewhere")
    return losses


if __name__ == "__main__":
    main()
