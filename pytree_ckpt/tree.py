"""The tree bridge: flatten any argument or output PyTree to tensor leaves and back.

Containers are whatever optree knows (dict and TypedDict, list, tuple, namedtuple, None,
``collections`` mappings) plus dataclasses (their extra instance attributes included; one that
is also a mapping, as transformers' ModelOutput, is rebuilt through its ``__init__`` and then
given the original's keys, items and attributes), which are registered on first sight in this
package's own optree namespace (so the global registry stays untouched). Leaves that are not
tensors (ints, strings, config objects) ride along unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple, cast

import optree
import torch

from .subclass import plain_parameter_class

__all__ = ["FlatTree", "LEAF_SPEC", "POSITIONAL_CALL_SPECS", "flatten", "flatten_call",
           "unflatten", "leaf_paths", "describe_leaf", "first_difference", "hidden_tensor",
           "can_look_into", "leaf_kind", "CONTAINER", "ITERATOR", "PLAIN", "alias", "alias_all",
           "dunder", "instance_dict", "object_children"]

NAMESPACE = "pytree_ckpt"
_registered: set[type] = set()
_register_lock = threading.Lock()


def _register_dataclass(cls: type) -> None:
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    field_set = frozenset(names)
    init_names = frozenset(f.name for f in fields if f.init)
    required = frozenset(f.name for f in fields if f.init and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
    # A Mapping without item assignment: items set on the rebuilt one would raise (NOTE
    # [mapping dataclasses]).
    is_mapping = issubclass(cls, Mapping) and callable(getattr(cls, "__setitem__", None))

    def flatten_one(obj: Any) -> tuple[list[Any], tuple[tuple[Any, ...], tuple[Any, ...]],
                                       tuple[Any, ...]]:
        # Instance attributes beyond the fields (set in __post_init__, say) are children too,
        # and so are a mapping's items that are not the attribute of their name: nothing is
        # dropped, and a tensor among them carries gradient like a field.
        # (A field left unset, as an init=False one may be, is left unset in the copy too.)
        # (dunder: a slotted one answers __dict__ through its __getattr__: helper HG)
        attrs = tuple(n for n in names if dunder(obj, n, _UNSET) is not _UNSET) + tuple(
            k for k in dunder(obj, "__dict__", None) or {} if k not in field_set)
        if not is_mapping:
            return [getattr(obj, k) for k in attrs], (attrs, ()), attrs
        # A mapping's keys in their own order, each marked by whether its item is the
        # attribute of that name (then it is not a child of its own).
        keys = tuple((k, k in field_set and hasattr(obj, k) and obj[k] is getattr(obj, k))
                     for k in obj.keys())
        own = [k for k, shared in keys if not shared]
        children = [getattr(obj, k) for k in attrs] + [obj[k] for k in own]
        return children, (attrs, keys), attrs + tuple(own)

    def unflatten_one(spec: tuple[tuple[Any, ...], tuple[Any, ...]], children: list[Any]) -> Any:
        # NOTE [mapping dataclasses]: a plain dataclass is rebuilt without calling
        # __init__/__post_init__: the same attribute values with tensors swapped, not a new
        # construction (frozen ones included). A dataclass that is also a mapping (transformers'
        # ModelOutput) keeps its items beside its attributes, so it goes through its __init__
        # with the fields that were keys (and required ones), then gets the other items, then
        # every attribute as it was (an attribute set after construction is not an item), then
        # the keys in the original's order and no others: to_tuple() and iteration give the
        # eager output's tensors in the eager order. A read-only Mapping (no __setitem__)
        # makes its items from its attributes: rebuilt as a plain dataclass.
        attrs, keys = spec
        values = dict(zip(attrs, children))
        if not is_mapping:
            obj: Any = object.__new__(cls)
        else:
            shared = {k for k, is_shared in keys if is_shared}
            obj = cls(**{k: v for k, v in values.items()
                         if k in init_names and (k in shared or k in required)})
            own = iter(children[len(attrs):])
            for key, is_shared in keys:
                item = values[key] if is_shared else next(own)
                if key not in obj or obj[key] is not item:
                    obj[key] = item
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        if is_mapping:
            _restore_keys(obj, [k for k, _ in keys])
        return obj

    # optree's stubs type the callbacks more loosely than these are
    optree.register_pytree_node(cls, flatten_one, unflatten_one,  # type: ignore[arg-type]
                                namespace=NAMESPACE)


def _restore_keys(obj: Any, keys: list[Any], /) -> None:
    """Give a rebuilt dict-based mapping exactly ``keys``, in that order (NOTE [mapping
    dataclasses]); the base class's own methods, as ModelOutput refuses ``del``."""
    if list(obj.keys()) == keys:
        return
    if isinstance(obj, collections.OrderedDict):
        wanted = set(keys)
        for key in [k for k in obj.keys() if k not in wanted]:
            collections.OrderedDict.__delitem__(obj, key)
        for key in keys:
            collections.OrderedDict.move_to_end(obj, key)
    elif isinstance(obj, dict):
        items = [(k, dict.__getitem__(obj, k)) for k in keys]
        for key in list(dict.keys(obj)):
            dict.__delitem__(obj, key)
        for key, value in items:
            dict.__setitem__(obj, key, value)


