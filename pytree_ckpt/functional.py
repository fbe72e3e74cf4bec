"""The boundary as a function call: ``checkpoint(fn, *args, **kwargs)`` runs ``fn`` behind
one boundary, and ``checkpointed(fn, ...)`` wraps it with boundary options (boundary.py holds
the boundary itself; module.py installs it on modules).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from torch import nn

from .apply import OFFLOAD_ENV
from .boundary import run_boundary
from .boundary_call import DEFAULT_OPTIONS, BoundaryOptions
from .eager import BOUNDARY_REASON, runs_eagerly, user_stacklevel
from .errors import CheckpointConfigError, require_callable
from .module_state import owning_module
from .phase import Phase, current_phase
from .refusals import fn_name, refuse_container
from .torch_options import (BOUNDARY_OPTIONS, TORCH_OPTIONS, refuses_torch_options,
                            torch_options_tip)
from .tree import dunder, flatten, refuse_proxy_function
from .tree_refusals import is_cache_object

if TYPE_CHECKING:  # offload imports this package's errors: no import cycle at run time
    from offload import OffloadManager

__all__ = ["checkpoint", "checkpointed"]

_ABSENT = object()  # a name functools.wraps would copy, not there

T = TypeVar("T")
P = ParamSpec("P")


def _whose(names: list[str], /, *, short: bool = False) -> str:
    """Whose options ``names`` are, in a message: torch's, checkpointed's, or both."""
    torch_ones = [name for name in names if name in TORCH_OPTIONS]
    if len(torch_ones) == len(names):
        return "torch.utils.checkpoint's options" if short else \
            "options of torch.utils.checkpoint"
    return "options of pytree_ckpt.checkpointed" if not torch_ones else \
        "options of torch.utils.checkpoint and of pytree_ckpt.checkpointed"


def _swallowed(fn: Callable[..., Any], names: list[str]) -> list[str]:
    """Those of ``names`` that ``fn`` takes only through ``**kwargs``."""
    try:  # a module's call takes (*args, **kwargs): its forward says what it names, also
        # through a partial of the module or of its __call__ (transformers' 5.x convention:
        # a layer taking `offload` itself was warned of swallowing it, helper GV)
        target = fn
        while isinstance(target, functools.partial):
            target = target.func
        owner = dunder(target, "__self__")
        if isinstance(owner, nn.Module) and dunder(target, "__func__") in (
                nn.Module.__call__, nn.Module._wrapped_call_impl):
            target = owner
        if isinstance(target, nn.Module):
            target = target.forward
        elif not inspect.isroutine(target) and dunder(target, "__wrapped__") is None:
            # A callable object: its class's __call__ (inspect.signature of the object asks
            # it for __wrapped__ and __signature__, which a __getattr__ may answer with a
            # KeyError: helper HK)
            target = dunder(type(target), "__call__", target)
        else:
            target = fn
        parameters = inspect.signature(target).parameters
    except Exception:  # no signature to read (a builtin): say nothing
        return []
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return [name for name in names if name not in parameters]


_FLAGS = (bool, int, float, str)


def _grad_leaves(value: Any, /) -> list[Any]:
    """The tensors requiring grad, the modules and the cache objects ``value`` holds. What a
    layer's partial usually binds (None, flags, a mask, a (cos, sin) pair) is looked at
    directly: a PyTree flatten costs microseconds a keyword, at every layer call."""
    if value is None or type(value) in _FLAGS:
        return []
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):
        return [v for v in value if v.requires_grad]
    return [leaf for leaf in flatten(value).leaves
            if (leaf.requires_grad if isinstance(leaf, torch.Tensor) else
                isinstance(leaf, nn.Module) or is_cache_object(leaf))]


def _trainable(value: Any, owner: nn.Module, /) -> bool:
    """Whether ``value`` holds a tensor requiring grad, a module or a cache object, other
    than the owner's own (a parameter of it, or a submodule, stays bound: known as they are)."""
    leaves = _grad_leaves(value)
    if not leaves:  # the usual case: a mask, cos/sin, None, flags
        return False
    own = {id(t) for t in owner.parameters()} | {id(m) for m in owner.modules()}
    return any(id(leaf) not in own for leaf in leaves)


