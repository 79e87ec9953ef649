"""Registers the fixed-resolution tower adapters (SigLIP, CLIP, InternVL) with :mod:`encgraph.models.registry`.

Imported by the registry's built-in block; the factories import their modules (and transformers) only when a
tower is wrapped.
"""

from encgraph.models.registry import register_adapter

FIXED_ADAPTERS = {
    "SiglipVisionConfig": ("encgraph.models.siglip:siglip_adapter", "SigLIP"),
    "CLIPVisionConfig": ("encgraph.models.clip:clip_adapter", "CLIP"),
    "InternVLVisionConfig": ("encgraph.models.internvl:internvl_adapter", "InternVL"),
}

for _config, (_factory, _family) in FIXED_ADAPTERS.items():
    register_adapter(_config, _factory, _family)
