"""Contrastive, retrieval and reward-model training through checkpointed encoder layers (helper
ND): GradCache (embeddings cached under no-grad, the loss's gradients handed back to each
re-encoded chunk under GradCache's RandContext), sentence-transformers' cached loss (the
re-encoding and its backward run in a hook during ``loss.backward()``), a dual encoder with
hard negatives and a learned temperature, MoCo's queue enqueued in place, SimCLR with a
BatchNorm projection head, a pairwise reward model over padded sequences, and a gradient
penalty on the embeddings. Each against an unwrapped eager twin, bit for bit in fp32: the
loss, every parameter's gradient, the buffers and the default generator after the step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
import pytree_ckpt
from pytree_ckpt import CheckpointError


class _Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc2(self.drop(F.gelu(self.fc1(self.norm(h)))))
        return h + (y if mask is None else y * mask.unsqueeze(-1))


class _Encoder(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(2))
        self.out = nn.Linear(d, d)

    def tokens(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h) if mask is None else layer(h, mask=mask)
        return h

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.tokens(ids).mean(1))


class _RandContext:
    """GradCache's RandContext: the generator's state at the cache pass, set again (inside a
    fork_rng) for the chunk's re-encoding."""

    def __init__(self) -> None:
        self.state = torch.get_rng_state()

    def __enter__(self) -> None:
        self.fork = torch.random.fork_rng(devices=[])
        self.fork.__enter__()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


