"""Tiny random-weight towers and full models of the packed-grid families added after the seed (GLM-4V and
GLM-4.5V, Qwen3.5 and Qwen3.5-MoE, ERNIE-4.5-VL, Kimi-K2.5, MiniCPM-V 4.6, PaddleOCR-VL, Pixtral in Mistral 3 and
LLaVA, HunYuan-VL, SigLIP2 NaFlex in SigLIP2 and LFM2-VL, Idefics3 and SmolVLM), built locally (no downloads), and
one table :data:`FAMILIES` of what their tests need to know about each: how to call the tower, how its output
fields split into items, whether it has video. Plain functions and records: the test files import them.

Geometry: patch 2, merge 2 (so an item of ``h x w`` patches is ``h*w / 4`` tokens; PaddleOCR-VL and Pixtral merge
outside the tower: ``h*w`` rows), hidden 32, 2 heads, 2-3
layers, fp32, eval mode; learned position tables of 4 x 4 (GLM-4V, Qwen3.5, Kimi, PaddleOCR-VL, HunYuan-VL) or 8 x 8 (MiniCPM), filled with
random values so that resampling them matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch

PATCH = 2
HIDDEN = 32
_TEXT = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64, head_dim=12)


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    # Frozen, as a served tower is: with parameters that require grad, graphed() hands autograd calls to the tower.
    torch.manual_seed(0)
    module = build().eval().requires_grad_(False)
    with torch.no_grad():  # zero- or constant-initialised tables: random values, so that the lookups matter
        for name, param in module.named_parameters():
            if "position_embedding" in name or "pos_embed" in name or name.endswith("class_embedding"):
                param.normal_()
    return module


# -- vision configs (dicts: the full models take them as sub-configs)
GLM_VISION = dict(depth=2, hidden_size=HIDDEN, num_heads=2, out_hidden_size=24, intermediate_size=40, patch_size=PATCH,
                  image_size=8, temporal_patch_size=2, spatial_merge_size=2)
QWEN35_VISION = dict(depth=2, hidden_size=HIDDEN, intermediate_size=64, num_heads=2, out_hidden_size=24,
                     patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
ERNIE_VISION = dict(depth=2, hidden_size=HIDDEN, intermediate_size=64, num_heads=2, patch_size=PATCH,
                    spatial_merge_size=2)
KIMI_VISION = dict(patch_size=PATCH, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4, num_attention_heads=2,
                   num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=64)
PADDLE_VISION = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     image_size=8, patch_size=PATCH, spatial_merge_size=2)
PIXTRAL_VISION = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": PATCH}  # image_size: 16 x 16 patches (5.15's rotary table)
HUNYUAN_VISION = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "patch_size": PATCH, "max_image_size": 8, "spatial_merge_size": 2, "text_hidden_size": 24}
SIGLIP2_VISION = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "patch_size": PATCH, "num_patches": 16}  # a 4 x 4 position table, resized up and down
IDEFICS_VISION = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 16, "patch_size": PATCH}  # an 8 x 8 table at bucketised fractional positions
MINICPM_VISION = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                      image_size=16, patch_size=PATCH, insert_layer_id=1)


def glm4v_tower() -> torch.nn.Module:
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    return _seeded(lambda: Glm4vVisionModel._from_config(Glm4vVisionConfig(**GLM_VISION)))


def glm4v_moe_tower() -> torch.nn.Module:
    from transformers.models.glm4v_moe.configuration_glm4v_moe import Glm4vMoeVisionConfig
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel

    return _seeded(lambda: Glm4vMoeVisionModel._from_config(Glm4vMoeVisionConfig(**GLM_VISION)))


def qwen3_5_tower() -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return _seeded(lambda: Qwen3_5VisionModel._from_config(Qwen3_5VisionConfig(**QWEN35_VISION)))


def qwen3_5_moe_tower() -> torch.nn.Module:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    return _seeded(lambda: Qwen3_5MoeVisionModel._from_config(Qwen3_5MoeVisionConfig(**QWEN35_VISION)))


def ernie_tower() -> torch.nn.Module:
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeVisionConfig
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVisionTransformerPretrainedModel,
    )

    config = Ernie4_5_VLMoeVisionConfig(**ERNIE_VISION)
    return _seeded(lambda: Ernie4_5_VLMoeVisionTransformerPretrainedModel._from_config(config))


def kimi_tower() -> torch.nn.Module:
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    return _seeded(lambda: Kimi_K25VisionModel._from_config(Kimi_K25VisionConfig(**KIMI_VISION)))


def minicpm_tower() -> torch.nn.Module:
    from transformers.models.minicpmv4_6.configuration_minicpmv4_6 import MiniCPMV4_6VisionConfig
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6VisionModel

    return _seeded(lambda: MiniCPMV4_6VisionModel._from_config(MiniCPMV4_6VisionConfig(**MINICPM_VISION)))


def paddle_tower() -> torch.nn.Module:
    from transformers.models.paddleocr_vl.configuration_paddleocr_vl import PaddleOCRVisionConfig
    from transformers.models.paddleocr_vl.modeling_paddleocr_vl import PaddleOCRVisionModel

    return _seeded(lambda: PaddleOCRVisionModel._from_config(PaddleOCRVisionConfig(**PADDLE_VISION)))


def pixtral_tower() -> torch.nn.Module:
    from transformers.models.pixtral.configuration_pixtral import PixtralVisionConfig
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

    return _seeded(lambda: PixtralVisionModel._from_config(PixtralVisionConfig(**PIXTRAL_VISION)))


def hunyuan_tower() -> torch.nn.Module:
    from transformers.models.hunyuan_vl.configuration_hunyuan_vl import (
        HunYuanVLVisionConfig,
    )
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import (
        HunYuanVLVisionTransformer,
    )

    return _seeded(lambda: HunYuanVLVisionTransformer._from_config(HunYuanVLVisionConfig(**HUNYUAN_VISION)))


def siglip2_tower() -> torch.nn.Module:
    from transformers.models.siglip2.configuration_siglip2 import Siglip2VisionConfig
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

    return _seeded(lambda: Siglip2VisionModel._from_config(Siglip2VisionConfig(**SIGLIP2_VISION)))
def idefics3_tower() -> torch.nn.Module:
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    return _seeded(lambda: Idefics3VisionTransformer._from_config(Idefics3VisionConfig(**IDEFICS_VISION)))


def smolvlm_tower() -> torch.nn.Module:
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

    return _seeded(lambda: SmolVLMVisionTransformer._from_config(SmolVLMVisionConfig(**IDEFICS_VISION)))


# -- full models (a one-layer text model each: only their feature functions run)
def glm4v_model() -> torch.nn.Module:
    import transformers as tf

    return _seeded(lambda: tf.Glm4vForConditionalGeneration(tf.Glm4vConfig(vision_config=GLM_VISION, text_config=_TEXT)))


def glm46v_model() -> torch.nn.Module:
    import transformers as tf

    config = tf.Glm46VConfig(vision_config=dict(GLM_VISION, model_type="glm4v_vision"),
                             text_config=dict(_TEXT, model_type="glm4v_text"))
    return _seeded(lambda: tf.Glm46VForConditionalGeneration(config))


def qwen3_5_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, layer_types=["full_attention"])
    return _seeded(lambda: tf.Qwen3_5ForConditionalGeneration(
        tf.Qwen3_5Config(vision_config=QWEN35_VISION, text_config=text)))


def ernie_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, hidden_size=32, head_dim=16, moe_num_experts=2, moe_k=1, moe_intermediate_size=[16, 16],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]})
    return _seeded(lambda: tf.Ernie4_5_VLMoeForConditionalGeneration(
        tf.Ernie4_5_VLMoeConfig(vision_config=ERNIE_VISION, text_config=text)))


def kimi_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64, n_routed_experts=2,
                num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1)
    return _seeded(lambda: tf.Kimi_K25ForConditionalGeneration(
        tf.Kimi_K25Config(vision_config=KIMI_VISION, projection_hidden_size=HIDDEN, text_config=text)))


def minicpm_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, model_type="qwen3_5_text", layer_types=["full_attention"])
    return _seeded(lambda: tf.MiniCPMV4_6ForConditionalGeneration(
        tf.MiniCPMV4_6Config(vision_config=MINICPM_VISION, text_config=text)))


def paddle_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, vocab_size=300)
    return _seeded(lambda: tf.PaddleOCRVLForConditionalGeneration(
        tf.PaddleOCRVLConfig(vision_config=PADDLE_VISION, text_config=text)))


def mistral3_model() -> torch.nn.Module:
    import transformers as tf

    vision = dict(PIXTRAL_VISION, model_type="pixtral")
    return _seeded(lambda: tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
        vision_config=vision, text_config=dict(_TEXT, model_type="mistral"), spatial_merge_size=2)))


def llava_pixtral_model() -> torch.nn.Module:
    """Pixtral-12B's layout: LLaVA with a Pixtral tower."""
    import transformers as tf

    vision = dict(PIXTRAL_VISION, model_type="pixtral")
    config = tf.LlavaConfig(vision_config=vision, text_config=dict(_TEXT, model_type="mistral"),
                            vision_feature_select_strategy="full")  # Pixtral-12B's: every patch
    return _seeded(lambda: tf.LlavaForConditionalGeneration(config))


