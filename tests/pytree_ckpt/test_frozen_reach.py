"""What a reused call's fn reaches past its first place: attributes its code reads.

Rule 3 of reuse_during_recompute (NOTE [what fn reaches with grad] in grad_reach.py) refuses a
float result where fn reaches a trainable module or a tensor that requires grad. Before this
file's change the look stopped one value in, so a router a closure reached as
``holder.cfg.gate`` replayed its gate weights without their graph under checkpointing: the
gate got no gradient, silently, where eager refuses the result (it requires grad).
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import ReuseError, checkpoint, current_phase, reuse_during_recompute
from tests.conftest import assert_same_grads, run_twice
from tests.pytree_ckpt.models import DictSettings, Log


class _Holder:
    """A plain object holding a config that holds the gate (not a module: nothing registers
    the gate as a submodule of anything fn is)."""

    def __init__(self, gate: nn.Module) -> None:
        self.cfg = types.SimpleNamespace(gate=gate, k=2)
        self.unused = nn.Linear(8, 8)  # trainable, never read by the router


class _FrozenRouter(nn.Module):
    """A module without trainable parameters whose method routes with what it holds plainly."""

    def __init__(self, gate: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["plain"] = types.SimpleNamespace(gate=gate)  # not a submodule
        self.scale = scale  # a tensor attribute, not a parameter or buffer

    def by_gate(self, x: torch.Tensor) -> Any:
        return self.plain.gate(x).softmax(-1).topk(2, dim=-1)

    def forward(self, x: torch.Tensor) -> Any:  # the module itself as fn
        return self.plain.gate(x).softmax(-1).topk(2, dim=-1)

    def by_scale(self, x: torch.Tensor) -> Any:
        return (x[:, :4] * self.scale).softmax(-1).topk(2, dim=-1)


# The gate is not the registry's first entry: every entry is looked at.
_REGISTRY = types.SimpleNamespace(routers={"frozen": nn.Identity()})


def _route_registry(x: torch.Tensor) -> Any:
    return _REGISTRY.routers["gate"](x).softmax(-1).topk(2, dim=-1)


def _router(how: str, gate: nn.Linear) -> Any:
    if how == "closure over a holder":
        holder = _Holder(gate)
        return lambda x: holder.cfg.gate(x).softmax(-1).topk(holder.cfg.k, dim=-1)
    if how == "frozen module's plain attribute":
        return _FrozenRouter(gate, torch.ones(4)).by_gate
    if how == "frozen module as fn":
        return _FrozenRouter(gate, torch.ones(4))
    if how == "four attributes deep":
        deep = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(
            c=types.SimpleNamespace(gate=gate))))
        return lambda x: deep.a.b.c.gate(x).softmax(-1).topk(2, dim=-1)
    if how == "read in a generator expression":
        many = types.SimpleNamespace(gates=[gate])
        return lambda x: sum(many.gates[i](x) for i in range(1)).softmax(-1).topk(2, dim=-1)
    if how == "frozen module's tensor attribute":
        return _FrozenRouter(nn.Identity(), gate.weight[0, :4]).by_scale
    if how == "bound method in a closure":
        score = gate.forward
        return lambda x: score(x).softmax(-1).topk(2, dim=-1)
    _REGISTRY.routers["gate"] = gate
    if how == "callable object reading a global":
        return _RegistryRouter()
    if how == "decorated method of a plain holder":
        return _Scorer(gate).routed
    return _route_registry


class _RegistryRouter:
    """A callable object holding nothing: its __call__ reads the global registry."""

    def __call__(self, x: torch.Tensor) -> Any:
        return _REGISTRY.routers["gate"](x).softmax(-1).topk(2, dim=-1)


@pytest.mark.parametrize("how, place", [
    ("closure over a holder", "closure variable 'holder', at .cfg.gate"),
    ("frozen module's plain attribute", "its module, at .plain.gate"),
    ("frozen module's tensor attribute", "its module, at .scale"),
    ("frozen module as fn", "its module, at .plain.gate"),
    ("four attributes deep", "closure variable 'deep', at .a.b.c.gate"),
    ("read in a generator expression", "closure variable 'many', at .gates[0]"),
    ("global registry object", "global '_REGISTRY', at .routers['gate']"),
    ("callable object reading a global", "global '_REGISTRY', at .routers['gate']"),
    ("bound method in a closure", "closure variable 'score'"),
    # A bound method's __wrapped__ is the plain function: unwrapping it lost the holder.
    ("decorated method of a plain holder", "attribute 'gate' of its _Scorer"),
])
def test_a_router_reached_through_attributes_fn_reads_is_refused_as_in_eager(
        how: str, place: str) -> None:
    gate = nn.Linear(8, 4)
    route = _router(how, gate)  # made once, as a layer holds it

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x[:, :2] * weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="returned result.values, which requires grad"):
        layer(x)  # eager: the weights carry the gate's graph
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError) as refused:
        out.sum().backward()  # before: passed, and the gate got no gradient
    assert place in str(refused.value) and "float result.values" in str(refused.value)
    assert gate.weight.grad is None  # refused before anything was accumulated


def test_a_trainable_module_the_code_does_not_read_refuses_nothing() -> None:
    # Only attributes whose names fn's code reads are looked in: the holder's trainable
    # `unused` and a frozen gate give floats without a graph in eager too.
    holder = _Holder(nn.Linear(8, 4).requires_grad_(False))
    route = lambda x: holder.cfg.gate(x).softmax(-1).topk(holder.cfg.k, dim=-1)  # noqa: E731
    calls = Log()

    def layer(x: torch.Tensor) -> torch.Tensor:
        calls.append(current_phase())
        weights, ids = reuse_during_recompute(route, x.detach())
        return holder.unused(x).gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(  # eager, then checkpointed
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(),
        [x, *holder.unused.parameters()]))
    assert len(calls) == 3  # eager, the original pass and the replay


def test_a_holder_that_refers_to_itself_is_looked_at_once_and_its_floats_replay() -> None:
    # A cycle (node.next is node) ends the look: each value is looked at once.
    node = types.SimpleNamespace(k=2)
    node.next = node

    def route(x: torch.Tensor) -> Any:
        return x.softmax(-1).topk(node.next.next.k, dim=-1)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x.gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(), [x]))


def test_a_frozen_module_holding_a_trainable_module_its_code_does_not_read_refuses_nothing(
        ) -> None:
    # A frozen router holding its trainable parent plainly (a back-reference) under a name
    # by_scale never reads computes its floats without grad in eager: they replay.
    router = _FrozenRouter(nn.Identity(), torch.ones(4))
    parent = nn.Linear(8, 8)
    router.__dict__["parent"] = parent
    route = router.by_scale

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return parent(x).gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(),
        [x, *parent.parameters()]))


_Config = collections.namedtuple("_Config", "gate k head")


def test_a_trainable_module_in_a_namedtuple_field_the_code_does_not_read_refuses_nothing(
        ) -> None:
    # Guards against (helper FQ, mutant Q44): every field of a namedtuple looked in, not only
    # those fn's code reads: its trainable `head` (used outside the reused call) would refuse
    # floats that eager computes without grad.
    cfg = _Config(nn.Linear(8, 4).requires_grad_(False), 2, nn.Linear(8, 8))
    route = lambda x: cfg.gate(x).softmax(-1).topk(cfg.k, dim=-1)  # noqa: E731
    calls = Log()

    def layer(x: torch.Tensor) -> torch.Tensor:
        calls.append(current_phase())
        weights, ids = reuse_during_recompute(route, x.detach())
        return cfg.head(x).gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*run_twice(
        lambda ckpt: (checkpoint(layer, x) if ckpt else layer(x)).sum().backward(),
        [x, *cfg.head.parameters()]))
    assert len(calls) == 3  # eager, the original pass and the replay


class _Counted:
    """A plain config that counts the reads of its ``__dict__``: each look in it reads it."""

    def __init__(self) -> None:
        self.k = 2
        self.reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            object.__getattribute__(self, "__dict__")["reads"] += 1
        return object.__getattribute__(self, name)


def _dict_reads_of_one_look(holder: Any, counted: _Counted) -> int:
    """How often a reused call returning floats (detached inputs, grad on) reads counted's
    __dict__: the refusal check looks at what the route reaches once per call."""
    def route(x: torch.Tensor) -> Any:
        if holder is None:  # never true: only names the route reads
            return holder.a.b.c.k + holder.b.k
        return x.softmax(-1).topk(2, dim=-1)

    before = counted.reads
    reuse_during_recompute(route, torch.randn(3, 8))
    return counted.reads - before


def test_a_value_reached_along_two_paths_is_looked_in_once() -> None:
    counted = _Counted()
    once = _dict_reads_of_one_look(types.SimpleNamespace(a=counted, b=None), counted)
    twice = _dict_reads_of_one_look(types.SimpleNamespace(a=counted, b=counted), counted)
    assert once > 0 and twice == once


def test_the_look_opens_nothing_four_attributes_from_a_place() -> None:
    # A gate four attributes away is found (the parametrized test above); a plain object
    # there is not opened: the look is bounded as docs/limits.md says (up to four steps).
    counted = _Counted()
    three = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=counted)))
    four = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(
        c=types.SimpleNamespace(b=counted))))
    assert _dict_reads_of_one_look(three, counted) > 0
    assert _dict_reads_of_one_look(four, counted) == 0


_GateTuple = collections.namedtuple("_GateTuple", "gate k")


class _ClassHeld:
    gate: nn.Module  # set per case on the class, read through an instance


class _Propped:
    """A holder giving its gate through a property (the getter reads self._gate)."""

    def __init__(self, gate: nn.Module) -> None:
        self._gate = gate

    @property
    def gate(self) -> nn.Module:
        return self._gate


class _FrozenOuter(nn.Module):
    """A frozen module whose frozen submodule holds the gate as a plain attribute."""

    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.sub = _FrozenRouter(gate, torch.ones(4))

    def route(self, x: torch.Tensor) -> Any:
        return self.sub.plain.gate(x).softmax(-1).topk(2, dim=-1)


_HELD: dict[str, nn.Module] = {}


def _helper_scores(x: torch.Tensor) -> torch.Tensor:
    return _HELD["gate"](x)


def _logged(method: Any) -> Any:
    """A decorator keeping the method's name (functools.wraps sets __wrapped__)."""
    @functools.wraps(method)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)
    return logged


