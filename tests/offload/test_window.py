"""The window rule and restores, at the edges: which saved tensors a window takes, and which
bytes backward gets back when the saved storage changed after forward."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from tests.conftest import GradIntoSaved, assert_same_grads
from tests.offload.blocks import grads_with_last_input_changed, manager
from tests.offload.simulated import POISON


def test_a_tensor_saved_in_a_window_on_a_storage_of_none_of_its_tensors_is_saved_as_usual(
        ) -> None:
    # Guards against: _pack drops ``key not in window.keys`` (offloads whatever is saved in the
    # block).
    m = manager()
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1.0
    with m.window([h]):
        y = torch.tanh(h @ h)  # mm saves h (the window's storage); tanh saves y (not one)
    assert m.stats()["offloaded_bytes"] == h.untyped_storage().nbytes()
    y.sum().backward()
    got = x.grad.clone()
    x.grad = None
    h = x * 1.0
    torch.tanh(h @ h).sum().backward()
    assert torch.equal(got, x.grad)


def test_a_storage_of_exactly_min_bytes_is_offloaded() -> None:
    # Guards against: ``nbytes < min_bytes`` -> ``nbytes <= min_bytes`` (docs: *smaller* stays).
    x = torch.randn(32, 32, requires_grad=True)
    m = manager(min_bytes=x.untyped_storage().nbytes())
    h = x * 1.0
    with m.window([h]):
        loss = h.square().sum()
    stats = m.stats()
    assert stats["offloaded_bytes"] == x.untyped_storage().nbytes()
    assert stats["below_min_bytes"] == 0
    loss.backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_a_parameter_passed_as_a_window_tensor_is_not_offloaded_through_a_detached_alias(
        ) -> None:
    # Guards against: _open keys parameters' storages too. ``p.detach()`` is neither a Parameter
    # nor a view of one, so only the missing key keeps the whole parameter storage off the host.
    m = manager()
    p = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1.0
    with m.window([h, p]):
        loss = (h * p.detach()).sum()  # saves the detached alias of p (for h's gradient)
    assert m.stats()["offloaded_bytes"] == 0
    loss.backward()
    assert torch.equal(x.grad, p.detach())


def test_a_parameter_saved_in_a_window_that_holds_its_storage_is_never_offloaded() -> None:
    # Guards against: _pack drops its parameter check and relies on _open alone. Called
    # directly, without ``resident``, a window given a detached alias of ``p`` has p's storage
    # as its own (the alias may be offloaded, docs/offload.md); ``p`` itself, saved by autograd
    # there, is a parameter and stays resident.
    m = manager()
    p = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    with m.window([p.detach()]):
        loss = (x * p).sum()  # saves p itself (for x's gradient)
    assert m.stats()["offloaded_bytes"] == 0
    loss.backward()
    assert torch.equal(x.grad, p.detach())
    assert m.stats()["restored_bytes"] == 0


def test_a_detached_alias_of_a_resident_parameter_stays_on_the_device() -> None:
    # ``p.detach()`` is neither a Parameter nor a view of one: without ``resident`` its storage
    # is the window's, and the whole parameter would be copied to host (and restored as a
    # second copy) once per window.
    # An alias that requires grad (``p.detach().requires_grad_()``, as a frozen-weight trick
    # does) and a view of an alias are the same storage.
    p = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    aliases = {"detach": lambda: p.detach(),
               "detach, requires grad": lambda: p.detach().requires_grad_(),
               "view of a detach": lambda: p.detach()[:, :32],
               "view of a detach that requires grad": lambda: p.detach().requires_grad_()[:, :32]}
    for kind, make in aliases.items():
        for resident, copied in (((), p.untyped_storage().nbytes()), ((p,), 0)):
            m = manager()
            alias = make()
            with m.window([alias], resident=resident):
                loss = (x[:, :alias.shape[1]] * alias).sum()  # saves the alias (x's gradient)
            assert m.stats()["offloaded_bytes"] == copied, kind
            x.grad = None
            loss.backward()
            assert torch.equal(x.grad[:, :alias.shape[1]], p.detach()[:, :alias.shape[1]]), kind


def test_a_checkpointed_module_keeps_a_detached_alias_of_its_own_parameter_resident() -> None:
    import pytree_ckpt

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))

        def forward(self, x: torch.Tensor, frozen_weight: torch.Tensor) -> torch.Tensor:
            return (x @ self.weight) * frozen_weight

    m = manager()
    layer = Scaled()
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1.0
    out = pytree_ckpt.checkpointed(layer, offload=m)(h, layer.weight.detach())
    # Only h: the alias of layer.weight stays where the parameter is.
    assert m.stats()["offloaded_bytes"] == h.untyped_storage().nbytes()
    out.sum().backward()
    got = [x.grad, layer.weight.grad]
    x.grad = layer.weight.grad = None
    ((x * 1.0) @ layer.weight * layer.weight.detach()).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.weight.grad)


def test_a_checkpointed_module_keeps_a_detached_alias_of_its_frozen_parameter_resident() -> None:
    # Guards against only the trainable parameters being passed as resident: a frozen one
    # (a LoRA base weight, a frozen embedding passed on as a table) is on the device for good
    # too, and a copy of its alias to host saves nothing.
    import pytree_ckpt

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))
            self.base = nn.Parameter(torch.randn(64, 64), requires_grad=False)

        def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return (x @ self.weight) * table + x @ self.base

    m = manager()
    layer = Gated()
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1.0
    out = pytree_ckpt.checkpointed(layer, offload=m)(h, layer.base.detach())
    assert m.stats()["offloaded_bytes"] == h.untyped_storage().nbytes()  # only h
    out.sum().backward()
    got = [x.grad, layer.weight.grad]
    x.grad = layer.weight.grad = None
    h = x * 1.0
    ((h @ layer.weight) * layer.base.detach() + h @ layer.base).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.weight.grad)


class _Alias(torch.autograd.Function):
    """Returns its input's storage as a new tensor: ``w.detach()``, with a graph (a non-leaf
    that is no view, on a parameter's storage), as a weight-tying Function may."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_a_custom_function_alias_of_a_resident_parameter_stays_on_the_device() -> None:
    # Guards against: window_keys checking the resident storages only for leaves and views of
    # leaves. _Alias.apply(p) is neither (a non-leaf with AliasBackward, no _base), so the whole
    # parameter was copied to host and restored as a second copy in backward, at every window
    # (gradients were right; the bytes were not): offloaded 4096 + 512 bytes, not 512.
    p = nn.Parameter(torch.randn(32, 32))
    alias = _Alias.apply(p)
    assert not alias.is_leaf and alias._base is None
    x = torch.randn(4, 32, requires_grad=True)
    for resident, copied in (((), p.untyped_storage().nbytes()), ((p,), 0)):
        m = manager()
        with m.window([x, alias], resident=resident):
            loss = (x @ alias).square().sum()  # mm saves both x and the alias
        assert m.stats()["offloaded_bytes"] == x.untyped_storage().nbytes() + copied
        loss.backward()
        stats = m.stats()
        assert stats["restored_bytes"] == x.untyped_storage().nbytes() + copied
        assert stats["host_buffers_in_use"] == 0

    # Through a boundary, which passes its module's parameters as resident: only h is copied.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32))

        def forward(self, h: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
            return torch.tanh(h @ self.weight) @ tied

    m = manager()
    layer = Tied()
    h = x * 1.0
    x.grad = None
    out = pytree_ckpt.checkpointed(layer, offload=m)(h, _Alias.apply(layer.weight))
    assert m.stats()["offloaded_bytes"] == h.untyped_storage().nbytes()
    out.sum().backward()
    assert m.stats()["restored_bytes"] == h.untyped_storage().nbytes()
    got = [x.grad, layer.weight.grad]
    x.grad = layer.weight.grad = None
    (torch.tanh((x * 1.0) @ layer.weight) @ _Alias.apply(layer.weight)).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.weight.grad)


