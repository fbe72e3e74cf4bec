"""The boundary installed on a module, in place: the forward attribute that routes the module's
forward through it, copies of it, finding it, and removing it (apply.py chooses the modules).

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
import types
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

from torch import nn

from .boundary import run_boundary
from .boundary_call import BoundaryOptions
from .compiled_layers import (check_compiled_wrapper, compiled_over, warn_compiled_over,
                              warn_module_compiled)
from .eager import BOUNDARY_REASON, in_compiled_module_call, runs_eagerly
from .errors import CheckpointConfigError, CheckpointError
from .hook_outputs import has_user_forward_hooks, remove_recorder
from .kept_owners import keeping_boundary_made, kept_elsewhere, kept_wrappers
from .module_state import drop_caches
from .refusals import refuse_container, require_module
from .tree import dunder

logger = logging.getLogger(__name__)

__all__ = ["remove_activation_checkpointing", "is_checkpointed", "body_forward",
           "install_boundary", "refuse_other_options", "refuse_other_options_among"]

M = TypeVar("M", bound=nn.Module)  # the module given is the one returned, changed in place

_INSTALLED = "_pytree_ckpt_installed"
_MARKS = "_pytree_ckpt_"  # the prefix of every attribute the library sets on a module


def _class_forward(module: nn.Module, /) -> Any:
    """The forward of ``module``'s class as ``module.forward`` would find it without the
    installed one: a function bound to the module, or a class attribute without ``__get__``
    (``forward = torch.tanh``, a callable object) as it is, as Python's lookup gives it."""
    forward = type(module).forward
    # Python looks __get__ up on the type: an object answering it through its __getattr__
    # (a decorator class delegating to the function it wraps: helper HL), or raising there
    # (a dict-backed config: helper HK), is no descriptor, and eager calls it unbound.
    get = dunder(type(forward), "__get__")
    return forward if get is None else get(forward, module, type(module))


class _CheckpointedForward:
    """The ``forward`` instance attribute that sends a module's forward through the boundary.

    It also holds what was checked and told about its module (NOTE [compiled around the
    layer] in compiled_layers.py): a copy (deepcopy, pickle) gets a new one, and so is checked
    and told anew.
    """

    __slots__ = ("module_ref", "bare", "static", "options", "check_wrapper", "told", "label",
                 "__weakref__")

    def __init__(self, module: nn.Module, bare: Any, options: BoundaryOptions) -> None:
        self.module_ref = weakref.ref(module)
        self.bare = bare  # an instance-level forward that was there before, else None
        # A class forward that is a staticmethod is called unbound, as Python's lookup gives it
        # (helper EL: bound, every call raised TypeError). Read once: a class attribute access
        # cannot tell it from a function.
        self.static = isinstance(inspect.getattr_static(type(module), "forward", None),
                                 staticmethod)
        self.options = options
        if options.keep is not None and options.keep.callables:
            # NOTE [kept methods of shared submodules] in kept_owners.py
            keeping_boundary_made(self)
        # Look for torch.compile(layer) around the module: at the next call (None), at calls
        # made while such a wrapper's call runs (True), or never (False: its body is compiled).
        self.check_wrapper: bool | None = None
        self.told: set[str] = set()  # the warnings given about the module, each given once
        # Where the entry point found the module (``#3 of the layers given to
        # checkpoint_layers``, check_fn's ``model.layers.3``), named by verify_replay's
        # refusal: layers of one class look alike (helper GU).
        self.label: str | None = None

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
        forward = self.bare if self.bare is not None else \
            type(module).forward if self.static else _class_forward(module)
        return run_boundary(forward, args, kwargs, self.options, owner=module,
                            nested=None if "nested" in self.told else self._nested)

    def _nested(self) -> None:
        # NOTE [a checkpointed layer inside a checkpointed call]: a boundary is being built
        # for it inside another's pass (not where it runs plainly: frozen, no-grad).
        self.told.add("nested")
        module = self.module_ref()
        if module is not None:
            _log_nested(module, self.label)

    @property
    def __signature__(self) -> inspect.Signature:
        # The layer's own signature, for code that inspects forward (transformers' Trainer
        # drops the batch columns forward does not name; PEFT checks keywords). Not
        # __wrapped__: inspect.unwrap would hand such code the bare forward, and a call to it
        # would skip the boundary.
        return inspect.signature(self._own_forward())

    @property
    def __code__(self) -> types.CodeType:
        # The layer's own forward's code, for code that reads a module's forward as a function
        # would (torch.export reads forward.__code__ for the argument names; the call then
        # runs no boundary while it records: NOTE [when there is no boundary] in boundary.py).
        bare = self._own_forward()
        code = dunder(bare, "__code__")
        if code is None:
            raise AttributeError("__code__")
        return code  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        # Only for what normal lookup does not find. torch.jit.script compiles a forward from
        # its source and globals, which this object has not: said with the fix, rather than
        # as "no attribute '__globals__'".
        if name == "__globals__":
            module = self.module_ref()
            which = f"this {type(module).__name__}" if module is not None else "this layer"
            raise AttributeError(
                f"the forward of {which} is checkpointed by pytree_ckpt, so torch.jit.script "
                "cannot read its source (it has no __globals__). Call "
                "pytree_ckpt.remove_activation_checkpointing(layer) on each checkpointed layer "
                "before scripting: `for m in model.modules(): "
                "pytree_ckpt.remove_activation_checkpointing(m)` (docs/boundary.md, 'Shipping "
                "a trained model')")
        raise AttributeError(name)

    def _own_forward(self) -> Any:
        module = self.module_ref()
        if module is None:  # hasattr() says False, and the call says why (_module)
            raise AttributeError("the checkpointed module no longer exists")
        return self.bare if self.bare is not None else \
            type(module).forward if self.static else _class_forward(module)

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
                f"cannot copy a checkpointed {type(module).__name__} whose forward was wrapped by "
                "torch.compile (or torch.compiler.disable) after checkpointing",
                expected="the boundary as the module's forward",
                got="dynamo's wrapper of the boundary, which the copy would share "
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


