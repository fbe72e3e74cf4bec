"""What the boundary refuses, and how it says so.

Each check runs where the problem first shows (before the original pass, after it, or in the
replay) and raises a ``CheckpointError`` that names the PyTree key path, shows both sides and
gives the fix. The boundary (``boundary.py``), its replay (``recompute.py``) and output
discard (``discard.py``, ``discard_function.py``) call these; each NOTE they cite names its
file where it is not here.
"""

from __future__ import annotations

import enum
import functools
import re
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from .errors import CheckpointConfigError, CheckpointError, SavedTensorChanged
from .frames import callable_name
from .module_state import foreign_leaf, mark_verified, owning_module, warn_forward_hooks
from .tree import CONTAINER, ITERATOR, describe_leaf, hidden_tensor, leaf_kind, leaf_paths

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall
    from .state_changes import ParameterVersions

__all__ = ["CHANGED_AFTER_CALL_TIP", "TORCH_REENTRANT", "container_elements", "fn_name",
           "input_path", "open_containers", "parameter_path", "raise_attached_to_outside_tensor",
           "raise_changed_after_call", "raise_hooked_outside_tensor", "raise_input_changed",
           "raise_parameter_changed_after_call", "raise_torch_reentrant_inside",
           "refuse_double_backward", "refuse_filled_containers", "refuse_hidden_outputs",
           "refuse_module_tensor", "refuse_parameters_changed", "refuse_strided_nested",
           "refuse_unreadable_inputs", "require_callable", "verify_leaves"]


def refuse_hidden_outputs(call: BoundaryCall, spec: Any, leaves: list[Any], tensor_index: list[int],
                           inputs: Sequence[torch.Tensor], /) -> None:
    """NOTE [leaves that hold tensors] (tree.py), for outputs: a floating tensor that ``fn``
    computed (under no-grad, so it requires none) inside an output leaf the bridge does not
    open never becomes an output of the Function: it leaves without gradient, and eager's
    gradient through it silently goes missing. Refused in the original pass, naming its path.
    Not refused: a leaf that is one of the inputs (an object passed on, a cache), and tensors
    that require grad or are known from before the call (parameters, buffers, the call's own
    input tensors: eager hands back those very tensors too), or frozen results of
    ``reuse_during_recompute`` (frozen when returned bare too: NOTE [frozen results returned
    as outputs] in boundary.py)."""
    passed = {id(leaf) for leaf in call.in_leaves if leaf is not None}
    tensors = set(tensor_index)
    known: dict[int, torch.Tensor] | None = None
    for index, leaf in enumerate(leaves):
        if index in tensors or leaf is None or id(leaf) in passed or \
                isinstance(leaf, (int, float, str, bool)):
            continue
        if known is None:  # built once, and only for a leaf that needs looking into
            known = dict(call.before or {})
            known.update((id(t), t) for t in (*inputs, *call.frame.tensors()))
        found = hidden_tensor(leaf, functools.partial(_fresh_float, known))
        if found is None:
            continue
        where, tensor = found
        path = leaf_paths(spec, root="output")[index]
        raise CheckpointError(
            f"{fn_name(call.fn)} returned a {type(leaf).__name__} at {path} that holds a "
            f"tensor at {path}{where}; the tree bridge does not open a {type(leaf).__name__}, "
            "so that tensor would leave the boundary without gradient",
            expected="tensors in dicts, lists, tuples, namedtuples, dataclasses or types "
                     "registered with optree in namespace 'pytree_ckpt'",
            got=f"{type(leaf).__name__} holding {describe_leaf(tensor)}",
            tip=f"return a plain container (dict(...), list(...)) or a dataclass instead, or "
                f"register {type(leaf).__name__} with optree.register_pytree_node(..., "
                "namespace='pytree_ckpt')")


# Leaves that cannot be a cache the original pass fills: immutable values (NOTE [a cache
# filled twice] refuses only objects that may hold state).
_STATELESS = (bytes, complex, torch.dtype, torch.device, torch.layout, torch.memory_format,
              enum.Enum, type, types.FunctionType, slice, range, type(Ellipsis),
              type(NotImplemented), types.MethodDescriptorType, types.WrapperDescriptorType,
              torch._ops.OpOverload, torch._ops.OpOverloadPacket)  # Tensor.add, aten.mm