def _is_unregistered_dataclass(leaf: Any) -> bool:
    return (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
            and type(leaf) not in _registered)


class FlatTree(NamedTuple):
    """A flattened PyTree: its leaves, its spec and where the tensor leaves are."""

    leaves: list[Any]
    spec: optree.PyTreeSpec
    tensor_index: list[int]


# FlatTree(leaves, spec, tensor_index), made three times per layer call: the class's own
# __new__ is a Python function (namedtuple's), which this calls, without its frame.
_tuple_new = tuple.__new__


# NOTE [fast paths]: a layer's usual call is ``layer(hidden)`` returning one tensor. For a
# plain tensor, and for positional plain tensors without keywords, the spec is known without
# asking optree (a few microseconds per boundary call, several times per call). The specs are
# optree's own, so they compare equal to what the general path builds for the same tree.
LEAF_SPEC = optree.tree_structure(  # on the CPU: imported under a default device, no CUDA start
    torch.empty(0, device="cpu"), namespace=NAMESPACE)  # type: ignore[arg-type]
# The spec of a call of n positional plain tensors, one object per n, kept for good: a spec
# that *is* one of these is known without hashing it (module_state.py's call keys).
POSITIONAL_CALL_SPECS: dict[int, optree.PyTreeSpec] = {}
_Tensor = torch.Tensor  # read per call


def flatten(tree: Any, /, *, root: str = "the tree") -> FlatTree:
    """Flatten ``tree``; dataclass instances are opened like named containers. ``root`` names
    ``tree`` in the message refusing a reference cycle."""
    if type(tree) is torch.Tensor:
        return _tuple_new(FlatTree, ([tree], LEAF_SPEC, [0]))
    try:
        return _flatten(tree)
    except RecursionError:
        where = _cycle_path(tree, root, set())
        if where is None:
            raise
        from .errors import CheckpointError  # errors.py imports this module
        raise CheckpointError(
            f"{where} refers back to an object that holds it (a child's parent, a node's "
            "owner): the tree bridge opens dataclasses, dicts, lists and tuples as containers, "
            "and a reference cycle through them has no end",
            expected="inputs and outputs whose containers do not hold one another",
            got=f"{where}: a {type(_at(tree, where, root)).__name__} that holds {where} itself",
            tip="keep the back-reference out of the tree: in a plain object (not a dataclass), "
                "or as a weakref.ref, or pass the nodes' tensors as a list") from None


def _flatten(tree: Any, /) -> FlatTree:
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    while True:
        pending = {type(leaf) for leaf in leaves  # (a dead proxy raises on is_dataclass)
                   if type(leaf) is not torch.Tensor and type(leaf) not in _PROXIES and
                   _is_unregistered_dataclass(leaf)}
        if not pending:
            break
        with _register_lock:
            for cls in pending - _registered:
                _register_dataclass(cls)
                _registered.add(cls)
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    # A proxy is no tensor, whatever isinstance says (and a dead one raises there).
    tensor_index = [i for i, leaf in enumerate(leaves)
                    if type(leaf) is torch.Tensor or
                    (type(leaf) not in _PROXIES and isinstance(leaf, torch.Tensor))]
    return _tuple_new(FlatTree, (leaves, spec, tensor_index))


