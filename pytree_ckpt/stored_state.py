"""What a forward stores on its modules, read around a module's first replay (NOTE [verified
per switch] in module_state.py) and warned about once per module: scalars computed with grad
stored as attributes (NOTE [results stored on a module]), Python numbers the forward changes
(NOTE [numbers a forward changes]) and transformers' own checkpointing switched on too. The
replay (``_FirstReplay`` in recompute.py) reads these; what is refused is in tree_refusals.py.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .eager import Told, user_stacklevel
from .plain_values import plain_entries, value_differs
from .changed_in_place import parameter_path
from .refusals import fn_name
from .state_changes import mark_stateful
from .torch_checkpoints import torchs_checkpoint_around
from .tree import dunder, instance_dict, object_children
from .tree_refusals import container_elements

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["stored_numbers", "stored_tensors", "warn_changed_numbers",
           "warn_first_change_unsaved", "warn_parameter_changed", "warn_stacked_checkpointing",
           "warn_stored_scalars", "warn_under_torchs_checkpoint"]

_WARNED_STORED = "_pytree_ckpt_warned_stored"
_WARNED_NUMBERS = "_pytree_ckpt_warned_numbers"


def stored_tensors(dicts: Sequence[dict[str, Any]], /) -> list[dict[str, Any]]:
    """Per module ``__dict__``, the id of each tensor attribute, and the ids of the tensors in
    each dict, list or tuple attribute, and the id of each plain object: read before an
    original pass of a module not yet verified (NOTE [results stored on a module])."""
    return [{name: id(value) if isinstance(value, torch.Tensor) or _plain_object(value) else
             _element_ids(value)
             for name, value in tuple(d.items()) if isinstance(value, torch.Tensor) or
             (isinstance(value, _HOLDERS) and name not in _MODULE_DICTS) or
             _plain_object(value)} for d in dicts]


def _plain_object(value: Any, /) -> bool:
    """An object of the user's, or torch.distributions', that may hold a result: not a
    tensor, container, module, class, function or plain value. Its ``__dict__`` is read as
    ``dunder`` reads it (a slotted class's ``__getattr__`` raising KeyError for it crashed
    the backward: helper PG); an object that cannot be asked is none."""
    try:
        return not isinstance(value, (torch.Tensor, nn.Module, type, *_HOLDERS,
                                      *_NOT_OBJECTS)) \
            and not callable(value) and isinstance(instance_dict(value), dict)
    except Exception:
        return False


_NOT_OBJECTS = (int, float, bool, str, bytes, complex, enum.Enum, torch.dtype, torch.device,
                torch.Size, set, frozenset)


_HOLDERS = (dict, list, tuple)
# nn.Module's own dicts (_buffers: a buffer registered in the forward is state, not a result)
_MODULE_DICTS = frozenset(nn.Module().__dict__)


def _element_ids(value: Any) -> frozenset[int]:
    return frozenset(id(t) for t in container_elements(value) if isinstance(t, torch.Tensor))


def _holds_a_result(value: Any, /) -> bool:
    try:  # a warning's search: an object that cannot be walked holds nothing told
        return any(isinstance(t, torch.Tensor) and t.grad_fn is not None and
                   t.is_floating_point() for _, t in object_children(value))
    except Exception:
        return False


def _scalar_result(value: Any) -> bool:
    """A floating scalar computed with grad (the replay's twin of an aux loss)."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and \
        value.is_floating_point() and value.requires_grad


class _Entries:
    """The entries of a small container of plain values, read before a first replay."""

    __slots__ = ("entries",)

    def __init__(self, entries: Any, /) -> None:
        self.entries = entries


def stored_numbers(dicts: Sequence[dict[str, Any]], /) -> list[dict[str, Any]]:
    """Per module ``__dict__``, each int, float or bool attribute, and the entries of each
    small container of plain values (a count per expert): read with ``stored_tensors`` (NOTE
    [numbers a forward changes]). A flag the forward sets once (at the first call) is set to
    the same value by the replay, and not told; one it flips (``self.odd = not self.odd``) is
    flipped back by the replay, and told."""
    found = []
    for d in dicts:
        numbers: dict[str, Any] = {}
        for name, value in tuple(d.items()):
            kind = type(value)
            if kind is int or kind is float or kind is bool:
                numbers[name] = value
            elif (entries := plain_entries(value)) is not None:
                numbers[name] = _Entries(entries)
        found.append(numbers)
    return found


def _number_differs(now: Any, before: Any, /) -> bool:
    if type(before) is _Entries:
        return plain_entries(now) != before.entries
    return value_differs(now, before)


def _warn_naming(owner: nn.Module, flag: str, modules: Sequence[nn.Module],
                 dicts: Sequence[dict[str, Any]], found: list[tuple[int, str]],
                 message: Callable[[str], str]) -> None:
    """Warn once per ``owner`` (its ``flag``) about the attributes ``found`` (index into
    ``dicts``, name), named by their module paths."""
    if not found:
        return
    owner.__dict__[flag] = Told()  # a copy is told anew
    warnings.warn(message(", ".join(_attribute_names(owner, modules, dicts, found))),
                  stacklevel=user_stacklevel())


def _attribute_names(owner: nn.Module, modules: Sequence[nn.Module],
                     dicts: Sequence[dict[str, Any]], found: list[tuple[int, str]]) -> list[str]:
    names = {id(m.__dict__): path for root in modules
             for path, m in root.named_modules(prefix="" if root is owner else
                                               f"({type(root).__name__})")}
    return [f"{names.get(id(dicts[i]), '?')}.{name}".lstrip(".") for i, name in found]


# NOTE [a small buffer first changed after the first replay]: a module's small buffers (and
# frozen parameters) are cloned before its forward at its first calls and once a forward of it
# changed state (snapshots_wanted in state_changes.py), not at every call: that would cost a
# clone per buffer per call to every layer holding one (a rotary table's inv_freq). One first
# changed in place after the layer's first replay (in a branch the first calls skipped: an
# early exit, a LayerDrop decided outside; an update gated on data) has no copy of what the
# forward read: that call's replay reads it as the forward left it, one update ahead, and where
# the output reads it (an EMA updated, then used) the call's gradients differ from eager's,
# silently before (helper NL); the layer is stateful from then on, so later calls are exact.
# Warned once per layer, naming the buffers; verify_replay=True finds such a call.
_WARNED_UNSAVED = "_pytree_ckpt_warned_unsaved"


def warn_first_change_unsaved(owner: nn.Module, roots: Sequence[nn.Module],
                              found: list[tuple[dict[str, Any], str]], /) -> None:
    """NOTE above: ``found`` is ``ChangedState.small_unsaved()`` of a call made without
    snapshots, ``roots`` the modules whose trees hold its dicts. Not a torch.nn batch or
    instance norm read by nothing else (its output in training does not read its running
    statistics: exact), but one of another class whose forward reads them (batch renorm), one
    given a forward or forward hooks, or one held by a fused QAT module that reads them
    (``ConvBn2d``: helpers NP, NS). One a reused call changed is told too (NOTE [state a reused
    call changes] in frozen.py gives the replay what the call left, for what reads it after
    the call; a read before it gets that too: helper NS)."""
    if not found or owner.__dict__.get(_WARNED_UNSAVED):
        return
    paths = {path: m for root in roots
             for path, m in root.named_modules(prefix="" if root is owner else
                                               f"({type(root).__name__})")}
    modules = {id(d): (path, m) for path, m in paths.items()
               for d in (m._buffers, m._parameters)}
    found = [(d, name) for d, name in found
             if not _a_norm_read_by_nothing(*modules.get(id(d), ("", None)), paths)]
    if not found:
        return
    owner.__dict__[_WARNED_UNSAVED] = Told()  # a copy is told anew
    names = ", ".join(f"{modules.get(id(d), ('?', None))[0]}.{name}".lstrip(".")
                      for d, name in found)
    warnings.warn(
        f"pytree_ckpt: the forward of the checkpointed {type(owner).__name__} changed {names} "
        "in place for the first time after the layer's first replay (a branch its first calls "
        "skipped: an early exit, LayerDrop; an update gated on data), when its small buffers "
        "are no longer copied before each call: this call's replay reads them as the forward "
        "left them, one update ahead, so where the output reads them its gradients differ from "
        "eager's (later calls are exact, but for buffers a kernel writes beside them without "
        "moving their versions, as F.batch_norm's running statistics where no "
        "num_batches_tracked buffer moves: those are updated twice at every later call). Tip: "
        "let the first step run every branch that changes state, or keep such state outside "
        "the checkpointed call; name a hand-written batch norm's counter num_batches_tracked; "
        "verify_replay=True finds the call (docs/limits.md, 'State the forward changes')",
        stacklevel=user_stacklevel())


_NORM_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward,
                  nn.modules.instancenorm._InstanceNorm.forward)


