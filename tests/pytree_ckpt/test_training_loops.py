"""torch's own training utilities around checkpointed layers: fp16 autocast with a GradScaler
(overflowing steps skipped, unscale and clipping), averaged models (SWA, EMA) with update_bn,
eval and train micro-batches in one step, layers frozen and unfrozen, optimizer hooks and lr
schedulers, state dicts loaded (resume, from an unwrapped model, assign=True) and dtype and
device moves. Each runs a few steps on a small model (Linear, LayerNorm, dropout, one
BatchNorm1d) against its unwrapped eager twin, bit for bit (fp16 too: both run the same
kernels), with offload off and on. Last, a torchtune-style recipe on a small decoder (gradient
accumulation, clip_grad_norm_, AdamW, eval passes under no_grad and inference_mode, a resume
from state dicts), in fp32 and under CPU bf16 autocast."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

import offload
import pytree_ckpt


class _Layer(nn.Module):
    calls = 0  # forward calls of every _Layer: the original pass and the replay count each

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.2)
        self.bn = nn.BatchNorm1d(8) if batch_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        h = self.drop(self.norm(self.lin(x)))
        if self.bn is not None:
            h = self.bn(h)
        return x + torch.tanh(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer(batch_norm=True), _Layer()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _batch(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(expected: Any, got: Any) -> None:
    """Equal leaf by leaf, tensors bit for bit with dtype (NaN where eager has NaN)."""
    leaves, spec = optree.tree_flatten(expected, none_is_leaf=True)
    others, other_spec = optree.tree_flatten(got, none_is_leaf=True)
    assert spec == other_spec
    for i, (a, b) in enumerate(zip(leaves, others)):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, i
            assert torch.equal(a.isnan(), b.isnan()), i
            assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), \
                f"leaf #{i} differs: max |d| = {(a - b).abs().nan_to_num(0.0).max()}"
        else:
            assert a == b, i


def _against_eager(body: Callable[[nn.Module], Any], *, offloaded: bool,
                   in_place: bool = False) -> tuple[Any, nn.Module]:
    """``body(model)`` on an eager model and on its checkpointed twin (each layer through
    ``checkpoint_layers``, or ``apply_activation_checkpointing`` with ``in_place``), compared;
    returns the checkpointed run's result and its model."""
    torch.manual_seed(0)
    eager = _Net()
    model = copy.deepcopy(eager)
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu") \
        if offloaded else False
    if in_place:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    else:
        pytree_ckpt.checkpoint_layers(model.layers, offload=manager)
    expected = body(eager)
    _Layer.calls = 0
    got = body(model)
    _same(expected, got)
    if offloaded:
        assert isinstance(manager, offload.OffloadManager)
        stats = manager.stats()
        assert stats["offloaded_bytes"] > 0 and stats["host_buffers_in_use"] == 0
    return got, model


_OFFLOAD = pytest.mark.parametrize("offloaded", [False, True], ids=["no-offload", "offload"])