def test_a_tensor_changed_in_place_after_its_save_and_then_dropped_is_refused_like_eager(
        ) -> None:
    # A stats() read lets go of the copy's device bytes (and its alias) at once on CPU: the
    # change it had seen must still be refused, not read from host (helper DJ).
    m = manager()
    x = torch.randn(64, 16, requires_grad=True)
    h = x * 1.0
    with m.window([h]):
        first = h.square().sum()   # saves h at version 0
        h.mul_(2)
        second = h.square().sum()  # saves h at version 1: a second copy of the storage
    del h
    assert m.stats()["offloaded_bytes"] == 2 * x.untyped_storage().nbytes()
    with pytest.raises(pytree_ckpt.CheckpointError,
                       match=r"(?s)window tensor #0 .*modified in place.*version 0 \(when saved\)"
                             r".*version 1"):
        (first + second).backward()


def test_a_change_through_a_detached_alias_after_the_copy_let_go_restores_the_saved_bytes(
        ) -> None:
    # Guards against: _unpack drops its own ``copy.restore()``. The window's copy for the storage
    # was replaced by a fresh one after an in-place change the first copy no longer watched
    # (made through a detach() alias once the saved tensor had died and the copy had let go:
    # the gap NOTE [in-place check] names); the first save's handle must still get its own
    # copy back.
    m = manager()
    x = torch.randn(64, 16, requires_grad=True)
    buf = torch.randn(64, 16)
    with m.window([buf]):
        saved = buf.detach()       # no view: the saved tensor is its own source
        first = (saved * x).sum()  # saves it at version 0
        del saved
        m.stats()                  # lets go of the copy's device bytes (done at once on CPU)
        buf.mul_(2)                # shares saved's version counter, unwatched now
        second = (buf * x).sum()   # saves buf at version 1: a second copy of the storage
    original = buf / 2
    del buf
    assert m.stats()["offloaded_bytes"] == 2 * x.untyped_storage().nbytes()
    (first + second).backward()
    # d/dx [sum(b * x) + sum(2b * x)] = b + 2b, from the bytes each save had (the first save
    # read back changed would give 2b + 2b)
    assert torch.equal(x.grad, original + 2 * original)


def test_a_storage_regrown_elsewhere_after_forward_is_copied_back_from_host_not_reused() -> None:
    # Guards against: _storage_intact compares only nbytes, not the address. The last layer's input
    # is freed and regrown to the same size at another address, holding other bytes: backward must
    # read the host copy, not the regrown storage.
    blockers: list[torch.Tensor] = []

    def regrow_elsewhere(h: torch.Tensor) -> None:
        storage, nbytes, address = h.untyped_storage(), h.untyped_storage().nbytes(), h.data_ptr()
        for _ in range(100):  # the allocator may hand the same address back: hold it until not
            storage.resize_(0)
            blockers.append(torch.empty(nbytes, dtype=torch.uint8))
            storage.resize_(nbytes)
            if storage.data_ptr() != address:
                break
        assert storage.data_ptr() != address and storage.nbytes() == nbytes
        # Other bytes, written through a tensor with its own version counter (h's is untouched).
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(POISON)

    m = manager()
    expected, got = grads_with_last_input_changed(m, regrow_elsewhere)
    assert_same_grads(expected, got)
    assert m.stats()["reused_bytes"] == 0


def test_a_conjugate_view_saved_in_a_window_restores_conjugated_like_eager() -> None:
    # Guards against: the restore rebuilding only offset, size and stride. ``b.conj()`` of a
    # complex tensor is a lazy view (the conj bit, same bytes); mm saves it as is, and a restore
    # without the bit gives backward b where it saved conj(b): wrong gradients, silently.
    torch.manual_seed(0)
    b0 = torch.randn(8, 8, dtype=torch.complex64)
    w0 = torch.randn(8, 8, dtype=torch.complex64)

    def grads(offloaded: bool) -> list[torch.Tensor]:
        b, w = b0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if offloaded:
            m = manager()
            with m.window([b]):
                loss = (b.conj() @ w).abs().sum() + (torch._neg_view(b) @ w).real.sum()
            assert m.stats()["offloaded_bytes"] == b.untyped_storage().nbytes()
        else:
            loss = (b.conj() @ w).abs().sum() + (torch._neg_view(b) @ w).real.sum()
        loss.backward()
        return [b.grad, w.grad]

    expected, got = grads(False), grads(True)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_a_conjugate_view_passed_to_an_offloaded_boundary_gets_eager_gradients() -> None:
    # The same through the boundary, which saves its inputs as they are.
    from pytree_ckpt import checkpointed

    torch.manual_seed(0)
    x0 = torch.randn(8, 8, dtype=torch.complex64)
    w0 = torch.randn(8, 8, dtype=torch.complex64)

    def fn(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return a @ w

    def grads(f: object) -> list[torch.Tensor]:
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        f((x * 1).conj(), w).abs().sum().backward()  # type: ignore[operator]
        return [x.grad, w.grad]

    expected, got = grads(fn), grads(checkpointed(fn, offload=manager()))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_a_nested_tensor_in_a_window_stays_on_the_device_and_holds_no_host_buffer() -> None:
    # Guards against: _plain_storage_key takes a strided nested tensor (several buffers, no
    # sizes) for a plain one, and Handle fails on it with a host buffer checked out.
    import warnings

    m = manager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the strided nested layout is a prototype
        parts = [torch.randn(2, 4), torch.randn(3, 4)]
        h = torch.nested.nested_tensor(parts, requires_grad=True)
    hh = h * 2
    with m.window([hh]):
        y = hh.sin()
    stats = m.stats()
    assert stats["offloaded_bytes"] == 0 and stats["host_buffers_in_use"] == 0
    torch.nested.to_padded_tensor(y, 0.0).sum().backward()
    expected = [2 * (2 * t).cos() for t in parts]
    assert all(torch.equal(g, e) for g, e in zip(h.grad.unbind(), expected))


def test_a_jagged_nested_tensor_through_a_checkpointed_layer_with_offload_gives_eager_gradients(
        ) -> None:
    # Guards against: the window taking any traceable wrapper subclass by its inner tensors,
    # as it does a DTensor's local shard (NOTE [a wrapper subclass's bytes are its inner
    # tensors'] in pytree_ckpt/subclass.py): a jagged nested tensor rebuilt around restored
    # offsets got a new ragged dimension (j3 for j2) and its replay's output was refused
    # (ReplayMismatchError). It stays on the device, as a nested tensor did before.
    import copy

    from pytree_ckpt import apply_activation_checkpointing

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    wrapped = copy.deepcopy(eager)
    m = manager()  # min_bytes 0: offsets and values both above the floor
    apply_activation_checkpointing(wrapped, offload=m)

    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        x = torch.nested.nested_tensor([torch.randn(n, 8) for n in (3, 5, 2)],
                                       layout=torch.jagged, requires_grad=True)
        model(x).values().square().sum().backward()
        return [x.grad.values(), *(p.grad for p in model.parameters())]

    expected, got = grads(eager), grads(wrapped)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    stats = m.stats()
    assert stats["offloaded_bytes"] == 0 and stats["host_buffers_in_use"] == 0


def _top2(scores: torch.Tensor) -> torch.Tensor:
    return scores.topk(2, -1).indices


@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["above the floor", "below the floor"])
def test_a_frozen_result_made_under_inference_mode_stays_on_the_device_with_eager_gradients(
        min_bytes: int) -> None:
    # Guards against: offload_into reading the version of an inference tensor (it has none:
    # "Inference tensors do not track version counter"), which made every layer whose reused
    # call ran under inference_mode fail with offload on, though it works with offload off
    # (tests/pytree_ckpt/test_frames.py). Like a boundary input made under inference_mode it
    # stays on the device, uncounted.
    import copy

    from pytree_ckpt import apply_activation_checkpointing, reuse_during_recompute
    from tests.conftest import grads_per_model

    class UnderInference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            with torch.inference_mode():
                ids = reuse_during_recompute(_top2, h.detach())
            return torch.gather(h, -1, ids.clone())

    torch.manual_seed(0)
    eager = UnderInference()
    m = manager(min_bytes=min_bytes)
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager), offload=m)
    x = torch.randn(4, 8)
    assert_same_grads(*grads_per_model([eager, wrapped], x, seed=0))
    stats = m.stats()
    assert stats["offloaded_bytes"] == (x.untyped_storage().nbytes() if min_bytes == 0 else 0)
    assert stats["host_buffers_in_use"] == 0


