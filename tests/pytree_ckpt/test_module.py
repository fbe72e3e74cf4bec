"""Wrapping modules in place: names, state dicts, hooks, idempotence, removal, layer ratio."""

from __future__ import annotations

import copy
import enum
import functools
import gc
import inspect
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import (CheckpointConfigError, apply_activation_checkpointing, checkpoint_layers,
                         current_phase, is_checkpointed, remove_activation_checkpointing)
from tests.conftest import assert_same_grads, grads_per_model, run_twice
from tests.pytree_ckpt.models import DictSettings, Gate, Log


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.phases: list[str] = Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.phases.append(current_phase().value)
        return x + self.mlp(self.attn(x) * self.scale)


class Stack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def names(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    return ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules()],
            list(model.state_dict()))


def test_wrapping_keeps_names_state_dict_keys_class_and_attributes() -> None:
    model = Stack()
    before = names(model)
    state = copy.deepcopy(model.state_dict())
    layer0 = model.layers[0]
    apply_activation_checkpointing(layer0)
    assert names(model) == before
    assert not any("_checkpoint_wrapped_module" in n for n in sum(names(model), []))
    assert type(layer0) is Layer and isinstance(layer0, Layer) and layer0.attn.out_features == 8
    model.load_state_dict(state)  # round trip with the wrapped layer
    assert all(torch.equal(a, b) for a, b in zip(state.values(), model.state_dict().values()))
    remove_activation_checkpointing(layer0)
    assert names(model) == before and not is_checkpointed(layer0)
    assert "forward" not in layer0.__dict__


def test_wrapped_stack_gives_eager_gradients_and_replays_each_layer_once() -> None:
    model = Stack()
    x = torch.randn(3, 8, requires_grad=True)
    twin = copy.deepcopy(model)
    for layer in twin.layers:
        apply_activation_checkpointing(layer)
    params = list(model.parameters())
    twin_params = list(twin.parameters())
    model(x).square().sum().backward()
    eager = [p.grad for p in params] + [x.grad.clone()]
    x.grad = None
    twin(x).square().sum().backward()
    assert_same_grads(eager, [p.grad for p in twin_params] + [x.grad])
    assert [layer.phases for layer in twin.layers] == [["forward", "recompute"]] * 4


def test_applying_twice_is_a_no_op_and_other_options_are_refused() -> None:
    layer = Layer()
    assert apply_activation_checkpointing(layer) is layer
    installed = layer.__dict__["forward"]
    apply_activation_checkpointing(layer)
    assert layer.__dict__["forward"] is installed
    layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert layer.phases == ["forward", "recompute"]  # one boundary, not two nested ones
    with pytest.raises(CheckpointConfigError, match="already checkpointed"):
        apply_activation_checkpointing(layer, preserve_rng_state=False)


def test_forward_hooks_run_once_outside_the_replay() -> None:
    layer = apply_activation_checkpointing(Layer())
    seen: list[tuple[str, str]] = []
    layer.register_forward_pre_hook(lambda *_: seen.append(("pre", current_phase().value)))
    layer.register_forward_hook(lambda *_: seen.append(("post", current_phase().value)))
    layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen == [("pre", "plain"), ("post", "plain")]
    assert layer.phases == ["forward", "recompute"]


def test_wrapping_creates_no_reference_cycle() -> None:
    layer = apply_activation_checkpointing(Layer())
    ref = weakref.ref(layer)
    gc.disable()
    try:
        del layer
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_deepcopy_and_pickle_of_a_wrapped_module_run_their_own_weights() -> None:
    layer = apply_activation_checkpointing(Layer())
    x = torch.randn(2, 8, requires_grad=True)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert is_checkpointed(twin)
        with torch.no_grad():
            twin.attn.weight.zero_()
        twin.phases.clear()
        twin(x).sum().backward()
        assert twin.phases == ["forward", "recompute"] and twin.attn.weight.grad is not None
        assert layer.attn.weight.grad is None and not torch.equal(layer(x), twin(x))


def test_a_wrapped_module_and_its_parent_pickle_after_a_step_too() -> None:
    # The caches a step leaves behind (weak references among them) are not pickled: they
    # are rebuilt at the next call.
    parent = nn.Sequential(apply_activation_checkpointing(Layer()))
    x = torch.randn(2, 8, requires_grad=True)
    parent(x).sum().backward()
    for copy_of in (pickle.loads(pickle.dumps(parent)), copy.deepcopy(parent)):
        copy_of.zero_grad(set_to_none=True)
        copy_of(x).sum().backward()
        assert_same_grads([p.grad for p in parent.parameters()],
                          [p.grad for p in copy_of.parameters()])
    remove_activation_checkpointing(parent[0])
    pickle.dumps(parent)


def test_a_forward_assigned_over_the_boundary_is_respected() -> None:
    layer = apply_activation_checkpointing(Layer())
    mine = lambda x: layer.attn(x) * 3  # noqa: E731
    layer.forward = mine  # type: ignore[method-assign]
    assert not is_checkpointed(layer)
    apply_activation_checkpointing(layer)  # wraps the new forward
    assert is_checkpointed(layer)
    remove_activation_checkpointing(layer)
    assert layer.forward is mine  # restored, not deleted


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + x


def test_removing_from_an_unwrapped_root_undoes_each_wrapped_layer_and_its_save_units() -> None:
    root = nn.Sequential(Gated(), Gated())
    pytree_ckpt.apply_recompute_config(
        list(root), pytree_ckpt.RecomputeConfig(1.0, save=["moe_gate"]),
        {pytree_ckpt.SaveUnit.MOE_GATE: pytree_ckpt.KeptCallables("Gate.project")})
    assert all("project" in layer.gate.__dict__ for layer in root)
    remove_activation_checkpointing(root[0])  # the layer's own removal takes its units too
    assert "project" not in root[0].gate.__dict__ and "project" in root[1].gate.__dict__
    # The root itself was never wrapped: removal undoes every checkpointed layer inside it
    # (it was a no-op, which left them checkpointed: helper EG).
    remove_activation_checkpointing(root)
    assert not any(is_checkpointed(m) for m in root.modules())
    assert not any("project" in layer.gate.__dict__ for layer in root)


def test_an_instance_level_forward_is_wrapped_and_restored() -> None:
    layer = Layer()
    custom = lambda x: layer.attn(x) * 2  # noqa: E731
    layer.forward = custom  # type: ignore[method-assign]
    apply_activation_checkpointing(layer)
    x = torch.randn(2, 8, requires_grad=True)
    eager, ckpt = run_twice(lambda w: (layer(x) if w else custom(x)).sum().backward(),
                            [x, *layer.attn.parameters()])
    assert_same_grads(eager, ckpt)
    remove_activation_checkpointing(layer)
    assert layer.forward is custom


@pytest.mark.parametrize(("ratio", "expected"), [(0, []), (0.5, [0, 1]), (1.0, [0, 1, 2, 3]),
                                                 (0.3, [0])])
def test_layer_ratio_checkpoints_the_first_int_n_times_ratio_layers(ratio: float,
                                                                     expected: list[int]) -> None:
    model = Stack()
    assert checkpoint_layers(model.layers, ratio=ratio) == expected
    assert [is_checkpointed(layer) for layer in model.layers] == [i in expected for i in range(4)]


def test_an_offload_manager_given_with_a_ratio_of_0_warns_that_nothing_will_be_offloaded(
        ) -> None:
    # Guards against (helper HE), as it was found:
    # docs/offload.md: "Offload that silently does nothing is a common complaint about other
    # tools". A manager passed explicitly, with a ratio that checkpoints no layer (a config
    # sweep's ratio 0), opens no window, copies nothing and never warns: the manager's
    # nothing-offloaded warning needs a pass, and there is none. apply_recompute_config warns
    # for save units in the same case ("checkpoints none of the 2 layers: the save units ...
    # keep nothing"), and the example's train refuses --offload --ratio 0 as a usage error.
    from offload import OffloadConfig, OffloadManager
    from pytree_ckpt import RecomputeConfig, apply_recompute_config

    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    with pytest.warns(UserWarning, match="offload"):
        assert checkpoint_layers(Stack().layers, ratio=0.0, offload=manager) == []
    with pytest.warns(UserWarning, match="offload"):
        assert apply_recompute_config(Stack().layers, RecomputeConfig(0.0), {},
                                      offload=manager) == []
    model = Stack()
    with pytest.warns(UserWarning, match=r"checkpoint_layers\(ratio=0.0\) checkpoints none of "
                      r"the 4 layers: offload=an OffloadManager offloads nothing"):
        checkpoint_layers(model.layers, ratio=0.0, offload=manager)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert manager.stats()["windows"] == 0  # what the warning says: nothing moved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the environment's switch is not warned about
        checkpoint_layers(Stack().layers, ratio=0.0, offload=None)
        checkpoint_layers(Stack().layers, ratio=0.0, offload=False)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), True, "1", None])
def test_layer_ratio_outside_zero_to_one_is_refused_with_a_tip(ratio: object) -> None:
    with pytest.raises(CheckpointConfigError, match=r"ratio must be a number in \[0, 1\]") as err:
        checkpoint_layers(Stack().layers, ratio=ratio)  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError) and "tip:" in str(err.value)


def test_a_lower_ratio_over_layers_checkpointed_beyond_it_is_refused_before_any_change() -> None:
    # ModuleList surgery between steps: a new layer inserted in front moves the checkpointed
    # ones back. checkpoint_layers(..., ratio) then returned the first indices as the
    # checkpointed ones while those past them silently stayed checkpointed (apply_recompute_config
    # refused the same call).
    model = Stack()
    assert checkpoint_layers(model.layers, ratio=0.5) == [0, 1]
    model.layers.insert(0, nn.Linear(8, 8))
    for apply in (lambda: checkpoint_layers(model.layers, ratio=0.4),
                  lambda: pytree_ckpt.apply_recompute_config(
                      model.layers, pytree_ckpt.RecomputeConfig(0.4), {})):
        with pytest.raises(CheckpointConfigError,
                           match=r"(?s)layers\[2\] \(Layer\) is checkpointed, but ratio=0\.4 "
                                 r"checkpoints only the first 2 of 5 layers.*tip: call "
                                 r"remove_activation_checkpointing"):
            apply()
        assert [is_checkpointed(layer) for layer in model.layers] == \
            [False, True, True, False, False]  # unchanged
    for layer in model.layers:
        remove_activation_checkpointing(layer)
    assert checkpoint_layers(model.layers, ratio=0.4) == [0, 1]
    assert [is_checkpointed(layer) for layer in model.layers] == \
        [True, True, False, False, False]


def test_wrapping_something_else_than_a_module_is_refused() -> None:
    with pytest.raises(CheckpointConfigError, match="expects an nn.Module"):
        apply_activation_checkpointing(lambda x: x)  # type: ignore[arg-type]


def test_lean_import_touches_no_cuda_and_imports_no_optional_package() -> None:
    import subprocess
    import sys

    # torch._dynamo too: importing it takes over a second (sympy); the boundary imports it at
    # its first call (NOTE [the boundary stays eager]). A class-level torch.compiler.disable
    # (on the kept method, then in save_units.py, now in kept_callables.py) imported it with the
    # package.
    code = ("import sys, warnings; warnings.simplefilter('error');"
            "import pytree_ckpt, offload, torch;"
            "bad = [m for m in ('flash_attn', 'tilelang', 'matplotlib', 'hypothesis', "
            "'torch._dynamo') if m in sys.modules];"
            "assert not bad, bad; assert not torch.cuda.is_initialized();"
            "print(sorted(pytree_ckpt.__all__) == pytree_ckpt.__all__)")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "True" and out.stderr == ""
    assert pytree_ckpt.__version__


def test_a_submodule_added_after_the_first_replay_gets_eager_gradients() -> None:
    eager = nn.Sequential(nn.Linear(4, 4), nn.Identity())
    layer = apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()
    adapter = nn.Linear(4, 4)  # an adapter injected after training started
    eager[1], layer[1] = adapter, copy.deepcopy(adapter)
    layer.zero_grad(set_to_none=True)
    for model in (eager, layer):
        model(x).square().sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in layer.parameters()])
    assert layer[1].weight.grad is not None


