"""What one boundary call carries from its original pass to its replay (``BoundaryCall``), and
the options of a boundary (``BoundaryOptions``); the boundary itself is in boundary.py, whose
docstring holds the NOTE blocks these fields follow, and its autograd Function in
boundary_function.py."""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .changed_in_place import ParameterVersions
from .errors import ReplayMismatchError, validate_bool
from .forward_hooks import ForwardHooks
from .forward_modules import ForwardModules
from .changed_numbers import ChangedNumbers
from .frames import Frame
from .hook_outputs import HookedOutputs
from .hook_tables import HookTables
from .keep import KeepPolicy
from .kept_replay import KeptReplay
from .module_state import ModuleDicts
from .refusals import fn_name
from .replay_values import OutputPrints
from .rng import ReplayEnvironment
from .shared_containers import unflatten_shared
from .state_changes import ChangedState
from .subclass import SubclassKind
from .tree import describe_leaf, first_difference, leaf_paths, unflatten

if TYPE_CHECKING:  # offload imports this package's errors: no import cycle at run time
    from offload import OffloadManager

    from .plain_state import PlainStateWatch
    from .rebound import Bound

__all__ = ["DEFAULT_OPTIONS", "NO_HELD", "BoundaryCall", "BoundaryOptions"]

# No held tensors (NOTE [empty defaults]): read-only, one for every call.
NO_HELD: Mapping[int, torch.Tensor] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryOptions:
    """Options of a boundary; they never travel as keywords of ``fn``.

    ``offload``: a manager that opens a window over the boundary's input tensor leaves at each
    call, so the inputs it saves (hidden states, top-k ids) go to host memory until backward.
    ``keep``: the ops whose outputs stay resident instead of being recomputed (save units);
    ``apply_recompute_config`` builds it from a ``RecomputeConfig``, not user code.
    ``verify_replay``: compare the replay's output values with the forward's, bit for bit.
    """

    preserve_rng_state: bool = True
    offload: OffloadManager | None = None
    keep: KeepPolicy | None = None  # what stays resident (apply_recompute_config builds it)
    verify_replay: bool = False  # NOTE [output prints] in replay_values.py

    def __post_init__(self) -> None:
        validate_bool(self.preserve_rng_state, name="preserve_rng_state")
        validate_bool(self.verify_replay, name="verify_replay", default=False)


DEFAULT_OPTIONS = BoundaryOptions()