def _bound_inputs(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], /
                  ) -> tuple[Callable[..., T], tuple[Any, ...], dict[str, Any]]:
    """NOTE [what a layer's partial binds]: transformers' layer wrapper calls its checkpoint
    function with ``partial(forward, self, **kwargs)`` (NOTE [a method bound by a partial] in
    module_state.py), so every keyword the layer was called with is bound in ``fn``, not
    passed to the boundary. A tensor that requires grad there (LW-DETR's decoder layers get
    the encoder's output and a trainable query position embedding as keywords) or a module
    with trainable parameters is neither an input nor the layer's parameter: refused in
    backward, as it would get no gradient. Those are made the call's inputs (keywords the call
    itself passes win, as in the partial), and so are a module of any kind (a frozen router
    passed by keyword: its hooks recorded and its state watched, as any module passed in) and a
    cache object (refused, as under any keyword: NOTE [a cache filled twice]; helper KG:
    both stayed bound, silently wrong); what needs no gradient (the mask, rotary cos/sin)
    stays bound, neither saved nor offloaded.
    Positional arguments bound after the layer move together, to keep their order. The same
    holds for a partial of a layer's bound method (earlier 5.x: ``partial(super().__call__,
    **kwargs)``)."""
    if not isinstance(fn, functools.partial):
        return fn, args, kwargs
    # Nothing bound needs a gradient (the usual call: a mask, cos/sin, flags): left as it is,
    # without looking for the owner.
    bound_args = fn.args[1:] if fn.args and isinstance(fn.args[0], nn.Module) else fn.args
    if not any(_grad_leaves(v) for k, v in fn.keywords.items() if k not in kwargs) and \
            not any(_grad_leaves(a) for a in bound_args):
        return fn, args, kwargs
    owner = owning_module(fn)
    if owner is None:
        return fn, args, kwargs
    first = 1 if fn.args and fn.args[0] is owner else 0
    # The owner's bound method, or the module itself (`partial(layer, cache=c)`: helper NG,
    # the cache it bound was never seen, so never refused); a wrapper or a nested partial is
    # left as it is.
    if not first and fn.func is not owner and dunder(fn.func, "__self__") is not owner:
        return fn, args, kwargs
    lifted = {k: v for k, v in fn.keywords.items()
              if k not in kwargs and _trainable(v, owner)}
    extra = fn.args[first:]
    move = any(_trainable(a, owner) for a in extra)
    if not lifted and not move:
        return fn, args, kwargs
    kept = {k: v for k, v in fn.keywords.items() if k not in lifted}
    bound = functools.partial(fn.func, *(fn.args[:first] if move else fn.args), **kept)
    return bound, ((*extra, *args) if move else args), {**lifted, **kwargs}


# Whether checkpoint() has warned that XTUNER_ACTIVATION_OFFLOAD is on but unused (once per
# process: one warning for all the layers of a model, and every step). No step state: a test
# resets it with monkeypatch.setattr; two threads racing past it warn twice at worst.
_ENV_OFFLOAD_TOLD = False

# NOTE [the variable read cheaply]: ``os.environ.get`` of an unset variable raises and catches
# two KeyErrors (about 7,500 instructions, at every checkpoint() call: counted by callgrind,
# examples.bench_instructions); the mapping's own dict, which every write through os.environ
# updates (os.putenv alone reaches neither), answers the same for a dict lookup. Read so only
# while os.environ is the mapping it was at import and has that dict (CPython's ``_Environ``);
# otherwise (a test that replaces os.environ) through os.environ.get.
_ENVIRON = os.environ
_ENVIRON_DATA: dict[Any, Any] | None = getattr(_ENVIRON, "_data", None)
if not isinstance(_ENVIRON_DATA, dict) or not hasattr(_ENVIRON, "encodekey"):
    _ENVIRON_DATA = None
_OFFLOAD_ENV_KEY: Any = _ENVIRON.encodekey(OFFLOAD_ENV) if _ENVIRON_DATA is not None else None


