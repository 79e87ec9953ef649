"""Issue 58's families that no model adapter serves: tiny random-weight models (a one-layer text model each: only
their feature functions run), built locally, and one table :data:`CASES` of how each model calls its vision tower.

Each :class:`Case` holds the tiny model, the tower's attribute path in it, and the model's own feature calls (its
``get_image_features`` / ``get_video_features``, with inputs shaped as its processor hands them over: padded images
and their masks, crops and pooling indices), so that a test runs exactly what the
model runs, once with its tower as it is and once with the tower graphed in place. ``served`` says how the
any-module path answers the tower's calls: ``"graphs"`` (batch-first: split, padded and replayed) or the reason its
own forward answers them (named in ``graphs(tower).stats["eager_reasons"]``).

Geometry: hidden 32, 2 heads, 2 layers, 32 x 32 images in 8 x 8 patches (4 x 4 patches an image), fp32, eval mode,
random learned position tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
T = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16)
SIDE = 32  # image side in pixels
PATCH = 8
GRID = SIDE // PATCH  # patches per side

# How the any-module path answers a call shape it cannot batch (encgraph.models.call_spec and generic).
NOT_BATCH_FIRST = "not batch-first"  # in the learned reason and in the self-check's verdict


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    module = build().eval()
    with torch.no_grad():  # zero-initialised tables: random values, so that the lookups matter
        for name, param in module.named_parameters():
            if "position" in name or "pos_embed" in name:
                param.normal_()
    return module


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ calls, as each model makes them
def fixed_images(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Fixed-size images: ``pixel_values`` ``(n, 3, SIDE, SIDE)``."""
    return {"pixel_values": torch.randn(n, 3, SIDE, SIDE, generator=_gen(seed))}




def _pooling(items: list[tuple[int, int]], seed: int) -> torch.Tensor:
    """Molmo2's token pooling: per item ``(tokens, patches)``, ``tokens`` rows of 4 indices into that item's own
    patches (``-1``: an empty slot; the first slot of a token never empty)."""
    g = _gen(seed + 7)
    rows = []
    for tokens, patches in items:
        idx = torch.randint(0, patches, (tokens, 4), generator=g)
        idx[:, 1:][torch.rand(tokens, 3, generator=g) < 0.3] = -1  # never all empty: the model drops such tokens
        rows.append(idx)
    return torch.cat(rows)


def molmo_call(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Molmo2: images as crops of patch rows ``(crops, P^2 patches, 3*P*P)`` with their grids (a low-res grid and a
    high-res grid of pooled tokens) and crop counts; videos as frames (the low-res path only)."""
    g = _gen(seed)
    crops = torch.randint(1, 4, (n,), generator=g)
    grids = torch.stack([torch.ones(n, dtype=torch.long) * 2, torch.ones(n, dtype=torch.long) * 2,
                         crops, torch.ones(n, dtype=torch.long)], 1)
    tokens = (grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).tolist()
    pooling = _pooling([(t, int(c) * GRID * GRID) for t, c in zip(tokens, crops.tolist())], seed)
    images = {"pixel_values": torch.randn(int(crops.sum()), GRID * GRID, 3 * PATCH * PATCH, generator=g),
              "image_token_pooling": pooling, "image_grids": grids, "image_num_crops": crops}
    frames = torch.tensor([[2, 2, 2], [3, 1, 2]])
    video_tokens = [(int(f * r * c), int(f) * GRID * GRID) for f, r, c in frames.tolist()]
    videos = {"pixel_values_videos": torch.randn(int(frames[:, 0].sum()), GRID * GRID, 3 * PATCH * PATCH, generator=g),
              "video_token_pooling": _pooling(video_tokens, seed + 1), "video_grids": frames}
    return [("get_image_features", images), ("get_video_features", videos)]


def phi4_call(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Phi-4-multimodal's image embedding: a global view and crops ``(n, 3, S, S)`` with a patch-level mask
    ``(n, S/P, S/P)`` (padding crops masked), passed as ``get_img_features(pixels, attention_mask=mask)``."""
    g = _gen(seed)
    mask = torch.ones(n, GRID, GRID, dtype=torch.bool)
    mask[1:, GRID // 2:] = torch.rand(n - 1, 1, 1, generator=g) < 0.5  # some crops half padding
    return [("get_img_features", {"img_embeds": torch.randn(n, 3, SIDE, SIDE, generator=g), "attention_mask": mask})]


def fixed_call(fn: str) -> Callable[[int, int], list[tuple[str, dict[str, Any]]]]:
    return lambda n, seed: [(fn, fixed_images(n, seed))]


# ------------------------------------------------------------------ tiny models
def _tf() -> Any:
    import transformers

    return transformers




def phi4_image_embedding() -> torch.nn.Module:
    tf = _tf()
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalImageEmbedding

    config = tf.Phi4MultimodalConfig(vision_config=dict(V, image_size=SIDE, patch_size=PATCH, crop_size=SIDE),
                                     hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=300, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    return Phi4MultimodalImageEmbedding(config)


def molmo2() -> torch.nn.Module:
    tf = _tf()
    vision = dict(V, num_key_value_heads=2, head_dim=16, image_size=[SIDE, SIDE], patch_size=PATCH)
    adapter = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   text_hidden_size=32, vision_feature_layer=[-1, -2])
    return tf.Molmo2ForConditionalGeneration(tf.Molmo2Config(vision_config=vision, text_config=T, adapter_config=adapter))


def janus() -> torch.nn.Module:
    tf = _tf()
    vq = dict(embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1], num_res_blocks=1,
              latent_channels=8, projection_dim=32, num_patches=4, image_token_embed_dim=32)
    return tf.JanusForConditionalGeneration(tf.JanusConfig(
        vision_config=dict(V, image_size=SIDE, patch_size=PATCH, mlp_ratio=2, projection_dim=32),
        text_config=dict(T, model_type="llama"), vq_config=vq))


def ovis2() -> torch.nn.Module:
    tf = _tf()
    return tf.Ovis2ForConditionalGeneration(tf.Ovis2Config(
        vision_config=dict(V, image_size=SIDE, patch_size=PATCH, vocab_size=64, hidden_stride=2),
        text_config=dict(T, model_type="qwen2"), visual_indicator_token_ids=[290, 291, 292, 293, 294]))


def florence2() -> torch.nn.Module:
    tf = _tf()
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[1, 2], num_groups=[1, 2], window_size=2,
                  projection_dim=32, drop_path_rate=0.0, max_position_embeddings=8, max_temporal_embeddings=4)
    text = dict(model_type="bart", vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                max_position_embeddings=64)
    return tf.Florence2ForConditionalGeneration(tf.Florence2Config(vision_config=vision, text_config=text))