def _micro_batches(model: nn.Module, modes: tuple[bool, ...], *, steps: int = 2,
                   read_clones: bool = False) -> Any:
    """``steps`` SGD steps of one micro-batch per mode (train or eval), all forwards before one
    backward; with ``read_clones``, each eval micro-batch runs on clones of the buffers (what
    it reads, as its forward read it, also in its backward)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(steps):
        losses = []
        for i, training in enumerate(modes):
            model.train(training)
            torch.manual_seed(10 * step + i)
            x = _batch(10 * step + i)
            if read_clones and not training:
                buffers = {name: b.clone() for name, b in model.named_buffers()}
                losses.append(torch.func.functional_call(model, buffers, (x,)))
            else:
                losses.append(model(x))
        model.train()
        sum(losses).backward()
        results.append(([loss.detach() for loss in losses], _grads(model)))
        optimizer.step()
        optimizer.zero_grad()
    return results, _state(model)


_MODES = pytest.mark.parametrize("modes", [(True, False, True), (False, True, True)],
                                 ids=["train-eval-train", "eval-train-train"])


@_OFFLOAD
@_MODES
def test_an_eval_micro_batch_before_a_train_one_gets_the_gradient_of_what_it_read(
        offloaded: bool, modes: tuple[bool, ...]) -> None:
    # An eval micro-batch's BatchNorm reads the running statistics as they are at its call; a
    # later train micro-batch of the same step changes them before backward. The replay must
    # read them as the forward did (it read the later ones). The reference is eager with the
    # eval micro-batches on clones of the buffers: plain eager's backward reads the later
    # ones (the next test), giving a gradient of no function it computed.
    def body(model: nn.Module) -> Any:
        wrapped = pytree_ckpt.is_checkpointed(model.layers[0])
        return _micro_batches(model, modes, read_clones=not wrapped)

    _against_eager(body, offloaded=offloaded)
    assert _Layer.calls == 2 * 2 * 3 * 3  # steps x micro-batches x layers, twice each


def test_an_eval_micro_batch_reads_what_its_forward_read_when_write_records_are_swept_often(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [forward writes, by id] (forward_writes.py): the records of the buffers forwards
    # changed are swept of dead tensors' once the table reaches a size (1024 records, which
    # these tests never reach). With a sweep as soon as it holds a record, the live buffers'
    # records must stay: the eval micro-batch still replays on what its forward read.
    # An empty table, so that the sweeps start at once whatever earlier tests left there
    # (helper FD's mutant M34, a sweep dropping the live records, passed after other tests:
    # the dead records they left kept the table past its next sweep).
    monkeypatch.setattr(pytree_ckpt.forward_writes, "_WRITES", {})
    monkeypatch.setattr(pytree_ckpt.forward_writes, "_SWEEP_AT", 1)
    monkeypatch.setattr(pytree_ckpt.forward_writes, "_sweep_at", 1)

    def body(model: nn.Module) -> Any:
        wrapped = pytree_ckpt.is_checkpointed(model.layers[0])
        return _micro_batches(model, (False, True, True), steps=1, read_clones=not wrapped)

    _against_eager(body, offloaded=False)


class _CountsWithGrad(nn.Module):
    """Counts its calls where grad is enabled: code written for reentrant checkpointing, whose
    replay is the only pass with grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.seen += 1
        return torch.tanh(self.lin(x))


def test_a_count_only_replays_make_is_kept_over_micro_batches() -> None:
    # A later call's replay changes the buffer before an earlier call's replay: no forward
    # changed it, so the earlier replay counts on the module's own (not on a copy of what its
    # forward read, which would lose its count). Guards NOTE [state read, then changed by a
    # later call].
    seen = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _CountsWithGrad()
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        for step in range(2):
            sum(layer(_batch(i)[:, :4]).sum() for i in range(3)).backward()
        seen.append(layer.seen.item())
    assert seen == [6, 6]


class _CountsAlsoWhenAsked(_CountsWithGrad):
    """Also counts a call asked to without grad: a forward that changes its state itself."""

    def forward(self, x: torch.Tensor, count: bool = False) -> torch.Tensor:
        if count and not torch.is_grad_enabled():
            self.seen += 1
        return super().forward(x)


def test_a_count_only_replays_make_is_kept_after_a_forward_that_counted_itself() -> None:
    # NOTE [state read, then changed by a later call]: the first call's forward changes the
    # buffer (recorded as a forward write); the next two only read it, at the version that
    # write left. The last call's replay counts first; the middle one's replay then finds a
    # version no forward wrote since its read, so it counts on the module's own too.
    seen = []
    for wrap in (False, True):
        torch.manual_seed(0)
        layer = _CountsAlsoWhenAsked()
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        xs = [_batch(i)[:, :4] for i in range(3)]
        (layer(xs[0], count=True).sum() + layer(xs[1]).sum() + layer(xs[2]).sum()).backward()
        seen.append(layer.seen.item())
    assert seen == [3, 3]


@_MODES
def test_eager_itself_reads_the_later_running_statistics_in_an_eval_micro_batchs_backward(
        modes: tuple[bool, ...]) -> None:
    # torch's batch-norm kernel updates the running statistics without moving their version,
    # so an eval-mode call's backward, which reads them, uses the later train micro-batch's
    # update without an error: docs/limits.md says so (the boundary gives the gradient of
    # what was computed instead). If torch changes this, the row and the test above change.
    torch.manual_seed(0)
    plain = _Net()
    clones = copy.deepcopy(plain)
    expected = _micro_batches(clones, modes, steps=1, read_clones=True)
    got = _micro_batches(plain, modes, steps=1)
    _same(expected[0][0][0], got[0][0][0])  # the losses: the forwards read the same
    with pytest.raises(AssertionError, match="differs"):
        _same(expected[0][0][1], got[0][0][1])


