"""InternVL (``InternVLVisionModel``): ``graphed(tower)`` equals the tower's own forward per tile, on CPU."""

from __future__ import annotations

import encgraph
from encgraph.models.own_forward import own_forward

import pytest

from encgraph.capture.records import RunMode
from encgraph.models.internvl import InternVLAdapter
from tests.models.fixtures_fixed import FixedTowerTests, check_batches, graphed_tower, images, tiny_internvl


class TestInternVL(FixedTowerTests):
    make = staticmethod(tiny_internvl)
    vlm = "internvl"
    interpolate_kwarg = None  # the tower interpolates its position embeddings by itself
    masked = {"bool_masked_pos": images(2)[:, 0].flatten(1)[:, :16] > 0}  # masked-image pretraining


def test_masked_positions_are_answered_like_the_tower():
    # A per-call mask is not held by the graphs: the tower's own forward answers the call, whatever it does with
    # it (this tiny tower has no mask token, so it raises exactly as it does unwrapped).
    tower = tiny_internvl()
    fast = graphed_tower(tower)
    x = images(2)
    try:
        want = own_forward(tower)(x, **TestInternVL.masked)
    except Exception as exc:  # noqa: BLE001 - the tower's own error, whichever it is
        with pytest.raises(type(exc)):
            fast(x, **TestInternVL.masked)
    else:
        got = fast(x, **TestInternVL.masked)
        assert (got.last_hidden_state - want.last_hidden_state).abs().max() < 1e-5
    assert encgraph.graphs(fast).stats["eager_reasons"] == {"bool_masked_pos given": 1}


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_mean_pooling_rms_norm_tower(mode):
    check_batches(tiny_internvl(use_mean_pooling=True, norm_type="rms_norm"), mode)


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_internvl())
    assert isinstance(encgraph.graphs(fast).adapter, InternVLAdapter)
    assert encgraph.graphs(fast).adapter.config.path("default").outputs == ("last_hidden_state",)  # the tower returns no pooler