def hunyuan_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, vocab_size=300)  # the model's config gives the tower the text width (24)
    return _seeded(lambda: tf.HunYuanVLForConditionalGeneration(
        tf.HunYuanVLConfig(vision_config=HUNYUAN_VISION, text_config=text)))


def siglip2_model() -> torch.nn.Module:
    import transformers as tf

    text = {"vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    return _seeded(lambda: tf.Siglip2Model(tf.Siglip2Config(vision_config=SIGLIP2_VISION, text_config=text)))


def lfm2_vl_model() -> torch.nn.Module:
    import transformers as tf

    vision = dict(SIGLIP2_VISION, model_type="siglip2_vision_model", vision_use_head=False)  # LFM2-VL's: no head
    return _seeded(lambda: tf.Lfm2VlForConditionalGeneration(tf.Lfm2VlConfig(
        vision_config=vision, text_config=dict(_TEXT, model_type="lfm2"), downsample_factor=2)))
def idefics3_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, model_type="llama", vocab_size=300)
    return _seeded(lambda: tf.Idefics3ForConditionalGeneration(
        tf.Idefics3Config(vision_config=IDEFICS_VISION, text_config=text, scale_factor=2)))


def smolvlm_model() -> torch.nn.Module:
    import transformers as tf

    text = dict(_TEXT, model_type="llama", vocab_size=300)
    return _seeded(lambda: tf.SmolVLMForConditionalGeneration(
        tf.SmolVLMConfig(vision_config=IDEFICS_VISION, text_config=text, scale_factor=2)))


