"""Saving, loading and resuming training around checkpointed layers (helper RF): each run is
compared bit for bit with its eager twin."""

from __future__ import annotations

import copy
import io
import pickle
import tempfile
import warnings

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import CheckpointWithoutOutput, KeptCallables, RecomputeConfig, SaveUnit


class _Attn(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.gen = gen

    def project(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape, generator=self.gen) > 0.3).float()   # a held generator
        return torch.dropout(torch.tanh(self.q(x)), 0.2, True) * keep      # and the global one


class _Block(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.attn = _Attn(gen)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(self.norm, self.attn.project(x))
        out = self.b(normed)
        ckpt.discard_output_and_register_recompute(out)
        return x + self.drop(out)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)          # one generator both layers share
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList([_Block(gen), _Block(gen)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).sum()


def _wrap(model: _Model, how: str) -> _Model:
    if how == "layers":
        pytree_ckpt.checkpoint_layers(model.layers)
    elif how == "units+offload":
        pytree_ckpt.apply_recompute_config(
            model.layers, RecomputeConfig(1.0, save=["attn"]),
            {SaveUnit.ATTN: KeptCallables("_Attn.project")},
            offload=offload.OffloadManager(offload.OffloadConfig(min_bytes=0)))
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    taken = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return taken


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _train(how: str, *, resume_at: int | None = None, whole: bool = False, steps: int = 4
           ) -> list[torch.Tensor]:
    """Losses, gradients and final parameters of ``steps`` AdamW steps, resumed at
    ``resume_at`` from a saved checkpoint into a fresh model (``whole``: the pickled objects)."""
    torch.manual_seed(0)
    model = _wrap(_Model(), how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    record: list[torch.Tensor] = []
    for step in range(steps):
        if step == resume_at:
            buf = io.BytesIO()
            if whole:
                torch.save({"model": model, "opt": opt, "rng": torch.get_rng_state()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=False)
                model, opt = saved["model"], saved["opt"]
            else:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "rng": torch.get_rng_state(),
                            "gen": model.layers[0].attn.gen.get_state()}, buf)
                buf.seek(0)
                saved = torch.load(buf)
                torch.manual_seed(99)                     # another init, another generator state
                model = _wrap(_Model(), how)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                model.layers[0].attn.gen.set_state(saved["gen"])
            torch.set_rng_state(saved["rng"])
        x = torch.randn(8, 16)
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        record += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
    return record + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("whole", [False, True], ids=["state_dicts", "whole_objects"])
@pytest.mark.parametrize("how", ["layers", "units+offload"])
def test_a_run_resumed_with_rng_and_held_generator_state_equals_the_uninterrupted_eager_run(
        how: str, whole: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _train("eager")
        assert _same(_train("eager", resume_at=2, whole=whole), eager)   # the recipe is sound
        assert _same(_train(how), eager)
        assert _same(_train(how, resume_at=2, whole=whole), eager)


@pytest.mark.parametrize("kind", ["deepcopy", "pickle", "torch.save"])
def test_a_wrapped_model_copied_between_forward_and_backward_keeps_ties_and_trains_as_eager(
        kind: str) -> None:
    torch.manual_seed(0)
    eager = _Model()
    ours = _wrap(copy.deepcopy(eager), "units+offload")
    x = torch.randn(8, 16)

    def copied(model: nn.Module) -> nn.Module:
        if kind == "deepcopy":
            return copy.deepcopy(model)
        if kind == "pickle":
            return pickle.loads(pickle.dumps(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(2)
        eager_loss = eager(x)
        torch.manual_seed(2)
        our_loss = ours(x)
        eager_copy, our_copy = copied(eager), copied(ours)       # with a replay pending
        assert our_copy.layers[0].attn.gen is our_copy.layers[1].attn.gen
        assert our_copy.layers[0].attn.gen is not ours.layers[0].attn.gen
        for _ in range(2):                                      # the copies step first
            torch.manual_seed(3)
            eager_copy(x).backward()
            torch.manual_seed(3)
            our_copy(x).backward()
            assert _same(_grads(eager_copy), _grads(our_copy))
        eager_loss.backward()
        our_loss.backward()
    assert _same(_grads(eager), _grads(ours))


def test_parameters_loaded_with_assign_between_forward_and_backward_get_eagers_gradients() -> None:
    torch.manual_seed(0)
    eager = _Model()
    ours = _wrap(copy.deepcopy(eager), "layers")
    new = {k: v + 0.5 for k, v in _Model().state_dict().items()}
    x = torch.randn(8, 16)
    per_model = []
    for model in (eager, ours):
        old = list(model.parameters())
        torch.manual_seed(2)
        loss = model(x)
        model.load_state_dict(new, assign=True)                 # the graph keeps the old ones
        loss.backward()
        assert all(p.grad is None for p in model.parameters())
        per_model.append([p.grad for p in old])
    assert _same(*per_model)


def test_a_parameter_loaded_in_place_between_forward_and_backward_is_refused_naming_it() -> None:
    torch.manual_seed(0)
    ours = _wrap(_Model(), "layers")
    loss = ours(torch.randn(8, 16))
    ours.layers[0].load_state_dict(
        {k: v + 0.5 for k, v in ours.layers[0].state_dict().items() if k.endswith("bias")},
        strict=False)                                          # eager: no error, its graph saved no bias
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"attn\.q\.bias.*changed in place"):
        loss.backward()


@pytest.mark.parametrize("how", ["layers", "units+offload"])
def test_dcp_without_a_process_group_round_trips_a_wrapped_model_into_wrapped_and_plain_ones(
        how: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    eager = _Model()
    ours = _wrap(copy.deepcopy(eager), how)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in (eager, ours):
            torch.manual_seed(2)
            model(x).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        _grads(eager), _grads(ours)
        with tempfile.TemporaryDirectory() as folder:
            dcp.save(ours.state_dict(), checkpoint_id=folder, no_dist=True)
            torch.manual_seed(5)
            loaded, plain = _wrap(_Model(), how), _Model()
            for model in (loaded, plain):
                state = model.state_dict()
                dcp.load(state, checkpoint_id=folder, no_dist=True)
                model.load_state_dict(state)
        loaded.layers[0].attn.gen.set_state(eager.layers[0].attn.gen.get_state())
        plain.layers[0].attn.gen.set_state(eager.layers[0].attn.gen.get_state())
        per_model = []
        for model in (eager, loaded):
            torch.manual_seed(4)
            model(x).backward()
            per_model.append(_grads(model))
    assert _same(*per_model)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 eager.state_dict().values()))


def test_a_torch_checkpoint_wrapper_state_dict_loads_strictly_into_a_wrapped_model() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    theirs = _Model()
    theirs.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in theirs.layers)
    assert "layers.0._checkpoint_wrapped_module.b.weight" in dict(theirs.named_parameters())
    state = theirs.state_dict()                                 # torch strips its prefix here
    ours = _wrap(_Model(), "units+offload")
    ours.load_state_dict(state)                                 # strict
    assert list(ours.state_dict()) == list(state)


def test_state_dicts_read_mid_step_and_by_backward_hooks_during_replays_are_eagers() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 16)
            self.register_buffer("ema", torch.zeros(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bn(self.a(x))
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
            return x + self.b(torch.relu(h))

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 16), Layer(), Layer(), nn.Linear(16, 1))
    ours = copy.deepcopy(eager)
    for layer in (ours[1], ours[2]):
        pytree_ckpt.apply_activation_checkpointing(layer)
    xs = [torch.randn(8, 16) for _ in range(3)]
    seen: list[list[dict[str, torch.Tensor]]] = []
    for model in (eager, ours):
        states: list[dict[str, torch.Tensor]] = []

        def read(*_: object, model: nn.Module = model,
                 states: list[dict[str, torch.Tensor]] = states) -> None:
            states.append({k: v.clone() for k, v in model.state_dict().items()})

        model[1].b.register_full_backward_hook(read)       # runs inside the replays' backward
        model[2].bn.register_full_backward_hook(read)
        losses = [model(x).sum() for x in xs]               # three micro-batches
        read()
        for loss in reversed(losses):
            loss.backward()
        read()
        seen.append(states)
    assert len(seen[0]) == len(seen[1]) == 8
    for a, b in zip(*seen):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _same(_grads(eager), _grads(ours))


