"""How ``encgraph demo`` times the tower's own forward against encgraph: interleaved calls, median and spread.

Timing each system in a block of its own lets load from other work land on one of them: on a loaded 2-core CPU
the same command printed eager/encgraph 313/13 ms, 87/228 ms and 92/8.7 ms (median of 3 calls each, issue 54).
Here both are called once untimed (the checked call ran the tower item by item, never on the whole batch), then
in pairs whose order alternates (tower first, then encgraph first), so that both see the same load; each is
reported as the median of its calls with their range (min-max), and the speed-up as the median of the per-pair
ratios.  On a CPU, unless the user fixes the count, pairs run until :data:`CPU_SECONDS` of calls have passed
(at least :data:`CPU_MIN_PAIRS`, at most :data:`CPU_MAX_PAIRS`).  Torch-free (the caller passes its ``sync``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

__all__ = ["Timing", "Timings", "time_interleaved", "CPU_MIN_PAIRS", "CPU_MAX_PAIRS", "CPU_SECONDS", "NOISY"]

#: On a CPU with no ``--repeats``: at least this many pairs of calls ...
CPU_MIN_PAIRS = 5
#: ... and more until this many seconds of timed calls have passed ...
CPU_SECONDS = 1.0
#: ... but at most this many pairs.
CPU_MAX_PAIRS = 25
#: A system whose slowest call took this many times its fastest is reported as timed on a noisy machine.
NOISY = 1.5


@attrs.frozen
class Timing:
    """One system's timed calls, in milliseconds, in the order they ran."""

    calls_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.calls_ms)

    @property
    def low(self) -> float:
        return min(self.calls_ms)

    @property
    def high(self) -> float:
        return max(self.calls_ms)

    @property
    def spread(self) -> float:
        """Slowest call / fastest call (1.0: every call the same)."""
        return self.high / self.low if self.low > 0 else float("inf")

    def text(self) -> str:
        """``"16.79 ms (15.90-19.20)"``: the median and the range of the calls (one call: its time alone)."""
        if len(self.calls_ms) == 1:
            return f"{self.median:.2f} ms"
        return f"{self.median:.2f} ms ({self.low:.2f}-{self.high:.2f})"


@attrs.frozen
class Timings:
    """The tower's own forward (``tower``) and encgraph (``runner``) timed in ``pairs`` interleaved pairs after
    ``warmup`` untimed calls of each."""

    tower: Timing
    runner: Timing
    warmup: int

    @property
    def pairs(self) -> int:
        return len(self.tower.calls_ms)

    @property
    def speedup(self) -> float:
        """The median over pairs of tower time / encgraph time (both calls of a pair saw about the same load)."""
        return statistics.median(t / r if r > 0 else float("inf") for t, r in zip(self.tower.calls_ms,
                                                                                   self.runner.calls_ms))

    @property
    def noisy(self) -> bool:
        """Whether either system's calls varied by more than :data:`NOISY` times (other work on the machine)."""
        return max(self.tower.spread, self.runner.spread) > NOISY

    def noise_note(self) -> str | None:
        """A sentence on how far to trust the medians, or ``None`` when the calls agreed."""
        if self.pairs < 3:
            return (f"{'one timed call' if self.pairs == 1 else f'{self.pairs} timed calls'} of each: no measure of "
                    f"the noise; rerun with --repeats 10 or more for a figure to compare")
        if self.noisy:
            return (f"the calls of one system varied by up to {max(self.tower.spread, self.runner.spread):.1f}x "
                    f"(min-max): other work shares this machine, so the medians are rough; the per-pair ratio "
                    f"({self.speedup:.2f}x tower/encgraph) is steadier")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "warmup": self.warmup,
            "interleaved": True,
            "tower_eager_calls": list(self.tower.calls_ms),
            "encgraph_calls": list(self.runner.calls_ms),
            "tower_eager_range": [self.tower.low, self.tower.high],
            "encgraph_range": [self.runner.low, self.runner.high],
            "speedup_per_pair_median": self.speedup,
            "noisy": self.noisy,
            "note": self.noise_note(),
        }


def time_interleaved(
    tower: Callable[[], Any],
    runner: Callable[[], Any],
    *,
    pairs: int,
    sync: Callable[[], None] = lambda: None,
    min_seconds: float = 0.0,
    max_pairs: int | None = None,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    bar: Callable[[Iterable[int]], Iterable[int]] = lambda it: it,
) -> Timings:
    """Time ``tower`` and ``runner`` (each a call on the whole batch) in interleaved pairs.

    ``warmup`` untimed calls of each first; then at least ``pairs`` pairs, more while the timed calls total less
    than ``min_seconds`` (at most ``max_pairs``, default ``pairs``). Pair ``i`` calls the tower first when ``i`` is
    even, encgraph first when odd. ``sync`` runs after each call, inside its timing (a device synchronisation).
    """
    fns = (tower, runner)
    for _ in range(warmup):
        for fn in fns:
            fn()
            sync()
    most = max(pairs, max_pairs or pairs)
    times: tuple[list[float], list[float]] = ([], [])
    spent = 0.0
    for i in bar(range(most)):
        if i >= pairs and spent >= min_seconds:
            break
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            start = clock()
            fns[k]()
            sync()
            took = clock() - start
            spent += took
            times[k].append(took * 1e3)
    return Timings(Timing(tuple(times[0])), Timing(tuple(times[1])), warmup)
