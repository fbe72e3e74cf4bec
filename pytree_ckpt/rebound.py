"""A plain function's modules, the indices it subscripts with, or the tensors it closes over,
rebound before its replay: refused (NOTE [a module rebound before the replay], NOTE [an index
rebound before the replay], NOTE [a tensor rebound before the replay]).
"""

from __future__ import annotations

import dis
import enum
import functools
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from .eager import user_stacklevel
from .errors import CheckpointError
from .frames import callable_name
from .function_reach import cell_contents, globals_of, globals_read
from .plain_state import modules_held
from .subscripts import index_places
from .tree import dunder

__all__ = ["Bound", "NOTHING_BOUND", "modules_bound", "modules_bound_now", "refuse_rebound"]

_Tensor = torch.Tensor

# NOTE [a module rebound before the replay]: Python closures and globals bind late, so
# `for layer in layers: h = checkpoint(lambda t: layer(t), h)` makes functions that all read
# the variable `layer` when they run: in backward, after the loop, every replay runs the last
# layer, and each boundary returns that layer's gradients for its own input, with no error
# (torch's checkpoint, reentrant or not, does the same). The replay must run the function the
# original pass ran, so the modules a plain function holds in its closure cells or names as
# globals (those plain_state.py's first look found: modules_held) are noted by identity at the
# original pass and compared before the replay; another module there is refused, naming the
# variable and both modules. Ids only: holding the modules would keep a model replaced since
# alive; an id reused by a new module after the old one was freed goes unseen (the old one
# could not have been replayed anyway). A place that held a module at the code's first look
# but holds none at this call (a function, None: `for layer in [block, torch.tanh, block]`) is
# noted as holding none, and refused when it holds a module at the replay: that replay would
# run a module where the original pass ran something else (silently, when the loop ends on a
# module the other calls held). A non-module replaced by another one is not seen (a new
# partial each iteration may compute the same); in such a loop the calls that held a module
# are refused then, unless the loop ended on that module, where those that held none are.
# The places looked at are kept with the ids, not read from plain_state.py's first look at
# the replay: a replay that warns about module state (a loop of batch-norm blocks: the last
# call's replay, run first, warns) drops that look, and the earlier calls' replays must still
# be checked. Not seen: a module reached through an attribute (`self.block` rebound), a
# function that holds no module at its first call, the calls of a code made after it was
# warned about by plain_state.py (a later step's: the first step's are refused), a callable
# object's attributes (a partial's function is looked at: its cells bind as late;
# docs/limits.md's row lists these). A decorator's wrapper (functools.wraps, torch.compile:
# its own cells hold the function) is followed by __wrapped__ to the function, whose code
# plain_state.py never looked at: every cell is noted, as for output discard. An index read
# late is NOTE [an index rebound before the replay]. Output
# discard (discard.py) has no first look: it notes every closure cell (a module or none) and
# the globals its code reads that hold a module, at each call (modules_bound_now), and
# checks them before its rebuild.
# NOTE [an index rebound before the replay]: `for i in range(n): h = checkpoint(lambda t:
# layers[i](t), h)` holds the layers' container, the same at every replay, and reads `i` late:
# every replay would run the last layer, silently, as with a loop variable that is a module. So the
# closure cells and globals a plain function's code reads into a subscript's index (subscripts.py
# reads that from the bytecode once per code object: `layers[i]`, `self.layers[i - 1]`, `t[:, i]`,
# `out[:, i] += 1`, in the comprehensions and inner functions it makes too; and the arguments of a
# getattr or get_submodule call, a layer picked by name: `getattr(self, f"layer{i}")`) are noted by
# value at the original pass when they hold an int or a str (a loop index, a ModuleDict's key), and
# a replay reading another value is refused: it would index another layer or another slice of a
# tensor. Only subscripts: a `layer_idx=i` passed on (a key/value cache's index, unused in
# training) is not compared, and other values (an object whose attribute indexes, `layers[cfg.i]`)
# are not noted. This runs for every plain function, holding a module or not (a plain list of
# layers is no module): one dict lookup a call for a code with no such index.
# NOTE [a tensor rebound before the replay]: the same late binding with a tensor the function
# closes over: `for e in embeds: h = checkpoint(lambda t: shared(t + e), h)` (one layer shared by
# every depth, as MTP's) replays every call with the last `e`, and `h = checkpoint(lambda t: t + h,
# h)` replays with the call's own output (the name it was assigned to): the weight's gradient is
# another's, silently. So the closure cells that held a tensor at the code's first call (a first
# look per code object, as for modules) are noted at the original pass by weak reference, and a
# replay that would read another tensor there (or none, or a place that held none now holding one)
# is refused. Weak references, not ids: a mask made in each iteration is freed when the next takes
# its name, and a new tensor may take its id; one freed since cannot be the one there now. A float
# is noted the same way, by value (`for scale in scales: h = checkpoint(lambda t: shared(t) *
# scale, h)`; NaN equal to NaN). An int (or bool), a str or an Enum member in a cell the code
# does not index with is noted by value too (a hybrid stack's `kind` a shared block branches on:
# helper MI), but another one at the replay is warned of, once per code, not refused:
# `lambda t: shared(t) / math.sqrt(i + 1)` computes with it, while a `layer_idx=i` only passed
# on (a key/value cache's index, unused in training) changes nothing, and the two cannot be told
# apart (one it indexes with is NOTE [an index rebound before the replay]'s, refused). A cell
# holding None at the first call is looked at too (`prev = None`
# before a loop that sets `prev = h`). A cell the function assigns before it reads it (`nonlocal
# stats; stats = ...`) is not taken, nor an index so set: its original pass set it, and its replay
# sets it again; one it reads first (`out = out * prev; prev = out`) is. Globals are not taken (a
# documented limit: a top-level script's loop tensor read late is silent): a global cache a helper
# the function calls builds or rebuilds (`global _mask` in `make_mask`) is set again by the
# replay's own call, so another tensor there is no late binding, and refusing it refused working
# code. Not seen: a place holding anything else at the code's first call; a tensor reached through
# an attribute or a container (`self.cache`, `masks[i]`: the index is NOTE [an index rebound before
# the replay]), a tensor changed in place (the saved-input checks' business).
_Places = tuple[tuple[int, ...], tuple[str, ...]]  # closure cells by index, globals by name
# NOTE [the check's cost]: every call of a plain function whose code held a module notes its
# places, so the call notes ids and classes only; the words of a refusal (the variable's name,
# the modules' descriptions) are made when refusing. modules_bound for a lambda over one
# Linear: 0.84 us a call (1.27 us when it made the words at each call; min of 5 timeit runs);
# under callgrind 11,500 instructions, and refuse_rebound 9,100, of the 832,000 the call and
# its backward cost (with the index check and the wrapper's unwrapping: comprehensions cost
# more, so loops are used, and a plain function leaves _unwrap at its first test). The tensor
# check (2026-12-04, 200 calls of checkpoint + backward under callgrind, against d0ebc29, with
# the float, None-cell and self-assigned-name rules): a lambda over a Linear 839,500 -> 843,400
# instructions a call, one that also closes over a tensor 870,700 -> 887,500 (its weak
# reference and comparison), `lambda t: t * 2` unchanged within the count's noise (about 0.3%:
# NOTHING_BOUND).
# The module places, per place (id(module) or _NO_MODULE, its class or None, a weak reference
# to it or None: an id alone passed a new module made at a dead one's address), the index places
# and per place its int or str (_NOT_NOTED for any other value), the tensor places and per
# place a weak reference to its tensor (None where it held none), a float in a 1-tuple, or a
# _LateValue.
Bound = tuple[_Places, tuple[tuple[int, type | None, Any], ...], _Places, tuple[Any, ...],
              _Places, tuple[Any, ...]]
