"""Unusual optimizers around checkpointed layers (helper PQ): LBFGS with closures (and strong
Wolfe line search), SAM / ASAM with micro-batches, Lookahead, EMA weights swapped in through
``.data`` for an eval forward between a training forward and its backward, an AveragedModel's
forward in that gap, K-FAC-style module hooks preconditioning ``.grad``, bf16 autocast with a
GradScaler, ``zero_grad(set_to_none=False)`` and foreach clipping, and an optimizer stepped in
``register_post_accumulate_grad_hook`` (also with a layer used twice). Each against its eager
twin, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

from tests.pytree_ckpt.test_training_loops import (_OFFLOAD, _Layer, _Net, _against_eager,
                                                    _batch, _grads, _state)


@_OFFLOAD
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_closures_with_dropout_and_batch_norm_train_as_eager(
        offloaded: bool, line_search: str | None) -> None:
    def body(model: nn.Module) -> Any:
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3,
                                line_search_fn=line_search)
        res: list[Any] = []
        for step in range(2):
            x = _batch(step)
            torch.manual_seed(step)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = model(x)
                loss.backward()
                res.append((loss.detach(), _grads(model)))
                return loss

            loss = opt.step(closure)
            state = opt.state_dict()["state"][0]
            res.append((loss.detach(), _state(model), torch.get_rng_state(),
                        [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]))
        return res

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_sam_with_micro_batches_and_weights_perturbed_in_place_trains_as_eager(
        offloaded: bool, adaptive: bool) -> None:
    def body(model: nn.Module) -> Any:
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        res = []
        for step in range(2):
            base.zero_grad()
            batches = [_batch(10 * step + i) for i in range(2)]
            for i, x in enumerate(batches):
                torch.manual_seed(100 * step + i)
                model(x).div(2).backward()
            first = _grads(model)
            params = [p for p in model.parameters() if p.grad is not None]
            with torch.no_grad():
                norm = torch.stack([((p.abs() if adaptive else 1.0) * p.grad).norm()
                                    for p in params]).norm()
                es = [(p.square() if adaptive else 1.0) * p.grad * (0.05 / (norm + 1e-12))
                      for p in params]
                for p, e in zip(params, es):
                    p.add_(e)
            base.zero_grad(set_to_none=False)
            for i, x in enumerate(batches):
                torch.manual_seed(200 * step + i)
                model(x).div(2).backward()
            second = _grads(model)
            with torch.no_grad():
                for p, e in zip(params, es):
                    p.sub_(e)
            base.step()
            res.append((first, second, _state(model), torch.get_rng_state()))
        return res

    _against_eager(body, offloaded=offloaded, in_place=adaptive)


@_OFFLOAD
def test_lookahead_and_ema_weights_swapped_in_between_forward_and_backward_train_as_eager(
        offloaded: bool) -> None:
    def body(model: nn.Module) -> Any:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        slow = [p.detach().clone() for p in model.parameters()]
        ema = [p.detach().clone() * 0.9 for p in model.parameters()]
        res = []
        for step in range(4):
            torch.manual_seed(step)
            loss = model(_batch(step))
            for p, e in zip(model.parameters(), ema):
                p.data, e.data = e.data, p.data
            model.eval()
            with torch.no_grad():
                evaluated = model(_batch(50 + step))
            model.train()
            for p, e in zip(model.parameters(), ema):
                p.data, e.data = e.data, p.data
            loss.backward()
            res.append((loss.detach(), evaluated, _grads(model)))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, e in zip(model.parameters(), ema):
                    e.mul_(0.9).add_(p, alpha=0.1)
                if step % 2 == 1:
                    for p, s in zip(model.parameters(), slow):
                        s.add_(p - s, alpha=0.5)
                        p.data.copy_(s)
            res.append(_state(model))
        return res

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
def test_an_averaged_models_forward_between_a_forward_and_its_backward_trains_as_eager(
        offloaded: bool) -> None:
    def body(model: nn.Module) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        res = []
        for step in range(3):
            torch.manual_seed(step)
            loss = model(_batch(step))
            averaged.eval()
            with torch.no_grad():
                evaluated = averaged(_batch(60 + step))
            averaged.train()
            with_grad = averaged(_batch(70 + step)).detach()  # a graph never backpropagated
            loss.backward()
            res.append((loss.detach(), evaluated, with_grad, _grads(model)))
            opt.step()
            opt.zero_grad()
            averaged.update_parameters(model)
        return res, _state(model), _state(averaged)

    _against_eager(body, offloaded=offloaded, in_place=True)


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@_OFFLOAD
@pytest.mark.parametrize("grad_gated", [False, True])
def test_kfac_style_hooks_preconditioning_grads_every_other_step_train_as_eager(
        offloaded: bool, grad_gated: bool) -> None:
    def body(model: nn.Module) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        factors_a: dict[nn.Module, torch.Tensor] = {}
        factors_g: dict[nn.Module, torch.Tensor] = {}
        lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
        now = {"step": 0}
        handles = []
        for lin in lins:
            def forward_hook(mod: nn.Module, inp: Any, out: Any) -> None:
                if grad_gated and not torch.is_grad_enabled():
                    return
                if now["step"] % 2 == 0 and mod.training:
                    a = inp[0].detach()
                    a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
                    factors_a[mod] = a.t() @ a / a.shape[0]

            def backward_hook(mod: nn.Module, grad_in: Any, grad_out: Any) -> None:
                if now["step"] % 2 == 0:
                    g = grad_out[0].detach()
                    factors_g[mod] = g.t() @ g * g.shape[0]

            handles.append(lin.register_forward_hook(forward_hook))
            handles.append(lin.register_full_backward_hook(backward_hook))
        res = []
        for step in range(4):
            now["step"] = step
            torch.manual_seed(step)
            model(_batch(step)).backward()
            with torch.no_grad():
                for lin in lins:
                    a_inv = torch.linalg.inv(factors_a[lin] + 0.1 * torch.eye(9))
                    g_inv = torch.linalg.inv(factors_g[lin] + 0.1 * torch.eye(lin.out_features))
                    grad = torch.cat([lin.weight.grad, lin.bias.grad[:, None]], 1)
                    new = g_inv @ grad @ a_inv
                    lin.weight.grad.copy_(new[:, :-1])
                    lin.bias.grad.copy_(new[:, -1])
            res.append((_grads(model), [factors_a[m] for m in lins],
                        [factors_g[m] for m in lins]))
            opt.step()
            opt.zero_grad()
        for handle in handles:
            handle.remove()
        return res, _state(model)

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
def test_bf16_autocast_grad_scaler_set_to_none_false_and_foreach_clipping_train_as_eager(
        offloaded: bool) -> None:
    def body(model: nn.Module) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
        res = []
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            for mb in range(2):
                torch.manual_seed(10 * step + mb)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(_batch(10 * step + mb))
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
            res.append((loss.detach(), norm, _grads(model)))
            scaler.step(opt)
            scaler.update()
        return res, _state(model), [v for s in opt.state.values() for v in s.values()]

    _against_eager(body, offloaded=offloaded)


class _SharedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = _Layer()
        self.layers = nn.ModuleList([shared, _Layer(batch_norm=True), shared])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


@_OFFLOAD
@pytest.mark.parametrize("shared", [False, True], ids=["distinct", "layer-used-twice"])
def test_an_optimizer_stepped_in_post_accumulate_grad_hooks_trains_as_eager(
        offloaded: bool, shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if shared:
        monkeypatch.setattr("tests.pytree_ckpt.test_training_loops._Net", _SharedNet)

    def body(model: nn.Module) -> Any:
        opts = {p: torch.optim.Adam([p], lr=0.01) for p in model.parameters()}
        calls = []

        def hook(p: torch.Tensor) -> None:
            calls.append(1)
            opts[p].step()
            opts[p].zero_grad(set_to_none=False)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        res = []
        for step in range(3):
            for mb in range(2):
                torch.manual_seed(10 * step + mb)
                loss = model(_batch(10 * step + mb))
                loss.backward()
                res.append((loss.detach(), _state(model)))
        return res, len(calls)

    _against_eager(body, offloaded=offloaded)


class _NoisyNet(nn.Module):
    """_Net with gradient noise drawn from the default generator in backward, between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer(batch_norm=True), _Layer()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x.register_hook(lambda g: g + 0.01 * torch.randn_like(g))
        return self.head(x).square().mean()


