"""What only a GPU can show: pinned host buffers, side streams, peak device memory.

Skipped cleanly without CUDA; `scripts/gpu_check.sh` runs them (with the GPU bench preset).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadManager
from pytree_ckpt import apply_activation_checkpointing, checkpoint_layers
from tests.conftest import assert_same_grads
from tests.offload.blocks import Block, Gated, stack

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_host_buffers_are_pinned_and_copies_run_on_side_streams() -> None:
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    assert manager.device.index is not None  # "cuda" must match tensors on "cuda:0"
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    h = x * 2
    with manager.window([h]) as window:
        loss = (h * h).sum()
    copy_ = next(iter(window.copies.values()))
    assert copy_.host.is_pinned()
    assert copy_.d2h_event is not None
    assert manager.engine.d2h_stream != torch.cuda.current_stream()
    assert manager.engine.h2d_stream != torch.cuda.current_stream()
    loss.backward()
    assert torch.equal(x.grad, 8 * x.detach())
    del copy_  # our reference keeps the copy, and with it its host buffer, checked out
    assert manager.stats()["host_buffers_in_use"] == 0


def test_under_the_default_device_cuda_host_copies_are_pinned_cpu_buffers() -> None:
    # Guards against: the pool's device-less torch.empty made its "host" buffers on the GPU
    # under torch.set_default_device("cuda"), so offload moved nothing off it.
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    with torch.device("cuda"):
        h = x * 2
        with manager.window([h]) as window:
            loss = (h * h).sum()
    copy_ = next(iter(window.copies.values()))
    assert copy_.host.device == torch.device("cpu") and copy_.host.is_pinned()
    loss.backward()
    assert torch.equal(x.grad, 8 * x.detach())


def test_a_graph_dropped_with_copies_in_flight_frees_them_after_the_saving_stream_waited(
        ) -> None:
    # NOTE [a copy nobody needs is not held] (offload/in_flight.py): with the GPU held back,
    # the copies to host are still queued when the graph goes; Copy.__del__ makes the saving
    # stream wait for them before their device memory goes back (stream rule 1), and the
    # host buffers go back with their events. The next step reuses the pool and gets eager's
    # gradients (a copy reading reused memory would not break them, but an ordering bug
    # shows as an illegal access or a hang here).
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(256) for _ in range(4)).cuda()
    twin = copy.deepcopy(layers)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    checkpoint_layers(twin, offload=manager)
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    stack(twin, x.clone()).sum().backward()  # warm the pool
    torch.cuda.synchronize()
    manager.stats(reset=True)
    base = torch.cuda.memory_allocated()
    torch.cuda._sleep(200_000_000)  # the copies below queue behind ~0.1 s of GPU time
    out = stack(twin, x.clone())
    del out  # dropped without backward, copies still queued
    assert manager.pool.checked_out == 0
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base
    twin.zero_grad(set_to_none=True)
    stack(layers, x).square().mean().backward()
    expected = [p.grad for p in layers.parameters()]
    stack(twin, x.clone()).square().mean().backward()
    assert_same_grads(expected, [p.grad for p in twin.parameters()])
    assert manager.stats()["pool_misses"] == 0


@pytest.mark.parametrize("gpu_held_back", [False, True])
def test_offload_gives_bit_identical_gradients_on_cuda(gpu_held_back: bool) -> None:
    # Held back, the host enqueues the whole step before any copy to host has run, so the
    # manager still holds the last two windows' device tensors when backward begins: they come
    # back with no copy (NOTE [reuse at the turn]), the others from host. Idle, the copies
    # usually land at once and only the last window (released one window late) is reused.
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(256) for _ in range(6)).cuda()
    twin = copy.deepcopy(layers)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    checkpoint_layers(twin, offload=manager)
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    stack(layers, x).square().mean().backward()
    expected = [p.grad for p in layers.parameters()] + [x.grad]
    x.grad = None
    stack(twin, x.clone()).square().mean().backward()  # warm the pool: no allocation below
    twin.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    manager.stats(reset=True)
    if gpu_held_back:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of everything below
    loss = stack(twin, x).square().mean()
    # Held back, the sleep must still run here: if not, something in the forward made the
    # host wait for the GPU (a synchronizing call), and the reuse count below says so.
    busy = not torch.cuda.current_stream().query()
    loss.backward()
    torch.cuda.synchronize()
    assert_same_grads(expected, [p.grad for p in twin.parameters()] + [x.grad])
    stats = manager.stats()
    assert stats["restored_bytes"] == 6 * x.nbytes
    reused_windows = stats["reused_bytes"] / x.nbytes
    assert reused_windows == 2 if gpu_held_back else reused_windows in (1, 2), (
        f"{reused_windows} windows reused; the GPU was {'still' if busy else 'no longer'} busy "
        f"when backward began; {stats}")


def test_peak_memory_drops_by_all_but_two_layer_inputs_with_the_host_far_ahead() -> None:
    # The target: the peak drops by (L-2) of the L layer inputs, all but the one being
    # recomputed and the one prefetched; with prefetch 1 that is also the best possible, so the
    # bound is tight by design. The GPU is held back first, so the host enqueues the whole
    # forward before any copy to host has run: NOTE [copies in flight] must still release
    # each input two windows later, in stream order.
    torch.manual_seed(0)
    num_layers, tokens, width = 8, 8192, 1024
    layers = nn.ModuleList(Block(width) for _ in range(num_layers)).cuda()
    plain = copy.deepcopy(layers)
    checkpoint_layers(plain, offload=False)
    offloaded = copy.deepcopy(layers)
    manager = OffloadManager(OffloadConfig(min_bytes=1 << 20), device="cuda")
    checkpoint_layers(offloaded, offload=manager)
    input_bytes = tokens * width * 4
    x = torch.randn(tokens, width, device="cuda", requires_grad=True)

    def measure(model: nn.ModuleList) -> dict[str, Any]:
        for t in [x, *model.parameters()]:  # a steady-state step: gradients already exist
            t.grad = torch.zeros_like(t)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        reserved = torch.cuda.memory_reserved()
        torch.cuda._sleep(100_000_000)  # the GPU lags behind the host from here on
        out = stack(model, x.clone())   # the clone: a first input only the graph holds
        # For the messages below: whether the host really ran ahead (the sleep still runs).
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        manager.stats()  # lets go of the last windows, whose copies have landed by now
        held = torch.cuda.memory_allocated() - base
        out.square().sum().backward()   # a real gradient into the last layer, as in training
        torch.cuda.synchronize()
        # Reserved: not a target (memory freed while a copy still reads it returns to the
        # allocator only once that copy is done), reported to tell the two apart on a miss.
        return {"held": held, "peak": torch.cuda.max_memory_allocated() - base,
                "peak_reserved": torch.cuda.max_memory_reserved() - reserved,
                "gpu_busy_after_forward": busy}

    measure(offloaded)  # warm the pool
    ckpt, off = measure(plain), measure(offloaded)
    seen = f"checkpoint only {ckpt}, offload {off}, input {input_bytes}, {manager.stats()}"
    assert ckpt["held"] - off["held"] >= (num_layers - 1) * input_bytes, seen
    # Less 4 MiB of allocator rounding, as examples/bench_offload.py allows.
    assert ckpt["peak"] - off["peak"] >= (num_layers - 2) * input_bytes - (4 << 20), seen
    assert manager.stats()["alive_elsewhere_bytes"] == 0


def test_the_copy_to_host_waits_for_the_kernel_that_produces_the_tensor() -> None:
    # NOTE [stream rules] 1: the d2h stream must wait for the compute stream. Keep the compute
    # stream busy, enqueue the producer behind it, and offload at once: without the wait the
    # host copy would read the storage before the producer wrote it. The storage holds NaN
    # until then (filled before the sleep), so a copy that ran early gives NaN gradients, not
    # whatever bytes the allocator's block happened to hold (possibly right ones).
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cuda")
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    # Pinned allocation may synchronize streams: none may happen while the GPU is held.
    manager.pool.reserve([x.untyped_storage().nbytes()])
    h = torch.full_like(x, float("nan"))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the compute stream
    h.copy_(x * 2)                  # the producer, queued behind the sleep
    with manager.window([h]):
        loss = (h * h).sum()
    busy = not torch.cuda.current_stream().query()  # the copy was queued before the producer ran
    del h
    for _ in range(2):  # two more windows: the manager lets go of h's device bytes, so
        with manager.window([]):  # backward must copy them back (no NOTE [reuse at the turn])
            pass
    loss.backward()
    stats = manager.stats()
    assert stats["reused_bytes"] == 0 and stats["restored_bytes"] == x.nbytes
    assert torch.equal(x.grad, 8 * x.detach())  # d(4x^2)/dx, from the restored bytes
    # Otherwise the test proved nothing: something on the way made the host wait for the GPU.
    assert busy, "the sleep had ended when the copy to host was queued"


def test_a_restored_tensor_is_not_read_before_its_copy_lands() -> None:
    # NOTE [stream rules] 2: the compute stream waits on the restore's event. The restore's
    # buffer is filled with NaN bytes before its copy back (on the compute stream, behind the
    # sleep), so a reader not ordered after that copy sees NaN. Without the fill the allocator
    # would likely hand the restore h's own freed block, still holding h's bytes, and a
    # missing wait would go unseen.
    manager = OffloadManager(OffloadConfig(min_bytes=0, prefetch=0), device="cuda")
    allocate = manager.engine.allocate
    busy: list[bool] = []  # whether the sleep still ran when each restore was issued

    def poisoned(nbytes: int) -> torch.Tensor:
        busy.append(not torch.cuda.current_stream().query())
        return allocate(nbytes).fill_(0xFF)  # 0xFFFFFFFF: a NaN in float32

    manager.engine.allocate = poisoned  # type: ignore[method-assign]
    x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    h = x * 3
    with manager.window([h]):
        loss = (h * h).sum()
    del h
    torch.cuda.synchronize()
    manager.stats()  # the copy landed: the manager lets go of h, backward must copy it back
    torch.cuda._sleep(200_000_000)  # the compute stream is busy while the restore is issued
    loss.backward()
    assert manager.stats()["reused_bytes"] == 0
    got = x.grad.clone()
    x.grad = None
    h = x * 3
    (h * h).sum().backward()  # the same graph, without offload
    assert torch.equal(got, x.grad)
    assert busy == [True], f"the sleep had ended when the restore was issued: {busy}"


def test_a_prefetch_given_up_on_cuda_lets_go_of_its_buffer_only_after_its_queued_copy() -> None:
    # NOTE [a prefetch that runs out of memory] and stream rule 5: window 2's prefetch copies its
    # first storage back (allocation 3), runs out of memory on its second (4, injected) and lets
    # go of the first's buffer while that copy is still queued (the GPU is held back). Its
    # record_stream on the h2d stream must keep the caching allocator from handing that memory
    # out before the copy ran: probes allocated on the compute stream at window 2's restore on
    # demand (5) never get it. Then the step is eager's, bit for bit.
    torch.manual_seed(0)
    eager = nn.ModuleList(Gated() for _ in range(4)).cuda()
    layers = copy.deepcopy(eager)
    m = OffloadManager(OffloadConfig(min_bytes=0, prefetch=1), device="cuda")
    for layer in layers:
        apply_activation_checkpointing(layer, offload=m)
    x = torch.randn(40, 32, device="cuda", requires_grad=True)
    gates = [torch.rand(40, 32, device="cuda") for _ in range(4)]

    def loss_of(model: nn.ModuleList) -> torch.Tensor:
        h = x
        for layer, gate in zip(model, gates):
            h = layer(h, gate.clone())  # a fresh gate per layer: its own storage
        return h.square().sum()

    loss_of(eager).backward()
    expected = [p.grad for p in eager.parameters()] + [x.grad]
    x.grad = None
    allocate, nbytes = m.engine.allocate, x.untyped_storage().nbytes()
    handed: list[int] = []  # the data_ptr of each allocation, numbered from 1 (0: failed)
    seen: dict[str, Any] = {}

    def allocations(size: int) -> torch.Tensor:
        call = len(handed) + 1
        if call == 4:
            handed.append(0)
            raise torch.OutOfMemoryError("out of memory (injected, allocation 4)")
        if call == 5:  # window 2's restore on demand: allocation 3's buffer was let go
            seen["queued"] = not m.engine.h2d_stream.query()  # its copy back has not run
            probes = [allocate(size) for _ in range(256)]
            seen["reused"] = any(p.data_ptr() == handed[2] for p in probes)
        buffer = allocate(size)
        handed.append(buffer.data_ptr())
        return buffer

    m.engine.allocate = allocations  # type: ignore[method-assign,assignment]
    loss = loss_of(layers)
    torch.cuda.synchronize()
    m.stats()  # every copy to host landed: each window comes back from host, none reused
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the copies back stay queued behind it
    loss.backward()
    torch.cuda.synchronize()
    assert m.events()[:2] == [("restore", 3), ("prefetch_oom", 2)], m.events()
    assert seen == {"queued": True, "reused": False}
    assert len(handed) == 8 + 2  # a copy back per storage, the failed one and the one let go
    assert_same_grads(expected, [p.grad for p in layers.parameters()] + [x.grad])
    stats = m.stats()
    assert stats["prefetch_oom"] == 1 and stats["reused_bytes"] == 0
    assert stats["restored_bytes"] == 8 * nbytes
    del loss
    assert m.stats()["host_buffers_in_use"] == 0
