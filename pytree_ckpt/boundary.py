"""The PyTree-aware reentrant checkpoint boundary.

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` once under no-grad (the *original pass*) and
again during backward (the *replay*), exactly like torch's reentrant checkpoint, but:

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
``retain_graph=True``, then fails). The attributes those pre-hooks name (tensors that require
grad, in the module's own ``__dict__``; NOTE [only attributes a pre-hook names] in
module_state.py) are extra inputs of the Function, after the call's inputs, and the replay sees
detached aliases of this call's tensors in their place: their gradients leave through the
boundary into their own graphs, as in eager. A custom pre-hook that sets such an attribute is
not recognized and behaves as before this note (one call per backward works).

NOTE [unknown callables]: for any other callable the parameters it closes over cannot be known,
so the replay accumulates every leaf's gradient with ``torch.autograd.backward``, as torch's
reentrant checkpoint does; when no input requires grad a tiny requires-grad *anchor* makes the
backward run. Such a replay cannot honour ``torch.autograd.grad`` or ``backward(inputs=...)``:
those raise ``CheckpointError`` instead of returning partial results.

What the boundary knows of the modules a call uses (their parameters and buffers, cached, and
the state the original pass changes) is in ``module_state.py``.

NOTE [when there is no boundary]: with grad disabled (``no_grad``, ``inference_mode``), under a
``torch.func`` transform (``grad``, ``vmap``, ``vjp``: it builds its own graph), or when
nothing can receive a gradient (no input requires grad and ``fn`` belongs to a module with no
trainable parameter), ``fn`` is just called: no node, no frame, phase unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from .census import Mechanism, census_active, report_held
from .errors import CheckpointConfigError, CheckpointError, ReplayMismatchError, validate_bool
from .frames import Frame, callable_name
from .keep import KeepMode, KeepPolicy
from .module_state import (ChangedState, ForwardModules, ModuleDicts, StateWatch, any_lazy,
                           collect_parameters, foreign_leaf, graph_attributes, is_verified,
                           mark_verified, module_dicts, owning_module, versions,
                           warn_forward_hooks)
from .phase import ACTIVE, Invocation, Phase
from .rng import IsolatedPass, ReplayEnvironment
from .saved import Unchanged
from .tree import (CONTAINER, ITERATOR, describe_leaf, first_difference, flatten, flatten_call,
                   hidden_tensor, leaf_kind, leaf_paths, unflatten)

if TYPE_CHECKING:  # offload imports this package's errors: no import cycle at run time
    from offload import OffloadManager

__all__ = ["BoundaryOptions", "checkpoint", "checkpointed"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
_STILL_LAZY = "_pytree_ckpt_still_lazy"  # a module warned about lazy state its call left lazy


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryOptions:
    """Options of a boundary; they never travel as keywords of ``fn``.

    ``offload``: a manager that opens a window over the boundary's input tensor leaves at each
    call, so the inputs it saves (hidden states, top-k ids) go to host memory until backward.
    ``keep``: the ops whose outputs stay resident instead of being recomputed (save units);
    ``apply_recompute_config`` builds it from a ``RecomputeConfig``, not user code.
    """

    preserve_rng_state: bool = True
    offload: OffloadManager | None = None
    keep: KeepPolicy | None = None  # what stays resident (apply_recompute_config builds it)

    def __post_init__(self) -> None:
        validate_bool(self.preserve_rng_state, name="preserve_rng_state")


DEFAULT_OPTIONS = BoundaryOptions()
_anchor_tensor: torch.Tensor | None = None


def _anchor() -> torch.Tensor:
    # A constant, never receives a gradient (backward returns None for it): no step state.
    global _anchor_tensor
    if _anchor_tensor is None:
        _anchor_tensor = torch.empty(0, requires_grad=True)
    return _anchor_tensor


def _returned_as_is(before: dict[int, torch.Tensor], inputs: tuple[torch.Tensor, ...],
                    outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Outputs that existed before the call and require no grad: inputs, and the frozen
    parameters and buffers in ``before`` (taken before ``fn`` ran).

    NOTE [outputs made before the call], continued: eager hands such a tensor back untouched.
    Marked non-differentiable it stays so: autograd neither gives it this node nor makes it
    require grad (a buffer would otherwise join every step's graph, and keep it alive). The
    snapshot must predate ``fn``: a result ``fn`` stores into a buffer slot and returns is
    fresh, and needs its gradient.
    """
    as_is = []
    for t in outputs:
        if not t.requires_grad and (before.get(id(t)) is t or any(t is x for x in inputs)):
            as_is.append(t)
    return as_is

