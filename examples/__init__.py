"""Examples for pytree-ckpt, importable from the repository root (``examples.glm_dsa``)."""
