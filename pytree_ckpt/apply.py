"""Which modules get a boundary, from the user's arguments: ``apply_activation_checkpointing``
(a module, or the modules ``check_fn`` chooses), ``checkpoint_layers`` (the first layers of a
list, by ratio), and the checks of those arguments (``offload=``, ``check_fn``, the ratio, the
layer list) that ``apply_recompute_config`` shares. Installing and removing a boundary on one
module is module.py's.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from torch import nn

from .boundary_call import BoundaryOptions
from .eager import user_stacklevel
from .errors import CheckpointConfigError
from .module import install_boundary, is_checkpointed, label_boundary, refuse_other_options_among
from .refusals import require_module
from .torch_options import refuses_torch_options
from .torch_wrappers import refuse_reentrant_torch_wrappers, warn_inside_torch_wrapper
from .tree import describe_leaf, dunder

if TYPE_CHECKING:  # offload imports this package's errors: imported lazily at run time
    from offload import OffloadManager

OFFLOAD_ENV = "XTUNER_ACTIVATION_OFFLOAD"

__all__ = ["apply_activation_checkpointing", "checkpoint_layers", "resolve_offload",
           "layer_count", "layer_refs", "refuse_checkpointed_beyond", "validate_ratio",
           "warn_offload_unused"]

M = TypeVar("M", bound=nn.Module)  # the module given is the one returned, changed in place


def warn_offload_unused(offload: bool | OffloadManager | None, count: int, total: int,
                        ratio: float, where: str, /) -> None:
    """Warn where offload is asked for explicitly (a manager, or True) and no layer is
    checkpointed: only boundaries offload, so a sweep's ratio 0 moved nothing, silently, where
    save units there warn (helper HE). Not for the environment variable, a process-wide switch
    that a ratio-0 baseline runs beside."""
    if count == 0 and total and offload is not None and offload is not False:
        given = "True" if offload is True else "an OffloadManager"
        warnings.warn(f"{where}(ratio={ratio}) checkpoints none of the {total} layers: "
                      f"offload={given} offloads nothing (only checkpointed layers offload "
                      "their inputs)", stacklevel=user_stacklevel())


def resolve_offload(offload: bool | OffloadManager | None, /) -> OffloadManager | None:
    """The manager an ``offload=`` argument means; ``None`` reads XTUNER_ACTIVATION_OFFLOAD.

    ``True`` (or the variable set to 1/true) uses the process's default manager for the
    current device, chosen now: call ``torch.cuda.set_device`` first (see
    ``offload.default_manager``).
    """
    from offload import OffloadConfig, OffloadManager, default_manager, env_flag

    if offload is None:
        offload = env_flag(OFFLOAD_ENV)  # CheckpointConfigError (a ValueError) if unparsable
    if offload is True:
        return default_manager()
    if offload is False:
        return None
    if isinstance(offload, OffloadManager):
        return offload
    if isinstance(offload, (str, int, float)):  # a flag read from a config file or the CLI
        got = f"{type(offload).__name__} {offload!r}"
        tip = ("offload=True turns it on (the process's default manager), offload=False off"
               + ("; a string is not parsed (XTUNER_ACTIVATION_OFFLOAD is, when offload=None):"
                  " parse a switch of your own with offload.env_flag(name)"
                  if isinstance(offload, str) else ""))
    elif isinstance(offload, OffloadConfig):
        got, tip = "OffloadConfig", "pass offload.OffloadManager(config, device=...)"
    else:
        got, tip = type(offload).__name__, \
            "build one with offload.OffloadManager(offload.OffloadConfig(...))"
    raise CheckpointConfigError(
        "offload= takes None (read XTUNER_ACTIVATION_OFFLOAD), a bool or an OffloadManager",
        expected="None | bool | offload.OffloadManager", got=got, tip=tip)


@refuses_torch_options
def apply_activation_checkpointing(module: M, /, *, preserve_rng_state: bool = True,
                                   offload: bool | OffloadManager | None = None,
                                   verify_replay: bool = False,
                                   check_fn: Callable[[nn.Module], bool] | None = None,
                                   checkpoint_wrapper_fn: None = None,
                                   auto_wrap_policy: None = None) -> M:
    """Route ``module``'s forward through the boundary, in place; returns ``module``.

    ``offload``: ``None`` reads ``XTUNER_ACTIVATION_OFFLOAD`` (``1``/``true`` on, ``0``/
    ``false``/unset off); ``True``/``False`` override it; a manager is used as given. With
    offload on, each call opens a window over the call's input tensor leaves.
    ``verify_replay``: compare each replay's output values with its original pass's, bit for
    bit (``ReplayMismatchError`` naming the output), to find a forward that reads state it
    should not; costs a few reductions per output in each pass (a chunk at a time) and a
    device sync per replay.
    ``check_fn``: as in torch.distributed's function of this name, checkpoint each module of
    ``module`` (itself included) for which it returns true, instead of ``module`` itself; one
    manager serves them all. Applying again with the same options is a no-op; with other
    options it raises (remove it first). See NOTE [in-place wrapping] in module.py.
    ``checkpoint_wrapper_fn`` and ``auto_wrap_policy``: torch.distributed's keywords of this
    function, accepted only to be refused (``CheckpointConfigError`` naming ``check_fn=``): the
    wrapper is pytree_ckpt's own boundary, and ``check_fn`` chooses the modules. Typed ``None``
    so that a type checker flags them too; ``None`` (their unset value) is ignored.
    """
    _refuse_torch_keywords(checkpoint_wrapper_fn, auto_wrap_policy)
    require_module(module, "apply_activation_checkpointing",
                   "pass one module (checkpoint_layers(model.layers) takes a list of layers); "
                   "wrap a plain function with pytree_ckpt.checkpoint(fn, *args) instead")
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload), verify_replay=verify_replay)
    if check_fn is None:
        warn_inside_torch_wrapper(module, [("", module)])
        return install_boundary(module, options)
    _refuse_policy(check_fn)
    chosen = _chosen_by(module, check_fn)
    # Before any changes: refused, none change.
    refuse_other_options_among(chosen, options, undo="[remove_activation_checkpointing(m) for m "
                               "in module.modules() if check_fn(m)]")
    warn_inside_torch_wrapper(module, chosen)
    for name, layer in chosen:
        install_boundary(layer, options, label=name or None)
    return module


def _refuse_policy(check_fn: object, /) -> None:
    """Refuse a ``check_fn`` that names layer classes instead of testing a module: torchtune's
    ``auto_wrap_policy={Layer}`` moved over as it is, or the class itself. Called with each
    module, a set raises "not callable" and a class builds one of itself from the module."""
    classes = (list(check_fn) if isinstance(check_fn, (set, frozenset, list, tuple))
               else [check_fn] if isinstance(check_fn, type) else None)
    if classes is None and callable(check_fn):
        if _policy_classes(check_fn) or _wants_more_than_a_module(check_fn):
            _refuse_wrap_policy(check_fn)
        return
    named = _class_names(classes or [])
    test = _isinstance_test(named)
    # Each container in its own brackets: a tuple shown in braces read as a set (helper GZ).
    opened, closed = ("(", ")") if isinstance(check_fn, tuple) else \
        ("[", "]") if isinstance(check_fn, list) else ("{", "}")
    got = (f"the class {named[0]}" if isinstance(check_fn, type)
           else f"{type(check_fn).__name__} {opened}{', '.join(named)}{closed}"
           if classes is not None else describe_leaf(check_fn))
    raise CheckpointConfigError(
        "check_fn is called with each module and returns whether to checkpoint it",
        expected="a function of a module returning a bool", got=got,
        tip=f"check_fn=lambda m: {test} (what torchtune's auto_wrap_policy={{Layer}} means)")


def _wants_more_than_a_module(check_fn: Callable[..., object], /) -> bool:
    """Whether ``check_fn`` needs more than one positional argument: an FSDP wrap policy
    (``ModuleWrapPolicy``, a ``(module, recurse, nonwrapped_numel)`` function, a partial of
    ``lambda_auto_wrap_policy``), which torchtune's ``set_activation_checkpointing`` takes."""
    try:
        # Not followed through functools.wraps: a decorator adapting a policy to one module
        # is a check_fn (helper QN).
        parameters = inspect.signature(check_fn, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return False
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in parameters) > 1


