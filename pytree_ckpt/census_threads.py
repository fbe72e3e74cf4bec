"""Which census is recording on a thread: where each census's pack hook is installed, and so
where the mechanisms' reports go (NOTE [where a census records]).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # census.py imports this module
    from .census import ActivationCensus

# The census entered last in this context: which one may end now (NOTE [ended as
# entered] in census.py).
_ACTIVE: ContextVar[ActivationCensus | None] = ContextVar("pytree_ckpt_census", default=None)

# NOTE [where a census records]: where its saved-tensor pack hook is installed, and nowhere
# else: the thread that entered it, and the threads autograd runs a backward on that was
# started there while it was open. On CPU autograd runs the nodes on the calling thread; on
# CUDA on its device thread for the GPU (and on CPU too past 60 nested backwards, on a
# thread of its reentrant pool). There each node runs under the thread-local state captured
# when the backward began (engine.cpp: ThreadLocalStateGuard(graph_task->thread_locals_)):
# the saved-tensor hooks come along, the Python context (ContextVar values) and the thread id
# do not. So the mechanisms find the census the way its hook travels: in the thread-local
# Python objects that state also carries (torch._C._stash_obj_in_tls), not through the
# ContextVar nor by thread id, which would drop on a device thread the reports the same
# backward makes on CPU (a nested boundary's input in a replay). A thread of Python's own
# (asyncio.to_thread, a copy_context().run) carries neither: its saves and its reports are
# both left out, as they were. A census entered on one thread is fed by autograd's threads
# at once (two GPUs): NOTE [one lock per census] in census.py. What still differs by thread:
# the module a save is filed under is the innermost one running on the thread that saves (the
# module stack is per thread), so in a backward called from inside a module's forward, what is
# saved outside any replayed module is filed under that module on CPU, outside any module on
# CUDA.
_TLS_KEY = "pytree_ckpt.census"
_stash_obj: Any = getattr(torch._C, "_stash_obj_in_tls", None)
_remove_obj: Any = getattr(torch._C, "_remove_obj_from_tls", None)
# Bound once: census_active() runs at every boundary call and offloaded save.
_is_key: Any = getattr(torch._C, "_is_key_in_tls", None)
_get_obj: Any = getattr(torch._C, "_get_obj_in_tls", None)
_CARRIED = None not in (_stash_obj, _remove_obj, _is_key, _get_obj)


# How many censuses are open, in any thread: with none (every step that measures nothing),
# census_active() is one list read, not a thread-local lookup (about 200 ns, at every boundary
# call and offloaded save). Changed only under _OPEN_LOCK, at a census's entry and end.
_OPEN = [0]
_OPEN_LOCK = threading.Lock()


def _recording() -> ActivationCensus | None:
    """The innermost census recording on this thread (NOTE [where a census records])."""
    if not _OPEN[0]:
        return None
    if _CARRIED:
        return _get_obj(_TLS_KEY) if _is_key(_TLS_KEY) else None
    # A torch without thread-local objects to carry (2.11 has no way to erase one): the thread
    # that entered it only (reports on autograd's device threads are then not counted;
    # docs/census.md), recorded per thread, not per context (read from the ContextVar, two
    # contexts' censuses interleaved on one thread each looked like the one recording, and the
    # first one's end was let through: it popped the other's hooks).
    return getattr(_THREAD_RECORDING, "census", None)


_THREAD_RECORDING = threading.local()  # where _CARRIED is false


def _set_recording(census: ActivationCensus | None) -> None:
    if not _CARRIED:
        _THREAD_RECORDING.census = census
        return
    if census is None:
        _remove_obj(_TLS_KEY)  # erased, not set to None: NOTE [nothing left in a thread]
    else:
        _stash_obj(_TLS_KEY, census)


# NOTE [nothing left in a thread]: a thread that ends with a Python object in its thread-local
# objects frees it in the C++ thread-local destructors, needing the GIL it may no longer get
# (torch erases its own "context" entry after each backward for this). The outermost census to
# end erases the entry; ending it in another thread is refused (NOTE [ended as entered] in
# census.py).