@_OFFLOAD
def test_fp16_autocast_with_a_grad_scaler_skips_the_overflowing_step_as_eager(
        offloaded: bool) -> None:
    # Step 1's scale makes the gradients inf (the step is skipped and the scale backs off);
    # step 2 puts the scale back. Gradients are read after unscale_ and both clippings.
    def body(model: nn.Module) -> Any:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        results = []
        for step in range(4):
            if step in (1, 2):
                scaler.update(new_scale=torch.tensor(1e30 if step == 1 else 256.0))
            torch.manual_seed(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(_batch(step))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
            grads = _grads(model)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            results.append((loss.detach(), norm, grads, scaler.get_scale(), _state(model)))
        return results

    results, _ = _against_eager(body, offloaded=offloaded)
    assert [r[1].isfinite().item() for r in results] == [True, False, True, True]
    assert results[1][3] < 1e30  # skipped: the scale backed off


@_OFFLOAD
def test_averaged_models_updated_each_step_then_update_bn_train_as_eager(
        offloaded: bool) -> None:
    # AveragedModel deep-copies the checkpointed model (each copy gets its own boundary);
    # update_bn runs the copy's forward under no_grad with momentum None.
    def body(model: nn.Module) -> Any:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        swa = AveragedModel(model)
        for step in range(3):
            torch.manual_seed(step)
            model(_batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
            swa.update_parameters(model)
        results = []
        for averaged in (ema, swa):
            update_bn([_batch(10), _batch(11)], averaged)
            torch.manual_seed(7)
            loss = averaged(_batch(12))
            loss.backward()
            results.append((loss.detach(), _grads(averaged), _state(averaged)))
        return results, _state(model)

    _, model = _against_eager(body, offloaded=offloaded, in_place=True)
    # Per layer: 3 steps (original pass and replay), update_bn's 2 no-grad batches per averaged
    # model (one call each), and each averaged model's step (two).
    assert _Layer.calls == 3 * (3 * 2 + 2 * 2 + 2 * 2)
    assert pytree_ckpt.is_checkpointed(model.layers[1])


@_OFFLOAD
def test_freezing_layers_schedulers_and_step_hooks_train_as_eager(offloaded: bool) -> None:
    # Micro-batches with a layer frozen between them, a layer frozen for a step and unfrozen,
    # one frozen between a forward and its backward; zero_grad(set_to_none=False), AdamW with
    # a StepLR schedule and a step pre-hook that reads the gradients.
    def body(model: nn.Module) -> Any:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        seen: list[Any] = []
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: seen.append([p.grad.clone() for g in opt.param_groups
                                                   for p in g["params"] if p.grad is not None]))
        results = []
        for step in range(4):
            model.layers[0].requires_grad_(step != 1)
            torch.manual_seed(step)
            first = model(_batch(step))
            if step == 2:
                model.layers[1].lin.requires_grad_(False)  # between micro-batches
            second = model(_batch(step + 10))
            if step == 3:
                model.layers[2].norm.requires_grad_(False)  # between forward and backward
            (first + second).backward()
            model.requires_grad_(True)
            results.append((first.detach(), second.detach(), _grads(model)))
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=False)
        return results, seen, _state(model)

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
def test_state_dicts_loaded_between_steps_resume_as_eager(offloaded: bool) -> None:
    # Keys are the unwrapped model's; a state dict loaded in place, one saved from an unwrapped
    # model, and assign=True (new parameter objects: the old ones get no gradient, the new
    # ones do) between steps.
    torch.manual_seed(5)
    source = _Net()
    saved = source.state_dict()

    def body(model: nn.Module) -> Any:
        assert list(model.state_dict()) == list(source.state_dict())
        start = copy.deepcopy(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        old = list(model.parameters())
        results = []
        for step in range(5):
            if step == 1:
                model.load_state_dict(saved)
            elif step == 2:
                model.load_state_dict(start)
            elif step == 3:
                # its own tensors: assign=True makes them the parameters, which train
                model.load_state_dict({k: v + 0.01 if v.is_floating_point() else v.clone()
                                       for k, v in saved.items()}, assign=True)
                assert not set(map(id, model.parameters())) & set(map(id, old))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(step)
            loss = model(_batch(step))
            loss.backward()
            results.append((loss.detach(), _grads(model)))
            optimizer.step()
            optimizer.zero_grad()
        assert all(p.grad is None for p in old)
        return results, _state(model)

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
def test_dtype_and_device_moves_after_wrapping_train_as_eager(offloaded: bool) -> None:
    # double, bfloat16 and back to float32, then to meta and to_empty with a re-init: a step
    # after each.
    def body(model: nn.Module) -> Any:
        results = []
        for step, dtype in enumerate((torch.float32, torch.float64, torch.bfloat16,
                                      torch.float32, torch.float32)):
            if step == 4:
                model.to("meta")
                model.to_empty(device="cpu")
                torch.manual_seed(3)
                for module in model.modules():
                    if isinstance(module, (nn.Linear, nn.LayerNorm, nn.BatchNorm1d)):
                        module.reset_parameters()
            else:
                model.to(dtype)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(step)
            loss = model(_batch(step, dtype))
            loss.backward()
            results.append((loss.detach(), _grads(model)))
            optimizer.step()
            optimizer.zero_grad()  # to_empty would leave a gradient uninitialised
            results.append(_state(model))
        return results

    _against_eager(body, offloaded=offloaded)


# A torchtune-style recipe: token embeddings, decoder layers (RMSNorm, a gated SiLU MLP,
# dropout, a residual) each checkpointed, a final norm and a cross-entropy loss; gradient
# accumulation over micro-batches, clip_grad_norm_, AdamW, an eval pass between steps, and a
# resume from the model's and the optimizer's state dicts, in fp32 and under CPU bf16
# autocast. The global RNG is seeded once per run, as a recipe does: dropout draws must
# follow eager's from step to step.

class _DecoderLayer(nn.Module):
    calls = 0  # forward calls of every _DecoderLayer: the original pass and the replay count

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.gate = nn.Linear(16, 32, bias=False)
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        x = self.norm(h)
        return h + self.drop(self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


class _Decoder(nn.Module):
    """With ``call_checkpoint``, its forward calls ``pytree_ckpt.checkpoint(layer, h)`` (the
    function form); otherwise its layers are called as they are (eager, or wrapped in place)."""

    def __init__(self, call_checkpoint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_DecoderLayer() for _ in range(3))
        self.norm = nn.RMSNorm(16)
        self.output = nn.Linear(16, 32, bias=False)
        self.call_checkpoint = call_checkpoint

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = pytree_ckpt.checkpoint(layer, h) if self.call_checkpoint else layer(h)
        return self.output(self.norm(h))


def _decoders(wrapping: str) -> tuple[_Decoder, _Decoder]:
    """An eager decoder and its twin checkpointed per layer: in place with torchtune's
    ``check_fn`` (``"apply"``) or through ``checkpoint`` in its forward (``"checkpoint"``)."""
    torch.manual_seed(0)
    eager = _Decoder()
    model = copy.deepcopy(eager)
    if wrapping == "apply":
        pytree_ckpt.apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, _DecoderLayer))
        assert all(pytree_ckpt.is_checkpointed(layer) for layer in model.layers)
    else:
        model.call_checkpoint = True
    return eager, model


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch: input tokens and the next-token labels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _recipe_steps(model: _Decoder, optimizer: torch.optim.Optimizer, steps: range,
                  dtype: torch.dtype) -> list[Any]:
    """torchtune's loop: per step, 3 micro-batches each scaled by 1/3 and backward at once
    (gradients accumulate), clip_grad_norm_, an AdamW step, then an eval pass under no_grad
    and one under inference_mode. Returns per step the losses, the total norm, the clipped
    gradients, the parameters after the step and the eval logits."""
    results = []
    for step in steps:
        model.train()
        losses = []
        for micro in range(3):
            tokens, labels = _tokens(100 * step + micro)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                   labels.flatten()) / 3
            loss.backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        evals = []
        for mode in (torch.no_grad, torch.inference_mode):
            with mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                evals.append(model(_tokens(999)[0]).clone())
        results.append((losses, norm, grads, _state(model), evals))
    model.train()
    return results


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@_DTYPES
@pytest.mark.parametrize("wrapping", ["apply", "checkpoint"])
def test_a_torchtune_style_loop_with_accumulation_clipping_and_eval_passes_trains_as_eager(
        dtype: torch.dtype, wrapping: str) -> None:
    # Guards against: a checkpointed recipe drifting from eager over steps: gradients that
    # accumulate over micro-batches other than eager's (a replay that reads .grad or adds
    # into it), dropout draws that fall out of step with eager's (the original pass and the
    # replay advancing the global generator other than eager's one forward), an eval pass
    # under no_grad or inference_mode that builds a boundary, replays or changes state, and
    # bf16 autocast's casts in the replay other than the forward's.
    eager, model = _decoders(wrapping)
    torch.manual_seed(1)
    expected = _recipe_steps(eager, _adamw(eager), range(3), dtype)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(1)
    _DecoderLayer.calls = 0
    got = _recipe_steps(model, _adamw(model), range(3), dtype)
    _same(expected, got)
    # 3 layers x 3 steps: 3 micro-batches, each an original pass and a replay, and the two
    # eval passes, one call each (no boundary without grad).
    assert _DecoderLayer.calls == 3 * 3 * (3 * 2 + 2)
    assert torch.equal(torch.get_rng_state(), expected_rng)  # the same draws, in number too
    assert all(r[1] > 0.5 for r in got)  # the clipping changed the gradients at every step
    assert got[0][4][0].dtype == dtype  # the eval pass ran under autocast


