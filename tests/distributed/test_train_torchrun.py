"""``examples/glm_dsa/train.py`` under torchrun: FSDP2, compiled bodies and offload together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, make_packed_batch, train

from .launch import run_torchrun

TIMEOUT_S = 240.0  # ~15 s on an idle 2-core machine


@pytest.mark.distributed
def test_train_py_under_torchrun_with_fsdp_moe_compile_and_offload_prints_mean_eager_loss(
        tmp_path: Path) -> None:
    # MoE: its router's expert choice goes through reuse_during_recompute inside a compiled body.
    run = run_torchrun(["-m", "examples.glm_dsa.train", "--fsdp", "--moe", "--compile",
                        "--compile-backend", "eager", "--offload", "--steps", "2", "--seed", "3"],
                       2, timeout=TIMEOUT_S, log_dir=tmp_path)
    output = run.output()
    assert run.ok, output
    lines = output.splitlines()
    assert any("; 2 ranks (gloo, FSDP2)" in line for line in lines), output
    steps = [line.split() for line in lines if line.startswith("step ")]
    assert [s[:2] for s in steps] == [["step", "1"], ["step", "2"]], output  # rank 0 only
    assert sum("offload:" in line for line in lines) == 2
    # Rank r trains on make_packed_batch(seed=3 + r); the script prints the mean over ranks.
    config = GlmDsaConfig(moe=True)
    torch.manual_seed(3)
    model = GlmDsaForCausalLM(config)
    with torch.no_grad():
        losses = [model(**make_packed_batch(config, seed=3 + rank))["loss"] for rank in (0, 1)]
    assert steps[0][3] == f"{((losses[0] + losses[1]) / 2).item():.6f}"
    assert float(steps[1][3]) < float(steps[0][3])  # the parameters moved


def test_train_py_refuses_to_shard_without_torchrun_and_to_train_copies_under_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        train.parse_args(["--fsdp"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.parse_args([])  # two ranks each training its own copy: refused
    assert train.parse_args(["--ddp"]).ddp
