"""How an offload manager offloads: ``OffloadConfig``."""

from __future__ import annotations

import dataclasses

from pytree_ckpt.errors import CheckpointConfigError

__all__ = ["OffloadConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How the manager offloads.

    ``min_bytes``: storages smaller than this stay where they are (copies of tiny tensors cost
    more than they save). ``prefetch``: how many windows ahead backward restores (0: restore on
    demand). ``pin_memory``: pinned host buffers; ``None`` pins when CUDA is available.
    """

    min_bytes: int = 1 << 16
    prefetch: int = 1
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        for name in ("min_bytes", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointConfigError(
                    f"OffloadConfig.{name} must be an int >= 0", expected="an int >= 0",
                    got=repr(value), tip="min_bytes=0 offloads every window storage; "
                                         "prefetch=0 restores on demand")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise CheckpointConfigError(
                "OffloadConfig.pin_memory must be None or a bool", expected="None | bool",
                got=repr(self.pin_memory), tip="None pins host buffers when CUDA is available")
