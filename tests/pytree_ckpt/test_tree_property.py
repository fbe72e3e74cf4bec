"""Property test: random input and output PyTrees give eager gradients through the boundary."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import optree
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytree_ckpt import checkpoint
from pytree_ckpt.tree import LEAF_SPEC, NAMESPACE, flatten, flatten_call, unflatten
from tests.conftest import assert_same_grads

Point = collections.namedtuple("Point", "a b")


@dataclasses.dataclass
class Box:
    first: Any
    second: Any


def tensor_leaf() -> st.SearchStrategy[Any]:
    floating = st.tuples(st.sampled_from([torch.float32, torch.float64]), st.booleans(),
                         st.integers(1, 3)).map(
        lambda spec: torch.randn(spec[2], dtype=spec[0]).requires_grad_(spec[1]))
    integer = st.integers(1, 4).map(lambda n: torch.arange(n, dtype=torch.int64))
    return st.one_of(floating, integer)


leaves = st.one_of(tensor_leaf(), st.integers(-3, 3), st.text(max_size=3), st.none(),
                   st.sampled_from([torch.bfloat16, "cfg"]))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        st.tuples(children, children).map(lambda ab: Point(*ab)),
        st.tuples(children, children).map(lambda ab: Box(*ab)),
    ),
    max_leaves=8,
)
# The tree bridge opens dataclasses (registering them on first sight); the test flattens with
# it too, so eager and checkpointed runs see the same leaves.
# An output skeleton: each slot says what the function puts there.
slots = st.sampled_from(["mix", "passthrough", "ids", "object", "none"])
out_skeletons = st.recursive(
    slots,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["hidden_states", "dsa_topk_ids", "aux"]), children,
                        min_size=1, max_size=3),
        st.tuples(children, children).map(lambda ab: Point(*ab)),
        st.tuples(children, children).map(lambda ab: Box(*ab)),
    ),
    max_leaves=6,
)


def make_fn(skeleton: Any, weight: torch.Tensor) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        floats = [t for t in flatten((args, kwargs)).leaves
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        mixed = weight.sin()
        for i, t in enumerate(floats):
            mixed = mixed + (t.double().square().sum() * (i + 1)).to(mixed.dtype)
        counter = iter(range(100))

        def fill(slot: str) -> Any:
            k = next(counter)
            if slot == "mix":
                return mixed * (k + 1) + weight.cos()
            if slot == "passthrough":
                return floats[k % len(floats)] * 2 if floats else weight * 2
            if slot == "ids":
                return torch.arange(k + 1)
            return None if slot == "none" else ("obj", k)

        flat = flatten(skeleton)
        return optree.tree_unflatten(flat.spec, [fill(slot) for slot in flat.leaves])

    return fn


def loss_of(out: Any) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for leaf in flatten(out).leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            total = total + leaf.double().sum()
    return total


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.lists(trees, max_size=3), kwargs=st.dictionaries(st.sampled_from(["x", "y", "fn"]),
                                                              trees, max_size=2),
       skeleton=out_skeletons)
def test_random_pytrees_give_eager_gradients_and_the_same_structure(args: list[Any],
                                                                    kwargs: dict[str, Any],
                                                                    skeleton: Any) -> None:
    weight = torch.randn(3, requires_grad=True)
    fn = make_fn(skeleton, weight)
    grad_leaves = [weight] + [t for t in flatten((args, kwargs)).leaves
                              if isinstance(t, torch.Tensor) and t.requires_grad]
    eager_out = fn(*args, **kwargs)
    eager_loss = loss_of(eager_out)
    if eager_loss.requires_grad:
        eager_loss.backward()
    eager = [None if t.grad is None else t.grad.clone() for t in grad_leaves]
    for t in grad_leaves:
        t.grad = None
    out = checkpoint(fn, *args, **kwargs)
    assert flatten(out).spec == flatten(eager_out).spec
    loss = loss_of(out)
    assert torch.equal(loss.detach(), eager_loss.detach())
    if loss.requires_grad:
        loss.backward()
    assert_same_grads(eager, [t.grad for t in grad_leaves])


@given(n=st.integers(0, 4), with_kwargs=st.booleans())
def test_the_fast_paths_build_optrees_own_specs_and_leaves(n: int, with_kwargs: bool) -> None:
    args = tuple(torch.randn(2) for _ in range(n))
    kwargs = {"scale": torch.randn(1)} if with_kwargs else {}
    fast = flatten_call(args, kwargs)
    leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
    assert fast.spec == spec and fast.tensor_index == list(range(len(leaves)))
    assert all(a is b for a, b in zip(fast.leaves, leaves)) and len(fast.leaves) == len(leaves)
    assert optree.tree_unflatten(fast.spec, fast.leaves) == (args, kwargs)
    tensor = torch.randn(3)
    assert flatten(tensor).spec == optree.tree_structure(tensor, namespace=NAMESPACE) == LEAF_SPEC
    assert unflatten(LEAF_SPEC, [tensor]) is tensor


# Trees whose leaves alias one another: a later tensor leaf may be an earlier one again, a view
# of it or a slice of it; containers of every kind the bridge opens, keys of several types,
# plain leaves of torch's own types, and complex, integer, boolean and empty tensors.
Frozen = dataclasses.make_dataclass("Frozen", [("only", Any)], frozen=True)


@st.composite
def aliased_calls(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any]]:
    drawn: list[torch.Tensor] = []

    @st.composite
    def tensor(draw: st.DrawFn) -> torch.Tensor:
        if drawn and draw(st.integers(0, 2)) == 0:
            earlier = draw(st.sampled_from(drawn))
            kind = draw(st.sampled_from(["same", "view", "slice"]))
            if kind == "slice" and earlier.shape[0] > 1:
                return earlier[1:]
            return earlier.view(earlier.shape) if kind == "view" else earlier
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.complex64,
                                      torch.int64, torch.bool]))
        t = torch.randn(draw(st.integers(0, 3)), dtype=torch.float64).to(dtype)
        if (dtype.is_floating_point or dtype.is_complex) and draw(st.booleans()):
            t.requires_grad_()
        drawn.append(t)
        return t

    keys = st.one_of(st.sampled_from("ab"), st.integers(0, 2),
                     st.tuples(st.integers(0, 1), st.integers(0, 1)))
    plain = st.sampled_from([torch.bfloat16, torch.device("cpu"), (), [], {}, b"raw", 1.5])
    tree = st.recursive(
        st.one_of(tensor(), plain, st.none(), st.integers(-2, 2)),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(keys, children, max_size=3),
            st.lists(st.tuples(st.sampled_from("xyz"), children), max_size=3).map(
                collections.OrderedDict),
            st.dictionaries(st.sampled_from("pq"), children, max_size=2).map(
                lambda d: collections.defaultdict(list, d)),
            st.tuples(children, children).map(lambda ab: Point(*ab)),
            children.map(Frozen)),
        max_leaves=8)
    return draw(st.lists(tree, max_size=3)), draw(st.dictionaries(st.just("x"), tree, max_size=1))


def make_aliasing_fn(skeleton: Any, weight: torch.Tensor) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in flatten((args, kwargs)).leaves if isinstance(t, torch.Tensor)]
        mixed = weight.sin()
        for i, t in enumerate(tensors):
            value = t.abs() if t.is_complex() else t
            mixed = mixed + (value.double().square().sum() * (i + 1)).to(mixed.dtype)
        counter = iter(range(100))

        def fill(slot: str) -> Any:
            k = next(counter)
            if slot == "mix":
                return mixed * (k + 1) + weight.cos()
            if slot == "passthrough":  # an input as it is
                return tensors[k % len(tensors)] if tensors else weight * 2
            if slot == "ids":  # a view of an input
                return tensors[k % len(tensors)][:] if tensors else torch.arange(k + 1)
            return None if slot == "none" else ("obj", k)

        flat = flatten(skeleton)
        return optree.tree_unflatten(flat.spec, [fill(slot) for slot in flat.leaves])

    return fn


def weighted_loss(out: Any) -> torch.Tensor:
    """Every leaf that requires grad, each element weighted differently."""
    total = torch.zeros((), dtype=torch.float64)
    for leaf in flatten(out).leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            value = torch.view_as_real(leaf) if leaf.is_complex() else leaf
            total = total + (value.double() * torch.arange(value.numel()).view(
                value.shape).cos()).sum()
    return total


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=aliased_calls(), skeleton=out_skeletons)
def test_aliased_inputs_and_outputs_of_any_kind_give_eagers_values_flags_and_gradients(
        call: tuple[list[Any], dict[str, Any]], skeleton: Any) -> None:
    # Leaves that are one tensor, views or slices of one another, returned as they are or as
    # views: values, requires_grad of each output leaf and every gradient are eager's.
    args, kwargs = call
    weight = torch.randn(3, requires_grad=True)
    fn = make_aliasing_fn(skeleton, weight)
    leaves = [t for t in flatten((args, kwargs)).leaves if isinstance(t, torch.Tensor)]
    roots = {id(t): t for t in (leaf if leaf._base is None else leaf._base for leaf in leaves)}
    grad_leaves = [weight, *(t for t in roots.values() if t.requires_grad)]
    eager_out = fn(*args, **kwargs)
    eager_loss = weighted_loss(eager_out)
    if eager_loss.requires_grad:
        eager_loss.backward()
    eager = [None if t.grad is None else t.grad.clone() for t in grad_leaves]
    for t in grad_leaves:
        t.grad = None
    out = checkpoint(fn, *args, **kwargs)
    assert flatten(out).spec == flatten(eager_out).spec
    for expected, got in zip(flatten(eager_out).leaves, flatten(out).leaves):
        if isinstance(expected, torch.Tensor):
            assert torch.equal(expected.detach(), got.detach())
            assert (expected.dtype, expected.requires_grad) == (got.dtype, got.requires_grad)
        else:
            assert expected == got
    loss = weighted_loss(out)
    assert torch.equal(loss.detach(), eager_loss.detach())
    if loss.requires_grad:
        loss.backward()
    assert_same_grads(eager, [t.grad for t in grad_leaves])
