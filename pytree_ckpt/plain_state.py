"""Module state a plain function changes: warned, once per function (NOTE [state a plain
function changes]).

The boundary watches the state of the modules it knows (NOTE [state the forward changes] in
``state_changes.py``); this file only looks, for a plain function, at the modules it is given
or holds, and says when the replay changes their state again.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .eager import user_site
from .frames import callable_name
from .function_reach import (attribute, attribute_names, cell_contents, globals_of, globals_read,
                             unwrap_partials)
from .module_state import argument_module, module_dicts, structure_generation
from .refusals import readable_path
from .state_changes import StateWatch
from .tree import dunder, leaf_paths

__all__ = ["NOTHING_HELD", "PlainStateWatch", "modules_held", "watch_plain_state"]

logger = logging.getLogger(__name__)

# NOTE [state a plain function changes]: a plain function (NOTE [unknown callables] in
# boundary.py) reaches modules the boundary does not know, so its replay runs their forward
# again on their own state: a batch norm's running statistics are updated twice a step, a step
# counter counts twice, as with torch's reentrant checkpoint. Making those modules known would
# change how their gradients are routed; instead the modules the function reaches here have
# their buffers watched: those it is given (argument leaves, bound methods of modules, the
# arguments a functools.partial binds), holds (closure cells, bound defaults, the attributes of
# a callable object, one level: in its __dict__ or its __slots__), or names as globals (a name
# its code reads as a global, globals_read, that is a module in its __globals__: a lambda at a
# script's top level; not any name of co_names, which holds attribute names too: `blk.norm(t)`
# beside a global module `norm` would be watched for nothing, and refused by rebound.py when
# that global is rebound before backward, though the replay never reads it). Not followed:
# functions it calls, attributes and containers of those modules' owners (self.block of a
# plain object's method), globals of a callable object's __call__.
#
# Warned when the replay changed them again, not when the original pass changed them: a
# forward that skips its update when current_phase() is "recompute" (a step counter counted
# once) changes them once, and a warning then would be false. The original pass's watch is
# kept (on the call, with the user's line) only when that pass changed a buffer; the replay
# watches the same buffers across its run of the function and warns, once per code object (a
# lambda written in a loop is one function), naming the module, the buffers, the user's
# checkpoint line (warnings.warn_explicit: the warning arrives in backward) and the fix. A
# warning given at the original pass with a caveat ("unless the forward skips it...") would
# still be given to the user who did skip it, who could only filter it out, hiding it for every
# other function too; the price of accuracy is a warning in backward, and none without one
# (the state then did change once, as in eager). A module watched needlessly (an attribute
# name of the code that is also a global module) only costs its watch: both passes must change
# its buffers for a warning, which only code the function runs does (or another thread, at
# that moment).
#
# Which cells, defaults, globals and attributes hold modules is read once per code object
# (type, for a callable object), at its first call; a function of that code holding a module
# where the first held none is not looked at. The globals and attributes found are read again
# by name at each call (a global rebound to another model is the new one). A function that
# holds none and is given none costs one dict lookup a call after that. One that holds modules
# is watched at every call until it is warned about (its buffers' versions read before and
# after: about 16,800 instructions a buffer, see _MOST_GLOBAL_BUFFERS; a forward that skips its
# update in the replay is watched so for good), then never again. Both tables are keyed by id
# and hold the code object itself (so its id is not reused): hashing a code object hashes its
# instructions, about 1.6 us for a 60-line function. Code objects are held strongly, as
# warnings' own registries hold what they warned about.
_Held = tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...], tuple[str, ...]]
_HELD: dict[int, tuple[Any, _Held | None]] = {}  # by id(code): (code, held; None: warned)
# The code objects whose functions hold no module (at their first call) or were warned about,
# by id: the boundary skips the call of watch_plain_state for them when they are given no
# argument that is not a tensor (counted by callgrind: about 1,200 instructions a call of
# checkpoint(lambda h: h * 2, x), 0.7% of the 179,000 it costs; the call would cost 0.5 us).
NOTHING_HELD: dict[int, Any] = {}


def modules_held(code: Any, /) -> _Held | None:
    """Which closure cells and defaults (by index), globals and attributes (by name) of
    ``code``'s functions (or a callable object's type's) held modules at its first call
    (``None`` once warned about, or never called)."""
    entry = _HELD.get(id(code))
    return None if entry is None else entry[1]


def _first_look(fn: Any, key: Any, /) -> _Held:
    cells = tuple(i for i, cell in enumerate(dunder(fn, "__closure__") or ())
                  if isinstance(cell_contents(cell), nn.Module))
    defaults = tuple(i for i, value in enumerate(_defaults(fn))
                     if isinstance(value, nn.Module))
    found_globals: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    if key is not type(fn):  # a function, or a method of a plain object
        space = globals_of(fn)
        found_globals = tuple(name for name in globals_read(key)
                              if isinstance(module := dict.get(space, name), nn.Module) and
                              _few_buffers(module, name))
    else:  # a callable object: its own attributes, one level
        attributes = tuple(name for name in attribute_names(fn)
                           if isinstance(attribute(fn, name), nn.Module))
    found = (cells, defaults, found_globals, attributes)
    _HELD[id(key)] = (key, found)
    if not any(found):
        NOTHING_HELD[id(key)] = key
    return found


# A global module with more submodules holding buffers than this is not watched: a whole model
# named by every layer's lambda (`lambda h: model.layers[i](h)`) would cost a watch of all its
# buffers at each call, the model's buffers once per layer (callgrind: 3.35 million instructions
# more a call for a stack of 200 layers with one RoPE buffer each, over the 233,000 the call
# costs; about 16,800 a buffer). A closure cell or argument holding one is watched still, at
# that cost (it is given that model), as before globals were looked at.
_MOST_GLOBAL_BUFFERS = 32


def _few_buffers(module: nn.Module, name: str, /) -> bool:
    holding = sum(1 for d in module_dicts(module).buffers if d)
    if holding <= _MOST_GLOBAL_BUFFERS:
        return True
    logger.info("pytree_ckpt: the global %r a plain function names is a module with %d "
                "submodules holding buffers: not watched for changes its replay repeats "
                "(NOTE [state a plain function changes])", name, holding)
    return False


# NOTE [the buffers a plain function's watch reads]: a function holding a whole model (a
# closure over `self` in a model's forward, `lambda h: self.layers[i](h)`) is watched at every
# call, and most of its submodules hold no buffer. Walking its tree each call (the structure
# check of module_dicts, then every empty dict) cost about 1.1 million callgrind instructions
# a call for a 32-layer model of 289 submodules and one buffer, six times the call itself.
# The dicts that hold buffers are kept per module instead, until a submodule or a buffer is
# registered anywhere (structure_generation): a change behind torch's registration hooks
# (ModuleList.insert) is seen at the next registration, and a buffer registered by the
# forward in a dict that had none is not looked for (this is a warning, not the replay's
# copies, which module_dicts keeps exact for known modules). Weak keys: a model deleted takes
# its entry with it, and a copy of a model has its own.
_BUFFER_DICTS: weakref.WeakKeyDictionary[nn.Module, tuple[int, list[dict[str, Any]]]] = (
    weakref.WeakKeyDictionary())


def _holding_buffers(module: nn.Module, /) -> list[dict[str, Any]]:
    """The buffer dicts of ``module``'s tree that hold a buffer (NOTE [the buffers a plain
    function's watch reads])."""
    cached = _BUFFER_DICTS.get(module)
    if cached is None or cached[0] != structure_generation():
        dicts = [d for d in module_dicts(module).buffers if d]
        cached = (structure_generation(), dicts)  # after module_dicts: it may bump it
        _BUFFER_DICTS[module] = cached
    return cached[1]


