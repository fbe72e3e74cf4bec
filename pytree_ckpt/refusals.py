"""What the boundary refuses of its function, its modules and its backward, and how every
refusal names what it speaks of.

Each check runs where the problem first shows (before the original pass, after it, or in the
replay) and raises a ``CheckpointError`` that names the PyTree key path, shows both sides and
gives the fix. The boundary (``boundary.py``, ``boundary_function.py``), its replay
(``recompute.py``) and output discard (``discard.py``, ``discard_function.py``) call these;
each NOTE they cite names its file where it is not here. What the call's inputs and outputs
may hold is refused in ``tree_refusals.py``; inputs and parameters changed in place, in
``changed_in_place.py``.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from .errors import CheckpointConfigError, CheckpointError
from .frames import callable_name
from .fsdp_units import refuse_fsdp_units_inside, refuse_flat_parameter
from .function_reach import cell_contents, globals_of
from .hook_outputs import is_library_hook
from .module_state import (foreign_leaves, graph_reaches, mark_verified, owning_module,
                           warn_forward_hooks)
from .tree import describe_leaf, dunder, leaf_paths, node_path, object_children

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["TORCH_REENTRANT", "check_made_leaves", "fn_name", "input_path", "input_path_of",
           "held_before_replay", "raise_attached_to_outside_tensor", "raise_hooked_outside_tensor",
           "raise_torch_reentrant_inside", "readable_path", "refuse_container",
           "refuse_double_backward", "refuse_module_tensor", "require_module", "verify_leaves"]


def readable_path(path: str) -> str:
    """``inputs[0][1]`` as ``args[1]``, ``inputs[1]['mask']`` as ``kwargs['mask']``."""
    for root, readable in (("inputs[0]", "args"), ("inputs[1]", "kwargs")):
        if path.startswith(root):
            return readable + path[len(root):]
    return path


def input_path(spec: Any, tensor_index: list[int], slots: list[int], slot: int, /) -> str:
    """The key path of the first input leaf that is unique input ``slot``, e.g. ``args[0]`` or
    ``kwargs['dsa_topk_ids']`` (for messages; computed only when one is needed)."""
    return readable_path(leaf_paths(spec, root="inputs")[tensor_index[slots.index(slot)]])


def input_path_of(fn: Callable[..., Any], spec: Any, tensor_index: list[int], slots: list[int],
                  slot: int, /) -> str:
    """``input_path``, naming whose input it is (``args[0] of Linear``), as the boundary's own
    in-place refusal does: for an offload window's messages."""
    return f"{input_path(spec, tensor_index, slots, slot)} of {fn_name(fn)}"


def fn_name(fn: Callable[..., Any], /) -> str:
    owner = owning_module(fn)
    if owner is not None:
        return type(owner).__name__
    return callable_name(fn)


# The start of the error torch's reentrant checkpoint raises in a backward that is not a plain
# loss.backward() (torch.autograd.grad, backward(inputs=...)).
TORCH_REENTRANT = "When use_reentrant=True, torch.utils.checkpoint is incompatible"


def raise_replay_reentered(node: Any, call: BoundaryCall, /) -> NoReturn:
    """NOTE [a replay that reaches its own node]: a forward that reads a tensor this very call
    returned, from state the replay finds it in (a plain object's attribute the caller set
    to the output, PyG's ``data.x = layer(data)``; helper ET), builds the replay's graph
    through the call's own node: backward then ran this replay again inside itself, without
    end (torch moved the nesting to new threads, memory grew). Refused at the first re-entry,
    naming where the output is held when it can be found (the call's inputs' attributes, its
    modules' attributes)."""
    where = _held_output(node, call)
    raise CheckpointError(
        f"the replay of {fn_name(call.fn)} reads a tensor that call returned{where}, so its "
        "backward runs into the call's own node, and would replay it again without end: the "
        "replay reads state as it is in backward, after the caller stored the output there",
        expected="the forward reads its inputs and module state, not what the call returned",
        got=f"the replay of {fn_name(call.fn)} reached its own node",
        tip="keep the output out of what the forward reads (`h = layer(data)`, not `data.x "
            "= layer(data)`; a state carried between calls is passed in and returned, `out, h "
            "= cell(x, h)`), or pass the tensors themselves (`layer(data.x, "
            "data.edge_index)`), or a dataclass or a class registered with optree in namespace "
            "'pytree_ckpt', whose tensors are inputs the boundary saves")


