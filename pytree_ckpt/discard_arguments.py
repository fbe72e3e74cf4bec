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

__all__ = ["Places", "checked_arguments", "held_places", "module_routes",
           "refuse_held_replaced", "refuse_taken_out"]

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
# the flatten alone); one holding a module is walked again for its places when the forward
# returns and twice in backward (before and after the rebuild), and for every route to its
# modules at the call and at the op's return (module_routes).

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


def _how(how: object, /) -> object:
    """A step's ``how`` as places and routes compare it: a dict key of a plain class by value,
    any other key by identity (its ``==`` is never called: helper RT, one answering a truthy
    non-bool let swapped modules through, one raising crashed backward); a dict's keys and a
    set's members by their place in no order (their identity is compared as the object's)."""
    if how is ... or isinstance(how, tuple) and how[0] == "key":
        return ("member",)
    if isinstance(how, tuple):  # (None, key): a dict's value under that key
        key = how[1]
        return ("value", key) if _plain_key(key) else ("value-of", id(key))
    return how


def _plain_key(key: object, /) -> bool:
    """A key compared by value: of a plain class, or a tuple (a namedtuple too, whose == and
    hash are the tuple's: helper RW) of such (helper RU: a fresh dict keyed by computed tuples
    was refused)."""
    kind = type(key)
    return kind in _EXACTLY_PLAIN or isinstance(key, tuple) and \
        kind.__eq__ is tuple.__eq__ and kind.__hash__ is tuple.__hash__ and \
        all(map(_plain_key, key))


def _route(step: _Step, /) -> tuple[object, ...]:
    """How ``step``'s object is reached from its root: the indices, keys and names on the way
    (a set's members, and a dict's keys, as members of it)."""
    hows: list[object] = []
    node: _Step | None = step
    while node is not None and node[1] is not None:
        hows.append(_how(node[2]))
        node = node[1]
    return tuple(reversed(hows))


def _walk(value: object, root: str, /, *, proxies: bool = True
          ) -> Iterator[tuple[object, _Step, bool | None]]:
    """Each object reachable in ``value`` as the NOTE says: the object, its step and whether
    the walk opened it (``None``: a container it opened before, met again at another place);
    what it opens once, a tensor, module or plain value at each place it is held. A
    weakref.proxy on the way is refused, named by its path (``proxies``; else it is met, not
    opened: one put in since the call is not the call's to refuse, helper RP)."""
    seen: set[int] = set()
    stack: list[_Step] = [(value, None, None)]
    while stack:
        step = stack.pop()  # children are pushed last first: met in their order
        item = step[0]
        if is_proxy(item):  # before isinstance, which a proxy answers for what it refers to
            if proxies:
                raise proxy_refused(item, _path(step, root))
            yield item, step, False
            continue
        if isinstance(item, (torch.Tensor, nn.Module) + _PLAIN):
            yield item, step, False  # at each place it is held (helper RM)
            continue
        if id(item) in seen:
            yield item, step, None
            continue
        seen.add(id(item))
        children = _children(item)
        if children is None:
            yield item, step, False
            continue
        stack.extend((v, step, how) for v, how in reversed(children))
        yield item, step, True


def _children(item: object, /) -> list[tuple[Any, Any]] | None:
    """What the walk opens ``item`` to, in order, each with how it is held there (values of
    exactly a plain class left out: they hold nothing); ``None`` where it does not open it."""
    if isinstance(item, (list, tuple)):
        return [(v, k) for k, v in enumerate(item) if type(v) not in _EXACTLY_PLAIN]
    if isinstance(item, (set, frozenset)):
        return [(v, ...) for v in item if type(v) not in _EXACTLY_PLAIN]
    if isinstance(item, dict):
        keys = list(item)
        return [(v, (None, k)) for k, v in item.items() if type(v) not in _EXACTLY_PLAIN] + \
            [(k, ("key", n)) for n, k in enumerate(keys) if type(k) not in _EXACTLY_PLAIN]
    if isinstance(item, types.SimpleNamespace):
        return [(v, k) for k, v in vars(item).items()]
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        held = dunder(item, "__dict__")
        return [(dunder(item, f.name), f.name) for f in dataclasses.fields(cast(Any, item))] + \
            [(v, k) for k, v in (held.items() if isinstance(held, dict) else ())]
    return None


def _opened(value: object, /) -> bool:
    """Whether the walk looks inside ``value`` (a plain tensor or int is not walked)."""
    return isinstance(value, (list, tuple, dict, set, frozenset, types.SimpleNamespace)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type))


