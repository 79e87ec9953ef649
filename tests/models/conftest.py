"""Tiny random-weight Hugging Face towers for the model tests (CPU, fp32, built locally: no downloads).

Towers are in eval mode with frozen parameters (``requires_grad_(False)``), as an inference server holds them, so
that plain calls (outside ``no_grad``) exercise the graphs' path; tests of autograd turn it back on.

Geometry is scaled down but keeps every feature: patch 2 (so a pixel row has 3 * 2 * 2 * 2 = 24 values), merge 2,
several layers, Qwen2.5-VL windows of 2 x 2 merged tokens with one full-attention layer, Qwen3-VL deepstack
layers and a 4 x 4 learned position grid (so interpolation really resamples).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

PATCH = 2
MERGE = 2
CHANNELS = 3 * 2 * PATCH * PATCH  # in_channels * temporal_patch_size * patch^2


def qwen2_vl_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    kw = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=MERGE)
    kw.update(overrides)
    return Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(**kw)).eval().requires_grad_(False)


def qwen2_5_vl_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    # Intermediate 60, like the real towers' 3420 not a multiple of 8: the padded MLP layout runs in every test.
    kw = dict(depth=3, hidden_size=32, intermediate_size=60, num_heads=2, out_hidden_size=48, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=MERGE, window_size=8, fullatt_block_indexes=[1])
    kw.update(overrides)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(**kw)).eval().requires_grad_(False)


def qwen3_vl_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    kw = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=MERGE, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2])
    kw.update(overrides)
    return Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**kw)).eval().requires_grad_(False)


def qwen3_vl_moe_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    kw = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=MERGE, num_position_embeddings=16,
              deepstack_visual_indexes=[1])
    kw.update(overrides)
    return Qwen3VLMoeVisionModel._from_config(Qwen3VLMoeVisionConfig(**kw)).eval().requires_grad_(False)


# The Omni models' vision encoders: the Qwen2.5-VL and Qwen3-VL towers under another config (the same geometry).
QWEN25_OMNI_VISION = dict(depth=3, hidden_size=32, intermediate_size=60, num_heads=2, out_hidden_size=48,
                          patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE, window_size=8,
                          fullatt_block_indexes=[1])
QWEN3_OMNI_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                         patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE, num_position_embeddings=16,
                         deepstack_visual_indexes=[0, 2])


def qwen2_5_omni_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    config = Qwen2_5OmniVisionEncoderConfig(**(QWEN25_OMNI_VISION | overrides))
    return Qwen2_5OmniVisionEncoder._from_config(config).eval().requires_grad_(False)


def qwen3_omni_moe_tower(**overrides) -> torch.nn.Module:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    config = Qwen3OmniMoeVisionEncoderConfig(**(QWEN3_OMNI_VISION | overrides))
    return Qwen3OmniMoeVisionEncoder._from_config(config).eval().requires_grad_(False)


QWEN_TOWERS: dict[str, Callable[..., torch.nn.Module]] = {
    "qwen2_vl": qwen2_vl_tower,
    "qwen2_5_vl": qwen2_5_vl_tower,
    "qwen3_vl": qwen3_vl_tower,
    "qwen3_vl_moe": qwen3_vl_moe_tower,
    "qwen2_5_omni": qwen2_5_omni_tower,
    "qwen3_omni_moe": qwen3_omni_moe_tower,
}


def random_grid(gen: np.random.Generator, n: int, *, max_side: int = 12, max_t: int = 3, video_share: float = 0.4):
    """``(n, 3)`` int64 grids: h, w even in [2, max_side] patches; t > 1 (a video) with ``video_share``."""
    t = np.where(gen.random(n) < video_share, gen.integers(2, max_t + 1, n), 1)
    hw = gen.integers(1, max_side // MERGE + 1, (n, 2)) * MERGE
    return np.concatenate([t[:, None], hw], axis=1).astype(np.int64)


def random_pixels(grid: np.ndarray, *, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, CHANNELS, generator=g).to(device=device, dtype=dtype)


# Helpers reach the tests through fixtures (not imports), so the tests work whether or not tests/models is a
# package.
@pytest.fixture
def qwen_towers() -> dict[str, Callable[..., torch.nn.Module]]:
    """``{family: builder(**config_overrides)}`` of the tiny Qwen-VL towers (seed before calling)."""
    return dict(QWEN_TOWERS)


@pytest.fixture
def make_grid() -> Callable[..., np.ndarray]:
    """:func:`random_grid`."""
    return random_grid


@pytest.fixture
def make_pixels() -> Callable[..., torch.Tensor]:
    """:func:`random_pixels`."""
    return random_pixels
