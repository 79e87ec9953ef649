"""Shared checks for the unit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from encgraph.errors import ConfigError, EncgraphError


def check_bad_argument(call: Callable[[], object], exc: type[BaseException], match: str) -> None:
    """One row of a table-driven bad-argument test: ``call()`` raises ``exc`` with a message matching ``match``.

    An encgraph error must also be an :class:`EncgraphError` and the matching builtin (``ValueError`` for
    :class:`ConfigError`, ``TypeError`` otherwise), so callers can catch either.  A plain ``TypeError`` row is
    Python's own (a wrong call signature) and is checked only for its type and message.
    """
    with pytest.raises(exc, match=match) as info:
        call()
    if exc is not TypeError:
        assert isinstance(info.value, EncgraphError)
        assert isinstance(info.value, ValueError if exc is ConfigError else TypeError)


def smoke_env() -> object:
    """The benchmarks' environment of a ``--cpu-smoke`` run (one run, no warm-up, seed 0)."""
    import argparse

    from benches.lib.env import make_env

    return make_env(argparse.Namespace(cpu_smoke=True, runs=1, warmup=0, seed=0))
