"""Recompute, selective saving, frozen-result replay and offload on the GLM-DSA example.

    python -m examples.glm_dsa.bench [--preset tiny|demo|gpu-small|gpu-large]
        [--rounds N] [--warmup N] [--device cpu|cuda] [--threads N] [--seed N] [--out DIR]

Trains the example model under every configuration of ``bench_configs.CONFIGS`` in one run
and prints one Markdown table: activation census, peak device memory (CUDA), median step time,
recompute FLOPs, indexer FLOPs recomputed, and whether step 1's loss and every gradient are
bit-equal to eager's.

NOTE [fair comparison]: every configuration is a deep copy of one model built from ``--seed``
and runs on the same packed batches (``make_packed_batch`` seeded per step). The step has no
optimizer (see NOTE [the step] in ``bench_measure``), so the weights stay identical. Warm-up and
timed rounds run one step of each configuration per round, the order rotated every round, so
slow drifts of a shared machine hit every configuration alike; medians are reported.

``--out DIR`` writes ``table.md``, ``results.json`` (everything the table shows, raw, plus the
per-step times) and, when matplotlib is installed, ``plot.png``. ``results.json`` is written
after each phase and each timed round too (``phases_done`` says how far it got): a run stopped
by a time limit (``timeout`` ends it without unwinding) keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..timing import check_output_path
from .bench_configs import CONFIGS, PRESETS, Preset, Variant
from .bench_measure import (Progress, census_of, compare_step, deterministic, flops_of,
                            indexer_forward_flops, peak_bytes_of, step_results, timed_step)
from .bench_report import markdown_table, write_plot
from .data import make_packed_batch
from .model import GlmDsaForCausalLM

__all__ = ["main", "parse_args"]

EAGER = "eager"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.glm_dsa.bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                        help="model size and step counts (default demo: CPU, about a minute)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds (default: the preset's)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda if available, else cpu")
    # One intra-op thread on CPU: these tensors are small, and on a shared machine spinning
    # OpenMP workers make timings slower and noisier, not faster.
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--out", type=Path, help="write table.md, results.json (and plot.png)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here; "
                     "tip: use --device cpu with --preset demo")
    if PRESETS[args.preset].cuda_only and args.device != "cuda":
        parser.error(f"--preset {args.preset} is sized for a GPU and needs --device cuda "
                     f"(this run would use {args.device}); tip: use --preset demo on CPU")
    check_output_path(parser, "--out", args.out, directory=True)
    for name in ("rounds", "warmup", "threads"):
        value = getattr(args, name)
        if value is not None and value < (1 if name != "warmup" else 0):
            parser.error(f"--{name} must be >= {1 if name != 'warmup' else 0}, got {value}")
    return args


def _batches(preset: Preset, count: int, seed: int, device: torch.device
             ) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in
             make_packed_batch(preset.model, preset.seq_lens, seed=seed + i).items()}
            for i in range(count)]


def _error_text(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:300]}"


class _Bench:
    """The run's state: variants, batches, results; one method per phase of ``main``."""

    def __init__(self, preset: Preset, device: torch.device, seed: int) -> None:
        self.preset, self.device, self.seed = preset, device, seed
        torch.manual_seed(seed)
        base = GlmDsaForCausalLM(preset.model).to(device)
        # Batch 0: the equality, census and FLOP steps; then one per warm-up and timed round.
        self.batches = _batches(preset, 1 + preset.warmup + preset.rounds, seed, device)
        self.rows: dict[str, dict[str, Any]] = {}
        self.variants: dict[str, Variant] = {}
        for config in CONFIGS:
            row = self.rows[config.key] = {"label": config.label, "family": config.family,
                                           "status": "ok", "note": None}
            if config.cuda_only and device.type != "cuda":
                row.update(status="skipped", note="CUDA only; this run is on CPU")
                continue
            try:
                self.variants[config.key] = config.build(base, preset, device)
            except Exception as err:  # shown in the table, never hidden
                row.update(status="error", note=f"could not be built: {_error_text(err)}")

    def _fail(self, key: str, phase: str, err: BaseException) -> None:
        self.rows[key].update(status="error", note=f"{phase} failed: {_error_text(err)}")
        self.variants.pop(key, None)

    def measure_each(self, progress: Progress, phase: str, measure: Any, field: str) -> None:
        for key, variant in list(self.variants.items()):
            progress.advance(f"{phase}: {key}")
            try:
                self.rows[key][field] = measure(variant, self.batches[0], self.device)
            except Exception as err:
                self._fail(key, phase, err)

    def equality(self, progress: Progress) -> dict[str, Any]:
        with deterministic(self.device):
            eager = self.variants[EAGER]
            reference = step_results(eager, self.batches[0], self.seed)
            progress.advance("equality: eager")
            repeat = compare_step(reference, step_results(eager, self.batches[0],
                                                          self.seed))
            progress.advance("equality: eager again")
            for key, variant in list(self.variants.items()):
                progress.advance(f"equality: {key}")
                try:
                    self.rows[key]["equality"] = compare_step(reference, step_results(
                        variant, self.batches[0], self.seed))
                except Exception as err:
                    self._fail(key, "step 1", err)
        return {k: v for k, v in repeat.items() if k != "grads_differing"}

    def flops(self, progress: Progress) -> dict[str, Any]:
        self.measure_each(progress, "FLOPs", flops_of, "flops")
        eager = self.rows[EAGER].get("flops")
        for row in self.rows.values():
            if "flops" in row and eager is not None:
                row["recompute_flops"] = row["flops"]["total"] - eager["total"]
                row["indexer_flops_recomputed"] = row["flops"]["indexer"] - eager["indexer"]
        progress.advance("FLOPs: indexers alone")
        if EAGER not in self.variants:  # its failure is in its row
            return {"indexer_forward_flops": None, "indexer_calls": 0, "recompute_drop": None,
                    "match": False}
        alone = indexer_forward_flops(self.variants[EAGER], self.batches[0])
        off, on = (self.rows[k].get("recompute_flops")
                   for k in ("pytree_reuse_off", "pytree_reuse_on"))
        drop = None if off is None or on is None else off - on
        return {"indexer_forward_flops": alone["flops"], "indexer_calls": alone["calls"],
                "recompute_drop": drop, "match": drop == alone["flops"]}

    def timing(self, progress: Progress, after_round: Callable[[], None] | None = None) -> None:
        """Warm-up and timed rounds; ``after_round()`` runs after each (outside the timing)."""
        warmup, rounds = self.preset.warmup, self.preset.rounds
        for row in self.rows.values():
            row.update(step_times_ms=[], median_ms=None, ratio_to_eager=None)
        gc.collect()
        # A collection landing inside a timed step would be charged to whichever configuration
        # ran then: collect between rounds instead, outside the timed region.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for r in range(warmup + rounds):
                keys = list(self.variants)
                keys = keys[r % len(keys):] + keys[:r % len(keys)]
                timed = r >= warmup
                for key in keys:
                    variant = self.variants.get(key)
                    if variant is None:
                        continue
                    progress.advance(f"{'round' if timed else 'warm-up'} "
                                     f"{(r - warmup if timed else r) + 1}: {key}")
                    try:
                        ms = timed_step(variant, self.batches[1 + r], self.device)
                    except Exception as err:
                        self._fail(key, f"timed step (round {r + 1})", err)
                        continue
                    if variant.manager is not None:  # outside the timed region
                        self.rows[key].setdefault("offload_stats", []).append(
                            variant.manager.stats(reset=True))
                    if timed:
                        self.rows[key]["step_times_ms"].append(ms)
                gc.collect()
                if after_round is not None:
                    after_round()
        finally:
            if was_enabled:
                gc.enable()
        eager_times = self.rows[EAGER]["step_times_ms"]
        eager_median = statistics.median(eager_times) if eager_times else None
        for row in self.rows.values():
            if row["step_times_ms"]:
                row["median_ms"] = statistics.median(row["step_times_ms"])
                if eager_median:
                    row["ratio_to_eager"] = row["median_ms"] / eager_median


