"""Registers the DeepSeek-OCR2 adapter with :mod:`encgraph.models.registry` (by the full model's config class:
the adapter needs the projector and view separator besides the vision tower). The factory imports its module
(and transformers) only when a model is wrapped."""

from encgraph.models.registry import register_adapter

register_adapter("DeepseekOcr2Config", "encgraph.models.deepseek_ocr2:adapter", "DeepSeek-OCR2")