def _sin_cos(t: torch.Tensor) -> torch.Tensor:
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(t.sin(), t.cos())


def _tagged_sin_cos(t: torch.Tensor) -> torch.Tensor:
    result = _sin_cos(t)
    result.tag = 2.0  # an attribute TwoTensor does not flatten
    return result


@pytest.mark.parametrize("frozen", [_sin_cos, _tagged_sin_cos], ids=["plain", "tagged"])
def test_a_frozen_result_of_a_wrapper_subclass_is_offloaded_by_its_inner_tensors(
        frozen: Any) -> None:
    # A frozen result that is a DTensor (a tensor-parallel layer's top-k ids) keeps its bytes
    # in its local shard; TwoTensor, torch's test wrapper subclass, in two inner tensors.
    # offload_into copies both, and the replay gets the wrapper back, rebuilt around the
    # restored ones (NOTE [a wrapper subclass's bytes are its inner tensors'] in
    # pytree_ckpt/subclass.py). Before, it stayed on the device, with a log line. "tagged"
    # guards against: the rebuild by __tensor_unflatten__ alone dropped the attributes set on
    # it: the replay, reading scale.tag as the original pass did, raised AttributeError.
    import copy

    from torch.testing._internal.two_tensor import TwoTensor

    from pytree_ckpt import apply_activation_checkpointing, reuse_during_recompute

    seen: list[tuple[type, bool]] = []

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            scale = reuse_during_recompute(frozen, h.detach())
            seen.append((type(scale), torch.is_grad_enabled()))
            return h * scale * (scale.tag if frozen is _tagged_sin_cos else 1.0)

    torch.manual_seed(0)
    eager = Scaled()
    m = manager(min_bytes=0)
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager), offload=m)
    x = torch.randn(4, 8)
    for model in (eager, wrapped):
        model(x).sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in wrapped.parameters()])
    # eager's call, the original pass, the replay
    assert seen == [(TwoTensor, True), (TwoTensor, False), (TwoTensor, True)]
    stats = m.stats()
    # x, and the frozen result's two inner tensors
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == x.nbytes + 2 * 4 * 8 * 4
    assert stats["host_buffers_in_use"] == 0


def test_a_wrapper_subclass_holding_its_inner_tensors_in_slots_frees_them_once_offloaded(
        ) -> None:
    # Guards against: kind_of (pytree_ckpt/subclass.py) recording the __slots__ that hold a
    # wrapper subclass's inner tensors (a DTensor's _local_tensor) as slots to give back: the
    # offloaded frozen result's kind then held its device inner tensors alive until backward
    # (offloaded, and kept too), and put them back in the restored wrapper. Gradients equal
    # eager's either way; the device tensors' lifetime shows the difference.
    import copy
    import gc
    import weakref

    from torch.testing._internal.two_tensor import TwoTensor

    from pytree_ckpt import apply_activation_checkpointing, reuse_during_recompute

    class SlotTwo(TwoTensor):
        """TwoTensor with its inner tensors in __slots__, as DTensor holds its local shard."""

        __slots__ = ("a", "b")

        @staticmethod
        def __new__(cls, a: torch.Tensor, b: torch.Tensor, outer_size: Any = None,
                    outer_stride: Any = None) -> SlotTwo:
            return TwoTensor.__new__(cls, a, b, outer_size, outer_stride)  # type: ignore

        @staticmethod
        def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, outer_size: Any,
                                 outer_stride: Any) -> SlotTwo:
            return SlotTwo(inner["a"], inner["b"], outer_size, outer_stride)

    seen: list[tuple[type, bool, weakref.ref[torch.Tensor]]] = []

    def slot_sin_cos(t: torch.Tensor) -> torch.Tensor:
        return SlotTwo(t.sin(), t.cos())

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            scale = reuse_during_recompute(slot_sin_cos, h.detach())
            seen.append((type(scale), torch.is_grad_enabled(), weakref.ref(scale.a)))
            return h * scale

    torch.manual_seed(0)
    eager = Scaled()
    m = manager(min_bytes=0)
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager), offload=m)
    x = torch.randn(4, 8)
    eager(x).sum().backward()
    loss = wrapped(x).sum()
    gc.collect()
    assert seen[1][2]() is None  # the original pass's inner tensor: offloaded and freed
    loss.backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in wrapped.parameters()])
    # eager's call, the original pass, the replay
    assert [s[:2] for s in seen] == [(SlotTwo, True), (SlotTwo, False), (SlotTwo, True)]
    stats = m.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == x.nbytes + 2 * 4 * 8 * 4
    assert stats["host_buffers_in_use"] == 0


