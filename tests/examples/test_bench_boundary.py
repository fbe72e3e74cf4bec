"""The boundary benchmark script runs end to end and reports a coherent result structure.

No timing is asserted here: timing claims live in the script's output only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examples import bench_boundary

EXPECTED_CONFIGS = {"ours", "ours (module)", "ours (verify_replay)", "torch reentrant",
                    "torch non-reentrant", "eager"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    path = tmp_path_factory.mktemp("bench") / "times.json"
    results = bench_boundary.main(
        ["--sizes", "small", "--rounds", "2", "--warmup", "1", "--json", str(path)])
    return results, path


def test_the_tiny_run_reports_every_configuration_for_the_small_size(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    results, _ = tiny_run
    assert set(results["sizes"]) == {"small"}
    small = results["sizes"]["small"]
    assert set(small["configs"]) == EXPECTED_CONFIGS
    assert set(bench_boundary.CONFIGS) == EXPECTED_CONFIGS


def test_the_gradients_of_ours_are_reported_bit_identical_to_eager(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    results, _ = tiny_run
    assert results["sizes"]["small"]["grads_equal"] is True


def test_every_configuration_has_positive_medians_and_one_raw_time_per_round(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    small = tiny_run[0]["sizes"]["small"]
    for config, stats in small["configs"].items():
        assert len(stats["times_ms"]) == 2, config
        assert all(t > 0 for t in stats["times_ms"]), config
        assert stats["median_ms"] > 0, config
        assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"], config


def test_the_ratios_are_the_quotients_of_the_medians(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    small = tiny_run[0]["sizes"]["small"]
    medians = {config: stats["median_ms"] for config, stats in small["configs"].items()}
    for config, stats in small["configs"].items():
        assert stats["ratio_vs_torch_reentrant"] == pytest.approx(
            medians[config] / medians["torch reentrant"], rel=1e-12)
    ours = small["ours_ratios"]
    assert ours["vs_torch_reentrant"] == pytest.approx(
        medians["ours"] / medians["torch reentrant"], rel=1e-12)
    assert ours["vs_torch_non_reentrant"] == pytest.approx(
        medians["ours"] / medians["torch non-reentrant"], rel=1e-12)
    assert ours["vs_eager"] == pytest.approx(medians["ours"] / medians["eager"], rel=1e-12)
    assert small["target_met"] == (ours["vs_torch_reentrant"] <= small["target"])


def test_the_json_file_holds_the_same_results_as_the_return_value(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    results, path = tiny_run
    assert json.loads(path.read_text()) == results


def test_no_timings_are_reported_when_the_gradients_differ_from_eager(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def off_by_a_bit(layer: Any, x: Any) -> Any:
        return layer(x) * 1.001

    monkeypatch.setitem(bench_boundary.LAYER_CALLS, "ours", off_by_a_bit)
    results = bench_boundary.main(["--sizes", "small", "--rounds", "1", "--warmup", "0"])
    small = results["sizes"]["small"]
    assert small["grads_equal"] is False
    assert "configs" not in small
    assert "timings not reported" in capsys.readouterr().out


def test_no_row_offloads_when_the_environment_turns_offload_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The module-wrapping row read XTUNER_ACTIVATION_OFFLOAD (apply_activation_checkpointing's
    # default) while `ours` (checkpoint(), which never offloads) did not: with the variable on,
    # one row of "the boundary's cost" timed offload's copies too, and the table did not say so.
    from offload import default_manager
    from pytree_ckpt import functional

    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    # checkpoint() warns once per process with the variable on: left as it was for the tests
    # that count that warning (the bench filters it, its report says the variable is ignored).
    monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
    manager = default_manager()
    manager.stats(reset=True)
    bench = bench_boundary.Bench(bench_boundary.SIZES["small"])
    bench.step(bench_boundary.OURS_MODULE)
    assert manager.stats(reset=True)["windows"] == 0  # before: one window per layer, 8
    bench.zero_grad()
    results = bench_boundary.main(["--sizes", "small", "--rounds", "1", "--warmup", "0"])
    assert results["offload_env_ignored"] is True
    assert manager.stats(reset=True)["windows"] == 0
    assert "XTUNER_ACTIVATION_OFFLOAD is on: ignored here" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_thread_count_below_one_is_a_usage_error_naming_the_flag(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # It reached torch.set_num_threads and died in a traceback ("set_num_threads expects a
    # positive integer"), after the parse.
    with pytest.raises(SystemExit) as info:
        bench_boundary.main(["--sizes", "small", "--threads", value])
    assert info.value.code == 2
    assert f"--threads must be >= 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize(("sizes", "message"), [
    (",", "--sizes names no size; choose from small, moderate"),
    ("small,huge,tiny", "unknown size(s) huge, tiny; choose from small, moderate"),
])
def test_sizes_naming_nothing_or_an_unknown_size_are_usage_errors_that_say_which(
        sizes: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # An empty list read "unknown size(s) []", naming no unknown size.
    with pytest.raises(SystemExit) as info:
        bench_boundary.main(["--sizes", sizes])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_verify_replay_row_compares_each_layers_replay_and_only_that_row_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytree_ckpt.refusals import fn_name
    from pytree_ckpt.replay_values import OutputPrints

    checked: list[str] = []
    original = OutputPrints.check

    def counted(self: OutputPrints, *args: Any, **kwargs: Any) -> None:
        checked.append(fn_name(kwargs["fn"]))
        original(self, *args, **kwargs)

    monkeypatch.setattr(OutputPrints, "check", counted)
    bench = bench_boundary.Bench(bench_boundary.SIZES["small"])
    for config in bench_boundary.CONFIGS:
        if config != bench_boundary.OURS_VERIFY:
            bench.step(config)
    assert checked == []
    bench.step(bench_boundary.OURS_VERIFY)
    assert checked == ["DecoderBlock"] * bench_boundary.LAYERS