# -- calling conventions
def strip(rows: torch.Tensor) -> torch.Tensor:
    """Patch rows ``(L, C, P, P)`` as MiniCPM's packed strip ``(1, C, P, L*P)``."""
    return rows.permute(1, 2, 0, 3).reshape(1, rows.shape[1], rows.shape[2], -1)


def padded(rows: torch.Tensor, grid: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch rows ``(L, C, P, P)`` of images ``grid`` as Pixtral's zero-padded images ``(n, C, maxH, maxW)`` and
    their ``image_sizes`` in pixels."""
    c, p = rows.shape[1], rows.shape[-1]
    sizes = grid[:, 1:] * p
    images = rows.new_zeros(grid.shape[0], c, *sizes.max(0).tolist())
    for i, (image, (h, w)) in enumerate(zip(torch.split(rows, grid.prod(1).tolist()), grid[:, 1:].tolist())):
        images[i, :, : h * p, : w * p] = image.reshape(h, w, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, h * p, w * p)
    return images, torch.from_numpy(sizes)


def naflex(rows: torch.Tensor, grid: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Patch rows ``(L, C*P*P)`` of images ``grid`` as SigLIP2 NaFlex's padded batch: ``pixel_values`` ``(n,
    max h*w, C*P*P)`` (zero padding rows), ``pixel_attention_mask`` ``(n, max h*w)`` and ``spatial_shapes``."""
    counts = (grid[:, 1] * grid[:, 2]).tolist()
    pixels = rows.new_zeros(grid.shape[0], max(counts), rows.shape[1])
    mask = torch.zeros(grid.shape[0], max(counts), dtype=torch.long)
    for i, image in enumerate(torch.split(rows, counts)):
        pixels[i, : counts[i]], mask[i, : counts[i]] = image, 1
    return pixels, mask, torch.from_numpy(grid[:, 1:].copy())


def unpad(value: Any, grid: np.ndarray) -> Any:
    """A NaFlex output field without its padding rows: ``(n, L, hidden)`` -> each image's ``h*w`` rows, one after
    the other (the graphed tower's padding rows are zero, the tower's are what its attention makes of them)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        return value
    return torch.cat([value[i, : h * w] for i, (h, w) in enumerate(grid[:, 1:].tolist())])


def masked(rows: torch.Tensor, grid: np.ndarray, side: tuple[int, int] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch rows ``(L, C, P, P)`` of images ``grid`` as the Idefics3 / SmolVLM tower's zero-padded images ``(n, C,
    H, W)`` (``side``: ``(H, W)`` in patches, default the largest image's) and ``patch_attention_mask`` ``(n, H, W)``
    (each image's real patches top-left, as the processors make it)."""
    images, _ = padded(rows, grid)
    rows_, cols_ = grid[:, 1:].max(0).tolist() if side is None else side
    p = rows.shape[-1]
    images = torch.nn.functional.pad(images, (0, cols_ * p - images.shape[-1], 0, rows_ * p - images.shape[-2]))
    mask = torch.zeros(grid.shape[0], rows_, cols_, dtype=torch.bool)
    for i, (h, w) in enumerate(grid[:, 1:].tolist()):
        mask[i, :h, :w] = True
    return images, mask


def frames_grid(grid: np.ndarray) -> np.ndarray:
    """``(t, h, w)`` rows as ``t`` rows ``(1, h, w)``: how GLM-4V's model hands a video to its tower."""
    return np.repeat(np.concatenate((np.ones((grid.shape[0], 1), np.int64), grid[:, 1:]), axis=1), grid[:, 0], 0)


@attrs.frozen
class Family:
    """What the family tests need to know about one family.

    ``fields``: per output field, the dim that counts items and what an item has there: ``"rows"`` (``t*h*w``),
    ``"tokens"`` (``t*h*w / 4``), ``"frame_tokens"`` (``h*w / 4``: Kimi's pooled output) or ``"framed_tokens"``
    (``h/2 * (w/2 + 1) + 2``: HunYuan-VL's merged tokens with a separator after each row, begin and end).
    """

    name: str
    adapter: str
    tower: Callable[[], torch.nn.Module]
    row_shape: tuple[int, ...]
    fields: dict[str, tuple[int, str]]
    model: Callable[[], torch.nn.Module] | None = None
    tower_attr: str = "visual"
    max_t: int = 1
    """Frames of the longest video item (1: the tower takes no video, or takes a video as its frames)."""
    video_t: int = 2
    """Frames of the video the full model's ``get_video_features`` test sends (0: none)."""
    tower_tests: bool = True
    """False: the family's tower is another family's (GLM-4.6V's is GLM-4.1V's): only its model is tested."""
    min_transformers: str = "5.15"
    """The lowest transformers the adapter takes (the tests skip below it)."""
    tower_merge: int = 2
    """The spatial merge inside the tower (1: PaddleOCR-VL's merges in its projector; any h, w is an item)."""
    odd_grids_to_tower: bool = False
    """True: an image whose h or w is not a multiple of the merge is the tower's own call, not refused (HunYuan-VL's
    merger drops its last row or column)."""
    call_style: str = "grid"
    """``"grid"``: ``tower(rows, grid_thw=...)``; ``"glm"``: the same, frames flattened for the tower itself;
    ``"strip"``: ``tower(strip, target_sizes=...)`` (MiniCPM); ``"batch1"``: ``tower(rows[None], grid_thw)``
    (PaddleOCR-VL); ``"padded"``: ``tower(images, image_sizes=...)`` (Pixtral: :func:`padded`); ``"naflex"``:
    ``tower(pixel_values, pixel_attention_mask, spatial_shapes)`` (SigLIP2 NaFlex: :func:`naflex`; fields split per
    image, padding rows dropped); ``"mask"``: ``tower(images, patch_attention_mask=...)`` (Idefics3, SmolVLM:
    :func:`masked`)."""
    base_attr: str = "model"
    """Where the model's feature functions live (``""``: the model itself, SigLIP2's)."""
    holds_hidden: bool = False
    """The adapter answers ``output_hidden_states`` from its graphs (Pixtral: its models always ask)."""

    def skip_if_unsupported(self, module: bool = False) -> None:
        """Skip the test (``module``: the whole test module) below the transformers the adapter needs."""
        from encgraph.models._hf import _parse, transformers_version

        installed = transformers_version() or "0"
        if _parse(installed) < _parse(self.min_transformers):
            pytest.skip(f"the {self.name} adapter needs transformers>={self.min_transformers}, found {installed}",
                        allow_module_level=module)

    def pixels(self, grid: np.ndarray, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = int(grid.prod(1).sum())
        return torch.randn(rows, *self.row_shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

    def call(self, module: torch.nn.Module, rows: torch.Tensor, grid: np.ndarray, reference: bool = False,
             **kwargs: Any) -> Any:
        """Run ``module`` (the tower, or its graphed drop-in) on ``rows`` / ``grid`` in the family's convention;
        ``reference``: the tower itself (GLM-4V's takes videos as their frames)."""
        # Grids on the rows' device, as a model hands them over (some towers index with them on the device).
        if self.call_style == "strip":
            return module(strip(rows), target_sizes=torch.from_numpy(grid[:, 1:]).to(rows.device), **kwargs)
        if self.call_style == "padded":
            images, sizes = padded(rows, grid)
            return module(images, image_sizes=sizes.to(rows.device), **kwargs)
        if self.call_style == "naflex":
            pixels, mask, shapes = naflex(rows, grid)
            return module(pixels, mask.to(rows.device), shapes.to(rows.device), **kwargs)
        if self.call_style == "mask":
            images, mask = masked(rows, grid)
            return module(images, patch_attention_mask=mask.to(rows.device), **kwargs)
        if self.call_style == "batch1":  # PaddleOCR-VL: its model hands the tower one packed batch
            return module(rows.unsqueeze(0), torch.from_numpy(grid).to(rows.device), **kwargs)
        if self.call_style == "glm" and reference:
            grid = frames_grid(grid)
        return module(rows, torch.from_numpy(grid).to(rows.device), **kwargs)

    def feature_calls(self) -> list[tuple[str, Any]]:
        """``(name, args)`` (a tuple, or a dict of keywords) of the full model's feature functions to test: four
        images (one over the test ladder's largest budget) and, where the family has video, two videos (MiniCPM:
        one video of 2 frames, in its video processor's layout ``(frames, C, P, h*w*P)``)."""
        images = np.array([[1, 4, 8], [1, 12, 12], [1, 4, 4], [1, 8, 4]])  # MiniCPM's merger: multiples of 4
        calls: list[tuple[str, Any]] = []
        if self.call_style == "strip":
            calls.append(("get_image_features", (strip(self.pixels(images)), torch.from_numpy(images[:, 1:]))))
            video = np.array([[1, 4, 8]] * self.video_t)
            frames = self.pixels(video, seed=1).reshape(self.video_t, 32, *self.row_shape)
            calls.append(("get_video_features", (torch.cat([strip(f) for f in frames]), torch.from_numpy(video[:1, 1:]))))
            return calls
        if self.call_style == "padded":  # by keyword: LLaVA's second parameter is vision_feature_layer
            pixels, sizes = padded(self.pixels(images), images)
            return [("get_image_features", {"pixel_values": pixels, "image_sizes": sizes})]
        if self.call_style == "naflex":
            pixels, mask, shapes = naflex(self.pixels(images), images)
            return [("get_image_features", {"pixel_values": pixels, "pixel_attention_mask": mask,
                                            "spatial_shapes": shapes})]
        if self.call_style == "mask":  # (batch, images, C, H, W) with an all-zero padding image, and pixel masks
            return [("get_image_features", _pixel_masked(self.pixels(images), images, 2))] + (
                [("get_image_features", _pixel_masked(self.pixels(np.array([[1, 4, 4]] * 4), seed=1),
                                                      np.array([[1, 4, 4]] * 4), 2))] if self.video_t else [])
        calls.append(("get_image_features", (self.pixels(images), torch.from_numpy(images))))
        if self.video_t:
            videos = np.array([[self.video_t, 4, 4], [self.video_t, 2, 4]])
            calls.append(("get_video_features", (self.pixels(videos, seed=1), torch.from_numpy(videos))))
        return calls

    def counts(self, grid: np.ndarray, kind: str) -> list[int]:
        if kind == "patches":  # one padded image per item
            return [1] * grid.shape[0]
        t, hw = grid[:, 0], grid[:, 1] * grid[:, 2]
        framed = (grid[:, 1] // 2) * (grid[:, 2] // 2 + 1) + 2
        return {"rows": t * hw, "tokens": t * hw // 4, "frame_tokens": hw // 4, "framed_tokens": framed}[kind].tolist()

    def split(self, out: Any, grid: np.ndarray) -> list[dict[str, torch.Tensor]]:
        """Per item, every field of ``out`` (which must be exactly :attr:`fields`)."""
        assert sorted(k for k, v in out.items() if v is not None) == sorted(self.fields), list(out.keys())
        if self.call_style == "naflex":  # (n, L, hidden) and (n, hidden): image i's rows and vector
            hw = (grid[:, 1] * grid[:, 2]).tolist()
            return [{name: out[name][i, : hw[i]] if out[name].dim() == 3 else out[name][i] for name in self.fields}
                    for i in range(grid.shape[0])]
        parts = {name: torch.split(out[name], self.counts(grid, kind), dim=dim)
                 for name, (dim, kind) in self.fields.items()}
        if any(kind == "patches" for _, kind in self.fields.values()):  # each image's real patches (top-left)
            side = grid[:, 1:].max(0).tolist()
            hw = grid[:, 1:].tolist()
            parts = {name: [p[0].unflatten(0, side)[:h, :w].flatten(0, 1) for p, (h, w) in zip(ps, hw)]
                     for name, ps in parts.items()}
        return [{name: p[i] for name, p in parts.items()} for i in range(grid.shape[0])]


_QWEN_FIELDS = {"last_hidden_state": (0, "rows"), "pooler_output": (0, "tokens")}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("glm4v", "Glm4vAdapter", glm4v_tower, (24,), {"last_hidden_state": (0, "tokens"),
           "pooler_output": (0, "tokens")}, glm4v_model, max_t=3, call_style="glm"),
    Family("glm4v_moe", "Glm4vAdapter", glm4v_moe_tower, (24,), {"last_hidden_state": (0, "tokens"),
           "pooler_output": (0, "tokens")}, max_t=3, call_style="glm"),
    Family("glm46v", "Glm4vAdapter", glm4v_tower, (24,), {"last_hidden_state": (0, "tokens"),
           "pooler_output": (0, "tokens")}, glm46v_model, max_t=3, call_style="glm", tower_tests=False),
    Family("qwen3_5", "Qwen35VLAdapter", qwen3_5_tower, (24,), _QWEN_FIELDS, qwen3_5_model, max_t=3),
    Family("qwen3_5_moe", "Qwen35VLAdapter", qwen3_5_moe_tower, (24,), _QWEN_FIELDS, max_t=3),
    Family("ernie4_5_vl", "Ernie45VLAdapter", ernie_tower, (12,), {"last_hidden_state": (0, "rows")}, ernie_model,
           tower_attr="vision_tower", max_t=4),
    Family("kimi_k25", "KimiK25Adapter", kimi_tower, (3, PATCH, PATCH), {"last_hidden_state": (0, "rows"),
           "pooler_output": (0, "frame_tokens")}, kimi_model, tower_attr="vision_tower", max_t=4,
           min_transformers="5.24"),
    Family("paddleocr_vl", "PaddleOCRVLAdapter", paddle_tower, (3, PATCH, PATCH), {"last_hidden_state": (0, "rows")},
           paddle_model, video_t=0, tower_merge=1, call_style="batch1"),
    Family("pixtral", "PixtralAdapter", pixtral_tower, (3, PATCH, PATCH), {"last_hidden_state": (1, "rows")},
           mistral3_model, tower_attr="vision_tower", video_t=0, tower_merge=1, call_style="padded",
           holds_hidden=True),
    Family("pixtral_llava", "PixtralAdapter", pixtral_tower, (3, PATCH, PATCH), {"last_hidden_state": (1, "rows")},
           llava_pixtral_model, tower_attr="vision_tower", video_t=0, tower_merge=1, call_style="padded",
           holds_hidden=True, tower_tests=False),
    Family("hunyuan_vl", "HunYuanVLAdapter", hunyuan_tower, (3 * PATCH * PATCH,), {"last_hidden_state": (1, "rows"),
           "pooler_output": (1, "framed_tokens")}, hunyuan_model, tower_attr="vision_tower", video_t=0,
           odd_grids_to_tower=True),
    Family("siglip2", "Siglip2Adapter", siglip2_tower, (3 * PATCH * PATCH,), {"last_hidden_state": (1, "rows"),
           "pooler_output": (0, "items")}, siglip2_model, tower_attr="vision_model", video_t=0, tower_merge=1,
           call_style="naflex", base_attr=""),
    Family("lfm2_vl", "Siglip2Adapter", siglip2_tower, (3 * PATCH * PATCH,), {"last_hidden_state": (1, "rows")},
           lfm2_vl_model, tower_attr="vision_tower", video_t=0, tower_merge=1, call_style="naflex",
           tower_tests=False),
    Family("idefics3", "Idefics3Adapter", idefics3_tower, (3, PATCH, PATCH), {"last_hidden_state": (0, "patches")},
           idefics3_model, tower_attr="vision_model", video_t=0, tower_merge=1, call_style="mask", holds_hidden=True),
    # SmolVLM's video frames reach the tower as images: video_t > 0 sends a batch of frames through get_image_features.
    Family("smolvlm", "Idefics3Adapter", smolvlm_tower, (3, PATCH, PATCH), {"last_hidden_state": (0, "patches")},
           smolvlm_model, tower_attr="vision_model", tower_merge=1, call_style="mask", holds_hidden=True),
    Family("minicpmv4_6", "MiniCPMVAdapter", minicpm_tower, (3, PATCH, PATCH), {"last_hidden_state": (1, "tokens")},
           minicpm_model, tower_attr="vision_tower", min_transformers="5.24", call_style="strip"),
)}


def _pixel_masked(rows: torch.Tensor, grid: np.ndarray, samples: int) -> dict[str, torch.Tensor]:
    """Idefics3 / SmolVLM ``get_image_features`` arguments: the images of ``grid`` zero-padded to one square side
    (the connector's pixel shuffle needs it), split over ``samples`` rows of the batch, each row then padded with an
    all-zero image (the model drops it), and the pixel-level ``pixel_attention_mask``."""
    side = int(grid[:, 1:].max())
    images, mask = masked(rows, grid, (side, side))
    p = rows.shape[-1]
    pixel_mask = mask.repeat_interleave(p, 1).repeat_interleave(p, 2).long()
    per = -(-grid.shape[0] // samples)
    chunks, masks = [], []
    for s in range(samples):
        part, part_mask = images[s * per:(s + 1) * per], pixel_mask[s * per:(s + 1) * per]
        k = per + 1 - part.shape[0]  # padding slots: every sample has per + 1 images
        chunks.append(torch.cat([part, part.new_zeros(k, *part.shape[1:])]))
        masks.append(torch.cat([part_mask, part_mask.new_zeros(k, *part_mask.shape[1:])]))
    return {"pixel_values": torch.stack(chunks), "pixel_attention_mask": torch.stack(masks)}


def random_grid(gen: np.random.Generator, n: int, family: Family, max_side: int = 12) -> np.ndarray:
    """``n`` items of ``h, w`` in ``2..max_side`` patches (even); where the family takes videos, about a third
    of them videos of ``2..max_t`` frames."""
    t = np.where(gen.random(n) < 0.35, gen.integers(2, family.max_t + 1, n), 1) if family.max_t > 1 else np.ones(n)
    hw = gen.integers(1, max_side // 2 + 1, (n, 2)) * 2
    return np.concatenate([t[:, None], hw], axis=1).astype(np.int64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def require(name: str) -> Family:
    """The family ``name`` for a test module of its own, skipped as a whole below the transformers it needs."""
    family = FAMILIES[name]
    family.skip_if_unsupported(module=True)
    return family