def _defaults(fn: Any, /) -> list[Any]:
    return [*(dunder(fn, "__defaults__") or ()),
            *(dunder(fn, "__kwdefaults__") or {}).values()]


def watch_plain_state(fn: Callable[..., Any], leaves: list[Any] | None, spec: Any, /
                      ) -> PlainStateWatch | None:
    """A watch over the buffers of the modules ``fn`` (a plain function) is given among
    ``leaves`` (its non-tensor argument leaves; ``None`` when it has none) or holds; ``None``
    when there are none with buffers (the usual case, a lookup)."""
    shown = fn
    bound: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):  # a partial of a module's method is known: not here
        fn, bound = unwrap_partials(fn)
    key = dunder(fn, "__code__") or type(fn)
    entry = _HELD.get(id(key))
    if entry is None:
        held = _first_look(fn, key)
    elif entry[1] is None:
        return None  # warned about
    else:
        held = entry[1]
    if not (held[0] or held[1] or held[2] or held[3] or leaves or bound):
        return None
    return _watch(fn, shown, key, held, leaves, bound, spec)


def _watch(fn: Any, shown: Any, key: Any, held: _Held, leaves: list[Any] | None,
           bound: list[tuple[str, Any]], spec: Any, /) -> PlainStateWatch | None:
    roots: list[tuple[Any, nn.Module]] = []  # (where: a leaf index or words, the module)
    closure = dunder(fn, "__closure__") or ()
    names = getattr(dunder(fn, "__code__"), "co_freevars", ())
    for i in held[0]:
        if i < len(closure) and isinstance(module := cell_contents(closure[i]), nn.Module):
            roots.append((f"closure variable {names[i]!r}" if i < len(names) else
                          "a closure variable", module))
    defaults = _defaults(fn)
    for i in held[1]:
        if i < len(defaults) and isinstance(defaults[i], nn.Module):
            roots.append(("a default argument", defaults[i]))
    if held[2]:
        space = globals_of(fn)
        for name in held[2]:  # read again by name: a global rebound since is the new one
            if isinstance(module := dict.get(space, name), nn.Module):
                roots.append((f"global {name!r}", module))
    for name in held[3]:
        if isinstance(module := attribute(fn, name), nn.Module):
            roots.append((f"attribute {name!r}", module))
    for where, value in bound:
        if (module := argument_module(value)) is not None:
            roots.append((where, module))
    for index, leaf in enumerate(leaves or ()):
        if leaf is not None and (module := argument_module(leaf)) is not None:
            roots.append((index, module))
    dicts = [d for _, module in roots for d in _holding_buffers(module)]
    if not dicts:
        return None
    return PlainStateWatch(shown, key, roots, spec, dicts)