class _Call:
    """Everything one boundary call needs for its replay, minus the tensors themselves."""

    __slots__ = ("fn", "options", "in_spec", "in_leaves", "in_tensor_index", "in_slots",
                 "n_inputs", "params", "owner", "out_spec", "out_leaves", "out_tensor_index",
                 "out_meta", "frame", "env", "original_call", "reported", "before", "as_is",
                 "attributes", "buffer_dicts", "frozen", "changed_state", "modules",
                 "forward_modules")

    def __init__(self, fn: Callable[..., Any], options: BoundaryOptions, in_spec: Any,
                 in_leaves: list[Any], in_tensor_index: list[int], in_slots: list[int]) -> None:
        self.fn = fn
        self.options = options
        self.in_spec = in_spec
        self.in_leaves = in_leaves  # tensor leaves replaced by None (NOTE [what is saved])
        self.in_tensor_index = in_tensor_index
        self.in_slots = in_slots
        self.n_inputs = 0
        # Names of the owner's attributes passed as inputs after the call's own (NOTE
        # [attributes set before the call]).
        self.attributes: list[str] = []
        self.params: list[torch.Tensor] | None = None  # None: an unknown callable
        self.owner: nn.Module | None = None
        self.frame = Frame()
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_tensor_index: list[int] = []
        self.out_meta: list[tuple[torch.Size, torch.dtype]] = []
        self.env: ReplayEnvironment | None = None
        # The caller's own args and kwargs, for the original pass only (then dropped): fn sees
        # the very containers it was given, as in eager; the replay gets rebuilt containers.
        self.original_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.reported = False  # an ActivationCensus watches this call's frame
        # Frozen parameters and buffers by id, taken before fn runs; for the original pass only.
        self.before: dict[int, torch.Tensor] | None = None
        # Inputs the original pass returned as they are, by output position; for run_boundary
        # only (then dropped).
        self.as_is: list[tuple[int, torch.Tensor]] | None = None
        # The modules' buffers, by submodule, and frozen parameters; for the original pass
        # only (then dropped).
        self.buffer_dicts: list[dict[str, torch.Tensor | None]] = []
        self.frozen: list[torch.Tensor] = []
        # What the original pass changed of the modules' state (NOTE [state the forward
        # changes] in module_state.py); None when it changed nothing.
        self.changed_state: ChangedState | None = None
        # The modules fn uses and their dicts, for the original pass only (then dropped); what
        # they were then, for the replay (NOTE [the replay sees the forward's modules]).
        self.modules: tuple[list[nn.Module], list[ModuleDicts]] | None = None
        self.forward_modules: ForwardModules | None = None

    def inputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.in_leaves)
        for index, slot in zip(self.in_tensor_index, self.in_slots):
            leaves[index] = tensors[slot]
        args, kwargs = unflatten(self.in_spec, leaves)
        return args, kwargs

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.out_leaves)
        for index, tensor in zip(self.out_tensor_index, tensors):
            leaves[index] = tensor
        return unflatten(self.out_spec, leaves)

    def check_replay(self, spec: Any, leaves: list[Any], tensor_index: list[int]) -> None:
        if (spec is self.out_spec or spec == self.out_spec) and \
                tensor_index == self.out_tensor_index and \
                all(leaves[i].shape == shape and leaves[i].dtype == dtype
                    for i, (shape, dtype) in zip(tensor_index, self.out_meta)):
            return  # the usual case; what follows finds and names the first difference
        name = _fn_name(self.fn)
        tip = ("the replay must return what the original pass returned; make the output depend "
               "only on the inputs (not on current_phase() or grad mode)")
        if spec != self.out_spec:
            path, expected, got = first_difference(self.out_spec, spec, root="output")
            raise ReplayMismatchError(
                f"the replay of {name} returned a different output structure at {path}",
                expected=expected, got=got, tip=tip)
        paths: list[str] | None = None
        if tensor_index != self.out_tensor_index:
            paths = leaf_paths(spec, root="output")
            first = min(set(tensor_index) ^ set(self.out_tensor_index))
            raise ReplayMismatchError(
                f"the replay of {name} returned a different kind of leaf at {paths[first]}",
                expected="a tensor" if first in self.out_tensor_index else "a non-tensor leaf",
                got=describe_leaf(leaves[first]), tip=tip)
        for index, (shape, dtype) in zip(tensor_index, self.out_meta):
            leaf = leaves[index]
            if leaf.shape != shape or leaf.dtype != dtype:
                paths = paths or leaf_paths(spec, root="output")
                raise ReplayMismatchError(
                    f"the replay of {name} returned a different tensor at {paths[index]}",
                    expected=f"Tensor(shape={tuple(shape)}, dtype={dtype})",
                    got=describe_leaf(leaf),
                    tip=tip + "; for results that may change between passes (top-k ids, MoE "
                              "routing) use reuse_during_recompute")


