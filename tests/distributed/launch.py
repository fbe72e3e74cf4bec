"""Launching the ranks of a distributed test: loopback only, a free port, bounded in time.

NOTE [no hangs, no orphans]: every rank (and torchrun) starts in a session of its own, so it
and whatever it starts can be signalled as a group. When a run outlives its timeout, or one
rank fails while the others may be waiting for it in a collective, every process of the run is
terminated (SIGTERM, then SIGKILL after a grace period): the ones this module started, by
their process group, and their descendants (torchrun starts its workers in sessions of their
own), found through /proc before anything is signalled. Gloo binds to the loopback interface
only (``GLOO_SOCKET_IFNAME=lo``, ``MASTER_ADDR=127.0.0.1``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5.0


@dataclasses.dataclass
class Run:
    """What a launch left behind: one log per process, return codes, whether it timed out."""

    returncodes: list[int | None]
    logs: list[Path]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def output(self) -> str:
        return "\n".join(f"----- {log.name} -----\n{log.read_text(errors='replace')[-6000:]}"
                         for log in self.logs)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XTUNER_ACTIVATION_OFFLOAD"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    return env


def _descendants(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # the session we started with this leader
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return
    pids = [p.pid for p in alive] + _descendants([p.pid for p in alive])
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in alive:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal(pids, signal.SIGKILL)
    for proc in alive:
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass


def _supervise(procs: list[subprocess.Popen[bytes]],
              timeout: float) -> tuple[list[int | None], bool]:
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes):
                break
            if any(code not in (None, 0) for code in codes):
                # One process failed: the others may wait for it forever in a collective.
                time.sleep(1.0)
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        _terminate(procs)
    return [p.poll() for p in procs], timed_out


# free_port() lets the port go before the ranks bind it: another process may take it between.
_PORT_TAKEN = ("address already in use", "eaddrinuse", "failed to listen")


def _retry_if_port_taken(launch: Callable[[], Run]) -> Run:
    """Run ``launch`` again, once, on a new port, if the first run lost its port to a race."""
    run = launch()
    if not run.ok and not run.timed_out and any(
            marker in run.output().lower() for marker in _PORT_TAKEN):
        run = launch()
    return run


def run_ranks(argv: list[str], nproc: int, *, timeout: float, log_dir: Path) -> Run:
    """Run ``python *argv`` as ``nproc`` ranks, set up as torchrun would (without the agent)."""
    return _retry_if_port_taken(lambda: _run_ranks(argv, nproc, timeout, log_dir))


def rank_results(script: str, cases: list[str], nproc: int, out: Path, *,
                 timeout: float = 120.0) -> dict[str, list[Any]]:
    """Run a rank script built on ``rank_cases.run_cases`` over ``cases`` as ``nproc`` ranks
    and read back each case's results, one per rank; a rank that failed, or a case that raised
    on a rank (its traceback shown), fails the caller."""
    import torch  # the ranks' results are torch.save'd; the launcher itself needs no torch

    run = run_ranks([script, str(out), *cases], nproc, timeout=timeout, log_dir=out)
    assert run.ok, run.output()
    results = {name: [torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)
                      for rank in range(nproc)] for name in cases}
    for name, per_rank in results.items():
        for rank, result in enumerate(per_rank):
            assert result["ok"], f"{name} rank {rank}:\n{result['error']}"
    return results


def _run_ranks(argv: list[str], nproc: int, timeout: float, log_dir: Path) -> Run:
    port = free_port()
    procs, logs = [], []
    try:
        for rank in range(nproc):
            env = environment(port)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc))
            logs.append(log_dir / f"rank{rank}.log")
            with logs[-1].open("wb") as log:
                procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
    except BaseException:
        _terminate(procs)
        raise
    codes, timed_out = _supervise(procs, timeout)
    return Run(codes, logs, timed_out)


def run_torchrun(args: list[str], nproc: int, *, timeout: float, log_dir: Path) -> Run:
    """``python -m torch.distributed.run --nproc-per-node nproc *args`` on a free loopback port."""
    return _retry_if_port_taken(lambda: _run_torchrun(args, nproc, timeout, log_dir))


def _run_torchrun(args: list[str], nproc: int, timeout: float, log_dir: Path) -> Run:
    port = free_port()
    log_path = log_dir / "torchrun.log"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=environment(port), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    codes, timed_out = _supervise([proc], timeout)
    return Run(codes, [log_path], timed_out)
