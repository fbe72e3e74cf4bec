"""The loop a rank runs over named cases (state_cases.py, pipeline_cases.py, tp_cases.py,
ep_cases.py, mesh2d_cases.py): one gloo group, each case's result (or its traceback) saved as
``out/<name>.rank<rank>.pt`` for the test to read, a barrier between cases."""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def run_cases(out: Path, names: list[str], case: Callable[[str, int], dict[str, Any]]
              ) -> NoReturn:
    """Run ``case(name, rank)`` for each name, saving ``{"ok": True, **result}`` or
    ``{"ok": False, "error": traceback}``; then leave the process."""
    torch.set_num_threads(1)  # tiny tensors, and one summation order
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for name in names:
        try:
            result: dict[str, Any] = {"ok": True, **case(name, rank)}
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
        torch.save(result, out / f"{name}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()
    # As fsdp_cases.py: no gloo worker thread's destructor at interpreter exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
