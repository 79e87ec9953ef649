"""The adapter protocol, for adapter authors.

The definitions live in :mod:`encgraph.capture.protocol` (the runner reads them and must not import this
layer); this module is where adapters import them from. See that module for the buffer lifetimes, the output
layout and the fill rules.
"""

from encgraph.capture.protocol import (
    AdapterConfig,
    BudgetUnit,
    BufferSpec,
    EncoderAdapter,
    FillRule,
    ModuleAdapter,
    PathSpec,
    StockCall,
)

__all__ = ["AdapterConfig", "BudgetUnit", "BufferSpec", "EncoderAdapter", "FillRule", "ModuleAdapter", "PathSpec", "StockCall"]
