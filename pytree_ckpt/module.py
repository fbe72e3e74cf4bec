"""Routing a module's forward through the boundary, in place, and choosing layers by ratio.

NOTE [in-place wrapping]: the boundary is installed as an instance attribute ``forward`` on the
module itself, so the module keeps its class, parameters, buffers, submodules, names and
``state_dict`` keys (no ``_checkpoint_wrapped_module.`` prefix). ``nn.Module.__call__`` still
runs the forward pre-hooks and hooks (FSDP2's unshard/reshard among them) *outside* the
boundary: the replay in backward calls only the bare forward. The installed callable holds the
module through a weak reference, so wrapping creates no reference cycle.

NOTE [the boundary stays eager]: the installed callable is opaque to dynamo
(``eager.runs_eagerly``: torch's lazy form of ``torch.compiler.disable``, with a reason), so
``torch.compile(model)``, ``layer.compile()`` or any compiled caller graph-breaks at the layer
call and runs the boundary eagerly (``torch.compile(layer)`` is told so: NOTE [compiled around
the layer] in compiled_layers.py). Traced, it broke:
``layer.compile()`` recursed without end (dynamo rebuilt ``type(module).forward.__get__(module)``
as the attribute ``module.forward``, which is this callable again) and ``torch.compile(model)``
raised ``ReplayMismatchError`` (the traced flatten lost the PyTree namespace). To compile a
layer's *body*, install a compiled forward before wrapping
(``layer.forward = torch.compile(layer.forward)``): it is kept as ``bare`` and called in the
original pass and in the replay, and a ``torch.compile``d function compiles even when called
from a disabled region. Dynamo is imported at the first *call* (about a second; a first
backward imports it anyway), never by ``import pytree_ckpt``. A copy (deepcopy, pickle) of a
module whose forward was replaced by something other than its own bound method is refused:
it would keep computing with the original's weights.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from .boundary import run_boundary
from .boundary_call import BoundaryOptions
from .compiled_layers import (check_compiled_wrapper, compiled_over, warn_compiled_over,
                              warn_module_compiled)
from .eager import BOUNDARY_REASON, in_compiled_module_call, runs_eagerly
from .errors import CheckpointConfigError, CheckpointError
from .hook_outputs import remove_recorder
from .kept_owners import keeping_boundary_made, kept_elsewhere, kept_wrappers
from .module_state import drop_caches
from .refusals import refuse_container
from .tree import describe_leaf

if TYPE_CHECKING:  # offload imports this package's errors: imported lazily at run time
    from offload import OffloadManager

OFFLOAD_ENV = "XTUNER_ACTIVATION_OFFLOAD"

logger = logging.getLogger(__name__)

__all__ = ["apply_activation_checkpointing", "remove_activation_checkpointing",
           "is_checkpointed", "checkpoint_layers", "resolve_offload", "body_forward",
           "install_boundary", "layer_count", "refuse_checkpointed_beyond", "refuse_other_options",
           "validate_ratio"]

_INSTALLED = "_pytree_ckpt_installed"


class _CheckpointedForward:
    """The ``forward`` instance attribute that sends a module's forward through the boundary.

    It also holds what was checked and told about its module (NOTE [compiled around the
    layer] in compiled_layers.py): a copy (deepcopy, pickle) gets a new one, and so is checked
    and told anew.
    """

    __slots__ = ("module_ref", "bare", "options", "check_wrapper", "told", "__weakref__")

    def __init__(self, module: nn.Module, bare: Any, options: BoundaryOptions) -> None:
        self.module_ref = weakref.ref(module)
        self.bare = bare  # an instance-level forward that was there before, else None
        self.options = options
        if options.keep is not None and options.keep.callables:
            # NOTE [kept methods of shared submodules] in kept_owners.py
            keeping_boundary_made(self)
        # Look for torch.compile(layer) around the module: at the next call (None), at calls
        # made while such a wrapper's call runs (True), or never (False: its body is compiled).
        self.check_wrapper: bool | None = None
        self.told: set[str] = set()  # the warnings given about the module, each given once

    @runs_eagerly(BOUNDARY_REASON)  # NOTE [the boundary stays eager]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:
            module = self._module()  # refuses
        if module.__dict__.get("forward") is not self:
            warn_compiled_over(module, self)
        if module.__dict__.get("_compiled_call_impl") is not None:
            warn_module_compiled(module, self)
        check = self.check_wrapper
        if check is None or (check and in_compiled_module_call()):
            # NOTE [compiled around the layer] in compiled_layers.py
            check_compiled_wrapper(module, self)
        forward = self.bare if self.bare is not None else type(module).forward.__get__(module)
        return run_boundary(forward, args, kwargs, self.options, owner=module)

    @property
    def __signature__(self) -> inspect.Signature:
        # The layer's own signature, for code that inspects forward (transformers' Trainer
        # drops the batch columns forward does not name; PEFT checks keywords). Not
        # __wrapped__: inspect.unwrap would hand such code the bare forward, and a call to it
        # would skip the boundary.
        module = self.module_ref()
        if module is None:  # hasattr() says False, and the call says why (_module)
            raise AttributeError("__signature__")
        forward = self.bare if self.bare is not None else type(module).forward.__get__(module)
        return inspect.signature(forward)

    def _module(self) -> nn.Module:
        module = self.module_ref()
        if module is None:
            raise CheckpointError(
                "the checkpointed module no longer exists", expected="the module whose forward "
                "this is, alive", got="a forward kept after its module was freed",
                tip="call the module itself (module(...)), not a forward taken from it")
        return module

    def _bare_for(self, twin: nn.Module) -> Any:
        # An instance-level forward must follow the copy: a bound method of the module is
        # rebound; anything else (a compiled forward) would keep computing with the original's
        # weights, so copying is refused rather than silently wrong.
        bare = self.bare
        if bare is None:
            return None
        if isinstance(bare, types.MethodType) and bare.__self__ is self.module_ref():
            return types.MethodType(bare.__func__, twin)
        raise CheckpointError(
            f"cannot copy a checkpointed {type(twin).__name__} whose forward was replaced "
            "before wrapping",
            expected="no instance-level forward, or a bound method of the module",
            got=type(bare).__name__,
            tip="copy the module first, then compile its forward and wrap each copy")

    def __deepcopy__(self, memo: dict[int, Any]) -> _CheckpointedForward:
        # copy.deepcopy(module) registers the new module in memo before copying its __dict__.
        module = self._module()
        twin = memo.get(id(module), module)
        forward = module.__dict__.get("forward")
        if forward is not self and compiled_over(forward, self):
            # A torch.compile wrapper over the boundary (NOTE [compiled over the boundary] in
            # compiled_layers.py) is a function, which deepcopy shares: the copy's forward
            # would run the original's boundary, with the original's weights, silently.
            raise CheckpointError(
                f"cannot copy a checkpointed {type(module).__name__} whose forward was compiled "
                "after checkpointing", expected="the boundary as the module's forward",
                got="torch.compile's wrapper of the boundary, which the copy would share "
                "(computing with the original's weights)",
                tip="remove_activation_checkpointing(layer) (which drops the compiled wrapper), "
                    "copy, then compile each copy's body and checkpoint it (docs/scaling.md, "
                    "'Wrapping order')")
        return _CheckpointedForward(twin, self._bare_for(twin), self.options)

    def __reduce__(self) -> Any:
        module = self._module()
        bare = self._bare_for(module)  # refuses what could not come back right
        name = None if bare is None else bare.__func__.__name__
        return (_restore_forward, (module, name, self.options))


def _restore_forward(module: nn.Module, method: str | None,
                     options: BoundaryOptions) -> _CheckpointedForward:
    bare = None if method is None else types.MethodType(getattr(type(module), method), module)
    return _CheckpointedForward(module, bare, options)


def _installed(module: nn.Module) -> _CheckpointedForward | None:
    """The boundary installed on ``module`` and still in effect: a ``forward`` assigned over it
    since (by the user) means it is not, unless it is a compiled wrapper of it (NOTE [compiled
    over the boundary] in compiled_layers.py)."""
    installed = module.__dict__.get(_INSTALLED)
    if installed is None:
        return None
    forward = module.__dict__.get("forward")
    return installed if forward is installed or compiled_over(forward, installed) else None


def body_forward(module: nn.Module, /) -> Any:
    """The forward that runs inside the boundary (or would): the instance-level ``forward``
    installed before wrapping (a compiled one), else ``None`` for the class's own."""
    installed = _installed(module)
    return installed.bare if installed is not None else module.__dict__.get("forward")


