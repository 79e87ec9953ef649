"""The tower table: every tower a benchmark can build, one :class:`TowerSpec` row each.

A row names the transformers config and model classes (``"module:Class"``, imported only when the tower is
built), the config at real geometry (``full``) and the overrides that make it tiny for the CPU smoke (``tiny``),
how the tower takes its inputs (``kind``: which input builder of :mod:`benches.lib.cases` makes a call's
tensors), where its geometry facts live in its config (``facts``, default per kind) and the transformers
version it needs. Adding a tower is adding a row::

    TowerSpec(
        "glm4v_9b", "GLM-4.1V-9B tower", TowerKind.PACKED,
        model="transformers.models.glm4v.modeling_glm4v:Glm4vVisionModel",
        config="transformers.models.glm4v.configuration_glm4v:Glm4vVisionConfig",
        full=dict(depth=24, hidden_size=1536, ...), tiny=dict(TINY_PACKED, depth=2),
        transformers="5.24",
    ),

A tower that stores a fact elsewhere (ERNIE-4.5-VL has no temporal patch) says so in ``facts``
(``Facts(temporal_patch=1)``); a tower that takes another input layout adds a :class:`TowerKind` (its default
facts in ``DEFAULT_FACTS``) and its builders in :mod:`benches.lib.cases`.

The rows of the families added after the seed (:data:`FAMILY_TOWERS`) are the one table of their real geometry:
the GPU tests build their towers from these rows too (``tests/gpu/family_geometry.py``, Gemma-4 and Step-3.7 in
``tests/models/fixtures_multipath.py``), with the depth cut. Sources: the transformers config docstrings'
checkpoints (their defaults are those models' values) and the models' published ``config.json``:

- GLM-4.1V-9B (and GLM-4.6V; GLM-4.5V's tower has the same shape): depth 24, hidden 1536, 12 heads, MLP 13696,
  patch 14, merge 2, output 4096, a 336 px (24 x 24) position table.
- Qwen3.5-27B: depth 27, hidden 1152, 16 heads, MLP 4304, patch 16, merge 2, a 48 x 48 position table, output
  5120 (the 27B text model's width).
- ERNIE-4.5-VL-28B-A3B: depth 32, hidden 1280, 16 heads, MLP 5120, patch 14, merge 2 (no temporal patch).
- Kimi-K2.5 (MoonViT): 27 layers, hidden 1152, 16 heads, MLP 4304, patch 14, a 64 x 64 position table, 4 frames
  of time table, 2 x 2 temporal-merge kernel.
- MiniCPM-V 4.6: SigLIP-so400m, 27 layers, hidden 1152, 16 heads, MLP 4304, patch 14, 980 px (70 x 70) position
  table, the window merger after layer 6.
- Pixtral-12B (Mistral-Small-3.1's tower has the same shape): 24 layers, hidden 1024, 16 heads, MLP 4096, patch
  16, images of at most 1024 px a side, rotary theta 10000, SiLU.
- HunyuanOCR (HunYuan-VL; its config docstring's checkpoint, tencent/HunyuanOCR): 27 layers, hidden 1152, 16 heads,
  MLP 4304, GELU, patch 16, merge 2 (in the tower's merger), a 2048 px (128 x 128) position table: the vision
  config's defaults (the processor's defaults, 512 to 2048 px, agree); the merger projects to 1024, the width of
  HunyuanOCR's 0.5B text model as published descriptions of its merger give it (``Linear(4608, 1024)``; the model
  config sets ``text_hidden_size`` to the text width, over the vision config's 3072). Not checked against the
  checkpoint's ``config.json``.
- SigLIP2-so400m NaFlex (google/siglip2-so400m-patch16-naflex; LFM2-VL-1.6B's tower is the same SigLIP2 so400m
  NaFlex): 27 layers, hidden 1152, 16 heads, MLP 4304, patch 16, a 16 x 16 position table (256 entries), the
  attention-pooling head, the processor's ``max_num_patches`` 256 (LFM2-VL's processor allows up to 1024 a tile,
  and has no head). The so400m widths as SigLIP so400m's published configs give them; not checked against the
  NaFlex checkpoint's ``config.json``.
- SmolVLM2-2.2B (and Idefics3-8B, whose tower is the same at 364 px tiles): SigLIP-so400m, 27 layers, hidden 1152,
  16 heads, MLP 4304, patch 14, 384 px tiles (27 x 27 patches), a 27 x 27 position table at bucketised fractional
  positions; the processor resizes an image's longest edge to 4 tiles (1536 px) and cuts it into tiles plus a global
  one (SmolVLM-Instruct's published ``preprocessor_config.json``: ``max_image_size`` 384, ``size`` 1536; SmolVLM2's
  smaller checkpoints use 512 and 2048). Not checked against SmolVLM2-2.2B's own ``config.json``.
- Llama 4 Scout: 34 layers, hidden 1408, 16 heads, MLP 5632, 336 px tiles of patch 14, pixel shuffle to
  4096-wide tokens.
- Gemma-4's vision tower: 16 layers of 768, 12 heads (as many KV heads), head 64, MLP 3072, patch 16, pooling
  3 x 3 patches into a soft token, a 10240-entry position table, standardised outputs.
- Step-3.7: 47 layers of 1536, 16 heads, MLP 8960, patch 14, 728 px global views and 504 px crops, two stride-2
  downsamplers and the projector into the 4096-wide text model (built as ``Step3p7Model`` with a one-layer text
  stub: the benchmark calls ``get_image_features``, never the language model).

Their ``tiny`` overrides keep the real patch sizes and position tables (so a case has its real token counts)
and shrink widths and depth, as the seed's rows do.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping
from typing import Any

import attrs

from benches.lib.env import Env


class TowerKind(enum.Enum):
    """How a tower takes its inputs (the input builder and size rules of :mod:`benches.lib.cases`)."""

    PACKED = "packed"
    """Qwen-VL style: ``(pixel rows (patches, C*T*P*P), grid_thw (items, 3))``, any image size, videos."""
    FIXED = "fixed"
    """SigLIP, InternViT style: ``pixel_values (tiles, C, S, S)`` at the tower's one resolution."""
    PATCHES = "patches"
    """Kimi-K2.5 style: the packed layout with one patch per row, ``(patches, C, P, P)``, + ``grid_thw``."""
    BATCH1 = "batch1"
    """PaddleOCR-VL style: the ``PATCHES`` rows with the model's leading batch of one, ``(1, patches, C, P, P)``,
    + ``grid_thw`` (the processor's sides multiples of patch x merge; the tower itself merges nothing)."""
    IMAGES = "images"
    """Pixtral style: zero-padded images ``(images, C, maxH, maxW)`` + ``image_sizes (images, 2)`` in pixels (sides
    multiples of the patch; the tower merges nothing)."""
    NAFLEX = "naflex"
    """SigLIP2 NaFlex style: each image's patch rows padded to ``max_num_patches``, ``(images, rows, C*P*P)``, +
    ``pixel_attention_mask (images, rows)`` + ``spatial_shapes (images, 2)`` in patches."""
    STRIP = "strip"
    """MiniCPM-V style: one strip of patches ``(1, C, P, patches * P)`` + ``target_sizes (images, 2)``."""
    PADDED = "padded"
    """Gemma-4 style: patches padded per image, ``(images, rows, C*P*P)``, + ``pixel_position_ids``."""
    MASKED = "masked"
    """Idefics3 / SmolVLM style: square tiles ``(tiles, C, S, S)`` + ``patch_attention_mask (tiles, S/P, S/P)``
    (the tower merges nothing; the model's connector does)."""
    VIEWS = "views"
    """Step-3.7 style: the model's ``get_image_features(global views (B, C, S, S), local crops, crops per
    image)``."""