def test_copies_rebind_an_instance_level_bound_forward_and_refuse_anything_else() -> None:
    layer = Layer()
    layer.forward = layer.forward  # an instance attribute: the module's own bound method
    apply_activation_checkpointing(layer)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        twin.phases.clear()
        twin(torch.randn(2, 8, requires_grad=True)).sum().backward()
        assert twin.phases == ["forward", "recompute"] and layer.phases == []
    other = Layer()
    other.forward = lambda x: other.attn(x)  # type: ignore[method-assign]
    apply_activation_checkpointing(other)
    with pytest.raises(pytree_ckpt.CheckpointError, match="cannot copy"):
        copy.deepcopy(other)


def test_a_forward_kept_after_its_module_was_freed_raises_a_checkpoint_error() -> None:
    layer = apply_activation_checkpointing(nn.Linear(2, 2))
    forward = layer.forward
    del layer
    gc.collect()
    with pytest.raises(pytree_ckpt.CheckpointError, match="(?s)no longer exists.*tip"):
        forward(torch.randn(1, 2, requires_grad=True))


def test_a_model_with_offload_pickles_with_one_fresh_manager_shared_as_before() -> None:
    from offload import OffloadConfig, OffloadManager, default_manager

    manager = OffloadManager(OffloadConfig(min_bytes=0, prefetch=2), device="cpu")
    model = nn.Sequential(Layer(), Layer())
    checkpoint_layers(model, offload=manager)
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()  # a pool with buffers, counters, a finished pass
    twin = pickle.loads(pickle.dumps(model))
    managers = {id(layer.forward.options.offload) for layer in twin}
    assert len(managers) == 1  # still one manager for both layers, numbering their windows
    fresh = twin[0].forward.options.offload
    assert fresh is not manager
    assert fresh.config == manager.config and fresh.device == manager.device
    assert fresh.stats()["offloaded_bytes"] == 0 and fresh.pool.host_bytes == 0
    model.zero_grad(set_to_none=True)
    manager.stats(reset=True)
    model(x).sum().backward()
    twin(x).sum().backward()
    assert_same_grads([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()])
    assert fresh.stats()["offloaded_bytes"] == manager.stats()["offloaded_bytes"] > 0
    # offload=True's process default comes back as the loading process's default
    default = apply_activation_checkpointing(Layer(), offload=True)
    assert pickle.loads(pickle.dumps(default)).forward.options.offload is default_manager()


def test_removing_checkpointing_lets_go_of_the_offload_manager_it_was_applied_with() -> None:
    # Guards against a leak: remove_activation_checkpointing must take the whole boundary off
    # the module, not only its forward; a boundary left in the module's __dict__ would keep
    # the manager it was given (its pinned pool) alive as long as the model lives.
    from offload import OffloadConfig, OffloadManager

    layer = Layer()
    before = set(vars(layer))
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    apply_activation_checkpointing(layer, offload=manager)
    layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    alive = weakref.ref(manager)
    del manager
    remove_activation_checkpointing(layer)
    gc.collect()
    assert alive() is None and set(vars(layer)) == before


def _recompute_config(layers: Any, *, ratio: float = 1.0) -> list[int]:
    return pytree_ckpt.apply_recompute_config(layers, pytree_ckpt.RecomputeConfig(ratio), {})


@pytest.mark.parametrize(("apply", "name"), [(checkpoint_layers, "checkpoint_layers"),
                                             (_recompute_config, "apply_recompute_config")])
def test_one_module_or_a_list_with_a_non_module_is_refused_with_a_tip(apply: Any,
                                                                       name: str) -> None:
    with pytest.raises(CheckpointConfigError,
                       match=f"(?s){name} takes a sequence of layers, not one Linear.*"
                             "apply_activation_chec"):
        apply(nn.Linear(2, 2))
    with pytest.raises(CheckpointConfigError, match=r"(?s)layers\[1\] is not one.*got: +str"):
        apply([nn.Linear(2, 2), "attn"])
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert apply(layers) == [0, 1]  # a Sequential is a sequence of layers


@pytest.mark.parametrize("apply", [checkpoint_layers, _recompute_config],
                         ids=["checkpoint_layers", "apply_recompute_config"])
def test_a_generator_of_layers_is_taken_in_order(apply: Any) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    assert apply(model.children(), ratio=0.5) == [0]  # int(3 * 0.5) layers
    assert [pytree_ckpt.is_checkpointed(m) for m in model] == [True, False, False]


def test_a_ratio_checkpoints_the_share_of_layers_it_names_despite_float_rounding() -> None:
    # 100 * 0.58 is 57.99999999999999 in floats: int() of it checkpointed 57 layers.
    layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(100))
    assert len(checkpoint_layers(layers, ratio=0.58)) == 58
    thirds = nn.ModuleList(nn.Linear(1, 1) for _ in range(3))
    assert checkpoint_layers(thirds, ratio=1 / 3) == [0]
    others = nn.ModuleList(nn.Linear(1, 1) for _ in range(100))
    config = pytree_ckpt.RecomputeConfig(0.29)
    assert len(pytree_ckpt.apply_recompute_config(others, config, {})) == 29


@pytest.mark.parametrize(("n", "ratio", "count"), [(3, 0.5, 1), (10, 0.99, 9), (10, 0.999, 9),
                                                    (7, 0.3, 2), (4, 0.2499, 0)])
def test_a_ratio_rounds_a_share_that_is_not_a_whole_layer_down(n: int, ratio: float,
                                                                count: int) -> None:
    # The forgiveness is for float error only: half of 3 layers is 1, 99.9% of 10 is 9.
    layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(n))
    assert checkpoint_layers(layers, ratio=ratio) == list(range(count))
    others = nn.ModuleList(nn.Linear(1, 1) for _ in range(n))
    config = pytree_ckpt.RecomputeConfig(ratio)
    assert pytree_ckpt.apply_recompute_config(others, config, {}) == list(range(count))


def test_compiling_a_forward_after_checkpointing_warns_and_the_layer_stays_checkpointed_once(
        ) -> None:
    # NOTE [compiled over the boundary] (compiled_layers.py): the compiled wrapper sees only
    # the opaque boundary.
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    phases: list[str] = []

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            phases.append(pytree_ckpt.current_phase().value)
            return self.proj(x).relu()

    layer = apply_activation_checkpointing(Block())
    counter = CompileCounterWithBackend("eager")
    layer.forward = torch.compile(layer.forward, backend=counter)  # the wrong order
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            layer(x).sum().backward()
    assert [str(w.message) for w in caught if "compiled after checkpointing" in str(w.message)
            and "Compile the body first" in str(w.message)] != []
    assert len(caught) == 1  # once per module
    assert counter.frame_count == 0 and phases == ["forward", "recompute"] * 2
    assert pytree_ckpt.is_checkpointed(layer)
    apply_activation_checkpointing(layer)  # the same options: a no-op, not a second boundary
    phases.clear()
    layer(x).sum().backward()
    assert phases == ["forward", "recompute"]
    remove_activation_checkpointing(layer)  # the wrapper goes with the boundary
    assert not pytree_ckpt.is_checkpointed(layer) and "forward" not in layer.__dict__
    phases.clear()
    layer(x).sum().backward()
    assert phases == ["plain"]


def test_a_forward_compiled_over_a_layer_with_save_units_is_told_they_need_an_eager_body(
        ) -> None:
    # Guards against (helper DN's m1): the warning's usual fix (compile the body first, then
    # checkpoint) leads a layer with save units straight into apply_recompute_config's refusal
    # of compiled bodies.
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    pytree_ckpt.apply_recompute_config(
        [layer], pytree_ckpt.RecomputeConfig(1.0, save=["attn"]),
        {pytree_ckpt.SaveUnit.ATTN: pytree_ckpt.KeptOps("aten::addmm")}, offload=False)
    counter = CompileCounterWithBackend("eager")
    layer.forward = torch.compile(layer.forward, backend=counter)  # over the boundary
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    (told,) = [str(w.message) for w in caught if "compiled after checkpointing" in str(w.message)]
    assert "save units, which need an eager body" in told and "Compile the body first" not in told
    assert counter.frame_count == 0


def test_a_functools_wraps_wrapper_over_the_boundary_is_the_users_own() -> None:
    # Only torch.compile's wrapper counts as the boundary (NOTE [compiled over the boundary],
    # compiled_layers.py).
    import functools
    import warnings

    layer = apply_activation_checkpointing(nn.Linear(4, 4))
    inner = layer.forward

    @functools.wraps(inner)
    def logged(*args: object, **kwargs: object) -> torch.Tensor:
        return inner(*args, **kwargs)

    layer.forward = logged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(torch.randn(2, 4, requires_grad=True))
    assert not pytree_ckpt.is_checkpointed(layer)
    remove_activation_checkpointing(layer)
    assert layer.__dict__["forward"] is logged


def test_module_compile_warns_once_naming_the_body_compile_whichever_order(
        ) -> None:
    # module.compile() compiles the call up to the opaque boundary: nothing inside.
    import inspect
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    x = torch.randn(2, 4, requires_grad=True)
    for compile_first in (True, False):
        layer = nn.Linear(4, 4)
        twin = copy.deepcopy(layer)
        counter = CompileCounterWithBackend("eager")
        if compile_first:
            layer.compile(backend=counter)
        apply_activation_checkpointing(layer)
        if not compile_first:
            layer.compile(backend=counter)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                layer(x).sum().backward()
        messages = [str(w.message) for w in caught if "module.compile()" in str(w.message)]
        assert len(messages) == 1 and "layer.forward = torch.compile(layer.forward)" in \
            messages[0]
        assert {w.filename for w in caught} == {inspect.getfile(inspect.currentframe())}
        twin(x).sum().backward()
        twin(x).sum().backward()
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert counter.frame_count == 0  # why it warns: nothing inside was compiled


def test_following_the_module_compile_fullgraph_refusal_tip_gives_eager_grads() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    twin = copy.deepcopy(layer)
    apply_activation_checkpointing(layer)
    layer.compile(backend="eager", fullgraph=True)
    with pytest.raises(CheckpointConfigError) as refused:
        layer(x)
    tip = str(refused.value)
    assert "remove_activation_checkpointing(layer), then layer.forward = torch.compile(" \
        "layer.forward, fullgraph=True), then apply_activation_checkpointing(layer)" in tip
    try:
        remove_activation_checkpointing(layer)                 # the tip, step by step
        layer.forward = torch.compile(layer.forward, backend="eager", fullgraph=True)
        apply_activation_checkpointing(layer)
        layer(x).sum().backward()
    finally:
        torch._dynamo.reset()
    twin(x).sum().backward()
    assert_same_grads([p.grad for p in twin.parameters()], [p.grad for p in layer.parameters()])


def test_a_container_of_layers_is_refused_naming_checkpoint_layers() -> None:
    # Its forward is never called: the boundary would have checkpointed nothing, silently.
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    for container in (layers, nn.ModuleDict({"a": nn.Linear(4, 4)})):
        with pytest.raises(CheckpointConfigError, match="has no forward of its own") as err:
            apply_activation_checkpointing(container)
        listed = ".values()" if isinstance(container, nn.ModuleDict) else ""  # else its keys
        assert f"checkpoint_layers(model.layers{listed})" in str(err.value)
        assert not pytree_ckpt.is_checkpointed(container)
    assert checkpoint_layers(layers) == [0, 1]
    # Among layers, before any of them changes (checkpoint_layers(model.children())).
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(CheckpointConfigError, match=r"layer 1 \(ModuleList\) has no forward"):
        checkpoint_layers(model.children())
    assert not pytree_ckpt.is_checkpointed(model[0])