def _a_norm_read_by_nothing(path: str, module: nn.Module | None,
                            paths: dict[str, nn.Module], /) -> bool:
    """A torch.nn batch (or sync batch, or instance) norm run by torch's own forward, with no
    forward of its own nor hooks, whose parent is no fused QAT module (``ConvBn2d`` reads its
    ``bn.running_var``: helper NS)."""
    if not isinstance(module, nn.modules.batchnorm._NormBase) or \
            type(module).forward not in _NORM_FORWARDS or "forward" in module.__dict__ or \
            module._forward_hooks or module._forward_pre_hooks:
        # (Global hooks are not asked: a profiler's, FlopCounterMode's, would make every
        # batch norm warned of, falsely: helper NU.)
        return False
    parent = paths.get(path.rpartition(".")[0])  # the root's for a child of it
    return parent is None or not type(parent).__module__.startswith("torch.ao.nn.intrinsic")


_WARNED_STACKED = "_pytree_ckpt_warned_stacked"


def _opened_by_transformers(owner: nn.Module, fn: Callable[..., Any], /) -> bool:
    """Whether this boundary is the one transformers' layer wrapper opened, with this library
    as its checkpoint function: ``fn`` is the wrapper's ``partial(forward, self, **kwargs)``
    (5.24: the function it wrapped, not the class's forward, which is the wrapper) or
    ``partial(super().__call__, **kwargs)`` (earlier 5.x: nn.Module's call, not the class's
    override). Either runs the layer without the wrapper: its only boundary, not a second. So
    does a partial of the class's forward where that forward is the body itself, no wrapper
    (a user's own layer wrapper calling ``partial(type(self).forward, self, **kwargs)``:
    helper KG, told "checkpointed twice", and the tip turned its only checkpointing off)."""
    if not isinstance(fn, functools.partial):
        return False
    func, kind = fn.func, type(owner)
    if fn.args and fn.args[0] is owner and dunder(func, "__self__") is None:
        return func is not kind.forward or dunder(func, "__wrapped__") is None
    if dunder(func, "__self__") is owner:
        return dunder(func, "__func__") not in (kind.__call__, kind.forward)
    return False


