"""The Markdown table, the notes under it, and the optional plot of ``examples.glm_dsa.bench``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["format_bytes", "format_flops", "markdown_table", "write_plot"]

HEADER = ("config", "activation bytes after forward", "census by mechanism",
          "peak device memory", "step time median ms", "ratio to eager", "recompute FLOPs",
          "indexer FLOPs recomputed", "loss = eager", "grads = eager")


def format_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "n/a"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_flops(flops: int | None, *, signed: bool = True) -> str:
    if flops is None:
        return "n/a"
    if flops == 0:
        return "0"
    sign = ("+" if flops > 0 else "-") if signed else ("-" if flops < 0 else "")
    value = abs(float(flops))
    for unit in ("", "k", "M", "G", "T", "P"):
        if value < 1000 or unit == "P":
            return f"{sign}{value:.3g} {unit}FLOP"
        value /= 1000
    raise AssertionError("unreachable")


def _mechanisms(census: dict[str, Any]) -> str:
    parts = sorted(census["by_mechanism_short"].items(), key=lambda item: -item[1])
    text = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in parts) or "nothing"
    if census.get("unseen_sac_cache_bytes") is not None:
        text += f"; + SAC cache {format_bytes(census['unseen_sac_cache_bytes'])} (unseen)"
    return text


def _yes_no(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**no**")


def _row(key: str, row: dict[str, Any]) -> list[str]:
    if row["status"] == "skipped":
        return [row["label"], *(["skipped"] + ["n/a"] * (len(HEADER) - 2))]
    if row["status"] == "error" and row.get("census") is None:
        return [row["label"], "error", "see note", *(["n/a"] * (len(HEADER) - 3))]
    census = row["census"]
    equality = row.get("equality") or {}
    median = row.get("median_ms")
    ratio = row.get("ratio_to_eager")
    activations = format_bytes(census["total_bytes"])
    if census.get("held_after_forward_bytes") is not None:  # CUDA: what the allocator holds
        activations += f" (device +{format_bytes(census['held_after_forward_bytes'])})"
    return [row["label"], activations, _mechanisms(census),
            format_bytes(row.get("peak_bytes")),
            "n/a" if median is None else f"{median:.1f}",
            "n/a" if ratio is None else f"{ratio:.2f}x",
            format_flops(row.get("recompute_flops")),
            format_flops(row.get("indexer_flops_recomputed")),
            _yes_no(equality.get("loss_equal")), _yes_no(equality.get("grads_equal"))]


def _count(value: int | None) -> str:
    return "n/a (a configuration it needs failed)" if value is None else f"{value:,}"


def markdown_table(results: dict[str, Any]) -> str:
    """The table, then numbered notes: what was measured and everything that went wrong."""
    rows = results["configs"]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_row(key, row)) + " |" for key, row in rows.items()]
    check = results["indexer_check"]
    notes = [
        f"Preset `{results['preset']['name']}`: {results['preset']['tokens']} tokens "
        f"(seq_lens {tuple(results['preset']['seq_lens'])}), {results['device']}, "
        f"torch {results['torch']}, {results['threads']} CPU thread(s); "
        f"{results['rounds']} timed rounds after {results['warmup']} warm-up rounds, one step "
        "of each configuration per round in an order rotated every round.",
        "Step = forward + loss + backward with gradients set to None before it and no "
        "optimizer, so the weights stay identical across configurations and rounds; equality "
        "is `torch.equal` of step 1's loss and of every parameter gradient against eager.",
        f"Indexer check: the recompute-FLOP drop from reuse off to reuse on is "
        f"{_count(check['recompute_drop'])} FLOPs; the indexer forward FLOPs (its "
        f"{check['indexer_calls']} calls of one forward, run alone under FlopCounterMode) are "
        f"{_count(check['indexer_forward_flops'])}: "
        f"{'match' if check['match'] else 'NO MATCH'}.",
        "Census = `ActivationCensus` after one untimed forward: it sees what passes through "
        "saved-tensor hooks and what pytree-ckpt reports. torch's selective checkpoint keeps "
        "the outputs of its saved ops in its own cache, which no saved-tensor hook sees: the "
        "bench meters them apart (\"SAC cache (unseen)\", not in the total). On CUDA, peak "
        "device memory is the ground truth for every row.",
        "Recompute FLOPs = FLOPs of a whole step under FlopCounterMode minus eager's "
        "(custom-op formulas in kernels.py); indexer FLOPs recomputed = FLOPs spent inside "
        "`DsaIndexer` forwards minus eager's.",
    ]
    repeat = results["eager_repeat"]
    notes.append(f"Noise floor: eager run twice gives loss equal {_yes_no(repeat['loss_equal'])}, "
                 f"grads equal {_yes_no(repeat['grads_equal'])}.")
    if rows.get("save_on_cpu", {}).get("status") == "ok":
        notes.append("torch save_on_cpu: the census sees what eager saves (its pack hook "
                     "chains to save_on_cpu's), held in pinned host memory; the device "
                     "and peak columns show what stays on the device.")
    for key, row in rows.items():
        if row["status"] == "skipped":
            notes.append(f"{row['label']}: skipped ({row['note']}).")
        elif row["status"] == "error":
            notes.append(f"{row['label']}: {row['note']}")
        equality = row.get("equality") or {}
        if equality and not equality["grads_equal"]:
            names = equality["grads_differing"]
            notes.append(f"{row['label']}: {len(names)} of {equality['grads_compared']} "
                         f"gradients differ from eager (max |d| "
                         f"{equality['max_abs_grad_diff']:.3g}), e.g. {', '.join(names[:3])}.")
        if census_flags := (row.get("census") or {}).get("flagged"):
            flagged = ", ".join(f"{flag['module']} {format_bytes(flag['bytes'])}"
                                for flag in census_flags)
            notes.append(f"{row['label']}: after the forward the census flags storages the "
                         f"offload released that something else keeps alive ({flagged}): "
                         "copying them saved nothing.")
        if offload_steps := row.get("offload_stats"):
            last = offload_steps[-1]
            notes.append(
                f"{row['label']}: per step the manager offloaded "
                f"{format_bytes(int(last['offloaded_bytes']))} in {int(last['windows'])} windows, "
                f"restored {format_bytes(int(last['restored_bytes']))} "
                f"({format_bytes(int(last['reused_bytes']))} of it without a copy back), "
                f"{int(last['prefetch_hits'])} prefetch hits; it counted "
                f"{format_bytes(int(last['alive_elsewhere_bytes']))} as still alive elsewhere "
                f"when backward began; host pool {format_bytes(int(last['host_bytes']))}, "
                f"{int(last['pool_misses'])} pool misses in the last step.")
    lines.append("")
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def write_plot(results: dict[str, Any], path: Path) -> Path | None:
    """Census bytes against median step time, one point per configuration (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # This interpreter's pip (./dev demo's is .venv's), the extra quoted (zsh globs it)
        print(f'plot skipped: matplotlib not installed ({sys.executable} -m pip install -e '
              '".[plot]")')
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in results["configs"].values():
        if row.get("median_ms") is None or row.get("census") is None:
            continue
        x, y = row["median_ms"], row["census"]["total_bytes"] / 1024
        ax.scatter([x], [y])
        ax.annotate(row["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("activation census after forward (KiB)")
    ax.set_title(f"GLM-DSA example, preset {results['preset']['name']} ({results['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
