"""Interleaved timing shared by ``examples.bench_boundary`` and ``examples.bench_offload``, and
the command-line checks the benchmark scripts share.

NOTE [measurement]: every configuration first runs its warm-up steps. Then each round runs one
step of every configuration, in an order rotated each round, so slow drifts of the machine
(clock frequency, other tenants) hit every configuration alike. The garbage collector runs
between rounds, never inside a timed step, where it would be charged to whichever
configuration happened to run. Medians are reported, with p10/p90 to show the spread.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["add_round_options", "check_output_path", "check_round_options",
           "check_threads_option", "summarize_ms", "time_interleaved"]


def time_interleaved(step: Callable[[str], float], configs: Sequence[str], /, *, rounds: int,
                     warmup: int) -> dict[str, list[float]]:
    """``step(config)`` returns one step's seconds; returns every timed round's, by config."""
    for config in configs:
        for _ in range(warmup):
            step(config)
    times: dict[str, list[float]] = {config: [] for config in configs}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % len(configs)
            for config in [*configs[shift:], *configs[:shift]]:
                times[config].append(step(config))
            gc.collect(1)  # the young generations: cheap, and what a step's garbage is
    finally:
        gc.collect()
        if was_enabled:
            gc.enable()
    return times


def summarize_ms(times_s: Sequence[float], /) -> dict[str, Any]:
    """Median, p10 and p90 in milliseconds, and the raw times."""
    ms = np.asarray(times_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "times_ms": ms.tolist()}


def add_round_options(parser: argparse.ArgumentParser, /, *, default_help: str) -> None:
    """``--rounds`` and ``--warmup`` (``None``: the script's own default, ``default_help``)."""
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timed rounds (default: {default_help})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"warm-up steps per configuration (default: {default_help})")


def check_round_options(parser: argparse.ArgumentParser, args: argparse.Namespace, /) -> None:
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")


def check_threads_option(parser: argparse.ArgumentParser, args: argparse.Namespace, /) -> None:
    """``--threads`` (``None``: leave torch's as is) must be positive: torch.set_num_threads
    raises a bare RuntimeError for anything else, after the parse, as a traceback."""
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}; tip: leave it out to keep "
                     f"torch's {torch.get_num_threads()}")


def check_output_path(parser: argparse.ArgumentParser, flag: str, path: Path | None, /, *,
                      directory: bool) -> None:
    """Refuse an output ``path`` (a directory, or a file when not ``directory``) that cannot be
    written, before anything runs: found at the first write, after the run's first
    measurements, it was a traceback and those minutes lost (a lent GPU's, in
    scripts/gpu_check.sh). Missing folders are fine: the scripts create them."""
    if path is None:
        return
    if not directory and path.is_dir():
        parser.error(f"{flag} {path} is a directory; tip: name a file in it")
    blocking = next((p for p in ((path,) if directory else ()) + tuple(path.parents)
                     if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        parser.error(f"{flag} {path}: {blocking} is a file, not a directory; tip: name a "
                     f"{'directory' if directory else 'file'} whose folders are folders (they "
                     "are created if missing)")
