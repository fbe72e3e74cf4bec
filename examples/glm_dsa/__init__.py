"""A small GLM-5-style decoder (MLA + DeepSeek Sparse Attention + MTP), faithful in dataflow.

The reference model of pytree-ckpt: DSA top-k ids flow explicitly from the layers that compute
them to the layers that consume them, and frozen results (top-k ids, MoE routing) are replayed
with ``pytree_ckpt.reuse_during_recompute`` under checkpointing. CPU-sized by default.
"""

from .config import GlmDsaConfig, topk_source_layers
from .data import make_packed_batch
from .decoder import DecoderLayer, DecoderLayerOutput
from .indexer import DsaIndexer
from .kernels import available_backends
from .model import CausalLMOutput, GlmDsaForCausalLM

__all__ = ["CausalLMOutput", "DecoderLayer", "DecoderLayerOutput", "DsaIndexer", "GlmDsaConfig",
           "GlmDsaForCausalLM", "available_backends", "make_packed_batch", "topk_source_layers"]