def aimv2() -> torch.nn.Module:
    tf = _tf()
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    return tf.Aimv2Model(tf.Aimv2Config(vision_config=dict(V, image_size=SIDE, patch_size=PATCH), text_config=text))


def dinov2() -> torch.nn.Module:
    tf = _tf()
    return tf.Dinov2Model(tf.Dinov2Config(**{**V, "mlp_ratio": 2}, image_size=SIDE, patch_size=PATCH))


def dinov3() -> torch.nn.Module:
    tf = _tf()
    return tf.DINOv3ViTModel(tf.DINOv3ViTConfig(**V, image_size=SIDE, patch_size=PATCH, num_register_tokens=2))


@attrs.frozen
class Case:
    """One family: ``name``, its transformers module; ``model`` builds the tiny model; ``tower`` is the tower's attribute path in it (``""``: the
    model is the tower, called directly); ``calls(n, seed)`` the model's feature calls for ``n`` images (a method's dotted path from the model, and
    its keyword arguments);
    ``served``: ``"graphs"`` or a phrase of the reason the tower's own forward answers; ``sizes``: ``n`` per round
    (the first call of a call shape is answered by the tower and teaches its output's structure)."""

    name: str
    model: Callable[[], torch.nn.Module]
    tower: str
    calls: Callable[[int, int], list[tuple[str, dict[str, Any]]]]
    served: str = "graphs"
    sizes: tuple[int, ...] = (2, 3, 5, 2)


CASES: dict[str, Case] = {c.name: c for c in (
    # Fixed-size towers: batch-first, replayed on a ladder of batch sizes.
    Case("janus", janus, "model.vision_model", fixed_call("model.get_image_features")),
    Case("ovis2", ovis2, "model.vision_tower", fixed_call("get_image_features")),
    Case("florence2", florence2, "model.vision_tower", fixed_call("get_image_features")),
    Case("aimv2", aimv2, "vision_model", fixed_call("get_image_features")),
    Case("dinov2", dinov2, "", fixed_call("__call__")),
    Case("dinov3_vit", dinov3, "", fixed_call("__call__")),
    Case("molmo2", molmo2, "model.vision_tower", molmo_call),
    # Answered by the tower's own forward, each for its reason (see the test module).
    Case("phi4_multimodal", phi4_image_embedding, "img_processor", phi4_call, served=NOT_BATCH_FIRST),
)}


def build(case: Case) -> torch.nn.Module:
    """The case's tiny model; the calling test is skipped where the installed transformers lacks the model."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(f"transformers.models.{case.name}") is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {case.name}")
    return _seeded(case.model)


def attribute(root: Any, path: str) -> Any:
    """``root``'s attribute at the dotted ``path`` (``""``: ``root``)."""
    for name in filter(None, path.split(".")):
        root = getattr(root, name)
    return root


def tower_of(model: torch.nn.Module, case: Case) -> torch.nn.Module:
    return attribute(model, case.tower)
