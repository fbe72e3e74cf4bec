"""A reused call whose fn reads torch.is_grad_enabled() (NOTE [a reused fn that reads the grad
mode] in frozen.py).

Helper DA: Megatron-Core's router counts tokens per expert only ``if torch.is_grad_enabled()``.
Frozen with reuse_during_recompute, the count never happened under checkpointing (the original
pass runs fn under the boundary's no-grad, the replay does not call it): the expert bias drifted
from eager's from the second step, silently.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import frozen, reuse_during_recompute
from pytree_ckpt.function_reach import code_reading


class _Router(nn.Module):
    """Megatron-style: the routing method's helper counts tokens per expert with grad on; with
    ``count_after`` the layer counts after the reused call instead (the warning's fix)."""

    def __init__(self, *, count_after: bool = False, under_no_grad: bool = False) -> None:
        super().__init__()
        self.count_after = count_after
        self.under_no_grad = under_no_grad
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("tokens_per_expert", torch.zeros(4))

    def _count(self, ids: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(ids.flatten(), minlength=4)

    def routing(self, scores: torch.Tensor) -> torch.Tensor:
        ids = (scores + self.expert_bias).topk(2, dim=-1).indices
        self._count(ids)
        return ids

    def routing_only(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores + self.expert_bias).topk(2, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(nn.functional.linear(x, self.weight))
        route = self.routing_only if self.count_after else self.routing
        if self.under_no_grad:
            with torch.no_grad():
                ids = reuse_during_recompute(route, scores.detach())
        else:
            ids = reuse_during_recompute(route, scores.detach())
        if self.count_after:
            self._count(ids)
        return x * scores.gather(-1, ids).sum(-1, keepdim=True)


def _train(router: _Router, steps: int = 3) -> tuple[list[torch.Tensor], list[str]]:
    """Steps of a loop that moves the bias from the counts after backward, as Megatron's does;
    returns the counts and the bias after each step (copies), and the warnings given."""
    seen = []
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            router.zero_grad(set_to_none=True)
            router(torch.randn(6, 8, requires_grad=True)).square().sum().backward()
            with torch.no_grad():
                counts = router.tokens_per_expert
                router.expert_bias += 0.01 * torch.sign(counts.mean() - counts)
            seen += [counts.clone(), router.expert_bias.clone(), router.weight.grad.clone()]
            counts.zero_()
    return seen, [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]


@pytest.fixture(autouse=True)
def _warned_anew() -> None:
    frozen._WARNED_GRAD_MODE.clear()  # said once per function in a process


def test_a_reused_router_counting_only_with_grad_on_is_warned_naming_the_helper() -> None:
    torch.manual_seed(0)
    eager = _Router()
    checkpointed = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager),
                                                              offload=False)
    expected, told_eager = _train(eager)
    got, told = _train(checkpointed)
    assert told_eager == []  # a plain call runs fn with eager's grad mode
    assert len(told) == 1  # once, at the first replay
    assert "_Router._count reads torch.is_grad_enabled()" in told[0]
    assert "Move that part out of the reused call, after it" in told[0]
    assert expected[0].sum() == 6 * 2  # eager: every token's two experts counted, once
    assert got[0].sum() == 0  # what the warning is about: the count never ran


def test_counting_after_the_reused_call_gives_eagers_counts_bias_and_gradients() -> None:
    # The warning's fix: the layer's own code runs again in the replay with grad on, once.
    torch.manual_seed(0)
    eager = _Router(count_after=True)
    checkpointed = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager),
                                                              offload=False)
    expected, _ = _train(eager)
    got, told = _train(checkpointed)
    assert told == []  # the reused routing reads no grad mode now
    assert expected[0].sum() == 6 * 2  # every token's two experts counted, once
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def test_a_reused_call_under_the_layers_own_no_grad_is_not_warned() -> None:
    # Eager runs fn with grad off there too: nothing differs.
    torch.manual_seed(0)
    eager = _Router(under_no_grad=True)
    checkpointed = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager),
                                                              offload=False)
    expected, _ = _train(eager)
    got, told = _train(checkpointed)
    assert told == []
    assert expected[0].sum() == 0
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def _counting_helper(ids: torch.Tensor, counts: torch.Tensor) -> None:
    if torch.is_grad_enabled():
        counts += torch.bincount(ids.flatten(), minlength=counts.numel())


