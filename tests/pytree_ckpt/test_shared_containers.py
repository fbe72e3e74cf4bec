"""One container object passed in several places of a call: the replay sees one object there
too (NOTE [containers passed in several places] in pytree_ckpt/shared_containers.py)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pytree_ckpt import apply_activation_checkpointing, checkpoint
from pytree_ckpt.shared_containers import shared_containers
from pytree_ckpt.tree import NAMESPACE, flatten, flatten_call
from tests.conftest import assert_same_grads


def _grads(run: Callable[[bool], torch.Tensor], *tensors: torch.Tensor) -> list[list[torch.Tensor]]:
    """The gradients of ``tensors`` after ``run(wrap).sum().backward()``, eager then wrapped."""
    grads = []
    for wrap in (False, True):
        run(wrap).sum().backward()
        grads.append([t.grad.clone() for t in tensors])
        for t in tensors:
            t.grad = None
    return grads


def test_one_list_passed_in_two_places_and_appended_to_gives_eager_gradients() -> None:
    # Guards against: the replay rebuilt one list per place, so the append through `seen` was
    # not seen through `also`: len(also) was 1 in the replay, 2 in eager (gradients halved).
    weight = torch.randn(4, requires_grad=True)

    def layer(seen: list[Any], also: list[Any]) -> torch.Tensor:
        seen.append("called")
        return also[0] * weight * len(also)

    def run(wrap: bool) -> torch.Tensor:
        shared: list[Any] = [torch.ones(4, requires_grad=True)]
        return checkpoint(layer, shared, shared) if wrap else layer(shared, shared)

    eager, wrapped = _grads(run, weight)
    assert torch.equal(eager[0], wrapped[0])


class Counting(nn.Module):
    """Appends to one place, reads the length of another; the reads scale the output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, log: list[Any], *, extra: dict[str, Any]) -> torch.Tensor:
        log.append("layer")
        extra["seen"].append(len(log))
        return self.proj(h) * len(extra["again"]) + len(extra["seen"])


def test_a_dict_holding_one_list_twice_and_the_list_also_passed_gives_eager_gradients() -> None:
    # Guards against: the replay rebuilt `log`, extra["seen"] and extra["again"] as three
    # lists: the appends through two of them were not seen through the third.
    torch.manual_seed(0)
    eager = Counting()
    wrapped = apply_activation_checkpointing(Counting())
    wrapped.load_state_dict(eager.state_dict())
    grads = []
    for layer in (eager, wrapped):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        log: list[Any] = []
        layer(x, log, extra={"seen": log, "again": log}).sum().backward()
        assert log == ["layer", 1]  # the original pass changed the caller's list once, as eager
        grads.append((x.grad, layer.proj.weight.grad, layer.proj.bias.grad))
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)


@dataclasses.dataclass
class State:
    """A dataclass passed in two places; the forward sets an attribute through one."""

    scale: float
    notes: list[Any]


def test_a_dataclass_passed_twice_and_changed_through_one_place_gives_eager_gradients() -> None:
    # Guards against: the replay rebuilt one State per place: the scale set through `a` was
    # not read through `b` (and the list inside was two lists).
    weight = torch.randn(4, requires_grad=True)

    def layer(x: torch.Tensor, a: State, b: State) -> torch.Tensor:
        a.scale = a.scale * 3.0
        a.notes.append(x.shape)
        return x * weight * b.scale * len(b.notes)

    def run(wrap: bool) -> torch.Tensor:
        x = torch.ones(4, requires_grad=True)
        state = State(1.0, [])
        return checkpoint(layer, x, state, state) if wrap else layer(x, state, state)

    eager, wrapped = _grads(run, weight)
    assert torch.equal(eager[0], wrapped[0])


def test_a_list_in_a_tuple_passed_twice_and_inside_a_namedtuple_gives_eager_gradients() -> None:
    # Tuples are rebuilt per place (they cannot change); the list inside each is one object.
    weight = torch.randn(4, requires_grad=True)
    Pair = collections.namedtuple("Pair", ["items", "label"])

    def layer(first: tuple[list[Any], int], second: tuple[list[Any], int], pair: Any
              ) -> torch.Tensor:
        first[0].append(1.5)
        return weight * sum(second[0]) * len(pair.items)

    def run(wrap: bool) -> torch.Tensor:
        items: list[Any] = [2.0]
        boxed = (items, 7)
        pair = Pair(items, "p")
        return checkpoint(layer, boxed, boxed, pair) if wrap else layer(boxed, boxed, pair)

    eager, wrapped = _grads(run, weight)
    assert torch.equal(eager[0], wrapped[0])


class Notebook:
    """A node type registered with optree in the package's namespace, mutable like a list."""

    def __init__(self, pages: list[Any]) -> None:
        self.pages = pages


optree.register_pytree_node(Notebook, lambda n: ((n.pages,), None, None),
                            lambda _, children: Notebook(*children), namespace=NAMESPACE)