_NO_MODULE = 0  # noted for a place holding no module at the original pass (no object's id)
_HELD_NONE: tuple[int, type | None, Any] = (_NO_MODULE, None, None)
_NOT_NOTED = object()  # an index place holding neither an int nor a str at the original pass
_NO_PLACES: _Places = ((), ())
# The code objects whose functions hold no module at plain_state.py's first look and subscript
# with no late-bound variable, by id (holding the code, so its id is not reused): the boundary
# skips modules_bound for them, one dict lookup a call (modules_bound would cost about 7,000
# callgrind instructions, 1% of `checkpoint(lambda h: h * 2, x)` and its backward, 631,000).
NOTHING_BOUND: dict[int, Any] = {}
# By id(code): (code, the closure cells holding a tensor, a float or None at its first call),
# (code, the names it writes before reading), and (code, its late index places): the codes held
# so their ids are not reused.
_TENSOR_PLACES: dict[int, tuple[Any, _Places]] = {}
_WRITTEN: dict[int, tuple[Any, frozenset[str]]] = {}
_WRITES = frozenset({"STORE_DEREF", "DELETE_DEREF", "STORE_GLOBAL", "DELETE_GLOBAL"})
_READS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_GLOBAL", "LOAD_NAME"})
_LATE_INDICES: dict[int, tuple[Any, _Places]] = {}
# What a tensor place may hold and have noted: a tensor (by weak reference), a float (by value,
# in a 1-tuple: `for scale in scales: h = checkpoint(lambda t: shared(t) * scale, h)`), an int,
# bool, str or Enum member where the code does not index with it (by value, in a _LateValue:
# warned of, not refused; NOTE [a tensor rebound before the replay]). Not a tuple, a dict or
# another object (a per-depth config read late is silent: docs/limits.md).
_LATE_VALUES = (int, str, enum.Enum)
_NOTED_VALUES = (_Tensor, float, *_LATE_VALUES)