def _write_results(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def _write_outputs(results: dict[str, Any], table: str, out: Path) -> dict[str, str | None]:
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {"table": str(out / "table.md"),
                                    "results": str(out / "results.json"), "plot": None}
    results["outputs"] = paths
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    try:  # last: a plotting failure must not cost the measurements
        plot = write_plot(results, out / "plot.png")
    except Exception as err:
        print(f"plot failed: {_error_text(err)}")
        plot = None
    if plot is not None:
        paths["plot"] = str(plot)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and return everything it shows (JSON-ready)."""
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    preset = dataclasses.replace(
        preset, rounds=args.rounds if args.rounds is not None else preset.rounds,
        warmup=args.warmup if args.warmup is not None else preset.warmup)
    device = torch.device(args.device)
    if device.type == "cuda":
        # With an explicit index: torch.device("cuda") != torch.device("cuda:0"), and the
        # offload manager compares its device with the tensors' (unindexed, it moves nothing).
        device = torch.device("cuda", torch.cuda.current_device())
        # cuBLAS is deterministic for the equality checks only with a fixed workspace; it must
        # be set before cuBLAS starts (no effect if something already used it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        bench = _Bench(preset, device, args.seed)
        results: dict[str, Any] = {
            "preset": preset.describe(), "device": str(device),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "cpu"),
            "torch": torch.__version__, "threads": args.threads, "seed": args.seed,
            "rounds": preset.rounds, "warmup": preset.warmup,
            "step": "forward + loss + backward; grads set to None before each step; no optimizer",
            "configs": bench.rows, "indexer_check": None, "eager_repeat": None,
            "phases_done": [],
        }

        def save() -> None:
            # NOTE: on a GPU lent for minutes the run may be stopped by its time limit, with no
            # unwinding (SIGTERM): what each phase measured is on disk before the next starts.
            if args.out is not None:
                _write_results(results, args.out)

        def done(phase: str) -> None:
            results["phases_done"].append(phase)
            save()

        n = len(bench.variants)
        cuda_steps = n if device.type == "cuda" else 0
        progress = Progress(2 + 3 * n + 1 + cuda_steps + n * (preset.warmup + preset.rounds))
        results["eager_repeat"] = bench.equality(progress)
        done("equality")
        bench.measure_each(progress, "census", census_of, "census")
        done("census")
        results["indexer_check"] = bench.flops(progress)
        done("flops")
        if device.type == "cuda":
            bench.measure_each(progress, "peak memory", peak_bytes_of, "peak_bytes")
            done("peak memory")
        bench.timing(progress, after_round=save)
        done("timing")
        progress.close()
    finally:
        torch.set_num_threads(threads)
    try:
        table = markdown_table(results)
    except Exception as err:  # the measurements must survive a formatting bug: still written
        table = f"the table could not be rendered: {_error_text(err)}"
    results["table_markdown"] = table
    print(table)
    if args.out is not None:
        paths = _write_outputs(results, table, args.out)
        print("outputs: " + ", ".join(p for p in paths.values() if p is not None))
    else:
        print("outputs: printed only (pass --out DIR to write table.md and results.json)")
    return results


if __name__ == "__main__":
    main()
