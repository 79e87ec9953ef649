"""Registry entries of the Qwen-VL adapters (imported by ``encgraph.models.registry``; the adapter modules
themselves load only when a matching tower is wrapped)."""

from encgraph.models.registry import register_adapter

register_adapter("Qwen2VLVisionConfig", "encgraph.models.qwen2_vl:adapter", "Qwen2-VL")
register_adapter("Qwen2_5_VLVisionConfig", "encgraph.models.qwen2_5_vl:adapter", "Qwen2.5-VL")
register_adapter("Qwen3VLVisionConfig", "encgraph.models.qwen3_vl:adapter", "Qwen3-VL")
register_adapter("Qwen3VLMoeVisionConfig", "encgraph.models.qwen3_vl:adapter", "Qwen3-VL-MoE")
