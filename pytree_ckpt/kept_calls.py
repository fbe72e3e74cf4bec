"""How the replay's call of a kept op is compared with the call the original pass recorded (NOTE
[kept ops called otherwise in the replay], NOTE [kept ops called on other tensors in the
replay]). ``KeepMode`` (keep.py) records ``call_arguments`` with each kept output and asks
``replay_may_take`` before handing a record to the replay.
"""

from __future__ import annotations

import warnings
from contextvars import ContextVar
from typing import Any

import torch

from .eager import user_stacklevel
from .errors import ReplayMismatchError, ReuseError

__all__ = ["KEPT_METHOD", "call_arguments", "for_backward", "kept_count_changed",
           "replay_may_take"]

# The innermost kept method running now (a ``_KeptMethod``, kept_callables.py), named when the
# replay is refused inside it (NOTE [kept ops called on other tensors in the replay]).
KEPT_METHOD: ContextVar[Any] = ContextVar("pytree_ckpt_kept_method", default=None)

# NOTE [kept ops called otherwise in the replay]: a record is matched to the replay's call by
# op and order; its arguments are the caller's. Callers that choose an argument by grad mode
# make the no-grad original pass and the replay call one op two ways: on CUDA,
# scaled_dot_product_attention asks the efficient and cuDNN kernels for the log-sum-exp that
# their backward needs only when grad is on, so a kept record would hand the replay an empty
# one (backward then fails, or reads garbage). So:
# - an argument named in _FOR_BACKWARD is set in the original pass as the replay will set it,
#   which is also what an eager training step passes (the record holds what backward needs,
#   as torch's selective checkpoint's does, whose forward runs with grad);
# - each record keeps the call's non-tensor arguments; a replay calling the op with others
#   does not use it: the op runs again there, as an op no unit keeps (right numbers, its
#   memory not saved), and a warning names the op and the argument, once per op.
#
# NOTE [kept ops called on other tensors in the replay]: no kernel choice by grad mode changes
# the shapes or dtypes of an op's tensor arguments, but a change of state the forward reads (a
# Python attribute, a global, a config value) between forward and backward does: the replay
# builds other tensors, and a record handed to it gave torch's shape error deep in a later op,
# or, where the shapes fit, numbers of neither pass, silently. So each record keeps its tensor
# arguments' shapes and dtypes too (read at each kept call of both passes, about 1 us an op),
# and a replay calling the op on other ones is refused (ReplayMismatchError): running the op
# again would not help, the rest of the replay computing something else than the forward did
# too. Not compared: strides, which do not change what an op computes, and devices (a record
# on another device than the replay's tensors fails loudly at the next op mixing them). An
# optional tensor given in one pass and not the other, or another number of tensors in a
# list, counts as another argument (the NOTE above).
_FOR_BACKWARD = frozenset({"compute_log_sumexp"})
_TENSOR = object()  # heads a tensor argument's marker in a call's arguments
_NAN = object()  # stands for a NaN argument


def for_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with ``func``'s _FOR_BACKWARD flag (if any) set."""
    at = _schema_of(func)[2]
    if at is None:
        return args, kwargs
    index, name = at
    if index < len(args):
        if args[index] is False:
            args = (*args[:index], True, *args[index + 1:])
    elif kwargs.get(name, False) is False:
        kwargs = {**kwargs, name: True}
    return args, kwargs


_NO_DEFAULT = object()
# Per op: its arguments' names and defaults, and where its _FOR_BACKWARD flag is (static
# metadata, not step state).
_SCHEMAS: dict[Any, tuple[tuple[str, ...], tuple[Any, ...], tuple[int, str] | None]] = {}


