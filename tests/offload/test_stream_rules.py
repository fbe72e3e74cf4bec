"""The stream rules of NOTE [stream rules], checked on CPU against a simulated asynchronous GPU.

On CPU the real ``CopyEngine`` copies synchronously, so a manager that forgot a wait or freed a
tensor too early would still pass every other test. ``SimulatedStreams`` replaces it with copies
that run only when their stream reaches them: a copy is queued on its stream and runs when its
event completes, either because the simulated device made progress (at random points, from a
seeded generator) or because someone must wait for it (``wait``, ``event.synchronize``). Until a
copy has run its destination holds poison bytes (NaN in every float dtype), and a device-to-host
copy whose source the manager no longer holds is recorded as a violation. The rules become
checkable, as the manager sees them:

1. the manager keeps the device tensor referenced until its device-to-host copy ran;
2. a restore waits for the host copy to land, and the compute stream waits for the restore;
3. a host buffer goes back to the pool only with the event of the last copy that reads it:
   a restore still queued when its buffer is handed out again is recorded as a violation.

Streams other than the two copy streams are names only (which one waits is recorded). Not
modelled: the copy stream's wait for the compute stream (``tests/offload/test_cuda.py`` checks
it on a GPU) and the allocator side of rule 2 (``record_stream``).
"""

from __future__ import annotations

import copy
import gc
import random
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import checkpoint_layers
from tests.conftest import assert_same_grads

POISON = 0xFF  # 0xFFFF... is a NaN in float16, bfloat16, float32 and float64


class SimEvent:
    def __init__(self, streams: SimulatedStreams, stream: str, run: Callable[[], None]) -> None:
        self.streams, self.stream, self.run, self.done = streams, stream, run, False

    def query(self) -> bool:
        self.streams.progress()
        return self.done

    def synchronize(self) -> None:
        self.streams.complete(self)


class SimulatedStreams:
    """A stand-in for ``offload.streams.CopyEngine`` with deferred, stream-ordered copies."""

    cuda = False  # no timing events to report

    def __init__(self, device: torch.device, *, seed: int | None, progress: float = 0.5) -> None:
        self.device = device
        self.rng = random.Random(seed)
        self.chance = 0.0 if seed is None else progress  # seed None: the device never runs ahead
        self.queues: dict[str, list[SimEvent]] = {"d2h": [], "h2d": []}
        self.violations: list[str] = []
        self.writes: dict[int, int] = {}  # host buffer address -> copies to host queued into it
        self.current = "compute"  # the name current_stream() gives
        self.waits: list[tuple[str, str]] = []  # (copy's stream, waiting stream)

    # -- the device --------------------------------------------------------------------------
    def complete(self, event: SimEvent) -> None:
        """Run ``event``'s stream up to and including ``event`` (streams run in order)."""
        queue = self.queues[event.stream]
        while not event.done:
            head = queue.pop(0)
            head.run()
            head.done = True

    def progress(self) -> None:
        """The device gets ahead on its own, by a random amount."""
        for queue in self.queues.values():
            while queue and self.rng.random() < self.chance:
                self.complete(queue[0])

    def finish(self) -> None:
        for queue in self.queues.values():
            while queue:
                self.complete(queue[-1])

    def _enqueue(self, stream: str, run: Callable[[], None]) -> SimEvent:
        event = SimEvent(self, stream, run)
        self.queues[stream].append(event)
        self.progress()
        return event

    # -- the CopyEngine interface --------------------------------------------------------------
    def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> SimEvent:
        target = host[: device_bytes.numel()]
        target.fill_(POISON)  # undefined until the copy ran (and catches a reader still on it)
        self.writes[host.data_ptr()] = self.writes.get(host.data_ptr(), 0) + 1
        source = weakref.ref(device_bytes)  # the real engine holds no reference either

        def run() -> None:
            alive = source()
            if alive is None:
                self.violations.append("rule 1: device bytes dropped before the copy to host ran")
                return
            target.copy_(alive)
        return self._enqueue("d2h", run)

    def to_device(self, host: torch.Tensor, nbytes: int, after: Any) -> tuple[torch.Tensor, Any]:
        buffer = torch.full((nbytes,), POISON, dtype=torch.uint8)
        writes = self.writes.get(host.data_ptr(), 0)

        def run() -> None:
            if after is not None:
                self.complete(after)  # the h2d stream waits on the copy to host
            if self.writes.get(host.data_ptr(), 0) != writes:
                self.violations.append("rule 3: a host buffer was reused before the restore "
                                       "that reads it ran")
            buffer.copy_(host[:nbytes])
        return buffer, self._enqueue("h2d", run)

    def current_stream(self) -> str:
        return self.current  # a name only: every simulated stream is ordered the same way

    def wait(self, event: Any, *, stream: Any = None) -> None:
        if event is not None:
            self.waits.append((event.stream, stream if stream is not None else self.current))
            self.complete(event)  # the waiting stream is ordered after it

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def waited_ms(self) -> float:
        return 0.0

    def reset_waits(self) -> None:
        pass


