"""Training steps that fail partway, and the steps after them, against an eager twin.

Trainers catch errors and go on: an out-of-memory step skipped (``zero_grad``, next batch),
a NaN check raising from a hook, a KeyboardInterrupt landing mid-step in a notebook, the same
micro-batch retried. A sweep raised RuntimeError, torch.OutOfMemoryError and KeyboardInterrupt
in a layer's forward, in its replay (later layers already replayed, earlier ones not yet), in
gradient hooks, in reuse_during_recompute, in a kept method, in an output discard's rebuild,
in offload's copies, and between forward and backward, with wrapped layers, nested
boundaries, save units, offload (prefetch 2) and a census: every step after the failed one
was eager's, bit for bit. These cases pin the recovery: the error reaches the trainer as
raised (a KeyboardInterrupt without a note), the phase is back to ``plain``, each later step
runs every layer once and replays it once, offload's host buffers all come back and its pool
does not grow, a census reads 0 after backward, and the failed step's input is freed once
the exception is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import ActivationCensus, CheckpointWithoutOutput, reuse_during_recompute, rng

WIDTH, LAYERS, FAILING = 16, 4, 2
# Layer calls by (id(layer), phase): outside the modules (a number on one is changed again by
# its replay: docs/limits.md, 'State the forward changes').
RUNS: collections.Counter[tuple[int, str]] = collections.Counter()
ARMED: dict[str, BaseException] = {}  # where -> the error raised there once


def _raise_if_armed(where: str) -> None:
    if where in ARMED:
        raise ARMED.pop(where)


def _route(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class _Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.inp, self.proj = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.norm, self.drop = nn.LayerNorm(WIDTH), nn.Dropout(0.25)
        self.discard = False  # the checkpointed twin discards the norm's output

    def normed(self, a: torch.Tensor) -> torch.Tensor:
        # A discard's rebuild is its only call with grad (its first runs under no-grad).
        if self.discard and torch.is_grad_enabled() and self.index == FAILING:
            _raise_if_armed("rebuild")
        return self.norm(a)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        phase = str(pytree_ckpt.current_phase())
        RUNS[id(self), phase] += 1
        if self.index == FAILING:
            _raise_if_armed("replay" if phase == "recompute" else "forward")
        a = self.drop(self.inp(h).relu())
        ids = reuse_during_recompute(_route, a.detach())  # a replay frame
        if self.discard:
            ckpt = CheckpointWithoutOutput()
            y = self.proj(ckpt.checkpoint(self.normed, a))
            ckpt.discard_output_and_register_recompute(y)
        else:
            y = self.proj(self.normed(a))
        return h + y * (ids.unsqueeze(-1) + 1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(i) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h)
            if layer.index == FAILING:
                # The eager twin's stand-in for the replay or rebuild: raised just before the
                # failing layer's backward, as the replay is.
                h.register_hook(lambda grad: _raise_if_armed("backward"))
        return h.square().mean()


def _train(model: _Net, where: str, error: Callable[[], BaseException], *, retry: bool,
           manager: offload.OffloadManager | None) -> tuple[list[Any], list[str]]:
    """Four steps, the second failing once at ``where`` (caught as a trainer does, then
    retried on the same batch when ``retry``); what the twins must agree on, and the errors
    caught."""
    torch.manual_seed(0)  # once: the failed step must leave the generator as eager's did
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seen: list[Any] = []  # tensors (every gradient is set)
    caught_errors: list[str] = []
    host_bytes = None
    step, retried = 0, False
    failed_input: weakref.ref[torch.Tensor] | None = None
    while step < 4:
        if failed_input is not None:  # out of the except block: the exception is dropped
            assert failed_input() is None  # nothing keeps the failed step alive
            failed_input = None
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step),
                        requires_grad=True)
        failing = step == 1 and not retried
        if failing:
            ARMED[where] = error()
        RUNS.clear()
        loss = None
        census = ActivationCensus(model)
        try:
            with census:
                loss = model(x)
                if failing and where == "between":
                    _raise_if_armed("between")  # the graph dropped by the exception
                loss.backward()
        except (Exception, KeyboardInterrupt) as caught:
            want = error()
            assert type(caught) is type(want) and caught.args == want.args  # the user's own
            if isinstance(caught, KeyboardInterrupt):  # a BaseException, unchanged
                assert not getattr(caught, "__notes__", None)
            caught_errors.append(type(caught).__name__)
            sgd.zero_grad(set_to_none=True)
            failed_input = weakref.ref(x)
            x = loss = None  # type: ignore[assignment]
            assert str(pytree_ckpt.current_phase()) == "plain"
            assert not ARMED
            if retry:
                retried = True  # the same batch again, a new forward
            else:
                step += 1
            continue
        assert census.total_bytes == 0
        seen += [loss.detach(), x.grad, *(p.grad for p in model.parameters())]
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        checkpointed = manager is not None
        # Each layer ran once, and was replayed once, whatever failed before.
        runs = {"forward": 1, "recompute": 1} if checkpointed else {"plain": 1}
        assert all({phase: n for (key, phase), n in RUNS.items() if key == id(layer)} == runs
                   for layer in model.layers), RUNS
        if manager is not None:
            stats = manager.stats()
            assert stats["host_buffers_in_use"] == 0
            assert host_bytes in (None, stats["host_bytes"])  # the pool does not grow
            host_bytes = stats["host_bytes"]
        step += 1
    return [*seen, *(p.detach().clone() for p in model.parameters())], caught_errors


CASES = [  # where it fails (the twin's), the error, retried on the same batch
    ("forward", lambda: KeyboardInterrupt("interrupted in the forward"), False),
    ("replay", lambda: RuntimeError("a NaN check in the replay"), True),
    ("replay", lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
     False),
    ("rebuild", lambda: KeyboardInterrupt("interrupted in a rebuild"), True),
    ("between", lambda: RuntimeError("loss is NaN"), False),
]


@pytest.mark.parametrize("where, error, retry", CASES,
                         ids=[f"{c[0]}-{type(c[1]()).__name__}-{'retried' if c[2] else 'skipped'}"
                              for c in CASES])
def test_steps_after_a_failed_one_match_the_eager_twin_and_leave_nothing_behind(
        where: str, error: Callable[[], BaseException], retry: bool) -> None:
    torch.manual_seed(1)
    eager = _Net()
    twin = copy.deepcopy(eager)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=2),
                                     device="cpu")
    for layer in twin.layers:
        assert isinstance(layer, _Layer)
        layer.discard = True
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    eager_where = "backward" if where in ("replay", "rebuild") else where
    expected, eager_errors = _train(eager, eager_where, error, retry=retry, manager=None)
    got, twin_errors = _train(twin, where, error, retry=retry, manager=manager)
    assert twin_errors == eager_errors == [type(error()).__name__]
    # The steps that succeeded (loss, input gradient, six parameter gradients a layer; the
    # failed batch too when retried), then the parameters.
    assert len(expected) == len(got) == (4 if retry else 3) * (2 + 6 * LAYERS) + 6 * LAYERS
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.isfinite(want).all() and torch.equal(want, have), \
            f"#{i}: max |d| = {(want - have).abs().max()}"
    assert manager.stats()["restored_bytes"] > 0  # offload was on


@pytest.mark.parametrize("flushed", [False, True], ids=["skipped", "empty-backward-after"])
def test_a_failed_post_accumulate_grad_hook_holds_host_buffers_until_an_empty_backward(
        flushed: bool) -> None:
    # docs/offload.md, Limits: torch keeps a graph whose backward raised in a
    # post-accumulate-grad hook until the next backward on the thread (eager's activations
    # too); the empty backward the guide names hands the host buffers back before the next
    # step, whose forward otherwise grows the pool.
    torch.manual_seed(1)
    model = _Net()
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=2),
                                     device="cpu")
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    last = model.layers[LAYERS - 1]
    assert isinstance(last, _Layer)
    weight = last.proj.weight
    weight.register_post_accumulate_grad_hook(lambda p: _raise_if_armed("optimizer"))
    pool = []
    for step in range(3):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step),
                        requires_grad=True)
        if step == 1:
            ARMED["optimizer"] = torch.OutOfMemoryError("CUDA out of memory (optimizer)")
        try:
            model(x).backward()
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            if flushed:
                torch.zeros((), requires_grad=True).backward()
        x = None  # type: ignore[assignment]
        stats = manager.stats()
        pool.append((stats["host_buffers_in_use"], stats["host_bytes"]))
    (_, before), (out_after_failure, _), (_, after) = pool
    assert (out_after_failure == 0) is flushed  # the layers not yet restored hold theirs
    assert (after == before) is flushed  # without it, the next forward took new buffers


# A Ctrl-C is delivered by CPython at its next check of pending signals, which comes right
# after a call returns. A profile function raising KeyboardInterrupt at the return of the n-th
# call made by IsolatedPass.__enter__ or __exit__ (rng.py) stands for the signal (helper EJ: the
# passes' lock taken before a try was left held, and every later pass waited for ever; one
# interrupted between its changes and their count left the fast path off for good).
def _interrupt_at(caller: str, n: int, *, file: str = "rng.py", called: str | None = None
                  ) -> tuple[Callable[..., None], list[str]]:
    """A profile function that raises KeyboardInterrupt as the ``n``-th (from 0) C call made by
    ``caller`` (a function of ``file``; of a callable named ``called`` only, if given) returns:
    where CPython delivers a pending SIGINT. ``seen``: the names of those returns so far."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and len(seen) <= n and frame.f_code.co_name == caller and \
                frame.f_code.co_filename.endswith(file) and \
                called in (None, getattr(arg, "__name__", None)):
            seen.append(getattr(arg, "__qualname__", getattr(arg, "__name__", repr(arg))))
            if len(seen) == n + 1:
                raise KeyboardInterrupt("Ctrl-C")

    return profile, seen


