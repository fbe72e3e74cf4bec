"""The replay in backward: one boundary call's forward again, with grad, and the gradients of
its inputs and parameters (``_BoundaryFunction.backward`` in boundary_function.py calls
``replay_backward``). The NOTE blocks it follows are in boundary.py's docstring (what is saved,
parameters are inputs, attributes set before the call, unknown callables); others are cited
with their files.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .addresses import data_pointer
from .engine import input_grads
from .errors import CheckpointError, ReuseError, SavedTensorChanged
from .forward_hooks import handles_made
from .generator_sets import replay_watch
from .grad_reach import grad_reach
from .hook_outputs import recording
from .hook_tables import HookTables
from .keep import KeepMode
from .kept_replay import KeptReplay
from .kept_calls import kept_count_changed
from .kept_weights import WeightCapture
from .made_before import refuse_changed_kept, refuse_changed_views
from .module_state import is_verified
from .notes import add_note, converted_since
from .parameter_hooks import ParameterHooksPaused, accumulated_nothing, skip_no_gradient
from .phase import ACTIVE, Invocation, Phase
from .changed_in_place import raise_changed_after_call
from .compiled_layers import recompile_limit_note, recompile_limit_noted
from .refusals import (TORCH_REENTRANT, fn_name, held_before_replay,
                       raise_attached_to_outside_tensor, raise_freed_graph_reached,
                       raise_hooked_outside_tensor, raise_torch_reentrant_inside, verify_leaves)
from .rebound import refuse_rebound
from .rng import IsolatedPass, Replaying
from .saved import Unchanged
from .state_changes import mark_stateful, refuse_graph_read, versions
from .stored_state import (stored_numbers, stored_tensors, warn_changed_numbers,
                           warn_stacked_checkpointing, warn_stored_scalars)
from .subclass import alias_as_kind, as_kind, detached as alias_of
from .tree import FlatTree, alias_all, flatten, leaf_paths
from .tree_refusals import open_containers, refuse_filled_containers

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["replay_backward", "used_by_this_backward"]

_NOTHING = nullcontext()  # reusable: entered on every replay without numbers to put back

# torch.autograd._is_checkpoint_valid() without its Python frame: the engine's own method.
_checkpoint_valid: Any = torch.autograd.Variable._execution_engine.is_checkpoint_valid
# Read at every replay: kept, not looked up through torch._C._autograd each time.
_top_saved_hooks: Any = torch._C._autograd._top_saved_tensors_default_hooks
_keep_graph: Any = torch._C._autograd._get_current_graph_task_keep_graph
_RECOMPUTE = Phase.RECOMPUTE  # an enum member's lookup costs about five plain ones


# NOTE [containers a plain function fills]: a plain function has no module to remember a
# first replay by, so the lists and dicts given to it are read at each replay (where none is
# given, the usual case, that is one isinstance check per argument): `checkpoint(fn, x, aux)`
# with `aux.append(loss)` inside lost the loss's gradient silently where the same body as a
# module was refused (helper JT). Its parameters are not known (a closure's module's), so any
# leaf counts as the caller's there: only a tensor the replay computed with a graph is refused.
# The other first-replay checks read a module's state.
class _FirstReplay:
    """What a module's first replay with a switch (NOTE [verified per switch] in
    module_state.py) reads around ``fn``: the containers passed in (NOTE [containers filled by
    the forward] in tree_refusals.py), the scalars
    and numbers on its modules (NOTE [results stored on a module], NOTE [numbers a forward
    changes] in stored_state.py). The replay runs with grad, so what it adds tells a loss from a
    value that never had a gradient, which the no-grad original pass cannot."""

    __slots__ = ("containers", "known", "modules", "dicts", "tensors", "numbers")

    def __init__(self, containers: Any, known: set[int], modules: list[nn.Module],
                 dicts: list[dict[str, Any]], numbers_saved: bool) -> None:
        self.containers = containers
        # The replay's inputs and parameters (the caller has them); a plain function's inputs,
        # and every leaf (refuse_filled_containers's leaves_known: no modules).
        self.known = known
        self.modules = modules
        self.dicts = dicts
        self.tensors = stored_tensors(dicts)
        # Where numbers were saved before the forward, a number the replay changes is its own
        # change (put back after it): nothing to read for the warning.
        self.numbers = None if numbers_saved else stored_numbers(dicts)

    @classmethod
    def of(cls, call: BoundaryCall, args: tuple[Any, ...], kwargs: dict[str, Any],
           aliases: tuple[torch.Tensor, ...]) -> _FirstReplay | None:
        if call.owner is None or call.forward_modules is None:
            # NOTE [containers a plain function fills]
            containers = open_containers(args, kwargs)
            return None if containers is None else \
                cls(containers, {id(t) for t in aliases}, [], [], True)
        if is_verified(call.owner, call.switches):
            return None
        known = {id(t) for t in (*aliases, *(call.params or ()))}
        modules = list(call.forward_modules.roots)
        return cls(open_containers(args, kwargs), known, modules,
                   [*(m.__dict__ for m in modules), *call.forward_modules.submodules],
                   call.numbers_saved)

    def check(self, call: BoundaryCall) -> None:
        if self.containers is not None:
            refuse_filled_containers(call, self.containers, self.known,
                                     leaves_known=not self.modules)
        if not self.modules:  # a plain function's
            return
        owner = self.modules[0]
        warn_stacked_checkpointing(owner, call.fn)
        warn_stored_scalars(owner, self.modules, self.dicts, self.tensors)
        if self.numbers is not None:
            warn_changed_numbers(owner, self.modules, self.dicts, self.numbers)


def used_by_this_backward(edges: tuple[tuple[Any, int], ...], wanted: list[int]
                          ) -> list[int]:
    """Those of ``wanted`` whose gradient this backward will use: all of them in a full one; in
    a restricted one (``torch.autograd.grad(loss, [bias])``, ``backward(inputs=...)``, where
    torch's checkpoint-valid flag is off) those it reaches: eager computes only those, and the
    replay's backward then runs no hook (a child's full backward hook, a tensor hook inside)
    and computes no gradient that eager's does not. ``edges`` are the node's: its tensor inputs
    only (not ``call``; a module's boundary takes no anchor). The output discard's backward
    asks it too (discard_function.py).

    NOTE [a leaf torch.autograd.grad captures]: asked about a leaf's node, torch answers False
    when the backward does not reach it and raises ("A leaf node was passed ... running
    autograd.grad()") only when ``torch.autograd.grad`` captures its gradient (measured on torch
    2.13: the check is on the leaf's capture), so a raise means used, and every leaf is asked.
    Taking every leaf after the first raise as used made a zero-bubble pipeline's input pass
    (``torch.autograd.grad(outputs, [stage input])``, a leaf, then a weight pass from the
    graph's nodes to the parameters: torch.distributed.pipelining's stage_backward_input) replay
    every parameter's gradient too, for autograd to drop."""
    if not wanted or _checkpoint_valid():
        return wanted
    will_run = torch._C._will_engine_execute_node
    used = []
    for i in wanted:
        try:
            runs = will_run(edges[i][0])
        except RuntimeError:  # NOTE [a leaf torch.autograd.grad captures]
            runs = True
        if runs:
            used.append(i)
    return used


def _inputs_without_gradient(saved: Sequence[torch.Tensor], grads: Sequence[Any],
                             needs: Sequence[bool]) -> None:
    """NOTE [inputs without a gradient] (parameter_hooks.py), for hooks registered on an input
    after the call, before backward: wrapped now, before autograd calls them with the ``None``
    this replay returns. (Under offload ``saved`` holds restored copies, without the caller's
    hooks: those registered after the call are not reached.)"""
    for tensor, grad, need in zip(saved, grads, needs):
        if grad is None and need and (tensor._backward_hooks or
                                      tensor._post_accumulate_grad_hooks):
            skip_no_gradient(tensor)


def _own_memory(saved: Sequence[torch.Tensor], grads: list[Any], /) -> None:
    """NOTE [a gradient on an input's memory]: a backward may hand back a tensor it saved as
    the gradient (``return x`` where the gradient coming in is 1, as fused losses return a
    saved one). Eager's saved tensor is the caller's leaf, which the graph holds, so
    AccumulateGrad copies it; the replay's is an alias of that leaf (or, under offload, a view
    of its reused bytes) that nothing else holds, and AccumulateGrad stole it: ``.grad``
    shared the input's memory, and the next micro-batch's ``+=`` changed the input (helper
    JL). Such a gradient is copied (a storage comparison per input otherwise)."""
    memories = {_memory(t) for t in saved if isinstance(t, torch.Tensor)}
    memories.discard(0)  # empty storages, and tensors without one
    for i, grad in enumerate(grads[:len(saved)]):  # the inputs' (a parameter's is its own)
        if grad is not None and _memory(grad) in memories:
            grads[i] = grad.clone()


def _memory(tensor: torch.Tensor, /) -> int:
    """Where ``tensor``'s storage begins; 0 for one without a plain storage (sparse, nested,
    a wrapper subclass's)."""
    try:
        return data_pointer(tensor)  # NOTE [a fake tensor's address]
    except (RuntimeError, NotImplementedError):
        return 0


def _refuse_leaves_reached(call: BoundaryCall, outs: Sequence[torch.Tensor],
                           inputs: Sequence[torch.Tensor], /) -> None:
    """Refuse a replay whose graph reaches a leaf that requires grad other than the call's
    inputs (a parameter fn found past the reach search): the explicit path would give it no
    gradient, silently (NOTE [a plain function under a restricted backward], below)."""
    own = {id(t) for t in inputs}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if variable is not None and id(variable) not in own:
            call.params = None  # unknown again: a later plain backward takes the implicit path
            raise CheckpointError(
                f"the boundary around {fn_name(call.fn)} was reached by a restricted backward "
                "(torch.autograd.grad(), backward(inputs=...), or an enclosing boundary's "
                "replay), and its replay reaches a tensor that requires grad other than its "
                "arguments, whose gradient that backward cannot take",
                expected="a function of its tensor arguments alone, or a module as fn",
                got=f"a leaf of shape {tuple(variable.shape)} reached from {fn_name(call.fn)}",
                tip="pass that tensor as an argument, or wrap the module that holds it "
                    "(pytree_ckpt.checkpoint(module, ...) or apply_activation_checkpointing)")
        stack += [next_node for next_node, _ in node.next_functions if next_node is not None]


def replay_backward(ctx: Any, call: BoundaryCall,
                    grad_outputs: tuple[torch.Tensor | None, ...], /, *,
                    backward_begins: Callable[[], None] = lambda: None) -> Any:
    """The replay of ``call`` and the gradients of its inputs (and parameters);
    ``backward_begins`` is called before the replay's own backward runs (NOTE [the replay's
    backward sees the modules as they are] in forward_modules.py)."""
    explicit = call.params is not None
    pure = False
    restricted = not explicit and not _checkpoint_valid()
    if restricted and grad_reach(
            call.fn, FlatTree(call.in_leaves, call.in_spec, call.in_tensor_index)) is None:
        # NOTE [a plain function under a restricted backward]: the implicit path (backward
        # inside the replay, into whatever fn reaches) cannot serve a restricted backward
        # (torch.autograd.grad, an enclosing boundary's replay). A function that reaches
        # nothing trainable (every tensor an argument: an attention core, F.gelu) has its
        # inputs' gradients alone, so the explicit path serves; the replay's graph is walked
        # to make sure (the reach is searched only so far), and refused below otherwise.
        call.params = []
        explicit = pure = True
    if restricted and not pure:
        raise CheckpointError(
            f"the boundary around {fn_name(call.fn)} was reached by a restricted backward: "
            "torch.autograd.grad(), backward(inputs=...), or the replay of a checkpoint "
            "boundary or output discard around it (which takes its gradients with "
            "torch.autograd.grad)",
            expected="a module (or a method of one) as fn, a function whose tensors are all "
                     "its arguments, or loss.backward() with no module-aware replay around it",
            got="a callable that reaches a trainable module or tensor, under a restricted "
                "backward",
            tip="pass the tensors fn reaches as arguments (checkpoint(fn, x, weight)), wrap the "
                "module that holds them (pytree_ckpt.checkpoint(module, ...) or "
                "apply_activation_checkpointing), or call loss.backward() and read .grad")
    needs = ctx.needs_input_grad[2:]
    if call.kept is not None:  # NOTE [a replay kept between restricted backwards]
        backward_begins()  # no forward runs: a backward of the kept graph alone
        return _from_kept(ctx, call, call.kept, grad_outputs)
    if call.bound is not None:  # NOTE [a module rebound before the replay] in rebound.py
        refuse_rebound(call.fn, call.bound)
    n = call.n_inputs + len(call.attributes)
    saved = _saved_unchanged(ctx, call)
    # NOTE [inference tensors are kept as they are] (boundary_function.py)
    if call.inference is not None:
        saved = tuple(call.inference.get(i, t) for i, t in enumerate(saved))
    call.frame.start_replay()
    assert call.env is not None
    invocation = Invocation(_RECOMPUTE, call.frame, ACTIVE.get())
    args: tuple[Any, ...] = ()  # the error note reads it: an error before fn's are made too
    # NOTE [hooks the forward registers on its parameters and inputs] (forward_hooks.py): what
    # the replay's forward registered and removed is settled even where it raises (helper QI:
    # a step skipped after a caught error left a hook more, and its pins, each time).
    hooks_pending: tuple[int, Any, list[Any]] | None = None
    try:
        ACTIVE.set(invocation)  # inside the try, as the original pass's (boundary_function.py)
        with Replaying(call.env), IsolatedPass(cached=call.env.parametrize_cached):
            # Detached here, under the forward's torch-function state: a __torch_function__
            # subclass input stays one (NOTE [the replay sees tensor subclasses as the forward
            # did] in rng.py).
            if call.subclasses is None:
                detached = []
                for t, need in zip(saved, needs[:n]):  # NOTE [loops on the per-call path]
                    detached.append(t.detach().requires_grad_(need))
            else:
                detached = [as_kind(alias_of(t), kind, attributes=False).requires_grad_(need)
                            for t, kind, need in zip(saved, call.subclasses, needs[:n])]
            # fn sees non-leaf aliases (made with grad enabled), whatever its inputs were in
            # eager. Three things need them (a review of a change that handed fn the leaves
            # found each; tests/pytree_ckpt/test_boundary.py keeps them): a multi-grad hook on
            # the input, which torch refuses on a leaf under the replay's gradient call (module
            # trackers such as FlopCounterMode's, FSDP, torch.utils.debug_log, fn itself);
            # autocast, which caches one cast of a leaf but casts a non-leaf anew at each use,
            # as eager does for a layer input; and memory, as a cached cast keeps its leaf
            # alive until the caller's autocast region ends (backward inside it kept every
            # layer's input).
            aliases = alias_all(detached)  # NOTE [tensors of other layouts]: sparse: clones
            for t, a in zip(saved, aliases):  # NOTE [dynamo's marks reach the replay]
                if t.__dict__:
                    _copy_dynamo_marks(t.__dict__, a)
            if call.marks is not None:
                for position, marks in call.marks.items():
                    _copy_dynamo_marks(marks, aliases[position])
            if call.subclasses is not None:
                aliases = tuple(alias_as_kind(a, d, kind)  # NOTE [a subclass whose view is plain]
                                for a, d, kind in zip(aliases, detached, call.subclasses))
            args, kwargs = call.inputs(aliases)
            if call.kept_aliases is not None:  # NOTE [outputs on a kept storage]
                refuse_changed_kept(call.fn, call.kept_aliases, lambda position: leaf_paths(
                    call.out_spec, root="output")[call.out_tensor_index[position]])
            if call.unviewed is not None:  # NOTE [outputs that view fn's own results]
                refuse_changed_views(
                    call.fn, call.unviewed,
                    call.forward_modules.roots if call.forward_modules is not None else (),
                    lambda position: leaf_paths(call.out_spec, root="output")[
                        call.out_tensor_index[position]])
            first = _FirstReplay.of(call, args, kwargs, aliases)  # None but at a first replay
            if first is not None and first.modules and \
                    (call.hooked or len(call.in_tensor_index) < len(call.in_leaves)):
                call.held_before_replay = held_before_replay(call)  # for a refusal's search
            shadow = _top_saved_hooks(False) is not None
            recorded = None
            # NOTE [state a plain function changes] in plain_state.py
            plain = call.plain_state.before_replay() if call.plain_state is not None else None
            # NOTE [numbers and flags as the forward began] (forward_numbers.py): around the
            # first replay's checks too, which read what the replay stored (an aux loss) before
            # the forward's objects are put back.
            numbers = _NOTHING if call.changed_numbers is None else \
                call.changed_numbers.as_forward_began(
                    fn_name(call.fn), [call.owner] if call.owner is not None else ())
            # NOTE [a forward that sets a default generator's state] (generator_sets.py)
            sets = replay_watch(call.generator_sets)
            # NOTE [the replay runs the forward's hooks] (hook_tables.py)
            hooks = None if call.hook_dicts is None else \
                HookTables.replay(call.hook_tables, call.hook_dicts, call.hook_epoch)
            # NOTE [hooks the forward registers on its parameters and inputs]
            handles_before = handles_made() if call.forward_hooks is not None else 0
            if call.forward_hooks is not None:
                hooks_pending = (handles_before, aliases, call.forward_hooks.before_replay())
            with numbers:
                if not (shadow or call.attributes or call.options.keep is not None or
                        call.hooked_outputs is not None or call.changed_state is not None
                        or sets is not None or hooks is not None):
                    output = call.fn(*args, **kwargs)  # the usual case, with no context more
                else:
                    with ExitStack() as stack:
                        if sets is not None:
                            stack.enter_context(sets)
                        if hooks is not None:
                            stack.enter_context(hooks)
                        if call.changed_state is not None:
                            # NOTE [the replay changes copies] in state_changes.py
                            stack.enter_context(call.changed_state.on_copies())
                        if shadow:
                            # Shadow an ambient hook (offload, census): the replay's
                            # short-lived graph is not theirs to see. Only then: the hooks
                            # cost ~1 us per saved tensor. NOTE [hooks switch off the in-place
                            # check] in saved.py: Unchanged checks.
                            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                                Unchanged, Unchanged.get))
                        if call.attributes:
                            assert call.owner is not None
                            stack.enter_context(_attributes_set(call.owner, call.attributes,
                                                                aliases[call.n_inputs:]))
                        if call.options.keep is not None:
                            stack.enter_context(KeepMode(
                                call.options.keep, invocation, layer=call.fn,
                                verify=call.options.verify_replay,
                                preserve_rng=call.options.preserve_rng_state))
                        if call.hooked_outputs is not None:
                            recorded = stack.enter_context(recording())
                        output = call.fn(*args, **kwargs)
                if hooks_pending is not None:
                    assert call.forward_hooks is not None
                    call.forward_hooks.drop_repeated(*hooks_pending)
                    hooks_pending = None
                if first is not None:
                    first.check(call)
            if call.changed_numbers is not None and call.changed_numbers.gave_back and \
                    call.owner is not None:  # NOTE [values read, then changed by a later call]
                mark_stateful(call.owner)
    except CheckpointError:
        raise
    except Exception as error:
        # An error only the replay meets has two usual causes: an argument the original pass
        # changed (a key/value cache object it appended to; containers are rebuilt, but the
        # objects in them are passed as they are), or code that behaves otherwise with grad
        # enabled (the replay's mode; a fullgraph compile that cannot trace it). The error
        # keeps its type (an out-of-memory error stays one); the note says where it came from
        # and names the first cause only as a possibility (an out-of-memory error gets its
        # own ways out instead).
        limit = recompile_limit_note(error, f"the replay of {fn_name(call.fn)} in backward")
        if limit is not None:  # NOTE [two entries per variant] in compiled_layers.py
            add_note(error, limit)
        elif isinstance(error, torch.OutOfMemoryError):
            # The replay's own peak, not a changed argument: the cache hint would mislead.
            add_note(error,
                f"pytree_ckpt: raised by the replay of {fn_name(call.fn)} in backward, which "
                "rebuilds that call's activations, with grad enabled, on top of what backward "
                "already holds. Tip: lower the replay's own peak by discarding outputs the next "
                "op can rebuild (docs/discard.md), what backward holds across layers with "
                "offload=True (docs/offload.md), or pass fewer tokens per micro-batch.")
        elif (batched := _batched_backward(grad_outputs)) is not None:
            # The replay runs inside the vmap of a batched backward: the cache hint would
            # mislead (NOTE [a replay under vmap]).
            add_note(error, _under_vmap_note(fn_name(call.fn), batched))
        elif (converted := converted_since(call.fn, args)) is not None:
            add_note(error,
                f"pytree_ckpt: raised by the replay of {fn_name(call.fn)} in backward, which "
                f"runs the forward again with the module as it is now: {converted}. If the "
                "model was converted (model.double(), model.to(...)) between this call's "
                "forward and its backward, the replay computes with other parameters than the "
                "forward did. Tip: convert between steps, after backward (docs/limits.md, "
                "'State the forward changes').")
        elif not recompile_limit_noted(error):  # an inner boundary's replay named it
            add_note(error,
                f"pytree_ckpt: raised by the replay of {fn_name(call.fn)} in backward, which "
                "runs the forward again on the same arguments, with grad enabled. If the "
                "error does not come from grad mode, check for an object the forward changed "
                "(a key/value cache it filled): the replay sees it as the forward left it. "
                "Tip: pass use_cache=False in training, or keep such state outside the "
                "checkpointed call.")
        raise
    finally:
        try:
            if hooks_pending is not None and call.forward_hooks is not None:
                call.forward_hooks.drop_repeated(*hooks_pending)
        finally:
            ACTIVE.set(invocation.parent)
    if plain is not None:  # outside the try: a warning made an error gets no replay note
        assert call.plain_state is not None
        call.plain_state.after_replay(plain)
    call.plain_state = None
    try:
        call.frame.check_consumed()
    except ReuseError as error:
        _refuse_removed_between(call, error)
        if call.options.keep is not None and "by a save unit" in str(error):
            raise kept_count_changed(error, call.fn, call.options.keep) from None
        raise
    flat = flatten(output)
    call.check_replay(flat.spec, flat.leaves, flat.tensor_index)
    outs, grads = [], []
    placed: list[tuple[int, torch.Tensor]] = []  # for a kept graph: by place in grad_outputs
    for place, (index, grad) in enumerate(zip(flat.tensor_index, grad_outputs)):
        out = flat.leaves[index]
        if out.grad_fn is ctx:
            raise_attached_to_outside_tensor(call, flat.spec, index)
        if out.requires_grad:
            placed.append((place, out))
            if grad is not None:
                outs.append(out)
                grads.append(grad)
    extra: list[torch.Tensor] = []
    if call.hooked_outputs is not None:
        assert recorded is not None
        extra = call.hooked_outputs.replayed(recorded, fn_name(call.fn), call.owner)
        extra_grads = grad_outputs[len(flat.tensor_index):]
        for position, (out, grad) in enumerate(zip(extra, extra_grads)):
            if out.grad_fn is ctx:
                raise_hooked_outside_tensor(call, position)
            if out.requires_grad:
                placed.append((len(flat.tensor_index) + position, out))
                if grad is not None:
                    outs.append(out)
                    grads.append(grad)
    if call.prints is not None:  # verify_replay=True: NOTE [output prints] (replay_values.py)
        hooked, owner = call.hooked_outputs, call.owner
        call.prints.check([*(flat.leaves[i] for i in flat.tensor_index), *extra], lambda: [
            *(leaf_paths(flat.spec, root="output")[i] for i in flat.tensor_index),
            *(hooked.names(owner) if hooked is not None else ())],
            fn=call.fn, preserve_rng=call.options.preserve_rng_state)
    # NOTE [a graph tensor a forward replaced] (state_changes.py)
    if call.changed_state is not None and call.changed_state.graph_read:
        refuse_graph_read(call.changed_state.graph_read, outs)
    # NOTE [frame lifetime] (frames.py), here: without retain_graph this node never runs
    # again (autograd frees its saved tensors right after it), so its frame is cleared as
    # soon as its own backward
    # is done, not when the whole backward call is (a callback at the end of the graph task,
    # as before): with offload, the frozen results (top-k ids) come back to the device for
    # the replay, and frames held to the end of backward kept every already-replayed layer's
    # restored ids there, O(layers) device memory at the tail of backward. keep_graph is read
    # here, in the outer task (the inner backward below is a task of its own); the frame is
    # cleared after that inner backward, in which a nested boundary's replay may still read
    # it. (The census reads frame.released as "this invocation no longer holds its inputs".)
    keep_graph = _keep_graph()
    release = bool(call.frame.results or call.reported) and not keep_graph
    if not keep_graph:
        # Its buffers' snapshots (NOTE [small state as it was before the forward] in
        # state_changes.py) served this replay only: freed now, not with the graph's nodes (a
        # loss kept for logging keeps those), as the census reads them (module state, held
        # by the frame). So are the values put back for it (NOTE [small tensor attributes as
        # the forward read them] in plain_values.py: a tensor it held).
        call.changed_state = None
        call.changed_numbers = None
        call.prints = None  # verify_replay's, compared above (helper HA: held with the graph)
    if not explicit:
        backward_begins()
        if outs:
            try:
                torch.autograd.backward(outs, grads)
            except RuntimeError as error:
                if not isinstance(error, CheckpointError):
                    raise_freed_graph_reached(call, error)
                raise
        if release:
            call.frame.clear()
        from_inputs = [d.grad if need else None for d, need in zip(detached, needs)]
        _own_memory(saved, from_inputs)
        _inputs_without_gradient(saved, from_inputs, needs)
        if keep_graph:  # NOTE [a backward that wrote into an input] (changed_in_place.py)
            call.replayed_versions = versions(saved)
        return (None, None, *from_inputs)
    assert call.params is not None
    if pure:
        _refuse_leaves_reached(call, outs, detached)
    wrt = [*detached, *call.params]
    # NOTE [parameters frozen or unfrozen since the forward] (discard_function.py): a
    # parameter frozen since the forward (requires_grad_(False) before backward) gets no
    # gradient, as in eager, where its AccumulateGrad then does nothing.
    needed = [i for i, need in enumerate(needs) if need and wrt[i].requires_grad]
    wanted = used_by_this_backward(ctx.next_functions, needed)
    # NOTE [a replay kept between restricted backwards] (kept_replay.py): a restricted backward
    # that keeps the graph keeps this replay's too, for the node's next run; not a replay that
    # made an output discard (one-shot).
    keep = keep_graph and bool(outs) and 0 < len(wanted) < len(needed) and \
        not invocation.discarded
    if outs and call.owner is not None and \
            not is_verified(call.owner, call.switches):
        # NOTE [leaves the call makes] (refusals.py): left to check, this replay keeps no graph
        keep = not verify_leaves(call, outs, wrt) and keep
    n = len(detached)
    result: list[torch.Tensor | None] = [None] * len(wrt)
    if outs and wanted:
        # NOTE [a weight pass from captured gradients] (kept_weights.py): the gradients the
        # intermediates get now, for a weight pass handed these grad_outputs again.
        capture = WeightCapture.of(outs, wrt, ctx.next_functions, wanted, [
            i for i in needed if i >= n and i not in wanted]) if keep else None
        backward_begins()
        with ParameterHooksPaused(call.params, outs) as replayed:
            try:
                # NOTE [the replay calls the engine directly] (engine.py): outs passed
                # check_replay, and grads are autograd's own for them.
                got = input_grads(replayed, grads, wrt if len(wanted) == len(wrt) else
                                  [wrt[i] for i in wanted],  # all wanted: the usual case
                                  keep)
            except RuntimeError as error:
                if isinstance(error, CheckpointError):
                    raise
                raise_freed_graph_reached(call, error)
                if TORCH_REENTRANT not in str(error):
                    raise
                raise_torch_reentrant_inside(call, error)
            finally:
                if capture is not None:
                    capture = capture.done(grad_outputs)  # its prehooks removed
        for i, grad in zip(wanted, got):
            result[i] = grad
        if keep:
            call.kept = KeptReplay(placed, wrt, set(wanted), capture)
    elif call.params:
        # Every parameter gets None (no output had a gradient): NOTE [unused parameters get
        # no hook call] (parameter_hooks.py) holds here too.
        ParameterHooksPaused(call.params)  # wraps them
    accumulated_nothing(call.params, result[n:], needs[n:])
    if outs and wanted:
        _own_memory(saved[:n], result)  # NOTE [a gradient on an input's memory]
    _inputs_without_gradient(saved, result[:n], needs)
    if release:
        call.frame.clear()
    if keep_graph:  # NOTE [a backward that wrote into an input] (changed_in_place.py)
        call.replayed_versions = versions(saved)
    return (None, None, *result)


