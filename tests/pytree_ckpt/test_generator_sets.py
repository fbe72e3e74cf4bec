"""A forward that sets a default generator's state (NOTE [a forward that sets a default
generator's state] in generator_sets.py).

Helper DF: Megatron-Core's and DeepSpeed's RNG trackers run dropout inside
``get_cuda_rng_tracker().fork()``, which loads the tracker's state into the default generator.
The replay loaded the state the original pass had already advanced, drew another mask, and
the gradients differed from eager's, silently; the tracker also ended the step elsewhere.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt


class _Tracker:
    """Megatron's CudaRNGStatesTracker, on the CPU generator: named states, fork() loads one
    into the default generator, stores it back advanced, and puts the default state back."""

    def __init__(self, seed: int) -> None:
        orig = torch.get_rng_state()
        self.states = {}
        for offset, name in enumerate(("model-parallel-rng", "expert-parallel-rng")):
            torch.manual_seed(seed + offset)
            self.states[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        orig = torch.get_rng_state()
        _set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            _set_rng_state(orig)


def _set_rng_state(state: torch.Tensor) -> None:
    # Megatron's _set_cuda_rng_state: the set is made in a callback (_lazy_call's), on the
    # generator object itself.
    def cb() -> None:
        torch.default_generator.set_state(state)
    cb()


class _Attention(nn.Module):
    """Attention-probability dropout under the tracker (Megatron's DotProductAttention), a
    hidden dropout on the default stream after it."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.tracker = tracker  # a list: the tracker is made per run, as a global would be

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with self.tracker[0].fork():
            h = nn.functional.dropout(h.softmax(-1), 0.5)
        return x + nn.functional.dropout(h, 0.2)


def _run(model: nn.Module, tracker: list[_Tracker], *, steps: int = 3,
         retain: bool = False, micro: bool = False,
         kind: type[_Tracker] = _Tracker) -> list[torch.Tensor]:
    """Steps of training; what each leaves: every trainable parameter's grad, the tracker's
    state and the default generator's."""
    tracker[:] = [kind(123)]
    torch.manual_seed(5)
    seen = []
    for _ in range(steps):
        if micro:  # two micro-batches, backward in the reverse order of their forwards
            losses = [model(torch.randn(4, 8, requires_grad=True)).square().sum()
                      for _ in range(2)]
            for loss in reversed(losses):
                loss.backward()
            seen += [p.grad.clone() for p in model.parameters()
                     if p.requires_grad]
            seen += [state.clone() for state in tracker[0].states.values()]
            seen += [torch.get_rng_state()]
            model.zero_grad(set_to_none=True)
            continue
        loss = model(torch.randn(4, 8, requires_grad=True)).square().sum()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()  # the replay runs again: the tracker must not move
        seen += [p.grad.clone() for p in model.parameters()
                 if p.requires_grad]
        seen += [state.clone() for state in tracker[0].states.values()]
        seen += [torch.get_rng_state()]
        model.zero_grad(set_to_none=True)
    return seen


def _assert_same_runs(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    """Every grad and generator state ``_run`` recorded, bit for bit, and as many of them."""
    assert len(expected) == len(got)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), i


def _twins() -> tuple[nn.Module, nn.Module, list[_Tracker]]:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(_Attention(tracker), _Attention(tracker), _Attention(tracker))
    return eager, copy.deepcopy(eager), tracker


@pytest.mark.parametrize("retain", [False, True])
def test_dropout_under_an_rng_tracker_fork_replays_as_eager_and_the_tracker_ends_as_eager(
        retain: bool) -> None:
    eager, ours, _ = _twins()
    tracker = ours[0].tracker  # the copies share one list, as they would a global
    pytree_ckpt.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, _Attention))
    expected = _run(eager, eager[0].tracker, retain=retain)
    got = _run(ours, tracker, retain=retain)
    _assert_same_runs(expected, got)


def test_a_fork_in_a_checkpointed_plain_function_replays_as_eager() -> None:
    eager, ours, _ = _twins()
    tracker = ours[0].tracker

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.inner:  # Megatron's "uniform" chunk, as a closure
                x = pytree_ckpt.checkpoint(lambda h, layer=layer: layer(h), x)
            return x

    expected = _run(eager, eager[0].tracker)
    got = _run(Checkpointed(ours), tracker)
    _assert_same_runs(expected, got)


# The profile function each call of _Plain ran under (a global: a list the module held would
# be module state, put back as the forward began for the replay).
_PROFILES: list[Any] = []