def test_a_wrapper_subclass_holding_its_inner_tensors_as_attributes_frees_them_once_offloaded(
        ) -> None:
    # The instance-dict twin of the test above (helper MB): TwoTensor keeps a and b in its
    # __dict__, and kind_of (pytree_ckpt/subclass.py) leaves them out of the attributes it
    # records. Recorded, the offloaded frozen result's kind held its device inner tensors
    # alive until backward and put them back in the restored wrapper.
    import copy
    import gc
    import weakref

    from torch.testing._internal.two_tensor import TwoTensor

    from pytree_ckpt import apply_activation_checkpointing, reuse_during_recompute

    seen: list[tuple[type, bool, weakref.ref[torch.Tensor]]] = []

    def two_sin_cos(t: torch.Tensor) -> torch.Tensor:
        return TwoTensor(t.sin(), t.cos())

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            scale = reuse_during_recompute(two_sin_cos, h.detach())
            seen.append((type(scale), torch.is_grad_enabled(), weakref.ref(scale.a)))
            return h * scale

    torch.manual_seed(0)
    eager = Scaled()
    m = manager(min_bytes=0)
    wrapped = apply_activation_checkpointing(copy.deepcopy(eager), offload=m)
    x = torch.randn(4, 8)
    eager(x).sum().backward()
    loss = wrapped(x).sum()
    gc.collect()
    assert seen[1][2]() is None  # the original pass's inner tensor: offloaded and freed
    loss.backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in wrapped.parameters()])
    assert [s[:2] for s in seen] == [(TwoTensor, True), (TwoTensor, False), (TwoTensor, True)]
    assert m.stats()["host_buffers_in_use"] == 0


def test_a_change_in_place_is_named_by_the_first_window_tensor_on_its_storage() -> None:
    # window_keys keeps, per storage, the index of the first window tensor on it (for the
    # message): a window given a tensor and a view of it names the tensor, as the caller
    # passed it first, not the view behind it.
    m = manager()
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 1.0
    with m.window([h, h[2:]], name=lambda i: f"args[{i}]"):
        loss = h.square().sum()  # saves h
    h.add_(1)
    with pytest.raises(pytree_ckpt.CheckpointError,
                       match=r"^args\[0\] \(offload window 0, .*modified in place"):
        loss.backward()


def test_a_frozen_result_on_a_window_tensors_storage_changed_in_place_is_named_as_that_tensor(
        ) -> None:
    # offload_into adds the storage of what it is given to the window's keys only where the
    # window has none for it: a frozen result that is a view of the layer's input (a reused
    # function that returns a slice of its argument) shares the input's copy, and a change of
    # the input after the call is named as the input, with a window tensor's tip (the
    # boundary's own where it opened the window); overwritten, it was named as "a tensor given
    # to offload_into", whose tip speaks of restore().
    m = manager()
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 1.0
    with m.window([h], name=lambda i: f"args[{i}]") as window:
        loss = h.square().sum()  # saves h
        handle = m.offload_into(window, h[2:])
    h.add_(1)
    for read in (loss.backward, lambda: m.restore(handle)):
        with pytest.raises(pytree_ckpt.CheckpointError) as refused:
            read()
        assert str(refused.value).startswith("args[0] (offload window 0, ")
        assert "change a clone after the block" in str(refused.value)


def test_a_view_made_inside_an_op_and_changed_through_its_base_later_is_refused_like_eager(
        ) -> None:
    # The handle of a saved view checks its base's version (NOTE [in-place check]): the view
    # itself (h[2:], made for the multiply) has no Python object that outlives the save, and
    # once the copy lets go of the device bytes (its copy to host is done; here at stats(), in
    # a stack two windows later) its own alias is gone too. Checked through the view only, a
    # change of the input after the call went unseen: backward read the bytes saved before
    # it, where eager's backward raises.
    m = manager()
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 1.0
    w = torch.randn(6, 8, requires_grad=True)
    with m.window([h], name=lambda i: f"args[{i}]"):
        loss = (h[2:] * w).sum()  # saves the view h[2:], dropped at once
    m.stats()
    h.add_(1)
    with pytest.raises(pytree_ckpt.CheckpointError,
                       match=r"^args\[0\] \(offload window 0, torch.float32\[6, 8\]\) was "
                             r"modified in place"):
        loss.backward()
    h_eager = x.detach() * 1.0
    loss_eager = (h_eager[2:] * w).sum()
    h_eager.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_eager.backward()


def test_reused_bytes_changed_during_backward_through_a_detached_alias_are_refused_like_eager(
        ) -> None:
    # The last window's bytes are reused at the turn (NOTE [reuse at the turn]): backward
    # reads the very storage, so the copy keeps its alias (which shares the saved tensor's
    # version counter) when it lets go of them, for handles unpacked later. Dropped there,
    # a change made between two unpacks of the window (here by a gradient hook, through a
    # detach() alias, the saved tensor itself dropped) went unseen: the second op read the
    # changed bytes, a wrong gradient, where eager's backward raises.
    def run(offloaded: bool) -> None:
        m = manager()
        w = torch.randn(8, 8, requires_grad=True)
        h = torch.randn(8, 8, requires_grad=True) * 1.0
        alias = h.detach()
        with m.window([h], name=lambda i: f"args[{i}]") if offloaded else nullcontext():
            y = h * w  # saves h, read last in backward
            loss = (y * h).sum()  # saves h, read first
        y.register_hook(lambda grad: alias.add_(1))  # runs between the two
        del h, y
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(offloaded=False)
    with pytest.raises(pytree_ckpt.CheckpointError,
                       match=r"^args\[0\] \(offload window 0, .*modified in place"):
        run(offloaded=True)


