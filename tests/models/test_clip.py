"""CLIP (``CLIPVisionModel``): ``graphed(tower)`` equals the tower's own forward per image, on CPU."""

from __future__ import annotations

import pytest

from encgraph.capture.records import RunMode
from encgraph.errors import UnsupportedModelError
from encgraph.models.clip import ClipAdapter, clip_adapter
from tests.models.fixtures_fixed import (
    check_batches,
    check_hidden_states,
    check_hidden_states_captured_once,
    check_input_errors,
    check_no_host_sync,
    check_resized,
    check_return_tuple,
    check_vlm_drop_in,
    graphed_tower,
    tiny_clip,
)


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_batches_equal_tower(mode):
    check_batches(tiny_clip(), mode)


def test_adapter_is_picked_by_config():
    assert isinstance(graphed_tower(tiny_clip()).adapter, ClipAdapter)


def test_projection_model_is_not_taken():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    tower = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                           num_attention_heads=4, image_size=32, patch_size=8))
    with pytest.raises(UnsupportedModelError, match="CLIPVisionModel"):
        clip_adapter(tower)


def test_return_tuple():
    check_return_tuple(tiny_clip())


def test_hidden_states():
    check_hidden_states(tiny_clip())


def test_hidden_states_captured_once():
    check_hidden_states_captured_once(tiny_clip())


def test_no_host_sync():
    check_no_host_sync(tiny_clip)


def test_input_errors():
    check_input_errors(tiny_clip())


def test_resized_images_interpolate():
    check_resized(tiny_clip(), "interpolate_pos_encoding")


def test_llava_drop_in():
    # LLaVA reads hidden_states[-2]: True on transformers 5.17, the index -2 on 5.24.
    check_vlm_drop_in("clip")
