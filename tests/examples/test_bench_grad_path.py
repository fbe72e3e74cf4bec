"""The gradient-path comparison behind docs/benchmarks.md: every path computes eager's gradients.

No timing is asserted here: timing claims live in the script's output only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples import bench_grad_path


def test_every_gradient_path_gives_eager_gradients_and_is_timed_each_round() -> None:
    result = bench_grad_path.main(["--rounds", "2", "--warmup", "1"])
    assert result["grads_equal_eager"] == {path: True for path in bench_grad_path.PATHS}
    assert set(result["paths"]) == set(bench_grad_path.PATHS)
    for path, stats in result["paths"].items():
        assert len(stats["times_ms"]) == 2 and stats["median_ms"] > 0, path
    assert result["paths"][bench_grad_path.ACCUMULATE]["extra_us_per_layer"] == 0


def test_a_path_that_drops_parameter_gradients_is_caught_before_timing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The equality check is what makes the timings comparable: break one path and it must fail.
    backward = bench_grad_path._Replay.backward

    def dropping(ctx: Any, grad: torch.Tensor) -> Any:
        grads = backward(ctx, grad)
        if ctx.path == bench_grad_path.GRAD_RETURNED:
            return (*grads[:3], *[None] * (len(grads) - 3))
        return grads
    monkeypatch.setattr(bench_grad_path._Replay, "backward", staticmethod(dropping))
    result = bench_grad_path.main(["--rounds", "1", "--warmup", "0"])
    assert result["grads_equal_eager"][bench_grad_path.GRAD_RETURNED] is False
    assert "paths" not in result


def test_moe_layers_give_eager_gradients_on_every_path_and_none_for_unrouted_experts() -> None:
    # Experts no token reached get no gradient in eager: every path must leave them without
    # one too (a zero would count as a gradient and differ from eager's None).
    result = bench_grad_path.main(["--layer", "moe", "--rounds", "1", "--warmup", "0"])
    assert result["grads_equal_eager"] == {path: True for path in bench_grad_path.PATHS}
    bench = bench_grad_path.Bench("small", layer="moe")
    bench.step(bench_grad_path.PYTREE_CKPT)
    unrouted = [p for layer in bench.layers for p in layer.parameters() if p.grad is None]
    assert unrouted and all(isinstance(layer, bench_grad_path.MoEBlock) for layer in bench.layers)


def test_a_thread_count_below_one_is_a_usage_error_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    # It reached torch.set_num_threads and died in a traceback after the parse.
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as info:
        bench_grad_path.main(["--threads", "0", "--rounds", "1", "--warmup", "0"])
    assert info.value.code == 2 and "--threads must be >= 1, got 0" in capsys.readouterr().err
    assert torch.get_num_threads() == threads


def test_the_moe_layer_has_the_parameter_and_module_counts_the_benchmarks_page_gives() -> None:
    # Guards against the page's counts drifting from the layer (helper KN: it said 384 and 513,
    # the experts' alone; the block also holds a norm and a router and is a module itself).
    page = (Path(__file__).parents[2] / "docs" / "benchmarks.md").read_text()
    layer = bench_grad_path.MoEBlock(64)
    parameters, modules = len(list(layer.parameters())), len(list(layer.modules()))
    assert f"are {parameters} parameters per layer" in page
    assert f"the layer's {modules} modules" in page
    assert f"({parameters} parameters)" in Path(bench_grad_path.__file__).read_text()  # --help
