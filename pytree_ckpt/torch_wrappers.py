"""torch.distributed's ``CheckpointWrapper`` met beside a boundary: a layer still inside it,
or holding one (a migration half done), found where layers are wrapped (``apply.py``) and at a
module's first calls through ``checkpoint(model, x)`` (``boundary.py``)."""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .eager import user_stacklevel
from .errors import CheckpointConfigError
from .tree import dunder

__all__ = ["PENDING", "check_at_first_call", "other_method_of", "refuse_reentrant_torch_wrappers",
           "warn_inside_torch_wrapper"]

# Set on a module once a wrapper it holds was told (or looked for where layers are wrapped).
_TOLD = "_pytree_ckpt_torch_wrapper_told"
# Set on a model while only calls of its other methods ran (check_at_first_call).
PENDING = "_pytree_ckpt_torch_wrapper_pending"


def _torch_wrapper(module: nn.Module, /) -> bool:
    # Known by its class's name and package: an isinstance test would import torch.distributed
    # for every user.
    return any(klass.__name__ == "CheckpointWrapper" and
               klass.__module__.startswith("torch.distributed.") for klass in type(module).__mro__)


def refuse_reentrant_torch_wrappers(chosen: Sequence[tuple[str, nn.Module]], /) -> None:
    """A layer about to be checkpointed that is, or holds anywhere below it, torch's
    CheckpointWrapper with CheckpointImpl.REENTRANT: torch's reentrant checkpoint inside this
    boundary refuses every backward (helper FR: a warning saying gradients stay exact, then
    each backward refused); refused before any layer changes (helper FT: checkpoint_layers had
    checkpointed the layers before it)."""
    for path, layer in chosen:
        for inner, m in layer.named_modules():
            impl = getattr(m, "checkpoint_impl", None) if _torch_wrapper(m) else None
            if getattr(impl, "name", None) != "REENTRANT":
                continue
            what = (f"{path or type(layer).__name__} is" if not inner else
                    f"{path or type(layer).__name__} holds at {inner!r}")
            raise CheckpointConfigError(
                f"{what} torch.distributed's CheckpointWrapper with CheckpointImpl.REENTRANT, "
                "whose reentrant checkpoint cannot run inside this boundary: every backward "
                "would be refused, or, where no input requires grad, give the parameters "
                "under it no gradient",
                expected="no torch checkpoint wrapper inside a layer checkpointed here",
                got=f"CheckpointWrapper(checkpoint_impl=CheckpointImpl.REENTRANT) at "
                    f"{inner or '(the layer itself)'}",
                tip="take the layer out of torch's wrapper (module._checkpoint_wrapped_module, "
                    "or drop the checkpoint_wrapper call) and keep pytree_ckpt's")


def _refuse_inside_reentrant(path: str, outer: str, wrapper: nn.Module, /) -> None:
    """A layer chosen inside torch's CheckpointWrapper with CheckpointImpl.REENTRANT (the
    model wrapped by torch before, then given here with ``check_fn``): torch's reentrant
    checkpoint gives nothing under it a gradient where no input requires one (frozen
    embeddings, LoRA), where eager and this boundary alone give the parameters theirs; the
    warning said "gradients stay exact" (helper QL)."""
    if getattr(getattr(wrapper, "checkpoint_impl", None), "name", None) != "REENTRANT":
        return
    raise CheckpointConfigError(
        f"{path} is inside torch.distributed's CheckpointWrapper with CheckpointImpl.REENTRANT "
        f"at {outer or '(the model)'}: torch's reentrant checkpoint gives the parameters under "
        "it no gradient where no input requires grad, and recomputes the layer once more",
        expected="no torch checkpoint wrapper around a layer checkpointed here",
        got=f"CheckpointWrapper(checkpoint_impl=CheckpointImpl.REENTRANT) at "
            f"{outer or '(the model)'}",
        tip="take the layer out of torch's wrapper (module._checkpoint_wrapped_module, or drop "
            "the checkpoint_wrapper call) and keep pytree_ckpt's")


def warn_inside_torch_wrapper(model: nn.Module | None,
                              chosen: Sequence[tuple[str, nn.Module]], /) -> None:
    """NOTE [a layer left in torch's wrapper]: a layer still inside torch.distributed's
    ``checkpoint_wrapper`` (a migration half done), or holding one, and checkpointed here too
    runs its forward three times a step (eager's, torch's recompute, this replay; gradients
    stay exact) where once more than eager is needed (helper FO): warned once per apply,
    naming the layers, as transformers' own checkpointing left on is
    (``warn_stacked_checkpointing``). With ``CheckpointImpl.REENTRANT`` it is refused at once:
    a layer holding one would have every backward refused, and one inside one gets no
    gradient where no input requires grad (helper QL: warned "gradients stay exact"). A layer
    warned about here is not warned again at its first call (``check_at_first_call``).
    ``chosen``: (path in ``model``, module) pairs about to be checkpointed; their subtrees, and
    their ancestors in ``model`` where given, are looked at (layers given in a list have no
    known ancestors: ``path`` then only names them)."""
    refuse_reentrant_torch_wrappers(chosen)
    found = []
    for path, layer in chosen:
        inner = next((name for name, m in layer.named_modules() if _torch_wrapper(m)), None)
        parts = path.split(".") if path and model is not None else []
        outer = next((".".join(parts[:i]) for i in range(len(parts)) if model is not None and
                      _torch_wrapper(model.get_submodule(".".join(parts[:i])))), None)
        if outer is not None and model is not None:
            _refuse_inside_reentrant(path, outer, model.get_submodule(outer))
        if inner is not None or outer is not None:
            found.append(f"{path or type(layer).__name__} ("
                         + (f"inside the CheckpointWrapper {outer or 'the model'}" if outer
                            is not None else f"holding the CheckpointWrapper {inner or 'itself'}")
                         + ")")
    for _, layer in chosen:
        layer.__dict__[_TOLD] = True
    if found:
        warnings.warn(
            f"pytree_ckpt: {', '.join(found[:3])}{' and others' if len(found) > 3 else ''} "
            "checkpointed twice: torch.distributed's checkpoint_wrapper recomputes it too, so "
            "each step runs its forward once more than needed (gradients stay exact). Tip: "
            "take the layer out of torch's wrapper (module._checkpoint_wrapped_module, or drop "
            "the checkpoint_wrapper call) and keep pytree_ckpt's", stacklevel=user_stacklevel())


