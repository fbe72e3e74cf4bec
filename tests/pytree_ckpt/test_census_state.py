"""What a census leaves behind, and which thread it records: it ends as it began."""

from __future__ import annotations

import contextvars
import threading

import torch
from torch import nn

from pytree_ckpt import ActivationCensus, checkpoint_layers


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _layers() -> nn.Sequential:
    layers = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)))
    checkpoint_layers(layers, offload=False)
    return layers


def test_a_thread_that_copied_the_census_context_is_not_recorded() -> None:
    # docs/census.md: only the thread that entered the census is recorded. A thread run in a
    # copy of its context (asyncio.to_thread, contextvars.copy_context().run) saw the census
    # through its ContextVar: the boundaries' reports of that thread were counted, its plain
    # autograd saves (its saved-tensor hooks are its own) not, which added up to nothing.
    layers = _layers()
    outputs: dict[str, torch.Tensor] = {}

    def other_thread() -> None:
        outputs["loss"] = layers(torch.randn(32, 64)).tanh().sum()

    x = torch.randn(16, 64)
    with ActivationCensus(layers) as census:
        thread = threading.Thread(target=contextvars.copy_context().run, args=(other_thread,))
        thread.start()
        thread.join()
        loss = layers(x).sum()  # this thread's: exactly its three layer inputs
    assert census.bytes_by("mechanism") == {"checkpoint boundary": 3 * nbytes(x)}
    (loss + outputs["loss"]).backward()