def _tell_env_offload_unused(fn: Callable[..., Any], /) -> None:
    """NOTE [the variable and checkpoint()]: ``checkpoint(fn, ...)`` never offloads (its
    options are fixed; ``checkpointed`` chooses them), but the variable turns offload on
    without code changes everywhere else. transformers' checkpoint switch given
    ``pytree_ckpt.checkpoint`` calls it for every layer: with the variable set, offload then did
    nothing, silently. So the first call made outside any boundary (a nested one opens no
    window anyway) with grad enabled and the variable on warns, once. Not under a saved-tensor
    hook (an offload window, torch's ``save_on_cpu``; an ``ActivationCensus`` too): that hook
    sees the inputs the call saves, which may not stay on the device; a later call with none
    is told. A value the variable does not accept (``yes``) is told too, once, with the
    refusal the other entry points raise (helper GL: its user, meaning on, got no offload and
    no word; checkpoint() itself does not read the variable, so it warns, not raises). Until
    told, a call with the variable unset costs one environment lookup."""
    global _ENV_OFFLOAD_TOLD
    if _ENV_OFFLOAD_TOLD:
        return
    data = _ENVIRON_DATA if os.environ is _ENVIRON else None  # NOTE [the variable read cheaply]
    if not (data.get(_OFFLOAD_ENV_KEY) if data is not None else os.environ.get(OFFLOAD_ENV)):
        return
    if not torch.is_grad_enabled() \
            or current_phase() is not Phase.PLAIN \
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return
    from offload import env_flag

    try:
        on = env_flag(OFFLOAD_ENV)
    except CheckpointConfigError as error:  # refused where it is read; told here
        _ENV_OFFLOAD_TOLD = True
        warnings.warn(
            "pytree_ckpt.checkpoint(fn, ...) never offloads, and apply_activation_"
            "checkpointing, checkpoint_layers, apply_recompute_config and checkpointed(fn) "
            f"refuse the variable's value: {error}", stacklevel=user_stacklevel())
        return
    if not on:
        return
    _ENV_OFFLOAD_TOLD = True
    warnings.warn(
        f"{OFFLOAD_ENV} is on, but pytree_ckpt.checkpoint(fn, ...) never offloads: "
        f"{fn_name(fn)} runs checkpointed with its inputs left on the device (the variable "
        "applies to apply_activation_checkpointing, checkpoint_layers, apply_recompute_config "
        "and checkpointed(fn)). Tip: call pytree_ckpt.checkpointed(fn)(*args), which reads the "
        "variable (for transformers: model._set_gradient_checkpointing(True, lambda fn, *args: "
        "pytree_ckpt.checkpointed(fn)(*args))), or wrap the layers themselves with "
        "pytree_ckpt.apply_activation_checkpointing(model, check_fn=is_layer); "
        "checkpointed(fn, offload=False) says no offload is meant",
        stacklevel=user_stacklevel())


