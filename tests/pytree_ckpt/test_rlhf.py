"""RLHF trainers (PPO, GRPO, DPO as TRL or OpenRLHF run them) on a tiny fp32 causal LM whose
decoder layers are checkpointed, compared bit for bit with the same model run eagerly: rollouts
generated with a key/value cache through the same layers under ``torch.no_grad()`` or
``torch.inference_mode()`` (no boundary there), training forwards with ``use_cache=False`` on the
generated (inference) tensors, old and reference log-probs under no-grad, the reference as the
same module with its LoRA adapters switched off by a flag (peft's ``disable_adapter()``), a value
head on the shared trunk backpropagated after the policy loss with ``retain_graph=True``,
``clip_grad_norm_`` and an EMA of the policy; with ``verify_replay``, offload, save units and an
output discard of a norm (helper NH)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import (CheckpointWithoutOutput, KeptCallables, KeptOps, RecomputeConfig,
                         SaveUnit, apply_recompute_config)

VOCAB, DIM, HEADS = 32, 16, 2


class LoraLinear(nn.Module):
    def __init__(self, root: list[Any]) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.lora_A, self.lora_B = nn.Linear(DIM, 4, bias=False), nn.Linear(4, DIM, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)
        self.root = root                    # a plain list: the flag lives on the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y + 0.5 * self.lora_B(self.lora_A(x)) if self.root[0].lora_enabled else y


class Block(nn.Module):
    def __init__(self, root: list[Any], drop: float) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.v = LoraLinear(root), LoraLinear(root)
        self.k, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(drop)
        self.discard = False

    def forward(self, h: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False, attn_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        b, t, _ = h.shape
        x = self.n1(h)
        q, k, v = (y.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for y in (self.q(x), self.k(x), self.v(x)))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if attn_mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, DIM))
        if self.discard:                     # Megatron-style: the norm's output freed
            ckpt = CheckpointWithoutOutput()
            u = self.fc1(ckpt.checkpoint(self.n2, h))
            ckpt.discard_output_and_register_recompute(u)
        else:
            u = self.fc1(self.n2(h))
        return h + self.drop(self.fc2(F.gelu(u))), ((k, v) if use_cache else None)


class TinyLM(nn.Module):
    def __init__(self, drop: float = 0.0) -> None:
        super().__init__()
        self.lora_enabled = True
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block([self], drop) for _ in range(2))
        self.norm, self.head, self.value_head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB), nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, past: Any = None, use_cache: bool = False,
                value: bool = False, attn_mask: torch.Tensor | None = None) -> Any:
        h, presents = self.emb(ids), []
        for i, layer in enumerate(self.layers):
            h, present = layer(h, None if past is None else past[i], use_cache=use_cache,
                               attn_mask=attn_mask)
            presents.append(present)
        h = self.norm(h)
        if value:
            return self.head(h), self.value_head(h).squeeze(-1)
        return (self.head(h), presents) if use_cache else self.head(h)


@contextlib.contextmanager
def disable_adapter(model: TinyLM) -> Iterator[None]:
    model.lora_enabled = False
    try:
        yield
    finally:
        model.lora_enabled = True


def frozen_base(model: TinyLM) -> TinyLM:
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or "value_head" in name)
    return model


def generate(model: TinyLM, prompt: torch.Tensor, new: int, mode: str) -> torch.Tensor:
    with torch.inference_mode() if mode == "inference" else torch.no_grad():
        logits, past = model(prompt, use_cache=True)
        ids = prompt
        for _ in range(new):
            nxt = torch.multinomial(logits[:, -1].softmax(-1), 1)
            ids = torch.cat([ids, nxt], 1)
            logits, past = model(nxt, past=past, use_cache=True)
    return ids


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(-1)


def taken(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def ppo(model: TinyLM, mode: str, *, groups: int = 1) -> list[torch.Tensor]:
    """Two PPO (or GRPO: ``groups`` completions a prompt) iterations: rollout, old and
    reference log-probs, two epochs of micro-batches, clipped objective + KL, value loss after
    the policy's with ``retain_graph=True``, clipping, SGD, EMA; what each step saw, in order."""
    torch.manual_seed(0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ema = [p.detach().clone() for p in model.parameters()]
    seen: list[torch.Tensor] = []
    for _ in range(2):
        ids = generate(model, torch.randint(0, VOCAB, (2, 3)).repeat_interleave(groups, 0), 5, mode)
        with torch.no_grad():
            old = logprobs(model(ids), ids)
            with disable_adapter(model):
                ref = logprobs(model(ids), ids)
        mask = torch.ones_like(old)
        mask[::2, -2:] = 0                       # padded completions
        reward = torch.randn(ids.shape[0])
        r = reward.view(-1, groups) if groups > 1 else reward.view(1, -1)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)
        for _ in range(2):
            for b in torch.randperm(ids.shape[0]).split(2):
                logits, value = model(ids[b], value=True)
                lp = logprobs(logits, ids[b])
                ratio = (lp - old[b]).exp()
                a = adv[b, None]
                policy = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.1 * (lp - ref[b])
                policy = (policy * mask[b]).sum() / mask[b].sum()
                value_loss = ((value[:, :-1] - reward[b, None]) ** 2 * mask[b]).mean()
                policy.backward(retain_graph=True)
                value_loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                seen += [policy.detach(), value_loss.detach(), norm, *taken(model)]
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for e, p in zip(ema, model.parameters()):
                        e.mul_(0.9).add_(p, alpha=0.1)
    return [*seen, *(p.detach().clone() for p in model.parameters()), *ema,
            *(b.clone() for b in model.buffers()), torch.get_rng_state()]