class _Unflattened(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: its storage is a placeholder whose data
    pointer torch refuses to read (no plain storage)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Unflattened:
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        out = func(*tree_map(lambda t: t.elem if isinstance(t, _Unflattened) else t, args),
                   **tree_map(lambda t: t.elem if isinstance(t, _Unflattened) else t,
                              kwargs or {}))
        return tree_map(lambda t: _Unflattened(t) if isinstance(t, torch.Tensor) else t, out)


def test_a_resident_subclass_keeps_its_later_inner_tensor_resident_after_one_without_storage(
        ) -> None:
    # Guards against: _resident_keys giving up on a resident tensor's remaining inner tensors
    # at the first one without a plain storage (``break`` for ``continue``): a TwoTensor whose
    # first part is a wrapper with no plain storage and whose second is the window's tensor
    # left that storage offloaded, copied to host and back once per window.
    from torch.testing._internal.two_tensor import TwoTensor

    y = torch.randn(64, 64)
    pair = TwoTensor(_Unflattened(torch.randn(64, 64)), y)
    for resident, copied in (((), y.untyped_storage().nbytes()), ((pair,), 0)):
        m = manager()
        x = torch.randn(64, 64, requires_grad=True)
        with m.window([y], resident=resident):
            loss = (x * y).sum()  # saves y (x's gradient)
        assert m.stats()["offloaded_bytes"] == copied
        loss.backward()
        assert torch.equal(x.grad, y)


def test_a_view_saved_in_a_window_is_held_to_the_floor_by_its_whole_storage() -> None:
    # Guards against: _pack weighing the saved view's own bytes (numel * element_size) against
    # min_bytes, or counting them in below_min_bytes, instead of its storage's: the unit copied
    # is the whole storage (NOTE [one copy per storage] in offload/packing.py). A two-row slice
    # of a large storage is offloaded with it; below the floor, the storage's bytes count.
    def saved_slice(m: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x = torch.randn(64, 64, requires_grad=True)
        h = x * 1.0
        with m.window([h]):
            loss = (h[:2] * h[:2]).sum()  # saves a 512-byte view of a 16 KiB storage
        stats = m.stats()
        loss.backward()
        return h, stats

    h, stats = saved_slice(manager(min_bytes=4096))
    assert h[:2].untyped_storage().nbytes() >= 4096 > h[:2].numel() * h.element_size()
    assert stats["offloaded_bytes"] == h.untyped_storage().nbytes()
    assert stats["below_min_bytes"] == 0
    h, stats = saved_slice(manager(min_bytes=1 << 20))
    assert stats["offloaded_bytes"] == 0
    assert stats["below_min_bytes"] == h.untyped_storage().nbytes()


def test_a_storage_changed_in_place_since_its_save_is_not_reused_at_the_turn() -> None:
    # Helper DK: backward's first unpack restores the whole window; the gate, changed since,
    # is refused at its own unpack, and its bytes are copied back, never taken as they are
    # (NOTE [reuse at the turn]: reused bytes are never changed ones).
    m = manager()
    x = torch.randn(64, 16, requires_grad=True)
    h, gate = x * 1.0, torch.randn(64, 16)
    with m.window([h, gate]):
        # mul saves h and the gate, then square saves h: backward unpacks h first
        out = (h * gate + h.square()).sum()
    gate.mul_(2)
    del h, gate
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"window tensor #1 .*modified in place"):
        out.backward()
    stats = m.stats()
    assert stats["reused_bytes"] == stats["offloaded_bytes"] - x.untyped_storage().nbytes()


def test_an_alias_with_a_counter_of_its_own_gets_a_copy_of_its_own_and_views_share_one(
) -> None:
    # NOTE [one counter per shared copy] (offload/window.py): a copy is shared only by tensors
    # known to count their versions on the copied tensor's counter (the tensor, its views). A
    # .data alias (a counter of its own) or a .detach() alias (which shares the counter but
    # cannot be told from one that does not) gets a copy of its own (helpers EB, EI:
    # matched by version number alone, a .data alias made after an in-place write took a
    # stale copy). docs/offload.md says which tensors share a copy.
    m = manager()
    w = torch.randn(32, requires_grad=True)
    x = torch.randn(32)  # x and x.data both at version 0, each counting on its own counter
    nbytes = x.untyped_storage().nbytes()
    with m.window([x]):
        loss = (w * x + w * x.data).sum()  # each mul saves its other operand: x, then x.data
    assert m.stats()["offloaded_bytes"] == 2 * nbytes
    loss.backward()
    assert torch.equal(w.grad, 2 * x)
    m = manager()
    w.grad = None
    with m.window([x]):
        loss = (w * x + w * x[:]).sum()  # a view shares x's counter, and its copy
    assert m.stats()["offloaded_bytes"] == nbytes
    loss.backward()
    assert torch.equal(w.grad, 2 * x)


def test_a_data_alias_at_the_same_version_number_in_the_same_window_gets_a_copy_of_its_own(
) -> None:
    # Mutation testing (helper EK): NOTE [one counter per shared copy] was checked for the
    # earlier windows' copies (pass_.shared) but not for the window's own (window.copies): a
    # .data alias written in place after x was copied reads 1 on its own counter, as x does,
    # and took x's copy, made before the write. Eager's backward reads the bytes as they are.
    m = manager()
    w = torch.randn(32, requires_grad=True)
    x = torch.randn(32)
    x.mul_(2)  # version 1
    alias = x.data  # its own counter, at 0
    with m.window([x]):
        unused = w * x  # saves x at version 1: copied
        alias.mul_(3)  # the alias at version 1 too; x's counter does not move
        loss = (w * alias).sum()  # saves the alias
    expected = alias.clone()  # eager's gradient of w
    del x, alias
    m.stats()  # the copies taken in: the storage lives on the host copies alone
    loss.backward()
    assert torch.equal(w.grad, expected)
    del unused  # held to here, its saved copy with it


def test_a_window_saving_its_tensor_again_after_a_nested_window_copied_a_data_alias_reuses_its_copy(
        ) -> None:
    # Mutation testing (helper FP, mutant P14: pack_saved skipped the window's own copies and
    # looked in pass_.shared only; every other test passed): a nested window (a boundary inside
    # another one, or manager.window used directly) that copies a .data alias of the outer
    # window's storage replaces it in pass_.shared, so the outer window saving the tensor again
    # found only the alias's copy (another counter) and copied the storage a third time.
    m = manager()
    w = torch.randn(32, requires_grad=True)
    x = torch.randn(32)
    alias = x.data  # the same storage, a counter of its own
    nbytes = x.untyped_storage().nbytes()
    with m.window([x]):
        a = w * x  # saves x: copied
        with m.window([alias]):
            b = w * alias  # saves the alias: a copy of its own (another counter)
        c = w * x  # x again: the outer window's own copy serves
    assert m.stats()["offloaded_bytes"] == 2 * nbytes
    (a + b + c).sum().backward()
    eager = w.detach().clone().requires_grad_()
    (eager * x + eager * alias + eager * x).sum().backward()
    assert torch.equal(w.grad, eager.grad)


class _OptionalInner(torch.Tensor):
    """A traceable wrapper subclass flattening an optional inner tensor (``_extra``, here None)
    among its names, as quantized tensors with an optional scale or zero point do."""

    _data: torch.Tensor
    _extra: torch.Tensor | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, extra: torch.Tensor | None = None) -> _OptionalInner:
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype,
                                                  device=data.device, strides=data.stride())
        out._data, out._extra = data, extra
        return out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data", "_extra"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Any], ctx: None, size: Any,
                             stride: Any) -> _OptionalInner:
        return _OptionalInner(inner["_data"], inner["_extra"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = (lambda t: t._data if isinstance(t, _OptionalInner) else t)
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


class _ScaleBy(torch.autograd.Function):
    """``w * t._data``, saving the wrapper ``t`` itself."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, t: _OptionalInner) -> torch.Tensor:
        ctx.save_for_backward(t)
        return w * t._data

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        t, = ctx.saved_tensors
        return grad * t._data, None


def test_a_wrapper_subclass_flattening_a_none_attribute_is_rebuilt_with_it_in_backward() -> None:
    # Mutation testing (helper FP, mutant P16: _pack_inner dropped the flattened attributes
    # that are no tensors, ``others``; every other test passed, no subclass in the suite
    # flattens one): the wrapper is rebuilt by __tensor_unflatten__ from its copied inner
    # tensors and those attributes, a KeyError without them.
    m = manager()
    w = torch.randn(32, requires_grad=True)
    t = _OptionalInner(torch.randn(32))
    with m.window([t]):
        loss = _ScaleBy.apply(w, t).sum()
    assert m.stats()["offloaded_bytes"] == t._data.untyped_storage().nbytes()
    loss.backward()
    eager = w.detach().clone().requires_grad_()
    _ScaleBy.apply(eager, t).sum().backward()
    assert torch.equal(w.grad, eager.grad)


def test_the_default_floor_is_64_kib_a_storage_of_it_is_offloaded_and_one_just_below_is_not(
        ) -> None:
    # Guards against: OffloadConfig's default min_bytes changed from 1 << 16 (docs/offload.md,
    # "The window rule": "default 64 KiB"; offload=True's default manager uses it).
    m = offload.OffloadManager(device="cpu")
    assert m.config.min_bytes == 64 * 1024
    at = torch.randn(64 * 1024 // 4, requires_grad=True) * 1.0  # exactly 64 KiB
    below = torch.randn(64 * 1024 // 4 - 1, requires_grad=True) * 1.0  # 4 bytes short
    with m.window([at, below]):
        loss = at.square().sum() + below.square().sum()
    stats = m.stats()
    assert stats["offloaded_bytes"] == 64 * 1024
    assert stats["below_min_bytes"] == 64 * 1024 - 4
    loss.backward()


@pytest.mark.xfail(strict=True, reason="documented limit (docs/offload.md, Limits: a write "
                   "that bypasses autograd's version counter, .data, has no defined effect): the "
                   "table changed through .data between two windows is shared from the earlier "
                   "window's copy, made before the write, which no version shows")
def test_a_table_changed_through_data_between_windows_gives_the_later_window_eager_gradients(
        ) -> None:
    def run(m: Any) -> torch.Tensor:
        torch.manual_seed(0)
        w1 = torch.randn(4096, requires_grad=True)
        w2 = torch.randn(4096, requires_grad=True)
        table = torch.randn(4096)  # a table every layer gets (RoPE-like)
        with m.window([table]) if m is not None else nullcontext():
            a = (w1 * table).sum()
        table.data.mul_(2)  # changed between the layers through .data: no version bump
        with m.window([table]) if m is not None else nullcontext():
            b = (w2 * table).sum()  # saves the doubled table
        (a + b).backward()
        return w2.grad

    eager = run(None)
    assert torch.equal(run(manager()), eager)


@pytest.mark.xfail(strict=True, reason="documented limit (docs/offload.md, 'In-place changes "
                   "after saving': a dtype view shares the counter without being a view) "
                   "(helper GY)")
def test_a_change_through_a_dtype_view_of_a_dropped_layer_input_is_refused_like_eager() -> None:
    # A documented limit (helper GY), strict: closing the gap makes it pass.
    # x.view(torch.int32) shares x's storage and version counter but is no ``_base`` view:
    # once the caller drops x, the handle's weak source is gone, the manager let go of its
    # alias (at stats(), at the next window, ...) and a change made through the dtype view is
    # read from host silently. Eager autograd (and the boundary without offload) refuse the
    # backward: the version counter the saved input shares moved.
    results = []
    for offloaded in (False, True):
        layer = nn.Linear(8, 8)
        m = manager()
        pytree_ckpt.apply_activation_checkpointing(layer, offload=m if offloaded else False)
        x = torch.randn(4, 8, requires_grad=True) * 1.0
        bits = x.view(torch.int32)  # a view in torch's terms: same storage, same counter
        y = layer(x)
        del x
        m.stats()                   # on CPU the copy has landed: its alias is let go
        bits.add_(1)                # changes the bytes the layer's backward needs
        with pytest.raises(pytree_ckpt.CheckpointError, match="changed in place|modified in pl"):
            y.sum().backward()
        results.append(offloaded)
    assert results == [False, True]


class _SaveAll(torch.autograd.Function):
    """Saves every tensor given after ``x``; backward checks each came back as it was."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        ctx.expected = [t.clone() for t in saved]
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        assert all(torch.equal(t, e) for t, e in zip(ctx.saved_tensors, ctx.expected))
        return (grad * 2, *(None for _ in ctx.expected))


@pytest.mark.xfail(strict=True, reason="documented limit (docs/offload.md, 'The window rule': "
                   "a dtype view gets a copy of its own) (helper GY)")
def test_a_dtype_view_saved_beside_its_tensor_shares_the_one_copy_of_the_storage() -> None:
    # A documented limit (helper GY), strict: sharing the copy makes it pass.
    # docs/offload.md: "Each storage is copied to host once per window, however many saved
    # tensors or views alias it". x.view(torch.int32) is a view (same storage, same version
    # counter), but has no ``_base``: Copy.same_counter takes it for a .data-like alias.
    m = manager()
    x = torch.randn(16, 32, requires_grad=True) * 1.0
    nbytes = x.untyped_storage().nbytes()
    with m.window([x]):
        out = _SaveAll.apply(x, x, x[2:], x.view(torch.int32))
    assert m.stats()["offloaded_bytes"] == nbytes
    out.sum().backward()


# Guards against (helper JI), as it was found; the view's case is helper JO's mutation test
# (the shared copy is found by its view's base, packing.py).
@pytest.mark.parametrize("beside", ["a fresh detached alias", "a fresh view"])
def test_a_table_every_window_gets_is_copied_once_per_pass_beside_a_fresh_alias_or_view(
        beside: str) -> None:
    # docs/offload.md: a storage already offloaded by an earlier window of the same pass, still
    # alive and unmodified ("the same tensor or a view of it, at the same version"), is shared,
    # not copied again; only "a fresh .data or .detach() alias per layer is copied per layer".
    # Here the same table is passed to every window, and each window also saves a fresh
    # ``cos.detach()`` (defensive code in an attention block), or a fresh view of it. One
    # shared copy per storage key let the alias's copy replace the table's, and the table was
    # copied again in every window (8 copies of the table for 4 windows, not 1 + 4).
    m = manager()
    torch.manual_seed(0)
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(4)]
    cos = torch.randn(64, 32)
    x = torch.randn(64, 32, requires_grad=True)

    def forward(offloaded: bool) -> torch.Tensor:
        h = x * 1.0
        for w in weights:
            with m.window([h, cos]) if offloaded else nullcontext():
                q = h @ w
                h = q * cos + q * cos.detach() if beside == "a fresh detached alias" else \
                    q * cos[1] + q * cos  # the view saved first
        return h

    forward(False).sum().backward()
    eager = [x.grad, *(w.grad for w in weights)]
    x.grad = None
    for w in weights:
        w.grad = None
    out = forward(True)
    table, inputs = cos.untyped_storage().nbytes(), 4 * 64 * 32 * 4
    offloaded = m.stats()["offloaded_bytes"]
    out.sum().backward()
    assert_same_grads(eager, [x.grad, *(w.grad for w in weights)])
    # the inputs, the table once, and one copy of each window's fresh detached alias (a view
    # shares the table's)
    assert offloaded == inputs + table + (4 * table if beside == "a fresh detached alias" else 0)


# Guards against (helper JI), as it was found:
@pytest.mark.parametrize("schedule", ["two nodes save it", "retain_graph twice"])
def test_a_saved_tensor_a_backward_changed_in_place_is_refused_like_eager(schedule: str) -> None:
    # Eager: the first backward's ``mul_`` moves the saved tensor's version, and the next unpack
    # of it (another node's, or the second backward's) raises "modified by an inplace
    # operation". With offload, every unpack rebuilds its alias on the one restored buffer with
    # a fresh version counter (Handle.rebuild), and check_unmodified reads the caller's tensor,
    # which did not change: the second reader gets the changed bytes, with no error.
    x0 = torch.randn(8, 16)

    def run(m: offload.OffloadManager | None) -> None:
        x = x0.clone().requires_grad_()
        h = x * 1.0
        with m.window([h]) if m is not None else nullcontext():
            if schedule == "two nodes save it":
                loss = (GradIntoSaved.apply(h) + GradIntoSaved.apply(h)).sum()
            else:
                loss = GradIntoSaved.apply(h).sum()
        if schedule == "two nodes save it":
            loss.backward()
        else:
            loss.backward(retain_graph=True)
            loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(None)
    with pytest.raises(RuntimeError, match="modified"):  # CheckpointError is a RuntimeError
        run(manager())


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Inputs and outputs: a "
                   "backward writing into what it saved, under offload) (helper JL): a replay's "
                   "backward writes into the reused input storage without moving the caller's "
                   "counter; another node reads it")