class BoundaryCall:
    """Everything one boundary call needs for its replay, minus the tensors themselves."""

    __slots__ = ("fn", "options", "in_spec", "in_leaves", "in_tensor_index", "in_slots",
                 "in_shared", "n_inputs", "params", "owner", "out_spec", "out_leaves",
                 "out_tensor_index", "out_meta", "frame", "env", "original_call", "reported",
                 "before", "as_is", "returned_attributes", "attributes", "buffer_dicts",
                 "frozen", "frozen_at_call",
                 "changed_state", "changed_numbers", "numbers_saved", "modules",
                 "forward_modules", "hooked", "hooked_outputs", "held", "subclasses",
                 "switches", "inference", "saved_versions", "unviewed", "kept_aliases", "marks",
                 "hook_dicts", "hook_tables", "hook_epoch", "replaying",
                 "param_versions", "plain_state", "bound", "kept", "made_leaves",
                 "generator_sets", "prints", "replayed_versions", "window_hooks",
                 "held_before_replay", "forward_hooks")

    def __init__(self, fn: Callable[..., Any], options: BoundaryOptions, in_spec: Any,
                 in_leaves: list[Any], in_tensor_index: list[int], in_slots: list[int], /) -> None:
        self.fn = fn
        self.options = options
        self.in_spec = in_spec
        # Tensor leaves replaced by None (NOTE [what is saved] in boundary.py).
        self.in_leaves = in_leaves
        self.in_tensor_index = in_tensor_index
        self.in_slots = in_slots
        # Places that hold a container an earlier place holds, mapped to it (NOTE [containers
        # passed in several places] in shared_containers.py); None when none repeats.
        self.in_shared: dict[int, int] | None = None
        self.switches: Any = None  # NOTE [verified per switch] in module_state.py
        self.n_inputs = 0
        # Names of the owner's attributes passed as inputs after the call's own (NOTE
        # [attributes set before the call] in boundary.py).
        self.attributes: Sequence[str] = ()
        self.params: list[torch.Tensor] | None = None  # None: an unknown callable
        self.owner: nn.Module | None = None
        self.frame = Frame()
        # NOTE [a forward that sets a default generator's state] (generator_sets.py): the
        # states the original pass's sets left, set again in the replay; None: none.
        self.generator_sets: list[tuple[torch.Generator, torch.Tensor]] | None = None
        # NOTE [a replay kept between restricted backwards] (kept_replay.py)
        self.kept: KeptReplay | None = None
        self.out_spec: Any = None
        # NOTE [empty defaults]: an empty tuple where a call most often keeps nothing, or
        # where the forward puts its own: a list per call is one more object allocated, and
        # one more for the garbage collector to scan while the call waits for its backward.
        self.out_leaves: Sequence[Any] = ()
        self.out_tensor_index: Sequence[int] = ()
        self.out_meta: Sequence[tuple[torch.Size, torch.dtype]] = ()
        self.prints: OutputPrints | None = None  # verify_replay=True: NOTE [output prints]
        # An offload window's hooks are on top while the original pass runs (NOTE [the body
        # runs without the window's hooks] in saved.py).
        self.window_hooks = False
        self.env: ReplayEnvironment | None = None
        # The caller's own args and kwargs, for the original pass only (then dropped): fn sees
        # the very containers it was given, as in eager; the replay gets rebuilt containers,
        # one per container object passed (NOTE [containers passed in several places] in
        # shared_containers.py).
        self.original_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.reported = False  # an ActivationCensus watches this call's frame
        # Frozen parameters and buffers by id, taken before fn runs; for the original pass only.
        self.before: dict[int, torch.Tensor] | None = None
        # Inputs the original pass returned as they are, by output position; for run_boundary
        # only (then dropped).
        self.as_is: list[tuple[int, torch.Tensor]] | None = None
        # Inputs that require grad returned as they are, with attributes or of a subclass, by
        # output position (NOTE [an input returned keeps its attributes] in
        # boundary_function.py); dropped once the call returns.
        self.returned_attributes: list[tuple[int, torch.Tensor]] | None = None
        # Outputs left as detach() aliases of views, with their versions (NOTE [outputs that
        # view fn's own results] in made_before.py).
        self.unviewed: list[tuple[int, Any, int]] | None = None
        # Outputs on a storage a save unit keeps, with their versions and the op kept there
        # (NOTE [outputs on a kept storage] in made_before.py).
        self.kept_aliases: list[tuple[int, Any, int, str, str]] | None = None
        # Dynamo's marks of inputs a window offloaded, by input position (NOTE [dynamo's marks
        # reach the replay] in recompute.py): the restored tensor is a new object.
        self.marks: dict[int, dict[str, Any]] | None = None
        # The modules' buffers, by submodule, and frozen parameters; for the original pass
        # only (then dropped).
        self.buffer_dicts: Sequence[dict[str, torch.Tensor | None]] = ()
        self.frozen: Sequence[torch.Tensor] = ()
        self.frozen_at_call: Sequence[torch.Tensor] = ()  # the frozen ones, kept for backward
        # NOTE [leaves the call makes] (refusals.py): weak references to the leaves the first
        # replay reached that are neither inputs nor parameters, checked once its graph is gone.
        self.made_leaves: list[weakref.ref[torch.Tensor]] | None = None
        # What hooks and input objects held as a first replay began (refusals.py's
        # held_before_replay), for a refusal's search.
        self.held_before_replay: frozenset[int] | None = None
        # NOTE [hooks the forward registers on its parameters and inputs] (forward_hooks.py)
        self.forward_hooks: ForwardHooks | None = None
        # The threads running this call's backward now (NOTE [a replay that reaches its own
        # node] in refusals.py).
        self.replaying: set[int] = set()
        # What ctx saved, as versions when saved: names an input changed after the call where
        # torch has no SavedTensor.unpack() (before 2.12; raise_changed_after_call in
        # changed_in_place.py).
        self.saved_versions: Sequence[int | None] = ()
        # Their versions after a replay whose graph the backward kept (retain_graph): a
        # second backward that finds one moved names the first backward's write (NOTE [a
        # backward that wrote into an input] in changed_in_place.py).
        self.replayed_versions: Sequence[int | None] | None = None
        # The trainable parameters' versions as the original pass (or the last replay) left
        # them (NOTE [parameters changed in place] in changed_in_place.py).
        self.param_versions: ParameterVersions | None = None
        # What the original pass changed of the modules' state (NOTE [state the forward
        # changes] in state_changes.py); None when it changed nothing.
        self.changed_state: ChangedState | None = None
        # And of their plain numbers and flags (NOTE [numbers and flags as the forward began]
        # in forward_numbers.py).
        self.changed_numbers: ChangedNumbers | None = None
        self.numbers_saved = False  # saved before the forward: the replay's own changes stay
        # For a plain function whose original pass changed the buffers of modules it reaches:
        # their watch, for the replay (NOTE [state a plain function changes] in plain_state.py).
        self.plain_state: PlainStateWatch | None = None
        # NOTE [a module rebound before the replay] (rebound.py): a plain function's modules.
        self.bound: Bound | None = None
        # The modules fn uses and their dicts, for the original pass only (then dropped); what
        # they were then, for the replay (NOTE [the replay sees the forward's modules] in
        # forward_modules.py).
        self.modules: tuple[list[nn.Module], list[ModuleDicts]] | None = None
        self.forward_modules: ForwardModules | None = None
        # The keys of the user forward hooks that run inside (NOTE [hooked outputs leave with
        # gradients] in hook_outputs.py; empty: none), and the extra outputs the original pass
        # chose.
        self.hooked: tuple[int, ...] = ()
        # NOTE [the replay runs the forward's hooks] (hook_tables.py): the modules whose hooks
        # run inside the call (their ``__dict__``s), and their hooks as the forward began where
        # any module (or the process) had one.
        self.hook_dicts: Sequence[dict[str, Any]] | None = None
        self.hook_tables: HookTables | None = None
        self.hook_epoch = 0  # hook_tables.registered() when the forward began
        self.hooked_outputs: HookedOutputs | None = None
        # The tensors the modules held as attributes before fn ran, by id, when hooked (NOTE
        # [held tensors are not hooked outputs] in hook_outputs.py); for the original pass only.
        self.held: Mapping[int, torch.Tensor] = NO_HELD
        # Per saved input, its __torch_function__ subclass and attributes (None for a plain
        # tensor); None when every one is plain (NOTE [subclasses come back as themselves] in
        # subclass.py, NOTE [the replay sees tensor subclasses as the forward did] in rng.py).
        self.subclasses: list[SubclassKind | None] | None = None
        # Saved inputs made under inference mode, by position (NOTE [inference tensors are
        # kept as they are] in boundary_function.py); None when there is none.
        self.inference: dict[int, torch.Tensor] | None = None

    def inputs(self, tensors: tuple[torch.Tensor, ...], /
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.in_leaves)
        for index, slot in zip(self.in_tensor_index, self.in_slots):
            leaves[index] = tensors[slot]
        if self.in_shared is None:
            args, kwargs = unflatten(self.in_spec, leaves)
        else:
            args, kwargs = unflatten_shared(self.in_spec, leaves, self.in_shared)
        return args, kwargs

    def outputs(self, tensors: Sequence[torch.Tensor], /) -> Any:
        leaves = list(self.out_leaves)
        for index, tensor in zip(self.out_tensor_index, tensors):
            leaves[index] = tensor
        return unflatten(self.out_spec, leaves)

    def check_replay(self, spec: Any, leaves: list[Any], tensor_index: list[int], /) -> None:
        if (spec is self.out_spec or spec == self.out_spec) and \
                tensor_index == self.out_tensor_index:
            # NOTE [loops on the per-call path] in boundary.py
            for i, (shape, dtype) in zip(tensor_index, self.out_meta):
                leaf = leaves[i]
                if leaf.shape != shape or leaf.dtype != dtype:
                    break
            else:
                return  # the usual case; what follows finds and names the first difference
        name = fn_name(self.fn)
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
                if leaf.is_nested and len(leaf.shape) == len(shape) and leaf.dtype == dtype:
                    # A jagged output built in the call from offsets it made (or cloned): the
                    # replay's offsets are other tensor objects, so its ragged dimension is
                    # another one (j2 for j1), and autograd cannot hand it the forward's
                    # gradient (helper ET: the tip pointed at reuse_during_recompute).
                    raise ReplayMismatchError(
                        f"the replay of {name} returned a jagged nested tensor at "
                        f"{paths[index]} with another ragged dimension than the forward's: "
                        "one built in the call from offsets the call made is a new ragged "
                        "dimension at each pass",
                        expected=f"Tensor(shape={tuple(shape)}, dtype={dtype})",
                        got=describe_leaf(leaf),
                        tip="return its values and offsets (`nt.values(), nt.offsets()`) and "
                            "build the nested tensor after the call, or build it with the "
                            "offsets of a nested input (`nested_tensor_from_jagged(v, "
                            "x.offsets())`)")
                raise ReplayMismatchError(
                    f"the replay of {name} returned a different tensor at {paths[index]}",
                    expected=f"Tensor(shape={tuple(shape)}, dtype={dtype})",
                    got=describe_leaf(leaf),
                    tip=tip + "; for results that may change between passes (top-k ids, MoE "
                              "routing) use reuse_during_recompute")
