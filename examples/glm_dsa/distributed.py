"""Scaling the example model out: compiled layer bodies, FSDP2, DDP, and the process group.

NOTE [wrapping order]: three mechanisms nest around each decoder and MTP layer, innermost
first, and are applied in that order:

1. ``compile_layer_bodies``: the layer's *bare* forward becomes a ``torch.compile``d function,
   installed as the instance attribute ``forward``;
2. ``model.checkpoint_layers`` (``pytree_ckpt.apply_activation_checkpointing``): the boundary
   keeps that compiled forward as the body it calls in the original pass and in the replay, and
   stays eager itself (it is opaque to dynamo);
3. ``shard_model`` (FSDP2 ``fully_shard``, each layer then the root) or ``wrap_ddp``: FSDP's
   unshard/reshard run as forward hooks of the layer, so outside the boundary; the replay calls
   only the bare forward, and sees the parameters FSDP's pre-backward hook has already
   unsharded.

Compiling after checkpointing would compile the boundary's callable instead of the body, so
``compile_layer_bodies`` refuses a layer that is already checkpointed.

NOTE [reuse stays eager]: ``pytree_ckpt.reuse_during_recompute`` must run eagerly, never
traced: it finds the replay frame through a ``ContextVar``, and records into or takes from that
frame, state dynamo can neither trace nor guard. Left to dynamo, a compiled MoE body lost the
router's recording in the original pass, and its replay raised ``ReuseError`` ("the original
pass recorded 0"). So ``compile_layer_bodies`` marks the methods that make those calls with
``torch.compiler.disable``, per instance: ``MlaAttention.select_keys`` of a layer that computes
its own top-k (the indexer runs eagerly, once per step, as before) and ``MoE.forward`` (the
router's expert choice; its data-dependent expert shapes would break the graph anyway). Such a
body has a graph break at that call; so has a body whose norms go through output discard
(``discard_norm_outputs``: ``CheckpointWithoutOutput`` is not traceable with grad on, in the
replay); every other body (the consumers of top-k ids with a dense MLP) compiles with
``fullgraph=True``.

NOTE [the decoder body's variants]: behind the boundary every variant of a compiled body costs
two entries, the original pass's (no-grad) and the replay's (grad), against dynamo's
``recompile_limit`` (NOTE [two entries per variant] in pytree_ckpt/compiled_layers.py). The
decoder body's code is shared by the decoder layers and the MTP layer's block (two classes
under FSDP2), called with top-k ids or without: eight entries at one sequence length, and a
second length (a recompile with dynamic shapes) asked for more in its replay, where the
fullgraph body raised "found no compiled frames" in backward. The MTP layer's block costs a
third entry per variant: the MTP layer's own no-grad pass hands it an input that does not
require grad, where a decoder layer's pass gets one that does (helper KV: packed batches of
7, 64, 3+4 and 1 tokens failed at the fourth). So ``compile_layer_bodies`` gives each body three
times the limit it finds: the variants a body may compile are those it would have without
checkpointing.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pytree_ckpt

from .attention import MlaAttention
from .decoder import DecoderLayer
from .mlp import MoE
from .model import GlmDsaForCausalLM

__all__ = ["DistEnv", "body_allows_fullgraph", "compile_layer_bodies", "full_gradients",
           "init_from_env", "shard_model", "torchrun_world_size", "wrap_ddp", "wrapped_layers"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: rank, world size and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def torchrun_world_size() -> int | None:
    """``WORLD_SIZE`` when this process was launched by torchrun (or set up like it), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def init_from_env(*, timeout: datetime.timedelta | None = None) -> DistEnv:
    """Join the process group torchrun described in the environment.

    CUDA when available (``nccl``, one device per local rank), else CPU (``gloo``): the same
    command runs on both. ``timeout`` bounds every collective (the default is torch's).
    """
    if torchrun_world_size() is None:
        raise RuntimeError("no process group to join: RANK and WORLD_SIZE are not set; tip: "
                           "launch with torchrun --nproc-per-node N -m examples.glm_dsa.train")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def wrapped_layers(model: GlmDsaForCausalLM) -> Iterator[tuple[str, nn.Module]]:
    """The decoder and MTP layers, by name: what compile, checkpoint and FSDP each wrap."""
    for i, layer in enumerate(model.layers):
        yield f"layers.{i}", layer
    for i, layer in enumerate(model.mtp_layers):
        yield f"mtp_layers.{i}", layer


