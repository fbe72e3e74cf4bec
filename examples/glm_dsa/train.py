"""Train the example model for a few AdamW steps on one synthetic packed batch (CPU-fast).

    python -m examples.glm_dsa.train --steps 5 --ratio 1.0 [--no-reuse] [--moe] \\
        [--mtp-depth 2] [--seed 0] [--offload [--offload-min-bytes 1024]] \\
        [--save attn,dsa_indexer,moe_gate,moe_dispatch | --save all] [--discard-norms] \\
        [--verify-replay] [--compile [--compile-backend inductor]]
    torchrun --nproc-per-node N -m examples.glm_dsa.train --fsdp [--compile] [...]
    torchrun --nproc-per-node N -m examples.glm_dsa.train --ddp [...]

The model is initialised right after ``torch.manual_seed(seed)`` and trained on
``make_packed_batch(config, seed=seed)`` at every step: one fixed batch, so a falling loss shows
the parameters moving rather than a change of data. ``--ratio`` is the fraction of decoder
layers behind a checkpoint boundary (the MTP layer is checkpointed whenever ``ratio > 0``);
``--no-reuse`` makes the attention call its indexer directly, so every replay reruns it.
``--offload`` copies what the checkpointed layers save (hidden states, top-k ids) to host memory
with an ``offload.OffloadManager`` and prints what it moved per step; without it offload follows
``XTUNER_ACTIVATION_OFFLOAD`` as everywhere else. ``--save`` keeps save units resident inside
the checkpointed layers (docs/save_units.md); ``--discard-norms`` frees the norms' outputs and
rebuilds them before backward needs them (docs/discard.md). ``--verify-replay`` compares each
replay's outputs (and, with ``--discard-norms``, each rebuilt norm output) with the forward's,
bit for bit, and stops at the first that differs (a debugging switch; docs/boundary.md).
``--compile`` compiles each layer's body before it is checkpointed (the boundary stays eager;
see docs/scaling.md).

Under torchrun, ``--fsdp`` shards every decoder and MTP layer, then the root, with FSDP2, and
``--ddp`` wraps the model in DistributedDataParallel; CUDA with nccl when available, else CPU
with gloo. Every rank builds the same model (same seed) and trains on its own fixed batch,
``make_packed_batch(config, seed=seed + rank)``; the printed loss is the mean over ranks.
Without torchrun the script runs in one process, on CPU, as it always did.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Sequence

import torch

from offload import OffloadConfig, OffloadManager, default_manager, env_flag
from pytree_ckpt import SaveUnit

from .config import GlmDsaConfig
from .data import make_packed_batch
from .distributed import (DistEnv, compile_layer_bodies, init_from_env, shard_model,
                          torchrun_world_size, wrap_ddp)
from .model import GlmDsaForCausalLM

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.glm_dsa.train",
                                     description=__doc__.splitlines()[0])
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
    parser.add_argument("--save", type=_save_units, action="append", metavar="UNITS",
                        help="save units to keep resident, comma-separated (attn, dsa_indexer; "
                             "with --moe also moe_gate, moe_dispatch), or 'all' for all the "
                             "model has; repeated flags add up")
    parser.add_argument("--verify-replay", action="store_true",
                        help="compare each replay's outputs with the forward's, bit for bit "
                             "(a debugging switch: a device sync per layer in backward)")
    parser.add_argument("--discard-norms", action="store_true",
                        help="free the norms' outputs once their consumers saved them and "
                             "rebuild them in backward: saves forward memory in layers left "
                             "uncheckpointed (--ratio < 1), else only the replay's peak; "
                             "gradients equal eager's to rounding")
    parallel = parser.add_mutually_exclusive_group()
    parallel.add_argument("--fsdp", action="store_true",
                          help="shard every layer, then the root, with FSDP2 (under torchrun)")
    parallel.add_argument("--ddp", action="store_true",
                          help="DistributedDataParallel around the model (under torchrun)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder and MTP layer's body")
    parser.add_argument("--compile-backend",
                        help="torch.compile backend for --compile (default inductor)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.ratio <= 1.0:  # also refuses nan
        parser.error(f"--ratio must be in [0, 1], got {args.ratio}; tip: 1.0 checkpoints every "
                     "layer, 0 none")
    if args.mtp_depth < 0:
        parser.error(f"--mtp-depth must be >= 0, got {args.mtp_depth}; tip: 0 disables MTP")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not -2**63 <= args.seed < 2**64:  # torch.manual_seed's range (helper KC: a traceback)
        parser.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if not 0.0 <= args.lr < math.inf:  # also refuses nan; AdamW's own check is a traceback
        parser.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.save is not None:  # repeated flags add up (helper HE: the last one alone was kept)
        if any(units is True for units in args.save):
            if len(args.save) > 1:
                parser.error("--save all keeps every unit: give it alone")
            args.save = True
        else:
            args.save = list(dict.fromkeys(unit for units in args.save for unit in units))
    moe_units = [unit.value for unit in (args.save if isinstance(args.save, list) else ())
                 if unit in (SaveUnit.MOE_GATE, SaveUnit.MOE_DISPATCH)]
    if moe_units and not args.moe:
        parser.error(f"--save {','.join(moe_units)} needs --moe: the dense model declares the "
                     "units attn and dsa_indexer")
    if args.save is not None and args.ratio <= 0:
        parser.error("--save needs --ratio > 0: save units live inside checkpointed layers")
    if args.offload and args.ratio <= 0:
        parser.error("--offload needs --ratio > 0: offload windows open at checkpoint "
                     "boundaries, and with ratio 0 there are none")
    if args.offload_min_bytes is not None and not args.offload:
        parser.error("--offload-min-bytes only applies with --offload")
    if args.offload_min_bytes is None:
        args.offload_min_bytes = 1024
    if args.offload_min_bytes < 0:
        parser.error(f"--offload-min-bytes must be >= 0, got {args.offload_min_bytes}")
    if args.save is not None and args.compile:
        parser.error("--save cannot be combined with --compile: save units need eager layer "
                     "bodies (docs/save_units.md); tip: drop one of them")
    if args.compile_backend is not None and not args.compile:
        parser.error("--compile-backend only applies with --compile")
    if args.compile_backend is None:
        args.compile_backend = "inductor"
    elif args.compile_backend not in _compile_backends():
        parser.error(f"--compile-backend {args.compile_backend!r} is not a torch.compile "
                     "backend here; tip: inductor (the default), aot_eager or eager "
                     "(torch._dynamo.list_backends(exclude_tags=()) lists them all)")
    world = torchrun_world_size()
    if (args.fsdp or args.ddp) and world is None:
        parser.error(f"--{'fsdp' if args.fsdp else 'ddp'} needs a process group; tip: launch "
                     "with torchrun --nproc-per-node N -m examples.glm_dsa.train "
                     f"--{'fsdp' if args.fsdp else 'ddp'}")
    if world is not None and world > 1 and not (args.fsdp or args.ddp):
        parser.error(f"launched with WORLD_SIZE={world} but neither --fsdp nor --ddp: every "
                     "rank would train its own copy; tip: add --fsdp or --ddp")
    return args


def _compile_backends() -> list[str]:
    # Every registered backend, the debug ones (eager, aot_eager) included: only asked when
    # --compile-backend is given (importing torch._dynamo takes a second or two).
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def _save_units(text: str) -> list[SaveUnit] | bool:
    if text.strip() == "all":
        return True
    try:
        return [SaveUnit(name.strip()) for name in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the units are {', '.join(u.value for u in SaveUnit)}, or 'all'") from None


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the training loop; print and return the loss of every step."""
    args = parse_args(argv)
    env = init_from_env() if args.fsdp or args.ddp else None
    try:
        losses = _train(args, env)
        if env is not None:
            # Every rank done before any tears its group down. Once in a full suite run a rank
            # aborted at exit ("terminate called without an active exception") after its last
            # step; a peer destroying gloo's group first is the likely cause.
            torch.distributed.barrier()
        return losses
    finally:
        if env is not None:
            torch.distributed.destroy_process_group()


