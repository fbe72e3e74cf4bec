"""Module state a plain function changes (``plain_state.py``): a lambda or closure over a
module (a cell, a default, a global, a partial's argument, a callable object's attribute), or
given one as an argument, whose forward changes that module's buffers is warned once per
function when the replay changes them again, as torch's reentrant checkpoint does; a known
callable, a module without buffers, with buffers left unchanged, or whose forward skips its
update in the replay is not. A lambda in a loop that reads the loop variable is refused
before its replay (docs/limits.md). Gradients are compared bit for bit with an unwrapped eager
twin."""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import importlib.util
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError, checkpoint, plain_state
from tests.conftest import assert_same_grads, grads_of


@pytest.fixture(autouse=True)
def _not_warned_yet() -> None:
    # Warned once per code object, for the process: each test starts as a fresh process would
    # (the lambdas below are shared by the parametrized cases, and a rerun would see none).
    plain_state._HELD.clear()
    plain_state.NOTHING_HELD.clear()


def _block(*, norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8) if norm else nn.ReLU())


def _steps(run: Callable[[nn.Module, torch.Tensor], torch.Tensor], block: nn.Module, *,
           steps: int = 3, every: list[warnings.WarningMessage] | None = None
           ) -> tuple[list[warnings.WarningMessage], list[torch.Tensor | None]]:
    """``steps`` forward and backward calls of ``run(block, x)``; the warnings they gave (the
    library's; all of them, Python's own included, appended to ``every``) and the gradients of
    the block's parameters and of the last ``x``."""
    block.zero_grad(set_to_none=True)
    eager = copy.deepcopy(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step),
                            requires_grad=True)
            x_eager = x.detach().clone().requires_grad_(True)
            run(block, x).square().sum().backward()
            eager(x_eager).square().sum().backward()
    assert_same_grads(grads_of([*eager.parameters(), x_eager]),
                      grads_of([*block.parameters(), x]))
    if every is not None:
        every.extend(caught)
    return [w for w in caught if "pytree_ckpt" in str(w.message)], \
        grads_of([*block.parameters(), x])


def _as_argument(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda m, h: m(h), block, x)  # type: ignore[no-any-return]


def _in_closure(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda h: block(h), x)  # type: ignore[no-any-return]


def _as_default(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda h, m=block: m(h), x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("run", [_as_argument, _in_closure, _as_default],
                         ids=["argument", "closure", "default"])
def test_a_plain_function_that_updates_a_batch_norm_is_warned_once_naming_it(run: Any) -> None:
    # Guards against: a lambda over a BatchNorm (passed in, closed over, or a bound default)
    # updating its running statistics twice a step, silently (the replay runs it again).
    caught, _ = _steps(run, _block())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for part in ("BatchNorm1d", "running_mean", "num_batches_tracked", "'1'", "again",
                 "reentrant", "checkpoint(block, h)"):
        assert part in message, (part, message)
    assert caught[0].category is UserWarning
    assert caught[0].filename == __file__  # the user's call, not the library's


@pytest.mark.parametrize("space", ["a fresh module", "spec None", "a script's __main__",
                                   "loaders differ"])
def test_the_warning_from_code_run_in_a_namespace_without_a_loader_is_given_not_raised(
        space: str) -> None:
    # Python 3.12+: warnings.warn_explicit(module_globals=...) raised ValueError ("Module
    # globals is missing a __spec__.loader") for the globals of code run by exec in a fresh
    # module (the doc-page runner; some notebook namespaces), so the warning raised from the
    # user's backward instead (found running the suite on Python 3.13).
    namespace: dict[str, Any] = {"checkpoint": checkpoint, "torch": torch}
    if space == "a fresh module":
        namespace.update(types.ModuleType("user_code").__dict__)
    elif space == "spec None":
        namespace.update(__name__="__main__", __spec__=None, __loader__=None)
    elif space == "a script's __main__":  # `python train.py`: a DeprecationWarning on 3.12+
        namespace.update(__name__="__main__", __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", "train.py"))
    else:
        namespace.update(__name__="user_code", __spec__=importlib.util.spec_from_loader(
            "user_code", loader=importlib.machinery.BuiltinImporter()), __loader__=object())
    code = compile("def run(block, x):\n    return checkpoint(lambda h: block(h), x)\n",
                   "user_code.py", "exec")
    exec(code, namespace)
    every: list[warnings.WarningMessage] = []
    caught_steps, _ = _steps(namespace["run"], _block(), every=every)
    assert len(caught_steps) == 1 and "is a plain function" in str(caught_steps[0].message)
    assert caught_steps[0].filename == "user_code.py" and caught_steps[0].lineno == 2
    # Python 3.12+ warns of a __loader__ other than __spec__.loader (helper DK: the check
    # looked outside _steps, which records every warning itself, and so saw none).
    assert not [w for w in every if issubclass(w.category, DeprecationWarning)], \
        [str(w.message) for w in every]


def test_the_warning_names_both_fixes_the_module_itself_or_skipping_the_update_in_the_replay(
        ) -> None:
    # Both fixes work (test_checkpointing_the_block_itself_is_not_warned_and_counts_once,
    # test_a_counter_the_forward_skips_in_the_replay_is_not_warned_and_counts_once): the
    # warning must name each, with the phase the forward is to test for.
    caught, _ = _steps(_in_closure, _block(), steps=1)
    (message,) = [str(w.message) for w in caught]
    for part in ("checkpoint(block, h)", "pytree_ckpt.current_phase()", "'recompute'",
                 "docs/limits.md"):
        assert part in message, (part, message)


def test_the_warning_names_where_the_function_reached_the_module() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = _block()
        checkpoint(lambda h, m: m(h), torch.randn(4, 8, requires_grad=True),
                   m=block).sum().backward()
        shared = _block()
        checkpoint(lambda h: shared(h), torch.randn(4, 8, requires_grad=True)).sum().backward()
    messages = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert len(messages) == 2, messages
    assert "kwargs['m']" in messages[0], messages[0]
    assert "closure variable 'shared'" in messages[1], messages[1]


def test_a_step_counter_buffer_a_closure_changes_is_warned() -> None:
    class Counting(nn.Module):
        step: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.step += 1
            return self.lin(x)

    torch.manual_seed(0)
    counting = Counting()
    model = nn.Sequential(counting)
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: model(h), x), model, steps=2)
    assert len(caught) == 1
    assert "closure variable 'model' submodule '0' (Counting): step." in str(caught[0].message)
    assert int(counting.step) == 4  # two steps, each counted twice: what the warning says


