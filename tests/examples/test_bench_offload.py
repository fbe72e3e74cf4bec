"""The offload benchmark script runs end to end on CPU and reports what it measured.

No timing is asserted here: timing claims live in the script's output only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examples import bench_offload


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    path = tmp_path_factory.mktemp("bench") / "offload.json"
    result = bench_offload.main(["--size", "tiny", "--rounds", "2", "--warmup", "1",
                                 "--json", str(path)])
    return result, path


def test_checkpoint_offload_and_save_on_cpu_give_eager_gradients_bit_for_bit(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    configs = tiny_run[0]["configs"]
    assert set(configs) == set(bench_offload.CONFIGS)
    for config in (bench_offload.CHECKPOINT, bench_offload.OFFLOAD, bench_offload.SAVE_ON_CPU):
        assert configs[config]["grads_equal_eager"], config
        assert configs[config]["grads_max_abs_diff"] == 0.0, config


def test_every_layer_input_is_offloaded_once_per_step_and_restored(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    result = tiny_run[0]
    size = bench_offload.SIZES["tiny"]
    probe = result["offload_probe"]
    assert probe["windows"] == size.layers
    assert probe["offloaded_bytes"] == probe["restored_bytes"] == size.layers * size.input_bytes()
    assert probe["alive_elsewhere_bytes"] == 0  # layer 0's input too: freed on the device
    timed = result["offload_timed"]  # 1 warm-up and 2 timed steps, after the probe step
    assert timed["offloaded_bytes"] == 3 * size.layers * size.input_bytes()
    assert timed["pool_misses"] == 0  # the probe step warmed the pool: it no longer grows


def test_the_ratios_are_the_quotients_of_the_medians_and_cpu_has_no_memory_columns(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, path = tiny_run
    configs = result["configs"]
    reference = configs[bench_offload.CHECKPOINT]["median_ms"]
    for config, stats in configs.items():
        assert len(stats["times_ms"]) == 2, config
        assert stats["ratio_vs_checkpoint"] == pytest.approx(stats["median_ms"] / reference,
                                                             rel=1e-12)
        assert stats["held_bytes"] is None and stats["peak_bytes"] is None
    targets = result["targets"]
    assert targets["overhead"]["value"] == configs[bench_offload.OFFLOAD]["ratio_vs_checkpoint"]
    assert "peak_drop" not in targets and "held_drop" not in targets  # only measured on CUDA
    assert json.loads(path.read_text())["configs"].keys() == configs.keys()
    assert result["eager_repeat"] == {"grads_equal": True, "grads_max_abs_diff": 0.0}
    assert result["failed"] == {}
    assert result["link"] is None and "link" not in bench_offload.format_report(result)


def test_the_link_line_sets_one_layer_input_s_copies_beside_a_layer_s_step_time(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    # As a GPU run reports it (_link_ms needs CUDA): the copy times against a checkpointed
    # layer's share of the step, to tell a slow link from the library's own overhead.
    result = {**tiny_run[0], "link": {"to_host_ms": 0.75, "to_device_ms": 0.5,
                                      "to_host_gb_s": 44.7, "to_device_gb_s": 67.1}}
    layer_ms = result["configs"][bench_offload.CHECKPOINT]["median_ms"] / 4  # tiny: 4 layers
    assert (f"link (alone, pinned, side stream): one layer input (0.1 MiB) to host 0.75 ms "
            f"(44.7 GB/s), back 0.50 ms (67.1 GB/s); a checkpoint step takes {layer_ms:.2f} ms "
            "per layer") in bench_offload.format_report(result)
    failed = {**result, "link": {"error": "RuntimeError: pinned allocation failed"}}
    assert "link: not measured (RuntimeError: pinned allocation failed)" in \
        bench_offload.format_report(failed)


def test_the_reserved_peak_is_reported_without_a_verdict_beside_the_allocated_targets(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    # As a GPU run reports it: the reserved peak is information, not a target (blocks freed
    # under record_stream stay reserved until their copy is done), so a small drop must not
    # read "NOT met" beside the allocated targets, which do.
    mib = 1 << 20
    drop = {"limit": 100 * mib, "value": 10 * mib, "met": False}
    reserved_drop = {"limit": 100 * mib, "value": 10 * mib}
    result = {**tiny_run[0], "targets": {**tiny_run[0]["targets"], "peak_drop": drop,
                                         "reserved_drop": reserved_drop}}
    lines = bench_offload.format_report(result).splitlines()
    (peak,) = (line for line in lines if line.startswith("target: peak drops"))
    (reserved,) = (line for line in lines if line.startswith("information, not a target"))
    assert peak.endswith("NOT met")
    assert "met" not in reserved and "peak reserved" in reserved
    assert "10.0 MiB" in reserved and "100.0 MiB" in reserved  # the drop and the allocated bar


def test_the_memory_targets_carry_a_verdict_and_the_reserved_drop_none() -> None:
    # The memory columns exist only on CUDA: the verdicts are computed here from a GPU run's
    # numbers, as _targets gets them. The JSON says what the report prints: no "met" for the
    # reserved peak, which is information, not a target.
    size = bench_offload.SIZES["tiny"]
    needed = (size.layers - 2) * size.input_bytes()
    base = {"median_ms": 10.0, "ratio_vs_checkpoint": 1.0}
    configs = {
        bench_offload.CHECKPOINT: {**base, "peak_bytes": 5 * needed, "held_bytes": 4 * needed,
                                   "peak_reserved_bytes": 6 * needed},
        bench_offload.OFFLOAD: {**base, "median_ms": 10.2, "ratio_vs_checkpoint": 1.02,
                                "peak_bytes": 4 * needed, "held_bytes": 3 * needed + 1,
                                "peak_reserved_bytes": 6 * needed},
    }
    targets = bench_offload._targets(size, configs)
    assert targets["overhead"] == {"value": 1.02, "limit": bench_offload.MAX_OVERHEAD,
                                   "met": True}
    assert targets["peak_drop"] == {"value": needed, "limit": needed, "met": True}
    assert targets["held_drop"] == {"value": needed - 1, "limit": needed, "met": True}  # rounding
    assert targets["reserved_drop"] == {"value": 0, "limit": needed}


def test_a_configuration_that_fails_is_reported_and_the_others_still_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    probe = bench_offload.Bench.probe

    def failing(self: bench_offload.Bench, config: str) -> dict[str, Any]:
        if config == bench_offload.SAVE_ON_CPU:
            raise RuntimeError("pinned allocation failed")
        return probe(self, config)

    monkeypatch.setattr(bench_offload.Bench, "probe", failing)
    path = tmp_path / "offload.json"
    result = bench_offload.main(["--size", "tiny", "--rounds", "1", "--warmup", "0",
                                 "--json", str(path)])
    assert result["failed"] == {bench_offload.SAVE_ON_CPU: "RuntimeError: pinned allocation failed"}
    assert bench_offload.SAVE_ON_CPU not in result["configs"]
    assert set(result["targets"]) == {"overhead"}  # vs save_on_cpu: not measured
    out = capsys.readouterr()
    assert "| torch save_on_cpu | failed: RuntimeError: pinned allocation failed |" in out.out
    assert "probe torch save_on_cpu: FAILED" in out.err
    assert json.loads(path.read_text())["failed"] == result["failed"]


def test_a_configuration_that_fails_while_timed_is_reported_and_not_run_again(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    step = bench_offload.Bench.step
    calls: list[str] = []

    def failing(self: bench_offload.Bench, config: str) -> float:
        calls.append(config)
        if config == bench_offload.TORCH_REENTRANT:
            raise MemoryError("out of memory")
        return step(self, config)

    monkeypatch.setattr(bench_offload.Bench, "step", failing)
    result = bench_offload.main(["--size", "tiny", "--rounds", "2", "--warmup", "1"])
    assert result["failed"] == {bench_offload.TORCH_REENTRANT: "MemoryError: out of memory"}
    assert calls.count(bench_offload.TORCH_REENTRANT) == 1
    assert calls.count(bench_offload.CHECKPOINT) == 3  # warm-up and two rounds
    assert bench_offload.TORCH_REENTRANT not in result["configs"]
    assert result["probed_not_timed"][bench_offload.TORCH_REENTRANT]["grads_equal_eager"]
    assert result["targets"]["overhead"]["value"] > 0
    assert "| torch reentrant | failed: MemoryError: out of memory |" in capsys.readouterr().out


def test_the_realistic_size_is_refused_on_cpu_with_a_tip(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_offload.main(["--size", "realistic", "--device", "cpu"])
    assert "needs --device cuda; tip: --size tiny on CPU" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_a_json_path_under_a_file_or_at_a_directory_is_refused_before_anything_runs(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # It ran the first probe, then died in a traceback at the first write of the results (in
    # the GPU script, that step's minutes for nothing).
    blocking = tmp_path / "a-file"
    blocking.write_text("")
    ran: list[object] = []
    monkeypatch.setattr(bench_offload, "run", lambda *args, **kwargs: ran.append(args))
    path = blocking / "offload.json" if where == "under-a-file" else tmp_path
    with pytest.raises(SystemExit) as exit_info:
        bench_offload.main(["--size", "tiny", "--json", str(path)])
    assert exit_info.value.code == 2 and not ran
    err = capsys.readouterr().err
    assert (f"{blocking} is a file, not a directory" in err if where == "under-a-file"
            else "is a directory; tip: name a file in it" in err)


# Guards against (helper HN), as it was found:
def test_the_offload_memory_probe_is_a_steady_state_step_on_a_warm_host_pool(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    probe = tiny_run[0]["offload_probe"]
    assert probe["windows"] == bench_offload.SIZES["tiny"].layers
    assert probe["pool_misses"] == 0 and probe["pool_hits"] == probe["windows"], probe