def _interrupted(profile: Callable[..., None], step: Callable[[], Any], /) -> bool:
    """Run ``step`` under ``profile``; whether a KeyboardInterrupt ended it."""
    try:
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    except KeyboardInterrupt:
        return True
    return False


@pytest.mark.parametrize("caller", ["__enter__", "__exit__"])
def test_a_keyboard_interrupt_after_any_call_of_a_pass_leaves_the_lock_and_switches_as_before(
        caller: str) -> None:
    # NOTE [a pass interrupted at any point] in rng.py.
    fast_path = torch.backends.mha.get_fastpath_enabled()
    fwd_grad = torch._C._is_fwd_grad_enabled()
    points = 0
    for n in range(12):
        torch.manual_seed(1)
        model = _Net()
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
        profile, seen = _interrupt_at(caller, n)
        if not _interrupted(profile, lambda: model(x).backward()):
            break  # past the last call of the first pass's enter or exit
        points += 1
        assert not rng._passes_lock.locked(), (n, seen)
        assert rng._passes.depth == 0, (n, seen)
        assert torch.backends.mha.get_fastpath_enabled() == fast_path, (n, seen)
        assert torch._C._is_fwd_grad_enabled() == fwd_grad, (n, seen)
        # The next step runs (it would hang on a held lock) and gives the unwrapped twin's
        # gradients.
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        eager = _Net()
        for net in (model, eager):
            torch.manual_seed(2)  # the same dropout masks
            net(x).backward()
        assert all(torch.equal(a.grad, b.grad)
                   for a, b in zip(model.parameters(), eager.parameters()))
    assert points >= 2  # each call's return in the first pass's enter or exit was tried