@_OFFLOAD
def test_shampoo_style_grad_hooks_and_noise_drawn_in_backward_train_as_eager(
        offloaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tensor hooks on the matrices inside checkpointed layers precondition each micro-batch's
    # gradient with a running statistic; random noise is drawn in backward between the layers
    # (after each replay) and in the head's post-accumulate hook.
    monkeypatch.setattr("tests.pytree_ckpt.test_training_loops._Net", _NoisyNet)

    def body(model: nn.Module) -> Any:
        stats: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith("layers"):
                def precondition(g: torch.Tensor, name: str = name) -> torch.Tensor:
                    stats[name] = stats.get(name, torch.zeros(g.shape[0], g.shape[0])) + g @ g.t()
                    ev, u = torch.linalg.eigh(stats[name] + 1e-3 * torch.eye(g.shape[0]))
                    return u @ torch.diag(ev.clamp_min(1e-6) ** -0.25) @ u.t() @ g
                p.register_hook(precondition)

        def noise(p: torch.Tensor) -> None:
            assert p.grad is not None
            p.grad.add_(torch.randn_like(p.grad))

        model.head.weight.register_post_accumulate_grad_hook(noise)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        res = []
        for step in range(2):
            for mb in range(2):
                torch.manual_seed(10 * step + mb)
                model(_batch(10 * step + mb).requires_grad_()).backward()
            res.append((_grads(model), torch.get_rng_state()))
            opt.step()
            opt.zero_grad()
        return res, sorted(stats.items()), _state(model)

    _against_eager(body, offloaded=offloaded)


@_OFFLOAD
def test_backward_into_a_parameter_subset_and_first_order_maml_train_as_eager(
        offloaded: bool) -> None:
    # loss.backward(inputs=...) for one optimizer's share of the parameters, then a first-order
    # MAML step: fast weights (tensors with a graph) given through functional_call.
    def body(model: nn.Module) -> Any:
        subset = [model.layers[1].lin.weight, model.layers[0].norm.weight, model.head.weight]
        first = torch.optim.SGD(subset, lr=0.1)
        outer = torch.optim.Adam(model.parameters(), lr=0.01)
        res = []
        for step in range(2):
            torch.manual_seed(step)
            model(_batch(step)).backward(inputs=subset)
            res.append(_grads(model))
            first.step()
            first.zero_grad()
            buffers = dict(model.named_buffers())
            fast = dict(model.named_parameters())
            for inner in range(2):
                torch.manual_seed(100 * step + inner)
                loss = torch.func.functional_call(model, {**fast, **buffers},
                                                  (_batch(10 * step + inner),))
                grads = torch.autograd.grad(loss, list(fast.values()))
                fast = {n: w - 0.1 * g for (n, w), g in zip(fast.items(), grads)}
            torch.manual_seed(7 + step)
            query = torch.func.functional_call(model, {**fast, **buffers}, (_batch(90 + step),))
            query.backward()
            res.append((query.detach(), _grads(model), [t.detach() for t in fast.values()]))
            outer.step()
            outer.zero_grad()
        return res, _state(model)

    _against_eager(body, offloaded=offloaded)


def _reset_without_moving_versions(bn: nn.modules.batchnorm._NormBase) -> None:
    assert bn.running_mean is not None and bn.running_var is not None
    assert bn.num_batches_tracked is not None
    bn.running_mean.data.zero_()
    bn.running_var.data.fill_(1)
    bn.num_batches_tracked.data.zero_()


@_OFFLOAD
@pytest.mark.parametrize("in_place", [False, True], ids=["checkpoint_layers", "apply"])
def test_update_bn_between_forward_and_backward_is_accepted_with_the_gradients_eager_gives(
        offloaded: bool, in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/limits.md, State the forward changes (a batch norm's running statistics reset
    # between a forward and its backward): eager refuses in backward, its batch norm having
    # saved the running statistics whose versions the reset's zero_() moved. Checkpointed, the
    # replay runs on the statistics as the forward began: the gradients are those of an eager
    # run whose reset moves no version, and the statistics end as update_bn left them.
    def body(model: nn.Module) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        res = []
        for step in range(2):
            torch.manual_seed(step)
            loss = model(_batch(step))
            update_bn([_batch(40 + step), _batch(50 + step)], model)
            loss.backward()
            res.append((loss.detach(), _grads(model), _state(model), torch.get_rng_state()))
            opt.step()
            opt.zero_grad()
        return res

    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        body(_Net())
    runs = iter([True, False])  # _against_eager runs the eager twin first

    def twins(model: nn.Module) -> Any:
        if not next(runs):
            return body(model)
        with monkeypatch.context() as patched:
            patched.setattr(nn.modules.batchnorm._NormBase, "reset_running_stats",
                            _reset_without_moving_versions)
            return body(model)

    _against_eager(twins, offloaded=offloaded, in_place=in_place)
