"""What the replay needs as the forward had it and finds changed in place: the boundary's
inputs (by the original pass itself, or after the call) and its trainable parameters (between
the forward and the replay: NOTE [parameters changed in place]).

Version counters tell (a call's parameters' versions, with the moves the library's own passes
made, are ``ParameterVersions``); each refusal names which input (by key path) or parameter (by
its path in the modules) changed, both versions and the fix. The boundary's Function
(``boundary_function.py``), its replay (``recompute.py``) and output discard's rebuild
(``discard.py``) call these.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from .errors import CheckpointError, SavedTensorChanged
from .module_state import structure_generation
from .refusals import fn_name, input_path
from .state_changes import versions

if TYPE_CHECKING:  # the boundary imports this module
    from .boundary_call import BoundaryCall

__all__ = ["CHANGED_AFTER_CALL_TIP", "ParameterVersions", "parameter_path",
           "raise_changed_after_call", "raise_input_changed", "raise_parameter_changed_after_call",
           "grad_switched", "refuse_grad_switched", "refuse_parameters_changed",
           "requires_grad_flags", "saved_path"]


def raise_input_changed(call: BoundaryCall, tensors: Sequence[torch.Tensor],
                        moved: list[int], /) -> None:
    paths = [input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot)
             for slot in moved]
    views = any(tensors[slot]._base is not None for slot in moved)
    # Views of one base share its counter: any of them may be the one written; each other
    # tensor's counter moved itself (helpers FS, FT: a running-softmax state's two tensors,
    # and a view beside a separate tensor, were named 'one of').
    groups: dict[int, list[str]] = {}
    for slot, path in zip(moved, paths):
        base = tensors[slot]._base
        groups.setdefault(id(tensors[slot] if base is None else base), []).append(path)
    parts = [names[0] if len(names) == 1 else "one of " + ", ".join(names)
             for names in groups.values()]
    where = f"input {parts[0]}" if len(parts) == 1 else "inputs " + " and ".join(parts)
    shared = (" (views share their base's version counter: the write may have gone to another "
              "view of the same tensor)" if views else "")
    # A sparse COO tensor's counter moves when it is only marked coalesced (`_coalesced_`,
    # which PyG's to_edge_index calls on an adjacency already coalesced): no value changed,
    # and nothing tells that apart; the fix is in the caller's hands (helper ET).
    coo = any(tensors[slot].layout == torch.sparse_coo for slot in moved)
    # A trainable input (an embedding table passed in and looked up with max_norm, which
    # renorms it in place): a clone drops the change eager makes to the caller's tensor
    # (helper NV: a row kept its norm of 5.06 where eager's was 1.0); so does one of any
    # input whose change the caller reads (helper QP: a running statistic passed in and written
    # by a custom op stayed 0): the clone is told for a change the caller does not need.
    trainable = any(tensors[slot].requires_grad and tensors[slot].is_leaf for slot in moved)
    raise CheckpointError(
        f"{fn_name(call.fn)} changed its {where} in place{shared}; the replay would run on "
        "the changed tensor and give wrong gradients",
        expected="inputs left as they are", got="a version counter moved by the original pass",
        tip=("make the change outside the checkpointed call, before it: for max_norm, "
             "torch.embedding_renorm_(table, ids, max_norm, norm_type) under torch.no_grad(), "
             "then the lookup without max_norm (a clone inside the layer would drop the change "
             "eager makes to the caller's tensor)" if trainable else
             "where the caller does not need the change, clone the input inside the layer "
             "before changing it (x = x.clone()); where it does (a running statistic passed "
             "in), keep that tensor as a buffer of the layer, or make the change outside the "
             "checkpointed call") + (
                "; a sparse COO input's counter also moves when code only marks it coalesced "
                "(`_coalesced_(True)`, as PyG's GCNConv does with a COO `adj_t`): pass it as "
                "CSR (`adj.to_sparse_csr()`)" if coo else ""))


def saved_path(call: BoundaryCall, slot: int, /) -> str:
    """The saved tensor ``slot`` of ``call`` (its inputs, then the attributes saved with them:
    NOTE [attributes set before the call] in boundary.py) by key path or attribute name."""
    return input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot) \
        if slot < call.n_inputs else \
        f"the attribute {call.attributes[slot - call.n_inputs]!r} (set before the call by a " \
        "forward pre-hook, saved with the call's inputs)"


def requires_grad_flags(tensors: Sequence[torch.Tensor], /) -> list[bool]:
    """Each tensor's ``requires_grad``, read as a call begins (NOTE [requires_grad switched
    inside the call]); a loop, not a comprehension (NOTE [loops on the per-call path] in
    boundary.py)."""
    needs = []
    for t in tensors:
        needs.append(t.requires_grad)
    return needs


def grad_switched(tensors: Sequence[torch.Tensor], needs: Sequence[bool],
                  frozen: Sequence[torch.Tensor], /) -> bool:
    """Whether the call switched an input's ``requires_grad`` (``needs``: as it began) or made a
    parameter frozen then require grad. No lists built: every LoRA layer has frozen
    parameters, read at each call."""
    for t, need in zip(tensors, needs):
        if t.requires_grad is not need:
            return True
    for p in frozen:
        if p.requires_grad:
            return True
    return False


def refuse_grad_switched(call: BoundaryCall, tensors: Sequence[torch.Tensor],
                         needs: Sequence[bool], frozen: Sequence[torch.Tensor], /) -> NoReturn:
    """NOTE [requires_grad switched inside the call]: the boundary's node takes its inputs and
    parameters as they are when the call begins: an input leaf or a frozen parameter that the
    forward itself makes require grad (``scale.requires_grad_()``, ``weight.requires_grad_(True)``
    before using it) has no edge from the node and would silently get no gradient, where eager
    gives it one; an input leaf the forward stops (``y.requires_grad_(False)``) cannot be
    stopped in the replay, whose inputs are not leaves. Both are refused after the original
    pass (once ``grad_switched`` found one), naming the tensor; so is a parameter unfrozen
    after its last use (eager: no gradient this step), which the original pass cannot tell
    from one unfrozen before. (A trainable parameter frozen inside the call gets no gradient,
    as in eager: NOTE [parameters frozen or unfrozen since the forward] in discard_function.py.)
    ``needs``: each input's ``requires_grad`` when the call began; ``frozen``: the modules'
    parameters that did not require grad then."""
    switched = [slot for slot, t in enumerate(tensors) if t.requires_grad != needs[slot]]
    unfrozen = [p for p in frozen if p.requires_grad]
    if switched:
        slot = switched[0]
        what = (f"input {input_path(call.in_spec, call.in_tensor_index, call.in_slots, slot)}"
                f" {'require' if tensors[slot].requires_grad else 'stop requiring'} grad")
    else:
        modules = call.modules[0] if call.modules is not None else []
        what = f"parameter {parameter_path(modules, unfrozen[0])!r} require grad"
    raise CheckpointError(
        f"the forward of {fn_name(call.fn)} made its {what} (requires_grad_) during the call; "
        "the boundary takes whether each input and parameter requires grad when the call "
        "begins, so its gradient would differ from eager's",
        expected="requires_grad as it was when the call began",
        got=f"switched by the forward ({len(switched) + len(unfrozen)} tensor"
            f"{'s' if len(switched) + len(unfrozen) > 1 else ''})",
        tip="set requires_grad before calling the layer (x.requires_grad_() or "
            "module.requires_grad_(True) outside it); to stop a gradient inside, use "
            "x.detach()")


_AUTOGRAD_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+)")
# The fix for a boundary input changed in place after the call (offload's copies say it too).
CHANGED_AFTER_CALL_TIP = (
    "the boundary keeps each input for the replay, where eager keeps only what backward needs "
    "(an integer position tensor, say): change a clone after the call (pos = pos + 4, not "
    "pos += 4), or make the change before the call")


def raise_changed_after_call(call: BoundaryCall, raw_saved: Sequence[Any],
                             error: RuntimeError, /) -> NoReturn:
    """An input of ``call`` (or an attribute saved with them) was changed in place after the
    call: autograd's check (or ``Unchanged``'s, under a hook) found it as backward unpacked the
    boundary's saved tensors. Named by key path: each saved tensor is unpacked again, alone,
    to find which (an error path: the cost does not matter)."""
    name = functools.partial(saved_path, call)
    changed = [_changed_since_saved(saved, call.saved_versions[slot])
               for slot, saved in enumerate(raw_saved)]
    if None in changed:  # this torch cannot tell which: named only if there is one
        names = [name(0)] if len(raw_saved) == 1 else []
    else:
        names = [name(slot) for slot, found in enumerate(changed) if found]
    views = ""
    if not names:
        where = "an input"
    elif len(names) == 1:
        where = f"the input {names[0]}"
    else:
        where = f"one of the inputs {', '.join(names)}"
        views = (" (views of one tensor share its version counter: the change may have gone "
                 "through any of them)")
    if isinstance(error, SavedTensorChanged):
        versions: tuple[object, object] = (error.saved_version, error.version)
    else:
        found = _AUTOGRAD_VERSIONS.search(str(error))
        versions = (found[2], found[1]) if found else ("?", "?")
    # NOTE [a backward that wrote into an input]: the replay's inputs are the caller's tensors
    # (aliases sharing their version counters), so a backward that writes into what it saved
    # (a custom Function's memory trick) changes the input itself; eager refuses a retained
    # graph's second backward too, but the change was no caller's (helper JQ: the message
    # said "after the call" and sent them to pos = pos + 4).
    replayed = call.replayed_versions
    if replayed is not None and any(
            after != before for after, before in zip(replayed, call.saved_versions)):
        raise CheckpointError(
            f"{where} of {fn_name(call.fn)} was changed in place by an earlier backward of this "
            f"call (a backward that writes into a tensor it saved), and the replay in backward "
            f"needs it as it was{views}", expected=f"version {versions[0]} (when saved)",
            got=f"version {versions[1]}",
            tip="write into a clone in that backward (x.clone().mul_(2)), as eager refuses "
                "this second backward too") from error
    raise CheckpointError(
        f"{where} of {fn_name(call.fn)} was changed in place after the call, and the replay in "
        f"backward needs it as it was{views}", expected=f"version {versions[0]} (when saved)",
        got=f"version {versions[1]}",
        tip=CHANGED_AFTER_CALL_TIP) from error


def _changed_since_saved(saved: Any, version: int | None) -> bool | None:
    """Whether one of autograd's saved tensors, unpacked alone, fails as backward did; None
    where this torch cannot tell. torch 2.12 and newer have ``SavedTensor.unpack()``; 2.11 has
    ``data`` and ``unpack_hook``: a saved-tensor hook is called on what it packed, and a tensor
    saved plainly is compared with its version when saved (``data`` skips autograd's check).
    Before that a saved tensor can be read only with all the others."""
    try:
        unpack = getattr(saved, "unpack", None)
        if unpack is not None:
            unpack()
            return False
        if not hasattr(saved, "data"):
            return None
        hook, data = saved.unpack_hook, saved.data
        if hook is not None:
            hook(data)
            return False
    except Exception:  # a changed one (views of one tensor share its version counter)
        return True
    return data is not None and version is not None and data._version != version


# On a parameter, the count of version moves the library's own passes made (a forward or a
# replay that changes the parameter in place: nn.Embedding's max_norm renorm). Until a pass
# first moves one, in this process, every count is 0 and none is read per call.
_OWN_MOVES = "_pytree_ckpt_own_moves"
_own_moves_seen = False


class ParameterVersions:
    """NOTE [parameters changed in place]: a call's trainable parameters'
    versions as its pass left them, and the moves the library's own passes had made by then.
    A move since that no pass of ours made (an optimizer step before backward) is the
    caller's; those our passes make (the same layer's next micro-batch, another call's
    replay) are counted on the parameter and told apart."""

    __slots__ = ("versions", "own", "generation")

    # Read four times per layer call (around the forward, around the replay): the versions
    # (read directly; versions() where asking raises: the parameters of a module built under
    # inference mode) and _own_moves are spelled out in each of these methods (a Python call
    # less each).

    @staticmethod
    def read(params: Sequence[torch.Tensor], /) -> tuple[list[int | None], list[int] | None]:
        """Before a pass: the versions, and the own-move counts if any was ever made."""
        now: list[int | None]
        try:
            now = [p._version for p in params]
        except RuntimeError:  # a module built under inference mode (see above)
            now = versions(params)
        return now, [p.__dict__.get(_OWN_MOVES, 0) for p in params] \
            if _own_moves_seen else None

    def __init__(self, params: Sequence[torch.Tensor],
                 before: tuple[list[int | None], list[int] | None], /) -> None:
        self.versions: list[int | None]
        try:
            self.versions = [p._version for p in params]
        except RuntimeError:  # a module built under inference mode
            self.versions = versions(params)
        if self.versions != before[0]:
            _count_own_moves(params, before, self.versions)
        self.own = _own_moves(params) if _own_moves_seen else None
        # Which module trees were as now: a parametrization registered since moved its
        # original's version (raise_parameter_changed_after_call names it).
        self.generation = structure_generation()

    def changed_since(self, params: Sequence[torch.Tensor], now: list[int | None], /
                      ) -> list[tuple[torch.Tensor, int, int]]:
        """The parameters changed by others than our passes, from their versions ``now``:
        (parameter, version at the call, version now)."""
        if now == self.versions:
            return []
        own = self.own or [0] * len(params)
        return [(p, v, n) for p, v, n, was in zip(params, self.versions, now, own)
                if v is not None and n is not None and
                n - v != p.__dict__.get(_OWN_MOVES, 0) - was]

    def replayed(self, params: Sequence[torch.Tensor],
                 before: tuple[list[int | None], list[int] | None], /) -> bool:
        """Count the replay's own moves; whether it moved any (the forward's change made
        again). A second backward (retain_graph) compares from here."""
        now: list[int | None]
        try:
            now = [p._version for p in params]
        except RuntimeError:  # a module built under inference mode
            now = versions(params)
        if now == before[0]:
            return False
        _count_own_moves(params, before, now)
        self.versions = now
        self.own = _own_moves(params)
        return True


def _own_moves(params: Sequence[torch.Tensor], /) -> list[int] | None:
    return [p.__dict__.get(_OWN_MOVES, 0) for p in params] if _own_moves_seen else None


def _count_own_moves(params: Sequence[torch.Tensor],
                     before: tuple[list[int | None], list[int] | None],
                     after: list[int | None]) -> None:
    """Add a pass's moves to each parameter's count, but for those a pass nested in it (an
    inner boundary's forward or replay) counted already."""
    global _own_moves_seen
    _own_moves_seen = True
    versions, own = before
    for i, (p, b, a) in enumerate(zip(params, versions, after)):
        if a is not None and b is not None and a != b:
            counted = p.__dict__.get(_OWN_MOVES, 0)
            inner = counted - (own[i] if own is not None else 0)
            p.__dict__[_OWN_MOVES] = counted + (a - b) - inner


def parameter_path(modules: Sequence[nn.Module], tensor: torch.Tensor, /) -> str:
    """Where ``modules`` (the call's own module first, then modules passed in) hold
    ``tensor`` as a parameter, or its shape (one ``torch.func.functional_call`` swapped in)."""
    for root in modules:
        prefix = "" if root is modules[0] else f"(argument {type(root).__name__})."
        for path, param in root.named_parameters(remove_duplicate=False):
            if param is tensor:
                return prefix + path
    return f"(one of shape {tuple(tensor.shape)}, not the module's own)"


def refuse_parameters_changed(watched: ParameterVersions, params: Sequence[torch.Tensor],
                              where: Callable[[], str], modules: Sequence[nn.Module], /
                              ) -> tuple[list[int | None], list[int] | None]:
    """Before a replay (the boundary's, an output discard's rebuild): refuse if a parameter
    was changed since the forward by others than our passes (NOTE [parameters changed in
    place]); the versions read, for ``watched.replayed`` after it. ``where()`` names the
    function, called only when refusing (every layer's backward passes here)."""
    before = watched.read(params)
    changed = watched.changed_since(params, before[0])
    if changed:
        raise_parameter_changed_after_call(where(), changed, modules,
                                           restructured=watched.generation
                                           != structure_generation())
    return before


def raise_parameter_changed_after_call(where: str,
                                       changed: Sequence[tuple[torch.Tensor, int, int]],
                                       modules: Sequence[nn.Module], /, *,
                                       restructured: bool = False) -> NoReturn:
    """NOTE [parameters changed in place]: the replay runs on the parameters as they are in
    backward. One changed in place between a call's forward and its backward (an optimizer
    step on a GAN's discriminator before the generator's backward through it, ``p.add_()``
    under no-grad) would be replayed with its new values and give other gradients, silently;
    eager refuses when an op saved it, and the boundary refuses for every trainable parameter
    whose version moved (versions read after the original pass, compared before the replay).
    One the forward itself changes in place (a weight constraint, ``nn.Embedding``'s
    ``max_norm`` renorm) is changed again by the replay: exact only when repeating the change
    leaves it as it is (a clamp; not the renorm, which rescales a row at the limit again);
    warned once per module when the replay moves a version again
    (``warn_parameter_changed`` in stored_state.py; a change inside
    ``reuse_during_recompute`` is not replayed, and not told). Writes through ``.data`` (a
    ``model.half()`` without ``swap_module_params_on_conversion``), and FSDP2's all-gathers
    (which keep the version counter), are not seen. A version that went back was swapped in
    with the tensor (``torch.utils.swap_tensors``: a conversion under
    ``swap_module_params_on_conversion``), and is named so. Output discard's
    rebuild (discard.py) checks its op's parameters the same way. ``where`` names the
    function, ``changed`` the parameters with their versions then and now (a move our own
    passes made, the same layer's next micro-batch changing it again, is not counted:
    ``ParameterVersions``); ``modules`` hold them, for their paths; ``restructured``: a
    submodule was registered since the forward (a parametrization, whose registration sets
    its original in place)."""
    paths = [parameter_path(modules, p) for p, _, _ in changed]
    _, version, now = changed[0]
    if any(n < v for _, v, n in changed):
        # A version counter only grows: one that went back came with the tensor's contents,
        # swapped in by torch.utils.swap_tensors (a conversion, model.double(), or
        # load_state_dict, under swap_module_params_on_conversion). Eager refuses that swap
        # (autograd holds its parameters); a checkpointed layer's original pass held none.
        raise CheckpointError(
            f"{where}'s parameter{'s' if len(paths) > 1 else ''} {', '.join(paths)} "
            f"{'were' if len(paths) > 1 else 'was'} replaced by torch.utils.swap_tensors "
            "between the forward and this backward (model.to(), .double(), .half() or "
            "load_state_dict with torch.__future__.set_swap_module_params_on_conversion(True)): "
            "the replay would run on the new tensors (eager refuses the conversion itself)",
            expected="trainable parameters left as the forward used them until its backward",
            got=f"{paths[0]}: version {version} at the forward, {now} now",
            tip="convert the model between steps (after backward), as eager requires")
    # register_parametrization moves its original's version (it sets the parameter's data
    # in place), so one registered between a call's forward and backward lands here too
    # (helper OJ: the message spoke only of optimizer steps); only where a submodule was
    # registered since (helper PB: an optimizer step on a model parametrized from the start
    # was blamed on it).
    parametrized = restructured and any(".parametrizations." in f".{path}" and
                                        ".original" in path for path in paths)
    raise CheckpointError(
        f"{where}'s parameter{'s' if len(paths) > 1 else ''} {', '.join(paths)} "
        f"{'were' if len(paths) > 1 else 'was'} changed in place between the forward and this "
        "backward (an optimizer step, an in-place update under no_grad"
        f"{', a parametrization registered since' if parametrized else ''}): the replay "
        "would run on the new values and give other gradients than the forward's",
        expected="trainable parameters left as the forward used them until its backward",
        got=f"{paths[0]}: version {version} at the forward, {now} now",
        tip="run backward before changing the parameters (step the optimizer after "
            "backward), or keep a detached copy for the forward (torch.func.functional_call "
            "with cloned parameters)" + ("; register parametrizations between steps, after "
                                         "backward (register_parametrization sets the "
                                         "original in place)" if parametrized else ""))