# NOTE [dynamo's marks reach the replay]: torch._dynamo.maybe_mark_dynamic(t, dim) (and
# mark_dynamic) set attributes on the tensor object, which the replay's detached aliases do
# not carry: a compiled body's replay entry compiled for its first length and again at the
# next (three graphs where two serve: helper ER); so does the mark AOTAutograd stamps on a
# dynamic compiled producer's outputs (_dynamo_propagated_dynamic_indices: helper EQ). Every
# attribute of dynamo's (its names start with "_dynamo", as in torch's own
# copy_dynamo_tensor_attributes, plus mark_dynamic's "_has_dynamo_dim_marking" and
# "_specialize_on") is copied onto the aliases fn is handed; an empty attribute dict costs a
# lookup per input. An input a window offloaded comes back as a new tensor, without them
# (its replay entry turned dynamic only at the second length): the boundary takes its marks
# when the window closes (dynamo_marks, into BoundaryCall.marks), and they are copied from
# there.
_DYNAMO_NAMES = ("_dynamo", "_has_dynamo", "_specialize_on")


def dynamo_marks(tensors: Sequence[torch.Tensor], /) -> dict[int, dict[str, Any]] | None:
    """Dynamo's attributes of ``tensors``, by position, or ``None`` where none has any."""
    marks = {}
    for position, t in enumerate(tensors):
        if t.__dict__:
            own = {name: value for name, value in t.__dict__.items()
                   if name.startswith(_DYNAMO_NAMES)}
            if own:
                marks[position] = own
    return marks or None


