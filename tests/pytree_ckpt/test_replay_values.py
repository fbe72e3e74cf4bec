"""verify_replay=True: the replay's output values against the original pass's, bit for bit
(NOTE [output prints] in pytree_ckpt/replay_values.py)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
    assert "tip: most likely the forward read something that changed" in message
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
    # One output: its print is five sums (two over the bits; the finite values', their
    # absolute values' and the count of the others, for the message) in each pass.
    layer = checkpointed(nn.Linear(5, 5), verify_replay=verify)
    x = torch.randn(3, 5, requires_grad=True)
    with _Sums() as counted:
        y = layer(x)
    forward = counted.sums
    with _Sums() as counted:
        y.backward(torch.ones_like(y))
    # A Linear's forward sums nothing; its backward sums the bias's gradient, once. At a first
    # call each parameter is summed once more (NOTE [a parameter written through .data]).
    assert (forward - 2, counted.sums) == ((5, 6) if verify else (0, 1))


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


# ------------------------------------------------------------- helper GR's review

class _ScaledRouter(nn.Module):
    """A router whose logits read a counter on a shared config object (the silent case)."""

    def __init__(self, shared: Config) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 3)
        self.config = shared

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.config.calls += 1
        return self.gate(h) * self.config.calls


class _Routed(nn.Module):
    def __init__(self, shared: Config) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.router = _ScaledRouter(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ids = self.router(h).argmax(-1)  # positive scale: the same ids in both passes
        return h * (ids.unsqueeze(-1) + 1)


def test_a_hooked_output_whose_replay_differs_is_refused() -> None:
    # A forward hook keeping the router's logits as they are (the transformers router_logits
    # pattern, which the hooks warning calls fine) makes them extra outputs of the boundary
    # (NOTE [hooked outputs leave with gradients]): the aux loss built from them backpropagates
    # through the replay. Here the logits read a shared counter, so the replay's are twice the
    # forward's; the layer's own output does not see it (argmax of a positive scaling). Its
    # print agrees, the hooked tensor has none, and the gradients differ from eager's with no
    # error. Cause: OutputPrints.of / check get the flat outputs only, not the hooked extra
    # tensors (boundary_function.py's `extra`, recompute.py's `hooked_outputs.replayed`).
    def step(wrap: Callable[[nn.Module], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        layer = _Routed(Config())
        kept: list[torch.Tensor] = []
        layer.router.register_forward_hook(lambda module, args, out: kept.append(out))
        x = torch.randn(4, 6, requires_grad=True)
        out = wrap(layer)(x)
        (out.sum() + kept[0].pow(2).sum()).backward()
        return grads_of([x, *layer.parameters()])

    expected = step(lambda layer: layer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pytree_ckpt: forward hooks inside")
        unchecked = step(checkpointed)  # the premise: other gradients, no error
        assert any(not torch.equal(a, b) for a, b in zip(expected, unchecked) if a is not None)
        with pytest.raises(ReplayMismatchError) as raised:
            step(lambda layer: checkpointed(layer, verify_replay=True))
    assert "at output of submodule 'router' (kept by a forward hook): " in str(raised.value)


def test_a_float64_output_negated_in_the_replay_is_refused() -> None:
    # A float64 read as int64 has its sign bit at 2**63: flipping it moves the element by
    # 2**63, which is -2**63 modulo 2**64, so an even number of flips leaves the plain sum as it
    # was, and the weighted one too whenever the flipped places' weights sum to an even number
    # (half of all cases: here the 24 places of a (4, 6) output, and any two places whose
    # weights have the same parity). A layer whose sign reads a shared counter then keeps the
    # wrong gradients. Fix: read 8-byte elements as two int32 halves (no sum of them wraps).
    shared = Config()

    class Flipped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shared.calls += 1
            return self.lin(x) * (-1) ** shared.calls

    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out = checkpointed(Flipped(), verify_replay=True)(x)
    with pytest.raises(ReplayMismatchError, match="other values"):
        out.pow(3).sum().backward()


def test_a_kept_op_whose_inputs_differ_in_the_replay_is_refused() -> None:
    # docs/save_units.md's Window with a shared counter in place of the width: the replay's q is
    # twice the forward's, of the same shape, so the save unit's own check (shapes, dtypes)
    # hands each bmm its record; both products are the forward's, and so is the output, whose
    # print agrees. The first bmm's backward then takes the replay's q, and the gradients are
    # not eager's, with no error. A print of each kept op's tensor arguments at its record,
    # compared where the replay is handed it, would see it (the layer's output cannot).
    class Window(nn.Module):
        def __init__(self, shared: Config) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.config = shared

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            self.config.calls += 1
            q = self.proj(h) * self.config.calls
            return h + (q @ q.transpose(-1, -2)).softmax(-1) @ h

    def step(checked: bool | None) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        window = Window(Config())
        if checked is not None:
            apply_recompute_config([window], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                                   {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::bmm")},
                                   verify_replay=checked)
        x = torch.randn(2, 8, 32, requires_grad=True)
        window(x).pow(2).sum().backward()
        return grads_of([x, *window.parameters()])

    expected = step(None)
    # The premise: unchecked, the output agrees and the gradients do not, with no error.
    assert any(not torch.equal(a, b) for a, b in zip(expected, step(False)) if a is not None)
    with pytest.raises(ReplayMismatchError) as raised:
        step(True)
    message = str(raised.value)
    assert "called aten.bmm.default, which a save unit keeps, on other values than its " \
        "original pass did (tensor argument 1 of 2, in call order)" in message


def test_a_complex_outputs_message_shows_its_complex_sum() -> None:
    # _print takes view_as_real before the value sum, so the message's "summing to" adds the
    # real and imaginary parts into one real number, which is no sum of the output's values
    # (and can be equal in both passes where the values are not). Fix: sum the complex
    # tensor itself (complex128) for the message, the bits over view_as_real as now.
    shared = Config()

    def fn(x: torch.Tensor) -> torch.Tensor:
        shared.calls += 1
        y = x * shared.calls
        return torch.complex(y, -2 * y)

    x = torch.tensor([1.0, 0.5, 0.75], requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    assert complex(out.sum().item()) == complex(2.25, -4.5)
    with pytest.raises(ReplayMismatchError) as raised:
        out.real.sum().backward()
    message = str(raised.value)
    assert "values summing to (2.25-4.5j)" in message, message
    assert "the replay's, summing to (4.5-9j)" in message, message


def test_an_output_with_uninitialized_padding_is_refused_naming_that_memory() -> None:
    # A dispatch that pads to a capacity with new_empty and writes the tokens' rows only (the
    # rest never read: eager's gradients are right) returns other garbage in the replay, and
    # verify_replay=True refuses it, rightly bit for bit, but the message shows "summing to
    # nan" or 1e24 against the forward's and sends the user to a shared counter. Under
    # torch.use_deterministic_algorithms(True) torch fills such memory with NaN in both passes
    # and the layer passes: the tip could say so. (The garbage is whatever the allocator hands
    # out: tried a few times, as it may be the same twice.)
    def dispatch(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(2 * x.shape[0], x.shape[1])
        out[:x.shape[0]] = x * 2
        return out

    for _ in range(5):
        x = torch.randn(16, 8, requires_grad=True)
        torch.full((32, 8), 7.0)  # freed: the forward's padding likely holds these bits
        out = checkpointed(dispatch, verify_replay=True)(x)
        torch.full((32, 8), 9.0)  # and the replay's these
        try:
            out[:16].sum().backward()
        except ReplayMismatchError as raised:
            message = str(raised)
            break
    else:
        pytest.skip("the allocator handed out the same bits in both passes")
    tip = message.split("tip: ")[1]  # the message names fn, whose path holds this test's name
    assert "uninitialized" in tip or "fill_uninitialized_memory" in tip, message


def test_a_random_layer_without_preserved_rng_is_told_the_option_is_the_cause() -> None:
    # preserve_rng_state=False (an option of the same call) lets the replay draw another
    # dropout mask: verify_replay=True rightly refuses it, but the tip names a shared counter
    # or atomic adds on CUDA. The boundary knows its own options: the tip could say that
    # random ops draw other numbers in the replay without preserve_rng_state=True (default).
    layer = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    x = torch.randn(4, 6, requires_grad=True)
    out = checkpointed(layer, preserve_rng_state=False, verify_replay=True)(x)
    with pytest.raises(ReplayMismatchError) as raised:
        out.sum().backward()
    assert "preserve_rng_state" in str(raised.value), str(raised.value)


@pytest.mark.parametrize("train", [True, False])
def test_torchs_layers_with_fast_paths_and_running_stats_pass_with_eager_gradients(
        train: bool) -> None:
    # nn.TransformerEncoderLayer would take its fused fast path under no-grad in eval mode (the
    # original pass's mode; the boundary keeps it off), BatchNorm updates its running stats,
    # and a nested checkpointed layer is replayed inside the replay: none of them makes
    # verify_replay=True refuse, and the gradients are eager's. (Not an Embedding with
    # max_norm: its replay renormalises the weight again, which is not idempotent in about
    # one draw in eight, and is rightly refused then; the boundary warns about it.)
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
            self.norm = nn.BatchNorm1d(5)
            self.inner = apply_activation_checkpointing(
                nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2)), verify_replay=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.norm(self.enc(x * 2)))  # x * 2: no grad in the first pass

    torch.manual_seed(0)
    layer = Stack().train(train)
    x = torch.randn(3, 5, 16, requires_grad=True)
    results = []
    for wrap in (lambda m: m, lambda m: checkpointed(m, verify_replay=True)):
        model = copy.deepcopy(layer)
        x.grad = None
        torch.manual_seed(1)
        wrap(model)(x).pow(2).sum().backward()
        results.append(grads_of([x, *model.parameters()]))
    assert_same_grads(results[0], results[1])


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


# ------------------------------------------------------------------ broadcast outputs

def test_a_broadcast_output_is_printed_by_the_one_slice_it_repeats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A mask expanded to (batch, heads, tokens, tokens) was copied whole for its print (about
    # 1 GiB and 28 s for a 2048-token mask: helper GR); its stride-0 dimensions repeat one slice.
    from pytree_ckpt import replay_values

    printed: list[int] = []
    original = replay_values._print

    def counted(t: torch.Tensor) -> Any:
        printed.append(t.numel())
        return original(t)

    monkeypatch.setattr(replay_values, "_print", counted)
    mask = torch.rand(1, 1, 16, 16) > 0.5

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, mask.expand(4, 8, 16, 16)

    x = torch.randn(3, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    out[0].sum().backward()
    assert printed == [3, 16 * 16] * 2  # each pass: the float output, then the mask's slice


@pytest.mark.parametrize("varies", [False, True])
def test_a_replay_materializing_a_broadcast_output_is_compared_along_its_repeats(
        varies: bool) -> None:
    base = torch.randn(1, 5)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pytree_ckpt.current_phase() != "recompute":
            return x * 2, base.expand(4, 5)
        made = base.repeat(4, 1)  # the same values, materialized ...
        if varies:
            made[2, 1] += 1  # ... or one place that differs from the slice the forward repeated
        return x * 2, made

    x = torch.randn(3, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    if not varies:
        out[0].sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
        return
    with pytest.raises(ReplayMismatchError) as raised:
        out[0].sum().backward()
    message = str(raised.value)
    assert "at output[1]" in message
    assert "expected: the forward's output[1], broadcast along dimension(s) [0]" in message


def test_kept_ops_arguments_are_printed_only_under_verify_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytree_ckpt import keep, replay_values

    calls: list[int] = []
    original = replay_values.arguments_print

    def counted(tensors: Any, **options: Any) -> Any:
        calls.append(len(tensors))
        return original(tensors, **options)

    monkeypatch.setattr(keep, "arguments_print", counted)  # the record's
    monkeypatch.setattr(replay_values, "arguments_print", counted)  # the replay's
    for verify in (False, True):
        calls.clear()
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))]
        apply_recompute_config(layers, pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                               {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::addmm")},
                               verify_replay=verify)
        layers[0](torch.randn(2, 4, requires_grad=True)).sum().backward()
        # Two kept addmm calls, each with three tensor arguments: printed at the record and
        # where the replay takes it.
        assert calls == ([3, 3, 3, 3] if verify else [])


# ------------------------------------------------------------------- output discard

class _ScaledNorm(nn.Module):
    """A norm whose output reads a global setting (the silent case, in a discarded op)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * SETTINGS.scale