def _log_nested(module: nn.Module, label: str | None, /) -> None:
    """NOTE [a checkpointed layer inside a checkpointed call]: a layer checkpointed and then its
    model too (``checkpoint_layers(model.layers)`` and ``apply_activation_checkpointing(
    model)``, in either order, or ``checkpoint(model, x)``) runs each layer's forward three
    times a step where eager runs it once and one boundary twice: gradients stay exact, and the
    outer boundary saves no memory over the layers' (its replay recomputes every layer input
    again). ``check_fn`` choosing both is refused at once (apply.py); two calls were silent
    (helper PT). Logged once per layer, where its first boundary is built inside another
    boundary's pass (its replay: the original pass runs the layer plainly, under no-grad; not
    where the layer runs plainly in the replay too, frozen: helper PX), the only place both
    orders can be seen (a list of layers names no ancestor). Logged, not a Python warning:
    nesting on purpose (a sub-block inside a layer, to lower the peak of the layer's own
    backward) is exact and documented, and the message says how to quiet it."""
    name = f"{type(module).__name__} ({label})" if label else type(module).__name__
    logger.warning(
        "the checkpointed %s was called inside another checkpointed call (its model, or a "
        "layer, checkpointed too): each step runs its forward once more than one boundary "
        "would (gradients stay exact). Tip: checkpoint the layers or the model, not both "
        "(remove_activation_checkpointing on one of them); if the nesting is on purpose (a "
        "sub-block inside a checkpointed layer), quiet this with "
        "logging.getLogger('pytree_ckpt.module').setLevel(logging.ERROR)", name)


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
    require_module(module, "is_checkpointed", "pass the module itself, is_checkpointed(layer); "
                   "for a list, [is_checkpointed(layer) for layer in model.layers]")
    return _installed(module) is not None


