"""Scientific-ML patterns through checkpointed layers, each against its eager twin bit for bit
(helper NW): physics-informed losses (input derivatives taken inside a layer, and the refusal of
create_graph through a boundary), torch.func transforms over and inside wrapped layers,
forward-mode AD, batched backward, Fourier-operator layers with complex weights (cfloat and
cdouble, offloaded and verified), torch.linalg ops and cdist in float64, and a conj-bit complex
input offloaded and restored."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import CheckpointError


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(2 if i == 0 else 16, 16), nn.Tanh())
                           for i in range(3)), nn.Linear(16, 1)).to(dtype)


def _wrapped_mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    m = _mlp(dtype)
    for layer in list(m)[:3]:
        pytree_ckpt.apply_activation_checkpointing(layer)
    return m


def _manager() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


def _train_twins(make: Callable[[], nn.Module], inputs: list[torch.Tensor],
                 loss: Callable[..., torch.Tensor], **options: Any) -> None:
    torch.manual_seed(0)
    eager = make()
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(twin, **options)
    got = []
    for m in (eager, twin):
        ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        value = loss(m, *ins)
        value.backward()
        got.append((value.detach(), _grads(m), [t.grad for t in ins]))
    assert torch.equal(got[0][0], got[1][0])
    assert _same(got[0][1], got[1][1])
    assert _same(got[0][2], got[1][2])


def test_create_graph_through_a_boundary_for_a_pinn_loss_is_refused_naming_create_graph() -> None:
    model = _wrapped_mlp()
    x = torch.randn(8, 2, requires_grad=True)
    u = model(x)
    with pytest.raises(CheckpointError, match="create_graph=True"):
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        du.pow(2).sum().backward()
    assert str(pytree_ckpt.current_phase()) == "plain"


class _Residual(nn.Module):
    """A PINN residual layer: the Laplacian of its own network, by autograd.grad inside."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            xi = x if x.requires_grad else x.detach().requires_grad_()
            u = self.net(xi)
            g = torch.autograd.grad(u.sum(), xi, create_graph=True)[0]
            lap = sum(torch.autograd.grad(g[:, i].sum(), xi, create_graph=True)[0][:, i]
                      for i in range(2))
        return lap - torch.sin(xi).prod(-1)


@pytest.mark.parametrize("x_grad", [False, True])
def test_a_pinn_residual_layer_taking_input_derivatives_inside_gives_eager_gradients(
        x_grad: bool) -> None:
    _train_twins(_Residual, [torch.randn(16, 2, requires_grad=x_grad)],
                 lambda m, x: m(x).pow(2).mean())


class _Forces(nn.Module):
    """Energy and forces by torch.func (vmap of grad, jacrev, hessian) inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())

        def energy(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.net, p, (xi,)).sum()

        forces = -torch.func.vmap(torch.func.grad(energy, argnums=1), in_dims=(None, 0))(params, x)
        jac = torch.func.vmap(torch.func.jacrev(self.net))(x)
        hess = torch.func.vmap(torch.func.hessian(lambda z: self.net(z).sum()))(x)
        return self.net(x).squeeze(-1) + forces.pow(2).sum(-1) + jac.sum((1, 2)) \
            + hess.diagonal(dim1=-2, dim2=-1).sum(-1)


@pytest.mark.parametrize("options", [{}, {"verify_replay": True}], ids=["plain", "verified"])
def test_torch_func_transforms_inside_a_checkpointed_layer_give_eager_gradients(
        options: dict[str, Any]) -> None:
    _train_twins(_Forces, [torch.randn(5, 3, requires_grad=True)], lambda m, x: m(x).pow(2).sum(),
                 **options)


def test_per_sample_gradients_and_jacobians_over_a_wrapped_model_are_eagers() -> None:
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    got = []
    for m in (_mlp(), _wrapped_mlp()):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor,
                 m: nn.Module = m) -> torch.Tensor:
            return (torch.func.functional_call(m, p, (xi[None],)) - yi).pow(2).sum()

        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        ntk = torch.func.jacrev(lambda p, m=m: torch.func.functional_call(m, p, (x,)))(params)
        jacfwd = torch.func.jacfwd(m)(x)
        got.append((per_sample, ntk, jacfwd))
    for k in got[0][0]:
        assert torch.equal(got[0][0][k], got[1][0][k])
        assert torch.equal(got[0][1][k], got[1][1][k])
    assert torch.equal(got[0][2], got[1][2])
    assert str(pytree_ckpt.current_phase()) == "plain"


def test_forward_mode_tangents_and_a_loss_on_them_through_wrapped_layers_are_eagers() -> None:
    x, t = torch.randn(8, 2), torch.randn(8, 2)
    got = []
    for m in (_mlp(), _wrapped_mlp()):
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(m(fwAD.make_dual(x, t)))
            loss = primal.sum() + tangent.pow(2).sum()
        loss.backward()
        got.append((tangent.detach(), loss.detach(), _grads(m)))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert _same(got[0][2], got[1][2])


class _Spectral(nn.Module):
    """A Fourier neural operator layer: rfftn, complex einsum on the low modes, irfftn."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        real = torch.float64 if dtype == torch.cdouble else torch.float32
        self.w = nn.Parameter(torch.randn(4, 4, 4, 4, dtype=dtype) * 0.1)
        self.lin = nn.Linear(4, 4, dtype=real)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = torch.fft.rfftn(x, dim=(-2, -1))
        out = torch.zeros_like(xf)
        out[..., :4, :4] = torch.einsum("bixy,ioxy->boxy", xf[..., :4, :4], self.w)
        y = torch.fft.irfftn(out, s=x.shape[-2:], dim=(-2, -1))
        return nn.functional.gelu(y + self.lin(x.movedim(1, -1)).movedim(-1, 1))


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.cdouble])
def test_a_fourier_operator_with_complex_weights_offloaded_and_verified_gives_eager_gradients(
        dtype: torch.dtype) -> None:
    real = torch.float64 if dtype == torch.cdouble else torch.float32
    _train_twins(lambda: nn.Sequential(*(_Spectral(dtype) for _ in range(2))),
                 [torch.randn(2, 4, 8, 8, dtype=real, requires_grad=True)],
                 lambda m, x: m(x).pow(2).sum())
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Spectral(dtype) for _ in range(2)))
    twin = copy.deepcopy(eager)
    manager = _manager()
    for layer in twin:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=manager, verify_replay=True)
    x = torch.randn(2, 4, 8, 8, dtype=real, requires_grad=True)
    got = []
    for m in (eager, twin):
        m(x).pow(2).sum().backward()
        got.append((_grads(m), x.grad))
        x.grad = None
    assert _same(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert manager.stats()["offloaded_bytes"] > 0


class _Linalg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, dtype=torch.float64)
        self.b = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        s = a.transpose(-1, -2) @ a + torch.eye(6, dtype=x.dtype)
        values, vectors = torch.linalg.eigh(s)
        _, sv, _ = torch.linalg.svd(self.b(x), full_matrices=False)
        sol = torch.linalg.solve(s, x.transpose(-1, -2)).transpose(-1, -2)
        d1 = torch.cdist(x, self.b(x), p=1)
        return x + sol + 0.01 * (vectors * values[..., None, :]).sum(-1)[..., None, :] \
            + 0.01 * sv.sum(-1, keepdim=True)[..., None] + 0.01 * d1.mean(-1, keepdim=True)