def is_checkpointed(module: nn.Module, /) -> bool:
    """Whether ``apply_activation_checkpointing`` is in effect on ``module``."""
    return _installed(module) is not None


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


def apply_activation_checkpointing(module: nn.Module, /, *, preserve_rng_state: bool = True,
                                   offload: bool | OffloadManager | None = None,
                                   check_fn: Callable[[nn.Module], bool] | None = None
                                   ) -> nn.Module:
    """Route ``module``'s forward through the boundary, in place; returns ``module``.

    ``offload``: ``None`` reads ``XTUNER_ACTIVATION_OFFLOAD`` (``1``/``true`` on, ``0``/
    ``false``/unset off); ``True``/``False`` override it; a manager is used as given. With
    offload on, each call opens a window over the call's input tensor leaves.
    ``check_fn``: as in torch.distributed's function of this name, checkpoint each module of
    ``module`` (itself included) for which it returns true, instead of ``module`` itself; one
    manager serves them all. Applying again with the same options is a no-op; with other
    options it raises (remove it first). See NOTE [in-place wrapping].
    """
    if not isinstance(module, nn.Module):
        raise CheckpointConfigError(
            "apply_activation_checkpointing expects an nn.Module",
            expected="nn.Module", got=type(module).__name__,
            tip="wrap a plain function with pytree_ckpt.checkpoint(fn, *args) instead")
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload))
    if check_fn is None:
        return install_boundary(module, options)
    _refuse_policy(check_fn)
    chosen = _chosen_by(module, check_fn)
    for _, layer in chosen:  # before any changes: refused, none change
        refuse_other_options(layer, options)
    for _, layer in chosen:
        install_boundary(layer, options)
    return module