@pytest.mark.parametrize("case", ["no buffers", "eval mode"])
def test_a_plain_function_whose_modules_keep_their_buffers_is_not_warned(case: str) -> None:
    block = _block(norm=case != "no buffers")
    if case == "eval mode":
        block.eval()
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: block(h), x), block)
    assert caught == []
    caught, _ = _steps(lambda m, x: checkpoint(lambda mm, h: mm(h), m, x), block)
    assert caught == []


def test_checkpointing_the_block_itself_is_not_warned_and_counts_once() -> None:
    block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(m, x), block, steps=2)
    assert caught == []
    assert int(block.get_submodule("1").get_buffer("num_batches_tracked")) == 2


def test_a_plain_function_over_no_module_is_not_watched() -> None:
    # The check costs nothing for such functions: each code object is looked at once, and
    # a function over tensors alone is then skipped with one lookup (measured in the commit).
    from pytree_ckpt import plain_state

    def double(h: torch.Tensor) -> torch.Tensor:
        return h * scale

    scale = torch.tensor(2.0)
    x = torch.randn(3, requires_grad=True)
    checkpoint(double, x).sum().backward()
    assert plain_state.modules_held(double.__code__) == ((), (), (), ())


# A module-level name, as a script's top-level model is: the lambdas below name it as a global.
_global_block: nn.Module = nn.Identity()


def _via_global(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda h: _global_block(h), x)  # type: ignore[no-any-return]


def test_a_plain_function_over_a_global_batch_norm_is_warned_and_a_rebound_one_is_watched(
        ) -> None:
    # Guards against: a lambda at a script's top level over the model, updating its running
    # statistics twice a step silently; and the module found at the first call being watched
    # after the global was rebound to another one.
    global _global_block
    quiet = _block().eval()  # the global at the first calls: its statistics do not move
    _global_block = quiet
    caught, _ = _steps(_via_global, quiet, steps=2)
    assert caught == []
    _global_block = _block()
    caught, _ = _steps(_via_global, _global_block, steps=2)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "global '_global_block' submodule '1' (BatchNorm1d): running_mean" in \
        str(caught[0].message)
    assert caught[0].filename == __file__


class _Holder:
    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def run(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)  # type: ignore[no-any-return]

    __call__ = run


block = _block()  # a global named as the attribute `block` is: watched, never run