def _discard_step(make: Callable[[], Any] | None) -> list[torch.Tensor | None]:
    """One step of a norm (discarded unless ``make`` is None) feeding a projection, with the
    setting changed between forward and backward."""
    torch.manual_seed(0)
    norm, proj = _ScaledNorm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    SETTINGS.scale = 1.0
    if make is None:
        out = proj(norm(x))
    else:
        ckpt = make()
        out = proj(ckpt.checkpoint(norm, x))
        ckpt.discard_output_and_register_recompute(out)
    SETTINGS.scale = 3.0
    out.pow(2).sum().backward()
    return grads_of([x, *norm.parameters(), *proj.parameters()])


def test_an_output_discard_whose_rebuild_differs_is_refused_under_verify_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SETTINGS, "scale", 1.0)  # put back after the test
    expected = _discard_step(None)
    # The premise: the rebuild reads the changed setting, and the gradients differ silently.
    unchecked = _discard_step(pytree_ckpt.CheckpointWithoutOutput)
    assert any(not torch.equal(a, b) for a, b in zip(expected, unchecked) if a is not None)
    with pytest.raises(ReplayMismatchError) as raised:
        _discard_step(lambda: pytree_ckpt.CheckpointWithoutOutput(verify_replay=True))
    message = str(raised.value)
    assert message.startswith("the replay of _ScaledNorm in backward computed other values "
                              "than its original pass at output: ")


class _Unified:
    """A manager's checkpoint, discarded through the manager (its unified hook)."""

    def __init__(self, **options: Any) -> None:
        self.manager = pytree_ckpt.CheckpointWithoutOutputManager(**options)

    def checkpoint(self, fn: Any, *args: Any) -> Any:
        return self.manager.checkpoint(fn, *args)

    def discard_output_and_register_recompute(self, hook: torch.Tensor) -> None:
        self.manager.discard_all_outputs_and_register_unified_recompute(hook)


