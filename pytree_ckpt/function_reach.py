"""What a plain callable reaches besides its arguments: the globals its code reads, its
closure cells, a callable object's own attributes, the values a ``functools.partial`` binds.

Read by the checks that look at what a function holds rather than what it is given: the late
binding of a lambda made in a loop (``rebound.py``), the state a plain function changes
(``plain_state.py``), what gives a reused call's floats a graph (``grad_reach.py``) and
whether a reused call's code reads the grad mode (``code_reading``). ``called`` is the one
place they learn which function a callable runs, and ``library_code`` which code is not the
user's.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
import weakref
from typing import Any, NamedTuple

from torch import nn

from .tree import dunder, instance_dict

__all__ = ["Called", "attribute", "attribute_names", "attributes_read", "called",
           "cell_contents", "code_reading", "defaults_of", "globals_of", "globals_read",
           "library_code", "library_package", "unwrap_partials"]


# By id(code), holding the code (its id is not reused); read once per code object.
_GLOBALS_READ: dict[int, tuple[Any, tuple[str, ...]]] = {}
_ATTRIBUTES_READ: dict[int, tuple[Any, frozenset[str]]] = {}


def globals_read(code: Any, /) -> tuple[str, ...]:
    """The names ``code`` reads as globals (LOAD_GLOBAL, LOAD_NAME), in order, once per code
    object; none for what is not a code object."""
    entry = _GLOBALS_READ.get(id(code))
    if entry is None:
        read = dict.fromkeys(i.argval for i in dis.get_instructions(code)
                             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                             ) if isinstance(code, types.CodeType) else {}
        entry = _GLOBALS_READ[id(code)] = (code, tuple(read))
    return entry[1]


def attributes_read(code: Any, /) -> frozenset[str]:
    """The attribute names ``code`` reads (``x.cfg.gate``: cfg, gate), its nested functions'
    and comprehensions' included, and its string constants that could name one
    (``getattr(h, "gate")``), once per code object; none for what is not a code object. A
    name only: which object it is read from is not known without running the code."""
    entry = _ATTRIBUTES_READ.get(id(code))
    if entry is None:
        names: set[str] = set()
        stack = [code] if isinstance(code, types.CodeType) else []
        while stack:
            one = stack.pop()
            names.update(i.argval for i in dis.get_instructions(one)
                         if i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR")
                         and isinstance(i.argval, str))
            names.update(c for c in one.co_consts if isinstance(c, str) and c.isidentifier())
            stack += [c for c in one.co_consts if isinstance(c, types.CodeType)]
        entry = _ATTRIBUTES_READ[id(code)] = (code, frozenset(names))
    return entry[1]


def cell_contents(cell: Any, /) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet (a name assigned after the function was made)
        return None


def globals_of(fn: Any, /) -> dict[str, Any]:
    # Read with dict.get, not the namespace's own get: exec'd code may have globals of a dict
    # subclass whose methods do more than look up (an audited or lazy namespace).
    space = dunder(fn, "__globals__")
    return space if isinstance(space, dict) else {}


def attribute_names(fn: Any, /) -> list[str]:
    """A callable object's own attributes: its ``__dict__``'s (when it is a dict: a property
    of that name may give anything) and its slots (no ``__dict__`` holds them), by the name
    ``getattr`` reads (a private slot's, mangled)."""
    own = instance_dict(fn)
    names = list(own) if isinstance(own, dict) else []
    for cls in type(fn).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"
            if name not in ("__dict__", "__weakref__"):
                names.append(name)
    return names


def attribute(fn: Any, name: str, /) -> Any:
    own = instance_dict(fn)
    if isinstance(own, dict) and name in own:
        return own[name]
    try:
        return getattr(fn, name, None)  # a slot (unset: None)
    except Exception:  # a property of a subclass that shadows the slot, raising
        return None


def unwrap_partials(fn: Any, /) -> tuple[Any, list[tuple[str, Any]]]:
    """The function a ``functools.partial`` (of partials) calls, and the values it binds."""
    bound: list[tuple[str, Any]] = []
    for _ in range(8):
        if not isinstance(fn, functools.partial):
            break
        bound += [(f"partial argument {i}", v) for i, v in enumerate(fn.args)]
        bound += [(f"partial keyword {k!r}", v) for k, v in fn.keywords.items()]
        fn = fn.func
    return fn, bound


def defaults_of(fn: Any, /) -> list[tuple[str, Any]]:
    """A function's argument defaults, by parameter name (``lambda x, g=gate: ...``)."""
    code = dunder(fn, "__code__")
    positional = (getattr(code, "co_varnames", ())[:getattr(code, "co_argcount", 0)]
                  if isinstance(code, types.CodeType) else ())
    values = dunder(fn, "__defaults__") or ()
    found = list(zip(positional[len(positional) - len(values):], values))
    return found + list((dunder(fn, "__kwdefaults__") or {}).items())


class Called(NamedTuple):
    """What calling ``fn`` runs: ``function``, the Python function whose code runs (None for a
    builtin or an object without one); ``holder``, the object it runs for (a method's
    ``self``, a classmethod's class, a callable object or module given as fn; None for a plain
    function); ``bound``, the values its partials bind."""

    function: types.FunctionType | None
    holder: Any
    bound: list[tuple[str, Any]]


def called(fn: Any, /) -> Called:
    """NOTE [the function fn calls]: through ``functools.partial`` (its bound values kept) and
    ``__wrapped__`` (``functools.wraps``, ``torch.compiler.disable``), stopping at a bound
    method (its ``__wrapped__`` is the unbound function: the ``self`` would be lost) and at a
    module; then a module's ``forward``, a callable object's ``__call__``. The one place both
    reach checks (what fn reaches with grad, what its code reads) learn what fn runs."""
    inner, bound = unwrap_partials(fn)
    for _ in range(8):
        wrapped = dunder(inner, "__wrapped__")
        if wrapped is None or isinstance(inner, nn.Module) or \
                dunder(inner, "__self__") is not None:
            break
        inner = wrapped
    holder = dunder(inner, "__self__")
    if holder is None and not isinstance(inner, (types.FunctionType, type)) and \
            type(inner).__module__ != "builtins":  # not a method descriptor (Tensor.topk)
        holder = inner  # a callable object or a module given as fn
    function = dunder(inner, "__func__", inner)
    if not isinstance(function, types.FunctionType) and holder is not None:
        function = getattr(type(holder), "forward" if isinstance(holder, nn.Module)
                           else "__call__", None)
    return Called(function if isinstance(function, types.FunctionType) else None, holder,
                  bound)


def library_code(value: Any, /) -> bool:
    """A function or class of torch's, numpy's, this library's or Python's own (builtins
    included): the reach checks do not follow into its code, which holds nothing of the
    user's."""
    return library_package(dunder(value, "__module__") or "builtins")


def library_package(module: str, /) -> bool:
    package = module.partition(".")[0]
    return package in _LIBRARIES or package in sys.stdlib_module_names


_LIBRARIES = frozenset({"torch", "pytree_ckpt", "offload", "numpy", "functorch", "triton"})


def code_reading(fn: Any, name: str, /) -> str | None:
    """The qualified name of a function whose code reads ``name`` (as a global or an
    attribute: ``torch.is_grad_enabled``), among the one ``fn`` calls (NOTE [the function fn
    calls]) and those its code reaches, up to _STEPS calls deep: the methods of the object it
    is bound to that it reads (``self._apply_expert_bias``), and the functions of the user's
    (not torch's, the standard library's, ...) it reads as globals or closure cells (its
    helpers); None if none does."""
    function, holder, _ = called(fn)
    if function is None:
        return None
    # Once per code, bound-to class, what its closure holds that runs (functions; bound
    # methods, by function and class) and name: a replayed call asks at every step (a lambda
    # made anew each step has the same code and cells). An entry goes with any of what its ids
    # are of, so no id is reused while it stands, and it holds none of them (helper EG: held,
    # a helper made per model kept each deleted model's weights, through its closure). (A
    # global rebound later to another helper is not looked at again.)
    cells = tuple(part for f in map(cell_contents, function.__closure__ or ())
                  for part in _runs(f))
    key = (id(function.__code__), id(type(holder)), tuple(map(id, cells)), name)
    if key in _CODE_READING:
        return _CODE_READING[key]
    answer = _CODE_READING[key] = _code_reading(function, holder, name)
    for part in {id(p): p for p in (function.__code__, type(holder), *cells)}.values():
        weakref.finalize(part, _CODE_READING.pop, key, None)
    return answer


def _runs(value: Any, /) -> tuple[Any, ...]:
    """What of a held value decides the code it runs: a function; a bound method's function
    and class (methods it reads are looked up there)."""
    if isinstance(value, types.MethodType):
        return value.__func__, type(value.__self__)
    return (value,) if isinstance(value, types.FunctionType) else ()


# (ids of code, class bound to, closure's functions; name) -> answer
_CODE_READING: dict[tuple[int, int, tuple[int, ...], str], str | None] = {}
# How deep code_reading follows calls (fn's helper is one, the helper's helper two), and how many
# functions it reads at most, so a call graph of many helpers costs a bounded first look.
_STEPS = 4
_FUNCTIONS = 64


def _code_reading(function: types.FunctionType, holder: Any, name: str, /) -> str | None:
    # Each function once per object it runs for (by identity: closures of one code may hold
    # different helpers).
    seen = {(id(function), id(holder))}
    level = [(function, holder)]
    budget = _FUNCTIONS
    for _ in range(_STEPS + 1):
        after: list[tuple[types.FunctionType, Any]] = []
        for candidate, bound_to in level:
            if _reads(candidate.__code__, name):
                return candidate.__qualname__
            for found in _functions_read(candidate, bound_to):
                mark = (id(found[0]), id(found[1]))
                if mark not in seen and budget > 0:
                    seen.add(mark)
                    budget -= 1
                    after.append(found)
        level = after
    return None


def _functions_read(function: types.FunctionType, holder: Any, /
                    ) -> list[tuple[types.FunctionType, Any]]:
    """The functions ``function``'s code calls that are known without running it, each with
    the object it runs for: the methods of ``holder``'s class whose names it reads (for
    ``holder``), and the user's functions among its closure cells and the globals it reads
    (a bound method's for its object)."""
    found: list[tuple[Any, Any]] = [] if holder is None else [
        (dunder(f, "__func__", f), holder)  # a staticmethod's, a classmethod's
        for n in sorted(attributes_read(function.__code__))
        if (f := getattr(type(holder), n, None)) is not None]
    space = globals_of(function)
    for value in [cell_contents(c) for c in function.__closure__ or ()] + \
            [space.get(g) for g in globals_read(function.__code__)]:
        if isinstance(value, types.MethodType):
            found.append((value.__func__, value.__self__))
        else:
            found.append((value, None))
    return [(f, h) for f, h in found
            if isinstance(f, types.FunctionType) and not library_code(f)]


def _reads(code: types.CodeType, name: str, /) -> bool:
    """Whether ``code`` (or a function or comprehension nested in it) names ``name``."""
    stack = [code]
    while stack:
        one = stack.pop()
        if name in one.co_names:
            return True
        stack += [c for c in one.co_consts if isinstance(c, types.CodeType)]
    return False