def warn_stacked_checkpointing(owner: nn.Module, fn: Callable[..., Any], /) -> None:
    """transformers' own checkpointing switched on for a layer this boundary wraps
    (``activation_checkpointing_enable()``, ``gradient_checkpointing_enable()`` before 5.23,
    before or after wrapping): its non-reentrant
    checkpoint around the layer's call recomputes the layer once more, every step
    (gradients stay exact; its reentrant one is refused in backward). Warned once per
    layer, at its first replay; not when this boundary is the one transformers opened with
    this library's checkpoint as its function."""
    held = owner.__dict__
    if held.get("gradient_checkpointing") is not True or held.get(_WARNED_STACKED) or \
            _opened_by_transformers(owner, fn):
        return
    _warn_twice(owner, "transformers' own gradient checkpointing is on for it too")


def warn_under_torchs_checkpoint(owner: nn.Module, /) -> None:
    """The same, where torch's checkpoint runs around the layer's boundary, told at the
    layer's first calls (``torchs_checkpoint_around`` in torch_checkpoints.py): transformers
    4.x keeps its flag on the model, not the layer, and calls torch's checkpoint on the
    layer's ``__call__`` (helper HQ: silent there), as does a ``checkpoint_wrapper`` or
    torchtune's wrapper left around a wrapped layer."""
    if owner.__dict__.get(_WARNED_STACKED) or not torchs_checkpoint_around():
        return
    _warn_twice(owner, "torch's checkpoint runs around it too (transformers' own gradient "
                       "checkpointing, or a torch.utils.checkpoint wrapper)")


