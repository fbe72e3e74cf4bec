"""``KeptCallables``: a save unit that keeps everything some methods dispatch, which methods of
a layer's submodules it matches, and the wrapper each matched method gets (``_KeptMethod``, NOTE
[kept methods follow copies], NOTE [kept methods wrap what the instance had]).

``apply_recompute_config`` (save_units.py) matches the methods, refuses those that cannot be
kept, and installs the wrappers.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .eager import KEPT_CALLABLE_REASON, runs_eagerly
from .errors import CheckpointConfigError, CheckpointError
from .keep import IN_KEPT_CALLABLE
from .kept_calls import KEPT_METHOD
from .kept_ops import RecomputeTarget
from .tree import dunder

__all__ = ["KeptCallables", "kept_methods", "near_misses", "unmatched"]


class KeptCallables(RecomputeTarget):
    """Keep everything these callables dispatch: methods (functions or ``"Class.method"``).

    Each matching method of a checkpointed layer's submodules is wrapped so the ops it runs
    are kept; the wrapper is excluded from torch.compile (it must see every op).
    """

    def __init__(self, *callables_or_qualnames: Callable[..., Any] | str) -> None:
        if not callables_or_qualnames:
            raise CheckpointConfigError("KeptCallables needs at least one callable",
                                        expected="a method or 'Class.method'", got="nothing",
                                        tip="e.g. KeptCallables('Router.project')")
        # A list, not next(..., None): None itself is a bad argument.
        bad = [t for t in callables_or_qualnames if not callable(t) and not (
            isinstance(t, str) and all(t.rpartition(".")[::2]))]
        if bad:
            raise CheckpointConfigError(
                "KeptCallables takes methods, or their qualified names 'Class.method'",
                expected="e.g. KeptCallables('Router.project') or KeptCallables(Router.project)",
                got=repr(bad[0]),
                tip="name the method with its class: the unit wraps that method of every "
                    "submodule of that class in the checkpointed layers")
        self.targets = tuple(callables_or_qualnames)

    def __repr__(self) -> str:
        return f"KeptCallables{self.targets!r}"

    def matches(self, module: nn.Module, /) -> list[str]:
        """Names of ``module``'s methods that this unit keeps."""
        names = []
        classes = {c.__qualname__ for c in type(module).__mro__}
        for target in self.targets:
            if isinstance(target, str):
                owner, _, method = target.rpartition(".")
                if owner in classes and callable(getattr(type(module), method, None)):
                    names.append(method)
            else:
                name = getattr(target, "__name__", "")
                if getattr(type(module), name, None) is target:
                    names.append(name)
        return names


class _KeptMethod:
    """A module's method wrapped so every op it dispatches is kept (weak: no cycle).

    NOTE [kept methods follow copies]: installed as an instance attribute, it is copied with
    its module's ``__dict__``. A function would be shared by ``copy.deepcopy`` (functions copy
    as themselves) and would go on calling the *original* module's method, and it could not be
    pickled; this object is rebound to the copy instead, as the installed forward is.

    NOTE [kept methods wrap what the instance had]: an instance attribute already under the
    name (a patched method, a wrapper another library installed) is what eager calls: it is
    wrapped (``inner``) and called, not the class's method, and removing checkpointing puts it
    back. A static or class method is called without the module.
    """

    __slots__ = ("module_ref", "name", "inner", "bound", "kept_as", "owners", "__weakref__")
    _pytree_ckpt_kept = True  # what apply_recompute_config looks for (wrapped already)
    made = 0  # how many were made (a copy's too): an owner may have appeared (kept_owners.py)

    def __init__(self, module: nn.Module, name: str, inner: Any = None,
                 kept_as: str | None = None) -> None:
        self.module_ref = weakref.ref(module)
        self.name = name
        self.inner = inner  # the instance attribute it replaced, if any
        # The "Class.method" name the boundary's policy lists it under, fixed when installed
        # (a wrapper that later swaps the module's class, as FSDP2's fully_shard does, changes
        # nothing): the region it opens is kept by that policy alone (IN_KEPT_CALLABLE).
        self.kept_as = kept_as or f"{type(module).__qualname__}.{name}"
        # Whether the class's attribute takes the module first (a plain method), read anew at
        # each call from the class (a patched class method is honoured).
        static = inspect.getattr_static(type(module), name, None)
        self.bound = not isinstance(static, (staticmethod, classmethod)) and \
            hasattr(type(static), "__get__")
        # The boundaries keeping it (NOTE [kept methods of shared submodules] in kept_owners.py):
        # a copy's are the copy's own, found anew.
        self.owners: weakref.WeakSet[Any] = weakref.WeakSet()
        _KeptMethod.made += 1

    @property
    def __self__(self) -> nn.Module | None:
        # Like a bound method's: whoever checkpoints it (output discard) finds the module.
        return self.module_ref()

    # Excluded from torch.compile: the region flag must see every op it runs. (Lazily: a
    # class-level torch.compiler.disable imported dynamo with the package.)
    @runs_eagerly(KEPT_CALLABLE_REASON)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:  # a method taken from its module, called after the module was freed
            raise CheckpointError(
                f"the module of the kept method {self.name} no longer exists",
                expected="the module whose method this is, alive",
                got="a method kept after its module was freed",
                tip=f"call {self.name} through the module (module.{self.name}(...)), not a "
                    "method taken from it")
        kept, running = IN_KEPT_CALLABLE.get(), KEPT_METHOD.get()
        try:  # NOTE [context variables set inside the try] (keep.py)
            IN_KEPT_CALLABLE.set(kept | {self.kept_as})
            KEPT_METHOD.set(self)  # named if the replay is refused inside (kept_calls.py)
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            if self.bound:
                return getattr(type(module), self.name)(module, *args, **kwargs)
            return getattr(type(module), self.name)(*args, **kwargs)
        finally:
            try:
                KEPT_METHOD.set(running)
            finally:
                IN_KEPT_CALLABLE.set(kept)

    def __deepcopy__(self, memo: dict[int, Any]) -> _KeptMethod:
        # copy.deepcopy(module) registers the new module in memo before copying its __dict__
        # (a bound method as inner is rebound to the copy the same way).
        module = self.module_ref()
        assert module is not None  # a module being copied is alive
        return _KeptMethod(memo.get(id(module), module), self.name,
                           copy.deepcopy(self.inner, memo), self.kept_as)

    def __reduce__(self) -> Any:
        return (_KeptMethod, (self.module_ref(), self.name, self.inner, self.kept_as))