def _weighted(x: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


class _Scorer:
    """A plain holder whose method reads the gate (the caller's code reads only .score)."""

    def __init__(self, gate: nn.Module) -> None:
        self.gate = gate

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    @_logged
    def routed(self, x: torch.Tensor) -> Any:
        return self.gate(x).softmax(-1).topk(2, dim=-1)


class _BadKey:
    """A dict key whose repr raises (the look names it by its type instead)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BadKey)


keyed: dict[Any, nn.Module] = {}


def _missed_router(how: str, gate: nn.Linear) -> Any:
    keyed[_BadKey()] = gate
    if how == "namedtuple config":
        cfg = _GateTuple(gate, 2)
        return lambda x: cfg.gate(x).softmax(-1).topk(cfg.k, dim=-1)
    if how == "OrderedDict registry":
        routers = collections.OrderedDict(gate=gate)
        return lambda x: routers["gate"](x).softmax(-1).topk(2, dim=-1)
    if how == "class attribute read through an instance":
        _ClassHeld.gate = gate
        held = _ClassHeld()
        return lambda x: held.gate(x).softmax(-1).topk(2, dim=-1)
    if how == "property of a holder":
        propped = _Propped(gate)
        return lambda x: propped.gate(x).softmax(-1).topk(2, dim=-1)
    if how == "getattr by name":
        holder = types.SimpleNamespace(gate=gate)
        return lambda x: getattr(holder, "gate")(x).softmax(-1).topk(2, dim=-1)
    if how == "Python module as a namespace":
        state = types.ModuleType("router_state")
        state.gate = gate  # type: ignore[attr-defined]
        return lambda x: state.gate(x).softmax(-1).topk(2, dim=-1)
    if how == "frozen submodule's plain attribute":
        return _FrozenOuter(gate).route
    if how == "helper closure":
        score = lambda x: gate(x)  # noqa: E731
        return lambda x: score(x).softmax(-1).topk(2, dim=-1)
    if how == "module-level helper":
        _HELD["gate"] = gate
        return lambda x: _helper_scores(x).softmax(-1).topk(2, dim=-1)
    if how == "partial of a helper":
        weighted = functools.partial(_weighted, weight=gate.weight)
        return lambda x: weighted(x).softmax(-1).topk(2, dim=-1)
    if how == "bound method of a plain holder":
        scorer = _Scorer(gate)
        return lambda x: scorer.score(x).softmax(-1).topk(2, dim=-1)
    if how == "dict key whose repr raises":
        return lambda x: keyed[_BadKey()](x).softmax(-1).topk(2, dim=-1)
    # A value first met far from one place (three steps in) is marked seen with one step
    # left, so from a nearer place its gate (two steps on) is not looked for.
    near = types.SimpleNamespace(p=types.SimpleNamespace(gate=gate))
    far = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=near)))

    def route(x: torch.Tensor) -> Any:
        assert far.a.b.c is near
        return near.p.gate(x).softmax(-1).topk(2, dim=-1)
    return route


@pytest.mark.parametrize("how, place", [
    ("namedtuple config", "closure variable 'cfg', at .gate"),
    ("OrderedDict registry", "closure variable 'routers'['gate']"),
    ("class attribute read through an instance", "closure variable 'held', at .gate"),
    ("value first met further away", "closure variable 'near', at .p.gate"),
    ("property of a holder", "closure variable 'propped', at ._gate"),
    ("getattr by name", "closure variable 'holder', at .gate"),
    ("Python module as a namespace", "closure variable 'state', at .gate"),
    ("frozen submodule's plain attribute", "its module, at .sub.plain.gate"),
    ("dict key whose repr raises", "global 'keyed'[<_BadKey>]"),
    ("helper closure", "closure variable 'score' via _missed_router.<locals>.<lambda>: "
                       "closure variable 'gate'"),
    ("module-level helper", "global '_helper_scores' via _helper_scores: global '_HELD'['gate']"),
    ("partial of a helper", "closure variable 'weighted' via partial: partial keyword 'weight'"),
    ("bound method of a plain holder", "closure variable 'scorer', at .gate"),
])
def test_a_router_in_other_containers_classes_properties_or_modules_is_refused_naming_it(
        how: str, place: str) -> None:
    # Helper CY (mutation round of 6930922): each of these gave the gate no gradient under
    # checkpointing, silently, where eager refuses the result.
    gate = nn.Linear(8, 4)
    route = _missed_router(how, gate)

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x[:, :2] * weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="which requires grad"):
        layer(x)  # eager: the weights carry the gate's graph
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError, match="float result.values") as refused:
        out.sum().backward()
    assert place in str(refused.value)
    assert gate.weight.grad is None  # refused before anything was accumulated


def test_a_router_in_a_list_of_exactly_64_modules_is_refused_naming_its_index() -> None:
    # Guards against (helper FQ, mutant Q43): a list of exactly _OPENED (64) values left
    # unopened like one of 65 (documented: "a dict, list or tuple of at most 64 values" is
    # opened): the gate got no gradient under checkpointing, silently, where eager refuses.
    gate = nn.Linear(8, 4)
    routers = [nn.Identity() for _ in range(63)] + [gate]
    route = lambda x: routers[63](x).softmax(-1).topk(2, dim=-1)  # noqa: E731

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x[:, :2] * weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="which requires grad"):
        layer(x)  # eager: the weights carry the gate's graph
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError, match="float result.values") as refused:
        out.sum().backward()
    assert "closure variable 'routers'[63]" in str(refused.value)
    assert gate.weight.grad is None  # refused before anything was accumulated


def test_an_int_read_through_a_trainable_model_refuses_the_floats_in_eager_too() -> None:
    # The rule is static: a trainable module reached is refused whatever fn reads from it
    # (docs/replay.md), alike in eager and under checkpointing; the message says where.
    model = nn.Linear(8, 4)
    model.config = types.SimpleNamespace(k=2)  # type: ignore[assignment]
    ctx = types.SimpleNamespace(model=model)
    route = lambda x: x.softmax(-1).topk(ctx.model.config.k, dim=-1)  # noqa: E731

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = reuse_during_recompute(route, x.detach())
        return x.gather(-1, ids) * weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="closure variable 'ctx', at .model"):
        layer(x)
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError, match="closure variable 'ctx', at .model"):
        out.sum().backward()


def test_library_modules_a_router_reads_are_not_opened() -> None:
    # torch, torch.nn.functional, math: their attributes hold nothing of the user's, and
    # opening them would spend the look's budget before the user's own places.
    import math

    from pytree_ckpt import grad_reach

    for module in (torch, nn.functional, math):
        look = grad_reach._Look(frozenset({"softmax", "topk", "sqrt", "float32"}))
        assert look("global", "", module, 4) is None
        assert look.budget == grad_reach._VALUES - 1  # the module itself, nothing inside
    user = types.ModuleType("router_state")
    user.gate = nn.Linear(2, 2)  # type: ignore[attr-defined]
    assert grad_reach._Look(frozenset({"gate"}))("global 'state'", "", user, 4) is not None


class _Slotted:
    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def _weights_from_holder(holder: Any) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = holder.logits.softmax(-1).topk(2, dim=-1)
    return ids, weights


@pytest.mark.parametrize("wrap", [lambda t: types.SimpleNamespace(logits=t), _Slotted],
                         ids=["namespace", "slots"])
def test_logits_passed_inside_a_plain_object_argument_are_refused_as_in_eager(wrap: Any) -> None:
    gate = nn.Linear(8, 4)

    def layer(x: torch.Tensor) -> torch.Tensor:
        ids, weights = reuse_during_recompute(_weights_from_holder, wrap(gate(x)))
        return x[:, :2] * weights + ids

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="requires grad"):
        layer(x)  # eager: the weights carry the gate's graph
    with pytest.raises(ReuseError):
        checkpoint(layer, x).sum().backward()  # got: no error, gate.weight.grad is None


class _NamespaceRouter(nn.Module):
    """A trainable gate whose weights come back inside a plain object (not a PyTree node)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> Any:
        return types.SimpleNamespace(weights=self.gate(x).softmax(-1))


def test_a_trainable_routers_weights_in_a_plain_object_are_refused_as_in_eager() -> None:
    # mutant: _refuse_hidden not asking grad_reach (only arguments that require grad): the
    # static look finds the gate, so nothing is probed, and the weights were replayed
    # without graph, silently (eager gave the gate a gradient)
    router = _NamespaceRouter()

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x[:, :4] * reuse_during_recompute(router, x.detach()).weights

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match=r"SimpleNamespace holding a float tensor at result\."):
        layer(x)  # eager
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError, match=r"SimpleNamespace holding a float tensor at result\."):
        out.sum().backward()


