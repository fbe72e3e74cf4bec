"""One rank of the scale-out tests; the tests launch it twice (``launch.run_ranks``).

    python tests/distributed/worker.py OUT_DIR SCENARIO [SCENARIO ...]

Every rank builds the reference model from seed 0 and trains on its own batch
(``make_packed_batch(config, seed=rank)``). Each scenario writes what it observed to
``OUT_DIR/<scenario>.rank<r>.json`` (call counts, phases, losses, counters) and rank 0 writes
the full (unsharded) gradients to ``OUT_DIR/<scenario>.grads.pt``; the tests compare those with
a single-process eager run they compute themselves. A scenario that raises records its
traceback instead, and the next scenario still runs.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import pytree_ckpt
from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, kernels, make_packed_batch
from examples.glm_dsa.distributed import (DistEnv, compile_layer_bodies, full_gradients,
                                          init_from_env, shard_model, wrap_ddp, wrapped_layers)
from offload import OffloadConfig, OffloadManager
from tests.distributed.common import SEQ_LENS, WORKER_LR, build

# The root returns logits[None], a view; nothing modifies it in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")


class Log:
    """Which part of the step runs ("forward" or "backward"), and what was seen in each."""

    def __init__(self) -> None:
        self.part = "idle"
        self.events: Counter[str] = Counter()

    def add(self, *what: str) -> None:
        self.events["|".join((*what, self.part, str(pytree_ckpt.current_phase())))] += 1

    def take(self) -> dict[str, int]:
        events = dict(self.events)
        self.events.clear()
        return events


LOG = Log()


def _counting_backend() -> None:
    """Count the DSA kernels where they really run (inside the custom ops, never traced)."""
    torch_backend = kernels.TORCH_BACKEND

    def topk(*args: Any) -> torch.Tensor:
        LOG.add("op", "indexer_topk")
        return torch_backend.indexer_topk(*args)

    def attention(*args: Any) -> torch.Tensor:
        LOG.add("op", "sparse_attention")
        return torch_backend.sparse_attention(*args)

    kernels.register_backend(kernels.Backend("counting", None, None, topk, attention,
                                             torch_backend.sparse_attention_backward))


def _spy_on_fsdp() -> None:
    """Record every FSDP2 pre-forward, unshard and pre-backward, with the phase it ran in."""
    for name in ("pre_forward", "unshard", "pre_backward"):
        original = getattr(FSDPParamGroup, name)

        def spy(self: FSDPParamGroup, *args: Any, _name: str = name,
                _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            LOG.add("fsdp", _name, self._module_fqn or "<root>")
            return _original(self, *args, **kwargs)

        setattr(FSDPParamGroup, name, spy)


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    LOG.part = "forward"
    loss = model(**batch)["loss"]
    LOG.part = "backward"
    loss.backward()
    LOG.part = "idle"
    return loss.item()


def hook_layers(model: GlmDsaForCausalLM, root: torch.nn.Module) -> None:
    # Registered after fully_shard / DDP: they run right after FSDP's own pre-forward hook.
    for name, layer in [*wrapped_layers(model), ("<root>", root)]:
        layer.register_forward_pre_hook(
            lambda module, args, kwargs, _name=name: LOG.add("pre_hook", _name),
            with_kwargs=True)


def two_passes(model: torch.nn.Module, batch: dict[str, torch.Tensor],
               manager: OffloadManager) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Two training steps: per step the loss, the logged events and the offload stats; the full
    gradients of each step; and whether the second step's equal the first's bit for bit."""
    result: dict[str, Any] = {"steps": []}
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = step(model, batch)
        stats = manager.stats(reset=True)
        result["steps"].append({"loss": loss, "events": LOG.take(), "offload": stats})
        grads.append(full_gradients(model))
    result["second_pass_grads_equal"] = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(grads[0].values(), grads[1].values()))
    return result, grads


def scenario_fsdp(out: Path, rank: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    _, model = build()
    plain_keys = list(model.state_dict())
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    # verify_replay: no replay under FSDP2 (parameters all-gathered again before it) computes
    # other outputs than its forward did; the gradients below are checked bit for bit anyway.
    model.checkpoint_layers(1.0, offload=manager, verify_replay=True)
    shard_model(model)
    hook_layers(model, model)
    # The second pass checks the steady state (FSDP's lazy init is done).
    result, grads = two_passes(model, batch, manager)
    result["plain_keys"] = plain_keys
    result["state_dict_keys"] = list(model.state_dict())
    result["dcp_keys"] = list(get_model_state_dict(model))
    result["sharded"] = sorted({type(p).__name__ for p in model.parameters()})
    # One AdamW step on the shards, then a distributed checkpoint the plain model must load.
    torch.optim.AdamW(model.parameters(), lr=WORKER_LR).step()
    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "fsdp.dcp"))
    if rank == 0:
        torch.save(grads[0], out / "fsdp.grads.pt")
    return result


def scenario_ddp(out: Path, rank: int, batch: dict[str, torch.Tensor],
                 env: DistEnv) -> dict[str, Any]:
    _, model = build()
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    model.checkpoint_layers(1.0, offload=manager)
    ddp = wrap_ddp(model, env)
    hook_layers(model, ddp)
    # A second pass fails if the first left a bucket unreduced.
    result, grads = two_passes(ddp, batch, manager)
    result["find_unused_parameters"] = ddp.find_unused_parameters
    result["state_dict_keys"] = list(model.state_dict())
    if rank == 0:
        torch.save(grads[0], out / "ddp.grads.pt")
    return result


def scenario_fsdp_compile(out: Path, rank: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    _, model = build()
    fullgraph = compile_layer_bodies(model, backend=counter)
    model.checkpoint_layers(1.0, offload=OffloadManager(OffloadConfig(min_bytes=0), device="cpu"),
                            verify_replay=True)  # compiled bodies: both passes the same bits
    shard_model(model)
    result: dict[str, Any] = {"fullgraph": fullgraph, "steps": []}
    for index in range(3):
        model.zero_grad(set_to_none=True)
        before = counter.frame_count
        LOG.part = "forward"
        loss = model(**batch)["loss"]
        compiled_in_forward = counter.frame_count - before
        LOG.part = "backward"
        loss.backward()
        LOG.part = "idle"
        result["steps"].append({"loss": loss.item(), "events": LOG.take(),
                                "compiled_in_forward": compiled_in_forward,
                                "compiled_in_backward": counter.frame_count - before
                                - compiled_in_forward})
        if index == 0:
            grads = full_gradients(model)
            if rank == 0:
                torch.save(grads, out / "fsdp_compile.grads.pt")
    return result


def main(out: Path, scenarios: list[str]) -> None:
    torch.set_num_threads(1)  # tiny tensors, two ranks on a small machine
    env = init_from_env(timeout=datetime.timedelta(seconds=90))
    _counting_backend()
    _spy_on_fsdp()
    config = GlmDsaConfig()
    batch = make_packed_batch(config, SEQ_LENS, seed=env.rank)
    runs = {"fsdp": lambda: scenario_fsdp(out, env.rank, batch),
            "ddp": lambda: scenario_ddp(out, env.rank, batch, env),
            "fsdp_compile": lambda: scenario_fsdp_compile(out, env.rank, batch)}
    for name in scenarios:
        try:
            result = {"ok": True, **runs[name]()}
        except Exception:  # recorded for the test to show; the other scenarios still run
            result = {"ok": False, "error": traceback.format_exc()}
            LOG.take()
        (out / f"{name}.rank{env.rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
