"""Keeping selected ops' outputs resident inside the reentrant boundary (selective recompute).

A ``KeepPolicy`` says which ops to keep: by op identity (``OpOverloadPacket``s), or every op
dispatched inside a kept callable (a region flag set by a wrapper around the callable). The mode
makes dynamo skip compiled frames, so a layer that keeps units must have an eager body (NOTE
[save units need eager bodies] in save_units.py).

NOTE [how keeping works inside one boundary]: a ``KeepMode`` (a ``TorchDispatchMode``, below
autograd) is active around the original pass and around the replay, and only when the boundary
has a policy: no policy, no mode, no per-op cost. In the original pass a kept op runs and its
outputs are recorded in the invocation's frame (FIFO per op, like frozen results); in the replay
the op is *not* run: the recorded outputs are returned. Autograd sits above the mode, so it
still records the op's node with the replay's inputs, and gradients flow. Rules:

1. collectives (``c10d``, ``_c10d_functional``) are never kept: every rank must run them;
   nor are views (``detach`` included): they cost nothing, and autograd dispatches some of them
   only when grad is enabled, so only in the replay; nor clones (NOTE [clones are never
   kept]); nor, under autocast, casts (NOTE [autocast casts are never kept]);
2. a mutating op (in-place, ``out=``) is never kept; inside a kept callable it is recomputed,
   with one warning per op;
3. a kept output that a later op of the same original pass changes in place (``relu_``, the
   ``bernoulli_`` of a dropout, a ``scatter_add_`` into ``zeros_like``) is not kept after all:
   the replay recomputes that op, and the change is made to the fresh output, as in eager. One
   changed after the original pass and before the replay (its version counter moved) raises
   ``CheckpointError`` naming the op;
4. ops run by ``reuse_during_recompute`` are not kept: the replay never runs them;
5. a kept op that the replay calls with other non-tensor arguments than the original pass is
   recomputed, with one warning per op (NOTE [kept ops called otherwise in the replay] in
   kept_calls.py); one it calls on tensors of other shapes or dtypes is refused (NOTE [kept ops
   called on other tensors in the replay]).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import FrameType
from typing import Any, TypeVar

import optree
import torch
from torch import nn
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from .addresses import data_pointer
from .census import Mechanism, census_active, report_held
from .eager import user_stacklevel
from .errors import CheckpointConfigError, CheckpointError, ReuseError
from .kept_calls import call_arguments, for_backward, kept_count_changed, replay_may_take
from . import module_state  # read at call time: module_state imports this module's users
from .phase import Invocation, Phase
from .recording import proxy_tracing
from .replay_values import arguments_print, check_arguments
from .rng import GeneratorStates, generators_moved, rng_changed, rng_state
from .tree import dunder
from .unit_use import UnitUse

__all__ = ["KeepMode", "KeepPolicy", "IN_KEPT_CALLABLE", "IN_REUSE", "kept_region", "never_kept",
           "op_name", "outside_kept_region"]


# The kept callables running now ("Class.method" names; KeptCallables), and whether
# reuse_during_recompute computes. NOTE: by name, not one flag: a boundary keeps what *its*
# methods dispatch, not what a nested layer's kept method does (held for nothing until backward).
IN_KEPT_CALLABLE: ContextVar[frozenset[str]] = ContextVar("pytree_ckpt_in_kept_callable",
                                                          default=frozenset())
# The reused call running (its function, in a tuple: true whatever the function's truth), or ().
IN_REUSE: ContextVar[tuple[Any, ...]] = ContextVar("pytree_ckpt_in_reuse", default=())
# NOTE [context variables set inside the try]: a pass, a reused call, a kept method or region
# sets its context variable inside the try whose finally puts back the value read before it,
# not by ``reset(token)`` of a set made before the try: a KeyboardInterrupt lands right after
# a call returns (NOTE [a pass interrupted at any point] in rng.py), and one as the set (or a
# call between it and the try) returned left the variable set for the rest of the thread:
# every later reused call a plain call, its function run again in each replay (helper LA), a
# boundary pass active for good (helper KZ).
T = TypeVar("T")


@contextmanager
def kept_region(names: frozenset[str], /) -> Iterator[None]:
    """Within: the kept callables ``names`` are running (``IN_KEPT_CALLABLE``).

    NOTE [the library's own ops in a kept method's region]: a boundary or an output discard
    nested in a kept method is a pass-through in the original pass (no grad) and real in the
    replay, where its own bookkeeping (snapshots of frozen parameters and buffers, their
    comparisons) dispatches ops the original pass never did: counted as the method's, the replay
    would ask for records that do not exist (a ReuseError; helper JJ). So their ``forward`` runs
    its bookkeeping outside the region and re-enters it for the user's function alone."""
    outer = IN_KEPT_CALLABLE.get()
    try:
        IN_KEPT_CALLABLE.set(names)  # NOTE [context variables set inside the try]
        yield
    finally:
        IN_KEPT_CALLABLE.set(outer)