def _refuse_hidden_outputs(call: _Call, spec: Any, leaves: list[Any], tensor_index: list[int],
                           inputs: Sequence[torch.Tensor]) -> None:
    """NOTE [leaves that hold tensors] (tree.py), for outputs: a floating tensor that ``fn``
    computed (under no-grad, so it requires none) inside an output leaf the bridge does not
    open never becomes an output of the Function: it leaves without gradient, and eager's
    gradient through it silently goes missing. Refused in the original pass, naming its path.
    Not refused: a leaf that is one of the inputs (an object passed on, a cache), and tensors
    that require grad or are known from before the call (parameters, buffers, the call's own
    input tensors: eager hands back those very tensors too), or frozen results of
    ``reuse_during_recompute`` (frozen when returned bare too: NOTE [frozen results returned
    as outputs])."""
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
            f"{_fn_name(call.fn)} returned a {type(leaf).__name__} at {path} that holds a "
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


def _refuse_unreadable_inputs(fn: Callable[..., Any], spec: Any, leaves: list[Any], *,
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
    graph torch's "backward through the graph a second time"). Plain objects (a key/value
    cache) are passed as they are, as documented, except with ``use_cache=True`` among the
    keywords: NOTE [a cache filled twice]."""
    for index, leaf in enumerate(leaves):
        if leaf is None or isinstance(leaf, (torch.Tensor, nn.Module, int, float, str)):
            continue
        sort = leaf_kind(leaf)
        if sort is not ITERATOR and kwargs_use_cache and not _holds_no_state(leaf):
            # NOTE [a cache filled twice]: a key/value cache object (transformers' DynamicCache)
            # with use_cache=True is appended to by the original pass and again by the replay.
            # The replay's attention then reads the keys the no-grad original pass stored
            # (same values, same shapes, so nothing fails): the key and value projections get
            # no gradient, silently. transformers' own checkpointing turns use_cache off.
            # Immutable values (a dtype, a device, an enum, a function) cannot be filled and
            # pass: such a call (a GPT-2 style layer returning its new keys) is legitimate.
            path = _readable(leaf_paths(spec, root="inputs")[index])
            raise CheckpointError(
                f"{_fn_name(fn)} was called with use_cache=True and an object at {path} "
                f"({type(leaf).__name__}); the original pass fills that cache and the replay in "
                "backward fills it again, and may read what the no-grad original pass stored "
                "(transformers' attention does): gradients through it would be silently "
                "missing",
                expected="use_cache=False while training", got="use_cache=True",
                tip="pass use_cache=False in training (with transformers, "
                    "model.config.use_cache = False or model(..., use_cache=False))")
        if sort is CONTAINER:
            found = hidden_tensor(leaf, _requires_grad)
            if found is not None:
                path = _readable(leaf_paths(spec, root="inputs")[index])
                kind = type(leaf).__name__
                raise CheckpointError(
                    f"{_fn_name(fn)} was given a {kind} at {path} that holds a tensor that "
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
                f"{_fn_name(fn)} was given an iterator at {path}; the original pass consumes "
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


def _input_path(spec: Any, tensor_index: list[int], slots: list[int], slot: int) -> str:
    """The key path of the first input leaf that is unique input ``slot``, e.g. ``args[0]`` or
    ``kwargs['dsa_topk_ids']`` (for messages; computed only when one is needed)."""
    return _readable(leaf_paths(spec, root="inputs")[tensor_index[slots.index(slot)]])


def _fn_name(fn: Callable[..., Any]) -> str:
    owner = owning_module(fn)
    if owner is not None:
        return type(owner).__name__
    return callable_name(fn)


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor | None, *inputs: torch.Tensor) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)
        tensors = inputs[: call.n_inputs]  # the rest are parameters (NOTE [parameters are inputs])
        call.env = ReplayEnvironment.capture(tensors, preserve_rng=call.options.preserve_rng_state)
        # NOTE [skipped work keeps the RNG in step] (frames.py): the generators it restores.
        call.frame.rng_devices = call.env.rng_devices()
        assert call.original_call is not None
        args, kwargs = call.original_call
        call.original_call = None
        invocation = Invocation(Phase.FORWARD, call.frame, ACTIVE.get())
        input_versions = versions(tensors)
        watch = StateWatch(call.buffer_dicts, call.frozen) if call.owner is not None else None
        token = ACTIVE.set(invocation)
        try:
            # NOTE [each pass caches its own parametrizations] and NOTE [no fast path by grad
            # mode] in rng.py.
            with IsolatedPass():
                if call.options.keep is None:
                    output = call.fn(*args, **kwargs)
                else:
                    with KeepMode(call.options.keep, invocation):
                        output = call.fn(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
        moved = [slot for slot, version in enumerate(versions(tensors))
                 if version != input_versions[slot]]
        # NOTE [attributes set before the call]: saved with the inputs, after them.
        saved = inputs[: call.n_inputs + len(call.attributes)]
        if moved:
            _raise_input_changed(call, tensors, moved)
        if watch is not None:
            call.changed_state = watch.changed()
        if call.modules is not None:
            call.forward_modules = ForwardModules(*call.modules)
        call.buffer_dicts, call.frozen, call.modules = [], [], None
        flat = flatten(output)
        if len(flat.tensor_index) < len(flat.leaves):
            _refuse_hidden_outputs(call, flat.spec, flat.leaves, flat.tensor_index, tensors)
        # NOTE [outputs made before the call]: the original pass runs under no-grad, so an
        # output that requires grad (a parameter, or a graph tensor fn closed over) existed
        # before fn ran. Returned as it is, autograd would attach this node to that very tensor
        # (a parameter would stop being a leaf, and a later backward would loop through it).
        # It leaves as an alias instead. Inputs returned as they are, autograd aliases itself.
        out_tensors = tuple(t.view_as(t) if t.requires_grad else t
                            for t in (flat.leaves[i] for i in flat.tensor_index))
        as_is = _returned_as_is(call.before or {}, tensors, out_tensors)
        call.before = None
        call.out_spec = flat.spec
        call.out_tensor_index = flat.tensor_index
        call.out_meta = [(t.shape, t.dtype) for t in out_tensors]
        call.out_leaves = flat.leaves
        for index in flat.tensor_index:
            call.out_leaves[index] = None
        frozen = [t for t in out_tensors if not (t.is_floating_point() or t.is_complex())]
        if call.frame.results and len(frozen) < len(out_tensors):
            # NOTE [frozen results returned as outputs]: a float result of
            # reuse_during_recompute returned as it is (router probabilities for statistics)
            # is known to be frozen. Given this node, the recorded tensor itself would carry
            # it, and the replay, which returns that very tensor, would find its own node on
            # it. It leaves non-differentiable and untouched, as in eager.
            recorded = {id(t) for t in call.frame.tensors()}
            frozen += [t for t in out_tensors if (t.is_floating_point() or t.is_complex())
                       and not t.requires_grad and id(t) in recorded]
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
        ctx.save_for_backward(*saved)
        return out_tensors

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        refuse_double_backward(lambda: f"the boundary around {_fn_name(call.fn)}")
        changes = call.forward_modules.changes() if call.forward_modules is not None else None
        if call.changed_state is None and changes is None:
            return _replay_backward(ctx, call, grad_outputs)
        with ExitStack() as stack:
            # The forward's modules first (NOTE [the replay sees the forward's modules]), so
            # that put_back saves and restores the very tensors the replay changes (a buffer
            # torch.func.functional_call passed in), and so that what runs in the replay's
            # backward (an output discard's rebuild) sees them too.
            if changes is not None:
                assert call.forward_modules is not None
                stack.enter_context(call.forward_modules.reinstated(changes))
            if call.changed_state is not None:
                stack.enter_context(call.changed_state.put_back())
            return _replay_backward(ctx, call, grad_outputs)


def _replay_backward(ctx: Any, call: _Call, grad_outputs: tuple[torch.Tensor | None, ...]) -> Any:
    """The replay of ``call`` and the gradients of its inputs (and parameters)."""
    explicit = call.params is not None
    if not explicit and not torch.autograd._is_checkpoint_valid():
        raise CheckpointError(
            f"the boundary around {_fn_name(call.fn)} was reached by torch.autograd.grad() "
            "or backward(inputs=...)",
            expected="a module (or a method of one) as fn, or loss.backward()",
            got="an arbitrary callable under a restricted backward",
            tip="wrap a module (pytree_ckpt.checkpoint(module, ...) or "
                "apply_activation_checkpointing) so its parameters are known, or call "
                "loss.backward() and read .grad")
    needs = ctx.needs_input_grad[2:]
    n = call.n_inputs + len(call.attributes)
    detached = tuple(t.detach().requires_grad_(need)
                     for t, need in zip(ctx.saved_tensors, needs[:n]))
    call.frame.start_replay()
    assert call.env is not None
    invocation = Invocation(Phase.RECOMPUTE, call.frame, ACTIVE.get())
    token = ACTIVE.set(invocation)
    try:
        with call.env.replaying(), IsolatedPass():
            # fn sees non-leaf aliases (made with grad enabled): module hooks watching their
            # inputs' gradients (FSDP, FlopCounterMode's module tracker) cannot hook a leaf
            # under torch.autograd.grad.
            aliases = tuple(d.view_as(d) if d.requires_grad else d for d in detached)
            args, kwargs = call.inputs(aliases)
            hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            if not (hooked or call.attributes or call.options.keep is not None):
                output = call.fn(*args, **kwargs)  # the usual case, with no context more
            else:
                with ExitStack() as stack:
                    if hooked:
                        # Shadow an ambient hook (offload, census): the replay's short-lived
                        # graph is not theirs to see. Only then: the hooks cost ~1 us per saved
                        # tensor. NOTE [hooks switch off the in-place check] in saved.py:
                        # Unchanged checks.
                        stack.enter_context(
                            torch.autograd.graph.saved_tensors_hooks(Unchanged, Unchanged.get))
                    if call.attributes:
                        assert call.owner is not None
                        stack.enter_context(_attributes_set(call.owner, call.attributes,
                                                            aliases[call.n_inputs:]))
                    if call.options.keep is not None:
                        stack.enter_context(KeepMode(call.options.keep, invocation))
                    output = call.fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as error:
        # An error only the replay meets has two usual causes: an argument the original pass
        # changed (a key/value cache object it appended to; containers are rebuilt, but the
        # objects in them are passed as they are), or code that behaves otherwise with grad
        # enabled (the replay's mode; a fullgraph compile that cannot trace it). The error
        # keeps its type (an out-of-memory error stays one); the note says where it came from
        # and names the first cause only as a possibility.
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(
                f"pytree_ckpt: raised by the replay of {_fn_name(call.fn)} in backward, which "
                "runs the forward again on the same arguments, with grad enabled. If the "
                "error does not come from grad mode, check for an object the forward changed "
                "(a key/value cache it filled): the replay sees it as the forward left it. "
                "Tip: pass use_cache=False in training, or keep such state outside the "
                "checkpointed call.")
        raise
    finally:
        ACTIVE.reset(token)
    call.frame.check_consumed()
    flat = flatten(output)
    call.check_replay(flat.spec, flat.leaves, flat.tensor_index)
    outs, grads = [], []
    for index, grad in zip(flat.tensor_index, grad_outputs):
        out = flat.leaves[index]
        if out.grad_fn is ctx:
            _raise_attached_to_outside_tensor(call, flat.spec, index)
        if grad is not None and out.requires_grad:
            outs.append(out)
            grads.append(grad)
    # NOTE [frame lifetime]: without retain_graph this node never runs again (autograd frees
    # its saved tensors right after it), so its frame is cleared as soon as its own backward
    # is done, not when the whole backward call is (a callback at the end of the graph task,
    # as before): with offload, the frozen results (top-k ids) come back to the device for
    # the replay, and frames held to the end of backward kept every already-replayed layer's
    # restored ids there, O(layers) device memory at the tail of backward. keep_graph is read
    # here, in the outer task (the inner backward below is a task of its own); the frame is
    # cleared after that inner backward, in which a nested boundary's replay may still read
    # it. (The census reads frame.released as "this invocation no longer holds its inputs".)
    release = bool(call.frame.results or call.reported) and \
        not torch._C._autograd._get_current_graph_task_keep_graph()
    if not explicit:
        if outs:
            torch.autograd.backward(outs, grads)
        if release:
            call.frame.clear()
        return (None, None, *(d.grad if need else None for d, need in zip(detached, needs)))
    assert call.params is not None
    wrt = [*detached, *call.params]
    # A parameter frozen since the forward (requires_grad_(False) before backward) gets no
    # gradient, as in eager, where its AccumulateGrad then does nothing.
    wanted = [i for i, need in enumerate(needs) if need and wrt[i].requires_grad]
    if outs and call.owner is not None and \
            not is_verified(call.owner):
        _verify_leaves(call, outs, wrt)
    result: list[torch.Tensor | None] = [None] * len(wrt)
    if outs and wanted:
        with ParameterHooksPaused(call.params):
            got = torch.autograd.grad(outs, [wrt[i] for i in wanted], grads,
                                      allow_unused=True)
        for i, grad in zip(wanted, got):
            result[i] = grad
    if release:
        call.frame.clear()
    return (None, None, *result)


def _raise_input_changed(call: _Call, tensors: Sequence[torch.Tensor], moved: list[int]) -> None:
    paths = [_input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot)
             for slot in moved]
    views = any(tensors[slot]._base is not None for slot in moved)
    where = paths[0] if len(paths) == 1 else "one of " + ", ".join(paths)
    shared = (" (views share their base's version counter: the write may have gone to another "
              "view of the same tensor)" if views else "")
    raise CheckpointError(
        f"{_fn_name(call.fn)} changed its input {where} in place{shared}; the replay would run "
        "on the changed tensor and give wrong gradients",
        expected="inputs left as they are", got="a version counter moved by the original pass",
        tip="clone the input inside the layer before changing it (x = x.clone()), or make the "
            "change outside the checkpointed call")


class ParameterHooksPaused:
    """NOTE [parameter hooks run once]: ``torch.autograd.grad`` runs a leaf's tensor hooks
    (``param.register_hook``) on the gradient it captures, and autograd runs them again when
    the returned gradient reaches the parameter in the outer backward: a hook that scales or
    masks would apply twice. Paused for the replay's ``grad``, they run once, where eager runs
    them. The hook dict is emptied and refilled in place: autograd's hook object reads it at
    call time, so nothing is re-registered. (A plain class: entered once per layer call.)
    """

    __slots__ = ("stash",)

    def __init__(self, params: Sequence[torch.Tensor], /) -> None:
        self.stash = [(hooks, list(hooks.items())) for p in params
                      if (hooks := p._backward_hooks)]

    def __enter__(self) -> None:
        for hooks, _ in self.stash:
            hooks.clear()

    def __exit__(self, *exc: object) -> None:
        for hooks, items in self.stash:
            hooks.update(items)


@contextmanager
def _attributes_set(module: nn.Module, names: Sequence[str],
                    tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """``module``'s attributes ``names`` set to ``tensors`` for the block (NOTE [attributes
    set before the call]); what they held before is put back after it."""
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


def _raise_attached_to_outside_tensor(call: _Call, spec: Any, index: int) -> None:
    # NOTE [outputs made before the call]: a tensor from outside that requires no grad and is
    # neither an input nor known to belong to the module cannot be told from a fresh result;
    # autograd gave it this node. The replay returns the very same tensor, still carrying this
    # node: backpropagating through it would re-enter this backward without end.
    path = leaf_paths(spec, root="output")[index]
    raise CheckpointError(
        f"{path} of {_fn_name(call.fn)} is a tensor from outside the call (not computed by it, "
        "not one of its inputs), and the boundary attached itself to it",
        expected="tensors computed by fn, its inputs, or buffers and parameters of the module "
                 "fn belongs to", got="the same outside tensor, returned again by the replay",
        tip="return a clone (t.clone()) of it, or checkpoint the module itself "
            "(pytree_ckpt.checkpoint(module, ...)) so its buffers are known")


def _verify_leaves(call: _Call, outs: list[torch.Tensor], wrt: list[torch.Tensor]) -> None:
    # NOTE [parameters are inputs]: once per module, on its first replay. A parameter of the
    # modules that was frozen in the forward and unfrozen since gets no gradient, as in eager
    # (it was not in the forward's graph): known, not foreign.
    known = {id(t) for t in wrt}
    if call.forward_modules is not None:
        known.update(id(t) for _, entries in call.forward_modules.entries
                     for t in entries.values())
    foreign = foreign_leaf(outs, known)
    assert call.owner is not None
    if foreign is not None:
        _refuse_fsdp_units_inside(call.owner)
        raise CheckpointError(
            f"the forward of {type(call.owner).__name__} uses a tensor that requires grad but is "
            "neither an input nor a parameter of the module; it would get no gradient",
            expected="inputs, and parameters of the module or of modules passed as arguments",
            got=f"Tensor(shape={tuple(foreign.shape)}, dtype={foreign.dtype})",
            tip="pass the tensor (or the module owning it) as an argument, or register it as a "
                "parameter of a submodule")
    # fn is the module itself (checkpoint(module, x)): its own hooks run inside the boundary.
    # So do those of a module passed as an argument, when fn calls it.
    passed = [leaf for leaf in call.in_leaves if isinstance(leaf, nn.Module)]
    warn_forward_hooks(call.owner, passed, own=call.fn is call.owner)
    mark_verified(call.owner)


def _refuse_fsdp_units_inside(owner: nn.Module) -> None:
    """NOTE [FSDP units inside a boundary]: a submodule that is an FSDP2 unit of its own swaps
    its parameters in its hooks, which run *inside* the boundary: the boundary collects its
    sharded parameters (DTensors, which the replay never uses) and the replay all-gathers
    unsharded ones that ``torch.autograd.grad`` would leave without gradient. Found as a
    foreign leaf at the first replay; said here in FSDP's terms, with the two ways out."""
    fsdp = getattr(torch.distributed, "fsdp", None) if torch.distributed.is_available() else None
    unit_type = getattr(fsdp, "FSDPModule", None)
    if unit_type is None:
        return
    units = [name for name, sub in owner.named_modules()
             if sub is not owner and isinstance(sub, unit_type)]
    if not units:
        return
    name = type(owner).__name__
    raise CheckpointConfigError(
        f"the checkpointed {name} contains separate FSDP units {units}: their hooks all-gather "
        "their parameters inside the boundary, so the replay's gradients for them would be lost",
        expected=f"no fully_shard()ed submodule inside the checkpointed {name}",
        got=f"fully_shard() applied to {', '.join(repr(u) for u in units)}",
        tip=f"checkpoint each unit instead (apply_activation_checkpointing on {units[0]!r}, "
            f"...), or make {name} itself the FSDP unit (fully_shard it, not its children)")


