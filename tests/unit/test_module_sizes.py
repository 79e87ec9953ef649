"""Module sizes (DESIGN.md: about 400 lines at most, split by concept). Issue 54 found ``capture/runner.py`` at 451
lines, ``models/attention.py`` at 410 and ``serving/preprocess.py`` at 408."""

from __future__ import annotations

from pathlib import Path

import encgraph

ROOT = Path(encgraph.__file__).resolve().parent
LIMIT = 400

def test_every_module_is_about_400_lines_or_fewer() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in ROOT.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by concept): {over}"
    for name in ("capture/runner.py", "models/attention.py", "serving/preprocess.py", "models/qwen_vl.py"):
        assert sizes[name] <= LIMIT, (name, sizes[name])