def test_a_discard_managers_checkpoints_verify_their_rebuilds_and_pass_when_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SETTINGS, "scale", 1.0)  # put back after the test
    with pytest.raises(ReplayMismatchError, match="other values than its original pass"):
        _discard_step(lambda: _Unified(verify_replay=True))
    # A correct op (the setting not read) passes, with the gradients of the unchecked run.
    monkeypatch.setattr(_ScaledNorm, "forward", lambda self, x: self.norm(x))
    assert_same_grads(_discard_step(lambda: _Unified()),
                      _discard_step(lambda: _Unified(verify_replay=True)))
    with pytest.raises(CheckpointConfigError, match="verify_replay takes a bool"):
        pytree_ckpt.CheckpointWithoutOutputManager(verify_replay="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------- helper GS's review

def _sparse_coo(y: torch.Tensor) -> torch.Tensor:
    return y.detach().to_sparse()


def _sparse_csr(y: torch.Tensor) -> torch.Tensor:
    return y.detach().to_sparse_csr()


def _mkldnn(y: torch.Tensor) -> torch.Tensor:
    return y.detach().to_mkldnn()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's own
@pytest.mark.parametrize("make", [_sparse_coo, _sparse_csr, _mkldnn],
                         ids=lambda make: make.__name__[1:])
def test_an_output_of_another_layout_is_not_a_crash_of_the_forward(
        make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    # Guards against (helper GS) _broadcast_dims reading the strides of a tensor of another
    # layout: a sparse COO tensor reports (0, 0), so _slice narrowed it (aten::as_strided,
    # which SparseCPU lacks), a CSR one raised "Sparse CSR tensors do not have strides", and
    # mkldnn has no as_strided either: the forward crashed where it should warn. The mkldnn
    # output is named in the warning; sparse ones are compared by their parts (helper HA).
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, make(y)

    x = torch.randn(3, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpointed(fn, verify_replay=True)(x)
    told = [str(w.message) for w in caught if "verify_replay" in str(w.message)]
    if make is _mkldnn:
        assert len(told) == 1 and "output[1] (Tensor, torch._mkldnn, torch.float32) not " \
            "compared" in told[0], told
    else:
        assert told == []
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), 2.0))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's own
@pytest.mark.parametrize("make", [_sparse_coo, _sparse_csr], ids=lambda make: make.__name__[1:])
def test_a_sparse_output_scaled_by_a_shared_counter_is_refused_naming_it(
        make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    # NOTE [sparse tensors are printed by their parts]: a sparse output was only named in a
    # warning (helper HA found the same for a kept op's sparse argument, which passed with
    # half of eager's gradients). Its indices and values are printed now: the counter's
    # change is refused at output[1], and the unchanged twin passes.
    for changing in (False, True):
        shared = Config()

        def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shared.calls += 1
            y = x * 2
            return y, make(y / (shared.calls if changing else 1))

        out = checkpointed(fn, verify_replay=True)(torch.randn(3, 4, requires_grad=True))
        if not changing:
            out[0].sum().backward()
            continue
        with pytest.raises(ReplayMismatchError, match=r"original pass at output\[1\]: "):
            out[0].sum().backward()


def test_a_kept_op_taking_a_sparse_argument_passes_verification() -> None:
    # A graph convolution, torch.sparse.mm(adj, h), dispatches aten._sparse_addmm(zeros, adj,
    # h): kept by a save unit, its record prints its tensor arguments. Guards against (helper
    # GS) the sparse adj's strides, (0, 0), read as broadcast dimensions and narrowed: a crash
    # in the forward. It is printed by its indices and values (NOTE [sparse tensors are
    # printed by their parts]).
    class Graph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(adj, self.lin(x)).relu()

    def step(verify: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        layer = Graph()
        apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
            pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::_sparse_addmm")},
            verify_replay=verify)
        x = torch.randn(5, 4, requires_grad=True)
        adj = (torch.rand(5, 5) > 0.5).float().to_sparse()
        layer(x, adj).pow(2).sum().backward()
        return grads_of([x, *layer.parameters()])

    assert_same_grads(step(False), step(True))


class _Permute(nn.Module):
    """MoE-style dispatch: tokens sorted by expert with a functional scatter into an empty
    buffer whose every row the scatter writes (its output holds no uninitialized memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.gate(x).argmax(-1).argsort(stable=True)
        dest = torch.empty_like(order).scatter(0, order, torch.arange(len(order)))
        h = self.up(x)
        return torch.scatter(torch.empty_like(h), 0, dest.unsqueeze(-1).expand_as(h), h).tanh()


def test_a_kept_op_on_an_empty_buffer_it_fills_is_not_sent_to_a_shared_counter() -> None:
    # The scatter's output is the same in both passes, and so are the gradients (scatter's
    # backward never reads `self`): the output check passes. Kept by a save unit, its first
    # argument, the empty buffer, holds other garbage in each pass, and check_arguments refuses
    # it (it cannot know which arguments the op's backward reads). Guards against (helper GS)
    # a tip naming only a shared counter and rounding: it names the uninitialized buffer and
    # torch.use_deterministic_algorithms(True), which makes this layer pass (torch fills new
    # memory with NaN in both passes). (The garbage is whatever the allocator hands out: tried
    # a few times.)
    kept = {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::scatter.src")}
    for _ in range(5):
        torch.manual_seed(0)
        layer = _Permute()
        apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), kept,
                               verify_replay=True)
        x = torch.randn(64, 8, requires_grad=True)
        out = layer(x)
        torch.full((64, 8), 7.0), torch.full((64, 8), 9.0)  # freed: other bits for the replay
        try:
            out.pow(2).sum().backward()
        except ReplayMismatchError as raised:
            message = str(raised)
            break
    else:
        pytest.skip("the allocator handed out the same bits in both passes")
    assert "aten.scatter.src" in message
    tip = message.split("tip: ")[1]
    assert "uninitialized" in tip, message


class _ConjOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).conj()  # a conjugate view: torch sets the conj bit, copies nothing


class _ConjArgument(_ConjOut):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.conj()).abs()  # mm's second argument has the conj bit


@pytest.mark.parametrize("kind", [_ConjOut, _ConjArgument], ids=["output", "kept_argument"])
def test_a_conjugate_view_is_printed_not_a_crash(kind: type[nn.Module]) -> None:
    # Guards against (helper GS) torch.view_as_real(t) of a conjugate view ("view_as_real
    # doesn't work on unresolved conjugated tensors"): a layer returning z.conj() failed its
    # forward under verify_replay=True, and so did a save unit keeping aten::mm called on
    # w.conj(). _print resolves the conjugate (a copy only where the bit is set) and a negative
    # view (z.conj().imag, which t.view(int32) refused: "not compared", wrongly).
    def step(verify: bool | None) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        layer = kind()
        if verify is not None:
            apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
                pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::mm")}, verify_replay=verify)
        x = torch.randn(2, 4, dtype=torch.complex64, requires_grad=True)
        layer(x).abs().pow(2).sum().backward()
        return grads_of([x, *layer.parameters()])

    assert_same_grads(step(None), step(True))


def test_a_kept_ops_arguments_on_two_devices_are_printed() -> None:
    # torch lets a 0-dim CPU tensor join a CUDA op (x * torch.tensor(0.5), torch.where(mask,
    # scores, torch.tensor(-inf)), lerp's weight): the kept op's arguments then live on two
    # devices. Guards against (helper GS) arguments_print stacking rows made on each tensor's
    # device ("Expected all tensors to be on the same device" at the record, in the forward).
    # No CUDA here: the meta device stands in for it, as torch lets a CPU scalar tensor join a
    # meta op too.
    from pytree_ckpt.replay_values import arguments_print

    scores = torch.ones(2, 3, device="meta")
    fill = torch.tensor(float("-inf"))
    assert (scores * fill).device.type == "meta"  # the op itself accepts the pair
    with pytest.warns(UserWarning, match=r"tensor argument 1 of 2 \(Tensor, torch.strided, "
                      r"torch.float32, meta\) not compared"):  # a meta tensor has no values
        made = arguments_print([scores, fill], op=torch.ops.aten.mul.Tensor, fn="a layer")
    assert made is not None and made.shape == (2, 2)


@pytest.mark.parametrize("case", ["nan repeated", "signed zero"])
def test_a_materialized_broadcast_output_is_compared_along_its_repeats_bit_for_bit(
        case: str) -> None:
    # The forward returns a slice broadcast (stride 0), the replay the same slice materialized
    # (_repeats). Guards against (helper GS) comparing values with torch.equal: NaN is unequal
    # to itself, so a replay repeating a NaN exactly was refused, and -0.0 equals 0.0, so a
    # repeat holding -0.0 where the slice has 0.0 passed (copysign, atan2 and 1/x see the
    # sign). The bits are compared.
    value = float("nan") if case == "nan repeated" else 0.0
    base = torch.tensor([[1.0, value, 2.0]])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pytree_ckpt.current_phase() != "recompute":
            return x * 2, base.expand(4, 3)
        made = base.repeat(4, 1)
        if case == "signed zero":
            made[2, 1] = -0.0
        return x * 2, made

    x = torch.randn(3, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    if case == "nan repeated":
        out[0].sum().backward()  # the same bits in every repeat: passes
        assert torch.equal(x.grad, torch.full((3,), 2.0))
    else:
        with pytest.raises(ReplayMismatchError, match=r"at output\[1\]"):
            out[0].sum().backward()


class _Gate(nn.Module):
    """A gate called twice per forward; only the second call reads the shared counter."""

    def __init__(self, shared: Config) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)
        self.config = shared

    def forward(self, h: torch.Tensor, counted: bool) -> torch.Tensor:
        self.config.calls += 1
        return self.proj(h) * (self.config.calls if counted else 1)


class _TwiceGated(nn.Module):
    def __init__(self, shared: Config) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gate = _Gate(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ids = self.gate(h, False).argmax(-1) + self.gate(h, True).argmax(-1)
        return h * (ids.unsqueeze(-1) + 1)


def test_a_hooked_output_that_differs_is_named_with_its_call_of_the_module() -> None:
    # The gate runs twice in the layer; a hook keeps both outputs (two extra outputs of the
    # boundary). Only the second call's differs in the replay. Guards against (helper GS) a
    # message naming both calls alike: the call's number among the module's calls is named.
    layer = _TwiceGated(Config())
    kept: list[torch.Tensor] = []
    layer.gate.register_forward_hook(lambda module, args, out: kept.append(out))
    x = torch.randn(4, 6, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pytree_ckpt: forward hooks inside")
        out = checkpointed(layer, verify_replay=True)(x)
        with pytest.raises(ReplayMismatchError) as raised:
            (out.sum() + kept[1].pow(2).sum()).backward()
    message = str(raised.value)
    assert "at output of submodule 'gate' (kept by a forward hook, call 2 of 2)" in message
    assert "(and " not in message.split("\n")[0]


def test_a_residual_stream_plan_verifies_each_blocks_rebuilds_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Megatron-Core's plan builds the managers itself: the option reaches them through it.
    monkeypatch.setattr(SETTINGS, "scale", 1.0)

    def step(verify: bool | None) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        norms = nn.ModuleList(_ScaledNorm() for _ in range(2))
        h = torch.randn(4, 8, requires_grad=True)
        if verify is None:  # eager
            for norm in norms:
                h = h + norm(h).tanh()
        else:
            plan = pytree_ckpt.build_residual_stream_recompute_plan(2, 2, verify_replay=verify)
            assert all(ctx.manager.verify_replay is verify for ctx in plan)
            for ctx, norm in zip(plan, norms):
                h = h + ctx.checkpoint(norm, h).tanh()
                ctx.finalize(h)
        SETTINGS.scale = 2.0
        h.sum().backward()
        SETTINGS.scale = 1.0
        return grads_of(list(norms.parameters()))

    # Unchecked, the rebuild reads the changed setting: other gradients, no error.
    assert any(not torch.equal(a, b) for a, b in zip(step(None), step(False)))
    with pytest.raises(ReplayMismatchError, match="other values than its original pass"):
        step(True)
    with pytest.raises(CheckpointConfigError, match="verify_replay takes a bool"):
        pytree_ckpt.build_residual_stream_recompute_plan(2, 1, verify_replay=None)  # type: ignore


def test_verify_replay_given_to_checkpoint_is_not_swallowed_by_a_forward_taking_kwargs() -> None:
    # The README lists verify_replay beside checkpoint(fn, *args, **kwargs), and a user tries it
    # there. checkpoint passes every keyword to fn; a transformers decoder layer's forward
    # takes **kwargs. Guards against (helper GU) the option vanishing there unreported: as for
    # torch's options, checkpoint warns, naming checkpointed(fn, verify_replay=True).
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return self.lin(x)

    x = torch.randn(3, 6, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pytree_ckpt.checkpoint(Layer(), x, verify_replay=True).sum().backward()
        except CheckpointConfigError as error:
            told = str(error)
        else:
            told = " ".join(str(w.message) for w in caught)
    assert "verify_replay" in told and "checkpointed" in told


def _largest_block(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, /, *,
                   besides: str = "") -> tuple[torch.Tensor, int]:
    """``checkpointed(fn, verify_replay=True)(x)`` and the largest CPU block its call took (as
    the profiler records allocations), but those of the op named ``besides``."""
    from torch.profiler import ProfilerActivity, profile

    layer = checkpointed(fn, verify_replay=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's, about blocks made before it started
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = layer(x)
    return y, max(e.self_cpu_memory_usage for e in prof.events() if e.name != besides)


def test_the_prints_of_a_large_output_allocate_no_temporary_larger_than_the_output() -> None:
    # Guards against (helper GU) the sums kept for the message, t.sum(dtype=float64) and
    # t.abs().sum(dtype=float64), copying the whole output to float64 (torch casts a
    # reduction's input to its dtype first) and taking a full abs() copy, in each pass: a
    # 128 MiB bf16 output raised the process's peak by about 620 MiB on CPU (the replay's, in
    # backward, where memory peaks). They go a chunk at a time, with the bit sums. Seen through
    # the CPU allocator as the profiler records it: the call's largest allocation.
    x = torch.randn(8, 1024, 1024).to(torch.bfloat16).requires_grad_()  # 16 MiB
    y, largest = _largest_block(lambda x: x * 2, x)
    assert largest <= max(y.nbytes, 8 << 20), f"{largest >> 20} MiB for {y.nbytes >> 20} MiB"


# Two places of a 2**20-element output whose pseudo-random weights agree modulo 2**33 (found by
# sorting _weights(0, 2**20) & (2**33 - 1): 74 such pairs; this is the first): weights linear in
# the bits could not tell a value and its negation swapped between them.
_COLLIDING = (188986, 716671)


def test_a_replay_that_swaps_a_value_and_its_negation_is_refused() -> None:
    # An fp32 x and -x differ in the sign bit only, 2**31 as an int32, so swapping them leaves
    # the plain sum as it was. Guards against (helper GU) a weighted sum linear in the bits,
    # which moved by 2**31 * (w_i - w_j): zero modulo 2**64 wherever w_i and w_j agreed in
    # their low 33 bits, about 74 place pairs of an output of 2**20 elements (a 4 MiB hidden
    # state). Each element's bits are hashed with its place now. Here a global sign table
    # (state the forward reads) changes before backward.
    i, j = _COLLIDING
    sign = torch.ones(1 << 20)
    layer = checkpointed(lambda x: x * sign, verify_replay=True)
    x = torch.zeros(1 << 20)
    x[i], x[j] = 1.0, -1.0
    x.requires_grad_()
    y = layer(x)
    sign[i] = sign[j] = -1.0  # the replay's output swaps the two values; its gradient differs
    with pytest.raises(ReplayMismatchError):
        (y * torch.arange(1 << 20)).sum().backward()


def test_the_tip_for_a_mode_the_replay_runs_without_names_modes() -> None:
    # docs/limits.md's row on a TorchFunctionMode entered around the forward (a fake
    # quantization) says verify_replay finds it. Guards against (helper GU) a tip that named
    # only shared state, rounding and uninitialized memory, and pointed at 'State the forward
    # changes', not at 'Random numbers and modes around the call', whose fix (enter the mode
    # inside the layer's forward) applies; a generator the replay does not see, and a branch
    # on grad mode, got the same tip.
    from torch.overrides import TorchFunctionMode

    class FakeQuant(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            return out.round() if func is nn.functional.linear else out

    layer = checkpointed(nn.Linear(6, 6), verify_replay=True)
    with FakeQuant():
        y = layer(torch.randn(3, 6, requires_grad=True))
    with pytest.raises(ReplayMismatchError,
                       match=r"(?s)tip: .*(TorchFunctionMode|modes around the call)"):
        y.sum().backward()


# ------------------------------------------------------------- helper GT's review

def _id_column(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x * 2
    return h, h.topk(2, dim=-1).indices[:, 0]  # the top expert per token: int64, stride 2


def _float64_column(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.double() * 2
    return h, h[:, 0]  # a float64 column: stride 6


@pytest.mark.parametrize("fn", [_id_column, _float64_column], ids=["int64", "float64"])
def test_an_8_byte_output_that_is_a_strided_column_is_printed_not_a_crash(
        fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
    # _print reads 8-byte elements as int32 pairs (helper GR's sign-bit fix). Guards against
    # (helper GT) the view of a chunk that keeps its stride (reshape(-1) of a 1-d column is a
    # view): "self.stride(-1) must be 1 to view Long as Int", so an int64 ids column
    # (topk(...).indices[:, 0]) or a float64 column failed its forward under verify_replay.
    x = torch.randn(4, 6, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.full((4, 6), 2.0))


def test_a_layer_run_on_the_meta_device_passes_its_backward_under_verify_replay() -> None:
    # A dry run on the meta device (shapes and the graph without memory: a memory planner, a
    # FLOP counter over the wrapped model) runs forward and backward without verify_replay.
    # Guards against (helper GT) meta prints, which hold no values, compared with torch.equal,
    # which has no meta kernel: NotImplementedError in backward. A meta output is named in the
    # warning and not compared, as a tensor of another layout.
    layer = nn.Linear(4, 4, device="meta")
    x = torch.randn(2, 4, device="meta", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning naming the output is fine
        checkpointed(layer, verify_replay=True)(x).sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"


class _History:
    """FP8 delayed scaling: each forward's scale comes from the amax the forwards before it saw
    (a history outside the layer, appended to at each call: the replay reads a longer one)."""

    amax = [1.0]


class _Fp8Linear(torch.autograd.Function):
    # The usual FP8 recipe: quantize, torch._scaled_mm, the quantized tensors saved for
    # backward (on CPU torch._scaled_mm takes float8_e4m3fn too).
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor
                ) -> torch.Tensor:
        xq, wq = (x / scale).to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        ctx.save_for_backward(xq, wq, scale)
        return torch._scaled_mm(xq, wq.t(), scale, torch.ones(()), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, wq, scale = ctx.saved_tensors
        return grad @ wq.float(), grad.t() @ (xq.float() * scale), None


class _Fp8Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(_History.amax[-1] / 448.0)
        _History.amax.append(x.detach().abs().max().item() * len(_History.amax))
        return _Fp8Linear.apply(x, self.w, scale).tanh()


def test_a_kept_fp8_matmul_whose_scaled_input_differs_is_refused_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The replay reads a longer amax history, so its quantized x differs; the save unit hands
    # it the forward's _scaled_mm result (the output agrees) and the Function's backward reads
    # the replay's xq: other gradients, silently (the premise, checked). Under verify_replay,
    # check_arguments finds argument 1 (xq, float8_e4m3fn) differs and, to order its tip, asks
    # whether it is finite. Guards against (helper GT) torch.isfinite on float8_e4m3fn ('not
    # implemented'; e5m2 has it, e4m3fn and the fnuz types do not): a crash in the error path
    # instead of the ReplayMismatchError. It is asked of a widened copy.
    def step(verify: bool | None) -> list[torch.Tensor | None]:
        monkeypatch.setattr(_History, "amax", [1.0])
        torch.manual_seed(0)
        layer = _Fp8Layer()
        if verify is not None:
            apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
                pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::_scaled_mm")},
                verify_replay=verify)
        x = torch.randn(16, 32, requires_grad=True)
        layer(x).pow(2).sum().backward()
        return grads_of([x, layer.w])

    assert any(not torch.equal(a, b) for a, b in zip(step(None), step(False))
               if a is not None)
    with pytest.raises(ReplayMismatchError) as raised:
        step(True)
    assert "called aten._scaled_mm.default, which a save unit keeps" in str(raised.value)


class _Stepped(nn.Module):
    """A layer with a frozen result, an output discard and a kept op; the second of its kind
    reads SETTINGS.scale (the refused step changes it between forward and backward)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.a, self.b, self.gate = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.norm = nn.LayerNorm(8)

    def route(self, h: torch.Tensor) -> torch.Tensor:
        return self.gate(h).detach().argmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = pytree_ckpt.reuse_during_recompute(self.route, x)
        discard = pytree_ckpt.CheckpointWithoutOutput()
        h = self.a(discard.checkpoint(self.norm, x))
        discard.discard_output_and_register_recompute(h)
        scale = SETTINGS.scale if self.index == 1 else 1.0
        return x + self.b(h.tanh() * scale * (ids.unsqueeze(-1) + 1))


@pytest.mark.parametrize("save", [False, True], ids=["outputs", "kept_arguments"])
def test_steps_after_a_refused_replay_match_eager_and_leave_nothing_held(
        save: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A ReplayMismatchError is raised after the replay's forward ran (an output's print) or
    # inside it (a kept op's arguments), with offload, a frozen result and an output discard in
    # the layer: the steps after it are eager's bit for bit, offload's host buffers all come
    # back, and a census reads 0 (test_failed_steps.py raises in the replay's forward only).
    import offload

    monkeypatch.setattr(SETTINGS, "scale", 1.0)
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Stepped(i) for i in range(3)))
    twin = copy.deepcopy(eager)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=2),
                                     device="cpu")
    apply_recompute_config(list(twin), pytree_ckpt.RecomputeConfig(1.0, save=["attn"] if save
                                                                   else []),
                           {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::addmm")},
                           offload=manager, verify_replay=True)
    results = []
    for model in (eager, twin):
        seen = []
        for step in range(3):
            torch.manual_seed(10 + step)
            x = torch.randn(6, 8, requires_grad=True)
            census = pytree_ckpt.ActivationCensus()
            SETTINGS.scale = 1.0
            failing = model is twin and step == 1
            with census:
                loss = model(x).pow(2).sum()
                if failing:
                    SETTINGS.scale = 2.0
                    with pytest.raises(ReplayMismatchError, match="a save unit keeps" if save
                                       else "computed other values"):
                        loss.backward()
                    model.zero_grad(set_to_none=True)
                    continue
                loss.backward()
            assert census.total_bytes == 0
            seen.append([x.grad, *(p.grad for p in model.parameters())])
            model.zero_grad(set_to_none=True)
        results.append(seen)
    expected, got = results[0][::2], results[1]  # the eager run's steps 0 and 2
    assert_same_grads([g for step in expected for g in step], [g for step in got for g in step])
    assert manager.stats()["host_buffers_in_use"] == 0
    assert str(pytree_ckpt.current_phase()) == "plain"


@pytest.mark.parametrize("option", ["verify_replay", "offload"])
def test_a_boundary_option_given_to_checkpoint_of_a_fn_without_it_names_checkpointed(
        option: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(TypeError) as raised:
        pytree_ckpt.checkpoint(fn, torch.randn(2, requires_grad=True), **{option: True})
    assert f"Tip: set {option} with pytree_ckpt.checkpointed(fn, {option}=" in str(raised.value)


@pytest.mark.parametrize("where", ["checkpoint_layers", "apply_recompute_config", "check_fn"])
def test_a_refused_layer_is_named_with_where_the_entry_point_found_it(where: str) -> None:
    # Layers of one class look alike: "the replay of Counted" named none of forty (helper GU).
    # Backward replays the last layer first: layers[1] is the one refused.
    model = nn.Module()
    model.layers = nn.ModuleList([Counted(Config()), Counted(Config())])
    if where == "checkpoint_layers":
        checkpoint_layers(model.layers, verify_replay=True)
        label = "#1 of the layers given to checkpoint_layers"
    elif where == "apply_recompute_config":
        apply_recompute_config(model.layers, pytree_ckpt.RecomputeConfig(1.0), {},
                               verify_replay=True)
        label = "#1 of the layers given to apply_recompute_config"
    else:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Counted),
                                       verify_replay=True)
        label = "layers.1"
    h = torch.randn(2, 6, requires_grad=True)
    for layer in model.layers:
        h = layer(h)["hidden"]
    with pytest.raises(ReplayMismatchError) as raised:
        h.sum().backward()
    assert str(raised.value).startswith(f"the replay of Counted ({label}) in backward computed")