def _reuse_sites(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """The methods of ``layer``'s submodules that call ``reuse_during_recompute``."""
    sites: list[tuple[nn.Module, str]] = []
    for module in layer.modules():
        if isinstance(module, MlaAttention) and module.indexer is not None and \
                module.reuse_indexer:
            sites.append((module, "select_keys"))
        elif isinstance(module, MoE):
            sites.append((module, "forward"))  # Router.select goes through the reuse
    return sites


def _discards_outputs(layer: nn.Module) -> bool:
    """Whether ``layer`` runs its norms through output discard (``CheckpointWithoutOutput``)."""
    return any(isinstance(module, DecoderLayer) and module.discard_norm_outputs
               for module in layer.modules())


def body_allows_fullgraph(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward makes no ``reuse_during_recompute`` call and discards no
    output: ``CheckpointWithoutOutput`` breaks the graph in the replay (with grad), so a
    ``fullgraph=True`` body raised "found no compiled frames" there (NOTE [reuse stays eager])."""
    return not _reuse_sites(layer) and not _discards_outputs(layer)


def compile_layer_bodies(model: GlmDsaForCausalLM, /, *, backend: str | Any = "inductor",
                         fullgraph: bool | None = None, **options: Any) -> dict[str, bool]:
    """Compile each layer's bare forward; call before ``checkpoint_layers`` and sharding.

    ``fullgraph=None`` uses ``fullgraph=True`` exactly for the bodies that allow it
    (:func:`body_allows_fullgraph`); the calls to ``reuse_during_recompute`` stay eager (NOTE
    [reuse stays eager]). ``options`` go to ``torch.compile``. Each body may compile three
    times dynamo's ``recompile_limit`` (NOTE [the decoder body's variants]): as ``torch.compile``'s
    ``recompile_limit`` where torch has it (unless ``options`` give one), else by raising
    ``torch._dynamo.config.recompile_limit`` itself, once per process (logged). Returns, per
    layer name, the ``fullgraph`` it was compiled with.
    """
    options = {**_raised_recompile_limit(options), **options}
    chosen: dict[str, bool] = {}
    for name, layer in wrapped_layers(model):
        if pytree_ckpt.is_checkpointed(layer):
            raise ValueError(
                f"{name} is already checkpointed: compiling its forward now would compile the "
                "checkpoint boundary, not the layer body; tip: compile first, then "
                "model.checkpoint_layers(...), then shard (see docs/scaling.md)")
        if "forward" in layer.__dict__:
            raise ValueError(f"{name} already has an instance-level forward (compiled twice?); "
                             "tip: compile each layer once, on a freshly built model")
        sites = _reuse_sites(layer)
        for module, method in sites:
            # An instance attribute shadowing the method: the body graph-breaks at this call.
            setattr(module, method, torch.compiler.disable(getattr(module, method)))
        full = body_allows_fullgraph(layer) if fullgraph is None else fullgraph
        # An instance attribute: apply_activation_checkpointing keeps it as the body it calls.
        layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=full, **options)
        chosen[name] = full
    return chosen


# The process-wide recompile_limit _raised_recompile_limit set on a torch whose torch.compile
# takes none, or None.
_RAISED_TO: int | None = None


# Entries per variant behind the boundary: a layer's no-grad pass, the MTP block's (its input
# does not require grad there), and the replay (NOTE [the decoder body's variants]).
_ENTRIES_PER_VARIANT = 3


def _raised_recompile_limit(options: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` option that lets a body compile every pass of as many variants
    as it would compile without checkpointing (NOTE [the decoder body's variants])."""
    import torch._dynamo

    if "recompile_limit" in options:
        return {}
    limit = torch._dynamo.config.recompile_limit
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": _ENTRIES_PER_VARIANT * limit}
    # An older torch: only the process-wide limit exists. Raised once: a second model's
    # bodies (or a second call) would raise it again, and again, for the whole process.
    global _RAISED_TO
    if limit == _RAISED_TO:
        return {}
    _RAISED_TO = _ENTRIES_PER_VARIANT * limit
    torch._dynamo.config.recompile_limit = _RAISED_TO
    logger.info("torch._dynamo.config.recompile_limit raised from %d to %d: a checkpointed "
                "body compiles each variant up to three times (no-grad as a layer, no-grad "
                "as the MTP block, grad)", limit, _RAISED_TO)
    return {}


def shard_model(model: GlmDsaForCausalLM, /, *, mesh: Any = None,
                reshard_after_forward: bool = True) -> GlmDsaForCausalLM:
    """FSDP2: ``fully_shard`` every decoder and MTP layer, then the root (embedding, head).

    Apply after ``checkpoint_layers`` (NOTE [wrapping order]). Each layer is one FSDP group:
    its pre-forward hook all-gathers the layer's parameters once per call, and its
    pre-backward hook all-gathers them again before the boundary replays the layer.
    """
    from torch.distributed.fsdp import fully_shard

    for _, layer in wrapped_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def wrap_ddp(model: GlmDsaForCausalLM, env: DistEnv, /) -> nn.Module:
    """``DistributedDataParallel`` around the whole (checkpointed) model.

    ``find_unused_parameters=True``: the DSA indexers' parameters get no gradient from the
    language-model loss (GLM-5 trains them with a separate loss). In an uncheckpointed layer
    they never enter the graph, and without the flag DDP would wait for them forever. In a
    checkpointed layer they are inputs of the boundary's autograd node (NOTE [parameters are
    inputs] in ``pytree_ckpt/boundary.py``), so autograd visits them with no gradient; without
    the flag DDP would count that as used and reduce zeros into their ``.grad`` (measured),
    where eager leaves ``None`` and AdamW would not touch them. With it, DDP warns once that it
    "did not find any unused parameters" (its traversal sees them in the graph), yet leaves
    their ``.grad`` at ``None``, exactly as eager does.
    """
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def full_gradients(model: nn.Module, /) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, unsharded (an FSDP2 DTensor is all-gathered: collective)."""
    found: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        found[name.removeprefix("module.")] = None if grad is None else grad.detach().clone()
    return found