def _warn_twice(owner: nn.Module, why: str, /) -> None:
    owner.__dict__[_WARNED_STACKED] = Told()  # a copy is told anew
    warnings.warn(
        f"pytree_ckpt: {type(owner).__name__} is checkpointed twice: {why}, so each step runs "
        "its forward once more than needed (gradients stay exact). Tip: "
        "model.activation_checkpointing_disable(), or TrainingArguments(activation_"
        "checkpointing=False) (before transformers 5.23: model.gradient_checkpointing_disable(), "
        "TrainingArguments(gradient_checkpointing=False)), or drop torch's wrapper, and keep "
        "pytree_ckpt's", stacklevel=user_stacklevel())


def warn_stored_scalars(owner: nn.Module, modules: Sequence[nn.Module],
                        dicts: Sequence[dict[str, Any]], before: list[dict[str, Any]], /) -> None:
    """NOTE [results stored on a module]: ``self.aux_loss = ...`` in a forward (an MoE
    layer's load-balancing loss, collected after the step) stores, in the original pass, a
    value computed under no-grad: a loss built from it has no gradient through it, silently
    (the replay stores one with a graph that nothing reads). Documented, and said once per
    module, when its replay stores a new floating scalar that requires grad (read around a
    module's first replay with each switch), as an attribute or in a dict, list or tuple
    attribute (``self.stats = {"aux": loss}``): a constant cached per length needs no grad,
    and is not told; nor is a cache (a rotary table): scalars only. A plain object the replay
    stores anew (a posterior ``Normal`` kept for the KL taken after the model, a dataclass
    holding the KL: helper PD) is told where an attribute of it is a floating tensor computed
    with grad, of any shape."""
    if owner.__dict__.get(_WARNED_STORED):
        return
    found = [(index, name) for index, (d, old) in enumerate(zip(dicts, before))
             for name, value in tuple(d.items())
             if (_scalar_result(value) and old.get(name) != id(value)) or
             (isinstance(value, _HOLDERS) and name not in _MODULE_DICTS and any(
                 _scalar_result(t) and id(t) not in old.get(name, ())
                 for t in container_elements(value))) or
             (_plain_object(value) and old.get(name) != id(value) and _holds_a_result(value))]
    # An object is no PyTree to return as it is (a posterior Normal is refused among the
    # outputs): its tensors are (helper PH).
    objects = any(_plain_object(dicts[index].get(name)) for index, name in found)
    _warn_naming(owner, _WARNED_STORED, modules, dicts, found, lambda where: (
        f"pytree_ckpt: the forward of the checkpointed {type(owner).__name__} stored {where} "
        "on a module: computed in the no-grad original pass, it has no gradient, and a loss "
        "built from it (an auxiliary load-balancing loss, a KL term) silently loses that "
        "term. Tip: " + ("return the tensors the loss needs as outputs of the layer (a "
                         "posterior's loc and scale, or the KL itself; any PyTree), or "
                         "register the object's class with optree in namespace 'pytree_ckpt' "
                         "and return it" if objects else
                         "return it as an output of the layer (any PyTree), or keep the "
                         "router's output with a forward hook and compute the loss from it "
                         "after the layer's call (docs/boundary.md, 'Forward hooks inside a "
                         "layer')")))


