"""A census open across backward counts the same whichever thread autograd runs the backward
on (on CUDA, the replay runs on autograd's device thread, not the thread that entered it)."""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import ActivationCensus, apply_activation_checkpointing, current_phase

from tests.conftest import assert_same_grads, grads_of

# Autograd runs a backward started from inside a backward (a reentrant one) on the same
# thread, up to this many levels deep; the next level goes to a thread of its own pool.
_AUTOGRAD_MAX_REENTRANT_DEPTH = 60


class _Reenter(torch.autograd.Function):
    """Identity whose backward starts a reentrant backward ``depth`` levels deep, the last of
    which calls ``run``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, depth: int, run: Callable[[], None]) -> torch.Tensor:
        ctx.depth, ctx.run = depth, run
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.depth == 0:
            ctx.run()
            return grad, None, None
        with torch.enable_grad():
            leaf = grad.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_Reenter.apply(leaf, ctx.depth - 1, ctx.run), leaf,
                                          grad)
        return grad, None, None


def _backward_on_an_autograd_thread(loss: torch.Tensor) -> None:
    """``loss.backward()``, run by autograd on a thread of its own, as on CUDA.

    What it simulates: on CUDA, autograd's engine runs the nodes of a CUDA graph (a
    boundary's backward, and so its replay) on its device thread for that GPU, not on the
    thread that called ``backward``. That thread runs each node under the graph task's
    ``ThreadLocalState``, captured when ``backward`` was called (engine.cpp, ``thread_main``:
    ``ThreadLocalStateGuard tls_guard(graph_task->thread_locals_)``): the saved-tensor hooks
    stack and the thread-local Python objects (``torch._C._stash_obj_in_tls``) come along;
    the Python context (``ContextVar`` values) and ``threading.get_ident()`` are the device
    thread's own.

    Why it is faithful: on CPU autograd runs a backward started from inside a backward on the
    same thread, but past ``_AUTOGRAD_MAX_REENTRANT_DEPTH`` levels it hands the graph task to
    a thread of its reentrant pool (engine.cpp, ``execute_with_graph_task``:
    ``add_thread_pool_task``), which runs the nodes through the same ``thread_main`` under the
    same guard. So this is the engine itself running ``loss``'s backward on a thread that is
    not the caller's, with the caller's hooks and thread-local objects and its own context
    and thread id, as the device thread does; only the device kind differs."""
    start = torch.zeros((), requires_grad=True)
    _Reenter.apply(start, _AUTOGRAD_MAX_REENTRANT_DEPTH, loss.backward).backward()


class _Probe(nn.Module):
    """Reads the census in the replay, mid-backward (what a census open across backward
    shows there), and which thread it ran on."""

    def __init__(self, seen: list[tuple[int, list[dict[str, Any]]]]) -> None:
        super().__init__()
        self.seen = seen
        self.census: ActivationCensus | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if current_phase() == "recompute" and self.census is not None:
            self.seen.append((threading.get_ident(), self.census.to_dict()["rows"]))
        return h


class _Layer(nn.Module):
    def __init__(self, seen: list[tuple[int, list[dict[str, Any]]]]) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.probe = _Probe(seen)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # The inner boundary saves (and reports) tanh's output in the outer one's replay.
        return self.probe(self.inner(torch.tanh(h)))


def _measured(on_an_autograd_thread: bool) -> tuple[list[tuple[int, list[dict[str, Any]]]],
                                                     list[torch.Tensor | None]]:
    torch.manual_seed(0)
    seen: list[tuple[int, list[dict[str, Any]]]] = []
    model = nn.Sequential(_Layer(seen), _Layer(seen))
    for layer in model:
        apply_activation_checkpointing(layer.inner)
        apply_activation_checkpointing(layer)
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationCensus(model) as census:
        for layer in model:
            layer.probe.census = census
        loss = model(x).sum()
        if on_an_autograd_thread:
            _backward_on_an_autograd_thread(loss)
        else:
            loss.backward()
    return seen, grads_of([x, *model.parameters()])


@pytest.mark.skipif(not hasattr(torch._C, "_remove_obj_from_tls"),
                    reason="a torch without thread-local objects for autograd to carry: "
                           "reports come from the entering thread only (docs/census.md)")
def test_a_census_open_across_backward_counts_the_same_on_autograds_own_thread() -> None:
    # On autograd's thread the census's pack hook ran (autograd copies the saved-tensor hooks
    # there), but the mechanisms' reports were dropped: they found the census through a
    # ContextVar (the thread's context is its own) and checked the thread id. Mid-backward,
    # the inner boundary's input, which the replay saves, was counted on the caller's thread
    # (CPU) and not on autograd's (CUDA).
    here, grads_here = _measured(on_an_autograd_thread=False)
    there, grads_there = _measured(on_an_autograd_thread=True)
    main = threading.get_ident()
    assert [thread == main for thread, _ in here] == [True, True]
    assert [thread == main for thread, _ in there] == [False, False]  # the simulation holds
    assert [rows for _, rows in here] == [rows for _, rows in there]
    # The replay of layer 1 (backward runs it first) holds its inner boundary's input.
    assert {"module": "1.inner", "mechanism": "checkpoint boundary", "device": "cpu",
            "bytes": 4 * 8 * 4} in here[0][1]
    assert_same_grads(grads_here, grads_there)


@pytest.mark.skipif(not hasattr(torch._C, "_remove_obj_from_tls"),
                    reason="a torch without thread-local objects: nothing is stashed")
def test_a_census_ended_on_a_thread_leaves_nothing_in_its_thread_local_objects() -> None:
    # NOTE [nothing left in a thread] (census_threads.py): an object left there is freed by the
    # thread's C++ destructors, which may no longer get the GIL; the entry must be erased,
    # not set to None.
    key = pytree_ckpt.census_threads._TLS_KEY
    seen: list[tuple[bool, bool]] = []

    def work() -> None:
        with ActivationCensus(nn.Linear(4, 4)):
            inside = torch._C._is_key_in_tls(key)
        seen.append((inside, torch._C._is_key_in_tls(key)))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [(True, False)]


@pytest.mark.parametrize("carried", [True, False], ids=["thread-local objects", "older torch"])
def test_a_boundary_called_in_a_copied_context_on_another_thread_is_left_out(
        carried: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [where a census records]: a thread of Python's own carries the census's pack hook
    # no more than its reports, so both are left out, alike. Without thread-local objects to
    # carry (an older torch), the census is found through the ContextVar, which a copied
    # context does carry: only the thread that entered it may record.
    if not carried:
        monkeypatch.setattr(pytree_ckpt.census_threads, "_CARRIED", False)
    layer = nn.Linear(8, 8)
    apply_activation_checkpointing(layer)
    x = torch.randn(4, 8, requires_grad=True)
    outs: list[torch.Tensor] = []
    with ActivationCensus(layer) as census:
        context = contextvars.copy_context()
        thread = threading.Thread(target=lambda: outs.append(context.run(layer, x)))
        thread.start()
        thread.join()
        assert census.total_bytes == 0
        here = layer(x)  # the same call on the entering thread is counted
        assert census.bytes_by("mechanism") == {"checkpoint boundary": 4 * 8 * 4}
    (outs[0].sum() + here.sum()).backward()
