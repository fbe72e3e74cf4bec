"""Selective save units: ``RecomputeConfig(ratio, save=...)`` and a model's ``RecomputeTargetMap``.

``ratio`` decides which layers are checkpointed (the first ``int(n * ratio)``); ``save`` decides
what stays resident inside them. A ``SaveUnit`` member means *keep this*: its outputs are kept
from the original pass and returned in the replay instead of being recomputed. Each unit a model
declares resolves to ``KeptOps`` (by op identity) or ``KeptCallables`` (everything a callable
dispatches). Either way the layer's body runs eagerly: a compiled body is refused (NOTE [save
units need eager bodies]). See ``keep.py`` for the engine.

``save`` is tri-state: ``None``/``False`` keep nothing and install no dispatch mode at all;
``True`` keeps every unit the model declares (this follows the library and model version: pin an
explicit list for stable memory); a list keeps exactly those units.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import inspect
import json
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from .boundary_call import BoundaryOptions
from .eager import KEPT_CALLABLE_REASON, runs_eagerly
from .errors import CheckpointConfigError, CheckpointError
from .keep import IN_KEPT_CALLABLE, KeepPolicy, never_kept
from .module import (body_forward, install_boundary, is_checkpointed, layer_count,
                     listed_layers, refuse_other_options, resolve_offload, validate_ratio)

if TYPE_CHECKING:  # offload imports this package's errors: imported lazily at run time
    from offload import OffloadManager

__all__ = ["KeptCallables", "KeptOps", "RecomputeConfig", "RecomputeTargetMap", "SaveUnit",
           "apply_recompute_config"]

log = logging.getLogger(__name__)


class SaveUnit(str, enum.Enum):
    """A part of a layer that may be kept resident instead of recomputed."""

    ATTN = "attn"
    DSA_INDEXER = "dsa_indexer"
    MOE_GATE = "moe_gate"
    MOE_DISPATCH = "moe_dispatch"

    def __str__(self) -> str:
        return self.value


class KeptOps:
    """Keep the outputs of ops, by qualified name (``"aten::mm"``, ``"glm_dsa::topk"``), one
    overload (``"aten::addmm.default"``, as torch's selective checkpoint and torchtitan list
    ops), or op object (``torch.ops.aten.mm``, ``torch.ops.aten.mm.default``).

    Names this torch build lacks are skipped (so a v2/v3 pair of kernel names resolves);
    a unit none of whose names exists warns once when applied, and a missing name close to one
    that exists warns naming it. An op the keep rules never keep (views, clones, collectives:
    docs/save_units.md) is skipped with a warning naming why.
    """

    def __init__(self, *ops: str | torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> None:
        names = [_op_name(op) for op in ops]
        bad: Any = next((op for op, n in zip(ops, names)
                         if not (isinstance(n, str) and "::" in n)), None)
        if not names or bad is not None:
            higher_order = isinstance(bad, torch._ops.HigherOrderOperator)
            raise CheckpointConfigError(
                "KeptOps takes one or more op names of the form 'namespace::name' (or "
                "'namespace::name.overload'), or torch.ops objects",
                expected="e.g. KeptOps('aten::mm', 'glm_dsa::sparse_mla_attention') or "
                         "KeptOps(torch.ops.aten.addmm.default)",
                got=(f"the higher-order op {bad.name()!r}" if higher_order else repr(bad))
                if names else "nothing",
                tip="a higher-order op (flex_attention) is no single op the mode that keeps "
                    "ops sees: keep the method that calls it with KeptCallables('Class.method')"
                    if higher_order else "op identity is the namespace and the op's name")
        self.op_names = tuple(names)

    def __repr__(self) -> str:
        return f"KeptOps{self.op_names!r}"

    def resolve(self) -> list[Any]:
        """The ops (``OpOverloadPacket``s, or ``OpOverload``s for names with an overload) that
        exist in this build and reach dispatch.

        An op that this build decomposes before dispatch (only a ``CompositeImplicitAutograd``
        kernel: ``aten::linear``, ``aten::scaled_dot_product_attention``) never reaches the
        mode that keeps ops: it is skipped with a warning naming the fix, like a missing name
        (a build with a kernel of its own for it, e.g. CUDA's ``aten::_fused_rms_norm``, keeps
        it).
        """
        return self._resolve()[0]

    def _resolve(self) -> tuple[list[Any], list[str]]:
        """``resolve``'s ops, and the names skipped with a warning (decomposed before
        dispatch, ops the keep rules never keep, missing names close to existing ones)."""
        found, warned = [], []
        for name in self.op_names:
            namespace, qualified = name.split("::", 1)
            op_name, _, overload = qualified.partition(".")
            try:
                packet = getattr(getattr(torch.ops, namespace), op_name)
                target = getattr(packet, overload) if overload else packet
            except (AttributeError, RuntimeError):
                close = _near_op_names(name, self.op_names)
                if close:
                    warnings.warn(f"KeptOps({name!r}) names no op in this build; did you mean "
                                  f"{' or '.join(map(repr, close))}?", stacklevel=3)
                    warned.append(name)
                continue
            reason = never_kept(namespace, packet, overload or None)
            if reason is not None:
                warnings.warn(f"KeptOps({name!r}) keeps nothing: {reason}", stacklevel=3)
                warned.append(name)
                continue
            base = f"{namespace}::{op_name}"
            if _decomposed_before_dispatch(base, packet, overload or None):
                warnings.warn(
                    f"KeptOps({name!r}) keeps nothing in this build: torch decomposes {name} "
                    "into other ops (a CompositeImplicitAutograd kernel) before the mode that "
                    "keeps ops sees it; name the ops it becomes (list them by running the layer "
                    "under torch.utils.flop_counter.FlopCounterMode or a TorchDispatchMode), "
                    "e.g. aten::addmm for aten::linear, or keep the method that calls it with "
                    "KeptCallables('Class.method')", stacklevel=3)
                warned.append(name)
                continue
            found.append(target)
        return found, warned


def _op_name(op: Any) -> Any:
    """The qualified name of a torch.ops object (``aten::mm``, ``aten::mm.default``); anything
    else as it is (refused by the caller unless a name)."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return op


