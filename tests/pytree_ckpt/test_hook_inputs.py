"""NOTE [hooked outputs leave with gradients] (hook_outputs.py), for the *inputs* a hook keeps:
a forward hook (or forward pre-hook) inside a boundary that keeps the tensor its module receives
(an activation hook on a projection's input, a regulariser on the hidden state entering the
MLP) keeps a tensor of the no-grad original pass. Every case is compared with an eager twin,
bit for bit (fp32): each kept input has two uses (the module and the loss), whose sum does not
depend on the order."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class KwBlock(Block):
    """Calls its submodule with a keyword argument."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(input=torch.tanh(self.up(self.norm(x))))


Register = Callable[[nn.Module, list], Any]

HOOKS: dict[str, Register] = {
    "forward hook": lambda m, kept: m.register_forward_hook(
        lambda mod, args, out: kept.append(args[0])),
    "forward pre-hook": lambda m, kept: m.register_forward_pre_hook(
        lambda mod, args: kept.append(args[0])),
}


def _grads_of_a_step(model: nn.Module, kept: list, x: torch.Tensor) -> list[torch.Tensor]:
    kept.clear()
    loss = model(x).square().mean()
    loss = loss + 0.1 * kept[0].square().mean()  # a penalty on the input of `down`
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_an_input_a_hook_inside_the_layer_keeps_gets_eager_gradients(kind: str) -> None:
    # Before, the kept input of `down` came from the no-grad original pass: the penalty's value
    # was right, and its gradients (to `up`, `norm` and x) were silently missing; a pre-hook
    # was not even warned about.
    torch.manual_seed(0)
    eager = Block()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept_eager: list = []
    kept: list = []
    HOOKS[kind](eager.down, kept_eager)
    HOOKS[kind](model.down, kept)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a user hook inside: warned about once
        for _ in range(2):
            expected = _grads_of_a_step(eager, kept_eager, x)
            got = _grads_of_a_step(model, kept, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert kept[0].grad_fn is not None


def test_an_input_a_pre_hook_keeps_in_a_fullgraph_compiled_body_gets_eager_gradients() -> None:
    # docs/scaling.md's order: the body compiled, then checkpointed; dynamo inlines both hooks.
    torch.manual_seed(0)
    eager = Block()
    model = copy.deepcopy(eager)
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    pytree_ckpt.apply_activation_checkpointing(model, offload=False)
    kept_eager: list = []
    kept: list = []
    HOOKS["forward pre-hook"](eager.down, kept_eager)
    HOOKS["forward pre-hook"](model.down, kept)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            expected = _grads_of_a_step(eager, kept_eager, x)
            got = _grads_of_a_step(model, kept, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_an_input_given_by_keyword_that_a_hook_keeps_gets_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = KwBlock()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept_eager: list = []
    kept: list = []
    for net, into in ((eager, kept_eager), (model, kept)):
        net.down.register_forward_hook(
            lambda mod, args, kwargs, out, into=into: into.append(kwargs["input"]),
            with_kwargs=True)
    x = torch.randn(4, 8, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _grads_of_a_step(eager, kept_eager, x)
        got = _grads_of_a_step(model, kept, x_twin)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(x.grad, x_twin.grad)


def test_a_forward_pre_hook_inside_the_layer_is_warned_about() -> None:
    # It runs under no-grad in the original pass and again in the replay, as a forward hook
    # does; a tensor it computes from the input has no gradient.
    layer = pytree_ckpt.apply_activation_checkpointing(Block(), offload=False)

    def penalty_of_input(module: nn.Module, args: Any) -> None:
        return None

    layer.down.register_forward_pre_hook(penalty_of_input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(4, 8)).sum().backward()
    told = [str(w.message) for w in caught if "forward hooks inside" in str(w.message)]
    assert len(told) == 1 and "down: " in told[0] and "penalty_of_input" in told[0]



@functools.lru_cache
def _cached_scale(n: int) -> torch.Tensor:
    return torch.full((n,), 0.5)  # built once, outside any boundary's call: a constant


class Gate(nn.Module):
    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h * scale


class GatedBlock(Block):
    """Hands its `gate` a cached tensor (a mask from an lru_cache) with the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.gate(torch.tanh(self.up(self.norm(x))), _cached_scale(16)))


def _gate_twins(eager: nn.Module, /) -> tuple[nn.Module, dict[str, list]]:
    """``eager``'s checkpointed copy, and for each twin the list its `gate`'s forward hook
    appends the arguments `gate` received to."""
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept: dict[str, list] = {"eager": [], "model": []}
    for net, into in ((eager, kept["eager"]), (model, kept["model"])):
        net.gate.register_forward_hook(lambda mod, args, out, into=into: into.append(args))
    return model, kept


def _penalised_steps(eager: nn.Module, model: nn.Module, kept: dict[str, list],
                     x: torch.Tensor, /) -> None:
    """A step of each twin whose loss has a term on the first input `gate` received."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for net, key in ((eager, "eager"), (model, "model")):
            net.zero_grad()
            kept[key].clear()
            loss = net(x).square().mean() + 0.1 * kept[key][0][0].square().mean()
            loss.backward()


def _constant_cache_steps(eager: nn.Module, cached: Callable[[], torch.Tensor], /) -> None:
    """Two steps of ``eager`` and its checkpointed copy (first, so its call fills the cache),
    with a hook on `gate` that does nothing: gradients equal, the cache left a constant."""
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    model.gate.register_forward_hook(lambda mod, args, out: None)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            eager.zero_grad()
            model.zero_grad()
            model(x).square().mean().backward()  # first: the call fills the cache
            eager(x).square().mean().backward()
            assert not cached().requires_grad and cached().grad_fn is None
            assert all(torch.equal(a.grad, b.grad)
                       for a, b in zip(eager.parameters(), model.parameters()))


def test_a_cached_tensor_a_hooked_module_receives_stays_a_constant_and_backward_runs() -> None:
    # NOTE [only what eager would give a gradient is recorded]: recorded as an input of the
    # hooked module, the cached tensor was made an extra output: it got the boundary's node in
    # place (it required grad for every later user) and backward raised, with a hook that only
    # counts calls; eager (and the code before inputs were recorded) ran.
    torch.manual_seed(0)
    eager = GatedBlock()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    calls: list[int] = []
    for net in (eager, model):
        net.gate.register_forward_hook(lambda mod, args, out: calls.append(1))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for net in (eager, model):
                net.zero_grad()
                net(x).square().mean().backward()
            assert not _cached_scale(16).requires_grad
            assert all(torch.equal(a.grad, b.grad)
                       for a, b in zip(eager.parameters(), model.parameters()))
    assert len(calls) == 2 * 3  # eager's, the original pass's and the replay's, per step


def test_a_view_of_a_cached_tensor_a_hook_keeps_gets_eager_values_and_no_node_on_the_cache(
        ) -> None:
    # A view made in the call (mask[:n]) is new: recorded as before; the cache is untouched.
    class Sliced(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.up(self.norm(x)))
            return x + self.down(self.gate(h, _cached_scale(32)[:16]))

    torch.manual_seed(0)
    eager = Sliced()
    model, kept = _gate_twins(eager)
    _penalised_steps(eager, model, kept, torch.randn(4, 8))
    assert not _cached_scale(32).requires_grad
    assert torch.equal(kept["eager"][0][1], kept["model"][0][1])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


_GLOBAL_SCALE = torch.full((16,), 0.5)  # a module-level table: a graph input to dynamo


class GlobalGatedBlock(Block):
    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.gate = Gate()
        self.clone = clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = _GLOBAL_SCALE.clone() if self.clone else _GLOBAL_SCALE
        return x + self.down(self.gate(torch.tanh(self.up(self.norm(x))), scale))


@pytest.mark.timeout(60, method="thread")  # the mutant below hangs in the engine
def test_a_global_tensor_a_hooked_module_receives_in_a_compiled_body_is_refused_with_the_clone_tip(
        ) -> None:
    # Guards against: replay_backward (recompute.py) no longer checking whether a replayed
    # hooked output's grad_fn is the boundary's own node: the replay then fed the node's own
    # output back into its backward, which never returned, instead of this refusal.
    # NOTE [only what eager would give a gradient is recorded]: in a compiled body the
    # original pass cannot note what its ops made, so the global gets the boundary's node
    # (documented in docs/limits.md): backward says so and names the fix, a clone made in the
    # call, which then gives eager's gradients.
    global _GLOBAL_SCALE
    pristine = _GLOBAL_SCALE.clone()
    try:
        torch.manual_seed(0)
        eager = GlobalGatedBlock(clone=False)
        for clone in (False, True):
            model = copy.deepcopy(eager)
            model.clone = clone
            model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
            pytree_ckpt.apply_activation_checkpointing(model, offload=False)
            model.gate.register_forward_hook(lambda mod, args, out: None)
            x = torch.randn(4, 8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not clone:
                    tip = "(?s)hooked output .* pass the module a clone made in the call"
                    with pytest.raises(pytree_ckpt.CheckpointError, match=tip):
                        model(x).square().mean().backward()
                    assert _GLOBAL_SCALE.grad_fn is not None  # the refused step's node: as the
                    _GLOBAL_SCALE = pristine.clone()          # limits row says, clone it afresh
                    continue
                eager.zero_grad()
                eager(x).square().mean().backward()
                model(x).square().mean().backward()
            assert not _GLOBAL_SCALE.requires_grad
            assert all(torch.equal(a.grad, b.grad)
                       for a, b in zip(eager.parameters(), model.parameters()))
    finally:
        _GLOBAL_SCALE = pristine


def test_a_cache_the_first_call_fills_for_a_hooked_module_stays_a_constant_as_in_eager() -> None:
    # NOTE [only what eager would give a gradient is recorded]: an lru_cache filled inside the
    # layer's first call is made there, by ops on no activation. Taken for an activation, it
    # got the boundary's node in place: backward was refused at that step and every later one
    # (the cache kept requiring grad). Built inside or before the first call, it is left as it
    # is, as in eager.
    @functools.lru_cache
    def cached_scale() -> torch.Tensor:
        return torch.full((16,), 0.5)

    class FirstCallCached(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.gate(torch.tanh(self.up(self.norm(x))), cached_scale()))

    torch.manual_seed(0)
    eager = FirstCallCached()
    for built_before in (False, True):
        cached_scale.cache_clear()
        if built_before:
            cached_scale()
        _constant_cache_steps(eager, cached_scale)


@pytest.mark.parametrize("fill", ["copy_ into a slice", "out= a slice", "a row, then fill_"])
def test_a_cache_built_by_filling_slices_of_an_empty_tensor_stays_a_constant_as_in_eager(
        fill: str) -> None:
    # NOTE [blank tensors]: a table an lru_cache builds at the layer's first call by writing
    # the halves of a torch.empty (as rotary caches are built). The writes went through views,
    # so the blank tensor itself was never taken as written: it counted as an activation, got
    # the boundary's node in place, and backward was refused at every step.
    @functools.lru_cache
    def cached_scale() -> torch.Tensor:
        table = torch.empty(16)
        if fill == "a row, then fill_":  # a view taken before its blank base is written
            rows = torch.empty(2, 16)
            row = rows[0]
            rows.fill_(0.5)
            return row
        if fill == "copy_ into a slice":
            table[:8].copy_(torch.full((8,), 0.5))
            table[8:].copy_(torch.full((8,), 2.0))
        else:
            torch.full((8,), 0.5, out=table[:8])
            torch.full((8,), 2.0, out=table[8:])
        return table

    class HalvesCached(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.gate(torch.tanh(self.up(self.norm(x))), cached_scale()))

    torch.manual_seed(0)
    _constant_cache_steps(HalvesCached(), cached_scale)


def test_an_activation_written_into_a_slice_of_an_empty_tensor_gets_eager_gradients() -> None:
    # NOTE [blank tensors]: written through views, the tensor takes their flow (an activation
    # copied into one half and a constant into the other: eager gives it a gradient).
    class HalvesFilled(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.up(self.norm(x)))
            both = torch.empty(4, 32)
            both[:, 16:].copy_(torch.full((4, 16), 0.5))
            both[:, :16].copy_(h)
            return x + self.down(self.gate(both[:, :16], both[:, 16:]))

    torch.manual_seed(0)
    eager = HalvesFilled()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept: dict[str, list] = {"eager": [], "model": []}
    for net, into in ((eager, kept["eager"]), (model, kept["model"])):
        net.gate.register_forward_hook(lambda mod, args, out, into=into: into.append(args[0]))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for net, key in ((eager, "eager"), (model, "model")):
            kept[key].clear()
            loss = net(x).square().mean() + 0.1 * kept[key][0].square().mean()
            loss.backward()
    assert kept["model"][0].requires_grad
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_a_mask_the_call_builds_comes_back_to_the_hook_as_eager_gives_it() -> None:
    # NOTE [only what eager would give a gradient is recorded]: a tensor built from no
    # activation (a mask) that a hooked module receives, and one detached in the call, came
    # back to the hook requiring grad (an extra output of the boundary); eager's require none.
    class Masked(GatedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.up(self.norm(x)))
            mask = torch.ones(16, 16).tril()[3] * 0.5
            return x + self.down(self.gate(h, mask)) + self.down(self.gate(h.detach(), mask))

    torch.manual_seed(0)
    eager = Masked()
    model, kept = _gate_twins(eager)
    _penalised_steps(eager, model, kept, torch.randn(4, 8))
    for (h_e, mask_e), (h_m, mask_m) in zip(kept["eager"], kept["model"]):
        assert (h_e.requires_grad, mask_e.requires_grad) == \
            (h_m.requires_grad, mask_m.requires_grad)
        assert torch.equal(h_e, h_m) and torch.equal(mask_e, mask_m)
    # (the replay ran the hooks again, appending its own two calls: as torch's checkpoint does)
    assert [a.requires_grad for a, _ in kept["model"]] == [True, False] * 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


@functools.lru_cache
def _causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n).tril()  # built at its first call, inside whichever call that is


class MaskedMix(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (mask / mask.sum(-1, keepdim=True)) @ h


class MaskedBlock(Block):
    """Hands its hooked `mix` a mask that its first call builds and an lru_cache keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = MaskedMix()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.norm(x)))
        return x + self.down(self.mix(h, _causal_mask(x.shape[0])))


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_a_mask_cached_at_its_first_call_inside_the_layer_stays_a_constant_as_in_eager(
        kind: str) -> None:
    # NOTE [only what eager would give a gradient is recorded]: the mask was made by the call's
    # ops, so it was taken for an activation and made an extra output: the cache kept a tensor
    # carrying the boundary's node, which the replay found again, and backward raised at the
    # first step, for a hook that only keeps what `mix` receives; eager has no graph on it.
    torch.manual_seed(0)
    eager = MaskedBlock()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept: dict[str, list] = {"eager": [], "model": []}
    for net, key in ((model, "model"), (eager, "eager")):
        HOOKS[kind](net.mix, kept[key])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            for net, key in ((model, "model"), (eager, "eager")):  # the model builds the mask
                if step == 0:
                    _causal_mask.cache_clear()
                net.zero_grad()
                kept[key].clear()
                x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
                loss = net(x).square().mean() + 0.1 * kept[key][0].square().mean()
                loss.backward()
            assert not _causal_mask(6).requires_grad and _causal_mask(6).grad_fn is None
            assert all(torch.equal(a.grad, b.grad)
                       for a, b in zip(eager.parameters(), model.parameters()))


class WrittenInto(Block):
    """Writes an activation into a buffer it made, then hands the hooked `down` a view of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(x.shape[0], 32)
        view = buf[:, :16]                       # taken before the write
        buf[:, :16] = torch.tanh(self.up(self.norm(x)))
        return x + self.down(view)


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_a_view_of_a_buffer_an_activation_is_written_into_gets_eager_gradients(kind: str) -> None:
    # NOTE [only what eager would give a gradient is recorded]: written in place, the buffer
    # (and the view taken of it before) requires grad in eager; followed only through the
    # call's results, the view was taken for a constant and the kept input lost its gradient.
    torch.manual_seed(0)
    eager = WrittenInto()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept: dict[str, list] = {"eager": [], "model": []}
    for net, key in ((eager, "eager"), (model, "model")):
        HOOKS[kind](net.down, kept[key])
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for net, key in ((eager, "eager"), (model, "model")):
            loss = net(x).square().mean() + 0.1 * kept[key][0].square().mean()
            loss.backward()
    assert kept["model"][0].requires_grad
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


@functools.lru_cache
def _cached_half(n: int) -> torch.Tensor:
    return torch.full((n,), 0.5)  # built outside any boundary's call


@functools.lru_cache
def _cached_blank_filled(n: int) -> torch.Tensor:
    return torch.empty(n).fill_(0.5)  # uninitialised, then written with no activation


SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mask.to(h)": lambda h: _cached_half(16).to(h),         # a no-op: the cached mask itself
    "mask.type_as(h)": lambda h: _cached_half(16).type_as(h),
    "ones_like(h)": lambda h: torch.ones_like(h) * 0.5,
    "h.new_full": lambda h: h.new_full((16,), 0.5),
    "empty filled": lambda h: _cached_blank_filled(16).to(h),
    # a bool made from h never requires grad, nor what it only selects with
    "masked by h > 0": lambda h: _cached_half(16).masked_fill(h[0] > 0, 0.25),
    "detached in place": lambda h: (h[0] * 0 + 0.5).detach_(),
    "torch.detach(h)": lambda h: torch.detach(h[0]) * 0 + 0.5,  # the function, not the method
    "h.data": lambda h: h.data[0] * 0 + 0.5,
    "zeros_like(h)": lambda h: torch.zeros_like(h) + 0.5,
    "h.new_zeros": lambda h: h.new_zeros((16,)) + 0.5,
    "mask.expand_as(h)": lambda h: _cached_half(16).expand_as(h),
    "mask.view_as(h[0])": lambda h: _cached_half(16).view_as(h[0]),
    "mask.reshape_as(h[0])": lambda h: _cached_half(16).reshape_as(h[0]),
}


class ShapedGateBlock(GatedBlock):
    def __init__(self, scale: str) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.norm(x)))
        return x + self.down(self.gate(h, SCALES[self.scale](h)))


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_a_constant_read_from_an_activation_only_for_its_shape_stays_a_constant_as_in_eager(
        scale: str) -> None:
    # NOTE [tensors read for their shape]: an activation among a call's arguments was taken
    # to flow into its result, even where only its dtype or shape is read: `mask.to(h)`, a
    # no-op returning the cached mask itself, marked the mask as written from h (made an extra
    # output, the cache got the boundary's node and backward raised, for a hook that only
    # keeps what `gate` receives), and `ones_like(h)` came back to the hook requiring grad.
    torch.manual_seed(0)
    eager = ShapedGateBlock(scale)
    model, kept = _gate_twins(eager)
    x = torch.randn(4, 8)
    for _ in range(2):
        _penalised_steps(eager, model, kept, x)
        (h_e, scale_e), (h_m, scale_m) = kept["eager"][0], kept["model"][0]
        assert (h_m.requires_grad, scale_m.requires_grad) == \
            (h_e.requires_grad, scale_e.requires_grad) == (True, False)
        assert torch.equal(scale_e, scale_m)
        assert not _cached_half(16).requires_grad and _cached_half(16).grad_fn is None
        assert all(torch.equal(a.grad, b.grad)
                   for a, b in zip(eager.parameters(), model.parameters()))


class _InvisibleKernel(torch.autograd.Function):
    """Triton-like: the forward fills a tensor from `torch.empty` with a kernel that no
    TorchFunctionMode sees (and `apply` is no call one sees either)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape, dtype=x.dtype)
        with torch._C.DisableTorchFunction():  # the kernel
            torch.mul(x, 3.0, out=y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3.0


class Tripled(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _InvisibleKernel.apply(h)


class KernelBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = Tripled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.kernel(torch.tanh(self.up(self.norm(x)))))


def test_the_output_of_a_custom_function_with_a_kernel_the_mode_cannot_see_gets_eager_gradients(
        ) -> None:
    # NOTE [blank tensors]: the output was made by `torch.empty` (no activation among its
    # arguments) and filled where the mode cannot look, so it was taken for a constant: the
    # hook kept it without a gradient and the penalty's gradients were silently missing.
    torch.manual_seed(0)
    eager = KernelBlock()
    model = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager), offload=False)
    kept: dict[str, list] = {"eager": [], "model": []}
    for net, into in ((eager, kept["eager"]), (model, kept["model"])):
        net.kernel.register_forward_hook(lambda mod, args, out, into=into: into.append(out))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for net, key in ((eager, "eager"), (model, "model")):
            kept[key].clear()
            loss = net(x).square().mean() + 0.1 * kept[key][0].square().mean()
            loss.backward()
    assert kept["model"][0].requires_grad
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))
