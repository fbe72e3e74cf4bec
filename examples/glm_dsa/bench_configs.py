"""The configurations ``examples.glm_dsa.bench`` compares, and the presets it runs them at.

Each configuration turns a deep copy of one seeded model into a *variant*: the model to step,
plus the context its forward runs in (``save_on_cpu`` for the offload anchor) and the offload
manager, if any. Nothing here measures; ``bench.py`` does.

NOTE [torch adapters]: ``torch.utils.checkpoint.checkpoint`` cannot take the example layers as
they are called. The model calls ``layer(hidden, rope_cos=..., rope_sin=..., cu_seqlens=...,
dsa_topk_ids=...)`` and gets a TypedDict back; torch's reentrant mode rejects keyword arguments
and returns only tensors (a dict output is not connected to the graph), and a source layer's
``dsa_topk_ids=None`` is not a tensor. :class:`TorchCheckpointAdapter` therefore takes the
keyword call, passes *positional tensors only* through the checkpoint (hidden, [token embeds,]
cos, sin, cu_seqlens, ids or an empty placeholder), rebuilds the keyword call inside, and
rebuilds the TypedDict from the returned tuple. The same adapter serves the non-reentrant and
selective modes so the three differ only in the checkpoint algorithm. The adapter is a module
that owns the layer, so the parameter names gain a ``wrapped.`` segment (torch's own
``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.``); the bench strips it to compare
gradients by name. Inside torch's checkpoint the phase is ``"plain"``, so
``reuse_during_recompute`` calls the indexer in both passes: torch modes always recompute it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from offload import OffloadConfig, OffloadManager

from .config import GlmDsaConfig
from .decoder import DecoderLayerOutput
from .model import GlmDsaForCausalLM
from .mtp import MtpLayer, MtpLayerOutput

__all__ = ["CONFIGS", "PRESETS", "BenchConfig", "Preset", "TorchCheckpointAdapter", "Variant",
           "sac_policy"]

ADAPTER_PREFIX = "wrapped."


# --------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model size, packed batch, and how many steps to time."""

    name: str
    model: GlmDsaConfig
    seq_lens: tuple[int, ...]
    rounds: int
    warmup: int
    cuda_only: bool = False
    # OffloadConfig.min_bytes: small enough that the hidden states (and top-k ids) qualify.
    offload_min_bytes: int = 1024

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": dataclasses.asdict(self.model),
                "seq_lens": list(self.seq_lens), "tokens": sum(self.seq_lens),
                "rounds": self.rounds, "warmup": self.warmup,
                "offload_min_bytes": self.offload_min_bytes}


_GPU_SMALL = GlmDsaConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=8,
                          moe=True, moe_intermediate_size=704, q_lora_rank=384, kv_lora_rank=256,
                          qk_nope_head_dim=64,
                          qk_rope_head_dim=32, v_head_dim=64, index_n_heads=4,
                          index_head_dim=64, index_topk=256, intermediate_size=2816)
# fp32 throughout, for bit-equality columns that mean something on GPU too. Its torch
# backend gathers [T, K, H, D] keys per layer: T=8192, K=128, H=16 keeps one gather near
# 6 GiB, and backward's four of them plus a dozen model copies well inside 139 GiB.
_GPU_LARGE = GlmDsaConfig(vocab_size=32000, hidden_size=2048, num_layers=12, num_heads=16,
                          moe=True, moe_intermediate_size=1408, q_lora_rank=768, kv_lora_rank=512,
                          qk_nope_head_dim=64,
                          qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8,
                          index_head_dim=64, index_topk=128, intermediate_size=5632)

PRESETS: dict[str, Preset] = {
    # Seconds: the test suite runs it. Default sizes of GlmDsaConfig (CONTEXT.md section 5).
    # The tiny MoE (a GLM-5 trait) is on so the moe_gate unit has something to keep.
    "tiny": Preset("tiny", GlmDsaConfig(moe=True), (20, 12), rounds=3, warmup=1),
    # The CPU demo: default widths, ten times the tokens (three packed sequences), so compute
    # rather than Python overhead dominates and top-k 8 of up to 160 keys is really sparse.
    "demo": Preset("demo", GlmDsaConfig(moe=True), (160, 96, 64), rounds=20, warmup=2),
    "gpu-small": Preset("gpu-small", _GPU_SMALL, (2048, 1024, 1024), rounds=10, warmup=3,
                        cuda_only=True, offload_min_bytes=1 << 16),
    "gpu-large": Preset("gpu-large", _GPU_LARGE, (4096, 2048, 2048), rounds=8, warmup=3,
                        cuda_only=True, offload_min_bytes=1 << 20),
}