@attrs.frozen
class Facts:
    """Where a tower's geometry lives in its config: each field names a config attribute (dotted for a
    sub-config's), or is the value itself (an ``int``). A list or tuple value (``patch_size=[14, 14]``) counts by
    its first element."""

    patch: str | int = "patch_size"
    merge: str | int = "spatial_merge_size"
    temporal_patch: str | int = "temporal_patch_size"
    channels: str | int = "in_channels"
    image_size: str | int | None = None
    """The one side a fixed-resolution tower takes, or a global view's (``None``: any size)."""

    def read(self, kind: TowerKind, config: Any) -> Geometry:
        def value(fact: str | int | None) -> int | None:
            if fact is None:
                return None
            raw = fact
            if isinstance(fact, str):  # "vision_config.patch_size": an attribute of a sub-config
                raw = config
                for part in fact.split("."):
                    raw = getattr(raw, part)
            return int(raw[0] if isinstance(raw, (list, tuple)) else raw)

        patch, merge, temporal, channels = (value(f) for f in (self.patch, self.merge, self.temporal_patch,
                                                               self.channels))
        return Geometry(kind, patch, merge, temporal, value(self.image_size), channels)  # type: ignore[arg-type]


_STEP = "vision_config."
DEFAULT_FACTS: dict[TowerKind, Facts] = {
    TowerKind.PACKED: Facts(),
    TowerKind.FIXED: Facts(merge=1, temporal_patch=1, channels="num_channels", image_size="image_size"),
    TowerKind.PATCHES: Facts(merge="merge_kernel_size", temporal_patch=1, channels=3),
    TowerKind.BATCH1: Facts(temporal_patch=1, channels="num_channels"),
    TowerKind.IMAGES: Facts(merge=1, temporal_patch=1, channels="num_channels"),
    TowerKind.NAFLEX: Facts(merge=1, temporal_patch=1, channels="num_channels"),
    TowerKind.STRIP: Facts(merge="window_kernel_size", temporal_patch=1, channels="num_channels"),
    TowerKind.PADDED: Facts(merge="pooling_kernel_size", temporal_patch=1, channels=3),
    TowerKind.MASKED: Facts(merge=1, temporal_patch=1, channels="num_channels", image_size="image_size"),
    TowerKind.VIEWS: Facts(patch=f"{_STEP}patch_size", merge=1, temporal_patch=1, channels=f"{_STEP}num_channels",
                           image_size=f"{_STEP}image_size"),
}
"""Where each kind's geometry lives by default: Qwen-VL's names (``PACKED``), SigLIP's (``FIXED``), Kimi-K2.5's,
MiniCPM-V's (``merge``: the window merger's side), Gemma-4's (``merge``: the pooling kernel), Step-3.7's (its
vision sub-config; ``image_size`` the global view's side)."""


