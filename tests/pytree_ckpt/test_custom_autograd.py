"""A kernel author's custom autograd code (flash-attn, Liger, xformers, apex and Megatron style)
inside checkpointed layers: `torch.autograd.Function` with `mark_dirty`,
`mark_non_differentiable`, `once_differentiable`, `set_materialize_grads(False)`,
`needs_input_grad`, outputs saved, views of inputs returned, state and an RNG seed on `ctx`,
`setup_context` with `generate_vmap_rule`; and `torch.library.custom_op` with `register_autograd`
and `mutates_args`, kept by `KeptOps` by its qualified name. Each against an eager twin, bit for
bit over several steps, with the Functions' call counts (helper QP)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable

import offload
import pytree_ckpt
from pytree_ckpt import (CheckpointError, CheckpointWithoutOutput, KeptCallables, KeptOps,
                         RecomputeConfig, SaveUnit, apply_recompute_config,
                         reuse_during_recompute)

CALLS: dict[str, int] = {}


def _bump(key: str) -> None:
    CALLS[key] = CALLS.get(key, 0) + 1


class _InPlaceBiasGelu(torch.autograd.Function):
    """A fused bias + sigmoid-GELU written into its input (`mark_dirty`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _bump("gelu_f")
        ctx.save_for_backward(x.detach().clone(), b)
        y = x.add_(b)
        y.mul_(torch.sigmoid(1.702 * y.clone()))
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _bump("gelu_b")
        x, b = ctx.saved_tensors
        z = x + b
        s = torch.sigmoid(1.702 * z)
        gz = g * (s + z * 1.702 * s * (1 - s))
        return gz, gz.sum(0)


class _SoftmaxLse(torch.autograd.Function):
    """Softmax saving its output, with the LSE and the argmax ids non-differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _bump("sm_f")
        lse = torch.logsumexp(x, -1, keepdim=True)
        out = torch.exp(x - lse)
        ids = out.argmax(-1)
        ctx.mark_non_differentiable(ids, lse)
        ctx.save_for_backward(out)
        return out, lse, ids

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor, _lse: Any, _ids: Any) -> torch.Tensor:
        _bump("sm_b")
        (out,) = ctx.saved_tensors
        return out * (g - (g * out).sum(-1, keepdim=True))


class _TwoOut(torch.autograd.Function):
    """Two outputs, grads not materialised (None for an unused one), `needs_input_grad`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _bump("two_f")
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        return x @ w, (x * 2).sum(-1)

    @staticmethod
    def backward(ctx: Any, ga: Any, gb: Any) -> tuple[Any, Any]:
        _bump("two_b")
        x, w = ctx.saved_tensors
        gx = gw = None
        if ga is not None:
            if ctx.needs_input_grad[0]:
                gx = ga @ w.t()
            if ctx.needs_input_grad[1]:
                gw = x.t() @ ga
            else:
                _bump("two_frozen")
        if gb is not None:
            _bump("two_gb")
            t = gb.unsqueeze(-1).expand_as(x) * 2
            gx = t if gx is None else gx + t
        return gx, gw


class _ViewOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(-1), x[:, :2]

    @staticmethod
    def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        g = g1.view(-1, 8).clone()
        g[:, :2] += g2
        return g


class _SeededDropout(torch.autograd.Function):
    """Draws its seed in forward, keeps it on ctx, redraws the mask in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        _bump("drop_f")
        ctx.seed, ctx.p = int(torch.randint(0, 2**31, ()).item()), p
        g = torch.Generator().manual_seed(ctx.seed)
        return x * (torch.rand(x.shape, generator=g) > p).to(x.dtype) / (1 - p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        gen = torch.Generator().manual_seed(ctx.seed)
        return g * (torch.rand(g.shape, generator=gen) > ctx.p).to(g.dtype) / (1 - ctx.p), None


class _NewStyle(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _bump("ns_f")
        return torch.tanh(x * w)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(output, *inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, x, w = ctx.saved_tensors
        d = g * (1 - out * out)
        return d * w, (d * x).sum(0)


@torch.library.custom_op("pytree_ckpt_qp::update_stat", mutates_args=("running",))
def _update_stat(x: torch.Tensor, running: torch.Tensor) -> None:
    _bump("stat_f")
    running.mul_(0.9).add_(x.mean(0) * 0.1)


@torch.library.custom_op("pytree_ckpt_qp::scaled", mutates_args=())
def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _bump("cop_f")
    return x * w


@_scaled.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_setup(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _scaled_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _bump("cop_b")
    x, w = ctx.saved_tensors
    return g * w, (g * x).sum(0)


_scaled.register_autograd(_scaled_backward, setup_context=_scaled_setup)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.randn(8) * 0.1)
        self.w2 = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.frozen = nn.Parameter(torch.randn(8, 8) * 0.3, requires_grad=False)
        self.v = nn.Parameter(torch.randn(8))
        self.register_buffer("running", torch.zeros(8))

    def core(self, h: torch.Tensor) -> torch.Tensor:
        _update_stat(h.detach(), self.running)
        return _scaled(h, self.v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _InPlaceBiasGelu.apply(self.lin(x), self.b)
        p, lse, ids = _SoftmaxLse.apply(h)
        a, s = _TwoOut.apply(p, self.w2)
        c, _unused = _TwoOut.apply(a, self.frozen)
        flat, v2 = _ViewOut.apply(c)
        n = _NewStyle.apply(_SeededDropout.apply(c, 0.25), self.v)
        return (self.core(n) + x + lse * 0.1 + ids.unsqueeze(-1).float() * 0.01
                + s.unsqueeze(-1) * 0.1 + v2.sum() * 0.01 + flat.sum() * 0.001)


def _steps_alike(wrap: Any, steps: int = 3) -> list[dict[str, int]]:
    """Eager and wrapped twins (two blocks, SGD) over ``steps`` steps: loss, every gradient and
    buffer equal bit for bit at each step; the last step's call counts of each."""
    torch.manual_seed(0)
    eager = nn.Sequential(_Block(), _Block())
    ours = copy.deepcopy(eager)
    wrap(ours)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)]
    counts: list[dict[str, int]] = []
    for step in range(steps):
        x = torch.randn(4, 8)
        taken = []
        counts = []
        for model, optim in zip((eager, ours), optims):
            CALLS.clear()
            torch.manual_seed(100 + step)
            xx = x.clone().requires_grad_()
            loss = model(xx).square().sum()
            loss.backward()
            taken.append([loss.detach(), xx.grad,
                          *[p.grad.clone() for p in model.parameters() if p.grad is not None],
                          *[b.clone() for b in model.buffers()], torch.rand(2)])
            counts.append(dict(CALLS))
            optim.step()
            optim.zero_grad()
        assert len(taken[0]) == len(taken[1]), step
        assert all(torch.equal(a, b) for a, b in zip(*taken)), step
    return counts