def test_a_container_given_a_forward_of_its_own_is_checkpointed_as_any_layer() -> None:
    # Guards against: refusing every module whose class has no forward, when an instance was
    # given one (a stack assembled without a class of its own is called, and checkpointed).
    phases: list[str] = []

    def stacked(stack: nn.ModuleList) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            phases.append(current_phase().value)
            return stack[1](torch.tanh(stack[0](x)))
        return forward

    torch.manual_seed(0)
    eager = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    wrapped = copy.deepcopy(eager)
    eager.forward, wrapped.forward = stacked(eager), stacked(wrapped)
    assert apply_activation_checkpointing(wrapped, offload=False) is wrapped
    grads = []
    for stack in (eager, wrapped):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        stack(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in stack.parameters())])
    assert_same_grads(*grads)
    assert phases == ["plain", "forward", "recompute"]


def test_a_wrapped_forward_shows_the_layers_own_signature() -> None:
    # Code that inspects forward (transformers' Trainer drops batch columns forward does not
    # name) saw (*args, **kwargs).
    import inspect

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    *, scale: float = 1.0) -> torch.Tensor:
            return self.proj(hidden_states) * scale

    layer = Layer()
    before = inspect.signature(layer.forward)
    apply_activation_checkpointing(layer)
    assert inspect.signature(layer.forward) == before
    assert list(before.parameters) == ["hidden_states", "attention_mask", "scale"]
    assert not hasattr(layer.forward, "__wrapped__")  # inspect.unwrap must not skip the boundary
    forward = layer.forward
    del layer
    gc.collect()
    assert not hasattr(forward, "__signature__")  # its module is gone: calling it says so
    # A forward installed on the instance before wrapping (the body that runs) is the one shown.
    other = Layer()

    def scaled_only(hidden_states: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return other.proj(hidden_states) * scale

    other.forward = scaled_only  # type: ignore[method-assign]
    before = inspect.signature(other.forward)
    apply_activation_checkpointing(other)
    assert inspect.signature(other.forward) == before
    assert list(before.parameters) == ["hidden_states", "scale"]


@pytest.mark.parametrize("how", ["method", "partial of a method", "module"])
def test_a_method_of_a_module_passed_as_an_argument_gives_its_module_eager_gradients(
        how: str) -> None:
    # `shared.forward` as an argument was not seen as its module: its weight was refused in
    # backward as a tensor from outside, though the user had passed what owns it.
    import functools

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, act: Any) -> torch.Tensor:
            return act(self.lin(x)).tanh()

    def as_argument(shared: nn.Module) -> Any:
        if how == "method":
            return shared.forward
        return functools.partial(shared.forward) if how == "partial of a method" else shared

    torch.manual_seed(0)
    eager, shared = Layer(), nn.Linear(8, 8)
    ours, ours_shared = copy.deepcopy(eager), copy.deepcopy(shared)
    apply_activation_checkpointing(ours)
    x = torch.randn(4, 8)
    eager(x, as_argument(shared)).sum().backward()
    ours(x, as_argument(ours_shared)).sum().backward()
    assert_same_grads([p.grad for p in (*eager.parameters(), *shared.parameters())],
                      [p.grad for p in (*ours.parameters(), *ours_shared.parameters())])


def test_a_method_of_the_model_holding_the_layer_gives_the_models_parameters_gradients(
        ) -> None:
    # The root's method may use any of its parameters, here one of its own that a later step
    # reaches: it is taken as a module argument (all of the model's parameters become inputs
    # of each layer's call, at a cost), not left out (its gradient was silently None).
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, act: Any, use: bool) -> torch.Tensor:
            return act(self.lin(x)) if use else self.lin(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            self.gate = nn.Parameter(torch.randn(8))

        def gated(self, h: torch.Tensor) -> torch.Tensor:
            return h * self.gate

        def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x, self.gated, use)
            return x

    torch.manual_seed(0)
    eager = Model()
    ours = copy.deepcopy(eager)
    checkpoint_layers(ours.layers)
    x = torch.randn(4, 8)
    for use in (False, True):
        for model in (eager, ours):
            model.zero_grad()
            model(x, use).sum().backward()
        assert_same_grads([p.grad for p in eager.parameters()],
                          [p.grad for p in ours.parameters()])


def test_a_module_reached_only_when_a_later_call_switches_it_on_is_refused_then() -> None:
    # Verified once per module, the block that first used the shared head at its second
    # step lost the head's gradient without an error (NOTE [verified per switch]).
    class Block(nn.Module):
        def __init__(self, head: nn.Module) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self._shared = (head,)  # held, not registered: no duplicate in state_dict

        def forward(self, h: torch.Tensor, use_head: bool) -> torch.Tensor:
            h = torch.tanh(self.proj(h))
            return h + self._shared[0](h) if use_head else h

    block = apply_activation_checkpointing(Block(nn.Linear(8, 8)))
    x = torch.randn(4, 8)
    block(x, False).sum().backward()
    with pytest.raises(pytree_ckpt.CheckpointError, match="neither an input nor a parameter"):
        block(x, True).sum().backward()
    block(x, False).sum().backward()  # the verified switch still runs


class _Mode(dict, enum.Enum):
    """An enum whose members are dicts: they cannot be hashed."""

    PLAIN = {"scale": 1.0}
    GATED = {"scale": 2.0}


def test_a_table_reached_only_with_another_member_of_an_unhashable_enum_is_refused_then(
        ) -> None:
    # The switch key of a call with an enum member that cannot hash was one None for all of
    # them: the GATED call shared the PLAIN call's verification, and the outside table it
    # reads lost its gradient without an error (NOTE [verified per switch]).
    table = torch.randn(8, requires_grad=True)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, h: torch.Tensor, mode: _Mode) -> torch.Tensor:
            h = self.proj(h) * mode["scale"]
            return h * table if mode is _Mode.GATED else h

    block = apply_activation_checkpointing(Block())
    x = torch.randn(4, 8)
    block(x, _Mode.PLAIN).sum().backward()
    with pytest.raises(pytree_ckpt.CheckpointError, match="neither an input nor a parameter"):
        block(x, _Mode.GATED).sum().backward()
    assert table.grad is None
    block(x, _Mode.PLAIN).sum().backward()  # the verified switch still runs


def test_checkpoint_layers_without_rng_preservation_lets_each_replay_draw_its_own_mask() -> None:
    # preserve_rng_state=False reaches every layer: their replays draw dropout masks from the
    # generator as backward finds it, moving it; preserved replays restore the forward's state
    # and leave the generator where backward found it.
    for preserve in (True, False):
        torch.manual_seed(0)
        layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(2))
        assert checkpoint_layers(layers, preserve_rng_state=preserve) == [0, 1]
        h = torch.randn(4, 8, requires_grad=True)
        for layer in layers:
            h = layer(h)
        before_backward = torch.get_rng_state()
        h.sum().backward()
        assert torch.equal(torch.get_rng_state(), before_backward) is preserve


def test_checkpoint_layers_with_offload_false_offloads_nothing_whatever_the_environment_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # offload= is resolved once, and every layer gets exactly that: an explicit False must not
    # fall back, per layer, to XTUNER_ACTIVATION_OFFLOAD=1.
    from offload import default_manager

    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    manager = default_manager()
    x = torch.randn(1024, 32, requires_grad=True)  # 128 KiB inputs: over the default floor
    for offload, moves in ((False, False), (None, True)):
        layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        checkpoint_layers(layers, offload=offload)
        before = manager.stats()["offloaded_bytes"]
        layers[1](layers[0](x)).sum().backward()
        assert (manager.stats()["offloaded_bytes"] > before) is moves


def test_applying_again_with_other_options_names_what_differs_as_installed_and_requested(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import offload
    from offload import defaults as offload_defaults

    layer = nn.Linear(2, 2)
    mine = offload.OffloadManager(offload.OffloadConfig(min_bytes=0))
    apply_activation_checkpointing(layer, offload=mine)
    defaults = dict(offload_defaults._default_managers)
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "0")
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(layer)  # the variable says off
    message = str(err.value)
    assert "already checkpointed with other options: offload differs" in message
    assert "as installed: offload=an OffloadManager(OffloadConfig(min_bytes=0" in message
    assert "as requested now: offload=off" in message
    assert "XTUNER_ACTIVATION_OFFLOAD" in message and "remove_activation_checkpointing" in message
    assert offload_defaults._default_managers == defaults  # naming them created none
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(layer, offload=True, preserve_rng_state=False)
    message = str(err.value)
    assert "preserve_rng_state, offload differ" in message
    assert "as requested now: preserve_rng_state=False, offload=the default manager" in message
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers([nn.Linear(2, 2), layer], offload=False)
    assert "layers[1] (Linear) is already checkpointed" in str(err.value)
    assert "remove_activation_checkpointing(layers[1])" in str(err.value)


def test_check_fn_checkpoints_each_chosen_layer_as_torchs_function_of_that_name() -> None:
    torch.manual_seed(0)
    model = Stack(3)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 8, requires_grad=True)
    assert apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer)) is model
    assert not is_checkpointed(model)
    assert [is_checkpointed(layer) for layer in model.layers] == [True] * 3
    grads = []
    for m in (twin, model):
        m(x).sum().backward()
        grads.append([x.grad, *(p.grad for p in m.parameters())])
        x.grad = None
    assert_same_grads(*grads)
    # Each chosen layer ran twice (forward, replay); the twin's once.
    assert [layer.phases for layer in model.layers] == [["forward", "recompute"]] * 3
    assert [layer.phases for layer in twin.layers] == [["plain"]] * 3


def test_check_fn_that_chooses_nothing_or_a_layer_and_its_child_is_refused_unchanged() -> None:
    model = Stack(2)
    with pytest.raises(CheckpointConfigError, match="(?s)chose none.*tip: check_fn=lambda m"):
        apply_activation_checkpointing(model, check_fn=lambda m: False)
    with pytest.raises(CheckpointConfigError, match="(?s)'layers.0.mlp' inside 'layers.0'.*twice"):
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, (Layer, nn.Sequential)))
    # The model itself (path "") chosen with its layers: each layer would replay twice in
    # backward (in the model's replay, then in its own), for no memory.
    with pytest.raises(CheckpointConfigError, match="(?s)'layers.0' inside 'the model'.*twice"):
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, (Stack, Layer)))
    assert not any(is_checkpointed(m) for m in model.modules())


def test_a_check_fn_returning_a_string_is_refused_naming_the_module_and_nothing_changes(
) -> None:
    # Helper DO: read by truth, lambda m: "no" chose every module, and the message then spoke
    # of nesting. None (a function with no return for other modules) stays false, as torch's.
    model = Stack(2)
    with pytest.raises(CheckpointConfigError,
                       match=r"(?s)returned the string 'no' for layers\.0 \(Layer\).*"
                             r"got: +str 'no'.*tip: return a bool"):
        apply_activation_checkpointing(
            model, check_fn=lambda m: ("no" if isinstance(m, Layer) else False))
    assert not any(is_checkpointed(m) for m in model.modules())

    def chosen(m: nn.Module) -> bool | None:
        if isinstance(m, Layer):
            return True
        return None

    apply_activation_checkpointing(model, check_fn=chosen)  # type: ignore[arg-type]
    assert [is_checkpointed(m) for m in model.layers] == [True, True]


def test_a_check_fn_returning_bytes_is_refused_as_a_string_is() -> None:
    # Mutation testing (helper EK): the refusal's bytes case was untested (b"False" is true).
    model = Stack(2)
    with pytest.raises(CheckpointConfigError,
                       match=r"(?s)returned the string b'False' for layers\.0 \(Layer\).*"
                             r"got: +bytes b'False'"):
        apply_activation_checkpointing(
            model, check_fn=lambda m: (b"False" if isinstance(m, Layer) else False))
    assert not any(is_checkpointed(m) for m in model.modules())


def test_check_fn_checks_every_chosen_layer_before_changing_any() -> None:
    model = Stack(3)
    apply_activation_checkpointing(model.layers[2], preserve_rng_state=False)
    with pytest.raises(CheckpointConfigError, match="other options: preserve_rng_state"):
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    assert [is_checkpointed(layer) for layer in model.layers] == [False, False, True]