class PlainStateWatch:
    """The buffers of a plain function's modules, watched across its original pass, then (when
    that pass changed one) across its replay."""

    __slots__ = ("fn", "key", "roots", "spec", "dicts", "watch", "site")

    def __init__(self, fn: Any, key: Any, roots: list[tuple[Any, nn.Module]], spec: Any,
                 dicts: list[dict[str, Any]], /) -> None:
        self.fn, self.key, self.roots, self.spec, self.dicts = fn, key, roots, spec, dicts
        self.watch = StateWatch(dicts, [], (), snapshot=False)
        self.site: tuple[str, int, dict[str, Any]] | None = None

    def after_forward(self) -> PlainStateWatch | None:
        """This watch, with the user's line, when the original pass changed a buffer (to be
        kept for the replay); ``None`` when it changed none."""
        if self.watch.changed() is None or _HELD[id(self.key)][1] is None:
            return None
        self.site = user_site()
        return self

    def before_replay(self) -> StateWatch | None:
        if _HELD[id(self.key)][1] is None:  # warned about (by another call's replay)
            return None
        return StateWatch(self.dicts, [], (), snapshot=False)

    def after_replay(self, watch: StateWatch, /) -> None:
        """Warn (once per code object) when the replay changed a buffer again."""
        changed = watch.changed()
        if changed is None or _HELD[id(self.key)][1] is None:
            return
        _HELD[id(self.key)] = (self.key, None)
        NOTHING_HELD[id(self.key)] = self.key
        moved = {id(d): [name for name in d] if names is None else [n for n, _ in names]
                 for d, names in changed.buffers}
        what = []
        for where, root in self.roots:
            if not isinstance(where, str):
                where = readable_path(leaf_paths(self.spec, root="inputs")[where])
                where = f"argument {where}"
            for path, module in root.named_modules():
                names = moved.pop(id(module._buffers), None)
                if names:
                    what.append(f"{where}{'' if not path else f' submodule {path!r}'} "
                                f"({type(module).__name__}): {', '.join(names)}")
        assert self.site is not None
        filename, lineno, space = self.site
        # NOTE: no module_globals, as warnings.warn passes none: Python 3.12+ raises
        # ValueError for globals without a loader (code exec'd in a fresh module, some
        # notebooks) and warns for a script's __main__ (an error under -W error), so the
        # warning raised in the user's backward; linecache reads the line by file name anyway.
        warnings.warn_explicit(
            f"pytree_ckpt: checkpoint({callable_name(self.fn)}) is a plain function, and both "
            f"its original pass and its replay in backward changed the buffers of modules it "
            f"reaches: {'; '.join(what)}. The boundary does not know these modules, so the "
            "replay runs their forward again and changes that state again, as torch's "
            "reentrant checkpoint does (a batch norm's running statistics are updated twice a "
            "step, num_batches_tracked counts 2); gradients are eager's. Tip: checkpoint the "
            "module itself, checkpoint(block, h), or one of its methods, so that the boundary "
            "knows its state, or skip the update when pytree_ckpt.current_phase() is "
            "'recompute' (docs/limits.md, 'Plain functions')",
            # A module name is needed: given None, warn_explicit drops the warning (code
            # exec'd in a dict without __name__); as Python's own default: the file name
            # without its .py.
            UserWarning, filename, lineno,
            module=space.get("__name__") or filename.removesuffix(".py") or "<unknown>",
            registry=space.setdefault("__warningregistry__", {}))