def dpo(model: TinyLM, mode: str) -> list[torch.Tensor]:
    """Two DPO steps: chosen and rejected (of other lengths) through the same layers, then one
    backward; the reference is the same model with its adapters off, under ``mode``."""
    torch.manual_seed(0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    seen: list[torch.Tensor] = []
    for _ in range(2):
        chosen, rejected = torch.randint(0, VOCAB, (2, 7)), torch.randint(0, VOCAB, (3, 5))
        with torch.inference_mode() if mode == "inference" else torch.no_grad(), \
                disable_adapter(model):
            ref_c = logprobs(model(chosen), chosen).sum(-1).mean()
            ref_r = logprobs(model(rejected), rejected).sum(-1).mean()
        pol_c = logprobs(model(chosen), chosen).sum(-1).mean()
        pol_r = logprobs(model(rejected), rejected).sum(-1).mean()
        loss = -F.logsigmoid(0.1 * ((pol_c - ref_c.clone()) - (pol_r - ref_r.clone())))
        loss.backward()
        seen += [loss.detach(), *taken(model)]
        opt.step()
        opt.zero_grad()
    return [*seen, torch.get_rng_state()]


def manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


def wrapped(**options: Any) -> Callable[[TinyLM], TinyLM]:
    def wrap(model: TinyLM) -> TinyLM:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, **options)
        return model
    return wrap


def kept(targets: dict[SaveUnit, Any], **options: Any) -> Callable[[TinyLM], TinyLM]:
    def wrap(model: TinyLM) -> TinyLM:
        assert apply_recompute_config(model.layers, RecomputeConfig(1.0, save=["attn"]),
                                      targets, **options) == [0, 1]
        return model
    return wrap


def discarding(model: TinyLM) -> TinyLM:
    for layer in model.layers:
        setattr(layer, "discard", True)
    return wrapped()(model)


ATTN_OP = {SaveUnit.ATTN: KeptOps("aten::_scaled_dot_product_flash_attention_for_cpu")}
LORA_METHOD = {SaveUnit.ATTN: KeptCallables("LoraLinear.forward")}
FORMS = {
    "plain": wrapped(),
    "verify_replay": wrapped(verify_replay=True),
    "offload": wrapped(offload=manager()),
    "attention kept": kept(ATTN_OP),
    "lora kept, offload": kept(LORA_METHOD, offload=manager()),
    "norm discarded": discarding,
}


