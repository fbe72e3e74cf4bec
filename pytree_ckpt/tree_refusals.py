"""What the boundary refuses of what its inputs and outputs hold.

Leaves the tree bridge does not open that hold tensors (NOTE [leaves that hold tensors] in
tree.py), inputs the replay cannot read as the forward did (an iterator; a cache: NOTE [a cache
filled twice]), nested tensors of the strided layout (NOTE [tensors of other layouts] in
tree.py), and lists and dicts passed in that the forward fills (NOTE [containers filled by the
forward]). Each raises a ``CheckpointError`` naming the key path, both sides and the fix; the
boundary (``boundary.py``, ``boundary_function.py``) and its replay (``recompute.py``) call
these.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import nn

from .errors import CheckpointError
from .module_state import owning_module
from .refusals import fn_name, readable_path
from .tree import (CONTAINER, ITERATOR, can_look_into, describe_leaf, dunder, hidden_tensor,
                   instance_dict, is_proxy, leaf_kind, leaf_paths, metadata_tensor,
                   object_children, proxy_referent)

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["container_elements", "is_cache_object", "open_containers", "refuse_filled_containers",
           "refuse_hidden_outputs", "refuse_metadata_tensors", "refuse_strided_nested",
           "refuse_unreadable_inputs"]


def refuse_metadata_tensors(fn: Callable[..., Any], spec: Any, /, *, root: str) -> None:
    """NOTE [tensors in a node's metadata] (tree.py): refused at the call, naming the node."""
    found = metadata_tensor(spec, root=root)
    if found is None:
        return
    path, kind, tensor = found
    path = readable_path(path) if root == "inputs" else path
    side = "returned" if root == "output" else "was given"
    raise CheckpointError(
        f"{fn_name(fn)} {side} a {kind} at {path} whose optree flatten keeps a tensor in the "
        "node's metadata (its second value), not among its children: the boundary sees only "
        "children, so that tensor would cross it without gradient, or be read as it is then "
        "by the replay",
        expected=f"every tensor of a {kind} among the children its flatten returns",
        got=f"{kind} metadata holding {describe_leaf(tensor)}",
        tip=f"return the tensor among the children in the flatten registered for {kind} "
            "(`lambda n: ((n.h, n.scale), None, ('h', 'scale'))`), keeping only plain values "
            "(names, sizes, flags) in its metadata")


def refuse_hidden_outputs(call: BoundaryCall, spec: Any, leaves: list[Any], tensor_index: list[int],
                           inputs: Sequence[torch.Tensor], /) -> None:
    """NOTE [leaves that hold tensors] (tree.py), for outputs: a floating tensor that ``fn``
    computed (under no-grad, so it requires none) inside an output leaf the bridge does not
    open never becomes an output of the Function: it leaves without gradient, and eager's
    gradient through it silently goes missing. Refused in the original pass, naming its path.
    Not refused: a leaf that is one of the inputs (an object passed on, a cache), and tensors
    that require grad or are known from before the call (parameters, buffers, the call's own
    input tensors: eager hands back those very tensors too), the call's own tensor outputs
    (the node is attached to those objects), or frozen results of
    ``reuse_during_recompute`` (frozen when returned bare too: NOTE [frozen results returned
    as outputs] in boundary_function.py)."""
    passed = {id(leaf) for leaf in call.in_leaves if leaf is not None}
    tensors = set(tensor_index)
    known: dict[int, torch.Tensor] | None = None
    for index, leaf in enumerate(leaves):
        if index in tensors or leaf is None or id(leaf) in passed:
            continue
        named = type(leaf).__name__
        if is_proxy(leaf):  # NOTE [a weakref.proxy leaf] (tree.py): what it refers to
            leaf = proxy_referent(leaf)
            if leaf is None or id(leaf) in passed:  # dead, or an input passed on
                continue
            named = f"weakref.proxy to a {dunder(leaf, '__class__', type(leaf)).__name__}"
        if isinstance(leaf, (int, float, str, bool)):
            continue
        if known is None:  # built once, and only for a leaf that needs looking into
            known = dict(call.before or {})
            known.update((id(t), t) for t in (*inputs, *call.frame.tensors()))
            # The call's own tensor outputs: each leaves with the boundary's node attached to
            # that very object, so a leaf holding one reaches it with its gradient (`return h,
            # h.size`; helper FJ).
            known.update((id(leaves[i]), leaves[i]) for i in tensor_index)
        found = ("", leaf) if isinstance(leaf, torch.Tensor) and _fresh_float(known, leaf) \
            else None if isinstance(leaf, torch.Tensor) else \
            hidden_tensor(leaf, functools.partial(_fresh_float, known))
        if found is None:
            if isinstance(leaf, Iterator) and not can_look_into(leaf):
                # itertools' chain or islice, an iterator class without attributes: what
                # it holds cannot be seen without consuming it, so a tensor fn computed into
                # it might leave without gradient. Said, not guessed.
                path = leaf_paths(spec, root="output")[index]
                kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
                raise CheckpointError(
                    f"{fn_name(call.fn)} returned an iterator ({kind}) at {path} whose items "
                    "cannot be looked at without consuming it: a tensor fn computed into it "
                    "would leave the boundary without gradient",
                    expected="tensors in dicts, lists, tuples, namedtuples, dataclasses, or "
                             "iterators over those (iter(list), zip, map, a generator)",
                    got=kind,
                    tip="return a plain container instead (list(...) of it), or build the "
                        "iterator after the call")
            continue
        where, tensor = found
        path = leaf_paths(spec, root="output")[index]
        if tensor is leaf:  # a proxy to it
            raise CheckpointError(
                f"{fn_name(call.fn)} returned a {named} at {path}, to a tensor that "
                "requires no grad and is none of its inputs or state: the tree bridge sees "
                "the proxy, not the tensor, so a tensor fn computed would leave the boundary "
                "without gradient",
                expected="the tensor itself among the outputs", got=named,
                tip="return the tensor, and make the proxy after the call")
        raise CheckpointError(
            f"{fn_name(call.fn)} returned a {named} at {path} that holds a tensor at "
            f"{path}{where}; the tree bridge does not open a {named}, so that tensor would "
            "leave the boundary without gradient",
            expected="tensors in dicts, lists, tuples, namedtuples, dataclasses or types "
                     "registered with optree in namespace 'pytree_ckpt'",
            got=f"{named} holding {describe_leaf(tensor)}",
            tip="return the object itself, not a weakref.proxy to it (a dict, list or "
                "dataclass, or a class registered with optree in namespace 'pytree_ckpt', is "
                "opened), and make the proxy after the call"
                if named.startswith("weakref") and (dataclasses.is_dataclass(leaf) or
                                                    not isinstance(leaf, _TOLD_BELOW)) else
                "return list(...) of it instead (a plain container the boundary opens), or "
                "build the iterator after the call" if isinstance(leaf, Iterator) else
                "return the tensor itself as an output, and build the function after the "
                "call from it" if isinstance(leaf, (types.FunctionType, types.MethodType,
                                                     functools.partial)) else
                f"return a plain container (dict(...), list(...)) or a dataclass instead, or "
                f"register {type(leaf).__name__} with optree.register_pytree_node(..., "
                "namespace='pytree_ckpt')")


# A proxy to one of these among the outputs is tipped as the object itself would be (helper
# OQ: returning the object itself is refused again).
_TOLD_BELOW = (Iterator, types.FunctionType, types.MethodType, functools.partial)

# Leaves that cannot be a cache the original pass fills: immutable values (NOTE [a cache
# filled twice] refuses only objects that may hold state).
_STATELESS = (bytes, complex, torch.dtype, torch.device, torch.layout, torch.memory_format,
              enum.Enum, type, types.FunctionType, slice, range, type(Ellipsis),
              type(NotImplemented), types.MethodDescriptorType, types.WrapperDescriptorType,
              torch._ops.OpOverload, torch._ops.OpOverloadPacket)  # Tensor.add, aten.mm


def is_cache_object(leaf: Any, /) -> bool:
    """A cache object, by what it can do: a key/value cache (transformers' caches have both
    ``update`` and ``get_seq_length``), or a state-space model's cache, which a forward reads
    and fills in place (transformers' MambaCache and its hybrids: ``update_conv_state``,
    ``update_ssm_state``; helper MV)."""
    return _cache_kind(leaf) is not None


def _cache_kind(leaf: Any, /) -> str | None:
    """``"key/value"``, ``"state"`` (``is_cache_object``), or ``None``; of what a
    weakref.proxy refers to (one in a namespace passed a cache: helper NY)."""
    kind = type(leaf)
    if is_proxy(leaf):
        try:
            kind = leaf.__class__
        except ReferenceError:  # a dead one: nothing to fill
            return None
    if callable(getattr(kind, "update", None)) and \
            callable(getattr(kind, "get_seq_length", None)):
        return "key/value"
    if any(callable(getattr(kind, name, None))
           for name in ("update_conv_state", "update_ssm_state")):
        return "state"
    return None


def _reads_caches_only(fn: Callable[..., Any], /) -> bool:
    """The layer's class says it only reads a cache in training (transformers' opt-in)."""
    owner = owning_module(fn)
    return bool(dunder(owner if owner is not None else fn, "_can_checkpoint_with_cache", False))


def _holds_no_state(leaf: Any, /) -> bool:
    """Whether ``leaf`` is an immutable value (a dtype, a device, an enum, a function, ...)
    rather than an object a forward could append to. A builtin counts only when it is bound to
    no object or to a module (``F.scaled_dot_product_attention``): ``cache.append`` is not."""
    if isinstance(leaf, _STATELESS):
        return True
    if isinstance(leaf, types.BuiltinFunctionType):
        owner = dunder(leaf, "__self__")
        return owner is None or isinstance(owner, types.ModuleType)
    return False


def _cache_inside(leaf: Any, /) -> tuple[str | None, str, Any]:
    """A cache object one level inside a leaf the bridge does not open (``_cache_kind``, its
    path step from the leaf, the object), else ``(None, "", leaf)``: an attribute or slot of a
    plain object (a per-step ``SimpleNamespace(cache=...)`` passed to a decoder layer), or an
    item of a mapping it does not open (a ``dict`` subclass): filled twice there too, silently
    (helper NK: the key/value projection got half its gradient). One level, as generators and
    hidden tensors are looked for (a method's instance, a partial's bound arguments); not a
    function's closure."""
    kind = type(leaf)  # not isinstance: a proxy's __class__ may name a dict it is not
    # A function's closure is not looked into (it may hold anything); an object with __call__
    # holding a cache is (an attention object filling its own cache: helper NS), and so are a
    # method's instance and a partial's bound arguments (`Attend().run`, `cache.update`:
    # helper NU), the instance's attributes too.
    if issubclass(kind, (types.FunctionType, set, frozenset)):
        return None, "", leaf
    children: Iterator[tuple[str, Any]]
    if issubclass(kind, _FUNCTIONS):
        children = iter(object_children(leaf))
        bound = dunder(leaf, "__self__")
        # By type: an instance's __class__ may be a property that raises (helper NY).
        if issubclass(kind, types.MethodType) and \
                not issubclass(type(bound), (nn.Module, type)):
            children = itertools.chain(children, ((f".__self__{step}", value)
                                                  for step, value in object_children(bound)))
    elif issubclass(kind, Mapping):
        children = ((f"[{key!r}]", value) for key, value in leaf.items())
    else:
        own = instance_dict(leaf)  # read lazily: a namespace may hold many attributes
        children = ((f".{name}", value) for name, value in own.items()) \
            if isinstance(own, dict) and not hasattr(kind, "__slots__") else \
            iter(object_children(leaf))
    for step, value in itertools.islice(children, 64):
        # Most attributes are tensors, numbers or strings: no class lookups for those (a
        # plain object of 64 tensors cost 70 us a call before: helper NP).
        if type(value) not in _NO_CACHE and (cache := _cache_kind(value)) is not None:
            return cache, step, value
    return None, "", leaf


_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial, types.BuiltinMethodType,
              types.MethodWrapperType)