def _refuse_wrap_policy(policy: Callable[..., object], /) -> None:
    """An FSDP wrap policy given as ``check_fn`` failed with Python's "missing 1 required
    positional argument: 'recurse'" from the first call (helper QL)."""
    test = _isinstance_test(_class_names(_policy_classes(policy)))
    keywords = getattr(policy, "keywords", None)  # partial(lambda_auto_wrap_policy, lambda_fn=f)
    chooser = keywords.get("lambda_fn") if isinstance(keywords, dict) else None
    raise CheckpointConfigError(
        "check_fn is called with each module and returns whether to checkpoint it; an FSDP "
        "wrap policy (called with module, recurse and nonwrapped_numel) is not one",
        expected="a function of a module returning a bool", got=_describe_keyword(policy),
        tip=(f"check_fn={_describe_keyword(chooser)}, the policy's lambda_fn (called with "
             "each module)" if callable(chooser) else
             f"check_fn=lambda m: {test} (what torchtune's auto_wrap_policy means)"))


def _class_names(classes: Iterable[object], /) -> list[str]:
    return [c.__name__ if isinstance(c, type) else repr(c) for c in classes]


def _isinstance_test(named: Sequence[str], /) -> str:
    """The ``isinstance`` a ``check_fn`` makes for the classes ``named`` (a placeholder
    ``Layer`` for none)."""
    return (f"isinstance(m, {named[0]})" if len(named) == 1
            else f"isinstance(m, ({', '.join(named)}))" if named else "isinstance(m, Layer)")