@attrs.frozen
class Geometry:
    """What input sizes a tower takes: patch side, merge factor, temporal patch, fixed image side (or None)."""

    kind: TowerKind
    patch: int
    merge: int
    temporal_patch: int
    image_size: int | None
    channels: int

    @classmethod
    def of(cls, kind: TowerKind, config: Any, facts: Facts | None = None) -> Geometry:
        return (facts or DEFAULT_FACTS[kind]).read(kind, config)

    @property
    def factor(self) -> int:
        """Image sides are rounded to multiples of this (patch x merge)."""
        return self.patch * self.merge

    @property
    def row_size(self) -> int:
        """Values per pixel row of a packed tower (``C * T * P * P``)."""
        return self.channels * self.temporal_patch * self.patch * self.patch


@attrs.frozen
class TowerSpec:
    """One row of the tower table (see the module docstring)."""

    name: str
    label: str
    kind: TowerKind
    model: str = attrs.field(kw_only=True)  # "module:Class"
    config: str = attrs.field(kw_only=True)  # "module:Class"
    full: Mapping[str, Any] = attrs.field(kw_only=True)
    tiny: Mapping[str, Any] = attrs.field(kw_only=True)
    facts: Facts | None = attrs.field(default=None, kw_only=True)
    transformers: str = attrs.field(default="5.15", kw_only=True)
    """The lowest transformers version that has the tower (older ones report it unavailable)."""
    features: str | None = attrs.field(default=None, kw_only=True)
    """The model function the benchmark calls instead of ``forward`` (Step-3.7: ``get_image_features``); the
    ``defaults`` system is then the adapter's shim of it over a default runner (``graphed()`` stands in for a
    forward only)."""
    cases: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)
    """The cases ``towers.py`` runs for this tower when ``--cases`` is not given (``None``: the script's)."""

    def config_class(self) -> Any:
        return _load(self.config)

    def model_class(self) -> Any:
        return _load(self.model)

    def make_config(self, tiny: bool) -> Any:
        """The config at real geometry, or with ``tiny``'s overrides on top."""
        return self.config_class()(**{**self.full, **(self.tiny if tiny else {})})

    def geometry(self, tiny: bool) -> Geometry:
        return Geometry.of(self.kind, self.make_config(tiny), self.facts)

    def missing(self) -> str | None:
        """Why this tower cannot be built here (an older transformers), or ``None``."""
        try:
            import transformers
            from packaging.version import Version

            if Version(transformers.__version__) < Version(self.transformers):
                return f"needs transformers >= {self.transformers}, found {transformers.__version__}"
            self.model_class()
            self.config_class()
        except (ImportError, AttributeError) as exc:
            return f"cannot import it ({type(exc).__name__}: {exc})"
        return None


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _table(*specs: TowerSpec) -> dict[str, TowerSpec]:
    table: dict[str, TowerSpec] = {}
    for spec in specs:
        if spec.name in table:
            raise ValueError(f"tower table: {spec.name!r} appears twice")
        table[spec.name] = spec
    return table