def _is_kv_cache(leaf: Any, /) -> bool:
    """A key/value cache, by what it can do: transformers' caches have both methods."""
    kind = type(leaf)
    return callable(getattr(kind, "update", None)) and \
        callable(getattr(kind, "get_seq_length", None))


def _reads_caches_only(fn: Callable[..., Any], /) -> bool:
    """The layer's class says it only reads a cache in training (transformers' opt-in)."""
    owner = owning_module(fn)
    return bool(getattr(owner if owner is not None else fn, "_can_checkpoint_with_cache", False))


def _holds_no_state(leaf: Any, /) -> bool:
    """Whether ``leaf`` is an immutable value (a dtype, a device, an enum, a function, ...)
    rather than an object a forward could append to. A builtin counts only when it is bound to
    no object or to a module (``F.scaled_dot_product_attention``): ``cache.append`` is not."""
    if isinstance(leaf, _STATELESS):
        return True
    if isinstance(leaf, types.BuiltinFunctionType):
        owner = getattr(leaf, "__self__", None)
        return owner is None or isinstance(owner, types.ModuleType)
    return False


def refuse_unreadable_inputs(fn: Callable[..., Any], spec: Any, leaves: list[Any], /, *,
                              kwargs_use_cache: bool = False) -> None:
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
    they are, as documented, except a key/value cache (an object with ``update()`` and
    ``get_seq_length()``) under any keyword, unless the layer's class sets
    ``_can_checkpoint_with_cache``, and any stateful object when ``use_cache=True`` is among
    the keywords: NOTE [a cache filled twice]."""
    for index, leaf in enumerate(leaves):
        if leaf is None or isinstance(leaf, (torch.Tensor, nn.Module, int, float, str)):
            continue
        sort = leaf_kind(leaf)
        kv_cache = _is_kv_cache(leaf)
        if kv_cache and _reads_caches_only(fn):
            continue  # transformers' opt-in: the layer only reads it, use_cache or not
        if sort is not ITERATOR and (kv_cache or kwargs_use_cache and not _holds_no_state(leaf)):
            # NOTE [a cache filled twice]: a key/value cache object (transformers' DynamicCache)
            # is appended to by the original pass and again by the replay. The replay's
            # attention then reads the keys the no-grad original pass stored (same values,
            # same shapes, so nothing fails): the key and value projections get no gradient,
            # silently. transformers' own checkpointing turns use_cache off. Refused: a cache
            # (an object with update() and get_seq_length(), as transformers' are) under any
            # name (Gemma, Olmo pass `cache=` with no use_cache keyword), unless the layer's
            # class says it only reads caches (transformers' _can_checkpoint_with_cache); and
            # any other object with use_cache=True. Immutable values (a dtype, a device, an
            # enum, a function) cannot be filled and pass: such a call (a GPT-2 style layer
            # returning its new keys) is legitimate.
            path = _readable(leaf_paths(spec, root="inputs")[index])
            raise CheckpointError(
                f"{fn_name(fn)} was called with grad enabled and "
                + (f"a key/value cache at {path}" if kv_cache else
                   f"use_cache=True and an object at {path}")
                + f" ({type(leaf).__name__}); the original pass fills that cache and the replay "
                "in backward fills it again, and may read what the no-grad original pass stored "
                "(transformers' attention does): gradients through it would be silently "
                "missing",
                expected="no cache (use_cache=False) while training",
                got=type(leaf).__name__ if kv_cache else "use_cache=True",
                tip="pass use_cache=False in training (with transformers, "
                    "model.config.use_cache = False or model(..., use_cache=False)); run "
                    "evaluation under torch.no_grad()")
        if sort is CONTAINER:
            found = hidden_tensor(leaf, _requires_grad)
            if found is not None:
                path = _readable(leaf_paths(spec, root="inputs")[index])
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
            path = _readable(leaf_paths(spec, root="inputs")[index])
            raise CheckpointError(
                f"{fn_name(fn)} was given an iterator at {path}; the original pass consumes "
                "it, and the replay in backward would read other items (or none)",
                expected="inputs the replay can read again (a list, a tuple, tensors)",
                got=f"{type(leaf).__name__} {leaf!r:.60}",
                tip="materialize it at the call site: checkpoint(fn, list(items)) (or "
                    "tuple(...))")


def _requires_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad


def _readable(path: str) -> str:
    """``inputs[0][1]`` as ``args[1]``, ``inputs[1]['mask']`` as ``kwargs['mask']``."""
    for root, readable in (("inputs[0]", "args"), ("inputs[1]", "kwargs")):
        if path.startswith(root):
            return readable + path[len(root):]
    return path


def _fresh_float(before: dict[int, torch.Tensor], tensor: torch.Tensor) -> bool:
    return not tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex()) \
        and before.get(id(tensor)) is not tensor


def input_path(spec: Any, tensor_index: list[int], slots: list[int], slot: int, /) -> str:
    """The key path of the first input leaf that is unique input ``slot``, e.g. ``args[0]`` or
    ``kwargs['dsa_topk_ids']`` (for messages; computed only when one is needed)."""
    return _readable(leaf_paths(spec, root="inputs")[tensor_index[slots.index(slot)]])


def fn_name(fn: Callable[..., Any], /) -> str:
    owner = owning_module(fn)
    if owner is not None:
        return type(owner).__name__
    return callable_name(fn)


# The start of the error torch's reentrant checkpoint raises in a backward that is not a plain
# loss.backward() (torch.autograd.grad, backward(inputs=...)).
TORCH_REENTRANT = "When use_reentrant=True, torch.utils.checkpoint is incompatible"


def raise_torch_reentrant_inside(call: BoundaryCall, error: RuntimeError, /) -> NoReturn:
    # A module's replay computes its gradients with torch.autograd.grad, under which torch's
    # reentrant checkpoint refuses to run; its message speaks of .grad() and inputs=, which the
    # user never called (transformers' gradient_checkpointing_enable(use_reentrant=True) puts
    # one inside every decoder layer).
    raise CheckpointError(
        f"the replay of {fn_name(call.fn)} in backward ran torch.utils.checkpoint with "
        "use_reentrant=True, which cannot run inside this boundary (it computes the module's "
        "gradients with torch.autograd.grad); the layer would be checkpointed twice anyway",
        expected="no reentrant torch checkpoint inside a module's boundary (use_reentrant=False "
                 "works, but runs the layer a third time)",
        got="torch.utils.checkpoint(..., use_reentrant=True) inside "
            f"{fn_name(call.fn)}",
        tip="drop the inner checkpoint: with transformers, model.gradient_checkpointing_disable() "
            "(pytree_ckpt already checkpoints the layer)") from error


def raise_input_changed(call: BoundaryCall, tensors: Sequence[torch.Tensor],
                        moved: list[int], /) -> None:
    paths = [input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot)
             for slot in moved]
    views = any(tensors[slot]._base is not None for slot in moved)
    where = paths[0] if len(paths) == 1 else "one of " + ", ".join(paths)
    shared = (" (views share their base's version counter: the write may have gone to another "
              "view of the same tensor)" if views else "")
    raise CheckpointError(
        f"{fn_name(call.fn)} changed its input {where} in place{shared}; the replay would run "
        "on the changed tensor and give wrong gradients",
        expected="inputs left as they are", got="a version counter moved by the original pass",
        tip="clone the input inside the layer before changing it (x = x.clone()), or make the "
            "change outside the checkpointed call")


_AUTOGRAD_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+)")
# The fix for a boundary input changed in place after the call (offload's copies say it too).
CHANGED_AFTER_CALL_TIP = (
    "the boundary keeps each input for the replay, where eager keeps only what backward needs "
    "(an integer position tensor, say): change a clone after the call (pos = pos + 4, not "
    "pos += 4), or make the change before the call")


def raise_changed_after_call(call: BoundaryCall, raw_saved: Sequence[Any],
                             error: RuntimeError, /) -> NoReturn:
    """An input of ``call`` (or an attribute saved with them) was changed in place after the
    call: autograd's check (or ``Unchanged``'s, under a hook) found it as backward unpacked the
    boundary's saved tensors. Named by key path: each saved tensor is unpacked again, alone,
    to find which (an error path: the cost does not matter)."""
    def name(slot: int) -> str:
        return input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot) \
            if slot < call.n_inputs else \
            f"the attribute {call.attributes[slot - call.n_inputs]!r} (saved with them)"

    changed = [_changed_since_saved(saved, call.saved_versions[slot])
               for slot, saved in enumerate(raw_saved)]
    if None in changed:  # this torch cannot tell which: named only if there is one
        names = [name(0)] if len(raw_saved) == 1 else []
    else:
        names = [name(slot) for slot, found in enumerate(changed) if found]
    views = ""
    if not names:
        where = "an input"
    elif len(names) == 1:
        where = f"the input {names[0]}"
    else:
        where = f"one of the inputs {', '.join(names)}"
        views = (" (views of one tensor share its version counter: the change may have gone "
                 "through any of them)")
    if isinstance(error, SavedTensorChanged):
        versions: tuple[object, object] = (error.saved_version, error.version)
    else:
        found = _AUTOGRAD_VERSIONS.search(str(error))
        versions = (found[2], found[1]) if found else ("?", "?")
    raise CheckpointError(
        f"{where} of {fn_name(call.fn)} was changed in place after the call, and the replay in "
        f"backward needs it as it was{views}", expected=f"version {versions[0]} (when saved)",
        got=f"version {versions[1]}",
        tip=CHANGED_AFTER_CALL_TIP) from error


def _changed_since_saved(saved: Any, version: int | None) -> bool | None:
    """Whether one of autograd's saved tensors, unpacked alone, fails as backward did; None
    where this torch cannot tell. torch 2.12 and newer have ``SavedTensor.unpack()``; 2.11 has
    ``data`` and ``unpack_hook``: a saved-tensor hook is called on what it packed, and a tensor
    saved plainly is compared with its version when saved (``data`` skips autograd's check).
    Before that a saved tensor can be read only with all the others."""
    try:
        unpack = getattr(saved, "unpack", None)
        if unpack is not None:
            unpack()
            return False
        if not hasattr(saved, "data"):
            return None
        hook, data = saved.unpack_hook, saved.data
        if hook is not None:
            hook(data)
            return False
    except Exception:  # a changed one (views of one tensor share its version counter)
        return True
    return data is not None and version is not None and data._version != version


def open_containers(args: tuple[Any, ...], kwargs: dict[str, Any], /
                    ) -> list[tuple[str, Any, frozenset[int]]] | None:
    """The lists and dicts passed as arguments (and those directly in them), with the ids of
    their elements: read before a module's first replay with a switch (NOTE [containers
    filled by the forward])."""
    found: list[tuple[str, Any, frozenset[int]]] | None = None
    for where, values in (("args", enumerate(args)), ("kwargs", kwargs.items())):
        for key, value in values:
            if not isinstance(value, (list, dict)):  # the usual case: a per-argument check
                continue
            path = f"{where}[{key!r}]"
            found = found or []
            elements = container_elements(value)
            found.append((path, value, frozenset(map(id, elements))))
            keys = value.keys() if isinstance(value, dict) else range(len(value))
            found += [(f"{path}[{k!r}]", inner, frozenset(map(id, container_elements(inner))))
                      for k, inner in zip(keys, elements) if isinstance(inner, (list, dict))]
    return found


def refuse_filled_containers(call: BoundaryCall,
                             found: list[tuple[str, Any, frozenset[int]]],
                             known: set[int], /) -> None:
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
    caller's own tensor carries. Checked at a module's first replay with each switch (NOTE
    [verified per switch]). A global list is not seen (docs/boundary.md)."""
    for path, container, ids in found:
        for element in container_elements(container):
            if id(element) not in ids and _carries_grad(element, known):
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


