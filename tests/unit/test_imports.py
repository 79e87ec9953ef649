"""Importing the planner (or the package) must not import torch; nothing starts at import time."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", ["encgraph.packing", "encgraph", "encgraph.errors"])
def test_import_leaves_torch_out(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert run(code) == "[]"


def test_planner_works_without_torch() -> None:
    # With torch made unimportable, the whole planner still runs.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from encgraph.packing import ItemSpec, balance, budget_ladder, pack\n"
        "plan = pack([ItemSpec(300), ItemSpec(900)], budget_ladder(256, 1024), max_items=2)\n"
        "print(len(plan.batches), balance([3, 1], 2))"
    )
    assert run(code) == "2 ((0,), (1,))"


def test_public_names() -> None:
    import encgraph.packing as packing

    for name in packing.__all__:
        assert getattr(packing, name) is not None
    assert {"budget_ladder", "ItemSpec", "pack", "balance", "Plan", "Batch", "Limits", "EagerReason"} <= set(
        packing.__all__
    )
