"""Output-discard replay for cheap ops (Megatron-style): ``CheckpointWithoutOutput``.

A cheap op (an RMSNorm, a residual read) produces an output that a consumer saves for its own
backward (the QKV projection saves the norm's output), so it lives from forward to backward.
``CheckpointWithoutOutput`` frees exactly that: the op runs under no-grad, its output's storage
is released once the consumer holds it, and a hook on a later tensor's gradient rebuilds it in
place just before the consumer's backward needs it.

Here: the checkpoint, the discard and the rebuild. Beside it: the autograd Function whose
backward differentiates the rebuilt graph (discard_function.py, with NOTE [exactness]), the
manager that discards a block of chained checkpoints (discard_manager.py), what discard
refuses (discard_refusals.py) and which arguments it takes (discard_arguments.py), and which
outputs are never freed (discard_aliases.py).

NOTE [discard lifetimes]:
1. ``checkpoint(fn, *args)`` saves the inputs through autograd (``save_for_backward``: an outer
   offload hook sees them) and records RNG state; the outputs are returned under no-grad.
2. ``discard_output_and_register_recompute(hook_tensor)`` resizes each output's storage to 0
   bytes: every tensor and view on it (the consumer's saved one included) stays a valid object
   with no memory. An output that aliases an input is never freed: the input is still needed.
3. The hook on ``hook_tensor``'s gradient reruns ``fn`` with grad enabled, resizes each storage
   back, and copies the recomputed bytes into *that very storage*, so every alias sees them.
   The recomputed outputs are kept for the Function's backward, which backpropagates through
   the small recomputed graph when autograd reaches it. When the Function's node is freed
   without its backward having run (a restricted backward that did not need it, a graph
   dropped after the forward), what the checkpoint kept is released with it, as eager's
   saved tensors are; a checkpoint whose node is gone before the hook fires (its output
   went unused: nothing in the graph reads it) is not rebuilt.
4. A manager (discard_manager.py) replays several chained checkpoints (a later one may take
   an earlier one's discarded output as input) in forward order, from one hook, once.
5. The rebuild runs ``fn`` again, and with it what ``fn`` changes of its modules' state
   (BatchNorm's running statistics), which eager does once. The forward watches that state
   as the boundary does (NOTE [state the forward changes] in state_changes.py), and the
   rebuild runs on copies of what changed (NOTE [the replay changes copies]), from the hook
   until ``fn`` returns: nothing depends on the Function's backward running after it (a
   restricted backward may not run it), and two rebuilds of one module never interleave
   their changes. State ``fn`` only reads (a BatchNorm in eval mode) that a later call's
   forward changes before the rebuild (a train micro-batch) is rebuilt from copies of it as
   this forward read it: the rebuild writes into the very storage the consumer saved, so it
   must give the bytes the forward gave (NOTE [state read, then changed by a later call]).
   A buffer a kernel writes without moving its version (QAT's fused fake-quant, ``.data``)
   is found by value at the module's first discarded call (NOTE [state a kernel writes] in
   kernel_written.py). Only a module's state is watched: a plain function reaching state
   another way (a lambda over a BatchNorm, ``F.batch_norm`` given running statistics)
   changes it again, and reads it as it is at the rebuild. ``fn`` changing its tensor
   arguments in place is refused: they are saved after it ran, so autograd cannot see it,
   and the rebuild would change them again.
Discarding twice, replaying twice, or a replay of another shape raises ``CheckpointError``.
With grad disabled (a checkpoint boundary's original pass) ``checkpoint`` just calls ``fn``
and discarding is a no-op: nothing was saved; the boundary's replay discards for real.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar, cast

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import nn

from .census import ActivationCensus, active_census
from .changed_in_place import ParameterVersions, refuse_parameters_changed
from .discard_aliases import reachable_tensors, register_rebuild
from .discard_arguments import (Places, checked_arguments, held_places, module_routes,
                                refuse_held_replaced, refuse_taken_out)
from .discard_function import DiscardFunction
from .discard_refusals import check_hook_tensor, refuse_discarded_hook, refuse_fp8
from .eager import DISCARD_REASON, runs_eagerly
from .errors import (CheckpointConfigError, CheckpointError, ReplayMismatchError, require_callable,
                     validate_bool)
from .forward_hooks import ForwardHooks, handles_made
from .inner_backward import mark_discard_rebuilt
from .forward_modules import ForwardModules
from .changed_numbers import ChangedNumbers
from .frames import callable_name
from .generator_sets import replay_watch
from .keep import kept_region
from .kept_replay import note_discard
from .module_state import (ModuleDicts, any_expanded, collect_parameters, module_dicts,
                           owning_module)
from .phase import outside_inference_mode, rebuilding
from .replay_values import OutputPrints, check_rebuilt
from .rebound import Bound, modules_bound_now, refuse_rebound
from .recording import proxy_tracing, tracer_records
from .refusals import refuse_container, refuse_double_backward
from .rng import IsolatedPass, ReplayEnvironment
from .state_changes import ChangedState
from .subclass import SubclassKind, alias_as_kind, as_kind, rebuilt_by_parts
from .torch_checkpoints import inside_torchs_checkpoint
from .tree import alias, dunder, refuse_proxy_function

__all__ = ["CheckpointWithoutOutput", "DISCARDED_MARK"]

# NOTE [discarded storages are marked]: an attribute set on each storage a discard frees, the
# discarded op's name (a storage keeps its Python object, and so its attributes, while it is
# alive; the rebuild resizes that very storage back). The offload manager reads it for a
# window storage it let go while still alive: one output discard freed (and backward rebuilt
# before the manager looked) was copied to host for nothing, and is no storage something else
# keeps (offload/liveness.py, ``copied_and_discarded``); a window copying a storage that
# carries the mark of a discard rebuilt since takes it off (offload/window.py, ``Copy``): a
# rebuilt output kept and given to a layer in a later step is not discarded there.
# ``detect_discarded_reads`` reads it for a storage still empty (discarded_reads.py).
DISCARDED_MARK = "_pytree_ckpt_discarded"
# Beside it, the discarding object by weak reference: NOTE [chained discards in any order].
_DISCARDED_BY = "_pytree_ckpt_discarded_by"

log = logging.getLogger(__name__)

_WARNED_WRAPPERS: set[type] = set()  # output classes a discard kept, warned of once
_WARNED_LAYOUTS: set[torch.layout] = set()  # sparse output layouts a discard kept, likewise

# Read at each discarded op, as boundary.py reads them (without a Python frame).
_functorch_transforms_active: Any = torch._C._are_functorch_transforms_active

# Ops whose inert discard was logged (a warning once per op name, not once per step).
_INERT_LOGGED: set[str] = set()


# NOTE [discard stays eager]: a compiled body whose norms go through output discard (the
# reference model's discard_norm_outputs) cannot trace the Function: it frees outputs in place
# and hangs their rebuild on a gradient hook. Called from traced code, dynamo gave up on it
# but traced its forward frame by frame, down to the replay environment's reads of torch's
# kernel switches, and warned about each builtin it could not trace there (once that body
# compiled past its second sequence length, NOTE [the decoder body's variants] in
# examples/glm_dsa/distributed.py). With only the Function's call marked eager, the object
# was made in the traced frame and its checkpoint() traced up to that call, and dynamo could
# carry neither across the break: it ran the whole body eagerly, with none of the body's
# compute compiled (only the bookkeeping before the call: helper HA found the body's linears
# in no graph), and compiled checkpoint()'s own frame once per layer and pass, past the
# recompile limit. So the constructor and the public methods run eagerly, each with the
# reason: the body breaks its graph at each, holds a real object across the breaks, and
# compiles what comes between them.
_eager = runs_eagerly(DISCARD_REASON)
T = TypeVar("T")


def _refuse_compiled_autograd(name: str, error: RuntimeError, /) -> None:
    """Raise a ``CheckpointError`` where compiled autograd runs this backward: it takes every
    node's saved tensors when it captures the graph and frees them before it runs, so a rebuild
    hook can no longer read the discarded op's inputs from the op's node (helper LI: torch's
    "backward through the graph a second time" and its retain_graph tip). Inside a checkpointed
    layer the rebuild runs in the boundary's eager replay, under no compiled autograd."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is None or not getattr(compiled_autograd, "in_compiled_autograd_region",
                                                False):
        return
    raise CheckpointError(
        f"the output-discard checkpoint of {name} cannot rebuild its output under compiled "
        "autograd: it reads the op's inputs from the op's autograd node, whose saved tensors "
        "compiled autograd took and freed before running the rebuild",
        expected="a backward that runs the discard's rebuild hook with the op's node intact",
        got="a backward under torch._dynamo.compiled_autograd",
        tip="run the discard inside a checkpointed layer (apply_activation_checkpointing: its "
            "replay rebuilds eagerly), or this backward without compiled autograd") from error


