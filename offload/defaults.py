"""What ``offload=True`` and ``XTUNER_ACTIVATION_OFFLOAD=1`` mean: the environment flag, and the
process's default managers, one per device.

The managers are made on first use (``default_manager()``): importing this touches no device.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

from pytree_ckpt.errors import CheckpointConfigError
from pytree_ckpt.tree import describe_leaf

if TYPE_CHECKING:  # default_manager() builds one; manager.py imports this module
    from .manager import OffloadManager

__all__ = ["default_manager", "env_flag", "is_default_manager"]

_default_managers: dict[str, OffloadManager] = {}
_default_lock = threading.Lock()


def is_default_manager(manager: OffloadManager, /) -> bool:
    """Whether ``manager`` is a default one (``offload=True``); creates none."""
    with _default_lock:
        return any(m is manager for m in _default_managers.values())


def is_default_for(manager: OffloadManager, device: str, /) -> bool:
    """Whether ``manager`` is the default manager of ``device`` (pickling: see
    ``OffloadManager.__reduce__``); creates none."""
    return _default_managers.get(device) is manager


def default_manager() -> OffloadManager:
    """The process's manager for ``offload=True`` / XTUNER_ACTIVATION_OFFLOAD=1, one per device.

    The device is the current CUDA device when this is called (when checkpointing is
    applied): call ``torch.cuda.set_device(local_rank)`` first. Windows and copies live on the
    autograd graph; across steps it keeps its host pool (the point of a pool) and counters.
    """
    from .manager import OffloadManager  # not at import: manager.py imports this module

    device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    with _default_lock:
        manager = _default_managers.get(device)
        if manager is None:
            manager = _default_managers[device] = OffloadManager(device=device)
    return manager


def env_flag(name: str, /) -> bool:
    """Parse an on/off environment variable: ``1``/``true`` on, ``0``/``false``/unset off."""
    if not isinstance(name, str) or not name:
        # os.environ's own TypeError ("str expected, not NoneType") names no fix.
        raise CheckpointConfigError(
            "env_flag takes the name of an environment variable", expected="a non-empty str",
            got=describe_leaf(name), tip="env_flag('XTUNER_ACTIVATION_OFFLOAD')")
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "0", "false"):
        return False
    if raw.strip().lower() in ("1", "true"):
        return True
    raise CheckpointConfigError(
        f"{name}={raw!r} is not understood; accepted values: 1, true (on), 0, false or unset "
        "(off)", expected="1 | true | 0 | false | unset", got=repr(raw),
        tip=f"unset {name}, or set it to 1 or 0")