def test_a_replay_that_swaps_two_values_whose_bits_are_complements_is_refused() -> None:
    # Guards against (helper GV) _mixed's shifts done arithmetically (int64 >> in torch):
    # ~z ^ (~z >> 31) == z ^ (z >> 31), so an element and its bit complement hashed alike at
    # any place, and a swap of two such values also kept the plain sum (b + ~b == -1 either
    # way): the print was unchanged. The shifts are logical (masked) now.
    one = torch.tensor([1.0])
    other = (~one.view(torch.int32)).view(torch.float32)  # -3.9999998: 1.0's bits flipped
    x = torch.cat([one, other, torch.tensor([0.5])]).requires_grad_()
    order = [0, 1, 2]  # state the forward reads, changed before backward
    layer = checkpointed(lambda v: v[order], verify_replay=True)  # outputs: x, reordered
    weights = torch.tensor([1.0, 2.0, 3.0])
    y = layer(x)
    order[:2] = [1, 0]  # the replay swaps the two: other gradients than eager's
    with pytest.raises(ReplayMismatchError):
        (y * weights).sum().backward()
    # The natural integer case: a 0/-1 window mask (0 is ~-1) moved by one place.
    pos = torch.arange(16)
    mask = torch.where((pos >= 4) & (pos < 8), 0, -1)
    moved = torch.where((pos >= 5) & (pos < 9), 0, -1)
    a, b = _print(mask), _print(moved)
    assert a is not None and b is not None and not torch.equal(a[0], b[0])