def _held_output(node: Any, call: BoundaryCall, /) -> str:
    """", held at inputs args[0].x" where an input object's attribute (or a module's) holds a
    tensor whose graph reaches ``node``; "" where none is found."""
    def holding(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.grad_fn is not None and \
            graph_reaches([value.grad_fn], node, most=256)

    found = _in_input_objects(call, holding)
    if found is not None:
        return f", held at {found}"
    func = dunder(call.fn, "__func__", call.fn)
    code = dunder(func, "__code__")
    if code is not None:  # a plain function's closure cells and globals
        for name, cell in zip(code.co_freevars, dunder(func, "__closure__") or ()):
            if _holds(cell_contents(cell), holding):
                return f", held by the closure variable {name!r} of {fn_name(call.fn)}"
        space = globals_of(func)
        for name in code.co_names:
            if _holds(space.get(name), holding):
                return f", held by the global {name!r} of {space.get('__name__', 'its module')}"
    roots = call.forward_modules.roots if call.forward_modules is not None else ()
    for root in roots:
        for path, module in root.named_modules():
            for name, value in tuple(vars(module).items()):
                at = f"{path}.{name}" if path else name
                if holding(value):
                    return f", held by the module attribute {at}"
                items = value.items() if isinstance(value, dict) else \
                    enumerate(value) if isinstance(value, (list, tuple)) else ()
                for key, item in items:
                    if holding(item):
                        return f", held by the module attribute {at}[{key!r}]"
    return ""


def _holds(value: Any, holding: Callable[[Any], bool], /) -> bool:
    """Whether ``value``, or an item of it (a dict, list or tuple), is one ``holding`` takes."""
    if holding(value):
        return True
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    return any(holding(item) for item in items)


def _in_input_objects(call: BoundaryCall, holding: Callable[[Any], bool], /) -> str | None:
    """The path (``args[0].x``) of the first attribute (or slot) of a plain object among the
    call's inputs (which the tree bridge does not open), or of what a function passed in holds
    (its closure's variables and defaults, a partial's bound arguments: ``args[1]<bias in its
    closure>``), whose value ``holding`` accepts."""
    paths = leaf_paths(call.in_spec, root="inputs")
    for path, leaf in zip(paths, call.in_leaves):
        if leaf is None or isinstance(leaf, (torch.Tensor, nn.Module, type)):
            continue
        children = object_children(leaf)
        if isinstance(leaf, types.MethodType) and not isinstance(leaf.__self__, nn.Module):
            # A bound method's instance holds what it reads (`holder.get`: helper FH).
            children += [(f".__self__{step}", value)
                         for step, value in object_children(leaf.__self__)]
        for step, value in children:
            if holding(value):
                return f"{readable_path(path)}{step}"
    return None


_FREED_GRAPH = "backward through the graph a second time"


def raise_freed_graph_reached(call: BoundaryCall, error: RuntimeError, /) -> None:
    """A replay whose backward reached a graph already freed: the usual cause is a tensor
    with a graph kept on a module between calls (a state carried with its gradient, in an
    attribute, dict or list: ``self.cache["h"] = out``), which the replay reads as the last
    call, or the last replay, left it, and whose graph another call's backward freed (helper
    ES: torch's bare error named nothing), one the caller set there between the forward and
    backward (helper NJ), or one computed once and read by several calls (helper NO). Refused
    naming such attributes where the modules hold one; otherwise torch's error stands."""
    if _FREED_GRAPH not in str(error):
        return
    holders = [(f"{path}.{name}" if path else name, sub, name)
               for module in ([call.owner] if call.owner is not None else [])
               for path, sub in module.named_modules()
               for name, value in tuple(vars(sub).items())
               if name not in ("_parameters", "_buffers", "_modules") and any(
                   isinstance(t, torch.Tensor) and t.grad_fn is not None
                   for t in ([value] if isinstance(value, torch.Tensor) else
                             value.values() if isinstance(value, dict) else
                             value if isinstance(value, (list, tuple)) else ()))]
    held = [label for label, _, _ in holders]
    if not held:
        # A tensor with a graph from outside the call, held by a function passed in (a
        # score_mod closure over a bias computed once and shared by every layer: helper FC):
        # each replay backpropagates through that graph, the first one frees it.
        passed = _in_input_objects(call, lambda value: isinstance(value, torch.Tensor) and
                                   value.grad_fn is not None)
        if passed is None:
            return  # another cause: torch's error as it is
        raise CheckpointError(
            f"the replay of {fn_name(call.fn)} reached a graph already freed through {passed}, "
            "a tensor with a graph computed outside the call that an argument the boundary "
            "does not open holds: each call's replay backpropagates into that graph itself (it "
            "is no input of the call), and another call's replay freed it",
            expected="tensors computed outside the call passed as arguments themselves",
            got=f"{passed} holding a tensor with a graph (torch: {_FREED_GRAPH})",
            tip="pass the tensor as an argument and build the function (or object) inside the "
                "forward from it (`score_mod = lambda s: s + bias` in the layer's forward)"
        ) from error
    what = f"the module attribute{'s' if len(held) > 1 else ''} {', '.join(map(repr, held))}"
    raise CheckpointError(
        f"the replay of {fn_name(call.fn)} reached a graph already freed through {what}, which "
        "holds a tensor with a graph made outside the call: a state carried between calls with "
        "its gradient, one set between the forward and backward (a learned initial state, "
        "`self.h = self.h0 * 1`), or one computed once and read by several calls (`self.scale "
        "= self.s0.exp()`): each call's replay backpropagates into that graph itself (module "
        "state is no input of the call), and another call's replay freed it",
        expected="tensors with a graph made outside the call passed as arguments, and states "
                 "returned; on the module, only tensors without grad",
        got=f"{what} holding a tensor with a graph (torch: {_FREED_GRAPH})",
        tip="pass it as an argument (`layer(x, scale)`) and return a new state (`out, h = "
            "cell(x, h)`); a state carried between calls may be kept detached on the module "
            "(`.detach()`: truncated backpropagation), but a value computed from parameters "
            "(`s0.exp()`, a learned initial state) then gets no gradient"
            + _unnamed_pre_hooks(call.owner, holders)) from error


def _unnamed_pre_hooks(owner: nn.Module | None,
                       holders: Sequence[tuple[str, nn.Module, str]], /) -> str:
    """A tip for an attribute of the checkpointed module that a user's forward pre-hook may
    set each call (a hand-written mask or DropConnect: ``module.weight = module.weight_orig *
    module.mask``; the hook runs outside the call): such a hook with a ``name`` naming it
    makes the attribute an input of each call (NOTE [only attributes a pre-hook names] in
    module_state.py), the way that works (helper OJ: the refusal named neither the hook nor
    that). A pre-hook of a module inside runs in the replay too, and is not the cause."""
    tips = [f"if {callable_name(hook)}, a forward pre-hook of {type(sub).__name__}, sets "
            f"{label!r} each call, give it the attribute `name = {name!r}` (as torch's "
            "weight_norm and pruning hooks have): that attribute is then an input of each call"
            for label, sub, name in holders if sub is owner
            for hook in sub._forward_pre_hooks.values() if not is_library_hook(hook)
            and not isinstance(dunder(hook, "name", dunder(hook, "_tensor_name")), str)]
    return "".join(f"; {tip}" for tip in tips[:3])


def raise_torch_reentrant_inside(call: BoundaryCall, error: RuntimeError, /) -> NoReturn:
    # A module's replay computes its gradients with torch.autograd.grad, under which torch's
    # reentrant checkpoint refuses to run; its message speaks of .grad() and inputs=, which the
    # user never called (transformers' activation_checkpointing_enable with
    # activation_checkpointing_kwargs={"use_reentrant": True} puts one inside every decoder
    # layer).
    raise CheckpointError(
        f"the replay of {fn_name(call.fn)} in backward ran torch.utils.checkpoint with "
        "use_reentrant=True, which cannot run inside this boundary (it computes the module's "
        "gradients with torch.autograd.grad); the layer would be checkpointed twice anyway",
        expected="no reentrant torch checkpoint inside a module's boundary (use_reentrant=False "
                 "works, but runs the layer a third time)",
        got="torch.utils.checkpoint(..., use_reentrant=True) inside "
            f"{fn_name(call.fn)}",
        tip="drop the inner checkpoint: with transformers, "
            "model.activation_checkpointing_disable() (gradient_checkpointing_disable() before "
            "5.23; pytree_ckpt already checkpoints the layer)") from error


def refuse_double_backward(where: Callable[[], str], /, *, discard: bool = False) -> None:
    """Refuse a backward with ``create_graph=True`` (autograd runs a Function's backward with
    grad mode on exactly then). The replay starts from detached inputs, so the gradient it
    returns has no graph back to them: a gradient penalty would silently lose its terms.
    ``where()`` names the node; called only to raise (every backward passes here).
    ``discard``: the node is an output discard's, whose way out is to keep that output."""
    if torch.is_grad_enabled():
        off = ("keep this op's output (no discard_output_and_register_recompute or residual "
               "plan around it; in the reference model, discard_norm_outputs=False)"
               if discard else "take them with checkpointing off for this module "
               "(remove_activation_checkpointing, or call it outside checkpoint())")
        raise CheckpointError(
            f"{where()} was reached by a backward with create_graph=True (double backward, a "
            "gradient penalty, torch.autograd.functional's jvp, hvp or hessian, a MAML inner "
            "step)", expected="create_graph=False", got="create_graph=True",
            tip="second-order gradients through a replay would be incomplete: use torch.func "
                "(torch.func.grad, jvp, hessian: no boundary is built under a transform, so "
                f"they see the plain layers), or {off}")


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
    # NOTE [only what eager would give a gradient is recorded] (hook_outputs.py): in a compiled
    # body, whose ops the original pass cannot follow, a hooked module received or returned a
    # tensor from outside the call that no module holds as an attribute (a global, a closure's
    # constant); autograd gave it this node, and the replay found it again.
    raise CheckpointError(
        f"hooked output {position} of {fn_name(call.fn)} (an input or the output of a module "
        "with a forward hook or pre-hook inside the boundary) is a tensor from outside the "
        "call, and the boundary attached itself to it",
        expected="module inputs and outputs computed in the call",
        got="the same outside tensor, returned again by the replay",
        tip="in a compiled body the boundary cannot tell it from an activation (NOTE [only "
            "what eager would give a gradient is recorded]): pass the module a clone made in "
            "the call, or hold the tensor as a buffer or an attribute of the module")


def verify_leaves(call: BoundaryCall, outs: list[torch.Tensor], wrt: list[torch.Tensor], /
                  ) -> bool:
    """Whether the replay's graph reaches leaves left to check (NOTE [leaves the call makes]):
    the replay then keeps no graph, and ``check_made_leaves`` runs once it returns."""
    # NOTE [parameters are inputs] (boundary.py): once per module, on its first replay. A
    # parameter of the modules that was frozen in the forward and unfrozen since gets no
    # gradient, as in eager (it was not in the forward's graph): known, not foreign. Nothing
    # else the modules hold is: a parameter registered or swapped in while the forward ran
    # (an FSDP2 unit's hooks inside the boundary leave its unsharded parameters with
    # reshard_after_forward=False) and a buffer that requires grad are not inputs, and the
    # replay's gradients would skip them.
    known = [*wrt, *call.frozen_at_call]
    call.frozen_at_call = ()
    foreign = foreign_leaves(outs, known)
    assert call.owner is not None
    # fn is the module itself (checkpoint(module, x)): its own hooks run inside the boundary.
    # So do those of a module passed as an argument, when fn calls it.
    passed = [leaf for leaf in call.in_leaves if isinstance(leaf, nn.Module)]
    if foreign:
        refuse_fsdp_units_inside(call.owner, own=call.fn is call.owner)
        for leaf in foreign:
            refuse_flat_parameter(leaf, call.owner)  # NOTE [FSDP1 around a boundary]
            refuse_module_tensor(leaf, [call.owner, *passed])
    warn_forward_hooks(call.owner, passed, own=call.fn is call.owner)
    if not foreign:
        mark_verified(call.owner, call.switches)
        return False
    call.made_leaves = [weakref.ref(leaf) for leaf in foreign]  # nothing strong: NOTE
    return True


def check_made_leaves(call: BoundaryCall, /) -> None:
    """NOTE [leaves the call makes]: a leaf that requires grad, reached by a module's first
    replay and neither an input nor a parameter, is either one the call made and dropped (T5's
    attention makes its zero position bias one, ``bias.requires_grad = True``, for torch's
    reentrant checkpoint; ``pos.detach().requires_grad_()`` for forces = -dE/dpos) or one from
    outside (a global table, a closure's tensor, one the forward stored on its module). Eager
    fills the first's ``.grad`` where nothing can read it, so giving it none is exact; the
    second's gradient would be lost. Which it is shows once the replay's graph, the last
    thing that could hold a made leaf, is gone: ``verify_leaves`` keeps weak references only,
    and this runs after ``replay_backward`` returned (its locals held the replayed outputs),
    before the node returns its gradients, so a refusal leaves no ``.grad`` filled. A leaf
    still alive then is refused; one held only by a reference cycle is given a collection
    first (only on that path). Such a replay keeps no graph between restricted backwards
    (NOTE [a replay kept between restricted backwards] in kept_replay.py): the kept graph would
    hold the leaf; the next pass replays anew, as before graphs were kept. A weak reference
    tracks the tensor's C++ owner too: torch preserves a tensor's Python object while its
    TensorImpl lives (the graph's AccumulateGrad holds it), so the reference dies with the
    graph (checked on torch 2.9, 2.11, 2.13)."""
    refs, call.made_leaves = call.made_leaves, None
    assert refs is not None and call.owner is not None
    if any(ref() is not None for ref in refs):
        gc.collect()  # a cycle through the graph (a hook's closure) would hold it still
        alive = [leaf for leaf in (ref() for ref in refs) if leaf is not None]
        if alive:
            where = _held_at(alive[0], call)
            raise CheckpointError(
                f"the forward of {type(call.owner).__name__} uses a tensor that requires grad "
                "but is neither an input nor a parameter of the module; it would get no "
                "gradient", expected="inputs, and parameters of the module or of modules "
                "passed as arguments",
                got=f"Tensor(shape={tuple(alive[0].shape)}, dtype={alive[0].dtype}), "
                    f"still held after the replay{where} (a leaf the forward made and "
                    "dropped is accepted)",
                tip="pass the tensor (or the module owning it) as an argument, or register it "
                    "as a parameter of a submodule; a leaf the forward makes should not be "
                    "kept past it (on the module, in a global)")
    mark_verified(call.owner, call.switches)


def _reaches_from_outside(value: Any, leaf: torch.Tensor, owner: nn.Module, /, *,
                          any_graph: bool) -> bool:
    """Whether ``value`` is ``leaf``, or a tensor with a graph to it that is no activation of
    the layer (a graph reaching the layer's own parameters too: an output a probe hook or a
    cache object kept, which the replay made from the refused tensor, helper OT). With
    ``any_graph``, the search's second round, any graph to it counts: a tensor made outside
    from it and a parameter the layer shares (tied weights, ``v + layer.a.bias``) reaches
    both (helper OU: the first round alone named no holder for those)."""
    if value is leaf:
        return True
    if not isinstance(value, torch.Tensor) or value.grad_fn is None or \
            not graph_reaches([value.grad_fn], leaf):
        return False
    return any_graph or not any(graph_reaches([value.grad_fn], p) for p in owner.parameters()
                                if p.requires_grad)


def _held_by_a_hook(leaf: torch.Tensor, owner: nn.Module, /, *,
                    before: frozenset[int] | None = None) -> str:
    """Where a forward hook (or pre-hook) on a module inside the layer holds ``leaf``: as a
    bound method of a module outside the layer (a ReFT intervention, a steering vector: its
    parameters, or a tensor attribute with a graph to it), or in its closure or defaults, or
    a partial's bound arguments, directly or as such a module's (helper OP); "" if none
    (helper OF: the refusal guessed a forward bound to another instance). A module holding
    the layer (the model, whose logging hook it is) proves nothing: helper ON. With
    ``before`` (the search's second round), a tensor with any graph to it counts where it
    was held before the replay began (``held_before_replay``)."""
    for label, kind, path, held in _hook_holdings(owner):
        if any(_reaches_from_outside(value, leaf, owner, any_graph=False) if before is None
               else id(value) in before and
               _reaches_from_outside(value, leaf, owner, any_graph=True) for value in held):
            return (f", by {label}, a {kind} on {path or 'the layer'} that holds it "
                    "from outside the layer (register its module under the layer, "
                    "`layer.intervention = ...`, so its parameters are the layer's; "
                    "or hook the checkpointed layer itself, whose hooks run outside "
                    "the boundary)")
    return ""


def _hook_holdings(owner: nn.Module, /) -> Iterator[tuple[str, str, str, list[Any]]]:
    """Each forward hook (or pre-hook) on a module inside the layer, with what it holds: its
    label, kind, the module's path, and the values (a bound method's module outside the layer
    gives its parameters and tensor attributes)."""
    inside = {id(m) for m in owner.modules()}
    for path, module in owner.named_modules():
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks),
                            ("forward hook", module._forward_hooks)):
            for hook in list(hooks.values()):
                holder = dunder(hook, "__self__")
                func = dunder(hook, "__func__", hook)
                label = dunder(func, "__qualname__", type(hook).__name__)
                if isinstance(holder, nn.Module):
                    bound = [holder]
                else:  # a function's closure and defaults; a partial's bound arguments
                    inner = dunder(func, "func") if isinstance(func, functools.partial) else None
                    bound = [*(func.args if inner is not None else ()),
                             *(func.keywords.values() if inner is not None else ())]
                    if (instance := dunder(inner, "__self__")) is not None:  # a method's
                        bound.append(instance)
                        label = dunder(dunder(inner, "__func__"), "__qualname__", label)
                    code = inner if inner is not None else func
                    bound += [cell_contents(cell) for cell in dunder(code, "__closure__") or ()]
                    bound += [*(dunder(code, "__defaults__") or ()),
                              *(dunder(code, "__kwdefaults__") or {}).values()]
                held: list[Any] = []
                for value in bound:
                    if not isinstance(value, nn.Module):
                        held.append(value)
                        continue
                    try:  # a refusal's search: a module that cannot be walked is skipped
                        if id(value) in inside or any(m is owner for m in value.modules()):
                            # inside the layer (a logging hook's submodule, helper OQ), or
                            # around it (the model, whose parameters are all: helper ON)
                            continue
                        held += [*value.parameters(), *(v for v in vars(value).values()
                                                        if isinstance(v, torch.Tensor))]
                    except Exception:
                        continue
                yield label, kind, path, held


