"""Reading a census: the bytes still held, grouped, flagged, as plain data or as a table.

``CensusReading`` is the reading half of ``ActivationCensus`` (census.py), which records.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any, TypedDict

from torch import nn

from .census_records import _Entry
from .errors import CheckpointConfigError
from .subclass import plain_parts

__all__ = ["CensusReading", "FlaggedStorage"]


class FlaggedStorage(TypedDict):
    """A row of ``ActivationCensus.flagged()``: typed, so that ``row["bytes"]`` reads as an int
    to a type checker (helper RL: the rows were ``dict[str, Any]``)."""

    module: str
    mechanism: str
    bytes: int
    device: str


class CensusReading:
    """What a census reports, from its records (``_recorded``) and the model it leaves out."""

    _entries: dict[tuple[Any, ...], _Entry]
    _lock: threading.RLock
    _model: nn.Module | None
    _model_ref: weakref.ref[nn.Module] | None

    def _recorded(self) -> list[_Entry]:
        with self._lock:  # NOTE [one lock per census] in census.py
            return list(self._entries.values())

    @property
    def discarded_bytes(self) -> int:
        """Bytes whose storage output discard freed (held for backward, but not resident)."""
        return sum(e.nbytes for e in self._recorded() if e.held() and e.discarded)

    def _model_storages(self) -> set[int]:
        """The storages the model's parameters and buffers are on now, by storage object.

        NOTE [parameters are left out when read]: not by the addresses they had when the
        census was entered: a buffer rebuilt during the census (a mask, a rotary cache) is a
        new storage that is left out too, and the old one's freed address, handed to the next
        activation by the allocator, does not leave that activation out."""
        model = self._model if self._model_ref is None else self._model_ref()
        if model is None:
            return set()
        found = set()
        for tensor in (*model.parameters(), *model.buffers()):
            for plain in plain_parts(tensor):  # a DTensor parameter: its local shard's
                try:
                    found.add(plain.untyped_storage()._cdata)
                except RuntimeError:  # a subclass without a storage of its own
                    pass
        return found

    def _alive(self) -> list[_Entry]:
        # Held and still there: a holder may outlive the storage it reported (a boundary's
        # frame holds its inputs, but offload swapped the saved reference and the device copy
        # was freed; a later window shared the storage one earlier window copied).
        model = self._model_storages()
        return [e for e in self._recorded()
                if e.held() and not e.discarded and not e.storage.expired()
                and e.storage.cdata not in model]

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct activation storages still held."""
        return sum(e.nbytes for e in self._alive())

    def bytes_by(self, what: str, /) -> dict[str, int]:
        """Bytes grouped by ``"device"``, ``"module"`` or ``"mechanism"``."""
        if what not in ("device", "module", "mechanism"):
            raise CheckpointConfigError(
                f"bytes_by cannot group by {what!r}", expected="'device', 'module' or "
                "'mechanism'", got=repr(what), tip="e.g. census.bytes_by('mechanism')")
        grouped: dict[str, int] = defaultdict(int)
        for entry in self._alive():
            key = entry.filed_under() if what == "mechanism" else getattr(entry, what)
            grouped[str(key)] += entry.nbytes
        return dict(grouped)

    def flagged(self) -> list[FlaggedStorage]:
        """Storages a mechanism released that something else still keeps alive."""
        return [FlaggedStorage(module=e.module, mechanism=str(e.filed_under()), bytes=e.nbytes,
                               device=e.device)
                for e in self._recorded() if e.flagged()]

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain data: totals, bytes by device and by mechanism, one row per
        (module, mechanism, device), and the flagged storages (for a JSON report). Rows are
        sorted by those three as strings (``layers.10`` before ``layers.2``), so two runs of
        one model give the same order whatever order their storages were saved in."""
        rows: dict[tuple[str, str, str], int] = defaultdict(int)
        for e in self._alive():
            rows[(e.module, str(e.filed_under()), e.device)] += e.nbytes
        return {
            "total_bytes": self.total_bytes,
            "by_device": self.bytes_by("device"),
            "by_mechanism": self.bytes_by("mechanism"),
            "rows": [{"module": m, "mechanism": k, "device": d, "bytes": b}
                     for (m, k, d), b in sorted(rows.items())],
            "flagged": self.flagged(),
            "discarded_bytes": self.discarded_bytes,
        }

    def report(self) -> str:
        """A readable table: one row per module, mechanism and device."""
        data = self.to_dict()
        # Module paths whole, however long: cut short, a layer's experts.0.gate_proj,
        # .up_proj and .down_proj read as three rows of one module.
        width = max([32, *(len(r["module"]) for r in data["rows"])])
        rule = "-" * (width + 45)
        lines = [f"{'module':<{width}} {'mechanism':<20} {'device':<8} {'bytes':>14}", rule]
        lines += [f"{r['module']:<{width}} {r['mechanism']:<20} {r['device']:<8} "
                  f"{r['bytes']:>14,}" for r in data["rows"]]
        if not data["rows"]:
            lines.append("(nothing held: no saved activation is alive)")
        lines.append(rule)
        for device, nbytes in sorted(data["by_device"].items()):
            lines.append(f"{'total':<{width}} {'':<20} {device:<8} {nbytes:>14,}")
        for flag in data["flagged"]:
            lines.append(f"FLAGGED: {flag['bytes']:,} bytes released by {flag['mechanism']} in "
                         f"{flag['module']} are still alive (something else references them)")
        return "\n".join(lines)