class _LateValue:
    """An int, bool, str or Enum member a tensor place held at the original pass: another
    one at the replay is warned of."""

    __slots__ = ("value",)

    def __init__(self, value: int | str | enum.Enum, /) -> None:
        self.value = value


# The codes warned of for a _LateValue read late, by id (holding the code, so its id is not
# reused): once per code, as a lambda written in a loop is one code.
_WARNED_VALUES: dict[int, Any] = {}


def _written(code: Any, /) -> frozenset[str]:
    """The closure variables and globals ``code`` assigns or deletes before it reads them
    (``nonlocal seq; seq = t.shape[0]``, in instruction order), or that a code it makes
    assigns: the function sets them itself, and the replay sets them again, so they are not
    read late. One read first (``out = out * prev; prev = out``) is (NOTE [a tensor rebound
    before the replay])."""
    entry = _WRITTEN.get(id(code))
    if entry is None:
        names: set[str] = set()
        if isinstance(code, types.CodeType):
            first: dict[str, bool] = {}  # by name: whether its first access writes it
            for i in dis.get_instructions(code):
                if i.opname in _WRITES or i.opname in _READS:
                    first.setdefault(i.argval, i.opname in _WRITES)
            names.update(n for n, writes in first.items() if writes)
            stack = [c for c in code.co_consts if isinstance(c, types.CodeType)]
            while stack:
                one = stack.pop()
                names.update(i.argval for i in dis.get_instructions(one)
                             if i.opname in _WRITES)
                stack.extend(c for c in one.co_consts if isinstance(c, types.CodeType))
        entry = _WRITTEN[id(code)] = (code, frozenset(names))
    return entry[1]


def _late_indices(code: Any, /) -> _Places:
    """index_places of ``code`` without the names it writes before reading (_written)."""
    entry = _LATE_INDICES.get(id(code))
    if entry is None:
        cells, names = index_places(code)
        written = _written(code)
        free = getattr(code, "co_freevars", ())
        entry = _LATE_INDICES[id(code)] = (code, (
            tuple(i for i in cells if not (i < len(free) and free[i] in written)),
            tuple(n for n in names if n not in written)))
    return entry[1]


def _tensor_cells(fn: Any, code: Any, /) -> _Places:
    """The closure cells holding a tensor, a float, an int, bool, str or Enum member
    (NOTE [a tensor rebound before the replay]), or None now, that ``code`` does not write
    before reading. Not globals: a global cache a helper the function calls builds or rebuilds
    (`global _mask; _mask = ...` in `make_mask`, called by the function) is set again by the
    replay's own call, so another tensor there is no late binding (NOTE [a tensor rebound
    before the replay])."""
    closure = dunder(fn, "__closure__") or ()
    written = _written(code)
    free = getattr(code, "co_freevars", ())
    indexed = _late_indices(code)[0]  # an int or str there is the index check's (refused)
    # A cell holding None may hold a tensor at later calls (`prev = None` before a loop that
    # sets `prev = h`).
    return (tuple(i for i, cell in enumerate(closure)
                  if (isinstance(value := cell_contents(cell), _NOTED_VALUES) or value is None)
                  and not (i < len(free) and free[i] in written)
                  and not (type(value) in (int, bool, str) and i in indexed)), ())


