"""The autograd Function behind ``CheckpointWithoutOutput`` (discard.py): its forward runs the
op under no-grad and records what the rebuild needs; its backward differentiates the rebuilt
graph (NOTE [discard lifetimes] in discard.py).

NOTE [exactness]: when ``fn`` is a module (or a method of one) its trainable parameters are
inputs of the Function, as in the checkpoint boundary, so they get bit-identical gradients
(other callables accumulate into ``.grad`` from the replay, reentrant-style). A tensor that
``fn`` uses *and* something else uses (the residual stream's input) receives its gradient as a
sum whose association differs from eager (``fn``'s own contributions are summed first), so it
matches eager up to float rounding (a few ulp of the tensor's largest value), as in Megatron;
in a residual stream that rounding then reaches everything upstream. This is the price of the
nested backward through the small recomputed graph, which is what lets the op's own
intermediates go unsaved.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from .census import Mechanism, census_active, report_held
from .changed_in_place import (ParameterVersions, grad_switched, parameter_path,
                               requires_grad_flags)
from .changed_numbers import ChangedNumbers, with_written
from .discard_aliases import made_outside
from .discard_refusals import refuse_grad_switched, refuse_input_changed, refuse_output
from .errors import CheckpointError
from .forward_hooks import ForwardHooks, handles_made
from .inner_backward import InnerBackwardWatch, discard_rebuilt
from .forward_modules import ForwardModules
from .forward_numbers import NumbersWatch, numbers_read
from .generator_sets import forward_watch, learned
from .held_generators import held_generators
from .keep import kept_region, outside_kept_region
from .kernel_written import (compared, mark_compared, parameter_sums, remember,
                             remembered)
from .module_state import foreign_leaves, module_dicts
from .parameter_hooks import ParameterHooksPaused, accumulated_nothing
from .recompute import used_by_this_backward
from .notes import note_no_grad_pass
from .refusals import refuse_double_backward, refuse_module_tensor
from .rng import IsolatedPass, ReplayEnvironment
from .state_changes import StateWatch, versions
from .subclass import kind_of
from .tree import dunder, flatten

if TYPE_CHECKING:  # discard.py imports this module
    from .discard import CheckpointWithoutOutput

__all__ = ["DiscardFunction"]


def _graph_freed(owner_ref: weakref.ref[CheckpointWithoutOutput], _: Any) -> None:
    """The checkpoint's node was freed (NOTE [discard lifetimes] 3 in discard.py): drop what
    it kept."""
    owner = owner_ref()
    if owner is not None:
        owner.recomputed = owner.detached = None
        owner.outputs = ()
        owner.tensor_kinds = []  # attributes may hold tensors (helper MQ)


class DiscardFunction(torch.autograd.Function):
    """``apply(owner, *args, *params)``: ``owner`` (a ``CheckpointWithoutOutput``) carries
    ``fn``, its keyword arguments and, once this ran, what the rebuild and backward need."""

    @staticmethod
    def forward(ctx: Any, owner: CheckpointWithoutOutput, *inputs: Any) -> Any:
        try:
            # NOTE [the library's own ops in a kept method's region] (keep.py)
            return outside_kept_region(DiscardFunction._forward, ctx, owner, inputs)
        except BaseException:
            # A failed call (fn raised, or its output was refused) is not used again
            # (discard.md: a new object per call), but a layer's self.ckpt or a traceback
            # may keep the object: it lets go of the inputs it holds (helper MR's note: they
            # lived on with it, in the kinds read for the rebuild and the tensors fn reaches).
            owner.tensor_kinds = []
            owner.reachable = None
            raise

    @staticmethod
    def _forward(ctx: Any, owner: CheckpointWithoutOutput, inputs: tuple[Any, ...],
                 region: frozenset[str], /) -> Any:
        args = inputs[: owner.n_args]  # the rest are fn's parameters (as in the boundary)
        # NOTE [generators passed in] (rng.py): among the other arguments, as at the boundary;
        # and those fn's modules hold (NOTE [generators held as attributes] in
        # held_generators.py).
        owner.env = ReplayEnvironment.capture(
            tuple(t for t in args if isinstance(t, torch.Tensor)),
            preserve_rng=owner.preserve_rng_state,
            leaves=[*args, *flatten(owner.kwargs).leaves] if owner.kwargs else list(args),
            fn=owner.fn,
            held=held_generators(owner.modules, owner.state[2])
            if owner.preserve_rng_state and owner.modules and owner.state is not None else ())
        assert owner.fn is not None  # set by checkpoint() before the Function runs
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        # NOTE [a subclass's attributes as the forward began] (subclass.py): the rebuild's
        # inputs get their class and attributes back from these, read before fn runs (helper
        # MP: dropped, the scale of a Parameter subclass with a __torch_function__ of its own,
        # or a plain input's `x.meta`, read by fn, was missing; one with torch functions off
        # still is: docs/limits.md; helper MQ: read after fn, one fn set anew reached it).
        owner.tensor_kinds = [kind_of(t, as_now=True) for t in tensors]
        input_versions = versions(tensors)
        needs = requires_grad_flags(tensors)  # NOTE [requires_grad switched inside the call]
        frozen = owner.state[1] if owner.state is not None else ()
        param_before = ParameterVersions.read(owner.params) if owner.params else None
        # NOTE [small state as it was before the forward] (state_changes.py), at each call (a
        # discarded module is never marked verified).
        # NOTE [state a kernel writes] (kernel_written.py): compared at a module's first
        # discarded call (a device sync), then read from what that found.
        roots = owner.modules or []
        watch = StateWatch(*owner.state, snapshot=True, compare=not compared(roots),
                           written=remembered(roots)) if owner.state is not None else None
        # NOTE [a parameter written through .data] (kernel_written.py), at its first calls too
        param_sums = parameter_sums(owner.params) if owner.params and roots and \
            not compared(roots) else None
        # NOTE [numbers and flags as the forward began] (forward_numbers.py), at each call too.
        numbers = NumbersWatch(numbers_read(roots, owner.state[2], every=True), clone=True) \
            if owner.state is not None else None
        # NOTE [each pass caches its own parametrizations] and NOTE [no fast path by grad
        # mode] in rng.py, as at the boundary.
        # NOTE [a forward that sets a default generator's state] (generator_sets.py)
        sets = forward_watch(owner.fn, None) if owner.preserve_rng_state else None
        # NOTE [a gradient inside the forward reaching the graph before the call]
        # (inner_backward.py), as at the boundary: the rebuild runs on the inputs detached
        # too (helper PZ: gradients halved, or a rebuild of another size). At a module's
        # calls until its first rebuild, at each call of a plain function not torch's own
        # (F.silu takes no gradient itself; a node once hooked costs backward time).
        inner = InnerBackwardWatch(tensors) if (not discard_rebuilt(roots) if roots else not (
            dunder(owner.fn, "__module__") or "").startswith("torch")) else None
        # NOTE [hooks the forward registers on its parameters and inputs] (forward_hooks.py)
        handles_before = handles_made()
        try:
            with torch.no_grad(), IsolatedPass(), sets if sets is not None else nullcontext(), \
                    kept_region(region) if region else nullcontext():
                outputs = owner.fn(*args, **owner.kwargs)
        except Exception as error:
            note_no_grad_pass(error, f"the original pass of {owner._name()}")
            raise
        finally:
            if inner is not None:
                inner.stop()
        if inner is not None and inner.reached:  # (names built only to refuse: helper QB)
            places = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            inner.refuse(owner._name(), lambda slot: f"its input args[{places[slot]}]",
                         inputs=len(tensors))
        owner.forward_hooks = ForwardHooks.found_since(handles_before, tensors,
                                                       owner.params or (), roots)
        if sets is not None:
            owner.generator_sets = learned(owner.fn, None, sets)
        if grad_switched(tensors, needs, frozen):
            refuse_grad_switched(owner._name(), args, tensors, needs, frozen, roots)
        version_moved = param_before is not None and \
            versions(owner.params or []) != param_before[0]
        numbers_changed = False
        if numbers is not None:
            owner.changed_numbers = numbers.changed()
            numbers_changed = owner.changed_numbers is not None
            if version_moved:
                # A trainable parameter changed in place: not put back (NOTE [numbers and
                # flags as the forward began] in forward_numbers.py).
                owner.changed_numbers = None
            # NOTE [values read, then changed by a later call] (forward_numbers.py)
            owner.changed_numbers = ChangedNumbers([], read=numbers.read()).joined(
                owner.changed_numbers)
            if owner.changed_numbers is not None and census_active():  # held by the discard
                report_held(owner.changed_numbers.snapshots(), Mechanism.MODULE_STATE,
                            holder=owner)
        moved = [i for i, (now, version) in enumerate(zip(versions(tensors), input_versions))
                 if now != version] if tensors else []
        if moved:
            refuse_input_changed(owner._name(), args, tensors[moved[0]])
        if watch is not None:  # NOTE [state the forward changes] (state_changes.py)
            # With what it only read (a BatchNorm in eval mode), for a later call's forward
            # that changes it before this rebuild: NOTE [state read, then changed by a later
            # call] (state_changes.py). Nothing more to do for a module without buffers.
            owner.changed_state = watch.changed(read=True)
            if owner.changed_state is not None and census_active():  # held by the discard
                report_held(owner.changed_state.snapshots(), Mechanism.MODULE_STATE,
                            holder=owner)
            if watch.compare:
                remember(roots, watch.kernel_written)
                mark_compared(roots)
        # NOTE [a parameter written through .data] (kernel_written.py): a flag changed, as a
        # plain value or a buffer, both put back for the rebuild
        if param_sums is not None and not version_moved and (numbers_changed or (
                owner.changed_state is not None and bool(owner.changed_state.changes))):
            name = functools.partial(parameter_path, roots)
            owner.changed_numbers = with_written(owner.changed_numbers, owner.params or [],
                                                 param_sums, name)
        if param_before is not None:  # NOTE [parameters changed in place] (changed_in_place.py)
            assert owner.params is not None
            owner.param_versions = ParameterVersions(owner.params, param_before)
        if owner.modules:  # NOTE [the replay sees the forward's modules] (forward_modules.py)
            owner.forward_modules = ForwardModules(
                owner.modules, [module_dicts(m) for m in owner.modules])
        owner.modules = None
        single = isinstance(outputs, torch.Tensor)
        outputs_given = outputs
        if not single and not isinstance(outputs, (tuple, list)):
            refuse_output(owner._name(), outputs)  # a dict would give its keys, a dataclass nothing
        outputs = (outputs,) if single else tuple(outputs)
        if not outputs:  # helper RN: refused as having no floating output, with "got" empty
            refuse_output(owner._name(), outputs_given)
        for i, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):  # before reading storages: None has none
                refuse_output(owner._name(), out, f"output[{i}]")
        owner.single = single
        owner.as_list = isinstance(outputs_given, list)
        owner.arg_kinds = [isinstance(t, torch.Tensor) for t in args]
        owner.non_tensor_args = [None if isinstance(t, torch.Tensor) else t for t in args]
        ctx.owner = owner
        # Which outputs live on storages from outside fn, read now: in forward,
        # ctx.saved_tensors would run an ambient unpack hook (an offload restore) and hand
        # back copies.
        owner.made_outside = made_outside(outputs, tensors, owner.fn, args, owner.reachable)
        owner.reachable = None  # found for this call only
        ctx.save_for_backward(*tensors)
        # Weak: the node owns us, not the other way round; its end releases what we kept.
        owner.ctx = weakref.ref(ctx, functools.partial(_graph_freed, weakref.ref(owner)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        owner: CheckpointWithoutOutput = ctx.owner
        refuse_double_backward(lambda: f"the output-discard checkpoint of {owner._name()}",
                               discard=True)
        if owner.recomputed is None:
            owner._replay()  # never discarded (or its hook never fired): replay now
        assert owner.recomputed is not None and owner.detached is not None
        pairs = [(o, g) for o, g in zip(owner.recomputed, grads)
                 if g is not None and o.requires_grad]
        outs, out_grads = [o for o, _ in pairs], [g for _, g in pairs]
        needs = ctx.needs_input_grad[1:]
        owner.recomputed = None  # the recomputed graph is done with
        owner.outputs = ()       # and so are the storages (NOTE [discard lifetimes], discard.py)
        if owner.params is None:  # an unknown callable: accumulate, as a reentrant checkpoint
            if not torch.autograd._is_checkpoint_valid():
                raise CheckpointError(
                    f"the discarded output of {owner._name()} was reached by a restricted "
                    "backward: torch.autograd.grad(), backward(inputs=...), or the replay of a "
                    "checkpointed layer around it (which takes its gradients with "
                    "torch.autograd.grad)",
                    expected="a module (or a method of one) as fn, or a function that reaches "
                             "no trainable tensor",
                    got="an arbitrary callable that reaches trainable parameters",
                    tip="pass the module or its method so its parameters are known (checkpoint("
                        "self.norm, x), not checkpoint(lambda t: self.norm(t) * 2, x))")
            if outs:
                torch.autograd.backward(outs, out_grads)
            detached = iter(owner.detached)
            grads_in = [next(detached).grad if kind else None for kind in owner.arg_kinds]
            owner.detached = None
            return (None, *grads_in)
        # Known parameters are inputs: return their grads so autograd sums them as eager does.
        detached = iter(owner.detached)
        wrt: list[torch.Tensor | None] = [next(detached) if kind else None
                                          for kind in owner.arg_kinds]
        wrt += owner.params
        # NOTE [parameters frozen or unfrozen since the forward]: a parameter frozen since the
        # forward (requires_grad_(False) before backward) gets no gradient, as in eager, where
        # its AccumulateGrad then does nothing (asking torch.autograd.grad for it raised
        # torch's "does not require grad"); one frozen in the forward and unfrozen since was
        # not in the forward's graph: it gets none either, and is a known tensor of the op's
        # modules, not a foreign one. The boundary's replay in recompute.py follows it too.
        wanted = [i for i, (need, t) in enumerate(zip(needs, wrt))
                  if need and t is not None and t.requires_grad]
        # A restricted backward (a zero-bubble pipeline's input pass: torch.autograd.grad to
        # the stage's input alone) takes only some: the others are not computed, as in eager,
        # and as at the boundary (NOTE [a leaf torch.autograd.grad captures] in recompute.py).
        # The node's edges are its tensor inputs alone: wrt's Nones (fn's other arguments)
        # have none.
        edges = iter(ctx.next_functions)
        wanted = used_by_this_backward(
            tuple(next(edges) if t is not None else (None, 0) for t in wrt), wanted)
        # As at the boundary (verify_leaves in refusals.py): the inputs, and the parameters
        # frozen at the call (unfrozen since, they get no gradient, as in eager).
        frozen = owner.state[1] if owner.state is not None else ()
        known = [*(t for t in wrt if t is not None), *frozen]
        foreign = next(iter(foreign_leaves(outs, known)), None) if outs else None
        if foreign is not None:  # it would get no gradient: refused, as at the boundary
            if owner.forward_modules is not None:  # its roots: fn's modules, then others
                refuse_module_tensor(foreign, owner.forward_modules.roots)
            raise CheckpointError(
                f"the discarded op {owner._name()} uses a tensor that requires grad but is "
                "neither an input nor a parameter of its module; it would get no gradient",
                expected="inputs, and parameters of the op's module or of modules passed as "
                         "arguments",
                got=f"Tensor(shape={tuple(foreign.shape)}, dtype={foreign.dtype})",
                tip="pass the tensor (or the module owning it) as an argument of checkpoint()")
        result: list[torch.Tensor | None] = [None] * len(wrt)
        if outs and wanted:
            inputs = [t for t in (wrt[i] for i in wanted) if t is not None]  # all of them
            # NOTE [parameter hooks run once] (parameter_hooks.py)
            with ParameterHooksPaused(owner.params, outs) as replayed:
                got = torch.autograd.grad(replayed, inputs, out_grads, allow_unused=True)
            for i, grad in zip(wanted, got):
                result[i] = grad
        if owner.params:
            n = len(wrt) - len(owner.params)
            accumulated_nothing(owner.params, result[n:], needs[n:])
        owner.detached = None
        return (None, *result)
