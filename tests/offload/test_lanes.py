"""Each forward thread's passes (offload/lanes.py): a lane's turn hands back the pass it ends,
which the manager checks for the "offloaded nothing" warning."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.offload.blocks import manager


def test_a_pass_a_turn_ends_is_checked_then_so_a_later_short_batch_is_not_warned_of(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: Lane.turn returning the new pass instead of the one it replaces: the
    # manager checked an empty pass at the turn, and the first pass, kept alive by a retained
    # graph, never told it offloaded something, so a short batch after it was warned of.
    big = torch.randn(64, 16)
    floor = big.untyped_storage().nbytes()
    m = manager(min_bytes=floor)
    h = big.clone().requires_grad_() * 1.0
    with m.window([h]):
        out = (h * h).sum()
    out.backward(retain_graph=True)  # its backward began: the next window opens a new pass
    short = torch.randn(2, 16).requires_grad_() * 1.0
    assert short.untyped_storage().nbytes() < floor
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        with m.window([short]):
            small_out = (short * short).sum()
        small_out.backward()
        del small_out, short
        stats = m.stats()
    assert stats["offloaded_bytes"] == floor
    assert [r for r in caplog.records if r.name == "offload.manager"] == []
    del out
