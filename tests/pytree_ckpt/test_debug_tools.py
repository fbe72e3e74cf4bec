"""The debugging and analysis tools a user runs around a model whose layers are checkpointed
(anomaly mode, torch.profiler, FlopCounterMode, module trackers, MemTracker under
FakeTensorMode, dispatch-mode loggers, the user's own saved-tensor hooks): the model's loss
and gradients stay eager's bit for bit in fp32 while the tool is on, and the tool's own
result is what it gives for torch's reentrant checkpoint (helper QK)."""

from __future__ import annotations

import collections
import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import pytree_ckpt


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class _Stack(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch_checkpoint(layer, x, use_reentrant=True) if self.reentrant else layer(x)
        return self.head(x).sum()


def _three() -> tuple[_Stack, _Stack, _Stack]:
    """Eager, this library's and torch's reentrant checkpoint, with one set of weights."""
    torch.manual_seed(0)
    eager = _Stack()
    ours = copy.deepcopy(eager)
    for layer in ours.layers:
        pytree_ckpt.apply_activation_checkpointing(layer)
    theirs = copy.deepcopy(eager)
    theirs.reentrant = True
    return eager, ours, theirs


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(7)  # one dropout mask per step, whichever model
    x = x.clone().requires_grad_()
    loss = model(x)
    loss.backward()
    out = [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("tool", ["detect_anomaly", "detect_anomaly_no_nan", "profiler",
                                  "save_on_cpu", "disable_saved_tensors_hooks",
                                  "allow_mutation_on_saved_tensors", "deterministic"])
def test_a_step_under_a_debugging_tool_gives_eager_gradients(tool: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    tools: dict[str, Callable[[], Any]] = {
        "detect_anomaly": torch.autograd.detect_anomaly,
        "detect_anomaly_no_nan": lambda: torch.autograd.detect_anomaly(check_nan=False),
        "profiler": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                    profile_memory=True, with_stack=True),
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "disable_saved_tensors_hooks": lambda: torch.autograd.graph.disable_saved_tensors_hooks(
            "a tool of the user's"),
        "allow_mutation_on_saved_tensors": torch.autograd.graph.allow_mutation_on_saved_tensors,
        "deterministic": contextlib.nullcontext,
    }
    eager, ours, _ = _three()
    x = torch.randn(4, 8)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(tool == "deterministic" or was_deterministic)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # anomaly mode's own notice
            for _ in range(2):
                with tools[tool]():
                    expected = _step(eager, x)
                with tools[tool]():
                    got = _step(ours, x)
                assert _same(expected, got)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def test_flop_counter_counts_the_recompute_as_torchs_reentrant_checkpoint_does() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    eager, ours, theirs = _three()
    x = torch.randn(4, 8)
    totals = {}
    for name, model in (("eager", eager), ("ours", ours), ("theirs", theirs)):
        with FlopCounterMode(display=False) as counter:
            totals[name] = (_step(model, x), counter.get_total_flops(),
                            counter.get_flop_counts())
    assert _same(totals["eager"][0], totals["ours"][0])
    assert totals["ours"][1] == totals["theirs"][1] > totals["eager"][1]
    # Each layer's submodules: forward, recompute and backward, as under torch's checkpoint.
    ours_counts, theirs_counts = totals["ours"][2], totals["theirs"][2]
    for i in range(3):
        for sub in ("up", "down"):
            assert (sum(ours_counts[f"_Stack.layers.{i}.{sub}"].values())
                    == sum(theirs_counts[f"_Stack.layers.{i}.{sub}"].values()))


def test_module_tracker_sees_the_replay_inside_its_layer_in_backward() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.module_tracker import ModuleTracker

    class Parents(TorchDispatchMode):
        def __init__(self, tracker: ModuleTracker) -> None:
            super().__init__()
            self.tracker = tracker
            self.seen: list[tuple[str, frozenset[str], bool]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.seen.append((func.__name__, frozenset(self.tracker.parents),
                              self.tracker.is_bw))
            return func(*args, **(kwargs or {}))

    eager, ours, _ = _three()
    x = torch.randn(4, 8)
    runs = {}
    for name, model in (("eager", eager), ("ours", ours)):
        tracker = ModuleTracker()
        with tracker, Parents(tracker) as parents:
            runs[name] = (_step(model, x), parents.seen)
    assert _same(runs["eager"][0], runs["ours"][0])
    # The replay's forward addmm of each layer's up projection, in backward, under its module.
    replayed = [parents_ for op, parents_, bw in runs["ours"][1] if op == "addmm.default" and bw]
    for i in range(3):
        assert any(f"_Stack.layers.{i}.up" in p for p in replayed)
    # The backward matmuls are attributed as in eager: the same module sets, in the same order.
    def mms(seen: list[tuple[str, frozenset[str], bool]]) -> list[frozenset[str]]:
        return [p for op, p, bw in seen if op == "mm.default" and bw]
    assert mms(runs["ours"][1]) == mms(runs["eager"][1])


def test_a_dispatch_mode_logger_sees_torchs_reentrant_checkpoints_ops_after_the_first_step(
        ) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    eager, ours, theirs = _three()
    x = torch.randn(4, 8)
    logged = {}
    for name, model in (("eager", eager), ("ours", ours), ("theirs", theirs)):
        _step(model, x)  # a module's first calls run checks of their own
        with Log() as log:
            logged[name] = (_step(model, x), log.ops)
    assert _same(logged["eager"][0], logged["ours"][0])
    ours_ops, theirs_ops = logged["ours"][1], logged["theirs"][1]
    # torch detaches each layer input for its replay; the boundary aliases it.
    assert ours_ops - theirs_ops == collections.Counter({"aten.alias.default": 3})
    assert theirs_ops - ours_ops == collections.Counter({"aten.detach.default": 3})


def test_a_fake_tensor_memory_estimate_with_mem_tracker_gives_torchs_reentrant_peak() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(kind: str, fake: bool) -> int:
        with FakeTensorMode() if fake else contextlib.nullcontext():
            torch.manual_seed(0)
            model = _Stack(reentrant=kind == "theirs")
            if kind == "ours":
                for layer in model.layers:
                    pytree_ckpt.apply_activation_checkpointing(layer)
            x = torch.randn(256, 8, requires_grad=True)
            tracker = MemTracker()
            tracker.track_external(model)
            with warnings.catch_warnings(), tracker:
                warnings.simplefilter("ignore", UserWarning)  # finding QK-1's warning
                for i in range(2):
                    model(x).backward()
                    if i == 0:
                        tracker.reset_mod_stats()
            return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    assert peak("ours", True) == peak("theirs", True) == peak("ours", False) \
        < peak("eager", True)


def test_a_fake_tensor_step_through_a_checkpointed_layer_warns_as_eager_does() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def warned(wrap: bool) -> list[str]:
        was = torch.is_warn_always_enabled()
        torch.set_warn_always(True)  # torch warns once per process otherwise
        try:
            with warnings.catch_warnings(record=True) as caught, FakeTensorMode():
                warnings.simplefilter("always")
                torch.manual_seed(0)
                layer = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
                if wrap:
                    pytree_ckpt.apply_activation_checkpointing(layer)
                x = torch.randn(2, 4, requires_grad=True)
                layer(x).sum().backward()
                assert x.grad is not None and x.grad.shape == x.shape
        finally:
            torch.set_warn_always(was)
        return [str(w.message) for w in caught if "data pointer of FakeTensor" in str(w.message)]

    assert warned(False) == []
    assert warned(True) == []


def test_an_input_changed_in_place_after_the_call_under_allow_mutation_gives_eager_gradients(
        ) -> None:
    # torch.autograd.graph.allow_mutation_on_saved_tensors() clones a saved tensor when it is
    # changed in place: eager's backward then runs. The boundary saves its inputs through
    # ctx.save_for_backward, which the context's hook sees: the replay reads the clone, as
    # eager's LayerNorm backward does (without the context both refuse).
    eager, ours, _ = _three()

    def changed(model: _Stack) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            x = x * 1.0
            for layer in model.layers:
                y = layer(x)
                x.mul_(2)  # the layer's input, saved for its backward (or replay)
                x = y
            return model.head(x).sum()
        return forward

    eager.forward = changed(eager)  # type: ignore[method-assign]
    ours.forward = changed(ours)  # type: ignore[method-assign]
    x = torch.randn(4, 8)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        expected = _step(eager, x)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        got = _step(ours, x)
    assert _same(expected, got)


# helper QN: c4202d1's docs (census.md: "so is a step under FakeTensorMode, offload included";
# offload.md: a fake step as a memory estimate) over a layer with buffers.
def _qn_fake_step(model_of: Callable[[], nn.Module], wrap: bool) -> tuple[int, ...]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.manual_seed(0)
        layer = model_of()
        if wrap:
            pytree_ckpt.apply_activation_checkpointing(layer)
        x = torch.randn(16, 8, requires_grad=True)
        layer(x).sum().backward()
        assert x.grad is not None
        return tuple(x.grad.shape)


def test_a_fake_tensor_step_through_a_layer_whose_batchnorm_trains_runs_as_eager() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.25))

    assert _qn_fake_step(model, True) == _qn_fake_step(model, False)


class _QnScaled(nn.Module):
    """A buffer the forward reads and never changes (a rotary table, a mask, a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("model", [
    lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8).eval()), _QnScaled,
], ids=["frozen batchnorm", "a buffer read"])
def test_a_fake_tensor_step_through_a_layer_with_an_unchanged_buffer_runs_as_eager(
        model: Callable[[], nn.Module]) -> None:
    assert _qn_fake_step(model, False) == (16, 8)
    assert _qn_fake_step(model, True) == (16, 8)


class _QqWrapperSubclassBuffer(nn.Module):
    """A layer holding a wrapper-subclass buffer (torch's TwoTensor, as a DTensor is one),
    unchanged by its forward."""

    def __init__(self) -> None:
        from torch.testing._internal.two_tensor import TwoTensor
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", TwoTensor(torch.ones(8), torch.ones(8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.a


def test_a_fake_tensor_step_through_a_layer_with_a_wrapper_subclass_buffer_runs_as_eager() -> None:
    assert _qn_fake_step(_QqWrapperSubclassBuffer, True) == \
        _qn_fake_step(_QqWrapperSubclassBuffer, False)


def test_a_real_step_through_layers_with_subclass_buffers_written_by_a_kernel_gives_eager() -> None:
    # without_values must leave real subclasses (one with its own storage, a wrapper one)
    # compared: a buffer written through .data (no version bump) is still seen.
    from torch.testing._internal.two_tensor import TwoTensor

    class Sub(torch.Tensor):
        pass

    class Layer(nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            b = torch.zeros(4)
            self.register_buffer("b", b.as_subclass(Sub) if kind == "sub" else
                                 TwoTensor(b.clone(), b.clone()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x) * (1 + self.b)
            self.b.data.add_(0.5)
            return y

    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.a if isinstance(t, TwoTensor) else t.as_subclass(torch.Tensor)

    for kind in ("sub", "two"):
        models = []
        for ours in (False, True):
            torch.manual_seed(0)
            models.append(nn.Sequential(Layer(kind), nn.Linear(4, 1)))
            if ours:
                pytree_ckpt.apply_activation_checkpointing(models[-1][0])
        torch.manual_seed(1)
        for _ in range(2):
            x = torch.randn(3, 4, requires_grad=True)
            for m in models:
                m.zero_grad()
                m(x).sum().backward()
        eager, ours_model = models
        assert all(torch.equal(plain(p.grad), plain(q.grad))
                   for p, q in zip(eager.parameters(), ours_model.parameters()))
        assert torch.equal(plain(eager[0].b), plain(ours_model[0].b))


# helper QR: 841d3df's without_values asks torch's is_fake, which raises AssertionError on a
# wrapper subclass whose __tensor_flatten__ names an inner attribute left None (an optional
# zero point), where the storage test before it answered "has values".
class _QROptional(torch.Tensor):
    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor | None = None) -> _QROptional:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, a.shape, dtype=a.dtype, device=a.device, strides=a.stride())

    def __init__(self, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
        self.a = a
        self.b = b

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Any], meta: Any, size: Any, stride: Any
                             ) -> _QROptional:
        return _QROptional(inner["a"], inner["b"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        def unwrap(t: Any) -> Any:
            return t.a if isinstance(t, _QROptional) else t
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                    torch.ops.aten.clone.default):
            return _QROptional(out)
        return out


class _QRLayerWithOptionalBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", _QROptional(torch.full((8,), 1.5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.a


def test_a_layer_with_a_wrapper_subclass_buffer_with_an_unset_inner_tensor_gives_eager_gradients(
        ) -> None:
    torch.manual_seed(0)
    eager = _QRLayerWithOptionalBuffer()
    torch.manual_seed(0)
    layer = _QRLayerWithOptionalBuffer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    eager(x).square().sum().backward()
    layer(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), layer.parameters()))


@pytest.mark.parametrize("kind", ["TwoTensor", "jagged nested", "quantized", "Parameter subclass"])
def test_without_values_keeps_real_subclass_tensors_compared(kind: str) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    from pytree_ckpt.addresses import without_values

    class _Param(nn.Parameter):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated
        tensor = {"TwoTensor": lambda: TwoTensor(torch.ones(8), torch.ones(8)),
                  "jagged nested": lambda: torch.nested.nested_tensor(
                      [torch.ones(2, 8), torch.ones(3, 8)], layout=torch.jagged),
                  "quantized": lambda: torch.quantize_per_tensor(torch.ones(8), 0.1, 0,
                                                                 torch.qint8),
                  "Parameter subclass": lambda: _Param(torch.ones(8), requires_grad=False)}[kind]()
    assert without_values(tensor) is False


class _QRLayerWritingItsOptionalBuffer(nn.Module):
    """_QRLayerWithOptionalBuffer whose forward doubles the buffer's inner tensor: a write the
    wrapper's version does not show, found only by comparing the buffer's values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", _QROptional(torch.full((8,), 1.5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scale.a.clone()
        self.scale.a.mul_(2)
        return self.lin(x) * s


def test_a_wrapper_subclass_buffer_with_an_unset_inner_tensor_written_in_forward_gives_eager_grads(
        ) -> None:
    # helper RG (mutation of addresses.without_values): a subclass torch's is_fake walk fails
    # on is a real tensor with values; taken for one without (the except branch returning
    # True), its write was not seen and the replay read the doubled buffer.
    torch.manual_seed(0)
    eager = _QRLayerWritingItsOptionalBuffer()
    torch.manual_seed(0)
    layer = _QRLayerWritingItsOptionalBuffer()
    pytree_ckpt.apply_activation_checkpointing(layer)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for _ in range(2):
        eager(x).square().sum().backward()
        layer(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), layer.parameters()))
    assert torch.equal(eager.scale.a, layer.scale.a)
