"""A split backward (an input pass with the graph kept, then a weight pass: what a zero-bubble
pipeline schedule runs in every stage) replays each checkpointed layer once, not once per pass
(NOTE [a replay kept between restricted backwards] in pytree_ckpt/kept_replay.py). Against an
unwrapped eager twin, bit for bit (fp32)."""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from offload import OffloadConfig, OffloadManager
from pytree_ckpt import CheckpointWithoutOutput, reuse_during_recompute
from tests.conftest import MatrixProducts, assert_same_grads

CALLS: Counter[str] = Counter()  # forward calls (of each layer kind), frozen calls


def _scale_of(h: torch.Tensor) -> torch.Tensor:
    CALLS["frozen"] += 1
    return torch.sigmoid(h.sum(-1, keepdim=True))


class Block(nn.Module):
    """Residual Linear-GELU-Linear; ``frozen``: its gate is a frozen result; ``discard``: its
    activation's output is discarded."""

    def __init__(self, frozen: bool = False, discard: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.frozen, self.discard = frozen, discard

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        CALLS["block"] += 1
        up = self.up(h)
        if self.discard:
            ckpt = CheckpointWithoutOutput()
            act = ckpt.checkpoint(torch.nn.functional.gelu, up)
            down = self.down(act)
            ckpt.discard_output_and_register_recompute(down)
        else:
            down = self.down(torch.nn.functional.gelu(up))
        if self.frozen:
            down = down * reuse_during_recompute(_scale_of, h.detach())
        return h + down


def _models(offload: bool = False, **kind: bool
            ) -> tuple[nn.Module, nn.Module, OffloadManager | None]:
    torch.manual_seed(0)
    eager = nn.Sequential(Block(**kind), Block(**kind))
    wrapped = copy.deepcopy(eager)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu") if offload else None
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block, offload=manager or False)
    return eager, wrapped, manager


