"""How long removing checkpointing from every layer of a model takes, one layer at a time.

    python -m examples.bench_removal [--layers 61] [--experts 63] [--rounds 10]

Each layer is MoE-like (attention projections, a router whose ``project`` a save unit keeps,
``--experts`` experts of three Linears: 261 modules at 63, about the MoE layer first measured), all
checkpointed by one ``apply_recompute_config`` keeping ``Router.project``. The time is that of
``remove_activation_checkpointing`` on each layer in turn (NOTE [kept methods of shared
submodules] in pytree_ckpt/kept_owners.py: which other layer still keeps a wrapped method),
the best of ``--rounds`` (each applies the config anew). Afterwards no method is left wrapped.
"""

from __future__ import annotations

import argparse
import time

from torch import nn

from pytree_ckpt import KeptCallables, RecomputeConfig, SaveUnit, apply_recompute_config
from pytree_ckpt import remove_activation_checkpointing


class Router(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(8, experts)

    def project(self, x: object) -> object:
        return self.gate(x)

    def forward(self, x: object) -> object:
        return self.project(x)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate, self.down = (nn.Linear(8, 8) for _ in range(3))


class Layer(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.LayerNorm(8)
        self.router = Router(experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: object) -> object:  # never called: only wrapping is measured
        return x


def _remove_all(model: nn.ModuleList) -> float:
    apply_recompute_config(model, RecomputeConfig(1.0, save=["moe_gate"]),
                           {SaveUnit.MOE_GATE: KeptCallables("Router.project")})
    start = time.perf_counter()
    for layer in model:
        remove_activation_checkpointing(layer)
    took = time.perf_counter() - start
    if any("project" in layer.router.__dict__ for layer in model):
        raise AssertionError("a kept method was left wrapped")
    return took


def main(argv: list[str] | None = None) -> float:
    """Print and return the best time, in seconds, of removing checkpointing from every layer."""
    parser = argparse.ArgumentParser(prog="python -m examples.bench_removal",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=61, help="layers (default 61)")
    parser.add_argument("--experts", type=int, default=63,
                        help="experts per layer, three Linears each (default 63)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="times the config is applied and removed; the best is reported "
                             "(default 10)")
    args = parser.parse_args(argv)
    for name in ("layers", "experts", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    model = nn.ModuleList(Layer(args.experts) for _ in range(args.layers))
    modules = sum(1 for _ in model[0].modules())
    best = min(_remove_all(model) for _ in range(args.rounds))
    print(f"{args.layers} layers of {modules} modules: removing all took {best:.3f} s "
          f"(best of {args.rounds})")
    return best


if __name__ == "__main__":
    main()
