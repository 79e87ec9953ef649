"""The package's metadata: the version in one place, and the data files the wheel must carry.

``.ci/run`` builds the wheel and sdist and runs them from a fresh venv; these checks are the cheap half.
"""

from __future__ import annotations

import ast
import re
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


#: What a test skips without, by import name -> the distribution that provides it.
DISTRIBUTIONS = {"PIL": "pillow", "prometheus_client": "prometheus-client"}
#: Skips that the ``test`` extra leaves in place on purpose: the engines (extras of their own, CUDA builds of torch).
ENGINES = {"vllm", "sglang"}
RAY_STEP = {"ray"}
"""``encgraph serve --ray``'s test (tests/integration/test_ray_serve.py) needs the ``ray`` extra, installed in a step
of its own (Ray's dependencies are many and heavy; the main step does not need them)."""
LIBRARY_STEP = {"timm", "open_clip", "torchvision"}
"""Vision libraries whose tests run in .ci/run's step of their own (they need torchvision, whose PyPI wheels do not
import beside the main step's CPU torch): not in the test extra, installed there."""


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_the_test_extra_installs_what_the_cpu_tests_import_or_skip() -> None:
    """Issue 54: the README said only GPU tests skip, while 66 plot tests skipped too: the ``test`` extra lacked
    matplotlib. Every package a test imports-or-skips (``pytest.importorskip``, a ``find_spec`` check) is in the
    extra (or a base dependency), the engines aside."""
    project = PYPROJECT["project"]
    installed = _requirement_names(project["optional-dependencies"]["test"]) | _requirement_names(
        project["dependencies"])
    pattern = re.compile(r"""(?:importorskip|find_spec)\(\s*["']([A-Za-z_][\w.]*)["']""")
    wanted: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        for name in pattern.findall(path.read_text(encoding="utf-8")):
            top = name.split(".")[0]
            if top not in ENGINES | LIBRARY_STEP | RAY_STEP:
                wanted.setdefault(DISTRIBUTIONS.get(top, top).lower().replace("_", "-"), set()).add(
                    str(path.relative_to(ROOT)))
    assert "matplotlib" in wanted  # the plot tests are found
    missing = {dist: sorted(paths) for dist, paths in wanted.items() if dist not in installed}
    assert not missing, f"not in the test extra: {missing}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert all(name.replace("_", "-") in ci or name in ci for name in LIBRARY_STEP), "a library step installs them"


def test_the_ray_extra_installs_ray_serve_on_top_of_the_serve_extra() -> None:
    ray = PYPROJECT["project"]["optional-dependencies"]["ray"]
    assert "encgraph[serve]" in ray and any(r.startswith("ray[serve]") for r in ray), ray
