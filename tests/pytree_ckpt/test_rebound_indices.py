"""A plain function whose code subscripts with a late-bound variable that holds another int or
str at its replay than at its original pass (`lambda t: layers[i](t)` made in a loop): refused
before the replay (NOTE [an index rebound before the replay] in pytree_ckpt/rebound.py)."""

from __future__ import annotations

import dis
import sys
import warnings

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pytree_ckpt import CheckpointError, CheckpointWithoutOutput, checkpoint
from pytree_ckpt import subscripts
from pytree_ckpt.subscripts import index_places
from tests.pytree_ckpt.test_rebound import _grads, _layers, _logged, looks_counted


def _assert_names_both_values(error: BaseException, where: str, then: object,
                              now: object) -> None:
    expected, got = str(error).split("\n  got:")
    assert f"{where} = {then!r} (the original pass's)" in expected
    assert f"{where} = {now!r}" in got.split("\n")[0]
    assert "which its code uses in a subscript's index (or in the name getattr" in expected


@pytest.mark.parametrize("container", ["ModuleList", "list"])
def test_a_lambda_indexing_layers_with_the_loop_variable_is_refused_naming_both_values(
        container: str) -> None:
    # Guards against: every replay indexing with the loop's last value: each boundary would
    # replay the last layer and return its gradients for its own input, silently (torch's
    # checkpoints do). A plain list of layers is no module, so the check must not depend on
    # the code holding one.
    layers = _layers()
    held: Any = layers if container == "ModuleList" else list(layers)
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for i in range(3):
        h = checkpoint(lambda t: held[i](t), h)  # noqa: B023 (the point of the test)
    with pytest.raises(CheckpointError) as caught:
        h.sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'i'", 1, 2)
    assert "lambda t, i=i: layers[i](t)" in str(caught.value)


def test_the_same_lambda_at_a_scripts_top_level_is_refused_naming_the_global_index() -> None:
    # Guards against: only closure cells being looked at: at a script's top level the loop
    # index is a global, read late the same way.
    space: dict[str, Any] = {"checkpoint": checkpoint, "layers": _layers(),
                             "x": torch.randn(2, 4, requires_grad=True)}
    exec("h = x\nfor i in range(3):\n    h = checkpoint(lambda t: layers[i](t), h)\n", space)
    with pytest.raises(CheckpointError) as caught:
        space["h"].sum().backward()
    _assert_names_both_values(caught.value, "global 'i'", 1, 2)


class _Stack(nn.Module):
    def __init__(self, late: bool) -> None:
        super().__init__()
        self.layers = _layers()
        self.late = late

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(1, len(self.layers) + 1):
            if self.late:  # `self` is the model: the module check sees it unchanged
                h = checkpoint(lambda t: self.layers[i - 1](t[:, :4]), h)  # noqa: B023
            else:
                h = checkpoint(lambda t, i=i: self.layers[i - 1](t[:, :4]), h)
        return h


def test_a_models_forward_indexing_its_own_layers_late_is_refused() -> None:
    # Guards against: an index read through an attribute and an arithmetic expression
    # (`self.layers[i - 1]`) not being found in the bytecode.
    model = _Stack(late=True)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(CheckpointError) as caught:
        model(x).sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'i'", 2, 3)


def test_a_lambda_slicing_a_tensor_with_the_loop_variable_is_refused() -> None:
    # Guards against: a late column index: the replay would read another slice of its input
    # and return that slice's gradient.
    lin = nn.Linear(1, 4)
    x = torch.randn(2, 3, requires_grad=True)
    outs = []
    for col in range(3):
        outs.append(checkpoint(lambda t: lin(t[:, col:col + 1]), x))  # noqa: B023
    with pytest.raises(CheckpointError) as caught:
        torch.stack(outs).sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'col'", 1, 2)


