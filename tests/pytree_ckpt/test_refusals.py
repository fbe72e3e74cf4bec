"""The refusal of a tensor a forward hook holds from outside the layer (docs/limits.md, the row
on tensors reached other than as an input; refusals.py _held_by_a_hook)."""
import functools

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Steering(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(4))

    def attach(self, module: nn.Module) -> None:  # the usual way: a lambda over self
        module.register_forward_pre_hook(lambda mod, args: (args[0] + self.v,))


def _refusal(attach) -> str:
    torch.manual_seed(0)
    layer, steer = _Layer(), _Steering()
    attach(layer, steer)
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(CheckpointError) as refused, pytest.warns(UserWarning):
        layer(torch.randn(8, 4)).sum().backward()
    return str(refused.value)


def test_a_bound_method_hook_from_outside_is_named_and_its_tip_gives_eager_gradients() -> None:
    assert "by _Bound.hook, a forward hook on a" in _refusal(
        lambda layer, s: layer.a.register_forward_hook(_Bound(s).hook))
    x, grads = torch.randn(8, 4), []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer, bound = _Layer(), _Bound(_Steering())
        layer.intervention = bound  # the tip: register its module under the layer
        layer.a.register_forward_hook(bound.hook)
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
            with pytest.warns(UserWarning):
                layer(x).pow(2).sum().backward()
        else:
            layer(x).pow(2).sum().backward()
        grads.append([p.grad for p in layer.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*grads))


class _Bound(nn.Module):
    def __init__(self, steer: _Steering) -> None:
        super().__init__()
        self.v = steer.v

    def hook(self, mod, inp, out):
        return out + self.v


def test_a_pre_hook_closing_over_a_steering_module_is_named_by_the_refusal() -> None:
    text = _refusal(lambda layer, s: s.attach(layer.a))
    assert "pre-hook" in text and "torch.compile" not in text


def test_a_partial_hook_binding_a_steering_vector_is_named_by_the_refusal() -> None:
    text = _refusal(lambda layer, s: layer.a.register_forward_hook(
        functools.partial(lambda v, m, i, o: o + v, s.v)))
    assert "forward hook" in text and "torch.compile" not in text


def test_weight_norm_applied_before_backward_is_refused_with_a_message_naming_the_cause() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    pytree_ckpt.apply_activation_checkpointing(lin)
    loss = lin(torch.randn(8, 4)).pow(2).sum()
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(lin)
    with pytest.raises((CheckpointError, AttributeError)) as refused:
        loss.backward()
    assert "torch.compile" not in str(refused.value)


def test_a_steering_hook_on_the_checkpointed_layer_itself_gives_eager_gradients() -> None:
    """The row's other tip: hook the checkpointed layer itself (its hooks run outside)."""
    v, grads = nn.Parameter(torch.randn(4)), []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _Layer()
        layer.register_forward_hook(lambda m, i, o: o + v)
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        v.grad = None
        layer(torch.ones(2, 4)).pow(2).sum().backward()
        grads.append([v.grad, *(p.grad for p in layer.parameters())])
    assert all(torch.equal(p, q) for p, q in zip(*grads))


# Helper OQ: regressions of the hook refusal's search into closures, defaults and partials.
def _refusal_of(layer: nn.Module) -> str:
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(CheckpointError) as refused, pytest.warns(UserWarning):
        layer(torch.randn(8, 4)).sum().backward()
    return str(refused.value)


