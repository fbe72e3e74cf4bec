"""Gradients a checkpointed layer's forward takes itself, against an eager twin bit for bit
(helper PW; NOTE [a gradient inside the forward reaching the graph before the call] in
pytree_ckpt/inner_backward.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import autograd, nn

import pytree_ckpt


def _against_eager(make: Callable[[], nn.Module], run: Callable[[nn.Module], list[Any]],
                   wrap: Callable[[nn.Module], None]) -> None:
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager)
    wrap(ours)
    want, got = run(eager), run(ours)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def _all_grads(m: nn.Module, s: torch.Tensor) -> list[Any]:
    loss = m(s).pow(2).sum()
    grads = autograd.grad(loss, [s, *m.parameters()], allow_unused=True)
    return [loss.detach(), *(torch.zeros(()) if g is None else g for g in grads)]


# -- findings ------------------------------------------------------------------------------

class _LocalLoss(nn.Module):
    """Forward-Forward / greedy local learning: the layer trains itself on a local loss of its
    detached input, `.backward()` inside its forward, and passes a detached output on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            h = torch.relu(self.lin(x.detach()))
            h.pow(2).mean().backward()
        return self.head(h.detach()) + x


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Random numbers and modes around the call: "
                   "a forward that calls backward() itself runs it in both passes) (helper PW)")
def test_a_local_loss_backward_inside_the_forward_accumulates_eager_grads() -> None:
    def run(m: nn.Module) -> list[Any]:
        torch.manual_seed(1)
        s = torch.randn(5, 4, requires_grad=True)
        loss = m(s).pow(2).sum()
        loss.backward()
        return [loss.detach(), s.grad, *(p.grad for p in m.parameters())]
    _against_eager(_LocalLoss, run, pytree_ckpt.apply_activation_checkpointing)