def _train(args: argparse.Namespace, env: DistEnv | None) -> list[float]:
    rank = 0 if env is None else env.rank
    device = torch.device("cpu") if env is None else env.device
    config = GlmDsaConfig(mtp_depth=args.mtp_depth, moe=args.moe,
                          reuse_indexer=not args.no_reuse, discard_norm_outputs=args.discard_norms)
    torch.manual_seed(args.seed)
    model = GlmDsaForCausalLM(config).to(device)
    if args.compile:  # the bodies first: the boundary keeps the compiled forward it finds
        compile_layer_bodies(model, backend=args.compile_backend)
    manager = (OffloadManager(OffloadConfig(min_bytes=args.offload_min_bytes),
                              **({} if env is None else {"device": device}))
               if args.offload else None)
    # None (no --offload) keeps the XTUNER_ACTIVATION_OFFLOAD behaviour.
    checkpointed = model.checkpoint_layers(args.ratio, mtp=args.ratio > 0, offload=manager,
                                           save=args.save, verify_replay=args.verify_replay)
    trained: torch.nn.Module = model
    if args.fsdp:
        # The root returns logits[None], a view; nothing modifies it in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        trained = shard_model(model)
    elif args.ddp:
        assert env is not None
        trained = wrap_ddp(model, env)
    batch = {k: v.to(device) for k, v in make_packed_batch(config, seed=args.seed + rank).items()}
    optimizer = torch.optim.AdamW(trained.parameters(), lr=args.lr)
    say = print if rank == 0 else (lambda *_: None)
    where = "" if env is None else (f"; {env.world_size} ranks ({env.backend}, "
                                    f"{'FSDP2' if args.fsdp else 'DDP'})")
    say(f"checkpointed decoder layers: {checkpointed}; tokens per step: "
        f"{batch['input_ids'].shape[1]}{where}")
    if manager is None and env_flag("XTUNER_ACTIVATION_OFFLOAD"):
        if args.ratio > 0:
            manager = default_manager()  # what the variable turned on: report it too
            say(f"XTUNER_ACTIVATION_OFFLOAD=1: the default manager moves storages of at least "
                f"{manager.config.min_bytes} bytes (--offload sets a lower floor for this "
                "CPU-sized model)")
        else:  # --offload is refused here; the variable is global, so said, not refused
            say("XTUNER_ACTIVATION_OFFLOAD=1: nothing to offload at --ratio 0 (offload works at "
                "checkpoint boundaries, and no layer is checkpointed)")
    losses = []
    for step in range(1, args.steps + 1):
        out = trained(**batch)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        shown = torch.stack([out["loss"], out["main_loss"], *out["mtp_losses"]]).detach()
        if env is not None:  # the mean over ranks (each trains on its own batch)
            torch.distributed.all_reduce(shown)
            shown /= env.world_size
        values = shown.tolist()
        losses.append(values[0])
        mtp = " ".join(f"{x:.4f}" for x in values[2:])
        say(f"step {step} loss {values[0]:.6f} main {values[1]:.6f} mtp [{mtp}]")
        if manager is not None:
            stats = manager.stats(reset=True)
            say(f"  offload: {int(stats['offloaded_bytes'])} bytes to host in "
                f"{int(stats['windows'])} windows, {int(stats['restored_bytes'])} restored "
                f"({int(stats['reused_bytes'])} without a copy back), "
                f"{int(stats['alive_elsewhere_bytes'])} alive elsewhere"
                + (" (copied, but also held outside the layers, so that copy freed no device "
                   "memory: docs/offload.md, 'Statistics')"
                   if stats["alive_elsewhere_bytes"] and step == 1 else ""))
    if args.verify_replay:
        # What was compared: checkpointed layers (decoder layers the ratio picked, and the MTP
        # layers, wrapped at any ratio > 0) and discarded norm outputs; a ratio too small for
        # any layer, without MTP, compares nothing (helper KC).
        compared = [what for what, done in (
            ("replay", bool(checkpointed) or args.ratio > 0 and args.mtp_depth > 0),
            ("norm rebuild", args.discard_norms)) if done]
        if not compared:
            say(f"verify_replay: nothing was compared (--ratio {args.ratio} checkpoints no "
                "layer, and no norm output is discarded without --discard-norms)")
        else:  # one that differed would have raised in its backward
            say(f"verify_replay: every {' and every '.join(compared)} matched its forward, "
                "bit for bit")
    return losses


if __name__ == "__main__":
    main()