def _scaled_by(settings: DictSettings) -> Any:
    """A decorator factory of the user's: the wrapper's closure holds the settings object."""
    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def wrapper(h: torch.Tensor) -> torch.Tensor:
            return f(h) * settings.scale
        return wrapper
    return decorate


@_scaled_by(DictSettings(scale=2.0))
def _routing_weights(h: torch.Tensor) -> torch.Tensor:
    return h.softmax(-1)


# Guards against (helper HK), as it was found:
def test_a_decorated_fn_whose_closure_holds_a_config_object_returns_floats_from_detached_inputs(
        ) -> None:
    # Frozen floats from a detached input (allowed by rule 3). fn is decorated by the user's
    # functools.wraps decorator, whose closure holds a config object whose __getattr__ raises
    # KeyError: _decorated_without_grad (frozen.py:579) asked each cell's content for
    # __self__ with getattr, and the KeyError escaped, in a plain call as under checkpointing.
    lin = nn.Linear(4, 4)

    def layer(x: torch.Tensor, reuse: Any) -> torch.Tensor:
        h = lin(x)
        return (h * reuse(_routing_weights, h.detach())).sum()

    x = torch.randn(3, 4, requires_grad=True)
    expected = layer(x, lambda fn, h: fn(h))
    expected.backward()
    grads, x.grad, lin.weight.grad, lin.bias.grad = [x.grad, lin.weight.grad, lin.bias.grad], \
        None, None, None
    assert torch.equal(layer(x, reuse_during_recompute), expected)  # a plain call
    got = checkpoint(layer, x, reuse_during_recompute)
    assert torch.equal(got, expected)
    got.backward()
    assert_same_grads(grads, [x.grad, lin.weight.grad, lin.bias.grad])