def outside_kept_region(forward: Callable[..., T], /, *args: Any) -> T:
    """``forward(*args, region)`` outside the kept callables' region ``region`` running now
    (empty, the usual case: called as it is), for it to re-enter around the user's function
    alone (NOTE [the library's own ops in a kept method's region])."""
    region = IN_KEPT_CALLABLE.get()
    if not region:
        return forward(*args, region)
    with kept_region(frozenset()):
        return forward(*args, region)

_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                    "_dtensor"})
# NOTE [kept methods of modules added later]: the structure generation a layer's kept methods
# were last looked for at (a mark on the layer, dropped with its checkpointing and by a copy).
_LATE_AT = "_pytree_ckpt_kept_late_at"


class _LateAt:
    """The mark: a copy or pickle of the layer carries none (as module_state.DroppedOnCopy,
    which this module cannot import at its own import: module_state imports its users)."""

    __slots__ = ("generation",)

    def __init__(self, generation: int, /) -> None:
        self.generation = generation

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


_CLONE = torch.ops.aten.clone  # NOTE [clones are never kept]


def never_kept(namespace: str, packet: Any, overload: str | None = None, /) -> str | None:
    """Why ``KeepPolicy.keeps`` never keeps the ops of ``packet`` (in ``namespace``; only its
    ``overload``, when named), or ``None`` when it may keep them: ``KeptOps`` naming such an op
    would keep nothing, silently."""
    if namespace in _COLLECTIVE_NAMESPACES:
        return "collectives are never kept: every rank must run them"
    if packet is _CLONE:
        return ("clones are never kept: autograd dispatches some in the replay alone (before "
                "an in-place op that needs the value it overwrites); keep the op that made "
                "the value instead")
    overloads = [getattr(packet, name) for name in ([overload] if overload
                                                    else packet.overloads())]
    functional = [op for op in overloads if not op._schema.is_mutable]
    if overloads and not functional:
        # An op of your own that mutates (torch.library.custom_op with mutates_args) has no
        # functional twin to name (helper QP): its change and its result come apart instead.
        return ("in-place and out= ops are never kept: the replay must make their change "
                "again; " + ("name the functional op (aten::addmm for aten::addmm_)"
                             if namespace == "aten" else
                             "split the change into an op of its own and keep an op that "
                             "returns the result without changing its inputs"))
    # Overloads on Python values (aten::split.str, aten::slice.t on lists) make no tensor to
    # keep: a view op beside them is a view op.
    functional = [op for op in functional if any("Tensor" in str(r.type)
                                                 for r in op._schema.returns)] or functional
    if functional and all(op.is_view for op in functional):
        return "views are never kept: they hold no memory of their own"
    return None


# Ops warned about as mutating inside a kept unit (a warning's dedupe, not step state).
_WARNED_MUTATING: set[str] = set()


