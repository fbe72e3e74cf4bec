"""The typed public API as a user's type checker sees it: ``mypy --strict`` on user code written
the way docs/*.md writes it (helper LJ). Skipped where mypy is not installed (`.[dev]` installs it).

One mypy run checks every snippet (a file each); its cache lives in the system temp folder, so
only the first run on a machine pays for reading torch's annotations (about half a minute).
"""

from __future__ import annotations

import re
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SNIPPETS = {
    # The control: what the checker must see for the API's context managers and functions
    # that are typed well; it also proves that mypy resolved this checkout's packages.
    "control": """
        import torch
        from torch import nn

        import offload
        import pytree_ckpt

        def mlp(x: torch.Tensor, *, scale: float) -> torch.Tensor:
            return torch.tanh(x) * scale

        model = nn.Sequential(nn.Linear(8, 8))
        manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
        with pytree_ckpt.ActivationCensus(model) as census:
            reveal_type(census)
        with manager.window([torch.randn(2)]) as window:
            reveal_type(window)
        reveal_type(pytree_ckpt.checkpoint(mlp, torch.randn(2), scale=2.0))
        reveal_type(pytree_ckpt.reuse_during_recompute(mlp, torch.randn(2), scale=2.0))
        reveal_type(pytree_ckpt.current_phase())
        reveal_type(pytree_ckpt.build_residual_stream_recompute_plan(4, 2)[0].checkpoint(
            mlp, torch.randn(2), scale=1.0))
    """,
    # docs/replay.md and docs/limits.md: `ckpt_router = apply_activation_checkpointing(
    # copy.deepcopy(eager_router))`, then `ckpt_router.e_score_correction_bias`.
    "same_module_back": """
        import copy

        from torch import nn

        import pytree_ckpt

        class Router(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj = nn.Linear(8, 4)

        eager_router = Router()
        ckpt_router = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager_router))
        proj: nn.Linear = ckpt_router.proj
        for router in (eager_router, ckpt_router):
            router.zero_grad()
        plain = pytree_ckpt.remove_activation_checkpointing(ckpt_router)
        also: nn.Linear = plain.proj
    """,
    # docs/boundary.md: `pytree_ckpt.checkpointed(layer, offload=manager)(batches, scale=scale)`.
    "checkpointed_signature": """
        import torch

        import pytree_ckpt

        def mlp(x: torch.Tensor, *, scale: float) -> torch.Tensor:
            return torch.tanh(x) * scale

        wrapped = pytree_ckpt.checkpointed(mlp, verify_replay=True)
        wrapped("not a tensor", scale="not a float")  # WRONG ARGUMENTS
        wrapped(torch.randn(2), scale=2.0)
    """,
    # docs/discard.md: `normed = ckpt.checkpoint(norm, x)`, here with a typed function.
    "discard_return_type": """
        import torch

        from pytree_ckpt import CheckpointWithoutOutput, CheckpointWithoutOutputManager

        def norm(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.layer_norm(x, (64,))

        def normed(x: torch.Tensor) -> torch.Tensor:
            return CheckpointWithoutOutput().checkpoint(norm, x)

        def normed_in_a_block(x: torch.Tensor) -> torch.Tensor:
            return CheckpointWithoutOutputManager().checkpoint(norm, x)
    """,
    # docs/save_units.md: `targets = {SaveUnit.ATTN: KeptOps(...), SaveUnit.MOE_GATE:
    # KeptCallables("Router.forward")}`, then `apply_recompute_config(kept, RecomputeConfig(...),
    # targets)`.
    "targets_map": """
        from torch import nn

        from pytree_ckpt import (KeptCallables, KeptOps, RecomputeConfig, SaveUnit,
                                 apply_recompute_config)

        targets = {
            SaveUnit.ATTN: KeptOps("aten::_scaled_dot_product_flash_attention_for_cpu"),
            SaveUnit.MOE_GATE: KeptCallables("Router.forward"),
        }
        kept = nn.Sequential(nn.Linear(8, 8))
        chosen = apply_recompute_config(kept, RecomputeConfig(1.0, save=["attn", "moe_gate"]),
                                        targets)
        by_name = {"attn": KeptOps("aten::mm")}  # a unit's name as the key
        apply_recompute_config(kept, RecomputeConfig(1.0, save=["attn"]), by_name)
    """,
    # docs/limits.md's fix for a lambda made in a loop: `checkpoint(lambda t, layer=layer:
    # layer(t), h)` (`lambda t, i=i: layers[i](t)`), and its `lambda h, m=block: m(h)`.
    "lambda_with_a_default": """
        import torch
        from torch import nn

        import pytree_ckpt

        def run(h: torch.Tensor, layers: nn.ModuleList) -> torch.Tensor:
            for i, layer in enumerate(layers):
                h = pytree_ckpt.checkpoint(lambda t, layer=layer: layer(t).tanh(), h)
                h = pytree_ckpt.checkpoint(lambda t, i=i: layers[i](t).tanh(), h)
                ids = pytree_ckpt.reuse_during_recompute(lambda t, k=i + 1: t.topk(k).indices, h)
                h = pytree_ckpt.CheckpointWithoutOutput().checkpoint(
                    lambda t, layer=layer: layer(t), h) + ids.float().mean()
            return h
    """,
    # docs/save_units.md: `assert cfg.save == (SaveUnit.ATTN, SaveUnit.MOE_GATE)`: the stored
    # field is a tuple of units, so a user reads `.value` off each (helper RL).
    "recompute_config_save": """
        from pytree_ckpt import RecomputeConfig, SaveUnit

        cfg = RecomputeConfig(0.5, save=["attn", "moe_gate"])
        assert cfg.save == (SaveUnit.ATTN, SaveUnit.MOE_GATE)

        def kept_names(config: RecomputeConfig) -> list[str]:
            if config.save is None or isinstance(config.save, bool):
                return []
            return [unit.value for unit in config.save]
    """,
    # docs/offload.md, "the window rule": `manager.offload_into(window, tensor)` returns an
    # opaque handle, `manager.restore(handle)` takes it back; the tensor itself is refused.
    "offload_handle": """
        import torch

        import offload

        manager = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
        t = torch.randn(2)
        with manager.window([t]) as window:
            handle = manager.offload_into(window, t)
        back: torch.Tensor = manager.restore(handle)
        manager.restore(t)  # WRONG ARGUMENTS
    """,
    # docs/census.md: `census.flagged()` lists storages; each row has fixed keys.
    "census_flagged": """
        import pytree_ckpt

        with pytree_ckpt.ActivationCensus() as census:
            pass
        for row in census.flagged():
            reveal_type(row["bytes"])
            reveal_type(row["module"])
    """,
    # The rest of both packages' __all__, used as README.md and docs/*.md write it, with
    # precise annotations (helper RL): every name type-checks, none of these values is Any.
    "whole_api": """
        import json

        import torch
        from torch import nn

        import offload
        import pytree_ckpt
        from offload import (HostPool, OffloadConfig, OffloadManager, Window, default_manager,
                             env_flag, size_class)
        from pytree_ckpt import (CheckpointConfigError, CheckpointError, KeptCallables, KeptOps,
                                 Mechanism, Phase, RecomputeConfig, RecomputeTarget,
                                 RecomputeTargetMap, ReplayMismatchError,
                                 ResidualStreamRecomputeContext, ReuseError, SaveUnit,
                                 SavedTensorChanged)

        class Layer(nn.Module):
            def indexer(self, x: torch.Tensor, k: int) -> torch.Tensor:
                return x.topk(k).indices

        config = OffloadConfig(min_bytes=1024, prefetch=1)
        sizes: tuple[int, int, bool | None] = (config.min_bytes, config.prefetch,
                                               config.pin_memory)
        manager: OffloadManager = OffloadManager(config, device="cpu")
        stats: dict[str, float] = manager.stats(reset=True)
        events: list[tuple[str, int]] = manager.events()
        default: OffloadManager = default_manager()
        flag: bool = env_flag("XTUNER_ACTIVATION_OFFLOAD")
        sized: int = size_class(4097, pinned=True)
        pool: HostPool = manager.pool
        pool.reserve([4096])
        with manager.window([torch.randn(2)]) as window:
            w: Window = window
            described: str = window.describe(("x", 0))
        resolved: OffloadManager | None = pytree_ckpt.resolve_offload(True)

        layers = nn.ModuleList(Layer() for _ in range(4))
        chosen: list[int] = pytree_ckpt.checkpoint_layers(layers, ratio=1.0, offload=manager,
                                                          verify_replay=True)
        one: Layer = pytree_ckpt.apply_activation_checkpointing(
            Layer(), offload=manager, check_fn=lambda m: isinstance(m, nn.Linear))
        wrapped: bool = pytree_ckpt.is_checkpointed(layers[0])
        phase: Phase = pytree_ckpt.current_phase()
        plain: bool = phase == "plain"

        cfg = RecomputeConfig(0.5, save=["attn", SaveUnit.MOE_GATE])
        again: RecomputeConfig = RecomputeConfig.from_json(cfg.to_json())
        targets: dict[SaveUnit, RecomputeTarget] = {SaveUnit.ATTN: KeptOps("aten::mm"),
                                                   SaveUnit.MOE_GATE: KeptCallables(Layer.indexer)}
        read_only: RecomputeTargetMap = targets
        kept: list[int] = pytree_ckpt.apply_recompute_config(layers, cfg, targets, offload=manager)

        plan: list[ResidualStreamRecomputeContext] = (
            pytree_ckpt.build_residual_stream_recompute_plan(4, 3, atomic_layer_pairs=[(0, 1)]))
        fields: tuple[int, int, bool] = (plan[0].layer_index, plan[0].block_index,
                                         plan[0].is_block_end)
        block: pytree_ckpt.CheckpointWithoutOutputManager = plan[0].manager
        with pytree_ckpt.detect_discarded_reads():
            pass

        with pytree_ckpt.ActivationCensus(layers) as census:
            pass
        report: str = census.report()
        by_module: dict[str, int] = census.bytes_by("module")
        held: tuple[int, int] = (census.total_bytes, census.discarded_bytes)
        data = json.dumps(census.to_dict())
        mechanism: str = Mechanism.AUTOGRAD.value

        error: CheckpointError = CheckpointConfigError("bad")
        also: ValueError = CheckpointConfigError("bad")
        for kind in (ReplayMismatchError, ReuseError):
            error = kind("what")
        try:
            pass
        except SavedTensorChanged as changed:
            versions: tuple[int, int] = (changed.saved_version, changed.version)
    """,
}


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mypy --strict's lines for each snippet, as ``<line>: <severity>: <message>``."""
    api = pytest.importorskip("mypy.api")
    folder = tmp_path_factory.mktemp("typed_user_code")
    for name, code in SNIPPETS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(code).lstrip())
    # mypy_path: this checkout's packages, ahead of any installed copy.
    # silent: the packages' own code is not what is checked here, only what users see of it.
    (folder / "mypy.ini").write_text(f"[mypy]\nmypy_path = {ROOT}\n\n"
                                     "[mypy-pytree_ckpt,pytree_ckpt.*,offload,offload.*]\n"
                                     "follow_imports = silent\n")
    cache = Path(tempfile.gettempdir()) / "pytree_ckpt_mypy_cache"
    out, err, status = api.run(["--strict", "--config-file", str(folder / "mypy.ini"),
                                "--cache-dir", str(cache), "--no-error-summary",
                                "--show-absolute-path",
                                *(str(folder / f"{name}.py") for name in SNIPPETS)])
    assert status in (0, 1), (out, err)
    report: dict[str, list[str]] = {name: [] for name in SNIPPETS}
    for line in out.splitlines():
        match = re.match(r"(.*?)\.py:(\d+): (.*)", line)
        assert match, line
        report[Path(match.group(1)).name].append(f"{match.group(2)}: {match.group(3)}")
    return report