_NO_CACHE = frozenset({torch.Tensor, nn.Parameter, type(None), bool, int, float, complex, str,
                       bytes, tuple, list, dict})


def refuse_unreadable_inputs(fn: Callable[..., Any], spec: Any, leaves: list[Any], /, *,
                              use_cache: Any = None) -> None:
    """Input leaves the boundary cannot hand to the replay as the forward had them, refused
    before the original pass.

    An iterator (a generator, ``iter(list)``, ``zip``) is a leaf, passed as it is to both
    passes: the original pass consumes it, and the replay reads whatever is left, so it runs on
    other values (or none) than the forward did.

    NOTE [leaves that hold tensors] (tree.py), for inputs: a tensor that requires grad inside
    a container the bridge does not open (a ``dict`` subclass, a set) is no input of the
    Function: not saved (nor offloaded), and its gradient comes, if at all, from the replay's
    own backward into its graph (for a module a foreign-tensor error; for a tensor with a
    graph torch's "backward through the graph a second time"). Plain objects are passed as
    they are, as documented, except a cache object (a key/value cache, with ``update()`` and
    ``get_seq_length()``, or a state-space model's, with ``update_conv_state`` or
    ``update_ssm_state``: ``is_cache_object``) under any keyword, unless the layer's class sets
    ``_can_checkpoint_with_cache``, and any stateful object when ``use_cache=True`` is among
    the keywords: NOTE [a cache filled twice]. ``use_cache``: the ``use_cache`` keyword as
    given (``None`` when absent); with ``False`` the tip says what else to do."""
    for index, leaf in enumerate(leaves):
        if leaf is None or isinstance(leaf, (torch.Tensor, nn.Module, int, float, str)):
            continue
        sort = leaf_kind(leaf)
        cache, step, shown = _cache_kind(leaf), "", leaf
        if cache is None and sort is not ITERATOR and not _holds_no_state(leaf):
            cache, step, shown = _cache_inside(leaf)
        if cache is not None and _reads_caches_only(fn):
            continue  # transformers' opt-in: the layer only reads it, use_cache or not
        if sort is not ITERATOR and (cache is not None or
                                     (use_cache is True and not _holds_no_state(leaf))):
            # NOTE [a cache filled twice]: a key/value cache object (transformers' DynamicCache)
            # is appended to by the original pass and again by the replay. The replay's
            # attention then reads the keys the no-grad original pass stored (same values,
            # same shapes, so nothing fails): the key and value projections get no gradient,
            # silently. transformers' own checkpointing turns use_cache off. Refused: a cache
            # (an object with update() and get_seq_length(), as transformers' are) under any
            # name (Gemma, Olmo pass `cache=` with no use_cache keyword), unless the layer's
            # class says it only reads caches (transformers' _can_checkpoint_with_cache); and
            # any other object with use_cache=True. A state-space model's cache (helper MV:
            # the replay read the state its original pass wrote, and wrote it again) is one
            # too (`is_cache_object`). Immutable values (a dtype, a device, an enum, a function)
            # cannot be filled and pass: such a call (a GPT-2 style layer returning its new
            # keys) is legitimate.
            accessor = optree.treespec_accessors(spec)[index]
            path = readable_path(accessor.codify("inputs")) + step
            # Held by something the call was given (an object, or a dict, list or dataclass
            # argument the bridge opens): the tip says to take it out (use_cache=False does
            # not: helpers NP, NS).
            holder = readable_path(accessor.codify("inputs")) if step else \
                readable_path(accessor[:-1].codify("inputs")) if len(accessor) > 2 else ""
            state = cache == "state"
            raise CheckpointError(
                f"{fn_name(fn)} was called with grad enabled and "
                + (f"a {cache} cache at {path}" if cache is not None else
                   f"use_cache=True and an object at {path}")
                + f" ({type(shown).__name__}); the original pass fills that cache and the replay "
                "in backward fills it again, and "
                + ("reads the state the no-grad original pass wrote there: its gradients "
                   "would be silently wrong" if state else
                   "may read what the no-grad original pass stored (transformers' attention "
                   "does): gradients through it would be silently missing"),
                expected="no cache object while grad is enabled (use_cache=False, and none "
                         "passed)",
                got=type(shown).__name__ if cache is not None else "use_cache=True",
                tip=("pass no cache object while grad is enabled (a state-space layer fills "
                     "the cache it is given, use_cache=False or not). To carry the state "
                     "across chunks, pass it as tensors and return the new one (`out, state = "
                     "layer(x, state)`), which the boundary saves as inputs; run generation "
                     "under torch.no_grad(), where the cache works as usual"
                     if state else
                     f"pass no cache object while grad is enabled (take it out of {holder}): "
                     "use_cache=False does not stop the attention filling a cache it is "
                     "given; run generation under torch.no_grad(), where the cache works as "
                     "usual"
                     if holder else
                     "pass no cache object while grad is enabled: use_cache=False does not "
                     "stop the attention filling a cache it is given. To train a continuation "
                     "on a prompt computed under no-grad, pass the prompt's keys and values "
                     "as tensors (a tuple per layer), which the boundary saves as inputs; or "
                     "run the prompt and the continuation as one sequence"
                     if use_cache is False else
                     "pass use_cache=False whenever grad is enabled: model.config.use_cache = "
                     "False, or model(..., use_cache=False). The boundary checkpoints every "
                     "call made with grad, in eval mode too, where transformers' own "
                     "checkpointing (which turns the cache off) does not run. Run evaluation "
                     "and generate() under torch.no_grad(): the cache works as usual there"))
        if sort is CONTAINER:
            found = hidden_tensor(leaf, _requires_grad)
            if found is not None:
                path = readable_path(leaf_paths(spec, root="inputs")[index])
                kind = type(leaf).__name__
                raise CheckpointError(
                    f"{fn_name(fn)} was given a {kind} at {path} that holds a tensor that "
                    f"requires grad at {path}{found[0]}; the tree bridge does not open a {kind}, "
                    "so that tensor is no input of the boundary (not saved, no exact gradient)",
                    expected="tensors in dicts, lists, tuples, namedtuples, dataclasses or "
                             "types registered with optree in namespace 'pytree_ckpt'",
                    got=f"{kind} holding {describe_leaf(found[1])}",
                    tip=f"pass a plain container (dict(...), list(...)) or a dataclass instead, "
                        f"or register {kind} with optree.register_pytree_node(..., "
                        "namespace='pytree_ckpt')")
        elif sort is ITERATOR:
            path = readable_path(leaf_paths(spec, root="inputs")[index])
            raise CheckpointError(
                f"{fn_name(fn)} was given an iterator at {path}; the original pass consumes "
                "it, and the replay in backward would read other items (or none)",
                expected="inputs the replay can read again (a list, a tuple, tensors)",
                got=f"{type(leaf).__name__} {leaf!r:.60}",
                tip="materialize it at the call site: checkpoint(fn, list(items)) (or "
                    "tuple(...))")