@pytest.mark.parametrize("policy", [{Layer}, Layer, (Layer, nn.Linear)])
def test_a_check_fn_naming_layer_classes_is_refused_with_the_isinstance_it_means(
        policy: Any) -> None:
    # torchtune's auto_wrap_policy={Layer} moved over as check_fn: a set raised "'set' object
    # is not callable", and a class was called with each module (Layer(module): a TypeError of
    # its __init__), neither naming the fix.
    model = Stack(2)
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, check_fn=policy)
    message = str(err.value)
    assert "expected: a function of a module returning a bool" in message
    if policy is Layer:
        assert "got:      the class Layer" in message
        assert "tip: check_fn=lambda m: isinstance(m, Layer) " in message
    elif isinstance(policy, set):
        assert "got:      set {Layer}" in message
    else:
        assert "tip: check_fn=lambda m: isinstance(m, (Layer, Linear))" in message
    assert not any(is_checkpointed(m) for m in model.modules())
    # What the tip says gives eager's gradients.
    twin = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, model], x, seed=0))


def _torch_keywords(case: str) -> dict[str, Any]:
    """torch.distributed's (and torchtune's) keywords of apply_activation_checkpointing, as a
    config moved over would pass them."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return {"wrapper": {"checkpoint_wrapper_fn": wrapper,
                        "check_fn": lambda m: isinstance(m, Layer)},
            "policy-set": {"auto_wrap_policy": {nn.GELU}},
            "policy-fsdp": {"auto_wrap_policy": ModuleWrapPolicy({nn.GELU})},
            "both": {"checkpoint_wrapper_fn": wrapper, "auto_wrap_policy": {nn.GELU}}}[case]


@pytest.mark.parametrize("case", ["wrapper", "policy-set", "policy-fsdp", "both"])
def test_torch_distributeds_keywords_are_refused_naming_the_keyword_and_check_fn(
        case: str) -> None:
    # Guards against: checkpoint_wrapper_fn= or auto_wrap_policy= (torch.distributed's
    # apply_activation_checkpointing, torchtune's set_activation_checkpointing) moved over as
    # they are raising Python's "unexpected keyword argument", which named no replacement, or
    # being taken and ignored. Refused before any layer changes; the tip's check_fn names the
    # policy's class, and (for the layers) gives eager's gradients.
    model = Stack(2)
    keywords = _torch_keywords(case)
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, **keywords)
    message = str(err.value)
    for name in ("checkpoint_wrapper_fn", "auto_wrap_policy"):
        assert (f"{name}=" in message) == (name in keywords), name
    assert "torch.distributed's keyword" in message and "no wrapper module" in message
    # the policy's class, or a placeholder where none is given
    test = "isinstance(m, GELU)" if "auto_wrap_policy" in keywords else "isinstance(m, Layer)"
    assert f"tip: apply_activation_checkpointing(model, check_fn=lambda m: {test})" in message
    assert ("the wrapper is pytree_ckpt's own" in message) == ("checkpoint_wrapper_fn" in keywords)
    if case == "policy-fsdp":
        assert "got:      auto_wrap_policy=ModuleWrapPolicy {GELU}" in message
    if case == "wrapper":
        assert "got:      checkpoint_wrapper_fn=partial(checkpoint_wrapper, ...)" in message
    assert not any(is_checkpointed(m) for m in model.modules())
    # Their unset value, None, is no refusal; what the tip says gives eager's gradients.
    twin = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer),
                                   checkpoint_wrapper_fn=None, auto_wrap_policy=None)
    assert [is_checkpointed(layer) for layer in model.layers] == [True, True]
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, model], x, seed=0))


def test_a_moduledict_or_a_model_given_as_layers_gets_a_tip_naming_its_layer_list() -> None:
    # torchtitan keeps model.layers in a ModuleDict: the tip was "apply_activation_
    # checkpointing(module) checkpoints one module", which wraps the container (refused too).
    class Titan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({str(i): Layer() for i in range(3)})

    model = Titan()
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers(model.layers)
    assert "got:      ModuleDict with keys ['0', '1', '2']" in str(err.value)
    assert "tip: pass model.layers.values() to checkpoint_layers" in str(err.value)
    with pytest.raises(CheckpointConfigError, match=r"tip: pass model.layers.values\(\) to "):
        checkpoint_layers(model)
    with pytest.raises(CheckpointConfigError, match=r"tip: pass model.layers to checkpoint_"):
        checkpoint_layers(Stack(2))
    with pytest.raises(CheckpointConfigError, match=r"tip: checkpoint_layers\(model.layers"
                                                    r".values\(\)\)"):
        apply_activation_checkpointing(model.layers)
    assert not any(is_checkpointed(m) for m in model.modules())
    assert checkpoint_layers(model.layers.values()) == [0, 1, 2]
    assert all(is_checkpointed(layer) for layer in model.layers.values())


def test_check_fn_choosing_layers_1_and_10_checkpoints_both_as_siblings() -> None:
    # Guards against: _chosen_by (apply.py) taking a name that merely starts with another's
    # ("10" with "1") for a module inside it: two sibling layers of a long stack were refused
    # as nested. Both are checkpointed, and give eager's gradients bit for bit.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(11)))
    twin = copy.deepcopy(model)
    chosen = (model[1], model[10])
    apply_activation_checkpointing(model, check_fn=lambda m: any(m is c for c in chosen))
    assert [i for i, layer in enumerate(model) if is_checkpointed(layer)] == [1, 10]
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, model], x, seed=0))


def test_a_list_check_fn_a_plain_dict_of_layers_and_one_refused_keyword_are_told_exactly() -> None:
    # Guards against: _refuse_policy (apply.py) leaving a list of classes out (check_fn=[Layer]
    # then failed in named_modules with "'list' object is not callable"); listed_layers
    # leaving a plain dict out of its refusal (iterating it gives its keys: "layers[0] is not
    # one" named no fix); _refuse_torch_keywords saying "keywords" of one keyword.
    model = Stack(2)
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, check_fn=[Layer])  # type: ignore[arg-type]
    assert "got:      list [Layer]" in str(err.value)
    assert "tip: check_fn=lambda m: isinstance(m, Layer) " in str(err.value)
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers({"0": Layer(), "1": Layer()})  # type: ignore[arg-type]
    assert str(err.value).startswith("checkpoint_layers takes a sequence of layers, not a dict")
    assert "got:      dict with keys ['0', '1']" in str(err.value)
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, auto_wrap_policy={Layer})  # type: ignore[arg-type]
    assert str(err.value).startswith(
        "apply_activation_checkpointing takes no auto_wrap_policy= (torch.distributed's "
        "keyword): ")
    assert not any(is_checkpointed(m) for m in model.modules())


def test_module_compile_of_a_checkpointed_layer_is_told_as_module_compile_only() -> None:
    # layer.compile() calls the layer through torch.compile(layer._call_impl), a compiled
    # function bound to the layer itself: not a compiled caller around it, so the one warning
    # is module.compile()'s (mutation round DE: kills D27).
    import warnings

    x = torch.randn(2, 4, requires_grad=True)
    layer = nn.Linear(4, 4)
    twin = copy.deepcopy(layer)
    apply_activation_checkpointing(layer)
    layer.compile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            layer(x).sum().backward()
            twin(x).sum().backward()
    told = [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]
    assert len(told) == 1 and "module.compile()" in told[0], told
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    assert torch.equal(layer.bias.grad, twin.bias.grad)


@pytest.mark.parametrize("fn", [pytree_ckpt.is_checkpointed,
                                pytree_ckpt.remove_activation_checkpointing,
                                pytree_ckpt.apply_activation_checkpointing])
@pytest.mark.parametrize("given", [None, [nn.Linear(2, 2)], nn.Linear])
def test_a_module_function_given_no_module_is_refused_naming_the_fix(fn: Any, given: Any) -> None:
    # is_checkpointed and remove_activation_checkpointing once raised "'NoneType' object has no
    # attribute '__dict__'" from inside; a module class was "got: type", naming no fix.
    with pytest.raises(CheckpointConfigError) as caught:
        fn(given)
    what, expected, got, tip = str(caught.value).split("\n")
    assert what == f"{fn.__name__} expects an nn.Module"
    assert expected == "  expected: an nn.Module"
    if given is nn.Linear:
        assert got == "  got:      the class Linear, not an instance of it"
        assert tip == "  tip: pass the model's Linear module itself, not its class"
    else:
        assert got == f"  got:      {type(given).__name__} {given!r}"
        assert tip.startswith("  tip: pass ") and "model.layers" in tip


# Coverage audit (helper EA): the branches below ran in no test.
@pytest.mark.parametrize("policy", ["class", "function"])
def test_an_auto_wrap_policy_given_as_a_class_or_a_function_is_refused_naming_it(
        policy: str) -> None:
    # torch.distributed's auto_wrap_policy= as a bare class, or as a policy function of its
    # own (neither a set nor FSDP's ModuleWrapPolicy): named by its qualified name; the tip
    # names the class where the policy is one, the placeholder where it is a function.
    def only_blocks(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True

    value: Any = nn.GELU if policy == "class" else only_blocks
    model = Stack(2)
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, auto_wrap_policy=value)
    lines = str(err.value).splitlines()
    name = "GELU" if policy == "class" else only_blocks.__qualname__
    test = "isinstance(m, GELU)" if policy == "class" else "isinstance(m, Layer)"
    assert lines[2] == f"  got:      auto_wrap_policy={name}"
    assert lines[3] == f"  tip: apply_activation_checkpointing(model, check_fn=lambda m: {test})"
    assert not any(is_checkpointed(m) for m in model.modules())


def test_a_checkpointed_forward_without_code_has_no_code_attribute_as_in_eager() -> None:
    # A forward installed on the instance as a functools.partial (no __code__): the installed
    # forward's __code__ raises AttributeError, so hasattr() says False as for the bare one;
    # the call runs it, with eager's gradients.
    import functools

    def scaled(module: nn.Module, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return module.proj(x) * scale

    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.Module()
        layer.proj = nn.Linear(4, 4)
        layer.forward = functools.partial(scaled, layer, scale=3.0)
        return layer

    twin, layer = make(), make()
    assert not hasattr(layer.forward, "__code__")
    apply_activation_checkpointing(layer)
    assert is_checkpointed(layer)
    assert not hasattr(layer.forward, "__code__")
    with pytest.raises(AttributeError, match="^__code__$"):
        layer.forward.__code__  # noqa: B018
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))


class _Tanh(nn.Module):
    forward = torch.tanh  # a builtin: no __get__, called as it is (nn.Module.__call__)


class _DoublingCall:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _Doubling(nn.Module):
    forward = _DoublingCall()  # a callable object without __get__


@pytest.mark.parametrize("kind", [_Tanh, _Doubling], ids=["builtin", "callable-object"])
def test_a_class_forward_without_get_runs_wrapped_with_eagers_gradients(kind: type) -> None:
    # Helper EA: the installed forward bound type(module).forward.__get__(module), so a class
    # forward without __get__ (a builtin, a callable object), which Python calls unbound,
    # raised AttributeError at every call once wrapped.
    twin, layer = kind(), kind()
    x = torch.randn(3, requires_grad=True)
    apply_activation_checkpointing(layer)
    assert is_checkpointed(layer)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))


class _StaticTanh(nn.Module):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # called unbound, as Python's lookup gives it
        return torch.tanh(x) * 2


def test_a_static_method_forward_runs_wrapped_with_eagers_gradients() -> None:
    twin, layer = _StaticTanh(), _StaticTanh()
    x = torch.randn(3, requires_grad=True)
    apply_activation_checkpointing(layer)
    assert is_checkpointed(layer)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))


def test_a_module_built_under_inference_mode_gets_eagers_gradients() -> None:
    # Its parameters are inference tensors, whose version counter cannot be read (reading
    # raises): the boundary's parameter checks take the other way; the gradients are eager's.
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.linspace(-1, 1, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 3).sin() + self.shift  # the add saves no parameter: eager runs

    with torch.inference_mode():
        layer = Shifted()
    assert layer.shift.is_inference() and layer.shift.requires_grad
    twin = Shifted()
    with torch.no_grad():
        twin.shift.copy_(layer.shift)
    apply_activation_checkpointing(layer)
    x = torch.randn(2, 4, requires_grad=True)
    grads = grads_per_model([twin, layer], x, seed=0)
    assert grads[0][0] is not None and grads[1][0] is not None
    assert_same_grads(*grads)


def test_removing_checkpointing_from_the_model_checkpoint_layers_was_given_undoes_every_layer(
        ) -> None:
    from offload import OffloadConfig, OffloadManager

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    checkpoint_layers(model, offload=manager)
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    held = weakref.ref(manager)
    del manager
    try:
        pytree_ckpt.remove_activation_checkpointing(model)
    except CheckpointConfigError:
        return  # refused, naming the per-layer call: fine
    gc.collect()
    assert [pytree_ckpt.is_checkpointed(layer) for layer in model] == [False] * 3
    assert held() is None


def test_removing_checkpointing_from_the_model_undoes_layers_nested_below_its_children() -> None:
    # Mutation testing (helper EK): the test above checkpoints a Sequential's direct children;
    # undoing only the model's children passed it. A model's layers sit in a ModuleList.
    model = Stack(2)
    twin = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    assert [is_checkpointed(layer) for layer in model.layers] == [True, True]
    pytree_ckpt.remove_activation_checkpointing(model)
    assert not any(is_checkpointed(m) for m in model.modules())
    assert "forward" not in model.layers[0].__dict__
    x = torch.randn(3, 8, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, model], x, seed=0))



def test_a_class_forward_without_get_keeps_its_signature_once_wrapped() -> None:
    # Mutation testing (helper EK): the installed forward's signature looks its own forward up
    # as its call does (module._class_forward); binding it there raised about __get__ inside
    # the property, inspect fell back to (*args, **kwargs), and the suite passed.
    twin, layer = _Doubling(), apply_activation_checkpointing(_Doubling())
    assert str(inspect.signature(twin.forward)) == "(x: 'torch.Tensor') -> 'torch.Tensor'"
    assert inspect.signature(layer.forward) == inspect.signature(twin.forward)


@pytest.mark.parametrize("option", ["use_reentrant", "context_fn", "determinism_check", "debug"])
@pytest.mark.parametrize("where", ["checkpointed", "apply_activation_checkpointing",
                                   "checkpoint_layers"])
def test_torch_checkpoint_options_given_where_boundary_options_go_name_their_replacement(
        where: str, option: str) -> None:
    # torchtitan's ptd_checkpoint_wrapper(block, context_fn=..., preserve_rng_state=False) and
    # torch's checkpoint(fn, x, use_reentrant=False, ...) moved over as boundary.md's table says
    # (options go to checkpointed(fn, preserve_rng_state=...), the wrapper becomes
    # apply_activation_checkpointing): the other options come along.
    value: Any = False if option in ("use_reentrant", "debug") else (
        "none" if option == "determinism_check" else (lambda: None))
    calls = {"checkpointed": lambda: pytree_ckpt.checkpointed(nn.Linear(2, 2), **{option: value}),
             "apply_activation_checkpointing": lambda: apply_activation_checkpointing(
                 nn.Linear(2, 2), **{option: value}),
             "checkpoint_layers": lambda: checkpoint_layers([nn.Linear(2, 2)], **{option: value})}
    with pytest.raises((TypeError, ValueError)) as err:
        calls[where]()
    assert option in str(err.value) and "tip:" in str(err.value)


def test_several_torch_options_given_at_once_are_each_named_with_their_values_and_tips(
        ) -> None:
    # Guards against: refuses_torch_options (torch_options.py) naming only the first option
    # given, or its value by str() (a string then read as a name), while the others, refused
    # next, cost one more round each (mutants, helper FY).
    block = nn.Linear(2, 2)
    with pytest.raises(CheckpointConfigError) as raised:
        apply_activation_checkpointing(block, use_reentrant=False, determinism_check="none")
    message = str(raised.value)
    assert message.startswith(
        "apply_activation_checkpointing takes no determinism_check=, use_reentrant= ")
    assert "got:      determinism_check='none', use_reentrant=False" in message
    assert "drop determinism_check" in message and "drop use_reentrant" in message
    assert not pytree_ckpt.is_checkpointed(block)


def test_a_torch_check_fn_that_also_matches_the_model_checkpoints_its_blocks_as_torchs_does(
        ) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as torch_apply)

    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)))

    def check(m: nn.Module) -> bool:
        return isinstance(m, nn.Sequential)

    theirs = blocks()
    torch_apply(theirs, check_fn=check)
    assert [type(b) for b in theirs] == [CheckpointWrapper, CheckpointWrapper]
    ours = blocks()
    try:
        apply_activation_checkpointing(ours, check_fn=check)
    except CheckpointConfigError as refused:
        # Says why torch's same call wraps the blocks, and the test that does the same here.
        assert "never chooses the model it is given" in str(refused)
        assert "m is not model and" in str(refused)
        apply_activation_checkpointing(ours, check_fn=lambda m: m is not ours and check(m))
    assert [is_checkpointed(b) for b in ours] == [True, True] and not is_checkpointed(ours)


def test_torchs_wrapper_and_selective_options_are_refused_where_they_are_moved_to() -> None:
    # torch.distributed's checkpoint_wrapper(block, checkpoint_impl=...) becomes
    # apply_activation_checkpointing(block), and a context_fn of selective checkpointing goes
    # with apply_recompute_config: each is refused naming what it becomes, while the options
    # these functions take themselves (preserve_rng_state) still reach them.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    block = nn.Linear(2, 2)
    with pytest.raises(CheckpointConfigError, match="checkpoint_impl=") as raised:
        apply_activation_checkpointing(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    assert "drop checkpoint_impl" in str(raised.value)
    assert not pytree_ckpt.is_checkpointed(block)
    with pytest.raises(CheckpointConfigError, match="context_fn=") as raised:
        pytree_ckpt.apply_recompute_config([block], pytree_ckpt.RecomputeConfig(save=["attn"]),
                                           {"attn": pytree_ckpt.KeptOps("aten::mm")},
                                           context_fn=lambda: None)
    assert "RecomputeConfig(save=[...])" in str(raised.value)
    apply_activation_checkpointing(block, preserve_rng_state=False)
    assert pytree_ckpt.is_checkpointed(block)


@pytest.mark.parametrize("policy", [(Layer, nn.Linear), [Layer, nn.Linear]])
def test_a_check_fn_given_as_a_tuple_or_list_of_classes_is_shown_as_that_container(
        policy: Any) -> None:
    # Guards against (helper GZ) "got:      tuple {Layer, Linear}", which read as a set of the
    # two classes: the container given is shown with its own brackets.
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(Stack(2), check_fn=policy)
    opened, closed = ("(", ")") if isinstance(policy, tuple) else ("[", "]")
    assert f"got:      {type(policy).__name__} {opened}Layer, Linear{closed}" in str(err.value)


class _ScaledCall(DictSettings):
    """A callable config object: its __getattr__ raises KeyError for any name it lacks."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.factor


