"""The stream rules of NOTE [stream rules], checked on CPU against a simulated asynchronous GPU.

On CPU the real ``CopyEngine`` copies synchronously, so a manager that forgot a wait or freed a
tensor too early would still pass every other test. ``SimulatedStreams`` (``simulated.py``)
replaces it with copies that run only when their stream reaches them, so the rules become
checkable, as the manager sees them:

1. the manager keeps the device tensor referenced until its device-to-host copy ran;
2. a restore waits for the host copy to land, and the compute stream waits for the restore;
3. a host buffer goes back to the pool only with the event of the last copy that reads it:
   a restore still queued when its buffer is handed out again is recorded as a violation.

Streams other than the two copy streams are names only (which one waits is recorded). Not
modelled: the copy stream's wait for the compute stream and the allocator side of rule 2
(``record_stream``); ``test_streams.py`` checks that the copy engine issues both, in order.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import checkpoint_layers
from tests.conftest import assert_same_grads
from tests.offload.blocks import FailingBackward, grads_with_last_input_changed, manager
from tests.offload.simulated import POISON, SimulatedStreams, simulated


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


def _schedule_grads(layers: nn.ModuleList, inputs: list[torch.Tensor], schedule: str,
                    manager: Any = None) -> list[torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        return h.square().sum()

    if schedule == "gpipe":  # every forward, then every backward in the same order
        for loss in [forward(x) for x in inputs]:
            loss.backward()
    elif schedule == "1f1b":  # one forward ahead of each backward
        first, second = forward(inputs[0]), forward(inputs[1])
        first.backward()
        third = forward(inputs[2])
        second.backward()
        third.backward()
    elif schedule == "retain_graph":
        loss = forward(inputs[0])
        loss.backward(retain_graph=True)
        loss.backward()
    else:  # "reverse, stats between": two forwards, backwards in reverse order
        first, second = forward(inputs[0]), forward(inputs[1])
        if manager is not None:
            manager.stats()  # lets go of what has landed: backward copies more back
        second.backward()
        first.backward()
    return [p.grad for p in layers.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "retain_graph", "reverse_stats_between"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_schedules_give_exact_gradients_whatever_backward_reuses_or_copies_back(
        schedule: str, prefetch: int, seed: int | None) -> None:
    # Which windows backward reuses (NOTE [reuse at the turn]) and which it copies back depends
    # on the schedule and on when copies land; the gradients must not.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(5))
    model = copy.deepcopy(eager)
    manager, streams = simulated(seed, prefetch=prefetch)
    checkpoint_layers(model, offload=manager)
    inputs = [torch.randn(8, 32) for _ in range(3)]
    expected = _schedule_grads(eager, inputs, schedule)
    got = _schedule_grads(model, inputs, schedule, manager)
    streams.finish()
    assert_same_grads(expected, got)
    assert streams.violations == []
    stats = manager.stats()
    assert stats["restored_bytes"] == stats["offloaded_bytes"] >= stats["reused_bytes"]
    if schedule == "retain_graph":  # a backward right after its forward: its last window
        assert stats["reused_bytes"] > 0


class _CountedLayer(Layer):
    calls = 0  # on the class: a count on the module would be the replay's to change too

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _CountedLayer.calls += 1
        return super().forward(h)


def _split_grads(layers: nn.ModuleList, inputs: list[torch.Tensor], order: str
                 ) -> list[torch.Tensor]:
    """A zero-bubble stage's split backwards by hand, in ``order`` (``F``: a forward, ``I``:
    its input pass, keeping the graph, ``W``: its weight pass, handed the same output gradient:
    NOTE [a weight pass from captured gradients]); each input's gradient, then the summed
    parameters' gradients."""
    params = list(layers.parameters())
    xs = [x.clone().requires_grad_() for x in inputs]
    outs: dict[int, torch.Tensor] = {}
    dxs: dict[int, torch.Tensor] = {}
    for step in order.split():
        i = int(step[1]) - 1
        if step[0] == "F":
            h = xs[i]
            for layer in layers:
                h = layer(h)
            outs[i] = h
        elif step[0] == "I":
            (dxs[i],) = torch.autograd.grad(outs[i], [xs[i]], torch.ones_like(outs[i]),
                                            retain_graph=True)
        else:
            out = outs.pop(i)
            for p, g in zip(params, torch.autograd.grad(out, params, torch.ones_like(out))):
                p.grad = g if p.grad is None else p.grad + g
    return [*(dxs[i] for i in range(len(xs))), *(p.grad for p in params)]