def _requires_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad


def _fresh_float(before: dict[int, torch.Tensor], tensor: torch.Tensor) -> bool:
    return not tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex()) \
        and before.get(id(tensor)) is not tensor


def open_containers(args: tuple[Any, ...], kwargs: dict[str, Any], /
                    ) -> list[tuple[str, Any, frozenset[int]]] | None:
    """The lists and dicts passed as arguments (and those directly in them), with the ids of
    their elements: read before a module's first replay with a switch (NOTE [containers
    filled by the forward])."""
    found: list[tuple[str, Any, frozenset[int]]] | None = None
    for where, values in (("args", enumerate(args)), ("kwargs", kwargs.items())):
        for key, value in values:
            # The usual case: a per-argument check. By type: a proxy's __class__ may name a
            # container it does not implement (helper HF's, given to a plain function).
            if not issubclass(type(value), (list, dict)):
                continue
            path = f"{where}[{key!r}]"
            found = found or []
            elements = container_elements(value)
            found.append((path, value, frozenset(map(id, elements))))
            keys = value.keys() if isinstance(value, dict) else range(len(value))
            found += [(f"{path}[{k!r}]", inner, frozenset(map(id, container_elements(inner))))
                      for k, inner in zip(keys, elements) if issubclass(type(inner), (list, dict))]
    return found


