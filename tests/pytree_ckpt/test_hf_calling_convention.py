"""``pytree_ckpt.checkpoint`` as a transformers model's checkpoint function
(``model._set_gradient_checkpointing(True, pytree_ckpt.checkpoint)``), through a stand-in of
transformers' ``GradientCheckpointingLayer``: no transformers import. transformers 5.24 wraps
each layer class's ``forward`` and calls ``func(partial(forward, self, **kwargs), *args)`` with
the class's plain function and the layer bound first; earlier 5.x releases wrapped ``__call__``
and passed ``partial(super().__call__, **kwargs)``. Both are compared bit for bit (fp32) with the
same layers run eagerly."""

from __future__ import annotations

import collections
import copy
import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from tests.conftest import assert_same_grads, grads_of


class ForwardWrappingLayer(nn.Module):
    """transformers 5.24's GradientCheckpointingLayer: the class's forward is wrapped."""

    gradient_checkpointing = False
    _gradient_checkpointing_func: Callable[..., Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        @functools.wraps(forward)
        def forward_with_checkpointing(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs),
                                                         *args)
            return forward(self, *args, **kwargs)

        cls.forward = forward_with_checkpointing  # type: ignore[method-assign]


class CallWrappingLayer(nn.Module):
    """Earlier transformers 5.x: ``__call__`` is wrapped, hooks run inside the checkpoint."""

    gradient_checkpointing = False
    _gradient_checkpointing_func: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs),
                                                     *args)
        return super().__call__(*args, **kwargs)


CALLS: collections.Counter[int] = collections.Counter()


class Flags:
    """An opaque object among the keywords (a config, a kwargs bundle): passed as it is."""

    scale = 0.5


def _decoder_forward(layer: nn.Module, hidden_states: torch.Tensor,
                     attention_mask: torch.Tensor | None = None,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                     cache: Any = None, use_cache: bool = False,
                     cache_position: torch.Tensor | None = None, flags: Flags | None = None,
                     output_attentions: bool = False, **kwargs: Any) -> torch.Tensor:
    assert cache is None and not use_cache and position_embeddings is not None
    assert flags is not None and cache_position is not None
    cos, sin = position_embeddings
    h = layer.norm(hidden_states)
    q, k = layer.q(h) * cos + h * sin, layer.k(h) * cos - h * sin
    scores = q @ k.transpose(1, 2) * flags.scale + cache_position[:, None] * 0.0
    if attention_mask is not None:
        scores = scores + attention_mask
    attn = layer.drop(scores.softmax(-1)) @ layer.v(h)
    hidden_states = hidden_states + attn
    return hidden_states + layer.mlp(layer.bn(hidden_states.transpose(1, 2)).transpose(1, 2))


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)  # attention_dropout > 0: the replay must draw the same mask
        self.bn = nn.BatchNorm1d(16)  # running statistics: a forward changes module state
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CALLS[id(self)] += 1  # counted outside the module: an int attribute is module state
        return _decoder_forward(self, *args, **kwargs)


class ForwardWrappedDecoderLayer(ForwardWrappingLayer, _Body):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _Body.forward(self, *args, **kwargs)


class CallWrappedDecoderLayer(CallWrappingLayer, _Body):
    pass


LAYERS = {"forward": ForwardWrappedDecoderLayer, "__call__": CallWrappedDecoderLayer}


def _model(kind: str, checkpoint_fn: Callable[..., Any] | None) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(LAYERS[kind]() for _ in range(2))
    for layer in layers:  # counted by id: a freed layer of an earlier test may have had it
        CALLS[id(layer)] = 0
    if checkpoint_fn is not None:  # what model._set_gradient_checkpointing(True, fn) sets
        for layer in layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = checkpoint_fn
    return layers.train()


def _layer_kwargs(seq: int = 6) -> dict[str, Any]:
    # What a transformers model passes each decoder layer in training (use_cache turned off).
    return dict(attention_mask=torch.full((seq, seq), float("-inf")).triu(1),
                position_embeddings=(torch.randn(seq, 16), torch.randn(seq, 16)),
                cache=None, use_cache=False, cache_position=torch.arange(seq),
                flags=Flags(), output_attentions=False)