def _copy_dynamo_marks(source: dict[str, Any], target: torch.Tensor, /) -> None:
    for name, value in source.items():
        if name.startswith(_DYNAMO_NAMES):
            setattr(target, name, copy.copy(value))


def _batched_backward(grad_outputs: Sequence[torch.Tensor | None], /) -> str | None:
    """What batches the backward this replay runs in: ``"is_grads_batched"`` (its legacy vmap
    hands the node batched gradients), ``"torch.func"`` (a transform of torch.func around the
    backward: ``torch.func.vmap`` over ``torch.autograd.grad``), or ``None``.

    NOTE [a replay under vmap]: ``torch.autograd.grad(..., is_grads_batched=True)`` runs the
    backward under vmap, and the replay, which runs in backward, with it: eager's forward ran
    once, outside, and saved what its backward reads. Under that (legacy) vmap the forward's
    ops run batched, and random ops (dropout in training, ``torch.rand``) cannot run at all;
    the rest gives eager's gradients (tests/pytree_ckpt/test_boundary_messages.py). Under a
    ``torch.func`` transform around a backward, the replay cannot make the leaves that
    require grad it differentiates (``requires_grad_`` is refused inside a transform), whatever
    the layer does; torch's non-reentrant checkpoint, which saves no leaves, runs there. Either
    error keeps its type and gets a note that says so (not the key/value cache hint).
    """
    if torch._C._functorch.maybe_current_level() is not None:
        return "torch.func"
    if any(g is not None and torch._C._functorch.is_legacy_batchedtensor(g)
           for g in grad_outputs):
        return "is_grads_batched"
    return None