def test_the_prints_of_a_batch_1_output_allocate_no_temporary_larger_than_the_output() -> None:
    # Guards against (helper GV) chunks of whole rows of dimension 0: an output whose first
    # dimension is small and whose rows are large (batch 1: (1, tokens, hidden), the usual
    # shape of a decoder layer's hidden state in LLM training) was one chunk, its int64 bits,
    # weights and hash temporaries the whole output's, 4x a bf16 output's bytes, in each pass.
    # _chunks slices the innermost dimensions that do not fit. Seen as the test above sees it.
    x = torch.randn(1, 8192, 1024).to(torch.bfloat16).requires_grad_()  # 16 MiB
    y, largest = _largest_block(lambda x: x * 2, x)
    assert largest <= max(y.nbytes, 8 << 20), f"{largest >> 20} MiB for {y.nbytes >> 20} MiB"


class OwnOffload(nn.Module):
    """A layer whose forward has an ``offload`` parameter of its own (it means the layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: Any = None, offload: bool = False) -> torch.Tensor:
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
        return self.lin(x) * (2 if offload else 1)


@pytest.mark.parametrize("how", ["partial of the layer", "partial of its __call__"])
def test_a_layer_naming_offload_itself_is_not_warned_when_called_through_a_partial(
        how: str) -> None:
    # checkpoint() warns where fn takes a boundary option only through **kwargs. A layer whose
    # forward names offload itself takes it, and checkpoint(layer, x, offload=True) is left
    # alone. Guards against (helper GV) a partial of it (partial(layer, mask=...), or
    # transformers' earlier 5.x convention partial(super().__call__, **kwargs)) read as
    # nn.Module's __call__, (*args, **kwargs): a false warning; its forward's signature is.
    import functools

    torch.manual_seed(0)
    layer, x = OwnOffload(), torch.randn(3, 6, requires_grad=True)
    fn = functools.partial(layer, mask=None) if how == "partial of the layer" else \
        functools.partial(layer.__call__, mask=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pytree_ckpt.checkpoint(fn, x, offload=True)
    assert torch.equal(got, layer(x, offload=True))


def test_a_layers_own_type_error_about_its_offload_parameter_gets_no_checkpointed_tip() -> None:
    # A layer that names offload itself and checks its type raises its own TypeError
    # ("offload must be a bool, got str"). Guards against (helper GV) checkpoint() rewriting
    # any TypeError naming a boundary option, as if fn had refused the keyword: the tip to
    # "set offload with pytree_ckpt.checkpointed(fn, offload=...)" would take the layer's own
    # option away. Only Python's "unexpected keyword argument" is that refusal.
    layer = OwnOffload()
    with pytest.raises(TypeError) as raised:
        pytree_ckpt.checkpoint(layer, torch.randn(3, 6, requires_grad=True), offload="cpu")
    assert str(raised.value) == "offload must be a bool, got str"


def test_a_refused_layer_of_a_module_dict_is_not_named_by_another_layers_index() -> None:
    # torchtitan keeps model.layers in a ModuleDict whose keys stay the model's layer numbers
    # when pipeline parallelism leaves a stage only some of them ("16", "17", ...), and
    # checkpoint_layers' own refusal of a ModuleDict tips "pass model.layers.values()".
    # Guards against (helper GV) a label "layers[1]" for this stage's layers.17, the name of
    # another stage's layer: the key is named (dict_values.mapping).
    model = nn.Module()
    model.layers = nn.ModuleDict({"16": Counted(Config()), "17": Counted(Config())})
    checkpoint_layers(model.layers.values(), verify_replay=True)
    h = torch.randn(2, 6, requires_grad=True)
    for layer in model.layers.values():
        h = layer(h)["hidden"]
    with pytest.raises(ReplayMismatchError) as raised:
        h.sum().backward()  # layers.17 replays first, and is refused
    head = str(raised.value).split(" in backward")[0]
    assert head == "the replay of Counted (key '17' of the layers given to checkpoint_layers)"


# ------------------------------------------------------------- helper GW's review

def _top_expert(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x * 2
    return h, h.topk(2, dim=-1).indices[:, 0]  # one token: int64 of shape (1,), stride 2


def _step_expanded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.double().sum().expand(3)  # a float64 scalar broadcast: stride 0


@pytest.mark.parametrize("fn", [_top_expert, _step_expanded], ids=["ids", "expanded"])
def test_an_8_byte_output_of_one_strided_element_is_printed_not_a_crash(
        fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
    # _print views a chunk of 8-byte elements as int32 pairs. Guards against (helper GW) the
    # view after part.contiguous(): a one-element tensor is contiguous whatever its stride,
    # so view(torch.int32) raised "self.stride(-1) must be 1 to view Long as Int" for the top
    # expert of a batch of one token, an int64 or float64 scalar expanded (printed by its one
    # broadcast slice: shape (1,), stride 0), and a strided 8-byte output whose chunked
    # dimension leaves a last piece of one element. The view goes through a trailing 1.
    x = torch.randn(1, 6, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    out[0].sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((1, 6), 2.0))


def test_a_strided_float64_output_whose_last_chunk_is_one_element_is_printed() -> None:
    # The same crash at the default _CHUNK: a (2, 2**20 + 1) float64 transposed view is
    # chunked along its last dimension (stride 2), and each row's last piece is one element.
    t = torch.zeros(2**20 + 1, 2, dtype=torch.float64).t()
    made = _print(t)
    copied = _print(t.contiguous())
    assert made is not None and copied is not None and torch.equal(made[0], copied[0])


# Two places whose _weights agree in their high 33 bits (w_p ^ w_q == 0x477f9c42 < 2**31; found
# by sorting _weights(0, 2**20) >> 31: 123 such pairs in 2**20 places, about 2**-32 of all
# pairs, since the weights' top bit is always 0; this pair has the smallest larger place).
_XOR_PAIR = (1787, 54332)


def test_a_replay_that_moves_bits_between_places_whose_weights_share_high_bits_is_refused() -> None:
    # Guards against (helper GW) a hash of w_p ^ b_p alone (b_p an int32 sign-extended), the
    # place entering by xor only: where d = w_p ^ w_q is below 2**31, the replay's
    # b'_p = b_q ^ d, b'_q = b_p ^ d hashed exactly the forward's two inputs, swapped, and the
    # plain sum was kept too where b_p holds d's bits and b_q none. Here b_p = d | 1 and
    # b_q = 0: the replay rounds one value down an ulp and makes a 0.0 the smallest denormal.
    # Such a pair of places is in any fp32 output over about 2**17 elements (123 in 2**20).
    # The place is hashed in again after the first mix.
    p, q = _XOR_PAIR
    scale = torch.zeros(q + 1)
    scale[p] = 65436.26171875  # bits 0x477f9c43 = d | 1
    layer = checkpointed(lambda v: v * scale, verify_replay=True)
    x = torch.ones(q + 1, requires_grad=True)
    y = layer(x)
    scale[p] = 65436.2578125  # bits d: an ulp less; the state the forward reads changed
    scale[q] = 1e-45  # bits 1: the smallest denormal
    with pytest.raises(ReplayMismatchError):
        y.sum().backward()  # unrefused, x.grad is the replay's scale, not the forward's


_VIEW_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64,
                torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                torch.bool,
                *[getattr(torch, name) for name in ("float8_e5m2",) if hasattr(torch, name)]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(_VIEW_DTYPES),
       dims=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0, 1, 2, 3, 7, 30])),
                     max_size=4),
       offset=st.integers(0, 3), conj=st.booleans(), chunk=st.sampled_from([1, 2, 3, 7, 1 << 20]),
       seed=st.integers(0, 2**16))
def test_a_views_print_is_its_copys_for_any_strides_and_chunking(
        dtype: torch.dtype, dims: list[tuple[int, int]], offset: int, conj: bool, chunk: int,
        seed: int) -> None:
    # The print reads values by place in row-major order, whatever the layout: a view (strided,
    # transposed, expanded, overlapping as_strided, a conjugate) has the print of its
    # contiguous copy under any _CHUNK, and chunking does not move the print. Both passes
    # must agree where the replay returns another layout than the forward (helper GW).
    from unittest import mock

    from pytree_ckpt import replay_values

    shape = [size for size, _ in dims]
    need = offset + 1 + sum((size - 1) * stride for size, stride in dims if size)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (need * size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    storage = (raw & 1 if dtype is torch.bool else raw).view(dtype)
    view = storage.as_strided(shape, [stride for _, stride in dims], offset)
    if conj and dtype.is_complex:
        view = view.conj()
    copy = view.clone(memory_format=torch.contiguous_format).resolve_conj()
    whole = _print(copy)
    with mock.patch.object(replay_values, "_CHUNK", chunk):
        made, copied = _print(view), _print(copy)
    assert whole is not None and made is not None and copied is not None
    assert torch.equal(made[0], whole[0]) and torch.equal(copied[0], whole[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128], ids=str)
def test_the_prints_of_an_8_byte_or_complex_output_allocate_no_temporary_over_8_mib(
        dtype: torch.dtype) -> None:
    # NOTE [output prints] promises int64 temporaries of 8 MiB. Guards against (helper GW)
    # chunks of _CHUNK float64 or complex elements, 2 or 4 * _CHUNK int32 words to hash: each
    # int64 temporary of _mixed was 16 or 32 MiB, in each pass. Chunks are _CHUNK words now.
    # Seen as the test above sees it; bounded by the chunk, not the output's size.
    count = (8 << 20) // torch.empty((), dtype=dtype).element_size()  # an 8 MiB output
    x = torch.zeros(count, dtype=dtype).reshape(8, -1).requires_grad_()
    y, largest = _largest_block(lambda x: x * 2, x)
    assert largest <= max(y.nbytes, 8 << 20), f"{largest >> 20} MiB for {y.nbytes >> 20} MiB"


def test_the_print_of_a_conjugate_view_output_copies_no_more_than_a_chunk() -> None:
    # Guards against (helper GW) _print resolving a conjugate (or negative) view before
    # chunking: t.resolve_conj() copied the whole output (a 32 MiB block for a 32 MiB complex64
    # output returned as (x * 2).conj(), in each pass). Each chunk is resolved now. Seen as the
    # tests above see it.
    x = torch.zeros(4 << 20, dtype=torch.complex64).reshape(8, -1).requires_grad_()  # 32 MiB
    # The largest block but the output's own (x * 2, made by aten::mul).
    y, largest = _largest_block(lambda x: (x * 2).conj(), x, besides="aten::mul")
    assert y.is_conj()  # the premise: the output is a conjugate view
    assert largest < y.nbytes, f"{largest >> 20} MiB for a {y.nbytes >> 20} MiB output"


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_the_message_names_an_unsigned_outputs_own_sums(dtype: torch.dtype) -> None:
    # Guards against (helper GW) _print adding a chunk's value sum, then failing at abs(),
    # which uint16/32/64 lack on CPU, and adding the sum again through the wide dtype: the
    # message said "values summing to 12" for the forward's [1, 2, 3]. Both sums are read
    # before either is added.
    counts = torch.tensor([1, 2, 3])  # state the forward reads, changed before backward
    layer = checkpointed(lambda x: (x * 2, counts.to(dtype)), verify_replay=True)
    y = layer(torch.randn(3, requires_grad=True))
    counts += 1
    with pytest.raises(ReplayMismatchError) as raised:
        y[0].sum().backward()
    sums = [line.split("summing to ")[1] for line in str(raised.value).splitlines()
            if "summing to" in line]
    assert sums == ["6", "9"]


# ------------------------------------------------------------- helper GX's review

def test_a_normed_output_scaled_by_a_changed_setting_is_not_called_float_rounding() -> None:
    # A LayerNorm's rows sum to about 0 whatever their scale, so the values' sums of the two
    # passes differ by far less than 1e-3 of the absolute sum even when the replay's values are
    # 3x the forward's. Guards against (helper GX) the message saying "as float rounding does"
    # there: rounding keeps the absolute sums close too, a 3x scale does not.
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x) * SETTINGS.scale

    torch.manual_seed(0)
    SETTINGS.scale = 1.0
    y = checkpointed(Normed(), verify_replay=True)(torch.randn(4, 8, requires_grad=True))
    SETTINGS.scale = 3.0
    try:
        with pytest.raises(ReplayMismatchError) as raised:
            y.pow(2).sum().backward()
    finally:
        SETTINGS.scale = 1.0
    message = str(raised.value)
    assert "tip: most likely the forward read something that changed" in message
    assert "as float rounding does" not in message


def test_a_broadcast_outputs_message_gives_the_sums_of_its_values_not_of_one_slice() -> None:
    # The print of an output broadcast with stride 0 is that of the one slice it repeats.
    # Guards against (helper GX) its value sums shown as the output's: "values summing to 4.0"
    # for a (5, 4) output of ones, whose values sum to 20.0; they are scaled by the repeats.
    scale = torch.ones(1, 4)  # state the forward reads, changed before backward
    layer = checkpointed(lambda x: (x * 2, (x[:1] * scale).expand(5, 4)), verify_replay=True)
    y = layer(torch.ones(3, 4, requires_grad=True))
    forward_sum = y[1].double().sum().item()
    scale += 1
    with pytest.raises(ReplayMismatchError) as raised:
        (y[0].sum() + y[1].sum()).backward()
    message = str(raised.value)
    assert "at output[1]" in message
    assert f"values summing to {forward_sum!r}" in message  # 20.0; it says 4.0


class _Temperature:
    value = 1.0  # a global setting the forward reads


def test_masked_logits_scaled_by_a_changed_setting_are_not_blamed_on_unwritten_memory() -> None:
    # Attention scores masked with -inf (a causal mask, as the DSA indexer's) are an ordinary
    # output. Their temperature, a global changed before backward, makes the replay's scores
    # half the forward's. Guards against (helper GX) a message showing "summing to -inf" for
    # both passes with a tip leading with uninitialized memory: the sums are the finite
    # values', the others counted, and that cause leads only where the counts differ.
    def scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (q @ k.t() / _Temperature.value).masked_fill(mask, float("-inf"))

    torch.manual_seed(0)
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
    _Temperature.value = 1.0
    y = checkpointed(scores, verify_replay=True)(
        torch.randn(4, 8, requires_grad=True), torch.randn(4, 8), mask)
    _Temperature.value = 2.0
    with pytest.raises(ReplayMismatchError) as raised:
        y.softmax(-1).sum().backward()
    message = str(raised.value)
    assert "tip: most likely the forward read something that changed" in message
    assert "summing to -inf" not in message


class _DiscardedNorm(nn.Module):
    """A pre-norm block whose norm output is discarded (Megatron's output discard): the replay
    frees the norm's output once the projection holds it, as the docs say it does inside a
    boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        discard = pytree_ckpt.CheckpointWithoutOutput()
        normed = discard.checkpoint(self.norm, x)
        out = self.proj(normed)
        discard.discard_output_and_register_recompute(out)
        return out + x


def test_a_hook_logging_a_discarded_norm_output_passes_verification_with_eager_gradients(
        ) -> None:
    # An activation-statistics hook (it reads the output when called, keeps nothing) on a
    # norm whose output an output discard frees. Without verify_replay the layer trains with
    # eager's gradients; with it, the replay's print read the freed storage: torch's
    # "setStorage: ... out of bounds for storage of size 0" RuntimeError in backward.
    stats: list[float] = []

    def log_rms(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        stats.append(float(output.detach().square().mean()))

    torch.manual_seed(0)
    eager = _DiscardedNorm()
    layer = copy.deepcopy(eager)
    eager.norm.register_forward_hook(log_rms)
    layer.norm.register_forward_hook(log_rms)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    eager(x).sum().backward()
    failure = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note on hooks inside a checkpointed layer
        try:
            checkpointed(layer, verify_replay=True)(x2).sum().backward()
        except RuntimeError as error:  # (not raised as is: pytest's repr of the freed
            failure = str(error)       # tensors in its frames crashes the interpreter)
    assert failure is None, failure
    assert torch.equal(x.grad, x2.grad)
    assert_same_grads(grads_of(eager.parameters()), grads_of(layer.parameters()))


def test_a_hooked_output_the_replay_discards_is_compared_once_it_is_rebuilt() -> None:
    # NOTE [a hooked output the replay discarded]: the hooked output's print is taken when the
    # discard refills its storage. The layer's output is zeros in every pass, so only that
    # deferred check can see the counter (1 in the forward; 3 at the rebuild, which runs the
    # discarded op once more after the replay's 2): refused, naming the hooked output.
    shared = Config()

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shared.calls += 1
            return x * shared.calls

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scaled, self.proj = Scaled(), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            discard = pytree_ckpt.CheckpointWithoutOutput()
            h = discard.checkpoint(self.scaled, x)
            out = self.proj(h)
            discard.discard_output_and_register_recompute(out)
            return (out * 0.0).abs()  # +0.0 whatever the signs

    layer = Block()
    layer.scaled.register_forward_hook(lambda module, args, output: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note on hooks inside a checkpointed layer
        out = checkpointed(layer, verify_replay=True)(torch.randn(4, 8, requires_grad=True))
        with pytest.raises(ReplayMismatchError) as raised:
            out.sum().backward()
    message = str(raised.value)
    assert "at output of submodule 'scaled' (kept by a forward hook)" in message, message
    assert shared.calls == 3


def test_the_prints_are_let_go_once_a_replay_without_retain_graph_is_done() -> None:
    # Guards against (helper HA) a call's prints held as long as its graph: a loss kept for
    # logging kept them. A replay under retain_graph=True keeps them for the next backward,
    # which compares again (a shared counter there is refused by both).
    import gc

    from pytree_ckpt.replay_values import OutputPrints

    def held() -> int:
        gc.collect()
        return sum(type(o) is OutputPrints for o in gc.get_objects())

    before = held()
    layer = checkpointed(nn.Linear(4, 4), verify_replay=True)
    y = layer(torch.randn(2, 4, requires_grad=True))
    assert held() == before + 1
    y.sum().backward(retain_graph=True)
    assert held() == before + 1
    y.sum().backward()
    assert held() == before  # y, and so the graph, still alive


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's own
@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_a_kept_sparse_argument_read_from_a_shared_counter_is_refused_naming_it(
        layout: str) -> None:
    # NOTE [sparse tensors are printed by their parts]: a graph convolution whose adjacency a
    # counter on a shared config object scales. The save unit hands the replay the forward's
    # output of aten._sparse_addmm, so the layer's output agrees, while the op's backward reads
    # the replay's adjacency: unverified, the linear's gradients differ from eager's (the
    # premise). Guards against (helper HA) the sparse argument getting a print of zeros in
    # both passes (no error, no warning, half of eager's gradients), and (helper HB) the
    # refusal's NaN probe calling any() on a compressed tensor (torch's NotImplementedError).
    class Graph(nn.Module):
        def __init__(self, shared: Config) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.config = shared
            self.register_buffer("base", (torch.rand(5, 5) > 0.5).float())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.config.calls += 1
            scaled = self.base / self.config.calls
            adj = {"coo": scaled.to_sparse, "csr": scaled.to_sparse_csr,
                   "csc": scaled.to_sparse_csc}[layout]()
            return torch.sparse.mm(adj, self.lin(x))

    def step(verify: bool | None) -> torch.Tensor:
        torch.manual_seed(0)
        layer = Graph(Config())
        if verify is not None:
            apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
                pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::_sparse_addmm")},
                verify_replay=verify)
        layer(torch.randn(5, 4)).sum().backward()
        return layer.lin.weight.grad

    assert not torch.equal(step(None), step(False))  # silent without verify_replay
    with pytest.raises(ReplayMismatchError, match="tensor argument 2 of 3"):
        step(True)


def test_the_prints_are_let_go_after_a_split_backwards_weight_pass() -> None:
    # Guards against (helper HB), as it was found:
    # The split backward of zero-bubble pipeline schedules: an input pass under
    # retain_graph=True, then a weight pass without it. The input pass keeps its replay for
    # the weight pass (NOTE [a replay kept between restricted backwards]), which runs no replay
    # (_from_kept in recompute.py) and so never reaches the line that lets the prints go: they
    # stay held as long as the graph, as before helper HA's fix (a loss kept for logging keeps
    # them), where boundary.md says they are freed once the replay is done.
    import gc

    from pytree_ckpt.replay_values import OutputPrints

    def held() -> int:
        gc.collect()
        return sum(type(o) is OutputPrints for o in gc.get_objects())

    before = held()
    layer = nn.Linear(4, 4)
    apply_activation_checkpointing(layer, verify_replay=True)
    x = torch.randn(2, 4, requires_grad=True)
    loss = layer(x).square().sum()
    assert held() == before + 1
    torch.autograd.grad(loss, [x], retain_graph=True)  # the input pass
    torch.autograd.grad(loss, list(layer.parameters()))  # the weight pass: the graph's last use
    assert held() == before  # loss, and so the graph, still alive


def test_a_kept_ops_argument_without_a_print_is_told_once_under_the_default_filter() -> None:
    # Guards against (helper HB), as it was found:
    # A kept op's argument that has no print (a tensor subclass) is named in a warning at the
    # forward, "as outputs are". An output without a print is told once under Python's default
    # filter (once per line); the argument's warning came at every step, because the replay's
    # check_arguments silences its own repeat with warnings.catch_warnings(), and entering or
    # leaving that resets every module's registry of warnings already shown (so any other
    # once-per-line warning of the program comes back each step too).
    class Tagged(torch.Tensor):
        pass

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.as_subclass(Tagged) @ self.w).as_subclass(torch.Tensor)

    layer = Layer()
    apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
        pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::mm")}, verify_replay=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "tensor arguments of aten.mm" in str(w.message)]
    assert len(told) == 1, told


class _GradScaleFn(torch.autograd.Function):
    """FP8 delayed scaling's gradient side: the forward hands its backward the scale it read,
    the backward records the gradient's amax into the module's buffer (state written in
    backward, read by the next forward)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, scale: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.scale, ctx.module = scale, module
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.module.grad_amax.fill_(g.abs().max())
        return (g * ctx.scale).to(torch.float8_e5m2).to(g.dtype) / ctx.scale, None, None


class _DelayedGradScaling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("grad_amax", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = torch.where(self.grad_amax > 0, 57344.0 / self.grad_amax, torch.ones(()))
        return _GradScaleFn.apply(self.lin(x), scale, self)


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, State the forward "
                   "changes: state a call reads, changed before its backward; verify_replay "
                   "finds it where it reaches the outputs) (helper LD)")
def test_verify_replay_finds_a_gradient_scale_a_later_micro_batch_backward_changed() -> None:
    # Helper LD. docs/limits.md, "state a call reads without changing it ... changed before the
    # call's backward ... by a later call": verify_replay finds it where the value reaches the
    # call's outputs, and a backward's change is read as it is. Here the replay reads the
    # scale (a small buffer) after the second micro-batch's backward wrote it; the scale feeds
    # only the replay's backward, so the outputs compared agree and nothing is raised, while
    # the first micro-batch's gradients differ from eager's.
    torch.manual_seed(0)
    eager = _DelayedGradScaling()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), verify_replay=True)
    xs = [torch.randn(4, 8), torch.randn(4, 8) * 3]
    (eager(xs[0]).square().sum() + eager(xs[1]).square().sum()).backward()
    try:
        (ours(xs[0]).square().sum() + ours(xs[1]).square().sum()).backward()
    except ReplayMismatchError:
        return                                          # found, as the docs say
    assert_same_grads(grads_of(eager.parameters()), grads_of(ours.parameters()))


class _UnwrapsOnEveryOp(torch.Tensor):
    """A ``__torch_function__`` subclass whose ops return plain tensors (a hand-written tag)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_verify_replay_takes_an_input_returned_as_it_is_whose_subclass_views_as_plain() -> None:
    # Guards against (helper LN) verify_replay refusing this. Eager and the boundary both
    # return the input as a _UnwrapsOnEveryOp (output[1]); the
    # forward's print was taken of its plain alias, the replay's output gets the class back,
    # and check() (replay_values.py) raises ReplayMismatchError 'returned another kind of
    # tensor ... expected: a plain strided or sparse tensor, as the forward returned', though
    # fn returns the same in both passes. A subclass without __torch_function__ passes.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x

    grads = []
    for run in (fn, checkpointed(fn, verify_replay=True)):
        w = torch.arange(3.0, requires_grad=True)
        out = run((w * 1).as_subclass(_UnwrapsOnEveryOp))
        assert type(out[1]) is _UnwrapsOnEveryOp
        (out[0].sum() + 3 * out[1].sum()).backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


# ------------------------------------------------------------- helper ND's review

class _MocoQueueHead(nn.Module):
    """MoCo's logits against a queue of keys, enqueued in place (`queue[:, ptr:ptr + B] =
    keys.T`, `ptr` an int buffer): 16 x 1200 floats, over the 64 KiB a buffer is copied under."""

    def __init__(self, dim: int = 16, size: int = 1200) -> None:
        super().__init__()
        self.register_buffer("queue", nn.functional.normalize(torch.randn(dim, size), dim=0))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))
        self.proj = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q = nn.functional.normalize(self.proj(q), dim=-1)
        logits = torch.cat([(q * k).sum(-1, keepdim=True), q @ self.queue.clone()], 1) / 0.07
        ptr = int(self.ptr)
        self.queue[:, ptr:ptr + k.shape[0]] = k.T
        self.ptr[0] = (ptr + k.shape[0]) % self.queue.shape[1]
        return logits


