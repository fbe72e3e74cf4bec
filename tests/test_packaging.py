"""The packaging and set-up that issue 2 asks for, read from the files themselves (helper JR)."""

from __future__ import annotations

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 has no TOML reader

ROOT = pathlib.Path(__file__).parents[1]


def test_both_import_packages_are_declared_and_ship_their_py_typed_marker() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "pytree-ckpt"
    assert project["project"]["requires-python"] == ">=3.10"
    deps = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in project["project"]["dependencies"]}
    assert {"torch", "optree"} <= deps
    setuptools = project["tool"]["setuptools"]
    assert set(setuptools["packages"]) == {"pytree_ckpt", "offload"}
    for package in ("pytree_ckpt", "offload"):
        # PEP 561: without the marker in the wheel, type checkers ignore the inline annotations.
        assert "py.typed" in setuptools["package-data"][package]
        assert (ROOT / package / "py.typed").is_file()


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in first_block.strip().splitlines()]
    assert commands[:2] == ["./dev demo", "./dev test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./dev test$", ci, re.M)
