"""InternVL (``InternVLVisionModel``): ``graphed(tower)`` equals the tower's own forward per tile, on CPU."""

from __future__ import annotations

import pytest

from encgraph.capture.records import RunMode
from encgraph.errors import InputError
from encgraph.models.internvl import InternVLAdapter
from tests.models.fixtures_fixed import FixedTowerTests, check_batches, graphed_tower, images, tiny_internvl


class TestInternVL(FixedTowerTests):
    make = staticmethod(tiny_internvl)
    vlm = "internvl"
    interpolate_kwarg = None  # the tower interpolates its position embeddings by itself
    masked = {"bool_masked_pos": images(2)[:, 0].flatten(1)[:, :16] > 0}  # masked-image pretraining
    extra_errors = ((images(2), masked, InputError, "bool_masked_pos"),)


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_mean_pooling_rms_norm_tower(mode):
    check_batches(tiny_internvl(use_mean_pooling=True, norm_type="rms_norm"), mode)


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_internvl())
    assert isinstance(fast.adapter, InternVLAdapter)
    assert fast.adapter.config.path("default").outputs == ("last_hidden_state",)  # the tower returns no pooler
