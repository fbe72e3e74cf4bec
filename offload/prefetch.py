"""Backward's restores: a window brought back, and the windows restored ahead of need (NOTE
[passes, window ids and prefetch] in manager.py), given up when the device runs out of memory.
"""

from __future__ import annotations

import logging

import torch

from .window import Window

__all__ = ["Prefetch", "restore_window"]

log = logging.getLogger(__name__)


def restore_window(window: Window, /, *, kind: str) -> None:
    """Bring every copy of ``window`` back to the device; ``kind``: ``"restore"`` (backward
    needs it now) or ``"prefetch"`` (ahead of need), as ``events()`` lists it."""
    for copy in list(window.copies.values()):
        copy.restore()
    # Only now: a restore that failed (out of memory) is retried at the next unpack.
    window.restored = True
    window.pass_.events.append((kind, window.id))
    if kind == "prefetch":
        window.pass_.prefetched.add(window.id)


class Prefetch:
    """One manager's prefetch: which windows backward restores ahead, and giving up."""

    __slots__ = ("depth", "device", "counters", "warned")

    def __init__(self, depth: int, device: torch.device, counters: dict[str, int], /) -> None:
        self.depth = depth          # OffloadConfig.prefetch
        self.device = device
        self.counters = counters    # the manager's, reset in place
        self.warned = False         # of a prefetch given up, once per manager

    def targets(self, window: Window, /) -> list[Window]:
        """The windows before ``window`` to restore now, nearest first (backward needs it
        first): up to ``prefetch`` windows back that have something to restore, those of its
        pass alive and not restored yet.

        NOTE [empty windows take no prefetch slot]: a window that copied nothing (every storage
        below ``min_bytes``, on another device, or a parameter) stays alive with its graph
        (autograd keeps the hooks) but no handle of its ever unpacks, so no prefetch hit on it
        would move the prefetch on. Counted as a slot, it would end the chain: the window
        before it would be restored on demand, an exposed copy. It is passed over instead.
        """
        if window.pass_.prefetch_off:  # NOTE [a prefetch that runs out of memory]
            return []
        windows = window.pass_.windows
        targets = []
        budget = self.depth
        earlier_id = window.id - 1
        while budget > 0 and earlier_id >= 0:
            earlier = windows.get(earlier_id)
            earlier_id -= 1
            if earlier is None or not earlier.copies:
                continue
            budget -= 1
            if not earlier.restored:
                targets.append(earlier)
        return targets

    def run(self, ahead: list[Window], /) -> None:
        """Restore ``ahead`` (nearest first), giving up at the first that runs out of memory.

        NOTE [a prefetch that runs out of memory]: a prefetch takes device memory for windows
        backward needs only later; on a device near its limit that allocation can fail where
        restoring on demand (``prefetch=0``) fits. So ``torch.OutOfMemoryError`` from a
        prefetch is not raised: what that window's prefetch restored so far is let go
        (``Copy.give_up_restore``; reused bytes stay, they took nothing new), the window stays
        unrestored (its first unpack restores it on demand, from host, bit for bit), the
        targets after it are skipped, and the give-up is counted (``prefetch_oom``), logged
        once per manager and listed in ``events()``. A restore on demand that runs out of
        memory still raises: backward needs that window now.
        The rest of that pass restores on demand (``Pass.prefetch_off``), not prefetching
        again at the next window: on CUDA a failed allocation first makes the caching
        allocator free its whole cache (synchronizing the device) and retry, so each prefetch
        that fails again would cost a stall and fresh cudaMallocs, more than the overlap a
        prefetch buys; and what filled the device (the backward's own working memory and the
        gradients it accumulates) mostly stays until that backward ends. The next pass (the
        next step, a later micro-batch's backward) prefetches again.
        On CUDA (stream rule 5 in streams.py): the allocation that failed is the first thing
        a restore does (``CopyEngine.allocate``), so it queued no copy and recorded no event.
        Each buffer let go had its copy back queued on the restore stream and marked there
        with ``record_stream``: the allocator hands that memory out again only once the copy
        is done, and nothing waits on its event (the compute stream waits on a copy's event
        only at an unpack, after the restore that replaces it). Its event stays on the copy
        as the host buffer's last use, until a later copy back on the same stream replaces it.
        """
        for earlier in ahead:
            fresh = [c for c in earlier.copies.values() if c.restored is None]
            try:
                restore_window(earlier, kind="prefetch")
            except torch.OutOfMemoryError as error:
                for copy in fresh:
                    copy.give_up_restore()
                self._give_up(earlier, error)
                return

    def _give_up(self, window: Window, error: torch.OutOfMemoryError, /) -> None:
        pass_ = window.pass_
        pass_.prefetch_off = True
        pass_.events.append(("prefetch_oom", window.id))
        self.counters["prefetch_oom"] += 1
        log.debug("prefetch of window %d given up: %s", window.id, error)
        if not self.warned:
            self.warned = True
            log.warning(
                "offload: prefetching window %d ran out of device memory on %s; the step goes "
                "on, that window and the rest of its pass are restored on demand (an exposed "
                "copy each): lower OffloadConfig(prefetch=%d), or set prefetch=0 to always "
                "restore on demand (stats()['prefetch_oom'] counts these)", window.id,
                self.device, self.depth)