# NOTE [a weakref.proxy leaf]: isinstance and __class__ look through a proxy to what it
# refers to, its type does not: a proxy to a tensor was taken for a tensor and crashed the
# process in autograd's C++, one to a module failed deep in the boundary, a dead one raised
# ReferenceError, and one to an iterator or a cache passed as a plain object where the object
# itself is refused (helpers NP, NU). Refused among a boundary's inputs and an output
# discard's arguments (``refuse_proxies``: the function is handed what the caller passed, and
# would read a cache or tensor through it), and as the function they run where it refers to a
# module or a tensor, or is dead (``refuse_proxy_function``). Among a boundary's outputs, a
# live one is looked through (``proxy_referent``; where what it refers to cannot be found, the
# proxy itself, through what it forwards) and what it refers to is checked as that object
# would be (a tensor fn computed, or one held by a closure, refused as a hidden output; a
# module, a config, a class, a known tensor passed), and a dead one passes: each refusal by
# type there was a regression (helpers OB, OC, OG: a nested call's output was refused in
# backward). Elsewhere (a reused call's arguments and result, a hook's output, a partial's
# bound arguments) passed as eager passes it (helper OA).
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def refuse_proxies(flat: FlatTree, /, *, root: str | None = None) -> None:
    """NOTE [a weakref.proxy leaf]: refuse one among a boundary's inputs (``root`` None: a
    call's, named ``args[i]``, ``kwargs[...]``) or an output discard's arguments; other
    flattenings (outputs, a reused call's, a hook's) do not refuse them."""
    for index, leaf in enumerate(flat.leaves):  # NOTE [loops on the per-call path]
        if type(leaf) in _PROXIES:
            path = leaf_paths(flat.spec, root="inputs" if root is None else root)[index]
            for start, readable in (("inputs[0]", "args"), ("inputs[1]", "kwargs")):
                if root is None and path.startswith(start):
                    path = readable + path[len(start):]
            raise proxy_refused(leaf, path)


def proxy_referent(proxy: Any, /) -> Any:
    """What a live weakref.proxy refers to, ``None`` for a dead one (NOTE [a weakref.proxy
    leaf]). A proxy gives no API for it: one of the referent's own methods reached through it
    is bound to it (``__init__``; ``__sizeof__`` and others where a class set ``__init__`` as
    a static method; ``__init_subclass__`` for a class), and each candidate is checked to be
    the object the proxy is a weak reference to. Where none is, the proxy itself, looked into
    through what it forwards (helper OG)."""
    for name in _BOUND_TO_IT:
        try:
            candidate = getattr(proxy, name).__self__
        except ReferenceError:
            return None
        except Exception:
            continue
        if any(ref is proxy for ref in weakref.getweakrefs(candidate)):
            return candidate
    return proxy


_BOUND_TO_IT = ("__init__", "__sizeof__", "__dir__", "__format__", "__reduce_ex__",
                "__init_subclass__")


def is_proxy(value: Any, /) -> bool:
    """NOTE [a weakref.proxy leaf]: whether ``value`` is a weakref.proxy (by its type)."""
    return type(value) in _PROXIES


def proxy_to_state(value: Any, /) -> bool:
    """Whether ``value`` is a weakref.proxy the boundary cannot take as the function it runs:
    a dead one, or one to a module or a tensor (one to a plain function is called as it is)."""
    if not is_proxy(value):
        return False
    try:
        return issubclass(value.__class__, (torch.nn.Module, torch.Tensor))
    except ReferenceError:
        return True


def refuse_proxy_function(fn: Any, where: str, /) -> None:
    """A weakref.proxy given as the function to run behind a boundary or a discard, where it
    refers to a module or a tensor, or is dead (``proxy_to_state``: one to a module failed with
    an AttributeError on its type, helper NY), refused; not by reuse_during_recompute, which
    runs it as eager does outside a boundary (helper OA)."""
    if proxy_to_state(fn):
        raise proxy_refused(fn, f"the function given to {where}")