# Helper MW's mutation round (grad_reach.py): each test below kills a hand-made mutant the
# tests above let live; its comment names the mutant.


def test_library_functions_a_router_reaches_are_not_opened() -> None:
    # mutant: _Look._helper opening torch's and the standard library's functions as the
    # user's (their defaults, closure cells and the globals their code reads): nothing of the
    # user's is there, and the look spent its budget on them before the user's own places
    import json

    from pytree_ckpt import grad_reach

    for function in (nn.functional.gumbel_softmax, nn.functional.dropout, json.dumps):
        look = grad_reach._Look(frozenset({"softmax"}))
        assert look("global", "", function, 4) is None
        assert look.budget == grad_reach._VALUES - 1  # the function itself, nothing inside
    gate = nn.Linear(2, 2)
    user = lambda x, g=gate: g(x)  # noqa: E731  (the user's: its default is looked at)
    assert grad_reach._Look(frozenset())("global 'route'", "", user, 4) is not None


def test_a_generated_routers_global_gate_read_by_name_is_refused_naming_it() -> None:
    # mutant: globals_read taking LOAD_GLOBAL only, not LOAD_NAME (code compiled in "eval" or
    # "exec" mode, made a function: a generated router): the look missed the global gate and
    # only the probe refused, naming no place fn reaches it from
    gate = nn.Linear(8, 4)
    route = types.FunctionType(compile("gate.weight.sum(0)", "<generated router>", "eval"),
                               {"gate": gate})

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x * reuse_during_recompute(route)

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ReuseError, match="which requires grad"):
        layer(x)  # eager: the result carries the gate's graph
    out = checkpoint(layer, x)
    with pytest.raises(ReuseError, match=r"reaches a module with trainable parameters "
                                         r"\(Linear, global 'gate'\)"):
        out.sum().backward()


