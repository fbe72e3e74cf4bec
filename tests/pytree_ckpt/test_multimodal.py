"""Multimodal and distillation models (LLaVA, Flamingo, Q-Former, prefix tuning, knowledge
distillation) written by hand in plain torch with transformers' calling conventions, each
compared bit for bit in fp32 with its eager twin: loss, every parameter's gradient, buffers and
the default generator's state after the step (helper OF)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt

D = 16
IMAGE = 7  # the image placeholder token id
ac = pytree_ckpt.apply_activation_checkpointing


def _manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0))


def _state(model: nn.Module, loss: torch.Tensor) -> list[Any]:
    return [loss.detach().clone(),
            *[(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()],
            *[(n, b.clone()) for n, b in model.named_buffers()],
            torch.get_rng_state()]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple):
        return a[0] == b[0] and ((a[1] is None and b[1] is None) or _equal(a[1], b[1]))
    return a == b


def assert_twins_match(make: Callable[[], nn.Module], step: Callable[[nn.Module], torch.Tensor],
                       wrap: Callable[[nn.Module], Any], steps: int = 2) -> None:
    """``make()`` and a copy ``wrap`` checkpoints, ``steps`` steps each from the same seed."""
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager)
    wrap(ours)
    for s in range(steps):
        states = []
        for model in (eager, ours):
            torch.manual_seed(100 + s)
            loss = step(model)
            loss.backward()
            states.append(_state(model, loss))
            model.zero_grad(set_to_none=True)
        a, b = states
        assert len(a) == len(b)
        bad = [x[0] if isinstance(x, tuple) else i for i, (x, y) in enumerate(zip(a, b))
               if not _equal(x, y)]
        assert not bad, f"step {s}: {bad}"


class DecoderLayer(nn.Module):
    """transformers' convention: a 4-D additive mask, keyword-only options, a tuple output
    with ``None`` where attentions or a cache are not asked for, a past key/value pair."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(2 * D, D))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *, past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
                output_attentions: bool = False, use_cache: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        h = self.ln(hidden_states)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], 1)
            v = torch.cat([past_key_value[1], v], 1)
        scores = q @ k.transpose(1, 2) / math.sqrt(D)
        if attention_mask is not None:
            scores = scores + attention_mask[:, 0]
        probs = scores.softmax(-1)
        out = hidden_states + self.o(probs @ v)
        out = out + self.mlp(out)
        return out, probs if output_attentions else None, None


def _causal(batch: int, length: int, prefix: int = 0) -> torch.Tensor:
    causal = torch.full((length, length), float("-inf")).triu(1)
    return torch.cat([torch.zeros(length, prefix), causal], 1)[None, None].expand(
        batch, 1, length, length + prefix)


class Llava(nn.Module):
    """A frozen vision tower run under no_grad, a trainable projector, the images' features
    merged into the text embeddings at the image tokens, then decoder layers."""

    def __init__(self, merge: str) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(12, D), nn.LayerNorm(D), nn.GELU())
        self.tower.requires_grad_(False).eval()
        self.proj = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
        self.emb = nn.Embedding(50, D)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(2))
        self.head = nn.Linear(D, 50)
        self.merge_how = merge

    def merge(self, ids: torch.Tensor, images: list[torch.Tensor]) -> torch.Tensor:
        embeds = self.emb(ids)
        with torch.no_grad():
            features = [self.tower(image) for image in images]
        features = self.proj(torch.cat(features, 0))
        mask = ids == IMAGE
        if self.merge_how == "masked_scatter":
            return embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), features)
        if self.merge_how == "masked_scatter_":
            embeds.masked_scatter_(mask.unsqueeze(-1).expand_as(embeds), features)
        else:
            embeds[mask] = features
        return embeds

    def forward(self, ids: torch.Tensor, images: list[torch.Tensor], labels: torch.Tensor
                ) -> torch.Tensor:
        h = self.merge(ids, images)
        mask = _causal(*ids.shape)
        attentions = []
        for layer in self.layers:
            h, probs, _ = layer(h, mask, output_attentions=True, use_cache=False)
            attentions.append(probs)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return loss + sum(p.square().mean() for p in attentions)


