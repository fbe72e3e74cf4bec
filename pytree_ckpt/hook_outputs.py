"""Outputs that forward hooks inside a boundary receive, made outputs of the boundary.

NOTE [hooked outputs leave with gradients]: a forward hook on a module *inside* a boundary runs
in the no-grad original pass. What it keeps has no graph: transformers collects
``router_logits`` (the MoE load-balancing loss) and ``output_attentions`` so, with a hook that
stores the module's output as it is, and the loss built from it silently lost its gradient.
The boundary therefore records, in both passes, the inputs (positional and keyword) and the
outputs of the modules inside it that have user forward hooks or forward pre-hooks, and returns
their floating tensors (those computed inside the call) as extra outputs of its autograd
Function. Autograd gives a tensor a Function returns its node in place, so the very tensor the
hook stored now carries the boundary's gradient; the replay records the same tensors again and
backpropagates the gradients that reached them, as eager does. Inputs count as well as outputs:
an activation hook that keeps what a projection receives (a forward hook's ``args[0]``, a
pre-hook's) lost its gradient the same way, and a pre-hook was not even warned about. A tensor a
hook *computes* (``output.softmax(-1)`` under no-grad) is not one the module received or
returned: it still has no gradient (the first replay warns about such hooks). Recorded inputs
are those the module got, after its pre-hooks: what a pre-hook kept before another rewrote the
input is no input of the module.

NOTE [only what eager would give a gradient is recorded]: in the no-grad original pass every
tensor looks alike (no grad_fn), and one made an extra output gets the boundary's node in place.
A module input from outside the call is common (a float mask from a ``functools.lru_cache``, a
global table), and so is one the call builds from no activation (a mask the first call puts in
that cache, rows of a rotary table): made extra outputs, the cached mask required grad for every
later user and backward raised, with a hook that only counted calls (a layer that worked broke),
and a mask the call built came back to the hook requiring grad where eager's does not. The
original pass therefore follows, as eager's autograd does, which tensors an activation flows
into (``GradFlow``, a ``TorchFunctionMode``, only in passes that record): an op's outputs do
when one of its tensor arguments requires grad (a parameter, an input, a view of them) or is
such an output (``detach`` and ``.data`` stop it, and an argument read for its shape:
NOTE [tensors read for their shape]; a blank tensor counts: NOTE [blank tensors]), and a tensor
written in place from one (``buf[i] = h``) does, with the tensor it views; and only those, and
views of tensors that require grad or of tensors written so, are recorded. Ids are set or
cleared at each result (an id freed in the call comes back). Eager gives the others no gradient
either. A user's own ``torch.no_grad()`` block inside the layer cannot be seen under the pass's
no-grad: its results are recorded (they come back requiring grad; eager's do not). A compiled
body runs its ops where the mode cannot key them (``blind``): there every floating tensor made
in the call is recorded, and one from outside gets the node (backward refuses it, naming the
fix: a clone made in the call).

Recording is a forward hook of this module's, installed once (prepended) on each such module;
it does nothing unless a boundary pass is recording (a thread-local stack: threads and nested
boundaries each record their own, and a nested boundary's pass records for the enclosing ones
too). Installed once, it leaves the module's hook dict unchanged from call to call (compiled
bodies guard on it); copies and pickles of the module carry it. Each record names its module,
and a replay keeps only the records of the modules its forward recorded, in the same order: a
hook added elsewhere since (before backward, or between micro-batches) changes nothing. Calls
inside ``reuse_during_recompute`` are not recorded: the replay skips them.

NOTE [the recorder is traceable]: a compiled body (``layer.forward =
torch.compile(layer.forward, fullgraph=True)``, docs/scaling.md) inlines the recorder, and
dynamo cannot read a ``ContextVar`` (``Unsupported``: the fullgraph compile of any layer with a
hooked module failed, and a partial one broke its graph at each hooked call). It reads a
``threading.local`` attribute instead, and guards on it (a graph for recording passes, one for
others). ``IN_REUSE`` is not read when compiling: ``reuse_during_recompute`` runs eagerly.
"""

from __future__ import annotations