@pytest.mark.parametrize("caller_hooks", [False, True], ids=["no-hooks-of-its-own",
                                                             "under-the-callers-hooks"])
@pytest.mark.parametrize("point", [
    ("saved.py", "top_saved_hooks", "_top_saved_tensors_default_hooks", 0),
    ("boundary_function.py", "_forward", "_pop_saved_tensors_default_hooks", 0),
    ("saved.py", "push_saved_hooks", "_push_saved_tensors_default_hooks", 0),
    ("boundary_function.py", "_forward", "set", 1)],
                         ids=["as-the-read-returns", "as-the-pop-returns",
                              "as-the-push-returns", "as-the-forward-resets-its-phase"])
def test_a_keyboard_interrupt_as_the_window_hooks_are_taken_off_leaves_the_callers_hooks(
        caller_hooks: bool, point: tuple[str, str, str, int]) -> None:
    # NOTE [the body runs without the window's hooks] (saved.py). Guards against (helper KW) a
    # Ctrl-C delivered as the pop returned (as _interrupt_at stands for it) leaving the hooks
    # popped and unrecorded, and one delivered as the phase's reset returned in the forward's
    # finally (its second ACTIVE.set now) skipping the push after it: either way nothing was
    # pushed back, and the window's own exit then popped one pair too many: the caller's
    # hooks (a save_on_cpu(), a census's), silently, or, with none under them, torch's
    # "INTERNAL ASSERT FAILED ... please report a bug to PyTorch", raised in place of the
    # KeyboardInterrupt.
    torch.manual_seed(1)
    model = _Net()
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    # The read or the pop in the boundary's forward, the push back or the phase's reset in its
    # finally.
    file, caller, called, n = point
    profile, seen = _interrupt_at(caller, n, file=file, called=called)

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
    own = torch.autograd.graph.saved_tensors_hooks(pack, pack)
    with own if caller_hooks else contextlib.nullcontext():
        # Raised as it was: no RuntimeError in its place.
        assert _interrupted(profile, lambda: model(x).backward()) and len(seen) == n + 1
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        assert (top is not None and top[0] is pack) is caller_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_a_keyboard_interrupt_after_any_call_of_a_cached_replays_pass_leaves_caching_off() -> None:
    # NOTE [the replay caches parametrizations as the forward did] and NOTE [a pass interrupted
    # at any point] in rng.py: torch's own example opens parametrize.cached() around the forward
    # only; the replay in backward moves the count up by one and puts it back in __exit__.
    # Guards against (helper KW) putting it back after the call that takes the pass off
    # IsolatedPass._swapped: a Ctrl-C as that call returned left parametrize._cache_enabled at 1
    # with no block open, every later parametrized weight of the program computed once and read
    # from the cache for good (the next step's weight the interrupted replay's).
    try:
        _interrupted_cached_replays()
    finally:  # what the interrupt left, not to leak into later tests
        nn.utils.parametrize._cache_enabled = 0
        nn.utils.parametrize._cache = {}