class _ScaledForward(nn.Module):
    forward = _ScaledCall(factor=2.0)  # a callable object without __get__, as _Doubling


# Guards against (helper HK), as it was found:
def test_a_class_forward_that_is_a_callable_config_object_runs_wrapped_with_eagers_gradients(
        ) -> None:
    # Eager: nn.Module.__call__ finds the class attribute (no __get__) and calls it unbound.
    # Wrapped: _class_forward reads forward.__get__, which the object's __getattr__ answers
    # with a KeyError, not the AttributeError it catches.
    twin, layer = _ScaledForward(), _ScaledForward()
    x = torch.randn(3, requires_grad=True)
    apply_activation_checkpointing(layer)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))


# Guards against (helper HK), as it was found:
def test_an_instance_forward_that_is_a_callable_config_object_is_wrapped_and_replaced() -> None:
    # A layer whose forward was replaced per instance by a callable config object: eager calls
    # it. Wrapped, check_compiled_wrapper's hasattr(installed.bare, "_torchdynamo_orig_callable")
    # (compiled_layers.py:114) raised the object's KeyError at the first call; and a forward
    # replaced by such an object after wrapping made is_checkpointed (compiled_over's getattr,
    # compiled_layers.py:190) raise instead of saying False.
    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.Linear(3, 3)
        layer.forward = _ScaledCall(factor=3.0)  # type: ignore[method-assign]
        return layer

    twin, layer = make(), make()
    x = torch.randn(2, 3, requires_grad=True)
    apply_activation_checkpointing(layer)
    assert is_checkpointed(layer)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))
    other = nn.Linear(3, 3)
    apply_activation_checkpointing(other)
    other.forward = _ScaledCall(factor=3.0)  # type: ignore[method-assign]
    assert not is_checkpointed(other)  # the user's forward replaced the boundary


class _Delegating:
    """A callable wrapper that answers the attributes it lacks from the function it wraps (a
    timing or logging decorator written as a class)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


def _doubled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


class _DelegatingForward(nn.Module):
    forward = _Delegating(_doubled_tanh)  # no __get__ on its type: eager calls it unbound


# Helper HL: _class_forward (module.py:66) asks the object for forward.__get__, which its
# __getattr__ answers with the wrapped function's __get__: the boundary binds the module to it
# and calls _doubled_tanh(module, x) (TypeError), where Python's descriptor protocol reads
# __get__ on the type only, as the except clause's own hasattr(type(forward), "__get__") does.
# Guards against (helper HL), as it was found:
def test_a_class_forward_that_delegates_its_attributes_runs_wrapped_with_eagers_gradients(
        ) -> None:
    twin, layer = _DelegatingForward(), _DelegatingForward()
    x = torch.randn(3, requires_grad=True)
    apply_activation_checkpointing(layer)
    assert_same_grads(*grads_per_model([twin, layer], x, seed=0))


# Each forward of a _RecTree, logged outside the module (a list the module held would be its
# state, which the replay leaves as the forward left it).
_REC_FORWARDS: list[None] = []


class _RecTree(nn.Module):
    """A recursive net over a parse tree (a tree-LSTM, SPINN on a right-branching parse): it
    calls itself on each child; each forward is logged in ``_REC_FORWARDS``."""

    def __init__(self) -> None:
        super().__init__()
        self.W, self.U = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)

    def forward(self, node: dict) -> torch.Tensor:
        _REC_FORWARDS.append(None)
        h = self.W(node["x"])
        for kid in node["kids"]:
            h = h + self.U(self(kid))
        return torch.tanh(h)


def _rec_trees_and_chain(depth: int, /) -> tuple[_RecTree, _RecTree, dict, list[None]]:
    """An eager tree net, its copy, a chain ``depth`` levels deep and their forwards' log."""
    torch.manual_seed(0)
    _REC_FORWARDS.clear()
    eager = _RecTree()
    emb = torch.randn(5, 2, 4)
    node: dict = {"x": emb[0], "kids": []}
    for level in range(depth):
        node = {"x": emb[level % 5], "kids": [node]}
    return eager, copy.deepcopy(eager), node, _REC_FORWARDS


@pytest.fixture
def python_default_recursion_limit() -> Iterator[None]:
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default, whatever the runner set
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.xfail(strict=True, reason="documented limit (docs/limits.md, Inputs and outputs: "
                   "a module that calls itself, wrapped in place) (helper MI): each self-call is "
                   "a nested boundary, 7 frames a level")
@pytest.mark.usefixtures("python_default_recursion_limit")
def test_a_recursive_tree_module_as_deep_as_eager_runs_gives_eagers_gradients() -> None:
    # Wrapped, each level of a self-calling module costs 7 Python frames (the
    # torch.compiler.disable wrapper's two, _CheckpointedForward.__call__, run_boundary, the
    # module's two and forward) where eager's costs 3: under the default limit a chain of 200
    # levels runs in eager and raises RecursionError in the wrapped twin's forward (from
    # about 110 levels on).
    eager, ours, node, _ = _rec_trees_and_chain(200)
    pytree_ckpt.apply_activation_checkpointing(ours)
    eager(node).sum().backward()
    ours(node).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), ours.parameters()))