class _Cached(_Layer):
    """Reads a plain attribute of its submodule with a graph to a tensor from outside."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + self.a.cached


def test_a_logging_hook_over_a_module_inside_the_layer_is_not_blamed_by_the_refusal() -> None:
    outside = torch.randn(4, requires_grad=True)
    torch.manual_seed(0)
    eager = _Cached()
    eager.a.cached = outside * 2
    eager(torch.randn(8, 4)).sum().backward()  # eager runs: outside.grad is filled
    assert outside.grad is not None
    torch.manual_seed(0)
    layer, seen = _Cached(), []
    layer.a.cached = outside * 2
    for name, sub in layer.named_children():  # a per-module logging hook, `m=m` as usual
        sub.register_forward_hook(lambda mod, i, o, sub=sub, name=name: seen.append(name))
    text = _refusal_of(layer)
    assert "forward hook" not in text and "register its module under the layer" not in text


class _RaisingModules(nn.Module):
    def modules(self):  # a wrapper whose module walk is not to be called here
        raise RuntimeError("modules() is not available on this wrapper")


def test_a_hook_closing_over_a_module_whose_walk_raises_still_gets_the_refusal() -> None:
    torch.manual_seed(0)
    layer, steer, other = _Layer(), _Steering(), _RaisingModules()
    layer.a.register_forward_hook(lambda m, i, o: o + steer.v if other is not None else o)
    _refusal_of(layer)


def test_a_partial_of_a_steering_modules_bound_method_is_named_by_the_refusal() -> None:
    torch.manual_seed(0)
    layer, steer = _Layer(), _Bound(_Steering())
    layer.a.register_forward_hook(functools.partial(steer.hook))
    text = _refusal_of(layer)
    assert "forward hook" in text and "torch.compile" not in text


def test_a_hook_closure_with_an_unfilled_cell_and_a_steering_vector_is_named() -> None:
    torch.manual_seed(0)
    layer, steer = _Layer(), _Steering()

    def hook(m, i, o):
        return o + steer.v if True else later  # noqa: F821 (assigned after, never read)

    layer.a.register_forward_hook(hook)
    text = _refusal_of(layer)
    assert "forward hook" in text and "torch.compile" not in text
    later = None  # noqa: F841


def test_a_partial_binding_a_steering_vector_by_keyword_is_named_by_the_refusal() -> None:
    torch.manual_seed(0)
    layer, steer = _Layer(), _Steering()
    layer.a.register_forward_hook(functools.partial(lambda m, i, o, v=None: o + v, v=steer.v))
    text = _refusal_of(layer)
    assert "forward hook" in text and "torch.compile" not in text


def test_a_lazy_module_in_a_hook_closure_does_not_break_the_refusal() -> None:
    torch.manual_seed(0)
    layer, steer, lazy = _Layer(), _Steering(), nn.LazyLinear(3)
    layer.a.register_forward_hook(lambda m, i, o: o + steer.v if lazy is not None else o)
    assert "forward hook" in _refusal_of(layer)


def test_a_partial_binding_the_model_around_the_layer_is_not_blamed() -> None:
    torch.manual_seed(0)
    outside = torch.randn(4, requires_grad=True)
    model = nn.Sequential(_Cached())  # a leaf reached through layer.a.cached, not the hook
    layer = model[0]
    layer.a.cached = outside * 2
    layer.b.register_forward_hook(functools.partial(lambda mdl, m, i, o: None, model))
    text = _refusal_of(layer)
    assert "forward hook" not in text


# Helper OR: regressions of 8c874f8 (a module inside the layer skipped by the hook's search).
def test_a_hook_reading_a_tensor_derived_from_a_steering_vector_on_a_module_inside_is_named(
) -> None:
    steer = _Steering()
    eager_grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _Layer()
        layer.steer = _Steering()  # registered under the layer, as the refusal's tip says
        layer.steer.scaled = steer.v * 2  # a plain attribute with a graph to a foreign leaf
        layer.a.register_forward_hook(
            functools.partial(lambda st, m, i, o: o + st.scaled, layer.steer))
        if not wrap:
            layer(torch.randn(8, 4)).sum().backward()  # eager: the vector gets its gradient
            eager_grads.append(steer.v.grad)
            continue
        text = _refusal_of(layer)
    assert eager_grads[0] is not None
    assert "torch.compile" not in text and ("forward hook" in text or "scaled" in text)


# Helper OS: regressions of 65e9ae7 (the plain-attribute scan runs before the hook search).
class _KeepsForAuxLoss(_Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.is_grad_enabled():  # kept for an auxiliary loss or logging, as MoE routers do
            self.b.kept = h
        return self.b(torch.tanh(h))


def test_a_hook_from_outside_is_named_even_when_a_submodule_keeps_an_activation() -> None:
    eager_grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer, steer = _KeepsForAuxLoss(), _Steering()
        layer.a.register_forward_hook(functools.partial(lambda v, m, i, o: o + v, steer.v))
        if not wrap:
            layer(torch.randn(8, 4)).sum().backward()  # eager: the vector gets its gradient
            eager_grads.append(steer.v.grad)
            continue
        text = _refusal_of(layer)
    assert eager_grads[0] is not None
    assert "forward hook" in text and "b.kept" not in text


class _Batch:
    """A plain object (not opened by the boundary) carrying the encoder's output."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _KeepsFromBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, data: _Batch) -> torch.Tensor:
        h = self.a(data.x)
        if torch.is_grad_enabled():  # kept for an auxiliary loss or logging
            self.a.kept = h
        return h