def _carries_grad(value: Any, known: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad and id(value) not in known
    return isinstance(value, (list, tuple, dict)) and any(
        isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in known
        for t in container_elements(value))


def refuse_double_backward(where: Callable[[], str], /) -> None:
    """Refuse a backward with ``create_graph=True`` (autograd runs a Function's backward with
    grad mode on exactly then). The replay starts from detached inputs, so the gradient it
    returns has no graph back to them: a gradient penalty would silently lose its terms.
    ``where()`` names the node; called only to raise (every backward passes here)."""
    if torch.is_grad_enabled():
        raise CheckpointError(
            f"{where()} was reached by a backward with create_graph=True (double backward, a "
            "gradient penalty)", expected="create_graph=False", got="create_graph=True",
            tip="second-order gradients through a replay would be incomplete: take the penalty "
                "with checkpointing off for this module (remove_activation_checkpointing, "
                "or call it outside checkpoint())")


def raise_attached_to_outside_tensor(call: BoundaryCall, spec: Any, index: int, /) -> None:
    # NOTE [outputs made before the call] (made_before.py): a tensor from outside that requires
    # no grad and is neither an input nor known to belong to the module cannot be told from a
    # fresh result; autograd gave it this node. The replay returns the very same tensor, still
    # carrying this node: backpropagating through it would re-enter this backward without end.
    path = leaf_paths(spec, root="output")[index]
    raise CheckpointError(
        f"{path} of {fn_name(call.fn)} is a tensor from outside the call (not computed by it, "
        "not one of its inputs), and the boundary attached itself to it",
        expected="tensors computed by fn, its inputs, or buffers and parameters of the module "
                 "fn belongs to", got="the same outside tensor, returned again by the replay",
        tip="return a clone (t.clone()) of it; or keep it as a buffer of the module "
            "(register_buffer) and checkpoint that module itself "
            "(pytree_ckpt.checkpoint(module, ...)) so its buffers are known: a plain "
            "attribute is never known")


def raise_hooked_outside_tensor(call: BoundaryCall, position: int, /) -> None:
    # NOTE [held tensors are not hooked outputs] (hook_outputs.py): a hooked module returned a
    # tensor from outside the call that no module holds as an attribute (a global, a closure's
    # constant); autograd gave it this node, and the replay found it again.
    raise CheckpointError(
        f"hooked output {position} of {fn_name(call.fn)} (the output of a module with a forward "
        "hook inside the boundary) is a tensor from outside the call, and the boundary attached "
        "itself to it", expected="module outputs computed in the call",
        got="the same outside tensor, returned again by the replay",
        tip="have that module return a clone (t.clone()) of it, or hold the tensor as a buffer "
            "or an attribute of the module")


def verify_leaves(call: BoundaryCall, outs: list[torch.Tensor], wrt: list[torch.Tensor], /
                  ) -> None:
    # NOTE [parameters are inputs] (boundary.py): once per module, on its first replay. A
    # parameter of the modules that was frozen in the forward and unfrozen since gets no
    # gradient, as in eager (it was not in the forward's graph): known, not foreign. Nothing
    # else the modules hold is: a parameter registered or swapped in while the forward ran
    # (an FSDP2 unit's hooks inside the boundary leave its unsharded parameters with
    # reshard_after_forward=False) and a buffer that requires grad are not inputs, and the
    # replay's gradients would skip them.
    known = [*wrt, *call.frozen_at_call]
    call.frozen_at_call = []
    foreign = foreign_leaf(outs, known)
    assert call.owner is not None
    if foreign is not None:
        _refuse_fsdp_units_inside(call.owner, own=call.fn is call.owner)
        passed = [leaf for leaf in call.in_leaves if isinstance(leaf, nn.Module)]
        refuse_module_tensor(foreign, [call.owner, *passed])
        raise CheckpointError(
            f"the forward of {type(call.owner).__name__} uses a tensor that requires grad but is "
            "neither an input nor a parameter of the module; it would get no gradient",
            expected="inputs, and parameters of the module or of modules passed as arguments",
            got=f"Tensor(shape={tuple(foreign.shape)}, dtype={foreign.dtype})",
            tip="pass the tensor (or the module owning it) as an argument, or register it as a "
                "parameter of a submodule; a leaf the forward makes itself for a gradient "
                "inside it (pos.detach().requires_grad_() for forces = -dE/dpos) is one the "
                "boundary cannot tell from an outside tensor: leave that module "
                "uncheckpointed")
    # fn is the module itself (checkpoint(module, x)): its own hooks run inside the boundary.
    # So do those of a module passed as an argument, when fn calls it.
    passed = [leaf for leaf in call.in_leaves if isinstance(leaf, nn.Module)]
    warn_forward_hooks(call.owner, passed, own=call.fn is call.owner)
    mark_verified(call.owner, call.switches)


def parameter_path(modules: Sequence[nn.Module], tensor: torch.Tensor, /) -> str:
    """Where ``modules`` (the call's own module first, then modules passed in) hold
    ``tensor`` as a parameter, or its shape (one ``torch.func.functional_call`` swapped in)."""
    for root in modules:
        prefix = "" if root is modules[0] else f"(argument {type(root).__name__})."
        for path, param in root.named_parameters(remove_duplicate=False):
            if param is tensor:
                return prefix + path
    return f"(one of shape {tuple(tensor.shape)}, not the module's own)"


def refuse_parameters_changed(watched: ParameterVersions, params: Sequence[torch.Tensor],
                              where: Callable[[], str], modules: Sequence[nn.Module], /
                              ) -> tuple[list[int | None], list[int] | None]:
    """Before a replay (the boundary's, an output discard's rebuild): refuse if a parameter
    was changed since the forward by others than our passes (NOTE [parameters changed in
    place]); the versions read, for ``watched.replayed`` after it. ``where()`` names the
    function, called only when refusing (every layer's backward passes here)."""
    before = watched.read(params)
    changed = watched.changed_since(params, before[0])
    if changed:
        raise_parameter_changed_after_call(where(), changed, modules)
    return before


def raise_parameter_changed_after_call(where: str,
                                       changed: Sequence[tuple[torch.Tensor, int, int]],
                                       modules: Sequence[nn.Module], /) -> NoReturn:
    """NOTE [parameters changed in place]: the replay runs on the parameters as they are in
    backward. One changed in place between a call's forward and its backward (an optimizer
    step on a GAN's discriminator before the generator's backward through it, ``p.add_()``
    under no-grad) would be replayed with its new values and give other gradients, silently;
    eager refuses when an op saved it, and the boundary refuses for every trainable parameter
    whose version moved (versions read after the original pass, compared before the replay).
    One the forward itself changes in place (a weight constraint, ``nn.Embedding``'s
    ``max_norm`` renorm) is changed again by the replay: exact only when repeating the change
    leaves it as it is; warned once per module when the replay moves a version again
    (``warn_parameter_changed`` in stored_state.py; a change inside
    ``reuse_during_recompute`` is not replayed, and not told). Writes through ``.data``, and
    FSDP2's all-gathers (which keep the version counter), are not seen. Output discard's
    rebuild (discard.py) checks its op's parameters the same way. ``where`` names the
    function, ``changed`` the parameters with their versions then and now (a move our own
    passes made, the same layer's next micro-batch changing it again, is not counted:
    ``ParameterVersions`` in state_changes.py); ``modules`` hold them, for their paths."""
    paths = [parameter_path(modules, p) for p, _, _ in changed]
    _, version, now = changed[0]
    raise CheckpointError(
        f"{where}'s parameter{'s' if len(paths) > 1 else ''} {', '.join(paths)} "
        f"{'were' if len(paths) > 1 else 'was'} changed in place between the forward and this "
        "backward (an optimizer step, an in-place update under no_grad): the replay would run "
        "on the new values and give other gradients than the forward's",
        expected="trainable parameters left as the forward used them until its backward",
        got=f"{paths[0]}: version {version} at the forward, {now} now",
        tip="run backward before changing the parameters (step the optimizer after "
            "backward), or keep a detached copy for the forward (torch.func.functional_call "
            "with cloned parameters)")


def refuse_module_tensor(foreign: torch.Tensor, modules: Sequence[nn.Module], /) -> None:
    """A foreign leaf that the modules do hold, said as what it is: a buffer that requires
    grad, or a parameter the forward registered (or swapped in) after the boundary collected
    the parameters. Returns if the modules do not hold it."""
    for root in modules:
        prefix = "" if root is modules[0] else f"(argument {type(root).__name__})."
        for path, buffer in root.named_buffers():
            if buffer is foreign:
                raise CheckpointError(
                    f"the buffer {prefix}{path} requires grad: the replay takes gradients for "
                    "inputs and parameters, so it would get none", expected="buffers that "
                    "require no grad", got=f"{prefix}{path}.requires_grad=True",
                    tip="register it as an nn.Parameter, or pass it as an argument")
        for path, param in root.named_parameters():
            if param is foreign:
                raise CheckpointError(
                    f"the parameter {prefix}{path} was registered (or swapped in) while the "
                    f"forward of {type(modules[0]).__name__} ran: the boundary collects "
                    "parameters before the call, so it would get no gradient",
                    expected="parameters that exist before the call",
                    got=f"{prefix}{path}, new in the forward",
                    tip="create it in __init__, or run one call without checkpointing first "
                        "(as a lazy module's first call runs)")


def _refuse_fsdp_units_inside(owner: nn.Module, *, own: bool) -> None:
    """NOTE [FSDP units inside a boundary]: a submodule that is an FSDP2 unit of its own swaps
    its parameters in its hooks, which run *inside* the boundary: the boundary collects its
    sharded parameters (DTensors, which the replay never uses) and the replay all-gathers
    unsharded ones that ``torch.autograd.grad`` would leave without gradient. Found as a
    foreign leaf at the first replay; said here in FSDP's terms, with the two ways out.
    ``own``: the owner's own hooks run inside too (``checkpoint(unit, x)``)."""
    fsdp = getattr(torch.distributed, "fsdp", None) if torch.distributed.is_available() else None
    unit_type = getattr(fsdp, "FSDPModule", None)
    if unit_type is None:
        return
    name = type(owner).__name__
    if own and isinstance(owner, unit_type):
        raise CheckpointConfigError(
            f"checkpoint() was given the FSDP unit {name} itself: its hooks all-gather its "
            "parameters inside the boundary, so the replay's gradients for them would be lost",
            expected="the unit's hooks outside the boundary",
            got=f"pytree_ckpt.checkpoint({name}, ...) on a fully_shard()ed module",
            tip=f"apply_activation_checkpointing on the {name} before fully_shard() (its hooks "
                "then run around the boundary), and call the module itself")
    units = [path for path, sub in owner.named_modules()
             if sub is not owner and isinstance(sub, unit_type)]
    if not units:
        return
    raise CheckpointConfigError(
        f"the checkpointed {name} contains separate FSDP units {units}: their hooks all-gather "
        "their parameters inside the boundary, so the replay's gradients for them would be lost",
        expected=f"no fully_shard()ed submodule inside the checkpointed {name}",
        got=f"fully_shard() applied to {', '.join(repr(u) for u in units)}",
        tip=f"checkpoint each unit instead (apply_activation_checkpointing on {units[0]!r}, "
            f"...), or make {name} itself the FSDP unit (fully_shard it, not its children)")


def require_callable(fn: Any, where: str, tip: str, /) -> None:
    if not callable(fn):
        raise CheckpointConfigError(
            f"{where} takes the function (or module) to run behind the boundary",
            expected="a callable", got=describe_leaf(fn), tip=tip)


def refuse_strided_nested(fn: Callable[..., Any], spec: Any, tensor_index: list[int],
                          tensors: Sequence[torch.Tensor], /, *, root: str) -> None:
    """Raise a ``CheckpointError`` naming the first nested tensor of the strided layout among
    ``tensors`` (the tensor leaves of ``spec``, in order) if there is one (NOTE [tensors of
    other layouts] in tree.py): torch's autograd Functions cannot take or return one."""
    for index, tensor in zip(tensor_index, tensors):
        if tensor.is_nested and tensor.layout is torch.strided:
            path = _readable(leaf_paths(spec, root=root)[index])
            raise CheckpointError(
                f"{fn_name(fn)} {'was given' if root == 'inputs' else 'returned'} a nested "
                f"tensor of the strided layout at {path}: no autograd Function takes or returns "
                "one (torch raises \"NestedTensorImpl doesn't support sizes\"; torch's "
                "reentrant checkpoint too), so it cannot cross the checkpoint boundary",
                expected="a tensor of the strided or jagged layout, or a sparse one",
                got="a nested tensor of layout torch.strided",
                tip="build it with torch.nested.nested_tensor(..., layout=torch.jagged), or "
                    "pad it (torch.nested.to_padded_tensor) before the call")
