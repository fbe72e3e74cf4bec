"""Backward's side of the manager: the tensor behind a handle, and what the first unpack from a
window sets off: restoring it, restoring ahead the windows backward needs next (NOTE [passes,
window ids and prefetch] in manager.py), letting go of what forward left on the device, and
judging the storages let go while alive (liveness.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from .prefetch import restore_window
from .window import Handle

if TYPE_CHECKING:  # the manager imports this module
    from .manager import OffloadManager

__all__ = ["unpack_handle"]


def unpack_handle(manager: OffloadManager, packed: Handle, /) -> torch.Tensor:
    """The tensor behind ``packed``; called under the manager's lock (NOTE [one thread at a
    time] in manager.py)."""
    packed.check_unmodified()
    copy = packed.copy
    window = packed.window  # not copy.window: a shared copy may come from an earlier one
    pass_ = window.pass_
    # The first unpack from a window restores it, or records that a prefetch did; either
    # way backward has moved on to it, so the windows before it are prefetched.
    restore_now = not window.restored
    moved_on = restore_now or window.id in pass_.prefetched
    # The forward's thread, not this one (NOTE [a pass per forward thread] in lanes.py);
    # None once that thread ended.
    lane = pass_.lane()
    if restore_now:
        if not pass_.backward:
            # Its backward begins: events() reads this pass now, until another's begins (not
            # at each restore: with prefetch=0, the outer backward's restores took it back
            # from a backward run inside one of its hooks; helper MF).
            pass_.backward = True
            if lane is not None:
                lane.recent = pass_
    elif moved_on:
        pass_.prefetched.discard(window.id)
        pass_.events.append(("prefetch_hit", window.id))
        manager._counters["prefetch_hits"] += 1
    ahead = manager._prefetch.targets(window) if moved_on else []
    # Backward began: nothing from forward stays on the device, but what is restored now
    # reuses the device bytes still held for it (NOTE [reuse at the turn]). The rest is
    # let go first, before any restore allocates; the reused ones once restored.
    if manager._pending:
        manager._pending.let_go(manager.engine, lane, pass_, force_before=sys.maxsize,
                                keep=[window, *ahead] if restore_now else ahead)
    if restore_now:
        restore_window(window, kind="restore")
    manager._prefetch.run(ahead)
    if manager._pending:
        manager._pending.let_go(manager.engine, lane, pass_, force_before=sys.maxsize)
    if manager._liveness and restore_now:  # NOTE [verdicts are taken at three points]
        manager._liveness.judge_all()
    copy.restore()  # no-op unless the window no longer lists it (replaced after a change)
    manager.engine.wait(copy.h2d_event)
    assert copy.restored is not None
    if copy.restored_version is None:  # NOTE [a change in backward through a restored alias]
        copy.restored_version = copy.restored._version  # (window.py): the bytes landed
    manager.engine.use_here(copy.restored, allocated_on=copy.restored_on)
    return packed.rebuild(copy.restored)