def test_a_registered_node_passed_twice_is_one_object_in_the_replay() -> None:
    # Its unflatten function runs once for both places, as eager has one object there.
    weight = torch.randn(4, requires_grad=True)

    def layer(a: Notebook, b: Notebook) -> torch.Tensor:
        a.pages = [*a.pages, "new"]  # rebinds the attribute: only one object shows it
        return weight * len(b.pages) * (a is b)

    def run(wrap: bool) -> torch.Tensor:
        book = Notebook([torch.ones(4)])
        return checkpoint(layer, book, book) if wrap else layer(book, book)

    eager, wrapped = _grads(run, weight)
    assert torch.equal(eager[0], wrapped[0])
    assert eager[0].abs().sum() > 0


@dataclasses.dataclass
class Box:
    first: Any
    second: Any


flatten(Box(None, None))  # registered now: fn's own flatten opens it in eager runs too


def _build(choices: list[int], x: torch.Tensor) -> tuple[list[Any], dict[str, Any]]:
    """Arguments built from ``choices``: lists, dicts, tuples and dataclasses to depth 3,
    some of them containers already built (placed again: shared), leaves ``x`` and ints."""
    it = iter(choices)
    pool: list[Any] = []

    def build(depth: int) -> Any:
        choice = next(it, 0)
        if choice == 0 or depth == 3:
            return x
        if choice == 1:
            return 2
        if choice in (2, 3):
            return pool[next(it, 0) % len(pool)] if pool else x
        children = [build(depth + 1) for _ in range(next(it, 0) % 3)]
        kind = choice % 4
        built: Any = (children if kind == 0 else
                      {f"k{i}": child for i, child in enumerate(children)} if kind == 1 else
                      tuple(children) if kind == 2 else Box(*(children + [None, None])[:2]))
        pool.append(built)  # complete before it can be placed again: no cycle
        return built

    return [build(0), build(0)], {"extra": build(0)}


def _reads_and_changes(weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    def fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        nodes: list[Any] = []
        optree.tree_flatten((args, kwargs), is_leaf=nodes.append, namespace=NAMESPACE)
        out = weight * 0
        for i, node in enumerate(nodes[2:], start=1):  # past the call's own tuple and args
            if isinstance(node, torch.Tensor):
                out = out + node * i
                continue
            size = len(vars(node)) if isinstance(node, Box) else \
                len(node) if isinstance(node, (list, dict, tuple)) else 0
            out = out + weight * (i * size)  # what earlier changes through other places left
            if isinstance(node, list):
                node.append(i)
            elif isinstance(node, dict):
                node[f"n{i}"] = i
            elif isinstance(node, Box):
                setattr(node, f"n{i}", i)
        return out

    return fn


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choices=st.lists(st.integers(0, 11), max_size=40))
def test_random_arguments_with_shared_containers_give_eager_gradients(choices: list[int]) -> None:
    weight = torch.randn(3, requires_grad=True)
    fn = _reads_and_changes(weight)
    grads = []
    for wrap in (False, True):
        x = torch.ones(3, requires_grad=True)
        args, kwargs = _build(choices, x)
        (checkpoint(fn, *args, **kwargs) if wrap else fn(*args, **kwargs)).sum().backward()
        grads.append([weight.grad, x.grad])  # x's is None when no place holds x
        weight.grad = None
    assert_same_grads(*grads)


def test_only_a_repeated_container_object_is_recorded() -> None:
    x = torch.ones(2)

    def recorded(*args: Any, **kwargs: Any) -> dict[int, int] | None:
        return shared_containers((args, kwargs), flatten_call(args, kwargs).spec)

    assert recorded(x, x) is None  # the usual call: no container at all
    assert recorded(x, mask=None, cache=None, ids=[x]) is None
    assert recorded([x], [x], {"a": [x]}) is None  # equal lists, distinct objects
    same = (x,)
    assert recorded(same, same, ids=same) is None  # tuples are not recorded
    log: list[Any] = []
    # Pre-order positions: 0 (args, kwargs), 1 args, 2 log, 3 the dict, 4 its "a" list (log),
    # 5 kwargs, 6 extra (log).
    assert recorded(log, {"a": log}, extra=log) == {4: 2, 6: 2}


def test_the_cache_of_container_positions_stays_bounded_when_every_call_has_another_structure(
        ) -> None:
    # Lists of varying length (a changing number of micro-batches, of cached layers) give a new
    # spec at each call: the positions cached per spec must be dropped when full, not kept for
    # every spec ever seen (a leak that grows with the steps).
    from pytree_ckpt import shared_containers as module

    x = torch.ones(2)
    log: list[Any] = []
    for n in range(module._MAX_SPECS + 50):
        args = ([x] * (n + 1), log)
        spec = flatten_call(args, {"again": log}).spec
        assert shared_containers((args, {"again": log}), spec) is not None
        assert len(module._POSITIONS) <= module._MAX_SPECS
