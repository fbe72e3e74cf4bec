"""The one error family of pytree-ckpt.

Every message names where the problem is (a PyTree key path such as ``output['dsa_topk_ids']``
or a callable), shows both sides of a mismatch, and ends with a tip.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .tree import describe_leaf  # tree.py imports nothing of this package: no cycle

__all__ = ["CheckpointError", "CheckpointConfigError", "ReplayMismatchError", "ReuseError",
           "SavedTensorChanged", "require_callable", "validate_bool"]


class CheckpointError(RuntimeError):
    """Anything that goes wrong at a checkpoint boundary."""

    def __init__(self, what: str, /, *, expected: object = None, got: object = None,
                 tip: str | None = None) -> None:
        parts = [what]
        if expected is not None or got is not None:
            parts.append(f"  expected: {expected}")
            parts.append(f"  got:      {got}")
        if tip:
            parts.append(f"  tip: {tip}")
        super().__init__("\n".join(parts))


class CheckpointConfigError(CheckpointError, ValueError):
    """A configuration value is out of range or of the wrong kind (also a ``ValueError``)."""


class ReplayMismatchError(CheckpointError):
    """The replay produced something other than the original pass did."""


class ReuseError(CheckpointError):
    """A frozen result was recorded or replayed wrongly (see ``reuse_during_recompute``)."""


class SavedTensorChanged(CheckpointError):
    """A tensor saved through a saved-tensor hook (a census, offload) was changed in place
    since it was saved (saved.py makes autograd's check there); the boundary rewords it for its
    own inputs (``raise_changed_after_call`` in changed_in_place.py)."""

    def __init__(self, what: str, /, *, saved_version: int, version: int, tip: str) -> None:
        super().__init__(what, expected=f"version {saved_version} (when saved)",
                         got=f"version {version}", tip=tip)
        self.saved_version = saved_version
        self.version = version


def validate_bool(value: object, /, *, name: str, default: bool | None = True) -> bool:
    """``value`` if it is a bool, else a ``CheckpointConfigError`` naming option ``name``;
    its tip names ``default`` as the default (``None``: the option has none).

    NOTE: options are never read by truthiness: ``preserve_rng_state=None`` (a config's missing
    key) would silently turn RNG restoring off and give other dropout masks in the replay.
    """
    if not isinstance(value, bool):
        choices = [f"{name}={flag}" + (" (the default)" if flag is default else "")
                   for flag in (True, False)]
        raise CheckpointConfigError(
            f"{name} takes a bool", expected="True or False", got=repr(value),
            tip=f"pass {choices[0]} or {choices[1]}")
    return value


def require_callable(fn: Any, where: str, tip: str, /, *,
                     role: str = "the function (or module) to run behind the boundary",
                     factory: bool = False) -> None:
    """A ``CheckpointConfigError`` unless ``fn`` is callable: ``where`` takes ``role``. A module
    class is refused too, unless ``factory``: ``checkpoint(Block, h)`` written for
    ``checkpoint(block, h)`` would build a module behind the boundary (helper PT), as
    ``apply_activation_checkpointing`` refuses one (refusals.require_module); a reused call
    may build one on purpose (a frozen random projection made per call: helper PX)."""
    if not factory and isinstance(fn, type) and issubclass(fn, nn.Module):
        raise CheckpointConfigError(
            f"{where} takes {role}, not a module class",
            expected="a callable: a module instance or a function",
            got=f"the class {fn.__name__}, not an instance of it",
            tip=f"pass the model's {fn.__name__} module itself, not its class")
    if not callable(fn):
        raise CheckpointConfigError(f"{where} takes {role}", expected="a callable",
                                    got=describe_leaf(fn), tip=tip)
