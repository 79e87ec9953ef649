"""Registers the multi-path adapters of issue 16 with :mod:`encgraph.models.registry`: Gemma-4's vision tower (by
its vision config: ``graphed(model.model.vision_tower)`` stands in for it) and Step-3.7 (by the full model's config:
the adapter needs the projector, and its shim replaces ``get_image_features``; the tower alone is refused with a
pointer to it). The factories import their modules (and transformers) only when a model is wrapped."""

from encgraph.models.registry import register_adapter

MULTIPATH_ADAPTERS = {
    "Gemma4VisionConfig": "encgraph.models.gemma4:adapter",
    "Step3p7Config": "encgraph.models.step3p7:adapter",
    "Step3p7VisionConfig": "encgraph.models.step3p7:tower_adapter",  # refused, pointing at the model's adapter
}

for _config, _factory in MULTIPATH_ADAPTERS.items():
    register_adapter(_config, _factory)