class _CountingRouter:
    """A callable router whose class counts the reads of its attributes (a proxy, a lazy
    config): the look must read its instance dict, not run its ``__getattribute__``."""

    def __init__(self, gate: nn.Module) -> None:
        self.gate = gate
        self.__dict__["reads"] = []

    def __getattribute__(self, name: str) -> Any:
        if name == "gate":
            object.__getattribute__(self, "__dict__")["reads"].append(name)
        return object.__getattribute__(self, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).softmax(-1)


def test_the_look_reads_a_callable_objects_attributes_without_running_its_getattribute() -> None:
    # mutant: function_reach.attribute reading every attribute with getattr (its instance-dict
    # read dropped): the look ran the object's __getattribute__ once more per call, user code
    # the eager call does not run
    router = _CountingRouter(nn.Linear(8, 4).requires_grad_(False))

    def layer(x: torch.Tensor) -> torch.Tensor:
        return x[:, :4] * reuse_during_recompute(router, x.detach())

    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    expected, x.grad = x.grad, None
    assert router.__dict__["reads"] == ["gate"]  # eager: fn's own read only
    router.__dict__["reads"].clear()
    checkpoint(layer, x).sum().backward()
    assert torch.equal(x.grad, expected)
    assert router.__dict__["reads"] == ["gate"]  # the original pass's call; the replay reuses