# Callable[..., T], not a ParamSpec: mypy cannot solve one from a lambda with defaults, the
# form docs/limits.md gives for a layer bound in a loop (helper LN); checkpointed keeps one.
@runs_eagerly(BOUNDARY_REASON)  # NOTE [the boundary stays eager] in module.py, for calls too
def checkpoint(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` behind a PyTree-aware reentrant checkpoint boundary.

    Every keyword goes to ``fn``; set boundary options with :func:`checkpointed`.
    """
    require_callable(fn, "checkpoint", "checkpoint(layer, x) or checkpoint(fn, x, ...): the "
                      "function (or module) first, then its arguments")
    refuse_proxy_function(fn, "checkpoint")  # NOTE [a weakref.proxy leaf] (tree.py)
    if isinstance(fn, nn.Module) and type(fn).forward is nn.Module.forward:
        # torch's own "missing the required forward function" otherwise, naming no fix
        refuse_container(fn, "checkpoint would have nothing to run")
    # Code moved over from torch.utils.checkpoint passes its options as keywords, and a
    # boundary option (verify_replay=True) given here reads as one for the boundary.
    torch_options = sorted((TORCH_OPTIONS.keys() | BOUNDARY_OPTIONS.keys()) & kwargs.keys()) \
        if kwargs else []
    swallowed = _swallowed(fn, torch_options) if torch_options else []
    if swallowed:
        # A forward taking **kwargs (a transformers decoder layer) takes them silently; one
        # that names such a keyword means its own, and one that takes none raises (noted below).
        warnings.warn(
            f"pytree_ckpt.checkpoint passes every keyword to fn, so {fn_name(fn)} receives "
            f"{swallowed} in its **kwargs: {_whose(swallowed)}, which mean nothing here. Tip: "
            f"{torch_options_tip(swallowed)}",
            stacklevel=user_stacklevel())
    _tell_env_offload_unused(fn)
    try:
        return run_boundary(*_bound_inputs(fn, args, kwargs), DEFAULT_OPTIONS)
    except TypeError as error:
        # A boundary option only where fn refused it as a keyword: a layer's own TypeError
        # about its own `offload` argument is no such refusal (helper GV).
        if torch_options and any(
                f"unexpected keyword argument '{name}'" in str(error) if name in BOUNDARY_OPTIONS
                else name in str(error) for name in torch_options):
            # In the message, not a note: loggers and trainers record str(error) only.
            raise TypeError(
                f"{error}: pytree_ckpt.checkpoint passes every keyword to fn, {torch_options} "
                f"included ({_whose(torch_options, short=True)}). Tip: "
                f"{torch_options_tip(torch_options)}.") from error
        if args and isinstance(args[0], bool) and any(
                words in str(error) for words in ("positional argument", "bool")):
            # Megatron-Core's tensor_parallel.checkpoint(fn, distribute_saved_activations,
            # *args) kept as it is: the flag became fn's first argument (a custom_forward
            # taking *args hands it to its first layer: "must be Tensor, not bool", helper HJ).
            raise TypeError(
                f"{error}: pytree_ckpt.checkpoint gave fn the bool {args[0]} as its first "
                "argument. If the call was Megatron-Core's tensor_parallel.checkpoint(fn, "
                "distribute_saved_activations, *args), drop that flag: "
                "pytree_ckpt.checkpoint(fn, *args).") from error
        raise


@refuses_torch_options
def checkpointed(fn: Callable[P, T], /, *, preserve_rng_state: bool = True,
                 offload: bool | OffloadManager | None = None,
                 verify_replay: bool = False) -> Callable[P, T]:
    """Return ``fn`` wrapped in a boundary with the given options.

    ``offload`` as in ``apply_activation_checkpointing``: ``None`` reads
    ``XTUNER_ACTIVATION_OFFLOAD`` now, ``True`` the process's default manager, ``False`` none.
    ``verify_replay``: compare each replay's output values with its original pass's, bit for
    bit (docs/boundary.md, "Checking that the replay computes what the forward did").
    """
    from .apply import resolve_offload  # imported at the call, as the layer entry points'

    # Refused now, not at the first call, far from where it was made.
    require_callable(fn, "checkpointed", "checkpointed(layer) or checkpointed(fn, "
                      "preserve_rng_state=False); the arguments go to the wrapper it returns")
    refuse_proxy_function(fn, "checkpointed")  # NOTE [a weakref.proxy leaf] (tree.py)
    if isinstance(fn, nn.Module):
        refuse_container(fn, "the wrapper would have nothing to run")
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload), verify_replay=verify_replay)

    @runs_eagerly(BOUNDARY_REASON)  # NOTE [the boundary stays eager] in module.py
    def run(*args: Any, **kwargs: Any) -> T:
        return run_boundary(*_bound_inputs(fn, args, kwargs), options)

    # functools.wraps' names, read through dunder: its getattr stops only AttributeError, and
    # a callable whose __getattr__ raises KeyError failed here (helper HG). Not __dict__: a
    # module's must not be copied onto run.
    for name in functools.WRAPPER_ASSIGNMENTS:
        value = dunder(fn, name, _ABSENT)
        if value is not _ABSENT:
            try:
                setattr(run, name, value)
            except (TypeError, ValueError):  # a __name__ that is no str, say: run keeps its own
                pass
    run.__wrapped__ = fn  # type: ignore[attr-defined]

    return run
