"""The instruction-count benchmark behind docs/benchmarks.md, without valgrind (CI has none).

No count is asserted here: instruction claims live in the script's output only. What is
tested is what the script decides without valgrind: its reading of callgrind's report, its
table, its refusal when valgrind is missing, and that it counts nothing when ours differs
from eager.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from examples import bench_boundary, bench_instructions


def test_the_count_is_read_from_callgrinds_last_collected_line() -> None:
    stderr = ("==12== Callgrind, a call-graph generating cache profiler\n"
              "==12== Collected : 1234\n==12==\n==12== Events    : Ir\n"
              "==12== Collected : 96091028\n==12== I   refs:      96,091,028\n")
    assert bench_instructions.parse_collected(stderr) == 96091028
    with pytest.raises(RuntimeError, match="no instruction count"):
        bench_instructions.parse_collected("==12== error: something else\n")


def test_the_table_gives_per_call_costs_over_eager_and_ratios_to_torch_reentrant() -> None:
    per_step = {config: 1000.0 * (i + 1) for i, config in enumerate(bench_boundary.CONFIGS)}
    per_step[bench_boundary.EAGER] = 1000.0
    per_step[bench_boundary.TORCH_REENTRANT] = 1000.0 + 8 * 500.0
    per_step[bench_boundary.OURS] = 1000.0 + 8 * 600.0
    table = bench_instructions.format_report("small", 5, per_step, True)
    ours = next(line for line in table.splitlines() if line.startswith("| ours |"))
    # 600 instructions a layer call over eager; 5800 / 5000 of torch reentrant's step.
    assert ours == "| ours | 6 | 0.6 | 1.160 |"


def test_a_machine_without_valgrind_is_told_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match="apt-get install valgrind"):
        bench_instructions.main(["--steps", "1"])


def test_nothing_is_counted_when_ours_differs_from_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[Any] = []
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(bench_boundary.Bench, "grads_equal", lambda self, config: False)
    monkeypatch.setattr(bench_instructions, "count_instructions",
                        lambda *args: counted.append(args) or 1)
    assert bench_instructions.main(["--steps", "1"]) == {"grads_equal": False}
    assert counted == []


# Guards against (helper HN), as it was found:
def test_every_pytree_ckpt_row_counted_is_first_checked_bit_for_bit_against_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(bench_boundary.Bench, "grads_equal",
                        lambda self, config: checked.append(config) or True)
    monkeypatch.setattr(bench_instructions, "count_instructions", lambda *args: 1000)
    result = bench_instructions.main(["--steps", "1"])
    counted = {config for config in result["per_step"] if config.startswith("ours")}
    assert counted == {bench_boundary.OURS, bench_boundary.OURS_MODULE,
                       bench_boundary.OURS_VERIFY}
    assert counted <= set(checked), checked
