"""NOTE [kept ops called on other tensors in the replay] (kept_calls.py): a record is matched to the
replay's call by op and order; a replay whose call has as many kept calls but other tensors
(shapes, dtypes, devices) is refused, naming the op, the layer, the call and both sides. The
usual cause: state the forward reads (a Python attribute, a global) changed between forward and
backward, and the replay built other shapes. Returning the record there gave torch's shape
error deep in a later op, or, where the shapes fit, other numbers than either pass, silently."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pytree_ckpt import (KeptCallables, KeptOps, RecomputeConfig, ReplayMismatchError, SaveUnit,
                         apply_recompute_config)
from tests.conftest import assert_same_grads, grads_per_model


class Scores(nn.Module):
    """Attention-like scores over the first ``width`` features: a Python attribute the step may
    change between forward and backward (as a curriculum's window or a config switch would)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.width = 8
        self.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        q = h[..., :self.width].to(self.dtype)
        first = (q @ q.transpose(-1, -2)).float()  # aten::bmm, kept: call #1
        second = h @ h.transpose(-1, -2)  # aten::bmm, kept: call #2 (always the same shapes)
        return x + (first + second).softmax(-1) @ h


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.width = 8

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h[..., :self.width].repeat(1, 1, 16 // self.width))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate.project(x).sigmoid()


def _twins(layer: nn.Module, targets: dict[SaveUnit, KeptOps | KeptCallables]
           ) -> tuple[nn.Module, nn.Module]:
    wrapped = copy.deepcopy(layer)
    apply_recompute_config([wrapped], RecomputeConfig(1.0, save=True), targets, offload=False)
    return layer, wrapped


def test_a_kept_op_the_replay_calls_on_other_shapes_is_refused_naming_the_op_and_the_call() -> None:
    # Guards against: the record of bmm (2, 4, 8) @ (2, 8, 4) was handed to the replay's
    # (2, 4, 4) @ (2, 4, 4), whose output has the same shape: no error, and gradients of
    # neither the forward's computation nor the replay's (silently).
    eager, wrapped = _twins(Scores(), {SaveUnit.ATTN: KeptOps("aten::bmm")})
    x = torch.randn(2, 4, 16, requires_grad=True)
    loss = wrapped(x).sum()
    wrapped.width = 4  # changed between forward and backward
    with pytest.raises(ReplayMismatchError) as caught:
        loss.backward()
    message = str(caught.value)
    assert "aten.bmm.default" in message and "Scores" in message
    assert "call #1 of 3" in message
    assert "expected: argument 'self': Tensor(shape=(2, 4, 8), dtype=torch.float32" in message
    assert "got:      argument 'self': Tensor(shape=(2, 4, 4), dtype=torch.float32" in message
    assert "changed between forward and backward" in message  # the tip
    # Refused, nothing left behind: with the state as in the forward, the next step is eager's.
    wrapped.width = 8
    wrapped.zero_grad(set_to_none=True)
    assert_same_grads(*grads_per_model([eager, wrapped], x, seed=1))


def test_a_kept_op_the_replay_calls_on_another_dtype_is_refused_naming_the_nth_call() -> None:
    # Guards against: the float32 record was handed to a float64 call of the same shapes.
    _, wrapped = _twins(Scores(), {SaveUnit.ATTN: KeptOps("aten::bmm")})
    x = torch.randn(2, 4, 16, requires_grad=True)
    loss = wrapped(x).sum()
    wrapped.dtype = torch.float64
    with pytest.raises(ReplayMismatchError, match=r"(?s)call #1 of 3.*"
                                                  r"Tensor\(shape=\(2, 4, 8\), dtype=torch\.float64"):
        loss.backward()


def test_the_second_call_of_a_kept_op_on_other_shapes_is_named_as_the_second() -> None:
    class TwoWidths(Scores):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            first = h @ h.transpose(-1, -2)  # the same in both passes
            q = h[..., :self.width]
            return x + (first + q @ q.transpose(-1, -2)).softmax(-1) @ h

    _, wrapped = _twins(TwoWidths(), {SaveUnit.ATTN: KeptOps("aten::bmm")})
    loss = wrapped(torch.randn(2, 4, 16, requires_grad=True)).sum()
    wrapped.width = 4
    with pytest.raises(ReplayMismatchError, match=r"call #2 of 3"):
        loss.backward()


def test_a_kept_method_the_replay_runs_on_other_shapes_is_refused_naming_the_method() -> None:
    # Guards against: Gate.project's kept ops (the slice's repeat, the projection) were handed
    # the forward's records though the replay sliced otherwise: same shapes in the end, other
    # numbers, silently.
    eager, wrapped = _twins(Gated(), {SaveUnit.MOE_GATE: KeptCallables("Gate.project")})
    x = torch.randn(2, 4, 16, requires_grad=True)
    loss = wrapped(x).sum()
    wrapped.gate.width = 4
    with pytest.raises(ReplayMismatchError) as caught:
        loss.backward()
    message = str(caught.value)
    assert "Gated" in message and "Gate.project" in message and "'gate'" in message
    assert "aten.repeat.default" in message
    wrapped.gate.width = 8
    wrapped.zero_grad(set_to_none=True)
    assert_same_grads(*grads_per_model([eager, wrapped], x, seed=1))


class MixedThenProjected(nn.Module):
    """A weight-normed Linear over a transposed 3-D input (torch.matmul dispatches aten::bmm in
    the no-grad original pass, aten::mm in the replay: NOTE [kept ops dispatched differently]
    in frames.py), then an mm of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16, bias=False))
        self.out = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.tanh(self.tok(x.transpose(1, 2))).transpose(1, 2)
        return torch.mm(y.flatten(0, 1), self.out)


def test_a_kept_op_torch_dispatches_otherwise_in_the_replay_is_refused_naming_that_cause_too() -> None:
    # Nothing changed between the passes: the replay's first aten::mm is the weight-normed
    # product, which the original pass ran as aten::bmm, and meets the record of the last mm.
    _, wrapped = _twins(MixedThenProjected(), {SaveUnit.ATTN: KeptOps("aten::mm")})
    loss = wrapped(torch.randn(2, 16, 16, requires_grad=True)).sum()
    with pytest.raises(ReplayMismatchError, match=r"(?s)aten\.mm\.default.*call #1 of 1.*"
                                                  r"torch\.matmul picks aten::mm or aten::bmm"):
        loss.backward()


class Concatenated(nn.Module):
    """Concatenates two slices of its projection; the second's width a Python attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.width = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return x + torch.cat([h[..., :4], h[..., :self.width]], -1).sum(-1, keepdim=True)


def test_a_kept_op_given_a_list_with_a_tensor_of_another_shape_is_refused_naming_its_place(
        ) -> None:
    # A tensor list argument (aten::cat's) is compared element by element: the message names
    # the element, with both shapes.
    _, wrapped = _twins(Concatenated(), {SaveUnit.ATTN: KeptOps("aten::cat")})
    x = torch.randn(2, 16, requires_grad=True)
    loss = wrapped(x).sum()
    wrapped.width = 6  # changed between forward and backward
    with pytest.raises(ReplayMismatchError) as caught:
        loss.backward()
    lines = str(caught.value).splitlines()
    assert lines[0] == (
        "the replay of Concatenated called aten.cat.default, which a save unit keeps, on other "
        "tensors than the original pass did (call #1 of 1): the record the original pass kept "
        "is for another computation")
    assert lines[1:3] == [
        "  expected: argument 'tensors'[1]: Tensor(shape=(2, 8), dtype=torch.float32)",
        "  got:      argument 'tensors'[1]: Tensor(shape=(2, 6), dtype=torch.float32)"]