def proxy_refused(proxy: Any, where: str, /) -> Exception:
    """The ``CheckpointError`` refusing ``proxy`` at ``where`` (NOTE [a weakref.proxy leaf])."""
    from .errors import CheckpointError  # errors.py imports this module

    try:
        what = f"a weakref.proxy to a {proxy.__class__.__name__}"
    except ReferenceError:
        what = "a dead weakref.proxy"
    except Exception:  # a __class__ property that raises
        what = "a weakref.proxy"
    return CheckpointError(
        f"{what} at {where}: the boundary tells tensors, modules, iterators and caches by "
        "their type, and a proxy's type is not that of what it refers to (isinstance says it "
        "is): a tensor, a module or a cache behind it would pass unseen",
        expected="the object itself (or a weakref.ref, called inside the function)",
        got=what, tip="pass the object the proxy refers to, or a weakref.ref to it")


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any], /, *,
                 at_boundary: bool = False) -> FlatTree:
    """Flatten a call's ``(args, kwargs)``; see NOTE [fast paths]. ``at_boundary``: a
    boundary's call, where a weakref.proxy among them is refused (NOTE [a weakref.proxy leaf];
    the fast path's leaves are all plain tensors)."""
    if not kwargs:
        for arg in args:  # NOTE [loops on the per-call path] (boundary.py): no generator
            if type(arg) is not _Tensor:
                return _slow_call(args, kwargs, at_boundary)
        spec = POSITIONAL_CALL_SPECS.get(len(args))
        if spec is None:
            spec = POSITIONAL_CALL_SPECS[len(args)] = flatten((args, kwargs)).spec
        return _tuple_new(FlatTree, ([*args], spec, list(range(len(args)))))
    return _slow_call(args, kwargs, at_boundary)


def _slow_call(args: tuple[Any, ...], kwargs: dict[str, Any], at_boundary: bool, /
               ) -> FlatTree:
    flat = flatten((args, kwargs), root=_CALL)
    if at_boundary:
        refuse_proxies(flat)
    return flat


_UNSET = object()
_CALL = "<call>"  # the root of a call's (args, kwargs): its paths read args[0], kwargs['x']


def _children(obj: Any, /) -> list[tuple[str, Any]]:
    """What the bridge opens of ``obj`` (for ``_cycle_path``), each with its path step."""
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", item) for i, item in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        found = [(f".{f.name}", dunder(obj, f.name, _UNSET)) for f in dataclasses.fields(obj)]
        return [(step, value) for step, value in found if value is not _UNSET]
    return []


def _cycle_path(obj: Any, path: str, holding: set[int], /) -> str | None:
    """The path of the first place in ``obj`` that holds one of its own holders (``None``
    where there is none: the recursion was deep, not endless). Only on the error path."""
    if id(obj) in holding:
        return path
    children = _children(obj)
    if not children:
        return None
    holding.add(id(obj))
    try:
        for step, child in children:
            if path == _CALL:  # (args, kwargs)
                found = _cycle_path(child, "args" if step == "[0]" else "kwargs", holding)
            else:
                found = _cycle_path(child, path + step, holding)
            if found is not None:
                return found
        return None
    finally:
        holding.discard(id(obj))


def _at(tree: Any, where: str, root: str, /) -> Any:
    """The object at ``where`` (a path ``_cycle_path`` found) in ``tree``."""
    obj, path = tree, root
    while path != where:
        for step, child in _children(obj):
            nxt = ("args" if step == "[0]" else "kwargs") if path == _CALL else path + step
            if where == nxt or where.startswith(nxt) and where[len(nxt)] in ".[":
                obj, path = child, nxt
                break
        else:
            return obj
    return obj


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any], /) -> Any:
    """Rebuild a tree from ``spec`` and ``leaves`` with the original container types."""
    if spec is LEAF_SPEC:
        return leaves[0]
    return optree.tree_unflatten(spec, leaves)


def leaf_paths(spec: optree.PyTreeSpec, /, *, root: str) -> list[str]:
    """Readable key paths of every leaf, e.g. ``output['dsa_topk_ids']`` (for error messages)."""
    return [accessor.codify(root) for accessor in optree.treespec_accessors(spec)]


def first_difference(expected: optree.PyTreeSpec, got: optree.PyTreeSpec, /, *,
                     root: str) -> tuple[str, str, str]:
    """Where two different specs first part: the key path, and what each side has there."""
    path = root
    while not (expected.is_leaf() or got.is_leaf()) and expected.type is got.type and \
            expected.entries() == got.entries():
        level = expected.one_level()
        assert level is not None  # not a leaf
        pairs = zip(level.accessors(), expected.children(), got.children())
        child = next(((a, e, g) for a, e, g in pairs if e != g), None)
        if child is None:  # the nodes differ in their metadata (a deque's maxlen, say)
            break
        accessor, expected, got = child
        path += accessor.codify("")
    shown = _describe_node(expected), _describe_node(got)
    if shown[0] == shown[1] and not (expected.is_leaf() or got.is_leaf()) and \
            expected.type is not got.type:
        # Two classes of one name (a namedtuple class made anew at each call): say which.
        # Neither is a leaf here, and only a leaf's spec has no type (None is a node of type
        # NoneType to optree).
        shown = (f"{shown[0]} (class {_class_id(cast(type, expected.type))})",
                 f"{shown[1]} (class {_class_id(cast(type, got.type))})")
    return path, shown[0], shown[1]