def _llava_batch() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (2, 12), generator=g)
    ids[ids == IMAGE] = 1
    ids[0, 1:4] = IMAGE                        # one image of 3 patches
    ids[1, 2:4] = IMAGE
    ids[1, 6:9] = IMAGE                        # two images, of 2 and 3 patches
    images = [torch.randn(n, 12, generator=g) for n in (3, 2, 3)]
    return ids, images, torch.randint(0, 50, (2, 12), generator=g)


def _layers(**options: Any) -> Callable[[nn.Module], Any]:
    return lambda model: [ac(layer, **options) for layer in model.layers]


@pytest.mark.parametrize("merge", ["masked_scatter", "masked_scatter_", "index"])
@pytest.mark.parametrize("wrap", ["layers", "check_fn", "verify", "offload", "projector"])
def test_llava_image_features_merged_at_image_tokens_give_eager_numbers(merge: str, wrap: str
                                                                        ) -> None:
    ids, images, labels = _llava_batch()
    wraps = {"layers": _layers(),
             "check_fn": lambda m: ac(m, check_fn=lambda x: isinstance(x, DecoderLayer)),
             "verify": _layers(verify_replay=True),
             "offload": _layers(offload=_manager()),
             "projector": lambda m: (_layers()(m), ac(m.proj))}
    assert_twins_match(lambda: Llava(merge), lambda m: m(ids, images, labels), wraps[wrap])


def test_llava_merge_checkpointed_with_a_list_of_images_gives_eager_numbers() -> None:
    ids, images, labels = _llava_batch()

    def wrap(model: Any) -> None:
        merge = model.merge
        model.merge = lambda ids, images: pytree_ckpt.checkpoint(merge, ids, images)
        _layers()(model)
    assert_twins_match(lambda: Llava("masked_scatter"), lambda m: m(ids, images, labels), wrap)


