"""What a reused call's fn reaches that gives its floats a graph (rule 3 of
``reuse_during_recompute``, NOTE [differentiable results are refused where grad is on] in
frozen.py): a module with a trainable parameter, or a tensor that requires grad, found from
fn's own places (its module, the call's arguments, a partial's bound values, a callable
object's attributes, defaults, closure cells, globals read) on through containers, the
attributes fn's code reads and the user's functions it reaches (NOTE [what fn reaches with
grad]).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .function_reach import (attribute, attribute_names, attributes_read, called,
                             cell_contents, defaults_of, globals_of, globals_read,
                             library_code, library_package, unwrap_partials)
from .module_state import owning_module
from .tree import FlatTree, dunder, leaf_paths

__all__ = ["Reach", "argument_path", "grad_reach", "reach_short", "reach_words"]


class Reach(NamedTuple):
    """What gives fn's floats a graph: a module with a trainable parameter (``module``), or a
    tensor that requires grad (``module`` None); ``place`` says where fn reaches it ("" for fn
    itself or its owner)."""

    module: nn.Module | None
    place: str


def grad_reach(fn: Callable[..., Any], call: FlatTree, /) -> Reach | None:
    """NOTE [what fn reaches with grad]: rule 3's places, in order: fn itself or its owner,
    the modules among the call's arguments, the values a ``functools.partial`` binds, a plain
    callable object's attributes (or those of the plain object, or the class, a method is
    bound to; class attributes of its class and user base classes included), the function's
    argument defaults (``lambda x, g=gate: ...``), its closure cells
    and the globals its code reads. From each place the look goes on (``_Look``) into a
    dict, list or tuple of at most 64 values (``GATES["router"]``), and into the attributes of
    a plain object, a namedtuple, a class, a Python module or a frozen module whose names fn's
    code reads (``self.cfg.gate``: cfg, gate; a property's getter or a method adds the names
    it reads), and into what a function of the user's found there holds (a helper fn calls),
    up to _STEPS steps (docs/limits.md, "Plain functions (closures)")."""
    owner = owning_module(fn)
    if owner is not None and _trainable(owner):
        return Reach(owner, "")
    for j, leaf in enumerate(call.leaves):
        if isinstance(leaf, nn.Module) and _trainable(leaf):
            return Reach(leaf, argument_path(call, j))
    function, holder, bound = called(fn)  # NOTE [the function fn calls]
    # A frozen owner is looked in too: the plain attributes its method reads (self.scale).
    places: list[tuple[str, Any]] = [("its module", owner)] if owner is not None else []
    places += bound
    if isinstance(holder, torch.Tensor):  # a tensor's method: scores.topk
        places.append(("the tensor its method is bound to", holder))
    code = dunder(function, "__code__")
    look = _Look(attributes_read(code))
    # Class attributes are looked at last: a large class table opened first spent the look's
    # budget before the places above (helper FW).
    last: list[tuple[str, Any]] = []
    if isinstance(holder, type):  # a classmethod: its class's attributes (cls.gate)
        last = _class_places(holder, look.read, set(), metaclass=True, calling=function)
    elif holder is not None and not isinstance(holder, (nn.Module, types.ModuleType)):
        names = attribute_names(holder)
        places += [(f"attribute {name!r} of its {type(holder).__name__}",
                    attribute(holder, name)) for name in names]
        # and its class's, where the instance has none of that name (helper FQ: a router held
        # as a class attribute, self.gate, got no gradient, silently)
        last = _class_places(type(holder), look.read, set(names), metaclass=False,
                             calling=function)
    places += [(f"default of {name!r}", value) for name, value in defaults_of(function)]
    for name, cell in zip(getattr(code, "co_freevars", ()),
                          dunder(function, "__closure__") or ()):
        places.append((f"closure variable {name!r}", cell_contents(cell)))
    space = globals_of(function)
    places += [(f"global {name!r}", space.get(name)) for name in globals_read(code)]
    for place, value in places + last:
        found = look(place, "", value, _STEPS)
        if found is not None:
            return found
    return None


# How far the look goes from a place: into containers and read attributes, this many steps
# (self.cfg.router.gate is three); at most _VALUES values are looked at in all, so a call whose
# fn reaches large object graphs costs a bounded look each time it returns floats.
_STEPS = 4
_VALUES = 512
# A dict, list or tuple is opened when it holds at most this many values (a registry of
# modules; a larger one, a table of anything, is left unopened).
_OPENED = 64


class _Look:
    """One look from rule 3's places at what they hold: each value opened once, or again when
    met nearer a place (with more steps left) than before."""

    def __init__(self, read: frozenset[str], /) -> None:
        self.read = set(read)  # the attribute names fn's code reads (and its properties')
        self.opened: dict[int, int] = {}  # id of a value opened: the steps it had left
        self.budget = _VALUES

    def __call__(self, place: str, path: str, value: Any, steps: int, /) -> Reach | None:
        if isinstance(value, types.MethodType):  # a bound method held: gate.forward
            self.read.update(attributes_read(dunder(value.__func__, "__code__")))
            value = value.__self__  # (and what its code reads of it: holder.score's self.gate)
        if isinstance(value, torch.Tensor):
            return Reach(None, _where(place, path)) if value.requires_grad else None
        if isinstance(value, nn.Module) and _trainable(value):
            return Reach(value, _where(place, path))
        self.budget -= 1
        if steps == 0 or self.budget < 0 or self.opened.get(id(value), -1) >= steps:
            return None
        self.opened[id(value)] = steps
        for step, v in self._inside(value):
            found = self(place, path + step, v, steps - 1)
            if found is not None:
                return found
        return None

    def _inside(self, value: Any, /) -> list[tuple[str, Any]]:
        """What the look goes on to from ``value``: a container's items, or the attributes
        (its own, its class's) whose names fn's code reads."""
        read = self.read
        if isinstance(value, types.FunctionType):
            return self._helper(value)
        if isinstance(value, functools.partial):  # score = partial(_score, gate=gate)
            inner, bound = unwrap_partials(value)
            return [(f" via partial: {where}", v) for where, v in bound] + [("", inner)]
        fields = getattr(type(value), "_fields", None)
        if isinstance(value, tuple) and isinstance(fields, tuple):  # a namedtuple: cfg.gate
            return [(f".{name}", v) for name, v in zip(fields, value) if name in read]
        if isinstance(value, (dict, list, tuple)):  # OrderedDict, defaultdict included
            if len(value) > _OPENED:
                return []
            items = dict.items(value) if isinstance(value, dict) else enumerate(value)
            return [(f"[{_key(key)}]", v) for key, v in items]
        if isinstance(value, nn.Module):  # frozen: its plain attributes and submodules read
            own = vars(value)
            return [(f".{name}", own[name] if name in own else own["_modules"][name])
                    for name in sorted(read) if name in own or name in own["_modules"]]
        if isinstance(value, types.ModuleType):  # a Python module as a namespace: state.gate
            if library_package(value.__name__):  # torch, F, math: nothing of the user's
                return []
            space = vars(value)
            return [(f".{name}", space[name]) for name in sorted(read) if name in space]
        if isinstance(value, type):  # a class read as a namespace: Routers.gate
            if library_code(value):
                return []
            return [(f".{name}", v) for name in sorted(read)
                    if (v := _class_attribute(value, name, read)) is not None]
        if not _plain_object(value):
            return []
        names = attribute_names(value)
        # First the class's: a property's getter adds the names it reads (self._gate).
        from_class = [(name, _class_attribute(type(value), name, read))
                      for name in sorted(read - set(names))]
        return [(f".{name}", attribute(value, name)) for name in names if name in read] + \
            [(f".{name}", v) for name, v in from_class if v is not None]


    def _helper(self, function: types.FunctionType, /) -> list[tuple[str, Any]]:
        """A function of the user's that fn reaches (a helper it calls, ``score = lambda x:
        gate(x)``): what it holds, as fn's own places are looked at (defaults, closure cells,
        the globals its code reads), and the names its code reads join those looked for.
        Not torch's or the standard library's functions: they hold no module of the user's."""
        if library_code(function):
            return []
        code = function.__code__
        self.read.update(attributes_read(code))
        name = function.__qualname__
        inside = [(f" via {name}: default of {arg!r}", v) for arg, v in defaults_of(function)]
        inside += [(f" via {name}: closure variable {var!r}", cell_contents(cell))
                   for var, cell in zip(code.co_freevars, function.__closure__ or ())]
        space = globals_of(function)
        return inside + [(f" via {name}: global {var!r}", space.get(var))
                         for var in globals_read(code)]