def _told_by_one_step(layer: Any) -> list[str]:
    """The pytree_ckpt warnings of one checkpointed step of ``layer``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(3, 8, requires_grad=True)).sum().backward()
    return [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]


def test_a_module_level_helper_a_plain_function_calls_is_named() -> None:
    counts = torch.zeros(8)

    def route(scores: torch.Tensor) -> torch.Tensor:
        ids = scores.topk(2, dim=-1).indices
        _counting_helper(ids, counts)
        return ids

    def plain(scores: torch.Tensor) -> torch.Tensor:
        return scores.topk(2, dim=-1).indices

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(route, x.detach())) + \
            x.gather(-1, reuse_during_recompute(plain, x.detach()))

    told = _told_by_one_step(layer)
    assert len(told) == 1 and "route): _counting_helper reads torch.is_grad_enabled()" in told[0]


def _accounting_helper(ids: torch.Tensor, counts: torch.Tensor) -> None:
    _counting_helper(ids, counts)  # the read is one call further on


class _Accounting(_Router):
    """The routing method reaches the read through two methods of its own."""

    def _account(self, ids: torch.Tensor) -> None:
        self._count(ids)

    def routing(self, scores: torch.Tensor) -> torch.Tensor:
        ids = (scores + self.expert_bias).topk(2, dim=-1).indices
        self._account(ids)
        return ids


def test_a_read_two_methods_deep_is_named_and_is_what_differs_from_eager() -> None:
    torch.manual_seed(0)
    eager = _Accounting()
    checkpointed = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager),
                                                              offload=False)
    expected, _ = _train(eager)
    got, told = _train(checkpointed)
    assert len(told) == 1 and "_Router._count reads torch.is_grad_enabled()" in told[0]
    assert expected[0].sum() == 6 * 2 and got[0].sum() == 0


def test_a_read_in_a_helper_of_a_helper_is_named() -> None:
    counts = torch.zeros(8)

    def route(scores: torch.Tensor) -> torch.Tensor:
        ids = scores.topk(2, dim=-1).indices
        _accounting_helper(ids, counts)
        return ids

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(route, x.detach()))

    told = _told_by_one_step(layer)
    assert len(told) == 1 and "route): _counting_helper reads torch.is_grad_enabled()" in told[0]


def test_the_read_is_looked_for_four_calls_deep_and_no_further() -> None:
    # Each step holds the next in a closure cell. Every chain's outer step has one code: the
    # answer is kept per code and the functions its cells hold, so chain(5) is looked at anew.
    def chain(depth: int) -> object:
        def reading(ids: torch.Tensor) -> torch.Tensor:
            return ids if torch.is_grad_enabled() else ids

        def wrap(inner: object) -> object:
            def step(ids: torch.Tensor) -> torch.Tensor:
                return inner(ids)  # type: ignore[operator]
            return step

        fn: object = reading
        for _ in range(depth):
            fn = wrap(fn)
        return fn

    assert code_reading(chain(4), "is_grad_enabled").endswith("reading")
    assert code_reading(chain(5), "is_grad_enabled") is None  # docs/limits.md


def test_torchs_own_functions_are_not_looked_into() -> None:
    # MultiheadAttention.forward reads the grad mode to pick its fast path: torch's code,
    # whose results do not depend on it, is not the user's count.
    def route(scores: torch.Tensor) -> torch.Tensor:
        if scores.dim() > 8:
            _MHA_FORWARD(scores, scores, scores)
        return scores.topk(2, dim=-1).indices

    assert code_reading(_MHA_FORWARD, "is_grad_enabled") is not None  # it does read
    assert code_reading(route, "is_grad_enabled") is None


_MHA_FORWARD = nn.MultiheadAttention.forward


class _Counting:
    """A plain router whose own method counts tokens only with grad on."""

    def __init__(self) -> None:
        self.counts = torch.zeros(8)

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        ids = scores.topk(2, dim=-1).indices
        if torch.is_grad_enabled():
            self.counts += torch.bincount(ids.flatten(), minlength=8)
        return ids


class _Quiet:
    def route(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.topk(2, dim=-1).indices


def _through(route: object) -> object:
    return lambda scores: route(scores)  # type: ignore[operator]


def test_closures_of_one_code_over_different_bound_methods_are_each_looked_at() -> None:
    # Helper DD: the cache key held only the plain functions a closure holds, so a closure of
    # the same code over another object's method got the first closure's answer.
    quiet, counting = _Quiet(), _Counting()
    first, second = _through(quiet.route), _through(counting.route)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(first, x.detach())) + \
            x.gather(-1, reuse_during_recompute(second, x.detach()))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(3, 8, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert counting.counts.sum() == 0  # eager counts 3 * 2: what the warning is for
    assert len(told) == 1 and "_Counting.route reads torch.is_grad_enabled()" in told[0]


class _Delegating(_Counting):
    """Its route reaches the read through a method of its own object."""

    def _tally(self, ids: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.counts += torch.bincount(ids.flatten(), minlength=8)

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        ids = scores.topk(2, dim=-1).indices
        self._tally(ids)
        return ids


def test_a_bound_method_a_closure_holds_is_read_with_its_own_objects_methods() -> None:
    # The method found in the closure runs for its own object: self._tally is looked up on
    # _Delegating, not on what the closure is bound to (nothing).
    assert code_reading(_through(_Delegating().route), "is_grad_enabled") == \
        "_Delegating._tally"


class _Logged:
    """A decorator object (functools.update_wrapper): it holds what it wraps as an attribute."""

    def __init__(self, fn: object) -> None:
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.fn = fn

    def __call__(self, *args: object) -> object:
        return self.fn(*args)  # type: ignore[operator]


def _counting_route(scores: torch.Tensor) -> torch.Tensor:
    ids = scores.topk(2, dim=-1).indices
    if torch.is_grad_enabled():
        _counting_route.calls += 1  # type: ignore[attr-defined]
    return ids


def test_a_function_under_two_decorator_objects_is_the_one_named() -> None:
    _counting_route.calls = 0  # type: ignore[attr-defined]
    route = _Logged(_Logged(_counting_route))

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(route, x.detach()))

    x = torch.randn(3, 8, requires_grad=True)
    layer(x)  # eager: grad on, counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, x).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert _counting_route.calls == 1  # type: ignore[attr-defined]  # the eager call only
    assert len(told) == 1 and "_counting_route reads torch.is_grad_enabled()" in told[0]


class _CountingWrapper(nn.Module):
    """A module wrapping another (as its __wrapped__): its own forward counts with grad on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.__wrapped__ = inner
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
        return self.__wrapped__(scores)