_Q25 = "transformers.models.qwen2_5_vl"
_Q3 = "transformers.models.qwen3_vl"
_SIGLIP = dict(model="transformers:SiglipVisionModel", config="transformers:SiglipVisionConfig")
_SIGLIP_FULL = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    patch_size=14)
TINY_PACKED = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48)
"""Tiny widths of a packed (Qwen-VL style) tower for the CPU smoke; rows add depth and their own indexes."""
TINY_FIXED = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
"""Tiny widths of a fixed-resolution tower (rows add their tiny image side), and of most family towers (their
Hugging Face names are SigLIP's)."""

_CORE_ROWS = (
    TowerSpec(
        "qwen2_5_vl_7b", "Qwen2.5-VL-7B tower", TowerKind.PACKED,
        model=f"{_Q25}.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
        config=f"{_Q25}.configuration_qwen2_5_vl:Qwen2_5_VLVisionConfig",
        full=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
        tiny=dict(TINY_PACKED, depth=2, window_size=56, fullatt_block_indexes=[1]),
    ),
    TowerSpec(
        "qwen3_vl_8b", "Qwen3-VL-8B tower", TowerKind.PACKED,
        model=f"{_Q3}.modeling_qwen3_vl:Qwen3VLVisionModel",
        config=f"{_Q3}.configuration_qwen3_vl:Qwen3VLVisionConfig",
        full=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
        tiny=dict(TINY_PACKED, depth=3, num_position_embeddings=64, deepstack_visual_indexes=[1]),
    ),
    TowerSpec(
        "siglip_so400m_224", "SigLIP-so400m 224 px", TowerKind.FIXED, **_SIGLIP,
        full=dict(_SIGLIP_FULL, image_size=224), tiny=dict(TINY_FIXED, image_size=28),
    ),
    TowerSpec(
        "siglip_so400m_384", "SigLIP-so400m 384 px", TowerKind.FIXED, **_SIGLIP,
        full=dict(_SIGLIP_FULL, image_size=384), tiny=dict(TINY_FIXED, image_size=42),
    ),
    TowerSpec(
        "internvit_300m", "InternViT-300M 448 px", TowerKind.FIXED,
        model="transformers.models.internvl.modeling_internvl:InternVLVisionModel",
        config="transformers.models.internvl.configuration_internvl:InternVLVisionConfig",
        full=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  patch_size=[14, 14], image_size=[448, 448], attention_bias=True, use_qk_norm=False,
                  hidden_act="gelu", layer_scale_init_value=0.1, norm_type="layer_norm", use_mean_pooling=True),
        tiny=dict(TINY_FIXED, image_size=[56, 56]),
    ),
)
FAMILY_CASES = ("1x448", "8x336")
"""The cases of the family rows (``benches.lib.cases``; each family sees them as its processor makes them)."""
NEWER_FAMILY_CASES = ("1x448", "photo", "8x336")
"""The cases of the families of issue 58 (PaddleOCR-VL, Pixtral, HunYuan-VL, SigLIP2 NaFlex, SmolVLM): also one
photo at the processor's default maximum (``cases.PHOTO_CASE``)."""
_T = "transformers.models"
_STEP_VISION = dict(num_hidden_layers=47, hidden_size=1536, intermediate_size=8960, num_attention_heads=16,
                    image_size=728, patch_size=14)