def test_a_merge_writing_image_features_into_its_input_embeddings_is_refused_at_the_call(
) -> None:
    class Merge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(D, D)

        def forward(self, inputs_embeds: torch.Tensor, features: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
            inputs_embeds[mask] = self.proj(features)
            return inputs_embeds

    merge = ac(Merge())
    ids = torch.tensor([[1, IMAGE, IMAGE, 2]])
    embeds = nn.Embedding(10, D)(ids)
    with pytest.raises(pytree_ckpt.CheckpointError, match="changed its input args\\[0\\] in place"):
        merge(embeds, torch.randn(2, D), ids == IMAGE)


class GatedCrossAttention(nn.Module):
    """Flamingo's: tanh-gated cross-attention and feed-forward, gates at zero at the start,
    text tokens attending only to the media before them (media locations)."""

    def __init__(self, gate: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.attn_gate = nn.Parameter(torch.tensor([gate]))
        self.ff = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
        self.ff_gate = nn.Parameter(torch.tensor([gate]))

    def forward(self, x: torch.Tensor, media: torch.Tensor, media_locations: torch.Tensor
                ) -> torch.Tensor:
        which = media_locations.cumsum(-1)                             # B, T
        tokens = media.shape[2]
        media_index = torch.arange(1, media.shape[1] + 1).repeat_interleave(tokens)
        allowed = which[:, :, None] == media_index[None, None]         # B, T, M * tokens
        k, v = self.kv(media.flatten(1, 2)).chunk(2, -1)
        out = F.scaled_dot_product_attention(self.q(self.ln(x))[:, None], k[:, None],
                                             v[:, None], attn_mask=allowed[:, None])[:, 0]
        x = x + torch.nan_to_num(self.o(out)) * self.attn_gate.tanh()
        return x + self.ff(x) * self.ff_gate.tanh()


class Resampler(nn.Module):
    """A perceiver resampler: learned latents attending to the frozen features and themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, D))
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, dropout=0.1)
        self.ff = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D))

    def forward(self, features: torch.Tensor) -> torch.Tensor:           # B, M, P, D
        b, m = features.shape[:2]
        latents = self.latents.expand(b * m, -1, -1)
        kv = torch.cat([features.flatten(0, 1), latents], 1)
        latents = latents + self.attn(latents, kv, kv, need_weights=False)[0]
        return (latents + self.ff(latents)).unflatten(0, (b, m))


class FlamingoLayer(nn.Module):
    def __init__(self, gate: float) -> None:
        super().__init__()
        self.gated = GatedCrossAttention(gate)
        self.lm = DecoderLayer().requires_grad_(False)                   # the frozen LM

    def forward(self, h: torch.Tensor, media: torch.Tensor, *, media_locations: torch.Tensor
                ) -> torch.Tensor:
        return self.lm(self.gated(h, media, media_locations), _causal(*h.shape[:2]))[0]


class Flamingo(nn.Module):
    def __init__(self, gate: float) -> None:
        super().__init__()
        self.vision = nn.Linear(12, D).requires_grad_(False)
        self.resampler = Resampler()
        self.emb = nn.Embedding(50, D).requires_grad_(False)
        self.layers = nn.ModuleList(FlamingoLayer(gate) for _ in range(2))
        self.head = nn.Linear(D, 50).requires_grad_(False)

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor, locations: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.vision(pixels)
        media = self.resampler(features)
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, media, media_locations=locations)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("gate", [0.0, 0.3])
@pytest.mark.parametrize("wrap", ["layers", "check_fn", "verify", "offload", "units"])
def test_flamingo_gated_cross_attention_and_resampler_give_eager_numbers(gate: float, wrap: str
                                                                         ) -> None:
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 50, (2, 10), generator=g) for _ in range(2))
    pixels = torch.randn(2, 2, 5, 12, generator=g)
    locations = torch.zeros(2, 10, dtype=torch.bool)
    locations[0, 0] = locations[0, 5] = locations[1, 3] = True  # row 1's first tokens: no media
    wraps = {"layers": _layers(),
             "check_fn": lambda m: ac(m, check_fn=lambda x: isinstance(
                 x, (GatedCrossAttention, DecoderLayer, Resampler))),
             "verify": _layers(verify_replay=True),
             "offload": _layers(offload=_manager()),
             "units": lambda m: pytree_ckpt.apply_recompute_config(
                 m.layers, pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
                 {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptCallables(
                     "GatedCrossAttention.forward")})}
    assert_twins_match(lambda: Flamingo(gate), lambda m: m(ids, pixels, locations, labels),
                       wraps[wrap])


class QFormerLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.ff = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(0.2))

    def forward(self, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | None = None, *, query_length: int = 0,
                output_attentions: bool = False) -> tuple[torch.Tensor, ...]:
        h = hidden_states + self.self_attn(hidden_states, hidden_states, hidden_states)[0]
        queries, text = h[:, :query_length], h[:, query_length:]
        if encoder_hidden_states is not None:
            queries = queries + self.cross_attn(queries, encoder_hidden_states,
                                                encoder_hidden_states)[0]
        h = torch.cat([queries, text], 1)
        return (h + self.ff(h),) + ((None,) if output_attentions else ())


class QFormer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(12, D), nn.LayerNorm(D))
        self.vision.requires_grad_(False).eval()
        self.query_tokens = nn.Parameter(torch.randn(1, 6, D) * 0.02)
        self.layers = nn.ModuleList(QFormerLayer() for _ in range(2))

    def run(self, pixels: torch.Tensor | None, text: torch.Tensor, queries: int) -> torch.Tensor:
        encoded = None
        if pixels is not None:
            with torch.no_grad():
                encoded = self.vision(pixels)
        h = torch.cat([self.query_tokens[:, :queries].expand(text.shape[0], -1, -1), text], 1)
        for layer in self.layers:
            h = layer(h, encoded, query_length=queries, output_attentions=queries % 2 == 0)[0]
        return h

    def forward(self, text: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        # three passes before one backward, as BLIP-2's ITC/ITM/ITG losses: with images and 4
        # queries, text only, with images and 3 queries
        return (self.run(pixels, text, 4).square().mean() + self.run(None, text, 0).abs().mean()
                + self.run(pixels, text, 3).sum() * 0.01)


@pytest.mark.parametrize("wrap", ["layers", "verify", "offload"])
def test_qformer_passes_with_and_without_images_before_one_backward_give_eager_numbers(
        wrap: str) -> None:
    text, pixels = torch.randn(2, 5, D), torch.randn(2, 7, 12)
    wraps = {"layers": _layers(), "verify": _layers(verify_replay=True),
             "offload": _layers(offload=_manager())}
    assert_twins_match(QFormer, lambda m: m(text, pixels), wraps[wrap])


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(2, D) * 0.1)
        self.B = nn.Parameter(torch.randn(D, 2) * 0.1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.drop(x) @ self.A.t() @ self.B.t() * 2.0


class PeftLayer(DecoderLayer):
    """A frozen layer with LoRA on q and v only, and a bottleneck adapter after it."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)
        self.q, self.v = LoraLinear(self.q), LoraLinear(self.v)
        self.adapter = nn.Sequential(nn.Linear(D, 4), nn.ReLU(), nn.Linear(4, D))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        out, probs, _ = super().forward(hidden_states, attention_mask, **kwargs)
        return out + self.adapter(out), probs, None


class PrefixTuned(nn.Module):
    """Prompt tuning (learned embeddings before the text) and prefix tuning (key/value pairs
    from a reparametrising MLP, passed to each layer as a past_key_value tuple)."""

    def __init__(self, prefix: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D).requires_grad_(False)
        self.layers = nn.ModuleList(PeftLayer() for _ in range(2))
        self.prompt = nn.Parameter(torch.randn(2, D) * 0.1)
        self.prefix = nn.Parameter(torch.randn(prefix, D) * 0.1)
        self.prefix_mlp = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 2 * 2 * D))
        self.head = nn.Linear(D, 50).requires_grad_(False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        h = torch.cat([self.prompt.expand(b, -1, -1), self.emb(ids)], 1)
        kv = self.prefix_mlp(self.prefix).view(-1, 2, 2, D).permute(1, 2, 0, 3)
        past = [(kv[i, 0].expand(b, -1, -1), kv[i, 1].expand(b, -1, -1)) for i in range(2)]
        mask = _causal(b, h.shape[1], self.prefix.shape[0])
        for layer, pair in zip(self.layers, past):
            h = layer(h, attention_mask=mask, past_key_value=pair, output_attentions=True,
                      use_cache=False)[0]
        return F.cross_entropy(self.head(h[:, 2:]).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("wrap", ["layers", "check_fn", "verify", "offload"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_prefix_and_prompt_tuning_with_lora_and_adapters_give_eager_numbers(
        wrap: str, micro_batches: int) -> None:
    g = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, 50, (2, 8), generator=g) for _ in range(2))
    wraps = {"layers": _layers(),
             "check_fn": lambda m: ac(m, check_fn=lambda x: isinstance(x, PeftLayer)),
             "verify": _layers(verify_replay=True), "offload": _layers(offload=_manager())}

    def step(model: nn.Module) -> torch.Tensor:
        if micro_batches == 1:
            return model(ids, labels)
        (model(ids, labels) / 2).backward()  # gradient accumulation
        return model(ids.flip(0), labels.flip(0)) / 2
    assert_twins_match(PrefixTuned, step, wraps[wrap])


class Net(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(depth))
        self.head = nn.Linear(D, 50)

    def forward(self, ids: torch.Tensor, checkpointed: bool = False) -> dict[str, Any]:
        h, hidden = self.emb(ids), {}
        for i, layer in enumerate(self.layers):
            h = (pytree_ckpt.checkpoint(layer, h) if checkpointed else layer(h))[0]
            hidden[f"h{i}"] = h
        return {"logits": self.head(h), "hidden": hidden}


def _kd_loss(student: dict[str, Any], teacher: dict[str, Any], align: nn.Module,
             temperature: float = 2.0) -> torch.Tensor:
    kl = F.kl_div(F.log_softmax(student["logits"] / temperature, -1),
                  F.log_softmax(teacher["logits"] / temperature, -1), log_target=True,
                  reduction="batchmean") * temperature ** 2
    return kl + F.mse_loss(align(student["hidden"]["h1"]), teacher["hidden"]["h2"])


class Distillation(nn.Module):
    def __init__(self, teacher_train: bool) -> None:
        super().__init__()
        self.student = Net(2)
        self.teacher = Net(3).requires_grad_(False).train(teacher_train)
        self.align = nn.Linear(D, D)
        self.checkpointed = False

    def step(self, ids: torch.Tensor) -> dict[str, Any]:
        """Teacher and student in one function (checkpointed whole by the twin)."""
        return {"loss": _kd_loss(self.student(ids), self.teacher(ids), self.align)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The student's layers checkpointed; the teacher's in checkpoints under no_grad."""
        student = self.student(ids, checkpointed=self.checkpointed)
        with torch.no_grad():
            teacher = self.teacher(ids, checkpointed=self.checkpointed)
        return _kd_loss(student, teacher, self.align)


@pytest.mark.parametrize("teacher_train", [False, True])
@pytest.mark.parametrize("how", ["one_boundary", "teacher_under_no_grad", "layers_offloaded"])
def test_distillation_with_a_frozen_teacher_gives_eager_numbers(teacher_train: bool, how: str
                                                                ) -> None:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    if how == "one_boundary":
        def step(model: Any) -> torch.Tensor:
            if getattr(model, "boundary", False):
                return pytree_ckpt.checkpoint(model.step, ids)["loss"]
            return model.step(ids)["loss"]
        wrap: Callable[[Any], Any] = lambda m: setattr(m, "boundary", True)
    elif how == "teacher_under_no_grad":
        step, wrap = (lambda m: m(ids)), (lambda m: setattr(m, "checkpointed", True))
    else:
        step = lambda m: m(ids)
        wrap = lambda m: [ac(layer, offload=manager) for layer in
                          [*m.student.layers, *m.teacher.layers]]
        manager = _manager()
    assert_twins_match(lambda: Distillation(teacher_train), step, wrap)


class StudentThroughTeacherHead(nn.Module):
    """SimKD: the student's features go through the frozen teacher's classifier (with a
    BatchNorm and a dropout), its gradient reaching the student through it."""

    def __init__(self, teacher_train: bool) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(6, D), nn.Tanh(), nn.Linear(D, D))
        self.head = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU(), nn.Dropout(0.5),
                                  nn.Linear(D, 5)).requires_grad_(False).train(teacher_train)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.student(x)), y)


@pytest.mark.parametrize("teacher_train", [False, True])
def test_student_features_through_a_checkpointed_frozen_teacher_head_give_eager_numbers(
        teacher_train: bool) -> None:
    x, y = torch.randn(6, 6), torch.randint(0, 5, (6,))
    assert_twins_match(lambda: StudentThroughTeacherHead(teacher_train),
                       lambda m: m(x[:3], y[:3]) + m(x[3:], y[3:]),
                       lambda m: ac(m.head, verify_replay=True))


class Steering(nn.Module):
    """Activation steering / ReFT on a layer's output, by hooks on the checkpointed layer
    itself (they run outside the boundary), the vector trained."""

    def __init__(self) -> None:
        super().__init__()
        self.vector = nn.Parameter(torch.randn(D) * 0.1)

    def after(self, module: nn.Module, args: Any, output: tuple[Any, ...]) -> tuple[Any, ...]:
        return (output[0] + self.vector, *output[1:])

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (args[0] * (1 + self.vector), *args[1:]), kwargs


@pytest.mark.parametrize("hook", ["after", "before"])
def test_steering_hooks_on_checkpointed_layers_give_eager_numbers(hook: str) -> None:
    ids, images, labels = _llava_batch()

    def make() -> nn.Module:
        model = Llava("masked_scatter")
        model.steering = nn.ModuleList(Steering() for _ in model.layers)
        for layer, steering in zip(model.layers, model.steering):
            if hook == "after":
                layer.register_forward_hook(steering.after)
            else:
                layer.register_forward_pre_hook(steering.before, with_kwargs=True)
        return model
    assert_twins_match(make, lambda m: m(ids, images, labels), _layers(offload=_manager()))


class SaliencyDistillation(nn.Module):
    """The frozen teacher's input gradient (a saliency map) computed inside the student's
    checkpointed layer with enable_grad and autograd.grad, used as a weight of its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(D, D)
        self.teacher = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1))
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.student(x))
        with torch.enable_grad():
            probe = x.detach().requires_grad_(True)
            saliency, = torch.autograd.grad(self.teacher(probe).sum(), probe)
        return (h * saliency.abs()).sum() + h.square().sum()


@pytest.mark.parametrize("option", ["plain", "verify", "offload"])
def test_a_teacher_saliency_taken_inside_the_student_layer_gives_eager_numbers(option: str
                                                                               ) -> None:
    x = torch.randn(4, D)
    options = {"plain": {}, "verify": {"verify_replay": True},
               "offload": {"offload": _manager()}}[option]
    assert_twins_match(lambda: nn.Sequential(nn.Linear(D, D), SaliencyDistillation()),
                       lambda m: m(x), lambda m: ac(m[1], **options))
