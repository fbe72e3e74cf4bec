"""What a census leaves behind, and which thread it records: it ends as it began."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import ActivationCensus, CheckpointError, checkpoint_layers

from tests.conftest import interrupted_at
from tests.pytree_ckpt.models import NormedLayer


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


def test_censuses_ended_out_of_order_are_refused_and_leave_none_active() -> None:
    # Ended before one entered after it (by hand, or an ExitStack unwound out of order), the
    # first reset the active census to none while the second was open; the second's end then
    # set it back to the first, long ended, which went on recording every boundary of every
    # later step (growing its records). Refused instead: the open one must end first.
    layers = _layers()
    first, second = ActivationCensus(layers), ActivationCensus(layers)
    first.__enter__()
    second.__enter__()
    with pytest.raises(CheckpointError, match="(?s)entered after it is still open.*tip"):
        first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    first.__exit__(None, None, None)
    assert pytree_ckpt.census.active_census() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.randn(16, 64)
    layers(x).sum().backward()  # a later step: neither records it
    assert first.total_bytes == second.total_bytes == 0
    assert len(first._entries) == len(second._entries) == 0


def test_a_census_ended_in_another_context_is_refused_and_can_still_end_in_its_own() -> None:
    census = ActivationCensus(_layers())
    context = contextvars.copy_context()
    context.run(census.__enter__)
    with pytest.raises(CheckpointError, match="(?s)its end in another thread or context.*tip"):
        census.__exit__(None, None, None)
    context.run(census.__exit__, None, None, None)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert context.run(pytree_ckpt.census.active_census) is None


def test_a_census_ended_in_another_thread_is_refused_and_keeps_recording_in_its_own() -> None:
    # A thread run in a copy of the census's context saw it as the one to end: its end went
    # as far as resetting the ContextVar, which raised a ValueError (the token belongs to
    # another context) after the census was already marked as ended. Refused instead,
    # before anything changes: it records on, and ends in its own thread.
    model = nn.Linear(64, 64)
    census = ActivationCensus(model).__enter__()
    errors: list[BaseException] = []

    def end() -> None:
        try:
            census.__exit__(None, None, None)
        except BaseException as error:  # noqa: BLE001 - checked below
            errors.append(error)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(end,))
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError)
    assert "its end in another thread or context" in str(errors[0]) and "tip" in str(errors[0])
    x = torch.randn(16, 64)
    loss = model(x).sum()  # still recorded: the Linear saves x
    census.__exit__(None, None, None)
    assert census.bytes_by("module") == {"<root>": nbytes(x)}
    assert pytree_ckpt.census.active_census() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss.backward()


def test_a_census_ended_in_a_copy_of_its_context_on_its_thread_is_refused_before_anything_changes(
) -> None:
    # Guards against: in a copy of the census's own context (contextvars.copy_context().run,
    # on the thread that entered it) the census looks like the one to end, so the end went as
    # far as resetting the ContextVar, which raised a ValueError (the token belongs to another
    # context) after the census was already marked as ended: its saved-tensor hooks stayed
    # pushed and it went on recording until a second end. Refused instead, before anything
    # changes: it records on, and ends in its own context.
    model = nn.Linear(64, 64)
    census = ActivationCensus(model).__enter__()
    with pytest.raises(CheckpointError, match="(?s)its end in another thread or context.*tip"):
        contextvars.copy_context().run(census.__exit__, None, None, None)
    assert not census._ended and pytree_ckpt.census.active_census() is census
    x = torch.randn(16, 64)
    loss = model(x).sum()  # still recorded: the Linear saves x
    census.__exit__(None, None, None)
    assert census.bytes_by("module") == {"<root>": nbytes(x)}
    assert pytree_ckpt.census.active_census() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert pytree_ckpt.census_threads._OPEN == [0]
    loss.backward()


def test_a_census_ended_twice_is_refused_and_leaves_the_open_one_recording() -> None:
    # A second end of a census went on to reset its spent ContextVar token, which raised a
    # bare RuntimeError ("has already been used once"), outside the CheckpointError family.
    # Refused as a second __enter__ is, before anything changes: the census open since keeps
    # recording, and the count of open censuses stays in step.
    model = nn.Linear(64, 64)
    first = ActivationCensus(model)
    with first:
        pass
    with ActivationCensus(model) as second:
        with pytest.raises(CheckpointError, match="(?s)cannot be ended twice.*tip"):
            first.__exit__(None, None, None)
        assert pytree_ckpt.census.active_census() is second
        assert pytree_ckpt.census_threads._OPEN == [1]
        x = torch.randn(16, 64)
        loss = model(x).sum()  # recorded by the open census only: the Linear saves x
    assert second.bytes_by("module") == {"<root>": nbytes(x)}
    assert first.total_bytes == 0
    assert pytree_ckpt.census_threads._OPEN == [0]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss.backward()


def test_censuses_of_two_interleaved_contexts_on_one_thread_end_only_in_reverse_order() -> None:
    # Coroutines on one thread (asyncio tasks, each in a context of its own) enter censuses in
    # one order and may end them in another. The first one entered is the one entered last in
    # its own context, but not on the thread, where the other records (its saved-tensor hooks
    # are on top): its end must be refused before anything changes (docs/census.md, Limits).
    # Let through, it erased the thread's record of the census recording (the other one's
    # reports went nowhere) and popped the other's saved-tensor hooks.
    model = nn.Linear(64, 64)
    first_context, second_context = contextvars.copy_context(), contextvars.copy_context()
    first = first_context.run(ActivationCensus(model).__enter__)
    second = second_context.run(ActivationCensus(model).__enter__)
    with pytest.raises(CheckpointError, match="(?s)a census entered after it is still open"):
        first_context.run(first.__exit__, None, None, None)
    assert not first._ended and pytree_ckpt.census.active_census() is second
    x = torch.randn(16, 64)
    loss = model(x).sum()  # recorded by both: the Linear saves x
    second_context.run(second.__exit__, None, None, None)
    first_context.run(first.__exit__, None, None, None)
    assert first.bytes_by("module") == second.bytes_by("module") == {"<root>": nbytes(x)}
    assert pytree_ckpt.census.active_census() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert pytree_ckpt.census_threads._OPEN == [0]
    loss.backward()


def _module_state_alive(census: ActivationCensus) -> int:
    return sum(1 for e in census._recorded()
               if e.mechanism is pytree_ckpt.Mechanism.MODULE_STATE and not e.storage.expired())


def _normed_twins_after_a_first_step() -> tuple[nn.Sequential, nn.Sequential]:
    """An eager NormedLayer and its checkpointed twin, after a first training step (the forward
    changes state, the replay verifies)."""
    torch.manual_seed(0)
    eager = nn.Sequential(NormedLayer())
    model = nn.Sequential(NormedLayer())
    model.load_state_dict(eager.state_dict())
    checkpoint_layers(model, offload=False)
    for m in (eager, model):
        m.train()
        m(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
        m.zero_grad()
    return eager, model


def test_buffer_snapshots_kept_for_the_replay_count_as_module_state_until_backward() -> None:
    # NOTE [state read, then changed by a later call]: once its forward changed state, each
    # call clones the layer's small buffers and keeps them to its replay, those it changed
    # (a train micro-batch: the BatchNorm's three) and those it only read (the eval one: all
    # four, and `scale` at both). The census counted none of these bytes, and after backward
    # they stayed alive as long as the losses did (the graph's nodes held the calls).
    eager, model = _normed_twins_after_a_first_step()
    x1, x2 = torch.randn(8, 16), torch.randn(8, 16)
    state = sum(nbytes(b) for b in model.buffers())  # 64 + 64 + 8 + 64: one clone each
    with ActivationCensus(model) as census:
        model.eval()
        first = model(x1).sum()
        assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x1),
                                                "module state": state}
        model.train()
        second = model(x2).sum()
        assert census.bytes_by("mechanism") == {"checkpoint boundary": 2 * nbytes(x1),
                                                "module state": 2 * state}
        assert census.total_bytes == 2 * nbytes(x1) + 2 * state
        (first + second).backward()
        assert census.total_bytes == 0
        assert _module_state_alive(census) == 0  # freed, while the losses are still alive
    eager.eval()  # on clones: plain eager's backward would read the train call's statistics
    clones = {name: b.clone() for name, b in eager.named_buffers()}
    eager_first = torch.func.functional_call(eager, clones, (x1,)).sum()
    eager.train()
    (eager_first + eager(x2).sum()).backward()
    assert torch.equal(first, eager_first)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name


def test_buffer_snapshots_kept_for_a_kept_replay_are_freed_by_the_weight_pass() -> None:
    # Guards against: _from_kept (recompute.py) leaving call.changed_state set after the last
    # pass through a kept replay's graph (a weight pass without retain_graph): the buffer
    # snapshots the call keeps to its replay (NOTE [state read, then changed by a later
    # call]) then stayed alive, counted as module state, as long as the loss did, where the
    # full backward frees them (test above).
    eager, model = _normed_twins_after_a_first_step()
    x = torch.randn(8, 16, requires_grad=True)
    state = sum(nbytes(b) for b in model.buffers())
    grads = []
    for m in (eager, model):
        with ActivationCensus(m) as census:
            loss = m(x).square().sum()
            (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
            if m is model:  # the input pass keeps the replay, and the snapshots with it
                assert census.bytes_by("mechanism")["module state"] == state
            dw = torch.autograd.grad(loss, list(m.parameters()))
            if m is model:
                assert census.total_bytes == 0
                assert _module_state_alive(census) == 0  # freed, while the loss is alive
        grads.append([dx, *dw])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for (name, a), b in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name


def test_a_fake_quant_layer_s_clones_count_as_module_state_at_every_step() -> None:
    # NOTE [state a kernel writes] (kernel_written.py): the fused fake-quant kernel writes its
    # observer's buffers with no version moving; the module then clones its small buffers
    # before every forward, and the call keeps them (counted as changed wholly) to its replay.
    fake_quant = torch.ao.quantization.FusedMovingAvgObsFakeQuantize()
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), fake_quant))
    checkpoint_layers(model, offload=False)
    state = sum(nbytes(b) for b in fake_quant.buffers())  # seven one-element buffers: 36
    with ActivationCensus(model) as census:
        for _ in range(2):
            x = torch.randn(8, 16)
            loss = model(x).sum()
            assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x),
                                                    "module state": state}
            loss.backward()
            assert census.total_bytes == 0
            assert _module_state_alive(census) == 0


def test_an_output_discard_s_buffer_snapshots_count_as_module_state_until_its_rebuild() -> None:
    # An output discard clones its module's small buffers before every call and keeps those
    # of the changed ones (a BatchNorm in training: all three) to its rebuild: uncounted, and
    # alive after backward as long as the discard object was.
    torch.manual_seed(0)
    eager_norm, norm, proj = nn.BatchNorm1d(64), nn.BatchNorm1d(64), nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    state = sum(nbytes(b) for b in norm.buffers())  # 256 + 256 + 8
    with ActivationCensus(nn.ModuleList([norm, proj])) as census:
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        out = proj(ckpt.checkpoint(norm, x))
        ckpt.discard_output_and_register_recompute(out)
        assert census.bytes_by("mechanism") == {"autograd": nbytes(x), "module state": state}
        out.sum().backward()
        assert census.total_bytes == 0
        assert _module_state_alive(census) == 0  # freed, while the discard is still alive
    grad = x.grad
    x.grad = None
    expected = proj(eager_norm(x))
    proj.zero_grad()
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(grad, x.grad)
    for (name, a), b in zip(norm.named_buffers(), eager_norm.buffers()):
        assert torch.equal(a, b), name


class AccumulatesIntoALargeTable(nn.Module):
    """A step counter (8 bytes) and a table 4 bytes over the small size (64 KiB), both
    changed in place by every forward; the output reads neither."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.zeros(16 * 1024 + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps += 1
            self.table[: x.shape[0]] += x.sum(-1)
        return self.lin(x)


