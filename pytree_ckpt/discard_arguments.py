"""The arguments an output discard takes (NOTE [an output discard's arguments]).

``CheckpointWithoutOutput.checkpoint`` checks them here before it runs anything: what it
refuses, and which modules the call is given inside its arguments.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import torch
from torch import nn

from .errors import CheckpointConfigError
from .frames import callable_name
from .tree import dunder, flatten, is_proxy, proxy_refused, refuse_proxies

__all__ = ["checked_arguments"]

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
#   [norm])`) is one of the call's modules, as one passed directly: its parameters get their
#   gradients from the op's node and the state its forward changes is watched (helper RB: in a
#   dataclass or namespace its parameters were unknown, and backward refused them as foreign;
#   in a list the call was an unknown callable's, and the rebuild updated a batch norm's
#   running statistics a second time).
# The walk takes each object once (a node holding its parent, or itself, ends: helper RA, the
# tree's walk raised RecursionError), is linear in the objects held and has no cap (helpers RB,
# RC: a cap read as no tensor, or as one). It opens containers, namespaces and dataclasses
# (their fields, slots fields too, and their __dict__: helper RB), not modules or other objects.


def _walk(value: object, root: str, /) -> Iterator[tuple[object, str]]:
    """Each object reachable in ``value`` as the NOTE says, once, with its path from ``root``;
    a weakref.proxy on the way is refused there."""
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(value, root)]
    while stack:
        item, path = stack.pop()  # children are pushed last first: met in their order
        if is_proxy(item):  # before isinstance, which a proxy answers for what it refers to
            raise proxy_refused(item, path)
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item, path
        if isinstance(item, (torch.Tensor, nn.Module)):
            continue
        children: list[tuple[object, str]] = []
        if isinstance(item, (list, tuple)):
            children = [(v, f"{path}[{k}]") for k, v in enumerate(item)]
        elif isinstance(item, (set, frozenset)):
            children = [(v, f"{path}{{...}}") for v in item]
        elif isinstance(item, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in item.items()]
            children += [(k, f"{path}.keys()[{n}]") for n, k in enumerate(item)]
        elif isinstance(item, types.SimpleNamespace):
            children = [(v, f"{path}.{k}") for k, v in vars(item).items()]
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            children = [(dunder(item, f.name), f"{path}.{f.name}")
                        for f in dataclasses.fields(cast(Any, item))]
            held = dunder(item, "__dict__")
            children += [(v, f"{path}.{k}") for k, v in
                         (held.items() if isinstance(held, dict) else ())]
        stack.extend(reversed(children))


def _opened(value: object, /) -> bool:
    """Whether the walk looks inside ``value`` (a plain tensor or int is not walked)."""
    return isinstance(value, (list, tuple, dict, set, frozenset, types.SimpleNamespace)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type))


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
                      /) -> list[nn.Module]:
    """Refuse what NOTE [an output discard's arguments] refuses; return the modules held inside
    ``args``' containers, dataclasses and namespaces, each once, in the order found."""
    for i, arg in enumerate(args):  # NOTE [a weakref.proxy leaf] (tree.py): helper NY
        if is_proxy(arg):
            raise proxy_refused(arg, f"args[{i}] of {callable_name(fn)}")
    for key, value in kwargs.items():
        root = f"kwargs[{key!r}]"
        flat = flatten(value, root=root)  # opens registered pytree nodes the walk does not
        refuse_proxies(flat, root=root)  # NOTE [a weakref.proxy leaf]
        if any(isinstance(x, (torch.Tensor, nn.Module)) for x in flat.leaves):
            _refuse_keyword(fn, key, value, root)
        for item, path in _walk(value, root) if _opened(value) else ():
            if isinstance(item, (torch.Tensor, nn.Module)):
                _refuse_keyword(fn, key, value, path)
    held: list[nn.Module] = []
    for i, arg in enumerate(args):
        if not _opened(arg):
            continue
        root = f"args[{i}]"
        if isinstance(arg, (list, tuple, dict)):
            flat = flatten(arg, root=root)
            refuse_proxies(flat, root=root)  # NOTE [a weakref.proxy leaf]
            if any(isinstance(x, torch.Tensor) for x in flat.leaves):  # a pytree node too
                _refuse_held_tensor(fn, i, arg, next((path for x, path in _walk(arg, root)
                                                      if isinstance(x, torch.Tensor)), root))
        for item, path in _walk(arg, root):
            if isinstance(item, torch.Tensor):
                _refuse_held_tensor(fn, i, arg, path)
            if isinstance(item, nn.Module) and not any(item is m for m in held):
                held.append(item)
    return held
