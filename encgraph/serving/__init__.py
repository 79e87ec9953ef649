"""Serving: a batching front that coalesces concurrent requests into one runner call
(:class:`BatchingFront`), and the ``encgraph serve`` image-embedding HTTP server (extra ``[serve]``:
:mod:`encgraph.serving.app`).

Importing this package imports neither torch nor the HTTP stack; the front loads torch when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from encgraph.errors import OverloadedError, ShutdownError

__all__ = ["BatchingFront", "FrontStats", "OverloadedError", "ShutdownError"]

if TYPE_CHECKING:  # pragma: no cover
    from encgraph.serving.front import BatchingFront, FrontStats


def __getattr__(name: str) -> Any:
    if name in ("BatchingFront", "FrontStats"):
        from encgraph.serving import front

        return getattr(front, name)
    raise AttributeError(f"module 'encgraph.serving' has no attribute {name!r}")
