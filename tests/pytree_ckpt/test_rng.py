"""The replay environment's RNG state (CPU, and CUDA through stand-in generators on CPU),
captured in the original pass and re-entered in the replay; its autocast state is tested in
``test_boundary.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import pytree_ckpt
from pytree_ckpt import apply_activation_checkpointing, reuse_during_recompute
from pytree_ckpt.rng import IsolatedPass, ReplayEnvironment, rng_changed, rng_state, set_rng_state
from tests.conftest import assert_same_grads, grads_of
from tests.pytree_ckpt.models import JitteredOnly, jittered_topk


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_without_rng_preservation_a_replay_of_a_frozen_draw_never_jumps_the_generator() -> None:
    # ReplayEnvironment.rng_devices() is None without preservation: the replay restores no
    # generator, so it must not jump to a recorded state either (that would rewind it). The
    # layer's only draw is replayed from its frame, so nothing else moves the generator (a
    # replay that draws anew, dropout, does: test_module.py).
    layer = JitteredOnly()
    pytree_ckpt.apply_activation_checkpointing(layer, preserve_rng_state=False)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(0)
    out = layer(x)
    torch.rand(100)  # the caller draws between forward and backward
    before_backward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), before_backward)


class FakeCudaGenerators:
    """CUDA generator states by device, for checking the CUDA paths of rng.py on CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int = 2) -> None:
        self.states = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(devices)}
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: self.states[d].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda s, d: self.states.__setitem__(d, s.clone()))


def test_a_change_of_a_cuda_generator_alone_counts_as_a_change() -> None:
    # rng_changed: a jittered routing on the GPU moves only a CUDA generator.
    cpu = torch.get_rng_state()
    before = (cpu, {0: torch.zeros(16, dtype=torch.uint8)})
    after = (cpu.clone(), {0: torch.ones(16, dtype=torch.uint8)})
    assert rng_changed(before, after)
    assert not rng_changed(before, (cpu.clone(), {0: torch.zeros(16, dtype=torch.uint8)}))


def test_rng_state_and_set_rng_state_cover_exactly_the_named_cuda_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gens = FakeCudaGenerators(monkeypatch)
    state = rng_state((0, 1))
    assert set(state[1]) == {0, 1} and torch.equal(state[1][1], gens.states[1])
    jump = (torch.get_rng_state(), {0: torch.full((16,), 7, dtype=torch.uint8),
                                    1: torch.full((16,), 9, dtype=torch.uint8)})
    set_rng_state(jump, devices=(0,))  # device 1 is not restored after the replay: untouched
    assert torch.equal(gens.states[0], jump[1][0])
    assert torch.equal(gens.states[1], torch.full((16,), 1, dtype=torch.uint8))


def test_the_replay_environment_sets_the_recorded_cuda_state_and_puts_the_ambient_one_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gens = FakeCudaGenerators(monkeypatch, devices=1)
    captured = ReplayEnvironment.capture((), preserve_rng=True)
    recorded = torch.full((16,), 5, dtype=torch.uint8)
    env = ReplayEnvironment(captured.cpu_rng, {0: recorded}, captured.autocast,
                            captured.autocast_cache, captured.torch_function, captured.kernels)
    assert env.rng_devices() == (0,)
    ambient = gens.states[0].clone()
    with env.replaying():
        assert torch.equal(gens.states[0], recorded)
        gens.states[0] = torch.full((16,), 6, dtype=torch.uint8)  # the replay draws
    assert torch.equal(gens.states[0], ambient)


def test_a_replay_environment_that_fails_to_enter_autocast_puts_the_rng_state_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The RNG states are set before the forward's autocast state is entered: if entering it
    # raises, the generators must not be left at the forward's state (the step would go on
    # drawing the forward's numbers again), nor a passed generator at its own.
    generator = torch.Generator().manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        env = ReplayEnvironment.capture((), preserve_rng=True, leaves=[generator])
    torch.rand(3)
    torch.rand(3, generator=generator)  # both move on after the forward
    ambient, own = torch.get_rng_state(), generator.get_state()

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("autocast refused")

    monkeypatch.setattr(torch, "autocast", refused)
    with pytest.raises(RuntimeError, match="autocast refused"):
        with env.replaying():
            pass
    assert torch.equal(torch.get_rng_state(), ambient)
    assert torch.equal(generator.get_state(), own)


