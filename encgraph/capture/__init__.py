"""The runner layer (torch): static buffers, capture into one pool, replay, CPU static mode."""

from encgraph.capture.protocol import AdapterConfig, BudgetUnit, BufferSpec, EncoderAdapter, FillRule, ModuleAdapter, PathSpec
from encgraph.capture.records import GraphRecord, RunMode
from encgraph.capture.runner import EncoderGraphRunner

__all__ = [
    "AdapterConfig",
    "BudgetUnit",
    "BufferSpec",
    "EncoderAdapter",
    "FillRule",
    "GraphRecord",
    "ModuleAdapter",
    "PathSpec",
    "RunMode",
    "EncoderGraphRunner",
]