class _Named(nn.Module):
    """Layers registered as `layer0`, `layer1`, ... (an older model's style), picked by a name
    built from the loop variable: through getattr, or get_submodule."""

    def __init__(self, late: bool, pick: str) -> None:
        super().__init__()
        for i, layer in enumerate(_layers()):
            self.add_module(f"layer{i}", layer)
        self.late, self.pick = late, pick

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            if self.pick == "getattr":
                late: Any = lambda t: getattr(self, f"layer{i}")(t)  # noqa: B023
                early: Any = lambda t, i=i: getattr(self, f"layer{i}")(t)
            else:
                late = lambda t: self.get_submodule(f"layer{i}")(t)  # noqa: B023
                early = lambda t, i=i: self.get_submodule(f"layer{i}")(t)
            h = checkpoint(late if self.late else early, h)
        return h


@pytest.mark.parametrize("pick", ["getattr", "get_submodule"])
def test_a_layer_picked_by_a_name_the_loop_variable_builds_is_refused_and_bound_early_is_eagers(
        pick: str) -> None:
    # Guards against: `getattr(self, f"layer{i}")` read late: every replay would run the last
    # layer and return its gradients for each layer's input, silently (the last note's Left).
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(CheckpointError) as caught:
        _Named(late=True, pick=pick)(x).sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'i'", 1, 2)
    model = _Named(late=False, pick=pick)
    twin = _layers()
    twin.load_state_dict({k.removeprefix("layer"): v for k, v in model.state_dict().items()})

    def eager(t: torch.Tensor) -> torch.Tensor:
        for layer in twin:
            t = layer(t)
        return t

    wrapped, expected = _grads(model, x, model), _grads(twin, x, eager)
    assert len(wrapped) == len(expected) == 7
    for got, want in zip(wrapped, expected):
        assert torch.equal(got, want)


