"""Implicit and continuous-depth models through checkpointed layers, each against its eager
twin bit for bit over a few SGD-with-momentum steps (helper PS): neural ODEs (fixed-step RK4 and
an adaptive Dormand-Prince loop deciding acceptance with ``.item()``, with a function-evaluation
counter on the module read by the loss), deep equilibrium models (a no-grad fixed point, one
step with grad and the implicit backward in a tensor hook), FFJORD-style continuous flows
(Hutchinson's divergence and the exact trace, ``autograd.grad(create_graph=True)`` inside the
forward), neural SDEs (Euler-Maruyama drawing from a generator passed in, also inside a dict
or a dataclass), and Hamiltonian / Lagrangian networks taking input derivatives inside."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import autograd, nn

import pytree_ckpt

D = 3


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _steps(model: nn.Module, step: Callable[[nn.Module, int], tuple[torch.Tensor, Any]],
           steps: int = 2) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1)
    got = []
    for i in range(steps):
        opt.zero_grad()
        loss, after = step(model, i)
        loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        got.append((loss.detach(), grads, [p.detach().clone() for p in model.parameters()],
                    [b.clone() for b in model.buffers()], after(), torch.get_rng_state()))
    return got


def _like_eager(make: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any],
                step: Callable[[nn.Module, int], tuple[torch.Tensor, Any]]) -> bool:
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager)
    wrap(ours)
    return _same(_steps(eager, step), _steps(ours, step))


def _wrap_all(m: nn.Module) -> None:
    pytree_ckpt.apply_activation_checkpointing(m)


def _wrap_children(m: nn.Module) -> None:
    for child in m.children():
        pytree_ckpt.apply_activation_checkpointing(child)


# -- neural ODEs ----------------------------------------------------------------------------

class _Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D + 1, 16), nn.Linear(16, D)
        self.nfe = 0

    def forward(self, t: float, y: torch.Tensor) -> torch.Tensor:
        self.nfe += 1
        return self.l2(torch.tanh(self.l1(torch.cat([y, torch.full_like(y[:, :1], t)], -1))))


class _RK4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.nfe = _Field(), 0

    def forward(self, y: torch.Tensor, n: int = 4) -> torch.Tensor:
        h, t = 1.0 / n, 0.0
        for _ in range(n):
            self.nfe += 4
            k1 = self.f(t, y)
            k2 = self.f(t + h / 2, y + h / 2 * k1)
            k3 = self.f(t + h / 2, y + h / 2 * k2)
            k4 = self.f(t + h, y + h * k3)
            y, t = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), t + h
        return y


_A = [[], [1 / 5], [3 / 40, 9 / 40], [44 / 45, -56 / 15, 32 / 9],
      [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
      [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
      [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]]
_C = [0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1, 1]
_B5 = [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0]
_B4 = [5179 / 57600, 0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40]


class _Dopri(nn.Module):
    """Dormand-Prince 5(4): acceptance by ``err.item()``, a step size kept across calls."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.nfe, self.rejected, self.h_last = _Field(), 0, 0, 1.0

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t, h = 0.0, self.h_last
        while t < 1.0:
            h = min(h, 1.0 - t)
            ks: list[torch.Tensor] = []
            for i in range(7):
                yi = y
                for j, a in enumerate(_A[i]):
                    if a:
                        yi = yi + h * a * ks[j]
                ks.append(self.f(t + _C[i] * h, yi))
                self.nfe += 1
            y5 = y + h * sum(b * k for b, k in zip(_B5, ks) if b)
            y4 = y + h * sum(b * k for b, k in zip(_B4, ks) if b)
            err = ((y5 - y4).abs() / (1e-7 + 1e-7 * y.abs().maximum(y5.abs()))).pow(2).mean()
            e = err.sqrt().item()
            if e <= 1.0:
                t, y = t + h, y5
            else:
                self.rejected += 1
            h = h * min(5.0, max(0.2, 0.9 * max(e, 1e-10) ** -0.2))
            if e <= 1.0 and t < 1.0:
                self.h_last = h
        return y


