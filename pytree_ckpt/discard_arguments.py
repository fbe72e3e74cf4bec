"""The arguments an output discard takes (NOTE [an output discard's arguments]).

``CheckpointWithoutOutput.checkpoint`` checks them here before it runs anything: what it
refuses, and which modules the call is given inside its arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import torch
from torch import nn

from .errors import CheckpointConfigError, CheckpointError
from .frames import callable_name
from .tree import dunder, flatten, is_proxy, proxy_refused, refuse_proxies

__all__ = ["Places", "checked_arguments", "refuse_held_replaced"]

# NOTE [an output discard's arguments]: the discard saves its tensor arguments through
# autograd and differentiates the rebuilt graph to them and to its modules' parameters, so:
# - tensors come as plain positional arguments. One inside a container, a dataclass or a
#   SimpleNamespace (also as a dict's key) would reach the op neither saved nor given its
#   gradient (helper QY: one with a graph used outside failed in backward): refused, naming
#   the argument and the tensor's path;
# - keyword arguments hold plain values only: no tensor and no module anywhere in them;
# - a weakref.proxy is refused wherever it is, named by its path (NOTE [a weakref.proxy
#   leaf] in tree.py): isinstance looks through it, so a walk would read it as what it
#   refers to;
# - a module held in a container, dataclass or namespace argument (`ckpt.checkpoint(fn, x,
#   [norm])`) is one of the call's modules: the state its forward changes is watched, and the
#   rebuild changes copies (helper RB: the rebuild updated a batch norm's running statistics a
#   second time; in a dataclass or namespace backward refused its parameters as foreign). Its
#   parameters are known, as those of a module passed directly, where ``fn`` is a module or a
#   method of one; for a plain function, which may reach other trainable tensors in ways no
#   search finds (a closure, a plain object's method, a callable beside the module: helpers RI,
#   RJ, refused as foreign once the held modules' were known), its parameters stay unknown,
#   accumulated as a reentrant checkpoint does (discard.py).
# The walk takes each object once (a node holding its parent, or itself, ends: helper RA, the
# tree's walk raised RecursionError), is linear in the objects held and has no cap (helpers RB,
# RC: a cap read as no tensor, or as one). It opens containers, namespaces and dataclasses
# (their fields, slots fields too, and their __dict__: helper RB), not modules or other objects;
# where it meets another object, the tree's flatten looks too (a registered pytree node may
# hold tensors). Paths are made only for a refusal: a tensor-free list of a million numbers is
# walked once, without a string per entry (helper RI: walked twice, with paths, it cost twice
# the flatten alone).

# Values that hold nothing the walk looks for; of exactly these classes, they are not even
# pushed (a list of numbers costs a type test each).
_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_EXACTLY_PLAIN = frozenset(_PLAIN)

# A step of the walk: (the object, the step it was reached from, how: an index, ("key", n) for
# a dict's n-th key, (None, key) for a dict's value, a name for an attribute, ... for a set's).
_Step = tuple[object, "_Step | None", object]


def _path(step: _Step, root: str, /) -> str:
    """The path of ``step``'s object from ``root`` (``args[1][0].t``)."""
    parts = []
    node: _Step | None = step
    while node is not None and node[1] is not None:
        how = node[2]
        if isinstance(how, tuple):  # a dict's key, or its value under that key
            parts.append(f".keys()[{how[1]}]" if how[0] == "key" else f"[{how[1]!r}]")
        else:
            parts.append(f"[{how}]" if isinstance(how, int) else f".{how}"
                         if isinstance(how, str) else "{...}")
        node = node[1]
    return root + "".join(reversed(parts))


