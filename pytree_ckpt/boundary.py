"""The PyTree-aware reentrant checkpoint boundary: ``run_boundary`` finds what one call is made
of (its unique input tensors; the parameters, buffers and attributes of the modules it uses) and
applies the boundary's autograd Function (boundary_function.py) to them, inside the offload
window when there is one.

``checkpoint(fn, *args, **kwargs)`` (functional.py) runs ``fn`` once under no-grad (the
*original pass*) and again during backward (the *replay*), exactly like torch's reentrant
checkpoint, but:

- arguments, keyword arguments and outputs may be any PyTree; every tensor leaf of the inputs
  is an input of one autograd Function, so it gets its gradient and is saved through the
  ambient ``saved_tensors_hooks`` (how offload sees it);
- parameters get their exact gradients even when no input requires grad;
- the phase is explicit (``current_phase()``), and frozen results recorded with
  ``reuse_during_recompute`` are replayed from the invocation's frame.

NOTE [what is saved]: only the *unique* tensor leaves of the inputs, once each, through
``ctx.save_for_backward``. Nothing computed inside the original pass is saved (it runs under
no-grad), and when an ambient hook exists the replay runs under identity saved-tensor hooks
that shadow it, so no ambient hook (offload, a census) ever sees a tensor computed inside the
boundary. Non-tensor leaves and the tree specs are kept by reference on the autograd node;
tensor leaves are never kept there, so swapping the saved reference (offload) really frees the
device copy.

NOTE [parameters are inputs]: when the boundary knows the module whose parameters ``fn`` uses
(``fn`` is a module, a bound method of one, or the forward installed by
``apply_activation_checkpointing``), its trainable parameters (and those of modules passed as
arguments) are extra inputs of the Function. The replay then computes their gradients with
``torch.autograd.grad`` and returns them, so autograd adds them to ``.grad`` where eager would,
in eager's order with the parameter's other uses: bit-identical gradients with micro-batch
accumulation and layers used several times (shared-weight MTP), parameters get gradients when
no input requires grad, and ``torch.autograd.grad`` / ``backward(inputs=...)`` work. The first
replay of each module (and the first after any module gains or swaps a submodule) checks that
its graph reaches no other tensor that requires grad: it would silently get no gradient. The
parameters' own hooks then run when the node returns, in autograd's order for tasks ready
together, not eager's within the layer (docs/limits.md, "Gradient hooks and DDP").

NOTE [attributes set before the call]: a module's own forward pre-hooks run before its wrapped
forward, outside the boundary. One that sets a tensor with a graph as a plain attribute (the
deprecated ``torch.nn.utils.weight_norm`` and ``spectral_norm`` compute ``module.weight`` so,
every call, and ``torch.nn.utils.prune`` the pruned tensor) leaves the replay, in backward,
reading whatever the attribute holds then: the last call's tensor, whose outside graph
``torch.autograd.grad`` would walk and free (a second call in one loss, or
``retain_graph=True``, then fails). The attributes those pre-hooks name (tensors in the
module's own ``__dict__``; NOTE [only attributes a pre-hook names] in module_state.py) are
extra inputs of the Function, after the call's inputs, and the replay sees detached aliases of
this call's tensors in their place: their gradients leave through the boundary into their own
graphs, as in eager. One without a graph (``spectral_norm`` over a frozen ``weight_orig``: its
power iteration still changes it every call) is saved the same way: with several calls before
backward (micro-batches), each replay reads its own call's tensor, not the last one. A custom
pre-hook that sets such an attribute is taken the same way where it carries a ``name`` naming
it; without one it is not recognized (one call per backward works, and a second call's backward
is refused naming the hook: ``raise_freed_graph_reached`` in refusals.py).

NOTE [unknown callables]: for any other callable the parameters it closes over cannot be known,
so the replay accumulates every leaf's gradient with ``torch.autograd.backward``, as torch's
reentrant checkpoint does; when no input requires grad a tiny requires-grad *anchor* makes the
backward run. Such a replay cannot honour ``torch.autograd.grad`` or ``backward(inputs=...)``:
those raise ``CheckpointError`` instead of returning partial results. Its replay changes the
state of the modules it reaches again (a batch norm's running statistics): warned when they are
modules it is given, holds or names as globals (NOTE [state a plain function changes] in
plain_state.py).

Elsewhere: what a call carries from its original pass to its replay, and the boundary's options,
in ``boundary_call.py`` (one container passed in several places, rebuilt once for the replay, in
``shared_containers.py``); what the boundary knows of the modules a call uses (their parameters
and buffers, cached) in ``module_state.py``; the state the original pass changes in
``state_changes.py``, and what its modules were then in ``forward_modules.py``; what it refuses,
and how its messages say so, in ``refusals.py``, ``tree_refusals.py`` and
``changed_in_place.py``; the autograd Function a call applies (its original pass, and the
start of its replay) in ``boundary_function.py``; the replay itself, in backward, in
``recompute.py``.

NOTE [when there is no boundary]: with grad disabled (``no_grad``, ``inference_mode``), under a
``torch.func`` transform (``grad``, ``vmap``, ``vjp``: it builds its own graph), inside
forward-mode AD (``torch.autograd.forward_ad.dual_level()``: the no-grad original pass would
drop the tangents of dual tensors it reaches other than as inputs, and the Function has no
jvp), while ``torch.jit.trace`` or a non-strict ``torch.export`` records the forward (they
capture the model's computation for serving: a boundary is an autograd Function with a Python
replay, which neither can record, and its save units and offload windows would run on their
fake tensors; an exported program trains without checkpointing, as ``torch.fx`` gives), or when
nothing can receive a gradient (no input requires grad and ``fn`` belongs to a module with no
trainable parameter), ``fn`` is just called: no node, no frame, phase unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

# BoundaryOptions: also what a layer pickled before boundary_call.py was split off names
# (``pytree_ckpt.boundary``).
from .boundary_call import BoundaryCall, BoundaryOptions
from .boundary_function import apply_function
from .changed_in_place import CHANGED_AFTER_CALL_TIP
from .errors import CheckpointError
from .hook_outputs import held_tensors, hooked_modules
from .hook_tables import HookTables, backward_or_global_hooks, registered
from .fsdp_units import refuse_fsdp1_units
from .module_state import (ModuleDicts, any_expanded, any_lazy, argument_module, call_switches,
                           collect_parameters, ever_verified, graph_attributes, is_verified,
                           module_dicts, owning_module, warn_forward_hooks)
from .parameter_hooks import skip_no_gradient
from .phase import ACTIVE, REBUILDING
from .plain_state import NOTHING_HELD, watch_plain_state
from .rebound import NOTHING_BOUND, modules_bound
from .recording import symbolic_tracing
from .recompute import dynamo_marks
from .refusals import input_path_of
from .shared_containers import shared_containers
from .subclass import with_attributes_of
from .torch_wrappers import PENDING as TORCH_WRAPPERS_PENDING
from .torch_wrappers import check_at_first_call as check_torch_wrappers
from .tree import dunder, flatten_call
from .tree_refusals import (refuse_metadata_tensors, refuse_strided_nested,
                            refuse_unreadable_inputs)

__all__ = ["run_boundary"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
_STILL_LAZY = "_pytree_ckpt_still_lazy"  # a module warned about lazy state its call left lazy
_EXPANDED = "_pytree_ckpt_expanded"  # a module told that its per-sample calls run plainly


# NOTE [loops on the per-call path]: Python 3.11 makes a function object and a frame for every
# list comprehension and generator expression it runs, and a generator object too for the latter:
# counted by callgrind, ``any(t.requires_grad for t in ts)`` over one tensor costs about 3,500
# instructions where a for loop costs 400, ``all(...)`` over a layer's seven submodules about
# 10,000 where a loop costs 6,000. On what runs at every layer call (the boundary's forward and
# replay and the checks they call), plain loops take the place of those over the few items a
# layer has, where they read as well. C-level pipelines (``all(map(operator.is_, ...))``,
# ``[*map(attrgetter(...), ...)]``) cost more again at these sizes: each map, chain or
# attrgetter call is a C call per item (tried and measured: about 26,000 more a layer call).
# Error paths and the first call of a layer keep their comprehensions.


_anchor_tensor: torch.Tensor | None = None


def _anchor() -> torch.Tensor:
    # A constant, never receives a gradient (backward returns None for it): no step state.
    global _anchor_tensor
    if _anchor_tensor is None:
        # On the CPU, whatever torch's default device is at the first call.
        _anchor_tensor = torch.empty(0, device="cpu", requires_grad=True)
    return _anchor_tensor


# Whether a torch.func transform is active, read as torch's own Function.apply reads it (the
# dispatch keys functorch includes while its interpreter stack is not empty). Not
# torch._C._functorch.peek_interpreter_stack(): the first call of that creates the thread's
# functorch state, which every autograd node run afterwards (and every ThreadLocalState
# capture) then deep-copies: about 100,000 instructions a layer call at the small size of
# examples.bench_instructions, in the caller's own autograd work as much as in the boundary's.
_functorch_transforms_active: Any = torch._C._are_functorch_transforms_active
# NOTE [a tracer records the plain forward] (recording.py): read inline, as the other tests
# here, the fx flag first (symbolic_tracing only where it is set).
_is_tracing: Any = torch._C._is_tracing  # torch.jit.trace records (torch.jit.is_tracing's test)
_compiler = torch.compiler  # _is_exporting_flag: torch.compiler.is_exporting()'s, read as is
_fx_trace: Any = torch.fx._symbolic_trace  # _is_fx_tracing_flag


def run_boundary(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: BoundaryOptions, /, *, owner: nn.Module | None = None,
                 nested: Callable[[], None] | None = None) -> T:
    """The boundary itself; ``checkpoint`` and module wrapping both call this.

    ``owner`` is the module whose parameters ``fn`` uses, when the caller knows it.
    ``nested``: called when a boundary is built inside another boundary's pass (its replay,
    or its original pass under enable_grad: NOTE [a checkpointed layer inside a checkpointed
    call] in module.py).
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or \
            _functorch_transforms_active() \
            or _forward_ad._current_level >= 0 or _is_tracing() \
            or getattr(_compiler, "_is_exporting_flag", False) \
            or getattr(_fx_trace, "_is_fx_tracing_flag", False) and symbolic_tracing():
        # NOTE [when there is no boundary]; under inference mode, grad enabled inside it too
        # (helper NW: a boundary ran, its output had a grad_fn eager's has not, and it held the
        # inputs); under a torch.func transform (grad, vmap, vjp,
        # jacrev) too: the Function has no setup_context, and torch's error would name no fix
        # (read as Function.apply reads it: see _functorch_transforms_active);
        # and inside forward-mode AD's dual_level(): the no-grad original pass drops the
        # tangents of dual tensors it reaches other than as inputs (parameters swapped in by
        # functional_call), silently; and while torch.jit.trace, torch.export (non-strict) or
        # torch.fx.symbolic_trace records the forward (helper LE: fx's proxies ran the boundary,
        # offload windows opened, and that pass counted as a save unit's first forward).
        return fn(*args, **kwargs)
    flat = flatten_call(args, kwargs, at_boundary=True)  # NOTE [a weakref.proxy leaf] (tree.py)
    leaves = flat.leaves
    if flat.spec.num_nodes - flat.spec.num_leaves > 3:  # more than (args, kwargs): NOTE
        refuse_metadata_tensors(fn, flat.spec, root="inputs")  # [tensors in a node's metadata]
    unique: list[torch.Tensor] = []
    slots: list[int] = []
    seen: dict[int, int] = {}
    for index in flat.tensor_index:
        tensor = leaves[index]
        key = id(tensor)
        slot = seen.get(key)
        if slot is None:
            slot = seen[key] = len(unique)
            unique.append(tensor)
            if tensor.requires_grad and (tensor._backward_hooks or
                                         tensor._post_accumulate_grad_hooks):
                skip_no_gradient(tensor)  # NOTE [inputs without a gradient] (parameter_hooks.py)
        slots.append(slot)
        leaves[index] = None
    given_owner = owner is not None  # a checkpointed layer's own call (module.py)
    owner = owner if owner is not None else owning_module(fn)
    params: list[torch.Tensor] | None = None
    before: list[torch.Tensor] = []  # frozen parameters and buffers, as they are before fn
    buffers: list[dict[str, torch.Tensor | None]] = []
    frozen: list[torch.Tensor] = []
    trees: list[ModuleDicts] = []
    if owner is not None:
        # Modules passed as arguments, or their bound methods (an activation passed as
        # `shared.forward`): their parameters are inputs too.
        modules = [owner] if len(flat.tensor_index) == len(leaves) else \
            [owner, *(module for leaf in leaves if leaf is not None and
                      (module := argument_module(leaf)) is not None)]
        trees = [module_dicts(owner)] if len(modules) == 1 else \
            [module_dicts(module) for module in modules]
        keep = options.keep
        if keep is not None and keep.callables:  # NOTE [kept methods of modules added later]
            keep.install_late(owner)
        # Not skipping inputs: a parameter also passed as an argument is used both ways, and
        # each use needs its gradient (the argument's comes through its input slot).
        try:
            params = collect_parameters(trees, set(), frozen=before)
        except RuntimeError:
            if not any_expanded(trees):
                raise
            # NOTE [expanded weights]: torch's per-sample gradients (call_for_per_sample_grads,
            # Opacus's grad_sample_mode="ew") swap ExpandedWeight tensors in for one call,
            # which refuse every op they do not know, `requires_grad` too (helper OV: torch's
            # "cannot handle function __get__" came from here). They compute each sample's
            # gradient in their own backward from what their ops save: the call runs as
            # eager does, without a boundary (not checkpointed; told once per module).
            if _EXPANDED not in owner.__dict__:
                owner.__dict__[_EXPANDED] = True
                logger.warning("%s runs with torch's ExpandedWeight parameters (per-sample "
                               "gradients): such calls run without checkpointing",
                               type(owner).__name__)
            return fn(*args, **kwargs)
        frozen = list(before)
        first = not ever_verified(owner)
        if first:
            refuse_fsdp1_units(owner, fn)  # NOTE [FSDP1 around a boundary] (fsdp_units.py)
        if first or TORCH_WRAPPERS_PENDING in owner.__dict__:
            # NOTE [a layer left in torch's wrapper]; pending while only parts of it ran
            check_torch_wrappers(fn, owner, given_owner)
        if first and any_lazy(trees):
            # A lazy module (nn.LazyLinear) gives its parameters (and buffers) their shape in
            # its first call: taken as inputs before it, they would get gradients of the wrong
            # shape. That call runs as eager does, without the boundary; the next ones are
            # checkpointed.
            logger.info("%s has uninitialized (lazy) parameters or buffers: its first call "
                        "runs without checkpointing, and materializes them", type(owner).__name__)
            output = fn(*args, **kwargs)
            if _STILL_LAZY not in owner.__dict__ and any_lazy(trees):
                # A lazy submodule this call did not run stays lazy, and every call runs so.
                owner.__dict__[_STILL_LAZY] = True  # warned once per module
                logger.warning("%s still has uninitialized (lazy) parameters or buffers after "
                               "a call: it is not checkpointed until they are materialized "
                               "(run a dummy batch through every lazy submodule first)",
                               type(owner).__name__)
            return output
        for tree in trees:
            buffers.extend(tree.buffers)
            if any(tree.buffers):  # most layers have none: no walk at each call
                before.extend(b for d in tree.buffers for b in d.values() if b is not None)
    attributes: list[tuple[str, torch.Tensor]] = []
    if owner is not None and fn is not owner and owner._forward_pre_hooks:
        attributes = graph_attributes(owner)  # NOTE [attributes set before the call]
    anchor = None
    if not params and not any(t.requires_grad for _, t in attributes) and \
            not any(t.requires_grad for t in unique):
        if params is not None:  # a module with nothing trainable: nothing to replay for
            return fn(*args, **kwargs)
        anchor = _anchor()
    # NOTE [state a plain function changes] (plain_state.py): a lookup, for most functions
    plain = None
    bound = None  # NOTE [a module rebound before the replay] (rebound.py)
    if len(flat.tensor_index) < len(leaves):
        refuse_unreadable_inputs(fn, flat.spec, leaves,
                                  use_cache=kwargs.get("use_cache"))
        if owner is None:
            plain = watch_plain_state(fn, leaves, flat.spec)
            bound = modules_bound(fn)
    elif owner is None:
        code_id = id(dunder(fn, "__code__"))
        if code_id not in NOTHING_HELD:
            plain = watch_plain_state(fn, None, flat.spec)
        if code_id not in NOTHING_BOUND:  # a code holding no module may still index late
            bound = modules_bound(fn)
    call = BoundaryCall(fn, options, flat.spec, leaves, flat.tensor_index, slots)
    call.bound = bound
    call.original_call = (args, kwargs)
    call.in_shared = shared_containers(call.original_call, flat.spec)
    call.n_inputs = len(unique)
    call.params = params
    call.owner = owner
    call.before = {id(t): t for t in before} if before else None
    call.buffer_dicts = buffers
    call.frozen = frozen
    if trees:
        call.modules = (modules, trees)
        # The owner's own hooks run inside when fn is the owner (checkpoint(module, x): a hook
        # that keeps the output before another rewrites it keeps no output of fn), outside for
        # an installed forward; those of modules passed in run inside.
        roots = modules if fn is owner else modules[1:]
        submodules = trees[0].submodules if len(trees) == 1 else \
            [d for tree in trees for d in tree.submodules]
        dicts: Sequence[dict[str, Any]] = submodules
        if roots:
            dicts = list(submodules)
            for m in roots:  # NOTE [loops on the per-call path]
                dicts.append(m.__dict__)
        call.hooked = hooked_modules(dicts, modules, None if fn is owner else owner)
        # NOTE [the replay runs the forward's hooks] (hook_tables.py)
        call.hook_dicts, call.hook_epoch = dicts, registered()
        if call.hooked or backward_or_global_hooks(dicts):
            call.hook_tables = HookTables(dicts)
        if call.hooked:
            call.held = held_tensors([*(m.__dict__ for m in modules),
                                      *(d for tree in trees for d in tree.submodules)])
    if owner is not None:
        call.switches = call_switches(flat.spec, leaves, hooked=call.hooked,
                                      only_tensors=len(flat.tensor_index) == len(leaves))
        if call.hooked and torch.is_grad_enabled() and not is_verified(owner, call.switches):
            # Hooks inside are warned about at the first replay (verify_leaves in refusals.py),
            # where one removed before backward (registered for one step's forward) is gone,
            # though what it computed under no-grad has no gradient: said here too, once.
            warn_forward_hooks(owner, [leaf for leaf in leaves if isinstance(leaf, nn.Module)],
                               own=fn is owner)
    inputs = unique
    if attributes:
        call.attributes = [name for name, _ in attributes]
        inputs = [*unique, *(t for _, t in attributes), *(params or ())]
    elif params:
        inputs = [*unique, *params]
    active = ACTIVE.get()
    if nested is not None and active is not None:
        nested()
    try:
        # NOTE [a discard's rebuild opens no window] (phase.py) too
        if options.offload is None or active is not None or REBUILDING.get():
            # NOTE: a boundary nested in another's replay runs in backward, where its inputs are
            # needed again at once: copying them to host and straight back would only cost time.
            # So does one nested in another's original pass (a body taking a gradient under
            # enable_grad): that graph is the pass's own, used before the pass ends (helper KW:
            # each inner input copied and read back in the forward, its backward turning the
            # pass, no prefetch).
            out_tensors = apply_function(call, anchor, inputs)
        else:
            # NOTE: the window covers only the save of the inputs (the original pass inside runs
            # without its hooks), so exactly the boundary's inputs are offloaded.
            manager = options.offload
            # Named from the callable, the spec and index lists only: the window must not hold
            # `call`, whose frame holds this window's handles (a cycle only the garbage
            # collector would free). Helper DJ: the message named no layer, unlike the one
            # without offload.
            name = functools.partial(input_path_of, call.fn, flat.spec, flat.tensor_index,
                                     slots)
            # The module's parameters: a detached alias of one passed in stays resident.
            resident = [*params, *frozen] if params is not None else ()
            with manager.eager_window(unique, name=name, resident=resident,
                                      changed_tip=CHANGED_AFTER_CALL_TIP) as window:
                call.window_hooks = True  # NOTE [the body runs without the window's hooks]
                out_tensors = apply_function(call, anchor, inputs)
            call.marks = dynamo_marks(unique)  # NOTE [dynamo's marks reach the replay]
            if call.frame.results:  # frozen results (top-k ids) go to host with the inputs
                call.frame.offload(functools.partial(manager.offload_into, window),
                                   manager.restore)
    except RuntimeError as error:
        if not isinstance(error, CheckpointError) and "NestedTensorImpl" in str(error):
            # NOTE [tensors of other layouts] (tree.py)
            refuse_strided_nested(fn, flat.spec, flat.tensor_index,
                                  [unique[slot] for slot in slots], root="inputs")
        raise
    if call.hook_dicts is not None and registered() != call.hook_epoch:
        # NOTE [the replay runs the forward's hooks] (hook_tables.py): one the forward
        # registered (a first call installing a hook before its submodule runs) ran in it.
        call.hook_tables = (call.hook_tables or HookTables.none(call.hook_dicts)).joined(
            call.hook_dicts)
        call.hook_epoch = registered()
    if plain is not None:
        call.plain_state = plain.after_forward()  # kept for the replay when it changed state
    if call.returned_attributes is not None:  # NOTE [an input returned keeps its attributes]
        out_tensors = list(out_tensors)
        for position, given in call.returned_attributes:
            out_tensors[position] = with_attributes_of(out_tensors[position], given)
        call.returned_attributes = None
    if call.as_is:
        out_tensors = list(out_tensors)
        for position, tensor in call.as_is:
            out_tensors[position] = tensor
        call.as_is = None
    return call.outputs(out_tensors)