def _interrupted_cached_replays() -> None:
    points = 0
    for n in range(12):
        torch.manual_seed(0)
        layer = nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH))
        eager = copy.deepcopy(layer)
        pytree_ckpt.apply_activation_checkpointing(layer)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with nn.utils.parametrize.cached():
            loss = layer(x).square().sum()
        profile, seen = _interrupt_at("__exit__", n)
        if not _interrupted(profile, loss.backward):
            break  # past the last call of the replay's pass's exit
        points += 1
        assert nn.utils.parametrize._cache_enabled == 0, (n, seen)
        # The next step, with the weights moved by a step, gives the unwrapped twin's gradients.
        layer.zero_grad(set_to_none=True)
        for net in (layer, eager):
            with torch.no_grad():
                net.parametrizations.weight.original1.add_(0.5)
            net(x).square().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(layer.parameters(),
                                                               eager.parameters())), (n, seen)
    assert points >= 2


_TOP_ID_CALLS = [0]


def _top_ids(h: torch.Tensor) -> torch.Tensor:
    _TOP_ID_CALLS[0] += 1
    return h.topk(2, dim=-1).indices


class _ReusingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(_top_ids, h)
        return self.proj(h).gather(-1, ids).sum(-1, keepdim=True) + h


@pytest.mark.parametrize("point", [("_forward", "boundary_function.py"),
                                   ("replay_backward", "recompute.py")],
                         ids=["in-the-original-pass", "in-the-replay"])
def test_a_keyboard_interrupt_as_a_pass_sets_its_phase_leaves_no_pass_active(
        point: tuple[str, str]) -> None:
    # NOTE [a pass interrupted at any point] in rng.py, for the boundary's phase. Guards
    # against (helper KZ) both passes calling ACTIVE.set one statement before the try whose
    # finally resets it (boundary_function.py _forward, recompute.py replay_backward): a
    # Ctrl-C delivered as it returned (as _interrupt_at stands for it) left the dead
    # invocation in the thread's context: current_phase() answered "forward" or "recompute"
    # for the rest of the program, every later window() of the manager's (NOTE [a window in
    # a replay copies nothing], since helper KY any pass) and every boundary copied nothing to
    # host, silently, and a plain reuse_during_recompute call outside any boundary returned
    # the interrupted step's recorded ids without calling its function.
    from pytree_ckpt.phase import ACTIVE
    torch.manual_seed(0)
    layer = _ReusingLayer()
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    profile, _ = _interrupt_at(point[0], 0, file=point[1], called="set")
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
    interrupted = _interrupted(profile, lambda: layer(x).sum().backward())
    leaked = ACTIVE.get()
    ACTIVE.set(None)  # not to leak into later tests
    assert interrupted
    assert leaked is None