def near_misses(layers: list[nn.Module], target: KeptCallables, /) -> str:
    """What a mistyped ``Class.method`` target was likely meant to be (for the warning)."""
    import difflib  # only on this warning's path

    methods = {f"{cls.__qualname__}.{name}" for layer in layers for module in layer.modules()
               for cls in type(module).__mro__ if cls.__module__ != "builtins"
               and not cls.__module__.startswith("torch.")
               for name, value in vars(cls).items()
               if callable(value) and not name.startswith("__")}
    classes = {name.rpartition(".")[0] for name in methods}
    # A checkpointed layer's own forward is refused as a target (helper EU: it was suggested
    # for an autograd.Function's forward): never a suggestion.
    candidates = sorted(methods - {f"{cls.__qualname__}.forward" for layer in layers
                                   for cls in type(layer).__mro__})
    hints = []
    for given in (t for t in target.targets if not isinstance(t, str)):
        # A Function's own method given as such (KeptCallables(QuantFn.apply), helper LQ): the
        # same hint as for its name below.
        owner_class = dunder(given, "__self__")
        if not isinstance(owner_class, type):
            # By its qualified name's class, where that class really holds it (helper LZ: a
            # method of another class named alike got the hint).
            owner_name = str(dunder(given, "__qualname__", "")).rpartition(".")[0]
            owner_class = _autograd_function(layers, owner_name) if owner_name else None
            if owner_class is not None and \
                    getattr(owner_class, str(dunder(given, "__name__", "")), None) is not given:
                owner_class = None
        if isinstance(owner_class, type) and issubclass(owner_class, torch.autograd.Function):
            owner = owner_class.__qualname__
            hints.append(f"{owner}.{dunder(given, '__name__', '?')}: {owner!r} is a "
                         "torch.autograd.Function, whose methods autograd calls, not a module: "
                         f"keep the module method that calls {owner}.apply "
                         "(KeptCallables('Class.method'))")
    for wanted in (t for t in target.targets if isinstance(t, str)):
        owner, _, method = wanted.rpartition(".")
        function = _autograd_function(layers, owner)
        if function is not None:
            hints.append(f"{wanted!r}: {owner!r} is a torch.autograd.Function, whose "
                         "methods autograd calls, not a module: keep the module method that "
                         f"calls {owner}.apply")
            continue
        close = difflib.get_close_matches(wanted, candidates, n=1)
        where = ("" if owner in classes else
                 f"no class {owner!r} in the checkpointed layers; ") + \
            (f"did you mean {close[0]!r}?" if close else f"no method {method!r} close to it")
        hints.append(f"{wanted!r}: {where}")
    return f" ({'; '.join(hints)})" if hints else ""


def _autograd_function(layers: list[nn.Module], owner: str, /) -> type | None:
    """The ``torch.autograd.Function`` subclass ``owner`` (a dotted qualified name) names in
    the globals of the layers' modules' forwards, if any."""
    head, *rest = owner.split(".")
    for module in (m for layer in layers for m in layer.modules()):
        # Unwrapped: a decorated forward's globals are its decorator's module's (helper EX).
        # Read statically: a scripted submodule's class attribute raises on access (helper LZ:
        # an AttributeError out of the warning's hint, out of apply_recompute_config).
        forward = inspect.getattr_static(type(module), "forward", None)
        if isinstance(forward, staticmethod | classmethod):
            forward = forward.__func__
        try:
            forward = inspect.unwrap(forward) if forward is not None else None
        except Exception:  # a __wrapped__ cycle, a descriptor that raises: no hint from it
            continue
        found: Any = dunder(forward, "__globals__", {}).get(head)
        for part in rest:
            found = dunder(found, part)
        if isinstance(found, type) and issubclass(found, torch.autograd.Function):
            return found
    return None


def kept_methods(layers: list[nn.Module], target: KeptCallables
                  ) -> list[tuple[nn.Module, str]]:
    """The (module, method name) pairs of ``layers`` that ``target`` keeps."""
    return [(module, name) for layer in layers for module in layer.modules()
            for name in target.matches(module)]


def unmatched(layers: list[nn.Module], target: KeptCallables, /) -> KeptCallables | None:
    """The targets of ``target`` no method of ``layers`` matches (a name mistyped beside one
    that matches was not told: helper NQ), as a ``KeptCallables`` for ``near_misses``."""
    modules = [module for layer in layers for module in layer.modules()]
    missing = [t for t in target.targets
               if not any(KeptCallables(t).matches(module) for module in modules)]
    return KeptCallables(*missing) if missing else None
