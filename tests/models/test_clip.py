"""CLIP (``CLIPVisionModel``): ``graphed(tower)`` equals the tower's own forward per image, on CPU."""

from __future__ import annotations

import encgraph

import pytest

from encgraph.errors import UnsupportedModelError
from encgraph.models.clip import ClipAdapter, clip_adapter
from tests.models.fixtures_fixed import FixedTowerTests, graphed_tower, tiny_clip


class TestClip(FixedTowerTests):
    make = staticmethod(tiny_clip)
    vlm = "clip"  # LLaVA


def test_adapter_is_picked_by_config():
    assert isinstance(encgraph.graphs(graphed_tower(tiny_clip())).adapter, ClipAdapter)


def test_projection_model_is_not_taken():
    from transformers import CLIPVisionModelWithProjection

    tower = CLIPVisionModelWithProjection(tiny_clip().config)  # same config class, other outputs
    with pytest.raises(UnsupportedModelError, match="CLIPVisionModel"):
        clip_adapter(tower)