def metadata_tensor(spec: optree.PyTreeSpec, /, *, root: str
                    ) -> tuple[str, str, torch.Tensor] | None:
    """NOTE [tensors in a node's metadata]: a class registered with optree (in the bridge's
    namespace, or globally) whose flatten keeps a tensor in the node's metadata rather than
    among its children (helper FB: `lambda n: ((n.h,), n.scale, ...)`) hides it from the
    boundary: an output's, computed under no-grad, left without gradient, silently; an
    input's was refused naming no place; and a spec comparison (``==`` on the metadata) raised
    torch's "Boolean value of Tensor with more than one value is ambiguous". So where such
    classes are registered, the bridge looks at the metadata of their nodes (a walk of the
    spec: about 0.13 us a container node on this machine, 9 us for a 68-node output; two
    reads where none is registered): the path of the node, its class's name and the first
    tensor in its metadata, or ``None``."""
    if spec is LEAF_SPEC or spec.num_nodes == spec.num_leaves:
        return None
    users = _user_node_types()
    if not users:
        return None
    found: list[tuple[type, torch.Tensor]] = []

    def look(node_type: type, data: Any, children: Any) -> None:
        if not found and node_type in users:
            hit = ("", data) if isinstance(data, torch.Tensor) else \
                hidden_tensor(data, lambda t: True)  # three levels, as for output leaves
            if hit is not None:
                found.append((node_type, hit[1]))

    spec.walk([None] * spec.num_leaves, look, None)
    if not found:
        return None
    kind, tensor = found[0]
    path = node_path(spec, lambda node_type, data: node_type is kind and (
        data is tensor or hidden_tensor(data, lambda t: t is tensor) is not None),
        root=root)
    return path or root, kind.__name__, tensor


def node_path(spec: optree.PyTreeSpec, test: Callable[[type, Any], bool], /, *, root: str
              ) -> str | None:
    """The path of the first node of ``spec`` whose type and metadata ``test`` accepts (a
    dict's metadata is its keys), or ``None``; for messages only."""
    level = spec.one_level()
    if level is None:
        return None
    data = level.walk([None] * level.num_leaves, lambda node_type, data, children: data, None)
    if test(cast(type, spec.type), data):
        return root
    for accessor, child in zip(level.accessors(), spec.children()):
        if child.num_nodes > child.num_leaves:
            found = node_path(child, test, root=root + accessor.codify(""))
            if found is not None:
                return found
    return None


def object_children(obj: Any, /) -> list[tuple[str, Any]]:
    """What a plain object holds (its attributes and slots), or a function (its closure's
    variables and defaults; a bound method's instance; a partial's bound arguments), each
    with its path from it: where ``hidden_tensor`` looks, one level."""
    kind = type(obj)  # not isinstance: __class__ may be a property that raises (helper NY)
    if issubclass(kind, _CALLABLES):
        return _callable_children(obj)
    attributes = instance_dict(obj)
    return [*((f".{name}", value) for name, value in attributes.items()), *_slot_children(obj)] \
        if isinstance(attributes, dict) and not issubclass(kind, types.ModuleType) else \
        _slot_children(obj)


# The classes registered with optree by users, recomputed when the registry changes: keyed
# on optree's own dict's keys, in order (its size alone, or with its last key, missed an
# unregistration followed by registrations: helpers FG, FJ; about 15 keys, compared by
# identity); looked up in full at every call where that dict is missing. One tuple, swapped
# whole: a thread reads a key and its set together.
_USERS: tuple[Any, frozenset[type]] = (None, frozenset())
_OPTREE_OWN = ("builtins", "collections", "optree")


def _user_node_types() -> frozenset[type]:
    global _USERS
    registry = getattr(getattr(optree, "registry", None), "_NODETYPE_REGISTRY", None)
    key = tuple(registry) if isinstance(registry, dict) else None
    cached = _USERS
    if key is not None and key == cached[0]:
        return cached[1]
    every: Any = optree.register_pytree_node.get(namespace=NAMESPACE)  # type: ignore[call-arg]
    users = frozenset(cls for cls in (every if isinstance(every, dict) else ())
                      if isinstance(cls, type) and cls not in _registered
                      and cls.__module__.split(".")[0] not in _OPTREE_OWN)
    if key is not None:
        _USERS = (key, users)
    return users