def _walk(value: object, root: str, /) -> Iterator[tuple[object, _Step, bool]]:
    """Each object reachable in ``value`` as the NOTE says: the object, its step and whether
    the walk opened it; what it opens once, a tensor, module or plain value at each place it is
    held. A weakref.proxy on the way is refused, named by its path."""
    seen: set[int] = set()
    stack: list[_Step] = [(value, None, None)]
    while stack:
        step = stack.pop()  # children are pushed last first: met in their order
        item = step[0]
        if is_proxy(item):  # before isinstance, which a proxy answers for what it refers to
            raise proxy_refused(item, _path(step, root))
        if isinstance(item, (torch.Tensor, nn.Module) + _PLAIN):
            yield item, step, False  # at each place it is held (helper RM)
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple)):
            stack.extend((v, step, k) for k, v in reversed(list(enumerate(item)))
                         if type(v) not in _EXACTLY_PLAIN)
        elif isinstance(item, (set, frozenset)):
            stack.extend((v, step, ...) for v in reversed(list(item))
                         if type(v) not in _EXACTLY_PLAIN)
        elif isinstance(item, dict):
            keys = list(item)
            stack.extend((keys[n], step, ("key", n)) for n in range(len(keys) - 1, -1, -1)
                         if type(keys[n]) not in _EXACTLY_PLAIN)
            stack.extend((v, step, (None, k)) for k, v in reversed(list(item.items()))
                         if type(v) not in _EXACTLY_PLAIN)
        elif isinstance(item, types.SimpleNamespace):
            stack.extend((v, step, k) for k, v in reversed(vars(item).items()))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            held = dunder(item, "__dict__")
            stack.extend((v, step, k) for k, v in
                         reversed(held.items() if isinstance(held, dict) else ()))
            stack.extend((dunder(item, f.name), step, f.name)
                         for f in reversed(dataclasses.fields(cast(Any, item))))
        else:
            yield item, step, False
            continue
        yield item, step, True


def _opened(value: object, /) -> bool:
    """Whether the walk looks inside ``value`` (a plain tensor or int is not walked)."""
    return isinstance(value, (list, tuple, dict, set, frozenset, types.SimpleNamespace)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type))


# Where a module is held: the container holding it (by id) and how (an index, a key, a name;
# a set member by its own id). Not a path from the root: a container referenced from a place the
# walk meets first would move every module in it to another path (helper RO: refused, naming a
# place that still held the module), and a path per place costs its depth (quadratic in a deep
# nesting). Each place keeps its container (so that no other object takes its id until the
# rebuild's check); a container replaced by a copy holding the same module is another place.
# Paths are made for a refusal only.
_Place = tuple[int, object]
Places = dict[_Place, tuple[nn.Module, object]]


def _place(step: _Step, /) -> _Place:
    parent = step[1]
    assert parent is not None
    return id(parent[0]), ("member", id(step[0])) if step[2] is ... else step[2]


def _look(value: object, root: str, refuse: Callable[[str], NoReturn] | None, places: Places,
          /, *, modules_too: bool) -> None:
    """Put the modules held in ``value`` into ``places``; ``refuse`` (if given) is called with
    the path of a tensor (or, ``modules_too``, of a module) held in it."""
    other = False
    for item, step, opened in _walk(value, root):
        if refuse is not None and (isinstance(item, torch.Tensor) or
                                   modules_too and isinstance(item, nn.Module)):
            refuse(_path(step, root))
        if isinstance(item, nn.Module):
            assert step[1] is not None  # a module is met inside an opened argument
            places[_place(step)] = (item, step[1][0])
        elif not opened and not isinstance(item, _PLAIN):
            other = True
    if other and refuse is not None:
        flat = flatten(value, root=root)
        refuse_proxies(flat, root=root)  # NOTE [a weakref.proxy leaf]
        if any(isinstance(x, torch.Tensor) or modules_too and isinstance(x, nn.Module)
               for x in flat.leaves):
            refuse(root)


def _refuse_held_tensor(fn: Callable[..., Any], i: int, arg: object, path: str, /) -> NoReturn:
    # A function taking them one by one: torch.cat itself takes no tensors so (helper QV: the
    # tip read as ckpt.checkpoint(torch.cat, a, b) failed).
    raise CheckpointConfigError(
        "CheckpointWithoutOutput takes tensors as plain arguments; "
        f"{callable_name(fn)} got a container of tensors at args[{i}]",
        expected="fn(tensor, ..., other_values)",
        got=f"args[{i}]: {type(arg).__name__} holding a tensor at {path}",
        tip="pass the tensors as separate arguments of a function that takes them one by one "
            "(ckpt.checkpoint(lambda a, b: torch.cat([a, b], -1), a, b)), or use "
            "pytree_ckpt.checkpoint for structured inputs")