def _class_places(cls: type, read: set[str], skip: set[str], /, *, metaclass: bool,
                  calling: Any = None) -> list[tuple[str, Any]]:
    """The attributes of ``cls`` (its bases' included: a router a base class holds) that fn
    may reach, but for names in ``skip`` (the instance's own): by the names fn's code reads
    (``cls.gate``, ``self.score``), the names a method or a property's getter reads joining
    those looked up (``self._score()`` reading ``self.gate``); with ``metaclass``, also what
    its metaclass holds (``cls.gate`` of a class made by ``class Meta(type): gate = ...``);
    where fn's code calls ``getattr`` (a name computed at run time), every module or tensor
    the classes hold. A method fn never calls is not opened (helper FR: a sibling
    method reading a trainable global refused a legal router, and a class of 30 helpers cost
    0.7 ms a call); fn's own name leads to the definitions it overrides only through
    ``super()`` (``calling``: fn's own function; helpers FT, FV)."""
    found: list[tuple[str, Any]] = []
    done = set(skip)
    code = dunder(calling, "__code__")
    if code is not None and "getattr" in code.co_names:
        # A name computed at run time (getattr(self, self.which)): every module or tensor the
        # classes hold, whatever its name; not where fn names what it reads (a trainable class
        # attribute it never uses refused a legal router: helper FV).
        for klass in cls.__mro__:
            if not library_code(klass):
                for name, value in vars(klass).items():
                    if name not in done and isinstance(value, _HELD):
                        done.add(name)
                        found.append((f"class attribute {name!r} of {cls.__name__}", value))
    while todo := sorted(read - done):  # a method's or getter's names join read
        for name in todo:
            done.add(name)
            if calling is not None and name == calling.__name__:
                found += _overridden(cls, calling, read)
                continue
            value = _class_attribute(cls, name, read)
            if value is None and metaclass:
                value = _class_attribute(type(cls), name, read)
            if value is not None:
                found.append((f"class attribute {name!r} of {cls.__name__}", value))
    return found


