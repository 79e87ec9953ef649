"""The counters of a batching front (:class:`~encgraph.serving.BatchingFront`), kept apart from its worker."""

from __future__ import annotations

import collections
from typing import Any

import attrs

__all__ = ["FrontStats"]


@attrs.define
class FrontStats:
    """Counters of a front (read a copy with :attr:`BatchingFront.stats`).

    ``requests`` submitted and accepted; ``rejected`` (queue full or closed); ``completed``, ``failed`` and
    ``cancelled`` requests; ``calls`` of the target and ``requests_per_call`` (a histogram: requests -> calls);
    ``retried_calls``: coalesced calls that raised and were run again one request at a time; ``items`` answered;
    ``waits_skipped``: calls that did not wait for more requests (the device was idle, or recent waits gathered
    none: see the module docs); ``idle_launches``: those of them that found a CUDA target's device idle;
    ``held_launches``: calls that gathered until the older of the two calls in flight on a CUDA target's device was
    done (:data:`~encgraph.serving.waiting.MAX_IN_FLIGHT`).
    """

    requests: int = 0
    rejected: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    calls: int = 0
    retried_calls: int = 0
    items: int = 0
    waits_skipped: int = 0
    idle_launches: int = 0
    held_launches: int = 0
    requests_per_call: collections.Counter = attrs.field(factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["requests_per_call"] = dict(sorted(self.requests_per_call.items()))
        return out