def _manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


def test_a_layer_of_custom_autograd_functions_gives_eager_numbers_and_runs_each_backward_once(
) -> None:
    eager, ours = _steps_alike(lambda m: [pytree_ckpt.apply_activation_checkpointing(layer)
                                          for layer in m])
    backward = {k: v for k, v in ours.items() if k.endswith(("_b", "_gb", "_frozen"))}
    assert backward == {k: v for k, v in eager.items() if k.endswith(("_b", "_gb", "_frozen"))}
    # the original pass and the replay: twice eager's forwards, as torch's reentrant checkpoint
    assert all(ours[k] == 2 * eager[k] for k in ("gelu_f", "sm_f", "two_f", "cop_f", "stat_f"))


def test_a_layer_of_custom_autograd_functions_with_offload_gives_eager_numbers() -> None:
    manager = _manager()
    _steps_alike(lambda m: [pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
                            for layer in m])


@pytest.mark.parametrize("op", ["pytree_ckpt_qp::scaled", _scaled], ids=["name", "custom_op"])
def test_a_custom_op_kept_by_its_qualified_name_runs_once_and_gives_eager_numbers(op: Any) -> None:
    # By name, or by the object @torch.library.custom_op returns (helper QP: it was refused).
    assert KeptOps(op, "aten::addmm").op_names == ("pytree_ckpt_qp::scaled", "aten::addmm")
    eager, ours = _steps_alike(lambda m: apply_recompute_config(
        list(m), RecomputeConfig(1.0, save=["attn"]),
        {SaveUnit.ATTN: KeptOps(op, "aten::addmm")}, offload=_manager()))
    assert ours["cop_f"] == eager["cop_f"] and ours["cop_b"] == eager["cop_b"]
    assert ours["stat_f"] == 2 * eager["stat_f"]   # the mutating op reruns; its buffer is eager's


