"""Real geometry of the families added after the seed: each released model's vision config (random weights are
built from it), in one table the GPU tests read and the benchmarks can copy (``benches.common.TowerSpec`` has the
same ``model`` / ``config`` / ``full`` fields).

Sources: the transformers config docstrings' checkpoints (their defaults are those models' values) and the
models' published ``config.json``:

- GLM-4.1V-9B (and GLM-4.6V; GLM-4.5V's tower has the same shape): depth 24, hidden 1536, 12 heads, MLP 13696,
  patch 14, merge 2, output 4096, a 336 px (24 x 24) position table.
- Qwen3.5-27B: depth 27, hidden 1152, 16 heads, MLP 4304, patch 16, merge 2, a 48 x 48 position table, output
  5120 (the 27B text model's width).
- ERNIE-4.5-VL-28B-A3B: depth 32, hidden 1280, 16 heads, MLP 5120, patch 14, merge 2 (no temporal patch).
- Kimi-K2.5 (MoonViT): 27 layers, hidden 1152, 16 heads, MLP 4304, patch 14, a 64 x 64 position table, 4 frames
  of time table, 2 x 2 temporal-merge kernel.
- MiniCPM-V 4.6: SigLIP-so400m, 27 layers, hidden 1152, 16 heads, MLP 4304, patch 14, 980 px (70 x 70) position
  table, the window merger after layer 6.
- Llama 4 Scout: 34 layers, hidden 1408, 16 heads, MLP 5632, 336 px tiles of patch 14, pixel shuffle to
  4096-wide tokens.

``layers`` names the config key of the depth; the GPU tests cut it to ``test_depth`` (the released depth is in
``full``).
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs


@attrs.frozen
class FamilyGeometry:
    """One family's tower at real geometry: ``model`` and ``config`` as ``"module:Class"``, ``full`` the config
    kwargs, ``layers`` the depth key; ``test_depth`` the depth the GPU tests build (random weights)."""

    name: str
    label: str
    model: str
    config: str
    full: dict[str, Any]
    layers: str
    test_depth: int = 8
    tokens_per_448px: int = 256
    """Budget units of one 448 x 448 image (Llama 4: tiles per 336 px tile, 1)."""

    def build(self, depth: int | None = None, dtype: Any = None, **overrides: Any) -> Any:
        """The tower with random weights (seeded) in ``dtype``, on the current default device, eval mode.

        Built in ``dtype`` rather than cast after: ``Module.to(bfloat16)`` would also cast Llama 4's complex rotary
        table to a real one (dropping its imaginary part)."""
        import torch

        config_class = _load(self.config)
        kwargs = {**self.full, self.layers: self.test_depth if depth is None else depth, **overrides}
        torch.manual_seed(0)
        tower = _load(self.model)._from_config(config_class(**kwargs), dtype=dtype or torch.bfloat16)
        with torch.no_grad():  # zero- or constant-initialised position tables: random values, as trained ones
            for name, param in tower.named_parameters():
                if "position_embedding" in name or "pos_embed" in name:
                    param.normal_(std=0.02)
        return tower.eval().requires_grad_(False)


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


_T = "transformers.models"
GEOMETRY: dict[str, FamilyGeometry] = {g.name: g for g in (
    FamilyGeometry(
        "glm4v", "GLM-4.1V-9B tower", f"{_T}.glm4v.modeling_glm4v:Glm4vVisionModel",
        f"{_T}.glm4v.configuration_glm4v:Glm4vVisionConfig",
        dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=13696, out_hidden_size=4096, patch_size=14,
             image_size=336, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu"),
        "depth",
    ),
    FamilyGeometry(
        "qwen3_5", "Qwen3.5-27B tower", f"{_T}.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel",
        f"{_T}.qwen3_5.configuration_qwen3_5:Qwen3_5VisionConfig",
        dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=5120, patch_size=16,
             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
             hidden_act="gelu_pytorch_tanh"),
        "depth", tokens_per_448px=196,  # patch 16: 448 px -> 28 x 28 patches
    ),
    FamilyGeometry(
        "ernie4_5_vl", "ERNIE-4.5-VL-28B tower",
        f"{_T}.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe:Ernie4_5_VLMoeVisionTransformerPretrainedModel",
        f"{_T}.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe:Ernie4_5_VLMoeVisionConfig",
        dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=5120, patch_size=14, spatial_merge_size=2,
             hidden_act="quick_gelu"),
        "depth",
    ),
    FamilyGeometry(
        "kimi_k25", "Kimi-K2.5 MoonViT", f"{_T}.kimi_k25.modeling_kimi_k25:Kimi_K25VisionModel",
        f"{_T}.kimi_k25.configuration_kimi_k25:Kimi_K25VisionConfig",
        dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304, patch_size=14,
             pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, merge_kernel_size=[2, 2],
             hidden_act="gelu_pytorch_tanh"),
        "num_hidden_layers",
    ),
    FamilyGeometry(
        "minicpmv4_6", "MiniCPM-V 4.6 SigLIP-so400m", f"{_T}.minicpmv4_6.modeling_minicpmv4_6:MiniCPMV4_6VisionModel",
        f"{_T}.minicpmv4_6.configuration_minicpmv4_6:MiniCPMV4_6VisionConfig",
        dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304, patch_size=14,
             image_size=980, insert_layer_id=6, hidden_act="gelu_pytorch_tanh"),
        "num_hidden_layers",
    ),
    FamilyGeometry(
        "llama4", "Llama 4 Scout tower", f"{_T}.llama4.modeling_llama4:Llama4VisionModel",
        f"{_T}.llama4.configuration_llama4:Llama4VisionConfig",
        dict(num_hidden_layers=34, hidden_size=1408, num_attention_heads=16, intermediate_size=5632, image_size=336,
             patch_size=14, vision_output_dim=4096, projector_input_dim=4096, projector_output_dim=4096,
             pixel_shuffle_ratio=0.5),
        "num_hidden_layers", tokens_per_448px=1,
    ),
)}