def _info_nce(q: torch.Tensor, d: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / temperature
    return F.cross_entropy(logits, torch.arange(len(q)))


def _twins(wrap: Callable[[nn.Module], None] | None = None) -> tuple[_Encoder, _Encoder]:
    torch.manual_seed(0)
    eager = _Encoder()
    ours = copy.deepcopy(eager)
    if wrap is None:
        for layer in ours.layers:
            pytree_ckpt.apply_activation_checkpointing(layer)
    else:
        wrap(ours)
    return eager, ours


def _assert_same(eager: nn.Module, ours: nn.Module, results: dict[str, Any]) -> None:
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name
    for a, b in zip(eager.buffers(), ours.buffers()):
        assert torch.equal(a, b)
    e, o = results["eager"], results["ours"]
    assert all(torch.equal(x, y) for x, y in zip(e, o))


def _both(eager: nn.Module, ours: nn.Module, step: Callable[[nn.Module], tuple[Any, ...]],
          seed: int = 3) -> dict[str, Any]:
    results = {}
    for name, model in (("eager", eager), ("ours", ours)):
        torch.manual_seed(seed)
        out = step(model)
        results[name] = (*out, torch.get_rng_state())
    return results


def _grad_cache_step(model: _Encoder, temperature: nn.Parameter, q_ids: torch.Tensor,
                     d_ids: torch.Tensor, chunk: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    contexts: list[list[_RandContext]] = [[], []]
    cached = []
    with torch.no_grad():
        for ids, ctxs in zip((q_ids, d_ids), contexts):
            reps = []
            for c in ids.split(chunk):
                ctxs.append(_RandContext())
                reps.append(model(c))
            cached.append(torch.cat(reps).requires_grad_())
    loss = _info_nce(*cached, temperature)
    loss.backward()
    for ids, ctxs, reps in zip((q_ids, d_ids), contexts, cached):
        for c, ctx, g in zip(ids.split(chunk), ctxs, reps.grad.split(chunk)):
            with ctx:
                again = model(c)
            torch.autograd.backward(again, grad_tensors=g)
    return loss.detach(), temperature.grad


@pytest.mark.parametrize("how", ["plain", "verify_replay", "offload"])
def test_grad_cache_with_rand_context_and_dropout_gives_eager_gradients(how: str) -> None:
    # Dropout inside the checkpointed layers; the chunk's forward runs inside fork_rng with
    # the cached state set, its backward (the replay) after the fork has put the state back.
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    options = {"plain": {}, "verify_replay": {"verify_replay": True},
               "offload": {"offload": manager}}[how]

    def wrap(model: nn.Module) -> None:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, **options)

    eager, ours = _twins(wrap)
    torch.manual_seed(1)
    q_ids, d_ids = torch.randint(0, 50, (6, 5)), torch.randint(0, 50, (6, 5))
    temps = {id(eager): nn.Parameter(torch.tensor(0.07)), id(ours): nn.Parameter(torch.tensor(0.07))}
    results = _both(eager, ours, lambda m: _grad_cache_step(m, temps[id(m)], q_ids, d_ids))
    _assert_same(eager, ours, results)
    if how == "offload":
        assert manager.stats()["host_buffers_in_use"] == 0


class _CachedLoss(nn.Module):
    """sentence-transformers' CachedMultipleNegativesRankingLoss: the loss comes back as a
    leaf with a hook; the hook re-encodes each chunk and backpropagates a surrogate, inside the
    caller's ``loss.backward()``."""

    def __init__(self, model: _Encoder, chunk: int = 2) -> None:
        super().__init__()
        self.model, self.chunk = model, chunk

    def forward(self, q_ids: torch.Tensor, d_ids: torch.Tensor) -> torch.Tensor:
        self.contexts: list[list[_RandContext]] = [[], []]
        cached = []
        with torch.no_grad():
            for ids, ctxs in zip((q_ids, d_ids), self.contexts):
                reps = []
                for c in ids.split(self.chunk):
                    ctxs.append(_RandContext())
                    reps.append(self.model(c))
                cached.append(torch.cat(reps).requires_grad_())
        with torch.enable_grad():
            loss = _info_nce(*cached, torch.tensor(0.05))
            loss.backward()
        self.grads = [r.grad for r in cached]
        loss = loss.detach().requires_grad_()
        loss.register_hook(partial(self._hook, ids=(q_ids, d_ids)))
        return loss

    def _hook(self, grad_output: torch.Tensor, ids: tuple[torch.Tensor, ...]) -> None:
        with torch.enable_grad():
            for x, ctxs, grads in zip(ids, self.contexts, self.grads):
                for c, ctx, g in zip(x.split(self.chunk), ctxs, grads.split(self.chunk)):
                    with ctx:
                        reps = self.model(c)
                    (torch.dot(reps.flatten(), g.flatten()) * grad_output).backward()


def test_a_cached_loss_re_encoding_inside_a_hook_during_backward_gives_eager_gradients() -> None:
    eager, ours = _twins()
    torch.manual_seed(1)
    q_ids, d_ids = torch.randint(0, 50, (6, 5)), torch.randint(0, 50, (6, 5))

    def step(model: nn.Module) -> tuple[torch.Tensor]:
        loss = _CachedLoss(model)(q_ids, d_ids)
        loss.backward()
        return (loss.detach(),)

    _assert_same(eager, ours, _both(eager, ours, step))


def test_a_dual_encoder_with_hard_negatives_and_mixed_retained_gradients_matches_eager() -> None:
    # Queries, documents and hard negatives through the same checkpointed layers, a learned
    # temperature; autograd.grad on the embeddings and on one layer's parameters with the
    # graph kept, then the full backward; then a gradient penalty on the query embeddings
    # (create_graph=True reaching no boundary).
    eager, ours = _twins()
    torch.manual_seed(1)
    q_ids, d_ids, n_ids = (torch.randint(0, 50, (4, 5)) for _ in range(3))

    def step(model: nn.Module) -> tuple[torch.Tensor, ...]:
        temperature = model.out.weight.new_tensor(0.05)
        q, d = model(q_ids), model(torch.cat([d_ids, n_ids]))
        loss = _info_nce(q, d, temperature)
        gq, = torch.autograd.grad(loss, [q], retain_graph=True)
        gp = torch.autograd.grad(loss, [*model.layers[0].parameters()], retain_graph=True)
        g, = torch.autograd.grad(loss, [q], create_graph=True)
        (loss + g.square().sum()).backward()
        return (loss.detach(), gq, *gp)

    _assert_same(eager, ours, _both(eager, ours, step))


def test_a_gradient_penalty_on_a_checkpointed_layers_input_is_refused_naming_create_graph(
        ) -> None:
    _, ours = _twins()
    h0 = ours.emb(torch.randint(0, 50, (4, 5)))
    loss = ours.layers[1](ours.layers[0](h0)).square().mean()
    with pytest.raises(CheckpointError, match="create_graph=True"):
        torch.autograd.grad(loss, [h0], create_graph=True)


class _QueueHead(nn.Module):
    """MoCo's logits against a small queue (16 x 32 floats) enqueued in place, ``ptr`` an int
    buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("queue", F.normalize(torch.randn(16, 32), dim=0))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.proj(q), dim=-1)
        logits = torch.cat([(q * k).sum(-1, keepdim=True), q @ self.queue.clone()], 1) / 0.07
        ptr = int(self.ptr)
        self.queue[:, ptr:ptr + k.shape[0]] = k.T
        self.ptr[0] = (ptr + k.shape[0]) % self.queue.shape[1]
        return logits


def test_moco_with_a_momentum_encoder_and_an_in_place_queue_over_micro_batches_trains_as_eager(
        ) -> None:
    torch.manual_seed(0)
    models = [[_Encoder(), _QueueHead()]]
    models[0].append(copy.deepcopy(models[0][0]))  # the key encoder
    models.append(copy.deepcopy(models[0]))
    for module in (*models[1][0].layers, *models[1][2].layers, models[1][1]):
        pytree_ckpt.apply_activation_checkpointing(module)
    losses = []
    for encoder, head, keys in models:
        torch.manual_seed(5)
        step_losses = []
        for _ in range(2):
            micro = []
            for _ in range(2):
                ids = torch.randint(0, 50, (4, 5))
                q = encoder(ids)
                with torch.no_grad():
                    for pq, pk in zip(encoder.parameters(), keys.parameters()):
                        pk.mul_(0.9).add_(pq.detach(), alpha=0.1)
                    k = F.normalize(keys(ids), dim=-1)
                micro.append(F.cross_entropy(head(q, k), torch.zeros(4, dtype=torch.long)))
            sum(micro).backward()
            step_losses += micro
        losses.append((torch.stack(step_losses).detach(), torch.get_rng_state()))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])
    for eager, ours in zip(models[0], models[1]):
        _assert_same(eager, ours, {"eager": (), "ours": ()})
        assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), ours.parameters()))


def test_a_pairwise_reward_model_over_padded_sequences_with_last_token_pooling_matches_eager(
        ) -> None:
    # Chosen and rejected through the same checkpointed layers, a padding mask as a keyword,
    # last-token pooling with gather, -logsigmoid(r_c - r_r).
    torch.manual_seed(0)
    value = nn.Linear(16, 1)
    eager, ours = _twins()
    heads = {id(eager): value, id(ours): copy.deepcopy(value)}
    torch.manual_seed(1)
    ids_c, ids_r = torch.randint(0, 50, (4, 7)), torch.randint(0, 50, (4, 7))
    mask_c = (torch.arange(7) < torch.tensor([7, 3, 5, 1])[:, None]).long()
    mask_r = (torch.arange(7) < torch.tensor([2, 7, 4, 6])[:, None]).long()

    def reward(model: _Encoder, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = model.tokens(ids, mask)
        last = (mask.sum(1) - 1)[:, None, None].expand(-1, 1, h.shape[-1])
        return heads[id(model)](h.gather(1, last).squeeze(1)).squeeze(-1)

    def step(model: nn.Module) -> tuple[torch.Tensor, ...]:
        loss = -F.logsigmoid(reward(model, ids_c, mask_c) - reward(model, ids_r, mask_r)).mean()
        loss.backward()
        return (loss.detach(), *(p.grad for p in heads[id(model)].parameters()))

    _assert_same(eager, ours, _both(eager, ours, step))
