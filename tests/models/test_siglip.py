"""SigLIP (``SiglipVisionModel``): ``graphed(tower)`` equals the tower's own forward per image, on CPU."""

from __future__ import annotations

import encgraph

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.models.siglip import SiglipAdapter
from tests.models.fixtures_fixed import (
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