def _near_op_names(name: str, named: Sequence[str]) -> list[str]:
    """Ops close to ``name`` that this build has and ``named`` does not name: a typo, not a
    kernel version this build lacks (a v2/v3 pair names both; a namespace not loaded, e.g.
    flash-attn not installed, has none). For an existing op with another overload, its
    overloads."""
    namespace, qualified = name.split("::", 1)
    op_name, _, overload = qualified.partition(".")
    base = f"{namespace}::{op_name}"
    bases = {n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith(namespace + "::")}
    if overload and base in bases:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return [f"{base}.{o}" for o in packet.overloads()
                if not getattr(packet, o)._schema.is_mutable]  # out= variants are never kept
    taken = {n.split(".", 1)[0] for n in named}
    if any(base != other and (base.startswith(other) or other.startswith(base))
           for other in taken):
        return []  # a version of a named op (_efficient_attention_forward_v2)
    # Not suggested: in-place variants (addmm_, never kept), and backward kernels.
    return [c for c in difflib.get_close_matches(base, sorted(bases), n=3, cutoff=0.85)
            if c not in taken and not c.endswith(("_", "_backward"))]


# A kernel under any of these keys runs the op itself on that device: the mode that keeps ops
# sees it there (``aten::_fused_rms_norm`` has CUDA kernels and a composite fallback).
_OWN_KERNEL_KEYS = ("CPU", "CUDA", "XPU", "MPS", "PrivateUse1", "CompositeExplicitAutograd",
                    "CompositeExplicitAutogradNonFunctional")