@pytest.mark.parametrize("order", ["F1 F2 I1 I2 W1 W2", "F1 I1 F2 W1 I2 W2"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("seed", [None, 0])
def test_split_backward_schedules_give_exact_gradients_whatever_the_copies_timing(
        order: str, prefetch: int, seed: int | None) -> None:
    # A zero-bubble schedule's input pass restores each window and keeps the replay's graph
    # (NOTE [a replay kept between restricted backwards] in pytree_ckpt/kept_replay.py); its
    # weight pass reads that graph with no unpack of its own but the in-place check: nothing
    # is copied back twice, and the restores of the input pass are what the weight pass reads.
    torch.manual_seed(0)
    eager = nn.ModuleList(_CountedLayer() for _ in range(4))
    model = copy.deepcopy(eager)
    manager, streams = simulated(seed, prefetch=prefetch)
    checkpoint_layers(model, offload=manager)
    inputs = [torch.randn(8, 32) for _ in range(2)]
    calls = []
    for layers in (eager, model):
        _CountedLayer.calls = 0
        calls.append((_split_grads(layers, inputs, order), _CountedLayer.calls))
    streams.finish()
    assert_same_grads(calls[0][0], calls[1][0])
    assert streams.violations == []
    # The original pass and one replay a layer: the input pass's graph served the weight pass.
    assert (calls[0][1], calls[1][1]) == (8, 2 * 8)
    gc.collect()
    stats = manager.stats()
    assert stats["restored_bytes"] == stats["offloaded_bytes"] == 8 * inputs[0].nbytes
    assert stats["host_buffers_in_use"] == 0


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
    # NOTE [copies in flight] (in_flight.py): the simulated device never runs ahead on its own, as a
    # GPU busy with large layers would not; the host opens window after window.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(6))
    checkpoint_layers(layers, offload=manager)
    x = torch.randn(8, 32, requires_grad=True)
    inputs: list[StorageWeakRef] = []  # of layers 1-5
    seen_in_backward: list[list[bool]] = []
    copies_waited_for: list[int] = []

    def after_first_restore() -> None:  # runs once layer 5's backward (the first) is done
        seen_in_backward.append([ref.expired() for ref in inputs])
        copies_waited_for.append(sum(1 for w in streams.waits if w[0] == "d2h"))

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
    # Backward's first restore took both as they were (NOTE [reuse at the turn]): window 5 for
    # layer 5, window 4 as the prefetch for layer 4, which the checkpoint right after layer 5's
    # backward still sees alive. Backward's first kernels do not wait for their copies to
    # host (both only read the bytes); the saving stream waits for one when backward lets go
    # of its bytes (stream rule 1), here window 5's after layer 5's backward. On a GPU that
    # copy has long landed by then, and is not waited for at all.
    assert seen_in_backward == [[True, True, True, False, True, True]]
    assert copies_waited_for == [5]  # windows 0-3 in forward, then window 5 as it let go
    # Layer 0's input is still alive elsewhere (the test holds it): that copy saved nothing.
    assert manager.stats()["alive_elsewhere_bytes"] == x.untyped_storage().nbytes()
    streams.finish()
    assert streams.violations == []


@pytest.mark.parametrize("device_keeps_up", [False, True])
def test_backward_reuses_the_device_bytes_it_still_holds_instead_of_copying_them_back(
        device_keeps_up: bool) -> None:
    # With the host far ahead the manager still holds the last two windows' device tensors
    # when backward begins; with every copy landed at once (the real engine on CPU) only the
    # last window's, released one window late. Those come back with no copy to the device;
    # everything else is copied back from host, and the gradients are exact either way.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(6))
    model = copy.deepcopy(eager)
    if device_keeps_up:
        manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
        copies_back = count_calls(manager.engine, "to_device")
    else:
        manager, streams = simulated(None)
        copies_back = count_calls(streams, "to_device")
    checkpoint_layers(model, offload=manager)
    x = torch.randn(8, 32)
    expected = stack_grads(eager, x.clone().requires_grad_())
    got = stack_grads(model, x.clone().requires_grad_())
    assert_same_grads(expected, got)
    held = 1 if device_keeps_up else 2
    stats = manager.stats()
    window_bytes = 8 * 32 * 4
    assert stats["restored_bytes"] == stats["offloaded_bytes"] == 6 * window_bytes
    assert stats["reused_bytes"] == held * window_bytes
    assert copies_back == [6 - held]
    # Window 0's input is the test's leaf: alive elsewhere. Nothing else holds the reused ones.
    assert stats["alive_elsewhere_bytes"] == window_bytes


def test_copies_of_another_micro_batch_are_let_go_before_backward_copies_anything_back() -> None:
    # One forward, one backward, the host far ahead: when micro-batch 0's backward begins, the
    # manager holds micro-batch 1's last two layer inputs (its copies are still queued). They
    # are let go before the first copy back allocates device memory, or the peak would rise.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    inputs_of_1: list[StorageWeakRef] = []

    def micro_batch(record: bool) -> torch.Tensor:
        h = torch.randn(8, 32, requires_grad=True)
        for layer in layers:
            if record:
                inputs_of_1.append(StorageWeakRef(h.untyped_storage()))
            h = layer(h)
        return h.sum()

    loss0 = micro_batch(False)
    loss1 = micro_batch(True)
    assert [ref.expired() for ref in inputs_of_1[1:]] == [True, False, False]  # 0: the leaf
    alive_at_copies_back: list[list[bool]] = []
    to_device = streams.to_device

    def recording(*args: Any) -> Any:
        alive_at_copies_back.append([not ref.expired() for ref in inputs_of_1[1:]])
        return to_device(*args)
    streams.to_device = recording  # type: ignore[method-assign]
    loss0.backward()
    assert alive_at_copies_back and not any(any(alive) for alive in alive_at_copies_back)
    loss1.backward()
    streams.finish()
    assert streams.violations == []


def count_calls(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name`` to count its calls; the one-element list holds the count."""
    count = [0]
    method = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return method(*args, **kwargs)
    setattr(obj, name, counted)
    return count


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


def _device_copies(manager: Any) -> list[Any]:
    """The copies whose device tensor ``manager`` still holds (NOTE [copies in flight])."""
    return [held for ref in manager._pending.copies
            if (held := ref()) is not None and held.device_bytes is not None]


def test_a_kept_graphs_copy_in_flight_is_let_go_when_a_one_window_backward_begins() -> None:
    # A grad-enabled evaluation keeps its output (and so its graph, and its copies). Its last
    # window is younger than the window opened next, so that opening keeps its copy in flight;
    # the next backward's first restore lets go of it (NOTE [copies in flight]), and gives
    # eager's gradients. A one-layer step opens no second window that would let it go first.
    # (A graph dropped instead lets go of its copies at once: test_a_dropped_graphs_copies_...)
    torch.manual_seed(0)
    eager = Layer()
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(3))
    layers[0].load_state_dict(eager.state_dict())
    checkpoint_layers(layers, offload=manager)
    stack_grads(layers, torch.randn(8, 32, requires_grad=True))  # one whole step first
    h = torch.randn(8, 32, requires_grad=True)
    for layer in layers[:2]:
        h = layer(h)
    last_input = StorageWeakRef(h.untyped_storage())
    kept = layers[2](h)  # its graph holds the copies (and the boundary its input)
    del h
    copy_of_last = _device_copies(manager)[-1]  # its last window's, still queued
    assert copy_of_last.storage_ref.cdata == last_input.cdata
    x = torch.randn(8, 32)
    leaf = x.clone().requires_grad_()
    loss = layers[0](leaf).square().sum()  # opens one window
    assert copy_of_last in _device_copies(manager)  # younger than that window: still held
    expected = stack_grads(nn.ModuleList([eager]), x.clone().requires_grad_())
    for p in layers[0].parameters():
        p.grad = None
    loss.backward()
    assert copy_of_last.device_bytes is None  # let go by the backward, before any stats()
    assert copy_of_last not in _device_copies(manager)
    assert_same_grads(expected, [p.grad for p in layers[0].parameters()] + [leaf.grad])
    streams.finish()
    del kept, copy_of_last
    assert streams.violations == [] and manager.stats()["host_buffers_in_use"] == 0


def test_a_kept_graphs_last_copy_in_flight_is_let_go_two_windows_into_the_next_forward(
        ) -> None:
    # Guards against: the window count restarting at each pass turn (Lane.turn resetting
    # ``opened``): windows of a finished forward (a grad-enabled evaluation keeping its
    # output, whose copies live) then count as younger than the next pass's, and the next
    # forward held its last input on the device window after window (NOTE [copies in
    # flight]: two windows later at the latest, counted per thread across passes). The new
    # forward's gradients are eager's bit for bit.
    torch.manual_seed(0)
    eager = nn.ModuleList(Layer() for _ in range(3))
    manager, streams = simulated(None)
    layers = copy.deepcopy(eager)
    checkpoint_layers(layers, offload=manager)
    stack_grads(layers, torch.randn(8, 32, requires_grad=True))  # one whole step first
    for p in layers.parameters():
        p.grad = None
    h = torch.randn(8, 32, requires_grad=True)
    for layer in layers[:2]:
        h = layer(h)
    last_input = StorageWeakRef(h.untyped_storage())
    kept = layers[2](h)  # a grad-enabled evaluation keeping its output: its copies live
    del h  # its last window's copy is still queued
    x = torch.randn(8, 32)
    leaf = x.clone().requires_grad_()
    held = []
    h = leaf
    for layer in layers:
        h = layer(h)
        held.append(not last_input.expired())
    assert held == [True, False, False]  # let go as the new forward's second window opened
    h.square().sum().backward()  # as stack_grads, for the eager twin
    expected = stack_grads(eager, x.clone().requires_grad_())
    assert_same_grads(expected, [p.grad for p in layers.parameters()] + [leaf.grad])
    streams.finish()
    del kept
    assert streams.violations == [] and manager.stats()["host_buffers_in_use"] == 0


def test_a_dropped_graphs_copies_in_flight_go_with_it_once_the_saving_stream_waited() -> None:
    # NOTE [a copy nobody needs is not held] (in_flight.py): helper GL, a forward dropped
    # without backward left its last window's input and host buffer held by the manager until
    # its next window, backward or stats(). The copies die with their handles; the stream
    # that saved each tensor waits for its copy to host first (stream rule 1), and the host
    # buffers go back to the pool with their copies' events.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(3))
    checkpoint_layers(layers, offload=manager)
    stack_grads(layers, torch.randn(8, 32, requires_grad=True))  # one whole step first
    h = torch.randn(8, 32, requires_grad=True)
    inputs = []
    for layer in layers:
        inputs.append(StorageWeakRef(h.untyped_storage()))
        h = layer(h)
    waits = len(streams.waits)
    del h  # dropped without backward: the last windows' copies are still queued
    assert [ref.expired() for ref in inputs[1:]] == [True, True]  # x is the caller's
    assert ("d2h", "compute") in streams.waits[waits:]
    assert manager.pool.checked_out == 0
    streams.finish()
    assert streams.violations == [] and manager.stats()["host_buffers_in_use"] == 0


def test_a_copy_is_waited_for_on_the_stream_that_saved_it_not_the_current_one() -> None:
    # The freed memory belongs to the stream that was current when the tensor was saved: a
    # window opened under another stream must make that one wait, not its own.
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    h = layers[1](layers[0](torch.randn(8, 32, requires_grad=True)))
    streams.current = "side"
    out = layers[3](layers[2](h)).sum()  # kept: its copies live (a dropped graph's go at once)
    assert [w for w in streams.waits if w[0] == "d2h"] == [("d2h", "compute"), ("d2h", "compute")]
    del out


def test_a_restore_read_on_another_stream_than_it_was_allocated_on_is_marked_used_there(
        ) -> None:
    # Stream rule 4: window 1 is prefetched while layer 2's backward runs (its buffer comes
    # from that stream's pool), then read by layer 1's backward, here on another stream. The
    # buffer must be marked used there, or its memory would go back to the first stream's pool
    # while the second stream's kernels still read it.
    manager, streams = simulated(None, prefetch=1)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    x = torch.randn(8, 32, requires_grad=True)
    h = layers[1](layers[0](x))

    def switch() -> None:
        streams.current = "side"  # layer 1's backward (and layer 0's) run on another stream

    h = Checkpoint.apply(h, switch)
    out = layers[3](layers[2](h)).sum()
    manager.stats()
    streams.finish()  # every copy landed: nothing is reused, everything is restored
    manager.stats()
    out.backward()
    # Layer 1's window (prefetched on "compute"), and layer 0's (restored on demand on "side":
    # same stream, not marked).
    assert streams.used_on == [("compute", "side")]
    assert manager.events()[:4] == [("restore", 3), ("prefetch", 2), ("prefetch_hit", 2),
                                    ("prefetch", 1)]


def _backward_on_another_stream() -> tuple[OffloadManager, SimulatedStreams]:
    """Four layers, the host far ahead (backward reuses the last two windows' device bytes,
    NOTE [reuse at the turn]), and backward reading them on another stream ("side") than the
    one that saved them ("compute"), as a layer run on a side stream does (autograd runs its
    backward there) when it reads a storage an earlier layer saved."""
    manager, streams = simulated(None)
    layers = nn.ModuleList(Layer() for _ in range(4))
    checkpoint_layers(layers, offload=manager)
    h = torch.randn(8, 32, requires_grad=True)
    for layer in layers:
        h = layer(h)
    out = h.square().sum()
    del h
    streams.current = "side"
    out.backward()
    streams.finish()
    assert streams.violations == []
    assert manager.stats()["reused_bytes"] == 2 * 8 * 32 * 4  # windows 3 and 2
    return manager, streams


def test_device_bytes_backward_reuses_are_marked_used_on_the_stream_that_reads_them() -> None:
    # Stream rule 4 for reused bytes: their memory came from the saving stream's pool; read on
    # another, they must be marked used there, or once backward lets go of them the saving
    # stream would get the memory back while the reading stream's kernels still read it. The
    # windows copied back were allocated on the reading stream itself: not marked.
    _, streams = _backward_on_another_stream()
    assert streams.used_on == [("compute", "side"), ("compute", "side")]


def test_device_bytes_backward_reused_are_let_go_after_the_saving_stream_waits_for_their_copy(
        ) -> None:
    # Stream rule 1 for reused bytes (Copy.__del__): the copy to host may still read them when
    # backward lets go; the stream that owns the memory (the saving one), not the one
    # backward runs on, must wait for it. Windows 0 and 1 were let go in forward (windows 2
    # and 3 opening), window 3 as backward let go of its bytes (window 2's copy, queued
    # before it on the d2h stream, had landed by then: not waited for again).
    _, streams = _backward_on_another_stream()
    assert [w for w in streams.waits if w[0] == "d2h"] == [("d2h", "compute")] * 3


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


class IdleRestoreStream(SimulatedStreams):
    """The copies to host stay queued (the d2h stream is behind), the h2d stream is idle: a
    restore runs as soon as it is queued, after what its stream was told to wait for. A copy
    to host reads the bytes its source had when queued (on a GPU the allocator keeps memory
    freed meanwhile for it: ``record_stream``), so a source freed in place can be modelled."""

    def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> Any:
        target, snapshot = host[: device_bytes.numel()], device_bytes.clone()
        target.fill_(POISON)
        return self._enqueue("d2h", lambda: target.copy_(snapshot))

    def to_device(self, host: torch.Tensor, nbytes: int, after: Any) -> tuple[torch.Tensor, Any]:
        buffer, event = super().to_device(host, nbytes, after)
        self.complete(event)
        return buffer, event


def test_a_copy_back_waits_for_the_copy_to_host_still_in_flight_at_backward() -> None:
    # Guards against a copy back that does not wait for the copy to host (no ``after`` event).
    # The last layer's input was freed in place after forward (as an output discard does)
    # while its copy to host is still queued: backward cannot reuse it and copies it back
    # from host, which must wait for that copy to land, or the gradients are computed from
    # the host buffer's stale bytes.
    m = manager()
    m.engine = IdleRestoreStream(m.device, seed=None)  # type: ignore[assignment]
    expected, got = grads_with_last_input_changed(m, lambda h: h.untyped_storage().resize_(0),
                                                  layer=Layer)
    assert_same_grads(expected, got)


class TwoInputs(nn.Module):
    """A layer given two tensors on storages of their own (hidden states and, say, top-k
    scores): each of its windows copies two storages."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * scores


def test_a_prefetch_restores_every_storage_of_the_window_before_backward_reaches_it() -> None:
    # Guards against a prefetch that restores part of a window and leaves the rest to an
    # exposed copy on demand: when layer 2's backward is done, window 1 (two storages) has
    # been copied back whole, and nothing more is copied once layer 1's backward runs.
    torch.manual_seed(0)
    manager = OffloadManager(OffloadConfig(min_bytes=0, prefetch=1), device="cpu")
    copies_back = count_calls(manager.engine, "to_device")
    eager = nn.ModuleList(TwoInputs() for _ in range(3))
    layers = copy.deepcopy(eager)
    checkpoint_layers(layers, offload=manager)
    scores = [torch.rand(8, 32) for _ in range(3)]
    x = torch.randn(8, 32)
    at_layer_1: list[int] = []

    def forward(model: nn.ModuleList, probe: bool) -> torch.Tensor:
        h = x.clone().requires_grad_()
        for index, layer in enumerate(model):
            if probe and index == 2:
                h = Checkpoint.apply(h, lambda: at_layer_1.append(copies_back[0]))
            h = layer(h, scores[index].clone())
        return h

    forward(layers, True).square().sum().backward()
    forward(eager, False).square().sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in layers.parameters()])
    # Window 2 is reused (held one window late on CPU); window 1 is prefetched, both storages.
    assert at_layer_1 == [2]
    assert copies_back == [4]  # then window 0, prefetched by layer 1's backward
    assert manager.stats()["prefetch_hits"] == 2


def test_a_prefetched_window_whose_storage_was_freed_lets_go_of_it_before_backward_moves_on(
) -> None:
    # Guards against: unpack_handle's second let_go without ``force_before`` (unpacking.py):
    # a window prefetched from host (its device storage freed in place by the caller, so not
    # reused) whose copy to host had not landed yet was held on the device until backward
    # reached that window, a layer later, where it is let go once the saving stream waited.
    # Seen only with the device lagging behind the host (the simulated engine, never ahead).
    class SnapshotStreams(SimulatedStreams):
        # A copy to host reads its source as it was when queued (the real engine keeps a
        # source freed meanwhile for the copy stream: record_stream), so a storage freed in
        # place after forward can be modelled; the device never runs ahead.
        def to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> object:
            target, snapshot = host[: device_bytes.numel()], device_bytes.clone()
            target.fill_(POISON)
            return self._enqueue("d2h", lambda: target.copy_(snapshot))

    m = manager(prefetch=1)
    m.engine = streams = SnapshotStreams(m.device, seed=None)  # type: ignore[assignment]
    x = torch.randn(16, 32, requires_grad=True)
    h0 = x * 1.0
    with m.window([h0]):
        a = h0 * h0
    h1 = a * 1.0
    with m.window([h1]):
        out = torch.sin(h1).sum()  # one save: one unpack of window 1
    freed = StorageWeakRef(h0.untyped_storage())
    h0.untyped_storage().resize_(0)  # freed in place: restored from host, not reused
    del h0, h1
    seen: list[bool] = []
    a.register_hook(lambda grad: seen.append(freed.expired()))  # between the two windows
    out.backward()
    assert seen == [True]
    twin = x.detach().clone().requires_grad_()
    e0 = twin * 1.0
    e1 = (e0 * e0) * 1.0
    torch.sin(e1).sum().backward()
    assert torch.equal(x.grad, twin.grad)
    streams.finish()
    assert streams.violations == []