def assert_twins(run: Callable[[TinyLM], list[torch.Tensor]], form: str, *,
                 drop: float = 0.1, lora: bool = False) -> None:
    torch.manual_seed(1)
    eager = TinyLM(drop)
    eager = frozen_base(eager) if lora else eager
    ours = FORMS[form](copy.deepcopy(eager))
    expected, got = run(eager), run(ours)
    assert len(expected) == len(got)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_ppo_on_cached_rollouts_gives_eager_numbers(form: str, mode: str) -> None:
    assert_twins(lambda m: ppo(m, mode), form)


@pytest.mark.parametrize("form", ["plain", "verify_replay", "attention kept", "norm discarded"])
def test_grpo_groups_with_lora_reference_give_eager_numbers(form: str) -> None:
    assert_twins(lambda m: ppo(m, "inference", groups=2), form, lora=True)


@pytest.mark.parametrize("form", ["plain", "verify_replay", "lora kept, offload"])
def test_dpo_chosen_and_rejected_of_other_lengths_give_eager_numbers(form: str) -> None:
    assert_twins(lambda m: dpo(m, "inference"), form, lora=True)


def padded_mask_step(model: TinyLM) -> list[torch.Tensor]:
    """GRPO's padded batch: a boolean causal-and-padding mask built under inference mode (as a
    rollout builds it) passed to every layer of the training forward, a masked loss."""
    torch.manual_seed(0)
    ids, lengths = torch.randint(0, VOCAB, (4, 7)), torch.tensor([7, 5, 6, 4])
    with torch.inference_mode():
        pad = torch.arange(7)[None] < lengths[:, None]
        mask = (torch.ones(7, 7, dtype=torch.bool).tril()[None] & pad[:, None])[:, None]
        mask = mask | torch.eye(7, dtype=torch.bool)
    loss_mask = pad[:, 1:].float()
    loss = -(logprobs(model(ids, attn_mask=mask), ids) * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    return [loss.detach(), *taken(model), torch.get_rng_state()]


@pytest.mark.parametrize("form", ["plain", "verify_replay", "offload", "attention kept"])
def test_padding_mask_made_under_inference_mode_gives_eager_gradients(form: str) -> None:
    assert_twins(padded_mask_step, form)


def rollout_before_backward(model: TinyLM) -> list[torch.Tensor]:
    """Online DPO's order: a training forward, then rollouts through the same layers (no_grad
    and inference mode, key/value cache, dropout's generator), then the backward."""
    torch.manual_seed(0)
    seen: list[torch.Tensor] = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 6))
        loss = logprobs(model(ids), ids).sum()
        seen += [generate(model, ids[:, :3], 4, mode) for mode in ("no_grad", "inference")]
        loss.backward()
        seen += [loss.detach(), *taken(model)]
    return [*seen, torch.get_rng_state()]


@pytest.mark.parametrize("form", ["plain", "verify_replay", "offload", "attention kept",
                                  "lora kept, offload"])
def test_rollout_between_forward_and_backward_gives_eager_numbers(form: str) -> None:
    assert_twins(rollout_before_backward, form)


def prefix_cache_step(model: TinyLM) -> list[torch.Tensor]:
    """A prompt's keys and values computed under inference mode, passed as tensors to the
    training forward of the completion (``use_cache=False``)."""
    torch.manual_seed(0)
    prompt, completion = torch.randint(0, VOCAB, (2, 3)), torch.randint(0, VOCAB, (2, 4))
    with torch.inference_mode():
        _, past = model(prompt, use_cache=True)
    h = model.emb(completion)
    for layer, kv in zip(model.layers, past):
        h, _ = layer(h, past=kv, use_cache=False)
    loss = model.head(model.norm(h)).logsumexp(-1).sum()
    loss.backward()
    return [loss.detach(), *taken(model)]


