"""pytree-ckpt: activation recompute, frozen-result replay and offload that compose.

Importing this package touches no accelerator and imports no optional dependency.
"""

from .functional import checkpoint, checkpointed
from .census import ActivationCensus, Mechanism
from .discard import CheckpointWithoutOutput
from .discard_manager import CheckpointWithoutOutputManager
from .discarded_reads import detect_discarded_reads
from .errors import (CheckpointConfigError, CheckpointError, ReplayMismatchError, ReuseError,
                     SavedTensorChanged)
from .frames import reuse_during_recompute
from .kept_callables import KeptCallables
from .kept_ops import KeptOps, RecomputeTarget
from .apply import apply_activation_checkpointing, checkpoint_layers, resolve_offload
from .module import is_checkpointed, remove_activation_checkpointing
from .phase import Phase, current_phase
from .residual_plan import ResidualStreamRecomputeContext, build_residual_stream_recompute_plan
from .save_units import RecomputeConfig, RecomputeTargetMap, SaveUnit, apply_recompute_config

__all__ = [
    "ActivationCensus",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputManager",
    "KeptCallables",
    "KeptOps",
    "Mechanism",
    "Phase",
    "RecomputeConfig",
    "RecomputeTarget",
    "RecomputeTargetMap",
    "ReplayMismatchError",
    "ResidualStreamRecomputeContext",
    "ReuseError",
    "SaveUnit",
    "SavedTensorChanged",
    "apply_activation_checkpointing",
    "apply_recompute_config",
    "build_residual_stream_recompute_plan",
    "checkpoint",
    "checkpoint_layers",
    "checkpointed",
    "current_phase",
    "detect_discarded_reads",
    "is_checkpointed",
    "remove_activation_checkpointing",
    "resolve_offload",
    "reuse_during_recompute",
]

__version__ = "0.1.0"
