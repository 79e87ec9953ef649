"""The adapters encgraph ships, as one table read by :mod:`encgraph.models.registry`: a tower's config class name
-> ``"module:factory"`` and the family's name in messages and docs (``None``: the config name without "Config").

Data only: the adapter modules (and transformers) load when a matching tower is wrapped, not when this table is
read. A factory takes ``(module, **options)`` and returns an adapter.
"""

from __future__ import annotations

__all__ = ["BUILTIN_ADAPTERS"]

BUILTIN_ADAPTERS: dict[str, tuple[str, str | None]] = {
    # Packed-grid towers of the Qwen-VL pattern (encgraph.models.qwen_vl).
    "Qwen2VLVisionConfig": ("encgraph.models.qwen2_vl:adapter", "Qwen2-VL"),
    "Qwen2_5_VLVisionConfig": ("encgraph.models.qwen2_5_vl:adapter", "Qwen2.5-VL"),
    "Qwen3VLVisionConfig": ("encgraph.models.qwen3_vl:adapter", "Qwen3-VL"),
    "Qwen3VLMoeVisionConfig": ("encgraph.models.qwen3_vl:adapter", "Qwen3-VL-MoE"),
    # The Omni models' vision encoders are these towers under another config: the same entries.
    "Qwen2_5OmniVisionEncoderConfig": ("encgraph.models.qwen2_5_vl:adapter", "Qwen2.5-Omni"),
    "Qwen3OmniMoeVisionEncoderConfig": ("encgraph.models.qwen3_vl:adapter", "Qwen3-Omni-MoE"),
    # Fixed-resolution towers (encgraph.models.fixed).
    "SiglipVisionConfig": ("encgraph.models.siglip:siglip_adapter", "SigLIP"),
    "CLIPVisionConfig": ("encgraph.models.clip:clip_adapter", "CLIP"),
    "InternVLVisionConfig": ("encgraph.models.internvl:internvl_adapter", "InternVL"),
    # DeepSeek-OCR2, by the full model's config: the adapter needs the projector and view separator too.
    "DeepseekOcr2Config": ("encgraph.models.deepseek_ocr2:adapter", "DeepSeek-OCR2"),
    # Packed-grid and tile families added after the seed.
    "Glm4vVisionConfig": ("encgraph.models.glm4v:adapter", None),  # GLM-4.1V, GLM-4.6V (glm46v reuses the config)
    "Glm4vMoeVisionConfig": ("encgraph.models.glm4v:adapter", None),  # GLM-4.5V
    "Qwen3_5VisionConfig": ("encgraph.models.qwen3_5:adapter", None),
    "Qwen3_5MoeVisionConfig": ("encgraph.models.qwen3_5:adapter", None),
    "Ernie4_5_VLMoeVisionConfig": ("encgraph.models.ernie4_5_vl:adapter", None),
    "Ernie4_5_VL_MoeVisionConfig": ("encgraph.models.ernie4_5_vl:adapter", None),  # transformers' deprecated alias
    "Kimi_K25VisionConfig": ("encgraph.models.kimi_k25:adapter", None),
    "MiniCPMV4_6VisionConfig": ("encgraph.models.minicpmv:adapter", None),
    "MiniCPMV4_7VisionConfig": ("encgraph.models.minicpmv:adapter", None),  # the same tower
    "MiniCPMOcrVisionConfig": ("encgraph.models.minicpmv:adapter", None),  # the same tower
    "Llama4VisionConfig": ("encgraph.models.llama4:adapter", None),
    "PaddleOCRVisionConfig": ("encgraph.models.paddleocr_vl:adapter", "PaddleOCR-VL"),
    "PixtralVisionConfig": ("encgraph.models.pixtral:adapter", None),  # Mistral 3, Pixtral-12B (LLaVA)
    "HunYuanVLVisionConfig": ("encgraph.models.hunyuan_vl:adapter", "HunYuan-VL"),
    "Siglip2VisionConfig": ("encgraph.models.siglip2:adapter", "SigLIP2 NaFlex"),  # SigLIP2's and LFM2-VL's tower
    "Idefics3VisionConfig": ("encgraph.models.idefics3:adapter", "Idefics3"),
    "SmolVLMVisionConfig": ("encgraph.models.idefics3:adapter", "SmolVLM"),  # the same tower
    # Multi-path towers: Gemma-4's vision tower (by its vision config) and Step-3.7: the full model (its shim
    # captures the projector too) and the tower alone as the model calls it (global views, then crops).
    "Gemma4VisionConfig": ("encgraph.models.gemma4:adapter", None),
    "Step3p7Config": ("encgraph.models.step3p7:adapter", None),
    "Step3p7VisionConfig": ("encgraph.models.step3p7_tower:adapter", None),
}