def test_a_recursive_tree_module_wrapped_in_place_forwards_as_often_as_its_limits_row_says(
        ) -> None:
    # docs/limits.md, a module that calls itself, wrapped in place: "at depth 40 a step runs
    # the forward 902 times, eager 41 times" (each self-call a nested boundary, replayed again
    # by each replay above it).
    eager, ours, node, forwards = _rec_trees_and_chain(40)
    root = copy.deepcopy(eager)  # the row's tip: the root call checkpointed, the module not
    pytree_ckpt.apply_activation_checkpointing(ours)
    counts = []
    for run in (eager, ours, lambda n: pytree_ckpt.checkpoint(root, n)):
        forwards.clear()
        run(node).sum().backward()
        counts.append(len(forwards))
    assert counts == [41, 902, 82]
    limits = (Path(__file__).parents[2] / "docs" / "limits.md").read_text()
    assert "(at depth 40 a step runs the forward 902 times, eager 41 times, the root " \
        "checkpointed as below 82)" in " ".join(limits.split())
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)  # the rounding row
               for a, b in zip(eager.parameters(), ours.parameters()))


@pytest.mark.usefixtures("python_default_recursion_limit")
def test_a_recursive_tree_module_checkpointed_at_its_root_runs_eagers_depth_with_one_more_forward(
        ) -> None:
    # docs/limits.md, a module that calls itself: the row's tip. One boundary around the root
    # call: its self-calls run plainly (no nested boundaries), so a chain as deep as eager's
    # runs, each level forwarded twice (the original pass and the one replay), gradients exact.
    eager, ours, node, forwards = _rec_trees_and_chain(200)
    eager(node).sum().backward()
    assert len(forwards) == 201
    forwards.clear()
    pytree_ckpt.checkpoint(ours, node).sum().backward()
    assert len(forwards) == 2 * 201
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), ours.parameters()))


class _CountedBlock(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.lin(x).tanh()


@pytest.mark.parametrize("order", ["layers_then_model", "model_then_layers", "checkpoint_call"])
def test_layers_checkpointed_inside_a_checkpointed_model_are_logged_once_with_eager_grads(
        order: str, caplog: pytest.LogCaptureFixture) -> None:
    # NOTE [a checkpointed layer inside a checkpointed call] (module.py): check_fn choosing a
    # module and one inside it is refused; the same nesting made by two calls ran each layer
    # three times a step, silently (helper PT). Logged once per layer at its first call inside
    # the other boundary's forward (a list of layers names no ancestor, so not at the apply;
    # a log, as nesting on purpose is exact and documented).
    torch.manual_seed(0)
    model = nn.Sequential(_CountedBlock(), _CountedBlock())
    eager = copy.deepcopy(model)
    if order != "model_then_layers":
        checkpoint_layers(model)
    if order == "layers_then_model":
        apply_activation_checkpointing(model)
    elif order == "model_then_layers":
        apply_activation_checkpointing(model)
        checkpoint_layers(model)
    run = (lambda x: pytree_ckpt.checkpoint(model, x)) if order == "checkpoint_call" else model
    x = torch.randn(2, 4, requires_grad=True)
    for step in range(2):
        _CountedBlock.calls = 0
        caplog.clear()
        with caplog.at_level("WARNING", logger="pytree_ckpt.module"):
            run(x).sum().backward()
        told = [r.getMessage() for r in caplog.records
                if "called inside another checkpointed" in r.getMessage()]
        assert len(told) == (2 if step == 0 else 0), told
        assert _CountedBlock.calls == 2 * 3  # what it costs: eager runs each block once
    for _ in range(2):
        eager(x).sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()])


def test_a_check_fn_returning_an_empty_string_is_not_said_to_be_always_true() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.raises(CheckpointConfigError) as refused:
        apply_activation_checkpointing(
            model, check_fn=lambda m: "yes" if isinstance(m, nn.Linear) else "")  # type: ignore
    assert bool("") is False
    assert "always true" not in str(refused.value) and "'' would not" in str(refused.value)


def test_a_check_fn_without_its_return_is_told_it_returned_none() -> None:
    # A def that tests but never returns gives None for every module (helper PT): said so,
    # not "false for all".
    def check_fn(m: nn.Module) -> bool:
        isinstance(m, nn.Linear)  # the slip: no return
        return None  # type: ignore[return-value]

    with pytest.raises(CheckpointConfigError, match="None for all 3 modules"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(4, 4), nn.GELU()),
                                       check_fn=check_fn)


class _EncoderThenHead(nn.Module):
    """A model whose encoder is frozen (or run under no_grad) and whose head trains."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.enc = _CountedBlock()
        self.head = nn.Linear(4, 4)
        self.frozen = frozen
        if frozen:
            self.enc.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:
            t = self.enc(x)
        else:
            with torch.no_grad():
                t = self.enc(x)
        return self.head(x) * t


def _nested_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "called inside another checkpointed" in r.getMessage()]


@pytest.mark.parametrize("frozen", [True, False])
def test_a_checkpointed_layer_running_plainly_in_a_checkpointed_model_is_not_said_to_cost_more(
        frozen: bool, caplog: pytest.LogCaptureFixture) -> None:
    # A frozen encoder (nothing in it can receive a gradient) or one called under no_grad runs
    # without a boundary in both passes of the model's (NOTE [when there is no boundary]): with
    # its own checkpointing it runs twice a step, as with the model's alone. The log (which
    # said "each step runs its forward once more than one boundary would" at its first call,
    # helper PX) fires only where an inner boundary is built.
    calls = []
    for layers_too in (False, True):
        torch.manual_seed(0)
        model = _EncoderThenHead(frozen)
        if layers_too:
            checkpoint_layers([model.enc])
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _EncoderThenHead))
        _CountedBlock.calls = 0
        caplog.clear()
        with caplog.at_level("WARNING", logger="pytree_ckpt.module"):
            model(torch.randn(2, 4)).sum().backward()
        calls.append(_CountedBlock.calls)
    assert calls[0] == calls[1] == 2
    assert _nested_logs(caplog) == []


def test_a_checkpointed_layer_called_from_an_output_discard_is_not_logged_as_nested(
        caplog: pytest.LogCaptureFixture) -> None:
    # An output discard opens no boundary pass (ACTIVE unset): its layers' boundaries are the
    # only ones, and nothing is said.
    torch.manual_seed(0)
    model = nn.Sequential(_CountedBlock(), _CountedBlock())
    eager = copy.deepcopy(model)
    checkpoint_layers(model)
    x = torch.randn(2, 4, requires_grad=True)
    with caplog.at_level("WARNING", logger="pytree_ckpt.module"):
        for _ in range(2):
            ckpt = pytree_ckpt.CheckpointWithoutOutput()
            out = ckpt.checkpoint(model, x)
            loss = (out * 2).sum()
            ckpt.discard_output_and_register_recompute(loss)
            loss.backward()
    assert _nested_logs(caplog) == []
    for _ in range(2):
        (eager(x) * 2).sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()])


def test_checkpointed_layers_called_from_a_checkpointed_function_are_logged_once_each(
        caplog: pytest.LogCaptureFixture) -> None:
    # checkpoint(fn, x) whose fn calls checkpointed layers (two layers grouped by hand) nests
    # as the model's wrapping does: three forwards a step each, told once per layer.
    torch.manual_seed(0)
    model = nn.Sequential(_CountedBlock(), _CountedBlock())
    eager = copy.deepcopy(model)
    checkpoint_layers(model)
    x = torch.randn(2, 4, requires_grad=True)
    told = []
    for _ in range(2):
        caplog.clear()
        _CountedBlock.calls = 0
        with caplog.at_level("WARNING", logger="pytree_ckpt.module"):
            pytree_ckpt.checkpoint(lambda t: model[1](model[0](t)), x).sum().backward()
        told.append(len(_nested_logs(caplog)))
        assert _CountedBlock.calls == 2 * 3
    assert told == [2, 0]
    for _ in range(2):
        eager(x).sum().backward()
    assert_same_grads([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()])


def _fsdp_style_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Layer)


@pytest.mark.parametrize("policy", ["ModuleWrapPolicy", "function", "lambda_auto_wrap_policy"])
def test_a_wrap_policy_callable_given_as_check_fn_is_refused_naming_the_isinstance_test(
        policy: str) -> None:
    # torchtune's set_activation_checkpointing(model, auto_wrap_policy) takes a set of classes
    # or an FSDP policy (ModuleWrapPolicy, a (module, recurse, nonwrapped_numel) function);
    # the docs map it to apply_activation_checkpointing(model, check_fn=...) and refuse the set
    # and the class naming the isinstance test. The callable forms, moved over as they are,
    # fail deep inside with a bare TypeError.
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    value: Any = (ModuleWrapPolicy({Layer}) if policy == "ModuleWrapPolicy"
                  else _fsdp_style_policy if policy == "function"
                  else functools.partial(lambda_auto_wrap_policy,
                                         lambda_fn=lambda m: isinstance(m, Layer)))
    model = Stack(2)
    with pytest.raises(CheckpointConfigError, match="isinstance"):
        apply_activation_checkpointing(model, check_fn=value)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_torchs_positional_apply_activation_checkpointing_call_is_refused_naming_check_fn(
        ) -> None:
    # torch.distributed's signature is apply_activation_checkpointing(model,
    # checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda _: True, auto_wrap_policy=None):
    # its arguments may be given by position.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Stack(2)
    with pytest.raises(CheckpointConfigError, match="check_fn="):
        apply_activation_checkpointing(model, checkpoint_wrapper,  # type: ignore[misc]
                                       lambda m: isinstance(m, Layer))
    assert not any(is_checkpointed(m) for m in model.modules())


def test_torchs_migration_keywords_give_eager_gradients_once_moved_as_the_docs_say() -> None:
    # The docs' rows, for a stack wrapped by torch.distributed's apply_activation_checkpointing
    # before: check_fn=isinstance, checkpointed(fn, preserve_rng_state=True), checkpoint_layers
    # over model.layers: each gives eager's gradients and names.
    eager = Stack(3)
    for how in ("check_fn", "checkpoint_layers"):
        model = copy.deepcopy(eager)
        if how == "check_fn":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer),
                                           preserve_rng_state=True)
        else:
            checkpoint_layers(model.layers)
        assert all(is_checkpointed(layer) for layer in model.layers)
        assert names(model) == names(eager)
        eager.zero_grad(set_to_none=True)
        x = torch.randn(2, 8, requires_grad=True)
        assert_same_grads(*grads_per_model([eager, model], x, seed=0))


def test_torchs_checkpoint_wrapper_checkpoint_fn_keyword_is_refused_naming_the_fix() -> None:
    # torch.distributed's checkpoint_wrapper(module, checkpoint_impl=..., checkpoint_fn=None,
    # **checkpoint_fn_kwargs): the docs map it to apply_activation_checkpointing(layer), whose
    # checkpoint_impl= is a CheckpointConfigError with a tip; checkpoint_fn= is not.
    from torch.utils.checkpoint import checkpoint

    layer = Layer()
    with pytest.raises(CheckpointConfigError, match="checkpoint_fn"):
        apply_activation_checkpointing(layer, checkpoint_fn=checkpoint)  # type: ignore[call-arg]
    assert not is_checkpointed(layer)


# helper QN: check_fn forms that are a function of one module (torch's apply_activation_
# checkpointing takes each), beside the wrap policies d8a6ea6 refuses.
class _QnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _QnChooser:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, m: nn.Module) -> bool:
        return isinstance(m, self.cls)

    def method(self, m: nn.Module) -> bool:
        return isinstance(m, self.cls)


def _qn_chosen_by(check_fn: Any) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(_QnBlock(), _QnBlock())
    ours = copy.deepcopy(eager)
    pytree_ckpt.apply_activation_checkpointing(ours, check_fn=check_fn)
    assert all(pytree_ckpt.is_checkpointed(layer) for layer in ours)
    x = torch.randn(2, 4, requires_grad=True)
    eager(x).sum().backward()
    ours(x).sum().backward()
    for p, q in zip(eager.parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad)


def _qn_pick(cls: type, m: nn.Module) -> bool:
    return isinstance(m, cls)


def _qn_keyword(m: nn.Module, *, cls: type) -> bool:
    return isinstance(m, cls)


def _qn_with_defaults(m: nn.Module, recurse: bool = True, nonwrapped_numel: int = 0) -> bool:
    return isinstance(m, _QnBlock)


@pytest.mark.parametrize("check_fn", [
    _QnChooser(_QnBlock), _QnChooser(_QnBlock).method, functools.partial(_qn_pick, _QnBlock),
    functools.partial(_qn_keyword, cls=_QnBlock), lambda m, c=_QnBlock: isinstance(m, c),
    _qn_with_defaults, lambda *args: isinstance(args[0], _QnBlock),
    functools.lru_cache(None)(lambda m: isinstance(m, _QnBlock)),
    functools.partial(_QnChooser.method, _QnChooser(_QnBlock)),
], ids=["callable object", "bound method", "partial binding the class first",
        "partial by keyword", "lambda with a default", "policy-shaped with defaults",
        "star args", "lru_cache", "partial of a method with self bound"])
def test_a_check_fn_of_one_module_in_any_form_is_taken_and_gives_eager_gradients(
        check_fn: Any) -> None:
    _qn_chosen_by(check_fn)


def _qn_adapts(f: Callable[[nn.Module, type], bool]) -> Callable[[nn.Module], bool]:
    @functools.wraps(f)
    def picked(m: nn.Module) -> bool:  # one argument: the wrapper binds the class
        return f(m, _QnBlock)
    return picked


@_qn_adapts
def _qn_adapted(m: nn.Module, cls: type) -> bool:
    return isinstance(m, cls)


def test_a_check_fn_adapted_by_a_functools_wraps_decorator_is_taken_as_torchs_is() -> None:
    assert _qn_adapted(_QnBlock()) is True  # a function of one module, as torch calls it
    _qn_chosen_by(_qn_adapted)


def test_a_reapply_over_moduledict_values_names_the_layer_by_its_key_and_its_tip_runs() -> None:
    class Stage(nn.Module):  # torchtitan's pipeline stage keeps the model's layer keys
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"4": nn.Linear(4, 4), "5": nn.Linear(4, 4)})

    stage = Stage()
    checkpoint_layers(stage.layers.values())
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers(stage.layers.values(), verify_replay=True)
    message = str(err.value)
    assert "'4'" in message, message  # the key the user knows the layer by
    assert "layers[0]" not in message, message  # stage.layers[0] is a KeyError


def test_a_reapply_over_a_layer_list_with_other_options_tip_runs_and_gives_eager_grads() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    twin = copy.deepcopy(layers)
    checkpoint_layers(layers)
    with pytest.raises(CheckpointConfigError, match=r"remove_activation_checkpointing\(layers\[0\]\)"):
        checkpoint_layers(layers, verify_replay=True)
    for layer in layers:  # the tip, for every layer
        pytree_ckpt.remove_activation_checkpointing(layer)
    assert checkpoint_layers(layers, verify_replay=True) == [0, 1, 2]
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, layers], x, seed=0))


def test_following_the_tip_to_reapply_other_options_to_several_checkpointed_layers_succeeds(
        ) -> None:
    # Mid-training, checkpointing is re-applied with other options (verify_replay turned on
    # to chase a mismatch): every layer is checkpointed, the tip names only layers[0], and
    # doing what it says raises the same error for layers[1] (then layers[2], ...).
    import re

    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    checkpoint_layers(layers)
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers(layers, verify_replay=True)
    removals = re.findall(r"remove_activation_checkpointing\(([^)]*)\)", str(err.value))
    assert removals
    for expression in removals:  # what the tip says, done as it says
        remove_activation_checkpointing(eval(expression, {"layers": layers, "layer": layers}))
    assert checkpoint_layers(layers, verify_replay=True) == [0, 1, 2]


def test_the_same_ratio_applied_twice_to_a_list_holding_a_layer_twice_gives_eager_grads() -> None:
    torch.manual_seed(0)
    shared, other = nn.Linear(4, 4), nn.Linear(4, 4)  # ALBERT-style: one layer called twice
    twin = nn.Sequential(copy.deepcopy(shared), copy.deepcopy(other))
    twin = nn.Sequential(twin[0], twin[1], twin[0])
    layers = [shared, other, shared]
    assert checkpoint_layers(layers, ratio=0.67) == [0, 1]
    assert checkpoint_layers(layers, ratio=0.67) == [0, 1]  # idempotent, as for distinct layers
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, nn.Sequential(*layers)], x, seed=0))


def test_a_reapply_over_a_slice_or_generator_names_each_layer_by_its_place_in_what_was_given(
        ) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    checkpoint_layers(model.children())
    with pytest.raises(CheckpointConfigError, match=r"layers\[1\] \(Tanh\) is checkpointed, "
                                                    r"but ratio=0.34"):
        checkpoint_layers((layer for layer in model), ratio=0.34)
    with pytest.raises(CheckpointConfigError, match=r"remove_activation_checkpointing\(layers\[0\]\)"):
        checkpoint_layers(model[1:], verify_replay=True)  # model[1:][0] is model[1]
    x = torch.randn(2, 4, requires_grad=True)
    assert_same_grads(*grads_per_model([twin, model], x, seed=0))


def test_moduledict_values_after_a_key_is_deleted_are_named_by_the_remaining_keys() -> None:
    layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 4)})
    checkpoint_layers(layers.values())
    del layers["a"]
    with pytest.raises(CheckpointConfigError, match=r"layers\['c'\] \(Linear\) is checkpointed"):
        checkpoint_layers(layers.values(), ratio=0.5)
    with pytest.raises(CheckpointConfigError,
                       match=r"remove_activation_checkpointing\(layers\['b'\]\)"):
        pytree_ckpt.apply_recompute_config(layers.values(), pytree_ckpt.RecomputeConfig(1.0), {},
                                           verify_replay=True)


# Helper QW: remove_activation_checkpointing on a model between a call's forward and its
# backward; the combined refusal's tips followed literally.


class _QwSub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _QwFunctional(nn.Module):
    """Not checkpointed itself: its forward checkpoints ``sub`` with the functional call."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = _QwSub()
        self.proj = nn.Linear(6, 6)
        self.eager = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sub(x) if self.eager else pytree_ckpt.checkpoint(self.sub, x)
        return x + h + self.proj(x)


