"""The removal benchmark's command line: what it counts and what it refuses.

No timing is asserted here: timing claims live in the script's output only.
"""

from __future__ import annotations

import pytest

from examples import bench_removal


def test_a_small_run_reports_the_layers_and_modules_it_built_and_leaves_nothing_wrapped(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 9 modules a layer and 4 per expert (three Linears and the expert): the docstring's 261
    # at 63 experts is the same count. _remove_all raises if a kept method stays wrapped.
    best = bench_removal.main(["--layers", "3", "--experts", "2", "--rounds", "2"])
    out = capsys.readouterr().out
    assert best >= 0 and out.startswith("3 layers of 17 modules: removing all took ")
    assert out.rstrip().endswith("(best of 2)")
    assert sum(1 for _ in bench_removal.Layer(63).modules()) == 261


@pytest.mark.parametrize("flag", ["--layers", "--experts", "--rounds"])
def test_a_count_below_one_is_a_usage_error_naming_the_flag(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --rounds 0 died in min()'s "empty sequence" traceback, --layers 0 in an IndexError, and
    # --experts 0 built routers with no output and timed them.
    with pytest.raises(SystemExit) as info:
        bench_removal.main(["--layers", "2", "--experts", "1", "--rounds", "1", flag, "0"])
    assert info.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err
