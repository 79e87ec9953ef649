"""Counters of a runner: items, replays per budget, eager runs and why, real and padded tokens per path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RunStats", "sum_counters"]


class RunStats:
    """Mutable counters (the runner's lock guards them). ``as_dict()`` gives a JSON-ready copy."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.calls = 0
        self.items = 0
        self.eager_items = 0
        self.eager_reasons: Counter[str] = Counter()
        self.replays = {p: Counter() for p in paths}  # type: dict[str, Counter[int]]
        self.eager_runs = dict.fromkeys(paths, 0)
        self.path_eager_items = dict.fromkeys(paths, 0)
        self.real_tokens = dict.fromkeys(paths, 0)
        self.padded_tokens = dict.fromkeys(paths, 0)
        self.stock_calls = 0

    def add_call(self) -> None:
        self.calls += 1

    def add_items(self, *, eager: int, total: int) -> None:
        self.items += total
        self.eager_items += eager

    def add_replay(self, path: str, budget: int, used: int) -> None:
        self.replays[path][budget] += 1
        self.real_tokens[path] += used
        self.padded_tokens[path] += budget - used

    def add_eager(self, path: str, reason: str, items: int, used: int) -> None:
        self.eager_runs[path] += 1
        self.path_eager_items[path] += items
        self.eager_reasons[reason] += items
        self.real_tokens[path] += used

    def add_stock(self, reason: str) -> None:
        """A call answered by the module's own forward (``encgraph.graphed``): counted once per call."""
        self.stock_calls += 1
        self.eager_reasons[reason] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "stock_calls": self.stock_calls,
            "items": self.items,
            "graph_items": self.items - self.eager_items,
            "eager_items": self.eager_items,
            "eager_reasons": dict(self.eager_reasons),
            "paths": {
                p: {
                    "replays": {int(b): n for b, n in sorted(self.replays[p].items())},
                    "eager_runs": self.eager_runs[p],
                    "eager_items": self.path_eager_items[p],
                    "real_tokens": self.real_tokens[p],
                    "padded_tokens": self.padded_tokens[p],
                    "padded_share": (
                        self.padded_tokens[p] / (self.padded_tokens[p] + self.real_tokens[p])
                        if self.padded_tokens[p] + self.real_tokens[p]
                        else 0.0
                    ),
                }
                for p in self.replays
            },
        }


def sum_counters(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the numbers of several stats dicts (the ranks' ``stats``) key by key, nested dicts recursively; other
    values are dropped."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, Mapping):
                out[k] = sum_counters([out.get(k, {}), v])
    return out