def held_before_replay(call: BoundaryCall, /) -> frozenset[int]:
    """The ids of the tensors with a graph that the plain objects among a call's inputs and
    the hooks inside its layer hold as its first replay begins: the refusal's second round
    (``_held_at``) takes only those, so an activation the replay made (a probe hook keeping a
    submodule's output, a cache object) is not named as the holder of a tensor the replay
    reached (helper PB). At first replays only, with hooks inside or objects among the
    inputs."""
    found: set[int] = set()

    def note(value: Any) -> bool:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            found.add(id(value))
        return False

    _in_input_objects(call, note)
    if call.hooked and call.owner is not None:
        try:  # a refusal's search: what cannot be walked is skipped
            for _, _, _, held in _hook_holdings(call.owner):
                for value in held:
                    note(value)
        except Exception:
            pass
    return frozenset(found)


def _held_at(leaf: torch.Tensor, call: BoundaryCall, /) -> str:
    """Where a foreign leaf is held, for the refusal to name (", by layer.cache[2]", ", by
    the closure variable 'table' of Lookup.forward"), or "": the modules' own attributes (and
    the lists, tuples and dicts in them), then the globals and closure variables of the code
    that ran, then tensors with a graph to it on the modules' buffers or on plain objects
    among the inputs, then hooks; a tensor whose graph reaches a parameter of the layer too
    last. Searched only when refusing, so its cost is of no matter."""
    owner, fn = call.owner, call.fn
    assert owner is not None
    for path, module in owner.named_modules():
        for name, value in tuple(vars(module).items()):
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            at = f"{path}.{name}" if path else name
            if value is leaf:
                return f", by {at} (a module attribute)"
            items = value.items() if isinstance(value, dict) else \
                enumerate(value) if isinstance(value, (list, tuple)) else ()
            for key, item in items:
                if item is leaf:
                    return f", by {at}[{key!r}] (a module attribute)"
    functions = [getattr(type(m), "forward", None) for m in owner.modules()]
    for func in (dunder(fn, "__func__", fn), *functions):
        code = dunder(func, "__code__")
        if code is None:
            continue
        label = dunder(func, "__qualname__", "the function")
        for name, cell in zip(code.co_freevars, dunder(func, "__closure__") or ()):
            if cell_contents(cell) is leaf:
                return f", by the closure variable {name!r} of {label}"
        names = code.co_varnames[code.co_argcount - len(dunder(func, "__defaults__")
                                                        or ()):code.co_argcount]
        defaults = [*zip(names, dunder(func, "__defaults__") or ()),
                    *(dunder(func, "__kwdefaults__") or {}).items()]
        for name, value in defaults:
            if value is leaf:
                return f", by the default of the argument {name!r} of {label}"
        space = globals_of(func)
        for name in code.co_names:
            if space.get(name) is leaf:
                return f", by the global {name!r} of {space.get('__name__', 'its module')}"
    # Reached through a tensor with a graph to it that the module holds (a learned initial
    # state put in a state buffer: `self.h = h0.expand(...)`; helper ES).
    for path, buffer in owner.named_buffers():
        if buffer.grad_fn is not None and graph_reaches([buffer.grad_fn], leaf):
            return f", reached through the buffer {path} (a tensor with a graph to it)"
    # Or through an attribute of a plain object passed in, which the tree bridge does not open
    # (a graph batch, `data.x` the encoder's output; helper ET: the encoder's weight was named
    # as a parameter of another instance).
    found = _in_input_objects(call, lambda value: _reaches_from_outside(value, leaf, owner,
                                                                        any_graph=False))
    if found is not None:
        return _through_input_object(found)
    # Or as a key of a dict passed in (optree keeps keys in the spec, not among the leaves).
    key = node_path(call.in_spec, lambda node_type, data: isinstance(data, (list, tuple)) and
                    isinstance(node_type, type) and issubclass(node_type, dict) and
                    any(k is leaf for k in data), root="inputs")
    if key is not None:
        return (f", used as a key of the dict at {readable_path(key)} (keys are not inputs of "
                "the boundary: pass it as a value)")
    hooked = _held_by_a_hook(leaf, owner)
    if hooked:
        return hooked
    # Or a plain tensor attribute of a module inside the layer, with a graph to it (a steering
    # vector scaled and kept there, read by a hook inside the layer: helper OR); asked last,
    # since an activation a submodule keeps has one too (helper OS).
    for path, module in owner.named_modules():
        for name, value in tuple(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None and \
                    graph_reaches([value.grad_fn], leaf):
                at = f"{path}.{name}" if path else name
                return f", reached through {at} (a module attribute with a graph to it)"
    # The second round: a tensor with a graph to it and to a parameter of the layer's own (an
    # input object's tensor made by an encoder tied to the layer, a hook's vector made
    # relative to its bias: helper OU), asked after all else, and only one held before the
    # replay began (not an activation it made: helper PB).
    before = call.held_before_replay
    if before:
        found = _in_input_objects(call, lambda value: id(value) in before and
                                  _reaches_from_outside(value, leaf, owner, any_graph=True))
        if found is not None:
            return _through_input_object(found)
        hooked = _held_by_a_hook(leaf, owner, before=before)
        if hooked:
            return hooked
    if isinstance(leaf, nn.Parameter):  # helper EM: a forward bound to another instance
        return (", an nn.Parameter of no module passed in (is the forward bound to another "
                "instance? `m.forward = torch.compile(m.forward)` before a deepcopy leaves "
                "the copy's forward on the original)")
    return ""


def _through_input_object(found: str, /) -> str:
    if "<" in found:  # a closure's variable or a default
        return (f", reached through {found} (held by a function passed as an argument, which "
                "the boundary does not open: build the function inside the forward from "
                "tensors passed as arguments)")
    return (f", reached through {found} (an attribute of a plain object, which the boundary "
            "does not open: pass a dataclass, or register its class with optree in namespace "
            "'pytree_ckpt', and its tensors are inputs; where it holds a tensor also passed as "
            "an argument, read that argument instead)")


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


def require_module(module: Any, where: str, tip: str, /) -> None:
    """A ``CheckpointConfigError`` unless ``module`` is an ``nn.Module`` instance; ``where``
    names the function, ``tip`` the fix (a module class is told to pass an instance)."""
    if isinstance(module, nn.Module):
        return
    if isinstance(module, type) and issubclass(module, nn.Module):
        got = f"the class {module.__name__}, not an instance of it"
        tip = f"pass the model's {module.__name__} module itself, not its class"
    else:
        got = describe_leaf(module)
    raise CheckpointConfigError(f"{where} expects an nn.Module", expected="an nn.Module",
                                got=got, tip=tip)


def refuse_container(module: nn.Module, consequence: str, /, *, index: int | None = None,
                     tip: str | None = None) -> None:
    """Refuse a container (``ModuleList``, ``ModuleDict``) as a module to checkpoint: nothing
    calls its forward. ``consequence``: what a boundary on it would do; ``index``: its place in
    a layer list, named in the message; ``tip``: the fix, where it is not to checkpoint each
    layer the container holds."""
    if type(module).forward is not nn.Module.forward or "forward" in module.__dict__:
        return
    name = type(module).__name__
    # A ModuleDict (torchtitan keeps model.layers in one) iterates over its keys.
    layers = "model.layers.values()" if isinstance(module, nn.ModuleDict) else "model.layers"
    raise CheckpointConfigError(
        f"{name if index is None else f'layer {index} ({name})'} has no forward of its own: "
        f"{consequence}", expected="a module that is called (a decoder layer, a norm)",
        got=f"a {name} (a container of modules)",
        tip=tip or f"checkpoint_layers({layers}) checkpoints each layer it holds")