def test_a_kept_method_calling_a_mutating_custom_op_gives_eager_statistics() -> None:
    eager, ours = _steps_alike(lambda m: apply_recompute_config(
        list(m), RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: KeptCallables("_Block.core")}))
    assert ours["cop_f"] == eager["cop_f"]


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _TwoOut.apply(x, self.w)


def test_an_unused_output_of_a_function_that_does_not_materialize_grads_gets_none_as_in_eager(
) -> None:
    got = []
    for wrap in (lambda m: m, pytree_ckpt.apply_activation_checkpointing):
        torch.manual_seed(0)
        layer = wrap(_Unused())
        x = torch.randn(4, 8, requires_grad=True)
        CALLS.clear()
        layer(x)[0].sum().backward()
        got.append((dict(CALLS).get("two_gb", 0), x.grad, layer.w.grad))
    assert got[0][0] == got[1][0] == 0     # torch's reentrant checkpoint hands zeros instead
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][2], got[1][2])


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float) -> torch.Tensor:
        ctx.s = s
        return x            # its input as is (a gradient-reversal layer)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.s, None


class _Reversal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.lin(x), _GradScale.apply(x, -0.5),
                self.lin(x) + _GradScale.apply(self.lin.weight, 3.0).sum())


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_function_returning_its_input_as_is_keeps_its_backward_at_the_boundary(
        offloaded: bool) -> None:
    got = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        layer, pre = _Reversal(), nn.Linear(8, 8)
        if checkpointed:
            pytree_ckpt.apply_activation_checkpointing(
                layer, offload=_manager() if offloaded else None)
        x = torch.randn(4, 8, requires_grad=True)
        outs = layer(pre(x))
        sum((o * (i + 1)).square().sum() for i, o in enumerate(outs)).backward()
        got.append([x.grad, *[p.grad for p in (*layer.parameters(), *pre.parameters())]])
    assert all(torch.equal(a, b) for a, b in zip(*got))


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        _bump("topk_f")
        v, i = s.topk(k, -1)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(i)
        ctx.n = s.shape[-1]
        return v, i

    @staticmethod
    def backward(ctx: Any, gv: torch.Tensor, _gi: Any) -> tuple[torch.Tensor, None]:
        (i,) = ctx.saved_tensors
        return gv.new_zeros(*gv.shape[:-1], ctx.n).scatter(-1, i, gv), None


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.lin(x)
        _v, i = reuse_during_recompute(_TopK.apply, s.detach(), 3)
        return x + torch.zeros_like(x).scatter(-1, i, s.gather(-1, i))


def test_a_functions_apply_reused_during_recompute_runs_once_with_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = _Routed()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    for _step in range(2):
        x = torch.randn(4, 8)
        grads = []
        for model in (eager, ours):
            CALLS.clear()
            model(x).square().sum().backward()
            assert CALLS == {"topk_f": 1}
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("op", ["softmax_lse", "two_out", "seeded_dropout", "new_style",
                                "in_place"])
