"""Model compression through checkpointed layers (helper OJ): pruning (torch.nn.utils.prune,
torch.ao.pruning, masks computed in forward), shared and tied weights, factorised and
parametrized weights. Each case trains an eager twin and a checkpointed copy for a few SGD
steps, with micro-batches whose backwards run in reverse order, and compares the losses,
every gradient, the parameters, the buffers and the RNG state bit for bit (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.parametrizations import orthogonal

import pytree_ckpt

Between = Callable[[nn.Module, int], Any]


def _state(model: nn.Module) -> list[torch.Tensor | None]:
    return [*(None if p.grad is None else p.grad.clone() for p in model.parameters()),
            *(p.detach().clone() for p in model.parameters()),
            *(b.clone() for b in model.buffers())]


def _train(model: nn.Module, *, steps: int = 3, between: Between | None = None,
           rows: int = 5, ids: bool = False) -> list[Any]:
    """Per step: ``between(model, step)``, two micro-batch forwards, their backwards in
    reverse order, a record of the losses, gradients, parameters, buffers and RNG state, then
    an SGD step."""
    record: list[Any] = []
    for step in range(steps):
        if between is not None:
            between(model, step)
        torch.manual_seed(100 + step)
        inputs = [torch.randint(0, 20, (rows, 6)) if ids else torch.randn(rows, 8)
                  for _ in range(2)]
        losses = []
        for x in inputs:
            out = model(x)
            losses.append(F.cross_entropy(out.flatten(0, 1), x.roll(1, 1).flatten()) if ids
                          else out.square().mean())
        for loss in reversed(losses):
            loss.backward()
        record.append([loss.detach() for loss in losses] + _state(model) +
                      [torch.get_rng_state()])
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        model.zero_grad(set_to_none=True)
    return record


def _assert_twins(make: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any], /,
                  **kwargs: Any) -> None:
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    ours = make()  # not a deepcopy: a pruned module's `weight` is no leaf, torch refuses
    wrap(ours)
    torch.manual_seed(1)
    expected = _train(eager, **kwargs)
    torch.manual_seed(1)
    got = _train(ours, **kwargs)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert len(a) == len(b), f"step {step}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert (x is None and y is None) or torch.equal(x, y), f"step {step}, item {i}"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module] = Block, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _wrap_layers(model: nn.Module) -> None:
    for layer in model.layers:
        pytree_ckpt.apply_activation_checkpointing(layer)


class _EveryOther(prune.BasePruningMethod):
    PRUNING_TYPE = "unstructured"

    def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        mask = default_mask.clone()
        mask.view(-1)[::2] = 0
        return mask


_PRUNINGS: dict[str, Callable[[Stack], Any]] = {
    "l1": lambda m: [prune.l1_unstructured(b.fc1, "weight", amount=0.4) for b in m.layers],
    "ln_structured": lambda m: [prune.ln_structured(b.fc2, "weight", amount=0.5, n=2, dim=1)
                                for b in m.layers],
    "global": lambda m: prune.global_unstructured(
        [(b.fc1, "weight") for b in m.layers] + [(b.fc2, "bias") for b in m.layers],
        pruning_method=prune.L1Unstructured, amount=0.5),
    "custom": lambda m: [_EveryOther.apply(b.fc1, "weight") for b in m.layers],
}


@pytest.mark.parametrize("pruning", sorted(_PRUNINGS))
@pytest.mark.parametrize("when", ["before wrapping", "after wrapping", "between steps"])
def test_pruned_linears_inside_checkpointed_layers_train_as_eager(pruning: str,
                                                                  when: str) -> None:
    prune_now = _PRUNINGS[pruning]

    def make() -> nn.Module:
        model = Stack()
        if when == "before wrapping":
            prune_now(model)
        return model

    def between(model: nn.Module, step: int) -> None:
        if (when == "after wrapping" and step == 0) or (when == "between steps" and step == 1):
            prune_now(model)

    _assert_twins(make, _wrap_layers, between=between)


def test_pruned_checkpointed_linears_re_pruned_then_made_permanent_between_steps_train_as_eager(
        ) -> None:
    class Dense(nn.Module):  # the pruned Linear is the checkpointed module itself
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            prune.l1_unstructured(self.fc, "weight", amount=0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(x))

    def between(model: nn.Module, step: int) -> None:
        for layer in model.layers:
            if step == 1:
                prune.random_unstructured(layer.fc, "weight", amount=0.3)  # a new mask
            elif step == 2:
                prune.remove(layer.fc, "weight")

    def wrap(model: nn.Module) -> None:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer.fc)

    _assert_twins(lambda: Stack(Dense), wrap, steps=4, between=between)


class _TopKStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, k: int) -> torch.Tensor:
        mask = torch.zeros_like(scores).flatten()
        mask[scores.flatten().topk(k).indices] = 1
        return mask.view_as(scores)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class MaskedInForward(nn.Module):
    """Movement pruning (learned scores, straight-through top-k), a 2:4 mask from the weight's
    magnitude, and a magnitude mask buffer refreshed every other call, all in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.nm, self.gmp = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.scores = nn.Parameter(torch.randn(8, 8) * 0.01)
        self.register_buffer("mask", torch.ones(8, 8))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(F.linear(x, self.fc.weight * _TopKStraightThrough.apply(self.scores, 40),
                                self.fc.bias))
        groups = self.nm.weight.detach().abs().view(-1, 4)
        two_of_four = torch.zeros_like(groups).scatter_(1, groups.topk(2, dim=1).indices, 1.0)
        x = torch.tanh(F.linear(x, self.nm.weight * two_of_four.view(8, 8), self.nm.bias))
        if self.calls % 2 == 0:
            with torch.no_grad():
                w = self.gmp.weight.abs()
                self.mask.copy_((w > w.flatten().kthvalue(20).values).float())
        self.calls += 1
        return torch.tanh(F.linear(x, self.gmp.weight * self.mask, self.gmp.bias))