def _tensor_places(fn: Any, code: Any, /) -> _Places:
    """The places of _tensor_cells at ``code``'s first call (NOTE [a tensor rebound before
    the replay])."""
    entry = _TENSOR_PLACES.get(id(code))
    if entry is None:
        entry = _TENSOR_PLACES[id(code)] = (code, _tensor_cells(fn, code))
    return entry[1]


def _values_now(fn: Any, places: _Places, /) -> list[Any]:
    """What each place holds now (``None`` for an empty cell or a missing global); loops, not
    comprehensions, and no words (NOTE [the check's cost])."""
    cells, names = places
    found = []
    if cells:
        closure = dunder(fn, "__closure__") or ()
        for i in cells:
            found.append(cell_contents(closure[i]) if i < len(closure) else None)
    if names:
        space = globals_of(fn)
        for name in names:
            found.append(dict.get(space, name))
    return found


def _place_name(fn: Any, places: _Places, k: int, /) -> str:
    cells, names = places
    if k >= len(cells):
        return f"global {names[k - len(cells)]!r}"
    free = getattr(dunder(fn, "__code__"), "co_freevars", ())
    i = cells[k]
    return f"closure variable {free[i]!r}" if i < len(free) else "a closure variable"


def _words(fn: Any, called: Any, places: _Places, k: int, default: str, /
           ) -> tuple[str, str, str]:
    """For a refusal: the function's name, the ``k``-th place's words, and the variable's name
    for the tip (``default`` where the place has none)."""
    where = _place_name(called, places, k)
    return callable_name(fn), where, where.split("'")[1] if "'" in where else default


def _describe(ident: int, cls: type | None, /) -> str:
    return "no module" if cls is None else f"{cls.__name__} at {ident:#x}"


_Function = types.FunctionType  # functools.wraps puts __wrapped__ in the wrapper's __dict__


def _unwrap(fn: Any, /) -> tuple[Any, bool]:
    """The function a ``functools.partial`` (of partials) calls, or a decorator's wrapper
    wraps (``__wrapped__``: ``functools.wraps``, ``torch.compile``), and whether a wrapper was
    passed: their cells and globals are read late as a lambda's are. plain_state.py's first
    look keys on a partial's function too, but on a wrapper's own code (whose cells hold the
    function, not its modules)."""
    if type(fn) is _Function and "__wrapped__" not in fn.__dict__:
        return fn, False  # the usual case: a plain function (NOTE [the check's cost])
    wrapped = False
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif type(fn) is _Function and \
                type(inner := fn.__dict__.get("__wrapped__")) is _Function:  # no raise
            fn, wrapped = inner, True
        else:
            break
    return fn, wrapped


def modules_bound(fn: Any, /) -> Bound | None:
    """The modules ``fn`` (a plain function) holds in closure cells or names as globals now,
    by identity, the places among those that hold none now, and the indices its code
    subscripts with; ``None`` when its code held no module at its first look and subscripts
    with no late int or str (NOTE [a module rebound before the replay], NOTE [an index
    rebound before the replay])."""
    fn, wrapped = _unwrap(fn)
    if wrapped:  # no first look at the wrapped function's code: every cell, as discard does
        return modules_bound_now(fn)
    code = dunder(fn, "__code__")
    if code is None:
        return None
    held = modules_held(code)
    places = (held[0], held[2]) if held is not None and (held[0] or held[2]) else _NO_PLACES
    indices = _late_indices(code)
    tensors = _tensor_places(fn, code)
    if held is not None and places is _NO_PLACES and not (indices[0] or indices[1]) and \
            not (tensors[0] or tensors[1]):
        NOTHING_BOUND[id(code)] = code  # facts of the code's first look: nothing to note
        return None
    return _note(fn, places, indices, tensors)