def _refuse_torch_keywords(checkpoint_wrapper_fn: object, auto_wrap_policy: object, /) -> None:
    """Refuse torch.distributed's ``checkpoint_wrapper_fn=`` and ``auto_wrap_policy=`` (also
    torchtune's ``set_activation_checkpointing`` keyword), moved over as they are: Python's
    "unexpected keyword argument" named no replacement. The tip's ``isinstance`` names the
    policy's classes where it holds them (torchtune's set, a class, FSDP's
    ``ModuleWrapPolicy``)."""
    given = {name: value for name, value in (("checkpoint_wrapper_fn", checkpoint_wrapper_fn),
                                            ("auto_wrap_policy", auto_wrap_policy))
             if value is not None}
    if not given:
        return
    test = _isinstance_test(_class_names(_policy_classes(given.get("auto_wrap_policy"))))
    keywords = " and ".join(f"{name}=" for name in given)
    raise CheckpointConfigError(
        f"apply_activation_checkpointing takes no {keywords} (torch.distributed's keyword"
        f"{'s' if len(given) > 1 else ''}): pytree_ckpt's wraps each module check_fn chooses "
        "with its own boundary, in place, with no wrapper module",
        expected="check_fn= (a function of a module returning a bool), and preserve_rng_state="
                 " or offload= for the boundary's options",
        got=", ".join(f"{name}={_describe_keyword(value)}" for name, value in given.items()),
        tip=f"apply_activation_checkpointing(model, check_fn=lambda m: {test})"
            + (", without checkpoint_wrapper_fn: the wrapper is pytree_ckpt's own (torch's "
               "checkpoint_impl and use_reentrant have no counterpart)"
               if "checkpoint_wrapper_fn" in given else ""))


def _policy_classes(policy: object, /) -> list[type]:
    """The module classes a wrap policy names: torchtune's set of them, one class, or FSDP's
    ``ModuleWrapPolicy`` (which holds them as ``_module_classes``); none for a function."""
    held = getattr(policy, "_module_classes", None)
    classes = (policy if isinstance(policy, (set, frozenset, list, tuple))
               else [policy] if isinstance(policy, type)
               else held if isinstance(held, (set, frozenset)) else [])
    return [c for c in classes if isinstance(c, type)]


def _describe_keyword(value: object, /) -> str:
    """A refused keyword's value for the message: a function or class by name, a partial
    by its function."""
    func = getattr(value, "func", None)  # functools.partial(checkpoint_wrapper, ...)
    if func is not None and callable(value):
        return f"partial({getattr(func, '__qualname__', repr(func))}, ...)"
    if isinstance(value, (set, frozenset, list, tuple)):
        return f"{type(value).__name__} {{{', '.join(_class_names(value))}}}"
    held = _policy_classes(value)
    if held and not isinstance(value, type):  # a ModuleWrapPolicy
        return f"{type(value).__name__} {{{', '.join(_class_names(held))}}}"
    name = dunder(value, "__qualname__")
    return name if isinstance(name, str) else type(value).__name__