# --------------------------------------------------------------------------- torch adapters


# torch 2.15 lets a selective checkpoint route its cache through saved-tensor hooks.
_SAC_CHOOSES_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(
    torch_ckpt.checkpoint).parameters


class TorchCheckpointAdapter(nn.Module):
    """A decoder or MTP layer behind ``torch.utils.checkpoint``; see NOTE [torch adapters]."""

    def __init__(self, layer: nn.Module, *, use_reentrant: bool,
                 context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.wrapped = layer
        self.is_mtp = isinstance(layer, MtpLayer)
        self.use_reentrant = use_reentrant
        self.context_fn = context_fn

    def _positional(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Rebuild the keyword call the model made; an empty ids tensor stands for None.
        if self.is_mtp:
            hidden, embeds, cos, sin, cu_seqlens, ids = tensors
            extra: dict[str, torch.Tensor] = {"token_embeds": embeds}
        else:
            hidden, cos, sin, cu_seqlens, ids = tensors
            extra = {}
        out = self.wrapped(hidden, **extra, rope_cos=cos, rope_sin=sin, cu_seqlens=cu_seqlens,
                           dsa_topk_ids=None if ids.numel() == 0 else ids)
        if self.is_mtp:
            return out["hidden_states"], out["final_hidden_states"], out["dsa_topk_ids"]
        return out["hidden_states"], out["dsa_topk_ids"]

    def forward(self, hidden_states: torch.Tensor, *, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, cu_seqlens: torch.Tensor,
                dsa_topk_ids: torch.Tensor | None = None,
                token_embeds: torch.Tensor | None = None) -> Any:
        ids = (dsa_topk_ids if dsa_topk_ids is not None
               else torch.empty(0, dtype=torch.int64, device=hidden_states.device))
        tensors: tuple[torch.Tensor | None, ...] = (
            (hidden_states, token_embeds) if self.is_mtp else (hidden_states,))
        tensors += (rope_cos, rope_sin, cu_seqlens, ids)
        options: dict[str, Any] = {"use_reentrant": self.use_reentrant}
        if self.context_fn is not None:
            options["context_fn"] = self.context_fn
            if _SAC_CHOOSES_HOOKS:
                # Its cache past the saved-tensor hooks, as every torch before 2.15 keeps it
                # (and 2.15 does, warning, when not told): the bench meters it apart.
                options["respect_saved_tensors_hooks"] = False
        out = torch_ckpt.checkpoint(self._positional, *tensors, **options)
        if self.is_mtp:
            return MtpLayerOutput(hidden_states=out[0], final_hidden_states=out[1],
                                  dsa_topk_ids=out[2])
        return DecoderLayerOutput(hidden_states=out[0], dsa_topk_ids=out[1])


@functools.cache  # read once: torch's SAC asks the policy at every op (helper HN: ~4% of the row)
def _sac_saved_ops() -> frozenset[Any]:
    ops: set[Any] = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                     torch.ops.aten.addmm.default,
                     torch.ops.glm_dsa.sparse_mla_attention.default}
    # The example's attention is the custom op; keep SDPA too in case a backend routes there.
    for name in ("_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_ckpt.CheckpointPolicy:
    """Keep matmuls and attention, recompute everything else (the torchtitan-style policy)."""
    if op in _sac_saved_ops():
        return torch_ckpt.CheckpointPolicy.MUST_SAVE
    return torch_ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def _wrap_layers(model: GlmDsaForCausalLM, **options: Any) -> None:
    for layers in (model.layers, model.mtp_layers):
        for i, layer in enumerate(layers):
            layers[i] = TorchCheckpointAdapter(layer, **options)


# --------------------------------------------------------------------------- configurations


@dataclasses.dataclass
class Variant:
    """One configuration applied to one copy of the model."""

    model: GlmDsaForCausalLM
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    manager: OffloadManager | None = None
    # Ops whose outputs torch's selective checkpoint caches where no saved-tensor hook (so no
    # census) sees them; the bench meters them separately.
    cached_ops: frozenset[Any] | None = None


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    key: str
    label: str
    family: str  # "eager", "torch" or "pytree-ckpt"
    build: Callable[[GlmDsaForCausalLM, Preset, torch.device], Variant]
    cuda_only: bool = False


def _eager(base: GlmDsaForCausalLM, preset: Preset, device: torch.device) -> Variant:
    return Variant(copy.deepcopy(base))


def _torch_mode(**options: Any) -> Callable[[GlmDsaForCausalLM, Preset, torch.device], Variant]:
    def build(base: GlmDsaForCausalLM, preset: Preset, device: torch.device) -> Variant:
        model = copy.deepcopy(base)
        _wrap_layers(model, **options)
        return Variant(model, cached_ops=_sac_saved_ops() if "context_fn" in options else None)
    return build


def _pytree(*, reuse: bool = True, offload: bool = False, save: list[str] | None = None,
            discard: bool = False) -> Callable[[GlmDsaForCausalLM, Preset, torch.device], Variant]:
    def build(base: GlmDsaForCausalLM, preset: Preset, device: torch.device) -> Variant:
        if reuse and not discard:
            model = copy.deepcopy(base)
        else:
            # These switches are read when the layers are built: build from the config, then
            # copy the weights, so the model differs from the base in those switches only.
            model = GlmDsaForCausalLM(dataclasses.replace(
                base.config, reuse_indexer=reuse, discard_norm_outputs=discard))
            model.to(device).load_state_dict(base.state_dict())
        manager = (OffloadManager(OffloadConfig(min_bytes=preset.offload_min_bytes),
                                  device=device) if offload else None)
        model.checkpoint_layers(1.0, mtp=True, offload=manager if offload else False,
                                save=save)
        return Variant(model, manager=manager)
    return build


def _save_on_cpu(base: GlmDsaForCausalLM, preset: Preset, device: torch.device) -> Variant:
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
    return Variant(copy.deepcopy(base), context=context)


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("eager", "eager (no checkpoint)", "eager", _eager),
    BenchConfig("torch_reentrant", "torch reentrant", "torch",
                _torch_mode(use_reentrant=True)),
    BenchConfig("torch_non_reentrant", "torch non-reentrant", "torch",
                _torch_mode(use_reentrant=False)),
    BenchConfig("torch_sac", "torch selective (mm + attention saved)", "torch",
                _torch_mode(use_reentrant=False, context_fn=functools.partial(
                    torch_ckpt.create_selective_checkpoint_contexts, sac_policy))),
    BenchConfig("pytree_reuse_off", "pytree-ckpt, reuse off", "pytree-ckpt",
                _pytree(reuse=False, offload=False)),
    BenchConfig("pytree_reuse_on", "pytree-ckpt + replay", "pytree-ckpt",
                _pytree(reuse=True, offload=False)),
    BenchConfig("pytree_offload", "pytree-ckpt + replay + offload", "pytree-ckpt",
                _pytree(reuse=True, offload=True)),
    BenchConfig("pytree_save_attn", "pytree-ckpt + replay, keep attn", "pytree-ckpt",
                _pytree(save=["attn"])),
    BenchConfig("pytree_save_indexer", "pytree-ckpt, reuse off, keep dsa_indexer",
                "pytree-ckpt", _pytree(reuse=False, save=["dsa_indexer"])),
    BenchConfig("pytree_save_gate", "pytree-ckpt + replay, keep moe_gate", "pytree-ckpt",
                _pytree(save=["moe_gate"])),
    BenchConfig("pytree_save_dispatch", "pytree-ckpt + replay, keep moe_dispatch",
                "pytree-ckpt", _pytree(save=["moe_dispatch"])),
    BenchConfig("pytree_discard", "pytree-ckpt + replay, norms discarded", "pytree-ckpt",
                _pytree(discard=True)),
    BenchConfig("save_on_cpu", "torch save_on_cpu (eager)", "torch", _save_on_cpu,
                cuda_only=True),
)


def parameter_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, with the adapters' ``wrapped.`` segment removed."""
    return {name.replace(ADAPTER_PREFIX, ""): p for name, p in model.named_parameters()}
