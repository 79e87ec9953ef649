"""The torch.compile systems and their bookkeeping: the reduce-overhead static forward (:class:`CompiledStatic`),
dynamo's counters and compile seconds, and a hard time cap for a system whose single call may compile for
minutes (:class:`TimeBox`)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

COMPILE_METRIC = "_compile.compile_inner"
"""The entry of ``torch._dynamo.utils.compilation_time_metrics`` that times each frame's whole compilation
(tracing, the backend, guards)."""


class CompiledStatic:
    """An adapter whose static-shape forward runs through ``torch.compile(mode="reduce-overhead")``; every other
    method is the wrapped adapter's. Run by a runner in ``STATIC`` mode, it gets exactly the plan, buffers and
    padding of the graph runner, with torch's own CUDA graphs instead of encgraph's.

    Outputs are cloned: cudagraph trees overwrite them at the next replay.
    """

    def __init__(self, adapter: Any) -> None:
        import torch

        self.inner = adapter
        self._compiled = torch.compile(adapter.forward_static, mode="reduce-overhead", dynamic=False)

    @property
    def config(self) -> Any:
        return self.inner.config

    def item_specs(self, inputs: Any) -> Any:
        return self.inner.item_specs(inputs)

    def select(self, inputs: Any, indices: Sequence[int]) -> Any:
        return self.inner.select(inputs, indices)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> Any:
        return self.inner.buffer_specs(path, budget, max_items, max_frames)

    def replay_values(self, path: str, inputs: Any, budget: int) -> Any:
        return self.inner.replay_values(path, inputs, budget)

    def forward_static(self, path: str, buffers: Mapping[str, Any], budget: int) -> dict[str, Any]:
        import torch

        torch.compiler.cudagraph_mark_step_begin()
        return {name: t.clone() for name, t in self._compiled(path, dict(buffers), budget).items()}

    def forward_eager(self, path: str, inputs: Any) -> Any:
        return self.inner.forward_eager(path, inputs)

    def assemble(self, parts: Any) -> Any:
        return self.inner.assemble(parts)


def compile_dynamic(module: Any, *, backend: str = "inductor") -> Any:
    """``torch.compile(module, dynamic=True)``: what a user tries instead of encgraph (the module itself is not
    changed; its own forward stays eager)."""
    import torch

    return torch.compile(module, dynamic=True, backend=backend)


def dynamo_counters() -> dict[str, Any]:
    """Snapshot of torch._dynamo's counters: graphs compiled, frames, graph breaks, cudagraph skips, recompiles,
    and the seconds dynamo spent compiling frames so far (``compile_seconds``)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "recompiles": int(sum(counters["recompiles"].values())),
        "compile_seconds": float(sum(compilation_time_metrics.get(COMPILE_METRIC, ()))),
    }


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def counter_delta(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """``after - before`` per counter (seconds rounded to ms)."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0)
        out[k] = round(d, 3) if isinstance(d, float) else d
    return out


class CapExceeded(BaseException):
    """Raised inside a call that ran past its :class:`TimeBox`. A ``BaseException``, so that torch's own
    ``except Exception`` handlers (dynamo falls back to eager on some errors) do not swallow it."""


@contextlib.contextmanager
def hard_cap(seconds: float) -> Iterator[None]:
    """Raise :class:`CapExceeded` in this thread once ``seconds`` have passed (``SIGALRM``; the main thread of
    a POSIX process only, elsewhere no cap). The signal lands between Python bytecodes, so a long C call (a
    kernel compile) finishes before it takes effect."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds == float("inf"):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise CapExceeded(f"time cap of {seconds:.1f} s reached")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class TimeBox:
    """A system's own time budget: every call through :meth:`run` counts against ``seconds`` and is cut off
    (:func:`hard_cap`) when it would pass them; after that, :attr:`spent` is set and the system is not run
    again. Keeps the calls that compiled (dynamo's unique-graph counter moved during the call), their count and
    seconds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.used = 0.0
        self.spent: str | None = None
        self.compiling_calls = 0
        self.compiling_seconds = 0.0

    def left(self) -> float:
        return self.seconds - self.used

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the remaining cap; raises :class:`CapExceeded` (and marks the box spent) when cut off."""
        if self.spent is not None:
            raise CapExceeded(self.spent)
        if self.left() <= 0:
            self.spent = f"time cap of {self.seconds:g} s spent"
            raise CapExceeded(self.spent)
        before = _unique_graphs()
        t0 = time.perf_counter()
        try:
            with hard_cap(self.left()):
                return fn()
        except CapExceeded:
            self.spent = f"time cap of {self.seconds:g} s reached inside a call (cut off)"
            raise
        finally:
            took = time.perf_counter() - t0
            self.used += took
            if _unique_graphs() != before:
                self.compiling_calls += 1
                self.compiling_seconds += took

    def summary(self) -> dict[str, Any]:
        return {"cap_seconds": self.seconds, "used_seconds": round(self.used, 2), "stopped": self.spent,
                "calls_that_compiled": self.compiling_calls,
                "seconds_in_calls_that_compiled": round(self.compiling_seconds, 2)}
