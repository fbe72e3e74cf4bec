"""Train the example model for a few AdamW steps on one synthetic packed batch (CPU-fast).

    python -m examples.glm_dsa.train --steps 5 --ratio 1.0 [--no-reuse] [--moe] \\
        [--mtp-depth 2] [--seed 0]

The model is initialised right after ``torch.manual_seed(seed)`` and trained on
``make_packed_batch(config, seed=seed)`` at every step: one fixed batch, so a falling loss shows
the parameters moving rather than a change of data. ``--ratio`` is the fraction of decoder
layers behind a checkpoint boundary (the MTP layer is checkpointed whenever ``ratio > 0``);
``--no-reuse`` makes the attention call its indexer directly, so every replay reruns it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

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
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the training loop; print and return the loss of every step."""
    args = parse_args(argv)
    config = GlmDsaConfig(mtp_depth=args.mtp_depth, moe=args.moe,
                          reuse_indexer=not args.no_reuse)
    torch.manual_seed(args.seed)
    model = GlmDsaForCausalLM(config)
    checkpointed = model.checkpoint_layers(args.ratio, mtp=args.ratio > 0)
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
    return losses


if __name__ == "__main__":
    main()
