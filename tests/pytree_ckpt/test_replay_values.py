"""verify_replay=True: the replay's output values against the original pass's, bit for bit
(NOTE [output prints] in pytree_ckpt/replay_values.py)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pytree_ckpt
from pytree_ckpt import (CheckpointConfigError, ReplayMismatchError,
                         apply_activation_checkpointing, apply_recompute_config,
                         checkpoint_layers, checkpointed)
from pytree_ckpt.replay_values import _print
from tests.conftest import assert_same_grads, grads_of


class Config:
    """A config object the layers share (transformers' ``self.config``)."""

    def __init__(self) -> None:
        self.calls = 0


class Counted(nn.Module):
    """A layer whose output depends on a call counter on a config object the layers share: the
    documented silent case (docs/limits.md, 'State the forward changes'); a counter on the
    layer itself is put back for the replay."""

    def __init__(self, shared: Config, how: str = "scale") -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.config = shared
        self.how = how

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.config.calls += 1
        h = self.lin(x)
        if self.how == "scale":
            h = h * self.config.calls
        elif self.how == "swap rows" and self.config.calls > 1:
            h = h[[1, 0, *range(2, h.shape[0])]]
        elif self.how == "swap columns" and self.config.calls > 1:
            h = h[:, [1, 0, *range(2, h.shape[1])]]
        ids = h.argsort(dim=-1)[:, :2] + self.config.calls  # (shifted, to differ too)
        return {"hidden": h, "ids": ids}


def _step(layer: Callable[..., Any], x: torch.Tensor) -> None:
    out = layer(x)
    out["hidden"].pow(2).sum().backward()


def test_a_forward_reading_a_shared_counter_is_refused_naming_the_output_and_both_sums(
        ) -> None:
    shared = Config()
    layer = Counted(shared)
    x = torch.randn(4, 6, requires_grad=True)
    eager = copy.deepcopy(layer)
    _step(eager, x)
    expected = grads_of([x, *eager.parameters()])
    x.grad = None

    # The premise: without the check the replay reads the counter the forward left, and the
    # gradients differ from eager's with no error.
    shared.calls = 0
    _step(checkpointed(layer), x)
    assert not torch.equal(grads_of([x])[0], expected[0])
    x.grad = None
    layer.zero_grad(set_to_none=True)

    shared.calls = 0
    out = checkpointed(layer, verify_replay=True)(x)
    forward_sum = out["hidden"].double().sum().item()
    with pytest.raises(ReplayMismatchError) as raised:
        out["hidden"].pow(2).sum().backward()
    message = str(raised.value)
    # Both outputs differ (the ids follow the hidden states): the first is named, with a count.
    assert message.startswith("the replay of Counted in backward computed other values than its "
                              "original pass at output['hidden'] (and 1 more output): ")
    assert f"values summing to {forward_sum!r}" in message
    assert f"the replay's, summing to {2 * forward_sum!r}" in message  # the counter doubled
    assert "tip: the forward read something that changed" in message
    assert "torch.use_deterministic_algorithms(True)" in message
    assert x.grad is None and all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("how", ["swap rows", "swap columns"])
def test_a_replay_that_only_reorders_values_is_refused_though_their_sum_is_the_same(
        how: str) -> None:
    shared = Config()
    layer = checkpointed(Counted(shared, how), verify_replay=True)
    out = layer(torch.randn(4, 6, requires_grad=True))
    with pytest.raises(ReplayMismatchError) as raised:
        out["hidden"].sum().backward()
    message = str(raised.value)
    assert "at output['hidden']" in message
    # The values' sums agree to rounding: only the positional sums tell the passes apart.
    summed = [float(part.split("summing to ")[1].split("\n")[0].split(",")[0])
              for part in message.split("expected: ")[1].split("got:")]
    assert summed[0] == pytest.approx(summed[1], rel=1e-12, abs=1e-12)


def test_a_layer_that_computes_from_its_inputs_passes_and_keeps_eager_gradients() -> None:
    # Dropout (the RNG restored), an int output, a bf16 output, a non-contiguous one, a
    # returned input and a non-tensor leaf: every print agrees, the gradients are eager's.
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
            h = self.drop(self.lin(x))
            return {"h": h, "low": h.to(torch.bfloat16), "t": h.t(), "ids": h.argmax(-1),
                    "mask": mask, "n": 3}

    layer = Mixed()
    x = torch.randn(4, 6, requires_grad=True)
    mask = torch.rand(4) > 0.5
    results = []
    for wrap in (lambda m: m, lambda m: checkpointed(m, verify_replay=True)):
        model = copy.deepcopy(layer)
        x.grad = None
        torch.manual_seed(3)
        out = wrap(model)(x, mask)
        (out["h"].sum() + out["low"].float().pow(2).sum() + out["t"][0].sum()).backward(
            retain_graph=True)
        out["h"].sum().backward()  # the replay runs again, against the same prints
        results.append(grads_of([x, *model.parameters()]))
    assert_same_grads(results[0], results[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_bf16_attention_layer_passes_verification_with_eager_gradients() -> None:
    # The original pass runs without grad and the replay with it: on CUDA the attention's
    # kernel choice may depend on that, which would show here as other bits in the replay.
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 192)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.drop(out.transpose(1, 2).reshape(2, 128, 64))

    layer = Attention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for wrap in (lambda m: m, lambda m: checkpointed(m, verify_replay=True)):
        model = copy.deepcopy(layer)
        x.grad = None
        torch.manual_seed(5)
        wrap(model)(x).float().pow(2).sum().backward()
        results.append(grads_of([x, *model.parameters()]))
    assert_same_grads(results[0], results[1])


def test_a_padded_lstm_on_cpu_is_refused_until_onednn_is_off_around_the_forward() -> None:
    # docs/limits.md, "Float rounding and other kernels": oneDNN takes another LSTM kernel
    # under no-grad, so the passes differ in their last bits; the row's way out makes them one.
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    layer = checkpointed(lambda x: lstm(x)[0], verify_replay=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    with pytest.raises(ReplayMismatchError) as raised:
        layer(x).sum().backward()
    message = str(raised.value)
    assert "the passes rounded otherwise: a kernel chosen by grad mode" in message
    summed = [float(part.split("summing to ")[1].split("\n")[0])
              for part in message.split("expected: ")[1].split("got:")]
    assert summed[0] != summed[1] and summed[0] == pytest.approx(summed[1], rel=1e-6)
    results = []
    for run in (lambda t: lstm(t)[0], layer):
        x.grad = None
        lstm.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # oneDNN's TF32 note on builds without an Intel GPU
            with torch.backends.mkldnn.flags(enabled=False):
                y = run(x)
        y.sum().backward()  # checkpointed: passes, and gives eager's gradients
        results.append(grads_of([x, *lstm.parameters()]))
    assert_same_grads(results[0], results[1])


def test_a_batched_backward_compares_the_replay_and_gets_eager_gradients() -> None:
    # The replay runs under the vmap of torch.autograd.grad(..., is_grads_batched=True); its
    # outputs are not batched, so their prints compare as in a plain backward.
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    seeds = torch.eye(12).reshape(12, 3, 4)
    expected, = torch.autograd.grad(layer(x), x, seeds, is_grads_batched=True)
    got, = torch.autograd.grad(checkpointed(layer, verify_replay=True)(x), x, seeds,
                               is_grads_batched=True)
    assert torch.equal(expected, got)


class _Sums(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sums = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func.overloadpacket is torch.ops.aten.sum:
            self.sums += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("verify", [False, True])
def test_the_prints_are_made_only_when_verify_replay_is_on(verify: bool) -> None:
    # One output: its print is three sums (two over the bits, one of the values) in each pass.
    layer = checkpointed(nn.Linear(5, 5), verify_replay=verify)
    x = torch.randn(3, 5, requires_grad=True)
    with _Sums() as counted:
        y = layer(x)
    forward = counted.sums
    with _Sums() as counted:
        y.backward(torch.ones_like(y))
    # A Linear's forward sums nothing; its backward sums the bias's gradient, once.
    assert (forward, counted.sums) == ((3, 4) if verify else (0, 1))


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          *[getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2")
            if hasattr(torch, name)]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_flipped_bit_or_swapped_pair_changes_an_outputs_print(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = (torch.randn(5, 7) * 50).to(dtype) if dtype.is_floating_point or dtype.is_complex \
        else torch.randint(0, 2 if dtype is torch.bool else 100, (5, 7)).to(dtype)
    made = _print(base)
    assert made is not None
    sums = made[0]
    bits_as = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        base.element_size()]
    for row, col in [(0, 0), (4, 6), (2, 3)]:
        flipped = base.clone()
        flipped.view(bits_as)[row, col] ^= 1  # the lowest bit of one element
        other = _print(flipped)
        assert other is not None and not torch.equal(other[0], sums), (row, col)
    # Every swap of two different values, and of two different rows or columns (a bool
    # tensor's rows often have equal sums: weights linear in the place missed those).
    flat = base.reshape(-1)
    swaps = [[*range(i), j, *range(i + 1, j), i, *range(j + 1, 35)]
             for i in range(35) for j in range(i + 1, 35) if not torch.equal(flat[i], flat[j])]
    reordered = [flat[order].reshape(5, 7) for order in swaps]
    reordered += [base[[b, *range(1, b), 0, *range(b + 1, 5)]] for b in range(1, 5)]
    reordered += [base[:, [b, *range(1, b), 0, *range(b + 1, 7)]] for b in range(1, 7)]
    assert len(swaps) > 100
    for swapped in reordered:
        if not torch.equal(swapped, base):
            other = _print(swapped)
            assert other is not None and not torch.equal(other[0], sums)
    # Strides do not matter, only values in their places.
    transposed = _print(base.t())
    copied = _print(base.t().contiguous())
    assert transposed is not None and copied is not None
    assert torch.equal(transposed[0], copied[0])


def test_an_output_weighted_in_chunks_has_the_print_it_has_in_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytree_ckpt import replay_values

    t = torch.randn(5, 7)
    whole = _print(t)
    monkeypatch.setattr(replay_values, "_CHUNK", 6)  # 35 elements: six chunks, one short
    chunked = _print(t)
    assert whole is not None and chunked is not None
    assert torch.equal(whole[0], chunked[0])
    swapped = t.reshape(-1)[[*range(5), 6, 5, *range(7, 35)]].reshape(5, 7)  # across chunks
    other = _print(swapped)
    assert other is not None and not torch.equal(other[0], chunked[0])


@pytest.mark.parametrize("shape", [(), (0, 3), (3, 0), (2, 0, 4)])
def test_empty_and_zero_dimensional_outputs_have_prints(shape: tuple[int, ...]) -> None:
    made = _print(torch.ones(shape))
    assert made is not None and made[0].shape == (2,)


class Tagged(torch.Tensor):
    pass


def test_an_output_that_cannot_be_printed_is_named_in_a_warning_and_the_rest_compared(
        ) -> None:
    shared = Config()

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shared.calls += 1
        y = x * 2
        return y.as_subclass(Tagged), y * shared.calls

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning) as caught:
        out = checkpointed(fn, verify_replay=True)(x)
    messages = [str(w.message) for w in caught]
    assert any("output[0] (Tagged, torch.strided, torch.float32) not compared" in m
               for m in messages), messages
    with pytest.raises(ReplayMismatchError, match=r"at output\[1\]: "):
        (out[0].sum() + out[1].sum()).backward()


def test_a_replay_returning_another_kind_of_tensor_is_refused_naming_it() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y.as_subclass(Tagged) if pytree_ckpt.current_phase() == "recompute" else y

    out = checkpointed(fn, verify_replay=True)(torch.randn(3, requires_grad=True))
    with pytest.raises(ReplayMismatchError) as raised:
        out.sum().backward()
    message = str(raised.value)
    assert "returned another kind of tensor than its original pass at output," in message
    assert "got:      Tagged of layout torch.strided" in message


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "checkpointed": lambda value: checkpointed(nn.Linear(2, 2), verify_replay=value),
    "apply_activation_checkpointing": lambda value: apply_activation_checkpointing(
        nn.Linear(2, 2), verify_replay=value),
    "checkpoint_layers": lambda value: checkpoint_layers([nn.Linear(2, 2)],
                                                         verify_replay=value),
    "apply_recompute_config": lambda value: apply_recompute_config(
        [nn.Linear(2, 2)], pytree_ckpt.RecomputeConfig(1.0), {}, verify_replay=value),
}


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_verify_replay_takes_a_bool_at_every_entry_point(where: str) -> None:
    with pytest.raises(CheckpointConfigError) as raised:
        ENTRY_POINTS[where](1)
    assert "verify_replay takes a bool" in str(raised.value)
    assert "verify_replay=False (the default)" in str(raised.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ENTRY_POINTS[where](True)


@pytest.mark.parametrize("where", ["checkpoint_layers", "apply_recompute_config"])
def test_every_layer_a_list_entry_point_wraps_verifies_its_replay(where: str) -> None:
    shared = Config()
    layers = nn.ModuleList([Counted(shared), Counted(shared)])
    if where == "checkpoint_layers":
        checkpoint_layers(layers, verify_replay=True)
    else:
        apply_recompute_config(layers, pytree_ckpt.RecomputeConfig(1.0), {}, verify_replay=True)
    out = layers[1](layers[0](torch.randn(2, 6, requires_grad=True))["hidden"])
    # The last layer's replay runs first: the counter stands at 2 there, 4 in its replay.
    with pytest.raises(ReplayMismatchError, match="summing to"):
        out["hidden"].sum().backward()


def test_applying_again_with_another_verify_replay_names_the_option() -> None:
    layer = nn.Linear(2, 2)
    apply_activation_checkpointing(layer, verify_replay=True)
    apply_activation_checkpointing(layer, verify_replay=True)  # the same options: a no-op
    with pytest.raises(CheckpointConfigError) as raised:
        apply_activation_checkpointing(layer)
    message = str(raised.value)
    assert "verify_replay differs" in message
    assert "expected: as installed: verify_replay=True" in message
    assert "got:      as requested now: verify_replay=False" in message


def test_torchs_determinism_check_names_verify_replay_as_its_replacement() -> None:
    with pytest.raises(CheckpointConfigError) as raised:
        apply_activation_checkpointing(nn.Linear(2, 2), determinism_check="default")
    assert "pass verify_replay=True to compare their values too" in str(raised.value)


# ------------------------------------------------------- the silent rows of docs/limits.md

class _Cfg:
    def __init__(self) -> None:
        self.scale = 1.0


SETTINGS = _Cfg()  # a global setting the forward reads


class _Layer(nn.Module):
    def __init__(self, body: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.body = body

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return self.body(self.lin(x), *rest)


class _DoubleLinear(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


def _plain_object_input(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    cfg = _Cfg()
    layer = _Layer(lambda h, c: h * c.scale)
    y = wrap(layer)(x, cfg)
    cfg.scale = 0.5  # "a plain object input whose ... attributes change before backward"
    return layer, y


def _inference_input_changed(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    with torch.inference_mode():
        table = torch.ones(4)
    layer = _Layer(lambda h, t: (h + t).tanh())  # (h * t would save the inference tensor)
    y = wrap(layer)(x, table)
    with torch.inference_mode():
        table.mul_(3)  # no version counter: nothing else can tell
    return layer, y


def _global_changed(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    SETTINGS.scale = 1.0
    layer = _Layer(lambda h: h * SETTINGS.scale)
    y = wrap(layer)(x)
    SETTINGS.scale = 2.0  # "state a call reads without changing it, changed before backward"
    return layer, y


def _unreached_generator(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    gen = torch.Generator().manual_seed(0)  # the body's closure holds it: the replay draws on
    layer = _Layer(lambda h: h * torch.rand(h.shape, generator=gen))
    return layer, wrap(layer)(x)


def _grad_mode_branch(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    layer = _Layer(lambda h: h * 2 if torch.is_grad_enabled() else h)
    return layer, wrap(layer)(x)


def _mode_around_the_forward(wrap: Callable[[Any], Any], x: torch.Tensor) -> Any:
    layer = _Layer(lambda h: h)
    with _DoubleLinear():
        y = wrap(layer)(x)
    return layer, y


@pytest.mark.parametrize("case", [_plain_object_input, _inference_input_changed,
                                  _global_changed, _unreached_generator, _grad_mode_branch,
                                  _mode_around_the_forward], ids=lambda case: case.__name__[1:])
def test_silent_rows_of_the_limits_page_that_change_the_output_are_refused(
        case: Callable[..., Any]) -> None:
    # Each is a row of docs/limits.md marked silent; the limits page says verify_replay finds
    # the rows whose replay computes other outputs than the forward.
    results = []
    x0 = torch.randn(3, 4)
    for wrap in (lambda m: m, checkpointed):
        x = x0.clone().requires_grad_()
        layer, y = case(wrap, x)
        y.pow(2).sum().backward()
        results.append(grads_of([x, *layer.parameters()]))
    # The premise: unchecked, the gradients differ from eager's with no error.
    assert any(not torch.equal(a, b) for a, b in zip(*results) if a is not None)
    x = torch.randn(3, 4, requires_grad=True)
    layer, y = case(lambda m: checkpointed(m, verify_replay=True), x)
    with pytest.raises(ReplayMismatchError, match="computed other values than its original"):
        y.pow(2).sum().backward()