def _chosen_by(model: nn.Module, check_fn: Callable[[nn.Module], bool], /
               ) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``check_fn`` chooses, refusing none and nested ones."""
    chosen = []
    nones = 0
    for name, m in model.named_modules():
        answer = check_fn(m)
        if isinstance(answer, (str, bytes)):
            # Read as torch reads it (by truth), "no" or "False" would choose the module, and
            # "" would not (helper PT: the message said any string was true).
            raise CheckpointConfigError(
                f"check_fn returned the string {answer!r} for {name or '(the model)'} "
                f"({type(m).__name__}): a string is read by its truth, so 'False' and 'no' "
                "would choose a module and '' would not",
                expected="True or False", got=f"{type(answer).__name__} {answer!r}",
                tip="return a bool: check_fn=lambda m: isinstance(m, DecoderLayer)")
        nones += answer is None
        if answer:
            chosen.append((name, m))
    if not chosen:
        count = sum(1 for _ in model.modules())
        # A def without its return gives None for every module (helper PT): said so.
        raise CheckpointConfigError(
            f"check_fn chose none of the modules of {type(model).__name__}: nothing would be "
            "checkpointed", expected="check_fn true for the layers to checkpoint",
            got=f"None for all {count} modules (does check_fn return its test?)"
            if nones == count else f"false for all {count} modules",
            tip="check_fn=lambda m: isinstance(m, DecoderLayer), with your layer class, or "
                "def check_fn(m): return isinstance(m, DecoderLayer)")
    for outer, _ in chosen:
        for inner, _ in chosen:
            if outer != inner and (outer == "" or inner.startswith(outer + ".")):
                # A boundary inside a boundary replays the inner layer twice in backward
                # (once in the outer's replay, once in its own): compute for no memory.
                # The model itself chosen (check_fn=lambda m: isinstance(m, nn.Sequential) on
                # a Sequential of blocks): torch.distributed's function never asks about it,
                # and wraps the blocks (helper FO); said, with the test that does the same.
                root = (" (torch.distributed's apply_activation_checkpointing never chooses "
                        "the model it is given; this one asks check_fn about it too)"
                        if outer == "" else "")
                raise CheckpointConfigError(
                    f"check_fn chose {inner!r} inside {outer or 'the model'!r}, which it also "
                    f"chose: the inner layer would be recomputed twice{root}",
                    expected="chosen modules that do not contain one another",
                    got=f"{outer or '(the model)'} and {inner}",
                    tip="make check_fn true for the layers only (isinstance(m, DecoderLayer))"
                        + ("; to leave the model out as torch does: check_fn=lambda m: m is "
                           "not model and ..." if outer == "" else ""))
    return chosen


def refuse_checkpointed_beyond(layers: Sequence[nn.Module], count: int, ratio: float,
                               refs: Sequence[str], /) -> None:
    """A layer past the first ``count`` that is checkpointed (an earlier apply with a higher
    ratio, or layers inserted in front of checkpointed ones since) would stay so, and the
    returned indices would be wrong; ``checkpoint_layers`` and ``apply_recompute_config``
    refuse before changing any layer. ``refs``: how each layer is named (``layer_refs``)."""
    first = {id(layer) for layer in layers[:count]}  # one module listed twice (helper QU)
    for index in range(count, len(layers)):
        if is_checkpointed(layers[index]) and id(layers[index]) not in first:
            raise CheckpointConfigError(
                f"{refs[index]} ({type(layers[index]).__name__}) is checkpointed, but "
                f"ratio={ratio} checkpoints only the first {count} of {len(layers)} layers",
                expected=f"layers {count}..{len(layers) - 1} not checkpointed",
                got=f"{refs[index]} checkpointed (an earlier apply with a higher ratio, or "
                    "layers inserted before it since?)",
                tip="call remove_activation_checkpointing on every layer first, then apply "
                    "the new config")


def validate_ratio(ratio: object, /) -> float:
    """``ratio`` as a float in [0, 1], or a ``CheckpointConfigError`` with a tip."""
    if (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
            or not math.isfinite(float(ratio)) or not 0.0 <= float(ratio) <= 1.0):
        raise CheckpointConfigError(
            "the checkpoint ratio must be a number in [0, 1]",
            expected="0.0 <= ratio <= 1.0 (the fraction of layers to checkpoint)",
            got=repr(ratio), tip="use 1.0 to checkpoint every layer, 0.0 for none; Megatron's "
                                 "recompute_num_layers=N of L layers is ratio=N/L (the first N)")
    return float(ratio)


def layer_count(n: int, ratio: float, /) -> int:
    """``int(n * ratio)``, forgiving float rounding: ``100 * 0.58`` is 57.99999999999999 in
    floats, and a user asking for 58% of 100 layers gets 58 (``3 * (1/3)`` still gives 1)."""
    return math.floor(n * ratio + 1e-9)


_DICT_VALUES: type = type({}.values())


def layer_labels(layers: Iterable[nn.Module], count: int, where: str, /) -> list[str]:
    """How messages name the first ``count`` of ``layers`` (a ModuleDict's ``values()`` by
    key: a view, which ``listed_layers`` does not use up; else by place in what was given).
    Not ``layers[k]``: a slice or a pipeline stage's list would name another layer of the
    model (helper GV)."""
    mapping = getattr(layers, "mapping", None) if isinstance(layers, _DICT_VALUES) else None
    if mapping is not None:
        return [f"key {key!r} of the layers given to {where}" for key in list(mapping)[:count]]
    return [f"#{index} of the layers given to {where}" for index in range(count)]


def layer_refs(layers: Iterable[nn.Module], count: int, /) -> list[str]:
    """How a tip names each of the first ``count`` of ``layers`` for the caller to index:
    ``layers['4']`` for a ModuleDict's ``values()`` (a pipeline stage keeps the model's keys:
    ``layers[0]`` was a KeyError, helper QV), else ``layers[i]``."""
    mapping = getattr(layers, "mapping", None) if isinstance(layers, _DICT_VALUES) else None
    if mapping is not None:
        return [f"layers[{key!r}]" for key in list(mapping)[:count]]
    return [f"layers[{index}]" for index in range(count)]


def listed_layers(layers: Iterable[nn.Module], where: str, /) -> list[nn.Module]:
    """``layers`` (a ``ModuleList``, a ``Sequential``, a list, ``model.children()`` or a
    generator) as a list, in order; one module or anything else that is not a module is
    refused, naming ``where``."""
    if isinstance(layers, (nn.ModuleDict, dict)):
        # Iterating over one gives its keys: torchtitan keeps model.layers in a ModuleDict.
        raise CheckpointConfigError(
            f"{where} takes a sequence of layers, not a {type(layers).__name__} (iterating "
            "over it gives its keys)",
            expected="an nn.ModuleList (model.layers), an nn.Sequential or a list of modules",
            got=f"{type(layers).__name__} with keys {list(layers)[:4]}"
                f"{' ...' if len(layers) > 4 else ''}",
            tip=f"pass model.layers.values() to {where}: its layers, in order")
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        # Given the model, the user most likely meant the layer list it holds: name it.
        lists = [name for name, child in layers.named_children()
                 if isinstance(child, (nn.ModuleList, nn.ModuleDict))]
        values = (".values()" if lists and isinstance(getattr(layers, lists[0]), nn.ModuleDict)
                  else "")
        raise CheckpointConfigError(
            f"{where} takes a sequence of layers, not one {type(layers).__name__}",
            expected="an nn.ModuleList (model.layers), an nn.Sequential or a list of modules",
            got=type(layers).__name__,
            tip=(f"pass model.{lists[0]}{values} to {where}: the layers "
                 f"{type(layers).__name__}.{lists[0]} holds; " if lists else "")
            + "apply_activation_checkpointing(module) checkpoints one module")
    listed = list(layers)
    for index, layer in enumerate(listed):
        if not isinstance(layer, nn.Module):
            raise CheckpointConfigError(
                f"{where} takes modules: layers[{index}] is not one",
                expected="nn.Module", got=type(layer).__name__,
                tip="pass model.layers (an nn.ModuleList) or a list of the layer modules")
    return listed


@refuses_torch_options
def checkpoint_layers(layers: Iterable[nn.Module], /, *, ratio: float = 1.0,
                      preserve_rng_state: bool = True,
                      offload: bool | OffloadManager | None = None,
                      verify_replay: bool = False) -> list[int]:
    """Checkpoint the first ``int(len(layers) * ratio)`` layers, forgiving float rounding;
    return their indices.

    ``offload`` is resolved once, so every layer shares one manager (one window numbering);
    ``verify_replay`` as in ``apply_activation_checkpointing``.
    """
    listed = listed_layers(layers, "checkpoint_layers")
    count = layer_count(len(listed), validate_ratio(ratio))
    labels = layer_labels(layers, count, "checkpoint_layers")
    refs = layer_refs(layers, len(listed))
    refuse_checkpointed_beyond(listed, count, ratio, refs)
    manager = resolve_offload(offload)
    warn_offload_unused(offload, count, len(listed), ratio, "checkpoint_layers")
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state, offload=manager,
                              verify_replay=verify_replay)
    # Before any changes: refused, none change.
    refuse_other_options_among(list(zip(refs, listed[:count])), options)
    refuse_reentrant_torch_wrappers(list(zip(refs, listed[:count])))
    for index, layer in enumerate(listed[:count]):
        apply_activation_checkpointing(layer, preserve_rng_state=preserve_rng_state,
                                       offload=manager if manager is not None else False,
                                       verify_replay=verify_replay)
        label_boundary(layer, labels[index])
    return list(range(count))
