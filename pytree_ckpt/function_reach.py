"""What a plain callable reaches besides its arguments: the globals its code reads, its
closure cells, a callable object's own attributes, the values a ``functools.partial`` binds.

Read by the checks that look at what a function holds rather than what it is given: the late
binding of a lambda made in a loop (``rebound.py``), the state a plain function changes
(``plain_state.py``), and what gives a reused call's floats a graph (``frozen.py``).
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any

__all__ = ["attribute", "attribute_names", "attributes_read", "cell_contents", "code_reading",
           "defaults_of", "globals_of", "globals_read", "unwrap_partials"]


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
    space = getattr(fn, "__globals__", None)
    return space if isinstance(space, dict) else {}


def attribute_names(fn: Any, /) -> list[str]:
    """A callable object's own attributes: its ``__dict__``'s (when it is a dict: a property
    of that name may give anything) and its slots (no ``__dict__`` holds them), by the name
    ``getattr`` reads (a private slot's, mangled)."""
    own = getattr(fn, "__dict__", None)
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
    own = getattr(fn, "__dict__", None)
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
    code = getattr(fn, "__code__", None)
    positional = (getattr(code, "co_varnames", ())[:getattr(code, "co_argcount", 0)]
                  if isinstance(code, types.CodeType) else ())
    values = getattr(fn, "__defaults__", None) or ()
    found = list(zip(positional[len(positional) - len(values):], values))
    return found + list((getattr(fn, "__kwdefaults__", None) or {}).items())


def code_reading(fn: Any, name: str, /) -> str | None:
    """The qualified name of a function whose code reads ``name`` (as a global or an
    attribute: ``torch.is_grad_enabled``), among ``fn``'s own (through partials and wrappers;
    a module's forward, a callable object's ``__call__``) and, one level on, the methods of
    the object it is bound to that its code reads (``self._apply_expert_bias``) and the
    functions it reads as globals or closure cells that are defined in the same module as it
    (its own helpers); None if none does."""
    inner, _ = unwrap_partials(fn)
    for _ in range(8):
        wrapped = getattr(inner, "__wrapped__", None)
        if wrapped is None or getattr(inner, "__self__", None) is not None:
            break
        inner = wrapped
    holder = getattr(inner, "__self__", None)
    function = getattr(inner, "__func__", inner)
    if not isinstance(function, types.FunctionType):  # a module (its forward), an object
        holder = inner if holder is None else holder
        function = next((f for f in (getattr(type(holder), "forward", None),
                                     getattr(type(holder), "__call__", None))
                         if isinstance(f, types.FunctionType)), None)
    if not isinstance(function, types.FunctionType):
        return None
    # Once per code, bound-to class and name: a replayed call asks at every step. The code
    # and the class are held with the answer, so their ids are not reused. (A closure or a
    # global rebound later to another helper is not looked at again.)
    key = (id(function.__code__), id(type(holder)), name)
    entry = _CODE_READING.get(key)
    if entry is None:
        entry = _CODE_READING[key] = (function.__code__, type(holder),
                                      _code_reading(function, holder, name))
    return entry[2]


# (id(code), id(class bound to), name) -> (code, class, answer): see code_reading.
_CODE_READING: dict[tuple[int, int, str], tuple[Any, Any, str | None]] = {}


def _code_reading(function: types.FunctionType, holder: Any, name: str, /) -> str | None:
    module = function.__module__
    candidates = [function]
    read = attributes_read(function.__code__)
    if holder is not None:
        candidates += [f for n in sorted(read) if isinstance(
            f := getattr(type(holder), n, None), types.FunctionType)]
    cells = [cell_contents(c) for c in function.__closure__ or ()]
    space = globals_of(function)
    candidates += [f for f in cells + [space.get(g) for g in globals_read(function.__code__)]
                   if isinstance(f, types.FunctionType) and f.__module__ == module]
    for candidate in candidates:
        if _reads(candidate.__code__, name):
            return candidate.__qualname__
    return None


def _reads(code: types.CodeType, name: str, /) -> bool:
    """Whether ``code`` (or a function or comprehension nested in it) names ``name``."""
    stack = [code]
    while stack:
        one = stack.pop()
        if name in one.co_names:
            return True
        stack += [c for c in one.co_consts if isinstance(c, types.CodeType)]
    return False