class _TopTwo(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.topk(2, dim=-1).indices


def test_a_module_given_as_fn_is_read_as_its_own_forward_not_what_it_wraps() -> None:
    route = _CountingWrapper(_TopTwo())

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(route, x.detach()))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(3, 8, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert route.calls == 0  # eager counts 1: what the warning is for
    assert len(told) == 1 and "_CountingWrapper.forward reads torch.is_grad_enabled()" in told[0]


class _AlwaysCounting(_Router):
    """The same routing method; its own count runs whatever the grad mode (once, as eager)."""

    def _count(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(ids.flatten(), minlength=4)


def test_one_method_code_is_looked_at_anew_for_each_class_it_runs_for() -> None:
    # _Router.routing's code reaches _Router._count, which reads the grad mode: told. For the
    # subclass the same code reaches another _count, which does not: not told, and exact.
    torch.manual_seed(0)
    _, told = _train(pytree_ckpt.apply_activation_checkpointing(_Router(), offload=False))
    assert len(told) == 1 and "_Router._count reads" in told[0]
    eager = _AlwaysCounting()
    checkpointed = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager),
                                                              offload=False)
    expected, _ = _train(eager)
    got, told = _train(checkpointed)
    assert told == []
    assert expected[0].sum() == 6 * 2
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def _spread(fs: list[object]) -> object:
    a, b, c, d, e, f, g, h = fs

    def step(ids: torch.Tensor) -> torch.Tensor:
        return a(b(c(d(e(f(g(h(ids))))))))  # type: ignore[operator]
    return step