def _split_backward(model: nn.Module, x: torch.Tensor, weight_pass: str
                    ) -> tuple[list[Any], int, Counter[str]]:
    """An input pass then a weight pass; the gradients, products and calls."""
    CALLS.clear()
    params = list(model.parameters())
    with MatrixProducts() as products:
        loss = model(x).square().sum()
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        if weight_pass == "grad":
            dw = list(torch.autograd.grad(loss, params))
        else:
            loss.backward(inputs=params)
            dw = [p.grad for p in params]
    return [dx, *dw], products.count, Counter(CALLS)


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
@pytest.mark.parametrize("weight_pass", ["grad", "backward"])
def test_an_input_pass_then_a_weight_pass_replay_each_layer_once_with_eager_gradients(
        weight_pass: str, offload: bool) -> None:
    eager, wrapped, manager = _models(offload)
    hooked: Counter[str] = Counter()
    accumulated: Counter[str] = Counter()
    for model in (eager, wrapped):
        for name, p in model.named_parameters():
            # Doubles: a hook run twice (in a replay's gradient call and again at the
            # parameter) would give 4x; counted by name across both models.
            p.register_hook(lambda g, name=name: (hooked.update([name]), g * 2)[1])
            p.register_post_accumulate_grad_hook(
                lambda t, name=name: accumulated.update([name]))
    x = torch.randn(4, 8, requires_grad=True)
    want, eager_products, eager_calls = _split_backward(eager, x, weight_pass)
    got, products, calls = _split_backward(wrapped, x, weight_pass)
    assert_same_grads(want, got)
    assert eager_calls["block"] == 2
    assert calls["block"] == 2 * 2  # the original pass and one replay each (three before)
    # The two replays' forward products, nothing more: the weight pass takes dW from the
    # kept graph, as eager's does (it replayed both blocks again, 4 products, and recomputed
    # each block's second dx, the first linear's dW needs: 2 more).
    assert products - eager_products == 2 * 2
    names = [name for name, _ in eager.named_parameters()]
    assert hooked == Counter({name: 2 for name in names})  # once a model
    # Accumulated only by backward(inputs=...), once a model: never after a None.
    assert accumulated == Counter({name: 2 for name in names if weight_pass == "backward"})
    if manager is not None:
        stats = manager.stats()
        assert stats["offloaded_bytes"] == stats["restored_bytes"] == 2 * x.nbytes  # once


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_a_frozen_result_layer_replays_once_across_both_passes_and_releases_its_frame(
        offload: bool) -> None:
    eager, wrapped, manager = _models(offload, frozen=True)
    x = torch.randn(4, 8, requires_grad=True)
    want, _, eager_calls = _split_backward(eager, x, "grad")
    CALLS.clear()
    loss = wrapped(x).square().sum()
    node = loss.grad_fn.next_functions[0][0].next_functions[0][0]  # the second block's
    frame = node.call.frame
    (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    assert not frame.released  # the weight pass may still need it
    dw = torch.autograd.grad(loss, list(wrapped.parameters()))
    assert frame.released
    assert_same_grads(want, [dx, *dw])
    assert eager_calls == Counter({"block": 2, "frozen": 2})
    assert CALLS == Counter({"block": 4, "frozen": 2})  # the frozen call never replayed
    if manager is not None:
        stats = manager.stats()
        # x and the block input, and each frame's gate (4 x 1 floats), restored once
        assert stats["offloaded_bytes"] == stats["restored_bytes"] == 2 * x.nbytes + 2 * 16


def test_a_second_input_pass_reuses_the_kept_graph_and_stays_exact() -> None:
    eager, wrapped, _ = _models()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for model in (eager, wrapped):
        CALLS.clear()
        loss = model(x).square().sum()
        first = torch.autograd.grad(loss, [x], retain_graph=True)
        second = torch.autograd.grad(loss, [x], retain_graph=True)
        weights = torch.autograd.grad(loss, list(model.parameters()))
        results.append(([*first, *second, *weights], CALLS["block"]))
    (want, eager_calls), (got, calls) = results
    assert_same_grads(want, got)
    assert torch.equal(got[0], got[1])
    assert (eager_calls, calls) == (2, 4)


def test_the_kept_graph_is_freed_after_the_weight_pass_and_with_a_graph_dropped_before_it(
        ) -> None:
    _, wrapped, _ = _models()
    x = torch.randn(4, 8, requires_grad=True)
    refs = []
    for weight_pass in (True, False):
        loss = wrapped(x).square().sum()
        torch.autograd.grad(loss, [x], retain_graph=True)
        node = loss.grad_fn.next_functions[0][0].next_functions[0][0]
        kept = node.call.kept
        assert kept is not None
        refs = [weakref.ref(kept), weakref.ref(kept.outs[0][1])]  # and a replayed output
        del kept, node
        if weight_pass:
            torch.autograd.grad(loss, list(wrapped.parameters()), retain_graph=True)
            # every gradient taken: released though the outer graph is kept
            assert [ref() for ref in refs] == [None, None]
            del loss
        else:
            del loss  # the user drops the graph with no weight pass: no collection needed
            assert [ref() for ref in refs] == [None, None]


def _boundary_calls(loss: torch.Tensor) -> list[Any]:
    """The ``BoundaryCall`` of each boundary node in ``loss``'s graph."""
    calls, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "call"):
            calls.append(node.call)
        stack.extend(n for n, _ in node.next_functions)
    return calls


def test_a_full_backward_that_retains_the_graph_keeps_no_replay_and_stays_exact() -> None:
    # Only a restricted backward keeps its replay (some gradients left for a later pass). A
    # full one with retain_graph=True (two losses over one graph, a GAN's two backwards) takes
    # every gradient: a kept replay would hold each layer's activations, and the captured
    # gradients, for as long as the caller keeps the graph, as if nothing were checkpointed.
    eager, wrapped, _ = _models()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for model in (eager, wrapped):
        CALLS.clear()
        x.grad = None
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        first = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        if model is wrapped:
            assert [call.kept for call in _boundary_calls(loss)] == [None, None]
        loss.backward()
        results.append(([*first, x.grad, *(p.grad for p in model.parameters())],
                        CALLS["block"]))
    (want, eager_calls), (got, calls_run) = results
    assert_same_grads(want, got)
    assert (eager_calls, calls_run) == (2, 6)  # each backward replays both layers


def test_a_layer_with_an_output_discard_replays_in_each_pass_and_stays_exact() -> None:
    # An output discard's rebuild and node run once per forward (one-shot): a kept replay
    # would run them twice, so such a replay is not kept; the weight pass replays afresh. (The
    # eager twin discards nothing: its own graph, run twice, would need the output twice.)
    eager, _, _ = _models()
    _, wrapped, _ = _models(discard=True)
    x = torch.randn(4, 8, requires_grad=True)
    want, _, eager_calls = _split_backward(eager, x, "grad")
    got, _, calls = _split_backward(wrapped, x, "grad")
    assert_same_grads(want, got)
    assert (eager_calls["block"], calls["block"]) == (2, 2 * 3)


