"""Selective save units: ``RecomputeConfig(ratio, save=...)`` and a model's ``RecomputeTargetMap``.

``ratio`` decides which layers are checkpointed (the first ``int(n * ratio)``, forgiving float
rounding); ``save`` decides what stays resident inside them. A ``SaveUnit`` member means *keep
this*: its outputs are kept from the original pass and returned in the replay instead of being
recomputed. Each unit a model declares resolves to ``KeptOps`` (by op identity) or
``KeptCallables`` (everything a callable dispatches; each in its module, ``kept_ops.py`` and
``kept_callables.py``). Either way the layer's body runs eagerly: a compiled body is refused
(NOTE [save units need eager bodies]). See ``keep.py`` for the engine.

``save`` is tri-state: ``None``/``False`` keep nothing and install no dispatch mode at all;
``True`` keeps every unit the model declares (this follows the library and model version: pin an
explicit list for stable memory); a list keeps exactly those units.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .apply import (layer_count, layer_labels, layer_refs, listed_layers,
                    refuse_checkpointed_beyond, resolve_offload, validate_ratio,
                    warn_offload_unused)
from .boundary_call import BoundaryOptions
from .eager import user_stacklevel
from .errors import CheckpointConfigError
from .keep import KeepPolicy, op_name
from .kept_callables import (KeptCallables, _KeptMethod, kept_methods, near_misses,
                             unmatched)
from .kept_ops import KeptOps, RecomputeTarget
from .module import body_forward, install_boundary, is_checkpointed, refuse_other_options_among
from .torch_options import refuses_torch_options
from .torch_wrappers import warn_inside_torch_wrapper
from .tree import describe_leaf, dunder

if TYPE_CHECKING:  # offload imports this package's errors: imported lazily at run time
    from offload import OffloadManager

__all__ = ["RecomputeConfig", "RecomputeTargetMap", "SaveUnit", "apply_recompute_config"]

log = logging.getLogger(__name__)


class SaveUnit(str, enum.Enum):
    """A part of a layer that may be kept resident instead of recomputed."""

    ATTN = "attn"
    DSA_INDEXER = "dsa_indexer"
    MOE_GATE = "moe_gate"
    MOE_DISPATCH = "moe_dispatch"

    def __str__(self) -> str:
        return self.value


# Keys: a unit or its name. Any, as Mapping's key type is invariant: no union of the two would
# take both a dict of units and a dict of names.
RecomputeTargetMap = Mapping[Any, RecomputeTarget]


# torch's selective checkpointing moved over as it is: its op list, an op's name, or the
# context_fn (a partial of create_selective_checkpoint_contexts) put in `save`, where units go
# (helper QL: the tips spoke of unit names and Megatron only).
_OPS_TIP = ("ops go in the targets, under a unit that `save` names: apply_recompute_config("
            "layers, RecomputeConfig(1.0, save=['attn']), {SaveUnit.ATTN: KeptOps("
            "'aten::mm.default', ...)}) keeps them (docs/save_units.md)")


def _torch_ops(value: object, /) -> bool:
    """Whether ``value`` is torch's way to name ops for selective checkpointing: an op or op
    packet (``torch.ops.aten.mm.default``), an op's name (``"aten::mm"``), or a context_fn or
    policy function."""
    return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or \
        isinstance(value, str) and "::" in value or callable(value)


def _unit(value: object, /) -> SaveUnit:
    try:
        return SaveUnit(value)
    except ValueError:
        if _torch_ops(value):
            raise CheckpointConfigError(
                f"unknown save unit {value!r}: `save` names units, not ops",
                expected=[u.value for u in SaveUnit], got=repr(value), tip=_OPS_TIP) from None
        raise CheckpointConfigError(
            f"unknown save unit {value!r}", expected=[u.value for u in SaveUnit], got=repr(value),
            tip="use SaveUnit members or their string values. `save` lists what stays "
                "resident, the inverse of Megatron's recompute_modules (what is recomputed): "
                "to recompute one submodule (core_attn, mlp), checkpoint it with "
                "apply_activation_checkpointing; a norm or activation (layernorm, moe_act), "
                "with CheckpointWithoutOutput (docs/save_units.md, 'Coming from "
                "Megatron-Core')") from None


@dataclasses.dataclass(frozen=True, init=False)
class RecomputeConfig:
    """Which layers are recomputed (``ratio``) and what stays resident in them (``save``)."""

    ratio: float = 1.0
    # Given as any sequence of units or their names, stored as a tuple of SaveUnit: typed as
    # stored, so that a type checker reads `unit.value` off it (helper RL: typed as given, a
    # str in the union refused that). An option, so keyword-only.
    save: tuple[SaveUnit, ...] | bool | None = dataclasses.field(default=None, kw_only=True)

    def __init__(self, ratio: float = 1.0, *,
                 save: Sequence[SaveUnit | str] | bool | None = None) -> None:
        # RecomputeConfig(0.5, save=["attn"]). The checks stay in __post_init__, which the
        # __init__ of a dataclass subclass calls (helper RM: a subclass skipped them).
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "save", save)
        self.__post_init__()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", validate_ratio(self.ratio))
        save: object = self.save
        if save is None or isinstance(save, bool):
            return
        if isinstance(save, (str, bytes, SaveUnit)) or not isinstance(save, Sequence):
            raise CheckpointConfigError(
                "RecomputeConfig.save takes None, a bool, or a list of save units",
                expected="None | bool | list[SaveUnit | str]", got=repr(save),
                tip=_OPS_TIP if _torch_ops(save) else "wrap a single unit in a list: "
                                                      "save=['attn']")
        units = tuple(dict.fromkeys(_unit(v) for v in save))
        object.__setattr__(self, "save", units)

    def to_json(self) -> str:
        """The config as JSON (``from_json`` reads it back)."""
        save = self.save if self.save is None or isinstance(self.save, bool) else [
            _unit(u).value for u in self.save]
        return json.dumps({"ratio": self.ratio, "save": save})

    @classmethod
    def from_json(cls, text: str, /) -> RecomputeConfig:
        if not isinstance(text, (str, bytes, bytearray)):  # json's bare TypeError (helper QV)
            raise CheckpointConfigError(
                "RecomputeConfig.from_json takes the JSON text", expected="str or bytes",
                got=describe_leaf(text),
                tip="RecomputeConfig.from_json(json.dumps(data)) for a dict already parsed "
                    "(json.load of a file gives one; its keys are checked so), or "
                    "RecomputeConfig.from_json(path.read_text())")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:  # bytes not UTF-8 (QU)
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


def _selected(config: RecomputeConfig, targets: RecomputeTargetMap) -> list[SaveUnit]:
    if config.save is None or config.save is False:
        return []
    declared = [_unit(u) for u in targets]
    if config.save is True:
        if not declared:
            warnings.warn("RecomputeConfig(save=True) on a model that declares no save units: "
                          "nothing is kept", stacklevel=user_stacklevel())
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


@refuses_torch_options
def apply_recompute_config(layers: Iterable[nn.Module], config: RecomputeConfig,
                           targets: RecomputeTargetMap, /, *, preserve_rng_state: bool = True,
                           offload: bool | OffloadManager | None = None,
                           verify_replay: bool = False) -> list[int]:
    """Checkpoint the first ``int(n * config.ratio)`` layers, forgiving float rounding, keeping
    ``config.save``'s units.

    Returns the indices of the checkpointed layers. ``offload`` and ``verify_replay`` as in
    ``apply_activation_checkpointing``.
    """
    if not isinstance(config, RecomputeConfig):
        raise CheckpointConfigError(
            "apply_recompute_config takes a RecomputeConfig", expected="RecomputeConfig",
            got=type(config).__name__,
            tip="RecomputeConfig(ratio, save=[...]), or RecomputeConfig.from_json(text)")
    if not isinstance(targets, Mapping):
        raise CheckpointConfigError(
            "apply_recompute_config takes the model's targets: a mapping from each save unit "
            "it declares to what the unit keeps",
            expected="e.g. {SaveUnit.ATTN: KeptOps('aten::mm')}, or {} (no units declared)",
            got=describe_leaf(targets),
            tip="pass {} for a model that declares no save units; put each target in a dict "
                "under the unit it serves ({SaveUnit.ATTN: KeptOps(...)})")
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
    labels = layer_labels(layers, count, "apply_recompute_config")
    units = _selected(config, targets)
    if units:
        _refuse_compiled_bodies(chosen)
    ops: list[Any] = []
    wrapped: list[str] = []
    kept: list[tuple[nn.Module, str]] = []  # installed once every layer was checked
    # What each unit keeps, by name: NOTE [a unit that keeps nothing at run time]
    unit_targets: list[tuple[str, list[str], list[str]]] = []
    if units and not chosen:
        warnings.warn(f"RecomputeConfig(ratio={config.ratio}) checkpoints none of the "
                      f"{len(listed)} layers: the save units {[u.value for u in units]} keep "
                      "nothing", stacklevel=user_stacklevel())
    for unit in units if chosen else ():
        target = targets[unit]
        if isinstance(target, KeptOps):
            found, warned = target._resolve()
            missing = [name for name in target.op_names if name not in warned]
            if not found and missing:  # the others were warned about by name
                warnings.warn(f"save unit {unit.value!r} keeps nothing: the ops {missing} do "
                              "not exist in this build (and the others, if any, were "
                              "skipped with a warning above)", stacklevel=user_stacklevel())
            ops.extend(found)
            if found:
                unit_targets.append((unit.value, [op_name(op) for op in found], []))
            log.info("save unit %s keeps ops %s", unit.value, [str(op) for op in found])
        else:
            assert isinstance(target, KeptCallables)  # refused above otherwise
            found_methods = kept_methods(chosen, target)
            kept.extend(found_methods)
            names = [f"{type(module).__qualname__}.{name}" for module, name in found_methods]
            if not names:
                warnings.warn(f"save unit {unit.value!r} keeps nothing: no checkpointed layer "
                              f"has a method matching {list(target.targets)}"
                              f"{near_misses(chosen, target)}", stacklevel=user_stacklevel())
            elif (stray := unmatched(chosen, target)) is not None:
                # Told per name, as KeptOps tells a mistyped op beside one that exists.
                warnings.warn(f"save unit {unit.value!r} keeps {sorted(set(names))} but no "
                              "checkpointed layer has a method matching "
                              f"{list(stray.targets)}{near_misses(chosen, stray)}: those "
                              "are recomputed", stacklevel=user_stacklevel())
            wrapped.extend(names)
            if names:
                unit_targets.append((unit.value, [], names))
            log.info("save unit %s keeps everything %s dispatch",
                     unit.value, sorted(set(names)))
    policy = None
    if units:
        policy = KeepPolicy(ops, callables=wrapped,
                            description=", ".join(u.value for u in units),
                            units=unit_targets, layers=chosen)
    options = BoundaryOptions(preserve_rng_state=preserve_rng_state,
                              offload=resolve_offload(offload), keep=policy,
                              verify_replay=verify_replay)
    warn_offload_unused(offload, count, len(listed), config.ratio, "RecomputeConfig")
    # Before anything changes: refused, nothing changes.
    refs = layer_refs(layers, len(listed))
    refuse_other_options_among(list(zip(refs, chosen)), options)
    refuse_checkpointed_beyond(listed, count, config.ratio, refs)
    for module, name in kept:
        _refuse_unkeepable(module, name, chosen)
    warn_inside_torch_wrapper(None, [(refs[index], layer)  # may refuse: before changes
                                     for index, layer in enumerate(chosen)])
    for module, name in kept:
        install_kept(module, name)
    for index, layer in enumerate(chosen):
        install_boundary(layer, options, label=labels[index])
    return list(range(count))


def install_kept(module: nn.Module, name: str, /, *,
                 layers: list[nn.Module] | None = None, kept_as: str | None = None) -> None:
    """Wrap ``module``'s method ``name`` for its save unit, unless it is already; with
    ``layers`` (the checkpointed layers holding it), refused first as at apply time (NOTE [kept
    methods of modules added later] in keep.py)."""
    held = module.__dict__.get(name)
    if dunder(held, "_pytree_ckpt_kept", False):
        return
    if layers is not None:
        _refuse_unkeepable(module, name, layers)
    module.__dict__[name] = _KeptMethod(module, name, held, kept_as)


def _refuse_unkeepable(module: nn.Module, name: str, layers: list[nn.Module]) -> None:
    """NOTE [kept methods wrap what the instance had] (kept_callables.py), and its exceptions: a
    layer's own forward (the boundary goes there), a boundary of the module's own (``forward``
    checkpointed on its own) and a compiled callable (NOTE [save units need eager bodies])
    cannot run inside a kept region."""
    qualname = f"{type(module).__qualname__}.{name}"
    index = next((i for i, layer in enumerate(layers) if module is layer), None)
    if name == "forward" and index is not None:
        # One whose class runs a forward of its own (not a ModuleList's, which has none and
        # whose unit would keep nothing: helper JY).
        child = next((m for m in module.modules() if m is not module and
                      type(m).forward is not nn.Module.forward), None)
        example = f'KeptCallables("{type(child).__qualname__}.forward")' \
            if child is not None else "a method of a submodule"
        raise CheckpointConfigError(
            f"a save unit keeps {qualname}, the forward of checkpointed layer {index}: "
            "everything in it would be kept", expected="methods of the layer's submodules "
            "(or its other methods)", got=f"{qualname} on a layer the ratio checkpoints",
            tip=f"keep the part of it you mean, a method of one of its submodules "
                f"({example}); a layer meant to keep all it computes is one left "
                "uncheckpointed (a layer the ratio leaves out)")
    if name == "forward" and is_checkpointed(module):
        raise CheckpointConfigError(
            f"{qualname} is kept by a save unit, but {type(module).__name__} is checkpointed on "
            "its own: a unit keeps what a replay would recompute, and a nested boundary "
            "recomputes it anyway", expected="a kept method that is not itself checkpointed",
            got=f"apply_activation_checkpointing on the {type(module).__name__} inside a layer",
            tip=f"remove_activation_checkpointing on the {type(module).__name__}, or drop "
                "the unit")
    on_class = inspect.getattr_static(type(module), name, None)
    on_class = dunder(on_class, "__func__", on_class)  # a static or class method's function
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
    return dunder(forward, "_torchdynamo_orig_callable") is not None and \
        not dunder(forward, "_torchdynamo_disable", False)


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