def test_a_keyboard_interrupt_as_a_reused_call_marks_itself_running_leaves_later_calls_recorded(
        ) -> None:
    # NOTE [context variables set inside the try] in keep.py, for reuse_during_recompute's
    # own ContextVar: the sibling of helper KZ's ACTIVE. Guards against (helper LA) a Ctrl-C
    # delivered as IN_REUSE.set returned (or in any of the watches made before the try)
    # leaving the thread's IN_REUSE set for good: every later reused call was a plain call
    # (NOTE [reuse inside reuse]), its result no longer recorded, its function called again
    # in each replay, not "once per step"; a save unit kept nothing more (keep.py reads
    # IN_REUSE).
    from pytree_ckpt.keep import IN_REUSE
    torch.manual_seed(0)
    layer = _ReusingLayer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    profile, _ = _interrupt_at("reuse_during_recompute", 0, file="frames.py", called="set")
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
    interrupted = _interrupted(profile, lambda: layer(x).sum().backward())
    leaked = IN_REUSE.get()
    _TOP_ID_CALLS[0] = 0
    layer(x).sum().backward()  # the next step, as the rest of the program would run it
    once = _TOP_ID_CALLS[0]
    IN_REUSE.set(())  # not to leak into later tests
    assert interrupted
    assert leaked == ()
    assert once == 1  # called in the forward, its result replayed


def test_a_keyboard_interrupt_as_a_host_buffer_is_handed_out_leaves_none_checked_out() -> None:
    # Helper EJ: raised as HostPool.acquire returned to Copy.__init__, the buffer stayed checked
    # out for good. NOTE [a buffer handed out under an interrupt] in offload/pool.py.
    torch.manual_seed(1)
    model = _Net()
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=2),
                                     device="cpu")
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    fired: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        # The return of HostPool.acquire to Copy.__init__: where CPython delivers a pending
        # SIGINT once the call is done.
        if event == "return" and not fired and frame.f_code.co_name == "acquire" and \
                frame.f_code.co_filename.endswith("pool.py") and frame.f_back is not None \
                and frame.f_back.f_code.co_name == "__init__":
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C")

    interrupted = False
    for step in range(3):  # a normal step, the interrupted one, a normal one
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step),
                        requires_grad=True)
        try:
            if step == 1:
                sys.setprofile(profile)
            try:
                model(x).backward()
            finally:
                sys.setprofile(None)
        except KeyboardInterrupt:
            interrupted = True
            model.zero_grad(set_to_none=True)
        x = None  # type: ignore[assignment]
    assert interrupted and fired
    assert manager.stats()["host_buffers_in_use"] == 0  # eager holds nothing after a step


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.outer = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(h))) + h


@pytest.mark.parametrize("nth", [1, 2], ids=["as-the-region-is-set", "as-the-method-is-set"])
def test_a_keyboard_interrupt_as_a_kept_method_marks_itself_running_leaves_no_region_open(
        nth: int) -> None:
    # NOTE [context variables set inside the try] in keep.py, for a kept method's two
    # variables (helper LA, by reading: both were set before the try that reset them, so a
    # Ctrl-C as either set returned left a kept callable's region open for the thread).
    from pytree_ckpt.keep import IN_KEPT_CALLABLE
    from pytree_ckpt.kept_calls import KEPT_METHOD
    torch.manual_seed(0)
    layer, eager = _TwoLinears(), _TwoLinears()
    eager.load_state_dict(layer.state_dict())
    pytree_ckpt.apply_recompute_config(
        [layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
        {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptCallables("Linear.forward")})
    profile, _ = _interrupt_at("__call__", nth - 1, file="kept_callables.py", called="set")
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert _interrupted(profile, lambda: layer(x).sum().backward())
    assert IN_KEPT_CALLABLE.get() == frozenset() and KEPT_METHOD.get() is None
    layer.zero_grad(set_to_none=True)
    for net in (layer, eager):  # the next step trains as eager
        net(x.detach()).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(layer.parameters(), eager.parameters()))


@pytest.mark.parametrize("watch", ["argument_versions", "with_its_module", "held_tensors"])
def test_an_error_in_a_reused_calls_own_watches_leaves_later_calls_recorded(
        watch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [context variables set inside the try] in keep.py: the watches a reused call makes
    # after marking itself running sit inside the try that puts IN_REUSE back, so an error in
    # one (here made to raise) leaves no reused call marked running (helper LB: before, it
    # stayed set, every later reused call a plain call).
    import pytree_ckpt.frames as frames
    from pytree_ckpt.keep import IN_REUSE

    def top_ids(h: torch.Tensor) -> torch.Tensor:
        return h.topk(2, dim=-1).indices

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a watch that fails")

    monkeypatch.setattr(frames, watch, broken)
    h = torch.randn(4, WIDTH)
    with pytest.raises(RuntimeError, match="a watch that fails"):
        pytree_ckpt.checkpoint(lambda x: reuse_during_recompute(top_ids, x).float() * x, h)
    assert IN_REUSE.get() == ()