def test_a_global_module_the_function_only_names_as_an_attribute_is_not_warned() -> None:
    # `self.block` puts 'block' in co_names; the global of that name is watched needlessly,
    # and must not be named: its buffers do not change during the call.
    inner = _block(norm=False)
    before = block.get_submodule("1").get_buffer("num_batches_tracked").clone()
    caught, _ = _steps(lambda m, x: checkpoint(_Holder(m).run, x), inner)
    assert caught == []
    assert torch.equal(block.get_submodule("1").get_buffer("num_batches_tracked"), before)


@pytest.mark.parametrize("case", ["partial of a lambda", "partial keyword", "callable object"])
def test_a_partial_or_callable_object_over_a_batch_norm_is_warned(case: str) -> None:
    # Guards against: functools.partial(lambda m, h: m(h), block) or an object holding the
    # block as an attribute (both unknown callables) updating its statistics twice, silently.
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if case == "partial of a lambda":
            return checkpoint(functools.partial(lambda mm, h: mm(h), m), x)  # type: ignore
        if case == "partial keyword":
            return checkpoint(functools.partial(lambda h, mm: mm(h), mm=m), x)  # type: ignore
        return checkpoint(_Holder(m), x)  # type: ignore[no-any-return]

    caught, _ = _steps(run, _block())
    assert len(caught) == 1, [str(w.message) for w in caught]
    where = {"partial of a lambda": "partial argument 0", "partial keyword":
             "partial keyword 'mm'", "callable object": "attribute 'block'"}[case]
    assert f"{where} submodule '1' (BatchNorm1d)" in str(caught[0].message)


def _apply(mm: nn.Module, h: torch.Tensor, *, scale: float) -> torch.Tensor:
    return mm(h) * scale  # type: ignore[no-any-return]


def test_a_partial_of_a_wrapped_partial_over_a_batch_norm_is_warned() -> None:
    # Guards against: only the outer partial unwrapped. Python merges a partial of a partial
    # into one, except when the inner one has attributes (functools.update_wrapper gives it
    # __name__, __wrapped__, ...): the block the inner one binds then goes unwatched, and its
    # statistics are updated twice a step without a warning.
    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inner = functools.update_wrapper(functools.partial(_apply, m), _apply)
        outer = functools.partial(inner, scale=1.0)
        assert outer.func is inner  # not merged
        return checkpoint(outer, x)  # type: ignore[no-any-return]

    caught, _ = _steps(run, _block())
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "partial argument 0 submodule '1' (BatchNorm1d)" in str(caught[0].message)


class _SlotHolder:
    """A callable object with ``__slots__``: its attributes are not in a ``__dict__``."""

    __slots__ = ("block",)

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)  # type: ignore[no-any-return]


def test_a_callable_object_with_slots_over_a_batch_norm_is_warned() -> None:
    # Guards against: a __slots__ object (no __dict__) holding the block being silent while its
    # statistics were updated twice a step, as the same object with a __dict__ is warned.
    block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(_SlotHolder(m), x), block, steps=2)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "attribute 'block' submodule '1' (BatchNorm1d)" in str(caught[0].message)
    assert int(block.get_submodule("1").get_buffer("num_batches_tracked")) == 4  # as warned


class _PrivateSlotHolder:
    """A private slot of a class whose name starts with an underscore: Python mangles
    ``__block`` to ``_PrivateSlotHolder__block`` (the class name's underscores stripped)."""

    __slots__ = ("__block",)

    def __init__(self, block: nn.Module) -> None:
        self.__block = block

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.__block(h)  # type: ignore[no-any-return]


def test_a_private_slot_of_an_underscored_class_over_a_batch_norm_is_warned() -> None:
    # Guards against: the slot's name mangled with the class name's leading underscore kept
    # (__PrivateSlotHolder__block): getattr finds nothing, and statistics updated twice a step
    # go unwarned.
    block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(_PrivateSlotHolder(m), x), block, steps=2)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "attribute '_PrivateSlotHolder__block' submodule '1' (BatchNorm1d)" in str(
        caught[0].message)


class _ViewDict:
    """A callable object whose ``__dict__`` is a property giving something else than a dict (a
    proxy's view): its attributes cannot be read one by one."""

    def __init__(self, block: nn.Module) -> None:
        object.__setattr__(self, "_block", block)

    @property  # type: ignore[misc]
    def __dict__(self) -> list[str]:  # type: ignore[override]
        return ["_block"]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return object.__getattribute__(self, "_block")(h)  # type: ignore[no-any-return]


