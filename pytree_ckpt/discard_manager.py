"""``CheckpointWithoutOutputManager``: several chained output-discard checkpoints (a later one
may take an earlier one's discarded output as input), discarded together and replayed in
forward order from one hook (NOTE [discard lifetimes] 4 in discard.py). Megatron's
residual-stream plan (residual_plan.py) gives each block of layers one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .discard import CheckpointWithoutOutput
from .discard_aliases import register_rebuild
from .discard_refusals import check_hook_tensor, refuse_discarded_hook
from .eager import DISCARD_REASON, runs_eagerly
from .errors import CheckpointError, validate_bool
from .refusals import refuse_double_backward

__all__ = ["CheckpointWithoutOutputManager"]

_eager = runs_eagerly(DISCARD_REASON)  # NOTE [discard stays eager] (discard.py)
T = TypeVar("T")


class CheckpointWithoutOutputManager:
    """Several chained checkpoints, discarded together, replayed in forward order by one hook.

    ``preserve_rng_state`` and ``verify_replay`` go to each of its checkpoints, as
    ``CheckpointWithoutOutput``'s.
    """

    @_eager
    def __init__(self, *, preserve_rng_state: bool = True, verify_replay: bool = False) -> None:
        self.preserve_rng_state = validate_bool(preserve_rng_state, name="preserve_rng_state")
        # Each checkpoint's rebuild compared with its forward (CheckpointWithoutOutput's option).
        self.verify_replay = validate_bool(verify_replay, name="verify_replay", default=False)
        self.checkpoints: list[CheckpointWithoutOutput] = []
        self.replay_order: list[int] = []  # indices, in the order replays happened
        self.registered = False

    # Callable[..., T] as pytree_ckpt.checkpoint is (functional.py says why)
    @_eager
    def checkpoint(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` through a new ``CheckpointWithoutOutput`` of this manager, in
        forward order; returns its output."""
        if self.registered:
            raise CheckpointError(
                "this manager's outputs were already discarded; it takes no more checkpoints",
                expected="every checkpoint() of the block before its discard",
                got="a checkpoint() after discard_all_outputs_and_register_unified_recompute",
                tip="use one manager per block and forward (build the plan per forward: a step of "
                    "several forwards, gradient accumulation or DPO's chosen and rejected, "
                    "builds one for each); inside "
                    "checkpointed layers, whose replays run in reverse order, a block cannot "
                    "span layers: block_size=1")
        ckpt = CheckpointWithoutOutput(preserve_rng_state=self.preserve_rng_state,
                                       verify_replay=self.verify_replay)
        self.checkpoints.append(ckpt)
        return ckpt.checkpoint(fn, *args, **kwargs)

    @_eager
    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: torch.Tensor,
                                                           /) -> None:
        """Free every output checkpointed so far, and rebuild them all, in forward order, when
        ``hook_tensor``'s gradient is computed (see docs/discard.md for where to put it)."""
        if self.registered:
            raise CheckpointError("this manager's outputs were already discarded",
                                  expected="one discard per manager", got="a second discard",
                                  tip="use one manager per block and forward")
        if not all(c.passthrough for c in self.checkpoints):
            check_hook_tensor(hook_tensor, "this manager's block")
        if any(c.discarded for c in self.checkpoints):
            raise CheckpointError("a checkpoint of this manager was already discarded on its own",
                                  expected="discards through the manager only",
                                  got="an earlier discard_output_and_register_recompute()",
                                  tip="let the manager discard all of its checkpoints")
        if all(c.passthrough for c in self.checkpoints):
            # Nothing was saved (no grad: a checkpoint boundary's original pass, whose replay
            # runs the block again with this manager): nothing to discard, and the manager
            # starts over for that replay.
            self.checkpoints = []
            return
        refuse_discarded_hook(hook_tensor, self.checkpoints)
        for ckpt in self.checkpoints:  # all of them before the first is freed
            ckpt._refuse_discard()
        self.registered = True
        for ckpt in self.checkpoints:
            ckpt._discard_output()
        register_rebuild(hook_tensor, self._hook)  # NOTE [a hook tensor that is a view]

    def _hook(self, grad: torch.Tensor) -> None:
        refuse_double_backward(  # as CheckpointWithoutOutput._hook refuses it
            lambda: "the output discard of "
                    f"{', '.join(c._name() for c in self.checkpoints if not c.passthrough)}",
            discard=True)
        # In forward order (NOTE [discard lifetimes] 4 in discard.py).
        for index, ckpt in enumerate(self.checkpoints):
            if ckpt.rebuilt_early:  # NOTE [chained discards in any order] (discard.py): by
                ckpt.rebuilt_early = False  # the discard it feeds, before this hook
            elif not ckpt.passthrough:
                if ckpt._replay():
                    self.replay_order.append(index)
