"""One manager shared by threads: each forward and backward of its own, with the manager's state
(passes, copies in flight, restores, counters) changed by one thread at a time."""

from __future__ import annotations

import threading
from typing import Any

import torch

from tests.offload.blocks import manager


def test_two_threads_restoring_one_copy_copy_it_back_once() -> None:
    # Two threads whose backwards share a manager reach one copy together (one restores the
    # window, the other prefetches it as a window of its own pass). Both saw "not restored
    # yet": two copies back, restored_bytes above offloaded_bytes, and on CUDA the second
    # could read the first's buffer before its copy event was even set.
    m = manager()
    x = torch.randn(64, 32)
    with m.window([x]) as window:
        pass
    handle = m.offload_into(window, x)
    m.stats()  # lets go of the device bytes: the restore copies back from host
    to_device = m.engine.to_device
    calls: list[str] = []
    first_inside, second_inside = threading.Event(), threading.Event()

    def slow_to_device(*args: Any) -> Any:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            first_inside.set()
            second_inside.wait(0.5)  # the other thread gets its chance to restore too
        else:
            second_inside.set()
        return to_device(*args)

    m.engine.to_device = slow_to_device  # type: ignore[method-assign]
    restored: dict[str, torch.Tensor] = {}

    def restore(name: str) -> None:
        restored[name] = m.restore(handle)

    first = threading.Thread(target=restore, args=("first",), name="first")
    first.start()
    assert first_inside.wait(5)
    second = threading.Thread(target=restore, args=("second",), name="second")
    second.start()
    first.join(5)
    second.join(5)
    assert calls == ["first"]
    assert torch.equal(restored["first"], x) and torch.equal(restored["second"], x)
    stats = m.stats()
    assert stats["restored_bytes"] == stats["offloaded_bytes"] == x.untyped_storage().nbytes()
