"""The copies to host still in flight, whose device tensors a manager holds, and when it lets
go of them (NOTE [copies in flight]).

NOTE [saved reference, not the live tensor]: autograd keeps the handle instead of the tensor;
the live tensor is never resized or freed by us, so other holders keep valid data. We keep the
device tensor until its copy completed, or the compute stream waits for it (stream rule 1), and
drop our reference at least one window late; if the storage is still alive when backward
begins (the forward that passed it from layer to layer is over by then), something else holds
it and the bytes are reported as ``alive_elsewhere_bytes`` (and flagged by an active census,
unless autograd also saves it): that offload saved nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lanes import Lane
    from .streams import CopyEngine
    from .window import Copy, Pass, Window

__all__ = ["InFlight"]


class InFlight:
    """One manager's copies whose device tensor it still holds (``Copy.drop_device_copy`` lets
    go of it); a ``Copy`` appends itself when its copy to host starts.

    NOTE [a copy nobody needs is not held]: held weakly. A copy lives while a handle to it does
    (NOTE [lifetimes] in window.py); held strongly here, a forward dropped without backward
    (an evaluation with grad on, a worker thread's forward) left its last windows' device
    tensors and host buffers held until the manager's next window, backward or ``stats()``
    (helper GL). A copy whose handles are gone dies at once: the stream that saved its tensor
    waits for its copy to host (stream rule 1, in ``Copy.__del__``, as for bytes backward
    reused), its device tensor goes, and its host buffer goes back to the pool with its copy's
    event."""

    __slots__ = ("copies",)

    def __init__(self) -> None:
        self.copies: list[weakref.ref[Copy]] = []

    def __bool__(self) -> bool:
        return bool(self.copies)

    def append(self, copy: Copy, /) -> None:
        self.copies.append(weakref.ref(copy))

    def let_go(self, engine: CopyEngine, lane: Lane | None, pass_: Pass | None = None, *,
               everyone: bool = False, force_before: int | None = None,
               keep: Sequence[Window] = ()) -> None:
        """Let go of device tensors whose copy to host completed, and of those from windows
        opened before ``force_before``, once the compute stream waits for their copy
        (``engine``: the manager's copy streams, as it has them now).

        Only copies of ``lane``'s passes (of ``pass_`` where the lane's thread has ended), and
        of passes gone (their graph was dropped), unless ``everyone``: another thread's copies
        are let go by that thread's windows and backward, so that each thread holds and reuses
        what it would alone (NOTE [a pass per forward thread] in lanes.py). ``force_before``
        counts the windows of ``lane``.

        NOTE [copies in flight]: a host running ahead of the device (the usual case with large
        layers) would otherwise find no copy complete and keep every layer input on the device
        until backward: the peak would not drop. So a window's device tensors are released
        two windows (of its thread) later at the latest: the stream that was current when the
        tensor was saved (not the host, and not whatever stream is current now) waits on the
        copy's event; the freed memory belongs to that stream, so the allocator reuses it only
        for kernels ordered after the wait. The copy of window ``k`` overlaps window ``k+1``'s
        compute; window ``k+2`` waits for it. Backward's first restore releases every copy
        still in flight the same way, those of the windows it restores now (``keep``) last:
        it reuses their device bytes (NOTE [reuse at the turn]).
        """
        kept = {id(copy) for window in keep for copy in window.copies.values()}
        still = []
        for ref in self.copies:
            copy = ref()
            if copy is None:
                continue  # nobody needed it: gone with its handles
            if id(copy) in kept or not (everyone or _belongs(copy, lane, pass_)):
                still.append(ref)
            elif copy.reused or engine.done(copy.d2h_event):
                # NOTE [reuse at the turn] (window.py): a reused copy's storage is held by its
                # restore, which backward reads (as the copy to host does): backward need not wait
                # for that copy. Stream rule 1 is applied when backward lets go (Copy.__del__).
                copy.drop_device_copy()
            elif force_before is not None and copy.seq < force_before:
                # Stream rule 1: the stream current at the save, which owns the memory, waits.
                engine.wait(copy.d2h_event, stream=copy.stream)
                copy.drop_device_copy()
            else:
                still.append(ref)
        self.copies = still


def _belongs(copy: Copy, lane: Lane | None, pass_: Pass | None) -> bool:
    """Whether ``let_go(engine, lane, pass_)`` lets go of ``copy``: a copy of one of
    ``lane``'s passes, of ``pass_`` (where the lane is gone), or of a pass gone itself."""
    owner = copy.pass_ref()
    if owner is None or owner is pass_:
        return True
    return lane is not None and owner.lane() is lane
