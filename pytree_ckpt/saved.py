"""A tensor a saved-tensor hook hands back as it is, checked for in-place changes on unpack.

NOTE [hooks switch off the in-place check]: autograd refuses a backward that needs a saved
tensor changed in place since it was saved ("modified by an inplace operation"), but it makes
that check only for tensors saved without hooks. Any ``saved_tensors_hooks``, even an identity
pair, switches it off. Every hook of this project that hands autograd the tensor itself (a
census, offload's tensors it does not copy, the replay's shadowing hooks) packs it in
``Unchanged``, which remembers the version and makes the check on unpack: wrapping a step in a
census or a window never turns an error into wrong gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import SavedTensorChanged
from .notes import add_note

__all__ = ["Unchanged", "note_hooks_disabled", "pop_saved_hooks", "push_saved_hooks",
           "top_saved_hooks"]

_top_hooks: Any = torch._C._autograd._top_saved_tensors_default_hooks
_pop_hooks: Any = torch._C._autograd._pop_saved_tensors_default_hooks
_push_hooks: Any = torch._C._autograd._push_saved_tensors_default_hooks


# NOTE [the body runs without the window's hooks]: a boundary with offload saves its inputs
# through an offload window's saved-tensor hooks, pushed around the whole call: autograd packs
# a custom Function's saved tensors after its forward returns. The original pass runs inside,
# usually under no-grad, saving nothing; but a body that takes a gradient itself (forces as
# -dE/dpos under enable_grad) saved through the window too: its saves of the input's storage
# were copied to host and straight back, a second copy of each input, and its inner backward
# ended the window's pass, so backward prefetched nothing (helper KM); and torch.func.grad in a
# body refuses to run under any saved-tensor hooks, where eager runs it. So the body runs with
# the window's hooks taken off the stack (what is under them, a census's or the caller's own,
# sees its saves, as in eager), and they are put back before the forward returns. Read, then
# popped, each by one call, and pushed back first in the forward's finally (NOTE [a pass
# interrupted at any point] in rng.py: a KeyboardInterrupt right after the pop, or after the
# phase's reset, left the caller's hooks popped or torch's stack asserting: helper KW).
def top_saved_hooks() -> tuple[object, object] | None:
    """The top saved-tensor hooks, None where there are none."""
    # Read as they are while AOT autograd traces, which hides them from the default read (it
    # refuses saved-tensor hooks in the graphs it makes): they are on the stack all the same
    # (helper KR: a bare AssertionError under aot_function).
    return _top_hooks(True)


pop_saved_hooks: Any = _pop_hooks


def push_saved_hooks(hooks: tuple[object, object], /) -> None:
    _push_hooks(*hooks)


def note_hooks_disabled(error: RuntimeError, who: str, tip: str, /) -> None:
    """Say what needed the hooks when entering ``saved_tensors_hooks`` raised ``error`` inside
    ``torch.autograd.graph.disable_saved_tensors_hooks(reason)``, whose message is only
    ``reason``: nothing else in it names the hooks, or this library."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is None or enabled():
        return
    add_note(error, f"pytree_ckpt: {who} needs saved-tensor hooks, which "
             "torch.autograd.graph.disable_saved_tensors_hooks turned off here (its reason is "
             f"the message above). Tip: {tip}")


class Unchanged:
    """``tensor`` (a leaf) or a detached alias of it (sharing its version counter), and its
    version when saved.

    A non-leaf is held by a detached alias, as autograd itself holds a saved output
    (``tensor_data()``): the tensor itself would hold its own grad_fn when it is that node's
    output (tensor -> grad_fn -> saved Unchanged -> tensor), a cycle through C++ that not even
    the garbage collector frees when the graph is dropped without backward. A leaf has no
    grad_fn: it is held itself, as autograd does, so ``param.data = ...`` swaps (ZeRO-3 style)
    reach backward as they do in eager."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, /) -> None:
        self.tensor = tensor if tensor.is_leaf else tensor.detach()
        # Autograd refuses to save an inference tensor before any hook; offload_into holds one
        # (a frozen result made under inference_mode): it has no version to check (None).
        self.version = None if tensor.is_inference() else tensor._version

    @property
    def released(self) -> bool:
        """Never: it holds the tensor for as long as autograd holds it (a census ``Holder``)."""
        return False

    def get(self) -> torch.Tensor:
        """The tensor, or a ``CheckpointError`` if it was changed in place since it was saved."""
        if self.version is not None and self.tensor._version != self.version:
            _raise_changed(self.tensor, self.version)
        return self.tensor


def _raise_changed(tensor: torch.Tensor, saved_version: int, /) -> None:
    raise SavedTensorChanged(
        f"a tensor saved for backward (shape {tuple(tensor.shape)}, {tensor.dtype}) was "
        "modified by an inplace operation after it was saved (autograd's check)",
        saved_version=saved_version, version=tensor._version,
        tip="eager autograd refuses this backward too (saved-tensor hooks switch its own check "
            "off, so it is made here): clone the tensor before changing it, or change it after "
            "backward; torch.autograd.set_detect_anomaly(True) names the op that saved it")
