"""``graphed(tower)`` for Step-3.7's vision tower on a GPU (bf16, random weights, real geometry, 4 layers), as the
model calls it: ``model.model.vision_model = encgraph.graphed(model.model.vision_model)``, then the model's own
``get_image_features`` (global views, then crops with ``output_hidden_states=False``) on fresh random mixes of 0..9
crops per image. Per image, every field against the model with its own tower: ``pooler_output`` (crop rows and
global rows) and ``last_hidden_state``; per view, the graphed tower's rows against the tower's forward. Graph
memory is NaN-poisoned first (every graph replays NaN inputs). With the greedy plan every view replays (asserted);
with the defaults (cost-aware plan, measured at capture) the same comparisons hold whatever runs eagerly. Both
Step-3.7 adapters' ``select`` never waits for the device (CUDA's sync debug mode set to raise).
"""

from __future__ import annotations

import copy

import pytest
import torch

import encgraph
from encgraph.models.registry import wrap
from tests.gpu.test_multipath_gpu import DEPTH, HF_TOL, poison
from tests.models.fixtures_multipath import norm_rel_err, step3p7_model, step3p7_views

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIXES = [[0], [2], [3, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2], [1, 4], [9, 0]]
"""Crops per image; [9, 0] overflows max_tiles=8 (two local batches)."""


@pytest.mark.parametrize("costs", [False, None], ids=["greedy", "defaults"])
def test_graphed_tower_inside_the_model(costs: bool | None) -> None:
    model = step3p7_model(depth=DEPTH, device="cuda", dtype=torch.bfloat16, real=True, text_hidden=64)
    plain = copy.deepcopy(model)  # the reference: the same weights, never wrapped (graphed() hooks in place)
    base = model.model
    tower = base.vision_model
    fast = encgraph.graphed(tower, costs=costs, compile=False, adapter_options={"max_images": 4, "max_tiles": 8})
    info = encgraph.graphs(fast).capture()
    assert not info["failed"], info["failed"]
    poison(encgraph.graphs(fast).runner)
    sizes = encgraph.graphs(fast).adapter.sizes
    views = 0
    for n, tiles in enumerate(MIXES):
        pv, local, counts = step3p7_views(tiles, sizes["global"], sizes["local"], seed=n, device="cuda",
                                          dtype=torch.bfloat16)
        with torch.no_grad():
            want = plain.model.get_image_features(pv, local, counts)
            got = base.get_image_features(pv, local, counts)
            for x, kwargs in ((pv, {}), (local, {"output_hidden_states": False})):
                if x is not None:
                    g = fast(x, **kwargs).last_hidden_state
                    w = plain.model.vision_model(x, **kwargs).last_hidden_state
                    for i in range(len(x)):
                        assert torch.isfinite(g[i]).all() and norm_rel_err(g[i], w[i]) < HF_TOL, (tiles, i)
        views += 2 * (len(tiles) + sum(tiles))
        assert got.last_hidden_state.shape == want.last_hidden_state.shape
        assert norm_rel_err(got.last_hidden_state, want.last_hidden_state) < HF_TOL, tiles
        assert got.hidden_states is None and got.attentions is None
        for i, (g, w) in enumerate(zip(got.pooler_output, want.pooler_output)):
            assert g.shape == w.shape and torch.isfinite(g).all(), (tiles, i)
            assert norm_rel_err(g, w) < HF_TOL, (tiles, i, norm_rel_err(g, w))
    stats = encgraph.graphs(fast).stats
    assert stats["items"] == views and stats["stock_calls"] == 0
    if costs is False:
        assert stats["eager_items"] == 0, stats["eager_reasons"]
    print(f"\nStep-3.7 graphed(tower), costs={costs}: {stats['graph_items']} of {views} views replayed; "
          f"paths {stats['paths']}")


def test_select_never_waits_for_the_device() -> None:
    """``select`` of consecutive and of scattered items, for the tower's adapter and the model's, with work queued
    on the device: nothing synchronises (a pageable host-to-device copy of the index did, once per call)."""
    model = step3p7_model(depth=1, device="cuda", dtype=torch.bfloat16, real=True, text_hidden=64)
    options = {"max_images": 4, "max_tiles": 8}
    tower, whole = wrap(model.model.vision_model, **options), wrap(model, **options)
    pv, local, counts = step3p7_views([1, 2, 0, 1], tower.sizes["global"], tower.sizes["local"], seed=3,
                                      device="cuda", dtype=torch.bfloat16)
    views, images = tower.inputs_from_call(pv), whole.inputs_from_call(pv, local, counts)
    picks = ([1, 2], [3, 0, 2])
    torch.cuda._sleep(10**8)  # about 50 ms of queued work that a synchronising call would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [(tower.select(views, idx), whole.select(images, idx)) for idx in picks]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for idx, (sub, sub_images) in zip(picks, got):
        assert torch.equal(sub.pixels["global"], pv[idx]) and torch.equal(sub_images.pixel_values, pv[idx])
    assert torch.equal(got[1][1].pixel_values_local, local[[3, 0]])  # image 3's crop, then image 0's
