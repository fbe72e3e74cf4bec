"""Output discard and what its op changes: module state (running statistics, counters), its
own inputs (in place), and outputs that are not tensors. Each test compares against an
unwrapped eager twin with exact equality in fp32, or checks the error."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointConfigError, CheckpointError, CheckpointWithoutOutput
from tests.conftest import assert_same_grads, grads_of


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in module.buffers()]


def _discard_step(norm: nn.Module, proj: nn.Linear, x: torch.Tensor) -> None:
    ckpt = CheckpointWithoutOutput()
    out = proj(ckpt.checkpoint(norm, x))
    ckpt.discard_output_and_register_recompute(out)
    out.square().sum().backward()


def test_a_discarded_batchnorm_updates_its_running_statistics_once_as_eager_does() -> None:
    # The rebuild runs BatchNorm's forward again; its second update of the running statistics
    # (and of num_batches_tracked) is put back after the gradients, as the boundary does.
    torch.manual_seed(0)
    norm, proj = nn.BatchNorm1d(16), nn.Linear(16, 16)
    twin_norm, twin_proj = copy.deepcopy(norm), copy.deepcopy(proj)
    x = (torch.randn(32, 16) * 3 + 1).requires_grad_()
    x_twin = x.detach().clone().requires_grad_()
    for _ in range(2):  # the second step starts from the first one's statistics
        twin_proj(twin_norm(x_twin)).square().sum().backward()
        _discard_step(norm, proj, x)
    assert int(norm.num_batches_tracked) == 2
    assert_same_grads(_state(twin_norm), _state(norm))
    assert_same_grads(grads_of([x_twin, *twin_norm.parameters(), *twin_proj.parameters()]),
                      grads_of([x, *norm.parameters(), *proj.parameters()]))


class _NormProj(nn.Module):
    """A layer whose norm's output is discarded after the projection consumed it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.BatchNorm1d(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = CheckpointWithoutOutput()
        out = self.proj(ckpt.checkpoint(self.norm, x))
        ckpt.discard_output_and_register_recompute(out)
        return torch.tanh(out)


def test_a_discarded_batchnorm_inside_a_checkpointed_layer_updates_its_statistics_once() -> None:
    # Three runs of BatchNorm's forward (original pass, the boundary's replay, the discard's
    # rebuild inside it): each later one is put back.
    torch.manual_seed(0)
    layer = _NormProj()
    twin = copy.deepcopy(layer)
    pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(32, 16).requires_grad_()
    x_twin = x.detach().clone().requires_grad_()
    twin(x_twin).square().sum().backward()
    layer(x).square().sum().backward()
    assert int(layer.norm.num_batches_tracked) == 1
    assert_same_grads(_state(twin), _state(layer))
    assert_same_grads(grads_of([x_twin, *twin.parameters()]), grads_of([x, *layer.parameters()]))


class _CountsCalls(nn.Module):
    """Reassigns a buffer each call (a new tensor under the same name), as an EMA update may."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return x * self.scale


def test_a_buffer_the_discarded_op_reassigns_ends_the_step_as_in_eager() -> None:
    torch.manual_seed(0)
    op, proj = _CountsCalls(), nn.Linear(16, 16)
    twin_op, twin_proj = copy.deepcopy(op), copy.deepcopy(proj)
    x = torch.randn(8, 16, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    twin_proj(twin_op(x_twin)).square().sum().backward()
    _discard_step(op, proj, x)
    assert float(op.calls) == float(twin_op.calls) == 1.0
    assert_same_grads(grads_of([x_twin, twin_op.scale, *twin_proj.parameters()]),
                      grads_of([x, op.scale, *proj.parameters()]))


class _ScalesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return x * self.gain


@pytest.mark.parametrize("make", [_ScalesInPlace, lambda: nn.ReLU(inplace=True)],
                         ids=["module scaling its input", "ReLU(inplace=True)"])
def test_a_discarded_op_that_changes_its_input_in_place_is_refused(make: Any) -> None:
    # Its inputs are saved after it ran: autograd cannot see the change, and the rebuild would
    # change the caller's tensor again in backward (the gradients were silently wrong).
    op = make()
    x = nn.Linear(16, 16)(torch.randn(8, 16))  # a non-leaf input that requires grad
    before = x.detach().clone()
    with pytest.raises(CheckpointError, match=r"changed its input args\[0\] in place") as info:
        CheckpointWithoutOutput().checkpoint(op, x)
    assert "inplace=True" in str(info.value)
    assert not torch.equal(before, x)  # it did change it: the error says so, nothing else ran


@dataclasses.dataclass
class _Out:
    out: torch.Tensor


class _Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> Any:
        out = self.norm(x)
        return {"with None": (out, None), "dict": {"out": out},
                "dataclass": _Out(out)}[self.kind]


@pytest.mark.parametrize("kind, got", [("with None", "None"), ("dict", "dict"),
                                       ("dataclass", "_Out")])
def test_outputs_other_than_tensors_are_refused_naming_what_came_back(kind: str,
                                                                      got: str) -> None:
    # A dict would have been read as its keys, and None crashed reading a storage.
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(CheckpointConfigError, match="to return a tensor or a tuple of tensors"
                       ) as info:
        CheckpointWithoutOutput().checkpoint(_Returns(kind), x)
    assert f"got:      {got}" in str(info.value)


def test_a_lambda_reaching_parameters_inside_a_checkpointed_layer_names_the_layers_replay(
) -> None:
    # Its parameters cannot be known, and the layer's replay takes gradients with
    # torch.autograd.grad: refused, and the message says the restricted backward is the
    # replay's, not the user's.
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ckpt = CheckpointWithoutOutput()
            out = self.proj(ckpt.checkpoint(lambda t: self.norm(t) * 2, x))
            ckpt.discard_output_and_register_recompute(out)
            return x + out

    layer = Layer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(CheckpointError, match="the replay of a checkpointed layer around it"
                       ) as info:
        layer(x).square().sum().backward()
    assert "checkpoint(self.norm, x)" in str(info.value)