def install_boundary(module: M, options: BoundaryOptions, /, *,
                     label: str | None = None) -> M:
    """Install a boundary with ``options`` on ``module``; ``apply_activation_checkpointing``'s
    core, also used by ``apply_recompute_config``. ``label``: where the caller found the
    module (``#3 of the layers given to ...``), kept for messages (a boundary already there
    takes it: ``label_boundary``)."""
    if refuse_other_options(module, options):
        label_boundary(module, label)
        return module
    forward = _CheckpointedForward(module, module.__dict__.get("forward"), options)
    forward.label = label
    module.__dict__["forward"] = forward
    module.__dict__[_INSTALLED] = forward
    return module


def label_boundary(module: nn.Module, label: str | None, /) -> None:
    """Give the boundary on ``module`` the ``label`` (see ``install_boundary``): the latest
    entry point that found the module names it (helper QT: after a layer was inserted in
    front and the layers applied again, the first label named another layer's place)."""
    installed = _installed(module)
    if installed is not None and label is not None:
        installed.label = label


def described(fn: Any, /) -> str:
    """``fn``'s name in a message, with the label of the boundary on its module, if any
    (``DecoderLayer (model.layers.3)``)."""
    from .module_state import owning_module
    from .refusals import fn_name

    owner = owning_module(fn)
    installed = _installed(owner) if owner is not None else None
    label = installed.label if installed is not None else None
    return f"{fn_name(fn)} ({label})" if label else fn_name(fn)


def refuse_other_options(module: nn.Module, options: BoundaryOptions, /) -> bool:
    """Whether ``module`` already has a boundary with ``options``; raises if it has one with
    other options (``refuse_other_options_among``, for the module alone)."""
    refuse_other_options_among([("", module)], options,
                               undo="remove_activation_checkpointing(module)")  # its own
    return _installed(module) is not None


def refuse_other_options_among(layers: Sequence[tuple[str, nn.Module]],
                               options: BoundaryOptions, /, *, undo: str | None = None) -> None:
    """Refuse ``layers`` ((how the caller names it, module) pairs) if any is checkpointed with
    other options than ``options``, naming every such one in one refusal: the tip named the
    first, and following it met the same refusal for the next (helper QT). ``undo``: one call
    that removes them all (the module a ``check_fn`` chose them in)."""
    differing = []
    for index, (ref, layer) in enumerate(layers):
        # A container (ModuleList, ModuleDict): nothing calls its forward, so a boundary there
        # would checkpoint nothing, silently.
        refuse_container(layer, "a boundary on it would never run, and its layers would not "
                         "be checkpointed", index=index if undo is None else None)
        installed = _installed(layer)
        if installed is not None and installed.options != options:
            differing.append((ref, layer, installed))
    if not differing:
        return
    refs = [ref for ref, _, _ in differing]
    fields = [field.name for field in dataclasses.fields(BoundaryOptions)
              if any(getattr(i.options, field.name) != getattr(options, field.name)
                     for _, _, i in differing)]
    # Each layer's own where they differ among themselves (helpers QW, QX: the first one's,
    # then the first three's, were shown).
    groups: dict[str, list[str]] = {}  # each set of values shown, with the layers holding it
    for ref, _, i in differing:
        groups.setdefault(_describe_options(i.options, fields), []).append(ref)
    as_installed = next(iter(groups)) if len(groups) == 1 else "; ".join(
        f"{', '.join(held[:3])}{f' and {len(held) - 3} more' if len(held) > 3 else ''}: {text}"
        for text, held in groups.items())
    shown = ", ".join(f"{ref} ({type(layer).__name__})" if ref else type(layer).__name__
                      for ref, layer, _ in differing[:3]) + (
        f" and {len(differing) - 3} more" if len(differing) > 3 else "")
    # A check_fn's choices are named by path, no expression: ``undo`` removes them all.
    each = undo if undo is not None else (
        ", ".join(f"remove_activation_checkpointing({ref})" for ref in refs) if len(refs) <= 3
        else "remove_activation_checkpointing(layer) for each layer given")
    env = (" (offload=None reads XTUNER_ACTIVATION_OFFLOAD: a value changed between two "
           "applies counts)" if "offload" in fields else "")
    raise CheckpointConfigError(
        f"{shown} {'are' if len(differing) > 1 else 'is'} already checkpointed with other "
        f"options: {', '.join(fields)} {'differ' if len(fields) > 1 else 'differs'}",
        expected="as installed: " + as_installed,
        got="as requested now: " + _describe_options(options, fields),
        tip=f"call {each} first, then apply again{env}"
            + ("; or wrap the layers once, with every option in one call: "
               "apply_recompute_config(layers, config, targets, offload=...)"
               if "keep" in fields else ""))


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


