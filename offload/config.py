"""How an offload manager offloads: ``OffloadConfig``."""

from __future__ import annotations

import dataclasses

from pytree_ckpt.errors import CheckpointConfigError

__all__ = ["OffloadConfig"]

# torchtune's ``OffloadActivations`` options, and what each is here: typed as they are by a
# torchtune user, Python's "unexpected keyword argument" named no replacement (helper DJ).
_TORCHTUNE_OPTIONS = {
    "min_offload_size": "OffloadConfig(min_bytes=...), which counts a whole storage's bytes "
                        "(a small view of a large buffer copies the buffer; default 64 KiB)",
    "use_pin_memory": "OffloadConfig(pin_memory=...); None pins where CUDA is available",
    "use_streams": "no option: copies always run on side streams on CUDA (no-ops on the CPU)",
    "max_fwd_stash_size": "no option: a window's device bytes are let go two windows later at "
                          "most, once the stream that saved them waits on the copy to host "
                          "(docs/offload.md, 'Stream and lifetime rules')",
}


def refuse_torchtune_options(where: str, given: dict[str, object], /) -> None:
    """Refuse torchtune's offload options passed to ``where``, naming each one's counterpart."""
    passed = {name: value for name, value in given.items() if value is not None}
    if not passed:
        return
    raise CheckpointConfigError(
        f"{where} takes no {' or '.join(f'{name}=' for name in passed)} (torchtune's "
        f"OffloadActivations option{'s' if len(passed) > 1 else ''})",
        expected="OffloadManager(OffloadConfig(min_bytes=..., prefetch=..., pin_memory=...), "
                 "device=...)",
        got=", ".join(f"{name}={value!r}" for name, value in passed.items()),
        tip="; ".join(f"{name}: {_TORCHTUNE_OPTIONS[name]}" for name in passed))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How the manager offloads.

    ``min_bytes``: storages smaller than this stay where they are (copies of tiny tensors cost
    more than they save). ``prefetch``: how many windows ahead backward restores (0: restore on
    demand). ``pin_memory``: pinned host buffers; ``None`` pins when CUDA is available.
    ``min_offload_size``, ``use_pin_memory``, ``use_streams``, ``max_fwd_stash_size``:
    torchtune's names, refused with what each is here (never stored).
    """

    min_bytes: int = 1 << 16
    prefetch: int = 1
    pin_memory: bool | None = None
    min_offload_size: dataclasses.InitVar[None] = None
    use_pin_memory: dataclasses.InitVar[None] = None
    use_streams: dataclasses.InitVar[None] = None
    max_fwd_stash_size: dataclasses.InitVar[None] = None

    def __post_init__(self, min_offload_size: None, use_pin_memory: None, use_streams: None,
                      max_fwd_stash_size: None) -> None:
        refuse_torchtune_options("OffloadConfig", {
            "min_offload_size": min_offload_size, "use_pin_memory": use_pin_memory,
            "use_streams": use_streams, "max_fwd_stash_size": max_fwd_stash_size})
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