# Where a module is held: the container holding it (by id) and how (an index, a key, a name; a
# set member, or a dict key, by its own id). Not a path from the root: a container referenced
# from a place the walk meets first would move every module in it to another path (helper RO:
# refused, naming a place that still held the module), and a path per place costs its depth
# (quadratic in a deep nesting). Each place keeps its walk step, and with it its containers (no
# other object takes their ids until the rebuild's check), for the path of a refusal. Places are
# kept in the order the walk meets them, which is the order the op iterates: modules reordered
# in a dict the op loops over would run in another order (helper RP). Where the places differ,
# the same modules at the same paths in the same order (containers of any class) pass still (a
# container replaced by a copy; an op building a fresh list of its modules at each call: helper
# RR), compared by their keys, not their text. Where a container holding modules is held is a
# place too (helper RS: one met again elsewhere, emptied there, was silent). The places are
# those the forward left (an op may put one of its modules at a new key itself: helper RP), and
# the rebuild must leave them so too (checked after it: one appending a module at each call ran
# others in the rebuild, helper RQ); one that takes a module it was given from where it found it
# is refused when it returns, by every route to it (refuse_taken_out; helper RU: by the walk's
# first route, an alias the op put at an earlier key read as a move).
_Place = tuple[int, object]
Places = dict[_Place, tuple[object, _Step, str]]  # a module, or a container holding one


def _place(step: _Step, /) -> _Place:
    parent, how = step[1], _how(step[2])
    assert parent is not None
    return id(parent[0]), ("member", id(step[0])) if how == ("member",) else how


def _look(value: object, root: str, refuse: Callable[[str], NoReturn] | None, places: Places,
          /, *, modules_too: bool) -> None:
    """Put the modules held in ``value`` into ``places``; ``refuse`` (if given) is called with
    the path of a tensor (or, ``modules_too``, of a module) held in it, and a weakref.proxy is
    refused (else passed over)."""
    other = False
    references: list[_Step] = []  # where containers are held (not the argument itself)
    holding: set[int] = set()  # the containers that hold a module, at any depth
    for item, step, opened in _walk(value, root, proxies=refuse is not None):
        if refuse is not None and (isinstance(item, torch.Tensor) or
                                   modules_too and isinstance(item, nn.Module)):
            refuse(_path(step, root))
        if isinstance(item, nn.Module):
            places[_place(step)] = (item, step, root)
            node = step[1]
            while node is not None and id(node[0]) not in holding:
                holding.add(id(node[0]))
                node = node[1]
        elif opened is None or opened and step[1] is not None:
            references.append(step)
        elif not opened and not isinstance(item, _PLAIN):
            other = True
    # Each place a container holding modules is held at is a place too, where it was opened
    # and where it was met again: emptied or replaced at the second, the op reading it there
    # ran other modules (helper RS). One that holds none is not: its places would refuse
    # changes that move no module.
    for step in references:
        if id(step[0]) in holding:
            places[_place(step)] = (step[0], step, root)
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


def held_places(args: tuple[Any, ...], /) -> Places:
    """Where modules are held in ``args`` now, in the order met (nothing refused: what was put
    in since the call is not the call's to refuse, helper RO)."""
    places: Places = {}
    for i, arg in enumerate(args):
        if _opened(arg):
            _look(arg, f"args[{i}]", None, places, modules_too=False)
    return places


def _same_routes(then: Places, now: Places, /) -> bool:
    """The same modules, reached by the same routes, in order."""
    return all(_alike(a[0], b[0]) and a[2] == b[2] and _route(a[1]) == _route(b[1])
               for a, b in zip(then.values(), now.values()))


def _alike(then: object, now: object, /) -> bool:
    """A module is the same object; a container, any container (an op building a fresh list
    of its modules at each call, or making a list a tuple: helper RU): the modules in it are
    compared at their own places."""
    return then is now or not isinstance(then, nn.Module) and not isinstance(now, nn.Module)