class _RaisingBlock(Block):
    """A Block whose hidden activation gets a gradient hook in forward (inside the body, so in
    the replay's graph) that raises while ``raising`` is set."""

    raising = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        up = self.up(h)
        if up.requires_grad:
            up.register_hook(self._maybe_raise)
        return h + self.down(torch.nn.functional.gelu(up))

    @classmethod
    def _maybe_raise(cls, grad: torch.Tensor) -> torch.Tensor:
        if cls.raising:
            raise ValueError("raised in the weight pass")
        return grad


def test_a_weight_pass_that_raises_can_be_run_again_as_in_eager() -> None:
    # The weight pass takes the last gradients, and ran the kept graph without retaining it;
    # a hook inside raised halfway, the graph was partly freed, and the retry (the user's
    # retain_graph=True keeps eager's graph) failed with autograd's "backward through the
    # graph a second time". Under retain_graph the kept graph is retained by every use now.
    torch.manual_seed(0)
    eager = nn.Sequential(_RaisingBlock(), _RaisingBlock())
    wrapped = copy.deepcopy(eager)
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block)
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for model in (eager, wrapped):
        CALLS.clear()
        _RaisingBlock.raising = False
        loss = model(x).square().sum()
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        _RaisingBlock.raising = True
        params = list(model.parameters())
        with pytest.raises(ValueError, match="raised in the weight pass"):
            torch.autograd.grad(loss, params, retain_graph=True)
        _RaisingBlock.raising = False
        dw = torch.autograd.grad(loss, params)
        results.append([dx, *dw])
    assert_same_grads(*results)


