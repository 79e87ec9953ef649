"""Registry entries of the packed-grid and tile families added after the seed (GLM-4V, Qwen3.5, ERNIE-4.5-VL,
Kimi-K2.5, MiniCPM-V, Llama 4): one table, config class name -> adapter factory. Imported by
``encgraph.models.registry``; the adapter modules (and transformers) load only when a matching tower is wrapped.
"""

from encgraph.models.registry import register_adapter

FAMILY_ADAPTERS = {
    "Glm4vVisionConfig": "encgraph.models.glm4v:adapter",  # GLM-4.1V, GLM-4.6V (glm46v reuses the config)
    "Glm4vMoeVisionConfig": "encgraph.models.glm4v:adapter",  # GLM-4.5V
    "Qwen3_5VisionConfig": "encgraph.models.qwen3_5:adapter",
    "Qwen3_5MoeVisionConfig": "encgraph.models.qwen3_5:adapter",
    "Ernie4_5_VLMoeVisionConfig": "encgraph.models.ernie4_5_vl:adapter",
    "Ernie4_5_VL_MoeVisionConfig": "encgraph.models.ernie4_5_vl:adapter",  # transformers' deprecated alias
    "Kimi_K25VisionConfig": "encgraph.models.kimi_k25:adapter",
    "MiniCPMV4_6VisionConfig": "encgraph.models.minicpmv:adapter",
    "MiniCPMV4_7VisionConfig": "encgraph.models.minicpmv:adapter",  # the same tower
    "MiniCPMOcrVisionConfig": "encgraph.models.minicpmv:adapter",  # the same tower
    "Llama4VisionConfig": "encgraph.models.llama4:adapter",
}

for _config, _factory in FAMILY_ADAPTERS.items():
    register_adapter(_config, _factory)