def test_a_replay_writing_into_its_restored_input_is_refused_where_another_node_saved_it(
        ) -> None:
    # A checkpointed layer whose custom Function builds its gradient in the saved input's
    # memory (GradIntoSaved), and an op outside the layer that saved the same tensor and runs
    # its backward later. Eager, and the boundary without offload, refuse ("modified by an
    # inplace operation": the replay's alias shares the caller's counter). With offload, the
    # window's bytes are reused at the turn: the replay's input is a view of the copy's uint8
    # alias of the caller's storage, with a counter of its own, so the write lands in the
    # caller's tensor unseen, and ``h * w``'s backward reads the doubled bytes: w.grad = 2h.
    x0 = torch.randn(8, 16)

    def run(offloaded: offload.OffloadManager | bool) -> torch.Tensor:
        leaf = x0.clone().requires_grad_()
        w = torch.ones(8, 16, requires_grad=True)
        h = leaf * 1.0
        b = h * w  # saves h, outside the layer; its backward runs after the layer's
        a = pytree_ckpt.checkpointed(GradIntoSaved.apply, offload=offloaded)(h)
        (a + b).sum().backward()
        assert w.grad is not None
        return w.grad

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(False)
    try:
        w_grad = run(manager())
    except RuntimeError as error:  # refused, as eager: the fix
        assert "modified" in str(error)
    else:
        assert torch.equal(w_grad, x0)  # h as the forward used it (got 2 * h)


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Inputs and outputs: a "
                   "backward writing into what it saved, under offload) (helper JL): a "
                   "backward's write through one copy's restored alias is not seen by a .data "
                   "or .detach() alias's own copy")