def _ode_step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
    torch.manual_seed(10 + i)
    x = torch.randn(6, D) * (1 + i)
    m.nfe = m.f.nfe = 0
    y = m(x)
    loss = y.pow(2).mean() + 1e-3 * (m.nfe + m.f.nfe)
    return loss, lambda: (m.nfe, m.f.nfe, getattr(m, "rejected", 0), getattr(m, "h_last", 0))


@pytest.mark.parametrize("make", [_RK4, _Dopri], ids=["rk4", "dopri5"])
@pytest.mark.parametrize("wrap", [_wrap_all, _wrap_children], ids=["solver", "field"])
def test_neural_ode_solvers_with_a_counter_read_by_the_loss_give_eager_numbers(
        make: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any]) -> None:
    assert _like_eager(make, wrap, _ode_step)


# -- deep equilibrium models ----------------------------------------------------------------

class _Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W, self.U = nn.Linear(D, D, bias=False), nn.Linear(D, D)
        with torch.no_grad():
            self.W.weight.mul_(0.3)

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.W(z) + self.U(x))


def _fixed_point(g: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor
                 ) -> tuple[torch.Tensor, list[float]]:
    res = []
    for _ in range(40):
        zn = g(z)
        res.append((zn - z).norm().item())
        z = zn
        if res[-1] < 1e-5:
            break
    return z, res


class _DEQ(nn.Module):
    """The implicit-layers tutorial's DEQ; the hook guarded as the boundary's note advises."""

    def __init__(self) -> None:
        super().__init__()
        self.f = _Cell()
        self.forward_res: list[float] = []
        self.backward_res: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z, self.forward_res = _fixed_point(lambda z: self.f(z, x), torch.zeros_like(x))
        z = self.f(z, x)
        z0 = z.clone().detach().requires_grad_()
        f0 = self.f(z0, x)

        def backward_hook(grad: torch.Tensor) -> torch.Tensor:
            g, self.backward_res = _fixed_point(
                lambda y: autograd.grad(f0, z0, y, retain_graph=True)[0] + grad, grad)
            return g

        if z.requires_grad:
            z.register_hook(backward_hook)
        return z


def _deq_step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
    torch.manual_seed(20 + i)
    x = torch.randn(5, D, requires_grad=True)
    z = m(x)
    return z.pow(2).sum() + (z * torch.arange(D)).sum(), \
        lambda: (m.forward_res, m.backward_res, x.grad)


@pytest.mark.parametrize("wrap", [_wrap_all, _wrap_children], ids=["deq", "cell"])
def test_a_deq_with_its_implicit_backward_in_a_tensor_hook_gives_eager_numbers(
        wrap: Callable[[nn.Module], Any]) -> None:
    assert _like_eager(_DEQ, wrap, _deq_step)


# -- continuous normalizing flows -----------------------------------------------------------

class _Dynamics(nn.Module):
    def __init__(self, exact: bool) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D + 1, 16), nn.Linear(16, D)
        self.exact = exact

    def forward(self, t: torch.Tensor, z: torch.Tensor,
                g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            z = z if z.requires_grad else z.detach().requires_grad_()
            dz = self.l2(torch.tanh(self.l1(torch.cat([z, t.expand(z.shape[0], 1)], -1))))
            if self.exact:
                div = sum(autograd.grad(dz[:, i].sum(), z, create_graph=True)[0][:, i]
                          for i in range(D))
            else:
                e = torch.randn_like(z) if g is None else torch.randn(z.shape, generator=g)
                div = (autograd.grad(dz, z, e, create_graph=True)[0] * e).sum(1)
        return dz, -div


class _CNF(nn.Module):
    def __init__(self, exact: bool) -> None:
        super().__init__()
        self.func = _Dynamics(exact)

    def forward(self, x: torch.Tensor, g: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        z, logp = x, torch.zeros(x.shape[0])
        for k in range(4):
            dz, dl = self.func(torch.tensor([k / 4]), z, g)
            z, logp = z + dz / 4, logp + dl / 4
        return z, logp


def _cnf_step(generator: bool) -> Callable[[nn.Module, int], tuple[torch.Tensor, Any]]:
    def step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(30 + i)
        g = torch.Generator().manual_seed(9 + i) if generator else None
        z, dlogp = m(torch.randn(8, D), g)
        return (0.5 * z.pow(2).sum(1) + dlogp).mean(), \
            lambda: None if g is None else g.get_state()
    return step


@pytest.mark.parametrize("estimator", ["exact", "hutchinson", "hutchinson-generator"])
@pytest.mark.parametrize("wrap", [_wrap_all, _wrap_children], ids=["flow", "dynamics"])
def test_a_cnf_taking_its_divergence_inside_the_forward_gives_eager_numbers(
        estimator: str, wrap: Callable[[nn.Module], Any]) -> None:
    assert _like_eager(lambda: _CNF(estimator == "exact"), wrap,
                       _cnf_step(estimator.endswith("generator")))


# -- neural SDEs ----------------------------------------------------------------------------

@dataclasses.dataclass
class _Opts:
    generator: torch.Generator


class _SDE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drift = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, D))
        self.diffusion = nn.Sequential(nn.Linear(D, D), nn.Sigmoid())

    def forward(self, y: torch.Tensor, opts: Any) -> torch.Tensor:
        g = opts if isinstance(opts, torch.Generator) else \
            opts["generator"] if isinstance(opts, dict) else opts.generator
        h = 1 / 6
        for _ in range(6):
            dw = torch.randn(y.shape, generator=g) * h ** 0.5
            y = y + self.drift(y) * h + self.diffusion(y) * dw
        return y