def _decomposed_before_dispatch(name: str, packet: Any, only: str | None = None) -> bool:
    """Every functional overload of ``packet`` (or the one named ``only``) has a
    CompositeImplicitAutograd kernel and no kernel of its own on any device (the out=
    overloads are never what a forward calls)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    decomposed = None
    for overload in [only] if only else packet.overloads():
        qualified = name if overload == "default" else f"{name}.{overload}"
        try:
            if getattr(packet, overload)._schema.is_mutable:
                continue
            composite_only = has(qualified, "CompositeImplicitAutograd") and not any(
                has(qualified, key) for key in _OWN_KERNEL_KEYS)
        except RuntimeError:  # listed, but unknown to the dispatcher (aten::einsum.sublist)
            continue
        if not composite_only:
            return False
        decomposed = True
    return bool(decomposed)


class KeptCallables:
    """Keep everything these callables dispatch: methods (functions or ``"Class.method"``).

    Each matching method of a checkpointed layer's submodules is wrapped so the ops it runs
    are kept; the wrapper is excluded from torch.compile (it must see every op).
    """

    def __init__(self, *callables_or_qualnames: Callable[..., Any] | str) -> None:
        if not callables_or_qualnames:
            raise CheckpointConfigError("KeptCallables needs at least one callable",
                                        expected="a method or 'Class.method'", got="nothing",
                                        tip="e.g. KeptCallables('Router.project')")
        self.targets = tuple(callables_or_qualnames)

    def __repr__(self) -> str:
        return f"KeptCallables{self.targets!r}"

    def matches(self, module: nn.Module, /) -> list[str]:
        """Names of ``module``'s methods that this unit keeps."""
        names = []
        classes = {c.__qualname__ for c in type(module).__mro__}
        for target in self.targets:
            if isinstance(target, str):
                owner, _, method = target.rpartition(".")
                if owner in classes and callable(getattr(type(module), method, None)):
                    names.append(method)
            else:
                name = getattr(target, "__name__", "")
                if getattr(type(module), name, None) is target:
                    names.append(name)
        return names


RecomputeTarget = Union[KeptOps, KeptCallables]
RecomputeTargetMap = Mapping[SaveUnit, RecomputeTarget]


def _unit(value: object, /) -> SaveUnit:
    try:
        return SaveUnit(value)
    except ValueError:
        raise CheckpointConfigError(
            f"unknown save unit {value!r}", expected=[u.value for u in SaveUnit], got=repr(value),
            tip="use SaveUnit members or their string values. `save` lists what stays "
                "resident, the inverse of Megatron's recompute_modules (what is recomputed): "
                "to recompute one submodule (core_attn, mlp), checkpoint it with "
                "apply_activation_checkpointing; a norm or activation (layernorm, moe_act), "
                "with CheckpointWithoutOutput (docs/save_units.md, 'Coming from "
                "Megatron-Core')") from None


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """Which layers are recomputed (``ratio``) and what stays resident in them (``save``)."""

    ratio: float = 1.0
    # Given as any sequence of units or their names; stored as a tuple of SaveUnit. An option,
    # so keyword-only: RecomputeConfig(0.5, save=["attn"]).
    save: Sequence[SaveUnit | str] | bool | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", validate_ratio(self.ratio))
        save = self.save
        if save is None or isinstance(save, bool):
            return
        if isinstance(save, (str, bytes, SaveUnit)) or not isinstance(save, Sequence):
            raise CheckpointConfigError(
                "RecomputeConfig.save takes None, a bool, or a list of save units",
                expected="None | bool | list[SaveUnit | str]", got=repr(save),
                tip="wrap a single unit in a list: save=['attn']")
        units = tuple(dict.fromkeys(_unit(v) for v in save))
        object.__setattr__(self, "save", units)

    def to_json(self) -> str:
        """The config as JSON (``from_json`` reads it back)."""
        save = self.save if self.save is None or isinstance(self.save, bool) else [
            _unit(u).value for u in self.save]
        return json.dumps({"ratio": self.ratio, "save": save})

    @classmethod
    def from_json(cls, text: str, /) -> RecomputeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointConfigError(
                f"RecomputeConfig JSON does not parse: {err}", expected='{"ratio": ..., '
                '"save": ...}', got=repr(text[:80]),
                tip="write it with RecomputeConfig.to_json()") from None
        if not isinstance(data, dict):
            raise CheckpointConfigError(
                "RecomputeConfig JSON must be an object", expected='{"ratio": ..., "save": ...}',
                got=type(data).__name__, tip="write it with RecomputeConfig.to_json()")
        unknown = set(data) - {"ratio", "save"}
        if unknown:
            raise CheckpointConfigError(
                f"RecomputeConfig JSON has unknown keys {sorted(unknown)}",
                expected=["ratio", "save"], got=sorted(data), tip="remove or rename them")
        return cls(**data)


