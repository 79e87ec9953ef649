"""One record per captured graph, and the run modes."""

from __future__ import annotations

import enum

import attrs
import torch

__all__ = ["RunMode", "GraphRecord"]


class RunMode(enum.Enum):
    """How the runner executes a planned batch."""

    GRAPH = "graph"
    """Replay the captured CUDA graph of the batch's budget (the default on CUDA)."""
    STATIC = "static"
    """Run the same padded static-shape forward eagerly, no capture (asked for on the CPU, a debugging aid on
    CUDA). Tests the plan, the buffers and their fill rules exactly as a replay would see them."""
    EAGER = "eager"
    """Run the adapter's eager forward on each planned batch (the default on the CPU, where no graph can save
    launches: a call costs what the tower's own forward costs; a baseline on CUDA). No buffers, no self-check."""


@attrs.define(eq=False)
class GraphRecord:
    """A captured graph of one path at one budget.

    ``inputs`` are views of the path's static buffers (written before each replay); ``outputs`` the tensors the
    graph writes on each replay, valid until the next replay of any graph of the pool.
    """

    path: str
    budget: int
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    capture_seconds: float
    memory_bytes: int
    compile_seconds: float = 0.0
    replay_ms: float | None = None

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "budget": self.budget,
            "capture_seconds": round(self.capture_seconds, 4),
            "compile_seconds": round(self.compile_seconds, 4),
            "memory_bytes": self.memory_bytes,
            "replay_ms": None if self.replay_ms is None else round(self.replay_ms, 4),
        }
        return out
