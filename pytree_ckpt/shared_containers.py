"""One container object passed in several places of a call, rebuilt once for the replay.

NOTE [containers passed in several places]: the original pass gets the caller's own arguments
(``BoundaryCall.original_call``); the replay gets containers rebuilt from the flattened spec,
one per *place*. A list passed twice (``layer(h, acc, extra=acc)``), a dict holding one list
under two keys, a list passed positionally and inside a dict: in eager a change through one
place (an append, a new key, a set attribute) is seen through the others, and the replay must
see the same. So the boundary records, at the call, which places hold a container object an
earlier place (in optree's pre-order) already holds, and the replay builds that container once
and puts the same object at each of its places.

- What is recorded: mutable containers only, the nodes whose type is not a ``tuple``
  (namedtuples and ``torch.return_types`` are tuples) and not ``None``: lists, dicts (and the
  ``collections`` mappings optree opens), deques, dataclass instances and any node type
  registered with optree (its unflatten function runs once for the shared object, as eager
  has one object). A tuple cannot be changed, so two rebuilt tuples equal to one are harmless;
  a list inside a repeated tuple is still found, as a repeated list.
- Cost: the usual call pays one subtraction: with fewer than two nodes (containers or
  ``None`` nodes: ``spec.num_nodes - spec.num_leaves``) besides the call's own ``(args, kwargs)``
  pair, ``args`` tuple and ``kwargs`` dict, no container can repeat. Otherwise the pre-order
  positions of the mutable containers are cached per spec, and only a call with two or more of
  them walks its arguments once more (one optree flatten that records each node, about 4 us)
  to compare their ids. The replay rebuilds through this module only when one does repeat.
- Not seen: a container inside a leaf the tree bridge does not open (a ``dict`` subclass, a
  plain object: NOTE [leaves that hold tensors] in tree.py), or one a module holds as an
  attribute: the replay hands such a leaf the caller's own object, which the original pass
  already changed, while the opened place gets a rebuilt copy (docs/limits.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import optree

from .tree import NAMESPACE

__all__ = ["shared_containers", "unflatten_shared"]

# The pre-order positions of a call spec's mutable containers, by spec (NOTE [containers
# passed in several places]); cleared when full: a call whose structure changes every time
# (lists of varying length) costs one spec walk a call, never memory.
_POSITIONS: dict[optree.PyTreeSpec, tuple[int, ...]] = {}
_MAX_SPECS = 256


def _positions(spec: optree.PyTreeSpec, /) -> tuple[int, ...]:
    found: list[int] = []

    def walk(node: optree.PyTreeSpec, index: int) -> None:
        kind = node.type
        if kind is None:  # a leaf
            return
        if not issubclass(kind, tuple) and kind is not type(None):
            found.append(index)
        index += 1
        for child in node.children():
            walk(child, index)
            index += child.num_nodes

    # Pre-order: 0 the (args, kwargs) pair, 1 args, then its arguments, then kwargs and its
    # values. The call's own args tuple and kwargs dict are never the caller's objects.
    args, kwargs = spec.children()
    index = 2
    for child in args.children():
        walk(child, index)
        index += child.num_nodes
    index += 1
    for child in kwargs.children():
        walk(child, index)
        index += child.num_nodes
    return tuple(found)


def shared_containers(call: tuple[tuple[Any, ...], dict[str, Any]], spec: optree.PyTreeSpec,
                      /) -> dict[int, int] | None:
    """For a call's ``(args, kwargs)`` and its spec: the pre-order position of each place that
    holds a container object an earlier place holds, mapped to that first place; ``None``
    when no container repeats (NOTE [containers passed in several places])."""
    if spec.num_nodes - spec.num_leaves < 5:  # (args, kwargs), args, kwargs, one container
        return None
    positions = _POSITIONS.get(spec)
    if positions is None:
        if len(_POSITIONS) >= _MAX_SPECS:
            _POSITIONS.clear()
        positions = _POSITIONS[spec] = _positions(spec)
    if len(positions) < 2:
        return None
    nodes: list[Any] = []
    # is_leaf is asked of every node, in pre-order, and append returns None: nothing stops.
    optree.tree_flatten(call, is_leaf=nodes.append, namespace=NAMESPACE)  # type: ignore[arg-type]
    first: dict[int, int] = {}
    shared: dict[int, int] | None = None
    for index in positions:
        earlier = first.setdefault(id(nodes[index]), index)
        if earlier != index:
            if shared is None:
                shared = {}
            shared[index] = earlier
    return shared


def unflatten_shared(spec: optree.PyTreeSpec, leaves: Sequence[Any], shared: dict[int, int],
                     /) -> Any:
    """``optree.tree_unflatten(spec, leaves)``, but each place ``shared`` maps to an earlier
    one gets the object built there. A first place comes before its repeats in pre-order and
    is not their ancestor (a container cannot hold itself in a tree optree flattens), so its
    object is complete when a repeat needs it."""
    firsts = set(shared.values())
    marks = sorted({*shared, *firsts})
    built: dict[int, Any] = {}

    def build(node: optree.PyTreeSpec, index: int, start: int) -> Any:
        earlier = shared.get(index)
        if earlier is not None:
            return built[earlier]
        end = index + node.num_nodes
        if bisect.bisect_right(marks, index) == bisect.bisect_left(marks, end):
            # No repeat inside this subtree: optree rebuilds it in one call.
            obj = optree.tree_unflatten(node, leaves[start:start + node.num_leaves])
        else:
            children = []
            index_of, start_of = index + 1, start
            for child in node.children():
                children.append(build(child, index_of, start_of))
                index_of += child.num_nodes
                start_of += child.num_leaves
            one_level = node.one_level()
            assert one_level is not None  # a subtree with a repeat in it is no leaf
            obj = optree.tree_unflatten(one_level, children)
        if index in firsts:
            built[index] = obj
        return obj

    return build(spec, 0, 0)
