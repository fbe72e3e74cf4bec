"""The launcher the distributed tests rely on cannot hang CI or leave processes behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .launch import environment, free_port, run_ranks

pytestmark = pytest.mark.distributed

SLEEPER = ("import os, pathlib, sys, time; "
           "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid())); "
           "sys.exit(3) if os.environ['RANK'] == sys.argv[2] else time.sleep(120)")


def _alive(pid_file: Path) -> bool:
    if not pid_file.exists():  # killed before it got that far
        return False
    pid = int(pid_file.read_text())
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_ranks_that_outlive_the_timeout_are_killed_with_their_process_groups(
        tmp_path: Path) -> None:
    start = time.monotonic()
    run = run_ranks(["-c", SLEEPER, str(tmp_path), "none"], 2, timeout=3.0, log_dir=tmp_path)
    assert run.timed_out and not run.ok
    assert all(code is not None and code != 0 for code in run.returncodes)
    # Not a speed claim: the ranks sleep 120 s, so returning in well under that shows the
    # launcher did not wait for them (15 s leaves a loaded CI machine 5x the 3 s timeout).
    assert time.monotonic() - start < 15
    assert not any(_alive(tmp_path / str(rank)) for rank in range(2))


def test_a_failing_rank_takes_down_the_ranks_that_would_wait_for_it(tmp_path: Path) -> None:
    run = run_ranks(["-c", SLEEPER, str(tmp_path), "0"], 2, timeout=60.0, log_dir=tmp_path)
    assert not run.timed_out and run.returncodes[0] == 3 and run.returncodes[1] != 0
    assert not _alive(tmp_path / "1")


def test_ranks_meet_on_loopback_only() -> None:
    env = environment(free_port())
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(env)  # each launch sets its own
