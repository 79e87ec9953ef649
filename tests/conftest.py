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