def op_name(op: Any, /) -> Any:
    """The qualified name of a torch.ops object (``aten::mm``, ``aten::mm.default``) or of the
    op ``@torch.library.custom_op`` makes; anything else as it is."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, torch._library.custom_ops.CustomOpDef):  # helper QP: was refused
        return op._qualname
    return op


def _policy_from_names(names: tuple[str, ...], callables: tuple[str, ...], description: str,
                       units: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (),
                       /) -> KeepPolicy:
    """A pickled ``KeepPolicy`` (its ``__reduce__``), its ops looked up by name."""
    ops = []
    for name in names:
        namespace, qualified = name.split("::", 1)
        base, _, overload = qualified.partition(".")
        try:
            packet = getattr(getattr(torch.ops, namespace), base)
            ops.append(getattr(packet, overload) if overload else packet)
        except (AttributeError, RuntimeError):
            raise CheckpointError(
                f"a checkpointed layer being loaded keeps the op {name}, which this process "
                "has not registered", expected=f"{name} registered before loading",
                got=f"no {name} in torch.ops",
                tip="import the library that registers it (its torch.library definitions) "
                    "before torch.load") from None
    # Its layers are not known here: the unit watch says nothing (unit_use.py).
    return KeepPolicy(ops, callables=callables, description=description, units=units)


class KeepPolicy:
    """Which ops a boundary keeps: ``ops`` by identity, plus everything the kept callables
    (``"Class.method"`` names of the wrapped methods) dispatch. ``units`` (each a unit's name,
    the names of its ops, its kept methods) and ``layers`` (the checkpointed layers) let it
    tell a unit that keeps nothing at run time (NOTE [a unit that keeps nothing at run time]
    in unit_use.py)."""

    def __init__(self, ops: Iterable[Any], /, *, callables: Iterable[str], description: str,
                 units: Iterable[tuple[str, Iterable[str], Iterable[str]]] = (),
                 layers: Iterable[Any] = ()) -> None:
        ops = frozenset(ops)
        # Whole ops (OpOverloadPackets) and single overloads (KeptOps("aten::mm.default")).
        self.ops = frozenset(op for op in ops if not isinstance(op, torch._ops.OpOverload))
        self.overloads = ops - self.ops
        self.callables = frozenset(callables)
        self.description = description
        self.use = UnitUse(units, layers)  # not part of what the policy is (_key)

    def install_late(self, layer: nn.Module, /) -> None:
        """NOTE [kept methods of modules added later]: ``apply_recompute_config`` wraps the
        kept methods of the instances the layers hold then; an instance of a kept class
        assigned into a layer afterwards (a LoRA adapter injected as peft does,
        ``setattr(parent, name, LoraLinear(...))``; a router replaced) had its method
        recomputed in the replay, silently (helper EF). Once the layer's tree changed (the
        structure generation moved), the next call wraps the methods of such instances as
        ``apply_recompute_config`` would have, before the original pass. One compare a call
        otherwise."""
        generation = module_state.structure_generation()
        mark = layer.__dict__.get(_LATE_AT)
        if mark is not None and mark.generation == generation:
            return
        from .save_units import install_kept  # save_units imports this module
        for module in layer.modules():
            # As KeptCallables matches at apply time: the class or a base of it (a subclass of
            # the kept class: helper EL), kept under the policy's own name.
            owners = {klass.__qualname__ for klass in type(module).__mro__}
            for kept in self.callables:
                owner, _, name = kept.rpartition(".")
                if owner in owners:
                    install_kept(module, name, layers=[layer], kept_as=kept)
        # Dropped by a copy (helper EL: a deep copy carried it, and an adapter assigned into the
        # copy before its first call was never wrapped).
        layer.__dict__[_LATE_AT] = _LateAt(module_state.structure_generation())

    def __repr__(self) -> str:
        # What it keeps, not only the units' names: a refused re-application names both sides
        # (two configs of one unit naming other methods read the same by unit name alone).
        kept = [f"ops {sorted(op_name(op) for op in self.ops | self.overloads)}"] \
            if self.ops or self.overloads else []
        if self.callables:
            kept.append(f"everything {sorted(self.callables)} dispatch")
        return f"KeepPolicy({self.description}: {'; '.join(kept) or 'nothing'})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # NOTE: torch's op objects cannot be pickled, and a checkpointed layer's options hold
        # this policy (torch.save(model) failed on a layer given KeptOps). The ops travel by
        # qualified name and are looked up again when loaded.
        names = tuple(sorted(op_name(op) for op in self.ops | self.overloads))
        units = tuple((name, tuple(sorted(ops)), tuple(sorted(methods)))
                      for name, ops, methods in self.use.units)
        return (_policy_from_names,
                (names, tuple(sorted(self.callables)), self.description, units))

    # Two policies that keep the same things are the same option (re-applying a config is a
    # no-op, as for apply_activation_checkpointing); one that wraps other methods is not.
    def _key(self) -> tuple[frozenset[Any], frozenset[Any], frozenset[str]]:
        return self.ops, self.overloads, self.callables

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepPolicy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def keeps_by_op(self, func: Any, /) -> bool:
        return func.overloadpacket in self.ops or bool(self.overloads) and func in self.overloads

    def keeps(self, func: Any, /) -> bool:
        if func.namespace in _COLLECTIVE_NAMESPACES or func.is_view or \
                func.overloadpacket is _CLONE or not _returns_tensors(func):
            # Views (detach included) hold no memory of their own, and autograd dispatches some
            # (saving an output) only when grad is on, i.e. in the replay alone.
            # NOTE [clones are never kept]: an in-place op whose derivative needs the value it
            # overwrites (``top /= top.sum()`` after a top-k, as transformers' MoE routers do)
            # makes autograd dispatch ``aten.clone`` of it first, when grad is on: in the replay
            # alone. A kept clone would make the replay ask for a record the original pass
            # never made (a ReuseError), or hand autograd's clone the output of another clone.
            # A clone is a copy, cheap to redo from its input. NOTE [ops that return no
            # tensor are never kept].
            return False
        by_op = self.keeps_by_op(func)
        # NOTE [autocast casts are never kept]: nor any cast by a kept callable's region, where
        # the layer may enter autocast itself (read only as the pass starts: helper HH).
        by_region = bool(self.callables) and func is not _TO_COPY and \
            not self.callables.isdisjoint(IN_KEPT_CALLABLE.get())
        if not (by_op or by_region):
            return False
        if func._schema.is_mutable:
            name = str(func)
            if name not in _WARNED_MUTATING:  # once per op, however many policies
                _WARNED_MUTATING.add(name)
                warnings.warn(f"pytree_ckpt: {name} mutates its inputs inside a kept unit; it "
                              "is recomputed in the replay, not kept. The numbers are "
                              "unchanged (a dropout's in-place mask draw is the usual case: "
                              "expected). To keep less recomputation, keep the ops around it "
                              "by name (KeptOps) or a method without it (KeptCallables); to "
                              "silence it: warnings.filterwarnings('ignore', 'pytree_ckpt: .* "
                              "mutates its inputs')", stacklevel=user_stacklevel())
            return False
        return True


def _tracking_alias(x: Any) -> Any:
    # Below autograd a plain detach() would get its own version counter; with ADInplaceOrView
    # re-enabled the alias shares the output's counter, so a later in-place change shows.
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


# NOTE [outputs made only with grad]: the original pass runs under no-grad, the replay (and an
# eager step) with grad on, and oneDNN's LSTM on CPU (aten::mkldnn_rnn_layer, torch's default
# kernel there) makes the workspace its backward needs only with grad on. Kept from the no-grad
# pass, its record held None there, and the replay handed that to the op's backward, which
# failed inside torch ("Expected a proper Tensor but got None ... 'workspace'"; helper ME). Such
# a call is not kept: the replay runs the op again, as one no unit names. Known ops only: CUDA's
# flash and cuDNN attention leave two Tensor outputs undefined in either mode and are kept (a
# check of every op's outputs kept nothing of them: helper MH). Not by running the kept op with
# grad on either: the layer's own no_grad, an autograd.Function's forward and a custom op's
# kernel run under no-grad in eager, and got another kernel's numbers (helper MJ).
_MADE_ONLY_WITH_GRAD = frozenset(
    op for op in (getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None),)
    if op is not None)


def _made_only_with_grad(func: Any, out: Any, /) -> bool:
    """Whether ``func`` is known to make, only with grad on, a tensor ``out`` lacks (None where
    its schema returns a Tensor): NOTE [outputs made only with grad]."""
    if func not in _MADE_ONLY_WITH_GRAD:
        return False
    returns = func._schema.returns
    values = out if type(out) is tuple and len(returns) > 1 else (out,)
    return any(value is None and isinstance(ret.type, torch.TensorType)
               for ret, value in zip(returns, values))


# NOTE [ops that return no tensor are never kept]: what an op returns when it returns no tensor
# (a size, a layout, a flag: `aten.sym_size`, `prim.layout`) holds no memory to keep, and
# autograd dispatches some of them only with grad on (for a nested tensor's input, in the
# replay alone): kept in a kept method's region, the replay asked for a record the original
# pass never made, a ReuseError raised inside C++, which ended the process (helper JS). Read
# from the op's schema once per op (a cache of torch's own op objects, not step state).
_RETURNS_TENSORS: dict[Any, bool] = {}


def _returns_tensors(func: Any, /) -> bool:
    found = _RETURNS_TENSORS.get(func)
    if found is None:
        found = _RETURNS_TENSORS[func] = any("Tensor" in str(r.type)
                                             for r in func._schema.returns)
    return found


def _emptied(kept: Any, /) -> bool:
    """NOTE [a kept record emptied by a failed replay]: a replay that takes a kept output and
    gives it to an output discard (a kept method that runs one: the discard is real in the
    replay, which has grad) frees the record's storage in place, and the discard's rebuild, in
    that replay's backward, fills it again. A backward that raises in between (a hook's NaN
    check, a KeyboardInterrupt, an out-of-memory error) leaves the record empty; a retry of
    ``backward(retain_graph=True)`` on the same graph was handed the empty tensor and torch
    raised "data is not allocated yet" where eager's retry works. An emptied record is taken
    back (rule 3's way: ``Frame.unkeep``, before its RNG jump): the replay runs the op again.
    Only a discard empties a storage with elements in it, so this is never true otherwise; a
    discard frees strided outputs only (a sparse result has no storage to read: helper JS).
    Under make_fx no discard frees anything (NOTE [make_fx records storages nowhere]), and a
    symbolic trace's element count cannot be read as a bool (helper QN)."""
    if proxy_tracing():
        return False
    for tensor in _tensors(kept):
        if tensor.layout is torch.strided and tensor.numel() and \
                not tensor.untyped_storage().nbytes():
            return True
    return False


RECOMPUTE = object()  # a frame record taken back: the replay runs the op (rule 3)


class _RecordHolder:
    """Held by one kept record: the census counts the record's bytes while it is alive."""

    __slots__ = ("__weakref__",)

    @property
    def released(self) -> bool:
        return False  # it goes with the record (taken back, or the frame cleared)


def _may_draw_random(func: Any) -> bool:
    # aten tags every op that draws random numbers (dropout, the attention kernels with a
    # dropout_p); other namespaces' ops (flash-attn's) cannot be told, so they are checked.
    return func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags


_TO_COPY = torch.ops.aten._to_copy.default
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def _on_nested(args: Any, kwargs: dict[str, Any], /) -> bool:
    """Whether an op reads a nested tensor: never kept, in either pass, nor one making one
    (helper PJ). A strided one (torch's jagged attention makes them inside a kept unit) has no
    sizes to compare, and the replay reads its sizes more often than the original pass (under
    grad): a record asked for there raised inside torch's C++, which aborted the process. A
    jagged one made in the replay from offsets has a new ragged symbol, and the forward's
    record handed to autograd there failed ("got [2, j2, 16] but expected ... [2, j3, 16]").
    Arguments one level deep (a list of tensors): a check on every kept op, in both passes."""
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and t.is_nested:
                return True
    return False


def _storage_id(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
        # A storage without an address (the meta device's, a memory estimate: every one is
        # at 0) by the storage itself, or a write to any meta tensor took back every kept
        # result (helper PJ; as census_records' _record_key files them).
        return data_pointer(tensor, storage) or storage._cdata  # NOTE [a fake tensor's address]
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor), a sparse tensor
        return None


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (its schema's mutable arguments)."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [t for t in values if isinstance(t, torch.Tensor)]
    return written


_OP = torch._ops.OpOverload  # the usual func: one type check per op, not an isinstance
# NOTE [control flow under save units]: torch's control-flow operators, by their names, and
# the folder of their Python code.
_CONTROL_FLOW = frozenset({"cond", "while_loop", "while_loop_stack_output", "scan", "map",
                           "map_impl"})
_HIGHER_ORDER_OPS = os.path.dirname(torch._higher_order_ops.__file__) + os.sep
_DYNAMO_REFUSED = "non-infra torch dispatch mode present"


def refuse_compiled_under_keep(error: BaseException, name: str, /) -> None:
    """Name the cause where dynamo refused to compile code inside a layer that keeps units
    (NOTE [higher-order ops pass through our modes]): save units keep ops through a dispatch
    mode, under which dynamo compiles nothing, so a region compiled with ``fullgraph=True``
    raises "found no compiled frames"; ``flex_attention`` compiles its own call so even when
    it is not compiled (helper FC: torch's message named dynamo's internals only)."""
    if not isinstance(error, RuntimeError) or _DYNAMO_REFUSED not in str(error):
        return
    flex = "flex_attention" in str(error)
    raise CheckpointConfigError(
        f"{name} runs code compiled with fullgraph=True"
        f"{' (flex_attention compiles its own call, even uncompiled)' if flex else ''} while "
        "the layer keeps save units: units keep ops through a TorchDispatchMode, and dynamo "
        "compiles nothing while one is active",
        expected="no save unit on a layer that calls flex_attention or other code compiled "
                 "with fullgraph=True",
        got="torch.compile(fullgraph=True) refused: non-infra torch dispatch mode present",
        tip="apply the save units to layers without such code (RecomputeConfig's save=[] for "
            "these, or wrap only the other layers), and recompute these layers in full; the "
            "boundary itself (recompute and offload) runs flex_attention as eager does"
    ) from error


class KeepMode(TorchDispatchMode):
    """Records kept ops' outputs in the original pass, returns them in the replay.

    A mode belongs to one boundary invocation (its frame and phase), not to whichever is
    innermost: in an outer replay, a nested boundary's original pass runs under both the outer
    mode (which returns what the outer original pass kept) and its own (which records that for
    its own replay). Modes stack, so each sees the op once.
    """

    # NOTE [higher-order ops pass through our modes] (discarded_reads.py): flex_attention
    # under a layer with save units raised torch's "no rule registered for HigherOrderOperator"
    # (helper FC). It runs as it is in both passes: recomputed, the ops inside it not kept.
    supports_higher_order_operators = True

    def _refuse_control_flow(self, func: HigherOrderOperator, /) -> None:
        """NOTE [control flow under save units]: torch.cond, while_loop, scan and map run
        eagerly by compiling their own call, which lifts what the branches read (parameters in
        a closure) into the op's operands, so that its autograd gives them gradients. Dynamo
        compiles nothing while this mode is active (NOTE [higher-order ops pass through our
        modes]): the op then ran its branches as they are, and in the replay the parameters
        they read got no gradient, silently (helper FN); torch's own selective checkpoint
        refuses these ops. Refused, in the original pass, naming the layer and the op. Dynamo
        marked the op's own compile wrapper (running now, further up this stack) to be
        skipped from then on, which left every later call of the op raising, in any module,
        until ``torch._dynamo.reset()``: those code objects' caches are reset first."""
        from .refusals import fn_name  # refusals imports keep's users
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith(_HIGHER_ORDER_OPS):
                torch._dynamo.reset_code(frame.f_code)
            frame = frame.f_back
        raise CheckpointConfigError(
            f"{fn_name(self.layer)} calls torch's {func.name()} (a control-flow operator) while "
            "the layer keeps save units: units keep ops through a TorchDispatchMode, under which "
            f"dynamo does not trace {func.name()}'s branches, and the parameters they read "
            "would get no gradient",
            expected="no save unit on a layer whose forward calls torch.cond, while_loop, scan "
                     "or map",
            got=f"{func.name()} in the original pass of {fn_name(self.layer)}",
            tip="apply the save units to layers without such code (RecomputeConfig's save=[] "
                "for these, or wrap only the other layers), and recompute these layers in "
                "full: the boundary itself (recompute and offload) runs them as eager does")

    def __init__(self, policy: KeepPolicy, invocation: Invocation, /, *, layer: Any,
                 verify: bool = False, preserve_rng: bool = True) -> None:
        super().__init__()
        self.policy = policy
        self.invocation = invocation
        self.layer = layer  # the boundary's fn, named when the replay is refused
        # verify_replay=True: NOTE [the kept ops' arguments are verified too] (replay_values.py)
        self.verify = verify
        self.preserve_rng = preserve_rng
        # Original pass: the storages of kept outputs -> every (op, position in the frame) kept
        # on it, so that a later in-place change can take the records back (rule 3).
        # NOTE [kept outputs share storages]: several records may hold one storage without
        # being views of each other: reshape of a non-viewable tensor dispatches aten.clone,
        # then aten._unsafe_view of the clone, a new tensor (its own version counter) on the
        # clone's storage. A write through either changes both, so all are taken back.
        self._kept_at: dict[int, list[tuple[Any, int]]] = {}
        # The kept methods' regions each record was kept in, by (op, position): for the tip of
        # refuse_changed_kept (made_before.py), which must name what the user can drop.
        self._kept_in: dict[tuple[Any, int], frozenset[str]] = {}
        # The records this pass kept (op, position, kept methods running), counted for their
        # units when the pass ends, once rule 3 had its chance to take them back (NOTE [a unit
        # that keeps nothing at run time] in unit_use.py).
        self._unit_records: list[tuple[Any, int, frozenset[str]]] = []
        # NOTE [autocast casts are never kept]: autocast caches its casts of leaves that
        # require grad (weights; a leaf input in the original pass, a view of one in the
        # replay) for its whole region, so whether a pass dispatches such a cast depends on
        # the cache (filled by the original pass, or not, when backward runs inside the
        # region), not on the code, and a kept cast would be handed to another cast in the
        # replay. Casts are cheap to redo: none is kept on a device where autocast is on when
        # the pass starts (the same in both: the replay re-enters the original pass's autocast
        # state). Read here: inside dispatch, autocast reads as off; so an autocast the layer
        # enters itself is not seen, and a kept callable's region keeps no cast at all (a
        # cast kept by name there is documented: docs/save_units.md, rule 2).
        self._autocast_on = frozenset(d for d in _AUTOCAST_DEVICE_TYPES
                                      if torch.is_autocast_enabled(d))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if type(func) is not _OP and isinstance(func, HigherOrderOperator):
            if func.name() in _CONTROL_FLOW:
                self._refuse_control_flow(func)
            return func(*args, **kwargs)  # NOTE [higher-order ops pass through our modes]
        if self._kept_at and func._schema.is_mutable:
            self._unkeep_written(func, args, kwargs)
        if IN_REUSE.get():
            if not self.policy.use.settled:  # replayed, not recomputed: what a unit asks for
                self._unit_kept(func, IN_KEPT_CALLABLE.get())
            return func(*args, **kwargs)
        if not self.policy.keeps(func) or (func is _TO_COPY and self._autocast_cast(args)) \
                or _on_nested(args, kwargs):
            return func(*args, **kwargs)
        invocation = self.invocation
        frame = invocation.frame
        if invocation.phase is Phase.FORWARD:
            devices = frame.rng_devices if _may_draw_random(func) else None
            before = rng_state(devices) if devices is not None else None
            # NOTE [generators passed in] (rng.py): those the replay restores jump too.
            generators_before: GeneratorStates = \
                tuple((g, g.get_state()) for g in frame.generators) \
                if devices is not None and frame.generators else ()
            args, kwargs = for_backward(func, args, kwargs)
            # Printed before the op runs, as the replay prints it: a kernel that writes an
            # argument its schema does not mark (a batch norm's running statistics) would
            # otherwise be printed as it left them (helper JM: a false ReplayMismatchError).
            prints = arguments_print(_tensors((args, kwargs)), op=func, fn=self.layer) \
                if self.verify else None
            out = func(*args, **kwargs)
            rng_after = None
            generators_after: GeneratorStates = ()
            if before is not None and devices is not None:
                # NOTE [skipped work keeps the RNG in step] (frames.py): the replay skips it.
                after = rng_state(devices)
                rng_after = after if rng_changed(before, after) else None
                if generators_before:
                    generators_after = generators_moved(generators_before)
            if any(t.is_inference() for t in _tensors(out)) or _made_only_with_grad(func, out) \
                    or _on_nested(out if isinstance(out, tuple) else (out,), {}):
                # Made under torch.inference_mode() inside the layer: no version to check, and
                # nothing to save for backward; the replay runs the op again (as it does an op
                # that left out what its backward needs: NOTE [outputs made only with grad]).
                # So does one making a nested tensor (_on_nested).
                frame.record(func, RECOMPUTE)
                return out
            kept = optree.tree_map(_tracking_alias, out)
            # The census counts the kept bytes while this record holds them: a record taken
            # back (rule 3), or cleared with the frame, lets go of its holder.
            holder = _RecordHolder()
            frame.record(func, (kept, [t._version for t in _tensors(kept)], holder,
                                call_arguments(func, args, kwargs), prints),
                         rng_after=rng_after,
                         generators_after=generators_after)
            position = len(frame.results[func]) - 1
            regions = IN_KEPT_CALLABLE.get()
            if not self.policy.use.settled:
                self._unit_records.append((func, position, regions))
            for tensor in _tensors(kept):
                key = _storage_id(tensor)
                if key is not None:
                    self._kept_at.setdefault(key, []).append((func, position))
                    if regions:
                        self._kept_in[(func, position)] = regions
            if census_active():
                report_held(_tensors(kept), Mechanism.SAVE_UNIT, holder=holder)
            return out
        upcoming = frame.upcoming(func)
        if upcoming is not None and upcoming[1] is not RECOMPUTE:
            # NOTE [kept ops called otherwise in the replay], NOTE [kept ops called on other
            # tensors in the replay] (kept_calls.py)
            position = upcoming[0]
            if _emptied(upcoming[1][0]) or \
                    not replay_may_take(func, upcoming[1][3],
                                        call_arguments(func, *for_backward(func, args, kwargs)),
                                        position=position, count=len(frame.results[func]),
                                        layer=self.layer):
                frame.unkeep(func, position)
        try:
            record = frame.take(func)
        except ReuseError as error:
            raise kept_count_changed(error, self.layer, self.policy) from None
        if record is RECOMPUTE:  # changed in place later in the original pass (rule 3), or
            return func(*args, **kwargs)  # called otherwise (rule 5)
        kept, versions, _, _, prints = record
        if prints is not None:  # NOTE [the kept ops' arguments are verified too]
            check_arguments(prints, _tensors(for_backward(func, args, kwargs)), fn=self.layer,
                            op=func, preserve_rng=self.preserve_rng)
        for tensor, version in zip(_tensors(kept), versions):
            # One with no elements has nothing a change could have changed (helper NB: the
            # caller's `out += residual` on an empty batch's output, which views it, passes in
            # eager).
            if tensor._version != version and tensor.numel():
                raise CheckpointError(
                    f"an output of {func} kept by a save unit was mutated between the original "
                    "pass and the replay (Tensor cached during selective activation checkpoint "
                    "has been mutated)",
                    expected=f"version {version}", got=f"version {tensor._version}",
                    tip="keep the op before the in-place change, not after it; or drop the "
                        "unit that keeps it, or clone before mutating")
        # A fresh alias each time (a replay may run twice with retain_graph): autograd, above
        # this mode, attaches this replay's history to it.
        return optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, kept)

    def kept_storages(self) -> dict[int, list[tuple[Any, int]]]:
        """The storages of the records this original pass kept and did not take back, by
        address, each with its (op, position) records (NOTE [outputs on a kept storage] in
        made_before.py)."""
        return self._kept_at

    def what_to_drop(self, func: Any, position: int, /) -> str:
        """The tip's words for a kept record the caller changed: the op where a unit names it,
        else the kept method whose region kept it (a ``KeptCallables`` unit names no op)."""
        if self.policy.keeps_by_op(func):
            return f"drop {func} from the unit that keeps it"
        methods = sorted(self.policy.callables & self._kept_in.get((func, position), set()))
        return f"keep another method than {' or '.join(methods) or 'the kept one'} (its unit " \
            f"keeps every op the method runs, {func} here)"

    def _unit_kept(self, func: Any, regions: frozenset[str], /) -> None:
        # NOTE [a unit that keeps nothing at run time] (unit_use.py)
        self.policy.use.kept((op_name(func), op_name(func.overloadpacket)), regions)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if exc[0] is None and self.invocation.phase is Phase.FORWARD and \
                not self.policy.use.settled:  # NOTE [a unit that keeps nothing at run time]
            results = self.invocation.frame.results
            for func, position, regions in self._unit_records:
                if results[func][position] is not RECOMPUTE:  # not taken back (rule 3)
                    self._unit_kept(func, regions)
            self.policy.use.pass_ended(dunder(self.layer, "__self__", self.layer))
        self._unit_records = []

    def _autocast_cast(self, args: Any) -> bool:
        # NOTE [autocast casts are never kept]
        return bool(args) and isinstance(args[0], torch.Tensor) and \
            args[0].device.type in self._autocast_on

    def _unkeep_written(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        # Rule 3: the kept value would be the changed one, and the replay would change it again.
        for tensor in _written(func, args, kwargs):
            key = _storage_id(tensor)
            found = self._kept_at.pop(key, ()) if key is not None else ()
            for op, position in found:  # NOTE [kept outputs share storages]
                self.invocation.frame.unkeep(op, position)