def _run(layers: nn.ModuleList, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    h = hidden
    for layer in layers:
        h = layer(h, **kwargs)
    return h.square().mean()


def _grads_and_warnings(layers: nn.ModuleList) -> tuple[list[torch.Tensor | None],
                                                        list[warnings.WarningMessage]]:
    """One backward from the same hidden states and kwargs whatever the layers: their
    parameters' and the hidden states' gradients, and every warning it gave."""
    torch.manual_seed(1)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    kwargs = _layer_kwargs()
    torch.manual_seed(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(layers, hidden, kwargs).backward()
    return grads_of([*layers.parameters(), hidden]), caught


@pytest.mark.parametrize("kind", ["forward", "__call__"])
def test_two_adamw_steps_through_the_transformers_calling_convention_match_eager(
        kind: str) -> None:
    # Nothing warned either: this is the layer's only boundary (not "checkpointed twice"), and
    # the layer's state is known (no "plain function changed the buffers").
    eager, ckpt = _model(kind, None), _model(kind, pytree_ckpt.checkpoint)
    results = []
    for layers in (eager, ckpt):
        opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
        torch.manual_seed(1)
        hidden = torch.randn(2, 6, 16, requires_grad=True)
        kwargs = _layer_kwargs()
        losses, grads = [], []
        for step in range(2):
            torch.manual_seed(10 + step)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                loss = _run(layers, hidden, kwargs)
                loss.backward()
            losses.append(loss.detach())
            grads.append(grads_of([*layers.parameters(), hidden]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            hidden.grad = None
        results.append((losses, grads, [b.clone() for b in layers.buffers()],
                        [CALLS[id(layer)] for layer in layers]))
    (eager_losses, eager_grads, eager_buffers, eager_calls), \
        (losses, grads, buffers, calls) = results
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    for a, b in zip(eager_grads, grads):
        assert_same_grads(a, b)
    # the BatchNorm's running statistics moved once per step, as eager's: not again in the replay
    assert all(torch.equal(a, b) for a, b in zip(eager_buffers, buffers))
    assert eager_calls == [2, 2] and calls == [4, 4]  # each step: original pass + one replay


@pytest.mark.parametrize("kind", ["forward", "__call__"])
def test_autograd_grad_through_the_transformers_calling_convention_gives_eager_gradients(
        kind: str) -> None:
    # transformers 5.24 passes partial(LayerClass.forward, layer, **kwargs): the layer is the
    # partial's first argument, not a bound method's __self__. Taken as an unknown callable,
    # torch.autograd.grad (and backward(inputs=...)) was refused.
    eager, ckpt = _model(kind, None), _model(kind, pytree_ckpt.checkpoint)
    got = []
    for layers in (eager, ckpt):
        torch.manual_seed(1)
        hidden = torch.randn(2, 6, 16, requires_grad=True)
        kwargs = _layer_kwargs()
        torch.manual_seed(2)
        wrt = [hidden, *layers.parameters()]
        got.append(list(torch.autograd.grad(_run(layers, hidden, kwargs), wrt)))
        assert all(p.grad is None for p in layers.parameters())
    assert_same_grads(*got)


def test_torch_checkpoint_options_passed_through_name_the_layer_in_the_warning() -> None:
    # transformers passes gradient_checkpointing_kwargs to the function as keywords:
    # partial(pytree_ckpt.checkpoint, use_reentrant=False) hands use_reentrant to the layer's
    # **kwargs. The warning names the layer class, not "partial".
    eager = _model("forward", None)
    ckpt = _model("forward", functools.partial(pytree_ckpt.checkpoint, use_reentrant=False))
    (expected, _), (got, caught) = _grads_and_warnings(eager), _grads_and_warnings(ckpt)
    assert_same_grads(expected, got)
    messages = [str(w.message) for w in caught if "use_reentrant" in str(w.message)]
    assert len(messages) == 2  # once per layer call
    assert all("ForwardWrappedDecoderLayer receives ['use_reentrant']" in m for m in messages)


def output_capturing_hook(module: nn.Module, args: Any, output: Any) -> None:
    """transformers' output capturing hook (utils/output_capturing.py): keeps the output in
    the collector of the model call running (none in backward, where the replay runs)."""
    if COLLECTOR:
        COLLECTOR[-1].append(output)


output_capturing_hook.__module__ = "transformers.utils.output_capturing"
COLLECTOR: list[list[torch.Tensor]] = []


class MoeDecoderLayer(ForwardWrappingLayer):
    """A router whose logits transformers collects with a hook for the load-balancing loss
    (output_router_logits=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.router.register_forward_hook(output_capturing_hook)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        weights = self.router(hidden_states).softmax(-1)
        top, ids = weights.topk(2, dim=-1)
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            mask = (ids == e).any(-1, keepdim=True)
            out = out + expert(hidden_states) * mask * (top * (ids == e)).sum(-1, keepdim=True)
        return hidden_states + out


def test_router_logits_captured_by_transformers_hooks_keep_their_gradient() -> None:
    # The aux loss reads the router logits the hook collected in the original pass. With the
    # layer unknown (its partial taken as a plain function) they were computed under no-grad:
    # the router got no gradient from the aux loss (qwen2_moe and mixtral: max |d| 5e-4).
    torch.manual_seed(0)
    eager = nn.ModuleList(MoeDecoderLayer() for _ in range(2)).train()
    torch.manual_seed(0)
    ckpt = nn.ModuleList(MoeDecoderLayer() for _ in range(2)).train()
    for layer in ckpt:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = pytree_ckpt.checkpoint
    grads = []
    for layers in (eager, ckpt):
        torch.manual_seed(1)
        hidden = torch.randn(2, 6, 16, requires_grad=True)
        h = hidden
        COLLECTOR.append([])
        for layer in layers:
            h = layer(h, position_embeddings=(torch.ones(6, 16), torch.zeros(6, 16)),
                      use_cache=False)
        router_logits = COLLECTOR.pop()
        assert len(router_logits) == 2 and all(t.requires_grad for t in router_logits)
        aux = sum(logits.logsumexp(-1).square().mean() for logits in router_logits)
        (h.square().mean() + 0.01 * aux).backward()
        grads.append(grads_of([*layers.parameters(), hidden]))
    assert_same_grads(*grads)


def test_checkpointed_with_offload_as_the_transformers_function_offloads_the_hidden_states(
        ) -> None:
    # The boundary's inputs are the positional arguments: the hidden states, 2 * 6 * 16 fp32
    # per layer. What the partial binds (mask, cos/sin) stays where it is, shared by layers.
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    eager = _model("forward", None)
    ckpt = _model("forward", lambda fn, *args: pytree_ckpt.checkpointed(
        fn, offload=manager)(*args))
    grads = []
    for layers in (eager, ckpt):
        torch.manual_seed(1)
        hidden = torch.randn(2, 6, 16, requires_grad=True)
        kwargs = _layer_kwargs()
        torch.manual_seed(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nor "checkpointed twice"
            _run(layers, hidden, kwargs).backward()
        grads.append(grads_of([*layers.parameters(), hidden]))
    assert_same_grads(*grads)
    stats = manager.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 2 * (2 * 6 * 16 * 4)


def test_offload_switched_on_by_the_environment_for_the_transformers_function_is_not_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # XTUNER_ACTIVATION_OFFLOAD=1 with model._set_gradient_checkpointing(True,
    # pytree_ckpt.checkpoint): checkpoint() never offloads, so the variable did nothing, and
    # nothing said so (found porting a transformers model's loop). Warned once, naming the fix;
    # checkpointed(fn, offload=...) chooses, and is not warned. Gradients stay eager's.
    from pytree_ckpt import functional

    monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    manager = offload.default_manager()
    before = manager.stats()["windows"]
    (expected, _), (got, caught) = (_grads_and_warnings(_model("forward", fn))
                                    for fn in (None, pytree_ckpt.checkpoint))
    assert_same_grads(expected, got)
    told = [w for w in caught if "XTUNER_ACTIVATION_OFFLOAD" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]  # two layers, one warning
    assert "never offloads" in str(told[0].message)
    assert "checkpointed(fn)" in str(told[0].message)
    assert told[0].filename == __file__  # the call that made the checkpoint (the layer's)
    assert manager.stats()["windows"] == before  # as it says: nothing offloaded
    for quiet in (lambda fn, *args: pytree_ckpt.checkpointed(fn)(*args),
                  lambda fn, *args: pytree_ckpt.checkpointed(fn, offload=False)(*args),
                  # nested in a boundary, whose window (had it one) covers the inputs
                  lambda fn, *args: pytree_ckpt.checkpointed(
                      lambda *a: pytree_ckpt.checkpoint(fn, *a), offload=False)(*args)):
        monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _run(_model("forward", quiet), torch.randn(2, 6, 16, requires_grad=True),
                 _layer_kwargs()).backward()
    assert manager.stats()["windows"] == before + 2  # checkpointed(fn) read the variable


def test_the_offload_variable_is_read_from_whatever_os_environ_is_at_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: checkpoint() reading the variable from the mapping os.environ was at
    # import (NOTE [the variable read cheaply] in functional.py) after a test or launcher put
    # another mapping in its place: the variable set there went unseen, and unwarned. Also an
    # empty value, off for os.environ.get, read as on by the cheap lookup. Gradients stay eager's.
    import os

    from pytree_ckpt import functional

    expected, _ = _grads_and_warnings(_model("forward", None))
    told = []
    for environ, warned in (({"XTUNER_ACTIVATION_OFFLOAD": "1"}, True),
                            ({}, False), ({"XTUNER_ACTIVATION_OFFLOAD": ""}, False)):
        monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
        monkeypatch.setattr(os, "environ", environ)
        got, caught = _grads_and_warnings(_model("forward", pytree_ckpt.checkpoint))
        monkeypatch.undo()
        assert_same_grads(expected, got)
        told.append(sum("XTUNER_ACTIVATION_OFFLOAD" in str(w.message) for w in caught))
    monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "")  # os.environ itself, set empty
    got, caught = _grads_and_warnings(_model("forward", pytree_ckpt.checkpoint))
    told.append(sum("XTUNER_ACTIVATION_OFFLOAD" in str(w.message) for w in caught))
    assert told == [1, 0, 0, 0]


def test_a_layer_wrapped_in_place_with_the_transformers_switch_on_too_is_warned() -> None:
    # Two boundaries a step (the installed one, and transformers' around the body): the
    # installed one says so, whichever function transformers was given.
    layers = _model("forward", pytree_ckpt.checkpoint)
    for layer in layers:
        pytree_ckpt.apply_activation_checkpointing(layer)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="ForwardWrappedDecoderLayer is checkpointed twice"):
        _run(layers, hidden, _layer_kwargs()).backward()


def test_only_a_function_the_layer_class_defines_makes_a_partial_the_layers_method() -> None:
    # NOTE [a method bound by a partial]: a helper that takes a module first may use any other
    # module's parameters, so it stays an unknown callable; the class's forward, under
    # functools.wraps wrappers (transformers' own), is the layer's method.
    from pytree_ckpt.module_state import owning_module

    class Layer(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h

    original = Layer.forward

    @functools.wraps(original)
    def wrapped(self: nn.Module, *args: Any) -> Any:
        return original(self, *args)

    Layer.forward = wrapped  # type: ignore[method-assign]
    layer = Layer()

    def helper(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h

    assert owning_module(functools.partial(original, layer)) is layer
    assert owning_module(functools.partial(wrapped, layer)) is layer
    assert owning_module(functools.partial(helper, layer)) is None
    helper.__name__ = "forward"  # a namesake that is not the class's function
    assert owning_module(functools.partial(helper, layer)) is None


def test_a_partial_of_the_layer_class_forward_compiled_is_the_layers_method() -> None:
    # partial(torch.compile(Layer.forward), layer): the compiled wrapper's __wrapped__ is the
    # class's function, as functools.wraps wrappers of a bound method are seen through. Taken
    # as an unknown callable, the BatchNorm's running statistics moved in the replay too
    # (num_batches_tracked 2 against eager's 1, a "plain function changed" warning).
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            CALLS[id(self)] += 1
            return self.bn(self.lin(h)).relu()

    compiled = torch.compile(Normed.forward, backend="eager")
    results = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        layer = Normed().train()
        CALLS[id(layer)] = 0
        torch.manual_seed(1)
        x = torch.randn(4, 8, requires_grad=True)
        fn = functools.partial(compiled, layer)
        with warnings.catch_warnings():  # dynamo's own warnings are not the library's
            warnings.filterwarnings("error", message="pytree_ckpt")
            out = pytree_ckpt.checkpoint(fn, x) if wrapped else fn(x)
            out.square().sum().backward()
        results.append((grads_of([*layer.parameters(), x]),
                        [b.clone() for b in layer.buffers()], CALLS[id(layer)]))
    (eager_grads, eager_buffers, eager_calls), (grads, buffers, calls) = results
    assert_same_grads(eager_grads, grads)
    assert all(torch.equal(a, b) for a, b in zip(eager_buffers, buffers))
    assert buffers[-1].item() == 1  # num_batches_tracked: the original pass only
    assert (eager_calls, calls) == (1, 2)


class _CrossAttentionBody(nn.Module):
    """A decoder layer with cross-attention given the encoder's output (which requires grad)
    as a keyword, as transformers 5.24's LW-DETR decoder does (``encoder_hidden_states=``), so
    the layer wrapper binds it in the partial; ``adapter`` stands for a trainable module passed
    the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                adapter: nn.Module | None = None, mask: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        CALLS[id(self)] += 1
        kv = self.kv(encoder_hidden_states)
        scores = (self.q(hidden_states) @ kv.transpose(1, 2)) + mask
        h = hidden_states + scores.softmax(-1) @ kv
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return adapter(h) if adapter is not None else h


class ForwardWrappedCrossAttentionLayer(ForwardWrappingLayer, _CrossAttentionBody):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _CrossAttentionBody.forward(self, *args, **kwargs)


class CallWrappedCrossAttentionLayer(CallWrappingLayer, _CrossAttentionBody):
    pass


CROSS_LAYERS = {"forward": ForwardWrappedCrossAttentionLayer,
                "__call__": CallWrappedCrossAttentionLayer}


@pytest.mark.parametrize("kind", ["forward", "__call__"])
def test_a_tensor_requiring_grad_bound_by_transformers_partial_gets_eager_gradients(
        kind: str) -> None:
    # partial(forward, layer, encoder_hidden_states=..., adapter=...): what the partial binds
    # was passed as it is, so the encoder's output and the adapter's parameters were neither
    # inputs nor the layer's parameters, and the boundary refused them in backward ("neither an
    # input nor a parameter of the module"). Those are now the boundary's inputs; the mask,
    # which requires no grad, stays bound.
    results = []
    for function in (None, pytree_ckpt.checkpoint):
        torch.manual_seed(0)
        encoder, adapter = nn.Linear(16, 16), nn.Linear(16, 16)
        layers = nn.ModuleList(CROSS_LAYERS[kind]() for _ in range(2)).train()
        for layer in layers:
            CALLS[id(layer)] = 0
            if function is not None:
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = function
        torch.manual_seed(1)
        hidden, source = torch.randn(2, 6, 16, requires_grad=True), torch.randn(2, 5, 16)
        mask = torch.zeros(6, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nor a plain function's changed buffers
            encoded = encoder(source)
            h = hidden
            for layer in layers:
                h = layer(h, encoder_hidden_states=encoded, adapter=adapter, mask=mask)
            h.square().mean().backward()
        modules = [encoder, adapter, layers]
        results.append((grads_of([*(p for m in modules for p in m.parameters()), hidden]),
                        [b.clone() for b in layers.buffers()],
                        [CALLS[id(layer)] for layer in layers]))
    (eager_grads, eager_buffers, eager_calls), (grads, buffers, calls) = results
    assert_same_grads(eager_grads, grads)
    assert all(torch.equal(a, b) for a, b in zip(eager_buffers, buffers))
    assert (eager_calls, calls) == ([1, 1], [2, 2])


class _TakesItsOwn(nn.Module):
    """A forward given its own parameter and submodule as keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.gain = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, gain: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return norm(self.lin(x)) * gain


def test_a_partial_binding_the_layers_own_parameter_and_submodule_leaves_them_bound() -> None:
    # NOTE [what a layer's partial binds]: what needs a gradient among the bound keywords is
    # the layer's own (its parameter, its submodule): known as the layer's parameters, left
    # bound (the partial as it is), with eager's gradients. (No test reached that branch.)
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _TakesItsOwn()
        x = torch.randn(3, 8, requires_grad=True)
        fn = functools.partial(type(layer).forward, layer, gain=layer.gain, norm=layer.norm)
        out = pytree_ckpt.checkpoint(fn, x) if wrap else fn(x)
        out.square().sum().backward()
        results.append([x.grad, *(p.grad for p in layer.parameters())])
    assert_same_grads(*results)


class _TakesAPosition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x + pos)


def test_a_partial_of_a_wrapped_forward_binding_a_trainable_tensor_is_refused_not_silent(
        ) -> None:
    # Coverage audit (helper EA): NOTE [what a layer's partial binds] lifts a trainable bound
    # keyword into the call's inputs for partial(layer.forward, ...); a partial of a wrapper of
    # the forward (functools.wraps: a decorator) is left as it is. Its bound tensor then gets
    # no gradient from the replay: refused in backward, never a silent missing gradient.
    import functools

    def logged(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)
        return call

    torch.manual_seed(0)
    layer = _TakesAPosition()
    pos = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    lifted = pytree_ckpt.checkpoint(functools.partial(layer.forward, pos=pos), x)
    lifted.square().sum().backward()
    assert pos.grad is not None  # the plain partial: lifted, eager's gradient
    pos.grad = None
    out = pytree_ckpt.checkpoint(functools.partial(logged(layer.forward), pos=pos), x)
    with pytest.raises(pytree_ckpt.CheckpointError) as refused:
        out.square().sum().backward()
    assert str(refused.value).startswith(
        "the forward of _TakesAPosition uses a tensor that requires grad but is neither an "
        "input nor a parameter of the module; it would get no gradient")
    assert pos.grad is None


@pytest.mark.parametrize("setting", ["0", "no_grad", "saved_tensors_hooks"])
def test_the_offload_variable_is_told_only_when_on_and_the_call_saves_on_the_device(
        monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    # NOTE [the variable and checkpoint()]: told when the variable says on, grad is enabled and
    # no saved-tensor hook sees the inputs. Set to "0" it says off; under no_grad there is no
    # boundary; under a hook (save_on_cpu, a census) the inputs may not stay on the device.
    # None of these warns, and none spends the one warning: the next plain call is told.
    from pytree_ckpt import functional

    monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1" if setting in (
        "no_grad", "saved_tensors_hooks") else setting)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if setting == "no_grad":
            with torch.no_grad():
                pytree_ckpt.checkpoint(lin, x)
        elif setting == "saved_tensors_hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                pytree_ckpt.checkpoint(lin, x).sum().backward()
        else:
            pytree_ckpt.checkpoint(lin, x).sum().backward()
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    with pytest.warns(UserWarning, match="never offloads"):
        pytree_ckpt.checkpoint(lin, x)


def test_an_offload_variable_checkpoint_cannot_read_is_told_once_with_the_refusal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Helper GL: XTUNER_ACTIVATION_OFFLOAD=yes (meant as on) gave a transformers user of
    # pytree_ckpt.checkpoint no offload and no word, where every other entry point refuses the
    # value. checkpoint() does not read the variable: told once, with that refusal's text.
    from pytree_ckpt import functional

    monkeypatch.setattr(functional, "_ENV_OFFLOAD_TOLD", False)
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "yes")
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for _ in range(2):
            pytree_ckpt.checkpoint(lin, x).sum().backward()
    with pytest.raises(pytree_ckpt.CheckpointConfigError) as refused:
        pytree_ckpt.checkpointed(lin)
    assert [str(w.message) for w in told] == [
        "pytree_ckpt.checkpoint(fn, ...) never offloads, and apply_activation_checkpointing, "
        "checkpoint_layers, apply_recompute_config and checkpointed(fn) refuse the variable's "
        f"value: {refused.value}"]


class _TakesPositionals(nn.Module):
    """A forward whose encoder states (and mask) transformers' partial may bind positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, mask: torch.Tensor, encoded: torch.Tensor, x: torch.Tensor,
                adapter: nn.Module) -> torch.Tensor:
        return torch.tanh(self.lin(x) + encoded) * mask + adapter(x)


@pytest.mark.parametrize("bound", ["mask and encoder states", "mask"])
def test_positional_arguments_a_partial_binds_after_the_layer_give_eager_gradients(
        bound: str) -> None:
    # NOTE [what a layer's partial binds]: encoder states requiring grad bound positionally
    # become inputs with the positionals after them (their order kept); a mask bound so
    # stays bound while a keyword (the adapter) is lifted.
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer, encoder, adapter = _TakesPositionals(), nn.Linear(8, 8), nn.Linear(8, 8)
        x, source = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
        mask = (torch.rand(3, 8) > 0.5).float()
        encoded = encoder(source)
        if bound == "mask":
            fn = functools.partial(type(layer).forward, layer, mask, adapter=adapter)
            args: tuple[Any, ...] = (encoded, x)
        else:
            fn = functools.partial(type(layer).forward, layer, mask, encoded, adapter=adapter)
            args = (x,)
        out = pytree_ckpt.checkpoint(fn, *args) if wrap else fn(*args)
        out.square().sum().backward()
        results.append(grads_of([x, *layer.parameters(), *encoder.parameters(),
                                 *adapter.parameters()]))
    assert_same_grads(*results)


class _Transformers4Model(nn.Module):
    """transformers 4.3x-4.4x: the flag is on the model (LlamaModel), not on its layers, and
    the model calls ``self._gradient_checkpointing_func(decoder_layer.__call__, *args)``, the
    function ``gradient_checkpointing_enable()`` built: torch's checkpoint, reentrant by
    default."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Body() for _ in range(2))
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=use_reentrant)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        k = _layer_kwargs()
        h = hidden
        for layer in self.layers:
            h = self._gradient_checkpointing_func(
                layer.__call__, h, k["attention_mask"], k["position_embeddings"], None, False,
                k["cache_position"], k["flags"], False)
        return h.square().mean()


# Guards against (helper HQ), as it was found:
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_layer_wrapped_in_place_under_a_transformers_4_model_checkpointing_it_too_is_warned(
        use_reentrant: bool) -> None:
    # boundary.md: leave gradient_checkpointing_enable() off "or every layer is checkpointed
    # twice: exact, but each step runs the layer once more (warned at its first replay)".
    # Under transformers 4.x the switch lives on the model, so the layer holds no flag: exact
    # and three forwards a step, but nothing is said.
    model = _Transformers4Model(use_reentrant).train()
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer)
        CALLS[id(layer)] = 0
    torch.manual_seed(2)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(hidden).backward()
    assert [CALLS[id(layer)] for layer in model.layers] == [3, 3]   # once more than needed
    assert any("checkpointed twice" in str(w.message) for w in caught)


class ClassForwardCallWrappingLayer(nn.Module):
    """A GradientCheckpointingLayer written as the brief of helper KG has it: ``__call__``
    wrapped, the checkpoint given ``partial(type(self).forward, self, **kwargs)``; the class's
    forward is the body itself, not a checkpointing wrapper."""

    gradient_checkpointing = False
    _gradient_checkpointing_func: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(
                functools.partial(self.__class__.forward, self, **kwargs), *args)
        return super().__call__(*args, **kwargs)


class ClassForwardDecoderLayer(ClassForwardCallWrappingLayer, _Body):
    pass


# Guards against (helper KG), as it was found:
def test_a_partial_of_a_plain_class_forward_as_the_only_boundary_is_not_told_twice() -> None:
    # One boundary a layer: each layer's forward runs twice a step (forward and replay), as
    # with transformers' own conventions above, and the gradients are eager's; yet the layer is
    # warned "checkpointed twice ... runs its forward once more than needed", whose tip
    # (activation_checkpointing_disable()) would turn off its only checkpointing.
    torch.manual_seed(0)
    eager = nn.ModuleList(ClassForwardDecoderLayer() for _ in range(2)).train()
    torch.manual_seed(0)
    ckpt = nn.ModuleList(ClassForwardDecoderLayer() for _ in range(2)).train()
    for layer in ckpt:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = pytree_ckpt.checkpoint
    for layer in (*eager, *ckpt):
        CALLS[id(layer)] = 0
    want, _ = _grads_and_warnings(eager)
    got, caught = _grads_and_warnings(ckpt)
    assert_same_grads(want, got)
    assert [CALLS[id(layer)] for layer in ckpt] == [2, 2]  # the forward and one replay
    assert not [w for w in caught if "checkpointed twice" in str(w.message)]


class _KVCache:
    """transformers' DynamicCache, as the boundary knows one: update() and get_seq_length()."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, keys: torch.Tensor) -> torch.Tensor:
        self.keys.append(keys)
        return torch.cat(self.keys, dim=1)

    def get_seq_length(self) -> int:
        return sum(k.shape[1] for k in self.keys)


class _CachedBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, hidden_states: torch.Tensor, cache: Any = None,
                **kwargs: Any) -> torch.Tensor:
        keys = self.k(hidden_states)
        if cache is not None:  # transformers' attention: fills the cache whenever given one
            keys = cache.update(keys)
        scores = self.q(hidden_states) @ keys.transpose(1, 2)
        return hidden_states + scores.softmax(-1) @ keys


class ForwardWrappedCachedLayer(ForwardWrappingLayer, _CachedBody):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _CachedBody.forward(self, *args, **kwargs)


# Guards against (helper KG), as it was found:
def test_a_cache_bound_in_the_transformers_partial_is_refused_as_one_passed_in_is() -> None:
    # docs/boundary.md: a call given a cache under any keyword (Gemma's `cache=`) is refused
    # with grad enabled, since the replay fills it again and reads what the original pass
    # stored. Wrapped in place it is; through transformers' calling convention the cache is
    # bound in partial(forward, self, cache=...), not an input of the boundary, and passes:
    # the replay attends over the original pass's keys and its own (12 where eager has 6).
    torch.manual_seed(0)
    eager = ForwardWrappedCachedLayer().train()
    ckpt = ForwardWrappedCachedLayer().train()
    ckpt.load_state_dict(eager.state_dict())
    ckpt.gradient_checkpointing = True
    ckpt._gradient_checkpointing_func = pytree_ckpt.checkpoint
    hidden = torch.randn(2, 6, 16)
    eager(hidden, cache=_KVCache()).square().sum().backward()
    # As documented, and as wrapped in place: before the original pass, naming the keyword.
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"kwargs\['cache'\]"):
        ckpt(hidden, cache=_KVCache())


class _RoutedBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, hidden_states: torch.Tensor, router: nn.Module | None = None,
                **kwargs: Any) -> torch.Tensor:
        assert router is not None
        h = self.lin(hidden_states)
        return h * router(h).softmax(-1).sum(-1, keepdim=True)


class ForwardWrappedRoutedLayer(ForwardWrappingLayer, _RoutedBody):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _RoutedBody.forward(self, *args, **kwargs)


# Guards against (helper KG), as it was found:
def test_a_frozen_hooked_module_passed_through_the_transformers_partial_keeps_its_gradient(
        ) -> None:
    # A frozen router shared by the layers, passed as a keyword (hooks on modules passed as
    # arguments are recorded: docs/boundary.md, 'Forward hooks inside a layer'). Wrapped in
    # place its hooked output leaves with its gradient (eager's, bit for bit); through
    # transformers' calling convention the frozen module stays bound in the partial, its
    # output keeps no graph, and the loss on it gives the layer's Linear no gradient: silent.
    def step(way: str) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        layer = ForwardWrappedRoutedLayer().train()
        router = nn.Linear(16, 4).requires_grad_(False)
        if way == "transformers":
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = pytree_ckpt.checkpoint
        kept: list[torch.Tensor] = []
        router.register_forward_hook(lambda m, args, out: kept.append(out))
        hidden = torch.randn(2, 6, 16)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pytree_ckpt: forward hooks inside")
            out = layer(hidden, router=router)
        (out.square().sum() + kept[0].square().sum()).backward()
        return grads_of([*layer.parameters()])

    assert_same_grads(step("eager"), step("transformers"))


# Helper NP (review of dbf8db3): a cache one level down in a plain-object argument.
class _NPCache:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, index: int) -> tuple[Any, Any]:
        self.keys.append(k)
        return k, v

    def get_seq_length(self, index: int = 0) -> int:
        return 0


