"""Skipping a test module below the transformers version its adapter needs (the adapters themselves refuse
older versions with a VersionError, which their own tests check where the version allows it)."""

from __future__ import annotations

import pytest


def skip_module_below(minimum: str, what: str) -> None:
    """Skip the calling test module when the installed transformers is older than ``minimum``."""
    skip_below(minimum, what, module=True)


def skip_below(minimum: str, what: str, *, module: bool = False) -> None:
    """Skip the calling test (its module with ``module=True``) when transformers is older than ``minimum``."""
    from encgraph.models._hf import _parse, transformers_version

    installed = transformers_version() or "0"
    if _parse(installed) < _parse(minimum):
        pytest.skip(f"{what} needs transformers>={minimum}, found {installed}", allow_module_level=module)