def _refuse_policy(check_fn: object, /) -> None:
    """Refuse a ``check_fn`` that names layer classes instead of testing a module: torchtune's
    ``auto_wrap_policy={Layer}`` moved over as it is, or the class itself. Called with each
    module, a set raises "not callable" and a class builds one of itself from the module."""
    classes = (list(check_fn) if isinstance(check_fn, (set, frozenset, list, tuple))
               else [check_fn] if isinstance(check_fn, type) else None)
    if classes is None and callable(check_fn):
        return
    named = [c.__name__ if isinstance(c, type) else repr(c) for c in classes or []]
    test = (f"isinstance(m, {named[0]})" if len(named) == 1
            else f"isinstance(m, ({', '.join(named)}))" if named else "isinstance(m, Layer)")
    got = (f"the class {named[0]}" if isinstance(check_fn, type)
           else f"{type(check_fn).__name__} {{{', '.join(named)}}}" if classes is not None
           else describe_leaf(check_fn))
    raise CheckpointConfigError(
        "check_fn is called with each module and returns whether to checkpoint it",
        expected="a function of a module returning a bool", got=got,
        tip=f"check_fn=lambda m: {test} (what torchtune's auto_wrap_policy={{Layer}} means)")


def _chosen_by(model: nn.Module, check_fn: Callable[[nn.Module], bool], /
               ) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``check_fn`` chooses, refusing none and nested ones."""
    chosen = [(name, m) for name, m in model.named_modules() if check_fn(m)]
    if not chosen:
        raise CheckpointConfigError(
            f"check_fn chose none of the modules of {type(model).__name__}: nothing would be "
            "checkpointed", expected="check_fn true for the layers to checkpoint",
            got=f"false for all {sum(1 for _ in model.modules())} modules",
            tip="check_fn=lambda m: isinstance(m, DecoderLayer), with your layer class")
    for outer, _ in chosen:
        for inner, _ in chosen:
            if outer != inner and (outer == "" or inner.startswith(outer + ".")):
                # A boundary inside a boundary replays the inner layer twice in backward
                # (once in the outer's replay, once in its own): compute for no memory.
                raise CheckpointConfigError(
                    f"check_fn chose {inner!r} inside {outer or 'the model'!r}, which it also "
                    "chose: the inner layer would be recomputed twice",
                    expected="chosen modules that do not contain one another",
                    got=f"{outer or '(the model)'} and {inner}",
                    tip="make check_fn true for the layers only (isinstance(m, DecoderLayer))")
    return chosen


def install_boundary(module: nn.Module, options: BoundaryOptions, /) -> nn.Module:
    """Install a boundary with ``options`` on ``module``; ``apply_activation_checkpointing``'s
    core, also used by ``apply_recompute_config``."""
    if refuse_other_options(module, options):
        return module
    forward = _CheckpointedForward(module, module.__dict__.get("forward"), options)
    module.__dict__["forward"] = forward
    module.__dict__[_INSTALLED] = forward
    return module


def refuse_other_options(module: nn.Module, options: BoundaryOptions, /, *,
                         index: int | None = None) -> bool:
    """Whether ``module`` already has a boundary with ``options``; raises if it has one with
    other options (callers check every layer before changing any). ``index``: the module's
    place in a layer list, named in the message (layers of one class look alike)."""
    # A container (ModuleList, ModuleDict): nothing calls its forward, so a boundary there
    # would checkpoint nothing, silently.
    refuse_container(module, "a boundary on it would never run, and its layers would not be "
                     "checkpointed", index=index)
    installed = _installed(module)
    if installed is not None and installed.options != options:
        name = type(module).__name__
        where, ref = (name, "module") if index is None else \
            (f"layer {index} ({name})", f"layers[{index}]")
        fields = [field.name for field in dataclasses.fields(BoundaryOptions)
                  if getattr(installed.options, field.name) != getattr(options, field.name)]
        env = (" (offload=None reads XTUNER_ACTIVATION_OFFLOAD: a value changed between two "
               "applies counts)" if "offload" in fields else "")
        raise CheckpointConfigError(
            f"{where} is already checkpointed with other options: {', '.join(fields)} "
            f"{'differ' if len(fields) > 1 else 'differs'}",
            expected="as installed: " + _describe_options(installed.options, fields),
            got="as requested now: " + _describe_options(options, fields),
            tip=f"call remove_activation_checkpointing({ref}) first, then apply again{env}")
    return installed is not None


def _describe_options(options: BoundaryOptions, fields: list[str], /) -> str:
    """The ``fields`` of ``options``, as a user set them (a manager by its config)."""
    from offload.defaults import is_default_manager

    parts = []
    for field in fields:
        value = getattr(options, field)
        if field == "offload":
            value = "off" if value is None else (
                f"the default manager (offload=True) on {value.device}"
                if is_default_manager(value) else
                f"an OffloadManager({value.config}) on {value.device}, id {id(value):#x}")
        parts.append(f"{field}={value}")
    return ", ".join(parts)


def remove_activation_checkpointing(module: nn.Module, /) -> nn.Module:
    """Undo ``apply_activation_checkpointing`` or ``apply_recompute_config`` on ``module``.

    A no-op on an unwrapped module (and on one whose ``forward`` was assigned over the
    boundary since: that forward stays; a ``torch.compile`` wrapper of the boundary goes with
    it, NOTE [compiled over the boundary] in compiled_layers.py); methods wrapped by its save
    units are restored too, but for those another layer still checkpointed keeps (NOTE [kept
    methods of shared submodules] in kept_owners.py).
    """
    drop_caches(module)
    installed = _installed(module)
    module.__dict__.pop(_INSTALLED, None)
    if installed is None:
        return module  # never wrapped (or its forward replaced since): nothing to undo
    # Methods its save units wrapped (KeptCallables), in submodules behind a boundary of their
    # own too: its units keep those as well (in its replay, their original pass is taken from
    # its records). NOTE [kept methods of shared submodules] in kept_owners.py: not those
    # another layer keeps.
    wrapped = kept_wrappers(module)
    if wrapped:
        elsewhere = kept_elsewhere(module, wrapped, _installed)
        for sub, name, kept in wrapped:
            if (id(sub), name) in elsewhere:
                continue
            # NOTE [kept methods wrap what the instance had] (kept_callables.py)
            if kept.inner is None:
                del sub.__dict__[name]
            else:
                sub.__dict__[name] = kept.inner
    for sub in _own_submodules(module):
        remove_recorder(sub)  # NOTE [a recorder stays] in hook_outputs.py
    bare = installed.bare
    # NOTE [compiled over the boundary] in compiled_layers.py
    if module.__dict__.get("forward") is not installed:
        logger.info("%s: the torch.compile wrapper put over its boundary goes with it",
                    type(module).__name__)
    if bare is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = bare
    return module


def _own_submodules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules, without those behind another boundary (their save
    units are theirs to remove)."""
    found, stack = [], [module]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += [m for m in current.children() if _installed(m) is None]
    return found