def test_helpers_many_callers_share_are_read_once_and_the_read_behind_them_is_named() -> None:
    # Eight helpers each call the same eight, which call the reading one: read once each
    # (by identity), the reading one is reached within the bound on functions read.
    def reading(ids: torch.Tensor) -> torch.Tensor:
        return ids if torch.is_grad_enabled() else ids

    shared = [_spread([reading] * 8) for _ in range(8)]
    route = _spread([_spread(shared) for _ in range(8)])
    assert code_reading(route, "is_grad_enabled").endswith("reading")


def test_a_bound_method_a_closure_calls_is_read_and_named() -> None:
    counting = _Counting()
    score = counting.route
    route = lambda scores: score(scores)  # noqa: E731  # a cell holding a bound method

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(route, x.detach()))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(3, 8, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert counting.counts.sum() == 0  # eager counts 3 * 2
    assert len(told) == 1 and "_Counting.route reads torch.is_grad_enabled()" in told[0]


def test_a_read_in_a_function_nested_in_fn_is_named_as_fn() -> None:
    counts = torch.zeros(8)

    def nesting_route(scores: torch.Tensor) -> torch.Tensor:
        def count(ids: torch.Tensor) -> None:  # a local: known only as fn's nested code
            if torch.is_grad_enabled():
                counts.add_(torch.bincount(ids.flatten(), minlength=8))
        ids = scores.topk(2, dim=-1).indices
        count(ids)
        return ids

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x.gather(-1, reuse_during_recompute(nesting_route, x.detach()))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pytree_ckpt.checkpoint(layer, torch.randn(3, 8, requires_grad=True)).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert counts.sum() == 0  # eager counts 3 * 2
    assert len(told) == 1 and "nesting_route reads torch.is_grad_enabled()" in told[0]


def test_a_reused_trainable_gate_as_a_layers_only_output_is_refused_as_in_eager() -> None:
    # Guards against (helper DO): a call whose outputs are all frozen results leaves no
    # differentiable output, so its node never ran and the replay's check never came: the
    # gate's gradient was silently lost (NOTE [a call that returns only frozen results]).
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 4)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return pytree_ckpt.reuse_during_recompute(self.gate, h)

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(pytree_ckpt.ReuseError):
        Layer()(x)  # eager refuses at the call
    layer = pytree_ckpt.apply_activation_checkpointing(Layer())
    with pytest.raises(pytree_ckpt.ReuseError):
        out = layer(x)
        (out.sum() + x.sum()).backward()  # was: ran, layer.gate.weight.grad stayed None


