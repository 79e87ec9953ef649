"""The error hierarchy: every error is an ``EncgraphError`` and the builtin a caller would catch."""

from __future__ import annotations

import pytest

import encgraph
from encgraph import errors

EXPECTED = {
    "ConfigError": ValueError,
    "ConfigTypeError": TypeError,
    "InputError": ValueError,
    "InputTypeError": TypeError,
    "CaptureError": RuntimeError,
    "UnsupportedModelError": TypeError,
    "VersionError": ImportError,
    "OverloadedError": RuntimeError,
    "ShutdownError": RuntimeError,
}


@pytest.mark.parametrize("name, builtin", sorted(EXPECTED.items()))
def test_each_error_is_encgraph_and_builtin(name: str, builtin: type) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.EncgraphError)
    assert issubclass(cls, builtin)
    assert getattr(encgraph, name) is cls
    with pytest.raises(builtin):
        raise cls("message")


def test_root_and_exports() -> None:
    assert issubclass(errors.EncgraphError, Exception)
    assert encgraph.EncgraphError is errors.EncgraphError
    assert set(errors.__all__) == {"EncgraphError", *EXPECTED}


def test_planner_errors_are_catchable_as_builtins() -> None:
    from encgraph.packing import ItemSpec, budget_ladder

    with pytest.raises(ValueError):
        budget_ladder(0, 4)
    with pytest.raises(TypeError):
        ItemSpec("4")