def test_a_custom_function_under_output_discard_gives_eager_gradients(op: str) -> None:
    torch.manual_seed(0)
    lin, proj = nn.Linear(8, 8), nn.Linear(8, 8)
    w, b = nn.Parameter(torch.randn(8, 8) * 0.3), nn.Parameter(torch.randn(8) * 0.1)
    ops = {"softmax_lse": lambda h: _SoftmaxLse.apply(h)[0],
           "two_out": lambda h: _TwoOut.apply(h, w)[0],
           "seeded_dropout": lambda h: _SeededDropout.apply(h, 0.3),
           "new_style": lambda h: _NewStyle.apply(h, b),
           "in_place": lambda h: _InPlaceBiasGelu.apply(h.clone(), b)}
    got = []
    for discard in (False, True):
        torch.manual_seed(5)
        for p in (*lin.parameters(), *proj.parameters(), w, b):
            p.grad = None
        x = torch.randn(4, 8, requires_grad=True)
        h = lin(x)
        if discard:
            ckpt = CheckpointWithoutOutput()
            y = ckpt.checkpoint(ops[op], h)
            out, side = proj(y), y.sum() * 0.3           # every reader before the discard
            ckpt.discard_output_and_register_recompute(out)
        else:
            y = ops[op](h)
            out, side = proj(y), y.sum() * 0.3
        (out.square().sum() + side).backward()
        got.append([t.grad if t.grad is not None else torch.zeros(())
                    for t in (x, *lin.parameters(), *proj.parameters(), w, b)])
    assert all(torch.equal(a, c) for a, c in zip(*got))


class _AmaxScaled(torch.autograd.Function):
    """FP8-style delayed scaling: an amax buffer written in forward, another (and a history)
    written in backward through ctx, a Python scale on ctx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fwd_amax: torch.Tensor,
                bwd_amax: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        fwd_amax.copy_(torch.maximum(fwd_amax, x.abs().max()))
        ctx.bwd_amax, ctx.history = bwd_amax, history
        ctx.save_for_backward(x, w)
        ctx.scale = float(fwd_amax)
        return (x @ w) / ctx.scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        ctx.bwd_amax.copy_(torch.maximum(ctx.bwd_amax, g.abs().max()))
        ctx.history[:-1] = ctx.history[1:].clone()
        ctx.history[-1] = g.abs().max()
        g = g / ctx.scale
        return g @ w.t(), x.t() @ g, None, None, None


class _Fp8Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.register_buffer("fwd_amax", torch.ones(()))
        self.register_buffer("bwd_amax", torch.zeros(()))
        self.register_buffer("history", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_AmaxScaled.apply(x, self.w, self.fwd_amax, self.bwd_amax,
                                            self.history)) + x


@pytest.mark.parametrize("offloaded", [False, True])
def test_amax_buffers_a_function_writes_in_forward_and_backward_end_micro_batches_as_eager(
        offloaded: bool) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_Fp8Linear(), _Fp8Linear())
    ours = copy.deepcopy(eager)
    manager = _manager() if offloaded else None
    for layer in ours:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    for step in range(3):
        xs = [torch.randn(4, 8) * (i + 1 + step) for i in range(2)]
        for model in (eager, ours):
            sum(model(x.clone().requires_grad_()).square().sum() for x in xs).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), ours.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(eager.buffers(), ours.buffers()))
        eager.zero_grad()
        ours.zero_grad()


class _StatOnInput(nn.Module):
    """A kernel that writes a running statistic the caller passes in (`mutates_args`)."""

    def __init__(self, clone: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.clone = clone

    def forward(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        _update_stat(h.detach(), stats.clone() if self.clone else stats)
        return h * 2


def test_a_statistic_passed_in_and_written_by_a_custom_op_is_refused_with_a_tip_that_keeps_eagers_statistic(
) -> None:
    # The refusal's tip once said only to clone the input inside the layer, which drops the
    # update eager makes to the caller's tensor (helper QP). It now says to keep such a tensor
    # as a buffer of the layer: followed, the statistic and the gradients are eager's.
    torch.manual_seed(0)
    eager = _StatOnInput()
    eager_stats = torch.zeros(8)
    x = torch.randn(4, 8, requires_grad=True)
    eager(x, eager_stats).sum().backward()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    with pytest.raises(CheckpointError, match="changed its input args\\[1\\] in place") as refused:
        ours(x, torch.zeros(8))
    assert "keep that tensor as a buffer of the layer" in str(refused.value)

    class StatAsBuffer(_StatOnInput):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("stats", torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x, self.stats)

    followed = StatAsBuffer()
    followed.lin.load_state_dict(eager.lin.state_dict())
    pytree_ckpt.apply_activation_checkpointing(followed)
    x2 = x.detach().clone().requires_grad_()
    followed(x2).sum().backward()
    assert torch.equal(followed.stats, eager_stats)
    assert torch.equal(x2.grad, x.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(),
                                                          followed.parameters()))


class _LseWhenNeeded(torch.autograd.Function):
    """Attention that computes and saves its LSE only `if any(ctx.needs_input_grad)` (a cheaper
    softmax otherwise), as memory-efficient kernels do: a branch on grad mode, which the
    original pass runs without."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = q @ k.t()
        if any(ctx.needs_input_grad):
            lse = torch.logsumexp(s, -1, keepdim=True)
            ctx.save_for_backward(q, k, lse)
            return torch.exp(s - lse) @ k
        return s.softmax(-1) @ k

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        q, k, lse = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
            return torch.autograd.grad(torch.exp(qq @ kk.t() - lse) @ kk, (qq, kk), g)


