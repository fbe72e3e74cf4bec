"""Every ```python block in docs/ runs, in order, one namespace per page: docs cannot drift."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


LINK = re.compile(r"\]\(([^)#]+\.md)(#[^)]*)?\)")


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file() -> None:
    root = Path(__file__).resolve().parents[1]
    for page in [root / "README.md", *DOCS]:
        for target, _ in LINK.findall(page.read_text()):
            if "://" not in target:
                assert (page.parent / target).is_file(), f"{page.name} links to {target}"


def test_every_doc_page_has_runnable_examples() -> None:
    assert DOCS, "docs/ has no pages"
    assert all(BLOCK.search(page.read_text()) for page in DOCS)


@pytest.mark.parametrize("page", DOCS, ids=[p.stem for p in DOCS])
def test_doc_page_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real module, so dataclasses and pickling defined in a page resolve their module.
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for number, match in enumerate(BLOCK.finditer(page.read_text()), 1):
        line = page.read_text()[: match.start()].count("\n") + 2
        code = compile("\n" * (line - 1) + match.group(1), str(page), "exec")
        try:
            exec(code, namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block #{number} (line {line}) failed: {err!r}") from err


def test_every_name_the_readme_uses_exists_in_the_public_api() -> None:
    # The README's usage sketch needs a model to run (docs/ has the runnable versions); its
    # names must still be real: every `pytree_ckpt.x` / `offload.x`, and every backticked
    # call in the usage section.
    import offload
    import pytree_ckpt

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    packages = {"pytree_ckpt": pytree_ckpt, "offload": offload}
    dotted = re.findall(r"(?<!/)\b(pytree_ckpt|offload)\.([A-Za-z_]\w*)\b(?!\.md)", text)
    usage = text[text.index("## Usage"):]
    called = re.findall(r"`([A-Za-z_]\w*)\(", usage)
    assert dotted and called
    for package, name in dotted:
        assert name in packages[package].__all__, f"README: {package}.{name}"
    for name in called:
        assert name in pytree_ckpt.__all__, f"README: {name}(...)"
