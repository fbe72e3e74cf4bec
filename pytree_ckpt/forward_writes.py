"""Which buffers an original pass changed, and at which version (NOTE [state read, then changed
by a later call] in state_changes.py): written at every call of a layer whose forward changes
its state, read only by a replay whose forward left state unchanged that has moved since.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["note_forward_write", "written_by_a_forward_since", "written_since"]

# NOTE [forward writes, by id]: each buffer an original pass changed (in place, reassigned or
# registered), with its version then, by id. Written for every changed buffer at every call of
# a layer whose forward changes state (a BatchNorm in training: three buffers a call), so the
# write must be cheap: a plain dict of plain weak references (CPython hands out one cached
# reference per tensor when no callback is asked for) costs about 0.5 us a buffer, where
# torch's WeakIdKeyDictionary cost 3.2 us (a new reference and its callback at every write;
# ~47 us a call for a Linear before four BatchNorms). An id a dead tensor left and another
# took is told apart by the reference. Entries of dead tensors are dropped in amortised sweeps
# (at twice the size after the last sweep): the table holds at most about twice the buffers
# alive that a forward changed. A cache of facts about live tensors, not step state: a version
# a forward wrote stays true across steps.
_WRITES: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
_SWEEP_AT = 1024
_sweep_at = _SWEEP_AT


def note_forward_write(t: torch.Tensor, /) -> None:
    """Record that an original pass left ``t`` (a buffer) at its current version."""
    global _sweep_at
    _WRITES[id(t)] = (weakref.ref(t), t._version)
    if len(_WRITES) >= _sweep_at:
        # list(): one C-level copy, so another thread writing meanwhile cannot break the walk.
        for key, (ref, _) in list(_WRITES.items()):
            if ref() is None:
                _WRITES.pop(key, None)
        _sweep_at = max(_SWEEP_AT, 2 * len(_WRITES))


def _forward_version(t: torch.Tensor, /) -> int | None:
    entry = _WRITES.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def written_by_a_forward_since(items: tuple[tuple[str, torch.Tensor | None], ...],
                               before: list[int | None], /) -> bool:
    """Whether an original pass changed one of ``items`` (a buffer dict's entries, read at
    versions ``before``) in place since they were read.

    Only in place: the replay finds the dict with the very entries its forward left (NOTE [the
    replay sees the forward's modules] in forward_modules.py puts back one a later forward
    reassigned or added to, before the replay's state copies are made), so an entry is never
    another object, nor a new name, by then."""
    for (_, t), version in zip(items, before):
        if t is not None and version is not None:
            written = _forward_version(t)
            if written is not None and written > version:
                return True
    return False


def written_since(items: tuple[tuple[str, torch.Tensor | None], ...], before: list[int | None],
                  /) -> list[str]:
    """The names among ``items`` that an original pass changed in place since they were read
    at versions ``before``: not those only a replay moved since (a count kept where grad is
    enabled, which the replay of a later call of the same step moved first: helper FD)."""
    found = []
    for (name, t), version in zip(items, before):
        if t is not None and version is not None:
            written = _forward_version(t)
            if written is not None and written > version:
                found.append(name)
    return found