def warn_changed_numbers(owner: nn.Module, modules: Sequence[nn.Module],
                         dicts: Sequence[dict[str, Any]],
                         before: list[dict[str, Any]], /) -> None:
    """NOTE [numbers a forward changes]: a Python int or float attribute the forward changes
    (``self.calls += 1``, a warm-up scale) is put back as the forward began for the replay
    where it was saved before the forward (NOTE [numbers and flags as the forward began] in
    forward_numbers.py), or seen rebound by the glance (NOTE [a number first changed after
    the first replay]). Where neither saw it (an entry of a small container first changed in
    place after the module's first replay, with a new switch), the replay changes it again
    and computes with the changed value: eager's gradient is not the replay's, and the count
    ends one ahead. Read
    around a module's first replay with each switch; said once per module. The module is then
    marked stateful, so its later calls save them. One the forward sets to a value it computes
    (``self.seq_len = x.shape[1]``) is set to the same value by the replay, and not told."""
    found = [(index, name) for index, (d, old) in enumerate(zip(dicts, before))
             for name, value in old.items() if _number_differs(d.get(name), value)]
    if found:
        mark_stateful(owner)
    if owner.__dict__.get(_WARNED_NUMBERS):
        return
    _warn_naming(owner, _WARNED_NUMBERS, modules, dicts, found, lambda where: (
        f"pytree_ckpt: the forward of the checkpointed {type(owner).__name__} changed the "
        f"number {where} again in its replay in backward, and computed with the changed "
        "value (a counter ends a step ahead, a scale read from it gives other gradients). "
        "This call's numbers were not saved before its forward (the layer first changed "
        "state after its first replay); from the layer's next call on they are, and each "
        "replay reads them as its forward began (docs/limits.md, 'Module state'). Tip: where "
        "this step's value matters, change such numbers outside the checkpointed call"))


_WARNED_PARAMETER = "_pytree_ckpt_warned_parameter"


def warn_parameter_changed(call: BoundaryCall, before: list[int | None], /) -> None:
    """NOTE [parameters changed in place] (changed_in_place.py): the replay changed a trainable
    parameter in place (``before``: the versions it started from), as the original pass did.
    Said once per module, naming the parameters."""
    assert call.params is not None
    held = call.owner.__dict__ if call.owner is not None else None
    if held is not None and held.get(_WARNED_PARAMETER):
        return
    if held is not None:
        held[_WARNED_PARAMETER] = Told()  # a copy is told anew
    modules = call.forward_modules.roots if call.forward_modules is not None else \
        [call.owner] if call.owner is not None else []
    paths = [parameter_path(modules, p) for p, version in zip(call.params, before)
             if version is not None and p._version != version]
    warnings.warn(
        f"pytree_ckpt: the forward of {fn_name(call.fn)} changed its "
        f"parameter{'s' if len(paths) > 1 else ''} {', '.join(paths)} in place, and its replay "
        "in backward changes it again: exact only "
        "if repeating the change leaves it as it is (a clamp), otherwise the step ends with "
        "the change made twice and other gradients (nn.Embedding's max_norm renorm rescales "
        "a row at the limit again: equal to rounding). "
        "Tip: make the change outside the checkpointed call (before the forward, or after "
        "the optimizer step; for max_norm, an Embedding without it and torch.embedding_renorm_"
        "(weight, ids, max_norm, norm_type) under no_grad before the layer), or compute with a "
        "changed copy (w = self.weight * 0.5); "
        "one that takes no gradient (a MoE router's e_score_correction_bias) can be frozen "
        "(requires_grad_(False)) or registered as a buffer: the replay then changes a copy",
        stacklevel=user_stacklevel())