def test_a_weight_pass_that_raises_without_retaining_the_graph_replays_when_run_again() -> None:
    # Guards against: _from_kept (recompute.py) keeping call.kept after a weight pass that
    # raised without retain_graph: that pass had freed part of the kept graph, and the retry
    # read it again and failed with autograd's "backward through the graph a second time"
    # (as eager's own retry does) instead of replaying the block from its saved inputs.
    # Handed a gradient other than the input pass's (a clone), the pass reads the kept graph
    # from its outputs (NOTE [a weight pass from captured gradients] in kept_weights.py).
    torch.manual_seed(0)
    eager = _RaisingBlock()
    wrapped = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(wrapped)
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    _RaisingBlock.raising = False
    want = torch.autograd.grad(eager(x), [x, *eager.parameters()], g)
    out = wrapped(x)
    (dx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
    params = list(wrapped.parameters())
    _RaisingBlock.raising = True
    try:
        with pytest.raises(ValueError, match="raised in the weight pass"):
            torch.autograd.grad(out, params, g.clone())
    finally:
        _RaisingBlock.raising = False
    dw = torch.autograd.grad(out, params, g.clone())
    assert_same_grads(list(want), [dx, *dw])


class _GatedBlock(nn.Module):
    """A residual block whose gate (a Linear a forward hook keeps the output of, as an
    auxiliary loss's collector does) scales its hidden activation."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        CALLS["block"] += 1
        logits = self.gate(h)
        return h + torch.tanh(self.up(h)) * logits.sigmoid().mean(-1, keepdim=True)


def test_a_weight_pass_from_a_kept_graph_gives_hooked_outputs_their_own_gradients() -> None:
    # Guards against: replay_backward (recompute.py) placing a hooked output (NOTE [hooked
    # outputs leave with gradients] in hook_outputs.py) in the kept replay at its place among
    # the hooked outputs rather than after the call's own outputs: the weight pass from the
    # kept graph then paired the gate's logits with the block output's gradient (autograd:
    # "invalid gradient at index 1") instead of the auxiliary loss's.
    torch.manual_seed(0)
    eager = nn.Sequential(_GatedBlock(), _GatedBlock())
    wrapped = copy.deepcopy(eager)
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block, offload=False)
    x = torch.randn(4, 8, requires_grad=True)
    results, calls = [], []
    for model in (eager, wrapped):
        kept: list[torch.Tensor] = []
        for block in model:
            block.gate.register_forward_hook(lambda module, args, out: kept.append(out))
        CALLS.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the hook is a user hook: warned about once
            loss = model(x).square().sum() + torch.stack(kept).square().sum()
            (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
            dw = torch.autograd.grad(loss, list(model.parameters()))
        results.append([dx, *dw])
        calls.append(CALLS["block"])
    assert_same_grads(*results)
    assert calls == [2, 2 * 2]  # one replay each: the weight pass read the kept graph


def _weight_passes_in_threads(hook: Any = None) -> None:
    """An input pass, then three threads taking two halves and all of the parameters'
    gradients at once, five rounds (the race needs the threads to overlap): no error, and
    gradients torch.equal to the eager twin's. ``hook``: registered on every parameter."""
    torch.manual_seed(0)
    eager = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                            for _ in range(4)])
    wrapped = copy.deepcopy(eager)
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block)
    if hook is not None:
        for p in [*eager.parameters(), *wrapped.parameters()]:
            p.register_hook(hook)
    x = torch.randn(256, 64, requires_grad=True)
    for _ in range(5):
        results = []
        for model in (eager, wrapped):
            loss = model(x).square().sum()
            params = list(model.parameters())
            torch.autograd.grad(loss, [x], retain_graph=True)
            groups = [params[:8], params[8:], params]
            got: list[Any] = [None] * len(groups)

            def weight_pass(i: int, loss: torch.Tensor = loss) -> None:
                try:
                    got[i] = torch.autograd.grad(loss, groups[i], retain_graph=True)
                except RuntimeError as error:
                    got[i] = error

            threads = [threading.Thread(target=weight_pass, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not [g for g in got if isinstance(g, RuntimeError)]
            results.append([grad for grads in got for grad in grads])
        assert_same_grads(*results)


def test_threads_taking_gradients_from_one_kept_graph_at_once_get_eager_gradients() -> None:
    # Backwards through one retained graph from several threads at once are allowed in eager.
    # The thread whose gradients completed the set took them without retaining the kept graph,
    # freeing it under a thread still running it: autograd's "backward through the graph a
    # second time". The graph is now freed by reference, once no thread runs it.
    _weight_passes_in_threads()


def test_parameter_hooks_run_once_a_gradient_when_threads_share_a_kept_graph() -> None:
    # Each use of the kept graph pauses the parameters' hooks for its own gradient call, marked
    # by a prehook on the kept outputs' nodes: shared by the threads, so one use marked the
    # others' calls too and, done first, unmarked them while they still ran: their parameters'
    # hooks ran inside too (doubled twice, or not at all). Each use marks a view of its own.
    _weight_passes_in_threads(lambda grad: grad * 2)


# torch's own stage_backward_weight before 2.13 cannot start from a Python autograd Function's
# node (the boundary's): its _make_grads reads the node's _input_metadata, "invalid for this
# instance of _C._FunctionBase" (2.9 and 2.11). The pipelining test is skipped there too.
_TORCH_WEIGHT_PASS = pytest.mark.skipif(
    torch.__version__ < "2.13", reason="torch's stage_backward_weight fails on a Python "
    "Function's node before torch 2.13")


def _stage_backward(model: nn.Module, x: torch.Tensor, clone_grads: bool = False,
                    seen: Any = None) -> tuple[list[Any], tuple[int, int]]:
    """What a zero-bubble stage runs (torch.distributed.pipelining's own functions): an input
    pass that captures the gradients reaching the nodes feeding the parameters, then a weight
    pass from those nodes with those very tensors (``clone_grads``: with equal copies). The
    gradients and the products of each pass. ``seen``: called between the passes with the
    output's node."""
    backward = pytest.importorskip("torch.distributed.pipelining._backward")
    CALLS.clear()
    out = model(x)
    node = out.grad_fn
    with MatrixProducts() as products:
        (dx,), groups = backward.stage_backward_input([out], [torch.ones_like(out)], [x],
                                                      model.parameters())
        input_products = products.count
        if seen is not None:
            seen(node)
        del node
        if clone_grads:
            for group in groups:
                group["grads"] = [tuple(None if g is None else g.clone() for g in grads)
                                  for grads in group["grads"]]
        backward.stage_backward_weight(model.parameters(), groups)
    return [dx, *(p.grad for p in model.parameters())], \
        (input_products, products.count - input_products)


@_TORCH_WEIGHT_PASS
@pytest.mark.parametrize("cast", [False, True], ids=["fp32", "autocast"])
def test_a_weight_pass_handed_the_input_pass_gradients_computes_weight_gradients_only(
        cast: bool) -> None:
    # torch's weight pass hands each node the gradients it got in the input pass and computes
    # only the parameters' share from there (each linear's dW product). The boundary's kept
    # graph was read from its outputs: the weight pass ran the second linear's dX product again
    # (the first's dW needs it), one product a block more than eager. It now takes each
    # parameter's gradient from what the replay's own nodes got in the input pass (NOTE [a
    # weight pass from captured gradients] in pytree_ckpt/kept_weights.py): eager's products,
    # plus the replay's forward (two products a block) in the input pass. Under autocast
    # each weight reaches its product through a cast (ToCopyBackward): the captured gradient
    # is the product's, whatever lies between it and the parameter.
    eager, wrapped, _ = _models()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
        want, eager_products = _stage_backward(eager, x.clone().requires_grad_())
        assert CALLS["block"] == 2
        got, products = _stage_backward(wrapped, x.clone().requires_grad_())
    assert CALLS["block"] == 2 * 2  # one replay each, for both passes
    assert_same_grads(want, got)
    assert eager_products == (2 * 2, 2 * 2)  # two dX, then two dW products a block
    assert products == (eager_products[0] + 2 * 2, eager_products[1])


@_TORCH_WEIGHT_PASS
def test_a_weight_pass_handed_other_gradients_reads_the_kept_graph_from_its_outputs(
        ) -> None:
    # Equal gradients in other tensors (a weight pass that is not the one the capture
    # serves): read from the kept graph's outputs, as before, and exact.
    eager, wrapped, _ = _models()
    x = torch.randn(4, 8)
    want, eager_products = _stage_backward(eager, x.clone().requires_grad_(), True)
    got, products = _stage_backward(wrapped, x.clone().requires_grad_(), True)
    assert_same_grads(want, got)
    assert CALLS["block"] == 2 * 2
    # each block's second linear's dX product again, in the weight pass
    assert products == (eager_products[0] + 2 * 2, eager_products[1] + 2)


@_TORCH_WEIGHT_PASS
def test_a_parameter_with_a_gradient_hook_reads_the_kept_graph_from_its_outputs() -> None:
    # Autograd runs a parameter's hooks on a gradient it captures, and the pause that keeps
    # them to once a gradient marks a node of the call's own, which a weight pass from the
    # captured gradients has not: read from the outputs then, hooks run once, as in eager.
    eager, wrapped, _ = _models()
    for model in (eager, wrapped):
        for p in model.parameters():
            p.register_hook(lambda g: g * 2)
    x = torch.randn(4, 8)
    want, eager_products = _stage_backward(eager, x.clone().requires_grad_())
    got, products = _stage_backward(wrapped, x.clone().requires_grad_())
    assert_same_grads(want, got)
    assert products == (eager_products[0] + 2 * 2, eager_products[1] + 2)


class _TiedBlock(nn.Module):
    """One square linear used twice (its weight meets the input's path at two nodes), then a
    second linear."""

    def __init__(self) -> None:
        super().__init__()
        self.tied, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        CALLS["block"] += 1
        return h + self.down(torch.nn.functional.gelu(self.tied(torch.tanh(self.tied(h)))))


@_TORCH_WEIGHT_PASS
def test_a_weight_tied_twice_in_a_block_gets_eager_gradients_in_a_weight_pass() -> None:
    # Each of the tied weight's consumers got its own gradient in the input pass; from them,
    # the weight pass would need them clamped (NOTE [a weight pass from captured gradients]):
    # the kept graph is read from its outputs instead.
    torch.manual_seed(0)
    eager = nn.Sequential(_TiedBlock(), _TiedBlock())
    wrapped = copy.deepcopy(eager)
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block)
    x = torch.randn(4, 8)
    want, eager_products = _stage_backward(eager, x.clone().requires_grad_())
    got, products = _stage_backward(wrapped, x.clone().requires_grad_())
    assert_same_grads(want, got)
    assert CALLS["block"] == 2 * 2
    assert products[0] == eager_products[0] + 3 * 2  # the replays' forwards
    # the down linear's dX product again, and the second tied product's
    assert products[1] > eager_products[1]


class _OnlyTiedBlock(nn.Module):
    """One square linear used twice and nothing else: no parameter of it meets the input's
    path at one node."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        CALLS["block"] += 1
        return h + self.tied(torch.tanh(self.tied(h)))


@_TORCH_WEIGHT_PASS
def test_a_block_whose_every_weight_is_tied_twice_keeps_no_capture_and_stays_exact() -> None:
    # No parameter has one intermediate to take its gradient from (WeightCapture.of finds no
    # group and captures nothing): the kept graph keeps no capture, and the weight pass reads
    # it from its outputs, with eager's gradients and one replay per block.
    torch.manual_seed(0)
    eager = nn.Sequential(_OnlyTiedBlock(), _OnlyTiedBlock())
    wrapped = copy.deepcopy(eager)
    for block in wrapped:
        pytree_ckpt.apply_activation_checkpointing(block)
    captures: list[Any] = []
    x = torch.randn(4, 8)
    want, _ = _stage_backward(eager, x.clone().requires_grad_())
    got, _ = _stage_backward(wrapped, x.clone().requires_grad_(),
                             seen=lambda node: captures.append(node.call.kept.weights))
    assert_same_grads(want, got)
    assert CALLS["block"] == 2 * 2
    assert captures == [None]  # the last block's node: a kept graph, no capture


@_TORCH_WEIGHT_PASS
def test_the_captured_gradients_go_with_the_kept_graph() -> None:
    _, wrapped, _ = _models()
    refs: list[Any] = []

    def seen(node: Any) -> None:
        kept = node.call.kept
        assert kept is not None and kept.weights is not None
        refs.extend(weakref.ref(g) for _, grads in kept.weights.groups.values()
                    for g in grads if g is not None)

    _stage_backward(wrapped, torch.randn(4, 8, requires_grad=True), seen=seen)
    assert refs and [ref() for ref in refs] == [None] * len(refs)


class _SparseBlock(nn.Module):
    """A graph layer: a linear, then a product with a sparse adjacency matrix (an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        CALLS["block"] += 1
        return h + torch.sparse.mm(adj, self.lin(h))


def test_a_sparse_input_asked_in_an_input_pass_leaves_the_weight_pass_exact() -> None:
    # The input pass that keeps the replay's graph finds the nodes feeding the parameters
    # from the asked inputs' accumulators, reached through a view (NOTE [a weight pass from
    # captured gradients]): a sparse tensor has no view, and the input pass raised
    # NotImplementedError ("Could not run 'aten::view' ... 'SparseCPU'"), where eager's and the
    # earlier kept replay's gave gradients. Such an input now reads the kept graph from its
    # outputs in the weight pass: eager's gradients, one replay for both passes.
    torch.manual_seed(0)
    eager = _SparseBlock()
    wrapped = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(wrapped)
    h = torch.randn(4, 8)
    adj = torch.randn(4, 4).relu().to_sparse()
    results, calls = [], []
    for model in (eager, wrapped):
        CALLS.clear()
        hh, aa = h.clone().requires_grad_(), adj.clone().requires_grad_()
        loss = model(hh, aa).square().sum()
        dh, dadj = torch.autograd.grad(loss, [hh, aa], retain_graph=True)
        dw = torch.autograd.grad(loss, list(model.parameters()))
        results.append([dh, dadj.to_dense(), *dw])
        calls.append(CALLS["block"])
    assert_same_grads(*results)
    assert calls == [1, 2]  # the original pass and one replay, kept for the weight pass


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
@pytest.mark.parametrize("blocks", [1, 2], ids=["reused", "copied-back"])
@pytest.mark.parametrize("weight_pass", ["same-grads", "other-grads"])
def test_an_input_changed_in_place_between_the_input_and_weight_passes_is_refused(
        offload: bool, blocks: int, weight_pass: str) -> None:
    # Eager's weight pass refuses a stage input changed in place since the forward (the
    # linear saved it). The weight pass reads the kept replay's graph, which with offload on
    # was built on the restored copy, not on the caller's tensor: nothing checked its version.
    # One block (its window the last of the forward, whose device bytes backward reuses): the
    # weight pass read the changed bytes beside statistics of the old ones, the gradients of
    # no function. Two (the input's window copied back from host): the forward's bytes, where
    # eager refuses. Both now raise the boundary's error naming the input, no gradient taken.
    eager, wrapped, manager = _models(offload)
    results = []
    for model in (eager[:blocks], wrapped[:blocks]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = model(x)
        grad = torch.ones_like(out)
        torch.autograd.grad(out, [x], grad, retain_graph=True)
        with torch.no_grad():
            x.mul_(2)
        with pytest.raises(RuntimeError) as raised:
            torch.autograd.grad(out, list(model.parameters()),
                                grad if weight_pass == "same-grads" else grad.clone())
        results.append((raised.type, str(raised.value)))
        del out, raised  # its traceback holds the graph
    assert "modified by an inplace operation" in results[0][1]
    assert issubclass(results[1][0], pytree_ckpt.CheckpointError)
    assert "args[0]" in results[1][1] and "version 1" in results[1][1]
    # autograd.grad writes no .grad; neither may the refused node (a replay accumulating
    # into parameters it does not hand back, as a plain function's replay does).
    assert all(p.grad is None for p in wrapped.parameters())
    if manager is not None:
        stats = manager.stats()
        assert stats["host_buffers_in_use"] == 0
        assert stats["restored_bytes"] == stats["offloaded_bytes"] == blocks * x.nbytes


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_an_input_hook_registered_after_the_call_runs_in_the_input_pass_only_as_in_eager(
        offload: bool) -> None:
    # A hook put on the stage input after the forward: eager runs it in the input pass, with
    # its gradient, and not in the weight pass, which never reaches the input. The boundary's
    # weight pass runs from the kept graph (the input's gradient not asked, its saved inputs
    # unpacked again for the in-place check, offload's restored copies among them): the same
    # single call with the same gradient, and no replay.
    eager, wrapped, manager = _models(offload)
    results, calls = [], []
    for model in (eager, wrapped):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
        seen: list[torch.Tensor | None] = []
        loss = model(x).square().sum()
        x.register_hook(lambda g: seen.append(g))
        CALLS.clear()
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        dw = torch.autograd.grad(loss, list(model.parameters()))
        results.append([dx, *dw, *seen])
        calls.append((len(seen), CALLS["block"]))
    assert_same_grads(*results)
    assert calls == [(1, 0), (1, 2)]  # one hook call each; two replays, none in the weight pass
    if manager is not None:
        assert manager.stats()["host_buffers_in_use"] == 0


class _TwoOutputBlock(nn.Module):
    """A residual output and a side output (an auxiliary head) from one activation, and a
    linear the forward never calls (an expert that got no token)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.side = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.idle = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        CALLS["block"] += 1
        act = torch.nn.functional.gelu(self.up(h))
        return h + self.down(act), self.side(act)


def _two_output_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = _TwoOutputBlock()
    wrapped = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(wrapped)
    return eager, wrapped


def test_a_weight_pass_reaching_an_output_the_input_pass_did_not_gets_eager_gradients(
        ) -> None:
    # The input pass backpropagates the residual output only (the side output's gradient is
    # None there); the weight pass hands that very gradient again, and one for the side output
    # too. The captured gradients cover the residual output alone: the weight pass must read
    # the kept graph from its outputs (WeightCapture.covers), or the side head's weights, and
    # the shared up projection's share of it, would be missing.
    results = []
    for model in _two_output_models():
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        main, side = model(x)
        grad_main = torch.ones_like(main)
        (dx,) = torch.autograd.grad(main, [x], grad_main, retain_graph=True)
        dw = torch.autograd.grad([main, side], list(model.parameters()),
                                 [grad_main, torch.full_like(side, 0.5)], allow_unused=True)
        results.append([dx, *dw])
    assert_same_grads(*results)
    assert results[1][-1] is None and results[1][-2] is None  # the idle linear: none, as eager


def test_a_weight_pass_from_the_captured_gradients_asking_some_parameters_gets_those(
        ) -> None:
    # A weight pass handed the input pass's own gradients at the boundary's node (what
    # stage_backward_weight does), but asking a subset of the parameters (one linear's weight;
    # an up bias and the idle linear's weight): the captured groups not asked are skipped, the
    # idle weight gets None, and the rest come from the captured gradients.
    eager, wrapped = _two_output_models()
    products: list[int] = []
    for names in (["down.weight"], ["up.bias", "idle.weight"]):
        results = []
        for model in (eager, wrapped):
            CALLS.clear()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2),
                            requires_grad=True)
            main, side = model(x)
            node = main.grad_fn  # the boundary's (or, eager, the residual add's)
            handed: list[Any] = []
            hook = node.register_prehook(lambda grads: handed.extend(grads))
            (dx,) = torch.autograd.grad(main, [x], torch.ones_like(main), retain_graph=True)
            hook.remove()
            edges = [torch.autograd.graph.GradientEdge(node, k)
                     for k, g in enumerate(handed) if g is not None]
            params = [p for name, p in model.named_parameters() if name in names]
            with MatrixProducts() as counted:
                dw = torch.autograd.grad(edges, params, [g for g in handed if g is not None],
                                         allow_unused=True)
            results.append([dx, *dw])
            products.append(counted.count)
        assert_same_grads(*results)
        assert CALLS["block"] == 2  # the call and one replay: none in the weight pass
    # The weight passes' products, eager then wrapped: down's dW alike; up's bias from the
    # gradient its node got in the input pass, where eager (from the residual add) computes
    # down's dX again. Read from the outputs, the wrapped run would compute that dX too.
    assert products == [1, 1, 1, 0]


class _WithAux(nn.Module):
    """A block that also returns a scalar statistic (an auxiliary output that requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.block(h)
        return out, out.mean()


@pytest.mark.parametrize("weight_pass", ["grad", "backward"])
def test_an_output_no_loss_reads_gets_no_gradient_in_a_weight_pass_from_the_kept_graph(
        weight_pass: str) -> None:
    # The loss reads the layer's first output only: its second (a statistic that requires
    # grad) gets None in both passes. The weight pass takes its gradients from the kept graph,
    # handed only the outputs that get one (KeptReplay.pairs): a None handed on with its
    # output fails in the engine ("None, but the corresponding Tensor requires grad").
    torch.manual_seed(0)
    eager = _WithAux()
    wrapped = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(wrapped)
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for model in (eager, wrapped):
        CALLS.clear()
        params = list(model.parameters())
        out, _ = model(x)
        loss = out.square().sum()
        (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        if weight_pass == "grad":
            dw = list(torch.autograd.grad(loss, params))
        else:
            loss.backward(inputs=params)
            dw = [p.grad for p in params]
        results.append([dx, *dw])
        assert CALLS["block"] == (1 if model is eager else 2)  # one replay, for both passes
    assert_same_grads(*results)



def test_a_weight_pass_handed_a_gradient_changed_in_place_since_the_input_pass_uses_it(
        ) -> None:
    # The weight pass is handed the very tensor the input pass was, but the caller scaled it
    # in place in between (a loss scale applied late): the gradients captured in the input
    # pass are of the old values, so the parameters' gradients are read from the kept graph
    # with the new ones (WeightCapture.covers checks each tensor's version), as eager's are.
    eager, wrapped, _ = _models()
    x = torch.randn(4, 8, requires_grad=True)
    grad = torch.randn(4, 8)
    results = []
    for model in (eager[0], wrapped[0]):
        CALLS.clear()
        params = list(model.parameters())
        out = model(x)
        g = grad.clone()
        (dx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
        g.mul_(3.0)
        dw = torch.autograd.grad(out, params, g)
        results.append([dx, *dw])
        assert CALLS["block"] == (1 if model is eager[0] else 2)  # one replay, both passes
    assert_same_grads(*results)


class _IndexedBlock(nn.Module):
    """A DSA-style layer: a trainable indexer (trained by a loss of its own elsewhere, so it
    requires grad) run under no-grad through ``reuse_during_recompute``; the language-model
    loss never reaches its parameters, in eager or checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer, self.proj = nn.Linear(8, 8), nn.Linear(8, 8)

    @torch.no_grad()
    def pick(self, h: torch.Tensor) -> torch.Tensor:
        return self.indexer(h).topk(2, dim=-1).indices

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(self.pick, h)
        return h + self.proj(h).gather(-1, ids).sum(-1, keepdim=True)


@_TORCH_WEIGHT_PASS
@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="documented limit (docs/limits.md, zero-bubble weight pass row; "
                   "scaling.md, Pipeline parallelism): torch's stage_backward_weight asks the "
                   "boundary's node for the indexer's parameters (every parameter is an input "
                   "of the node), the node returns None and torch raises 'appears to not have "
                   "been used in the graph'; eager never reaches them")
def test_a_trainable_indexer_run_under_no_grad_passes_torchs_zero_bubble_weight_pass_as_eager(
) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_IndexedBlock(), _IndexedBlock())
    model = copy.deepcopy(eager)
    pytree_ckpt.checkpoint_layers(model)
    x = torch.randn(4, 8, requires_grad=True)
    expected = _stage_backward(eager, x.detach().requires_grad_())[0]
    got = _stage_backward(model, x.detach().requires_grad_())[0]
    assert_same_grads(expected, got)


@_TORCH_WEIGHT_PASS
def test_a_frozen_indexer_run_under_no_grad_passes_torchs_zero_bubble_weight_pass_as_eager(
) -> None:
    # The documented fix for the limit above (scaling.md): freeze what no loss trains.
    torch.manual_seed(0)
    eager = nn.Sequential(_IndexedBlock(), _IndexedBlock())
    for block in eager:
        block.indexer.requires_grad_(False)
    model = copy.deepcopy(eager)
    pytree_ckpt.checkpoint_layers(model)
    x = torch.randn(4, 8)
    expected = _stage_backward(eager, x.clone().requires_grad_())[0]
    got = _stage_backward(model, x.clone().requires_grad_())[0]
    assert_same_grads(expected, got)
