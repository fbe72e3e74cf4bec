"""``scripts/gpu_check.sh`` on CPU, with a stand-in ``python3`` that answers as a GPU machine.

The script runs once, on a GPU lent for minutes, and must work the first time. Here its
shell logic runs for real: the optree check, PYTHONPATH, the pytest command line (markers,
``-o`` options, with or without pytest-timeout) and where each step writes. The stand-in passes
every call through to this interpreter except the CUDA check (it answers yes) and the two
benches, whose argument parsers it runs (with ``torch.cuda.is_available`` answering yes) on
the arguments the script gives, before writing a placeholder where the bench would write.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

_STAND_IN = """#!/usr/bin/env bash
# python3 as on a GPU machine (written by tests/test_gpu_check.py)
real={python}
if [ "$1" = "-c" ]; then
  case "$2" in
    *torch.cuda.is_available*) echo "2.11.0+cu130 NVIDIA H200 (stand-in)"; exit 0 ;;
    *"import optree, sys"*) [ -n "${{NO_OPTREE:-}}" ] && exit 1 ;;
    *"import pytest_timeout"*) [ -n "${{NO_PYTEST_TIMEOUT:-}}" ] && exit 1 ;;
  esac
fi
if [ "$1" = "-m" ] && [ "$2" = examples.bench_offload ]; then
  shift 2
  "$real" -c 'import sys, torch
torch.cuda.is_available = lambda: True
from examples.bench_offload import _parse
args = _parse(sys.argv[1:])
assert (args.size, args.device) == ("realistic", "cuda"), args
args.json.write_text("{{}}")
print("bench_offload (stand-in)", args)' "$@" || exit
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = examples.glm_dsa.bench ]; then
  shift 2
  "$real" -c 'import sys, torch
torch.cuda.is_available = lambda: True
from examples.glm_dsa.bench import parse_args
args = parse_args(sys.argv[1:])
assert (args.preset, args.device) == ("gpu-small", "cuda"), args
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "results.json").write_text("{{}}")
print("glm_dsa.bench (stand-in)", args)' "$@" || exit
  exit 0
fi
exec "$real" "$@"
"""


def _files_with_cuda_tests(session: pytest.Session) -> frozenset[str]:
    """The test files of every test ``-m cuda`` selects in the whole suite (a full collection,
    as the script ran it before it picked its files). Read from this session's own items when
    it collected every test file and deselected nothing (the README's test command), else
    collected again in a subprocess (about 20 s)."""
    config = session.config
    files = {str(Path(item.path).relative_to(ROOT)) for item in session.items}
    every = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")}
    if files == every and not (config.option.keyword or config.option.markexpr or
                               config.getoption("deselect", None)):
        return frozenset(str(Path(item.path).relative_to(ROOT)) for item in session.items
                         if item.get_closest_marker("cuda") is not None)
    return _collected_cuda_files()


@functools.cache
def _collected_cuda_files() -> frozenset[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--collect-only", "-q", "-m", "cuda", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return frozenset(re.findall(r"^(tests/\S+?\.py)::", done.stdout, re.MULTILINE))


def _stand_in(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(_STAND_IN.format(python=sys.executable))
    python3.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
@pytest.mark.parametrize("pytest_timeout", [True, False], ids=["plugin", "no_plugin"])
def test_gpu_check_runs_the_cuda_tests_and_both_benches_with_arguments_they_accept(
        tmp_path: Path, pytest_timeout: bool, request: pytest.FixtureRequest) -> None:
    if pytest_timeout:
        pytest.importorskip("pytest_timeout")  # the dev extra installs it
    env = _stand_in(tmp_path)
    if not pytest_timeout:  # a machine without the plugin: the script must not rely on it
        env["NO_PYTEST_TIMEOUT"] = "1"
        env["PYTEST_ADDOPTS"] = "-p no:timeout"
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tests_log = (out / "gpu_tests.log").read_text()
    # The CUDA tests were selected and skipped here (no GPU); nothing failed to collect.
    assert "tests/offload/test_cuda.py::" in tests_log and " SKIPPED" in tests_log
    summary = tests_log.strip().splitlines()[-1]
    assert " skipped" in summary and "error" not in summary and "failed" not in summary
    # The script collects only the files that mark a test cuda: every such test is among them.
    ran = frozenset(re.findall(r"^(tests/\S+?\.py)::", tests_log, re.MULTILINE))
    assert ran == _files_with_cuda_tests(request.session)
    assert tests_log.startswith("2.11.0+cu130 NVIDIA H200 (stand-in)")  # what ran, first
    assert "slowest 12 durations" in tests_log  # each test's cost there, for the next limits
    assert ("timeout: 45.0s" in tests_log) == pytest_timeout  # the per-test limit, if any
    assert (out / "offload.json").read_text() == "{}"
    assert "bench_offload (stand-in)" in (out / "offload.log").read_text()
    assert (out / "bench" / "results.json").read_text() == "{}"
    assert "glm_dsa.bench (stand-in)" in (out / "bench.log").read_text()


def test_gpu_check_stops_with_a_tip_when_optree_is_missing_and_no_wheel_was_carried(
        tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, copy / "scripts" / "gpu_check.sh")  # no .whl/ beside it
    env = _stand_in(tmp_path)
    env["NO_OPTREE"] = "1"
    done = subprocess.run(["bash", str(copy / "scripts" / "gpu_check.sh"), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "optree is missing here and no wheel was carried in .whl/" in done.stderr


def test_gpu_checks_optree_floor_is_the_one_pyproject_declares() -> None:
    # Guards against the script admitting an optree the project does not support (helper KN:
    # it checked 0.13, pyproject.toml declares 0.15).
    declared = re.search(r'"optree>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    checked = re.search(r"< \((\d+), (\d+)\)", SCRIPT.read_text())
    assert declared and checked
    assert declared.groups() == checked.groups()