def _errors(lines: list[str]) -> list[str]:
    return [line for line in lines if ": error: " in line]


def test_mypy_strict_sees_the_typed_values_of_the_api_context_managers_and_functions(
        mypy_report: dict[str, list[str]]) -> None:
    lines = mypy_report["control"]
    assert not _errors(lines), lines
    revealed = [line.split('Revealed type is ', 1)[1] for line in lines if "Revealed" in line]
    assert revealed == ['"pytree_ckpt.census.ActivationCensus"', '"offload.window.Window"',
                        '"torch._tensor.Tensor"', '"torch._tensor.Tensor"',
                        '"pytree_ckpt.phase.Phase"', '"torch._tensor.Tensor"'], lines


def test_apply_and_remove_activation_checkpointing_keep_the_type_of_the_module_they_return(
        mypy_report: dict[str, list[str]]) -> None:
    # Guards against (helper LJ) both typed -> nn.Module: the docs' `ckpt_router.proj` and a
    # loop over the eager and checkpointed twins failed --strict.
    assert not _errors(mypy_report["same_module_back"]), mypy_report["same_module_back"]


def test_checkpointed_keeps_the_parameters_of_the_function_it_wraps_for_a_type_checker(
        mypy_report: dict[str, list[str]]) -> None:
    # Guards against (helper LJ) Callable[..., T] in and out: checkpointed(fn) took any
    # arguments. (checkpoint, reuse_during_recompute and the discards' checkpoint take fn's
    # arguments untyped: a ParamSpec there made mypy refuse a lambda with defaults, the form
    # docs/limits.md gives: helper LN, the snippet "lambda_with_a_default".)
    lines = mypy_report["checkpointed_signature"]
    code = textwrap.dedent(SNIPPETS["checkpointed_signature"]).lstrip().splitlines()
    wrong = [i for i, line in enumerate(code, 1) if "WRONG ARGUMENTS" in line]
    flagged = sorted({int(line.split(":", 1)[0]) for line in _errors(lines)})
    assert len(wrong) == 1 and flagged == wrong, lines