def test_a_moco_queue_written_in_place_is_not_called_only_float_rounding() -> None:
    # Guards against (helper ND) the message calling a few changed values float rounding, and
    # its state cause excluding the module's own state. The queue is over 64 KiB, so the
    # replay reads it as the forward left it (documented, docs/limits.md 'State the forward
    # changes'), and verify_replay=True refuses it: the 4 enqueued columns change 16 of 4804
    # logits, by up to ~28, and the sums differ by 1.3, within 1e-3 of the absolute sum
    # (13696), as rounding with TF32 kernels (cuDNN's fp32 default) can also move them.
    torch.manual_seed(0)
    head = _MocoQueueHead()
    apply_activation_checkpointing(head, verify_replay=True)
    keys = nn.functional.normalize(torch.randn(4, 16), dim=-1)
    logits = head(torch.randn(4, 16, requires_grad=True), keys)
    with pytest.raises(ReplayMismatchError) as raised:
        nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).backward()
    message = str(raised.value)
    assert "as float rounding does (and as a change to a few of many values can)" in message
    assert "a buffer or attribute over 64 KiB changed in place, a MoCo queue" in message


# ------------------------------------------------------------- helper NN's mutation round

def _kept_window_grads(verify: bool | None, swap: bool) -> list[torch.Tensor | None]:
    """test_a_kept_op_whose_inputs_differ_in_the_replay_is_refused's Window, whose replay
    swaps two tokens of q (same values, same sums: only their places differ)."""
    class Window(nn.Module):
        def __init__(self, shared: Config) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.config = shared

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            self.config.calls += 1
            q = self.proj(h)
            if swap and self.config.calls > 1:
                q = q[:, [1, 0, *range(2, q.shape[1])]]
            return h + (q @ q.transpose(-1, -2)).softmax(-1) @ h

    torch.manual_seed(0)
    window = Window(Config())
    if verify is not None:
        apply_recompute_config([window], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                               {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::bmm")},
                               verify_replay=verify)
    x = torch.randn(2, 4, 8, requires_grad=True)
    window(x).pow(2).sum().backward()
    return grads_of([x, *window.parameters()])


def test_a_kept_ops_argument_whose_replay_only_swaps_two_rows_is_refused() -> None:
    # Helper NN, mutant R24: the kept op's arguments compared by their value sums, not their
    # bit prints, passed this replay (the same values in other places), silently with other
    # gradients than eager's (the premise, unverified).
    expected = _kept_window_grads(None, swap=False)
    assert any(not torch.equal(a, b) for a, b in
               zip(expected, _kept_window_grads(False, swap=True)) if a is not None)
    assert all(torch.equal(a, b) for a, b in
               zip(expected, _kept_window_grads(True, swap=False)) if a is not None)
    with pytest.raises(ReplayMismatchError, match="tensor argument 1 of 2"):
        _kept_window_grads(True, swap=True)


def test_a_kept_sparse_argument_whose_replay_moves_its_entries_is_refused() -> None:
    # Helper NN, mutant R01: a sparse argument printed by its values alone (all ones here)
    # missed an adjacency whose replay links other nodes: the indices differ, the values not.
    class Graph(nn.Module):
        def __init__(self, shared: Config) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.config = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.config.calls += 1
            adj = torch.eye(5).roll(self.config.calls, dims=1).to_sparse()
            return torch.sparse.mm(adj, self.lin(x))

    def step(verify: bool | None) -> torch.Tensor:
        torch.manual_seed(0)
        layer = Graph(Config())
        if verify is not None:
            apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]), {
                pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::_sparse_addmm")},
                verify_replay=verify)
        layer(torch.randn(5, 4)).pow(2).sum().backward()
        return layer.lin.weight.grad

    assert not torch.equal(step(None), step(False))  # silent without verify_replay
    with pytest.raises(ReplayMismatchError, match="tensor argument 2 of 3"):
        step(True)