import functools
import operator
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .eager import user_stacklevel
from .errors import ReplayMismatchError
from .keep import IN_REUSE
from .parameter_hooks import put_first
from .tree import describe_leaf, dunder, first_difference, flatten, leaf_paths

__all__ = ["GradFlow", "HookedOutputs", "has_user_forward_hooks", "held_tensors", "hooked_modules",
           "is_library_hook", "keeps_output_as_is", "recording", "remove_recorder"]

# .passes: this thread's recording passes, innermost last (a module output goes to each of
# them). Not a ContextVar: NOTE [the recorder is traceable].
_RECORDING = threading.local()
_LIBRARY_HOOKS = ("torch.", "pytree_ckpt.", "offload.")  # FSDP, module trackers, a census
_INSTALLING = threading.Lock()  # held only while a recorder is installed
_FORWARD_HOOKS = operator.itemgetter("_forward_hooks")  # of a module's __dict__
_PRE_HOOKS = operator.itemgetter("_forward_pre_hooks")


def is_library_hook(hook: Any, /) -> bool:
    """Whether ``hook`` is torch's or this library's (they only read or rewrite outputs)."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    module = dunder(fn, "__module__") or type(fn).__module__
    return (module + ".").startswith(_LIBRARY_HOOKS)


# transformers' output capturing hook (``utils/output_capturing.py``, 5.x) appends the output
# it receives, or one item of it, to its collector: it keeps the output as it is.
_KEEPS_OUTPUT_AS_IS = ("transformers.utils.output_capturing", "output_capturing_hook")


def keeps_output_as_is(hook: Any, /) -> bool:
    """Whether ``hook`` is known to keep the module output it receives as it is (so the
    output's gradient is all it needs: NOTE [hooked outputs leave with gradients])."""
    module, name = _KEEPS_OUTPUT_AS_IS
    return dunder(hook, "__module__") == module and \
        dunder(hook, "__name__") == name


def _record_output(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    # Registered with_kwargs: what the module received (after its pre-hooks) and returned.
    # Put first, it runs before the user's hooks: what the module holds now, it held when its
    # forward returned (NOTE [held tensors are not hooked outputs]).
    # Not an output recorded before in the pass, though: a hook that keeps outputs in a list
    # on the module (or on one two hooked modules share) holds the earlier call's by then
    # (helper FG).
    # In a compiled body this runs as dynamo traces it: nothing read here then, and the
    # boundary reads what those modules hold after the call instead (``compiled``; only
    # those: a hook keeping outputs on a module run eagerly beside a compiled submodule keeps
    # their graph, helper FJ).
    passes = getattr(_RECORDING, "passes", ())
    if passes and not torch.compiler.is_compiling() and (reused := IN_REUSE.get()):
        _warn_hooked_in_reuse(module, output, reused[0])
    elif passes:
        compiling = torch.compiler.is_compiling()
        # Its submodules' too: a table a child without hooks builds and the hooked module
        # returns (helper FL).
        held = held_tensors([m.__dict__ for m in module.modules()]) if not compiling else {}
        made = [t for t in flatten(output).leaves if isinstance(t, torch.Tensor)] \
            if not compiling else []
        for recorded in passes:
            recorded.append((module, (args, kwargs, output)))
            recorded.held.update((key, t) for key, t in held.items()
                                 if key not in recorded.outputs)
            recorded.outputs.update(id(t) for t in made)
            if compiling:
                recorded.compiled.append(module)


# Module classes warned about by _warn_hooked_in_reuse (a warning's dedupe, not step state).
_WARNED_IN_REUSE: weakref.WeakSet[type] = weakref.WeakSet()


def _warn_hooked_in_reuse(module: nn.Module, output: Any, fn: Any, /) -> None:
    """NOTE [hooks inside a reused call]: a module with forward hooks, called inside
    ``reuse_during_recompute`` (a router a free function is given and calls for its top-k), runs
    only in the no-grad original pass: the replay skips the call, so what a hook keeps of its
    output (transformers' ``router_logits`` for the load-balancing loss) has no graph, where
    eager's has one through the module's trainable parameters. No boundary output can give it
    one (helper JX). The layer's own hooks warning (module_state.warn_forward_hooks), told
    before the original pass, names such a module too and calls keeping its output fine: this
    one says that does not hold here (helper KF; leaving the module out of that warning lost the
    warning of a hook removed during the forward, and of a frozen module fed an activation,
    helper KH). Warned once per module class, where the module has trainable parameters
    and returned a float tensor, and the function ``fn`` does not switch grad off itself (then
    eager's has no graph either: helper JZ); a hook that only logs is told too (nothing tells
    them apart)."""
    if type(module) in _WARNED_IN_REUSE or not any(
            isinstance(t, torch.Tensor) and t.is_floating_point()
            for t in flatten(output).leaves) or \
            not any(p.requires_grad for p in module.parameters()):
        return
    from .frozen import switches_grad_off  # a rare path: imported here (frozen imports this)
    if switches_grad_off(fn):
        return
    _WARNED_IN_REUSE.add(type(module))
    warnings.warn(
        f"pytree_ckpt: {type(module).__name__} has forward hooks and ran inside "
        "reuse_during_recompute: its output there is computed under the original pass's "
        "no-grad, and the replay skips the call, so what a hook keeps of it (router logits for "
        "a load-balancing loss) gets no gradient, where eager's does (for this module, the "
        "layer's 'forward hooks inside' warning, which calls keeping a module's output as it "
        "is fine, does not hold). Tip: call the module "
        "outside the reused call and reuse only the frozen part (the top-k of its logits: "
        "reuse_during_recompute(topk_ids, logits.detach()))",
        stacklevel=user_stacklevel())


# What stops the flow: eager's results of these require no grad.
_STOPS = frozenset({torch.Tensor.detach, torch.Tensor.detach_, torch.detach})
_DATA = torch._C.TensorBase.__dict__["data"]  # .data (its getter is seen as a call)
# NOTE [tensors read for their shape]: these read their tensor arguments' shape, dtype and
# device only (eager's results require no grad, even from an activation): ``mask.to(h)``, a
# no-op that returns the mask itself, marked the mask (an lru_cache'd one broke backward), and
# ``torch.ones_like(h)`` came back to a hook requiring grad. Of the second set only ``self``
# (the first argument) is read for its values.
_SHAPE_ONLY = frozenset({
    torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
    torch.Tensor.new_tensor})
_SELF_ONLY = frozenset({torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.expand_as,
                        torch.Tensor.view_as, torch.Tensor.reshape_as})
# NOTE [blank tensors]: uninitialised memory is filled by what comes next, often a kernel the
# mode cannot see (Triton in a custom ``autograd.Function``, whose ``apply`` is no call a
# ``TorchFunctionMode`` sees either, though eager gives its outputs a gradient): a blank tensor
# is taken as in the flow (as in a compiled body) until a call the mode sees writes it in place,
# itself or through a view (``t[:n].copy_(c)``, ``out=t[:, :n]``: a table an lru_cache built so
# at the first call was taken for an activation, and backward was refused at every step); a
# view of it follows it, and is not marked itself.
_BLANK = frozenset({torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
                    torch.Tensor.new_empty_strided})


class GradFlow(torch.overrides.TorchFunctionMode):
    """The ids of the tensors the torch calls of a no-grad pass made from activations, which
    eager's autograd would give a gradient (NOTE [only what eager would give a gradient is
    recorded])."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()
        self.blank: set[int] = set()  # in ids until written: NOTE [blank tensors]
        # Appended to by a compiled body (dynamo cannot key a set by a traced tensor's id):
        # then the flow is unknown, and every tensor made in the call is taken as in it.
        self.blind: list[None] = []

    def flows(self, t: torch.Tensor, /) -> bool:
        """Whether eager would give ``t`` a gradient (the pass's no-grad aside): it requires
        grad (a parameter, an input, a view of them), an activation flowed into it, or into
        the tensor it views (written in place after the view was taken)."""
        if t.requires_grad or id(t) in self.ids:
            return True
        base = t._base
        return base is not None and (base.requires_grad or id(base) in self.ids)

    def _blank_of(self, t: torch.Tensor, /) -> torch.Tensor | None:
        """The blank tensor ``t`` is or views, if any (NOTE [blank tensors])."""
        if id(t) in self.blank:
            return t
        base = t._base
        return base if base is not None and id(base) in self.blank else None

    def _written(self, t: torch.Tensor, /) -> None:
        """``t`` written by a call the mode sees: if it is (or views) a blank tensor, that one
        is blank no more, and takes the flow of what is written (set by the caller)."""
        blank = self._blank_of(t)
        if blank is not None:
            for written in (t, blank):
                self.blank.discard(id(written))
                self.ids.discard(id(written))

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if torch.compiler.is_compiling():
            self.blind.append(None)
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        # The bookkeeping's own reads (requires_grad, _base) are no calls for a user's mode.
        with torch._C.DisableTorchFunction():
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            # A blank tensor written in place (itself, or through a view of it: t[:n].copy_(c),
            # torch.cos(f, out=t[:, :n])) takes the flow of what is written into it.
            written = first is not None and (out is first or out is None) and \
                self._blank_of(first) is not None and _in_place(func, kwargs)
            if written:
                assert first is not None
                self._written(first)
            if kwargs and kwargs.get("out") is not None:  # written as well
                for t in _tensors_in(kwargs["out"]):
                    self._written(t)
            if func in _STOPS or dunder(func, "__self__") is _DATA or \
                    func in _SHAPE_ONLY:
                flows = False
            elif func in _SELF_ONLY:  # NOTE [tensors read for their shape]
                flows = first is not None and self.flows(first)
            else:
                flows = any(map(self.flows, _tensors_in((args, kwargs))))
            blank = func in _BLANK
            mark = self.ids.add if flows or blank else self.ids.discard
            for t in (out,) if isinstance(out, torch.Tensor) else \
                    out if isinstance(out, (tuple, list)) else ():
                if isinstance(t, torch.Tensor) and t is not first:
                    # each new result set or cleared: an id freed may come back; an integer
                    # or bool result never requires grad (h > 0 read by masked_fill); a view
                    # of a blank tensor follows it (NOTE [blank tensors]), not marked itself
                    if (t.is_floating_point() or t.is_complex()) and \
                            not (t._base is not None and id(t._base) in self.blank):
                        mark(id(t))
                    else:
                        self.ids.discard(id(t))
                    (self.blank.add if blank else self.blank.discard)(id(t))
            if func is torch.Tensor.detach_ and first is not None:
                self.ids.discard(id(first))  # h.detach_(): h requires grad no more
            if flows and first is not None and (out is first or out is None):
                # Written in place (h.add_(w), buf[i] = w): it, and the tensor it views,
                # require grad in eager from then on. (An in-place call with no activation
                # leaves either as it was.)
                self.ids.add(id(first))
                if first._base is not None:
                    self.ids.add(id(first._base))
            if flows and kwargs and kwargs.get("out") is not None:  # the same for out=
                for t in _tensors_in(kwargs["out"]):
                    if t._base is not None:
                        self.ids.add(id(t._base))
        return out


def _in_place(func: Any, kwargs: Any, /) -> bool:
    """Whether ``func`` writes its first argument (``fill_``, ``copy_``, ``buf[i] = w``,
    ``F.relu(x, inplace=True)``), rather than returning it as it is (``.contiguous()``)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or name in _AUGMENTED or \
        (name.endswith("_") and not name.endswith("__")) or bool(kwargs and kwargs.get("inplace"))


_AUGMENTED = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
    "lshift", "rshift"))  # buf += h


def _tensors_in(value: Any, /) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments (in lists, tuples and dicts, at any depth)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def hooked_modules(dicts: Iterable[dict[str, Any]], roots: Sequence[nn.Module],
                   skip: nn.Module | None, /) -> tuple[int, ...]:
    """The keys of the user forward hooks and forward pre-hooks of the modules among
    ``dicts`` (each a module's ``__dict__``), empty when there are none; if there are, the
    recorder is installed on each such module of ``roots``' trees but ``skip`` that lacks it.
    Keys, not a flag: they are part of the call's switches (NOTE [verified per switch] in
    module_state.py), so a hook added beside another one verifies the module again, and a
    hook that computes is warned about (torch's handles number hooks uniquely; -1 stands for
    the recorder an enclosing pass needs, below)."""
    dicts = dicts if isinstance(dicts, list) else list(dicts)
    if not any(map(_FORWARD_HOOKS, dicts)) and not any(map(_PRE_HOOKS, dicts)):
        return ()  # the usual case: two dict lookups per submodule (C-level: no generator)
    # An enclosing pass that records (an outer boundary's replay, whose forward recorded a
    # module inside this boundary) needs this boundary to hand the module's outputs on as
    # outputs of its node, with or without user hooks on it now.
    enclosing = bool(getattr(_RECORDING, "passes", ()))
    found: list[int] = []
    for module in (m for root in roots for m in root.modules() if m is not skip):
        hooks = module._forward_hooks
        if not hooks and not module._forward_pre_hooks:
            continue
        keys = [key for table in (module._forward_pre_hooks, hooks)
                for key, hook in table.items() if not is_library_hook(hook)]
        if not keys:
            # NOTE [a recorder stays]: once the user's hooks are gone, the recorder is left
            # where it is, as a call still waiting for its backward may need it in its replay
            # (micro-batches; an outer replay, above); remove_activation_checkpointing takes it
            # off once the user's hooks are gone (it leaves it beside them: a removal between
            # a forward and its backward was refused in the replay, helper QW).
            if enclosing and _record_output in hooks.values():
                found.append(-1)
            continue
        found.extend(keys)
        if _record_output not in hooks.values():
            with _INSTALLING:  # two threads' first calls must not both install one
                if _record_output not in hooks.values():
                    # NOTE [hooks put first in place] (parameter_hooks.py): with prepend=True
                    # the fullgraph compile of a hooked layer raised InternalTorchDynamoError
                    # on torch 2.11.
                    key = module.register_forward_hook(_record_output, with_kwargs=True).id
                    put_first(hooks, key, _record_output)
        elif next(iter(hooks.values())) is not _record_output:
            # A recorder left beside the user's hooks by a removal (NOTE [a recorder stays]),
            # then a hook registered with prepend=True before a re-apply: first again, or it
            # recorded what that hook rewrote or kept (helper QX: silent, other gradients).
            with _INSTALLING:
                held = next((k for k, h in hooks.items() if h is _record_output), None)
                if held is not None:
                    put_first(hooks, held, _record_output)
    return tuple(found)


def has_user_forward_hooks(module: nn.Module, /) -> bool:
    """Whether ``module`` has forward hooks or pre-hooks of the user's (not the recorder's or
    torch's): either installs the recorder (helper QX: a pre-hook alone was missed)."""
    return any(not is_library_hook(hook) for table in (module._forward_pre_hooks,
                                                       module._forward_hooks)
               for hook in table.values())


def remove_recorder(module: nn.Module, /) -> None:
    """Take the recorder off ``module`` (``remove_activation_checkpointing``)."""
    hooks = module._forward_hooks
    for key in [key for key, hook in hooks.items() if hook is _record_output]:
        del hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)


