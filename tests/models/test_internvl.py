"""InternVL (``InternVLVisionModel``): ``graphed(tower)`` equals the tower's own forward per tile, on CPU."""

from __future__ import annotations

import pytest

from encgraph.capture.records import RunMode
from encgraph.errors import InputError
from encgraph.models.internvl import InternVLAdapter
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
    images,
    tiny_internvl,
)


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
@pytest.mark.parametrize("pooling", [False, True], ids=["layernorm", "mean-pooling"])
def test_batches_equal_tower(mode, pooling):
    check_batches(tiny_internvl(use_mean_pooling=pooling, norm_type="rms_norm" if pooling else "layer_norm"), mode)


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_internvl())
    assert isinstance(fast.adapter, InternVLAdapter)
    assert fast.adapter.config.path("default").outputs == ("last_hidden_state",)  # the tower returns no pooler


def test_return_tuple():
    check_return_tuple(tiny_internvl())


def test_hidden_states():
    check_hidden_states(tiny_internvl())


def test_hidden_states_captured_once():
    check_hidden_states_captured_once(tiny_internvl())


def test_no_host_sync():
    check_no_host_sync(tiny_internvl)


def test_input_errors():
    masked = (images(2), {"bool_masked_pos": images(2)[:, 0, :4, :4].flatten(1) > 0}, InputError, "bool_masked_pos")
    check_input_errors(tiny_internvl(), [masked])


def test_resized_images_interpolate():
    check_resized(tiny_internvl(), None)


def test_internvl_drop_in():
    check_vlm_drop_in("internvl")
