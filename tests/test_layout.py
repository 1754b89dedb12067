"""The repository layout, and the one-way dependency minirad -> (events) -> viz."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_layout() -> None:
    for name in ("notebooks", "minirad", "viz", "data", "tests"):
        assert (ROOT / name).is_dir(), name
    for name in ("environment.yml", "README.md", "pyproject.toml", "Makefile", ".ci/run"):
        assert (ROOT / name).is_file(), name


def test_minirad_never_imports_viz() -> None:
    offenders = []
    for path in (ROOT / "minirad").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "viz"]
    assert offenders == []


def test_readme_starts_with_the_two_commands() -> None:
    head = (ROOT / "README.md").read_text().split("## ")[0]
    assert "make lab" in head and "make test" in head