class _Plain(nn.Module):
    """Sets no generator's state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _PROFILES.append(sys.getprofile())
        return nn.functional.dropout(self.lin(x), 0.5)


def test_a_layer_whose_first_call_sets_no_state_is_not_watched_again() -> None:
    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(_Plain())
    for _ in range(2):
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    # original pass, replay; original pass, replay: only the first pass is watched
    assert [p is not None for p in _PROFILES] == [True, False, False, False]


def test_a_users_profiler_is_left_in_place_and_still_called() -> None:
    # A foreign profile function cannot be known to chain: nothing is watched while it is on
    # (docs/limits.md), and it sees every call.
    events: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        events.append(event)

    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(_Plain())
    sys.setprofile(profiler)
    try:
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    finally:
        sys.setprofile(None)
    assert _PROFILES == [profiler, profiler] and "c_call" in events


class _DiscardedDropout(nn.Module):
    """Megatron's pattern: the dropout under the tracker is an output discard's function, its
    output rebuilt in backward."""

    def __init__(self, tracker: list[_Tracker], *, discard: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)
        self.tracker, self.discard = tracker, discard

    def dropped(self, h: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork():
            return nn.functional.dropout(h, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.discard:
            return self.down(self.dropped(self.up(x)))
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        d = ckpt.checkpoint(self.dropped, self.up(x))
        out = self.down(d)
        ckpt.discard_output_and_register_recompute(out)
        return out


def test_a_fork_in_an_output_discards_function_rebuilds_as_eager() -> None:
    torch.manual_seed(0)
    eager_tracker: list[_Tracker] = []
    ours_tracker: list[_Tracker] = []
    eager = nn.Sequential(*(_DiscardedDropout(eager_tracker, discard=False) for _ in range(2)))
    ours = copy.deepcopy(eager)
    for layer in ours:
        layer.tracker, layer.discard = ours_tracker, True
    expected = _run(eager, eager_tracker)
    got = _run(ours, ours_tracker)
    _assert_same_runs(expected, got)


def test_dynamos_own_sets_while_compiling_a_body_are_not_the_forwards() -> None:
    # Dynamo keeps the RNG state around its tracing (get, then set, deep inside torch): a
    # compiled body's first call was taken for a forward that sets a state, and every later
    # pass was watched.
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.lin(x), 0.5)

    class Compiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.body.forward = torch.compile(self.body.forward, backend="aot_eager")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _PROFILES.append(sys.getprofile())
            return self.body(x)

    torch.manual_seed(0)
    eager = Compiled()
    torch.manual_seed(0)  # not a deepcopy: the copy's compiled forward would be eager's
    ours = pytree_ckpt.apply_activation_checkpointing(Compiled())
    _PROFILES.clear()
    grads = []
    for model in (eager, ours):
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert [p is not None for p in _PROFILES[2:]] == [True, False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _TwoForks(nn.Module):
    """Two streams and four forks in one layer (attention dropout, then an expert's), a draw
    on the default stream between them, torch's fork_rng inside a fork (it reads the state,
    draws, and sets it back) inside a fork and between two, and a fork that draws nothing
    (dropout with p=0)."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork():
            h = nn.functional.dropout(self.a(x), 0.5)
        h = nn.functional.dropout(h, 0.3)
        with torch.random.fork_rng():  # reads the default state, draws, sets it back
            h = h + nn.functional.dropout(h, 0.2)
        with self.tracker[0].fork("expert-parallel-rng"):
            h = nn.functional.dropout(self.b(h), 0.4)
        with self.tracker[0].fork():
            with torch.random.fork_rng():
                h = nn.functional.dropout(h, 0.2)
            h = nn.functional.dropout(h, 0.2)
        with self.tracker[0].fork("expert-parallel-rng"):
            h = nn.functional.dropout(h, 0.0)
        return x + h


@pytest.mark.parametrize("micro", [False, True])
def test_several_forks_of_several_streams_in_one_layer_replay_as_eager(micro: bool) -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(*(_TwoForks(tracker) for _ in range(3)))
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, _TwoForks))
    expected = _run(eager, tracker, micro=micro)
    got = _run(ours, ours[0].tracker, micro=micro)
    _assert_same_runs(expected, got)


class _Outer(nn.Module):
    """A checkpointed layer that checkpoints a block of its own; each forks, the outer one
    before and after the inner boundary."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.inner, self.b = _Attention(tracker), nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork("expert-parallel-rng"):
            h = nn.functional.dropout(self.b(x), 0.5)
        h = pytree_ckpt.checkpoint(self.inner, h)
        with self.tracker[0].fork("expert-parallel-rng"):  # after the inner boundary's
            return nn.functional.dropout(h, 0.1)


def test_forks_in_a_checkpointed_block_inside_a_checkpointed_layer_replay_as_eager() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Outer(tracker) for _ in range(2)))
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), check_fn=lambda m: isinstance(m, _Outer))
    expected = _run(eager, tracker, retain=True)
    got = _run(ours, ours[0].tracker, retain=True)
    _assert_same_runs(expected, got)


class _Sometimes(nn.Module):
    """Forks on its first call, not on its second (an eval-like step), and again after."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.tracker = tracker
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        if self.calls != 2:
            with self.tracker[0].fork():
                h = nn.functional.dropout(h, 0.5)
        return x + h