class _Hnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(2, 8), nn.Linear(8, 1)

    def forward(self, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            energy = self.out(torch.tanh(self.lin(torch.cat([q, p], -1)))).sum()
            dq, dp = autograd.grad(energy, (q, p), create_graph=True)
        return q + 0.1 * dp, p - 0.1 * dq


class _EncodedHnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.h = nn.Linear(2, 2), _Hnn()

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        z = self.enc(s)
        q, p = self.h(z[:, :1], z[:, 1:])
        for _ in range(2):
            q, p = self.h(q, p)
        return q + p


def test_a_checkpointed_model_holding_an_hnn_layer_is_told_how_to_fix_it() -> None:
    # The whole model wrapped: the HNN layer's inputs come from the boundary's no-grad pass,
    # so torch.autograd.grad raises "One of the differentiated Tensors does not require grad".
    # limits.md promises a note naming the fix; notes.py matches only torch's other wording
    # ("does not require grad and does not have a grad_fn"), so none is added.
    torch.manual_seed(0)
    ours = _EncodedHnn()
    pytree_ckpt.apply_activation_checkpointing(ours)
    with pytest.raises(RuntimeError, match="does not require grad") as raised:
        _all_grads(ours, torch.randn(5, 2, requires_grad=True))
    assert "enable_grad" in "".join(getattr(raised.value, "__notes__", []))


# -- checked, eager's numbers ----------------------------------------------------------------

@pytest.mark.parametrize("how", ["chunk", "unbind", "slices"])
def test_an_hnn_rollout_on_parts_of_one_tensor_gives_eager_gradients(how: str) -> None:
    # q and p are outputs of one node (split / unbind) or views of one tensor: a gradient
    # taken for them stops at their node without running it; nothing is refused.
    class Parts(_EncodedHnn):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            z = self.enc(s)
            if how == "chunk":
                q, p = z.chunk(2, -1)
            elif how == "unbind":
                q, p = (t[:, None] for t in z.unbind(-1))
            else:
                q, p = z[:, :1], z[:, 1:]
            for _ in range(3):
                q, p = self.h(q, p)
            return q + p

    def run(m: nn.Module) -> list[Any]:
        torch.manual_seed(1)
        return _all_grads(m, torch.randn(5, 2, requires_grad=True))
    _against_eager(Parts, run, lambda m: pytree_ckpt.apply_activation_checkpointing(m.h))


class _FuncGrad(nn.Module):
    """Input derivatives by torch.func inside the forward (no torch.enable_grad needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(torch.func.grad(lambda v: torch.tanh(self.lin(v)).sum()))(x) + x


def test_input_derivatives_by_torch_func_inside_the_forward_give_eager_gradients() -> None:
    def run(m: nn.Module) -> list[Any]:
        torch.manual_seed(1)
        s = torch.randn(5, 3, requires_grad=True)
        loss = m(s * 1.5).pow(2).sum()
        return [loss.detach(), *autograd.grad(loss, [s, *m.parameters()])]
    _against_eager(_FuncGrad, run, pytree_ckpt.apply_activation_checkpointing)


# -- per-call cost (helper QB) ---------------------------------------------------------------

def _decoder_like(n: int = 4) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n))


def _count_watches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import pytree_ckpt.boundary_function as boundary_function
    made: list[int] = []
    real = boundary_function.InnerBackwardWatch

    def counted(tensors: Any) -> Any:
        made.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(boundary_function, "InnerBackwardWatch", counted)
    return made


@pytest.mark.parametrize("how", ["checkpoint_layers", "checkpoint_module", "bound_call"])
def test_a_modules_inner_backward_watch_is_off_after_its_first_replay(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    made = _count_watches(monkeypatch)
    layers = _decoder_like()
    if how == "checkpoint_layers":
        pytree_ckpt.checkpoint_layers(layers, offload=False)
    x = torch.randn(2, 8, requires_grad=True)
    per_step = []
    for _ in range(3):
        made.clear()
        h = x
        for layer in layers:
            h = layer(h) if how == "checkpoint_layers" else pytree_ckpt.checkpoint(
                layer if how == "checkpoint_module" else layer.__call__, h)
        h.sum().backward()
        per_step.append(len(made))
    assert per_step == [4, 0, 0]


def test_no_hook_record_is_scanned_or_kept_when_the_forward_registers_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [hooks the forward registers on its parameters and inputs]: two reads of
    # RemovableHandle.next_id, nothing else, even with a module backward hook on a submodule.
    import pytree_ckpt.forward_hooks as forward_hooks
    scanned: list[int] = []
    real = forward_hooks._registered

    def counted(*args: Any) -> Any:
        scanned.append(1)
        return real(*args)

    monkeypatch.setattr(forward_hooks, "_registered", counted)
    layers = _decoder_like()
    for layer in layers:
        layer[0].register_full_backward_hook(lambda m, gi, go: None)
    pytree_ckpt.checkpoint_layers(layers, offload=False)
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(2):
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    assert scanned == []


def test_a_plain_functions_call_names_nothing_when_nothing_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pytree_ckpt.boundary_function as boundary_function
    named: list[str] = []
    real = boundary_function.fn_name

    def counted(fn: Any) -> str:
        named.append(real(fn))
        return named[-1]

    monkeypatch.setattr(boundary_function, "fn_name", counted)
    layers = _decoder_like()
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(2):
        named.clear()
        h = x
        for layer in layers:
            h = pytree_ckpt.checkpoint(lambda t, layer=layer: layer(t), h)
        h.sum().backward()
    assert named == []


# -- helper QM: mutation coverage ------------------------------------------------------------

class _StepsOnItsWeightNormGain(nn.Linear):
    """A test-time step inside the forward: the gradient of a loss for the gain of the old
    torch.nn.utils.weight_norm, whose pre-hook sets ``weight`` before the call (so that
    gradient flows past the attribute into the graph that computed it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = nn.functional.linear(x, self.weight, self.bias)
            (g,) = autograd.grad(y.pow(2).sum(), self.weight_g, create_graph=True)
        return y * g.sum()


def test_a_gradient_past_an_attribute_set_before_the_call_is_refused_with_the_parametrizations_tip(
        ) -> None:
    # Guards against: refuse() telling an attribute's slot (the first one: slot == the number
    # of inputs) for an input's, with the tip for related inputs instead of parametrizations'.
    import warnings

    from pytree_ckpt import CheckpointError

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's weight_norm deprecation
        layer = torch.nn.utils.weight_norm(_StepsOnItsWeightNormGain(4, 4))
    pytree_ckpt.checkpoint_layers([layer], offload=False)
    with pytest.raises(CheckpointError, match="took a gradient inside its forward") as refused:
        layer(torch.randn(3, 4, requires_grad=True))
    assert "parametrizations' weight_norm" in str(refused.value)


def test_a_gradient_past_two_inputs_is_refused_naming_both() -> None:
    # Guards against: refuse() naming only the first of the inputs the gradient flowed past.
    from pytree_ckpt import CheckpointError

    w = torch.randn(3, requires_grad=True)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (g,) = autograd.grad((a * b).sum(), w, create_graph=True)  # through both inputs
        return a * g

    with pytest.raises(CheckpointError, match="took a gradient inside its forward") as refused:
        pytree_ckpt.checkpoint(step, w * 2, w * 3)
    assert "args[0]" in str(refused.value) and "args[1]" in str(refused.value)
