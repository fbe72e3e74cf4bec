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
no-grad), and the replay runs under identity saved-tensor hooks, so no ambient hook (offload, a
census) ever sees a tensor computed inside the boundary. Non-tensor leaves and the tree specs
are kept by reference on the autograd node; tensor leaves are never kept there, so swapping the
saved reference (offload) really frees the device copy.

NOTE [when there is no boundary]: with grad disabled (``no_grad``, ``inference_mode``) or when
nothing can receive a gradient (no input requires grad and ``fn`` is a module, or a bound method
of one, with no trainable parameter), ``fn`` is just called: no node, no frame, phase unchanged.
When no input requires grad but ``fn`` may use trainable parameters (an unknown callable counts
as such), a tiny requires-grad *anchor* is passed to the Function so that its backward runs and
the replay's ``torch.autograd.backward`` accumulates the parameters' gradients.

NOTE [.grad() and backward(inputs=...)]: like every reentrant checkpoint, the replay accumulates
parameter gradients into ``.grad`` with its own backward call, which cannot honour a restricted
set of inputs. Such calls raise ``CheckpointError`` instead of returning partial results.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
from torch import nn

from offload import OffloadManager

from .census import Mechanism, census_active, report_held
from .errors import CheckpointError, ReplayMismatchError
from .frames import Frame
from .phase import ACTIVE, Invocation, Phase
from .rng import ReplayEnvironment
from .tree import describe_leaf, flatten, leaf_paths, unflatten

__all__ = ["BoundaryOptions", "checkpoint", "checkpointed"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class BoundaryOptions:
    """Options of a boundary; they never travel as keywords of ``fn``.

    ``offload``: a manager that opens a window over the boundary's input tensor leaves at each
    call, so the inputs it saves (hidden states, top-k ids) go to host memory until backward.
    """

    preserve_rng_state: bool = True
    offload: OffloadManager | None = None


DEFAULT_OPTIONS = BoundaryOptions()
_anchor_tensor: torch.Tensor | None = None


def _anchor() -> torch.Tensor:
    # A constant, never receives a gradient (backward returns None for it): no step state.
    global _anchor_tensor
    if _anchor_tensor is None:
        _anchor_tensor = torch.empty(0, requires_grad=True)
    return _anchor_tensor


def _owning_module(fn: Callable[..., Any]) -> nn.Module | None:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _may_need_parameter_grads(fn: Callable[..., Any], leaves: list[Any],
                              owner: nn.Module | None) -> bool:
    owner = owner if owner is not None else _owning_module(fn)
    if owner is None:
        return True  # unknown callable: it may close over trainable parameters
    modules = [owner] + [leaf for leaf in leaves if isinstance(leaf, nn.Module)]
    return any(p.requires_grad for m in modules for p in m.parameters())


def _identity(x: Any) -> Any:
    return x


class _Call:
    """Everything one boundary call needs for its replay, minus the tensors themselves."""

    __slots__ = ("fn", "options", "in_spec", "in_leaves", "in_tensor_index", "in_slots",
                 "out_spec", "out_leaves", "out_tensor_index", "out_meta", "frame", "env",
                 "original_call")

    def __init__(self, fn: Callable[..., Any], options: BoundaryOptions, in_spec: Any,
                 in_leaves: list[Any], in_tensor_index: list[int], in_slots: list[int]) -> None:
        self.fn = fn
        self.options = options
        self.in_spec = in_spec
        self.in_leaves = in_leaves  # tensor leaves replaced by None (NOTE [what is saved])
        self.in_tensor_index = in_tensor_index
        self.in_slots = in_slots
        self.frame = Frame()
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_tensor_index: list[int] = []
        self.out_meta: list[tuple[torch.Size, torch.dtype]] = []
        self.env: ReplayEnvironment | None = None
        # The caller's own args and kwargs, for the original pass only (then dropped): fn sees
        # the very containers it was given, as in eager; the replay gets rebuilt containers.
        self.original_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def inputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.in_leaves)
        for index, slot in zip(self.in_tensor_index, self.in_slots):
            leaves[index] = tensors[slot]
        args, kwargs = unflatten(self.in_spec, leaves)
        return args, kwargs

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for index, tensor in zip(self.out_tensor_index, tensors):
            leaves[index] = tensor
        return unflatten(self.out_spec, leaves)

    def check_replay(self, spec: Any, leaves: list[Any], tensor_index: list[int]) -> None:
        name = _fn_name(self.fn)
        tip = ("the replay must return what the original pass returned; make the output depend "
               "only on the inputs (not on current_phase() or grad mode)")
        if spec != self.out_spec:
            raise ReplayMismatchError(
                f"the replay of {name} returned a different output structure",
                expected=self.out_spec, got=spec, tip=tip)
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