def _qw_grads_with_hook(remove_between: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _QwFunctional()
    twin = copy.deepcopy(model)
    twin.eager = True
    x = torch.randn(4, 6)
    for net in (model, twin):
        kept: list[torch.Tensor] = []
        net.sub.lin.register_forward_hook(lambda _m, _i, out, kept=kept: kept.append(out))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = net(x)
        if remove_between and net is model:
            remove_activation_checkpointing(model)  # a no-op on its numbers: nothing wrapped
        (y.pow(2).sum() + sum(o.pow(2).sum() for o in kept)).backward()
    return [p.grad for p in model.parameters()], [p.grad for p in twin.parameters()]


def test_a_model_with_a_functional_checkpoint_and_a_hook_inside_gives_eager_grads() -> None:
    got, want = _qw_grads_with_hook(remove_between=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # beside the point
def test_removing_checkpointing_from_an_unwrapped_model_mid_step_keeps_a_functional_checkpoints_hooks(
) -> None:
    got, want = _qw_grads_with_hook(remove_between=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _QwLayer(nn.Module):
    """A layer whose inner submodule the removal tests hook."""

    def __init__(self, size: int = 6) -> None:
        super().__init__()
        self.inner = nn.Linear(size, size)
        self.lin = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.inner(x)))


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # beside the point
def test_removing_a_layer_with_a_hooked_submodule_between_forward_and_backward_gives_eager_grads(
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_QwLayer(), _QwLayer())
    twin = copy.deepcopy(model)
    for layer in model:
        apply_activation_checkpointing(layer)
    x = torch.randn(4, 6)
    losses = []
    for net in (model, twin):
        kept: list[torch.Tensor] = []
        net[0].inner.register_forward_hook(lambda _m, _i, out, kept=kept: kept.append(out))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = net(x)
        if net is model:
            remove_activation_checkpointing(model[0])   # checkpointing off mid-accumulation
        losses.append(y.pow(2).sum() + sum(o.pow(2).sum() for o in kept))
    losses[1].backward()
    losses[0].backward()
    assert_same_grads([p.grad for p in twin.parameters()], [p.grad for p in model.parameters()])


class _QwBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _QwStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_QwBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_following_the_check_fn_refusals_tip_on_a_checkpointed_model_then_applying_succeeds(
) -> None:
    torch.manual_seed(0)
    model = _QwStack()
    twin = copy.deepcopy(model)
    for layer in model.layers:
        apply_activation_checkpointing(layer)
    apply_activation_checkpointing(model)             # nested: the whole model too

    def check_fn(module: nn.Module) -> bool:
        return isinstance(module, _QwBlock)

    tip = "[remove_activation_checkpointing(m) for m in module.modules() if check_fn(m)]"
    with pytest.raises(CheckpointConfigError) as err:
        apply_activation_checkpointing(model, check_fn=check_fn, verify_replay=True)
    assert tip in str(err.value)
    [remove_activation_checkpointing(m) for m in model.modules() if check_fn(m)]  # the tip
    apply_activation_checkpointing(model, check_fn=check_fn, verify_replay=True)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    twin(x).sum().backward()
    assert_same_grads([p.grad for p in twin.parameters()], [p.grad for p in model.parameters()])


@pytest.mark.parametrize("count", [3, 5])
@pytest.mark.parametrize("as_dict", [False, True])
def test_following_the_combined_refusals_tip_literally_then_applying_gives_eager_grads(
        count: int, as_dict: bool) -> None:
    torch.manual_seed(0)
    blocks = [_QwBlock() for _ in range(count)]
    layers: Any = (nn.ModuleDict({f"k{i}": b for i, b in enumerate(blocks)}) if as_dict
                   else nn.ModuleList(blocks))
    twin = [copy.deepcopy(b) for b in blocks]
    given = (lambda: layers.values()) if as_dict else (lambda: layers)
    checkpoint_layers(given())
    with pytest.raises(CheckpointConfigError) as err:
        checkpoint_layers(given(), verify_replay=True)
    tip = str(err.value).split("tip: call ")[1].split(" first")[0]
    if count > 3:
        assert tip == "remove_activation_checkpointing(layer) for each layer given"
        for layer in given():
            remove_activation_checkpointing(layer)
    else:
        exec(tip.replace("), ", ")\n"),  # noqa: S102 - the tip's own code, literally
             {"remove_activation_checkpointing": remove_activation_checkpointing, "layers": layers})
    checkpoint_layers(given(), verify_replay=True)
    assert all(b.forward.options.verify_replay for b in blocks)
    x = torch.randn(3, 4)
    h, e = x, x
    for b, t in zip(blocks, twin):
        h, e = b(h), t(e)
    h.sum().backward()
    e.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for b, t in zip(blocks, twin)
               for p, q in zip(b.parameters(), t.parameters()))


