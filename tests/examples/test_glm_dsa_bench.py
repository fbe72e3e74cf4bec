"""The GLM-DSA benchmark at its tiny preset: every row, exactness, FLOP accounting, outputs.

One run (module-scoped) serves every test; nothing here looks at timings, which a shared CI
machine cannot promise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.glm_dsa import bench
from examples.glm_dsa.bench_configs import CONFIGS
from examples.glm_dsa.kernels import indexer_topk_flops, sparse_attention_flops

# Output discard sums a block input's gradient in another order (pytree_ckpt/discard.py NOTE
# [exactness]): its row is loss-equal, and grads-equal only up to rounding, so it is not here.
PYTREE_ROWS = ("pytree_reuse_off", "pytree_reuse_on", "pytree_offload", "pytree_save_attn",
               "pytree_save_indexer", "pytree_save_gate", "pytree_save_dispatch")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bench.main(["--preset", "tiny", "--device", "cpu", "--out", str(out),
                              "--rounds", "2", "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    return results, out


def test_every_configuration_has_a_row_and_only_cuda_ones_are_skipped_on_cpu(
        run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    rows = results["configs"]
    assert list(rows) == [config.key for config in CONFIGS]
    for config in CONFIGS:
        expected = "skipped" if config.cuda_only else "ok"
        assert rows[config.key]["status"] == expected, (config.key, rows[config.key]["note"])
        assert f"| {config.label} |" in results["table_markdown"]
    assert "save_on_cpu" in rows and "CUDA only" in rows["save_on_cpu"]["note"]


def test_every_pytree_ckpt_configuration_matches_eager_bit_for_bit(
        run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    for key in PYTREE_ROWS:
        equality = rows[key]["equality"]
        assert equality["loss_equal"] is True, key
        assert equality["grads_equal"] is True, (key, equality["grads_differing"])
        assert equality["grads_compared"] > 0
    assert run[0]["eager_repeat"]["grads_equal"] is True


def test_reuse_saves_exactly_the_indexer_forward_flops(run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    rows, check = results["configs"], results["indexer_check"]
    off, on = rows["pytree_reuse_off"], rows["pytree_reuse_on"]
    assert check["indexer_forward_flops"] > 0
    assert off["recompute_flops"] - on["recompute_flops"] == check["indexer_forward_flops"]
    assert check["match"] is True and check["recompute_drop"] == check["indexer_forward_flops"]
    # Replay never reruns an indexer; reuse off reruns each computing call exactly once.
    assert on["indexer_flops_recomputed"] == 0
    assert off["indexer_flops_recomputed"] == check["indexer_forward_flops"]
    assert check["indexer_calls"] == 5  # layers 0, 1, 2, 6 and MTP depth 1 compute top-k


def test_indexer_flops_follow_the_documented_formula(run: tuple[dict[str, Any], Path]) -> None:
    results, _ = run
    model = results["preset"]["model"]
    tokens = results["preset"]["tokens"]
    heads, dim, hidden = model["index_n_heads"], model["index_head_dim"], model["hidden_size"]
    # Per call: wq (q_lora -> H*d), wk (hidden -> d), weights_proj (hidden -> H), then top-k.
    projections = 2 * tokens * (model["q_lora_rank"] * heads * dim + hidden * dim + hidden * heads)
    per_call = projections + indexer_topk_flops((tokens, heads, dim), (tokens, dim))
    assert results["indexer_check"]["indexer_forward_flops"] == 5 * per_call
    assert sparse_attention_flops((4, 2, 3), (4, 2, 5), (4, 7)) == 2 * 4 * 2 * 7 * (3 + 5)


def test_checkpointed_pytree_ckpt_rows_hold_fewer_activation_bytes_than_eager(
        run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    eager = rows["eager"]["census"]["total_bytes"]
    for key in PYTREE_ROWS:
        assert 0 < rows[key]["census"]["total_bytes"] < eager, key


def test_offload_moves_the_boundary_inputs_to_host(run: tuple[dict[str, Any], Path]) -> None:
    rows = run[0]["configs"]
    offload = rows["pytree_offload"]["census"]["by_mechanism"]
    replay = rows["pytree_reuse_on"]["census"]["by_mechanism"]
    assert offload.get("offloaded to host", 0) > 0
    assert offload.get("checkpoint boundary", 0) < replay["checkpoint boundary"]
    stats = rows["pytree_offload"]["offload_stats"]
    assert stats and all(s["offloaded_bytes"] == s["restored_bytes"] > 0 for s in stats)


def test_table_and_results_json_are_written_and_match_the_returned_dict(
        run: tuple[dict[str, Any], Path]) -> None:
    results, out = run
    table = (out / "table.md").read_text()
    assert table == results["table_markdown"]
    assert table.startswith("| config | activation bytes after forward |")
    loaded = json.loads((out / "results.json").read_text())
    assert loaded == json.loads(json.dumps(results))
    assert loaded["outputs"]["results"] == str(out / "results.json")
    for key, row in loaded["configs"].items():
        if row["status"] == "ok":
            assert len(row["step_times_ms"]) == 2, key
            assert row["flops"]["total"] == results["configs"][key]["flops"]["total"]


def test_gpu_presets_refuse_to_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--preset", "gpu-small", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_the_table_still_renders_when_a_configuration_the_indexer_check_needs_failed(
        run: tuple[dict[str, Any], Path]) -> None:
    # A first CUDA run may fail a row; the table (and results.json after it) must survive.
    results = json.loads(json.dumps(run[0]))
    results["configs"]["pytree_reuse_on"].update(status="error", note="step 1 failed: boom")
    results["indexer_check"].update(recompute_drop=None, match=False)
    table = bench.markdown_table(results)
    assert "n/a (a configuration it needs failed)" in table and "NO MATCH" in table
    assert "step 1 failed: boom" in table