def refuse_checkpointed_beyond(layers: Sequence[nn.Module], count: int, ratio: float, /
                               ) -> None:
    """A layer past the first ``count`` that is checkpointed (an earlier apply with a higher
    ratio, or layers inserted in front of checkpointed ones since) would stay so, and the
    returned indices would be wrong; ``checkpoint_layers`` and ``apply_recompute_config``
    refuse before changing any layer."""
    for index in range(count, len(layers)):
        if is_checkpointed(layers[index]):
            raise CheckpointConfigError(
                f"layer {index} ({type(layers[index]).__name__}) is checkpointed, but "
                f"ratio={ratio} checkpoints only the first {count} of {len(layers)} layers",
                expected=f"layers {count}..{len(layers) - 1} not checkpointed",
                got=f"layers[{index}] checkpointed (an earlier apply with a higher ratio, or "
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


def checkpoint_layers(layers: Iterable[nn.Module], /, *, ratio: float = 1.0,
                      preserve_rng_state: bool = True,
                      offload: bool | OffloadManager | None = None) -> list[int]:
    """Checkpoint the first ``int(len(layers) * ratio)`` layers; return their indices.

    ``offload`` is resolved once, so every layer shares one manager (one window numbering).
    """
    listed = listed_layers(layers, "checkpoint_layers")
    count = layer_count(len(listed), validate_ratio(ratio))
    refuse_checkpointed_beyond(listed, count, ratio)
    manager = resolve_offload(offload)
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state, offload=manager)
    for index, layer in enumerate(listed[:count]):  # before any changes: refused, none change
        refuse_other_options(layer, options, index=index)
    for layer in listed[:count]:
        apply_activation_checkpointing(layer, preserve_rng_state=preserve_rng_state,
                                       offload=manager if manager is not None else False)
    return list(range(count))