def _class_id(cls: type) -> str:
    return (f"{cls.__module__}.{cls.__qualname__} at {id(cls):#x}: same name, another class "
            "object; define the class once, at module level")


def _describe_node(spec: optree.PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf (a tensor or another object)"
    if spec.type is type(None):
        return "None"
    text = str(spec)
    return text if len(text) <= 120 else text[:117] + "..."


def describe_leaf(leaf: Any, /) -> str:
    """A short description of a leaf for messages: shape and dtype for tensors."""
    if isinstance(leaf, torch.Tensor):
        return f"Tensor(shape={tuple(leaf.shape)}, dtype={leaf.dtype}, device={leaf.device})"
    return f"{type(leaf).__name__} {leaf!r:.60}"


# NOTE [tensors of other layouts]: where the boundary wants a new tensor object on a leaf's data
# for autograd to attach a node to (a detached input in the replay, an output that existed
# before the call), a plain strided tensor gets ``t[...]``, torch's alias, whose backward passes
# the gradient on as it is: a sparse gradient reaches a dense input (``F.embedding(ids, table,
# sparse=True)`` of a table passed in), where a ``view_as`` view's backward reshaped it, which
# torch refuses for a sparse tensor (helper MD). A ``__torch_function__`` subclass gets torch's
# alias too (helper MJ), through ``as_subclass`` of its own class: no code of the class runs (its
# ``__getitem__`` may return a plain tensor, and a discard's rebuild then ran fn without the
# subclass: helper MK), as eager calls none there. A subclass that dispatches in Python (a
# wrapper subclass, ``__torch_dispatch__``) gets a view, as before: an op table may serve
# ``aten.view`` and not ``aten.alias`` (torch.masked.MaskedTensor, float8 wrappers: helper MG);
# so does a jagged nested tensor, which has no alias. A sparse tensor (COO, CSR) has neither:
# it gets a clone, whose backward passes the gradient on as it is too, so gradients stay
# eager's, at the price of one copy. A nested tensor of the strided layout cannot cross any
# autograd Function (torch raises "NestedTensorImpl doesn't support sizes"): it is refused
# (tree_refusals.refuse_strided_nested).


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # aliased by t[...]: NOTE [tensors of other layouts]
_dispatch_keys = torch._C._dispatch_keys
_PYTHON_KEY = torch._C.DispatchKey.Python  # set on a tensor whose class has __torch_dispatch__


def alias(tensor: torch.Tensor, /) -> torch.Tensor:
    """A new tensor object with ``tensor``'s values and a graph to it (NOTE [tensors of other
    layouts]): torch's alias of a strided tensor that dispatches in C++, a view of another
    tensor where the layout has views, a clone otherwise."""
    if tensor.layout is torch.strided:
        if type(tensor) in _PLAIN:
            return tensor[...]
        if _dispatch_keys(tensor).has(_PYTHON_KEY):
            return tensor.view_as(tensor)
        if plain_parameter_class(type(tensor)):
            return tensor[...]  # a Parameter subclass's (torch functions off): plain, as its view
        return tensor.as_subclass(type(tensor))  # NOTE [tensors of other layouts]
    if tensor.layout is torch.jagged:
        return tensor.view_as(tensor)
    return tensor.clone()


def alias_all(tensors: Sequence[torch.Tensor], /) -> tuple[torch.Tensor, ...]:
    """``alias`` of each tensor that requires grad, the others as they are. A plain tensor's
    alias is tried first: the usual, strided case pays no layout check per tensor."""
    aliased = []
    try:
        for t in tensors:  # NOTE [loops on the per-call path] (boundary.py)
            aliased.append((t[...] if type(t) is torch.Tensor else alias(t)) if t.requires_grad
                           else t)
    except (NotImplementedError, RuntimeError):  # NOTE [tensors of other layouts]
        aliased = [alias(t) if t.requires_grad else t for t in tensors]
    return tuple(aliased)


def hidden_tensor(leaf: Any, wanted: Callable[[torch.Tensor], bool], /, *,
                  depth: int = 3) -> tuple[str, torch.Tensor] | None:
    """The first ``wanted`` tensor inside a leaf the bridge did not open, with its path from
    the leaf (``['aux']``, ``.h``, ``[0]``; an iterator's items by what it iterates over, a
    generator's by its frame's variables), looking ``depth`` levels down and at 64 objects in
    all (docs/limits.md: one past those is not found); ``None`` if none. ``leaf`` is never a
    tensor: its callers pass only the leaves that are not.

    NOTE [leaves that hold tensors]: optree opens dict, list and tuple themselves, not their
    subclasses (a ``dict`` subclass, ``UserDict``), nor sets, nor a class registered only with
    ``torch.utils._pytree``, nor plain objects: to the bridge those are leaves, passed by
    reference. A tensor in one is not an input or output of the boundary. Modules are
    skipped (their parameters are known otherwise), and so are strings and bytes. An object
    is looked into through its attributes and slots; a function through its closure's
    variables and its defaults, a bound method through its instance, a ``functools.partial``
    through its function and bound arguments (a closure returned holding a tensor ``fn``
    computed left it without gradient: helper FB).
    """
    budget = [64]  # objects looked at in all: a huge leaf costs a bounded time

    def search(obj: Any, level: int) -> tuple[str, torch.Tensor] | None:
        budget[0] -= 1
        if type(obj) in _PROXIES:  # NOTE [a weakref.proxy leaf]: what it refers to, if alive
            obj = proxy_referent(obj)
        if isinstance(obj, torch.Tensor):
            return ("", obj) if wanted(obj) else None
        if level == 0 or budget[0] <= 0 or obj is None or \
                isinstance(obj, (str, bytes, int, float, complex, type, torch.nn.Module)):
            return None
        if isinstance(obj, Mapping):
            children: Any = ((f"[{key!r}]", value) for key, value in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            children = ((f"[{i}]" if not isinstance(obj, (set, frozenset)) else "", item)
                        for i, item in enumerate(obj))
        elif isinstance(obj, _CALLABLES) or (
                isinstance(instance_dict(obj), dict) and
                not isinstance(obj, types.ModuleType)) or \
                (not isinstance(obj, Iterator) and _slot_names(obj)):
            # An object's attributes and slots (a slotted result object: helper FB); what a
            # closure, a bound method (a builtin one too: `(t * 2).clone`) or a partial would
            # hand back (helpers FB, FH): object_children.
            children = object_children(obj)
        elif isinstance(obj, types.GeneratorType):
            # What a generator (a generator expression's source iterator included) holds is
            # in its frame, None once it is finished.
            frame = obj.gi_frame
            children = () if frame is None else \
                [("<its iterable>" if name == ".0" else f"<{name}>", value)  # a genexpr's
                 for name, value in frame.f_locals.items()]
            if obj.gi_yieldfrom is not None:  # a started `yield from`: what it delegates to
                children = [*children, ("<yield from>", obj.gi_yieldfrom)]
        elif isinstance(obj, Iterator) and (slots := _slot_names(obj)):  # a class of slots
            children = ((f".{name}", getattr(obj, name, None)) for name in slots)
        elif isinstance(obj, Iterator) and (items := _reduced_items(obj)) is not None:
            # iter(list), map, zip, enumerate, reversed, dict iterators: __reduce__ gives what
            # they iterate over without advancing them (itertools' is deprecated, not used).
            children = (("", item) for item in items)
        else:
            return None
        for key, child in children:
            found = search(child, level - 1)
            if found is not None:
                return key + found[0], found[1]
            if budget[0] <= 0:
                break
        return None

    return search(leaf, depth)


_CALLABLE_ITERATOR = type(iter(int, 1))  # iter(fn, sentinel): its items are fn's results


def _reduced_items(iterator: Any, /) -> tuple[Any, ...] | None:
    """What one of Python's own iterators (``iter(list)``, ``zip``, ``map``, ``enumerate``,
    ``reversed``, dict iterators) iterates over, from its ``__reduce__``; ``None`` for others:
    ``iter(fn, sentinel)``, whose items are calls yet to come, and one that does not reduce
    (a memoryview's)."""
    kind = type(iterator)
    if kind.__module__ != "builtins" or kind is _CALLABLE_ITERATOR:
        return None
    try:
        return tuple(iterator.__reduce__()[1])
    except TypeError:  # "cannot pickle 'memory_iterator' object"
        return None


# The callables hidden_tensor looks into (what they hold: _callable_children).
_CALLABLES = (types.FunctionType, types.MethodType, functools.partial, types.BuiltinMethodType,
              types.MethodWrapperType)


def _callable_children(fn: Any, /) -> list[tuple[str, Any]]:
    """What a function (its closure's variables, its defaults), a bound method (its
    instance, its function) or a ``functools.partial`` (its function and bound arguments)
    holds, each with its path from it, for ``hidden_tensor``."""
    if isinstance(fn, types.MethodType):
        return [(".__self__", fn.__self__), ("", fn.__func__)]
    if isinstance(fn, (types.BuiltinMethodType, types.MethodWrapperType)):
        bound = dunder(fn, "__self__")  # a module's for a builtin function: skipped
        return [] if bound is None or isinstance(bound, (types.ModuleType, type)) else \
            [(".__self__", bound)]
    if isinstance(fn, functools.partial):
        return [(".func", fn.func), *((f".args[{i}]", a) for i, a in enumerate(fn.args)),
                *((f".keywords[{k!r}]", v) for k, v in fn.keywords.items())]
    found: list[tuple[str, Any]] = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            found.append((f"<{name} in its closure>", cell.cell_contents))
        except ValueError:  # an empty cell: a variable not yet assigned
            continue
    names = fn.__code__.co_varnames[fn.__code__.co_argcount - len(fn.__defaults__ or ()):]
    found += [(f"<default of {name}>", value) for name, value in zip(names, fn.__defaults__ or ())]
    found += [(f"<default of {name}>", value) for name, value in (fn.__kwdefaults__ or {}).items()]
    return found


def dunder(obj: Any, name: str, default: Any = None, /) -> Any:
    """``getattr(obj, name, default)`` for a special attribute (``__self__``, ``__wrapped__``,
    ``__closure__``, ``__dict__`` ...), a marker torch or this library sets
    (``_torchdynamo_orig_callable``, ``_pytree_ckpt_kept``), or a field that may be unset,
    on a user's object: ``default`` whatever the lookup raises. NOTE: an
    object that lacks the name answers it through its ``__getattr__``, which may raise
    something else than AttributeError (a KeyError from settings kept in a dict, as config
    classes do: helpers HD, HF), and getattr's default lets that pass: eager never asks, so
    the boundary must not fail there."""
    try:
        return getattr(obj, name, default)
    except Exception:
        return default


def instance_dict(obj: Any, /) -> Any:
    """``obj.__dict__``, or None (``dunder``: an object with slots has none, and its
    ``__getattr__`` is asked)."""
    return dunder(obj, "__dict__")


def _slot_children(obj: Any, /) -> list[tuple[str, Any]]:
    """The set ``__slots__`` attributes of ``obj``, with their paths (an unset one left out,
    whatever its class's ``__getattr__`` raises: ``dunder``)."""
    found = []
    for name in _slot_names(obj):
        try:
            found.append((f".{name}", getattr(obj, name)))
        except Exception:
            continue
    return found


def _slot_names(obj: Any, /) -> list[str]:
    """The ``__slots__`` attributes of ``obj``'s Python classes (none for builtin types)."""
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def can_look_into(iterator: Any, /) -> bool:
    """Whether ``hidden_tensor`` sees what ``iterator`` holds without consuming it: a
    generator, one of Python's own iterators over values, or an iterator class of the user's
    (its attributes, or its slots)."""
    return isinstance(iterator, types.GeneratorType) or _reduced_items(iterator) is not None or \
        isinstance(instance_dict(iterator), dict) or bool(_slot_names(iterator))


CONTAINER = "container"
ITERATOR = "iterator"
PLAIN = "plain"
# By type: the abstract base class checks cost about 1 us per leaf and call otherwise (a
# key/value cache object among a decoder layer's keyword arguments is looked at every call).
# A class registered with an ABC after its first instance was seen keeps its first kind.
_LEAF_KINDS: dict[type, str] = {}


def leaf_kind(leaf: Any, /) -> str:
    """``CONTAINER`` for a leaf that is a container by its type (a ``dict`` or ``list``
    subclass, a set, a ``UserDict``, a ``SimpleNamespace``) that optree left unopened,
    ``ITERATOR`` for an iterator (a generator, ``iter(list)``), ``PLAIN`` for anything else
    (a key/value cache, a config); plain objects are not containers here."""
    cls = type(leaf)
    kind = _LEAF_KINDS.get(cls)
    if kind is None:
        if issubclass(cls, (Mapping, AbstractSet, types.SimpleNamespace)) or (
                issubclass(cls, Sequence) and not issubclass(cls, (str, bytes, bytearray))):
            kind = CONTAINER
        elif issubclass(cls, Iterator):
            kind = ITERATOR
        else:
            kind = PLAIN
        _LEAF_KINDS[cls] = kind
    return kind