def modules_bound_now(fn: Any, /) -> Bound | None:
    """For a caller without plain_state.py's first look (output discard): every closure cell
    of ``fn`` (a module, or none), the globals its code reads that hold a module now, the
    indices its code subscripts with and the cells holding a tensor, a float or None now;
    ``None`` when there are none (NOTE [a module rebound before the replay], NOTE [a tensor
    rebound before the replay])."""
    fn = _unwrap(fn)[0]
    code = dunder(fn, "__code__")
    if code is None:
        return None
    closure = dunder(fn, "__closure__") or ()
    space = globals_of(fn)
    names = tuple(n for n in globals_read(code)
                  if isinstance(dict.get(space, n), nn.Module)) if space else ()
    return _note(fn, (tuple(range(len(closure))), names), _late_indices(code),
                 _tensor_cells(fn, code))


def _note(fn: Any, places: _Places, indices: _Places, tensors: _Places, /) -> Bound | None:
    noted: list[tuple[int, type | None, Any]] = []
    for value in _values_now(fn, places):
        noted.append((id(value), type(value), weakref.ref(value))
                     if isinstance(value, nn.Module) else _HELD_NONE)
    values: list[Any] = []
    if indices[0] or indices[1]:
        checked = False
        for value in _values_now(fn, indices):
            if isinstance(value, (int, str)):
                checked = True
                values.append(value)
            else:
                values.append(_NOT_NOTED)
        if not checked:
            indices, values = _NO_PLACES, []
    refs: list[Any] = []
    if tensors[0] or tensors[1]:
        for value in _values_now(fn, tensors):
            refs.append(weakref.ref(value) if isinstance(value, _Tensor) else
                        (value,) if isinstance(value, float) else
                        _LateValue(value) if isinstance(value, _LATE_VALUES) else None)
    if not noted and not values and not refs:
        return None
    return places, tuple(noted), indices, tuple(values), tensors, tuple(refs)


def _short(value: Any, /) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_rebound(fn: Any, bound: Bound, /, *, what: str = "checkpoint") -> None:
    """Refuse the replay of ``fn`` (given to ``what``) when a module it held at its original
    pass is no longer the one it holds, a place that held none then holds one now, or an index
    it subscripts with holds another value, or a tensor it closes over is another one (NOTE [a
    module rebound before the replay], NOTE [an index rebound before the replay], NOTE [a
    tensor rebound before the replay])."""
    places, noted, indices, values, tensors, refs = bound
    called = _unwrap(fn)[0]
    now = _values_now(called, places)  # the places noted: plain_state may drop its own look
    for k, ((ident, cls, ref), value) in enumerate(zip(noted, now)):
        module = value if isinstance(value, nn.Module) else None
        if (module is None) if ident == _NO_MODULE else (module is not None and ref() is module):
            continue
        name, where, variable = _words(fn, called, places, k, "layer")
        then, now_ = ("no module", "one") if ident == _NO_MODULE else ("one module", "another")
        raise CheckpointError(
            f"the replay of {what}({name}) would run another module: its {where} held "
            f"{then} at the original pass and holds {now_} now (Python closures and "
            "globals bind late: a function made in a loop reads the loop variable's last "
            "value), so the replay would compute, and return the gradients of, another layer",
            expected=f"{where} = {_describe(ident, cls)} (the original pass's)",
            got=f"{where} = " + _describe(id(module), type(module) if module is not None
                                          else None),
            tip=f"bind it when the function is made, checkpoint(lambda t, {variable}={variable}: "
                f"{variable}(t), h), or pass the module itself, checkpoint({variable}, h), "
                "which also knows its parameters and state")
    if refs:
        _refuse_other_tensors(fn, called, tensors, refs, what)
    if not values:
        return
    for k, (then, value) in enumerate(zip(values, _values_now(called, indices))):
        if then is _NOT_NOTED or (type(value) is type(then) and value == then):
            continue
        name, where, variable = _words(fn, called, indices, k, "i")
        raise CheckpointError(
            f"the replay of {what}({name}) would index another element: its {where}, which "
            "its code uses in a subscript's index (or in the name getattr or get_submodule "
            "reads), held another value at the original pass "
            "(Python closures and globals bind late: a function made in a loop reads the loop "
            "variable's last value), so the replay would run another layer, or read another "
            "slice, and return the gradients of that",
            expected=f"{where} = {_short(then)} (the original pass's)",
            got=f"{where} = {_short(value)}",
            tip=f"bind it when the function is made (a default is read then): "
                f"checkpoint(lambda t, {variable}={variable}: layers[{variable}](t), h); for a "
                f"layer, pass the module itself, checkpoint(layers[{variable}], h), which also "
                "knows its parameters and state")