def test_output_discard_checkpoint_returns_the_type_of_what_fn_returns(
        mypy_report: dict[str, list[str]]) -> None:
    # Guards against (helper LJ) both discards' checkpoint typed -> Any (no-any-return).
    assert not _errors(mypy_report["discard_return_type"]), mypy_report["discard_return_type"]


def test_the_targets_dict_the_save_units_page_builds_type_checks_as_a_recompute_target_map(
        mypy_report: dict[str, list[str]]) -> None:
    # Guards against (helper LJ) KeptOps and KeptCallables sharing no base: a dict of both was
    # a dict of object, not a RecomputeTargetMap; and a map keyed by units' names.
    assert not _errors(mypy_report["targets_map"]), mypy_report["targets_map"]


def test_the_lambda_with_a_default_docs_limits_recommends_type_checks_with_checkpoint(
        mypy_report: dict[str, list[str]]) -> None:
    # Guards against (helper LN) a2d7653's Callable[P, T] for checkpoint's fn (and
    # reuse_during_recompute's, the discards'): mypy --strict (and plain mypy) said 'Cannot
    # infer type of lambda' for each, where Callable[..., T] takes them.
    assert not _errors(mypy_report["lambda_with_a_default"]), mypy_report["lambda_with_a_default"]


def _flagged_wrong_lines(report: dict[str, list[str]], snippet: str) -> tuple[list[int], list[int]]:
    code = textwrap.dedent(SNIPPETS[snippet]).lstrip().splitlines()
    wrong = [i for i, line in enumerate(code, 1) if "WRONG ARGUMENTS" in line]
    flagged = sorted({int(line.split(":", 1)[0]) for line in _errors(report[snippet])})
    return wrong, flagged


