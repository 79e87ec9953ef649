"""Shared pytest setup: hypothesis profiles.

``ci`` (the default) keeps the unit suite fast; ``dev`` searches harder.  Pick one with the
``HYPOTHESIS_PROFILE`` environment variable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# Tests import shared helpers as ``tests.strategies``; ``python -m pytest`` puts the repository root on
# sys.path, a bare ``pytest`` run from a layout without ``tests/__init__.py`` does not.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config) -> None:
    # The CPU tests run tiny towers: one intra-op thread is faster than two spinning workers (measured: a tiny
    # Gemma-4 forward took 830 ms with 2 threads on a loaded 2-core machine, 16 ms with 1), and CPU timings
    # never enter a test's verdict. Only when torch is importable (the planner tests need none).
    try:
        import torch
    except ImportError:
        return
    if os.environ.get("ENCGRAPH_TEST_THREADS"):
        torch.set_num_threads(int(os.environ["ENCGRAPH_TEST_THREADS"]))
    elif not torch.cuda.is_available():
        torch.set_num_threads(1)