def test_linalg_eigh_svd_solve_and_cdist_p1_in_float64_offloaded_give_eager_gradients() -> None:
    _train_twins(lambda: nn.Sequential(_Linalg(), _Linalg()),
                 [torch.randn(3, 6, 6, dtype=torch.float64, requires_grad=True)],
                 lambda m, x: m(x).pow(2).sum(), offload=_manager(), verify_replay=True)


def test_a_batched_backward_and_a_vectorized_jacobian_over_wrapped_fno_layers_are_eagers() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Spectral(torch.cfloat) for _ in range(2)))
    twin = copy.deepcopy(eager)
    for layer in twin:
        pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(2, 4, 8, 8)
    got = []
    for m in (eager, twin):
        xx = x.clone().requires_grad_()
        u = m(xx).sum((1, 2, 3))
        batched = torch.autograd.grad(u, [xx, *m.parameters()], torch.eye(2), is_grads_batched=True)
        jac = torch.autograd.functional.jacobian(lambda z, m=m: m(z).sum((2, 3)), x, vectorize=True)
        got.append((batched, jac))
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0]))
    assert torch.equal(got[0][1], got[1][1])


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cdouble))

    def forward(self, z: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(z @ self.w) * r[..., None], (z.real * 2 + z.imag).sum(-1)


@pytest.mark.parametrize("view", ["conj", "neg", "imag"])
def test_a_conj_or_neg_bit_complex_input_offloaded_and_restored_gives_eager_gradients(
        view: str) -> None:
    torch.manual_seed(0)
    eager = _Complex()
    twin = copy.deepcopy(eager)
    manager = _manager()
    pytree_ckpt.apply_activation_checkpointing(twin, offload=manager, verify_replay=True)
    z0 = torch.randn(64, 8, dtype=torch.cdouble, requires_grad=True)
    r0 = torch.randn(64, dtype=torch.float64, requires_grad=True)
    got = []
    for m in (eager, twin):
        z = z0.conj() if view == "conj" else z0
        r = torch._neg_view(r0) if view == "neg" else z0.imag[:, 0] if view == "imag" else r0
        a, b = m(z, r)
        (a.abs().pow(2).sum() + b.sum()).backward()
        got.append((_grads(m), z0.grad, r0.grad))
        z0.grad = r0.grad = None
    assert _same(got[0][0], got[1][0])
    assert _same(list(got[0][1:]), list(got[1][1:]))
    stats = manager.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] > 0