# ------------------------------------------- CUDA paths of rng.py (not runnable without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class CudaJitteredRouting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        ids = reuse_during_recompute(jittered_topk, h.detach())  # draws on the CUDA generator
        y = torch.gather(h, -1, ids).sum(-1, keepdim=True) * h
        return nn.functional.dropout(y, 0.5, training=True)


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_skipped_jittered_routing_keeps_dropout_masks_and_the_generator_in_step(
        ) -> None:
    # rng_state / rng_changed read the CUDA generators: the routing moves only the CUDA one,
    # and the replay's generator must be put back afterwards.
    torch.manual_seed(0)
    eager = CudaJitteredRouting().cuda()
    wrapped = copy.deepcopy(eager)
    apply_activation_checkpointing(wrapped)
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    after = []
    grads = []
    for model in (eager, wrapped):
        torch.manual_seed(5)
        out = model(x)
        torch.rand(100, device="cuda")  # the caller draws between forward and backward
        out.sum().backward()
        after.append(torch.cuda.get_rng_state())
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)
    assert torch.equal(after[0], after[1])


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 64, 32)


def _math_attention() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _no_onednn() -> Any:
    return torch.backends.mkldnn.flags(enabled=False)


# torch's mkldnn.flags() notes that oneDNN TF32 needs an Intel GPU, on every exit
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning")
@pytest.mark.parametrize(("model", "switch", "shape"), [
    (SelfAttention, _math_attention, (2, 64, 32)),
    (lambda: nn.Sequential(nn.Conv2d(16, 32, 3), nn.Tanh(), nn.Conv2d(32, 16, 3)), _no_onednn,
     (4, 16, 32, 32))], ids=["sdpa_kernel(MATH)", "mkldnn.flags(enabled=False)"])
def test_a_kernel_switch_set_around_the_forward_only_is_set_again_for_the_replay(
        model: Any, switch: Any, shape: tuple[int, ...]) -> None:
    # Guards against: the replay in backward (outside the switch, as usual) ran the default
    # kernels, not the forward's, and fp32 gradients differed from eager's, whose backward uses
    # what the forward's kernels saved (NOTE [the replay picks the forward's kernels]).
    torch.manual_seed(0)
    eager = model()
    twin = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(*shape)
    before = torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()
    for layer in (eager, twin):
        with switch():
            out = layer(x)
        out.square().sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in twin.parameters()])
    assert (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()) == before


class OwnDropout(nn.Module):
    """Dropout drawn from a generator the caller passes in (a seeded, per-rank stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=generator) > 0.5
        return self.lin(x) * keep * 2


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
def test_a_generator_passed_in_draws_the_forwards_numbers_in_the_replay_and_ends_as_in_eager(
        default: bool) -> None:
    # Guards against: only the default generators were restored for the replay, so one passed
    # as an argument drew the next numbers: another dropout mask in the replay, other gradients,
    # silently, and the generator ended the step two draws on (eager: one).
    torch.manual_seed(0)
    layer = OwnDropout()
    twin = apply_activation_checkpointing(copy.deepcopy(layer))
    results = []
    for model in (layer, twin):
        generator = torch.default_generator if default else torch.Generator()
        generator.manual_seed(3)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model(x, generator=generator).square().sum().backward()
        results.append([*grads_of([x, *model.parameters()]),
                        torch.rand(8, generator=generator)])  # where the step left it
    assert_same_grads(*results)


# Per pass (forward, replay), the devices MadeDevices's tensors were made on. A global, not the
# module's: a list the layer holds and appends to is module state, which its replay changes
# on a copy (docs/limits.md, "Module state").
MADE_ON: list[list[torch.device]] = []


class MadeDevices(nn.Module):
    """Records, per pass, the device of the tensors its forward makes without naming one (a
    causal mask, positions), as a layer under torch's default device makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask, positions = torch.ones(4, 4).tril(), torch.arange(4)
        MADE_ON.append([mask.device, positions.device])
        return self.lin(x).relu()


# Each doubles the layer's output, as _discarded's consumer does.
def _torch_non_reentrant(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) * 2