def refuse_held_replaced(fn: Callable[..., Any], args: tuple[Any, ...], then: Places, /, *,
                         rebuilt: bool = False) -> None:
    """Refuse the rebuild of a discard of ``fn`` unless ``args`` hold the modules they held
    when the forward returned (``then``, from ``held_places``; an op that puts one of its
    modules at a new key itself is not refused, helper RP) at the same places, in the same
    order, and no others: a list entry swapped before backward would make the rebuild run
    another module and give its gradients there (helper RI), one appended to a list the op
    loops over would run too (helper RM), the call's own module appended again would run twice
    (helper RO), modules reordered in a dict would run in another order (helper RP). By place,
    not by order of the walk alone: a module put back where it was passes (helper RK).
    ``rebuilt``: checked again once the rebuild ran the op, which must leave them as the
    forward did (an op that appends a module at each call ran others: helper RQ)."""
    now = held_places(args)
    if len(now) == len(then) and all(
            k == j and a[0] is b[0] for (k, a), (j, b) in zip(then.items(), now.items())):
        return
    # Other containers, the same routes to the same modules in the same order: an op that
    # builds a fresh list of them at each call (helper RR), a container replaced by a copy.
    # Routes by their keys, not by the text of their paths (helper RS: two keys that print
    # alike told apart only by identity).
    if len(now) == len(then) and _same_routes(then, now):
        return
    for place, (module, step, root) in then.items():
        current = now.get(place)
        if current is None or current[0] is not module:
            where = _path(step, root)
            got = "no module" if current is None else f"another {type(current[0]).__name__}"
            expected = f"the {type(module).__name__} the forward was given"
            break
    else:
        # the most specific new place (a namespace now holding a list of modules holds them
        # too: name the list's place in it)
        added = max((v for k, v in now.items() if k not in then),
                    key=lambda v: len(_route(v[1])), default=None)
        if added is not None:
            module, step, root = added
            where, expected, got = _path(step, root), "no module", f"a {type(module).__name__}"
        else:  # the same places, met in another order
            module, step, root = next(iter(then.values()))
            where = _path(step, root) + " and the modules beside it"
            expected, got = "the order of the call", "another order"
    if rebuilt:
        raise CheckpointError(
            f"the rebuild of {callable_name(fn)} left the modules held in its arguments "
            "otherwise than its forward did: the op changes where they are held at each call "
            "(appends one, pops one), so the rebuild ran other modules than the forward, or in "
            "another order", expected=f"{where}: {expected} (as the forward left it)",
            got=f"{where}: {got}",
            tip="keep the op from changing its arguments' containers (build the list before "
                "the call), or do not discard its output")
    raise CheckpointError(
        f"a module held in an argument of {callable_name(fn)} changed between its forward and "
        "this backward: the rebuild would run other modules than the forward ran, or in "
        "another order, and give their gradients there",
        expected=f"{where}: {expected}", got=f"{where}: {got}",
        tip="change the modules an argument holds between steps (after backward)")


# The routes module_routes follows at most: sharing (a list held at two places of a list held
# at two places...) multiplies routes; past this many steps the check at the op's return is not
# made (the checks before and after the rebuild still are).
_MOST_ROUTE_STEPS = 100_000


_Routes = dict[tuple[str, tuple[object, ...]], list[nn.Module]]


def module_routes(args: tuple[Any, ...], /) -> _Routes | None:
    """Every route to a module held in ``args``' containers, by each path to it (a container
    held at two places gives its modules two routes; helper RU: by the walk's first route
    alone, an alias the op put at an earlier key hid the place it found them at). ``None``
    past _MOST_ROUTE_STEPS."""
    found: _Routes = {}  # a list: a set's members share their route (helper RV)
    steps = 0
    for i, arg in enumerate(args):
        if not _opened(arg):
            continue
        stack: list[tuple[object, tuple[object, ...], frozenset[int]]] = [(arg, (), frozenset())]
        while stack:
            item, route, inside = stack.pop()
            steps += 1
            if steps > _MOST_ROUTE_STEPS:
                return None
            if is_proxy(item):
                continue
            if isinstance(item, nn.Module):
                found.setdefault((f"args[{i}]", route), []).append(item)
            elif id(item) not in inside:  # a cycle ends
                within = inside | {id(item)}
                stack.extend((child, route + (_how(how),), within)
                             for child, how in _children(item) or ())
    return found


def refuse_taken_out(fn: Callable[..., Any], before: _Routes | None, args: tuple[Any, ...],
                     /) -> None:
    """Refuse an op that took a module it was given (``before``: its routes at the call) from
    where it found it while it ran (``args`` at its return): its rebuild in backward would not
    find it there (helper RS: `while q: x = q.pop(0)(x)` rebuilt nothing; helper RT: `d["b"]
    = d.pop("a")` raised the op's KeyError). Put at new places too is fine (an op caching its
    module at a new key: helper RP), and so is a container made another (a list a tuple)."""
    after = module_routes(args) if before else None
    if before is None or after is None:
        return  # nothing held, or past the bound
    for (root, route), modules in before.items():
        there = {id(m) for m in after.get((root, route), ())}  # a set: helper RW, quadratic
        module = next((m for m in modules if id(m) not in there), None)
        if module is None:
            continue
        raise CheckpointError(
            f"{callable_name(fn)} took a module it was given from where it found it while it "
            "ran: its rebuild in backward would not find it there, and would run other modules "
            "than its forward",
            expected=f"{_route_text(root, route)}: the {type(module).__name__}, still there "
                     "when the op returns", got=f"{_route_text(root, route)}: taken out or moved",
            tip="keep the op from changing the containers it is given (iterate over a copy "
                "inside it: for m in list(queue)), or do not discard its output")


def _route_text(root: str, route: tuple[object, ...], /) -> str:
    """``route`` as a path from ``root`` (``args[1]['mods'][0]``)."""
    parts = [f"[{how}]" if isinstance(how, int) else f".{how}" if isinstance(how, str) else
             "{...}" if how == ("member",) else
             f"[{how[1]!r}]" if isinstance(how, tuple) and how[0] == "value" else "[<key>]"
             for how in route]
    return root + "".join(parts)