def _tensor_words(t: Any, /) -> str:
    return f"a tensor of shape {list(t.shape)}, {t.dtype}, at {id(t):#x}"


def _refuse_other_tensors(fn: Any, called: Any, tensors: _Places, refs: tuple[Any, ...],
                          what: str, /) -> None:
    """NOTE [a tensor rebound before the replay]: refuse a replay that would read another
    tensor (or none) where the original pass read one, or one where it read none."""
    for k, (ref, value) in enumerate(zip(refs, _values_now(called, tensors))):
        if type(ref) is tuple:
            _refuse_another_float(fn, called, tensors, k, ref[0], value, what)
            continue
        if type(ref) is _LateValue:
            _warn_another_value(fn, called, tensors, k, ref.value, value, what)
            continue
        then = None if ref is None else ref()
        if ref is None and not isinstance(value, _Tensor) or then is not None and then is value:
            continue
        name, where, variable = _words(fn, called, tensors, k, "t")
        now = "none" if not isinstance(value, _Tensor) else "one" if ref is None else "another"
        raise CheckpointError(
            f"the replay of {what}({name}) would compute with another tensor: its {where} "
            f"held {'one tensor' if ref is not None else 'no tensor'} at the original pass "
            f"and holds {now} now (Python "
            "closures and globals bind late: a function made in a loop reads the loop "
            "variable's last value, and one that reads the name the call's output is "
            "assigned to reads that output), so the replay would compute, and return the "
            "gradients of, something else",
            expected=f"{where} = " + ("the original pass's tensor, freed since" if
                                      ref is not None and then is None else
                                      ("no tensor" if ref is None else _tensor_words(then))
                                      + " (the original pass's)"),
            got=f"{where} = " + (_tensor_words(value) if isinstance(value, _Tensor)
                                 else _short(value)),
            tip=f"bind it when the function is made, checkpoint(lambda t, {variable}={variable}: "
                f"..., h), or pass it as an argument, checkpoint(fn, h, {variable}), which "
                "also gives it its gradient")


def _refuse_another_float(fn: Any, called: Any, tensors: _Places, k: int, then: float,
                          value: Any, what: str, /) -> None:
    """NOTE [a tensor rebound before the replay]: a float the function closes over that holds
    another value at the replay (NaN equal to NaN)."""
    if isinstance(value, float) and (value == then or value != value and then != then):
        return
    name, where, variable = _words(fn, called, tensors, k, "scale")
    raise CheckpointError(
        f"the replay of {what}({name}) would compute with another value: its {where} held "
        "another float at the original pass (Python closures and globals bind late: a "
        "function made in a loop reads the loop variable's last value), so the replay would "
        "compute, and return the gradients of, something else",
        expected=f"{where} = {then!r} (the original pass's)",
        got=f"{where} = " + (_tensor_words(value) if isinstance(value, _Tensor)
                             else _short(value)),
        tip=f"bind it when the function is made, checkpoint(lambda t, {variable}={variable}: "
            f"..., h), or pass it as an argument, checkpoint(fn, h, {variable})")


def _warn_another_value(fn: Any, called: Any, tensors: _Places, k: int, then: Any, value: Any,
                        what: str, /) -> None:
    """NOTE [a tensor rebound before the replay]: an int, str or Enum member the function closes
    over (not as an index) that holds another value at the replay: warned of once per code."""
    if type(value) is type(then) and value == then:
        return
    code = dunder(called, "__code__")
    if id(code) in _WARNED_VALUES:
        return
    _WARNED_VALUES[id(code)] = code
    name, where, variable = _words(fn, called, tensors, k, "i")
    warnings.warn(
        f"pytree_ckpt: the replay of {what}({name}) in backward reads its {where} = "
        f"{_short(value)}, where its original pass read {_short(then)} (Python closures bind "
        "late: a function made in a loop reads the loop variable's last value). If the "
        "function computes with it (a per-depth scale, a kind a block branches on), the "
        "replay computes, and returns the gradients of, something else; if it only passes "
        "it on (a layer_idx that a key/value cache uses, unused in training), nothing "
        "changes. Tip: bind it when the function is "
        f"made, checkpoint(lambda t, {variable}={variable}: ..., h), or pass it as an "
        "argument. Said once per function", stacklevel=user_stacklevel())