# The names of a module's own entry points, bound: ``layer.forward``, ``layer.__call__``.
_ENTRY_POINTS = frozenset({"forward", "__call__", "_wrapped_call_impl", "_call_impl"})


def other_method_of(fn: Callable[..., Any], owner: nn.Module, /) -> bool:
    """Whether ``fn`` (through partials and ``functools.wraps``' ``__wrapped__``, as
    ``owning_module`` finds ``owner``) is a method of ``owner`` other than its forward:
    ``model.encode`` runs a part of the model, and a torch wrapper around the decoder is not
    in its call (helper QN: refused, or warned, falsely). Anything else (the module, its
    forward however wrapped or compiled, a forward set on the instance under another name)
    runs what ``owner`` holds (helper QQ: a compiled or decorated forward was let through)."""
    instance_forward = owner.__dict__.get("forward")
    for _ in range(16):  # a wrapper of a wrapper ... (a cycle of __wrapped__ ends here)
        if instance_forward is not None and _same_callable(fn, instance_forward):
            return False  # set on the instance, a partial too (helper QR)
        if isinstance(fn, functools.partial):
            if fn.args and fn.args[0] is owner:  # partial(type(model).encode, model)
                return dunder(fn.func, "__name__") not in _ENTRY_POINTS
            fn = fn.func
            continue
        wrapped = dunder(fn, "__wrapped__")
        if wrapped is None:
            break
        fn = wrapped
    # dunder: a callable object's __getattr__ may raise other than AttributeError
    return dunder(fn, "__self__") is owner and dunder(fn, "__name__") not in _ENTRY_POINTS


def _same_callable(a: object, b: object, /) -> bool:
    """``a is b``, or two bindings of one function to one object (a bound method is made anew
    at each attribute read); never a user's ``__eq__``."""
    return a is b or isinstance(a, types.MethodType) and isinstance(b, types.MethodType) and \
        a.__func__ is b.__func__ and a.__self__ is b.__self__


def check_at_first_call(fn: Callable[..., Any], owner: nn.Module, whole: bool, /) -> None:
    """NOTE [a layer left in torch's wrapper], for a boundary's call at ``owner``'s first
    calls (``ever_verified`` false), or while ``owner`` has only run parts: a layer's own call
    (``whole``), or a functional call that is not ``other_method_of`` the model, checks what
    ``owner`` holds; a call of another method checks nothing and leaves the check pending, so
    that a later call of the whole model, which the part's first calls made no first call,
    still checks (helper QR: ``checkpoint(model.run_head, h)``, then ``checkpoint(model, x)``,
    was let through)."""
    if whole or not other_method_of(fn, owner):
        _at_first_call(owner)  # may refuse: pending until it passes (helper QS: a retry ran)
        owner.__dict__.pop(PENDING, None)
    else:
        owner.__dict__[PENDING] = True


def _at_first_call(owner: nn.Module, /) -> None:
    """The module a boundary's call runs (``checkpoint(model, x)``, or a layer's own), at its
    first calls (``ever_verified`` false): the checks of ``warn_inside_torch_wrapper`` for
    what it holds, which only the functions that wrap layers made (helper QL:
    ``checkpoint(model, x)`` over a model holding a reentrant wrapper gave its parameters no
    gradient, silently, where no input required grad). The reentrant refusal is a walk of the
    module's tree at first calls; the warning is given once per module."""
    refuse_reentrant_torch_wrappers([("", owner)])
    if _TOLD in owner.__dict__:
        return
    owner.__dict__[_TOLD] = True
    inner = next((name for name, m in owner.named_modules() if _torch_wrapper(m)), None)
    if inner is None:
        return
    warnings.warn(
        f"pytree_ckpt: {type(owner).__name__} (holding the CheckpointWrapper "
        f"{inner or 'itself'}) checkpointed twice: torch.distributed's checkpoint_wrapper "
        "recomputes it too, so each step runs its forward once more than needed (gradients "
        "stay exact). Tip: take the layer out of torch's wrapper "
        "(module._checkpoint_wrapped_module, or drop the checkpoint_wrapper call) and keep "
        "pytree_ckpt's", stacklevel=user_stacklevel())