def held_tensors(dicts: Iterable[dict[str, Any]], /) -> dict[int, torch.Tensor]:
    """The tensors the modules hold as plain attributes (each a module's ``__dict__``),
    directly or in a tuple, list or dict, by id. Read before the call, and for each hooked
    module as its forward returns (before the user's hooks run): they are no results of the
    call (one a module builds in its first call and keeps, a lazy cache, neither). Not after
    the call: a hook that keeps the output on a module (``m.kept.append(out)``, ``m.last =
    out``: an attention-map loss) stored a result of it, which then left without its graph
    and its gradient was lost (helper FC). But after the call in a compiled body, where the
    read at the return would be traced, not run (a lazy table of a hooked module there was
    made an extra output, and backward was refused at the next step: helper FH); a hook
    keeping outputs on a module in a compiled body loses their gradient, documented. The
    tensors themselves are kept until the selection is made, so their ids stay theirs (a
    pre-hook that replaces ``.weight`` frees the old one, and its id went to a fresh output).

    NOTE [held tensors are not hooked outputs]: a hooked module that returns such a tensor (a
    cached table, ``(cos, sin)`` kept as an attribute) returns the same object in both passes.
    Made an extra output, it would carry the boundary's node for good: the replay would find it
    again and backpropagate into its own node (backward hung, or was refused as a foreign
    tensor), just because a hook, even one that only reads, was on that module. Such a tensor
    requires no grad in eager either: it leaves as it is.
    """
    held: dict[int, torch.Tensor] = {}
    for d in dicts:
        for value in tuple(d.values()):
            if isinstance(value, torch.Tensor):
                held[id(value)] = value
            elif isinstance(value, (tuple, list)):
                held.update((id(v), v) for v in value if isinstance(v, torch.Tensor))
            elif isinstance(value, dict):  # a cache by key (sequence length, device)
                held.update((id(v), v) for v in value.values() if isinstance(v, torch.Tensor))
    return held


