"""The boundary's autograd Function, ``_BoundaryFunction``, and how ``run_boundary``
(boundary.py) applies it. Its forward is the original pass of one call: ``fn`` under no-grad,
then the checks of what the call changed, what leaves it as outputs and what the node saves;
its backward checks the parameters and modules the call used and hands the replay to
``recompute.py``. What a call is made of (its inputs, parameters and attributes) and the NOTE
blocks the Function follows (what is saved, parameters are inputs, attributes set before the
call, loops on the per-call path) are in boundary.py.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from .boundary_call import NO_HELD, BoundaryCall
from .census import Mechanism, census_active, report_held
from .changed_in_place import (ParameterVersions, grad_switched, parameter_path,
                               raise_input_changed, refuse_grad_switched,
                               refuse_parameters_changed, requires_grad_flags, saved_path)
from .changed_numbers import ChangedNumbers, with_written
from .compiled_layers import recompile_limit_note
from .eager import BACKWARD_REASON, runs_eagerly
from .forward_modules import ForwardModules
from .forward_numbers import (NumbersGlance, NumbersWatch, glanced_dicts, numbers_read,
                              reads_changed_state)
from .generator_sets import forward_watch, learned
from .held_generators import held_generators, warn_made_during
from .hook_outputs import GradFlow, HookedOutputs, held_tensors, recording
from .forward_hooks import ForwardHooks, handles_made
from .inner_backward import InnerBackwardWatch
from .keep import KeepMode, kept_region, outside_kept_region, refuse_compiled_under_keep
from .kernel_written import parameter_sums, remember, remembered
from .made_before import leaving_tensors, on_kept_storages, unviewed
from .module_state import ever_verified
from .notes import add_note, note_no_grad_pass
from .phase import ACTIVE, Invocation, Phase, outside_inference_mode
from .recompute import replay_backward
from .refusals import (check_made_leaves, fn_name, raise_replay_reentered,
                       refuse_double_backward)
from .replay_values import OutputPrints
from .reused_numbers import with_reused_calls
from .rng import IsolatedPass, ReplayEnvironment
from .saved import pop_saved_hooks, push_saved_hooks, top_saved_hooks
from .state_changes import (StateWatch, mark_stateful, registered_state, snapshots_wanted,
                            versions)
from .stored_state import (warn_first_change_unsaved, warn_parameter_changed,
                           warn_under_torchs_checkpoint)
from .subclass import kind_of
from .tree import dunder, flatten, leaf_paths, object_children
from .tree_refusals import refuse_hidden_outputs, refuse_metadata_tensors, refuse_strided_nested

__all__ = ["apply_function"]

_Tensor = torch.Tensor  # read per call
_FORWARD = Phase.FORWARD  # an enum member's lookup costs about five plain ones


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: BoundaryCall, anchor: torch.Tensor | None,
                *inputs: torch.Tensor) -> Any:
        # NOTE [the library's own ops in a kept method's region] (keep.py)
        return outside_kept_region(_BoundaryFunction._forward, ctx, call, inputs)

    @staticmethod
    def _forward(ctx: Any, call: BoundaryCall, inputs: tuple[torch.Tensor, ...],
                 region: frozenset[str], /) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)
        # The rest are parameters (NOTE [parameters are inputs] in boundary.py).
        tensors = inputs[: call.n_inputs]
        preserve_rng = call.options.preserve_rng_state
        env = call.env = ReplayEnvironment.capture(
            tensors, preserve_rng=preserve_rng,
            leaves=call.in_leaves if len(call.in_tensor_index) < len(call.in_leaves) else None,
            fn=call.fn,
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
        invocation = Invocation(_FORWARD, call.frame, ACTIVE.get())
        input_versions = versions(tensors)
        needs = requires_grad_flags(tensors)  # NOTE [requires_grad switched inside the call]
        frozen = call.frozen
        # NOTE [attributes set before the call] (boundary.py), continued: saved with the
        # inputs, after them.
        saved = inputs[: call.n_inputs + len(call.attributes)]
        for t in saved:  # NOTE [loops on the per-call path] (boundary.py): no generator
            if type(t) is not _Tensor or t.__dict__:
                # Saved-tensor hooks (offload, a census) hand backward a new plain tensor, and
                # the replay's aliases are new objects: a plain tensor's attributes too (a
                # forward reading `x.meta`, helper JY). NOTE [a subclass's attributes as the
                # forward began]: read now.
                call.subclasses = [kind_of(t, as_now=True) for t in saved]
                break
        param_before = ParameterVersions.read(call.params) if call.params else None
        # NOTE [state the forward changes] (state_changes.py); a tree with no buffer nor frozen
        # parameter (the usual layer) needs no watch: only a registration can happen there,
        # looked for after the call (registered_state).
        wanted = call.owner is not None and call.modules is not None and \
            snapshots_wanted(call.owner)
        if wanted and call.owner is not None:  # its first calls: torch's checkpoint around?
            warn_under_torchs_checkpoint(call.owner)
        # NOTE [a parameter written through .data] (kernel_written.py), before its first replay
        param_sums = parameter_sums(call.params) if call.params and call.owner is not None \
            and not ever_verified(call.owner) else None
        watch = StateWatch(call.buffer_dicts, call.frozen, call.modules[1],
                           snapshot=wanted, compare=not ever_verified(call.owner),
                           written=remembered(call.modules[0])) \
            if call.owner is not None and call.modules is not None and \
            (call.frozen or any(call.buffer_dicts)) else None
        # NOTE [numbers and flags as the forward began] (forward_numbers.py): every module's
        # at first calls and once stateful, else those holding buffers.
        numbers = NumbersWatch(numbers_read(*call.modules, every=wanted), clone=wanted) \
            if call.modules is not None and (wanted or watch is not None) else None
        # NOTE [a number first changed after the first replay]: the other dicts, glanced at.
        glance = None
        if call.modules is not None and not wanted:
            every = glanced_dicts(*call.modules)
            if numbers is not None:
                read = {id(d) for d in numbers.dicts}
                every = [d for d in every if id(d) not in read]
            glance = NumbersGlance(every)
        # NOTE [a forward that sets a default generator's state] (generator_sets.py)
        sets = forward_watch(call.fn, call.owner) if preserve_rng else None
        keeping: KeepMode | None = None
        hooks = None
        # NOTE [a gradient inside the forward reaching the graph before the call]: at a
        # module's calls before its first replay, and at each call of a plain function.
        inner = InnerBackwardWatch(saved) \
            if call.owner is None or not ever_verified(call.owner) else None
        # NOTE [hooks the forward registers on its parameters and inputs] (forward_hooks.py)
        handles_before = handles_made()
        try:
            # Set inside the try, put back as the parent, not by a token: a KeyboardInterrupt
            # as the set returned left the pass active for good (helper KZ: offload windows
            # idle, current_phase() wrong; NOTE [a pass interrupted at any point] in rng.py).
            ACTIVE.set(invocation)
            if call.window_hooks:  # NOTE [the body runs without the window's hooks] (saved.py)
                hooks = top_saved_hooks()
                if hooks is not None:
                    pop_saved_hooks()
            # NOTE [each pass caches its own parametrizations] and NOTE [no fast path by grad
            # mode] in rng.py.
            with IsolatedPass():
                recorded = None
                flow: GradFlow | None = None
                if call.options.keep is None and not call.hooked and sets is None and \
                        not region:
                    output = call.fn(*args, **kwargs)  # the usual case, with no context more
                else:
                    with ExitStack() as stack:
                        if region:
                            stack.enter_context(kept_region(region))
                        if sets is not None:
                            stack.enter_context(sets)
                        if call.options.keep is not None:
                            keeping = stack.enter_context(
                                KeepMode(call.options.keep, invocation, layer=call.fn,
                                         verify=call.options.verify_replay,
                                         preserve_rng=preserve_rng))
                        if call.hooked:
                            recorded = stack.enter_context(recording())
                            flow = stack.enter_context(GradFlow())
                        output = call.fn(*args, **kwargs)
        except Exception as error:
            if keeping is not None:  # NOTE [higher-order ops pass through our modes]
                refuse_compiled_under_keep(error, fn_name(call.fn))
            # A forward, or a forward hook, that assumes grad mode: name the no-grad pass.
            note_no_grad_pass(error, f"the original pass of {fn_name(call.fn)}")
            limit = recompile_limit_note(error, f"the original pass of {fn_name(call.fn)}")
            if limit is not None:
                add_note(error, limit)  # NOTE [two entries per variant] in compiled_layers.py
            raise
        finally:
            try:
                if inner is not None:
                    inner.stop()
                if hooks is not None:
                    push_saved_hooks(hooks)
            finally:
                ACTIVE.set(invocation.parent)
        if inner is not None and inner.reached:  # (names built only to refuse: helper QB)
            inner.refuse(fn_name(call.fn), _its_saved(call), inputs=call.n_inputs)
        call.forward_hooks = ForwardHooks.found_since(
            handles_before, saved, call.params or (),
            call.modules[0] if call.modules is not None else ())
        if sets is not None:
            call.generator_sets = learned(call.fn, call.owner, sets)
        if grad_switched(tensors, needs, frozen):
            refuse_grad_switched(call, tensors, needs, frozen)
        now = versions(tensors)
        moved = [slot for slot, version in enumerate(now) if version != input_versions[slot]] \
            if now != input_versions else []
        if param_before is not None:  # NOTE [parameters changed in place] (changed_in_place.py)
            assert call.params is not None
            call.param_versions = ParameterVersions(call.params, param_before)
        call.saved_versions = versions(saved) if call.attributes else now
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
                if not wanted:  # NOTE [a small buffer first changed after the first replay]
                    assert call.modules is not None
                    warn_first_change_unsaved(call.owner, call.modules[0],
                                              call.changed_state.small_unsaved())
                mark_stateful(call.owner)
        if numbers is not None or glance is not None:
            call.numbers_saved = wanted
            call.changed_numbers = numbers.changed() if numbers is not None else None
            if glance is not None and (glanced := glance.changed()) is not None:
                call.changed_numbers = glanced.joined(call.changed_numbers)
            version_moved = call.param_versions is not None and param_before is not None \
                and call.param_versions.versions != param_before[0]
            flag_changed = call.changed_numbers is not None or (
                call.changed_state is not None and bool(call.changed_state.changes))
            if call.changed_numbers is not None:
                assert call.owner is not None  # modules
                mark_stateful(call.owner)
                if version_moved:
                    # A trainable parameter changed in place: not put back (NOTE [numbers
                    # and flags as the forward began]).
                    call.changed_numbers = None
            # NOTE [a parameter written through .data] (kernel_written.py): a flag changed, as
            # a plain value or a buffer, both put back for the replay
            written = param_sums is not None and flag_changed and not version_moved
            if numbers is not None:  # NOTE [values read, then changed by a later call]
                tensors_read = numbers.read()
                if tensors_read and call.owner is not None and reads_changed_state(tensors_read):
                    mark_stateful(call.owner)
                call.changed_numbers = ChangedNumbers([], read=tensors_read).joined(
                    call.changed_numbers)
            if written:
                assert param_sums is not None
                name = functools.partial(parameter_path,
                                         call.modules[0] if call.modules is not None else [])
                call.changed_numbers = with_written(call.changed_numbers, call.params or [],
                                                    param_sums, name)
        if call.frame.state_after:  # NOTE [state a reused call changes] (frozen.py)
            made = [value for changes in call.frame.state_after.values()
                    for kind, _, _, value in changes if kind == "numbers"]
            given = [value for changes in call.frame.state_after.values()
                     for kind, _, _, value in changes if kind == "contents"]
            if made or given:
                call.changed_numbers = with_reused_calls(call.changed_numbers, made, given)
        if call.modules is not None:
            if call.options.preserve_rng_state:  # NOTE [generators held as attributes]
                warn_made_during(*call.modules, env.generators)
            call.forward_modules = ForwardModules(*call.modules)
            # NOTE [held tensors are not hooked outputs] (hook_outputs.py): as each hooked
            # module returned too, or, in a compiled body, after the call
            if recorded:
                held = call.held = {**call.held, **recorded.held}
                if recorded.compiled:
                    held.update(held_tensors(
                        {id(sub): sub.__dict__ for module in recorded.compiled
                         for sub in module.modules()}.values()))
        # For verify_leaves, should this call's replay be the one that verifies (whether it is
        # depends on the module structure then, which may change before backward).
        call.frozen_at_call = call.frozen
        call.buffer_dicts, call.frozen, call.modules = (), (), None
        flat = flatten(output, root="output")
        if len(flat.tensor_index) < len(flat.leaves):  # NOTE [a weakref.proxy leaf] there too
            refuse_hidden_outputs(call, flat.spec, flat.leaves, flat.tensor_index, tensors)
        if flat.spec.num_nodes > flat.spec.num_leaves:  # NOTE [tensors in a node's metadata]
            refuse_metadata_tensors(call.fn, flat.spec, root="output")
        leaves = flat.leaves if len(flat.tensor_index) == len(flat.leaves) else \
            [flat.leaves[i] for i in flat.tensor_index]
        # NOTE [an input returned keeps its attributes]: autograd hands the caller an input the
        # Function returns as a new alias carrying the node (the class survives, through a
        # subclass's __torch_function__), not the input itself as eager does, so what the
        # caller set on it (`x.meta`, a tagged tensor's tag) was gone: `out.meta` raised where
        # eager's ran (helper JS). The alias gets the input's attributes (the values, by
        # reference) and slots (helper JY), a parameter subclass's too (helper KA).
        call.returned_attributes = [
            (k, t) for k, t in enumerate(leaves)
            if t.requires_grad and (type(t) is not _Tensor or t.__dict__) and
            any(t is x for x in tensors)] or None
        # NOTE [outputs made before the call] (made_before.py)
        out_tensors, as_is, views, state = leaving_tensors(leaves, tensors, call.before, watch)
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
        if views:  # NOTE [outputs that view fn's own results] (made_before.py)
            out_tensors, call.unviewed = unviewed(out_tensors, views,
                                                  (*extra, *call.frame.tensors()))
        if keeping is not None and keeping.kept_storages():
            # NOTE [outputs on a kept storage] (made_before.py)
            call.kept_aliases = on_kept_storages(out_tensors, keeping.kept_storages(),
                                                 keeping.what_to_drop)
        if state:
            # A buffer's rows returned untouched (marked non-differentiable below) and changed
            # in place by the caller: a replay that reads the buffer would read the changed
            # one, where eager refuses at backward when an op saved it. Watched as the views
            # above are (refused whether or not fn reads it: nothing cheap tells).
            call.unviewed = [*(call.unviewed or ()),
                             *((p, weakref.ref(out_tensors[p]), out_tensors[p]._version)
                               for p in state)]
        call.before = None
        call.held = NO_HELD
        call.out_spec = flat.spec
        call.out_tensor_index = flat.tensor_index
        call.out_meta = out_meta = []
        try:
            for t in out_tensors:  # NOTE [loops on the per-call path] (boundary.py)
                out_meta.append((t.shape, t.dtype))
        except RuntimeError:  # NOTE [tensors of other layouts] (tree.py)
            refuse_strided_nested(call.fn, flat.spec, flat.tensor_index, out_tensors,
                                  root="output")
            raise
        if call.options.verify_replay:  # NOTE [output prints] (replay_values.py)
            spec, places, kept_hooks, owner = flat.spec, flat.tensor_index, \
                call.hooked_outputs, call.owner
            # (a view's _base is its root's: an input that views another tensor, as
            # as_subclass makes one, is reached through that root)
            input_ids = {id(t) for t in tensors} | {id(t._base) for t in tensors
                                                     if t._base is not None}
            call.prints = OutputPrints.of(
                (*out_tensors, *extra), lambda: [
                    *(leaf_paths(spec, root="output")[i] for i in places),
                    *(kept_hooks.names(owner) if kept_hooks is not None else ())],
                fn=call.fn, inputs_as_is=frozenset(
                    k for k, t in enumerate(out_tensors)
                    if id(t) in input_ids or t._base is not None and id(t._base) in input_ids))
        out_leaves = call.out_leaves = flat.leaves
        for index in flat.tensor_index:
            out_leaves[index] = None
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
            floats = [t for t in out_tensors if (t.is_floating_point() or t.is_complex())
                      and not t.requires_grad and id(t) in in_frame]
            float_ids = {id(t) for t in floats}
            if floats and all(id(t) in float_ids or any(t is u for u in (*frozen, *as_is))
                              for t in out_tensors):  # (an int input returned is in two)
                # NOTE [a call that returns only frozen results]: then nothing would ever reach
                # this node, so the replay, which decides whether eager computes those floats
                # with grad (NOTE [differentiable results are refused where grad is on] in
                # frozen.py), would never run: a trainable gate's weights returned alone lost
                # their gradient silently, where eager refuses. They leave as detach() aliases
                # that carry the node (the recorded tensors stay clean), so a backward through
                # them runs the replay, which refuses them or, where eager computes them
                # without grad, gives them no gradient. Unlike eager, they require grad.
                out_tensors = tuple(t.detach() if id(t) in float_ids else t
                                    for t in out_tensors)
            else:
                frozen += floats
        # Autograd returns an input as a view of it even so: the caller gets the input itself.
        if as_is:  # by id, not a scan per output (helper LK: quadratic in a PyTree's leaves)
            as_is_ids = {id(x) for x in as_is}.intersection(id(x) for x in tensors)
            call.as_is = [(k, t) for k, t in enumerate(out_tensors) if id(t) in as_is_ids]
            if any(t.layout != torch.strided for _, t in call.as_is):
                # A sparse input has no view, and autograd's view_as of it raised
                # NotImplementedError at the call (`return x, adj`, helper ET): a dense
                # placeholder leaves in its place, and the caller gets the input itself.
                placed = dict(call.as_is)
                out_tensors = tuple(
                    torch.empty(0, dtype=t.dtype, device=t.device)
                    if k in placed and t.layout != torch.strided else t
                    for k, t in enumerate(out_tensors))
                as_is = [*as_is, *(t for k, t in enumerate(out_tensors) if k in placed)]
        if frozen or as_is:
            ctx.mark_non_differentiable(*frozen, *as_is)
        if census_active():
            call.reported = True
            report_held(saved, Mechanism.BOUNDARY, holder=call.frame)
            report_held(referenced_tensors(call.fn, call.in_leaves), Mechanism.BOUNDARY,
                        holder=call.frame)
            report_held(call.frame.tensors(), Mechanism.REPLAY_FRAME, holder=call.frame)
            if call.changed_state is not None:  # released with the frame (recompute.py)
                report_held(call.changed_state.snapshots(), Mechanism.MODULE_STATE,
                            holder=call.frame)
            if call.changed_numbers is not None:
                report_held(call.changed_numbers.snapshots(), Mechanism.MODULE_STATE,
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
        if _is_compiling():  # NOTE [the replay stays eager]: only code dynamo traces
            return _backward_opaque(ctx, grad_outputs)
        if torch.is_inference_mode_enabled():  # NOTE [a backward run under inference mode]
            with outside_inference_mode():
                return _BoundaryFunction._backward(ctx, grad_outputs)
        return _BoundaryFunction._backward(ctx, grad_outputs)

    @staticmethod
    def _backward(ctx: Any, grad_outputs: tuple[torch.Tensor | None, ...]) -> Any:
        call: BoundaryCall = ctx.call
        if torch.is_grad_enabled():  # refused (no closure made per call otherwise)
            refuse_double_backward(lambda: f"the boundary around {fn_name(call.fn)}")
        # NOTE [a replay that reaches its own node] (refusals.py): autograd runs a backward
        # called inside a backward on the calling thread, so this thread being in this call's
        # backward already is a cycle; two threads each in one are not.
        me = threading.get_ident()
        if me in call.replaying:
            raise_replay_reentered(ctx, call)
        call.replaying.add(me)
        try:
            return _BoundaryFunction._checked_replay(ctx, call, grad_outputs)
        finally:
            call.replaying.discard(me)

    @staticmethod
    def _checked_replay(ctx: Any, call: BoundaryCall,
                        grad_outputs: tuple[torch.Tensor | None, ...]) -> Any:
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
        # forward_modules.py) for the replay's forward: the replay's copies (NOTE [the replay
        # changes copies] in state_changes.py) are of the very tensors the forward changed (a
        # buffer torch.func.functional_call passed in). The present ones are put back before
        # the replay's backward (NOTE [the replay's backward sees the modules as they are]).
        assert call.forward_modules is not None
        with call.forward_modules.reinstated(changes) as put_back:
            grads = replay_backward(ctx, call, grad_outputs, backward_begins=put_back)
        if call.made_leaves is not None:  # NOTE [leaves the call makes] (refusals.py)
            check_made_leaves(call)
        return grads


# NOTE [the replay stays eager]: dynamo meets the Function's backward where compiled autograd
# puts it into its graph, and where a compiled step calls loss.backward() on the CPU (the
# engine then runs backward on the calling thread, under dynamo's frame callback). Traced, the
# replay's try blocks crashed dynamo ("exception table entry start instruction has no
# offset"); opaque, it runs eagerly, as in any backward. Only there: the opaque wrapper costs
# about 3 us a call, so backward takes it where torch.compiler.is_compiling() is true, which
# it is only in code dynamo traces (in eager it is a flag read).
# NOTE [tensors held by reference are counted]: besides the inputs it saves, a call holds
# for its replay the callable it runs and the input objects optree does not open, as they
# are: a functools.partial's bound tensors (transformers' calling convention binds the
# attention mask and the rotary tables so), a closure's (through decorators' ``__wrapped__``),
# and a plain input object's attributes and slots. The census left them out (helper HC: a
# 3-layer stack's masks and tables, 18 of 51 KB). Reported for the census only, by a walk of
# its own, bounded as the census's other searches are: lists, tuples and dicts' values opened
# (never dict keys, which may be tensors, nor dataclasses, whose links may cycle: helper HD),
# four levels deep, 64 values each, 256 values in all.
_LOOKED_AT = 64


def referenced_tensors(fn: Any, leaves: list[Any], /) -> list[torch.Tensor]:
    """The tensors ``fn`` and the input objects ``leaves`` hold (NOTE [tensors held by
    reference are counted])."""
    values: list[Any] = []
    for _ in range(8):  # partials of partials, decorators of decorators
        if isinstance(fn, functools.partial):
            values += [*fn.args[:_LOOKED_AT], *list(fn.keywords.values())[:_LOOKED_AT]]
            fn = fn.func
            continue
        closure = dunder(fn, "__closure__")
        for cell in closure[:_LOOKED_AT] if type(closure) is tuple else ():  # (a function's)
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        fn = dunder(fn, "__wrapped__")
        if fn is None:
            break
    for leaf in leaves:
        kind = type(leaf)  # NOTE: not isinstance, which a proxy's __class__ answers (helper HF)
        if issubclass(kind, (list, tuple, dict)):  # a subclass optree passes on as it is
            values.append(leaf)
        elif leaf is not None and not issubclass(kind, (_Tensor, int, float, str, bytes,
                                                        torch.nn.Module)):
            values += [value for _, value in object_children(leaf)[:_LOOKED_AT]]
    found: list[torch.Tensor] = []
    budget = 4 * _LOOKED_AT
    level = 0
    while values and level < 4 and budget > 0:
        deeper: list[Any] = []
        for value in values[:budget]:
            kind = type(value)
            if issubclass(kind, _Tensor):
                found.append(value)
            elif issubclass(kind, list):  # the builtin's own items, whatever a subclass does
                deeper += list.__getitem__(value, slice(_LOOKED_AT))
            elif issubclass(kind, tuple):
                deeper += tuple.__getitem__(value, slice(_LOOKED_AT))
            elif issubclass(kind, dict):
                deeper += list(dict.values(value))[:_LOOKED_AT]
        budget -= len(values)
        values, level = deeper, level + 1
    return found


_backward_opaque = runs_eagerly(BACKWARD_REASON)(_BoundaryFunction._backward)
_is_compiling = torch.compiler.is_compiling


# NOTE [the Function is applied in C]: ``torch.autograd.Function.apply`` (Python) binds default
# arguments when a Function defines ``setup_context`` (this one does not), hands the call to
# functorch when a transform is active (run_boundary never gets here then: NOTE [when there is
# no boundary] in boundary.py, read the same way), and otherwise passes each tensor argument through
# ``torch._C._functorch.unwrap_if_dead`` (a tensor that escaped a ``torch.func`` transform is
# unwrapped) before calling ``torch._C._FunctionBase.apply``. That Python work, a generator over
# every argument, cost about 20,000 instructions a layer call at the small size of
# examples.bench_instructions: the boundary does the same steps itself, unwrapping each input
# tensor with a C-level map (``call`` and the anchor, the library's own, need none). A torch
# without ``unwrap_if_dead`` gets ``Function.apply`` itself.
_unwrap_if_dead: Any = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_apply_in_c: Any = super(torch.autograd.Function, _BoundaryFunction).apply \
    if _unwrap_if_dead is not None else None


def apply_function(call: BoundaryCall, anchor: torch.Tensor | None,
                   inputs: list[torch.Tensor], /) -> Any:
    """``_BoundaryFunction.apply(call, anchor, *inputs)`` (NOTE [the Function is applied in C])."""
    if _apply_in_c is None:
        return _BoundaryFunction.apply(call, anchor, *inputs)
    return _apply_in_c(call, anchor, *map(_unwrap_if_dead, inputs))


def _its_saved(call: BoundaryCall, /) -> Callable[[int], str]:
    """Names of ``call``'s saved tensors for InnerBackwardWatch.refuse (only on refusal)."""
    return lambda slot: ("its input " if slot < call.n_inputs else "") + saved_path(call, slot)