def _fn_name(fn: Callable[..., Any]) -> str:
    owner = _owning_module(fn)
    if owner is not None:
        return type(owner).__name__
    return getattr(fn, "__qualname__", None) or repr(fn)


def _release_frame_if_freed(ctx: Any, frame: Frame) -> None:
    # NOTE [frame lifetime]: runs once the graph task finished; autograd has then released the
    # node's saved tensors unless retain_graph was set, and the frame goes with them. (The census
    # reads frame.released as "this invocation no longer holds its inputs".)
    try:
        ctx._raw_saved_tensors
    except RuntimeError:
        frame.clear()


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor | None, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)
        call.env = ReplayEnvironment.capture(tensors, preserve_rng=call.options.preserve_rng_state)
        assert call.original_call is not None
        args, kwargs = call.original_call
        call.original_call = None
        token = ACTIVE.set(Invocation(Phase.FORWARD, call.frame, ACTIVE.get()))
        try:
            output = call.fn(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
        flat = flatten(output)
        out_tensors = tuple(flat.leaves[i] for i in flat.tensor_index)
        call.out_spec = flat.spec
        call.out_tensor_index = flat.tensor_index
        call.out_meta = [(t.shape, t.dtype) for t in out_tensors]
        call.out_leaves = flat.leaves
        for index in flat.tensor_index:
            call.out_leaves[index] = None
        frozen = [t for t in out_tensors if not (t.is_floating_point() or t.is_complex())]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        if census_active():
            report_held(tensors, Mechanism.BOUNDARY, holder=call.frame)
            report_held(call.frame.tensors(), Mechanism.REPLAY_FRAME, holder=call.frame)
        ctx.save_for_backward(*tensors)
        return out_tensors

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        if not torch.autograd._is_checkpoint_valid():
            raise CheckpointError(
                f"the boundary around {_fn_name(call.fn)} was reached by torch.autograd.grad() "
                "or backward(inputs=...)",
                expected="loss.backward() without inputs=", got="a restricted backward",
                tip="reentrant replay accumulates parameter gradients into .grad; call "
                    "loss.backward() and read .grad, or leave this region unwrapped")
        needs = ctx.needs_input_grad[2:]
        detached = tuple(t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs))
        args, kwargs = call.inputs(detached)
        call.frame.start_replay()
        assert call.env is not None
        token = ACTIVE.set(Invocation(Phase.RECOMPUTE, call.frame, ACTIVE.get()))
        try:
            with ExitStack() as stack:
                call.env.enter(stack)
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_identity, _identity))
                output = call.fn(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
        call.frame.check_consumed()
        flat = flatten(output)
        call.check_replay(flat.spec, flat.leaves, flat.tensor_index)
        outs, grads = [], []
        for index, grad in zip(flat.tensor_index, grad_outputs):
            out = flat.leaves[index]
            if grad is not None and out.requires_grad:
                outs.append(out)
                grads.append(grad)
        if outs:
            torch.autograd.backward(outs, grads)
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_release_frame_if_freed, ctx, call.frame))
        return (None, None, *(d.grad if need else None for d, need in zip(detached, needs)))


def run_boundary(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: BoundaryOptions, owner: nn.Module | None = None) -> T:
    """The boundary itself; ``checkpoint`` and module wrapping both call this.

    ``owner`` is the module whose parameters ``fn`` uses, when the caller knows it.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    flat = flatten((args, kwargs))
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
    anchor = None
    if not any(t.requires_grad for t in unique):
        if not _may_need_parameter_grads(fn, leaves, owner):
            return fn(*args, **kwargs)
        anchor = _anchor()
    call = _Call(fn, options, flat.spec, leaves, flat.tensor_index, slots)
    call.original_call = (args, kwargs)
    if options.offload is None:
        out_tensors = _BoundaryFunction.apply(call, anchor, *unique)
    else:
        # NOTE: the window covers only the save of the inputs (the original pass inside runs
        # under no-grad and saves nothing), so exactly the boundary's inputs are offloaded.
        with options.offload.window(unique):
            out_tensors = _BoundaryFunction.apply(call, anchor, *unique)
    return call.outputs(out_tensors)


def checkpoint(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` behind a PyTree-aware reentrant checkpoint boundary.

    Every keyword goes to ``fn``; set boundary options with :func:`checkpointed`.
    """
    return run_boundary(fn, args, kwargs, DEFAULT_OPTIONS)


def checkpointed(fn: Callable[..., T], /, *, preserve_rng_state: bool = True,
                 offload: OffloadManager | None = None) -> Callable[..., T]:
    """Return ``fn`` wrapped in a boundary with the given options."""
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state, offload=offload)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        return run_boundary(fn, args, kwargs, options)

    return run