class _NPLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _NPAnything:
    def __getattr__(self, name: str) -> Any:
        return lambda *args: 0


class _NPConfig:
    def __init__(self) -> None:
        self.tokenizer = type("Tok", (), {"update": lambda self: None})()
        self.anything, self.layers = _NPAnything(), 2


class _NPReadsCaches(_NPLayer):
    _can_checkpoint_with_cache = True


@pytest.mark.parametrize("ctx", [_NPAnything(), _NPConfig()], ids=["getattr_anything", "config"])
def test_a_plain_object_holding_no_cache_gives_eager_gradients(ctx: Any) -> None:
    torch.manual_seed(0)
    eager = _NPLayer()
    ours = copy_of(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)
    x = torch.randn(2, 4)
    got = []
    for model in (eager, ours):
        model(x, ctx=ctx).square().sum().backward()
        got.append(grads_of(model.parameters()))
    assert_same_grads(*got)


def copy_of(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def test_a_cache_inside_a_plain_object_is_accepted_by_a_layer_that_opts_in() -> None:
    import types
    layer = _NPReadsCaches()
    pytree_ckpt.apply_activation_checkpointing(layer)
    layer(torch.randn(2, 4, requires_grad=True), ctx=types.SimpleNamespace(c=_NPCache())).sum(
        ).backward()


@pytest.mark.parametrize("held", ["tensors", "numbers"])
def test_checking_a_plain_object_argument_for_a_cache_asks_nothing_of_tensors_and_numbers(
        held: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against (helper NP) the cost of dbf8db3's look one level into a plain object
    # argument: each attribute's class was asked for four methods at every call (70 us a call
    # for 64 tensors, where the check cost 1.3 us). Counted, not timed: tensors and numbers
    # are told by their type alone; an object (the only kind that can be a cache) is asked.
    from pytree_ckpt import tree_refusals

    asked: list[type] = []
    original = tree_refusals._cache_kind

    def counting(value: Any, /) -> str | None:
        asked.append(type(value))
        return original(value)

    monkeypatch.setattr(tree_refusals, "_cache_kind", counting)

    class Batch:  # 64 per-step values on a plain object (holds no cache), and one object
        def __init__(self) -> None:
            self.__dict__.update({f"t{i}": torch.zeros(1) if held == "tensors" else i
                                  for i in range(63)})
            self.config = types.SimpleNamespace(k=1)

    def fn(x: torch.Tensor, batch: Batch) -> None:
        pass

    tree_refusals.refuse_unreadable_inputs(fn, None, [torch.zeros(1), Batch()])
    assert asked == [Batch, types.SimpleNamespace]  # the leaf, then its one object


def test_a_cache_inside_a_plain_object_is_refused_with_a_tip_that_fixes_it() -> None:
    # Guards against (helper NP) the tip saying only `pass use_cache=False`, which the same
    # refusal then still gave: a cache in the user's own object is taken out of it.
    import types

    class Layer(_NPLayer):
        def forward(self, x: torch.Tensor, ctx: Any = None, use_cache: Any = None
                    ) -> torch.Tensor:
            return torch.tanh(self.lin(x))

    layer = Layer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(pytree_ckpt.CheckpointError) as first:
        layer(x, ctx=types.SimpleNamespace(cache=_NPCache()))
    with pytest.raises(pytree_ckpt.CheckpointError):  # the tip followed: refused again
        layer(x, ctx=types.SimpleNamespace(cache=_NPCache()), use_cache=False)
    assert "pass no cache object" in str(first.value).split("tip:")[-1]


# Helper NS (review of 1892cec, 033a3f3): _cache_inside's holders, adversarially.
class _NSCatCache(_NPCache):
    def update(self, k: torch.Tensor, v: torch.Tensor, index: int) -> tuple[Any, Any]:
        self.keys.append(k)
        return torch.cat(self.keys), v


class _NSAttend:
    """A callable attention implementation holding the cache it fills (an object, not a
    function: its attributes are as reachable as a namespace's)."""

    def __init__(self) -> None:
        self.cache = _NSCatCache()

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        keys, _ = self.cache.update(k, k, 0)
        return (q @ keys.T).softmax(-1) @ keys


class _NSAttendLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        return attend(self.q(x), self.k(x))


def _refused_as_a_cache_holder(attend: Any, /) -> None:
    """The layer given ``attend`` (something that fills a cache it holds) is refused, where it
    filled the cache twice, silently: the key projection got half its gradient."""
    ours = pytree_ckpt.apply_activation_checkpointing(_NSAttendLayer())
    with pytest.raises(pytree_ckpt.CheckpointError, match="a key/value cache at args"):
        ours(torch.randn(3, 4), attend)


def test_a_cache_held_by_a_callable_object_argument_is_refused() -> None:
    # Guards against (helper NS) an object with __call__ skipped as a callable.
    _refused_as_a_cache_holder(_NSAttend())


class _NSSlotsAndDict:
    __slots__ = ("a", "__dict__")


class _NSIntCache(int):
    def update(self, *args: Any) -> None:
        pass

    def get_seq_length(self, index: int = 0) -> int:
        return 0


class _NSOrdered(collections.OrderedDict):  # type: ignore[type-arg]
    pass


def _ns_slot() -> Any:
    holder = _NSSlotsAndDict()
    holder.a = _NPCache()
    return holder


def _ns_dict_beside_slots() -> Any:
    holder = _NSSlotsAndDict()
    holder.c = _NPCache()  # type: ignore[attr-defined]
    return holder


@pytest.mark.parametrize("make, step", [
    (_ns_slot, ".a"), (_ns_dict_beside_slots, ".c"),
    (lambda: types.MappingProxyType({"c": _NPCache()}), "['c']"),
    (lambda: _NSOrdered(c=_NPCache()), "['c']"),
    (lambda: types.SimpleNamespace(c=_NSIntCache(3)), ".c"),
], ids=["slot", "dict_beside_slots", "mapping_proxy", "ordered_dict_subclass", "int_subclass"])
def test_a_cache_one_level_down_is_refused_with_a_tip_naming_its_holder(make: Any, step: str
                                                                        ) -> None:
    layer = _NPLayer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(pytree_ckpt.CheckpointError) as refused:
        layer(torch.randn(2, 4, requires_grad=True), ctx=make())
    message = str(refused.value)
    assert f"cache at kwargs['ctx']{step} " in message
    assert "take it out of kwargs['ctx'])" in message.split("tip:")[-1]


def test_a_cache_in_a_namespace_in_a_dataclass_is_refused_naming_the_namespace() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Step:
        extra: Any
        t: torch.Tensor

    layer = _NPLayer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(pytree_ckpt.CheckpointError) as refused:
        layer(torch.randn(2, 4, requires_grad=True),
              ctx=Step(types.SimpleNamespace(cache=_NPCache()), torch.zeros(1)))
    assert "take it out of kwargs['ctx'].extra)" in str(refused.value).split("tip:")[-1]


def test_a_cache_in_a_dict_argument_is_refused_with_a_tip_naming_its_holder() -> None:
    layer = _NPLayer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(pytree_ckpt.CheckpointError) as refused:
        layer(torch.randn(2, 4, requires_grad=True), ctx={"cache": _NPCache(), "step": 1})
    assert "kwargs['ctx']" in str(refused.value).split("tip:")[-1]


# Helper NU (review of cd39704): a cache reached through a callable argument other than an
# object with __call__ (docs/limits.md excludes only a function's closure).
class _NUAttend(_NSAttend):
    def run(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self(q, k)


def _nu_attend_with(q: torch.Tensor, k: torch.Tensor, cache: Any) -> torch.Tensor:
    keys, _ = cache.update(k, k, 0)
    return (q @ keys.T).softmax(-1) @ keys


class _NUFillLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, fill: Any) -> torch.Tensor:
        keys, _ = fill(self.k(x), self.k(x), 0)
        return (self.q(x) @ keys.T).softmax(-1) @ keys


@pytest.mark.parametrize("make", [lambda: _NUAttend().run, lambda: _NUAttend().__call__,
                                  lambda: functools.partial(_nu_attend_with,
                                                            cache=_NSCatCache())],
                         ids=["bound_method", "dunder_call", "partial"])
def test_a_cache_behind_a_method_or_partial_argument_is_refused(make: Any) -> None:
    # Guards against (helper NU) a method's instance and a partial's arguments not looked into.
    _refused_as_a_cache_holder(make())


def test_a_caches_bound_update_passed_as_an_argument_gives_eager_gradients_or_is_refused(
        ) -> None:
    torch.manual_seed(0)
    eager = _NUFillLayer()
    ours = copy_of(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)
    x = torch.randn(3, 4)
    got = []
    for model in (eager, ours):
        try:
            model(x, _NSCatCache().update).square().sum().backward()
        except pytree_ckpt.CheckpointError:
            return
        got.append(grads_of(model.parameters()))
    assert_same_grads(*got)


def test_a_read_only_cache_in_a_namespace_under_the_opt_in_gives_eager_gradients() -> None:
    """Helper OA: `_cache_inside` finds a cache one level inside a plain object; a layer whose
    class sets transformers' `_can_checkpoint_with_cache` only reads it and passes, as a cache
    passed directly does."""

    class Cache:
        def __init__(self) -> None:
            self.k = torch.randn(3, 4)

        def update(self, k: torch.Tensor) -> None:
            raise AssertionError("read only")

        def get_seq_length(self) -> int:
            return 3

    class Layer(nn.Module):
        _can_checkpoint_with_cache = True

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, ctx: Any) -> torch.Tensor:
            return self.lin(x) + ctx.cache.k

    torch.manual_seed(0)
    ours = Layer()
    eager = copy.deepcopy(ours)
    ctx = types.SimpleNamespace(cache=Cache())
    x = torch.randn(3, 4)
    eager(x, ctx).sum().backward()
    pytree_ckpt.checkpoint(ours, x, ctx).sum().backward()
    for p, q in zip(ours.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