def test_a_plain_input_object_is_named_even_when_a_submodule_keeps_an_activation() -> None:
    torch.manual_seed(0)
    enc, layer = nn.Linear(4, 4), _KeepsFromBatch()
    layer(_Batch(enc(torch.randn(8, 4)))).sum().backward()  # eager: the encoder gets gradients
    assert enc.weight.grad is not None
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(CheckpointError) as refused:
        layer(_Batch(enc(torch.randn(8, 4)))).sum().backward()
    assert "args[0].x" in str(refused.value) and "a.kept" not in str(refused.value)


# Helper OT: regressions of 6a3c1c0 (the plain-attribute scan asked after the hook search and
# the plain input objects, which also accept a tensor with a graph to the leaf: an activation
# kept by a hook's outside module, or written into a cache object passed in, has one too).
class _Probe(nn.Module):
    """Outside the layer: keeps the last activation of the module it hooks (a probe)."""

    def hook(self, m: nn.Module, i: tuple, o: torch.Tensor) -> None:
        self.last = o


class _PlainCache:
    """A plain cache object passed in, which the layer writes into (as HF's Cache)."""

    def __init__(self) -> None:
        self.h = None


class _WritesCache(_Layer):
    def forward(self, x: torch.Tensor, cache: _PlainCache) -> torch.Tensor:
        h = self.a(x)
        cache.h = h
        return self.b(torch.tanh(h))


def _steered(layer: _Layer, steer: _Steering) -> None:
    layer.steer = _Steering()
    layer.steer.scaled = steer.v * 2  # a plain attribute with a graph to a foreign leaf
    layer.a.register_forward_hook(
        functools.partial(lambda st, m, i, o: o + st.scaled, layer.steer))


def test_a_steering_vector_kept_inside_is_named_even_when_a_probe_from_outside_keeps_an_output(
) -> None:
    steer, eager_grads = _Steering(), []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _Layer()
        _steered(layer, steer)
        layer.b.register_forward_hook(_Probe().hook)
        if not wrap:
            layer(torch.randn(8, 4)).sum().backward()  # eager: the vector gets its gradient
            eager_grads.append(steer.v.grad)
            continue
        text = _refusal_of(layer)
    assert eager_grads[0] is not None
    assert "steer.scaled" in text and "Probe.hook" not in text


def test_a_steering_vector_kept_inside_is_named_even_when_the_layer_writes_a_plain_cache(
) -> None:
    steer, eager_grads = _Steering(), []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _WritesCache()
        _steered(layer, steer)
        if not wrap:
            layer(torch.randn(8, 4), _PlainCache()).sum().backward()
            eager_grads.append(steer.v.grad)
            continue
        pytree_ckpt.apply_activation_checkpointing(layer)
        with pytest.raises(CheckpointError) as refused, pytest.warns(UserWarning):
            layer(torch.randn(8, 4), _PlainCache()).sum().backward()
        text = str(refused.value)
    assert eager_grads[0] is not None
    assert "steer.scaled" in text and "args[1].h" not in text


def _masked_linear(*, named: bool) -> nn.Linear:
    """A hand-written mask (DropConnect, a user's pruning): a forward pre-hook sets the plain
    attribute `weight` from a trainable `weight_orig` each call."""
    torch.manual_seed(0)
    fc = nn.Linear(4, 4)
    fc.weight_orig = nn.Parameter(fc.weight.detach().clone())
    del fc.weight
    fc.register_buffer("mask", (torch.rand(4, 4) > 0.5).float())

    def mask_weight(module: nn.Module, args: tuple) -> None:
        module.weight = module.weight_orig * module.mask

    if named:
        mask_weight.name = "weight"  # type: ignore[attr-defined]
    fc.register_forward_pre_hook(mask_weight)
    fc.weight = fc.weight_orig * fc.mask
    return fc


def _two_calls_then_backward(fc: nn.Module) -> list[torch.Tensor]:
    xs = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(1))
    (fc(xs[0]).tanh().sum() + fc(xs[1]).tanh().sum()).backward()
    return [p.grad for p in fc.parameters()]


def test_an_unnamed_pre_hook_setting_the_attribute_is_named_with_the_tip_that_works() -> None:
    fc = pytree_ckpt.apply_activation_checkpointing(_masked_linear(named=False))
    with pytest.raises(CheckpointError, match="through the module attribute 'weight'") as refused:
        _two_calls_then_backward(fc)
    assert ("if _masked_linear.<locals>.mask_weight, a forward pre-hook of Linear, sets 'weight' "
            "each call, give it the attribute `name = 'weight'`") in str(refused.value)
    eager = _two_calls_then_backward(_masked_linear(named=True))
    wrapped = _two_calls_then_backward(
        pytree_ckpt.apply_activation_checkpointing(_masked_linear(named=True)))
    assert all(torch.equal(p, q) for p, q in zip(eager, wrapped, strict=True))