def _under_vmap_note(name: str, batched: str, /) -> str:
    """The note for an error the replay met inside a batched backward (NOTE [a replay under
    vmap])."""
    if batched == "is_grads_batched":
        return (
            f"pytree_ckpt: raised by the replay of {name} in backward, which runs the forward "
            "again inside this backward: a batched one (torch.autograd.grad(..., "
            "is_grads_batched=True)), which runs under torch's vmap, so the replay's ops run "
            "under vmap too (eager's forward ran once, outside it). Random ops, dropout in "
            "training among them, cannot run under that vmap. Tip: take the gradients one "
            "vector at a time (a loop of torch.autograd.grad(..., retain_graph=True): the "
            "replay draws the forward's dropout mask again, eager's result bit for bit), or "
            "for this gradient run the layer without random ops (dropout p=0, or the module "
            "in eval mode: the gradient of the function without dropout), or without "
            "checkpointing it (pytree_ckpt.remove_activation_checkpointing(layer)).")
    return (
        f"pytree_ckpt: raised by the replay of {name} in backward, which runs the forward "
        "again inside this backward, here under a torch.func transform around the backward "
        "(torch.func.vmap over torch.autograd.grad): the replay cannot make the leaves that "
        "require grad it differentiates there (torch.func refuses requires_grad_ inside a "
        "transform), whatever the layer does. Tip: take the gradients one vector at a time (a "
        "loop of torch.autograd.grad(..., retain_graph=True)), use torch.autograd.grad(..., "
        "is_grads_batched=True) for a layer without random ops, or build the graph inside "
        "the transform (torch.func.vmap over torch.func.vjp of the model: no boundary is "
        "built under a transform, the layer runs as eager).")