# Not containers: a constant getattr name opened a class registry holding other routers, and
# refused a legal one (helper FW); a class-attribute dict read by a computed name is missed.
_HELD = (nn.Module, torch.Tensor)


def _overridden(cls: type, calling: Any, read: set[str], /) -> list[tuple[str, Any]]:
    """The definitions that fn's own method (``calling``) reaches through ``super()``: each
    next one along ``cls``' MRO while the one before calls ``super`` (a chain of overrides,
    helper FV); none where fn does not (``self.inner.route(x)`` reads the same name of another
    object: helper FV)."""
    found: list[tuple[str, Any]] = []
    name = calling.__name__
    current = calling
    passed = False
    for klass in cls.__mro__:
        if name not in vars(klass) or library_code(klass):
            continue
        value = vars(klass)[name]
        function = dunder(value, "__func__", value)
        if function is calling:
            passed = True
            continue
        if not passed:
            continue
        if "super" not in getattr(dunder(current, "__code__"), "co_names", ()):
            break
        if not isinstance(function, types.FunctionType):
            break
        read.update(attributes_read(function.__code__))
        found.append((f"{klass.__name__}.{name}, which super() calls", function))
        current = function
    return found


def _class_attribute(cls: type, name: str, read: set[str], /) -> Any:
    """The value a class (or an instance through it) gives for ``name``, if a plain one
    (``Routers.gate``); for a property or a method, its getter or function, whose code's
    names join ``read`` (``return self._gate``) and which the look opens as a helper (the
    globals it reads: a property returning a global router, helper FR). Read from the
    classes' own dicts: no descriptor runs."""
    for klass in cls.__mro__:
        if name not in vars(klass) or library_code(klass):
            continue
        found = vars(klass)[name]
        if isinstance(found, (property, types.FunctionType, staticmethod, classmethod)):
            # A method fn calls reads the object's attributes for it (holder.score: self.gate)
            getter = found.fget if isinstance(found, property) else \
                dunder(found, "__func__", found)
            read.update(attributes_read(dunder(getter, "__code__")))
            return getter if isinstance(getter, types.FunctionType) else None
        return found
    return None


def _key(key: Any, /) -> str:
    try:
        return repr(key)
    except Exception:  # a key whose repr raises: named by its type
        return f"<{type(key).__name__}>"


def _plain_object(value: Any, /) -> bool:
    """An object of the user's whose attributes may hold a router (a config, a holder)."""
    return not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                  types.BuiltinFunctionType, torch.Tensor)) and \
        type(value).__module__ != "builtins"


def _where(place: str, path: str, /) -> str:
    if not path or path.startswith(("[", " via ")):  # GATES["router"]: the key follows the name
        return place + path
    return f"{place}, at {path}"  # closure variable 'self', at .cfg.gate



def _trainable(module: nn.Module, /) -> bool:
    return any(p.requires_grad for p in module.parameters())


def reach_words(fn: Callable[..., Any], reach: Reach, /) -> str:
    if reach.module is None:
        return f"reaches a tensor that requires grad ({reach.place})"
    kind = type(reach.module).__name__
    if not reach.place:
        relation = "is" if fn is reach.module else "belongs to"
        return f"{relation} a module with trainable parameters ({kind})"
    return f"reaches a module with trainable parameters ({kind}, {reach.place})"


def reach_short(reach: Reach, /) -> str:
    if reach.module is None:
        return f"a function reaching a tensor that requires grad ({reach.place})"
    kind = type(reach.module).__name__
    return f"a trainable {kind}" + (f" ({reach.place})" if reach.place else "")


def argument_path(call: FlatTree, index: int, /) -> str:
    path = leaf_paths(call.spec, root="call")[index]  # call[0][i] or call[1]['key']
    if path.startswith("call[0]"):
        return "argument " + path.replace("call[0]", "args", 1)
    return "argument " + path.replace("call[1]", "kwargs", 1)


