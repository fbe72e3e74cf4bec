"""torch.utils.checkpoint's options, moved over to pytree_ckpt's calls as they are: what each
becomes here, told where it is given (NOTE [torch's options]); and the boundary's own options
given to ``checkpoint``, which takes none."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .errors import CheckpointConfigError

__all__ = ["BOUNDARY_OPTIONS", "TORCH_OPTIONS", "refuses_torch_options", "torch_options_tip"]

# NOTE [torch's options]: code moved from torch.utils.checkpoint (torchtitan's
# ptd_checkpoint_wrapper(block, context_fn=..., determinism_check=..., early_stop=...)) brings
# its options along. ``checkpoint(fn, *args, **kwargs)`` passes every keyword to ``fn`` (they
# may be fn's own), so it tells about these where fn does not take them (functional.py); the
# functions that take the boundary's own options refuse them here, naming what each becomes:
# Python's "unexpected keyword argument" named no replacement (helper FO).
TORCH_OPTIONS = {
    "use_reentrant": "drop use_reentrant (the boundary is always reentrant-style, and takes "
                     "any PyTree)",
    "preserve_rng_state": "set preserve_rng_state with pytree_ckpt.checkpointed(fn, "
                          "preserve_rng_state=...)(*args)",
    "context_fn": "selective checkpointing (create_selective_checkpoint_contexts) is "
                  "RecomputeConfig(save=[...]) with KeptOps targets, applied to layers with "
                  "apply_recompute_config (docs/save_units.md)",
    "determinism_check": "drop determinism_check (the structure, shapes and dtypes of the "
                         "replay's outputs are always checked: ReplayMismatchError); pass "
                         "verify_replay=True to compare their values too, bit for bit, which "
                         "finds a forward that reads state other than its inputs and its "
                         "modules' (docs/limits.md)",
    "debug": "drop debug (a replay that differs raises ReplayMismatchError naming the key path,"
             " and an error raised in the replay says it came from there)",
    "early_stop": "drop early_stop (the replay always reruns the whole forward; keep what is "
                  "costly to recompute with save units: docs/save_units.md)",
}
# torch.distributed's checkpoint_wrapper(module, checkpoint_impl=...), whose place
# apply_activation_checkpointing takes.
_WRAPPER_OPTIONS = {
    "checkpoint_impl": "drop checkpoint_impl (the boundary is always reentrant-style, and takes "
                       "any PyTree)",
    "checkpoint_fn": "drop checkpoint_fn (the boundary is pytree_ckpt's own checkpoint; its "
                     "options are this call's keywords: preserve_rng_state=, offload=, "
                     "verify_replay=)",
}


# The boundary's own options, which checkpoint(fn, *args, **kwargs) passes to fn as it does
# every keyword (a forward taking **kwargs swallowed verify_replay=True: nothing was verified,
# helper GU); checkpointed takes them.
BOUNDARY_OPTIONS = {
    "offload": "set offload with pytree_ckpt.checkpointed(fn, offload=...)(*args)",
    "verify_replay": "set verify_replay with pytree_ckpt.checkpointed(fn, "
                     "verify_replay=True)(*args)",
}


def torch_options_tip(names: list[str], /) -> str:
    return "; ".join(TORCH_OPTIONS.get(name) or BOUNDARY_OPTIONS.get(name) or
                     _WRAPPER_OPTIONS[name] for name in names)


P = ParamSpec("P")
R = TypeVar("R")


def refuses_torch_options(fn: Callable[P, R], /) -> Callable[P, R]:
    """Have ``fn`` (which takes the boundary's options as keywords) refuse torch's options with
    a ``CheckpointConfigError`` naming what each becomes (NOTE [torch's options]), but for
    those ``fn`` takes itself. Its signature is unchanged; a call costs one set intersection
    (these functions run once, when the model is set up)."""
    # Less those fn takes itself (preserve_rng_state).
    parameters = inspect.signature(fn).parameters
    known = (TORCH_OPTIONS.keys() | _WRAPPER_OPTIONS.keys()) - parameters.keys()
    name = getattr(fn, "__name__", "this call")
    positional = [p.name for p in parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        if len(args) > len(positional):
            _refuse_positional(name, positional, args, "check_fn" in parameters)
        given = sorted(known & kwargs.keys()) if kwargs else []
        if given:
            raise CheckpointConfigError(
                f"{name} takes no {', '.join(f'{option}=' for option in given)} "
                "(options of torch.utils.checkpoint or torch.distributed's checkpoint_wrapper)",
                expected=f"the keywords of {name} (docs/boundary.md, 'Coming from torch's "
                         "checkpoint')",
                got=", ".join(f"{option}={kwargs[option]!r}" for option in given),
                tip=torch_options_tip(given))
        return fn(*args, **kwargs)

    return checked


def _refuse_positional(name: str, positional: list[str], args: tuple[object, ...],
                       takes_check_fn: bool, /) -> None:
    """torch.distributed's ``apply_activation_checkpointing(model, checkpoint_wrapper_fn,
    check_fn)`` and torchtune's ``set_activation_checkpointing(model, {Layer})`` pass options
    by position, which these calls take by keyword: Python's "takes 1 positional argument but
    3 were given" named no fix (helper QL)."""
    extra = args[len(positional):]
    classes = [c for value in extra
               for c in (value if isinstance(value, (set, frozenset, list, tuple))
                         else [value]) if isinstance(c, type)]
    test = (f"isinstance(m, {classes[0].__name__})" if len(classes) == 1 else
            f"isinstance(m, ({', '.join(c.__name__ for c in classes)}))" if classes else
            "isinstance(m, Layer)")
    raise CheckpointConfigError(
        f"{name} takes {len(positional)} positional argument{'s' * (len(positional) > 1)} "
        f"({', '.join(positional)}) and its options by keyword; {len(extra)} more "
        f"{'was' if len(extra) == 1 else 'were'} given by position"
        + (" (torch.distributed's apply_activation_checkpointing and torchtune's "
           "set_activation_checkpointing take them so)" if takes_check_fn else ""),
        expected=f"{name}({', '.join(positional)}, <option>=...)",
        got=f"{len(args)} positional arguments: "
            + ", ".join(_short(value) for value in args),
        tip=(f"{name}({positional[0]}, check_fn=lambda m: {test}), without "
             "checkpoint_wrapper_fn: the wrapper is pytree_ckpt's own (docs/boundary.md, "
             "'Coming from torch's checkpoint')" if takes_check_fn else
             _POSITIONAL_TIPS.get(name, "pass the options by keyword")))


_POSITIONAL_TIPS = {
    "checkpointed": "checkpointed(fn, <option>=...) returns the wrapped function: call it with "
                    "the arguments, checkpointed(fn)(*args), or pytree_ckpt.checkpoint(fn, "
                    "*args)",
    "checkpoint_layers": "checkpoint_layers(layers, ratio=...): the ratio is a keyword",
}


def _short(value: object, /) -> str:
    """A positional argument for the message: a class or function by name, else its type."""
    if isinstance(value, type):
        return value.__name__
    label = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(label, str):
        return label
    if isinstance(value, (set, frozenset, list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