def _ours(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pytree_ckpt.checkpoint(layer, x) * 2


def _discarded(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    ckpt = pytree_ckpt.CheckpointWithoutOutput()
    out = ckpt.checkpoint(layer, x) * 2  # the product saves nothing of the output
    ckpt.discard_output_and_register_recompute(out)
    return out


@pytest.mark.parametrize("how", ["context", "process"])
@pytest.mark.parametrize("call", [_ours, _discarded], ids=["boundary", "discard"])
def test_the_replay_makes_tensors_on_the_default_device_the_forward_ran_under(
        how: str, call: Any) -> None:
    # Guards against: torch's default device (`with torch.device("cuda"):`,
    # torch.set_default_device) is a TorchFunctionMode, and none is active inside backward, so
    # the replay made the forward's masks and positions on the CPU: on a GPU, an error in
    # backward ("Expected all tensors to be on the same device") where eager and torch's
    # non-reentrant checkpoint run (NOTE [the replay sees the forward's default device]).
    # "meta" stands in for the accelerator: nothing here computes with what it makes.
    runs = []
    for run in (_torch_non_reentrant, call):
        MADE_ON.clear()
        torch.manual_seed(0)
        layer, x = MadeDevices(), torch.randn(2, 8, requires_grad=True)
        if how == "context":
            with torch.device("meta"):
                out = run(layer, x)
        else:
            torch.set_default_device("meta")
            try:
                out = run(layer, x)
            finally:
                torch.set_default_device(None)
        out.sum().backward()  # outside: as a step's backward after the model's forward
        runs.append(([device for devices in MADE_ON for device in devices],
                     [x.grad, *grads_of(layer.parameters())]))
        assert torch.empty(0).device == torch.device("cpu")  # nothing left behind
    (torch_devices, torch_grads), (devices, grads) = runs
    assert len(devices) == len(torch_devices) == 4  # the forward and one replay (or rebuild)
    assert devices == torch_devices == [torch.device("meta")] * 4
    assert_same_grads(torch_grads, grads)


def test_a_replay_under_a_default_device_of_its_own_is_left_as_it_is() -> None:
    # The replay enters the forward's default device only where backward runs under another:
    # under the same one nothing more is pushed, and backward's own is back afterwards.
    MADE_ON.clear()
    layer, x = MadeDevices(), torch.randn(2, 8, requires_grad=True)
    with torch.device("meta"):
        out = pytree_ckpt.checkpoint(layer, x)
    env = ReplayEnvironment.capture((x,), preserve_rng=False)
    assert env.device is None  # outside any default device
    with torch.device("meta"):
        env = ReplayEnvironment.capture((x,), preserve_rng=False)
        depth = torch._C._len_torch_function_stack()
        with env.replaying():
            assert torch._C._len_torch_function_stack() == depth
        out.sum().backward()
        assert torch._C._len_torch_function_stack() == depth
    assert torch._C._len_torch_function_stack() == 0
    assert MADE_ON == [[torch.device("meta")] * 2] * 2


class MaskedAttention(nn.Module):
    """Causal scores with a mask made without naming a device, as code written for
    torch.set_default_device("cuda") makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        scores = (q @ k.transpose(1, 2)).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ x


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_layer_under_the_default_device_gets_eager_gradients() -> None:
    # Guards against: the replay made the mask on the CPU (no default device inside
    # backward), and masked_fill refused a CPU mask for CUDA scores in backward.
    torch.manual_seed(0)
    eager = MaskedAttention().cuda()
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager))
    grads = []
    for layer in (eager, wrapped):
        torch.manual_seed(1)
        x = torch.randn(2, 5, 8, device="cuda", requires_grad=True)
        with torch.device("cuda"):
            out = layer(x)
        out.square().sum().backward()
        grads.append([x.grad, *grads_of(layer.parameters())])
    assert_same_grads(*grads)


class RotaryScaled(nn.Module):
    """Rotary angles made in the default dtype (`torch.arange(...) / d`, `10000 ** ...`) and
    cast to the activations' dtype, as many RoPE implementations compute them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8))
        angles = torch.arange(x.shape[0])[:, None] * inv[None]
        return self.lin(x) * torch.cat([angles.sin(), angles.cos()], -1).to(x.dtype)


@pytest.mark.parametrize("call", [_ours, _discarded], ids=["boundary", "discard"])
def test_the_replay_makes_tensors_in_the_default_dtype_the_forward_ran_under(call: Any) -> None:
    runs = []
    for run in (lambda layer, x: layer(x) * 2, call):
        torch.manual_seed(0)
        layer, x = RotaryScaled(), torch.randn(4, 8, requires_grad=True)
        torch.set_default_dtype(torch.float64)
        try:
            out = run(layer, x)
        finally:
            torch.set_default_dtype(torch.float32)
        out.square().sum().backward()  # outside, as a step's backward
        runs.append([x.grad, *grads_of(layer.parameters())])
    assert_same_grads(*runs)


class ChainedEinsum(nn.Module):
    """A four-operand einsum, whose contraction order torch.backends.opt_einsum picks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(64, 48))
        self.b = nn.Parameter(torch.randn(48, 80))
        self.c = nn.Parameter(torch.randn(80, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ij,jk,kl,lm->im", x, self.a, self.b, self.c).tanh()


def _strategy(name: str) -> Any:
    import contextlib

    @contextlib.contextmanager
    def strategy() -> Any:
        before = torch.backends.opt_einsum.strategy
        torch.backends.opt_einsum.strategy = name
        try:
            yield
        finally:
            torch.backends.opt_einsum.strategy = before
    return strategy()


@pytest.mark.parametrize("switch", [lambda: torch.backends.opt_einsum.flags(enabled=False),
                                    lambda: _strategy("greedy")], ids=["disabled", "greedy"])
def test_an_einsum_contraction_order_set_around_the_forward_only_is_set_again_for_the_replay(
        switch: Any) -> None:
    pytest.importorskip("opt_einsum")  # without it torch contracts left to right, always
    torch.manual_seed(0)
    eager = ChainedEinsum()
    twin = apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(32, 64)
    for layer in (eager, twin):
        with switch():
            out = layer(x)
        out.square().sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in twin.parameters()])


class ConvStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(),
                                  nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class HalfAttention(SelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


def _no_onednn_nor_nnpack() -> Any:
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
    stack.enter_context(torch.backends.nnpack.flags(enabled=False))
    return stack


def _math_with_low_precision_reduction() -> Any:
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @contextlib.contextmanager
    def switch() -> Any:
        before = torch._C._get_math_sdp_allow_fp16_bf16_reduction()
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                yield
        finally:
            torch._C._set_math_sdp_allow_fp16_bf16_reduction(before)
    return switch()


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning")
@pytest.mark.parametrize(("model", "switch", "shape", "dtype"), [
    (ConvStack, _no_onednn_nor_nnpack, (16, 8, 16, 16), torch.float32),
    (HalfAttention, _math_with_low_precision_reduction, (2, 64, 32), torch.bfloat16)],
    ids=["nnpack.flags(enabled=False)", "allow_fp16_bf16_reduction_math_sdp"])
def test_every_kernel_switch_set_around_the_forward_only_is_set_again_for_the_replay(
        model: Any, switch: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if dtype is torch.float32 and not torch._nnpack_available():
        pytest.skip("this torch build has no NNPACK")
    torch.manual_seed(0)
    eager = model().to(dtype)
    twin = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(*shape).to(dtype)
    for layer in (eager, twin):
        with switch():
            out = layer(x)
        out.float().square().sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in twin.parameters()])


# Helper LG (mutation round over rng.py): one test per surviving mutant.


def test_a_pass_that_ends_before_a_later_one_hands_the_callers_cache_on_to_it() -> None:
    # Mutant (helper LG): the first pass to end, its cache swapped out by a later pass still
    # running (passes of two threads overlap without nesting), not handing its outer cache
    # on: the later pass then put back the first pass's own cache, and the caller's block
    # lost its cache.
    with parametrize.cached():
        caller = parametrize._cache
        first, second = IsolatedPass(), IsolatedPass()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
        assert parametrize._cache is caller


def _counted(x: torch.Tensor) -> torch.Tensor:
    return (x * torch.arange(3.0)).square()  # a table made without naming a device


def test_the_replay_runs_under_the_innermost_default_device_of_the_forward() -> None:
    # Mutant (helper LG): _default_device reading the outermost DeviceContext: the replay
    # made its table on the meta device (an error in backward) where the forward's was on
    # the CPU.
    x = torch.randn(3, requires_grad=True)
    grads = []
    for wrap in (False, True):
        with torch.device("meta"), torch.device("cpu"):
            out = pytree_ckpt.checkpoint(_counted, x) if wrap else _counted(x)
        out.sum().backward()
        grads.append(x.grad)
        x.grad = None
    assert torch.equal(*grads)


def test_a_replay_entered_under_another_default_device_runs_under_the_forwards() -> None:
    # Mutant (helper LG): the replay entering the forward's default device only where no
    # mode at all is active (not where another default device is): a replay run outside
    # backward under torch.device("meta") made its tensors there.
    with torch.device("cpu"):
        env = ReplayEnvironment.capture((), preserve_rng=False)
    with torch.device("meta"):
        with env.replaying():
            assert torch.empty(1).device == torch.device("cpu")
        assert torch.empty(1).device == torch.device("meta")


def test_a_replay_puts_the_callers_grad_mode_back() -> None:
    # Mutant (helper LG): Replaying's exit not restoring grad mode: a replay entered under
    # no_grad (enabled for the replay) left grad enabled after it.
    env = ReplayEnvironment.capture((), preserve_rng=True)
    with torch.no_grad():
        with env.replaying():
            assert torch.is_grad_enabled()
        assert not torch.is_grad_enabled()
