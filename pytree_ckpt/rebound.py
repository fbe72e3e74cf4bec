"""A plain function's modules rebound before its replay: refused (NOTE [a module rebound
before the replay]).
"""

from __future__ import annotations

import dis
import functools
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import CheckpointError
from .frames import callable_name
from .plain_state import cell_contents, globals_of, modules_held

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["Bound", "modules_bound", "refuse_rebound"]

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
# (`lambda t: layers[i](t)`: `i` is no module; docs/limits.md's row lists these).
_Places = tuple[tuple[int, ...], tuple[str, ...]]  # closure cells by index, globals by name
# NOTE [the check's cost]: every call of a plain function whose code held a module notes its
# places, so the call notes ids and classes only; the words of a refusal (the variable's name,
# the modules' descriptions) are made when refusing. modules_bound for a lambda over one
# Linear: 0.84 us a call (1.27 us when it made the words at each call; min of 5 timeit runs).
# The places, then per place: (id(module) or _NO_MODULE, its class or None)
Bound = tuple[_Places, tuple[tuple[int, type | None], ...]]
_NO_MODULE = 0  # noted for a place holding no module at the original pass (no object's id)
# Of the global names plain_state.py's first look found (any of the code's co_names that is a
# global module, attribute names included: `holder.layer(t)` beside a global `layer`), those
# its instructions read as globals; the others are never read, and a global of that name
# rebound since changes nothing the replay runs. By id(code), holding the code (its id is not
# reused); read once per code object.
_GLOBALS_READ: dict[int, tuple[Any, tuple[str, ...]]] = {}


def _globals_read(code: Any, names: tuple[str, ...], /) -> tuple[str, ...]:
    entry = _GLOBALS_READ.get(id(code))
    if entry is None:
        read = {i.argval for i in dis.get_instructions(code)
                if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        entry = _GLOBALS_READ[id(code)] = (code, tuple(n for n in names if n in read))
    return entry[1]


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
    names = _globals_read(code, held[2]) if held[2] else ()
    if not (held[0] or names):
        return None
    places = (held[0], names)
    return places, tuple((_NO_MODULE, None) if module is None else (id(module), type(module))
                         for module in _modules_now(fn, places))


def refuse_rebound(call: BoundaryCall, /) -> None:
    """Refuse the replay when a module ``call.fn`` held at its original pass is no longer the
    one it holds, or a place that held none then holds one now (NOTE [a module rebound before
    the replay])."""
    assert call.bound is not None
    places, bound = call.bound
    fn = _called(call.fn)
    now = _modules_now(fn, places)  # the places noted: plain_state may drop its own look
    for k, ((ident, cls), module) in enumerate(zip(bound, now)):
        if (module is None) if ident == _NO_MODULE else \
                (module is not None and id(module) == ident):
            continue
        name = callable_name(call.fn)
        where = _place_name(fn, places, k)
        variable = where.split("'")[1] if "'" in where else "layer"
        then, now_ = ("no module", "one") if ident == _NO_MODULE else ("one module", "another")
        raise CheckpointError(
            f"the replay of checkpoint({name}) would run another module: its {where} held "
            f"{then} at the original pass and holds {now_} now (Python closures and "
            "globals bind late: a function made in a loop reads the loop variable's last "
            "value), so the replay would compute, and return the gradients of, another layer",
            expected=f"{where} = {_describe(ident, cls)} (the original pass's)",
            got=f"{where} = " + _describe(id(module), type(module) if module is not None
                                          else None),
            tip=f"bind it when the function is made, checkpoint(lambda t, {variable}={variable}: "
                f"{variable}(t), h), or pass the module itself, checkpoint({variable}, h), "
                "which also knows its parameters and state")