class _CountingLayer(nn.Module):
    """A layer whose forward reassigns a buffer (limits.md's advice for state), and whose
    submodule's full backward hook keeps a gradient statistic as another buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("grad_ema", torch.zeros(()))
        self.b.register_full_backward_hook(self.track)

    def track(self, module: nn.Module, grad_in: object, grad_out: tuple[torch.Tensor, ...]
              ) -> None:
        self.grad_ema = 0.9 * self.grad_ema + 0.1 * grad_out[0].norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return x + self.b(torch.tanh(self.a(x)))


def test_a_buffer_a_backward_hook_reassigns_across_micro_batches_ends_the_step_as_eagers(
        ) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 16), _CountingLayer(), nn.Linear(16, 1))
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours[1])
    xs = [torch.randn(8, 16) for _ in range(2)]
    for model in (eager, ours):
        losses = [model(x).sum() for x in xs]              # two micro-batches, then backward
        for loss in losses:
            loss.backward()
    assert torch.equal(ours[1].steps, eager[1].steps)
    assert torch.equal(ours[1].grad_ema, eager[1].grad_ema)   # eager: 2 updates; ours: 1


def test_a_state_dict_saved_by_a_backward_hook_during_a_replay_is_eagers() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 16), _CountingLayer(), nn.Linear(16, 1))
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours[1])
    xs = [torch.randn(8, 16) for _ in range(2)]
    saved = []
    for model in (eager, ours):
        states: list[dict[str, torch.Tensor]] = []

        def save(*_: object, model: nn.Module = model,
                 states: list[dict[str, torch.Tensor]] = states) -> None:
            buf = io.BytesIO()                              # a checkpoint written in backward
            torch.save(model.state_dict(), buf)
            buf.seek(0)
            states.append(torch.load(buf))

        model[1].a.register_full_backward_hook(save)
        losses = [model(x).sum() for x in xs]
        for loss in losses:
            loss.backward()
        saved.append(states)
    assert len(saved[0]) == len(saved[1]) == 2
    for a, b in zip(*saved):
        assert torch.equal(a["1.steps"], b["1.steps"])     # eager: 2 at both reads; ours: 1