class _LseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        return _LseWhenNeeded.apply(self.q(x), self.k(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


def test_a_function_branching_on_needs_input_grad_is_found_by_verify_replay_and_refused_by_save_units(
) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8, requires_grad=True)
    checked = pytree_ckpt.apply_activation_checkpointing(_LseLayer(), verify_replay=True)
    with pytest.raises(pytree_ckpt.ReplayMismatchError, match="kernel chosen by grad mode"):
        checked(x).square().sum().backward()
    kept = _LseLayer()
    apply_recompute_config([kept], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_LseLayer.attn")})
    with pytest.raises(pytree_ckpt.ReuseError, match="branches on grad mode"):
        kept(x).square().sum().backward()


_OWNER: list[nn.Module] = []


class _AmaxThroughModule(torch.autograd.Function):
    """The tip of limits.md's row on a Function updating a buffer in backward: through the
    module (`ctx.module.amax`), not a captured tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        module = _OWNER[-1]
        module.amax.copy_(torch.maximum(module.amax, x.abs().max()))
        ctx.module = module
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        ctx.module.amax.add_(g.abs().max())
        return g @ w.t(), x.t() @ g


class _AmaxLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.register_buffer("amax", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _OWNER.append(self)
        try:
            return _AmaxThroughModule.apply(x, self.w) + x
        finally:
            _OWNER.pop()


def test_a_buffer_a_function_updates_in_backward_through_its_module_ends_as_eager() -> None:
    torch.manual_seed(0)
    eager = _AmaxLayer()
    ours = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    for _step in range(2):
        x = torch.randn(4, 8)
        for model in (eager, ours):
            model(x.clone().requires_grad_()).sum().backward()
        assert torch.equal(eager.amax, ours.amax) and torch.equal(eager.w.grad, ours.w.grad)


class _LinearIntoMainGrad(torch.autograd.Function):
    """Megatron's gradient_accumulation_fusion: backward adds the weight's gradient into
    `weight.main_grad` and returns None for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(g.t() @ x)
        weight.grad_added_to_main_grad = True
        return g @ weight, None


class _FusedAccumulation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_LinearIntoMainGrad.apply(x, self.weight)) + x


@pytest.mark.parametrize("offloaded", [False, True])
def test_gradient_accumulation_fused_into_main_grad_gives_eagers_main_grad_over_micro_batches(
        offloaded: bool) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_FusedAccumulation(), _FusedAccumulation())
    ours = copy.deepcopy(eager)
    for model in (eager, ours):
        for p in model.parameters():
            p.main_grad = torch.zeros(8, 8)            # type: ignore[attr-defined]
            p.grad_added_to_main_grad = False          # type: ignore[attr-defined]
    manager = _manager() if offloaded else None
    for layer in ours:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager)
    for _micro in range(3):
        x = torch.randn(4, 8)
        for model in (eager, ours):
            model(x.clone().requires_grad_()).square().sum().backward()
    for a, b in zip(eager.parameters(), ours.parameters()):
        assert torch.equal(a.main_grad, b.main_grad)   # type: ignore[attr-defined]
        assert a.grad is None and b.grad is None and b.grad_added_to_main_grad  # type: ignore[attr-defined]