def _schema_of(func: Any) -> tuple[tuple[str, ...], tuple[Any, ...], tuple[int, str] | None]:
    known = _SCHEMAS.get(func)
    if known is None:
        arguments = func._schema.arguments
        names = tuple(a.name for a in arguments)
        known = _SCHEMAS[func] = (
            names,
            tuple(a.default_value if a.has_default_value() else _NO_DEFAULT for a in arguments),
            next(((i, n) for i, n in enumerate(names) if n in _FOR_BACKWARD), None))
    return known


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # NOTE [kept ops called on other tensors in the replay]: compared as a tuple (C speed);
        # the marker heads it, so no argument of the caller's can equal it.
        return (_TENSOR, value.shape, value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    # NaN (masked_fill(mask, nan)) is equal to itself as an argument
    if isinstance(value, (float, complex)) and value != value:
        return _NAN
    return value


def call_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments of a call by the op's schema, positional or keyword, defaults filled in
    (torch's Python dispatch drops a trailing argument equal to its default); a tensor stands
    as a marker with its shape and dtype."""
    names, defaults, _ = _schema_of(func)
    return tuple(_plain(args[i] if i < len(args) else kwargs.get(name, defaults[i]))
                 for i, name in enumerate(names))


def _is_tensor(marker: Any) -> bool:
    return type(marker) is tuple and len(marker) == 3 and marker[0] is _TENSOR


def _shown(value: Any) -> Any:
    if _is_tensor(value):
        _, shape, dtype = value
        return f"Tensor(shape={tuple(shape)}, dtype={dtype})"
    if type(value) is tuple:
        return f"({', '.join(str(_shown(v)) for v in value)}{',' if len(value) == 1 else ''})"
    return "nan" if value is _NAN else repr(value)


def _other_tensor(old: Any, new: Any, where: str) -> tuple[str, Any, Any] | None:
    """Where ``new`` holds a tensor of another shape or dtype than ``old`` in the same
    place (``None`` if nowhere), with both markers."""
    if _is_tensor(old) and _is_tensor(new):
        return None if old == new else (where, old, new)
    if type(old) is tuple and type(new) is tuple and len(old) == len(new) and \
            not _is_tensor(old) and not _is_tensor(new):
        for i, (o, n) in enumerate(zip(old, new)):
            found = _other_tensor(o, n, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def replay_may_take(func: Any, recorded: tuple[Any, ...], now: tuple[Any, ...], *,
                    position: int, count: int, layer: Any) -> bool:
    """Whether the replay's call (``now``, the ``position``-th of ``count`` recorded calls of
    ``func`` in the boundary around ``layer``) may take the record made of ``recorded``: not
    with other arguments (warned); refused with other tensors."""
    if now == recorded:
        return True
    names = _schema_of(func)[0]
    for name, old, new in zip(names, recorded, now):
        found = _other_tensor(old, new, repr(name))
        if found is not None:
            _raise_other_tensors(func, found, position=position, count=count, layer=layer)
    differs = [(name, old, new) for name, old, new in zip(names, recorded, now) if old != new]
    difference = next((f"{name}: {_shown(old)} -> {_shown(new)}"
                       for name, old, new in differs), "?")
    _warn_called_otherwise(func, difference, generator=any(
        isinstance(old, torch.Generator) and isinstance(new, torch.Generator)
        for _, old, new in differs))
    return False


def _raise_other_tensors(func: Any, found: tuple[str, Any, Any], *, position: int, count: int,
                         layer: Any) -> None:
    from .module_state import owning_module  # an error path: imported here, no cycle
    from .refusals import fn_name

    where, old, new = found
    method = KEPT_METHOD.get()
    inside = ""
    if method is not None:
        owner, module = owning_module(layer), method.module_ref()
        path = next((p for p, m in owner.named_modules() if m is module), None) \
            if owner is not None else None
        inside = f", inside the kept method {method.kept_as}" + \
            (f" of the submodule {path!r}" if path else "")
    raise ReplayMismatchError(
        f"the replay of {fn_name(layer)} called {func}, which a save unit keeps, on other "
        f"tensors than the original pass did (call #{position + 1} of {count}{inside}): the "
        "record the original pass kept is for another computation",
        expected=f"argument {where}: {_shown(old)}", got=f"argument {where}: {_shown(new)}",
        tip="the replay must compute what the original pass did. Usually the code branches "
            "on grad mode (`if torch.is_grad_enabled():`, or on current_phase(): the original "
            "pass runs without grad, the replay with it; Megatron-Core's router computes its "
            "aux loss so), or state the forward reads (a Python attribute, a global, a config "
            "value) changed between forward and backward, so the replay built other tensors: "
            "branch on inputs or self.training instead, change such state only after backward "
            "or pass it to the layer as an argument; if that code must differ, keep it out of "
            "the unit (drop the op from KeptOps, or keep a smaller method: a router's gating "
            "projection, not the whole router). If neither, torch may have dispatched the kept "
            "ops otherwise in the replay (torch.matmul picks aten::mm or aten::bmm by whether "
            "an operand requires grad: docs/save_units.md, rule 1)")


# Ops warned about as called otherwise in the replay (a warning's dedupe, not step state).
_WARNED_OTHERWISE: set[str] = set()


def _warn_called_otherwise(func: Any, difference: str, *, generator: bool) -> None:
    name = str(func)
    if name in _WARNED_OTHERWISE:
        return
    _WARNED_OTHERWISE.add(name)
    # A generator compares by identity: one the layer makes at each call is a new object in
    # the replay, whatever its seed (helper HH: the grad-mode words misled there).
    why = ("A torch.Generator is compared by identity, and one the layer makes at each call "
           "is another object in the replay. Tip: make the generator once (on the module) or "
           "pass it in as an argument, or drop the op from the unit" if generator else
           "The original pass runs under torch.no_grad(): code choosing an argument by grad "
           "mode calls the op otherwise there. Tip: keep another op (the kernel that code "
           "calls in both passes), or drop the op from the unit")
    warnings.warn(
        f"pytree_ckpt: the replay called {name}, which a save unit keeps, with another argument "
        f"than the original pass did ({difference}): its record was not used, and the op ran "
        f"again in the replay (right numbers, its memory not saved). {why}",
        stacklevel=user_stacklevel())


def kept_count_changed(error: ReuseError, layer: Any, policy: Any, /) -> ReuseError:
    """A replay that called a kept op another number of times than its original pass (the
    frame's refusal, ``error``), told with the layer, the methods its save units keep and the
    usual cause: state the forward reads, changed between forward and backward, took the
    replay down another branch (helper OK: a dynamic-NTK rotary grown by a later micro-batch
    compared a tensor with a tensor where its forward compared it with a number; the frame's
    words named grad-dependent kernels only)."""
    from .frames import KEPT_OP_TIP  # an error path: imported here, no cycle
    from .refusals import fn_name

    methods = sorted({m for _, _, names in getattr(getattr(policy, "use", None), "units", ())
                      for m in names})
    kept = f" (its save units keep {', '.join(methods)})" if methods else ""
    return ReuseError(
        f"the replay of {fn_name(layer)}{kept} did not call the ops a save unit kept as its "
        f"original pass did: {str(error).splitlines()[0]}",
        tip="the replay must dispatch the same kept ops, in the same order, as the original "
            "pass. Usually state the forward reads (a Python attribute, a global, a config "
            "value, a cached length) changed between forward and backward, so the replay took "
            "another branch: change such state only after backward, or pass it to the layer "
            "as an argument; or the code branches on grad mode or current_phase() (branch on "
            "inputs or self.training instead). "
            + KEPT_OP_TIP[KEPT_OP_TIP.index("torch itself"):])