def _refuse_keyword(fn: Callable[..., Any], key: str, value: object, path: str, /) -> NoReturn:
    raise CheckpointConfigError(
        f"CheckpointWithoutOutput takes tensors and modules as positional arguments; "
        f"{callable_name(fn)} got one as keyword {key!r}",
        expected="fn(tensor, ..., option=plain_value)",
        got=f"{key}={type(value).__name__}" + ("" if path == f"kwargs[{key!r}]" else
                                               f" holding one at {path}"),
        tip="pass it positionally (a lambda or a method can reorder arguments: "
            "ckpt.checkpoint(lambda x, w: F.layer_norm(x, (64,), weight=w), x, w))")


def checked_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                      /) -> Places:
    """Refuse what NOTE [an output discard's arguments] refuses; return where modules are held
    inside ``args``' containers, dataclasses and namespaces (each place in the order met)."""
    for i, arg in enumerate(args):  # NOTE [a weakref.proxy leaf] (tree.py): helper NY
        if is_proxy(arg):
            raise proxy_refused(arg, f"args[{i}] of {callable_name(fn)}")
    for key, value in kwargs.items():
        if isinstance(value, (torch.Tensor, nn.Module)):
            _refuse_keyword(fn, key, value, f"kwargs[{key!r}]")
        if not isinstance(value, _PLAIN):
            _look(value, f"kwargs[{key!r}]", functools.partial(_refuse_keyword, fn, key, value),
                  {}, modules_too=True)
    places: Places = {}
    for i, arg in enumerate(args):
        if _opened(arg):
            _look(arg, f"args[{i}]", functools.partial(_refuse_held_tensor, fn, i, arg), places,
                  modules_too=False)
    return places


def _held_now(args: tuple[Any, ...], /) -> Places:
    places: Places = {}
    for i, arg in enumerate(args):
        if _opened(arg):  # a tensor put in since is not the call's to refuse (helper RO)
            _look(arg, f"args[{i}]", None, places, modules_too=False)
    return places


def _path_of(args: tuple[Any, ...], place: _Place, /) -> str:
    """The path of ``place`` in ``args`` now, for a refusal (``args[1][0]``)."""
    for i, arg in enumerate(args):
        if _opened(arg):
            for item, step, _ in _walk(arg, f"args[{i}]"):
                if isinstance(item, nn.Module) and _place(step) == place:
                    return _path(step, f"args[{i}]")
    return "a place in the arguments that held it at the call"


def refuse_held_replaced(fn: Callable[..., Any], args: tuple[Any, ...], then: Places, /
                         ) -> None:
    """Refuse the rebuild of a discard of ``fn`` unless ``args`` hold the modules they held at
    the call (``then``, from ``checked_arguments``) at the same places, and no others: a list
    entry swapped before backward would make the rebuild run another module and give its
    gradients there (helper RI), one appended to a list the op loops over would run too
    (helper RM), the call's own module appended again would run twice (helper RO). By place,
    not by order: a module put back where it was passes (helper RK)."""
    now = {k: module for k, (module, _) in _held_now(args).items()}
    if now.keys() == then.keys() and all(now[k] is m for k, (m, _) in then.items()):
        return
    place = next((k for k, (m, _) in then.items() if now.get(k) is not m), None)
    if place is None:
        place = next(k for k in now if k not in then)
    was, current = then[place][0] if place in then else None, now.get(place)
    path = _path_of(args, place) if current is not None else \
        "a place in the arguments that held it at the call"
    raise CheckpointError(
        f"a module held in an argument of {callable_name(fn)} changed between its forward and "
        "this backward: the rebuild would run other modules than the forward ran, and give "
        "their gradients there",
        expected=f"{path}: " + (f"the {type(was).__name__} the forward was given"
                                if was is not None else "no module"),
        got=f"{path}: " + ("no module" if current is None else f"another {type(current).__name__}"
                           if was is not None else f"a {type(current).__name__}"),
        tip="change the modules an argument holds between steps (after backward)")
