"""Adapters (torch; transformers as the optional ``hf`` extra): the model-specific half of encgraph."""

from encgraph.models.graphed import GraphedForward, graphed, graphs
from encgraph.models.registry import known_configs, register_adapter, wrap

__all__ = ["wrap", "graphed", "graphs", "GraphedForward", "register_adapter", "known_configs"]
