"""Whether this thread is making what a CUDA graph will hold: a budget's warm-ups (which build what its capture
then records) and its capture (:mod:`encgraph.capture.graph_steps`). A kernel that prepares a plan per shape on
its first call runs only there, where that call is paid once at capture (cuDNN's packed SDPA:
:mod:`encgraph.models.varlen_kernel`); an eager forward's calls are outside."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["graph_calls", "in_graph_calls"]

_LOCAL = threading.local()


@contextlib.contextmanager
def graph_calls() -> Iterator[None]:
    """Within it, on this thread, :func:`in_graph_calls` is true (nested uses included)."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


def in_graph_calls() -> bool:
    """Whether this thread is within :func:`graph_calls`."""
    return bool(getattr(_LOCAL, "depth", 0))