def simulated(seed: int | None, **config: Any) -> tuple[OffloadManager, SimulatedStreams]:
    manager = OffloadManager(OffloadConfig(**{"min_bytes": 0, **config}), device="cpu")
    streams = SimulatedStreams(manager.device, seed=seed)
    manager.engine = streams  # type: ignore[assignment]
    return manager, streams


class Layer(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * h


def stack_grads(layers: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor | None]:
    h = x
    for layer in layers:
        h = layer(h)
    h.square().sum().backward()
    return [p.grad for p in layers.parameters()] + [x.grad]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_gradients_are_exact_however_the_simulated_copies_are_timed(seed: int | None,
                                                                    prefetch: int) -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(6))
    model = copy.deepcopy(eager)
    manager, streams = simulated(seed, prefetch=prefetch)
    checkpoint_layers(model, offload=manager)
    x = torch.randn(8, 32)
    expected = stack_grads(eager, x.clone().requires_grad_())
    for _ in range(3):  # later steps reuse pooled host buffers (rule 3)
        model.zero_grad(set_to_none=True)
        got = stack_grads(model, x.clone().requires_grad_())
        assert_same_grads(expected, got)
    assert streams.violations == []
    streams.finish()
    stats = manager.stats()
    assert stats["host_buffers_in_use"] == 0 and stats["pool_misses"] == 6


