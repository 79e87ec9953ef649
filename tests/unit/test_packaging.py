"""The package's metadata: the version in one place, and the data files the wheel must carry.

``.ci/run`` builds the wheel and sdist and runs them from a fresh venv; these checks are the cheap half.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import encgraph

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_version_lives_in_the_package_only() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "encgraph.__version__"}
    # setuptools reads it without importing the package: a plain string assignment.
    tree = ast.parse((ROOT / "encgraph" / "__init__.py").read_text(encoding="utf-8"))
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["__version__"]]
    assert isinstance(value, ast.Constant) and value.value == encgraph.__version__


def test_the_changelog_names_the_version() -> None:
    assert f"## {encgraph.__version__}" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_package_data_covers_the_files_the_package_reads() -> None:
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["encgraph"]
    package = ROOT / "encgraph"
    covered = {p for pattern in data for p in package.glob(pattern)}
    assert package / "py.typed" in covered
    configs = set((package / "configs").glob("*.json"))
    assert configs and configs <= covered