def test_recompute_config_save_reads_back_as_the_tuple_of_save_units_the_docs_compare_it_with(
        mypy_report: dict[str, list[str]]) -> None:
    # docs/save_units.md asserts cfg.save == (SaveUnit.ATTN, SaveUnit.MOE_GATE), and
    # __post_init__ stores tuple(SaveUnit); --strict refuses `unit.value` on the read
    # ('Item "str" of "SaveUnit | str" has no attribute "value"').
    assert not _errors(mypy_report["recompute_config_save"]), mypy_report["recompute_config_save"]


def test_offload_restore_takes_only_the_handle_offload_into_returns_for_a_type_checker(
        mypy_report: dict[str, list[str]]) -> None:
    wrong, flagged = _flagged_wrong_lines(mypy_report, "offload_handle")
    assert len(wrong) == 1 and flagged == wrong, mypy_report["offload_handle"]


def test_census_flagged_rows_have_typed_fields(mypy_report: dict[str, list[str]]) -> None:
    lines = mypy_report["census_flagged"]
    revealed = [line.split("Revealed type is ", 1)[1] for line in lines if "Revealed" in line]
    assert len(revealed) == 2 and '"Any"' not in revealed, lines


def test_every_public_name_of_both_packages_type_checks_as_the_docs_use_it(
        mypy_report: dict[str, list[str]]) -> None:
    assert not _errors(mypy_report["whole_api"]), mypy_report["whole_api"]


