"""Module state a plain function changes: warned, once per function (NOTE [state a plain
function changes]).

The boundary watches the state of the modules it knows (NOTE [state the forward changes] in
``state_changes.py``); this file only looks, for a plain function, at the modules it is given
or holds, and says when the replay will change their state again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import CodeType
from typing import Any

from torch import nn

from .eager import user_stacklevel
from .frames import callable_name
from .module_state import argument_module, module_dicts
from .refusals import readable_path
from .state_changes import StateWatch
from .tree import leaf_paths

__all__ = ["NOTHING_HELD", "PlainStateWatch", "modules_held", "watch_plain_state"]

# NOTE [state a plain function changes]: a plain function (NOTE [unknown callables] in
# boundary.py) reaches modules the boundary does not know, so its replay runs their forward
# again on their own state: a batch norm's running statistics are updated twice a step, a step
# counter counts twice, as with torch's reentrant checkpoint. Making those modules known would
# change how their gradients are routed; instead the modules the function is given (argument
# leaves, or bound methods of modules) or holds (closure cells, bound defaults: not globals)
# have their buffers watched across the original pass with a StateWatch, and a change is
# warned once per code object (a lambda written in a loop is one function), naming the module,
# the buffers and the fix. Which cells and defaults hold modules is read once per code object,
# at its first call (a later function of that code holding a module where the first held none
# is not looked at); a function that holds none and is given none costs one dict lookup a
# call after that. One that holds modules is watched at every call until it is warned about
# (a module in eval mode: a version read per buffer), then never again. Both tables are keyed
# by id and hold the code object itself (so its id is not reused): hashing a code object hashes
# its instructions, about 1.6 us for a 60-line function. Code objects are held strongly, as
# warnings' own registries hold what they warned about.
_Held = tuple[tuple[int, ...], tuple[int, ...]]
_HELD: dict[int, tuple[Any, _Held | None]] = {}  # by id(code): (code, held; None: warned)
# The code objects whose functions hold no module (at their first call) or were warned about,
# by id: the boundary skips the call of watch_plain_state for them when they are given no
# argument that is not a tensor (counted by callgrind: about 1,200 instructions a call of
# checkpoint(lambda h: h * 2, x), 0.7% of the 179,000 it costs; the call would cost 0.5 us).
NOTHING_HELD: dict[int, Any] = {}


def modules_held(code: CodeType, /) -> _Held | None:
    """Which closure cells and defaults of ``code``'s functions held modules at its first
    call (``None`` once warned about, or never called)."""
    entry = _HELD.get(id(code))
    return None if entry is None else entry[1]


def _first_look(fn: Any, key: Any, /) -> _Held:
    cells = tuple(i for i, cell in enumerate(getattr(fn, "__closure__", None) or ())
                  if isinstance(_contents(cell), nn.Module))
    defaults = tuple(i for i, value in enumerate(_defaults(fn))
                     if isinstance(value, nn.Module))
    found = (cells, defaults)
    _HELD[id(key)] = (key, found)
    if not (cells or defaults):
        NOTHING_HELD[id(key)] = key
    return found


def _contents(cell: Any, /) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet (a name assigned after the function was made)
        return None


def _defaults(fn: Any, /) -> list[Any]:
    return [*(getattr(fn, "__defaults__", None) or ()),
            *(getattr(fn, "__kwdefaults__", None) or {}).values()]


def watch_plain_state(fn: Callable[..., Any], leaves: list[Any] | None, spec: Any, /
                      ) -> PlainStateWatch | None:
    """A watch over the buffers of the modules ``fn`` (a plain function) is given among
    ``leaves`` (its non-tensor argument leaves; ``None`` when it has none) or holds; ``None``
    when there are none with buffers (the usual case, a lookup)."""
    key = getattr(fn, "__code__", None) or type(fn)
    entry = _HELD.get(id(key))
    if entry is None:
        held = _first_look(fn, key)
    elif entry[1] is None:
        return None  # warned about
    else:
        held = entry[1]
    if not (held[0] or held[1] or leaves):
        return None
    return _watch(fn, key, held, leaves, spec)


def _watch(fn: Any, key: Any, held: _Held,
           leaves: list[Any] | None, spec: Any, /) -> PlainStateWatch | None:
    roots: list[tuple[Any, nn.Module]] = []  # (where: a leaf index or a name, the module)
    closure = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    for i in held[0]:
        if i < len(closure) and isinstance(module := _contents(closure[i]), nn.Module):
            roots.append((f"closure variable {names[i]!r}" if i < len(names) else
                          "a closure variable", module))
    defaults = _defaults(fn)
    for i in held[1]:
        if i < len(defaults) and isinstance(defaults[i], nn.Module):
            roots.append(("a default argument", defaults[i]))
    for index, leaf in enumerate(leaves or ()):
        if leaf is not None and (module := argument_module(leaf)) is not None:
            roots.append((index, module))
    dicts = [d for _, module in roots for d in module_dicts(module).buffers]
    if not any(dicts):
        return None
    return PlainStateWatch(fn, key, roots, spec, StateWatch(dicts, [], (), snapshot=False))


class PlainStateWatch:
    """The buffers of a plain function's modules, watched across its original pass."""

    __slots__ = ("fn", "key", "roots", "spec", "watch")

    def __init__(self, fn: Any, key: Any, roots: list[tuple[Any, nn.Module]], spec: Any,
                 watch: StateWatch, /) -> None:
        self.fn, self.key, self.roots, self.spec, self.watch = fn, key, roots, spec, watch

    def tell(self) -> None:
        """Warn (once per code object) when the original pass changed a buffer."""
        changed = self.watch.changed()
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
        name = callable_name(self.fn)
        warnings.warn(
            f"pytree_ckpt: checkpoint({name}) is a plain function, and its original pass "
            f"changed the buffers of modules it reaches: {'; '.join(what)}. The boundary does "
            "not know these modules, so the replay in backward runs their forward again and "
            "changes that state again, as torch's reentrant checkpoint does (a batch norm's "
            "running statistics are updated twice a step, num_batches_tracked counts 2); "
            "gradients are eager's. Tip: checkpoint the module itself, checkpoint(block, h), "
            "or one of its methods, so that the boundary knows its state (docs/limits.md, "
            "'Plain functions')",
            stacklevel=user_stacklevel())
