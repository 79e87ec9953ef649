"""SigLIP (``SiglipVisionModel``): ``graphed(tower)`` equals the tower's own forward per image, on CPU."""

from __future__ import annotations

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.models.siglip import SiglipAdapter
from tests.models.fixtures_fixed import (
    assert_outputs_match,
    check_batches,
    check_hidden_states,
    check_hidden_states_captured_once,
    check_input_errors,
    check_no_host_sync,
    check_resized,
    check_return_tuple,
    check_vlm_drop_in,
    graphed_tower,
    images,
    tiny_siglip,
)


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
@pytest.mark.parametrize("head", [True, False], ids=["pooling-head", "no-head"])
def test_batches_equal_tower(mode, head):
    tower = tiny_siglip(vision_use_head=head)
    check_batches(tower, mode)
    assert graphed_tower(tower).adapter.config.path("default").outputs == (
        ("last_hidden_state", "pooler_output") if head else ("last_hidden_state",)
    )


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_siglip())
    assert isinstance(fast.adapter, SiglipAdapter)


def test_return_tuple():
    check_return_tuple(tiny_siglip())


def test_hidden_states():
    check_hidden_states(tiny_siglip())


def test_hidden_states_captured_once():
    check_hidden_states_captured_once(tiny_siglip())


def test_no_host_sync():
    check_no_host_sync(tiny_siglip)


def test_input_errors():
    check_input_errors(tiny_siglip())


def test_resized_images_interpolate():
    check_resized(tiny_siglip(), "interpolate_pos_encoding")


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


def test_paligemma_drop_in():
    check_vlm_drop_in("siglip")
