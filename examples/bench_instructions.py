"""The boundary's per-call cost in CPU instructions, counted by valgrind: no timing noise.

    python -m examples.bench_instructions [--size small] [--steps N] [--jobs N]

``examples.bench_boundary`` times the 8-layer decoder stack; at the small size the boundary's
extra cost is a few percent of a step, about the size of the run-to-run noise of a shared
CPU. This script counts instead: each configuration of ``examples.bench_boundary`` (eager,
``pytree_ckpt.checkpoint``, module wrapping, torch's reentrant and non-reentrant checkpoint)
runs in its own process under ``valgrind --tool=callgrind``, instrumented only while it runs
``--steps`` forward + backward steps (after warm-up steps, so one-time work is left out). The
count of executed instructions is repeatable to about 0.3% between runs, where medians of
interleaved timings move by several percent. Instructions are not time (a cache miss costs
more than an add), so this is a proxy for the per-call bookkeeping of Python code, which is
what differs between the boundaries at this size; ``bench_boundary`` stays the measure of
time.

Needs valgrind (``apt-get install valgrind``): about 4 minutes for the small size on 2 cores.
The gradients of every ``ours`` configuration are checked bit for bit against eager first (in
this process, without valgrind); counts are not reported when they differ.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from examples.bench_boundary import (CONFIGS, EAGER, LAYERS, OURS, OURS_MODULE, OURS_VERIFY,
                                     SIZES, TORCH_REENTRANT, Bench)

__all__ = ["count_instructions", "format_report", "main", "parse_collected"]

WARMUP_STEPS = 3


def parse_collected(stderr: str, /) -> int:
    """The instruction count callgrind reports on exit ("Collected : N")."""
    found = re.findall(r"Collected\s*:\s*(\d+)", stderr)
    if not found:
        raise RuntimeError("callgrind reported no instruction count; its output ends with:\n"
                           + stderr[-2000:])
    return int(found[-1])


def _toggle(on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off."""
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   check=True, capture_output=True)


def _child(config: str, size: str, steps: int) -> None:
    """Run under callgrind: warm up, then count ``steps`` steps of ``config`` alone."""
    torch.set_num_threads(1)
    bench = Bench(SIZES[size])
    for _ in range(WARMUP_STEPS):
        bench.step(config)
    _toggle(True)
    for _ in range(steps):
        bench.step(config)
    _toggle(False)


def count_instructions(config: str, size: str, steps: int) -> int:
    """Instructions executed by ``steps`` steps of ``config``, in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={tmp}/callgrind.out", sys.executable, "-m",
                   "examples.bench_instructions", "--child", config, "--size", size,
                   "--steps", str(steps)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{config} under callgrind failed ({done.returncode}):\n"
                               + done.stderr[-2000:])
        return parse_collected(done.stderr)


def format_report(size: str, steps: int, per_step: dict[str, float], grads_equal: bool) -> str:
    """The table: thousands of instructions per step, per layer call over eager, ratios."""
    lines = [
        f"pytree-ckpt boundary vs torch.utils.checkpoint, instructions (callgrind), {LAYERS}-layer "
        f"decoder, size {size}, torch {torch.__version__}, {steps} steps counted per config",
        f"grads of ours (checkpoint, module wrapping, verify_replay) bit-identical to eager: "
        f"{'yes' if grads_equal else 'NO'}",
        "",
        "| config | k instructions / step | over eager, k / layer call | ratio vs torch reentrant |",
        "|---|---:|---:|---:|",
    ]
    eager = per_step[EAGER]
    reference = per_step[TORCH_REENTRANT]
    for config, count in per_step.items():
        lines.append(f"| {config} | {count / 1e3:,.0f} | {(count - eager) / LAYERS / 1e3:,.1f} "
                     f"| {count / reference:.3f} |")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.bench_instructions",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=10, help="steps counted per config")
    parser.add_argument("--jobs", type=int, default=2, help="configs counted at once")
    parser.add_argument("--child", default=None, choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.jobs < 1:
        parser.error("--steps and --jobs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Count every configuration, print the table, return the counts per step."""
    args = _parse(argv)
    if args.child is not None:
        _child(args.child, args.size, args.steps)
        return {}
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"examples.bench_instructions needs {' and '.join(missing)} on PATH: "
                         "install valgrind (apt-get install valgrind), or time the boundary "
                         "with python -m examples.bench_boundary instead")
    bench = Bench(SIZES[args.size])
    # Every row of ours that is counted (helper HN: the verify_replay row was not checked).
    grads_equal = all(bench.grads_equal(config) for config in (OURS, OURS_MODULE, OURS_VERIFY))
    if not grads_equal:
        print("gradients of ours differ from eager: instructions not counted")
        return {"grads_equal": False}
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(CONFIGS, pool.map(
            lambda config: count_instructions(config, args.size, args.steps), CONFIGS)))
    per_step = {config: counts[config] / args.steps for config in CONFIGS}
    print(format_report(args.size, args.steps, per_step, grads_equal))
    return {"grads_equal": True, "per_step": per_step}


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if result.get("grads_equal", True) else 1)