@pytest.mark.parametrize("holder", ["argument", "dict", "dataclass"])
@pytest.mark.parametrize("wrap", [_wrap_all, _wrap_children], ids=["sde", "nets"])
def test_euler_maruyama_drawing_from_a_generator_passed_in_gives_eager_numbers(
        holder: str, wrap: Callable[[nn.Module], Any]) -> None:
    def step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(40 + i)
        g = torch.Generator().manual_seed(7 + i)
        opts = {"argument": g, "dict": {"generator": g}, "dataclass": _Opts(g)}[holder]
        return (m(torch.randn(8, D), opts) - 1).pow(2).mean(), g.get_state
    assert _like_eager(_SDE, wrap, step)


# -- Hamiltonian and Lagrangian networks ----------------------------------------------------

class _HNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.H = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            xi = x if x.requires_grad else x.detach().requires_grad_()
            dH = autograd.grad(self.H(xi).sum(), xi, create_graph=True)[0]
        return torch.cat([dH[:, 1:], -dH[:, :1]], -1)


class _Rollout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = _HNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            k1 = self.f(x)
            k2 = self.f(x + 0.05 * k1)
            x = x + 0.1 * k2
        return x


@pytest.mark.parametrize("wrap", [_wrap_all, _wrap_children], ids=["rollout", "hnn"])
def test_an_hnn_rollout_taking_input_derivatives_inside_gives_eager_numbers(
        wrap: Callable[[nn.Module], Any]) -> None:
    def step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(50 + i)
        return (m(torch.randn(10, 2)) - torch.randn(10, 2)).pow(2).mean(), lambda: None
    assert _like_eager(_Rollout, wrap, step)