@pytest.mark.parametrize("alias", ["data", "detach"])
def test_a_write_a_backward_makes_into_a_saved_tensor_reaches_an_alias_saved_beside_it_like_eager(
        alias: str) -> None:
    # Two nodes in one window: one saves h and writes into it in backward (GradIntoSaved,
    # runs first), the other saves an alias of h. Eager: a ``.data`` alias (a counter of its
    # own, the same memory) reads the written bytes, x.grad = 4 * x0; a ``.detach()`` alias
    # (the same counter) is refused. With offload each alias has a copy of its own (NOTE
    # [one counter per shared copy]), restored apart, so the write in one never reaches the
    # other, and its counter does not move either: x.grad = 3 * x0 with no error, both
    # reused at the turn and copied back (helper JI's fix covers aliases of one copy only).
    x0 = torch.randn(8, 16)

    class ReadAlias(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(saved)
            return x * saved

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            (saved,) = ctx.saved_tensors
            return grad * saved, None

    def run(m: offload.OffloadManager | None, stats_between: bool = False) -> torch.Tensor:
        x = x0.clone().requires_grad_()
        h = x * 1.0
        with m.window([h]) if m is not None else nullcontext():
            second = ReadAlias.apply(h, h.data if alias == "data" else h.detach())
            first = GradIntoSaved.apply(h)  # made later: its backward runs first
            loss = (first + second).sum()
        if m is not None and stats_between:
            m.stats()  # lets go of the device bytes: copied back, not reused
        loss.backward()
        assert x.grad is not None
        return x.grad

    if alias == "data":
        eager = run(None)
        assert torch.equal(eager, 4 * x0)
        for stats_between in (False, True):
            assert torch.equal(run(manager(), stats_between), eager)
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(None)
        for stats_between in (False, True):
            with pytest.raises(RuntimeError, match="modified"):
                run(manager(), stats_between)




# Guards against (helper JT), as it was found:
def test_a_manual_window_tensor_changed_after_its_save_gets_a_tip_without_a_boundary() -> None:
    lin = nn.Linear(8, 8)
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    eager = lin(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager.sum().backward()  # eager refuses it too: the linear saved h
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    with manager().window([h]):
        y = lin(h)
    h.add_(1)
    with pytest.raises(pytree_ckpt.CheckpointError) as refused:
        y.sum().backward()
    message = str(refused.value)
    assert "window tensor #0" in message  # the right tensor, both versions
    assert "boundary" not in message and "replay" not in message


# Guards against (helper JW), as it was found:
def test_a_keyboard_interrupt_in_a_copys_destructor_gives_its_host_buffer_back() -> None:
    # A Ctrl-C delivered while a destructor runs is printed and dropped by CPython ("Exception
    # ignored in ..."): training goes on. Here it lands right after Copy.__del__'s first call
    # returns (where CPython delivers a pending signal), in
    # a copy that still holds its host buffer.
    import sys

    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)))
    mgr = offload.OffloadManager(offload.OffloadConfig(min_bytes=0, prefetch=2), device="cpu")
    for layer in layers:
        pytree_ckpt.apply_activation_checkpointing(layer, offload=mgr)
    fired: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and not fired and frame.f_code.co_name == "__del__" and \
                frame.f_code.co_filename.endswith("window.py") and \
                getattr(frame.f_locals.get("self"), "host", None) is not None:
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C")

    def step(seed: int) -> None:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        layers(x).square().mean().backward()
        layers.zero_grad(set_to_none=True)

    step(0)
    host_bytes = mgr.stats()["host_bytes"]
    unraisable = sys.unraisablehook
    sys.unraisablehook = lambda info: None  # CPython's report of the dropped interrupt
    try:
        sys.setprofile(profile)
        try:
            step(1)
        finally:
            sys.setprofile(None)
    finally:
        sys.unraisablehook = unraisable
    assert fired
    for seed in (2, 3):
        step(seed)
    stats = mgr.stats()
    assert stats["host_buffers_in_use"] == 0
    assert stats["host_bytes"] == host_bytes  # the pool does not grow


def test_a_data_alias_made_again_at_a_dead_aliass_address_after_a_change_gives_eager_gradients(
) -> None:
    # Guards against: pack_saved's lookup of the pass's shared copies (packing.py, the second
    # ``holds``/``same_counter`` test) without ``same_counter``: the registry is keyed by
    # ``id(base)``, and a fresh ``.data`` alias made where a dead one lived has its id and its
    # version (0, its own counter) and the same storage, so it took the copy made before the
    # table changed in place: backward read bytes its forward never used.
    m = manager()
    table = torch.randn(16, 32)
    x = torch.randn(16, 32, requires_grad=True)
    with m.window([table]):
        alias = table.data
        first = id(alias)
        kept = (x * alias).sum()  # saves the alias: the window's copy is of it
        del alias
    table.add_(1.0)  # through the table itself: its counter, not the dead alias's
    spare = []
    alias = table.data
    while id(alias) != first and len(spare) < 10_000:  # the dead alias's address, made again
        spare.append(alias)
        alias = table.data
    assert id(alias) == first
    with m.window([table]):
        out = (x * alias).sum()
    del alias, spare
    out.backward()
    assert torch.equal(x.grad, table)  # eager: d(x * table)/dx is the table as it is now
    del kept


