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

A tower that stores a fact elsewhere (Kimi-K2.5's merge is ``merge_kernel_size``, it has no temporal patch)
says so in ``facts`` (``Facts(merge="merge_kernel_size", temporal_patch=1, channels=3)``); a tower that takes
another input layout adds a :class:`TowerKind` and its builder in :mod:`benches.lib.cases`.
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


@attrs.frozen
class Facts:
    """Where a tower's geometry lives in its config: each field names a config attribute, or is the value
    itself (an ``int``). A list or tuple value (``patch_size=[14, 14]``) counts by its first element."""

    patch: str | int = "patch_size"
    merge: str | int = "spatial_merge_size"
    temporal_patch: str | int = "temporal_patch_size"
    channels: str | int = "in_channels"
    image_size: str | int | None = None
    """The one side a fixed-resolution tower takes (``None``: any size, a packed tower)."""

    def read(self, kind: TowerKind, config: Any) -> Geometry:
        def value(fact: str | int | None) -> int | None:
            if fact is None:
                return None
            raw = getattr(config, fact) if isinstance(fact, str) else fact
            return int(raw[0] if isinstance(raw, (list, tuple)) else raw)

        patch, merge, temporal, channels = (value(f) for f in (self.patch, self.merge, self.temporal_patch,
                                                               self.channels))
        return Geometry(kind, patch, merge, temporal, value(self.image_size), channels)  # type: ignore[arg-type]


DEFAULT_FACTS: dict[TowerKind, Facts] = {
    TowerKind.PACKED: Facts(),
    TowerKind.FIXED: Facts(merge=1, temporal_patch=1, channels="num_channels", image_size="image_size"),
}


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
"""Tiny widths of a fixed-resolution tower; rows add their tiny image side."""

TOWERS: dict[str, TowerSpec] = _table(
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
SMOKE_TOWERS = ("qwen2_5_vl_7b", "siglip_so400m_224")
"""The CPU smoke's default towers: one packed and one fixed-resolution family (every code path, in seconds)."""
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