def test_the_public_entry_points_take_their_subject_by_position_and_options_by_keyword() -> None:
    import inspect

    import offload
    import pytree_ckpt

    primary = {pytree_ckpt.checkpoint: "fn", pytree_ckpt.checkpointed: "fn",
               pytree_ckpt.reuse_during_recompute: "fn",
               pytree_ckpt.apply_activation_checkpointing: "module",
               pytree_ckpt.remove_activation_checkpointing: "module",
               pytree_ckpt.checkpoint_layers: "layers", pytree_ckpt.is_checkpointed: "module",
               pytree_ckpt.resolve_offload: "offload", offload.env_flag: "name",
               offload.size_class: "nbytes"}
    for function, name in primary.items():
        first = next(iter(inspect.signature(function).parameters.values()))
        assert (first.name, first.kind) == (name, inspect.Parameter.POSITIONAL_ONLY), function
    options = {pytree_ckpt.checkpointed: ["preserve_rng_state", "offload", "verify_replay"],
               pytree_ckpt.apply_activation_checkpointing: ["preserve_rng_state", "offload",
                                                            "verify_replay", "check_fn"],
               pytree_ckpt.checkpoint_layers: ["ratio", "preserve_rng_state", "offload",
                                               "verify_replay"],
               pytree_ckpt.apply_recompute_config: ["preserve_rng_state", "offload",
                                                    "verify_replay"],
               pytree_ckpt.build_residual_stream_recompute_plan: ["atomic_layer_pairs",
                                                                  "verify_replay"],
               pytree_ckpt.RecomputeConfig: ["save"], offload.OffloadConfig: ["min_bytes",
                                                                              "prefetch",
                                                                              "pin_memory"],
               offload.OffloadManager: ["device"], offload.size_class: ["pinned"],
               pytree_ckpt.CheckpointWithoutOutputManager: ["preserve_rng_state",
                                                            "verify_replay"]}
    for function, names in options.items():
        parameters = inspect.signature(function).parameters
        assert all(parameters[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names), function
    # every __all__ name is importable from its package
    for package in (pytree_ckpt, offload):
        for name in package.__all__:
            assert getattr(package, name) is not None