class Checkpoint(torch.autograd.Function):
    """Identity whose backward runs ``check`` (placed between layers: runs mid-backward)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, check: Callable[[], None]) -> torch.Tensor:
        ctx.check = check
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.check()
        return grad, None


def test_a_host_running_ahead_holds_device_tensors_of_the_last_two_windows_at_most() -> None:
    # NOTE [copies in flight]: the simulated device never runs ahead on its own, as a GPU
    # busy with large layers would not; the host opens window after window.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(6))
    checkpoint_layers(layers, offload=manager)
    x = torch.randn(8, 32, requires_grad=True)
    inputs: list[StorageWeakRef] = []  # of layers 1-5
    seen_in_backward: list[list[bool]] = []

    def after_first_restore() -> None:  # runs once layer 5's backward (the first) is done
        seen_in_backward.append([ref.expired() for ref in inputs])

    h = x
    for index, layer in enumerate(layers):
        h = layer(h)
        if index == 4:
            h = Checkpoint.apply(h, after_first_restore)
        inputs.append(StorageWeakRef(h.untyped_storage()))
    out = h.sum()
    del h
    manager.stats()  # reads events, waits for nothing
    # Windows 1-3 were released when windows 3-5 opened: the compute stream waited for their
    # copies. Windows 4 and 5 stay held by the manager until their copies ran.
    assert [ref.expired() for ref in inputs[:5]] == [True, True, True, False, False]
    assert streams.queues["d2h"] != []  # their copies really are still queued
    out.backward()
    # Backward's first restore released both (waiting for their copies), not only the window
    # it restored: the checkpoint right after it sees neither.
    assert seen_in_backward == [[True] * 6]
    # Layer 0's input is still alive elsewhere (the test holds it): that copy saved nothing.
    assert manager.stats()["alive_elsewhere_bytes"] == x.untyped_storage().nbytes()
    streams.finish()
    assert streams.violations == []


def test_a_graph_dropped_with_copies_in_flight_ends_its_pass() -> None:
    # Copies still queued hold their device tensors, not their windows: once the graph goes,
    # the next forward starts a new pass (ids from 0) and the buffers come back with the copies.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    stack_grads(layers, torch.randn(8, 32, requires_grad=True))  # warm: one pass done
    out = layers[3](layers[2](layers[1](layers[0](torch.randn(8, 32, requires_grad=True)))))
    del out  # two copies are still queued
    stack_grads(layers, torch.randn(8, 32, requires_grad=True))
    assert manager.events()[0] == ("restore", 3)
    streams.finish()
    assert manager.stats()["host_buffers_in_use"] == 0 and streams.violations == []


def test_a_copy_is_waited_for_on_the_stream_that_saved_it_not_the_current_one() -> None:
    # The freed memory belongs to the stream that was current when the tensor was saved: a
    # window opened under another stream must make that one wait, not its own.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    h = layers[1](layers[0](torch.randn(8, 32, requires_grad=True)))
    streams.current = "side"
    layers[3](layers[2](h)).sum()
    assert [w for w in streams.waits if w[0] == "d2h"] == [("d2h", "compute"), ("d2h", "compute")]


def _skip_waits_on(kind: str) -> Callable[[SimulatedStreams], None]:
    """Break one rule only: the compute stream no longer waits on ``kind`` ("d2h"/"h2d")."""

    def breaker(streams: SimulatedStreams) -> None:
        wait = streams.wait

        def selective(event: Any, *, stream: Any = None) -> None:
            if event is None or event.stream != kind:
                wait(event, stream=stream)
        streams.wait = selective  # type: ignore[method-assign]
    breaker.__name__ = f"skip_waits_on_{kind}"
    return breaker


def test_the_simulation_catches_a_restore_read_too_early() -> None:
    # The simulation is only worth something if a broken rule shows: poison reaches the grads.
    # (A restore that skipped its wait for the copy to host cannot be shown: backward's first
    # restore has the compute stream wait for every copy in flight before any restore starts.)
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(3))
    model = copy.deepcopy(eager)
    manager, streams = simulated(None)
    _skip_waits_on("h2d")(streams)  # restores only: the copies to host are still waited for
    checkpoint_layers(model, offload=manager)
    x = torch.randn(8, 32)
    expected = stack_grads(eager, x.clone().requires_grad_())
    got = stack_grads(model, x.clone().requires_grad_())
    assert not any(g.isnan().any() for g in expected if g is not None)
    assert any(g.isnan().any() for g in got if g is not None)


def _think_every_copy_done(streams: SimulatedStreams) -> None:
    streams.done = lambda event: True  # type: ignore[method-assign]


@pytest.mark.parametrize("break_rule_1", [_think_every_copy_done, _skip_waits_on("d2h")])
def test_the_simulation_catches_a_device_tensor_dropped_before_its_copy_ran(
        break_rule_1: Callable[[SimulatedStreams], None]) -> None:
    manager, streams = simulated(None)
    break_rule_1(streams)
    layers = nn.ModuleList(Layer() for _ in range(3))
    checkpoint_layers(layers, offload=manager)
    h = torch.randn(8, 32, requires_grad=True)
    for layer in layers:
        h = layer(h)
    h = h.sum()
    manager.stats()  # "completed": the manager lets go of the device bytes
    streams.finish()
    assert any(v.startswith("rule 1") for v in streams.violations)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


@pytest.mark.parametrize("break_rule_3", [False, True])
def test_a_host_buffer_is_reused_only_after_the_restore_that_reads_it_ran(
        break_rule_3: bool) -> None:
    manager, streams = simulated(None)  # copies run only when something waits for them
    if break_rule_3:  # hand buffers back without the event of their last copy
        release = manager.pool.release
        manager.pool.release = lambda buffer, *, event=None: release(buffer)  # type: ignore
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)

    def forward() -> torch.Tensor:
        h = torch.randn(8, 32, requires_grad=True)
        h = FailingBackward.apply(layers[1](layers[0](h)))
        return layers[3](layers[2](h)).sum()

    loss = forward()
    with pytest.raises(RuntimeError, match="on purpose"):
        loss.backward()
    # Backward restored windows 3 and 2 and was prefetching window 1 when it failed: that
    # restore is still queued when the graph goes and its host buffer returns to the pool.
    assert manager.events()[-1] == ("prefetch", 1)
    del loss
    gc.collect()
    assert manager.stats()["host_buffers_in_use"] == 0
    forward()  # the next step's copies to host reuse those buffers
    streams.finish()
    caught = any(v.startswith("rule 3") for v in streams.violations)
    assert caught == break_rule_3
