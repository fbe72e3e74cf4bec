"""What ``examples.glm_dsa.bench`` measures per configuration, one function per quantity.

NOTE [the step]: every measurement runs the same step, forward + loss + backward, with the
gradients set to ``None`` before it and **no optimizer**: the weights never change, so every
configuration at every round computes from the same initial weights on the same batches, and a
configuration's gradients can be compared with eager's at any step. Only the forward runs under
the configuration's context (``save_on_cpu``); backward runs outside, as in a training loop.

NOTE [measured apart]: census, FLOPs, peak memory and equality each get their own untimed
step(s); timed steps run nothing extra (no census hooks, no dispatch mode), so the timings are
of the configuration alone.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from pytree_ckpt import ActivationCensus

from .bench_configs import TorchCheckpointAdapter, Variant, parameter_names
from .indexer import DsaIndexer

__all__ = ["Progress", "census_of", "compare_step", "flops_of", "indexer_forward_flops",
           "peak_bytes_of", "run_step", "timed_step"]

Batch = dict[str, torch.Tensor]


class Progress:
    """A one-line progress bar on stderr (``\\r`` redraws; no dependency)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()

    def advance(self, label: str, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        filled = self.width * self.done // self.total
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {elapsed:5.1f}s {label:<44.44}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zero_grads(variant: Variant) -> None:
    for param in variant.model.parameters():
        param.grad = None


def run_step(variant: Variant, batch: Batch) -> torch.Tensor:
    """One step of NOTE [the step]; returns the detached loss."""
    zero_grads(variant)
    with variant.context():
        out = variant.model(**batch)
    loss = out["loss"]
    del out  # drop the logits before backward, as a training loop would
    loss.backward()
    return loss.detach()


def timed_step(variant: Variant, batch: Batch, device: torch.device) -> float:
    """Milliseconds of one step (grads zeroed and the device synchronised outside)."""
    zero_grads(variant)
    _sync(device)
    start = time.perf_counter()
    run_step(variant, batch)
    _sync(device)
    elapsed = time.perf_counter() - start
    zero_grads(variant)  # eight configurations' gradients must not pile up on the device
    return elapsed * 1e3


def step_results(variant: Variant, batch: Batch,
                 seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss and gradients (cloned, by adapter-free name) of one step from ``seed``."""
    torch.manual_seed(seed)  # dropout masks (if any) are then the same in every configuration
    loss = run_step(variant, batch)
    grads = {name: None if p.grad is None else p.grad.detach().clone()
             for name, p in parameter_names(variant.model).items()}
    zero_grads(variant)
    return loss, grads


def compare_step(reference: tuple[torch.Tensor, dict[str, Any]],
                 got: tuple[torch.Tensor, dict[str, Any]]) -> dict[str, Any]:
    """Bit equality (``torch.equal``) of the loss and of every parameter gradient."""
    (ref_loss, ref_grads), (loss, grads) = reference, got
    differing: list[str] = []
    max_diff = 0.0
    for name in sorted(set(ref_grads) | set(grads)):
        a, b = ref_grads.get(name), grads.get(name)
        if a is None or b is None:
            if (a is None) != (b is None):
                differing.append(f"{name} (grad is None in one)")
            continue
        if not torch.equal(a, b):
            differing.append(name)
            max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
    return {"loss_equal": bool(torch.equal(ref_loss, loss)),
            "loss": ref_loss.item(), "loss_diff": (loss.float() - ref_loss.float()).item(),
            "grads_equal": not differing, "grads_differing": differing,
            "grads_compared": len(ref_grads), "max_abs_grad_diff": max_diff}


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the equality checks (CUDA's index_add_ uses atomics)."""
    if device.type != "cuda":
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


_SHORT = {"checkpoint boundary": "boundary", "replay frame": "frame", "offloaded to host": "host",
          "offload in flight": "in flight", "autograd": "autograd", "module state": "state"}


class _CacheMeter(TorchDispatchMode):
    """Bytes of the outputs torch's selective checkpoint caches inside the adapters.

    SAC keeps them in its own storage, out of every saved-tensor hook's sight, so the census
    cannot see them. Entered before the forward, this mode sits below SAC's caching mode and
    sees each op SAC runs; outputs of the cached ops are counted once per storage.
    """

    def __init__(self, ops: frozenset[Any], model: torch.nn.Module) -> None:
        super().__init__()
        self.ops = ops
        self.depth = 0
        self.storages: dict[tuple[str, int], int] = {}
        self._handles = []
        for module in model.modules():
            if isinstance(module, TorchCheckpointAdapter):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, *_: Any) -> None:
        self.depth += 1

    def _exit(self, *_: Any) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth and func in self.ops:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    storage = leaf.untyped_storage()
                    self.storages[(str(leaf.device), storage.data_ptr())] = storage.nbytes()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def census_of(variant: Variant, batch: Batch, device: torch.device) -> dict[str, Any]:
    """``ActivationCensus`` of one forward (no backward), plus device bytes held on CUDA."""
    zero_grads(variant)
    gc.collect()
    _sync(device)
    if variant.manager is not None:
        # Counters of this forward alone: the phases before (the equality step) used the same
        # manager, and their windows were counted into the census's statistics (helper HC).
        variant.manager.stats(reset=True)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    meter = (_CacheMeter(variant.cached_ops, variant.model) if variant.cached_ops
             else None)
    # The configuration's context (save_on_cpu's hooks) goes outside the census, so the
    # census's pack hook is innermost and chains to it: entered inside, those hooks would
    # shadow the census, which would then see nothing at all.
    try:
        with variant.context(), meter or contextlib.nullcontext(), \
                ActivationCensus(variant.model) as census:
            out = variant.model(**batch)
    finally:
        if meter is not None:
            meter.remove()
    loss = out["loss"]
    del out
    _sync(device)
    data = census.to_dict()
    data["by_mechanism_short"] = {_SHORT.get(k, k): v for k, v in data["by_mechanism"].items()}
    # Not part of total_bytes: the census did not see them (see _CacheMeter).
    data["unseen_sac_cache_bytes"] = (None if meter is None
                                      else sum(meter.storages.values()))
    if variant.manager is not None:
        variant.manager.stats()  # lets go of device tensors whose copies have landed (synced)
    data["held_after_forward_bytes"] = (None if before is None
                                        else torch.cuda.memory_allocated(device) - before)
    del loss  # the graph goes without a backward: frames and offload copies are released
    if variant.manager is not None:
        data["offload_stats"] = variant.manager.stats(reset=True)
    return data


class _IndexerProbe:
    """Adds the FLOPs counted while any ``DsaIndexer`` forward runs (original or replay)."""

    def __init__(self, model: torch.nn.Module, counter: FlopCounterMode) -> None:
        self.counter = counter
        self.flops = 0
        self.calls = 0
        self._start: list[int] = []
        self._handles = []
        for module in model.modules():
            if isinstance(module, DsaIndexer):
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post))

    def _pre(self, *_: Any) -> None:
        self._start.append(self.counter.get_total_flops())

    def _post(self, *_: Any) -> None:
        self.flops += self.counter.get_total_flops() - self._start.pop()
        self.calls += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` that only totals (its module breakdown is not used here)."""
    return FlopCounterMode(display=False)


def flops_of(variant: Variant, batch: Batch, device: torch.device) -> dict[str, int]:
    """FLOPs of one whole step, and those spent in indexer forwards (original + replay).

    ``device`` is unused: every per-configuration measurement takes the same arguments.
    """
    counter = flop_counter()
    probe = _IndexerProbe(variant.model, counter)
    try:
        with counter, warnings.catch_warnings():
            # The probe's hooks only count: the boundary's warning about computing hooks
            # inside a checkpointed layer is not about them.
            warnings.filterwarnings("ignore", message="pytree_ckpt: forward hooks inside")
            run_step(variant, batch)
    finally:
        probe.remove()
    zero_grads(variant)
    if variant.manager is not None:
        variant.manager.stats(reset=True)
    return {"total": counter.get_total_flops(), "indexer": probe.flops,
            "indexer_calls": probe.calls}


def indexer_forward_flops(variant: Variant, batch: Batch) -> dict[str, int]:
    """FLOPs of every indexer call of one eager forward, run again alone under the counter.

    The calls' inputs are captured by forward pre-hooks during an ordinary forward; then each
    indexer is called once more on them inside ``FlopCounterMode``, so nothing but indexers is
    counted.
    """
    calls: list[tuple[DsaIndexer, tuple[Any, ...]]] = []
    handles = [module.register_forward_pre_hook(
        lambda mod, args: calls.append((mod, args))) for module in variant.model.modules()
        if isinstance(module, DsaIndexer)]
    try:
        with torch.no_grad(), variant.context():
            variant.model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    counter = flop_counter()
    with counter, torch.no_grad(), variant.context():
        for module, args in calls:
            module(*args)
    return {"flops": counter.get_total_flops(), "calls": len(calls)}


def peak_bytes_of(variant: Variant, batch: Batch, device: torch.device) -> int | None:
    """Peak device memory of one step above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    zero_grads(variant)
    gc.collect()
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_step(variant, batch)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    zero_grads(variant)
    if variant.manager is not None:
        variant.manager.stats(reset=True)
    return peak
