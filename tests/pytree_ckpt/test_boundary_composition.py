"""The boundary composed with torch features that training code uses around or inside a layer
(parametrizations, fused fast paths, function transforms), against an unwrapped eager twin, bit
for bit in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations

import pytree_ckpt
from tests.conftest import assert_same_grads, grads_of


def weight_normed() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    parametrizations.weight_norm(model[0])
    return model


def test_a_parametrization_cached_around_forward_and_backward_gives_eager_gradients() -> None:
    # parametrize.cached() computes a parametrized weight once and reuses it until the block
    # ends. The original pass runs under no-grad: the weight it cached had no graph, so the
    # replay (and any later use in the block) read it and `original0/1` silently got None.
    eager = weight_normed()
    twin = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (eager, twin):
        with parametrize.cached():
            model(x).sum().backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)


def test_a_parametrized_weight_cached_by_the_boundary_keeps_its_graph_for_later_uses() -> None:
    # The same weight used again after the checkpointed layer, in one cached() block (an
    # output head tied to it): that use must not read a no-grad weight the original pass left
    # (it did: the parametrization silently got only the replay's gradient). Equal to float
    # rounding, not bit for bit: the boundary's use comes back as one gradient (NOTE [each
    # pass caches its own parametrizations]).
    eager = weight_normed()
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(twin[0])
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (eager, twin):
        with parametrize.cached():
            loss = model(x).sum() + model[0].weight.exp().sum()
        loss.backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    for expected, got in zip(*grads):
        assert expected is not None and got is not None
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_attention_in_eval_mode_gives_eager_outputs_and_gradients() -> None:
    # nn.MultiheadAttention and nn.TransformerEncoderLayer take a fused fast path when grad is
    # off (or nothing requires it) in eval mode; eager with a grad-requiring input never does.
    # The original pass runs under no-grad: it took the fast path, so the output (and the next
    # layer's replay, fed by it) differed from eager by rounding, silently.
    eager = encoder()
    twin = copy.deepcopy(eager)
    for layer in twin.layers:
        pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(2, 4, 8, requires_grad=True)
    outs, grads = [], []
    for model in (eager, twin):
        out = model(x)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert torch.equal(*outs)
    assert_same_grads(*grads)


def test_torch_func_transforms_through_a_wrapped_module_give_eager_results() -> None:
    # Under torch.func.grad / vmap / vjp the boundary's autograd.Function raised torch's
    # "must override the setup_context staticmethod", which names no fix. A transform computes
    # its own graph; like no_grad, the layer is then simply called (no boundary).
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    twin = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(3, 4)

    def per_sample_grads(model: nn.Module) -> dict[str, torch.Tensor]:
        params = {name: p.detach() for name, p in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], row: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, p, (row,)).pow(2).sum()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    expected, got = per_sample_grads(eager), per_sample_grads(twin)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert torch.equal(torch.func.vmap(eager)(x), torch.func.vmap(twin)(x))
    _, pull = torch.func.vjp(eager, x)
    _, pull_twin = torch.func.vjp(twin, x)
    assert torch.equal(pull(torch.ones(3, 4))[0], pull_twin(torch.ones(3, 4))[0])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.weight_norm is deprecated
def test_a_weight_set_by_the_modules_own_pre_hook_gives_eager_gradients_over_two_calls() -> None:
    torch.manual_seed(0)
    eager = torch.nn.utils.weight_norm(nn.Linear(4, 4))
    twin = torch.nn.utils.weight_norm(nn.Linear(4, 4))
    twin.load_state_dict(eager.state_dict())
    pytree_ckpt.apply_activation_checkpointing(twin)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (eager, twin):
        # Two calls in one loss, then a backward that keeps the graph for a second one: each
        # replay must see its own call's weight, and leave its outside graph to autograd.
        loss = model(x).exp().sum() + model(x * 2).exp().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)
    assert "weight" in twin.__dict__  # the caller's attribute is back after the replays


def test_a_graph_tensor_a_forward_hook_keeps_as_an_attribute_is_no_input_of_the_next_step() -> None:
    # A forward hook that keeps the module's output as an attribute (feature extraction,
    # distillation) leaves a graph tensor in the module's __dict__ whose graph the step's
    # backward frees. A forward pre-hook (FSDP2's, a census's, a user's) on the same module
    # made the boundary take every such attribute as an input of the next call, and that
    # step's backward ran into the freed graph ("backward through the graph a second time").
    def keep_output(module: nn.Module, args: object, output: torch.Tensor) -> None:
        module.__dict__["last"] = output

    torch.manual_seed(0)
    eager, twin = nn.Linear(4, 4), nn.Linear(4, 4)
    twin.load_state_dict(eager.state_dict())
    for model in (eager, twin):
        model.register_forward_hook(keep_output)
        model.register_forward_pre_hook(lambda *_: None)
    pytree_ckpt.apply_activation_checkpointing(twin)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (eager, twin):
        for _ in range(3):
            y = model(model(x))
            (y.sum() + model.last.sum()).backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.spectral_norm is old
def test_weights_set_by_pruning_and_spectral_norm_hooks_give_eager_gradients_over_two_calls(
        ) -> None:
    from torch.nn.utils import prune

    def make() -> nn.Linear:
        torch.manual_seed(0)
        layer = torch.nn.utils.spectral_norm(nn.Linear(4, 4), name="weight")
        prune.l1_unstructured(layer, "bias", amount=0.5)
        return layer

    eager, twin = make(), make()
    pytree_ckpt.apply_activation_checkpointing(twin)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (eager.eval(), twin.eval()):  # eval: no power iteration, same weight
        loss = model(x).exp().sum() + model(x * 2).exp().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(grads_of([*model.parameters(), x]))
        x.grad = None
    assert_same_grads(*grads)