class _Inner(nn.Module):
    """A MAML-style inner step on the layer's own weight (create_graph inside the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            w = self.lin.weight
            g = torch.autograd.grad((x @ w.t()).pow(2).mean(), w, create_graph=True)[0]
        return torch.tanh(x @ (w - 0.1 * g).t() + self.lin.bias)


def test_an_inner_gradient_step_with_create_graph_inside_a_layer_gives_eager_gradients() -> None:
    _train_twins(_Inner, [torch.randn(6, 4, requires_grad=True)], lambda m, x: m(x).pow(2).sum())


def test_a_batched_backward_through_a_layer_taking_its_own_input_derivatives_is_eagers() -> None:
    torch.manual_seed(0)
    eager = _Residual()
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(twin)
    x = torch.randn(4, 2)
    got = []
    for m in (eager, twin):
        xx = x.clone().requires_grad_()
        got.append(torch.autograd.grad(m(xx), [xx, *m.parameters()], torch.eye(4),
                                       is_grads_batched=True, allow_unused=True,
                                       materialize_grads=True))
    assert all(torch.equal(a, b) for a, b in zip(*got))


class _Adjoint(torch.autograd.Function):
    """A neural-ODE adjoint: forward under no-grad, backward re-evaluates f with grad."""

    @staticmethod
    def forward(ctx: Any, y0: torch.Tensor, f: nn.Module, *params: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            ys = [y0]
            for _ in range(4):
                ys.append(ys[-1] + 0.1 * f(ys[-1]))
        ctx.f = f
        ctx.save_for_backward(*ys)
        return ys[-1]

    @staticmethod
    def backward(ctx: Any, a: torch.Tensor) -> Any:
        ys, params = ctx.saved_tensors, list(ctx.f.parameters())
        total = [torch.zeros_like(p) for p in params]
        for i in reversed(range(4)):
            with torch.enable_grad():
                y = ys[i].detach().requires_grad_()
                g = torch.autograd.grad(y + 0.1 * ctx.f(y), [y, *params], a)
            a = g[0]
            total = [t + d for t, d in zip(total, g[1:])]
        return (a, None, *total)


def test_a_checkpointed_ode_function_under_an_adjoint_backward_gives_eager_gradients() -> None:
    _train_twins(lambda: nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)),
                 [torch.randn(3, 4, requires_grad=True)],
                 lambda f, y: _Adjoint.apply(y, f, *f.parameters()).pow(2).sum())


class _SpectralEma(nn.Module):
    """A complex buffer (a running spectrum) updated in place by the forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=dtype))
        self.register_buffer("spectrum", torch.zeros(6, dtype=dtype))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = z @ self.w
        with torch.no_grad():
            self.spectrum.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.tanh(h + self.spectrum)


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.cdouble])
def test_a_complex_buffer_updated_in_place_ends_each_step_as_eagers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(_SpectralEma(dtype) for _ in range(2))
    twin = copy.deepcopy(eager)
    for layer in twin:
        pytree_ckpt.apply_activation_checkpointing(layer)
    got: list[list[Any]] = [[], []]
    for step in range(3):
        z0 = torch.randn(4, 6, dtype=dtype, generator=torch.Generator().manual_seed(step))
        for k, m in enumerate((eager, twin)):
            z = z0.clone().requires_grad_()
            h = z
            for layer in m:
                h = layer(h)
            h.abs().pow(2).sum().backward()
            got[k].append((_grads(m), z.grad, [b.clone() for b in m.buffers()]))
    for (ga, za, ba), (gb, zb, bb) in zip(*got):
        assert _same(ga, gb) and torch.equal(za, zb) and _same(ba, bb)


def test_an_output_discard_of_a_complex_fft_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    first = nn.Linear(8, 8, dtype=torch.float64)
    w = nn.Parameter(torch.randn(5, 5, dtype=torch.cdouble))
    x0 = torch.randn(6, 8, dtype=torch.float64)
    got = []
    for discard in (False, True):
        first.zero_grad(set_to_none=True)
        w.grad = None
        x = x0.clone().requires_grad_()
        h = first(x)
        if discard:
            ckpt = pytree_ckpt.CheckpointWithoutOutput(verify_replay=True)
            spectrum = ckpt.checkpoint(lambda t: torch.fft.rfft(t, dim=-1), h)
        else:
            spectrum = torch.fft.rfft(h, dim=-1)
        out = torch.fft.irfft(spectrum @ w, n=8, dim=-1)
        if discard:
            ckpt.discard_output_and_register_recompute(out)
        out.pow(2).sum().backward()
        got.append([x.grad, w.grad, *_grads(first)])
    assert _same(*got)


def test_save_units_keeping_eigh_svd_and_fft_results_give_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList([_Linalg(), _Linalg()])
    twin = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config(
        twin, pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
        {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::_linalg_eigh", "aten::_linalg_svd",
                                                        "aten::_cdist_forward")},
        verify_replay=True)
    x0 = torch.randn(3, 6, 6, dtype=torch.float64)
    got = []
    for m in (eager, twin):
        x = x0.clone().requires_grad_()
        h = x
        for layer in m:
            h = layer(h)
        h.pow(2).sum().backward()
        got.append([x.grad, *_grads(m)])
    assert _same(*got)
