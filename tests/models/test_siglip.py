"""SigLIP (``SiglipVisionModel``): ``graphed(tower)`` equals the tower's own forward per image, on CPU."""

from __future__ import annotations

import encgraph

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.models.siglip import SiglipAdapter
from tests.models.fixtures_fixed import (
    _VISION,
    PATCH,
    SIZE,
    FixedTowerTests,
    assert_outputs_match,
    check_batches,
    graphed_tower,
    images,
    tiny_siglip,
)


class TestSiglip(FixedTowerTests):
    make = staticmethod(tiny_siglip)
    vlm = "siglip"  # PaliGemma


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_tower_without_pooling_head(mode):
    tower = tiny_siglip(vision_use_head=False)  # PaliGemma's and Gemma3's towers
    check_batches(tower, mode)
    assert encgraph.graphs(graphed_tower(tower)).adapter.config.path("default").outputs == ("last_hidden_state",)


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_siglip())
    assert isinstance(encgraph.graphs(fast).adapter, SiglipAdapter)
    assert encgraph.graphs(fast).adapter.config.path("default").outputs == ("last_hidden_state", "pooler_output")


def test_interpolate_at_config_size_is_the_same():
    tower, x = tiny_siglip(), images(3)
    with torch.no_grad():
        ref = tower(x, interpolate_pos_encoding=True)
    assert_outputs_match(graphed_tower(tower)(x, interpolate_pos_encoding=True), ref)


def test_pixels_cast_to_the_tower_dtype():
    tower = tiny_siglip().double()
    x = images(3)  # fp32 pixels: the tower casts them to its dtype, so does the pixel buffer
    with torch.no_grad():
        assert_outputs_match(graphed_tower(tower)(x), tower(x), tol=1e-12)


_SIGLIP_VISION = dict(_VISION, model_type="siglip_vision_model", image_size=SIZE, patch_size=PATCH)
_TINY_TEXT = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16)


def _cohere2_vision():
    import transformers as tf

    config = tf.Cohere2VisionConfig(vision_config=_SIGLIP_VISION, text_config=dict(_TINY_TEXT, model_type="cohere2"),
                                    downsample_factor=2, alignment_intermediate_size=64, image_token_id=299)
    return tf.Cohere2VisionForConditionalGeneration(config), "model.vision_tower"


def _deepseek_vl():
    import transformers as tf

    config = tf.DeepseekVLConfig(vision_config=_SIGLIP_VISION, text_config=dict(_TINY_TEXT, model_type="llama"),
                                 image_token_id=299)
    return tf.DeepseekVLForConditionalGeneration(config), "model.vision_model"


@pytest.mark.parametrize("build", [_cohere2_vision, _deepseek_vl], ids=["cohere2_vision", "deepseek_vl"])
def test_models_with_a_siglip_tower_get_the_same_image_features(build):
    """Cohere2-Vision and DeepSeek-VL call their SigLIP tower as ``tower(pixel_values, return_dict=True)`` from
    ``get_image_features``: with the tower graphed in place (the SigLIP adapter, padded batches of the ladder), every
    image's features and every output field equal the model's own."""
    import copy

    torch.manual_seed(0)
    model, path = build()
    model.eval()
    reference = copy.deepcopy(model)
    tower = model.get_submodule(path)
    assert encgraph.graphed(tower, mode=RunMode.STATIC, budgets=[1, 2, 4]) is tower
    assert isinstance(encgraph.graphs(tower).runner.adapter, SiglipAdapter)
    served = 0
    with torch.no_grad():
        for seed, n in enumerate((3, 1, 6)):
            pixels = images(n, seed=seed)
            got = model.model.get_image_features(pixel_values=pixels)
            want = reference.model.get_image_features(pixel_values=pixels)
            assert_outputs_match(got, want)  # same class, same fields, every tensor close per image
            served += n
    assert encgraph.graphs(tower).stats["graph_items"] == served