def test_a_replay_materializing_one_of_two_broadcast_dimensions_is_compared_along_it() -> None:
    # Helper NN, mutant R16: _repeats taking one stride-0 dimension of two for all of them
    # passed a replay that materializes dimension 0 with other values and keeps dimension 1
    # broadcast.
    base = torch.randn(1, 1, 5)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pytree_ckpt.current_phase() != "recompute":
            return x * 2, base.expand(4, 3, 5)
        rows = base + torch.tensor([0.0, 0.0, 1.0, 0.0]).view(4, 1, 1)  # (4, 1, 5)
        made = rows.expand(4, 3, 5)  # dimension 1 broadcast (stride 0), dimension 0 not
        assert made.stride(1) == 0 and made.stride(0) != 0
        return x * 2, made

    x = torch.randn(3, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    with pytest.raises(ReplayMismatchError, match=r"at output\[1\]"):
        out[0].sum().backward()


def test_an_output_whose_replay_holds_a_nan_leads_with_unwritten_memory_not_rounding() -> None:
    # Helper NN, mutants R17, R18: a replay whose output holds a NaN where the forward's held
    # a tiny finite value has sums within 1e-3 of each other, but other counts of values not
    # finite: the tip leads with uninitialized memory and does not call it float rounding.
    values = torch.linspace(1.0, 2.0, 64)
    values[5] = 1e-7

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        made = values.clone()
        if pytree_ckpt.current_phase() == "recompute":
            made[5] = float("nan")
        return x * 2, made

    x = torch.randn(3, requires_grad=True)
    out = checkpointed(fn, verify_replay=True)(x)
    with pytest.raises(ReplayMismatchError) as raised:
        out[0].sum().backward()
    message = str(raised.value)
    assert "(1 not finite, left out)" in message
    assert "as float rounding does" not in message
    assert "tip: most likely an output holding uninitialized memory" in message.lower()


@pytest.mark.parametrize("nan", [False, True])
def test_a_kept_ops_refusal_leads_with_the_rng_option_or_a_nan_argument(nan: bool) -> None:
    # Helper NN, mutants R07 (preserve_rng=False not named first) and R08 (a NaN argument not
    # leading with the unwritten buffer).
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            q = nn.functional.dropout(self.proj(h), 0.5, training=True)
            if nan:  # NaN where this pass's draw dropped a value: other places in each pass
                q = torch.where(q == 0, float("nan"), q)
            return h + (q @ q.transpose(-1, -2)) @ h

    torch.manual_seed(0)
    layer = Noisy()
    apply_recompute_config([layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                           {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::bmm")},
                           verify_replay=True, preserve_rng_state=False)
    with pytest.raises(ReplayMismatchError) as raised:
        layer(torch.randn(2, 4, 8, requires_grad=True)).sum().backward()
    tip = str(raised.value).split("most likely ", 1)[1]
    assert tip.startswith("preserve_rng_state=False")
    assert tip.split("; else ")[1].startswith("a buffer the kept op fills" if nan else
                                              "the forward read something")


def test_a_broadcast_outputs_message_gives_the_replays_sums_of_its_values_too() -> None:
    # Helper NN, mutant R19: the replay's value sums of a broadcast output left as its one
    # slice's ("summing to 6.0" for five repeated rows of 6.0: 30.0).
    scale = torch.ones(1, 4)
    layer = checkpointed(lambda x: (x * 2, (x[:1] * scale).expand(5, 4)), verify_replay=True)
    y = layer(torch.ones(3, 4, requires_grad=True))
    scale += 0.5
    with pytest.raises(ReplayMismatchError) as raised:
        (y[0].sum() + y[1].sum()).backward()
    assert "the replay's, summing to 30.0\n" in str(raised.value) + "\n"


class _Tagged(torch.Tensor):
    """A subclass that only tags its tensors (torch's default __torch_function__)."""


def test_an_input_of_a_tag_subclass_returned_as_it_is_is_compared_without_a_warning() -> None:
    # Helper NN, mutant R03: a subclass that is no traceable wrapper, returned as it is, is
    # printed by its as_subclass(torch.Tensor) alias; without it, it was named in a warning as
    # not compared. Gradients as eager's.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.as_subclass(torch.Tensor) * 2, x

    grads = []
    for run in (fn, checkpointed(fn, verify_replay=True)):
        w = torch.arange(3.0, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = run((w * 1).as_subclass(_Tagged))
            (out[0].sum() + 3 * out[1].sum()).backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_output_is_named_as_not_compared_and_the_rest_keeps_eager_gradients(
        ) -> None:
    # Helper NN, mutant R20: without _strided_print's is_quantized test, a quantized output's
    # int8 view was summed: a segmentation fault of the process on torch 2.13 (CPU).
    packed = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    x = torch.randn(4, requires_grad=True)
    with pytest.warns(UserWarning, match=r"output\[1\] \(Tensor, torch.strided, torch.qint8\) "
                                         "not compared"):
        out = checkpointed(lambda x: (x * 2, packed), verify_replay=True)(x)
    out[0].pow(2).sum().backward()
    assert torch.equal(x.grad, 8 * x.detach())


_SCALE = {"value": 1.0}  # state the layers read, changed before backward (what verify_replay finds)


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * _SCALE["value"]


def test_verify_replay_names_a_layer_by_its_place_after_growth_in_front_and_a_reapply() -> None:
    # Progressive growth: a new layer inserted in front of trained checkpointed ones, and
    # check_fn applied again over the grown model (a no-op for those already wrapped, the new
    # one wrapped and labelled "layers.0"). The old layers keep the labels of their old places
    # (the first entry point that found a module names it: label_boundary in module.py), so
    # two layers are "layers.0" and the refusal of model.layers[3]'s replay says "layers.2".
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_ScaledBlock() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    def wrap(model: nn.Module) -> None:
        pytree_ckpt.apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, _ScaledBlock), verify_replay=True)

    model = Model()
    wrap(model)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    model.layers.insert(0, _ScaledBlock())  # grown between steps
    wrap(model)
    out = model(x)
    _SCALE["value"] = 2.0  # every replay now differs; the last layer's is checked first
    try:
        with pytest.raises(ReplayMismatchError) as err:
            out.sum().backward()
    finally:
        _SCALE["value"] = 1.0
    assert "(layers.3)" in str(err.value), str(err.value)[:200]
