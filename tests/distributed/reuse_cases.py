"""Reused calls, plain functions, offload and save units under FSDP2 and DDP (two ranks).

    python tests/distributed/reuse_cases.py OUT CASE [CASE ...]

Each case trains the same model twice on each rank, under the same wrapper: once checkpointed,
once not (the eager twin), STEPS SGD steps each; it returns, per step, both runs' losses and
full gradients, and both runs' module state after the last step, for the test to compare bit
for bit (helper KF), with what the checkpointed run warned or raised.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pytree_ckpt
from tests.distributed.rank_cases import run_cases

WORLD = 2
STEPS = 2
E = 4  # experts


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)  # a DTensor under FSDP2
    return (full() if full is not None else t).detach().clone()


class CountingRouter(nn.Module):
    """Buffers only: a fixed projection, and a token count per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(8, E))
        self.register_buffer("counts", torch.zeros(E, dtype=torch.long))


def route(router: CountingRouter, h: torch.Tensor) -> torch.Tensor:
    ids = (h @ router.proj).topk(2, dim=-1).indices
    router.counts += torch.bincount(ids.flatten(), minlength=E)
    return ids


class GateRouter(nn.Module):
    """A trainable gate: its logits, for a hook to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, E)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.gate(h)


def route_hooked(router: GateRouter, h: torch.Tensor) -> torch.Tensor:
    return router(h).topk(2, dim=-1).indices


class MoELayer(nn.Module):
    def __init__(self, router: nn.Module, fn: Any, how: str = "") -> None:
        super().__init__()
        self.router, self.fn, self.how = router, fn, how
        self.lin = nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(E, 8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how.startswith("chunks"):  # two calls, the count read after each
            return torch.cat([self._chunk(part) for part in h.chunk(2)])
        return self._chunk(h)

    def _chunk(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "kw":
            ids = pytree_ckpt.reuse_during_recompute(self.fn, router=self.router, h=h)
        else:
            ids = pytree_ckpt.reuse_during_recompute(self.fn, self.router, h)
        w = self.experts[ids].sum(1)
        counts = getattr(self.router, "counts", None)
        if counts is not None:  # read after the call: this layer's call's count
            share = counts.float() / (1 + counts.sum())
            w = w * (1 + share[ids].sum(-1, keepdim=True))
        return h + torch.tanh(self.lin(h)) * w


def moe_model(kind: str, how: str = "") -> nn.Sequential:
    torch.manual_seed(0)
    router = CountingRouter() if kind == "count" else GateRouter()
    fn = route if kind == "count" else route_hooked
    first = MoELayer(router, fn, how)
    second = first if how == "shared" else MoELayer(router, fn, how)
    return nn.Sequential(nn.Linear(4, 8), first, second, nn.Linear(8, 1))


class PlainFn(nn.Module):
    """Calls a plain function given a list: checkpoint(fn, x, aux_list)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x)
        aux = [h0.sin(), torch.arange(8)]

        def body(h: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
            return torch.tanh(self.mid(h)) * extra[0] + extra[1]

        h = pytree_ckpt.checkpoint(body, h0, aux) if self.checkpointed else body(h0, aux)
        return self.out(h)


class MetaLayer(nn.Module):
    """Reads a Python attribute of its input, and returns the input beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + torch.tanh(self.lin(x)) * x.meta, x


class MetaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = (nn.Linear(4, 8), MetaLayer(), MetaLayer(),
                                              nn.Linear(8, 1))
        self.metas: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h.meta = 0.5
        y, back = self.a(h)
        self.metas.append((back is h, getattr(back, "meta", None)))
        y.meta = 0.25
        z, back2 = self.b(y)
        self.metas.append((back2 is y, getattr(back2, "meta", None)))
        return self.out(z + back + back2)


class Projecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h)


class ReturnsKept(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Projecting()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn.project(torch.tanh(h))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _wrap(wrapper: str, model: nn.Module, units: list[nn.Module], **ddp: Any) -> nn.Module:
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **ddp)


def train(model: nn.Module, rank: int, micro: int = 1) -> dict[str, Any]:
    """STEPS SGD steps of ``micro`` micro-batches each (one backward a step): per step the loss
    and full gradients, then the module state (full tensors)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = getattr(model, "module", model)
    steps = []
    for step in range(STEPS):
        loss = sum(model(batch(rank, 10 * m + step)).square().mean() for m in range(micro))
        loss.backward()
        steps.append({"loss": loss.detach(),
                      "grads": {n: _full(p.grad) for n, p in inner.named_parameters()}})
        optimizer.step()
        optimizer.zero_grad()
    return {"steps": steps, "state": {n: _full(t) for n, t in inner.state_dict().items()}}


def _twins(wrapper: str, make: Any, checkpoint: Any, units: Any, rank: int, *,
           ddp: dict[str, Any] | None = None, micro: int = 1) -> dict[str, Any]:
    """Eager, then checkpointed, each under ``wrapper``; the warnings the checkpointed run
    gave (pytree_ckpt's), and its CheckpointError if it raised one."""
    eager = make()
    eager_result = train(_wrap(wrapper, eager, units(eager), **(ddp or {})), rank, micro=micro)
    model = make()
    checkpoint(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = train(_wrap(wrapper, model, units(model), **(ddp or {})), rank,
                           micro=micro)
            error = None
        except pytree_ckpt.CheckpointError as raised:
            result, error = None, f"{type(raised).__name__}: {raised}"
    return {"eager": eager_result, "ckpt": result, "error": error, "model": model,
            "warnings": [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]}


def _layers_checkpointed(model: nn.Module) -> None:
    for layer in dict.fromkeys((model[1], model[2])):
        pytree_ckpt.apply_activation_checkpointing(layer, offload=False)


def case(name: str, rank: int) -> dict[str, Any]:
    wrapper, what = name.split("-", 1)
    if what.split("_")[0] in ("count", "hooked", "router"):
        kind = "count" if what.startswith("count") else "hooked"
        how = what.split("_", 1)[1] if what.startswith("count_") else ""
        kept: list[torch.Tensor] = []

        def make() -> nn.Sequential:
            model = moe_model(kind, how)
            if what == "hooked":
                model[1].router.register_forward_hook(lambda m, a, o: kept.append(o))
            return model

        def units(model: nn.Module) -> list[nn.Module]:
            # The shared router is its own unit where it has parameters (FSDP registers
            # forward hooks on it).
            layers = [model[1]] if model[1] is model[2] else [model[1], model[2]]
            return ([model[1].router] if kind == "hooked" else []) + layers

        result = _twins(wrapper, make, _layers_checkpointed, units, rank,
                        ddp={"find_unused_parameters": kind == "hooked"},
                        micro=2 if how.endswith("accum") else 1)
        result.pop("model")
        return result
    if what == "plainfn":
        result = _twins(wrapper, lambda: (torch.manual_seed(0), PlainFn(False))[1],
                        lambda m: setattr(m, "checkpointed", True), lambda m: [], rank)
        result.pop("model")
        return result
    if what == "offload":
        def make_meta() -> MetaModel:
            torch.manual_seed(0)
            return MetaModel()

        def offloaded(model: MetaModel) -> None:
            for layer in (model.a, model.b):
                pytree_ckpt.apply_activation_checkpointing(layer, offload=True)

        result = _twins(wrapper, make_meta, offloaded, lambda m: [], rank)
        result["metas"] = result.pop("model").metas
        return result
    if what == "kept_changed":
        from pytree_ckpt import KeptCallables, RecomputeConfig

        def make_kept() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8), ReturnsKept(), ReturnsKept(), nn.Linear(8, 1))

        def units_kept(model: nn.Module) -> list[nn.Module]:
            return [model[1], model[2]]

        def keep(model: nn.Module) -> None:
            pytree_ckpt.apply_recompute_config(
                nn.ModuleList([model[1], model[2]]), RecomputeConfig(1.0, save=["attn"]),
                {"attn": KeptCallables("Projecting.project")})

        class Changing(nn.Module):  # the caller changes the layer's output in place
            def __init__(self, inner: nn.Sequential) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.inner[1](self.inner[0](x))
                h += 1
                return self.inner[3](self.inner[2](h))

        def make_changing() -> nn.Module:
            return Changing(make_kept())

        def units_changing(model: nn.Module) -> list[nn.Module]:
            return units_kept(model.inner)

        result = _twins(wrapper, make_changing, lambda m: keep(m.inner), units_changing, rank)
        result.pop("model")
        return result
    raise KeyError(name)


def main(out: Path, names: list[str]) -> None:
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    run_cases(out, names, case)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
