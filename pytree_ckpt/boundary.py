"""The PyTree-aware reentrant checkpoint boundary.

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
``torch.autograd.grad`` and returns them, so autograd adds them to ``.grad`` exactly where and
in the order eager would: bit-identical gradients with micro-batch accumulation and layers used
several times (shared-weight MTP), parameters get gradients when no input requires grad, and
``torch.autograd.grad`` / ``backward(inputs=...)`` work. The first replay of each module (and
the first after any module gains or swaps a submodule) checks that its graph reaches no other
tensor that requires grad: it would silently get no gradient.

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
pre-hook that sets such an attribute is not recognized and behaves as before this note (one
call per backward works).

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
``changed_in_place.py``; the replay itself, in backward, in ``recompute.py``.

NOTE [when there is no boundary]: with grad disabled (``no_grad``, ``inference_mode``), under a
``torch.func`` transform (``grad``, ``vmap``, ``vjp``: it builds its own graph), inside
forward-mode AD (``torch.autograd.forward_ad.dual_level()``: the no-grad original pass would
drop the tangents of dual tensors it reaches other than as inputs, and the Function has no
jvp), or when
nothing can receive a gradient (no input requires grad and ``fn`` belongs to a module with no
trainable parameter), ``fn`` is just called: no node, no frame, phase unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

# BoundaryOptions: also what a layer pickled before boundary_call.py was split off names
# (``pytree_ckpt.boundary``).
from .boundary_call import BoundaryCall, BoundaryOptions
from .census import Mechanism, census_active, report_held
from .changed_in_place import (ParameterVersions, raise_input_changed,
                               refuse_parameters_changed)
from .compiled_layers import recompile_limit_note
from .errors import CheckpointError
from .forward_modules import ForwardModules
from .held_generators import held_generators, warn_made_during
from .hook_outputs import GradFlow, HookedOutputs, held_tensors, hooked_modules, recording
from .keep import KeepMode
from .kernel_written import remember, remembered
from .made_before import leaving_tensors
from .module_state import (ModuleDicts, any_lazy, argument_module, call_switches,
                           collect_parameters, ever_verified, graph_attributes, module_dicts,
                           owning_module)
from .parameter_hooks import skip_no_gradient
from .phase import ACTIVE, Invocation, Phase
from .plain_state import NOTHING_HELD, watch_plain_state
from .recompute import replay_backward
from .refusals import check_made_leaves, fn_name, input_path, refuse_double_backward
from .rng import IsolatedPass, ReplayEnvironment
from .shared_containers import shared_containers
from .state_changes import (StateWatch, mark_stateful, registered_state, snapshots_wanted,
                            versions)
from .stored_state import warn_parameter_changed
from .subclass import kind_of
from .tree import flatten, flatten_call
from .tree_refusals import (refuse_hidden_outputs, refuse_strided_nested,
                            refuse_unreadable_inputs)

__all__ = ["run_boundary"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
_STILL_LAZY = "_pytree_ckpt_still_lazy"  # a module warned about lazy state its call left lazy


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
        _anchor_tensor = torch.empty(0, requires_grad=True)
    return _anchor_tensor


_Tensor = torch.Tensor  # read per call
# Whether a torch.func transform is active, read as torch's own Function.apply reads it (the
# dispatch keys functorch includes while its interpreter stack is not empty). Not
# torch._C._functorch.peek_interpreter_stack(): the first call of that creates the thread's
# functorch state, which every autograd node run afterwards (and every ThreadLocalState
# capture) then deep-copies: about 100,000 instructions a layer call at the small size of
# examples.bench_instructions, in the caller's own autograd work as much as in the boundary's.
_functorch_transforms_active: Any = torch._C._are_functorch_transforms_active


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: BoundaryCall, anchor: torch.Tensor | None,
                *inputs: torch.Tensor) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)
        tensors = inputs[: call.n_inputs]  # the rest are parameters (NOTE [parameters are inputs])
        preserve_rng = call.options.preserve_rng_state
        env = call.env = ReplayEnvironment.capture(
            tensors, preserve_rng=preserve_rng,
            leaves=call.in_leaves if len(call.in_tensor_index) < len(call.in_leaves) else None,
            # NOTE [generators held as attributes] (held_generators.py)
            held=held_generators(*call.modules) if preserve_rng and call.modules is not None
            else ())
        # NOTE [skipped work keeps the RNG in step] (frames.py): the generators it restores
        # (env.rng_devices(), spelled out for the usual case: the CPU one alone).
        call.frame.rng_devices = None if env.cpu_rng is None else \
            env.rng_devices() if env.cuda_rng else ()
        if env.generators:  # NOTE [generators passed in] (rng.py), and held: they jump too
            call.frame.generators = tuple(g for g, _ in env.generators)
        assert call.original_call is not None
        args, kwargs = call.original_call
        call.original_call = None
        invocation = Invocation(Phase.FORWARD, call.frame, ACTIVE.get())
        input_versions = versions(tensors)
        param_before = ParameterVersions.read(call.params) if call.params else None
        # NOTE [state the forward changes] (state_changes.py); a tree with no buffer nor frozen
        # parameter (the usual layer) needs no watch: only a registration can happen there,
        # looked for after the call (registered_state).
        watch = StateWatch(call.buffer_dicts, call.frozen, call.modules[1],
                           snapshot=snapshots_wanted(call.owner),
                           compare=not ever_verified(call.owner),
                           written=remembered(call.modules[0])) \
            if call.owner is not None and call.modules is not None and \
            (call.frozen or any(call.buffer_dicts)) else None
        token = ACTIVE.set(invocation)
        try:
            # NOTE [each pass caches its own parametrizations] and NOTE [no fast path by grad
            # mode] in rng.py.
            with IsolatedPass():
                recorded = None
                flow: GradFlow | None = None
                if call.options.keep is None and not call.hooked:
                    output = call.fn(*args, **kwargs)  # the usual case, with no context more
                else:
                    with ExitStack() as stack:
                        if call.options.keep is not None:
                            stack.enter_context(KeepMode(call.options.keep, invocation,
                                                         layer=call.fn))
                        if call.hooked:
                            recorded = stack.enter_context(recording())
                            flow = stack.enter_context(GradFlow())
                        output = call.fn(*args, **kwargs)
        except Exception as error:
            # torch's "cannot register a hook on a tensor that doesn't require gradient" from
            # a forward that assumes grad mode: name the boundary's no-grad pass.
            if isinstance(error, RuntimeError) and "register a hook" in str(error) and \
                    hasattr(error, "add_note"):  # 3.11+
                error.add_note(
                    f"pytree_ckpt: raised in the original pass of {fn_name(call.fn)}, which "
                    "runs the forward under torch.no_grad() (the replay in backward runs it "
                    "with grad). Tip: guard what needs grad, e.g. `if h.requires_grad: "
                    "h.register_hook(...)`: the hook is then registered in the replay, whose "
                    "gradients are the ones used.")
            limit = recompile_limit_note(error, f"the original pass of {fn_name(call.fn)}")
            if limit is not None and hasattr(error, "add_note"):
                error.add_note(limit)  # NOTE [two entries per variant] in compiled_layers.py
            raise
        finally:
            ACTIVE.reset(token)
        now = versions(tensors)
        moved = [slot for slot, version in enumerate(now) if version != input_versions[slot]] \
            if now != input_versions else []
        if param_before is not None:  # NOTE [parameters changed in place] (changed_in_place.py)
            assert call.params is not None
            call.param_versions = ParameterVersions(call.params, param_before)
        # NOTE [attributes set before the call], continued: saved with the inputs, after them.
        saved = inputs[: call.n_inputs + len(call.attributes)]
        call.saved_versions = versions(saved) if call.attributes else now
        for t in saved:
            if type(t) is not _Tensor:
                # Saved-tensor hooks (offload, a census) hand backward a new plain tensor.
                call.subclasses = [kind_of(t) for t in saved]
                break
        if moved:
            raise_input_changed(call, tensors, moved)
        if watch is not None or any(call.buffer_dicts):
            call.changed_state = watch.changed(read=True) if watch is not None else \
                registered_state(call.buffer_dicts)
            if watch is not None and watch.compare:
                assert call.modules is not None
                remember(call.modules[0], watch.kernel_written)
            if call.changed_state is not None and call.changed_state.changes:
                assert call.owner is not None  # a watch has one, and buffer dicts
                mark_stateful(call.owner)
        if call.modules is not None:
            if call.options.preserve_rng_state:  # NOTE [generators held as attributes]
                warn_made_during(*call.modules, env.generators)
            call.forward_modules = ForwardModules(*call.modules)
            # NOTE [held tensors are not hooked outputs] (hook_outputs.py): after the call too
            if recorded:
                modules, trees = call.modules
                call.held.update(held_tensors(
                    [*(m.__dict__ for m in modules),
                     *(d for tree in trees for d in tree.submodules)]))
        # For verify_leaves, should this call's replay be the one that verifies (whether it is
        # depends on the module structure then, which may change before backward).
        call.frozen_at_call = call.frozen
        call.buffer_dicts, call.frozen, call.modules = [], [], None
        flat = flatten(output)
        if len(flat.tensor_index) < len(flat.leaves):
            refuse_hidden_outputs(call, flat.spec, flat.leaves, flat.tensor_index, tensors)
        # NOTE [outputs made before the call] (made_before.py)
        out_tensors, as_is = leaving_tensors(
            flat.leaves if len(flat.tensor_index) == len(flat.leaves) else
            [flat.leaves[i] for i in flat.tensor_index], tensors, call.before, watch)
        extra: tuple[torch.Tensor, ...] = ()
        if recorded:
            known = {id(t) for t in (*tensors, *(call.before or {}).values(), *out_tensors,
                                     *call.frame.tensors())}
            known |= call.held.keys()
            hooked = HookedOutputs(recorded, known,
                                   flow if flow is not None and not flow.blind else None)
            if hooked.positions:
                call.hooked_outputs = hooked
                extra = tuple(hooked.tensors(recorded))
            del recorded
        call.before = None
        call.held = {}
        call.out_spec = flat.spec
        call.out_tensor_index = flat.tensor_index
        call.out_meta = out_meta = []
        try:
            for t in out_tensors:  # NOTE [loops on the per-call path]
                out_meta.append((t.shape, t.dtype))
        except RuntimeError:  # NOTE [tensors of other layouts] (tree.py)
            refuse_strided_nested(call.fn, flat.spec, flat.tensor_index, out_tensors,
                                  root="output")
            raise
        call.out_leaves = flat.leaves
        for index in flat.tensor_index:
            call.out_leaves[index] = None
        frozen = []
        for t in out_tensors:
            if not (t.is_floating_point() or t.is_complex()):
                frozen.append(t)
        if call.frame.results and len(frozen) < len(out_tensors):
            # NOTE [frozen results returned as outputs]: a float result of
            # reuse_during_recompute returned as it is (router probabilities for statistics)
            # is known to be frozen. Given this node, the recorded tensor itself would carry
            # it, and the replay, which returns that very tensor, would find its own node on
            # it. It leaves non-differentiable and untouched, as in eager.
            in_frame = {id(t) for t in call.frame.tensors()}
            frozen += [t for t in out_tensors if (t.is_floating_point() or t.is_complex())
                       and not t.requires_grad and id(t) in in_frame]
        if frozen or as_is:
            ctx.mark_non_differentiable(*frozen, *as_is)
        # Autograd returns an input as a view of it even so: the caller gets the input itself.
        if as_is:
            call.as_is = [(k, t) for k, t in enumerate(out_tensors)
                          if any(t is x for x in as_is) and any(t is x for x in tensors)]
        if census_active():
            call.reported = True
            report_held(saved, Mechanism.BOUNDARY, holder=call.frame)
            report_held(call.frame.tensors(), Mechanism.REPLAY_FRAME, holder=call.frame)
            if call.changed_state is not None:  # released with the frame (recompute.py)
                report_held(call.changed_state.snapshots(), Mechanism.MODULE_STATE,
                            holder=call.frame)
        # NOTE [inference tensors are kept as they are]: autograd refuses to save a tensor made
        # under torch.inference_mode() (a table built there), which eager accepts as an input
        # of ops that do not save it. It cannot change outside inference mode, so it is kept
        # by reference instead (never offloaded).
        for t in saved:
            if t.is_inference():
                call.inference = {i: t for i, t in enumerate(saved) if t.is_inference()}
                ctx.save_for_backward(*(None if i in call.inference else t
                                        for i, t in enumerate(saved)))
                break
        else:
            ctx.save_for_backward(*saved)
        # NOTE [hooked outputs leave with gradients] (hook_outputs.py): after the outputs of fn,
        # which the caller gets (run_boundary takes only those).
        return out_tensors + extra

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        call: BoundaryCall = ctx.call
        if torch.is_grad_enabled():  # refused (no closure made per call otherwise)
            refuse_double_backward(lambda: f"the boundary around {fn_name(call.fn)}")
        watched = call.param_versions
        if watched is not None:
            assert call.params is not None
            # refuse_parameters_changed, with its usual case (no version moved) spelled out
            before = watched.read(call.params)
            if before[0] != watched.versions:
                before = refuse_parameters_changed(
                    watched, call.params, functools.partial(fn_name, call.fn),
                    call.forward_modules.roots if call.forward_modules is not None else [])
            grads = _BoundaryFunction._replay(ctx, call, grad_outputs)
            if watched.replayed(call.params, before):  # the forward's change, made again
                warn_parameter_changed(call, before[0])
            return grads
        return _BoundaryFunction._replay(ctx, call, grad_outputs)

    @staticmethod
    def _replay(ctx: Any, call: BoundaryCall, grad_outputs: tuple[torch.Tensor | None, ...]
                ) -> Any:
        changes = call.forward_modules.changes() if call.forward_modules is not None else None
        if changes is None:
            grads = replay_backward(ctx, call, grad_outputs)
            if call.made_leaves is not None:  # NOTE [leaves the call makes] (refusals.py)
                check_made_leaves(call)
            return grads
        # The forward's modules (NOTE [the replay sees the forward's modules] in
        # forward_modules.py), around the
        # replay's gradients too: what runs in the replay's backward (an output discard's
        # rebuild) sees them, and the replay's copies (NOTE [the replay changes copies]) are of
        # the very tensors the forward changed (a buffer torch.func.functional_call passed in).
        assert call.forward_modules is not None
        with call.forward_modules.reinstated(changes):
            grads = replay_backward(ctx, call, grad_outputs)
        if call.made_leaves is not None:  # NOTE [leaves the call makes] (refusals.py)
            check_made_leaves(call)
        return grads


# NOTE [the Function is applied in C]: ``torch.autograd.Function.apply`` (Python) binds default
# arguments when a Function defines ``setup_context`` (this one does not), hands the call to
# functorch when a transform is active (run_boundary never gets here then: NOTE [when there is
# no boundary], read the same way), and otherwise passes each tensor argument through
# ``torch._C._functorch.unwrap_if_dead`` (a tensor that escaped a ``torch.func`` transform is
# unwrapped) before calling ``torch._C._FunctionBase.apply``. That Python work, a generator over
# every argument, cost about 20,000 instructions a layer call at the small size of
# examples.bench_instructions: the boundary does the same steps itself, unwrapping each input
# tensor with a C-level map (``call`` and the anchor, the library's own, need none). A torch
# without ``unwrap_if_dead`` gets ``Function.apply`` itself.
_unwrap_if_dead: Any = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_apply_in_c: Any = super(torch.autograd.Function, _BoundaryFunction).apply \
    if _unwrap_if_dead is not None else None


def _apply(call: BoundaryCall, anchor: torch.Tensor | None, inputs: list[torch.Tensor], /
           ) -> Any:
    """``_BoundaryFunction.apply(call, anchor, *inputs)`` (NOTE [the Function is applied in C])."""
    if _apply_in_c is None:
        return _BoundaryFunction.apply(call, anchor, *inputs)
    return _apply_in_c(call, anchor, *map(_unwrap_if_dead, inputs))


def run_boundary(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: BoundaryOptions, /, *, owner: nn.Module | None = None) -> T:
    """The boundary itself; ``checkpoint`` and module wrapping both call this.

    ``owner`` is the module whose parameters ``fn`` uses, when the caller knows it.
    """
    if not torch.is_grad_enabled() or _functorch_transforms_active() \
            or _forward_ad._current_level >= 0:
        # NOTE [when there is no boundary]; under a torch.func transform (grad, vmap, vjp,
        # jacrev) too: the Function has no setup_context, and torch's error would name no fix
        # (read as Function.apply reads it: see _functorch_transforms_active);
        # and inside forward-mode AD's dual_level(): the no-grad original pass drops the
        # tangents of dual tensors it reaches other than as inputs (parameters swapped in by
        # functional_call), silently.
        return fn(*args, **kwargs)
    flat = flatten_call(args, kwargs)
    leaves = flat.leaves
    unique: list[torch.Tensor] = []
    slots: list[int] = []
    seen: dict[int, int] = {}
    for index in flat.tensor_index:
        tensor = leaves[index]
        slot = seen.get(id(tensor))
        if slot is None:
            slot = seen[id(tensor)] = len(unique)
            unique.append(tensor)
            if tensor.requires_grad and (tensor._backward_hooks or
                                         tensor._post_accumulate_grad_hooks):
                skip_no_gradient(tensor)  # NOTE [inputs without a gradient] (parameter_hooks.py)
        slots.append(slot)
        leaves[index] = None
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
        # Not skipping inputs: a parameter also passed as an argument is used both ways, and
        # each use needs its gradient (the argument's comes through its input slot).
        params = collect_parameters(trees, set(), frozen=before)
        frozen = list(before)
        if not ever_verified(owner) and any_lazy(trees):
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
    if len(flat.tensor_index) < len(leaves):
        refuse_unreadable_inputs(fn, flat.spec, leaves,
                                  kwargs_use_cache=kwargs.get("use_cache") is True)
        if owner is None:
            plain = watch_plain_state(fn, leaves, flat.spec)
    elif owner is None and id(getattr(fn, "__code__", None)) not in NOTHING_HELD:
        plain = watch_plain_state(fn, None, flat.spec)
    call = BoundaryCall(fn, options, flat.spec, leaves, flat.tensor_index, slots)
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
        if call.hooked:
            call.held = held_tensors([*(m.__dict__ for m in modules),
                                      *(d for tree in trees for d in tree.submodules)])
    if owner is not None:
        call.switches = call_switches(flat.spec, leaves, hooked=call.hooked,
                                      only_tensors=len(flat.tensor_index) == len(leaves))
    inputs = unique
    if attributes:
        call.attributes = [name for name, _ in attributes]
        inputs = [*unique, *(t for _, t in attributes), *(params or ())]
    elif params:
        inputs = [*unique, *params]
    active = ACTIVE.get()
    try:
        if options.offload is None or (active is not None and active.phase is Phase.RECOMPUTE):
            # NOTE: a boundary nested in another's replay runs in backward, where its inputs are
            # needed again at once: copying them to host and straight back would only cost time.
            out_tensors = _apply(call, anchor, inputs)
        else:
            # NOTE: the window covers only the save of the inputs (the original pass inside runs
            # under no-grad and saves nothing), so exactly the boundary's inputs are offloaded.
            manager = options.offload
            # Named from the spec and index lists only: the window must not hold `call`, whose
            # frame holds this window's handles (a cycle only the garbage collector would free).
            name = functools.partial(input_path, flat.spec, flat.tensor_index, slots)
            # The module's parameters: a detached alias of one passed in stays resident.
            resident = [*params, *frozen] if params is not None else ()
            with manager.window(unique, name=name, resident=resident) as window:
                out_tensors = _apply(call, anchor, inputs)
            if call.frame.results:  # frozen results (top-k ids) go to host with the inputs
                call.frame.offload(functools.partial(manager.offload_into, window),
                                   manager.restore)
    except RuntimeError as error:
        if not isinstance(error, CheckpointError) and "NestedTensorImpl" in str(error):
            # NOTE [tensors of other layouts] (tree.py)
            refuse_strided_nested(fn, flat.spec, flat.tensor_index,
                                  [unique[slot] for slot in slots], root="inputs")
        raise
    if plain is not None:
        call.plain_state = plain.after_forward()  # kept for the replay when it changed state
    if call.as_is:
        out_tensors = list(out_tensors)
        for position, tensor in call.as_is:
            out_tensors[position] = tensor
        call.as_is = None
    return call.outputs(out_tensors)
