"""``manager.stats()``, ``events()`` and the "offloaded nothing" warning: each counts what it
says, once."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload import OffloadConfig, OffloadManager
from tests.offload.blocks import manager, offloaded_stack, stack


def manager_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "offload.manager"]


def test_a_small_storage_saved_twice_in_a_window_counts_once_below_the_floor() -> None:
    # Guards against: _pack counts below_min_bytes at every save instead of once per window
    # storage.
    m = manager(min_bytes=1 << 20)
    h = torch.randn(64, requires_grad=True) * 1.0
    with m.window([h]):
        loss = (h * h).sum()  # mul saves h twice
    assert m.stats()["below_min_bytes"] == h.untyped_storage().nbytes()
    loss.backward()


def test_a_storage_on_another_device_saved_twice_in_a_window_counts_once() -> None:
    # Guards against: _other_device drops its ``key in window.small`` early return.
    m = OffloadManager(OffloadConfig(min_bytes=0), device="meta")
    h = torch.randn(64, requires_grad=True) * 1.0
    with m.window([h]):
        loss = (h * h).sum()  # mul saves h twice
    assert m.stats()["other_device_bytes"] == h.untyped_storage().nbytes()
    loss.backward()


def test_a_pass_that_offloads_its_large_storages_is_not_warned_of_for_its_small_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: _Copy does not add to ``pass_.offloaded``; or _check_pass_offloaded drops its
    # ``pass_.offloaded == 0`` condition. Either warns "offloaded nothing" for a working pass.
    m = manager(min_bytes=1024)
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        for _ in range(2):  # the second window opens a new pass: the first is judged there
            big = torch.randn(64, 64, requires_grad=True) * 1.0
            small = torch.randn(8, requires_grad=True) * 1.0
            with m.window([big, small]):
                loss = big.square().sum() + small.square().sum()
            loss.backward()
        stats = m.stats()
    assert stats["offloaded_bytes"] == 2 * big.untyped_storage().nbytes()
    assert stats["below_min_bytes"] == 2 * small.untyped_storage().nbytes()
    assert manager_warnings(caplog) == []


def test_stats_read_in_the_middle_of_a_pass_does_not_make_it_look_like_it_offloaded_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: stats() runs _check_pass_offloaded on a pass still alive, which zeroes its
    # ``offloaded``; the rest of the pass is below the floor, and its end warns falsely.
    m = manager(min_bytes=1024)
    big = torch.randn(64, 64, requires_grad=True) * 1.0
    small = torch.randn(8, requires_grad=True) * 1.0
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        with m.window([big]):
            first = big.square().sum()
        m.stats()  # mid-pass: window 0 is alive
        with m.window([small]):
            second = small.square().sum()
        (first + second).backward()
        m.stats()  # the pass is over: judged
    assert manager_warnings(caplog) == []


def test_stats_read_after_a_first_window_below_the_floor_does_not_warn_before_the_pass_offloads(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: stats() checks the pass of each thread whatever its state, not only one
    # no window of which is alive. Read from a hook between layers, after a first window whose
    # storages were all below the floor, it warned "the last pass offloaded nothing" of a pass
    # that was still running and offloaded its next window.
    m = manager(min_bytes=1024)
    small = torch.randn(8, requires_grad=True) * 1.0
    big = torch.randn(64, 64, requires_grad=True) * 1.0
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        with m.window([small]):
            first = small.square().sum()
        m.stats()  # mid-pass: window 0 is alive, nothing offloaded yet
        with m.window([big]):
            second = big.square().sum()
        (first + second).backward()
        stats = m.stats()  # the pass is over: judged
    assert stats["offloaded_bytes"] == big.untyped_storage().nbytes()
    assert manager_warnings(caplog) == []


def test_stats_reset_starts_pool_hits_from_zero() -> None:
    # Guards against: stats() reports pool.hits without subtracting the value at the last reset.
    m = manager()
    layers = offloaded_stack(m, 3)
    for _ in range(2):  # the second step hits the pool 3 times
        stack(layers, torch.randn(4, 32, requires_grad=True).clone()).sum().backward()
    assert m.stats(reset=True)["pool_hits"] == 3
    stack(layers, torch.randn(4, 32, requires_grad=True).clone()).sum().backward()
    stats = m.stats()
    assert stats["pool_hits"] == 3 and stats["pool_misses"] == 0


def test_layer_inputs_kept_past_the_next_forward_count_as_alive_elsewhere_when_it_opens(
        ) -> None:
    # Guards against: _open does not judge the suspects when it opens a new pass. A grad-enabled
    # evaluation keeps its hidden states until the next step's forward has begun; judged only at
    # that step's backward (or at stats()), they are gone and the copies look useful.
    m = manager()
    layers = offloaded_stack(m, 3)
    kept = []
    h = torch.randn(4, 32, requires_grad=True)
    for layer in layers:
        kept.append(h.detach())  # the storage only, not the graph (as a hidden-states list)
        h = layer(h)
    per = h.untyped_storage().nbytes()
    del h  # the graph is dropped without backward: no window alive, the pass is over
    out = stack(layers, torch.randn(4, 32, requires_grad=True).clone())  # a new pass
    del kept
    out.sum().backward()
    assert m.stats()["alive_elsewhere_bytes"] == 3 * per


@pytest.mark.parametrize("kept_through_stats", [False, True])
def test_a_micro_batch_run_inside_a_backward_is_judged_at_stats_not_at_the_next_unpack(
        kept_through_stats: bool) -> None:
    # Guards against: judging at every unpack (NOTE [verdicts are taken at three points] in
    # liveness.py). A hook in pass A's backward runs pass B's forward, keeps B's layer inputs
    # as detached aliases and drops B's graph; A's backward then only unpacks prefetched
    # windows. The caller lets the aliases go before stats(): not counted (at stats() they are
    # gone; no backward began and no pass opened while they lived). Kept through stats(): B's
    # three inputs are counted, on top of A's first input (the caller's x), counted when A's
    # backward began.
    m = manager()
    layers_a, layers_b = offloaded_stack(m, 4), offloaded_stack(m, 3)
    x = torch.randn(8, 32, requires_grad=True)
    per = x.untyped_storage().nbytes()
    kept: list[torch.Tensor] = []
    h = x
    for i, layer in enumerate(layers_a):
        h = layer(h)
        if i == 1:
            h.register_hook(lambda grad: kept.extend(run_b()))

    def run_b() -> list[torch.Tensor]:
        inputs = []
        with torch.enable_grad():
            hb = torch.randn(8, 32, requires_grad=True)
            for layer in layers_b:
                inputs.append(hb.detach())
                hb = layer(hb)
        return inputs  # hb, B's graph, goes here: B's pass is over

    h.sum().backward()
    assert m.events() == [("restore", 3), ("prefetch", 2), ("prefetch_hit", 2),
                          ("prefetch", 1), ("prefetch_hit", 1), ("prefetch", 0),
                          ("prefetch_hit", 0)]  # no restore after the hook: no verdicts
    if not kept_through_stats:
        kept.clear()
    assert m.stats()["alive_elsewhere_bytes"] == (4 if kept_through_stats else 1) * per


def test_a_window_saved_several_times_counts_one_prefetch_hit() -> None:
    # Guards against: _unpack no longer discards the window from ``prefetched`` at its first
    # unpack, so every later unpack of a prefetched window counts (and logs) another hit.
    m = manager(prefetch=1)
    x = torch.randn(16, 32, requires_grad=True)
    h = x * 1.0
    for _ in range(4):
        with m.window([h]):
            h = torch.tanh(h * h)  # mul saves h twice: two handles per window
    h.sum().backward()
    assert m.events() == [("restore", 3), ("prefetch", 2), ("prefetch_hit", 2),
                          ("prefetch", 1), ("prefetch_hit", 1), ("prefetch", 0),
                          ("prefetch_hit", 0)]
    assert m.stats()["prefetch_hits"] == 3


def test_stats_read_between_layers_does_not_count_a_table_every_layer_gets_as_alive_elsewhere(
        ) -> None:
    # Guards against: stats() judging the storages let go while a forward still runs. A table
    # made in forward and passed to every layer (RoPE, cu_seqlens) is let go after the first
    # layers; a stats() from a logging hook between layers found it alive (the forward uses
    # it) and counted it as kept by something else, though it is gone when backward begins.
    from torch import nn

    import pytree_ckpt

    class TableLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return h + torch.tanh(self.proj(h) * table)

    m = manager()
    layers = nn.ModuleList(TableLayer() for _ in range(4))
    pytree_ckpt.checkpoint_layers(layers, offload=m)
    h = torch.randn(8, 32, requires_grad=True) * 1.0
    table = torch.randn(8, 32)  # made in forward, only the forward holds it
    for i, layer in enumerate(layers):
        h = layer(h, table)
        if i == 2:
            m.stats()  # a logging hook between layers
    del table
    h.sum().backward()
    assert m.stats()["alive_elsewhere_bytes"] == 0


def test_a_short_batch_after_passes_that_offloaded_is_not_warned_of_but_a_first_one_is(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: the "offloaded nothing ... or turn offload off" warning at the first short
    # batch of variable-length training, whose long batches offload (the setting is right).
    def step(m: OffloadManager, rows: int) -> None:
        h = torch.randn(rows, 64, requires_grad=True) * 1.0
        with m.window([h]):
            loss = h.square().sum()
        loss.backward()

    long_first = manager(min_bytes=16 * 64 * 4)
    short_first = manager(min_bytes=16 * 64 * 4)
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        for rows in (32, 4, 32, 4):
            step(long_first, rows)
        long_first.stats()
        assert manager_warnings(caplog) == []
        for rows in (4, 32):
            step(short_first, rows)
        short_first.stats()
    assert len(manager_warnings(caplog)) == 1
    assert "min_bytes=4096" in manager_warnings(caplog)[0]
    assert long_first.stats()["offloaded_bytes"] == 2 * 32 * 64 * 4


def test_a_log_handler_reading_stats_while_storages_are_judged_loses_no_copy_of_a_storage(
        ) -> None:
    # Guards against: judge_all's merge of an entry let go again meanwhile (``elif key in
    # self.suspects``) dropped, or replaced by an overwrite. Every caller holds the manager's
    # lock, so only a re-entry on the judging thread reaches it: here a logging handler on the
    # "still alive elsewhere" debug line reads stats(), which lets go of a second copy of a
    # storage (changed in place between two windows of a worker's pass, still running) while
    # the outer loop has yet to put the first copy's entry back. Overwritten, that copy's bytes
    # were never counted: 512 + 256, not 512 + 2 * 256.
    m = manager()
    w = torch.randn(16, requires_grad=True)
    x = torch.randn(8, 16)  # the main thread's window storage, kept by the caller
    s = torch.randn(4, 16)  # the worker's, copied twice in one pass
    with m.window([x]):
        loss = (x * w).sum()
    m.stats()  # lets go of x's copy while its pass is alive: judged later, first in line
    held: list[torch.Tensor] = []

    def worker() -> None:  # run alone: its pass is still running (graphs alive) once it ends
        with m.window([s]):
            first = s * w
        s.add_(1)  # a new version: the next window copies s again
        with m.window([s]):  # lets go of the first copy; the second stays in flight
            second = s * w
        held.extend([first, second])

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert len(held) == 2
    del loss  # the main thread's pass is over

    class ReadStats(logging.Handler):
        calls = 0

        def emit(self, record: logging.LogRecord) -> None:
            ReadStats.calls += 1
            if ReadStats.calls == 1:
                m.stats()

    handler = ReadStats(logging.DEBUG)
    log = logging.getLogger("offload.manager")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with m.window([torch.randn(2)]):  # a new pass on this thread: x judged, then s's entry
            pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert ReadStats.calls == 1  # x's verdict only: s's pass had not ended
    assert m.stats()["alive_elsewhere_bytes"] == x.untyped_storage().nbytes()
    held.clear()  # the worker's pass is over: both copies of s saved nothing
    assert m.stats()["alive_elsewhere_bytes"] == (x.untyped_storage().nbytes()
                                                  + 2 * s.untyped_storage().nbytes())


def test_the_offloaded_nothing_warning_names_the_largest_storage_below_the_floor(
        caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: Pass.largest_small keeping the first or the last storage below min_bytes
    # rather than the largest (every other test's storages were of one size). The warning tells
    # how far to lower min_bytes: the largest of the pass, here in the middle window and the
    # second storage of it, with smaller ones before and after.
    m = manager(min_bytes=1 << 20)
    sizes = [[16], [8, 64], [32]]  # rows of width 32 (float32): 2 KiB, 1 KiB + 8 KiB, 4 KiB
    with caplog.at_level(logging.WARNING, logger="offload.manager"):
        losses = []
        for rows in sizes:
            tensors = [torch.randn(n, 32, requires_grad=True) * 1.0 for n in rows]
            with m.window(tensors):
                losses.append(sum(t.square().sum() for t in tensors))
        sum(losses).backward()
        stats = m.stats()
    assert stats["below_min_bytes"] == sum(n for rows in sizes for n in rows) * 32 * 4
    assert stats["offloaded_bytes"] == 0
    warnings = manager_warnings(caplog)
    assert len(warnings) == 1 and f"(the largest had {64 * 32 * 4} bytes)" in warnings[0]


def test_every_reused_storage_the_caller_keeps_counts_as_alive_elsewhere_at_the_first_read(
        ) -> None:
    # Guards against: count_late taking out only one verdict counted late, or storing one
    # instead of adding it. Two storages of one window, reused at backward's turn (NOTE [reuse
    # at the turn]) and kept by the caller, are judged by their copies' __del__ (NOTE [counted
    # late]): both must be in the first stats() after backward, added to each other.
    m = manager()
    a = torch.randn(16, 32, requires_grad=True) * 1.0
    b = torch.randn(8, 32, requires_grad=True) * 1.0
    with m.window([a, b]):
        loss = (a[:8] * b).sum() + a.square().sum()
    loss.backward()
    both = a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    stats = m.stats()
    assert stats["reused_bytes"] == both  # judged late, not when backward began
    assert stats["alive_elsewhere_bytes"] == both


def test_a_view_on_another_device_counts_its_whole_storage_as_the_size_floor_does() -> None:
    # Guards against: _other_device counting the saved view's bytes (``tensor.nbytes``) rather
    # than its storage's. docs/offload.md: other_device_bytes are "bytes of window storages";
    # below_min_bytes counts whole storages too (a view is held to the floor by its storage).
    m = OffloadManager(OffloadConfig(min_bytes=0), device="meta")
    h = torch.randn(64, 64, requires_grad=True) * 1.0
    with m.window([h]):
        loss = h[:8].square().sum()  # square saves the view h[:8]: 8 rows of a 64-row storage
    assert m.stats()["other_device_bytes"] == h.untyped_storage().nbytes() == 64 * 64 * 4
    loss.backward()


@pytest.mark.xfail(strict=True, reason="documented limit (docs/offload.md, the "
                   "alive_elsewhere_bytes row): a window storage only an autograd save outside "
                   "the layers holds, freed by that op's backward before backward's first "
                   "restore (an encoder output read by a CTC head after the decoder, the "
                   "caller's variable gone), is judged too late to count (helper FE)")
def test_an_encoder_output_a_head_saves_after_the_decoder_counts_as_alive_elsewhere() -> None:
    # docs/census.md, Flags: a storage autograd also saves "keeps it resident whatever the
    # offload does (the manager counts it in alive_elsewhere_bytes)". A Whisper-style model
    # whose CTC head reads the encoder output after the decoder layers: the head's Linear
    # saves it, so the offloaded copy frees nothing, yet the count stays 0 once the forward's
    # local `enc` is gone (kept by the caller, it counts: 8192).
    from torch import nn

    import pytree_ckpt

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, y: torch.Tensor, enc: torch.Tensor | None = None) -> torch.Tensor:
            return y + torch.tanh(self.lin(enc if enc is not None else y))

    torch.manual_seed(0)
    m = manager(min_bytes=0)
    layers = nn.ModuleList(Layer() for _ in range(3))
    for layer in layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=m)
    head = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def forward() -> torch.Tensor:
        enc = x * 3                                       # the encoder output
        y = layers[0](x * 2, enc)                         # cross-attention reads it
        for layer in layers[1:]:
            y = layer(y)
        return y.sum() + head(enc).sum()                  # CTC head after the decoder

    loss = forward()
    loss.backward()
    assert m.stats()["alive_elsewhere_bytes"] == 32 * 64 * 4


def test_stats_read_after_a_forward_lets_go_of_the_last_windows_device_tensors() -> None:
    # Guards against: stats() letting go only of copies of passes gone (``everyone=False``):
    # the last windows' device tensors, whose copies to host are done, stayed held until the
    # next window or backward.
    m = manager()
    x = torch.randn(64, 16, requires_grad=True)
    h = x * 1.0
    held = StorageWeakRef(h.untyped_storage())
    with m.window([h]):
        out = (h * h).sum()
    del h
    assert not held.expired()  # the manager holds it, one window late
    m.stats()
    assert held.expired()
    out.backward()


def test_stats_counts_every_window_opened_once() -> None:
    # Guards against: _open not counting the windows it opens (stats()["windows"]).
    m = manager()
    layers = offloaded_stack(m, 3)
    stack(layers, torch.randn(4, 32, requires_grad=True).clone()).sum().backward()
    assert m.stats(reset=True)["windows"] == len(layers)
    stack(layers, torch.randn(4, 32, requires_grad=True).clone()).sum().backward()
    assert m.stats()["windows"] == len(layers)


@pytest.mark.parametrize("kept", ["none", "all", "one"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_alive_elsewhere_counts_exactly_the_layer_inputs_the_caller_keeps(kept: str,
                                                                            prefetch: int) -> None:
    # helper PV: counted by hand; the last window's bytes are reused at the turn either way.
    m = manager(prefetch=prefetch)
    layers = offloaded_stack(m, 4)
    x = torch.randn(8, 32, requires_grad=True)
    inputs = [x * 1.0]
    for layer in layers:
        inputs.append(layer(inputs[-1]))
    out = inputs.pop()
    held = {"none": [], "all": inputs, "one": inputs[2:3]}[kept]
    del inputs
    out.sum().backward()
    stats = m.stats()
    assert stats["alive_elsewhere_bytes"] == len(held) * 8 * 32 * 4
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 4 * 8 * 32 * 4
    assert stats["reused_bytes"] == 8 * 32 * 4


def test_layers_given_chunks_of_one_storage_copy_it_once_and_give_eager_gradients() -> None:
    # helper PV: four windows on one storage (a batch split into micro-chunks) share one copy.
    from torch import nn

    from tests.offload.blocks import Layer
    m = manager(prefetch=1)
    layers = offloaded_stack(m, 4)
    eager = nn.ModuleList(Layer() for _ in range(4))
    eager.load_state_dict(layers.state_dict())
    x = torch.randn(32, 32, requires_grad=True)

    def run(stack_: nn.ModuleList, leaf: torch.Tensor) -> None:
        chunks = (leaf * 1.0).chunk(4)
        loss = torch.cat([layer(c) for layer, c in zip(stack_, chunks)]).sum()
        del chunks  # held through backward, the storage would count as alive elsewhere
        loss.backward()

    run(layers, x)
    got = [x.grad, *(p.grad for p in layers.parameters())]
    x.grad = None
    run(eager, x)
    assert all(torch.equal(a, b) for a, b in
               zip([x.grad, *(p.grad for p in eager.parameters())], got))
    stats = m.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 32 * 32 * 4
    assert stats["alive_elsewhere_bytes"] == 0 and stats["host_buffers_in_use"] == 0


@pytest.mark.parametrize("alias", ["detach", "data"])
def test_a_detached_alias_saved_beside_its_tensor_counts_nothing_alive_elsewhere(
        alias: str) -> None:
    # A stop-gradient branch beside the main one (a linear probe on detached features, a
    # VQ-VAE commitment term): ``h`` and ``h.detach()`` are saved in one window, two copies of
    # one storage (docs: an alias with a counter that cannot be told from another gets a copy
    # of its own). The caller drops ``h``: nothing but the graph holds the storage, and the
    # gradients are eager's. At backward's first restore the window's newest copy (the alias's)
    # reuses the device bytes; the older one (``h``'s), not listed in ``window.copies``, is
    # let go, its storage (held by the sibling's reuse) judged alive elsewhere: 512 bytes
    # reported as "something else holds them, the copy saved nothing", and copied back from
    # host though on the device.
    m = manager()
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    w2 = torch.randn(8, 16, requires_grad=True)
    h = x * 1.0
    with m.window([h]):
        other = h.detach() if alias == "detach" else h.data
        loss = (h * w).sum() + (other * w2).sum()
    del h, other
    loss.backward()
    assert torch.equal(w.grad, x.detach()) and torch.equal(w2.grad, x.detach())
    stats = m.stats()
    assert stats["offloaded_bytes"] == 2 * 8 * 16 * 4  # one copy each, as documented
    assert stats["alive_elsewhere_bytes"] == 0


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("where", [0, 1])  # which of two windows saves the alias beside h
@pytest.mark.parametrize("retain", [False, True])
def test_a_detached_alias_in_one_of_two_windows_counts_by_hand_and_gives_eager_gradients(
        prefetch: int, kept: bool, where: int, retain: bool) -> None:
    # helper PX, counted by hand: window ``where`` saves h and h.detach() (two copies of one
    # storage), the other window its own h (one copy). The last window's copies are reused at
    # the turn; alive elsewhere is every copy whose storage the caller still holds (each copy
    # counts its bytes, as offloaded_bytes does). A retained graph's second backward restores
    # nothing more. Every host buffer goes back.
    size = 8 * 16 * 4
    m = manager(prefetch=prefetch)
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    ws = [torch.randn(8, 16, requires_grad=True) for _ in range(4)]

    def run(window: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        held, h = [], x * 1.0
        for i in range(2):
            with window([h]):
                t = (h * ws[2 * i]).sum()
                if i == where:
                    t = t + (h.detach() * ws[2 * i + 1]).sum()
                nxt = h * 2.0 + t
            if kept:
                held.append(h)
            h = nxt
        return h.sum(), held

    loss, held = run(lambda _: contextlib.nullcontext())
    loss.backward()
    eager = [w.grad.clone() for w in ws if w.grad is not None] + [x.grad.clone()]
    for t in (*ws, x):
        t.grad = None
    del loss, held
    loss, held = run(m.window)
    loss.backward(retain_graph=retain)
    if retain:
        for t in (*ws, x):
            t.grad = None
        loss.backward()
    ours = [w.grad for w in ws if w.grad is not None] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(eager, ours, strict=True))
    stats = m.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 3 * size
    assert stats["reused_bytes"] == (2 if where == 1 else 1) * size
    assert stats["alive_elsewhere_bytes"] == (3 * size if kept else 0)
    del loss, held
    assert m.stats()["host_buffers_in_use"] == 0
