"""The runners behind one graphed module: one for a model adapter, or one per call shape for any other module.

An :class:`Engine` is an adapter and the :class:`~encgraph.EncoderGraphRunner` that captures and replays it.
:class:`ShapeFamilies` keeps the engines of a module on the any-module path (:mod:`encgraph.models.generic`), one
per call shape, at most ``max_shapes`` of them: a new shape's first call is answered by the module and teaches
its output's structure; its second call builds its engine (captured on that call, on the GPU); past
``max_shapes`` the least recently used engine is dropped, its graphs and their memory freed, its counters kept.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import attrs

from encgraph.capture.runner import EncoderGraphRunner
from encgraph.capture.stats import sum_counters
from encgraph.models.call_spec import CallSplit, describe_key
from encgraph.models.generic import GenericModuleAdapter, OutputSpec

__all__ = ["Engine", "ShapeFamilies", "LEARNED_SHAPES"]

log = logging.getLogger("encgraph")

LEARNED_SHAPES = 256
"""Call shapes whose output structure a module keeps (a few hundred bytes each; least recently seen dropped)."""


@attrs.define(eq=False)
class Engine:
    """One adapter and its runner; ``key`` is its call shape (``None`` for a model adapter)."""

    adapter: Any
    runner: EncoderGraphRunner
    key: Any = None

    def graph_bytes(self) -> int:
        info = self.runner.capture_info
        return int(info.get("pool_bytes", 0)) + int(info.get("buffer_bytes", 0))

    def summary(self) -> dict[str, Any]:
        stats = self.runner.stats
        return {
            "shape": describe_key(self.key) if self.key is not None else "model adapter",
            "captured": self.runner.captured,
            "calls": stats["calls"],
            "graph_items": stats["graph_items"],
            "graph_bytes": self.graph_bytes(),
            "stock_reason": getattr(self.adapter, "stock_reason", None),
        }

    def close(self) -> None:
        """Undo what the adapter changed on the module; the runner's graphs go with the last reference."""
        self.adapter.unwrap()


class ShapeFamilies:
    """The any-module engines of one module, by call shape, least recently used first.

    Args:
        build: makes the engine of a call shape from its example call and output structure.
        max_shapes: engines kept at once (their graphs held).
    """

    def __init__(self, build: Callable[[CallSplit, OutputSpec], Engine], max_shapes: int) -> None:
        self._build = build
        self.max_shapes = max_shapes
        self.engines: collections.OrderedDict[Any, Engine] = collections.OrderedDict()
        self.learned: collections.OrderedDict[Any, OutputSpec | str] = collections.OrderedDict()
        self.evicted = 0
        self.built = 0
        self.retired: dict[str, Any] = {}  # counters of dropped engines, summed

    def engine(self, split: CallSplit) -> Engine | OutputSpec | str | None:
        """The engine of ``split``'s shape (built on the shape's second call); else ``None`` for a shape never
        seen (answer with the module, then :meth:`learn`), or the reason the shape is answered by the module."""
        found = self.engines.get(split.key)
        if found is not None:
            self.engines.move_to_end(split.key)
            return found
        learned = self.learned.get(split.key)
        if learned is None or isinstance(learned, str):
            return learned
        self.learned.move_to_end(split.key)
        engine = self._build(split, learned)
        self.built += 1
        self.engines[split.key] = engine
        while len(self.engines) > self.max_shapes:
            _, old = self.engines.popitem(last=False)
            self.retire(old)
            self.evicted += 1
            log.info("encgraph: dropped the graphs of call shape %s (least recently used of %d; max_shapes=%d).",
                     describe_key(old.key), self.max_shapes + 1, self.max_shapes)
        return engine

    def learn(self, split: CallSplit, out: Any) -> None:
        """Keep the structure of the module's answer ``out`` to ``split`` (or why it cannot be split per item)."""
        self.learned[split.key] = OutputSpec.learn(out, split.batch)
        while len(self.learned) > LEARNED_SHAPES:
            self.learned.popitem(last=False)

    def forget(self, key: Any, reason: str) -> None:
        """The shape's engine goes (its self-check failed, say); its calls are answered by the module from now on."""
        engine = self.engines.pop(key, None)
        if engine is not None:
            self.retire(engine)
        self.learned[key] = reason

    def retire(self, engine: Engine) -> None:
        """Close ``engine`` (its adapter undoes what it changed), keeping its counters in :attr:`retired`."""
        self.retired = sum_counters([self.retired, engine.runner.stats])
        engine.close()

    def clear(self) -> None:
        for engine in self.engines.values():
            self.retire(engine)
        self.engines.clear()
        self.learned.clear()

    def as_dict(self) -> dict[str, Any]:
        live = list(self.engines.values())
        return {
            "max_shapes": self.max_shapes,
            "live": [e.summary() for e in live],
            "built": self.built,
            "evicted": self.evicted,
            "learned": len(self.learned),
            "graph_bytes": sum(e.graph_bytes() for e in live),
        }


def new_generic_engine(module: Any, split: CallSplit, output: OutputSpec, adapter_options: dict[str, Any],
                       runner_options: dict[str, Any]) -> Engine:
    adapter = GenericModuleAdapter(module, split, output, **adapter_options)
    return Engine(adapter, EncoderGraphRunner(adapter, **runner_options), split.key)
