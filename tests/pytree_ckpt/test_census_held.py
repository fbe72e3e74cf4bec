"""The census's totals against what is really held: storages watched independently of it."""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import (ActivationCensus, KeptOps, RecomputeConfig, SaveUnit,
                         apply_recompute_config, checkpoint_layers)


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _EndsInKeptOp(nn.Module):
    """A layer whose output is a kept op's output (the addmm of its last Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(h))


def _four_kept_output_layers() -> tuple[nn.Sequential, OffloadManager, list[StorageWeakRef]]:
    """Four _EndsInKeptOp layers keeping their addmm under offload, and weak references to
    their outputs' storages (watched independently of the census)."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(_EndsInKeptOp() for _ in range(4)))
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::addmm")}, offload=manager)
    outputs: list[StorageWeakRef] = []
    for layer in layers:
        layer.register_forward_hook(
            lambda _m, _a, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    return layers, manager, outputs


def test_a_kept_output_a_later_window_copies_stays_counted_as_resident_under_its_save_unit(
) -> None:
    # The record of a save unit holds the kept output on the device until the replay, so the
    # next layer's window, which copies it to host as its input, frees nothing: the bytes are
    # held twice, on the device by the record and on host by the copy. The census counted
    # only the host copy (the window's report dropped the record as a holder) and flagged
    # the device bytes as "offload in flight" still alive elsewhere.
    layers, manager, outputs = _four_kept_output_layers()
    with ActivationCensus(layers) as census:
        loss = layers(torch.randn(32, 64)).sum()  # sum saves nothing: only the unit holds
    manager.stats()  # the manager lets go of the device tensors whose copies landed
    gc.collect()
    layer_bytes = 32 * 64 * 4
    assert [ref.expired() for ref in outputs] == [False] * 4  # every kept output is resident
    assert census.bytes_by("mechanism") == {"save unit": 4 * layer_bytes,
                                            "offloaded to host": 4 * layer_bytes}
    assert census.total_bytes == 8 * layer_bytes
    assert census.flagged() == []
    loss.backward()
    assert census.total_bytes == 0


def test_a_kept_output_autograd_also_saves_stays_under_its_save_unit_when_a_window_copies_it(
) -> None:
    # A loss term on every layer's output (autograd's mul saves it outside the layers) holds
    # the kept outputs too. The rule of docs/census.md holds with offload as without: a plain
    # autograd save does not take a storage from a mechanism, so all four stay under the save
    # unit (that filed three of them under autograd once the next window's copy replaced the
    # boundary, autograd coming first among the resident holders).
    layers, manager, outputs = _four_kept_output_layers()
    with ActivationCensus(layers) as census:
        h = torch.randn(32, 64)
        loss = torch.zeros(())
        for layer in layers:
            h = layer(h)
            loss = loss + (h * h).sum()
    del h
    manager.stats()
    gc.collect()
    layer_bytes = 32 * 64 * 4
    assert [ref.expired() for ref in outputs] == [False] * 4
    # Host copies: the first layer's input and the three outputs the next layers received.
    assert census.bytes_by("mechanism") == {"save unit": 4 * layer_bytes,
                                            "offloaded to host": 4 * layer_bytes}
    assert census.flagged() == []
    loss.backward()
    assert census.total_bytes == 0


def test_a_kept_output_the_next_layer_receives_counts_once_under_the_boundary() -> None:
    # docs/census.md: a storage held through several mechanisms counts once, under the one
    # that reported it last; the next layer's boundary holds the kept output without the unit
    # too. Each is filed under the module that held it first: the kept op ran in `proj`.
    layer_bytes = 32 * 64 * 4
    torch.manual_seed(0)
    layers = nn.Sequential(*(_EndsInKeptOp() for _ in range(4)))
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::addmm")})
    with ActivationCensus(layers) as census:
        loss = layers(torch.randn(32, 64)).sum()
    assert census.bytes_by("mechanism") == {"checkpoint boundary": 4 * layer_bytes,
                                            "save unit": layer_bytes}
    assert census.bytes_by("module") == {"0": layer_bytes, "0.proj": layer_bytes,
                                         "1.proj": layer_bytes, "2.proj": layer_bytes,
                                         "3.proj": layer_bytes}
    loss.backward()
    assert census.total_bytes == 0


def test_a_dropped_graphs_last_copies_go_with_it_and_the_census_counts_none() -> None:
    # docs/offload.md, stream rule 4: the copies still in flight (the last two windows of a
    # thread) live as long as the graph's handles; for a graph dropped without backward they
    # go at once, their host buffers back to the pool (helper GL: the manager held them until
    # its next call). The census counts what is really held: nothing.
    import pytree_ckpt

    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
    pytree_ckpt.checkpoint_layers(layers, offload=manager)
    h = torch.randn(8, 64, requires_grad=True)
    with ActivationCensus(layers) as census:
        out = h
        for layer in layers:
            out = layer(out)
        loss = out.sum()
    del loss, out, layer
    gc.collect()
    assert census.bytes_by("mechanism") == {}
    assert manager.pool.checked_out == 0  # before any call of the manager's
    assert manager.stats()["host_buffers_in_use"] == 0
    assert census.total_bytes == 0


# helper JP: census.md said "the last window of each forward whose graph lives".
def test_two_live_forwards_on_cpu_hold_the_latest_forwards_last_window_in_flight(
        ) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    checkpoint_layers(layers, offload=manager)
    lasts: list[StorageWeakRef] = []
    layers[3].register_forward_pre_hook(
        lambda _m, args: lasts.append(StorageWeakRef(args[0].untyped_storage())))
    xs = [torch.randn(32, 64, requires_grad=True) for _ in range(2)]
    with ActivationCensus(layers) as census:
        losses = [layers(x).square().sum() for x in xs]  # two micro-batches, graphs alive
        gc.collect()
        in_flight = census.bytes_by("mechanism").get("offload in flight", 0)
        first_last_alive = not lasts[0].expired()
        for loss in losses:
            loss.backward()
    # docs/census.md, `offload in flight`: "on the CPU, where copies land at once, that is the
    # last window of the latest forward on the thread": the second forward's first window let
    # go of the first forward's last one, which is freed, not held.
    assert (in_flight, first_last_alive) == (32 * 64 * 4, False)