class _LNN(nn.Module):
    """qdd from a learned Lagrangian L(q, qd), its derivatives taken w.r.t. both inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.L = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, q: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            q = q if q.requires_grad else q.detach().requires_grad_()
            qd = qd if qd.requires_grad else qd.detach().requires_grad_()
            gq, gqd = autograd.grad(self.L(torch.cat([q, qd], -1)).sum(), (q, qd),
                                    create_graph=True)
            hdd = autograd.grad(gqd.sum(), qd, create_graph=True)[0]
            hqd = autograd.grad(gqd.sum(), q, create_graph=True)[0]
        return (gq - hqd * qd) / (hdd.abs() + 1.0)


def _lnn_step(n: int) -> Callable[[nn.Module, int], tuple[torch.Tensor, Any]]:
    def step(m: nn.Module, i: int) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(60 + i)
        q, qd, target = torch.randn(10, 1), torch.randn(10, 1), torch.randn(10, 1)
        for _ in range(n):  # semi-implicit Euler: the next q is computed from the next qd
            qd = qd + 0.1 * m(q, qd)
            q = q + 0.1 * qd
        return (q - target).pow(2).mean() + 0.1 * qd.pow(2).mean(), lambda: None
    return step


def test_an_lnn_called_once_on_data_gives_eager_numbers() -> None:
    assert _like_eager(_LNN, _wrap_all, _lnn_step(1))


_REACHED = "took a gradient inside its forward"


def test_an_lnn_rollout_whose_next_q_is_computed_from_qd_is_refused_naming_the_input() -> None:
    # NOTE [a gradient inside the forward reaching the graph before the call]: from the
    # second step q is computed from qd, and the derivative taken for qd flows through q's
    # history in eager; the replay's detached q would cut it (parameter gradients 2% off,
    # helper PS).
    torch.manual_seed(0)
    model = _LNN()
    pytree_ckpt.apply_activation_checkpointing(model)
    with pytest.raises(pytree_ckpt.CheckpointError, match=_REACHED) as refused:
        _lnn_step(2)(model, 0)
    assert "its input args[0]" in str(refused.value)


class _DuDx(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            u = torch.tanh(self.lin(torch.cat([x, y], -1))).sum()
            return autograd.grad(u, x, create_graph=True)[0]


def _dudx_grads(m: nn.Module, derived: bool) -> list[torch.Tensor]:
    torch.manual_seed(1)
    s = torch.randn(5, 1, requires_grad=True)
    loss = m(s, s * 2 if derived else s).pow(2).sum()
    return [loss.detach(), *autograd.grad(loss, [s, *m.parameters()])]


def test_a_derivative_taken_inside_wrt_an_input_passed_twice_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = _DuDx()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)
    assert _same(_dudx_grads(eager, False), _dudx_grads(ours, False))


def test_a_derivative_taken_inside_wrt_an_input_another_input_derives_from_is_refused(
        ) -> None:
    # Eager's du/dx is the total derivative, through y = 2 * x too; the replay's y would be a
    # leaf of its own (a weight's gradient 11.2 off, helper PS). A gradient that stops at the
    # inputs runs none of their nodes: passed twice, or as above with x alone, it is exact.
    torch.manual_seed(0)
    ours = _DuDx()
    pytree_ckpt.apply_activation_checkpointing(ours)
    with pytest.raises(pytree_ckpt.CheckpointError, match=_REACHED) as refused:
        _dudx_grads(ours, True)
    assert "its input args[1]" in str(refused.value) and "args[0]" not in str(refused.value)


class _DuDxInside(_DuDx):
    """The tip: y computed from x inside the call, in its enable_grad block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with torch.enable_grad():
            return super().forward(x, x * 2)


