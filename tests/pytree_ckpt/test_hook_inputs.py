"""NOTE [hooked outputs leave with gradients] (hook_outputs.py), for the *inputs* a hook keeps:
a forward hook (or forward pre-hook) inside a boundary that keeps the tensor its module receives
(an activation hook on a projection's input, a regulariser on the hidden state entering the
MLP) keeps a tensor of the no-grad original pass. Every case is compared with an eager twin,
bit for bit (fp32): each kept input has two uses (the module and the loss), whose sum does not
depend on the order."""

from __future__ import annotations

import copy
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
