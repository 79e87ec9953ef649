"""The server's Python heap: freeze what start-up built, and time the garbage collector's pauses.

Why: a process that imported torch, transformers and FastAPI and built a tower holds about 400,000 objects the
cyclic garbage collector tracks. A full (generation 2) collection walks every one of them while holding the GIL:
220-250 ms on this repository's 2-core VM (measured: three ``gc.collect()`` in such a process), during which the
front's worker launches no replay, the event loop answers nothing and every request in flight waits. Python
starts one whenever the objects that survived younger collections reach a quarter of the old ones, so under load
it comes every so often; on the H200 the server at 32 clients had a P99 of 417-459 ms against a P50 of 91-120 ms
in some runs and 118-135 ms in others, about one such pause among a point's ~900 requests. ``gc.freeze()`` after
start-up moves every object alive into a permanent generation that collections skip: a full collection of the
same process then took 0.002 ms. Objects still freed by reference counting are freed as before; only cycles among
the frozen objects are never collected, and start-up leaves none worth collecting.

``encgraph serve`` freezes its heap once its models are captured (:func:`freeze`), and each preprocessing worker
once it is warm. :data:`PAUSES` times every collection of the process (``gc.callbacks``); ``/metrics`` exports them
(``encgraph_gc_collections_total``, ``encgraph_gc_pause_seconds_total``, ``encgraph_gc_longest_pause_seconds``,
by generation, since the freeze) so that an operator sees a pause that still happens.
"""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["GcPauses", "PAUSES", "freeze"]


def freeze() -> int:
    """Collect once, then freeze every object alive (``gc.freeze``); the number of frozen objects. :data:`PAUSES`
    starts counting again from here: start-up's own collections (this one took 0.51 s in the CPU test server)
    are not pauses of serving."""
    gc.collect()
    gc.freeze()
    PAUSES.reset()
    return gc.get_freeze_count()


class GcPauses:
    """Collections of this process and their pauses, per generation (0, 1, 2), timed by a ``gc.callbacks`` hook
    that :meth:`install` adds once (called from the main thread, as the app is built). A collection runs with the
    GIL held and never nests, so the hook's two calls of one collection come in a row."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def reset(self) -> None:
        self.collections, self.seconds, self.longest = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]

    def install(self) -> GcPauses:
        if self._hook not in gc.callbacks:
            gc.callbacks.append(self._hook)
        return self

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        spent, self._started = time.perf_counter() - self._started, None
        generation = min(int(info.get("generation", 2)), 2)
        self.collections[generation] += 1
        self.seconds[generation] += spent
        self.longest[generation] = max(self.longest[generation], spent)


PAUSES = GcPauses()
"""This process's collections (installed by the first :class:`~encgraph.serving.metrics.Metrics`)."""