class _GradsInForward(torch.autograd.Function):
    """Liger's fused linear cross entropy: the gradients are taken in forward, chunk by chunk
    (`torch.autograd.grad` under its own `enable_grad`), and backward only scales them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        gx, gw, total = torch.zeros_like(x), torch.zeros_like(w), x.new_zeros(())
        for i in range(0, x.shape[0], 2):
            with torch.enable_grad():
                xc, wc = x[i:i + 2].detach().requires_grad_(), w.detach().requires_grad_()
                loss = nn.functional.cross_entropy(xc @ wc.t(), target[i:i + 2], reduction="sum")
                a, b = torch.autograd.grad(loss, (xc, wc))
            gx[i:i + 2] = a
            gw += b
            total += loss.detach()
        ctx.save_for_backward(gx, gw)
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gx, gw = ctx.saved_tensors
        return gx * g, gw * g, None


class _WithFusedLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Parameter(torch.randn(5, 8) * 0.3)

    def loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _GradsInForward.apply(h, self.head, target)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        return x + h, self.loss(h, target)


@pytest.mark.parametrize("kept", [False, True])
def test_gradients_a_function_takes_in_its_forward_are_eagers_under_the_boundary(
        kept: bool) -> None:
    torch.manual_seed(0)
    eager = _WithFusedLoss()
    ours = copy.deepcopy(eager)
    if kept:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # its in-place writes: recomputed, warned
            apply_recompute_config([ours], RecomputeConfig(1.0, save=["attn"]),
                                   {SaveUnit.ATTN: KeptCallables("_WithFusedLoss.loss")})
    else:
        pytree_ckpt.apply_activation_checkpointing(ours, verify_replay=True)
    for _step in range(2):
        x, target = torch.randn(6, 8), torch.randint(0, 5, (6,))
        taken = []
        for model in (eager, ours):
            xx = x.clone().requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, loss = model(xx, target)
                (out.square().sum() + 0.5 * loss).backward()
            taken.append([loss.detach(), xx.grad, *[p.grad.clone() for p in model.parameters()]])
            model.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(*taken))


def test_a_running_statistic_passed_in_and_changed_in_place_kept_as_a_buffer_per_the_tip_gives_eager(
        ) -> None:
    class Passed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            stat.add_(h.detach().mean(0))
            return torch.tanh(h) * stat.sum()

    class Kept(nn.Module):  # the tip: the statistic as a buffer of the layer
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("stat", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            self.stat.add_(h.detach().mean(0))
            return torch.tanh(h) * self.stat.sum()

    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(CheckpointError, match="keep that tensor as a buffer of the layer"):
        pytree_ckpt.checkpoint(Passed(), x, torch.zeros(4))
    eager = Kept()
    ckpt = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ckpt)
    xe, xc = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    for _ in range(2):
        eager(xe).sum().backward()
        ckpt(xc).sum().backward()
    assert torch.equal(eager.stat, ckpt.stat)
    assert torch.equal(xe.grad, xc.grad)
    assert torch.equal(eager.lin.weight.grad, ckpt.lin.weight.grad)
    assert torch.equal(eager.lin.bias.grad, ckpt.lin.bias.grad)


def test_a_mutating_custom_op_named_in_kept_ops_warns_with_a_tip_that_fits_an_op_of_ones_own(
        ) -> None:
    # aten's tip names its functional twin (aten::addmm for aten::addmm_); an op of one's own
    # has none (helper QP): the tip says to split the change from the result.
    with pytest.warns(UserWarning, match="keeps nothing: in-place and out= ops are never kept") \
            as caught:
        kept = KeptOps(_update_stat, "aten::mm").resolve()
    assert kept == [torch.ops.aten.mm]
    message = str(caught[0].message)
    assert "split the change into an op of its own" in message and "aten::addmm" not in message