class _KeptMethod:
    """A module's method wrapped so every op it dispatches is kept (weak: no cycle).

    NOTE [kept methods follow copies]: installed as an instance attribute, it is copied with
    its module's ``__dict__``. A function would be shared by ``copy.deepcopy`` (functions copy
    as themselves) and would go on calling the *original* module's method, and it could not be
    pickled; this object is rebound to the copy instead, as the installed forward is.

    NOTE [kept methods wrap what the instance had]: an instance attribute already under the
    name (a patched method, a wrapper another library installed) is what eager calls: it is
    wrapped (``inner``) and called, not the class's method, and removing checkpointing puts it
    back. A static or class method is called without the module.
    """

    __slots__ = ("module_ref", "name", "inner", "bound", "__weakref__")
    _pytree_ckpt_kept = True  # what remove_activation_checkpointing looks for

    def __init__(self, module: nn.Module, name: str, inner: Any = None) -> None:
        self.module_ref = weakref.ref(module)
        self.name = name
        self.inner = inner  # the instance attribute it replaced, if any
        # Whether the class's attribute takes the module first (a plain method), read anew at
        # each call from the class (a patched class method is honoured).
        self.bound = not isinstance(inspect.getattr_static(type(module), name, None),
                                    (staticmethod, classmethod))

    @property
    def __self__(self) -> nn.Module | None:
        # Like a bound method's: whoever checkpoints it (output discard) finds the module.
        return self.module_ref()

    # Excluded from torch.compile: the region flag must see every op it runs. (Lazily: a
    # class-level torch.compiler.disable imported dynamo with the package.)
    @runs_eagerly(KEPT_CALLABLE_REASON)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:  # a method taken from its module, called after the module was freed
            raise CheckpointError(
                f"the module of the kept method {self.name} no longer exists",
                expected="the module whose method this is, alive",
                got="a method kept after its module was freed",
                tip=f"call {self.name} through the module (module.{self.name}(...)), not a "
                    "method taken from it")
        token = IN_KEPT_CALLABLE.set(True)
        try:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            if self.bound:
                return getattr(type(module), self.name)(module, *args, **kwargs)
            return getattr(type(module), self.name)(*args, **kwargs)
        finally:
            IN_KEPT_CALLABLE.reset(token)

    def __deepcopy__(self, memo: dict[int, Any]) -> _KeptMethod:
        # copy.deepcopy(module) registers the new module in memo before copying its __dict__
        # (a bound method as inner is rebound to the copy the same way).
        module = self.module_ref()
        assert module is not None  # a module being copied is alive
        return _KeptMethod(memo.get(id(module), module), self.name,
                           copy.deepcopy(self.inner, memo))

    def __reduce__(self) -> Any:
        return (_KeptMethod, (self.module_ref(), self.name, self.inner))


def _selected(config: RecomputeConfig, targets: RecomputeTargetMap) -> list[SaveUnit]:
    if config.save is None or config.save is False:
        return []
    declared = [_unit(u) for u in targets]
    if config.save is True:
        if not declared:
            warnings.warn("RecomputeConfig(save=True) on a model that declares no save units: "
                          "nothing is kept", stacklevel=3)
        return declared
    assert isinstance(config.save, tuple)
    missing = [u for u in config.save if u not in declared]
    if missing:
        raise CheckpointConfigError(
            f"save units {[u.value for u in missing]} are not declared by this model",
            expected=[u.value for u in declared], got=[u.value for u in config.save],
            tip="choose among the units the model's RecomputeTargetMap declares" if declared
            else "declare what each unit keeps in the targets, the third argument: "
                 "{'attn': KeptOps('aten::_scaled_dot_product_flash_attention_for_cpu')} keeps "
                 "an op's outputs, {'moe_gate': KeptCallables('Router.forward')} a method's "
                 "(docs/save_units.md, 'Declaring targets for your model')")
    return list(config.save)


