"""The GLM-DSA benchmark at its tiny preset: every row, exactness, FLOP accounting, outputs.

One run (module-scoped) serves most tests; nothing here looks at measured timings, which a
shared CI machine cannot promise. The last tests drive the bench's phases on scripted inputs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, bench, make_packed_batch
from examples.glm_dsa.bench_configs import CONFIGS
from examples.glm_dsa.kernels import indexer_topk_flops, sparse_attention_flops

# Output discard sums a block input's gradient in another order (NOTE [exactness] in
# pytree_ckpt/discard_function.py): its row is loss-equal, and grads-equal only up to
# rounding, so it is not here.
PYTREE_ROWS = ("pytree_reuse_off", "pytree_reuse_on", "pytree_offload", "pytree_save_attn",
               "pytree_save_indexer", "pytree_save_gate", "pytree_save_dispatch")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bench.main(["--preset", "tiny", "--device", "cpu", "--out", str(out),
                              "--rounds", "2", "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    return results, out


def test_every_configuration_has_a_row_and_only_cuda_ones_are_skipped_on_cpu(
        run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    rows = results["configs"]
    assert list(rows) == [config.key for config in CONFIGS]
    for config in CONFIGS:
        expected = "skipped" if config.cuda_only else "ok"
        assert rows[config.key]["status"] == expected, (config.key, rows[config.key]["note"])
        assert f"| {config.label} |" in results["table_markdown"]
    assert "save_on_cpu" in rows and "CUDA only" in rows["save_on_cpu"]["note"]


def test_every_pytree_ckpt_configuration_matches_eager_bit_for_bit(
        run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    for key in PYTREE_ROWS:
        equality = rows[key]["equality"]
        assert equality["loss_equal"] is True, key
        assert equality["grads_equal"] is True, (key, equality["grads_differing"])
        assert equality["grads_compared"] > 0
    assert run[0]["eager_repeat"]["grads_equal"] is True


def test_reuse_saves_exactly_the_indexer_forward_flops(run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    rows, check = results["configs"], results["indexer_check"]
    off, on = rows["pytree_reuse_off"], rows["pytree_reuse_on"]
    assert check["indexer_forward_flops"] > 0
    assert off["recompute_flops"] - on["recompute_flops"] == check["indexer_forward_flops"]
    assert check["match"] is True and check["recompute_drop"] == check["indexer_forward_flops"]
    # Replay never reruns an indexer; reuse off reruns each computing call exactly once.
    assert on["indexer_flops_recomputed"] == 0
    assert off["indexer_flops_recomputed"] == check["indexer_forward_flops"]
    assert check["indexer_calls"] == 5  # layers 0, 1, 2, 6 and MTP depth 1 compute top-k


def test_indexer_flops_follow_the_documented_formula(run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    model = results["preset"]["model"]
    tokens = results["preset"]["tokens"]
    heads, dim, hidden = model["index_n_heads"], model["index_head_dim"], model["hidden_size"]
    # Per call: wq (q_lora -> H*d), wk (hidden -> d), weights_proj (hidden -> H), then top-k.
    projections = 2 * tokens * (model["q_lora_rank"] * heads * dim + hidden * dim + hidden * heads)
    # the logits qI . kI for every (query, key, head) and their head-weighted sum, written
    # out here rather than read from kernels.indexer_topk_flops, the formula under test
    per_call = projections + 2 * tokens * tokens * heads * (dim + 1)
    assert results["indexer_check"]["indexer_forward_flops"] == 5 * per_call
    assert sparse_attention_flops((4, 2, 3), (4, 2, 5), (4, 7)) == 2 * 4 * 2 * 7 * (3 + 5)


def test_checkpointed_pytree_ckpt_rows_hold_fewer_activation_bytes_than_eager(
        run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    eager = rows["eager"]["census"]["total_bytes"]
    for key in PYTREE_ROWS:
        assert 0 < rows[key]["census"]["total_bytes"] < eager, key


def test_offload_moves_the_boundary_inputs_to_host(run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    offload = rows["pytree_offload"]["census"]["by_mechanism"]
    replay = rows["pytree_reuse_on"]["census"]["by_mechanism"]
    assert offload.get("offloaded to host", 0) > 0
    assert offload.get("checkpoint boundary", 0) < replay["checkpoint boundary"]
    stats = rows["pytree_offload"]["offload_stats"]
    assert stats and all(s["offloaded_bytes"] == s["restored_bytes"] > 0 for s in stats)


def test_table_and_results_json_are_written_and_match_the_returned_dict(
        run: tuple[dict[str, Any], Path]) -> None:
    results, out = run
    table = (out / "table.md").read_text()
    assert table == results["table_markdown"]
    assert table.startswith("| config | activation bytes after forward |")
    loaded = json.loads((out / "results.json").read_text())
    assert loaded == json.loads(json.dumps(results))
    assert loaded["outputs"]["results"] == str(out / "results.json")
    for key, row in loaded["configs"].items():
        if row["status"] == "ok":
            assert len(row["step_times_ms"]) == 2, key
            assert row["flops"]["total"] == results["configs"][key]["flops"]["total"]


def test_gpu_presets_refuse_to_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--preset", "gpu-small", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_out_path_that_is_or_lies_under_a_file_is_refused_before_anything_runs(
        below: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # It ran the equality phase, then died in FileExistsError's traceback at the first write of
    # results.json: on a GPU lent for minutes, the run's time for nothing.
    blocking = tmp_path / "a-file"
    blocking.write_text("")
    built: list[object] = []
    monkeypatch.setattr(bench, "_Bench", lambda *args: built.append(args))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--preset", "tiny", "--device", "cpu", "--out", str(blocking / below)])
    assert exit_info.value.code == 2 and not built
    assert f"{blocking} is a file, not a directory" in capsys.readouterr().err


def test_the_table_still_renders_when_a_configuration_the_indexer_check_needs_failed(
        run: tuple[dict[str, Any], Path]) -> None:
    # A first CUDA run may fail a row; the table (and results.json after it) must survive.
    results = json.loads(json.dumps(run[0]))
    results["configs"]["pytree_reuse_on"].update(status="error", note="step 1 failed: boom")
    results["indexer_check"].update(recompute_drop=None, match=False)
    table = bench.markdown_table(results)
    assert "n/a (a configuration it needs failed)" in table and "NO MATCH" in table
    assert "step 1 failed: boom" in table


def test_keeping_the_indexer_op_saves_exactly_its_top_k_flops_in_every_computing_replay(
        run: tuple[dict[str, Any], Path]) -> None:
    # Reuse off, the replay reruns each of the 5 computing indexers; keeping dsa_indexer (by
    # op identity) skips only their top-k op: its projections still rerun.
    results, _ = run
    rows, model = results["configs"], results["preset"]["model"]
    tokens = results["preset"]["tokens"]
    shape = (tokens, model["index_n_heads"], model["index_head_dim"])
    top_k = 5 * indexer_topk_flops(shape, (tokens, model["index_head_dim"]))
    off, kept = rows["pytree_reuse_off"], rows["pytree_save_indexer"]
    assert off["recompute_flops"] - kept["recompute_flops"] == top_k
    assert off["indexer_flops_recomputed"] - kept["indexer_flops_recomputed"] == top_k
    assert 0 < kept["indexer_flops_recomputed"] < off["indexer_flops_recomputed"]


def test_the_table_shows_each_rows_median_and_ratio_to_eager(
        run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    lines = results["table_markdown"].splitlines()
    for key, row in results["configs"].items():
        if row["status"] != "ok":
            continue
        [line] = [line for line in lines if line.startswith(f"| {row['label']} |")]
        assert f"| {row['median_ms']:.1f} | {row['ratio_to_eager']:.2f}x |" in line, key
        assert row["ratio_to_eager"] == row["median_ms"] / results["configs"]["eager"]["median_ms"]


# --------------------------------------------------------------------------- the bench's arithmetic
#
# The run above cannot tell a median from a mean (two rounds) nor a comparison from a constant
# (every row it checks is equal). These drive the bench's own phases on scripted inputs.


def _bare_bench(keys: tuple[str, ...], *, warmup: int = 0, rounds: int = 0,
                variants: dict[str, Any] | None = None) -> Any:
    # A _Bench without building the twelve configurations: only what the phase reads.
    state = bench._Bench.__new__(bench._Bench)
    state.preset = SimpleNamespace(warmup=warmup, rounds=rounds)
    state.device, state.seed = torch.device("cpu"), 0
    state.rows = {key: {"label": key, "family": "x", "status": "ok", "note": None}
                  for key in keys}
    state.variants = variants if variants is not None else {
        key: SimpleNamespace(manager=None) for key in keys}
    state.batches = [{"round": r} for r in range(1 + warmup + rounds)]
    return state


def _quiet_progress() -> Any:
    import io

    from examples.glm_dsa.bench_measure import Progress
    return Progress(1, stream=io.StringIO())


def test_the_median_and_ratio_columns_are_the_median_of_timed_rounds_over_eagers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Three timed rounds with a skewed time, so median, mean and min all differ; the warm-up
    # round's time (1000 ms) must not count.
    script = {"eager": [1000.0, 10.0, 40.0, 16.0], "pytree_reuse_on": [1000.0, 30.0, 90.0, 33.0]}
    seen: dict[str, int] = {key: 0 for key in script}

    def fake_timed_step(variant: Any, batch: Any, device: Any) -> float:
        key = variant.key
        seen[key] += 1
        return script[key][batch["round"] - 1]

    variants = {key: SimpleNamespace(manager=None, key=key) for key in script}
    state = _bare_bench(tuple(script), warmup=1, rounds=3, variants=variants)
    monkeypatch.setattr(bench, "timed_step", fake_timed_step)
    state.timing(_quiet_progress())
    eager, replay = state.rows["eager"], state.rows["pytree_reuse_on"]
    assert seen == {"eager": 4, "pytree_reuse_on": 4}
    assert eager["step_times_ms"] == [10.0, 40.0, 16.0]
    assert replay["step_times_ms"] == [30.0, 90.0, 33.0]
    assert (eager["median_ms"], replay["median_ms"]) == (16.0, 33.0)
    assert eager["ratio_to_eager"] == 1.0
    assert replay["ratio_to_eager"] == 33.0 / 16.0


def test_a_step_time_is_reported_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from examples.glm_dsa import bench_measure

    clock = iter([100.0, 100.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(bench_measure, "run_step", lambda variant, batch: None)
    monkeypatch.setattr(bench_measure, "zero_grads", lambda variant: None)
    assert bench_measure.timed_step(None, {}, torch.device("cpu")) == 250.0


def test_compare_step_reports_a_one_ulp_difference_and_a_missing_gradient() -> None:
    from examples.glm_dsa.bench_measure import compare_step

    loss = torch.tensor(2.0)
    grad = torch.linspace(-1, 1, 6)
    ulp = torch.nextafter(grad, torch.full_like(grad, 2.0))
    reference = (loss, {"a": grad, "b": grad, "c": None})
    assert compare_step(reference, (loss.clone(), {"a": grad.clone(), "b": grad.clone(),
                                                   "c": None}))["grads_equal"] is True
    got = compare_step(reference, (torch.nextafter(loss, torch.tensor(3.0)),
                                   {"a": ulp, "b": grad.clone(), "c": torch.zeros(1)}))
    assert got["loss_equal"] is False and got["grads_equal"] is False
    assert got["grads_differing"] == ["a", "c (grad is None in one)"]
    assert got["max_abs_grad_diff"] == (ulp - grad).abs().max().item() > 0
    assert got["grads_compared"] == 3


def test_the_equality_phase_compares_each_configuration_with_eagers_step() -> None:
    from examples.glm_dsa.bench_configs import Variant

    config = GlmDsaConfig()
    torch.manual_seed(0)
    model = GlmDsaForCausalLM(config)
    nudged = copy.deepcopy(model)
    with torch.no_grad():  # one weight one ulp up: another loss and other gradients
        weight = nudged.layers[0].mlp.up_proj.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    variants = {"eager": Variant(model), "same": Variant(copy.deepcopy(model)),
                "nudged": Variant(nudged)}
    state = _bare_bench(tuple(variants), variants=variants)
    state.batches = [make_packed_batch(config, (20, 12))]
    repeat = state.equality(_quiet_progress())
    assert repeat["loss_equal"] is True and repeat["grads_equal"] is True
    assert state.rows["same"]["equality"]["grads_equal"] is True
    assert state.rows["same"]["equality"]["loss_equal"] is True
    nudged_row = state.rows["nudged"]["equality"]
    assert nudged_row["grads_equal"] is False and nudged_row["max_abs_grad_diff"] > 0


def test_the_indexer_check_matches_only_when_the_drop_equals_the_indexer_flops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    totals = {"eager": (1000, 40), "pytree_reuse_off": (1700, 80), "pytree_reuse_on": (1660, 40)}
    monkeypatch.setattr(bench, "flops_of", lambda variant, batch, device: {
        "total": totals[variant.key][0], "indexer": totals[variant.key][1], "indexer_calls": 1})
    for alone, match in ((40, True), (41, False)):
        monkeypatch.setattr(bench, "indexer_forward_flops",
                            lambda variant, batch, alone=alone: {"flops": alone, "calls": 5})
        variants = {key: SimpleNamespace(manager=None, key=key)
                    for key in totals}
        state = _bare_bench(tuple(totals), variants=variants)
        check = state.flops(_quiet_progress())
        rows = state.rows
        assert [rows[k]["recompute_flops"] for k in totals] == [0, 700, 660]
        assert [rows[k]["indexer_flops_recomputed"] for k in totals] == [0, 40, 0]
        assert check == {"indexer_forward_flops": alone, "indexer_calls": 5,
                         "recompute_drop": 40, "match": match}


def test_a_run_stopped_during_timing_leaves_what_the_earlier_phases_and_rounds_measured(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # On a GPU lent for minutes, scripts/gpu_check.sh stops the bench at its time limit with
    # SIGTERM, which unwinds nothing: results.json must hold each phase (and each timed
    # round) before the next starts. Here the phases run on scripted measurements, and the
    # second timed round never ends (a BaseException, as nothing may catch it).
    class Stopped(BaseException):
        pass

    keys = ("eager", "pytree_reuse_off", "pytree_reuse_on")  # those the FLOP phase reads

    def bare_init(self: Any, preset: Any, device: torch.device, seed: int) -> None:
        self.__dict__.update(vars(_bare_bench(keys, warmup=preset.warmup,
                                              rounds=preset.rounds)))

    steps: list[int] = []

    def timed_step(variant: Any, batch: dict[str, int], device: torch.device) -> float:
        if batch["round"] == 3:  # warm-up is round 1, the first timed round 2
            raise Stopped
        steps.append(batch["round"])
        return 10.0 * batch["round"]

    monkeypatch.setattr(bench._Bench, "__init__", bare_init)
    monkeypatch.setattr(bench, "step_results", lambda variant, batch, seed: None)
    monkeypatch.setattr(bench, "compare_step", lambda reference, got: {
        "loss_equal": True, "grads_equal": True, "grads_differing": []})
    monkeypatch.setattr(bench, "census_of", lambda variant, batch, device: {"total_bytes": 7})
    monkeypatch.setattr(bench, "flops_of", lambda variant, batch, device: {
        "total": 5, "indexer": 2, "indexer_calls": 1})
    monkeypatch.setattr(bench, "indexer_forward_flops", lambda variant, batch: {
        "flops": 2, "calls": 1})
    monkeypatch.setattr(bench, "timed_step", timed_step)
    with pytest.raises(Stopped):
        bench.main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path),
                    "--rounds", "2", "--warmup", "1"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["phases_done"] == ["equality", "census", "flops"]
    assert saved["eager_repeat"] == {"loss_equal": True, "grads_equal": True}
    assert saved["indexer_check"]["indexer_forward_flops"] == 2
    for key in keys:
        row = saved["configs"][key]
        assert row["census"] == {"total_bytes": 7} and row["flops"]["total"] == 5
        assert row["step_times_ms"] == [20.0]  # the first timed round, the warm-up not
    assert steps == [1, 1, 1, 2, 2, 2]


def test_the_demos_plot_hint_is_the_readmes_command(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Any) -> None:
    import sys

    from examples.glm_dsa import bench_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert bench_report.write_plot({"configs": {}}, tmp_path / "plot.png") is None
    out = capsys.readouterr().out
    # quoted, and a pip of the interpreter that runs the demo (README's, or sys.executable's)
    assert any(hint in out for hint in ('.venv/bin/pip install -e ".[plot]"',
                                        f'{sys.executable} -m pip install -e ".[plot]"')), out


def test_the_census_rows_offload_statistics_are_those_of_the_census_forward_alone() -> None:
    # Guards against (helper HC) the census's offload statistics adding the equality step's
    # windows (20 for 10 in the demo: offloaded bytes above the host copies counted).
    # The bench's own phases in its order (equality, then census) on the tiny preset, with
    # only the rows they need. The census measures one forward; its offload_stats must be that
    # forward's: one window per layer call, and offloaded bytes no more than the
    # host copies the census counts (docs/census.md: "at least stats()['offloaded_bytes']").
    from examples.glm_dsa.bench_configs import PRESETS
    from examples.glm_dsa.bench_measure import census_of
    state = bench._Bench(PRESETS["tiny"], torch.device("cpu"), 0)
    state.variants = {key: state.variants[key] for key in ("eager", "pytree_offload")}
    state.equality(_quiet_progress())
    state.measure_each(_quiet_progress(), "census", census_of, "census")
    census = state.rows["pytree_offload"]["census"]
    config = state.variants["pytree_offload"].model.config
    stats = census["offload_stats"]
    assert stats["windows"] == config.num_layers + config.mtp_depth  # one window a layer call
    assert stats["offloaded_bytes"] <= census["by_mechanism"]["offloaded to host"]


# Guards against (helper HN), as it was found:
def test_the_torch_selective_anchors_policy_does_not_rebuild_its_op_set_at_every_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.glm_dsa import bench_configs
    from examples.glm_dsa.bench_measure import run_step

    preset = bench_configs.PRESETS["tiny"]
    torch.manual_seed(0)
    base = GlmDsaForCausalLM(preset.model)
    sac = next(config for config in CONFIGS if config.key == "torch_sac")
    variant = sac.build(base, preset, torch.device("cpu"))
    builds: list[int] = []  # each frozenset the module makes: one per _sac_saved_ops() call
    monkeypatch.setattr(bench_configs, "frozenset",
                        lambda *args: builds.append(1) or frozenset(*args), raising=False)
    run_step(variant, make_packed_batch(preset.model, preset.seq_lens))
    # The policy is consulted per op; the set it consults is the same each time.
    assert len(builds) <= 1, len(builds)