class _LoudGlobals(dict[str, Any]):
    """Globals of exec'd code whose ``get`` is not a plain lookup (an audited namespace)."""

    def get(self, *args: Any) -> Any:  # type: ignore[override]
        raise RuntimeError("globals read through get")


@pytest.mark.parametrize("case", ["__dict__ not a dict", "globals whose get raises"])
def test_a_callable_whose_attributes_or_globals_are_unusual_runs_as_eager(case: str) -> None:
    # Guards against: the watch's first look failing the forward (AttributeError: 'list' object
    # has no attribute 'items'; the namespace's own error) for a callable that runs fine.
    block = _block()
    if case == "__dict__ not a dict":
        fn: Any = _ViewDict(block)
    else:
        space = _LoudGlobals(block=block)
        exec("fn = lambda h: block(h)", space)  # as a launcher runs a script
        fn = dict.__getitem__(space, "fn")
    caught, _ = _steps(lambda m, x: checkpoint(fn, x), block, steps=2)
    if case == "globals whose get raises":  # read as a dict: the global is watched still
        assert len(caught) == 1 and "global 'block'" in str(caught[0].message)
    else:  # its attributes are not looked at
        assert caught == []


def test_a_partial_of_a_modules_forward_is_known_and_counts_once() -> None:
    block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(functools.partial(m.forward), x), block,
                       steps=2)
    assert caught == []
    assert int(block.get_submodule("1").get_buffer("num_batches_tracked")) == 2


def test_a_counter_the_forward_skips_in_the_replay_is_not_warned_and_counts_once() -> None:
    # Guards against: a false warning for a forward that already keeps its update out of the
    # replay (pytree_ckpt.current_phase() is "recompute" there).
    class PhaseAware(nn.Module):
        step: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if pytree_ckpt.current_phase() != "recompute":
                self.step += 1
            return self.lin(x)

    torch.manual_seed(0)
    aware = PhaseAware()
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: m(h), x), aware, steps=3)
    assert caught == []
    assert int(aware.step) == 3  # once a step, as in eager
    with warnings.catch_warnings(record=True) as without_backward:
        warnings.simplefilter("always")
        fresh = _block()  # its statistics move in the original pass: no replay, no warning
        checkpoint(lambda h: fresh(h), torch.randn(4, 8, requires_grad=True))
    assert [w for w in without_backward if "pytree_ckpt" in str(w.message)] == []


def test_a_counter_the_forward_keeps_out_of_the_no_grad_pass_is_not_warned_and_counts_once(
        ) -> None:
    # Guards against: keeping the original pass's watch for the replay when that pass changed
    # nothing. A forward that updates its statistics only with grad enabled (a guard that keeps
    # them out of evaluation under torch.no_grad()) changes them in the replay alone: once a
    # step, as in eager, and a warning that both passes changed them would be false.
    class GradOnly(nn.Module):
        step: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("step", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                self.step += 1
            return self.lin(x)

    torch.manual_seed(0)
    counted = GradOnly()
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: m(h), x), counted, steps=3)
    assert caught == []
    assert int(counted.step) == 3  # once a step (in the replay), as in eager


_small_model = nn.Sequential(*(nn.BatchNorm1d(8) for _ in range(plain_state._MOST_GLOBAL_BUFFERS)))
_whole_model = nn.Sequential(*(nn.BatchNorm1d(8)
                               for _ in range(plain_state._MOST_GLOBAL_BUFFERS + 1)))


def test_a_global_whole_model_is_not_watched_at_each_call_and_a_smaller_one_is() -> None:
    # Guards against: every layer's lambda naming the model as a global watching all of its
    # buffers at each call (3.35 million instructions a call for 200 buffers, measured).
    def by_global(h: torch.Tensor) -> torch.Tensor:
        return _small_model[0](h) + _whole_model[0](h)  # type: ignore[no-any-return]

    checkpoint(by_global, torch.randn(4, 8, requires_grad=True))
    assert plain_state.modules_held(by_global.__code__) == ((), (), ("_small_model",), ())


def test_a_module_checkpointed_inside_a_plain_function_over_it_is_warned() -> None:
    # The outer replay runs the inner checkpoint's original pass again, on the module's own
    # buffers (the inner replay runs on copies): counted twice a step, which the warning says.
    global _global_block
    _global_block = _block()
    caught, _ = _steps(lambda m, x: checkpoint(lambda h: checkpoint(_global_block, h), x),
                       _global_block, steps=2)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "global '_global_block' submodule '1' (BatchNorm1d)" in str(caught[0].message)
    assert int(_global_block.get_submodule("1").get_buffer("num_batches_tracked")) == 4