def apply_recompute_config(layers: Iterable[nn.Module], config: RecomputeConfig,
                           targets: RecomputeTargetMap, /, *, preserve_rng_state: bool = True,
                           offload: bool | OffloadManager | None = None) -> list[int]:
    """Checkpoint the first ``int(n * config.ratio)`` layers keeping ``config.save``'s units.

    Returns the indices of the checkpointed layers. ``offload`` as in
    ``apply_activation_checkpointing``.
    """
    if not isinstance(config, RecomputeConfig):
        raise CheckpointConfigError(
            "apply_recompute_config takes a RecomputeConfig", expected="RecomputeConfig",
            got=type(config).__name__,
            tip="RecomputeConfig(ratio, save=[...]), or RecomputeConfig.from_json(text)")
    for unit, target in targets.items():
        if not isinstance(target, (KeptOps, KeptCallables)):
            raise CheckpointConfigError(
                f"the target of save unit {unit!r} is neither KeptOps nor KeptCallables",
                expected="KeptOps(op names) | KeptCallables(method paths)",
                got=type(target).__name__,
                tip="KeptOps('aten::mm') keeps ops by name; KeptCallables('Gate.project') "
                    "keeps everything a method dispatches")
    listed = listed_layers(layers, "apply_recompute_config")
    count = layer_count(len(listed), config.ratio)
    chosen = listed[:count]
    units = _selected(config, targets)
    if units:
        _refuse_compiled_bodies(chosen)
    ops: list[Any] = []
    wrapped: list[str] = []
    kept: list[tuple[nn.Module, str]] = []  # installed once every layer was checked
    if units and not chosen:
        warnings.warn(f"RecomputeConfig(ratio={config.ratio}) checkpoints none of the "
                      f"{len(listed)} layers: the save units {[u.value for u in units]} keep "
                      "nothing", stacklevel=2)
    for unit in units if chosen else ():
        target = targets[unit]
        if isinstance(target, KeptOps):
            found, warned = target._resolve()
            missing = [name for name in target.op_names if name not in warned]
            if not found and missing:  # the others were warned about by name
                warnings.warn(f"save unit {unit.value!r} keeps nothing: the ops {missing} do "
                              "not exist in this build (and the others, if any, were "
                              "skipped with a warning above)", stacklevel=2)
            ops.extend(found)
            log.info("save unit %s keeps ops %s", unit.value, [str(op) for op in found])
        else:
            found_methods = _kept_methods(chosen, target)
            kept.extend(found_methods)
            names = [f"{type(module).__qualname__}.{name}" for module, name in found_methods]
            if not names:
                warnings.warn(f"save unit {unit.value!r} keeps nothing: no checkpointed layer "
                              f"has a method matching {list(target.targets)}"
                              f"{_near_misses(chosen, target)}", stacklevel=2)
            wrapped.extend(names)
            log.info("save unit %s keeps everything %s dispatch",
                     unit.value, sorted(set(names)))
    policy = None
    if units:
        policy = KeepPolicy(ops, callables=wrapped,
                            description=", ".join(u.value for u in units))
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload), keep=policy)
    # Before anything changes: refused, nothing changes.
    for index, layer in enumerate(chosen):
        refuse_other_options(layer, options, index=index)
    _refuse_checkpointed_beyond(listed, count, config.ratio)
    for module, name in kept:
        _refuse_unkeepable(module, name, chosen)
    for module, name in kept:
        held = module.__dict__.get(name)
        if not getattr(held, "_pytree_ckpt_kept", False):
            module.__dict__[name] = _KeptMethod(module, name, held)
    for layer in chosen:
        install_boundary(layer, options)
    return list(range(count))


def _refuse_checkpointed_beyond(layers: Sequence[nn.Module], count: int, ratio: float) -> None:
    """A layer past the first ``count`` that is checkpointed (an earlier config with a higher
    ratio) would stay so, and the returned indices would be wrong."""
    for index in range(count, len(layers)):
        if is_checkpointed(layers[index]):
            raise CheckpointConfigError(
                f"layer {index} ({type(layers[index]).__name__}) is checkpointed, but "
                f"ratio={ratio} checkpoints only the first {count} of {len(layers)} layers",
                expected=f"layers {count}..{len(layers) - 1} not checkpointed",
                got=f"layers[{index}] checkpointed (an earlier apply with a higher ratio?)",
                tip="call remove_activation_checkpointing on every layer first, then apply "
                    "the new config")


