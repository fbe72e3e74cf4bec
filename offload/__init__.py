"""pytree-ckpt's activation offload (pinned-memory windows over saved storages).

The manager lands with its own issue; importing this package is cheap and touches no device.
"""

__all__: list[str] = []