def run_boundary(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: BoundaryOptions, owner: nn.Module | None = None) -> T:
    """The boundary itself; ``checkpoint`` and module wrapping both call this.

    ``owner`` is the module whose parameters ``fn`` uses, when the caller knows it.
    """
    if not torch.is_grad_enabled() or torch._C._functorch.peek_interpreter_stack() is not None:
        # NOTE [when there is no boundary]; under a torch.func transform (grad, vmap, vjp,
        # jacrev) too: the Function has no setup_context, and torch's error would name no fix.
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
        slots.append(slot)
        leaves[index] = None
    owner = owner if owner is not None else owning_module(fn)
    params: list[torch.Tensor] | None = None
    before: list[torch.Tensor] = []  # frozen parameters and buffers, as they are before fn
    buffers: list[dict[str, torch.Tensor | None]] = []
    frozen: list[torch.Tensor] = []
    trees: list[ModuleDicts] = []
    if owner is not None:
        modules = [owner, *(leaf for leaf in leaves if isinstance(leaf, nn.Module))]
        trees = [module_dicts(module) for module in modules]
        # Not skipping inputs: a parameter also passed as an argument is used both ways, and
        # each use needs its gradient (the argument's comes through its input slot).
        params = collect_parameters(trees, set(), frozen=before)
        frozen = list(before)
        if not is_verified(owner) and any_lazy(trees):
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
            before.extend(b for d in tree.buffers for b in d.values() if b is not None)
    attributes: list[tuple[str, torch.Tensor]] = []
    if owner is not None and fn is not owner and owner._forward_pre_hooks:
        attributes = graph_attributes(owner)  # NOTE [attributes set before the call]
    anchor = None
    if not params and not attributes and not any(t.requires_grad for t in unique):
        if params is not None:  # a module with nothing trainable: nothing to replay for
            return fn(*args, **kwargs)
        anchor = _anchor()
    if len(flat.tensor_index) < len(leaves):
        _refuse_unreadable_inputs(fn, flat.spec, leaves,
                                  kwargs_use_cache=kwargs.get("use_cache") is True)
    call = _Call(fn, options, flat.spec, leaves, flat.tensor_index, slots)
    call.original_call = (args, kwargs)
    call.n_inputs = len(unique)
    call.params = params
    call.owner = owner
    call.before = {id(t): t for t in before} if before else None
    call.buffer_dicts = buffers
    call.frozen = frozen
    if trees:
        call.modules = (modules, trees)
    call.attributes = [name for name, _ in attributes]
    inputs = unique
    if params or attributes:
        inputs = [*unique, *(t for _, t in attributes), *(params or ())]
    active = ACTIVE.get()
    if options.offload is None or (active is not None and active.phase is Phase.RECOMPUTE):
        # NOTE: a boundary nested in another's replay runs in backward, where its inputs are
        # needed again at once: copying them to host and straight back would only cost time.
        out_tensors = _BoundaryFunction.apply(call, anchor, *inputs)
    else:
        # NOTE: the window covers only the save of the inputs (the original pass inside runs
        # under no-grad and saves nothing), so exactly the boundary's inputs are offloaded.
        manager = options.offload
        # Named from the spec and index lists only: the window must not hold `call`, whose
        # frame holds this window's handles (a cycle only the garbage collector would free).
        name = functools.partial(_input_path, flat.spec, flat.tensor_index, slots)
        # The module's parameters: a detached alias of one passed in stays resident.
        resident = [*params, *frozen] if params is not None else ()
        with manager.window(unique, name=name, resident=resident) as window:
            out_tensors = _BoundaryFunction.apply(call, anchor, *inputs)
        if call.frame.results:  # frozen results (top-k ids) go to host with the inputs
            call.frame.offload(functools.partial(manager.offload_into, window), manager.restore)
    if call.as_is:
        out_tensors = list(out_tensors)
        for position, tensor in call.as_is:
            out_tensors[position] = tensor
        call.as_is = None
    return call.outputs(out_tensors)