def test_a_closure_over_a_whole_model_reads_its_buffer_dicts_once_until_a_module_is_added(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [the buffers a plain function's watch reads]: a closure over a model of many layers
    # (self in a model's forward) walked the model's whole tree at every call; its buffer dicts
    # are now read once, and again only after a registration (here a batch norm added later,
    # which is then watched and warned about).
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(16)])
    model.register_buffer("inv_freq", torch.ones(4))  # never changed
    walks = []
    real = plain_state.module_dicts
    monkeypatch.setattr(plain_state, "module_dicts",
                        lambda module: walks.append(module) or real(module))
    run = (lambda m: lambda h: m[0](h))(model)  # one code object for every call below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            checkpoint(run, torch.randn(6, 8, requires_grad=True)).sum().backward()
        assert walks == [model]
        model[0].add_module("norm", nn.BatchNorm1d(8))  # a registration: read again
        for _ in range(2):
            checkpoint(run, torch.randn(6, 8, requires_grad=True)).sum().backward()
    assert walks == [model, model]
    messages = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert len(messages) == 1 and "submodule '0.norm' (BatchNorm1d)" in messages[0], messages


_LAYER_CALLS: dict[int, int] = {}  # by id(layer): held outside the layer, which the
# boundary watches (a number attribute changed in the replay is warned of)


class _CountedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # forward calls of this layer: the original pass and each replay count
        _LAYER_CALLS[id(self)] = _LAYER_CALLS.get(id(self), 0) + 1
        return super().forward(x)


def _loop_of_layers(form: str) -> tuple[list[torch.Tensor | None], list[int]]:
    """Three layers checkpointed in a loop, one step: the gradients of their parameters and of
    the input, and each layer's forward calls. ``form``: eager (no boundary), ``late`` (a
    lambda reading the loop variable), ``default`` (the variable bound as a default) or
    ``module`` (the layer itself checkpointed)."""
    torch.manual_seed(0)
    layers = [_CountedLinear(8, 8) for _ in range(3)]
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    h = x
    for layer in layers:
        if form == "eager":
            h = layer(h)
        elif form == "late":
            h = checkpoint(lambda t: layer(t), h)  # noqa: B023 (the point of the test)
        elif form == "default":
            h = checkpoint(lambda t, layer=layer: layer(t), h)
        else:
            h = checkpoint(layer, h)
        h = torch.tanh(h)
    h.square().sum().backward()
    return grads_of([p for layer in layers for p in layer.parameters()] + [x]), \
        [_LAYER_CALLS.pop(id(layer)) for layer in layers]


def test_a_lambda_in_a_loop_is_refused_before_any_replay_runs_the_wrong_layer() -> None:
    # Guards against: a late-bound loop lambda replayed. Python binds the closure's `layer`
    # late: by backward the loop is over, so each call's replay would run the last layer on
    # its own input (calls [1, 1, 4], the first layers without gradient, the rest wrong, as
    # torch's checkpoints do). The last call's replay runs its own layer; the next one is
    # refused before it runs anything (NOTE [a module rebound before the replay]).
    _, eager_calls = _loop_of_layers("eager")
    with pytest.raises(CheckpointError, match="closure variable 'layer'"):
        _loop_of_layers("late")
    calls = [_LAYER_CALLS.pop(k) for k in list(_LAYER_CALLS)]
    assert eager_calls == [1, 1, 1] and calls == [1, 1, 2]


@pytest.mark.parametrize("form", ["default", "module"])
def test_a_loop_binding_each_layer_now_gives_the_eager_twins_gradients(form: str) -> None:
    # Guards against: the fix the docs give for the late-bound lambda (a default argument, or
    # the layer checkpointed itself) not holding: each layer replays once, bit for bit.
    eager, _ = _loop_of_layers("eager")
    got, calls = _loop_of_layers(form)
    assert calls == [2, 2, 2]
    assert_same_grads(eager, got)


def test_the_warning_from_code_exec_d_in_globals_without_a_name_is_given() -> None:
    # Helper DZ: warnings.warn_explicit given module=None drops the warning; the file's stem
    # stands in for a missing __name__, as Python's own default.
    namespace: dict[str, Any] = {"checkpoint": checkpoint, "torch": torch}  # exec(src, {...})
    exec(compile("def run(block, x):\n    return checkpoint(lambda h: block(h), x)\n",
                 "user_code.py", "exec"), namespace)
    caught, _ = _steps(namespace["run"], _block())
    assert len(caught) == 1 and "is a plain function" in str(caught[0].message)
