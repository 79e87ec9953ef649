"""The README's and the docs' code runs as written, and their links lead somewhere.

Every ```python block of README.md and docs/*.md is executed in a fresh namespace, except blocks whose first line
is ``# not run``, and blocks whose first line is ``# needs cuda`` when CUDA is unavailable. The Quickstart's first
command's main job runs too, and its test command is the one ``.ci/run`` runs. The API reference itself is checked
by ``mkdocs build --strict`` in ``.ci/run``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return [
        (text[: m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang
    ]


def cuda_available() -> bool:
    import torch  # only for blocks that say they need CUDA

    return bool(torch.cuda.is_available())


PYTHON_BLOCKS = [(path, line, code) for path in DOCUMENTS for line, code in blocks(path, "python")]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_and_docs_have_python_examples() -> None:
    names = {_name(path) for path, _, _ in PYTHON_BLOCKS}
    assert {"README.md", "docs/runner.md", "docs/serving.md", "docs/writing-an-adapter.md"} <= names


@pytest.mark.parametrize("path, line, code", PYTHON_BLOCKS,
                         ids=[f"{_name(path)}:{line}" for path, line, _ in PYTHON_BLOCKS])
def test_python_block_runs(path: Path, line: int, code: str) -> None:
    first = code.lstrip().splitlines()[0].strip() if code.strip() else ""
    if first == "# not run":
        pytest.skip("marked '# not run'")
    if first == "# needs cuda" and not cuda_available():
        pytest.skip("marked '# needs cuda' and CUDA is unavailable")
    exec(compile(code, f"{_name(path)}:{line}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_relative_links_lead_to_files(path: Path) -> None:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    missing = [target for target, _ in LINK.findall(text)
               if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{_name(path)} links to missing files: {missing}"


def test_readme_is_a_newcomers_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def quickstart_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (block,) = [m.group(2) for m in FENCE.finditer(section) if m.group(1) in ("bash", "sh", "shell")]
    return [line for line in block.splitlines() if line.strip()]


def test_quickstart_is_two_commands_and_ci_runs_the_same_tests() -> None:
    commands = quickstart_commands()
    assert len(commands) == 2
    assert commands[0] == (
        "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && "
        "pip install -e \".[test]\" && encgraph demo"
    )
    assert commands[1] == "python -m pytest -q tests"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # Whichever interpreter CI's main step uses (the system's, or a venv's "$PY"), the same command on the suite.
    assert re.search(r"^\s*\S*(python3?|\$PY\"?) -m pytest -q tests$", ci, re.M), "CI does not run the README's tests"


def test_quickstart_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # The main job of the first command, through the console script's entry point.
    from encgraph.cli import main

    assert main(["demo", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "budget" in out.lower()