class Recorded(list):  # type: ignore[type-arg]
    """The (module, (args, kwargs, output)) of each hooked module's call, in call order;
    ``held``: the tensors those modules held as their forwards returned (``held_tensors``),
    but for the outputs recorded before; ``outputs``: the ids of those outputs' tensors (each
    held by the entries above, so no id is reused meanwhile)."""

    __slots__ = ("held", "outputs", "compiled")

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, torch.Tensor] = {}
        self.outputs: set[int] = set()
        # The hooked modules recorded as dynamo traced them: what they (and their
        # submodules) hold is read after the call instead.
        self.compiled: list[nn.Module] = []


@contextmanager
def recording() -> Iterator[Recorded]:
    """The (module, (args, kwargs, output)) of each hooked module's call in the block, in call
    order."""
    recorded = Recorded()
    enclosing = getattr(_RECORDING, "passes", ())
    _RECORDING.passes = (*enclosing, recorded)
    try:
        yield recorded
    finally:
        _RECORDING.passes = enclosing


class HookedOutputs:
    """Which recorded tensors the original pass returned as extra outputs, and their replay
    counterparts (NOTE [hooked outputs leave with gradients])."""

    __slots__ = ("modules", "positions", "meta", "specs")

    def __init__(self, recorded: Sequence[tuple[nn.Module, Any]], known: set[int],
                 flow: GradFlow | None = None, /) -> None:
        # Which module made each recorded output, in call order: the replay records those
        # modules only (a hook added or removed since, on another module, changes nothing).
        self.modules = [id(module) for module, _ in recorded]
        self.positions: list[tuple[int, int]] = []  # (call, tensor leaf) per extra output
        self.meta: list[tuple[torch.Size, torch.dtype]] = []
        # Each call's (args, kwargs, output) structure: a replay's leaf index means the same
        # place only in the same structure.
        self.specs: list[Any] = []
        self._select(recorded, known, flow)

    def _select(self, recorded: Sequence[Any], known: set[int],
                flow: GradFlow | None) -> None:
        # Computed inside the call, floating, once each: not an input, parameter, buffer or
        # frozen result (those come back as they are in eager), nor an output of fn already.
        # NOTE [views of inputs are hooked outputs too]: under the pass's no-grad a view of a
        # tensor that requires grad (an input sliced or reshaped by the hooked module, a
        # parameter transposed) requires grad, with no grad_fn: it was made in the call all the
        # same, and in eager it would carry the view's graph. Skipped, it kept no gradient.
        # NOTE [only what eager would give a gradient is recorded]: ``flow`` (None: unknown,
        # in a compiled body).
        for call, (_, output) in enumerate(recorded):
            flat = flatten(output)
            self.specs.append(flat.spec)
            for index in flat.tensor_index:
                tensor = flat.leaves[index]
                if id(tensor) in known or \
                        not (tensor.is_floating_point() or tensor.is_complex()) or \
                        (tensor.requires_grad and
                         not (tensor.grad_fn is None and tensor._is_view())):
                    continue
                if flow is not None and not flow.flows(tensor):
                    continue
                known.add(id(tensor))
                self.positions.append((call, index))
                self.meta.append((tensor.shape, tensor.dtype))

    def tensors(self, recorded: Sequence[tuple[nn.Module, Any]], /) -> list[torch.Tensor]:
        """The tensors at the chosen positions of ``recorded`` (one pass's outputs)."""
        flats = [flatten(output).leaves for _, output in recorded]
        return [flats[call][index] for call, index in self.positions]

    def names(self, owner: nn.Module | None, /) -> list[str]:
        """How a message names each extra output: the hooked module's path, then the leaf."""
        paths = {id(module): path for path, module in owner.named_modules()} \
            if owner is not None else {}
        named = []
        for call, index in self.positions:
            path = paths.get(self.modules[call])
            module = "the layer itself" if path == "" else f"submodule {path!r}" if path else \
                "a hooked module"
            # A module called several times (a shared gate): which of its calls.
            calls = [c for c, m in enumerate(self.modules) if m == self.modules[call]]
            which = f", call {calls.index(call) + 1} of {len(calls)}" if len(calls) > 1 else ""
            named.append(f"{_leaf_path(self.specs[call], index)} of {module} (kept by a forward "
                         f"hook{which})")
        return named

    def replayed(self, recorded: Sequence[tuple[nn.Module, Any]], name: str,
                 owner: nn.Module | None = None, /) -> list[torch.Tensor]:
        """The replay's counterparts, checked against what the original pass recorded
        (``owner``: the checkpointed module, if any, to name the hooked one by its path)."""
        tip = ("the modules with forward hooks must run the same way in the replay; for results "
               "that may change between passes use reuse_during_recompute")
        forward = set(self.modules)
        recorded = [entry for entry in recorded if id(entry[0]) in forward]
        if [id(module) for module, _ in recorded] != self.modules:
            raise ReplayMismatchError(
                f"the replay of {name} called its modules with forward hooks another number of "
                "times, or in another order", expected=f"{len(self.modules)} call(s)",
                got=f"{len(recorded)} call(s)", tip=tip)
        flats = [flatten(output) for _, output in recorded]
        tensors = []
        for (call, index), (shape, dtype) in zip(self.positions, self.meta):
            flat = flats[call]
            # The same structure first: another one (a term put before the kept tensor) would
            # give its leaf at the kept one's index the kept tensor's gradient, silently.
            if flat.spec != self.specs[call]:
                where, expected, got = _first_difference(self.specs[call], flat.spec)
                raise _replayed_otherwise(name, where, recorded[call][0], owner,
                                          expected, got, tip)
            tensor = flat.leaves[index]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or \
                    tensor.dtype != dtype:
                raise _replayed_otherwise(name, _leaf_path(flat.spec, index), recorded[call][0],
                                          owner, f"Tensor(shape={tuple(shape)}, dtype={dtype})",
                                          describe_leaf(tensor), tip)
            tensors.append(tensor)
        return tensors