_STEP_TEXT = dict(vocab_size=64, hidden_size=4096, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, intermediate_size=64, mlp_layer_types=["dense"], layer_types=["full_attention"])
"""A one-layer stub of Step-3.7's text model: only its width matters (the projector's output, 4096)."""


def _family(name: str, label: str, kind: TowerKind, model: str, config: str, **fields: Any) -> TowerSpec:
    """A family row: ``model`` and ``config`` are class names in ``transformers.models.<name>``."""
    fields.setdefault("cases", FAMILY_CASES)
    return TowerSpec(name, label, kind, model=f"{_T}.{name}.modeling_{name}:{model}",
                     config=f"{_T}.{name}.configuration_{name}:{config}", **fields)


_FAMILY_ROWS = (
    _family("glm4v", "GLM-4.1V-9B tower", TowerKind.PACKED, "Glm4vVisionModel", "Glm4vVisionConfig",
            full=dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=13696, out_hidden_size=4096,
                      patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu"),
            tiny=dict(TINY_PACKED, depth=2)),
    _family("qwen3_5", "Qwen3.5-27B tower", TowerKind.PACKED, "Qwen3_5VisionModel", "Qwen3_5VisionConfig",
            full=dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=5120,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      hidden_act="gelu_pytorch_tanh"),
            tiny=dict(TINY_PACKED, depth=2)),
    _family("ernie4_5_vl_moe", "ERNIE-4.5-VL-28B tower", TowerKind.PACKED,
            "Ernie4_5_VLMoeVisionTransformerPretrainedModel", "Ernie4_5_VLMoeVisionConfig",
            full=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=5120, patch_size=14,
                      spatial_merge_size=2, hidden_act="quick_gelu"),
            tiny=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2), facts=Facts(temporal_patch=1)),
    _family("kimi_k25", "Kimi-K2.5 MoonViT", TowerKind.PATCHES, "Kimi_K25VisionModel", "Kimi_K25VisionConfig",
            full=dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
                      patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, merge_kernel_size=[2, 2],
                      hidden_act="gelu_pytorch_tanh"),
            tiny=TINY_FIXED, transformers="5.24"),
    _family("minicpmv4_6", "MiniCPM-V 4.6 SigLIP-so400m", TowerKind.STRIP, "MiniCPMV4_6VisionModel",
            "MiniCPMV4_6VisionConfig",
            full=dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
                      patch_size=14, image_size=980, insert_layer_id=6, hidden_act="gelu_pytorch_tanh"),
            tiny=dict(TINY_FIXED, insert_layer_id=0), transformers="5.24"),
    _family("paddleocr_vl", "PaddleOCR-VL-0.9B tower", TowerKind.BATCH1, "PaddleOCRVisionModel",
            "PaddleOCRVisionConfig",
            full=dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
                      patch_size=14, image_size=384, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh"),
            tiny=dict(TINY_FIXED, image_size=56, spatial_merge_size=2), cases=NEWER_FAMILY_CASES),
    _family("pixtral", "Pixtral-12B tower", TowerKind.IMAGES, "PixtralVisionModel", "PixtralVisionConfig",
            full={"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
                  "patch_size": 16, "image_size": 1024, "rope_theta": 10000.0, "hidden_act": "silu"},
            tiny=TINY_FIXED, cases=NEWER_FAMILY_CASES),
    _family("hunyuan_vl", "HunyuanOCR tower", TowerKind.PACKED, "HunYuanVLVisionTransformer", "HunYuanVLVisionConfig",
            full={"num_hidden_layers": 27, "hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 4304,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 1, "max_image_size": 2048,
                  "text_hidden_size": 1024, "hidden_act": "gelu", "interpolate_mode": "bilinear"},
            tiny=dict(TINY_FIXED, text_hidden_size=48), facts=Facts(channels="num_channels"), cases=NEWER_FAMILY_CASES),
    _family("siglip2", "SigLIP2-so400m NaFlex tower", TowerKind.NAFLEX, "Siglip2VisionModel", "Siglip2VisionConfig",
            full={"num_hidden_layers": 27, "hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 4304,
                  "patch_size": 16, "num_patches": 256, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": True},
            tiny=TINY_FIXED, cases=NEWER_FAMILY_CASES),
    _family("smolvlm", "SmolVLM2-2.2B tower", TowerKind.MASKED, "SmolVLMVisionTransformer", "SmolVLMVisionConfig",
            full={"num_hidden_layers": 27, "hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 4304,
                  "patch_size": 14, "image_size": 384, "hidden_act": "gelu_pytorch_tanh"},
            tiny=dict(TINY_FIXED, image_size=56), cases=NEWER_FAMILY_CASES),
    _family("llama4", "Llama 4 Scout tower", TowerKind.FIXED, "Llama4VisionModel", "Llama4VisionConfig",
            full=dict(num_hidden_layers=34, hidden_size=1408, num_attention_heads=16, intermediate_size=5632,
                      image_size=336, patch_size=14, vision_output_dim=4096, projector_input_dim=4096,
                      projector_output_dim=4096, pixel_shuffle_ratio=0.5),
            # The pixel shuffle's MLP takes 4 x hidden (intermediate_size).
            tiny=dict(TINY_FIXED, intermediate_size=128, vision_output_dim=48, projector_input_dim=48,
                      projector_output_dim=48)),
    _family("gemma4", "Gemma-4 vision tower", TowerKind.PADDED, "Gemma4VisionModel", "Gemma4VisionConfig",
            full=dict(num_hidden_layers=16, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                      num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                      position_embedding_size=10240, standardize=True),
            tiny=dict(TINY_FIXED, num_key_value_heads=1, head_dim=16), transformers="5.17"),
    _family("step3p7", "Step-3.7 tower + projector", TowerKind.VIEWS, "Step3p7Model", "Step3p7Config",
            full=dict(vision_config=_STEP_VISION, text_config=_STEP_TEXT),
            tiny=dict(vision_config=dict(_STEP_VISION, **TINY_FIXED), text_config=dict(_STEP_TEXT, hidden_size=24)),
            transformers="5.17", features="get_image_features"),
)
TOWERS: dict[str, TowerSpec] = _table(*_CORE_ROWS, *_FAMILY_ROWS)
SMOKE_TOWERS = ("qwen2_5_vl_7b", "siglip_so400m_224")
"""The CPU smoke's default towers: one packed and one fixed-resolution family (every code path, in seconds)."""
CORE_TOWERS = tuple(spec.name for spec in _CORE_ROWS)
"""The seed's towers: what ``towers.py``, ``capture.py`` and ``floor.py`` run when ``--towers`` is not given."""
FAMILY_TOWERS = tuple(spec.name for spec in _FAMILY_ROWS)
"""The families added after the seed (issues 15 and 16): ``towers.py --towers`` picks them by name."""
QWEN_TOWERS = ("qwen2_5_vl_7b", "qwen3_vl_8b")
"""The towers of the traffic benchmark (issue 13's targets are about these two)."""


def build_tower(spec: TowerSpec, env: Env, *, seed_offset: int = 0) -> Any:
    """The tower with random weights (the transformers init, seeded), in ``env.dtype`` on ``env.device``,
    ``attn_implementation="sdpa"``, in eval mode. Built on the device directly (no CPU copy of the weights)."""
    import torch

    torch.manual_seed(env.seed + seed_offset)
    with torch.device(env.device):
        model = spec.model_class()._from_config(spec.make_config(env.tiny), attn_implementation="sdpa",
                                                dtype=env.dtype)
    param = next(model.parameters())
    if param.device != env.device or param.dtype != env.dtype:  # an older transformers ignored the device context
        model = model.to(device=env.device, dtype=env.dtype)
    return model.eval().requires_grad_(False)


def count_params(spec: TowerSpec, tiny: bool = False) -> int:
    """The tower's parameter count, built on the ``meta`` device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        model = spec.model_class()._from_config(spec.make_config(tiny))
    return sum(p.numel() for p in model.parameters())