def refuse_filled_containers(call: BoundaryCall,
                             found: list[tuple[str, Any, frozenset[int]]],
                             known: set[int], /, *, leaves_known: bool = False) -> None:
    """NOTE [containers filled by the forward]: a list or dict passed in to collect results
    (an MoE layer appending its load-balancing loss to a tracker) receives, in the original
    pass, a value computed under no-grad: a loss built from it silently loses that term, and
    the replay adds to a container rebuilt from the inputs, which nothing reads. What the
    original pass adds cannot tell a loss from a value that never had a gradient (a rotary
    table built once and shared, Transformer-XL's detached memories, a logged attention
    map), so the replay tells: refused, in backward, when the replay put a tensor that
    requires grad into a list or dict passed as an argument, or into one directly inside such
    a container (by identity: a pre-keyed ``{"aux": 0.0}`` counts), other than one the
    caller has itself (``known``: the replay's inputs and parameters; an input kept in a list
    of hidden states, a tied weight, inputs repackaged in a tuple), whose gradient the
    caller's own tensor carries; ``leaves_known`` for a plain function, whose parameters are not
    known: any leaf counts as the caller's (a closure's module's weight put in a regulariser
    list is the same object in both passes: helper JY). Checked at a module's first replay with
    each switch (NOTE [verified per switch] in module_state.py), a plain function's at each
    (NOTE [containers a plain function fills] in recompute.py). A global list is not seen
    (docs/limits.md)."""
    for path, container, ids in found:
        for element in container_elements(container):
            if id(element) not in ids and _carries_grad(element, known, leaves_known):
                raise CheckpointError(
                    f"{fn_name(call.fn)} put a tensor that requires grad into the "
                    f"{type(container).__name__} passed as {path}: the original pass put in "
                    "its twin computed under no-grad, which has no gradient, so a loss built "
                    "from what the caller received silently loses that term",
                    expected="containers passed in left without tensors that require grad",
                    got=describe_leaf(element),
                    tip="return such values as outputs of the layer (any PyTree) and collect "
                        "them after the call; detach what needs no gradient")


