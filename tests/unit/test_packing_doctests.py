"""The planner's docstring examples run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "encgraph.packing",
    "encgraph.packing.ladder",
    "encgraph.packing.limits",
    "encgraph.packing.spec",
    "encgraph.packing.plan",
    "encgraph.packing.greedy",
    "encgraph.packing.sharding",
    "encgraph._validate",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if name != "encgraph._validate":
        assert result.attempted > 0