def _bound_early(layers: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = checkpoint(lambda t, i=i: layers[i](t), x)
        return x
    return run


def _index_not_subscripted(layers: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
    def layer_call(layer: nn.Module, t: torch.Tensor, layer_idx: int) -> torch.Tensor:
        del layer_idx  # a key/value cache's index: nothing in training reads it
        return layer(t)

    def run(x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(layers):
            x = checkpoint(lambda t, layer=layer: layer_call(layer, t, layer_idx=i), x)  # noqa
        return x
    return run


@pytest.mark.parametrize("make", [_bound_early, _index_not_subscripted])
def test_functions_whose_index_is_bound_early_or_not_subscripted_give_the_eager_twins_gradients(
        make: Callable[[nn.ModuleList], Callable[[torch.Tensor], torch.Tensor]]) -> None:
    # Guards against: the check refusing a replay that reads what the original pass read (a
    # default binds the index at the call) or refusing a late int the code only passes on
    # (a layer_idx for a key/value cache, NOTE [an index rebound before the replay]).
    # A late int only passed on is warned of (NOTE [a tensor rebound before the replay]: one
    # computed with cannot be told from it), once.
    layers, twin = _layers(), _layers()

    def eager(t: torch.Tensor) -> torch.Tensor:
        for layer in twin:
            t = layer(t)
        return t

    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = _grads(layers, x, make(layers))
    told = [str(w.message) for w in caught if "reads its closure variable 'i'" in str(w.message)]
    assert len(told) == (1 if make is _index_not_subscripted else 0)
    expected = _grads(twin, x, eager)
    assert len(wrapped) == len(expected) == 7
    for got, want in zip(wrapped, expected):
        assert torch.equal(got, want)


def test_each_call_replayed_before_its_index_moves_on_gives_the_eager_twins_gradients() -> None:
    # Guards against: refusing a late index that still holds the original pass's value at the
    # replay (each call's backward run inside the loop, as in a per-layer loss).
    layers, twin = _layers(), _layers()
    x = torch.randn(2, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    for i in range(3):
        checkpoint(lambda t: layers[i](t), x).square().sum().backward()  # noqa: B023
        twin[i](y).square().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.grad)
    for got, want in zip(layers.parameters(), twin.parameters()):
        assert got.grad is not None and torch.equal(got.grad, want.grad)


def test_an_output_discard_indexing_with_the_loop_variable_is_refused() -> None:
    # Guards against: the discard's rebuild indexing with the loop's last value: every
    # discarded op rebuilt through the last layer, silently.
    layers = _layers()
    x = torch.randn(2, 4, requires_grad=True)
    h, kept = x, []
    for i in range(3):
        ckpt = CheckpointWithoutOutput()
        h = ckpt.checkpoint(lambda t: torch.tanh(layers[i](t)), h) * 2  # noqa: B023
        ckpt.discard_output_and_register_recompute(h)
        kept.append(ckpt)
    with pytest.raises(CheckpointError) as caught:
        h.square().sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'i'", 1, 2)
    assert "CheckpointWithoutOutput.checkpoint" in str(caught.value)


def _codes() -> dict[str, Any]:
    layers: Any = None
    cfg: Any = None
    order: Any = None
    cache: Any = None
    i, j, k = 0, 1, 2

    def store(t: Any) -> None:
        cache[i] = t

    def delete(t: Any) -> None:
        del cache[i]

    def store_slice(t: Any) -> None:
        cache[i:j] = t  # Python 3.12+: STORE_SLICE, two bounds

    def own_cell(t: Any) -> Any:
        n = 1  # its own variable, set at each call, that an inner function captures
        return (lambda: n)() + t[n]

    return {
        "layers[i](t)": lambda t: layers[i](t),
        "layers[0](t) * i": lambda t: layers[0](t) * i,
        "layers[len(t) - k](t)": lambda t: layers[len(t) - k](t),
        "t[i:j]": lambda t: t[i:j],
        "layers[i if t else j](t)": lambda t: layers[i if t else j](t),
        "layers[cfg.n](t)": lambda t: layers[cfg.n](t),
        "getattr(cfg, f'layer{i}')(t)": lambda t: getattr(cfg, f"layer{i}")(t),
        "getattr(cfg, 'l%d' % i, None)(t)": lambda t: getattr(cfg, "l%d" % i, None)(t),
        "cfg.get_submodule(f'layers.{j}')(t)": lambda t: cfg.get_submodule(f"layers.{j}")(t),
        "cfg.get_parameter(f'w{j}') * k": lambda t: cfg.get_parameter(f"w{j}") * k,
        "layers.get_submodule(str(i))(len(t))":
            lambda t: layers.get_submodule(str(i))(len(t)),
        "layers[-i](t)": lambda t: layers[-i](t),
        "layers[order[i]](t)": lambda t: layers[order[i]](t),
        "cache[i] = t": store,
        "del cache[i]": delete,
        "cache[i:j] = t": store_slice,
        "n = 1; t[n]": own_cell,
    }


@pytest.mark.parametrize("source, indices", [
    ("layers[i](t)", ("i",)), ("layers[0](t) * i", ()), ("layers[len(t) - k](t)", ("k",)),
    ("t[i:j]", ("i", "j")), ("layers[i if t else j](t)", ()), ("layers[cfg.n](t)", ("cfg",)),
    ("getattr(cfg, f'layer{i}')(t)", ("cfg", "i")),
    ("getattr(cfg, 'l%d' % i, None)(t)", ("cfg", "i")),
    ("cfg.get_submodule(f'layers.{j}')(t)", ("j",)), ("cfg.get_parameter(f'w{j}') * k", ()),
    ("layers.get_submodule(str(i))(len(t))", ("i",)),
    ("layers[-i](t)", ("i",)), ("layers[order[i]](t)", ("order", "i")),
    ("cache[i] = t", ("i",)), ("del cache[i]", ("i",)), ("n = 1; t[n]", ()),
    ("cache[i:j] = t", ("i", "j"))])
def test_the_cells_a_code_reads_into_a_subscripts_index_are_found(
        source: str, indices: tuple[str, ...]) -> None:
    # Guards against: a walk back over the index expression that stops early (an arithmetic
    # index, a call in it, a slice's two bounds, a negated index, whose instruction takes no
    # argument) or runs past it (the container's own cell taken for an index), or that reads
    # through a jump (a conditional index: not followed); a store or a delete through a late
    # index not read; a function's own cell (captured by an inner function, set at each call)
    # taken for a late one (it is no free variable: no place in __closure__); and a layer
    # picked by a name the loop variable builds (getattr's arguments, a get_submodule call's
    # but not its object's, nor another method's, nor the arguments of a call made on what it
    # returned); a store through a slice's two late bounds (helper FQ, mutant Q67: Python
    # 3.12's STORE_SLICE read as one value, its first bound missed).
    fn = _codes()[source]
    cells, names = index_places(fn.__code__)
    if source == "layers[i if t else j](t)" and sys.version_info[:2] in ((3, 10), (3, 12)):
        # Python 3.10's and 3.12's compilers copy the subscript, the call and the return into
        # each branch: the first branch's index is read like any other (no jump in its walk
        # back).
        indices = ("i",)
    assert {fn.__code__.co_freevars[c] for c in cells} == set(indices)
    assert names == {"layers[len(t) - k](t)": ("len",),
                     "layers.get_submodule(str(i))(len(t))": ("str",)}.get(source, ())


def _indexing(terms: int, negated: bool) -> tuple[Any, int]:
    """A closure reading ``layers[i + a + ... + a]`` (negated or not), and how many
    instructions push its index."""
    expression = " + ".join(["i", *["a"] * terms])
    if negated:
        expression = f"-({expression})"
    space: dict[str, Any] = {}
    exec(f"def make(layers, i, a):\n    return lambda t: layers[{expression}]\n", space)
    fn = space["make"]([], 0, 0)
    ops = list(dis.get_instructions(fn.__code__))
    at = next(n for n, op in enumerate(ops) if op.opname == "BINARY_SUBSCR" or
              (op.opname == "BINARY_OP" and op.argrepr == "[]"))
    start = next(n for n, op in enumerate(ops) if op.argval == "layers")
    return fn, at - start - 1


def test_an_index_of_exactly_the_longest_read_length_is_read_and_one_longer_is_not() -> None:
    # Guards against (helper FQ, mutant Q48): the walk back over an index stopping one
    # instruction short of _LONGEST_INDEX ("an index expression longer than this is not
    # read"), or reading past it.
    made: dict[int, Any] = {}
    for terms in range(10, 40):
        for negated in (False, True):
            fn, length = _indexing(terms, negated)
            made.setdefault(length, fn)
    longest = subscripts._LONGEST_INDEX
    if longest not in made or longest + 1 not in made:
        pytest.skip("this Python's bytecode makes no index of exactly those lengths")
    for length, read in ((longest, True), (longest + 1, False)):
        fn = made[length]
        cells, _ = index_places(fn.__code__)
        found = {fn.__code__.co_freevars[c] for c in cells}
        assert found == ({"a", "i"} if read else set()), (length, found)


def test_a_code_with_nothing_to_note_is_looked_at_once_and_one_with_an_index_at_every_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: the index check costing every plain function's call its look (NOTHING_BOUND
    # in rebound.py: about 7,000 instructions a call), or a code with a late index being skipped
    # after its first call.
    calls = looks_counted(monkeypatch)
    layers = list(_layers())
    x = torch.randn(2, 4, requires_grad=True)
    for i in range(3):
        checkpoint(lambda t: t * 2, x)
        checkpoint(lambda t: layers[i](t), x)  # noqa: B023
    codes = [fn.__code__.co_freevars for fn in calls]
    assert codes.count(()) == 1 and codes.count(("i", "layers")) == 3


def test_a_module_dict_indexed_with_a_late_str_key_is_refused_naming_both_keys() -> None:
    # Guards against: only ints noted: a ModuleDict's str key read late replays the last
    # block for every call, silently; and a tip naming `i` rather than the code's variable.
    blocks = nn.ModuleDict(dict(zip(["a", "b", "c"], _layers())))
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for key in blocks:
        h = checkpoint(lambda t: blocks[key](t), h)  # noqa: B023
    with pytest.raises(CheckpointError) as caught:
        h.sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'key'", "b", "c")
    assert "lambda t, key=key: layers[key](t)" in str(caught.value)


def test_a_scripts_top_level_loop_indexing_a_plain_list_late_is_refused() -> None:
    # Guards against: a code whose only late index is a global (and that holds no module: a
    # plain list of layers) skipped for good after its first call as having nothing to note.
    space: dict[str, Any] = {"checkpoint": checkpoint, "layers": list(_layers()),
                             "x": torch.randn(2, 4, requires_grad=True)}
    exec("h = x\nfor i in range(3):\n    h = checkpoint(lambda t: layers[i](t), h)\n", space)
    with pytest.raises(CheckpointError) as caught:
        space["h"].sum().backward()
    _assert_names_both_values(caught.value, "global 'i'", 1, 2)


def test_a_function_storing_into_a_column_by_the_loop_variable_is_refused() -> None:
    # Guards against: only loads through an index read: a store (`out[:, col] = ...`) at the
    # replay writes another column, and each call would get the last column's gradient.
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    total = x.new_zeros(())
    for col in range(3):
        def place(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(2, 3)
            out[:, col] = lin(t).sum(1)  # noqa: B023
            return out * torch.arange(1.0, 4.0)
        total = total + checkpoint(place, x).sum()
    with pytest.raises(CheckpointError) as caught:
        total.backward()
    _assert_names_both_values(caught.value, "closure variable 'col'", 1, 2)


@pytest.mark.parametrize("form", ["through a list", "in a partial"])
def test_a_late_index_still_holding_its_value_at_the_replay_gives_the_eager_twins_gradients(
        form: str) -> None:
    # Guards against: a place not noted (the list in `layers[order[i]]`, neither int nor
    # str) compared all the same, or a partial's late index read from the partial rather
    # than from the function it calls: either refuses a replay that reads what the original
    # pass read.
    import functools

    layers, twin = _layers(), _layers()
    order = [2, 0, 1]
    x = torch.randn(2, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    for i in range(3):
        if form == "through a list":
            fn: Any = lambda t: layers[order[i]](t)  # noqa: B023, E731
            checkpoint(fn, x).square().sum().backward()
            twin[order[i]](y).square().sum().backward()
        else:
            fn = functools.partial(lambda t, scale: layers[i](t) * scale, scale=2.0)  # noqa
            checkpoint(fn, x).square().sum().backward()
            (twin[i](y) * 2.0).square().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.grad)
    for got, want in zip(layers.parameters(), twin.parameters()):
        assert got.grad is not None and torch.equal(got.grad, want.grad)


def test_a_late_index_rebound_to_an_equal_int_gives_the_eager_twins_gradients() -> None:
    # Guards against: values compared by identity: a width recomputed at each iteration is
    # an equal int but another object (above 256), and the replay reads the same slice.
    x = torch.randn(2, 600, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    outs, twins = [], []
    for scale in (1.0, 2.0, 3.0):
        half = x.shape[1] // 2  # a new int object each time
        outs.append(checkpoint(lambda t: t[:, :half].tanh(), x) * scale)  # noqa: B023
        twins.append(y[:, :half].tanh() * scale)
    torch.stack(outs).square().sum().backward()
    torch.stack(twins).square().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.grad)


def test_a_partial_of_a_decorated_lambda_indexing_late_is_refused() -> None:
    # Guards against: the unwrapping stopping after the partial: the decorator's wrapper
    # subscripts nothing, and the late index of the lambda it wraps replays the last layer
    # for every call, silently.
    import functools

    layers = list(_layers())
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for i in range(3):
        h = checkpoint(functools.partial(_logged(lambda s, t: layers[i](t) * s), 2.0), h)  # noqa
    with pytest.raises(CheckpointError) as caught:
        h.sum().backward()
    _assert_names_both_values(caught.value, "closure variable 'i'", 1, 2)


def test_a_code_is_read_once_however_many_of_its_functions_are_checkpointed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards against: the bytecode walk run at every call (index_places' per-code table):
    # every plain function's call would pay for a disassembly.
    import pytree_ckpt.subscripts as subscripts

    reads: list[Any] = []
    real = subscripts._read
    monkeypatch.setattr(subscripts, "_read", lambda code: reads.append(code) or real(code))
    layers = list(_layers())
    x = torch.randn(2, 4, requires_grad=True)
    for i in range(3):  # a late index: looked at in each call (nothing backward here)
        checkpoint(lambda t: layers[i](t) * 3.0, x)  # noqa: B023
    assert len(reads) == 1 and reads[0].co_consts[-1] == 3.0


def _in_a_comprehension(layers: nn.ModuleList, x: torch.Tensor, late: bool) -> torch.Tensor:
    for i in range(3):
        if late:
            x = checkpoint(lambda t: torch.stack([layers[i](r) for r in t]), x)  # noqa: B023
        else:
            x = torch.stack([layers[i](r) for r in x])
    return x


def _augmented(layers: nn.ModuleList, x: torch.Tensor, late: bool) -> torch.Tensor:
    for i in range(3):
        def shift(t: torch.Tensor) -> torch.Tensor:
            out = t * 1.0
            out[:, i] += 1.0  # noqa: B023
            return layers[0](out)
        x = checkpoint(shift, x) if late else shift(x)
    return x


def _in_an_inner_functions_comprehension(layers: nn.ModuleList, x: torch.Tensor, late: bool
                                         ) -> torch.Tensor:
    for i in range(3):
        def block(t: torch.Tensor) -> torch.Tensor:
            def each(u: torch.Tensor) -> torch.Tensor:
                return torch.stack([layers[i](r) for r in u])  # noqa: B023
            return each(t)
        x = checkpoint(block, x) if late else block(x)
    return x


@pytest.mark.parametrize("run", [_in_a_comprehension, _augmented,
                                 _in_an_inner_functions_comprehension])
def test_a_late_index_in_a_comprehension_or_an_augmented_store_is_refused(
        run: Callable[[nn.ModuleList, torch.Tensor, bool], torch.Tensor]) -> None:
    # Guards against (helper CD's finding): a late index the walk does not see, in the code
    # of a comprehension the function makes or copied for an augmented store: each replay
    # read the loop's last value and returned another layer's (another column's) gradients,
    # with no error.
    layers = _layers()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(CheckpointError) as caught:
        _grads(layers, x, lambda t: run(layers, t, True))
    _assert_names_both_values(caught.value, "closure variable 'i'", 1, 2)


def test_a_comprehension_indexing_with_a_default_bound_index_gives_eagers_gradients() -> None:
    # Guards against: the comprehension's own free variable taken for a late one where it is
    # the function's local (a default, bound at the call): no refusal, eager's gradients.
    layers, twin = _layers(), _layers()
    x = torch.randn(2, 4, requires_grad=True)

    def ours(h: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            h = checkpoint(lambda t, i=i: torch.stack([layers[i](r) for r in t]), h)
        return h

    got = _grads(layers, x, ours)
    want = _grads(twin, x, lambda t: _in_a_comprehension(twin, t, False))
    assert len(got) == len(want) == 7
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_scripts_top_level_comprehension_indexing_late_is_refused() -> None:
    # Guards against: the globals a comprehension reads into an index dropped (only its free
    # variables kept): at a script's top level the loop variable is a global there.
    space: dict[str, Any] = {"checkpoint": checkpoint, "torch": torch, "layers": _layers(),
                             "x": torch.randn(2, 4, requires_grad=True)}
    exec("h = x\nfor i in range(3):\n"
         "    h = checkpoint(lambda t: torch.stack([layers[i](r) for r in t]), h)\n", space)
    with pytest.raises(CheckpointError) as caught:
        space["h"].sum().backward()
    _assert_names_both_values(caught.value, "global 'i'", 1, 2)