@_DTYPES
def test_a_recipe_resumed_from_model_and_optimizer_state_dicts_continues_as_eager(
        dtype: torch.dtype) -> None:
    # Guards against: a resume that differs from the run it continues: the checkpointed
    # model's state dict (keys or values) not the unwrapped model's, AdamW's state (its step
    # counts and moments) not carrying over to a fresh checkpointed model's parameters, or a
    # fresh model's first calls (its first replays, with their checks) computing otherwise.
    eager, model = _decoders("apply")
    torch.manual_seed(1)
    expected = _recipe_steps(eager, _adamw(eager), range(4), dtype)

    torch.manual_seed(1)
    optimizer = _adamw(model)
    first = _recipe_steps(model, optimizer, range(2), dtype)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "rng": torch.get_rng_state()})
    assert list(saved["model"]) == list(eager.state_dict())
    del model, optimizer
    torch.manual_seed(2)  # a fresh process: other initial values, replaced by the load
    resumed = _Decoder()
    pytree_ckpt.apply_activation_checkpointing(
        resumed, check_fn=lambda m: isinstance(m, _DecoderLayer))
    resumed_optimizer = _adamw(resumed)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    rest = _recipe_steps(resumed, resumed_optimizer, range(2, 4), dtype)
    _same(expected, first + rest)
    assert resumed_optimizer.state_dict()["state"][0]["step"].item() == 4