def _from_kept(ctx: Any, call: BoundaryCall, kept: KeptReplay,
               grad_outputs: tuple[torch.Tensor | None, ...], /) -> Any:
    """The gradients this run of the node takes, from the graph an earlier restricted run
    kept (NOTE [a replay kept between restricted backwards] in kept_replay.py): no replay, no
    frame read; the saved inputs are unpacked again, for the in-place check."""
    assert call.params is not None  # kept only where the parameters are known
    # NOTE [a replay kept between restricted backwards] (kept_replay.py): the in-place check.
    saved = _saved_unchanged(ctx, call)
    keep_graph = _keep_graph()
    needs = ctx.needs_input_grad[2:]
    wrt = kept.wrt
    needed = [i for i, need in enumerate(needs) if need and wrt[i].requires_grad]
    wanted = used_by_this_backward(ctx.next_functions, needed)
    outs, grads = kept.pairs(grad_outputs)
    n = len(wrt) - len(call.params)
    result: list[torch.Tensor | None] = [None] * len(wrt)
    if outs and wanted:
        weights = kept.weights
        if weights is not None and not weights.covers(grad_outputs, wanted, wrt):
            weights = None  # NOTE [a weight pass from captured gradients] (kept_weights.py)
        with ParameterHooksPaused(() if weights is not None else call.params, outs,
                                  shared=True) as replayed:  # once each
            try:
                # Retained whenever the outer graph is, even for its last use: another thread
                # may be running it at once; dropped below, it is freed by reference.
                got = weights.weights(wrt, wanted, keep_graph) if weights is not None else \
                    input_grads(replayed, grads, [wrt[i] for i in wanted], keep_graph)
            except BaseException as error:
                if not keep_graph and call.kept is kept:  # partly freed: a retry replays
                    call.kept = None
                if not isinstance(error, RuntimeError) or isinstance(error, CheckpointError) \
                        or TORCH_REENTRANT not in str(error):
                    raise
                raise_torch_reentrant_inside(call, error)
        for i, grad in zip(wanted, got):
            result[i] = grad
    elif call.params:
        ParameterHooksPaused(call.params)  # NOTE [unused parameters get no hook call]
    accumulated_nothing(call.params, result[n:], needs[n:])
    if outs and wanted:
        _own_memory(saved[:n], result)  # NOTE [a gradient on an input's memory]
    _inputs_without_gradient(saved, result[:n], needs)
    kept.taken.update(wanted)  # in place: threads taking gradients at once each add theirs
    if (not keep_graph or kept.taken.issuperset(needed)) and call.kept is kept:
        call.kept = None  # never used again
    if not keep_graph:  # as after a replay: NOTE [frame lifetime] (frames.py)
        call.changed_state = None
        call.changed_numbers = None  # (helper HB: held with the graph on this path)
        call.prints = None
        if call.frame.results or call.reported:
            call.frame.clear()
    return (None, None, *result)


