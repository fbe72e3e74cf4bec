"""Notes on errors raised by others (torch, dynamo, the user's forward) inside a boundary: what
the boundary was doing and a tip, added without changing the error's type or message."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .tree import dunder

__all__ = ["add_note", "converted_since", "note_no_grad_pass"]

_LOG = logging.getLogger(__name__)

# NOTE [notes on Python 3.10]: ``BaseException.add_note`` is Python 3.11+ (PEP 678). On 3.10
# the note is appended to ``__notes__`` as PEP 678 defines it (pytest and the exceptiongroup
# backport's tracebacks show it; the boundary's own checks for an inner boundary's note read
# it), and logged as a warning, because 3.10's own traceback printing ignores ``__notes__``: the
# tip would otherwise reach no one.
_NATIVE = hasattr(BaseException, "add_note")


def add_note(error: BaseException, note: str, /) -> None:
    """Add ``note`` to ``error``, shown under its traceback (logged as well on Python 3.10)."""
    if _NATIVE:
        error.add_note(note)
        return
    notes = dunder(error, "__notes__")
    if not isinstance(notes, list):
        notes = []
        error.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)
    # A string, not the error, in the record: a handler that keeps records (pytest's, a
    # memory handler) would keep the error's traceback, and with it the step's tensors.
    _LOG.warning("%s", f"{type(error).__name__}: {error}\n{note}")


# What a grad_fn's hook methods raise on None (a forward's intermediate under no-grad); not a
# module's register_forward_hook on None, which eager raises alike (helper FV).
_NODE_HOOKS = frozenset(f"'NoneType' object has no attribute '{method}'"
                        for method in ("register_hook", "register_prehook"))


def note_no_grad_pass(error: BaseException, where: str, /) -> None:
    """A note on an error a forward that assumes grad mode meets in an original pass, which
    runs under no-grad (``where`` names it): a hook registered on a tensor, ``retain_grad``,
    or gradients taken inside the forward (a physics-informed network's du/dx, forces =
    -dE/dpos: torch's "does not require grad and does not have a grad_fn", or "One of the
    differentiated Tensors does not require grad": helper PW). Other errors pass unnoted."""
    text = str(error) if isinstance(error, (RuntimeError, AttributeError, AssertionError)) \
        else ""
    # A hook on a grad_fn (None under no-grad) or a multi-grad hook: helper FU.
    node_hook = (isinstance(error, AttributeError) and text in _NODE_HOOKS) or \
        (isinstance(error, AssertionError) and "Expected gradient function to be set" in text)
    if "register a hook" in text or "retain_grad" in text or node_hook:
        add_note(error,
            f"pytree_ckpt: raised in {where}, which runs the forward under torch.no_grad() "
            "(the replay in backward runs it with grad). Tip: guard what needs grad, e.g. `if "
            "h.requires_grad: h.register_hook(...)` (or `h.retain_grad()`, "
            "`h.grad_fn.register_prehook(...)`, `register_multi_grad_hook((h,), ...)`): it "
            "then runs in the replay, whose gradients are the ones used.")
    elif "does not require grad and does not have a grad_fn" in text or \
            "differentiated Tensors does not require grad" in text:  # torch.autograd.grad's
        add_note(error,
            f"pytree_ckpt: raised in {where}, which runs the forward under torch.no_grad() "
            "(the replay in backward runs it with grad). Tip: a forward that takes gradients "
            "itself (torch.autograd.grad inside it) needs grad mode there in every pass: wrap "
            "that part in `with torch.enable_grad():`, from the computation of what it "
            "differentiates to the gradient call (a tensor computed before the block has no "
            "graph in this pass); both passes then build its graph, and the results are "
            "eager's.")


def converted_since(fn: Any, args: tuple[Any, ...], /) -> str | None:
    """Where a replay's error follows a model converted between a call's forward and its
    backward (``model.double()``, ``model.to(device)``: helper GA): the float parameters of
    ``fn``'s module share no dtype, or no device, with the call's float tensor arguments; what
    each side has, or ``None``. A mixed-precision layer whose parameters and inputs always
    differ meets this too, so the note says it as a possibility."""
    module = fn if isinstance(fn, torch.nn.Module) else dunder(fn, "__self__")
    if not isinstance(module, torch.nn.Module):
        return None
    params = [p for p in module.parameters() if p.is_floating_point()]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not params or not inputs:
        return None
    for what in ("dtype", "device"):
        have = {str(getattr(p, what)) for p in params}
        given = {str(getattr(a, what)) for a in inputs}
        if not have & given:
            return (f"its parameters are {', '.join(sorted(have))} and the inputs its forward "
                    f"was given {', '.join(sorted(given))}")
    return None