def test_a_layer_that_skips_its_fork_at_one_call_is_still_watched_after() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _Sometimes(tracker)
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    expected = _run(eager, tracker)
    got = _run(ours, ours.tracker)
    _assert_same_runs(expected, got)


class _Methods(nn.Module):
    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.tracker = tracker

    def quiet(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a(x)

    def forked(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork():
            return x + nn.functional.dropout(self.a(x), 0.5)


class _BothMethods(nn.Module):
    def __init__(self, tracker: list[_Tracker], *, checkpointed: bool) -> None:
        super().__init__()
        self.m, self.checkpointed = _Methods(tracker), checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return self.m.forked(self.m.quiet(x))
        return pytree_ckpt.checkpoint(self.m.forked, pytree_ckpt.checkpoint(self.m.quiet, x))


def test_two_checkpointed_methods_of_one_class_are_learned_apart() -> None:
    # The method checkpointed first sets no state: the other one, that forks, is watched.
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _BothMethods(tracker, checkpointed=False)
    ours = copy.deepcopy(eager)
    ours.checkpointed = True
    expected = _run(eager, tracker)
    got = _run(ours, ours.m.tracker)
    _assert_same_runs(expected, got)


class _ReusedFork(nn.Module):
    """Router noise drawn under the tracker inside a reused call, then attention dropout
    under the tracker."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.tracker = tracker

    def noisy_ids(self, h: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork("expert-parallel-rng"):
            return (h + torch.rand_like(h)).argmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        ids = pytree_ckpt.reuse_during_recompute(self.noisy_ids, h.detach())
        h = h * (ids.unsqueeze(-1) + 1)
        with self.tracker[0].fork():
            h = nn.functional.dropout(h, 0.5)
        return x + h


def test_a_fork_inside_a_reused_call_then_a_fork_replays_as_eager() -> None:
    # Helper DG: the replay skips the reused call and its sets, so the later fork's set was
    # matched with the reused call's recorded state: another mask, silently.
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _ReusedFork(tracker)
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    expected = _run(eager, tracker, steps=1)
    got = _run(ours, ours.tracker, steps=1)
    _assert_same_runs(expected, got)


class _Gate(nn.Module):
    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.g = nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with self.tracker[0].fork():
            return nn.functional.dropout(self.g(h), 0.5)


class _Gated(nn.Module):
    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a, self.gate = nn.Linear(8, 8), _Gate(tracker)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate(self.a(x))


@pytest.mark.filterwarnings("ignore:.* mutates its inputs")  # the dropout's draw
def test_a_fork_inside_a_save_units_kept_callable_replays_as_eager() -> None:
    # Helper DG: the watch's own torch.equal was dispatched under the save unit's KeepMode
    # in the replay: "kept output #1 of aten.equal.default" refused in backward.
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(_Gated(tracker), _Gated(tracker))
    ours = copy.deepcopy(eager)
    assert pytree_ckpt.apply_recompute_config(
        ours, pytree_ckpt.RecomputeConfig(1.0, save=["moe_gate"]),
        {pytree_ckpt.SaveUnit.MOE_GATE: pytree_ckpt.KeptCallables("_Gate.forward")}) == [0, 1]
    expected = _run(eager, tracker)
    got = _run(ours, ours[0].gate.tracker)
    _assert_same_runs(expected, got)


class _ReusedDraw(_ReusedFork):
    """Router noise from the default generator in a reused call (the replay skips it and
    jumps the generator instead), then attention dropout under the tracker."""

    def noisy_ids(self, h: torch.Tensor) -> torch.Tensor:
        return (h + torch.rand_like(h)).argmax(-1)


def test_a_reused_calls_jump_is_not_taken_for_a_set_of_the_forwards() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _ReusedDraw(tracker)
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    expected = _run(eager, tracker)
    got = _run(ours, ours.tracker)
    _assert_same_runs(expected, got)


class _GatedFork(nn.Module):
    """A save unit's kept callable without a fork, and a fork in the layer around it."""

    def __init__(self, tracker: list[_Tracker]) -> None:
        super().__init__()
        self.a, self.gate = nn.Linear(8, 8), _Plain()
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(self.a(x))
        with self.tracker[0].fork():
            return x + nn.functional.dropout(h, 0.5)


@pytest.mark.filterwarnings("ignore:.* mutates its inputs")  # _Plain's dropout draw
def test_a_fork_around_a_save_units_kept_callable_replays_as_eager() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(_GatedFork(tracker), _GatedFork(tracker))
    ours = copy.deepcopy(eager)
    assert pytree_ckpt.apply_recompute_config(
        ours, pytree_ckpt.RecomputeConfig(1.0, save=["moe_gate"]),
        {pytree_ckpt.SaveUnit.MOE_GATE: pytree_ckpt.KeptCallables("_Plain.forward")}) == [0, 1]
    expected = _run(eager, tracker)
    got = _run(ours, ours[0].tracker)
    _assert_same_runs(expected, got)


def test_a_call_that_opts_out_of_the_rng_restore_is_not_watched() -> None:
    class Fresh(_Plain):  # a class of its own: its first pass is not learned yet
        pass

    class Discarded(_Plain):
        pass

    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(Fresh(), preserve_rng_state=False)
    layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    ckpt = pytree_ckpt.CheckpointWithoutOutput(preserve_rng_state=False)
    plain = Discarded()
    out = ckpt.checkpoint(plain, torch.randn(4, 8, requires_grad=True))
    ckpt.discard_output_and_register_recompute(out.exp())
    # layer's pass and replay, the discard's function: none ran under a watch
    assert _PROFILES[:3] == [None, None, None]


def test_a_replay_run_under_cprofile_leaves_it_in_place() -> None:
    # The forward set a state (its replay would be watched); backward runs under cProfile.
    # Up to Python 3.11 cProfile's profile function cannot be chained: the replay is not
    # watched (docs/limits.md), and cProfile stays on, counting. From 3.12 cProfile runs on
    # sys.monitoring, sets no profile function, and the watch runs beside it: the replay is
    # eager's (found running the suite on Python 3.13, where this test assumed 3.11's way).
    import cProfile
    import pstats

    tracker: list[_Tracker] = [_Tracker(1)]
    layer = pytree_ckpt.apply_activation_checkpointing(_Attention(tracker))
    loss = layer(torch.randn(4, 8, requires_grad=True)).sum()
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        before = sys.getprofile()
        loss.backward()
        still = sys.getprofile()
    finally:
        profiler.disable()
    assert still is before
    assert (before is profiler) == (sys.version_info < (3, 12))
    assert any(name == "forward" for _, _, name in pstats.Stats(profiler).stats)
    if sys.version_info >= (3, 12):
        eager, ours, _ = _twins()
        pytree_ckpt.apply_activation_checkpointing(
            ours, check_fn=lambda m: isinstance(m, _Attention))
        expected = _run(eager, eager[0].tracker)
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            got = _run(ours, ours[0].tracker)
        finally:
            profiler.disable()
        _assert_same_runs(expected, got)


def test_a_layer_that_sets_its_own_generators_state_is_not_watched_again() -> None:
    # Only the default generators' sets count: a generator of the layer's own, reset each call
    # (held as an attribute, restored for the replay by the boundary), is no fork.
    class Reseeded(_Plain):
        def __init__(self) -> None:
            super().__init__()
            self.gen = torch.Generator().manual_seed(3)
            self.start = self.gen.get_state()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _PROFILES.append(sys.getprofile())
            self.gen.set_state(self.start)
            return self.lin(x) * torch.rand(x.shape, generator=self.gen)

    _PROFILES.clear()
    layer = pytree_ckpt.apply_activation_checkpointing(Reseeded())
    for _ in range(2):
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert [p is not None for p in _PROFILES] == [True, False, False, False]


# torch.set_rng_state behind a torch wrapper: the set is made three frames inside torch, as
# torch.cuda.set_rng_state's is (through its _lazy_call callback) for Megatron's CUDA tracker.
_DEEP_SET = torch.compiler.disable(torch.set_rng_state)


class _DeepTracker(_Tracker):
    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        orig = torch.get_rng_state()
        _DEEP_SET(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            _DEEP_SET(orig)


def test_a_set_made_three_frames_inside_torch_is_the_forwards() -> None:
    eager, ours, _ = _twins()
    pytree_ckpt.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, _Attention))
    expected = _run(eager, eager[0].tracker, kind=_DeepTracker)
    got = _run(ours, ours[0].tracker, kind=_DeepTracker)
    _assert_same_runs(expected, got)


def test_the_watchs_own_frames_inside_a_compiled_body_are_not_compiled() -> None:
    # A fork inside the compiled body: the watch runs in its frames. A watched replay compiles
    # as many frames as one not watched (preserve_rng_state=False).
    from torch._dynamo.utils import counters

    class Body(_Attention):
        pass

    def frames(preserve: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        body = Body([_Tracker(1)])
        body.forward = torch.compile(body.forward, backend="aot_eager")
        model = pytree_ckpt.apply_activation_checkpointing(
            nn.Sequential(body), check_fn=lambda m: m is body, preserve_rng_state=preserve)
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        return counters["frames"]["total"]

    assert frames(True) == frames(False)


class _CudaTracker:
    """Megatron-Core's CudaRNGStatesTracker as it is: CUDA states through torch.cuda's
    get_rng_state / set_rng_state (the set three frames inside torch)."""

    def __init__(self, seed: int) -> None:
        orig = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        self.states = {"model-parallel-rng": torch.cuda.get_rng_state()}
        torch.cuda.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        orig = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(orig)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dropout_under_megatrons_cuda_tracker_fork_replays_as_eager() -> None:
    def run(model: nn.Module, tracker: list[Any]) -> list[torch.Tensor]:
        tracker[:] = [_CudaTracker(123)]
        torch.manual_seed(5)
        seen = []
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda", requires_grad=True)
            model(x).square().sum().backward()
            seen += [p.grad.clone() for p in model.parameters()]
            seen += [tracker[0].states["model-parallel-rng"].clone(),
                     torch.cuda.get_rng_state()]
            model.zero_grad(set_to_none=True)
        return seen

    eager_tracker: list[Any] = []
    ours_tracker: list[Any] = []
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Attention(eager_tracker) for _ in range(3))).cuda()
    ours = copy.deepcopy(eager)
    for layer in ours:
        layer.tracker = ours_tracker
    pytree_ckpt.apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, _Attention))
    expected, got = run(eager, eager_tracker), run(ours, ours_tracker)
    _assert_same_runs(expected, got)