def _refuse_unkeepable(module: nn.Module, name: str, layers: list[nn.Module]) -> None:
    """NOTE [kept methods wrap what the instance had], and its exceptions: a layer's own
    forward (the boundary goes there), a boundary of the module's own (``forward``
    checkpointed on its own) and a compiled callable (NOTE [save units need eager bodies])
    cannot run inside a kept region."""
    qualname = f"{type(module).__qualname__}.{name}"
    if name == "forward" and any(module is layer for layer in layers):
        raise CheckpointConfigError(
            f"a save unit keeps {qualname}, the forward of a checkpointed layer: everything "
            "in it would be kept", expected="methods of the layer's submodules (or its "
            "other methods)", got=f"{qualname} on a layer the ratio checkpoints",
            tip="leave such layers out of the checkpointed ones (a lower ratio) instead")
    if name == "forward" and is_checkpointed(module):
        raise CheckpointConfigError(
            f"{qualname} is kept by a save unit, but {type(module).__name__} is checkpointed on "
            "its own: a unit keeps what a replay would recompute, and a nested boundary "
            "recomputes it anyway", expected="a kept method that is not itself checkpointed",
            got=f"apply_activation_checkpointing on the {type(module).__name__} inside a layer",
            tip=f"remove_activation_checkpointing on the {type(module).__name__}, or drop "
                "the unit")
    on_class = inspect.getattr_static(type(module), name, None)
    on_class = getattr(on_class, "__func__", on_class)  # a static or class method's function
    for where, held in (("instance attribute", module.__dict__.get(name)),
                        ("class attribute", on_class)):
        if _compiled(held):
            raise CheckpointConfigError(
                f"{qualname} is kept by a save unit, but it is a torch.compile'd callable: "
                "the dispatch mode that keeps ops makes dynamo skip it (it would run "
                "eagerly, or raise with fullgraph=True)",
                expected="an eager method", got=f"a compiled {where}",
                tip="drop the unit for this method, or do not compile it")


def _compiled(forward: Any) -> bool:
    """Whether ``forward`` is a ``torch.compile``d callable (not a ``torch.compiler.disable``d
    one, which carries the same marker)."""
    return getattr(forward, "_torchdynamo_orig_callable", None) is not None and \
        not getattr(forward, "_torchdynamo_disable", False)


def _refuse_compiled_bodies(layers: list[nn.Module]) -> None:
    """NOTE [save units need eager bodies]: a unit keeps ops through a ``TorchDispatchMode``
    active around the original pass and the replay, and dynamo skips every frame while a
    (non-infra) dispatch mode is active. A compiled body behind a save unit therefore runs
    eagerly, dynamo marks its code skipped for every later call (other layers sharing the code,
    checkpointed or not, stop compiling too), and a ``fullgraph=True`` body raises "found no
    compiled frames". Refused before anything changes, naming the layer."""
    for index, layer in enumerate(layers):
        if _compiled(body_forward(layer)) or _compiled(layer):
            raise CheckpointConfigError(
                f"layer {index} ({type(layer).__name__}) has a torch.compile'd forward, and save "
                "units cannot run inside a compiled body: the dispatch mode that keeps ops makes "
                "dynamo skip it (it would run eagerly, or raise with fullgraph=True)",
                expected="save=None (or False) for layers with compiled bodies",
                got=f"save units with a compiled forward on layer {index}",
                tip="drop the save units (RecomputeConfig(ratio, save=None)) to keep the "
                    "compiled bodies, or do not compile the layers that keep units")


def _near_misses(layers: list[nn.Module], target: KeptCallables, /) -> str:
    """What a mistyped ``Class.method`` target was likely meant to be (for the warning)."""
    import difflib  # only on this warning's path

    methods = {f"{cls.__qualname__}.{name}" for layer in layers for module in layer.modules()
               for cls in type(module).__mro__ if cls.__module__ != "builtins"
               and not cls.__module__.startswith("torch.")
               for name, value in vars(cls).items()
               if callable(value) and not name.startswith("__")}
    classes = {name.rpartition(".")[0] for name in methods}
    hints = []
    for wanted in (t for t in target.targets if isinstance(t, str)):
        owner, _, method = wanted.rpartition(".")
        close = difflib.get_close_matches(wanted, sorted(methods), n=1)
        where = ("" if owner in classes else
                 f"no class {owner!r} in the checkpointed layers; ") + \
            (f"did you mean {close[0]!r}?" if close else f"no method {method!r} close to it")
        hints.append(f"{wanted!r}: {where}")
    return f" ({'; '.join(hints)})" if hints else ""


def _kept_methods(layers: list[nn.Module], target: KeptCallables
                  ) -> list[tuple[nn.Module, str]]:
    """The (module, method name) pairs of ``layers`` that ``target`` keeps."""
    return [(module, name) for layer in layers for module in layer.modules()
            for name in target.matches(module)]