def container_elements(value: Any, /) -> Any:
    """The values of a dict, else the container itself (a list or tuple)."""
    return value.values() if isinstance(value, dict) else value


def _carries_grad(value: Any, known: set[int], leaves_known: bool) -> bool:
    def computed(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in known and \
            not (leaves_known and t.grad_fn is None)

    if isinstance(value, torch.Tensor):
        return computed(value)
    return isinstance(value, (list, tuple, dict)) and any(
        computed(t) for t in container_elements(value))


def refuse_strided_nested(fn: Callable[..., Any], spec: Any, tensor_index: list[int],
                          tensors: Sequence[torch.Tensor], /, *, root: str) -> None:
    """Raise a ``CheckpointError`` naming the first nested tensor of the strided layout among
    ``tensors`` (the tensor leaves of ``spec``, in order) if there is one (NOTE [tensors of
    other layouts] in tree.py): torch's autograd Functions cannot take or return one."""
    for index, tensor in zip(tensor_index, tensors):
        if tensor.is_nested and tensor.layout is torch.strided:
            path = readable_path(leaf_paths(spec, root=root)[index])
            raise CheckpointError(
                f"{fn_name(fn)} {'was given' if root == 'inputs' else 'returned'} a nested "
                f"tensor of the strided layout at {path}: no autograd Function takes or returns "
                "one (torch raises \"NestedTensorImpl doesn't support sizes\"; torch's "
                "reentrant checkpoint too), so it cannot cross the checkpoint boundary",
                expected="a tensor of the strided or jagged layout, or a sparse one",
                got="a nested tensor of layout torch.strided",
                tip="build it with torch.nested.nested_tensor(..., layout=torch.jagged), or "
                    "pad it (torch.nested.to_padded_tensor) before the call")