@torch._disable_dynamo  # NOTE [the boundary stays eager] in module.py, for calls too
def checkpoint(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` behind a PyTree-aware reentrant checkpoint boundary.

    Every keyword goes to ``fn``; set boundary options with :func:`checkpointed`.
    """
    _require_callable(fn, "checkpoint", "checkpoint(layer, x) or checkpoint(fn, x, ...): the "
                      "function (or module) first, then its arguments")
    try:
        return run_boundary(fn, args, kwargs, DEFAULT_OPTIONS)
    except TypeError as error:
        # Code moved over from torch.utils.checkpoint passes its options as keywords.
        torch_options = sorted({"use_reentrant", "preserve_rng_state", "context_fn",
                                "determinism_check", "debug"} & kwargs.keys())
        if torch_options and hasattr(error, "add_note") and \
                any(name in str(error) for name in torch_options):
            error.add_note(
                f"pytree_ckpt.checkpoint passes every keyword to fn, {torch_options} included "
                "(torch.utils.checkpoint's options). Tip: drop use_reentrant (the boundary is "
                "always reentrant-style, and takes any PyTree), and set other options with "
                "pytree_ckpt.checkpointed(fn, preserve_rng_state=...).")
        raise


def _require_callable(fn: Any, where: str, tip: str) -> None:
    if not callable(fn):
        raise CheckpointConfigError(
            f"{where} takes the function (or module) to run behind the boundary",
            expected="a callable", got=describe_leaf(fn), tip=tip)


def checkpointed(fn: Callable[..., T], /, *, preserve_rng_state: bool = True,
                 offload: bool | OffloadManager | None = None) -> Callable[..., T]:
    """Return ``fn`` wrapped in a boundary with the given options.

    ``offload`` as in ``apply_activation_checkpointing``: ``None`` reads
    ``XTUNER_ACTIVATION_OFFLOAD`` now, ``True`` the process's default manager, ``False`` none.
    """
    from .module import resolve_offload  # module builds on this file

    # Refused now, not at the first call, far from where it was made.
    _require_callable(fn, "checkpointed", "checkpointed(layer) or checkpointed(fn, "
                      "preserve_rng_state=False); the arguments go to the wrapper it returns")
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload))

    @functools.wraps(fn, updated=())  # a module's __dict__ must not be copied onto run
    @torch._disable_dynamo  # NOTE [the boundary stays eager] in module.py
    def run(*args: Any, **kwargs: Any) -> T:
        return run_boundary(fn, args, kwargs, options)

    return run
