"""README.md's code runs as written.

Every ```python block is executed in a fresh namespace, except blocks whose first line is ``# not run``, and
blocks whose first line is ``# needs cuda`` when CUDA is unavailable.  The Quickstart's ``python -c`` snippet
runs too, and the Quickstart's test command is the one ``.ci/run`` runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[tuple[int, str]]:
    text = README.read_text(encoding="utf-8")
    return [
        (text[: m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang
    ]


def cuda_available() -> bool:
    import torch  # only for blocks that say they need CUDA

    return bool(torch.cuda.is_available())


PYTHON_BLOCKS = blocks("python")


def test_readme_has_python_examples() -> None:
    assert PYTHON_BLOCKS, "README.md should show the planner in a ```python block"


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"README.md:{line}" for line, _ in PYTHON_BLOCKS])
def test_python_block_runs(line: int, code: str) -> None:
    first = code.lstrip().splitlines()[0].strip() if code.strip() else ""
    if first == "# not run":
        pytest.skip("marked '# not run'")
    if first == "# needs cuda" and not cuda_available():
        pytest.skip("marked '# needs cuda' and CUDA is unavailable")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


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
    assert "python3 -m pytest -q tests" in ci or "python -m pytest -q tests" in ci


def test_quickstart_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # The main job of the first command, through the console script's entry point.
    from encgraph.cli import main

    assert main(["demo", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "budget" in out.lower()