def _qw_remove_inner_of_a_checkpointed_layer(mid_step: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_QwLayer(), _QwLayer())
    twin = copy.deepcopy(model)
    for layer in model:
        apply_activation_checkpointing(layer)
    kept: dict[int, list[torch.Tensor]] = {id(model): [], id(twin): []}
    for net in (model, twin):
        net[0].inner.register_forward_hook(lambda _m, _i, out, k=kept[id(net)]: k.append(out))
    for step in range(2):
        x = torch.randn(4, 6)
        losses = []
        for net in (model, twin):
            kept[id(net)].clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = net(x)
            if net is model and step == 0 and mid_step:
                remove_activation_checkpointing(model[0].inner)  # not checkpointed: layer stays
            losses.append(y.pow(2).sum() + sum(o.pow(2).sum() for o in kept[id(net)]))
        losses[1].backward()
        losses[0].backward()
        if step == 0 and not mid_step:
            remove_activation_checkpointing(model[0].inner)
        assert is_checkpointed(model[0])
        assert_same_grads([p.grad for p in twin.parameters()], [p.grad for p in model.parameters()])
        for p in (*model.parameters(), *twin.parameters()):
            p.grad = None


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # beside the point
def test_removing_from_an_unwrapped_submodule_of_a_checkpointed_layer_between_steps_gives_eager_grads(
) -> None:
    _qw_remove_inner_of_a_checkpointed_layer(mid_step=False)


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # beside the point
def test_removing_from_an_unwrapped_submodule_of_a_checkpointed_layer_mid_step_gives_eager_grads(
) -> None:
    _qw_remove_inner_of_a_checkpointed_layer(mid_step=True)


def test_the_combined_refusal_states_each_differing_layers_installed_options() -> None:
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    apply_activation_checkpointing(layers[0], verify_replay=True)
    apply_activation_checkpointing(layers[1], preserve_rng_state=False)
    with pytest.raises(CheckpointConfigError, match="preserve_rng_state, verify_replay differ") as err:
        checkpoint_layers(layers)
    installed = next(line for line in str(err.value).splitlines() if "as installed" in line)
    assert "preserve_rng_state=False" in installed    # what layers[1] holds


# Helper QX: regressions of 6127bf8 (the recorder left beside a user's forward hook on removal).


class _QxKeep:
    """A picklable forward hook keeping the outputs it receives (not pickled with them)."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.kept.append(output)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.kept = []


def _qx_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_QwLayer(4), _QwLayer(4))


def _qx_steps(model: nn.Module, keep: _QxKeep, x: torch.Tensor, steps: int = 3) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        keep.kept.clear()
        opt.zero_grad()
        loss = model(x).pow(2).sum() + sum(k.pow(2).sum() for k in keep.kept)
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return out


def _qx_same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(la, lb) and all(torch.equal(g, h) for g, h in zip(ga, gb))
        for (la, ga), (lb, gb) in zip(a, b))


def _qx_has_recorder(module: nn.Module) -> bool:
    from pytree_ckpt.hook_outputs import _record_output
    return any(hook is _record_output for hook in module._forward_hooks.values())


def _qx_unwrapped_beside_a_hook(x: torch.Tensor) -> tuple[nn.Module, _QxKeep, Any]:
    """A model whose inner module holds a user's forward hook, wrapped, stepped once, unwrapped:
    the model, the hook and its handle."""
    model, keep = _qx_model(), _QxKeep()
    handle = model[0].inner.register_forward_hook(keep)
    for layer in model:
        apply_activation_checkpointing(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).sum().backward()
    model.zero_grad()
    remove_activation_checkpointing(model)
    return model, keep, handle


def test_a_model_unwrapped_beside_a_users_hook_trains_pickles_and_unhooks_as_eager() -> None:
    x = torch.randn(3, 4)
    eager, keep_e = _qx_model(), _QxKeep()
    eager[0].inner.register_forward_hook(keep_e)
    model, keep, handle = _qx_unwrapped_beside_a_hook(x)
    assert _qx_has_recorder(model[0].inner)  # documented: it stays beside the user's hook
    with torch.no_grad():
        assert torch.equal(model(x), eager(x)) and torch.equal(keep.kept[-1], keep_e.kept[-1])
    copied = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    keep_l = next(h for h in loaded[0].inner._forward_hooks.values() if isinstance(h, _QxKeep))
    keep_c = next(h for h in copied[0].inner._forward_hooks.values() if isinstance(h, _QxKeep))
    want = _qx_steps(eager, keep_e, x)
    eager2, keep_e2 = _qx_model(), _QxKeep()
    eager2[0].inner.register_forward_hook(keep_e2)
    want2 = _qx_steps(eager2, keep_e2, x)
    assert _qx_same(want, _qx_steps(model, keep, x))
    assert _qx_same(want2, _qx_steps(loaded, keep_l, x))
    assert _qx_same(want2, _qx_steps(copied, keep_c, x))
    handle.remove()
    remove_activation_checkpointing(model)  # once the hook is gone, removal takes the recorder
    assert not _qx_has_recorder(model[0].inner)
    assert b"_record_output" not in pickle.dumps(model)


def test_a_model_unwrapped_beside_a_users_hook_compiles_fullgraph_as_eager() -> None:
    x = torch.randn(3, 4)
    model, keep, _ = _qx_unwrapped_beside_a_hook(x)
    eager, keep_e = _qx_model(), _QxKeep()
    eager[0].inner.register_forward_hook(keep_e)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (compiled(x).pow(2).sum() + keep.kept[-1].pow(2).sum()).backward()
    assert not [w for w in caught if "pytree_ckpt" in str(w.message)]
    (eager(x).pow(2).sum() + keep_e.kept[-1].pow(2).sum()).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_a_reapply_after_removal_beside_a_users_hook_installs_one_recorder_and_gives_eager_grads(
        ) -> None:
    x = torch.randn(3, 4)
    model, keep = _qx_model(), _QxKeep()
    model[0].inner.register_forward_hook(keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layer in model:
            apply_activation_checkpointing(layer)
        model(x).sum().backward()
        model.zero_grad()
        remove_activation_checkpointing(model)
        for layer in model:
            apply_activation_checkpointing(layer)
        eager, keep_e = _qx_model(), _QxKeep()
        eager[0].inner.register_forward_hook(keep_e)
        assert _qx_same(_qx_steps(eager, keep_e, x), _qx_steps(model, keep, x))
    from pytree_ckpt.hook_outputs import _record_output
    assert sum(h is _record_output for h in model[0].inner._forward_hooks.values()) == 1


@pytest.mark.filterwarnings("ignore:pytree_ckpt. forward hooks inside")  # beside the point
def test_removing_a_layer_whose_submodule_has_a_users_pre_hook_mid_step_gives_eager_grads(
        ) -> None:
    x = torch.randn(3, 4)

    def double(module: nn.Module, args: Any) -> Any:
        return (args[0] * 2,)

    eager = _qx_model()
    eager[0].inner.register_forward_pre_hook(double)
    eager(x).pow(2).sum().backward()
    model = _qx_model()
    model[0].inner.register_forward_pre_hook(double)
    for layer in model:
        apply_activation_checkpointing(layer)
    y = model(x)
    remove_activation_checkpointing(model)  # checkpointing off between forward and backward
    y.pow(2).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_a_prepended_hook_added_after_removal_then_reapplied_gives_eager_grads() -> None:
    x = torch.randn(3, 4)

    def reads(module: nn.Module, args: Any, output: Any) -> None:
        pass

    def stash(module: nn.Module, args: Any, output: Any) -> None:
        module.last = output

    def loss_of(model: nn.Module) -> torch.Tensor:
        return model(x).pow(2).sum() + model[0].inner.last.pow(2).sum()

    eager = _qx_model()
    eager[0].inner.register_forward_hook(reads)
    eager[0].inner.register_forward_hook(stash, prepend=True)
    loss_of(eager).backward()
    model = _qx_model()
    model[0].inner.register_forward_hook(reads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layer in model:
            apply_activation_checkpointing(layer)
        model(x).sum().backward()
        model.zero_grad()
        remove_activation_checkpointing(model)  # the recorder stays beside `reads`
        model[0].inner.register_forward_hook(stash, prepend=True)
        for layer in model:
            apply_activation_checkpointing(layer)
        loss_of(model).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_the_combined_refusal_shows_the_installed_value_of_each_differing_field() -> None:
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
    for layer in layers[:3]:
        apply_activation_checkpointing(layer, verify_replay=True)
    apply_activation_checkpointing(layers[3], preserve_rng_state=False)
    with pytest.raises(CheckpointConfigError) as info:
        checkpoint_layers(layers)
    assert "preserve_rng_state=False" in str(info.value)


def test_prepended_keeping_and_rewriting_hooks_added_after_removal_then_reapplied_give_eager_grads(
        ) -> None:
    x = torch.randn(3, 4)
    kept: list[torch.Tensor] = []

    def reads(module: nn.Module, args: Any, output: Any) -> None:
        pass

    def triple(module: nn.Module, args: Any, output: Any) -> Any:
        return output * 3

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        kept.append(output)

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        model = _qx_model()
        model[0].inner.register_forward_hook(reads)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if checkpointed:
                for layer in model:
                    apply_activation_checkpointing(layer)
                model(x).sum().backward()
                model.zero_grad()
                remove_activation_checkpointing(model)
            model[0].inner.register_forward_hook(triple, prepend=True)
            model[0].inner.register_forward_hook(keep, prepend=True)
            if checkpointed:
                for layer in model:
                    apply_activation_checkpointing(layer)
            kept.clear()
            (model(x).pow(2).sum() + sum(k.pow(2).sum() for k in kept)).backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


# Helper QZ: regressions of 1c5df22 (the recorder put first again at each call where a user's
# hook was prepended before it).


def _qz_hook_run(checkpointed: bool, kind: str, when: str) -> list[torch.Tensor]:
    """Two SGD steps of _qx_model with a user hook on model[0].inner; a hook prepended
    ``when``: between steps, between two micro-batches' forwards, or between a forward and its
    backward, the layers staying checkpointed throughout."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))

    def reads(module: nn.Module, args: Any, output: Any) -> None:
        pass

    def triple(module: nn.Module, args: Any, output: Any) -> Any:
        return output * 3

    def stash(module: nn.Module, args: Any, output: Any) -> None:
        module.last = output

    hook = {"rewrites": triple, "keeps": stash}[kind]
    model = _qx_model()
    inner = model[0].inner
    inner.register_forward_hook(reads)
    if checkpointed:
        for layer in model:
            apply_activation_checkpointing(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of() -> torch.Tensor:
        loss = model(x).pow(2).sum()
        return loss + inner.last.pow(2).sum() if hasattr(inner, "last") else loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.zero_grad()
        loss_of().backward()
        opt.step()
        opt.zero_grad()
        if when == "between steps":
            inner.register_forward_hook(hook, prepend=True)
            loss = loss_of()
        elif when == "between micro-batches":
            first = loss_of()
            inner.register_forward_hook(hook, prepend=True)
            loss = first + loss_of()
        else:  # between a forward and its backward
            loss = loss_of()
            inner.register_forward_hook(hook, prepend=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_of().backward()
    return [p.grad for p in model.parameters()] + [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("when", ["between steps", "between micro-batches",
                                  "between a forward and its backward"])
@pytest.mark.parametrize("kind", ["rewrites", "keeps"])
def test_a_hook_prepended_on_a_layer_that_stays_checkpointed_gives_eager_grads(
        kind: str, when: str) -> None:
    eager = _qz_hook_run(False, kind, when)
    assert all(torch.equal(a, b) for a, b in zip(_qz_hook_run(True, kind, when), eager))


def _qz_pre_hook(module: nn.Module, args: Any) -> None:
    """A picklable forward pre-hook of the user's that changes nothing."""


def test_a_model_unwrapped_beside_a_users_pre_hook_pickles_as_the_docs_say() -> None:
    model = _qx_model()
    model[0].inner.register_forward_pre_hook(_qz_pre_hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layer in model:
            apply_activation_checkpointing(layer)
        model(torch.randn(3, 4)).sum().backward()
        remove_activation_checkpointing(model)
    names_library = b"pytree_ckpt" in pickle.dumps(model)
    page = (Path(__file__).resolve().parents[2] / "docs" / "boundary.md").read_text()
    sentence = page[page.index("a pickle of the model loads without pytree-ckpt installed"):]
    sentence = " ".join(sentence[:sentence.index(").")].split())
    # boundary.md: "It leaves each layer as it was, with nothing of this library on it: a pickle
    # of the model loads without pytree-ckpt installed (a forward hook of yours still on a
    # submodule keeps the output recorder beside it, ...)": a pre-hook is not named.
    assert not names_library or "pre-hook" in sentence, sentence