def test_a_buffer_over_the_small_size_is_not_cloned_before_the_forward() -> None:
    # Guards against: the small-size limit of NOTE [small state as it was before the forward]
    # (64 KiB a buffer) raised or dropped: every call of a stateful layer would clone its
    # large buffers (a KV cache, a big table) before its forward and keep them to its replay,
    # memory the docs promise it does not take. Only the counter's 8 bytes are kept; the
    # table's copy for the replay is made from what the forward left, and ends as eager's.
    layer = _three_steps_counting_module_state(AccumulatesIntoALargeTable,
                                               lambda m: nbytes(m.steps))
    assert nbytes(layer.table) == 64 * 1024 + 4


def _three_steps_counting_module_state(make: Callable[[], nn.Module],
                                       state: Callable[[nn.Module], int]) -> nn.Module:
    """Three steps of ``make()``'s layer, checkpointed, against an eager twin: the census counts
    the input, the loss's saved output and ``state(layer)`` bytes of module state; gradients
    and buffers end each step as eager's. Returns the checkpointed layer."""
    torch.manual_seed(0)
    eager = make()
    model = nn.Sequential(make())
    model.load_state_dict({f"0.{k}": v for k, v in eager.state_dict().items()})
    checkpoint_layers(model, offload=False)
    layer = model[0]
    for step in range(3):
        x = torch.randn(8, 16, requires_grad=True)
        with ActivationCensus(model) as census:
            loss = model(x).square().sum()
            # the loss's square saves the layer's output (as large as x)
            assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x),
                                                    "autograd": nbytes(x),
                                                    "module state": state(layer)}, step
            loss.backward()
        grads = [x.grad, *(p.grad for p in layer.parameters())]
        x.grad = None
        eager.zero_grad()
        eager(x).square().sum().backward()
        for a, b in zip(grads, [x.grad, *(p.grad for p in eager.parameters())]):
            assert torch.equal(a, b), step
        model.zero_grad()
        for (name, a), b in zip(layer.named_buffers(), eager.buffers()):
            assert torch.equal(a, b), (step, name)
    return layer