# The parts of a recorded call, in order (what _record_output keeps).
_PARTS = ("args", "kwargs", "output")


def _first_difference(expected: Any, got: Any, /) -> tuple[str, str, str]:
    """``first_difference`` of two recorded calls' structures, rooted at the part
    (``args``, ``kwargs``, ``output``) where they differ (one does: both are 3-tuples)."""
    part, e, g = next((part, e, g) for part, e, g in
                      zip(_PARTS, expected.children(), got.children()) if e != g)
    return first_difference(e, g, root=part)


def _leaf_path(spec: Any, index: int, /) -> str:
    """The key path of a recorded call's leaf ``index`` (``output[0]``, ``args[1]``)."""
    return [path for part, child in zip(_PARTS, spec.children())
            for path in leaf_paths(child, root=part)][index]


def _replayed_otherwise(name: str, where: str, module: nn.Module, owner: nn.Module | None,
                        expected: str, got: str, tip: str, /) -> ReplayMismatchError:
    path = next((path for path, m in owner.named_modules() if m is module), "") \
        if owner is not None else ""
    kind = type(module).__name__
    return ReplayMismatchError(
        f"in the replay of {name}, the call of {f'{path} ({kind})' if path else kind} (a module "
        f"with forward hooks, which keep its tensors) differs at {where}", expected=expected,
        got=got, tip=tip)
