"""Synthetic packed batches, deterministic from a seed (nothing is downloaded).

Each sequence is an arithmetic progression of token ids modulo the vocabulary, with a random
start and step: easy enough for the tiny model to learn in a few steps, so a falling loss
shows training works, and for MTP depths to predict further ahead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import GlmDsaConfig
from .mtp import IGNORE_INDEX

__all__ = ["make_packed_batch"]


def make_packed_batch(config: GlmDsaConfig, seq_lens: Sequence[int] = (20, 12),
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """One packed row: ``input_ids`` and ``labels`` ``[1, T]`` (int64), ``cu_seqlens`` int32.

    ``labels[t]`` is the next token of ``t``'s own sequence, ``-100`` at each sequence end.
    """
    if not seq_lens or any(int(n) < 1 for n in seq_lens):
        raise ValueError(f"seq_lens must be non-empty positive lengths, got {tuple(seq_lens)}; "
                         "tip: the default (20, 12) packs two sequences")
    generator = torch.Generator().manual_seed(seed)
    tokens, labels = [], []
    for length in seq_lens:
        start, step = torch.randint(0, config.vocab_size, (2,), generator=generator).tolist()
        seq = (start + (step | 1) * torch.arange(int(length))) % config.vocab_size
        tokens.append(seq)
        labels.append(torch.cat([seq[1:], torch.tensor([IGNORE_INDEX])]))
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.cat(tokens)[None], "labels": torch.cat(labels)[None],
            "cu_seqlens": cu_seqlens}