def test_masks_computed_in_forward_train_as_eager() -> None:
    _assert_twins(lambda: Stack(MaskedInForward), _wrap_layers, steps=4)


def test_a_torch_ao_sparsifier_stepped_between_steps_trains_as_eager() -> None:
    from torch.ao.pruning import WeightNormSparsifier

    sparsifiers: list[WeightNormSparsifier] = []

    def between(model: nn.Module, step: int) -> None:
        if step == 0:  # one sparsifier per twin (the config holds the model's modules)
            sparsifiers.append(WeightNormSparsifier(sparsity_level=0.5,
                                                    sparse_block_shape=(1, 4),
                                                    zeros_per_block=2))
            sparsifiers[-1].prepare(model, [{"tensor_fqn": f"layers.{i}.{fc}.weight"}
                                            for i in range(2) for fc in ("fc1", "fc2")])
        sparsifiers[-1].step()

    _assert_twins(Stack, _wrap_layers, between=between)


class SharedLayers(nn.Module):
    """ALBERT's one layer applied three times (the layer checkpointed: three calls a step),
    then a Universal-Transformer-style halting mix over the applications."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.halt, self.head = Block(), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halted = torch.zeros(x.shape[0], 1)
        out = torch.zeros_like(x)
        for _ in range(3):
            p = torch.sigmoid(self.halt(x)) * (halted < 0.9).float()
            x = self.layer(x)
            out = out + p * x
            halted = halted + p
            if bool((halted >= 0.9).all()):
                break
        return self.head(out)


def test_a_shared_layer_applied_several_times_with_halting_trains_as_eager() -> None:
    _assert_twins(SharedLayers, lambda m: pytree_ckpt.apply_activation_checkpointing(
        m.layer, verify_replay=True), steps=3)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.block = nn.Embedding(20, 8), Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lm = nn.LayerNorm(8), nn.Linear(8, 20, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm(self.norm(h))


class TiedLM(nn.Module):
    """The embedding in the first checkpointed layer, the LM head tied to it in the last."""

    def __init__(self) -> None:
        super().__init__()
        embed, head = Embed(), Head()
        head.lm.weight = embed.emb.weight
        self.layers = nn.ModuleList([embed, Block(), head])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            ids = layer(ids)
        return ids


def test_an_embedding_and_lm_head_tied_across_checkpointed_layers_train_as_eager() -> None:
    _assert_twins(TiedLM, _wrap_layers, ids=True, rows=4)


class LowRank(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def right_inverse(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        return (u[:, :3] * s[:3]).contiguous(), vh[:3].contiguous()


class Factorised(nn.Module):
    """A low-rank parametrized weight (two originals), an orthogonal one, and a DoRA-style
    magnitude times direction over a frozen base."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.orth, self.base = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        parametrize.register_parametrization(self.low, "weight", LowRank(), unsafe=True)
        orthogonal(self.orth)
        self.base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(2, 8) * 0.1)
        self.b = nn.Parameter(torch.randn(8, 2) * 0.1)
        self.magnitude = nn.Parameter(self.base.weight.norm(dim=1, keepdim=True).detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.orth(torch.tanh(self.low(x))))
        w = self.base.weight + self.b @ self.a
        return torch.tanh(F.linear(x, self.magnitude * w / w.norm(dim=1, keepdim=True).detach(),
                                   self.base.bias))


@pytest.mark.parametrize("cached", [False, True])
def test_factorised_and_parametrized_weights_train_as_eager(cached: bool) -> None:
    def make() -> nn.Module:
        return Stack(Factorised)

    if not cached:
        _assert_twins(make, _wrap_layers)
        return

    class OneBlockPerStep(nn.Module):  # parametrize.cached() around each micro-batch
        def __init__(self) -> None:
            super().__init__()
            self.inner = make()
            self.layers = self.inner.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with parametrize.cached():
                return self.inner(x)

    _assert_twins(OneBlockPerStep, _wrap_layers)
