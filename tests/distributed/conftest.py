"""Scale-out tests: FSDP2, DDP and torch.compile with the boundary, replay frames and offload.

They run by default. Deselect the ones that launch processes with ``-m "not distributed"``, the
ones that run dynamo with ``-m "not compile"``.

The two-rank worker (``worker.py``) runs once per session for all the tests that read it; each
rank trains on its own batch (``seed=rank``), and the expected values come from single-process
eager runs computed here, in the test process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from .common import SCENARIOS, WORLD, Reference, WorkerRun
from .launch import run_ranks

WORKER_TIMEOUT_S = 240.0  # ~20 s on an idle 2-core machine; generous for a loaded CI box


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: launches 2 CPU ranks (gloo, loopback); "
                   "deselect with -m 'not distributed'")
    config.addinivalue_line(
        "markers", "compile: runs torch.compile (dynamo); deselect with -m 'not compile'")


@pytest.fixture(scope="session")
def worker_run(tmp_path_factory: pytest.TempPathFactory) -> WorkerRun:
    out = tmp_path_factory.mktemp("scale_out")
    run = run_ranks([str(Path(__file__).with_name("worker.py")), str(out), *SCENARIOS], WORLD,
                    timeout=WORKER_TIMEOUT_S, log_dir=out)
    if not run.ok:
        why = "timed out" if run.timed_out else f"exited with {run.returncodes}"
        pytest.fail(f"the {WORLD}-rank worker {why}:\n{run.output()}")
    return WorkerRun(out)


@pytest.fixture(scope="session")
def reference() -> Iterator[Reference]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add synchronisation
    try:
        yield Reference()
    finally:
        torch.set_num_threads(threads)
