"""A prefetch that runs out of device memory is given up, not raised (NOTE [a prefetch that
runs out of memory] in offload/prefetch.py): what it restored is let go, the rest of the pass
restores on demand, bit for bit; a restore on demand that runs out of memory still raises.

The error is injected at ``CopyEngine.allocate``, the one device allocation of a restore (on
CUDA the first thing a restore does), for chosen allocations only; and, for the stream rule a
give-up follows (rule 5 in offload/streams.py), at the simulated device's copy back.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadManager
from pytree_ckpt import checkpoint_layers
from tests.conftest import assert_same_grads
from tests.offload.blocks import FailingBackward, Gated, Layer, manager, offloaded_stack
from tests.offload.simulated import simulated

LAYERS = 8


class Allocations:
    """Stands in for ``m.engine.allocate``: raises ``torch.OutOfMemoryError`` at the calls
    numbered (from 1) in ``fail``, and records, at each call, which earlier calls' buffers are
    still alive (held by a restore)."""

    def __init__(self, m: OffloadManager, monkeypatch: pytest.MonkeyPatch,
                 fail: set[int]) -> None:
        self.allocate = m.engine.allocate
        self.fail = fail
        self.handed: list[tuple[int, weakref.ref[torch.Tensor]]] = []
        self.alive_at: dict[int, list[int]] = {}
        monkeypatch.setattr(m.engine, "allocate", self)

    def __call__(self, nbytes: int) -> torch.Tensor:
        call = len(self.alive_at) + 1
        self.alive_at[call] = [n for n, ref in self.handed if ref() is not None]
        if call in self.fail:
            raise torch.OutOfMemoryError(f"out of memory (simulated, allocation {call})")
        buffer = self.allocate(nbytes)
        self.handed.append((call, weakref.ref(buffer)))
        return buffer


def twins(m: OffloadManager, layer: type[nn.Module]) -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    layers = offloaded_stack(m, LAYERS, layer)
    eager = nn.ModuleList(layer() for _ in range(LAYERS))
    eager.load_state_dict(layers.state_dict())
    return layers, eager


def loss_of(layers: nn.ModuleList, x: torch.Tensor, gates: list[torch.Tensor]) -> torch.Tensor:
    h = x
    for index, layer in enumerate(layers):
        h = layer(h, gates[index].clone()) if gates else layer(h)  # a fresh gate per layer
    return h.square().sum()


def step(layers: nn.ModuleList, seed: int, gated: bool
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One step: a fresh input (and gates); returns the loss, its input, and what was saved."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 32, generator=generator, requires_grad=True)
    gates = [torch.rand(8, 32, generator=generator) for _ in range(LAYERS)] if gated else []
    loss = loss_of(layers, x, gates)
    return loss, x, loss.detach(), gates


def grads(layers: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [p.grad for p in layers.parameters()] + [x.grad]


def eager_step(eager: nn.ModuleList, seed: int, gated: bool) -> list[torch.Tensor | None]:
    eager.zero_grad(set_to_none=True)
    loss, x, _, _ = step(eager, seed, gated)
    loss.backward()
    return [loss.detach(), *grads(eager, x)]


def assert_exact(got: list[torch.Tensor | None], expected: list[torch.Tensor | None]) -> None:
    assert all(g is not None for g in got)
    assert_same_grads(expected, got)  # torch.equal, each


def on_demand(first: int) -> list[tuple[str, int]]:
    return [("restore", i) for i in range(first, -1, -1)]


# prefetch, layer, the allocation that fails, the events, the allocations of the given-up
# window's prefetch (let go) and the first of its restore on demand (they must be gone by
# then). Window 7 reuses its device bytes (held one window late): every allocation is a
# window's copy back, nearest window first, one per storage (Gated: two).
CASES = [
    (1, Layer, 3,
     [("restore", 7), ("prefetch", 6), ("prefetch_hit", 6), ("prefetch", 5),
      ("prefetch_hit", 5), ("prefetch_oom", 4), *on_demand(4)], [], 4),
    (2, Layer, 2,  # window 6 prefetched, window 5 given up in the same call
     [("restore", 7), ("prefetch", 6), ("prefetch_oom", 5), ("prefetch_hit", 6),
      *on_demand(5)], [], 3),
    (1, Gated, 2,  # window 6's first storage restored, its second fails: the first let go
     [("restore", 7), ("prefetch_oom", 6), *on_demand(6)], [1], 3),
    (2, Gated, 4,  # window 6 prefetched (allocations 1 and 2), window 5 half
     [("restore", 7), ("prefetch", 6), ("prefetch_oom", 5), ("prefetch_hit", 6),
      *on_demand(5)], [3], 5),
    (2, Layer, 1,  # window 6 given up: window 5, the next target, is not prefetched after it
     [("restore", 7), ("prefetch_oom", 6), *on_demand(6)], [], 2),
]


@pytest.mark.parametrize("prefetch, layer, fails, events, let_go, again", CASES,
                         ids=["prefetch1", "prefetch2-second", "prefetch1-half",
                              "prefetch2-half", "prefetch2-first"])
def test_a_prefetch_out_of_memory_is_given_up_and_its_window_restored_on_demand_exactly(
        prefetch: int, layer: type[nn.Module], fails: int, events: list[tuple[str, int]],
        let_go: list[int], again: int, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    m = manager(prefetch=prefetch)
    layers, eager = twins(m, layer)
    gated = layer is Gated
    expected = eager_step(eager, 0, gated)
    allocations = Allocations(m, monkeypatch, {fails})
    loss, x, value, _ = step(layers, 0, gated)
    with caplog.at_level(logging.WARNING, logger="offload.prefetch"):
        loss.backward()
    assert_exact([value, *grads(layers, x)], expected)
    assert m.events() == events
    # What the given-up prefetch restored was held when it failed, and let go before the
    # window's restore on demand allocated.
    assert all(n in allocations.alive_at[fails] for n in let_go)
    assert not set(let_go) & set(allocations.alive_at[again])
    stats = m.stats()
    assert stats["prefetch_oom"] == 1
    per = x.untyped_storage().nbytes()
    storages = LAYERS * (2 if gated else 1)
    # Each storage came back once (window 7's reused); the given-up copies are not counted.
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == storages * per
    assert stats["reused_bytes"] == (2 if gated else 1) * per
    # Once per storage not reused, plus the failed allocation and the ones let go.
    assert len(allocations.alive_at) == storages - (2 if gated else 1) + 1 + len(let_go)
    assert stats["host_buffers_in_use"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "offload.prefetch"]
    assert len(warnings) == 1
    assert f"lower OffloadConfig(prefetch={prefetch}), or set prefetch=0" in warnings[0]


def test_a_given_up_prefetch_leaves_restored_a_table_every_layer_shares(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One tensor given to every layer (a RoPE table) is copied once, by window 0, and restored
    # by the first window backward reaches (7). When window 6's prefetch runs out of memory,
    # only what that prefetch restored is let go: letting go of the table too (window 6 lists
    # it) copied it back again at window 6's restore on demand, a second device copy of it
    # while the device was short of memory.
    m = manager(prefetch=1)
    layers, eager = twins(m, Gated)

    def run(layers: nn.ModuleList) -> list[torch.Tensor | None]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, 32, generator=generator, requires_grad=True)
        table = torch.rand(8, 32, generator=generator)
        h = x
        for layer in layers:
            h = layer(h, table)
        loss = h.square().sum()
        loss.backward()
        return [loss.detach(), *grads(layers, x)]

    expected = run(eager)
    allocations = Allocations(m, monkeypatch, {2})  # window 6's input (window 7's is reused)
    assert_exact(run(layers), expected)
    assert m.events() == [("restore", 7), ("prefetch_oom", 6), *on_demand(6)]
    # The table once, the failed allocation, then windows 6..0's inputs on demand.
    assert len(allocations.alive_at) == 1 + 1 + (LAYERS - 1)
    stats = m.stats()
    assert stats["restored_bytes"] == stats["offloaded_bytes"] == (LAYERS + 1) * 8 * 32 * 4
    assert stats["host_buffers_in_use"] == 0


def test_a_give_up_is_logged_once_per_manager_and_the_next_pass_prefetches_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    m = manager(prefetch=1)
    layers, eager = twins(m, Layer)
    # Step 0 fails its first prefetch (window 6), step 1 its second (window 5: allocation 10,
    # after step 0's failed one and its seven on-demand restores); step 2 prefetches them all.
    Allocations(m, monkeypatch, {1, 10})
    logs = []
    with caplog.at_level(logging.WARNING, logger="offload.prefetch"):
        for seed in range(3):
            expected = eager_step(eager, seed, False)
            layers.zero_grad(set_to_none=True)
            loss, x, value, _ = step(layers, seed, False)
            loss.backward()
            assert_exact([value, *grads(layers, x)], expected)
            logs.append(m.events())
    assert logs[0] == [("restore", 7), ("prefetch_oom", 6), *on_demand(6)]
    assert logs[1] == [("restore", 7), ("prefetch", 6), ("prefetch_hit", 6),
                       ("prefetch_oom", 5), *on_demand(5)]
    assert logs[2] == [("restore", 7)] + [
        event for i in range(6, -1, -1) for event in (("prefetch", i), ("prefetch_hit", i))]
    stats = m.stats()
    assert stats["prefetch_oom"] == 2 and stats["prefetch_hits"] == 1 + 7
    assert stats["host_buffers_in_use"] == 0
    assert len([r for r in caplog.records if r.name == "offload.prefetch"]) == 1


@pytest.mark.parametrize("prefetch, fail, events", [
    (0, {1}, [("restore", 7)]),  # window 6's restore, on demand
    (1, {1, 2}, [("restore", 7), ("prefetch_oom", 6)]),  # its prefetch, then on demand
], ids=["prefetch0", "prefetch1-after-give-up"])
def test_a_restore_on_demand_out_of_memory_still_raises_and_leaves_nothing_checked_out(
        prefetch: int, fail: set[int], events: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = manager(prefetch=prefetch)
    layers, eager = twins(m, Layer)
    allocations = Allocations(m, monkeypatch, fail)
    loss, x, _, _ = step(layers, 0, False)
    with pytest.raises(torch.OutOfMemoryError, match=f"allocation {max(fail)}"):
        loss.backward()
    assert m.events() == events
    assert m.stats()["prefetch_oom"] == len(fail) - 1
    failed_input = weakref.ref(x)
    del loss, x
    assert failed_input() is None  # the failed step's graph is gone
    assert m.stats()["host_buffers_in_use"] == 0
    # Every buffer a restore allocated went with it, and the next step is eager's.
    assert all(ref() is None for _, ref in allocations.handed)
    allocations.fail = set()
    layers.zero_grad(set_to_none=True)
    loss, x, value, _ = step(layers, 1, False)
    loss.backward()
    assert_exact([value, *grads(layers, x)], eager_step(eager, 1, False))


def test_a_given_up_copy_back_still_queued_keeps_its_host_buffer_until_it_ran() -> None:
    # Stream rule 5 on the simulated device (copies run only when waited for): window 1's
    # prefetch queues its first storage's copy back, runs out of memory on the second, and
    # lets go of the first's buffer; then backward fails and the graph goes, with that copy
    # still queued. Its host buffer goes back with that copy's event, so the next step's copy
    # to host into it waits for it (dropping the event, as if the restore never happened, is
    # caught as rule 3).
    m, streams = simulated(None, prefetch=1)
    layers = nn.ModuleList(Gated() for _ in range(4))
    checkpoint_layers(layers, offload=m)
    to_device, calls = streams.to_device, [0]

    def second_fails(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return to_device(*args)
    streams.to_device = second_fails  # type: ignore[method-assign,assignment]

    def forward() -> torch.Tensor:
        h = torch.randn(8, 32, requires_grad=True)
        gates = [torch.rand(8, 32) for _ in range(4)]
        h = FailingBackward.apply(layers[1](layers[0](h, gates[0]), gates[1]))
        return layers[3](layers[2](h, gates[2]), gates[3]).sum()

    loss = forward()
    with pytest.raises(RuntimeError, match="on purpose"):
        loss.backward()
    assert m.events() == [("restore", 3), ("prefetch", 2), ("prefetch_hit", 2),
                          ("prefetch_oom", 1)]
    assert len(streams.queues["h2d"]) == 1  # the given-up copy back, not run
    del loss
    gc.collect()
    assert m.stats()["host_buffers_in_use"] == 0
    forward()  # the next step's copies to host reuse those buffers
    streams.finish()
    assert streams.violations == []


def test_a_given_up_prefetch_keeps_the_device_bytes_it_reused() -> None:
    # On the simulated device (copies run only when waited for) window 6's copies are still in
    # flight when backward begins, so its prefetch reuses their device bytes (NOTE [reuse at
    # the turn]); the table window 6 shares with window 0 comes back from host, and that copy
    # back runs out of memory. Only what took new memory is let go: letting go of the reused
    # input too made window 6's restore on demand copy it back from host, one more
    # allocation at the moment the device was short of memory.
    m, streams = simulated(None, prefetch=1)
    torch.manual_seed(0)
    layers = nn.ModuleList(Gated() for _ in range(LAYERS))
    checkpoint_layers(layers, offload=m)
    eager = nn.ModuleList(Gated() for _ in range(LAYERS))
    eager.load_state_dict(layers.state_dict())
    to_device, calls = streams.to_device, [0]

    def first_fails(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return to_device(*args)
    streams.to_device = first_fails  # type: ignore[method-assign,assignment]

    def run(layers: nn.ModuleList) -> list[torch.Tensor | None]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, 32, generator=generator, requires_grad=True)
        table = torch.rand(8, 32, generator=generator)
        h = x
        for index, layer in enumerate(layers):  # the table for layers 0 and 6, fresh gates else
            h = layer(h, table if index in (0, LAYERS - 2) else
                      torch.rand(8, 32, generator=generator))
        loss = h.square().sum()
        loss.backward()
        return [loss.detach(), *grads(layers, x)]

    expected = run(eager)
    assert_exact(run(layers), expected)
    assert m.events() == [("restore", 7), ("prefetch_oom", 6), *on_demand(6)]
    # The failed copy back, the table again, windows 5..1's two storages and window 0's x.
    assert calls[0] == 1 + 1 + 2 * (LAYERS - 3) + 1
    stats = m.stats()
    assert stats["reused_bytes"] == 3 * 8 * 32 * 4  # window 7's two storages, window 6's input
    assert stats["host_buffers_in_use"] == 0 and not streams.violations