def _saved_unchanged(ctx: Any, call: BoundaryCall, /) -> tuple[torch.Tensor, ...]:
    """``ctx.saved_tensors`` (the call's inputs), refused by the boundary's error, naming the
    input, if one was changed in place since the call."""
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        # Autograd's own check, or (under a saved-tensor hook: a census, offload's tensors left
        # on the device) Unchanged's; offload's copies raise their own, naming the input.
        if isinstance(error, SavedTensorChanged) or (
                not isinstance(error, CheckpointError) and
                "modified by an inplace operation" in str(error)):
            raise_changed_after_call(call, ctx._raw_saved_tensors, error)
        if "backward through the graph a second time" in str(error):
            # Every output of a call shares this one node, which saved the call's inputs: in
            # eager, a second backward through another output (a critic's head reading
            # detached features, after the actor's loss) reaches only nodes the first left
            # alone (helper PC), and one through the same output reaches ops that may have
            # saved nothing (a bias add: helper PI); said as it applies (helper PG).
            several = len(call.out_tensor_index) > 1
            add_note(error, f"pytree_ckpt: the checkpointed call {fn_name(call.fn)} saved its "
                     "inputs for its replay on one autograd node" +
                     (" that all its outputs share" if several else "") + ", and an earlier "
                     "backward freed them; eager runs this second backward only where its own "
                     "ops on the way saved nothing (a bias add" +
                     (", or another output whose graph shares nothing with the first's"
                      if several else "") + "). Pass retain_graph=True to the first backward" +
                     (" (or sum the losses into one backward, or checkpoint only the shared "
                      "part)" if several else "") +
                     " (docs/limits.md, 'Gradient hooks and DDP')")
        raise


