"""A trained model shipped: torch.export, torch.jit and ONNX of models with checkpointed layers.

Each either works (the twin's program and outputs) or is refused naming the fix
(remove_activation_checkpointing first); a raw internal error is not either.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import KeptCallables, RecomputeConfig, SaveUnit, apply_recompute_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.project(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = Proj()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.p(x))


def twin_and_model() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(8, 8), Layer(), nn.Linear(8, 2))
    return twin, copy.deepcopy(twin)


def call_targets(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_exporting_a_model_with_a_kept_callable_save_unit_gives_the_twins_program() -> None:
    twin, model = twin_and_model()
    apply_recompute_config([model[1]], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("Proj.project")})
    x = torch.randn(2, 8)
    model(x).sum().backward()  # trained
    twin.eval()
    model.eval()
    expected = torch.export.export(twin, (x,))
    program = torch.export.export(model, (x,))
    assert call_targets(program) == call_targets(expected)
    assert torch.equal(program.module()(x), twin(x))


def test_exporting_a_checkpointed_module_itself_gives_the_twins_program() -> None:
    twin, model = twin_and_model()
    pytree_ckpt.apply_activation_checkpointing(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = torch.export.export(twin, (x,))
        program = torch.export.export(model, (x,))
    assert call_targets(program) == call_targets(expected)
    assert torch.equal(program.module()(x), twin(x))


# torch 2.14 warns that torch.jit is deprecated (FutureWarning); shipping through it is tested
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace_method` is deprecated")
def test_jit_trace_of_a_model_with_a_checkpointed_layer_gives_the_twins_outputs() -> None:
    twin, model = twin_and_model()
    pytree_ckpt.apply_activation_checkpointing(model[1])
    x = torch.randn(2, 8)
    traced = torch.jit.trace(model, (x,))
    assert torch.equal(traced(x), twin(x))
    assert str(traced.graph).count("aten::linear") == \
        str(torch.jit.trace(twin, (x,)).graph).count("aten::linear")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_jit_script_of_a_model_with_a_checkpointed_layer_works_or_names_the_fix() -> None:
    twin, model = twin_and_model()
    pytree_ckpt.apply_activation_checkpointing(model[1])
    x = torch.randn(2, 8)
    try:
        scripted = torch.jit.script(model)
    except Exception as error:  # a refusal is fine if it names the layer and the fix
        assert "the forward of this Layer is checkpointed" in str(error), repr(error)
        assert "remove_activation_checkpointing(m)" in str(error), repr(error)
    else:
        assert torch.equal(scripted(x), twin(x))


def test_strict_export_of_a_model_with_a_checkpointed_layer_works_or_names_the_fix() -> None:
    twin, model = twin_and_model()
    pytree_ckpt.apply_activation_checkpointing(model[1])
    x = torch.randn(2, 8)
    with torch.no_grad():
        try:
            program = torch.export.export(model, (x,), strict=True)
        except Exception as error:
            assert "remove_activation_checkpointing" in str(error), str(error)[:300]
        else:
            assert torch.equal(program.module()(x), twin(x))


def test_exporting_a_model_with_an_offloading_layer_opens_no_window_and_warns_of_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    twin, model = twin_and_model()
    manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    pytree_ckpt.apply_activation_checkpointing(model[1], offload=manager)
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING):
        program = torch.export.export(model, (x,))
    assert torch.equal(program.module()(x), twin(x))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("offload")] == []
    assert manager.stats()["windows"] == 0
