"""What the pause of parameter hooks around a replay's gradient call leaves behind (NOTE
[parameter hooks run once], pytree_ckpt/parameter_hooks.py): nothing once it is over. Its
marks are prehooks on the nodes of the replay's outputs, which those outputs hold."""

from __future__ import annotations

import gc
import sys
import weakref

import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointWithoutOutput
from pytree_ckpt.parameter_hooks import _REPLAYS


class _Recorded(nn.Linear):
    """A layer that keeps a weak reference to each output it computes with grad enabled: in a
    checkpointed layer, the replay's."""

    def __init__(self) -> None:
        super().__init__(64, 64)
        self.replayed: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(super().forward(x))
        if torch.is_grad_enabled():
            self.replayed.append(weakref.ref(out))
        return out


def _alive_bytes(layers: list[_Recorded]) -> int:
    gc.collect()
    return sum(out.nbytes for layer in layers for ref in layer.replayed
               if (out := ref()) is not None)


def test_a_replay_with_parameter_hooks_frees_its_outputs_after_backward() -> None:
    # Guards against: each output's node held the pause (its prehook, a bound method), which
    # held the outputs: a cycle through autograd's C++ nodes that Python's collector cannot
    # see, so every replay of a layer whose parameters had a hook kept its outputs alive for
    # good (3 steps of 4 layers: 12 outputs, 393,216 bytes, growing by a step's every step).
    layers = [_Recorded() for _ in range(4)]
    model = nn.Sequential(*layers)
    for layer in layers:
        pytree_ckpt.apply_activation_checkpointing(layer)
    for p in model.parameters():
        p.register_hook(lambda g: g * 2)
    for _ in range(3):
        model(torch.randn(128, 64, requires_grad=True)).sum().backward()
    assert [len(layer.replayed) for layer in layers] == [3] * 4  # every step replayed
    assert _alive_bytes(layers) == 0
    assert not _REPLAYS


def test_an_output_discard_rebuild_with_parameter_hooks_frees_its_outputs() -> None:
    # The same cycle, through the gradient call of the discarded op's backward
    # (discard_function.py).
    norm = _Recorded()
    proj = nn.Linear(64, 64)
    for p in norm.parameters():
        p.register_hook(lambda g: g * 2)
    for _ in range(3):
        x = torch.randn(16, 64, requires_grad=True)
        ckpt = CheckpointWithoutOutput()
        out = proj(ckpt.checkpoint(norm, x))
        ckpt.discard_output_and_register_recompute(out)
        (x + out).sum().backward()
    assert len(norm.replayed) == 3
    assert _alive_bytes([norm]) == 0
    assert not _REPLAYS


def test_a_parameter_hook_registered_inside_the_replay_runs_twice_as_the_limits_table_says(
) -> None:
    # docs/limits.md, "Gradient hooks and DDP": a hook that a backward hook of a submodule of
    # the checkpointed layer registers runs in the replay's gradient call, which the pause
    # did not wrap it for, and again when the gradient reaches the parameter. One registered
    # from a hook on the layer's output, before the layer's backward starts, runs once.
    def run(wrap: bool, inside: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        first = nn.Linear(4, 4)
        layer = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4))
        calls: list[int] = []
        handles: list[object] = []

        def doubled(grad: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return grad * 2

        def register(*args: object) -> None:
            if not handles:
                handles.append(first.weight.register_hook(doubled))
        if inside:
            layer[2].register_full_backward_hook(register)
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        out = layer(torch.randn(3, 4, requires_grad=True))
        if not inside:
            out.register_hook(register)
        out.sum().backward()
        assert first.weight.grad is not None
        return first.weight.grad, len(calls)

    eager, eager_calls = run(False, True)
    twice, twice_calls = run(True, True)
    assert (eager_calls, twice_calls) == (1, 2)
    assert torch.equal(twice, eager * 2)  # its doubling, applied twice
    once, once_calls = run(True, False)
    assert once_calls == 1 and torch.equal(once, eager)


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def test_a_parameter_hook_runs_at_the_same_call_depth_at_every_step() -> None:
    # Guards against: each replay wrapped the parameter's hook again, around the wrapper of the
    # step before (NOTE [parameter hooks run once]): one more Python call per step, for good,
    # until the hook raised RecursionError after about a thousand steps.
    layer = pytree_ckpt.apply_activation_checkpointing(nn.Linear(4, 4))
    depths: list[int] = []
    layer.weight.register_hook(lambda g: depths.append(_stack_depth()) or g * 2)
    x = torch.randn(2, 4)
    for _ in range(4):
        layer(x).sum().backward()
    assert len(depths) == 4 and len(set(depths)) == 1, depths