def test_a_derivative_taken_inside_wrt_an_input_the_call_derives_from_gives_eager_gradients(
        ) -> None:
    torch.manual_seed(0)
    eager = _DuDxInside()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)

    def grads(m: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        s = torch.randn(5, 1, requires_grad=True)
        loss = m(s * 1).pow(2).sum()
        return [loss.detach(), *autograd.grad(loss, [s, *m.parameters()])]
    assert _same(grads(eager), grads(ours))


class _InnerStep(nn.Module):
    """An inner gradient step on the layer's own weight, taken inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            w = self.lin.weight
            g = autograd.grad((x @ w.t()).pow(2).mean(), w, retain_graph=True)[0]
        return torch.tanh(x @ (w - 0.1 * g).t() + self.lin.bias)


def _inner_grads(m: nn.Module, calls: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    h = torch.randn(6, 4)
    for _ in range(calls):
        h = m(h)
    loss = h.pow(2).sum()
    return [loss.detach(), *autograd.grad(loss, list(m.parameters()))]


def test_an_inner_gradient_step_on_the_layers_weight_called_once_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = _InnerStep()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)
    assert _same(_inner_grads(eager, 1), _inner_grads(ours, 1))


def test_an_inner_gradient_step_on_the_layers_weight_called_twice_is_refused() -> None:
    # The second call's input was computed from the weight by the first call: eager's inner
    # gradient follows it (running the first call's boundary node inside the forward), the
    # replay's detached input would not (gradients 0.02 off, helper PS).
    torch.manual_seed(0)
    ours = _InnerStep()
    pytree_ckpt.apply_activation_checkpointing(ours)
    with pytest.raises(pytree_ckpt.CheckpointError, match=_REACHED) as refused:
        _inner_grads(ours, 2)
    assert "its input args[0]" in str(refused.value)


# Helper PZ: the refusal names kwargs and nested keys, a plain function's boundary refuses
# alike, and common models whose inputs are non-leaf (chunks of one tensor) are not refused.
class _DuDxKw(_DuDx):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None,  # type: ignore[override]
                d: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if d is not None:
            x, y = d["a"], d["b"]
        assert y is not None
        return super().forward(x, y)


@pytest.mark.parametrize("how", ["kwarg", "dict_key", "plain_function"])
def test_a_gradient_inside_past_an_input_is_refused_naming_the_kwarg_or_the_key(how: str) -> None:
    torch.manual_seed(0)
    layer = _DuDxKw()
    s = torch.randn(5, 1, requires_grad=True)
    with pytest.raises(pytree_ckpt.CheckpointError, match=_REACHED) as refused:
        if how == "plain_function":
            def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return layer(x, y)
            pytree_ckpt.checkpoint(fn, s, 2 * s)
        else:
            pytree_ckpt.apply_activation_checkpointing(layer)
            if how == "kwarg":
                layer(s, y=2 * s)
            else:
                layer(None, d={"a": s, "b": 2 * s})
    want = {"kwarg": "its input kwargs['y']", "dict_key": "its input kwargs['d']['b']",
            "plain_function": "its input args[1]"}[how]
    assert want in str(refused.value)


class _PinnResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            u = self.net(torch.cat([x, t], -1))
            u_x, u_t = autograd.grad(u.sum(), (x, t), create_graph=True)
            u_xx = autograd.grad(u_x.sum(), x, create_graph=True)[0]
        return u_t - 0.1 * u_xx + u * u_x


def test_a_pinn_on_collocation_points_chunked_from_one_non_leaf_gives_eager_gradients() -> None:
    def grads(m: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        xn = ((torch.rand(16, 2) - 0.5) * 0.5).requires_grad_()
        x, t = torch.chunk(xn * 3.0, 2, dim=-1)  # non-leaf inputs sharing one SplitBackward
        loss = m(x, t).pow(2).mean()
        return [loss.detach(), *autograd.grad(loss, [xn, *m.parameters()])]
    torch.manual_seed(0)
    eager = _PinnResidual()
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours)
    assert _same(grads(eager), grads(ours)) and _same(grads(eager), grads(ours))


class _WeightNormInnerStep(nn.Linear):
    """An inner step on the weight's direction, taken inside the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            w = self.weight
            v = self.parametrizations.weight.original1 if hasattr(self, "parametrizations") \
                else self.weight_v
            g = autograd.grad((x @ w.t()).pow(2).mean(), v, retain_graph=True)[0]
        return torch.tanh(x @ (w - 0.1 * g).t() + self.bias)


def _wn_grads(m: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    loss = m(torch.randn(3, 4)).sum()
    return [loss.detach(), *autograd.grad(loss, list(m.parameters()))]


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
def test_an_inner_step_through_a_pre_hook_attribute_is_refused_naming_it() -> None:
    # The deprecated weight_norm computes `weight` in a forward pre-hook, outside the call: it
    # is saved with the inputs, and the inner gradient for weight_v runs its node.
    torch.manual_seed(0)
    layer = torch.nn.utils.weight_norm(_WeightNormInnerStep(4, 4))
    pytree_ckpt.apply_activation_checkpointing(layer)
    with pytest.raises(pytree_ckpt.CheckpointError, match=_REACHED) as refused:
        _wn_grads(layer)
    assert "the attribute 'weight'" in str(refused.value)


def test_an_inner_step_through_a_parametrized_weight_gives_eager_gradients() -> None:
    # The same layer with torch.nn.utils.parametrizations.weight_norm: the weight is computed
    # inside the call, and the result is eager's.
    torch.manual_seed(0)
    base = _WeightNormInnerStep(4, 4)
    twin = copy.deepcopy(base)
    eager = torch.nn.utils.parametrizations.weight_norm(base)
    ours = torch.nn.utils.parametrizations.weight_norm(twin)
    pytree_ckpt.apply_activation_checkpointing(ours)
    assert _same(_wn_grads(eager), _wn_grads(ours))