class _ForksInTraining(_Attention):
    """Forks only in training mode (its dropout is off in eval)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).softmax(-1)
        if self.training:
            with self.tracker[0].fork():
                h = nn.functional.dropout(h, 0.5)
        return x + h


def _validate_with_grad(*models: nn.Module) -> None:
    """A validation pass with grad on (eval mode, a backward), before training."""
    for model in models:
        model.eval()
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        model.train()
        model.zero_grad(set_to_none=True)


def test_a_layer_first_called_in_eval_mode_with_grad_is_still_watched_in_training() -> None:
    # Helper DH: the first pass decided for good; one made in eval mode (no fork there) left
    # the layer unwatched when training began.
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = nn.Sequential(_ForksInTraining(tracker), _ForksInTraining(tracker))
    ours = copy.deepcopy(eager)
    ours_tracker = ours[0].tracker
    pytree_ckpt.apply_activation_checkpointing(
        ours, check_fn=lambda m: isinstance(m, _ForksInTraining))
    _validate_with_grad(eager, ours)
    expected, got = _run(eager, tracker), _run(ours, ours_tracker)
    _assert_same_runs(expected, got)


def test_each_layer_is_watched_on_its_own_not_by_its_class() -> None:
    # Helper DH: keyed by class, a checkpointed Sequential that forks nowhere left every other
    # Sequential (Megatron's "uniform" chunks) unwatched.
    quiet = nn.Sequential(nn.Linear(8, 8))
    pytree_ckpt.checkpoint(quiet, torch.randn(4, 8, requires_grad=True)).sum().backward()
    eager, ours, tracker = _twins()
    ours_tracker = ours[0].tracker

    class Chunked(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return pytree_ckpt.checkpoint(self.inner, x)  # one boundary around the chunk

    expected = _run(eager, eager[0].tracker)
    got = _run(Chunked(ours), ours_tracker)
    _assert_same_runs(expected, got)


def test_what_was_learned_of_a_layer_goes_with_it() -> None:
    # Its id may be reused by a layer made later, which must be looked at anew.
    from pytree_ckpt import generator_sets

    layer = pytree_ckpt.apply_activation_checkpointing(_Plain())
    layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    learned = [key for key in generator_sets._SETS if key[0] == id(layer)]
    assert len(learned) == 1 and generator_sets._SETS[learned[0]] is False
    del layer
    gc.collect()
    assert learned[0] not in generator_sets._SETS


class _PlainBlock:
    """A plain object (not a module) whose method is checkpointed; a block made with a
    tracker forks, one made without does not."""

    def __init__(self, lin: nn.Module, tracker: _Tracker | None) -> None:
        self.lin, self.tracker = lin, tracker

    def run(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.tracker is not None:
            with self.tracker.fork():
                h = nn.functional.dropout(h, 0.5)
        return x + h


def test_a_plain_objects_method_at_a_reused_address_is_looked_at_anew() -> None:
    torch.manual_seed(0)
    quiet = _PlainBlock(nn.Linear(8, 8), None)  # its method sets no state: learned so
    pytree_ckpt.checkpoint(quiet.run, torch.randn(4, 8, requires_grad=True)).sum().backward()
    address = id(quiet)
    lin = nn.Linear(8, 8)
    eager_lin = copy.deepcopy(lin)
    trackers = [_Tracker(1), _Tracker(1)]
    del quiet
    gc.collect()
    made = []  # kept alive until one lands at the dead block's address, as a sweep's would
    for _ in range(10000):
        ours = _PlainBlock(lin, trackers[0])
        if id(ours) == address:
            break
        made.append(ours)
    if id(ours) != address:  # the case under test needs the address reused (3.11 here does)
        pytest.skip("this Python did not reuse the dead object's address within 10,000 tries")
    eager = _PlainBlock(eager_lin, trackers[1])
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    eager.run(x.clone().requires_grad_()).square().sum().backward()
    torch.manual_seed(3)
    pytree_ckpt.checkpoint(ours.run, x.clone().requires_grad_()).square().sum().backward()
    assert torch.equal(lin.weight.grad, eager_lin.weight.grad)
    assert torch.equal(trackers[0].states["model-parallel-rng"],
                       trackers[1].states["model-parallel-rng"])


def _quiet(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lin(x).relu()


def _forking(lin: nn.Module, tracker: _Tracker, x: torch.Tensor) -> torch.Tensor:
    h = lin(x)
    with tracker.fork():
        h = nn.functional.dropout(h, 0.5)
    return x + h


def test_a_partial_that_forks_is_watched_after_an_unrelated_partial_that_did_not() -> None:
    import functools

    from pytree_ckpt import generator_sets

    # Learned afresh here, whatever an earlier test's partial left (partials are keyed by
    # identity; this clears any a test left).
    for key in [k for k in generator_sets._SETS if k[2] is functools.partial]:
        del generator_sets._SETS[key]
    pytree_ckpt.checkpoint(functools.partial(_quiet, nn.Linear(8, 8)),
                           torch.randn(4, 8, requires_grad=True)).sum().backward()
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    eager_lin = copy.deepcopy(lin)
    trackers = [_Tracker(1), _Tracker(1)]
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    _forking(eager_lin, trackers[1], x.clone().requires_grad_()).square().sum().backward()
    torch.manual_seed(3)
    pytree_ckpt.checkpoint(functools.partial(_forking, lin, trackers[0]),
                           x.clone().requires_grad_()).square().sum().backward()
    assert torch.equal(lin.weight.grad, eager_lin.weight.grad)
    assert torch.equal(trackers[0].states["model-parallel-rng"],
                       trackers[1].states["model-parallel-rng"])


@pytest.mark.parametrize("over", ["a layer", "a layer and a tensor made each step"])
def test_a_lambda_made_anew_each_step_is_watched_only_at_its_first_pass(
        monkeypatch: pytest.MonkeyPatch, over: str) -> None:
    # A closure is keyed by its code and the objects it closes over (a tracker of its own), but
    # not by a tensor: data made anew each step would make every step's lambda new to the watch.
    from pytree_ckpt import generator_sets

    made = []

    class Counted(generator_sets.GeneratorSets):
        def __init__(self, recorded: Any) -> None:
            made.append(recorded is None)  # an original pass's watch
            super().__init__(recorded)

    monkeypatch.setattr(generator_sets, "GeneratorSets", Counted)
    lin = nn.Linear(8, 8)
    for _ in range(4):
        scale = torch.rand(8)
        fn = (lambda h: torch.tanh(lin(h))) if over == "a layer" else \
            (lambda h: torch.tanh(lin(h)) * scale)
        pytree_ckpt.checkpoint(fn, torch.randn(4, 8, requires_grad=True)).sum().backward()
        gc.collect()
    assert made.count(True) == 1, made


def test_a_partial_that_forks_is_watched_while_an_unrelated_quiet_partial_is_alive() -> None:
    # Mutation testing (helper EK): the test above lets its quiet partial die at once, and its
    # entry goes with it, so keying every partial by the partial class passed it; held alive
    # (a model's partial), the quiet one's entry must not stand for the forking one.
    import functools

    quiet = functools.partial(_quiet, nn.Linear(8, 8))
    pytree_ckpt.checkpoint(quiet, torch.randn(4, 8, requires_grad=True)).sum().backward()
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    eager_lin = copy.deepcopy(lin)
    trackers = [_Tracker(1), _Tracker(1)]
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    _forking(eager_lin, trackers[1], x.clone().requires_grad_()).square().sum().backward()
    torch.manual_seed(3)
    pytree_ckpt.checkpoint(functools.partial(_forking, lin, trackers[0]),
                           x.clone().requires_grad_()).square().sum().backward()
    assert torch.equal(lin.weight.grad, eager_lin.weight.grad)
    assert torch.equal(trackers[0].states["model-parallel-rng"],
                       trackers[1].states["model-parallel-rng"])
    del quiet


def _make_block(lin: nn.Module, tracker: _Tracker | None) -> Any:
    def block(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        if tracker is not None:
            with tracker.fork():
                h = nn.functional.dropout(h, 0.5)
        return x + h
    return block


def test_a_closure_that_forks_is_watched_while_a_quiet_closure_of_the_same_code_is_alive(
) -> None:
    # Helper EK: the partial case (helper EG) for closures made by one factory, one per model
    # or per stage: keyed by code, the first one's "sets no state" stands for every other.
    quiet = _make_block(nn.Linear(8, 8), None)
    pytree_ckpt.checkpoint(quiet, torch.randn(4, 8, requires_grad=True)).sum().backward()
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    eager_lin = copy.deepcopy(lin)
    trackers = [_Tracker(1), _Tracker(1)]
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    _make_block(eager_lin, trackers[1])(x.clone().requires_grad_()).square().sum().backward()
    torch.manual_seed(3)
    pytree_ckpt.checkpoint(_make_block(lin, trackers[0]),
                           x.clone().requires_grad_()).square().sum().backward()
    assert torch.equal(lin.weight.grad, eager_lin.weight.grad)
    assert torch.equal(trackers[0].states["model-parallel-rng"],
                       trackers[1].states["model-parallel-rng"])
    del quiet


class _SlottedBlock:
    """As _PlainBlock, with no __weakref__: it cannot be forgotten with its entry."""

    __slots__ = ("lin", "tracker")

    def __init__(self, lin: nn.Module, tracker: _Tracker | None) -> None:
        self.lin, self.tracker = lin, tracker

    run = _PlainBlock.run


def test_a_method_of_an_object_without_weak_references_is_watched_at_every_pass() -> None:
    # Mutation testing (helper EK): one that takes no weak reference is not remembered
    # (generator_sets.learned); remembering it anyway, a new object at a dead one's address
    # inherited "sets no state" and its fork went unwatched, and the suite passed.
    with pytest.raises(TypeError):
        weakref.ref(_SlottedBlock(nn.Linear(1, 1), None))
    torch.manual_seed(0)
    quiet = _SlottedBlock(nn.Linear(8, 8), None)
    pytree_ckpt.checkpoint(quiet.run, torch.randn(4, 8, requires_grad=True)).sum().backward()
    address = id(quiet)
    lin = nn.Linear(8, 8)
    eager_lin = copy.deepcopy(lin)
    trackers = [_Tracker(1), _Tracker(1)]
    del quiet
    gc.collect()
    made = []
    for _ in range(10000):
        ours = _SlottedBlock(lin, trackers[0])
        if id(ours) == address:
            break
        made.append(ours)
    assert id(ours) == address
    eager = _SlottedBlock(eager_lin, trackers[1])
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    eager.run(x.clone().requires_grad_()).square().sum().backward()
    torch.manual_seed(3)
    pytree_ckpt.checkpoint(ours.run, x.clone().requires_grad_()).square().sum().backward()
    assert torch.equal(lin.weight.grad, eager_lin.weight.grad)
    assert torch.equal(trackers[0].states["model-parallel-rng"],
                       trackers[1].states["model-parallel-rng"])


class _CustomBlock(nn.Module):
    """Megatron-Core's TransformerBlock under recompute_method="uniform": each group of layers
    runs through ``checkpoint(custom(start, end), h)``, a closure over the block, as
    docs/save_units.md's "Coming from Megatron-Core" says works."""

    def __init__(self, tracker: list[_Tracker], checkpointed: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ForksInTraining(tracker) for _ in range(2))
        self.checkpointed = checkpointed

    def custom(self, start: int, end: int) -> Any:
        def custom_forward(h: torch.Tensor) -> torch.Tensor:
            for index in range(start, end):
                h = self.layers[index](h)
            return h
        return custom_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self.custom(0, len(self.layers))
        return pytree_ckpt.checkpoint(fn, x) if self.checkpointed else fn(x)