@pytest.mark.parametrize("form", ["plain", "verify_replay", "offload", "attention kept"])
def test_prompt_cache_made_under_inference_mode_gives_eager_gradients(form: str) -> None:
    assert_twins(prefix_cache_step, form)


def split_backwards(model: TinyLM) -> list[torch.Tensor]:
    """Separate actor and critic backwards on a shared trunk, each restricted to its own
    parameters (``backward(inputs=...)``), the first with ``retain_graph=True``."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 6))
    logits, value = model(ids, value=True)
    actor = [p for n, p in model.named_parameters() if "value_head" not in n]
    critic = [p for n, p in model.named_parameters() if "value_head" in n or "layers.1" in n]
    logprobs(logits, ids).sum().backward(retain_graph=True, inputs=actor)
    first = taken(model)
    model.zero_grad(set_to_none=True)
    value.square().sum().backward(inputs=critic)
    return [*first, *taken(model)]


@pytest.mark.parametrize("form", ["plain", "verify_replay", "offload", "attention kept"])
def test_actor_and_critic_backwards_restricted_to_their_parameters_give_eager_gradients(
        form: str) -> None:
    assert_twins(split_backwards, form)


def reinforce(model: TinyLM) -> list[torch.Tensor]:
    """REINFORCE with log-probs taken during a grad-enabled generation: ``use_cache=True``
    with the keys and values as tensors (no cache object), one backward over all the steps."""
    torch.manual_seed(0)
    seen: list[torch.Tensor] = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 3))
        logits, past = model(ids, use_cache=True)
        chosen = []
        for _ in range(4):
            dist = logits[:, -1].log_softmax(-1)
            nxt = torch.multinomial(dist.exp().detach(), 1)
            chosen.append(dist.gather(1, nxt))
            ids = torch.cat([ids, nxt], 1)
            logits, past = model(nxt, past=past, use_cache=True)
        loss = -(torch.cat(chosen, 1).sum(1) * torch.randn(2)).mean()
        loss.backward()
        seen += [ids, loss.detach(), *taken(model)]
    return [*seen, torch.get_rng_state()]


@pytest.mark.parametrize("form", list(FORMS))
def test_grad_enabled_cached_generation_gives_eager_gradients(form: str) -> None:
    assert_twins(reinforce, form)


@contextlib.contextmanager
def peft_disable_adapter(model: TinyLM) -> Iterator[None]:
    """peft's ``disable_adapter()``: the flag off and the adapters frozen, both undone after."""
    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    model.lora_enabled = False
    for p in adapters:
        p.requires_grad_(False)
    try:
        yield
    finally:
        model.lora_enabled = True
        for p in adapters:
            p.requires_grad_(True)


def reference_between_forward_and_backward(model: TinyLM, grad: bool) -> list[torch.Tensor]:
    """The policy's forward, then the reference (adapters off, peft's way) with or without
    grad, then the policy and value backwards: the reference never reaches the replay."""
    torch.manual_seed(0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    seen: list[torch.Tensor] = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 6))
        logits, value = model(ids, value=True)
        with contextlib.nullcontext() if grad else torch.inference_mode(), \
                peft_disable_adapter(model):
            ref = logprobs(model(ids), ids)
        assert not ref.requires_grad
        lp = logprobs(logits, ids)
        ((lp - ref.clone()).square().sum() + lp.sum()).backward(retain_graph=True)
        value.sum().backward()
        seen += taken(model)
        opt.step()
        opt.zero_grad()
    return [*seen, torch.get_rng_state()]


@pytest.mark.parametrize("grad", [False, True], ids=["inference_mode", "grad enabled"])
@pytest.mark.parametrize("form", ["plain", "verify_replay", "offload", "lora kept, offload"])
def test_peft_style_reference_between_forward_and_backward_gives_eager_gradients(
        form: str, grad: bool) -> None:
    assert_twins(lambda m: reference_between_forward_and_backward(m, grad), form, lora=True)
