"""pytree-ckpt's activation offload: storage windows copied once to pooled host memory.

Importing this package touches no device. See docs/offload.md.
"""

from .config import OffloadConfig
from .defaults import default_manager, env_flag
from .manager import OffloadManager
from .pool import HostPool, size_class
from .window import OffloadHandle, Window

__all__ = ["HostPool", "OffloadConfig", "OffloadHandle", "OffloadManager", "Window",
           "default_manager", "env_flag", "size_class"]