class CountsIntoAWindow(nn.Module):
    """A buffer of 4 floats that is a view of a storage over the small size (64 KiB): saved
    alone before the forward, its values resolved. Every forward adds into it in place and
    the output reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("window", torch.zeros(16 * 1024 + 1)[:4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.window += x[:4].sum(-1)
        return self.lin(x) * self.window.sum()


def test_a_small_buffer_viewing_a_large_storage_counts_as_module_state() -> None:
    # Guards against: ChangedState.snapshots() listing only the saved storages, not the
    # buffers saved alone (a small view of a large storage): the census left their bytes,
    # kept from the forward to the replay, out of Mechanism.MODULE_STATE. The replay reads the
    # window as the forward did: gradients and buffers end each step as eager's.
    layer = _three_steps_counting_module_state(CountsIntoAWindow, lambda m: 4 * 4)
    assert layer.window.untyped_storage().nbytes() == 64 * 1024 + 4


class CountsInAPlainTensor(nn.Module):
    """A count kept as a small plain tensor attribute (not a buffer), changed in place by
    every forward, which scales the output with it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.steps = torch.zeros(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps += 1
        return self.lin(x) * (1 + 0.125 * self.steps.sum())


def test_a_plain_tensor_count_changed_in_place_counts_its_copy_as_module_state() -> None:
    # NOTE [small tensor attributes as the forward read them]: the copy of the count's values
    # as the forward read them is held from the forward to the replay, which reads it: the
    # census counts its bytes as module state (they were left out), and the gradients and
    # the count end each step as eager's.
    layer = _three_steps_counting_module_state(CountsInAPlainTensor, lambda m: 2 * 4)
    assert layer.steps.tolist() == [3.0, 3.0]


class ReplacesAPlainTensor(nn.Module):
    """A count kept as a small plain tensor attribute (not a buffer) that every forward
    replaces with a new tensor (not in place), and scales the output with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.steps = torch.zeros(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (1 + 0.125 * self.steps.sum())
        self.steps = self.steps + 1
        return out


def test_a_plain_tensor_the_forward_replaces_counts_the_one_held_for_the_replay() -> None:
    # Mutant M48 (helper FH): ChangedNumbers.snapshots leaving out the small tensor attribute
    # held from the forward to its replay (the one the forward replaced) counted no module
    # state; the gradients and the count end each step as eager's either way.
    layer = _three_steps_counting_module_state(ReplacesAPlainTensor, lambda m: 2 * 4)
    assert layer.steps.tolist() == [3.0, 3.0]


class ReplacesAPlainTensorPair(nn.Module):
    """As ReplacesAPlainTensor, the count kept in a (count, count) tuple (TupleHeld)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.steps = (torch.zeros(2), torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (1 + 0.125 * self.steps[0].sum())
        self.steps = (self.steps[0] + 1, self.steps[1] + 1)
        return out


def test_a_plain_tensor_pair_the_forward_replaces_counts_both_held_for_the_replay() -> None:
    # The tuple held from the forward to its replay (helper MV's pair) counts both tensors.
    layer = _three_steps_counting_module_state(ReplacesAPlainTensorPair, lambda m: 3 * 4)
    assert layer.steps[0].tolist() == [3.0, 3.0]


def test_a_census_interrupted_while_it_enters_leaves_nothing_recording_and_can_enter_again(
        ) -> None:
    # Guards against an interrupt inside __enter__ (NOTE [an entry undone], census.py): after
    # the pack hook was pushed, only the module hooks were removed, and every later save of the
    # thread went on into a census never ended (and _OPEN stayed counted). Each run interrupts
    # one more call than the last.
    layers = _layers()
    x = torch.randn(16, 64)
    with ActivationCensus(layers) as whole:
        layers(x).sum().backward()
    hooks_before = (len(nn.modules.module._global_forward_pre_hooks),
                    len(nn.modules.module._global_forward_hooks))
    index = 0
    while True:
        census = ActivationCensus(layers)
        if not interrupted_at([pytree_ckpt.census.__file__, pytree_ckpt.census_threads.__file__],
                              index, census.__enter__):
            census.__exit__(None, None, None)
            break
        index += 1
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert pytree_ckpt.census.active_census() is None
        assert pytree_ckpt.census_threads._ACTIVE.get() is None  # the census to end next
        assert pytree_ckpt.census_threads._OPEN == [0]
        assert (len(nn.modules.module._global_forward_pre_hooks),
                len(nn.modules.module._global_forward_hooks)) == hooks_before
        layers(x).sum().backward()  # a step between: the interrupted census records nothing
        assert census.total_bytes == 0
        with census:  # entered again, it records as one never interrupted
            layers(x).sum().backward()
        assert census.to_dict() == whole.to_dict()
    assert index >= 8  # the interrupts reached the hooks, the count and the context variable


def test_a_census_interrupted_twice_while_it_enters_inside_another_leaves_the_outer_as_it_was(
        ) -> None:
    # Mutation round MO on NOTE [an entry undone]: the tests above enter with no census around
    # and interrupt once. Inside an outer census, the undo must leave the outer recording, the
    # outer's pack hook on top (not pop it as if it were the census's own), the context variable
    # at the outer (not None) and _OPEN at one; a second interrupt, earlier, of the same census
    # must undo no count and reset no token twice.
    layers = _layers()
    x = torch.randn(16, 64)
    files = [pytree_ckpt.census.__file__, pytree_ckpt.census_threads.__file__]
    with ActivationCensus(layers) as whole:
        layers(x).sum().backward()
    index = 0
    with ActivationCensus() as outer:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        while True:
            census = ActivationCensus(layers)
            if not interrupted_at(files, index, census.__enter__):
                census.__exit__(None, None, None)
                break
            index += 1
            for again in (0, 1, 2):  # the same census, interrupted before its count
                assert interrupted_at(files, again, census.__enter__)
                assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
                assert pytree_ckpt.census.active_census() is outer
                assert pytree_ckpt.census_threads._ACTIVE.get() is outer
                assert pytree_ckpt.census_threads._OPEN == [1]
            with census:
                layers(x).sum().backward()
            assert census.to_dict() == whole.to_dict()
    assert index >= 8
    assert pytree_ckpt.census_threads._OPEN == [0]



def test_a_census_interrupted_inside_torchs_hook_entry_leaves_the_outer_hooks_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Mutation round MO (NOTE [an entry undone]: the undo popped the top hooks without checking
    # they were the census's own): an interrupt inside saved_tensors_hooks.__enter__, before
    # its push (a Ctrl-C in torch's Python code), left the census's hooks unpushed, and the
    # undo popped the user's outer hooks instead (the step then ran without them).
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt("Ctrl-C")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with monkeypatch.context() as patch:
            patch.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__", interrupted)
            with pytest.raises(KeyboardInterrupt):
                ActivationCensus().__enter__()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
        assert pytree_ckpt.census_threads._OPEN == [0]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class ReplacesANestedTensorTuple(nn.Module):
    """As ReplacesAPlainTensorPair, the counts kept in a nested tuple ((count, count), count,
    a flag): tuple_tensors opens nested tuples (helper NG)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.steps = ((torch.zeros(2), torch.zeros(1)), torch.zeros(3), "flag")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (a, b), c, flag = self.steps
        out = self.lin(x) * (1 + 0.125 * a.sum() + 0.0625 * c.sum())
        self.steps = ((a + 1, b + 1), c + 1, flag)
        return out


def test_a_nested_tensor_tuple_the_forward_replaces_counts_all_its_tensors_held() -> None:
    # Guards against tuple_tensors (which replaced TupleHeld(...).tensors() in 7f9ee07) listing
    # only a tuple's top-level tensors: the nested pair's are held with it, as census.md's
    # module state row says.
    layer = _three_steps_counting_module_state(ReplacesANestedTensorTuple, lambda m: 6 * 4)
    assert layer.steps[1].tolist() == [3.0, 3.0, 3.0]


class RebindsATupleFromItsSecondStep(nn.Module):
    """A (count, count) tuple the forward first replaces at the second step, after the
    module's first replay (the glance: NOTE [a number first changed after the first
    replay]); the output reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.steps = (torch.zeros(2), torch.zeros(1))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (1 + 0.125 * self.steps[0].sum())
        if self.step:
            self.steps = (self.steps[0] + 1, self.steps[1] + 1)
        return out


def test_a_tuple_first_replaced_after_the_first_replay_gives_eager_gradients_in_micro_batches(
        ) -> None:
    # The glance path (NumbersGlance.changed, whose and/or got parentheses in 7f9ee07): a tuple
    # first rebound after the module's first replay is held for the replay, micro-batches'
    # forwards all before their backwards, gradients bit for bit eager's (helper NG).
    torch.manual_seed(0)
    eager = RebindsATupleFromItsSecondStep()
    model = nn.Sequential(RebindsATupleFromItsSecondStep())
    model.load_state_dict({f"0.{k}": v for k, v in eager.state_dict().items()})
    checkpoint_layers(model, offload=False)
    layer = model[0]
    for step in range(3):
        eager.step = layer.step = step
        xs = [torch.randn(8, 16) for _ in range(3)]
        per_model = []
        for m in (eager, model):
            losses = [m(x).square().sum() for x in xs]
            for loss in losses:
                loss.backward()
            per_model.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*per_model)), step
        assert torch.equal(eager.steps[0], layer.steps[0]), step