class CheckpointWithoutOutput:
    """Run a cheap ``fn`` under no-grad now; free its output; rebuild it just before backward.

    ``preserve_rng_state``: the rebuild draws the forward's random numbers. ``verify_replay``:
    compare each rebuilt output with the forward's, bit for bit, before refilling it
    (``ReplayMismatchError`` naming the output), to find an ``fn`` that reads state changed
    since; a debugging switch (docs/boundary.md, "Checking that the replay computes what the
    forward did"). ``fp8``: Megatron-Core's keyword, off only (False or None).
    """

    @_eager
    def __init__(self, fp8: bool | str | None = False, *, preserve_rng_state: bool = True,
                 verify_replay: bool = False) -> None:
        # fp8 positional too, as Megatron-Core's CheckpointWithoutOutput(config.fp8) passes it
        # (helper HJ: a bare "takes 1 positional argument" error otherwise).
        refuse_fp8(fp8)  # Megatron-Core's keyword: said, not swallowed
        self.preserve_rng_state = validate_bool(preserve_rng_state, name="preserve_rng_state")
        # The rebuilt outputs compared with the forward's, bit for bit (NOTE [output prints] in
        # replay_values.py): printed before the discard frees them.
        self.verify_replay = validate_bool(verify_replay, name="verify_replay", default=False)
        self.prints: OutputPrints | None = None
        self.fn: Callable[..., Any] | None = None
        self.kwargs: dict[str, Any] = {}  # plain values only (checked in checkpoint())
        self.ctx: Any = None
        self.env: ReplayEnvironment | None = None
        # NOTE [a forward that sets a default generator's state] (generator_sets.py)
        self.generator_sets: list[tuple[torch.Generator, torch.Tensor]] | None = None
        self.single = True
        self.as_list = False  # fn returned a list of tensors
        self.arg_kinds: list[bool] = []
        self.tensor_kinds: list[SubclassKind | None] = []  # NOTE [a subclass's attributes as
        # the forward began] (subclass.py): each tensor argument's, read in forward
        self.non_tensor_args: list[Any] = []
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.sizes: list[int] = []   # bytes of each freed storage (0: kept); set by the discard
        self.discarded = False
        self.replayed = False
        self.rebuilt_early = False  # NOTE [chained discards in any order]
        self.recomputed: tuple[torch.Tensor, ...] | None = None
        self.detached: list[torch.Tensor] | None = None
        self.census: ActivationCensus | None = None
        self.passthrough = False  # ran without grad: no graph, nothing to discard or replay
        self.checkpointed = False  # checkpoint() returned: there is something to discard
        self.n_args = 0
        self.params: list[torch.Tensor] | None = None  # fn's parameters, when fn is a module
        # Their versions after the forward (NOTE [parameters changed in place] in
        # changed_in_place.py).
        self.param_versions: ParameterVersions | None = None
        self.made_outside: list[bool] = []  # per output: on an input's or fn's state's storage
        self.versions: list[int] = []  # per output, when checkpointed
        self.reachable: list[torch.Tensor] | None = None  # see _found_reachable
        self.modules: list[nn.Module] | None = None  # fn's modules, until its forward ran
        self.forward_modules: ForwardModules | None = None
        # NOTE [hooks the forward registers on its parameters and inputs] (forward_hooks.py)
        self.forward_hooks: ForwardHooks | None = None
        # NOTE [a module rebound before the replay] (rebound.py): a plain function's modules.
        self.bound: Bound | None = None
        # The arguments' containers, and where they held modules when the forward returned
        # (NOTE [an output discard's arguments]), for the checks around the rebuild.
        self.held: tuple[tuple[Any, ...], Places] | None = None
        # Their buffer dicts, frozen parameters (known tensors for backward's check) and
        # trees; what the forward changed of them (NOTE [state the forward changes] in
        # state_changes.py, NOTE [discard lifetimes] 5).
        self.state: tuple[list[dict[str, torch.Tensor | None]], list[torch.Tensor],
                          list[ModuleDicts]] | None = None
        self.changed_state: ChangedState | None = None
        # And of their plain numbers and flags (NOTE [numbers and flags as the forward began]
        # in forward_numbers.py), for the rebuild.
        self.changed_numbers: ChangedNumbers | None = None

    # Callable[..., T] as pytree_ckpt.checkpoint is (functional.py says why)
    @_eager
    def checkpoint(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` under no-grad; inputs saved through autograd; returns its
        output. Keyword arguments take plain values only (``eps=1e-6``)."""
        if self.fn is not None:
            raise CheckpointError("this CheckpointWithoutOutput was already used",
                                  expected="one checkpoint() per object", got="a second call",
                                  tip="create one CheckpointWithoutOutput per op call")
        require_callable(fn, "CheckpointWithoutOutput.checkpoint", "ckpt.checkpoint(norm, x) or "
                         "ckpt.checkpoint(fn, x, ...): the op first, then its arguments",
                         role="the op whose output is discarded and rebuilt")
        refuse_proxy_function(fn, "CheckpointWithoutOutput.checkpoint")
        if isinstance(fn, nn.Module):
            # torch's own "missing the required forward function" otherwise, naming no fix
            refuse_container(fn, "checkpoint would have nothing to run",
                             tip="checkpoint each module it holds on its own: one "
                                 "CheckpointWithoutOutput per op (ckpt.checkpoint(norm, x)), "
                                 "or one CheckpointWithoutOutputManager for the block")
        places = checked_arguments(fn, args, kwargs)  # NOTE [an output discard's arguments]
        held = list({id(m): m for m, _, _ in places.values() if isinstance(m, nn.Module)}
                    .values())
        # Set only once the call is accepted: a refused call leaves the object unused, to retry.
        self.fn = fn
        self.kwargs = kwargs
        owner = owning_module(fn)
        self.n_args = len(args)
        modules = [m for m in (owner, *args) if isinstance(m, nn.Module)]
        modules += [m for m in held if not any(m is known for known in modules)]
        if modules:
            self.modules = modules
            trees = [module_dicts(m) for m in modules]
            frozen: list[torch.Tensor] = []
            # Tensor arguments not skipped: a parameter the module also receives as an argument
            # is used both ways, and each use needs its gradient (as in the boundary).
            try:
                self.params = collect_parameters(trees, set(), frozen=frozen)
            except RuntimeError:
                if not any_expanded(trees):
                    raise
                # NOTE [expanded weights] (boundary.py): a plain call, nothing discarded
                # (helper PB: torch's "cannot handle function __get__" came from here too).
                if self._name() not in _INERT_LOGGED:
                    _INERT_LOGGED.add(self._name())
                    log.warning("output discard of %s runs with torch's ExpandedWeight "
                                "parameters (per-sample gradients): its output is kept",
                                self._name())
                self.passthrough = True
                self.reachable = None
                output = fn(*args, **kwargs)
                self.checkpointed = True
                return output
            self.state = ([d for tree in trees for d in tree.buffers], frozen, trees)
            if owner is None and held:  # NOTE [an output discard's arguments]
                self.params = None
        elif not any(t.requires_grad and not any(t is a for a in args)
                     for t in self._found_reachable(fn, args)):
            # By identity, not id(): when dynamo traced this method (before NOTE [discard
            # stays eager]), id() of a tensor argument made it guard on that very object, so
            # each call with a new input recompiled, up to the recompile limit.
            # A plain function that reaches nothing trainable (F.gelu, a lambda, a partial):
            # its gradients are its inputs' alone, so the explicit path serves, also under
            # torch.autograd.grad (a checkpoint boundary's replay uses it).
            self.params = []
        needs_grad = bool(self.params) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        # NOTE [a tracer records the plain forward], NOTE [make_fx records storages nowhere]
        transformed = _functorch_transforms_active() or _forward_ad._current_level >= 0 \
            or tracer_records() or proxy_tracing()  # (recording.py)
        # NOTE [a discard inside torch's non-reentrant checkpoint]: torch's checkpoint
        # (transformers' gradient checkpointing, torchtune, torchtitan) runs the body with
        # grad on under its own saved-tensor hooks, which keep nothing, and runs it again in
        # backward to make what was saved. A discard there freed the rerun's output that torch
        # had just saved for the consumer (``silu(g) * u``), and set its rebuild on the
        # rerun's output, which no backward reaches: the consumer's backward read freed memory
        # (a segfault: helper HO). Torch's checkpoint frees what the body saves already, so
        # the discard is a plain call under its hooks, in both runs (torch_checkpoints.py).
        inside_torchs = torch.is_grad_enabled() and inside_torchs_checkpoint()
        # Under inference mode, grad enabled inside it too, nothing can be saved (helper NY:
        # torch's "Inference tensors cannot be saved for backward"): a plain call, as at a
        # boundary (run_boundary).
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or \
                not needs_grad or transformed or inside_torchs:
            # Nothing will be saved (no_grad, a checkpoint boundary's original pass, or nothing
            # that needs a gradient): nothing to discard; a boundary's replay runs this again.
            # Under a torch.func transform or forward-mode AD, which build their own graph (and
            # where the Function, with no setup_context or jvp, is refused), and while
            # torch.jit.trace, torch.export or torch.fx records (they would record the Python
            # Function, or the no-grad region around the op: helper LE's export, whose program
            # gave the op's input no gradient), it is a plain call too, as the boundary is
            # (NOTE [when there is no boundary] in boundary.py).
            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and \
                    not transformed and not inside_torchs and self._name() not in _INERT_LOGGED:
                _INERT_LOGGED.add(self._name())  # once per op: a step would repeat it
                why = ("its parameters are unknown (a lambda or function reaching a module's: "
                       "pass the module or its method instead)" if self.params is None else
                       "it has no trainable parameters")
                log.warning("output discard of %s frees nothing: no input needs grad and %s, so "
                            "no graph node can rebuild its output (a trainable consumer keeps "
                            "it whole, as without discard)", self._name(), why)
            self.passthrough = True
            self.reachable = None
            output = fn(*args, **kwargs)
            self.checkpointed = True
            return output
        if owner is None:  # NOTE [a module rebound before the replay] (rebound.py)
            self.bound = modules_bound_now(fn)
        if held:  # NOTE [an output discard's arguments]: where the op finds its modules
            containers = tuple(None if isinstance(a, torch.Tensor) else a for a in args)
            routes = module_routes(containers)
        outputs = tuple(DiscardFunction.apply(self, *args, *(self.params or ())))
        if held:  # NOTE [an output discard's arguments]: checked again at the rebuild, as the
            # forward left them; the containers alone (no tensor inputs)
            self.held = (containers, held_places(containers))
            refuse_taken_out(fn, routes, containers)
        # After the Function's call: a fullgraph body is refused at this method's call (NOTE
        # [discard stays eager]), before this ContextVar read.
        note_discard()  # NOTE [a replay kept between restricted backwards] (kept_replay.py)
        if not any(o.requires_grad for o in outputs):
            # No output can carry a gradient, so autograd keeps no node (and no inputs) to
            # replay from: the discard would free what nothing can rebuild.
            raise CheckpointConfigError(
                f"CheckpointWithoutOutput needs {self._name()} to return a floating output",
                expected="at least one output that can require grad",
                got=", ".join(str(o.dtype) for o in outputs),
                tip="integer results (argmax ids) are small: call the op plainly, or replay "
                    "them with pytree_ckpt.reuse_during_recompute inside a checkpoint")
        # Detached aliases: the same storages, without a grad_fn pointing back at our node.
        self.outputs = tuple(o.detach() for o in outputs)
        if self.verify_replay:
            # Outside a kept method's region, as the Function's own bookkeeping (NOTE [the
            # library's own ops in a kept method's region] in keep.py; helper JM).
            with kept_region(frozenset()):
                self.prints = OutputPrints.of(self.outputs, self._paths, fn=self._name())
        self.versions = [o._version for o in self.outputs]  # they share the outputs' counters
        self.checkpointed = True
        # fn's own container: a list of outputs comes back a list (the Function returns a tuple)
        return cast(T, outputs[0] if self.single else list(outputs) if self.as_list else outputs)

    def _paths(self) -> list[str]:
        """How a message names each output."""
        return ["output"] if self.single else [f"output[{i}]" for i in range(len(self.outputs))]

    def _found_reachable(self, fn: Callable[..., Any], args: tuple[Any, ...]
                         ) -> list[torch.Tensor]:
        # Kept for the forward's own search (made_outside): the scan can be long (a global
        # model), so it runs once per call.
        self.reachable = reachable_tensors(fn, args)
        return self.reachable

    @property
    def released(self) -> bool:
        """Backward is done with the outputs (read by the census, which keeps this weakly)."""
        return self.discarded and not self.outputs

    def _name(self) -> str:
        return callable_name(self.fn) if self.fn is not None else "CheckpointWithoutOutput"

    def _refuse_discard(self) -> None:
        """Raise where this checkpoint cannot be discarded; frees nothing. A manager asks each
        of its checkpoints before it frees the first (docs/discard.md: a refused discard
        frees nothing)."""
        if self.fn is None:
            raise CheckpointError(
                "discard_output_and_register_recompute was called before checkpoint()",
                expected="ckpt.checkpoint(fn, *args) first, then the discard",
                got="a discard with nothing checkpointed",
                tip="call checkpoint() on this object for the op whose output is to be freed")
        if not self.checkpointed:
            # fn is set once the arguments are accepted; a refusal of fn's output, or fn's own
            # error, comes later and leaves no graph node: a discard registered then found no
            # graph in backward, and was reported as one freed.
            raise CheckpointError(
                f"the output of {self._name()} cannot be discarded: its checkpoint() raised",
                expected="a checkpoint() that returned the output, then its discard",
                got="a discard of an op whose checkpoint() was refused or failed: nothing is "
                    "checkpointed to free or rebuild",
                tip="fix what checkpoint() raised, and checkpoint the op again with a new "
                    "CheckpointWithoutOutput")
        if self.discarded:
            raise CheckpointError(f"the output of {self._name()} was already discarded",
                                  expected="one discard", got="a second discard",
                                  tip="discard each checkpoint once (a manager discards all)")
        for path, out, version in zip(self._paths(), self.outputs, self.versions):
            if out._version != version:
                raise CheckpointError(
                    f"{path} of {self._name()} was changed in place before its discard",
                    expected="the output as the op made it", got="an in-place change (relu_, "
                    "mul_, ...) by a consumer", tip="the rebuild would write the op's own "
                    "result back under the consumer: make the consumer out of place, or do not "
                    "discard this output")

    def _discard_output(self) -> None:
        """Free each output's storage (NOTE [discard lifetimes] 2). Private: freeing without
        registering the rebuild leaves the consumer's backward reading freed memory, so it
        only comes with a registration (``discard_output_and_register_recompute``, or a
        manager's unified one)."""
        self._refuse_discard()  # before anything is freed
        self.discarded = True
        if self.passthrough:
            return
        self.census = active_census()
        for out, outside in zip(self.outputs, self.made_outside):
            if outside and rebuilt_by_parts(out):
                # NOTE [a wrapper subclass's bytes are its inner tensors']: no storage of its
                # own to free (made_outside files it as outside); kept, as eager keeps it.
                # Warned once per class: a discard runs every layer of every step.
                if type(out) not in _WARNED_WRAPPERS:
                    _WARNED_WRAPPERS.add(type(out))
                    log.warning("output of %s is a %s, a wrapper subclass whose bytes are its "
                                "inner tensors': kept, nothing freed; discard the op on its "
                                "local tensor (DTensor.to_local()) to free them",
                                self._name(), type(out).__name__)
                self.sizes.append(0)
                continue
            if outside and out.layout != torch.strided:
                # A sparse output (a learned adjacency built with sparse_coo_tensor) has no
                # storage of its own either (helper NM: the debug line below called it an
                # alias, and nothing said it was kept). Warned once per layout.
                if out.layout not in _WARNED_LAYOUTS:
                    _WARNED_LAYOUTS.add(out.layout)
                    log.warning("output of %s is a %s tensor, which has no storage of its own "
                                "to free: kept, nothing freed; discard the op that makes its "
                                "values instead", self._name(), out.layout)
                self.sizes.append(0)
                continue
            if outside:
                log.debug("output of %s aliases an input or state outside it: kept",
                          self._name())
                self.sizes.append(0)
                continue
            # Read only for what is freed: a wrapper kept above has no storage of its own.
            storage = out.untyped_storage()
            self.sizes.append(storage.nbytes())
            if self.census is not None:
                self.census._note_discarded(out, keeper=self)
            # NOTE [discarded storages are marked]
            setattr(storage, DISCARDED_MARK, self._name())
            setattr(storage, _DISCARDED_BY, weakref.ref(self))
            storage.resize_(0)

    @_eager
    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor, /) -> None:
        """Free the outputs now; rebuild them when ``hook_tensor``'s gradient is computed."""
        if not self.passthrough:
            check_hook_tensor(hook_tensor, self._name())
            refuse_discarded_hook(hook_tensor, [self])
        self._discard_output()
        if not self.passthrough:
            register_rebuild(hook_tensor, self._hook)  # NOTE [a hook tensor that is a view]

    @_eager
    def _hook(self, grad: torch.Tensor) -> None:
        # Eager, as the boundary's replay (_backward_opaque in boundary_function.py): under
        # compiled autograd dynamo traced it, to a graph break that hid the refusal below.
        # A create_graph backward reaching the consumer (a penalty on its weight's gradient)
        # would build its gradient's graph on the rebuilt output: the penalty's own backward
        # then needs a second replay. Refused here, naming create_graph, not there.
        refuse_double_backward(lambda: f"the output-discard checkpoint of {self._name()}",
                               discard=True)
        if self.rebuilt_early:  # by the op it feeds (NOTE [chained discards in any order])
            self.rebuilt_early = False
            return
        self._replay()

    def _replay(self) -> bool:
        """Rebuild the outputs; ``False`` when the node is gone (nothing to rebuild for)."""
        if torch.is_inference_mode_enabled():  # NOTE [a backward run under inference mode]
            with outside_inference_mode():
                return self._replay()
        if self.replayed:
            raise CheckpointError(f"the output of {self._name()} was already replayed",
                                  expected="one replay per forward", got="a second replay",
                                  tip="a graph backpropagated twice (retain_graph=True, or a "
                                  "split backward: an input pass, then a weight pass, as "
                                  "zero-bubble pipeline schedules run) needs the output twice: "
                                  "leave this op undiscarded there, or run it inside a "
                                  "checkpointed layer, whose every replay discards and rebuilds "
                                  "it anew")
        self.replayed = True
        # Held from here on: read twice, a collection in between could free the node after
        # the first read said it lived. Set by every checkpoint() that returned and was not a
        # passthrough, the only ones a discard registers (_refuse_discard).
        ctx = self.ctx() if self.ctx is not None else None
        if ctx is None:
            return False  # its node is gone: nothing reads its output (NOTE [discard lifetimes] 3)
        if self.bound is not None:  # NOTE [a module rebound before the replay] (rebound.py)
            refuse_rebound(self.fn, self.bound, what="CheckpointWithoutOutput.checkpoint")
        if self.held is not None:  # NOTE [an output discard's arguments]
            assert self.fn is not None
            refuse_held_replaced(self.fn, *self.held)
        watched, param_before = self.param_versions, None
        if watched is not None:
            assert self.params is not None
            param_before = refuse_parameters_changed(
                watched, self.params, self._name,
                self.forward_modules.roots if self.forward_modules is not None else [])
        try:
            saved_tensors = ctx.saved_tensors
        except RuntimeError as error:
            _refuse_compiled_autograd(self._name(), error)
            raise
        for t in saved_tensors:  # a sparse input has no storage, and is never discarded
            if t.layout is torch.strided and t.numel() and not t.untyped_storage().nbytes():
                # NOTE [chained discards in any order]: discards of chained ops, each its own
                # object, registered on one tensor: hooks run in their registration order, so
                # a later op's rebuild may run first and find its input, the earlier op's
                # output, still freed (helper HO: refused, blaming a .detach()). That op
                # rebuilds now, and its own hook, when it runs, finds nothing to do.
                by = dunder(t.untyped_storage(), _DISCARDED_BY)
                producer = by() if callable(by) else None
                if isinstance(producer, CheckpointWithoutOutput) and \
                        not producer.replayed and producer._replay():
                    producer.rebuilt_early = True
                    continue
                raise CheckpointError(
                    f"an input of {self._name()} is a discarded output that nothing can rebuild: "
                    "the op that made it has no graph any more (it reached this op only "
                    "through .detach(), and the caller dropped it)",
                    expected="a discarded output given to the next op as it is, or kept",
                    got="its storage freed, and its op's graph gone",
                    tip="pass the output itself to the next op (not .detach()), or hold it until "
                        "backward")
        saved = iter(saved_tensors)
        self.detached = []
        assert self.env is not None and self.fn is not None
        with ExitStack() as stack:
            stack.enter_context(self.env.replaying())
            stack.enter_context(IsolatedPass(cached=self.env.parametrize_cached))
            stack.enter_context(rebuilding())  # NOTE [a discard's rebuild opens no window]
            sets = replay_watch(self.generator_sets)
            if sets is not None:  # NOTE [a forward that sets a default generator's state]
                stack.enter_context(sets)
            changes = self.forward_modules.changes() if self.forward_modules else None
            if changes is not None:
                assert self.forward_modules is not None
                stack.enter_context(self.forward_modules.reinstated(changes))
            if self.changed_state is not None:  # NOTE [discard lifetimes] 5
                stack.enter_context(self.changed_state.on_copies())
            if self.changed_numbers is not None:  # NOTE [numbers and flags as the forward began]
                stack.enter_context(self.changed_numbers.as_forward_began(
                    self._name(),
                    self.forward_modules.roots if self.forward_modules is not None else ()))
            args = []
            given = []  # the tensors fn gets, by input slot
            kinds = iter(self.tensor_kinds)
            for is_tensor, other in zip(self.arg_kinds, self.non_tensor_args):
                if not is_tensor:
                    args.append(other)
                    continue
                t, kind = next(saved), next(kinds)
                d = t.detach()
                if kind is not None and type(d) is not kind.cls:
                    # its own __torch_function__ made the detach plain (NOTE [subclasses come
                    # back as themselves] in subclass.py): fn computes with its class, as eager
                    d = as_kind(d, kind, attributes=False)
                d.requires_grad_(t.requires_grad)
                self.detached.append(d)
                # a non-leaf alias, as in the boundary's replay (module input-gradient hooks;
                # NOTE [tensors of other layouts] in tree.py), with its class and attributes as
                # the forward began (discard_function.py)
                a = alias(d) if d.requires_grad else d
                given.append(a if kind is None else alias_as_kind(a, d, kind))
                args.append(given[-1])
            handles_before = handles_made()
            hooks = self.forward_hooks
            hooks_held = hooks.before_replay() if hooks is not None else []
            try:
                outputs = self.fn(*args, **self.kwargs)
            finally:  # settled even where the rebuild raises (helper QI)
                if hooks is not None:
                    hooks.drop_repeated(handles_before, given, hooks_held)
        if self.held is not None:  # NOTE [an output discard's arguments]: an op that moves
            # its modules at each call (appends one) ran others in the rebuild (helper RQ)
            refuse_held_replaced(self.fn, *self.held, rebuilt=True)
            self.held = None
        # One replay per forward: the buffers' snapshots served it (freed now, as the census
        # reads them: module state, held until the outputs are rebuilt and handed over).
        self.changed_state = self.changed_numbers = None
        # NOTE [hooks the forward registers on its parameters and inputs]: served too (a kept
        # discard object held the hooks' closures and parameters: helper QB); and this
        # module's later calls need no watch of NOTE [a gradient inside the forward reaching
        # the graph before the call] (inner_backward.py).
        self.forward_hooks = None
        if self.forward_modules is not None:
            mark_discard_rebuilt(self.forward_modules.roots)
        self.tensor_kinds = []  # attributes may hold tensors (helper MQ)
        if watched is not None and param_before is not None:  # its own moves, counted
            assert self.params is not None
            watched.replayed(self.params, param_before)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        if len(outputs) != len(self.outputs):
            raise ReplayMismatchError(
                f"the replay of {self._name()} returned another number of outputs",
                expected=len(self.outputs), got=len(outputs),
                tip="a discarded op must return the same outputs in its replay")
        # Never discarded (backward replays it all the same): nothing freed, nothing to refill,
        # but the outputs are checked as a discarded one's are.
        sizes = self.sizes or [0] * len(outputs)
        for index, (original, new, size) in enumerate(zip(self.outputs, outputs, sizes)):
            if new.shape != original.shape or new.dtype != original.dtype:
                raise ReplayMismatchError(
                    f"the replay of {self._name()} returned another shape or dtype at "
                    f"output[{index}]",
                    expected=f"{tuple(original.shape)} {original.dtype}",
                    got=f"{tuple(new.shape)} {new.dtype}",
                    tip="a discarded op must be deterministic in shape")
        if self.prints is not None:  # before any refill: a refused rebuild changes nothing
            self.prints.check(outputs, self._paths, fn=self._name(),
                              preserve_rng=self.preserve_rng_state)
        for original, new, size in zip(self.outputs, outputs, sizes):
            if size:
                storage = original.untyped_storage()
                storage.resize_(size)
                with torch.no_grad():
                    storage.copy_(new.untyped_storage())
                if self.census is not None:
                    self.census._note_refilled(original)
                check_rebuilt(storage)  # NOTE [a hooked output the replay discarded]
        self.recomputed = outputs
        return True
