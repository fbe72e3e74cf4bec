"""Outputs a weakref.proxy refers to (docs/limits.md, the weakref.proxy and class rows)."""
import dataclasses
import weakref

import optree
import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError

TABLE = torch.randn(3)  # a constant made at import, requiring no grad


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


optree.register_pytree_node(_Holder, lambda o: ((o.t,), None, None),
                            lambda _, c: _Holder(*c), namespace="pytree_ckpt")


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Inputs and outputs: "
                   "a weakref.proxy among the outputs to another tensor that requires no "
                   "grad is refused as a hidden output) (helper OP)")
def test_a_proxy_to_a_constant_made_before_the_call_is_returned_as_eager_returns_it() -> None:
    x = torch.randn(2, 4, requires_grad=True)

    def fn(h: torch.Tensor):
        return h * 2, weakref.proxy(TABLE)

    eager = fn(x)
    out = pytree_ckpt.checkpoint(fn, x)
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1] + 0, TABLE)


def test_a_proxy_to_a_module_a_config_or_a_class_among_the_outputs_passes() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)

    class Cfg:
        pass

    cfg = Cfg()
    out = pytree_ckpt.checkpoint(
        lambda h: (h * 2, weakref.proxy(lin), weakref.proxy(cfg), weakref.proxy(Cfg)), x)
    assert out[1].weight is lin.weight and out[2].__class__ is Cfg and out[3].__name__ == "Cfg"
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_a_class_holding_a_computed_tensor_leaves_it_without_gradient_as_documented() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    _, holder = pytree_ckpt.checkpoint(
        lambda h: (h * 2, type("Holder", (), {"t": lin(h)})), x)
    assert holder.t.grad_fn is None and not holder.t.requires_grad


def test_the_refusal_of_a_proxy_to_an_object_gives_a_tip_that_works_when_followed() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    kept = []

    def fn(h: torch.Tensor):
        holder = _Holder(lin(h))  # _Holder IS registered in namespace 'pytree_ckpt'
        kept.append(holder)
        return h * 2, weakref.proxy(holder)

    with pytest.raises(CheckpointError) as refused:
        pytree_ckpt.checkpoint(fn, x)
    assert "register _Holder" not in str(refused.value)


_KEPT: list = []  # keeps the proxies' referents alive


def test_a_proxy_to_a_closure_among_the_outputs_is_tipped_to_return_the_tensor() -> None:
    x = torch.randn(2, 4, requires_grad=True)

    def fn(h: torch.Tensor):
        with torch.no_grad():
            t = h.sum() * 2
        f = lambda: t  # noqa: E731
        _KEPT.append(f)
        return h * 2, weakref.proxy(f)

    with pytest.raises(CheckpointError) as refused:
        pytree_ckpt.checkpoint(fn, x)
    assert "return the tensor itself" in str(refused.value)


def test_a_proxy_to_an_iterator_among_the_outputs_is_tipped_to_return_a_list() -> None:
    x = torch.randn(2, 4, requires_grad=True)

    class _It:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __iter__(self):
            return self

        def __next__(self):
            raise StopIteration

    def fn(h: torch.Tensor):
        with torch.no_grad():
            it = _It(h.sum() * 2)
        _KEPT.append(it)
        return h * 2, weakref.proxy(it)

    with pytest.raises(CheckpointError) as refused:
        pytree_ckpt.checkpoint(fn, x)
    assert "list(...)" in str(refused.value)


@dataclasses.dataclass
class _Stream:
    """A dataclass that is also an iterator (a cursor): the tree bridge opens it."""
    t: torch.Tensor

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration


def test_the_tip_for_a_proxy_to_an_iterator_dataclass_gives_eager_gradients() -> None:
    x = torch.randn(2, 4, requires_grad=True)

    def fn(h: torch.Tensor):
        s = _Stream(h * 2)
        _KEPT.append(s)
        return h * 3, weakref.proxy(s)

    with pytest.raises(CheckpointError) as refused:
        pytree_ckpt.checkpoint(fn, x)
    assert "return the object itself" in str(refused.value)  # the tip that works:
    a, s = pytree_ckpt.checkpoint(lambda h: (h * 3, _Stream(h * 2)), x)
    (a.sum() + s.t.pow(2).sum()).backward()
    wrapped, x.grad = x.grad, None
    a, s = x * 3, _Stream(x * 2)
    (a.sum() + s.t.pow(2).sum()).backward()
    assert torch.equal(wrapped, x.grad)
    assert list(_Stream(x * 2)) == []  # while list(...) of it holds no tensor at all
