"""Megatron's residual-stream recompute plan: which layers share an output-discard manager
(``CheckpointWithoutOutputManager``, in discard_manager.py), so that a block of layers
discards its cheap outputs together and replays them, in forward order, from one hook."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .discard_manager import CheckpointWithoutOutputManager
from .discard_refusals import refuse_fp8
from .errors import CheckpointConfigError, validate_bool

__all__ = ["ResidualStreamRecomputeContext", "build_residual_stream_recompute_plan"]

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResidualStreamRecomputeContext:
    """One layer's place in a residual-stream recompute plan (Megatron-Core's name, fields
    and methods, plus the layer's and block's indices)."""

    layer_index: int
    block_index: int
    manager: CheckpointWithoutOutputManager
    is_block_end: bool

    def __post_init__(self) -> None:
        # Built by build_residual_stream_recompute_plan; one built by hand (a custom plan) is
        # checked here, as a wrong field would fail only at the block's discard or replay.
        for name in ("layer_index", "block_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointConfigError(
                    f"ResidualStreamRecomputeContext.{name} must be an int >= 0",
                    expected="an int >= 0", got=f"{type(value).__name__} {value!r}",
                    tip="build the plan with build_residual_stream_recompute_plan(num_layers, "
                        "block_size)")
        if not isinstance(self.manager, CheckpointWithoutOutputManager):
            raise CheckpointConfigError(
                "ResidualStreamRecomputeContext.manager must be a CheckpointWithoutOutputManager",
                expected="CheckpointWithoutOutputManager()",
                got=type(self.manager).__name__,
                tip="the layers of one block share one manager: build the plan with "
                    "build_residual_stream_recompute_plan")
        if not isinstance(self.is_block_end, bool):
            raise CheckpointConfigError(
                "ResidualStreamRecomputeContext.is_block_end must be a bool",
                expected="True at the block's last layer, else False",
                got=repr(self.is_block_end), tip="pass True or False")

    def checkpoint(self, function: Callable[..., R], /, *args: Any,
                   fp8: bool | str | None = False, **kwargs: Any) -> R:
        """Run one cheap op through the block's manager, for ordered replay."""
        refuse_fp8(fp8)
        return self.manager.checkpoint(function, *args, **kwargs)  # type: ignore[no-any-return]

    def finalize(self, hidden_states: torch.Tensor, /) -> None:
        """At the block's last layer, discard the block's outputs and register their rebuild
        on ``hidden_states`` (the residual stream after the block); elsewhere nothing."""
        if self.is_block_end:
            self.manager.discard_all_outputs_and_register_unified_recompute(hidden_states)


def build_residual_stream_recompute_plan(
        num_layers: int, block_size: int | None, *,
        atomic_layer_pairs: Iterable[tuple[int, int]] = (),
        verify_replay: bool = False,
) -> list[ResidualStreamRecomputeContext]:
    """One context per layer; layers of a block share a manager; pairs never split. The
    signature is Megatron-Core's (both arguments may be given by name).

    Managers are single-use (one discard and one replay per forward): build a plan per forward
    (several a step under gradient accumulation).

    ``block_size=None`` makes the whole stack one block. A pair ``(a, b)`` keeps layers
    ``a..b`` in one block even when that exceeds ``block_size`` (``block_size=1`` included).
    No layers (a pipeline stage without local layers) is an empty plan, as in Megatron-Core.
    ``verify_replay``: each block's manager compares its rebuilt outputs with the forward's
    (``CheckpointWithoutOutputManager(verify_replay=True)``); not Megatron-Core's.
    """
    validate_bool(verify_replay, name="verify_replay", default=False)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise CheckpointConfigError("num_layers must be an int >= 0", expected=">= 0",
                                    got=repr(num_layers), tip="pass the number of layers")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 1):
        raise CheckpointConfigError("block_size must be a positive int or None",
                                    expected=">= 1, or None for the whole stack",
                                    got=repr(block_size), tip="None makes one block")
    # Read once: a generator is used up by the check below, and the plan would split its pairs.
    if isinstance(atomic_layer_pairs, (str, bytes)) or \
            not isinstance(atomic_layer_pairs, Iterable):
        raise CheckpointConfigError(
            "atomic_layer_pairs must be an iterable of (a, b) layer index pairs",
            expected="a list or tuple of pairs, () for none", got=repr(atomic_layer_pairs),
            tip="pass atomic_layer_pairs=() (the default) when no layers must stay together")
    pairs = tuple(atomic_layer_pairs)
    unit_of = list(range(num_layers))  # the first layer of the atomic unit holding each layer
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(isinstance(i, int) and not isinstance(i, bool) for i in pair)
                and 0 <= pair[0] < pair[1] < num_layers):
            raise CheckpointConfigError(
                f"atomic_layer_pairs entry {pair!r} is not a pair of layer indices a < b",
                expected=f"0 <= a < b < {num_layers}", got=repr(pair),
                tip="give each pair as two int layer indices (not bools), smaller first, each "
                    "listed once")
    # In order of their first layer, so that overlapping pairs chain into one unit whatever
    # order they are listed in.
    for a, b in sorted(tuple(pair) for pair in pairs):
        for layer in range(a + 1, b + 1):
            unit_of[layer] = unit_of[a]
    units: list[list[int]] = []
    for layer in range(num_layers):
        if units and unit_of[layer] == unit_of[units[-1][0]]:
            units[-1].append(layer)
        else:
            units.append([layer])
    limit = num_layers if block_size is None else block_size
    blocks: list[list[int]] = []
    for unit in units:
        if blocks and len(blocks[-1]) + len(unit) <= limit:
            blocks[-1].extend(unit)
        else:
            blocks.append(list(unit))
    plan = []
    for block_index, block in enumerate(blocks):
        manager = CheckpointWithoutOutputManager(verify_replay=verify_replay)
        for layer in block:
            plan.append(ResidualStreamRecomputeContext(
                layer_index=layer, block_index=block_index, manager=manager,
                is_block_end=layer == block[-1]))
    return plan