@contextmanager
def _attributes_set(module: nn.Module, names: Sequence[str],
                    tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """``module``'s attributes ``names`` set to ``tensors`` for the block (NOTE [attributes
    set before the call] in boundary.py); what they held before is put back after it."""
    held = module.__dict__
    before = [held.get(name, _MISSING) for name in names]
    held.update(zip(names, tensors))
    try:
        yield
    finally:
        for name, value in zip(names, before):
            if value is _MISSING:
                held.pop(name, None)
            else:
                held[name] = value


_MISSING = object()


def _refuse_removed_between(call: Any, error: ReuseError, /) -> None:
    """A replay that left kept results over because ``remove_activation_checkpointing`` ran
    between its forward and this backward: the kept methods (``KeptCallables``) are the
    instance's own again, so the replay runs them and takes none of their records (helper
    FI: the tip sent the user to branches on current_phase()). Said as that."""
    if call.options.keep is None or not call.options.keep.callables or call.owner is None or \
            "by a save unit" not in str(error):
        return  # only kept methods' records are left by the removal (helper FJ)
    from .module import is_checkpointed  # module.py imports this module's users
    if is_checkpointed(call.owner):
        return
    raise ReuseError(
        f"remove_activation_checkpointing ran on {type(call.owner).__name__} between a call's "
        "forward and its backward: its save units' kept methods (KeptCallables) are the "
        "module's own again, so that call's replay cannot take what they kept",
        expected="the module's checkpointing, save units included, in place until the "
                 "backward of every call made with it",
        got=str(error).split("\n", 1)[0],
        tip="remove it after the backward (between steps), or keep ops with KeptOps, whose "
            "replay needs no wrapped method") from error
