"""pytree-ckpt's activation offload: storage windows copied once to pooled host memory.

Importing this package touches no device. See docs/offload.md.
"""

from .manager import OffloadConfig, OffloadManager, Window, default_manager, env_flag
from .pool import HostPool, size_class

__all__ = ["HostPool", "OffloadConfig", "OffloadManager", "Window", "default_manager", "env_flag",
           "size_class"]