def test_a_checkpointed_closure_first_called_in_eval_mode_with_grad_is_still_watched() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _CustomBlock(tracker, checkpointed=False)
    ours = copy.deepcopy(eager)
    ours.checkpointed = True
    ours_tracker = ours.layers[0].tracker
    _validate_with_grad(eager, ours)
    expected, got = _run(eager, tracker), _run(ours, ours_tracker)
    _assert_same_runs(expected, got)


class _DiscardedActivation(nn.Module):
    """Megatron-Core's experts: the activation is a closure defined in the forward
    (``bias_act_func``) whose output is discarded; its dropout forks only in training."""

    def __init__(self, tracker: list[_Tracker], discard: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.tracker, self.discard = tracker, discard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def act(h: torch.Tensor) -> torch.Tensor:
            if self.training:
                with self.tracker[0].fork():
                    return nn.functional.dropout(nn.functional.silu(h), 0.5)
            return nn.functional.silu(h)

        if not self.discard:
            return self.fc2(act(self.fc1(x)))
        ckpt = pytree_ckpt.CheckpointWithoutOutput()
        out = self.fc2(ckpt.checkpoint(act, self.fc1(x)))
        ckpt.discard_output_and_register_recompute(out)
        return out


def test_a_discarded_closure_first_run_in_eval_mode_with_grad_is_still_watched() -> None:
    # Helper GJ: as for a checkpointed closure, the eval pass (no fork) decided for good, and
    # the rebuild of the training passes drew other masks: other gradients, silently.
    runs = []
    for discard in (False, True):
        tracker: list[_Tracker] = []
        torch.manual_seed(0)
        model = _DiscardedActivation(tracker, discard)
        tracker[:] = [_Tracker(123)]
        model.eval()
        model(torch.randn(4, 8, requires_grad=True))  # a validation pass with grad on
        model.train()
        runs.append(_run(model, tracker))
    _assert_same_runs(*runs)


def test_a_closure_over_a_frozen_eval_mode_teacher_is_watched_only_until_a_training_pass() -> None:
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    teacher = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    teacher.eval().requires_grad_(False)  # frozen for the whole run; the student trains
    watched: list[bool] = []

    def make() -> Any:
        def distill(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            watched.append(sys.getprofile() is not None)
            with torch.no_grad():
                target = teacher(x)
            return student(x), target
        return distill

    distill = make()
    for _ in range(4):
        out, target = pytree_ckpt.checkpoint(distill, torch.randn(4, 8, requires_grad=True))
        (out - target).square().mean().backward()
    assert watched[::2] == [True, False, False, False]  # original passes; replays: [1::2]


class _BlockWithLoss(nn.Module):
    """A checkpointed closure over the layers and a loss module the training script made
    (nn.SmoothL1Loss, not a child of the model: ``model.eval()`` leaves it in training mode),
    as a chunked loss or a head-plus-criterion closure holds them."""

    def __init__(self, tracker: list[_Tracker], criterion: nn.Module, checkpointed: bool
                 ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ForksInTraining(tracker) for _ in range(2))
        self.checkpointed = checkpointed
        self.criterion = [criterion]  # held outside the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers, criterion = self.layers, self.criterion[0]

        def body(h: torch.Tensor) -> torch.Tensor:
            for layer in layers:
                h = layer(h)
            return criterion(h, torch.zeros_like(h)) * torch.ones(4, 8)

        return pytree_ckpt.checkpoint(body, x) if self.checkpointed else body(x)


def test_a_closure_over_eval_layers_and_a_training_mode_loss_module_is_still_watched() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _BlockWithLoss(tracker, nn.SmoothL1Loss(), checkpointed=False)
    ours = copy.deepcopy(eager)
    ours.criterion = [nn.SmoothL1Loss()]
    ours.checkpointed = True
    ours_tracker = ours.layers[0].tracker
    _validate_with_grad(eager, ours)
    assert ours.criterion[0].training  # model.eval() did not reach it
    expected, got = _run(eager, tracker), _run(ours, ours_tracker)
    _assert_same_runs(expected, got)


class _FrozenBaseWithAdapter(nn.Module):
    """A frozen base (its dropout forks in training, its parameters frozen, as a LoRA base's)
    run by a checkpointed closure, after a trainable adapter held outside the closure."""

    def __init__(self, tracker: list[_Tracker], checkpointed: bool) -> None:
        super().__init__()
        self.adapter = nn.Linear(8, 8)
        self.base = nn.ModuleList(_ForksInTraining(tracker) for _ in range(2))
        self.base.requires_grad_(False)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base

        def body(h: torch.Tensor) -> torch.Tensor:
            for layer in base:
                h = layer(h)
            return h

        h = self.adapter(x)
        return pytree_ckpt.checkpoint(body, h) if self.checkpointed else body(h)


def test_a_closure_over_a_frozen_base_that_forks_in_training_is_still_watched_after_eval() -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _FrozenBaseWithAdapter(tracker, checkpointed=False)
    ours = copy.deepcopy(eager)
    ours.checkpointed = True
    ours_tracker = ours.base[0].tracker
    _validate_with_grad(eager, ours)
    expected, got = _run(eager, tracker), _run(ours, ours_tracker)
    _assert_same_runs(expected, got)


class _FrozenBaseWithLoss(nn.Module):
    """Prompt tuning: a frozen base (its dropout forks in training) and the loss module the
    training script made (parameterless, not a child: ``model.eval()`` leaves it in training
    mode), run by one checkpointed closure, after a trainable soft prompt held outside it."""

    def __init__(self, tracker: list[_Tracker], criterion: nn.Module, checkpointed: bool
                 ) -> None:
        super().__init__()
        self.adapter = nn.Linear(8, 8)  # the trainable prompt encoder, outside the closure
        self.base = nn.ModuleList(_ForksInTraining(tracker) for _ in range(2))
        self.base.requires_grad_(False)
        self.checkpointed = checkpointed
        self.criterion = [criterion]  # held outside the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, criterion = self.base, self.criterion[0]

        def body(h: torch.Tensor) -> torch.Tensor:
            for layer in base:
                h = layer(h)
            return criterion(h, torch.zeros_like(h)) * torch.ones(4, 8)

        h = self.adapter(x)
        return pytree_ckpt.checkpoint(body, h) if self.checkpointed else body(h)


def test_a_closure_over_a_frozen_base_and_a_training_mode_loss_module_is_still_watched(
) -> None:
    tracker: list[_Tracker] = []
    torch.manual_seed(0)
    eager = _FrozenBaseWithLoss(tracker, nn.SmoothL1Loss(), checkpointed=False)
    ours = copy.deepcopy(eager)
    ours.criterion = [nn.SmoothL1Loss()]
    ours.checkpointed = True
    ours_tracker = ours.base[0].tracker
    _validate_with_grad(eager, ours)
    assert ours.criterion[0].training  # model.eval() did not reach it
    expected, got = _run(eager, tracker), _run(ours, ours_tracker)
    _assert_same_runs(expected, got)