@_OFFLOAD
def test_model_surgery_between_steps_trains_as_eager(offloaded: bool) -> None:
    # Helper QT: progressive depth growth (a trained layer duplicated with deepcopy, a new one
    # inserted in front and wrapped), a layer dropped, the layers reordered, a submodule
    # swapped (layer.lin = new), a parametrization added and removed, weight tying set up
    # after wrapping, checkpointing removed and re-applied with a lower then a higher ratio,
    # a dropout p and per-layer eval() changed mid-run, gradual unfreezing, and the optimizer
    # rebuilt after each surgery: the twin undergoes the same surgery.
    from torch.nn.utils import parametrize

    class Half(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    def body(model: nn.Module) -> Any:
        ours = pytree_ckpt.is_checkpointed(model.layers[0])
        manager = model.layers[0].forward.options.offload if ours else None

        def wrap(layer: nn.Module) -> None:
            if ours:
                pytree_ckpt.apply_activation_checkpointing(layer, offload=manager or False)

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model.requires_grad_(False)
        model.head.requires_grad_(True)
        results = []
        for step in range(9):
            rebuilt = True
            if step == 1:
                model.layers.append(copy.deepcopy(model.layers[1]))  # a wrapped layer's copy
                torch.manual_seed(5)
                model.layers.insert(0, _Layer())
                wrap(model.layers[0])
            elif step == 2:
                del model.layers[2]
                model.layers = nn.ModuleList(list(model.layers)[::-1])
            elif step == 3:
                torch.manual_seed(6)
                model.layers[1].lin = nn.Linear(8, 8)
                parametrize.register_parametrization(model.layers[2].lin, "weight", Half())
            elif step == 4:
                model.layers[0].lin.weight = model.layers[3].lin.weight  # tied after wrapping
                parametrize.remove_parametrizations(model.layers[2].lin, "weight")
            elif step == 5:
                if ours:
                    pytree_ckpt.remove_activation_checkpointing(model.layers)
                    pytree_ckpt.checkpoint_layers(model.layers, ratio=0.5,
                                                  offload=manager or False)
            elif step == 6:
                if ours:
                    pytree_ckpt.checkpoint_layers(model.layers, ratio=1.0,
                                                  offload=manager or False)
                model.layers[1].drop.p = 0.5
                model.layers[2].eval()
            else:
                rebuilt = False
            model.layers[len(model.layers) - 1 - step % len(model.layers)].requires_grad_(True)
            if rebuilt:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            torch.manual_seed(step)
            loss = model(_batch(step))
            loss.backward()
            results.append((loss.detach(), _grads(model)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return results, _state(model)

    _, model = _against_eager(body, offloaded=offloaded)
    assert all(pytree_ckpt.is_checkpointed(layer) for layer in model.layers)
