"""A plain function's modules rebound before its replay: refused (NOTE [a module rebound
before the replay]).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from .errors import CheckpointError
from .frames import callable_name
from .plain_state import cell_contents, globals_of, globals_read, modules_held

__all__ = ["Bound", "modules_bound", "modules_bound_now", "refuse_rebound"]

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
# object's attributes (a partial's function is looked at: its cells bind as late), a
# torch.compile'd lambda (its wrapper's cells hold the function), an index read late
# (`lambda t: layers[i](t)`: `i` is no module; docs/limits.md's row lists these). Output
# discard (discard.py) has no first look: it notes every closure cell (a module or none) and
# the globals its code reads that hold a module, at each call (modules_bound_now), and
# checks them before its rebuild.
_Places = tuple[tuple[int, ...], tuple[str, ...]]  # closure cells by index, globals by name
# NOTE [the check's cost]: every call of a plain function whose code held a module notes its
# places, so the call notes ids and classes only; the words of a refusal (the variable's name,
# the modules' descriptions) are made when refusing. modules_bound for a lambda over one
# Linear: 0.84 us a call (1.27 us when it made the words at each call; min of 5 timeit runs).
# The places, then per place: (id(module) or _NO_MODULE, its class or None)
Bound = tuple[_Places, tuple[tuple[int, type | None], ...]]
_NO_MODULE = 0  # noted for a place holding no module at the original pass (no object's id)


def _modules_now(fn: Any, places: _Places, /) -> list[nn.Module | None]:
    """What each place holds now, a module or ``None``; no words (NOTE [the check's cost])."""
    cells, names = places
    closure = getattr(fn, "__closure__", None) or ()
    found: list[nn.Module | None] = []
    for i in cells:
        value = cell_contents(closure[i]) if i < len(closure) else None
        found.append(value if isinstance(value, nn.Module) else None)
    space = globals_of(fn) if names else {}
    for name in names:
        value = dict.get(space, name)
        found.append(value if isinstance(value, nn.Module) else None)
    return found


def _place_name(fn: Any, places: _Places, k: int, /) -> str:
    cells, names = places
    if k >= len(cells):
        return f"global {names[k - len(cells)]!r}"
    free = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    i = cells[k]
    return f"closure variable {free[i]!r}" if i < len(free) else "a closure variable"


def _describe(ident: int, cls: type | None, /) -> str:
    return "no module" if cls is None else f"{cls.__name__} at {ident:#x}"


def _called(fn: Any, /) -> Any:
    """The function a ``functools.partial`` (of partials) calls: its cells and globals are
    read late as a lambda's are (plain_state.py's first look keys on its code too)."""
    for _ in range(8):
        if not isinstance(fn, functools.partial):
            break
        fn = fn.func
    return fn


def modules_bound(fn: Any, /) -> Bound | None:
    """The modules ``fn`` (a plain function) holds in closure cells or names as globals now,
    by identity, and the places among those that hold none now; ``None`` when its code held
    none at its first look (NOTE [a module rebound before the replay])."""
    fn = _called(fn)
    code = getattr(fn, "__code__", None)
    held = modules_held(code) if code is not None else None
    if held is None or not (held[0] or held[2]):
        return None
    return _note(fn, (held[0], held[2]))


def modules_bound_now(fn: Any, /) -> Bound | None:
    """For a caller without plain_state.py's first look (output discard): every closure cell
    of ``fn`` (a module, or none) and the globals its code reads that hold a module now;
    ``None`` when there are none (NOTE [a module rebound before the replay])."""
    fn = _called(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    closure = getattr(fn, "__closure__", None) or ()
    space = globals_of(fn)
    names = tuple(n for n in globals_read(code)
                  if isinstance(dict.get(space, n), nn.Module)) if space else ()
    if not closure and not names:
        return None
    return _note(fn, (tuple(range(len(closure))), names))


def _note(fn: Any, places: _Places, /) -> Bound:
    return places, tuple((_NO_MODULE, None) if module is None else (id(module), type(module))
                         for module in _modules_now(fn, places))


def refuse_rebound(fn: Any, bound: Bound, /, *, what: str = "checkpoint") -> None:
    """Refuse the replay of ``fn`` (given to ``what``) when a module it held at its original
    pass is no longer the one it holds, or a place that held none then holds one now (NOTE [a
    module rebound before the replay])."""
    places, noted = bound
    called = _called(fn)
    now = _modules_now(called, places)  # the places noted: plain_state may drop its own look
    for k, ((ident, cls), module) in enumerate(zip(noted, now)):
        if (module is None) if ident == _NO_MODULE else \
                (module is not None and id(module) == ident):
            continue
        name = callable_name(fn)
        where = _place_name(called, places, k)
        variable = where.split("'")[1] if "'" in where else "layer"
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