def remove_activation_checkpointing(module: M, /) -> M:
    """Undo ``apply_activation_checkpointing`` or ``apply_recompute_config`` on ``module``.

    On a module that is not checkpointed itself (the model or list given to
    ``checkpoint_layers``, ``apply_recompute_config`` or a ``check_fn``), it is undone on every
    checkpointed module inside it, and what boundaries left on the rest of its tree is taken
    off (a submodule swapped out of a checkpointed layer). A no-op where there is none (and on
    a module whose ``forward`` was assigned over the boundary since: that forward stays, while
    the checkpointed modules inside it are undone; a ``torch.compile`` wrapper of the boundary
    goes with it, NOTE [compiled over the boundary] in compiled_layers.py); methods wrapped by
    its save units are restored too, but for those another layer still checkpointed keeps
    (NOTE [kept methods of shared submodules] in kept_owners.py).
    """
    require_module(module, "remove_activation_checkpointing", "pass the module itself; for a "
                   "list, for layer in model.layers: remove_activation_checkpointing(layer)")
    drop_caches(module)
    installed = _installed(module)
    module.__dict__.pop(_INSTALLED, None)
    if installed is None:
        # Never wrapped (or its forward replaced since): the checkpointed modules inside it,
        # then what boundaries left on the rest of its tree: a submodule swapped out of a
        # checkpointed layer between steps, unwrapped by itself (helper QT: it kept its
        # marks, recorder and kept-method wrapper, its pickle naming pytree_ckpt).
        for sub in list(module.modules())[1:]:
            if _installed(sub) is not None:
                remove_activation_checkpointing(sub)
        _undo_left(module)
        return module
    _undo_left(module)
    bare = installed.bare
    if module.__dict__.get("_compiled_call_impl") is not None:
        # module.compile() of the checkpointed layer compiled nothing through the boundary,
        # and left on, it would refuse (fullgraph) or warn again once the layer is checkpointed
        # anew, whatever its body: removal takes it away, as a wrapper compiled over the
        # boundary goes (compile the module again after removal to compile it unwrapped).
        logger.info("%s: module.compile()'s compiled call goes with the boundary",
                    type(module).__name__)
        module.__dict__["_compiled_call_impl"] = None
    # NOTE [compiled over the boundary] in compiled_layers.py
    if module.__dict__.get("forward") is not installed:
        logger.info("%s: the torch.compile wrapper put over its boundary goes with it",
                    type(module).__name__)
    if bare is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = bare
    return module


def _undo_left(module: nn.Module, /) -> None:
    """What boundaries put on ``module``'s tree, less what is behind another boundary. A
    module with forward hooks of the user's keeps its recorder (NOTE [a recorder stays] in
    hook_outputs.py): a call waiting for its backward replays them (helper QW: a removal
    between a forward and its backward took it, and the pending replay was refused)."""
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
        if not has_user_forward_hooks(sub):
            remove_recorder(sub)  # NOTE [a recorder stays] in hook_outputs.py
        # What the boundary noted on the modules (caches, warnings given, state seen changing):
        # relearned at the first calls of a boundary applied again, and, left, a pickle of the
        # unwrapped model would still name pytree_ckpt's classes (a warning's Told marker).
        for name in [name for name in sub.__dict__ if name.startswith(_MARKS)]:
            del sub.__dict__[name]


def _own_submodules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules, without those behind another boundary (their save
    units are theirs to remove)."""
    found, stack = [], [module]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += [m for m in current.children() if _installed(m) is None]
    return found