def test_a_reused_result_of_a_graph_argument_as_the_only_output_is_refused_as_in_eager() -> None:
    # The same through rule 2 (an argument that requires grad): x.grad was 1, not a refusal.
    def scale(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(pytree_ckpt.ReuseError):
        pytree_ckpt.reuse_during_recompute(scale, x)  # eager refuses at the call
    out = pytree_ckpt.checkpoint(lambda h: pytree_ckpt.reuse_during_recompute(scale, h * 1), x)
    with pytest.raises(pytree_ckpt.ReuseError):
        (out.sum() + x.sum()).backward()


def test_frozen_statistics_as_the_only_output_keep_eagers_gradients_and_carry_the_node() -> None:
    # Frozen floats eager computes without grad (a no-grad function of the input), returned
    # alone: the replay runs when backward reaches them and gives them no gradient, so the
    # numbers are eager's. Unlike eager they require grad (they carry the boundary's node).
    @torch.no_grad()
    def load(h: torch.Tensor) -> torch.Tensor:
        return h.softmax(-1).mean(0)

    calls = []

    def layer(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return pytree_ckpt.reuse_during_recompute(load, h), h.argmax(-1)

    x = torch.randn(3, 4, requires_grad=True)
    stats, ids = layer(x)
    (stats.sum() + x.square().sum()).backward()
    expected, x.grad = x.grad, None
    got_stats, got_ids = pytree_ckpt.checkpoint(layer, x)
    assert torch.equal(got_stats, stats) and torch.equal(got_ids, ids)
    assert got_stats.requires_grad and not stats.requires_grad
    (got_stats.sum() + x.square().sum()).backward()
    assert torch.equal(x.grad, expected)
    assert len(calls) == 3  # eager, the original pass, and the replay backward reached


def test_a_module_whose_forward_is_decorated_without_grad_is_told_to_pass_its_forward() -> None:
    # Guards against (helper DM's F5): the refusal told a user whose forward *is* decorated with
    # @torch.no_grad() to use such a function, without saying to pass module.forward (a
    # module's call is refused: its hooks could add a graph).
    class Indexer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(8, 8)

        @torch.no_grad()
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            values, ids = self.wq(x).topk(3, dim=-1)
            return {"ids": ids, "values": values}

    indexer = Indexer()
    x = torch.randn(4, 8)
    with pytest.raises(pytree_ckpt.ReuseError, match="pass module.forward"):
        pytree_ckpt.reuse_during_recompute(indexer, x)
    got = pytree_ckpt.reuse_during_recompute(indexer.forward, x)
    expected = indexer(x)
    assert torch.equal(got["ids"], expected["ids"]) and not got["values"].requires_grad
    assert torch.equal(got["values"], expected["values"])


def test_a_reused_trainable_gate_returned_with_an_untouched_buffer_is_refused_as_in_eager(
        ) -> None:
    # An untouched buffer returned beside it (marked non-differentiable as it is) leaves the
    # gate's weights the only float output that could carry the node: still refused, not a
    # gradient lost silently (NOTE [a call that returns only frozen results]).
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(4))

        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return pytree_ckpt.reuse_during_recompute(self.gate, h), self.table

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(pytree_ckpt.ReuseError):
        Layer()(x)  # eager refuses at the call
    layer = pytree_ckpt.apply_activation_checkpointing(Layer())
    with pytest.raises(pytree_ckpt.ReuseError):
        out = layer(x)
        (out[0].sum() + x.sum()).backward()


def test_frozen_statistics_returned_with_an_input_as_it_is_hand_back_that_input_itself() -> None:
    # Only the frozen floats leave as aliases carrying the node: an input returned as it is
    # (a mask) is still the caller's own tensor, as in eager.
    @torch.no_grad()
    def load(h: torch.Tensor) -> torch.Tensor:
        return h.softmax(-1).mean(0)

    def layer(h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pytree_ckpt.reuse_during_recompute(load, h), mask

    x, mask = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    stats, kept = layer(x, mask)
    got_stats, got_mask = pytree_ckpt.checkpoint(layer, x, mask)
    assert got_mask is mask and kept is mask
    assert torch.equal(got_stats, stats)


def test_frozen_statistics_beside_an_integer_input_and_a_differentiable_output_need_no_grad(
        ) -> None:
    @torch.no_grad()
    def load(h: torch.Tensor) -> torch.Tensor:
        return h.softmax(-1).mean(0)

    def layer(h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pytree_ckpt.reuse_during_recompute(load, h), ids, h * 2

    x, ids = torch.randn(3, 4, requires_grad=True), torch.arange(3)
    stats = layer(x, ids)[0]
    got = pytree_ckpt.checkpoint(layer, x, ids)
    assert torch.equal(got[0], stats)
    assert got[1] is ids
    assert got[0].requires_grad == stats.requires_grad  # False, as in eager (got: True)