def test_a_window_named_by_a_proxy_to_a_function_gives_eager_gradients() -> None:
    import weakref

    def namer(i: int) -> str:
        return f"block.args[{i}]"

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x0 = torch.randn(2, 4)
    x = x0.clone().requires_grad_()
    lin(x).relu().sum().backward()
    eager = (x.grad, lin.weight.grad.clone())
    lin.zero_grad()
    x = x0.clone().requires_grad_()
    with offload.OffloadManager().window([x], name=weakref.proxy(namer)):
        y = lin(x).relu().sum()
    y.backward()
    assert torch.equal(x.grad, eager[0]) and torch.equal(lin.weight.grad, eager[1])


def _views_offsets(h: torch.Tensor) -> torch.Tensor:
    return (h[2:, 3:] * h[2:, 3:].exp()).sum() + (h.t()[1:] ** 2).sum()


def _expanded(h: torch.Tensor) -> torch.Tensor:
    e = h[:1].expand(8, 16)
    return (e * e.sin()).sum()


def _as_strided(h: torch.Tensor) -> torch.Tensor:
    a = h.as_strided((4, 5), (3, 2), 7)
    return (a * a).sum() + h.as_strided((3, 3), (0, 1), 2).cos().sum()


def _complex(h: torch.Tensor) -> torch.Tensor:
    c = torch.view_as_complex(h.view(8, 8, 2))
    return (c.conj() * c.conj().exp()).real.sum() + (c.imag * c.real.exp()).sum()


def _bool_mask(h: torch.Tensor) -> torch.Tensor:
    mask = h > 0  # not on the window's storage: stays
    return torch.where(mask, h, h * 2).square().sum() + (h.masked_fill(mask, 0) * h).sum()


class _SavesInputAndOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        out = a.exp()
        ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        a, out = ctx.saved_tensors
        return grad * out + a * 0


def _custom_function(h: torch.Tensor) -> torch.Tensor:
    return (_SavesInputAndOutput.apply(h[1:]) * h[:-1]).sum()


@pytest.mark.parametrize("block", [_views_offsets, _expanded, _as_strided, _complex, _bool_mask,
                                   _custom_function], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("prefetch", [0, 1])
def test_aliases_of_every_layout_saved_in_a_window_give_eager_gradients_from_one_copy(
        block: Any, prefetch: int) -> None:
    # helper PV: offsets, transposes, expand, as_strided with overlapping strides, complex
    # views with the conj bit, a bool mask beside, a custom Function saving input and output.
    x = torch.randn(8, 16, requires_grad=True)
    block(x * 1.0).backward()
    expected = x.grad
    x.grad = None
    m = manager(prefetch=prefetch)
    h = x * 1.0
    with m.window([h]):
        loss = block(h)
    del h
    loss.backward()
    assert torch.equal(expected, x.grad)
    stats = m.stats()
    assert stats["offloaded_bytes"] == stats["restored_bytes"] == 8 * 16 * 4
    assert stats["host_buffers_in_use"] == 0


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex32, torch.complex128, torch.bfloat16,
                                   torch.float16, torch.uint16, torch.uint64, torch.int8,
                                   torch.bool, torch.float8_e5m2, torch.bits16])
def test_a_strided_alias_of_any_dtype_saved_by_a_custom_function_comes_back_bit_for_bit(
        dtype: torch.dtype) -> None:
    # helper PV: the restore views its uint8 bytes as each dtype (window.py, Handle.rebuild).
    raw = torch.randint(0, 2 if dtype is torch.bool else 120, (512,), dtype=torch.uint8)
    kept = (raw.bool() if dtype is torch.bool else raw.view(dtype))[3:]
    seen: list[torch.Tensor] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(k)
            return a * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            seen.append(ctx.saved_tensors[0])
            return grad * 2, None

    m = manager()
    x = torch.randn(4, requires_grad=True)
    with m.window([kept]):
        loss = Keep.apply(x, kept[1::2]).sum()
    loss.backward()
    expected = kept[1::2]
    assert seen[0].dtype == dtype and seen[0].shape == expected.shape
    assert seen[0].stride() == expected.stride()
    assert torch.equal(seen[0].contiguous().view(torch.uint8),
                       expected.contiguous().view(torch.uint8))
    assert m.stats()["offloaded_bytes"] == kept.untyped_storage().nbytes()


@pytest.mark.parametrize("alias", [False, True])
def test_an_input_changed_in_place_between_two_windows_is_refused_where_eager_refuses(
        alias: bool) -> None:
    # helper PX: window 0 saves h (or its .detach() alias, which shares h's counter: a copy of
    # its own since 5237f38), h is doubled in place, window 1 saves it again: eager refuses in
    # backward ("modified by an inplace operation"), and so does the window's first copy.
    m = manager()
    x = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    h = x * 1.0
    with m.window([h]):
        first = (h.detach() if alias else h) * w1
    with torch.no_grad():
        h.mul_(2)
    with m.window([h]):
        second = h * w2
    with pytest.raises(pytree_ckpt.CheckpointError, match="modified in place after it was saved"):
        (first.sum() + second.sum()).backward()


def test_reuse_records_and_copies_are_gone_after_each_step_of_a_checkpointed_stack() -> None:
    # Helper QB: the Reused record (NOTE [reuse at the turn]) lives with its copies only; the
    # storage a step reuses (the stack's input, which the caller keeps) counts as alive
    # elsewhere once per step, as before the record.
    import gc

    from offload import OffloadConfig, OffloadManager
    from offload.window import Copy, Reused
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                 for _ in range(4))
    manager = OffloadManager(OffloadConfig(min_bytes=0))
    pytree_ckpt.checkpoint_layers(layers, offload=manager)
    x = torch.randn(2, 8, requires_grad=True)
    for step in range(1, 4):
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        del h
        gc.collect()
        assert not any(type(o) in (Copy, Reused) for o in gc.get_objects())
        stats = manager.stats()
        assert stats["reused_bytes"] == step * x.untyped_storage().nbytes()
        assert stats["alive_elsewhere_bytes"] == step * x.untyped_storage().nbytes()


def test_make_fx_of_a_training_step_with_offload_traces_eagers_gradients() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    ours = pytree_ckpt.apply_activation_checkpointing(
        copy.deepcopy(eager), offload=manager())

    def step_of(model: nn.Module) -> Any:
        def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            loss = model(x * 1.0).sum()
            return (loss, *torch.autograd.grad(loss, [x, *model.parameters()]))
        return step

    x = torch.randn(4, 8, requires_grad=True)
    expected = make_fx(step_of(eager))(x)(x)  # the traced program, run on x
    got = make_fx(step_of(ours))(x)(x)
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