def test_a_value_computed_once_on_a_module_without_pre_hooks_gets_no_pre_hook_tip() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.s0 = nn.Linear(4, 4), nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale

    layer = pytree_ckpt.apply_activation_checkpointing(Scaled())
    layer.scale = layer.s0.exp()  # computed once, read by both calls
    with pytest.raises(CheckpointError, match="module attribute 'scale'") as refused:
        (layer(torch.randn(4)).sum() + layer(torch.randn(4)).sum()).backward()
    assert "pre-hook" not in str(refused.value)


# Helper OU: regressions of bffb61a (a tensor with a graph to the refused one is taken only
# where that graph does not reach the layer's own parameters too).
class _Graph:
    """A plain batch object passed in (as a graph batch), which the boundary does not open."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _ReadsGraph(_Layer):
    def forward(self, data: _Graph) -> torch.Tensor:
        return self.b(torch.tanh(self.a(data.x)))


def test_a_plain_input_object_made_by_an_encoder_tied_to_the_layer_is_named() -> None:
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer, enc = _ReadsGraph(), nn.Linear(4, 4)
        enc.weight = layer.a.weight  # tied: the encoder's bias alone is from outside
        x = torch.randn(8, 4)
        if not wrap:
            layer(_Graph(enc(x))).sum().backward()  # eager: the bias gets its gradient
            grads.append(enc.bias.grad)
            continue
        pytree_ckpt.apply_activation_checkpointing(layer)
        with pytest.raises(CheckpointError) as refused:
            layer(_Graph(enc(x))).sum().backward()
        text = str(refused.value)
    assert grads[0] is not None
    assert "still held after the replay, reached through args[0].x (an attribute of a plain " \
        "object" in text and "torch.compile" not in text


def test_a_hook_closure_over_a_vector_made_with_a_layer_parameter_is_named() -> None:
    torch.manual_seed(0)
    layer, steer = _Layer(), _Steering()
    scaled = steer.v + layer.a.bias  # relative to the layer's own bias
    layer.a.register_forward_hook(lambda m, i, o: o + scaled)
    text = _refusal_of(layer)
    assert "<lambda>, a forward hook on a that holds it from outside the layer" in text
    assert "torch.compile" not in text


def test_a_plain_input_object_read_by_a_layer_without_parameters_gives_eager_gradients(
) -> None:
    class _Plain(nn.Module):
        def forward(self, data: _Graph) -> torch.Tensor:
            return torch.tanh(data.x) * 2

    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer, enc = _Plain(), nn.Linear(4, 4)
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        layer(_Graph(enc(torch.randn(8, 4)))).pow(2).sum().backward()
        grads.append([p.grad for p in enc.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*grads))


def test_a_steering_vector_made_with_another_layers_parameter_is_named_by_its_hook() -> None:
    torch.manual_seed(0)
    layer, other, steer = _Layer(), _Layer(), _Steering()
    pytree_ckpt.apply_activation_checkpointing(other)
    scaled = steer.v * other.a.bias  # another checkpointed layer's parameter
    layer.a.register_forward_hook(lambda m, i, o: o + scaled)
    text = _refusal_of(layer)
    assert "forward hook" in text and "torch.compile" not in text


class _PBConfig:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table


class _PBReadsConfig(nn.Module):
    def __init__(self, config: _PBConfig) -> None:
        super().__init__()
        self.lin, self.config = nn.Linear(4, 4), config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.config.table)


def test_a_probe_hook_keeping_an_activation_is_not_named_for_a_table_a_config_holds() -> None:
    """The table is held by a plain config object on the layer; a logging probe on lin keeps
    lin's output, made by the replay from the table and lin's parameters (bffb61a's
    exclusion): the second round (any_graph=True) names the probe as holding the table
    'from outside the layer' and tips registering its module under the layer."""
    def make_probe():
        last = None

        def probe(module, args, out):
            nonlocal last
            last = out
        return probe

    layer = _PBReadsConfig(_PBConfig(torch.ones(4, requires_grad=True)))
    layer.lin.register_forward_hook(make_probe())
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as refused:
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert "probe" not in str(refused.value)
