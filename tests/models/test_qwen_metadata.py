"""Host-side Qwen-VL metadata (numpy, whole batch at once) equals transformers' own helpers exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

vision_utils = pytest.importorskip("transformers.vision_utils")

from encgraph.models.qwen2_5_vl import window_layout  # noqa: E402
from encgraph.models.qwen3_vl import interpolation  # noqa: E402
from encgraph.models.qwen_grid import frame_bounds, rotary_positions, unit_grid  # noqa: E402

CASES = 40


def grids(make_grid, merge):
    gen = np.random.default_rng(1)
    for case in range(CASES):
        grid = make_grid(gen, int(gen.integers(1, 7)), max_side=24, max_t=4)
        if merge != 2:
            grid[:, 1:] = grid[:, 1:] // 2 * merge
        yield case, grid


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_cu_seqlens_and_positions(make_grid, merge):
    for case, grid in grids(make_grid, merge):
        g = torch.from_numpy(grid)
        units = unit_grid(grid, merge)
        cu = vision_utils.get_vision_cu_seqlens(g).numpy()
        np.testing.assert_array_equal(frame_bounds(units), cu, f"case {case}")
        np.testing.assert_array_equal(
            rotary_positions(units), vision_utils.get_vision_position_ids(g, merge).numpy(), f"case {case}"
        )


@pytest.mark.parametrize("window_px, patch", [(112, 14), (8, 2), (4, 2), (12, 2)])
def test_window_layout(make_grid, window_px, patch):
    merge = 2
    side = window_px // merge // patch
    for case, grid in grids(make_grid, merge):
        index, bounds = window_layout(unit_grid(grid, merge), side)
        ref_index, ref_bounds = vision_utils.get_vision_window_index(torch.from_numpy(grid), merge, window_px, patch)
        np.testing.assert_array_equal(index, ref_index.numpy(), f"case {case}")
        np.testing.assert_array_equal(bounds, ref_bounds.numpy(), f"case {case}")
        assert np.diff(bounds).max() <= side * side * merge * merge  # the windowed layers' max_seqlen


@pytest.mark.parametrize("side", [4, 48])
def test_interpolation_bit_exact(make_grid, side):
    for case, grid in grids(make_grid, 2):
        idx, w = interpolation(unit_grid(grid, 2), side)
        ref_idx, ref_w = vision_utils.get_vision_interpolation_indices_and_weights(
            torch.from_numpy(grid), side, mode="bilinear", align_corners=True, spatial_merge_size=2
        )
        np.testing.assert_array_equal(idx, ref_idx.numpy(), f"case {case}")
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, ref_w.numpy(), f"case {case}")


def test_window_slot_bound(make_grid):
    # The Qwen2.5-VL cu_window_seqlens buffer has 1 + min(B, B // W + frames) + ceil(B / W^2) slots; check the
    # windows of random batches (any budget B >= their tokens) never need more.
    gen = np.random.default_rng(2)
    for w in (1, 2, 3, 4, 5):
        for _ in range(200):
            grid = make_grid(gen, int(gen.integers(1, 6)), max_side=30, max_t=3)
            units = unit_grid(grid, 2)
            _, bounds = window_layout(units, w)
            windows, tokens, frames = bounds.shape[0] - 1, units.units, int(grid[:, 0].sum())
            assert windows <= min(tokens, tokens // w + frames)


def test_adapter_metadata_with_cache_equals_transformers(qwen_towers, make_grid):
    # What replay_values uses: per-frame-shape tables from the cache, concatenated with offsets. Repeated shapes
    # (cache hits), new shapes (misses) and videos in one batch must all give transformers' values.
    from encgraph.models import wrap

    torch.manual_seed(0)
    a25 = wrap(qwen_towers["qwen2_5_vl"]())
    a3 = wrap(qwen_towers["qwen3_vl"]())
    gen = np.random.default_rng(5)
    for case in range(12):
        grid = make_grid(gen, int(gen.integers(1, 9)), max_side=10, max_t=3)
        g = torch.from_numpy(grid)
        meta = a25.metadata(grid)
        np.testing.assert_array_equal(meta["cu_seqlens"], vision_utils.get_vision_cu_seqlens(g).numpy())
        np.testing.assert_array_equal(meta["position_ids"], vision_utils.get_vision_position_ids(g, 2).numpy())
        index, bounds = vision_utils.get_vision_window_index(g, 2, 8, 2)
        np.testing.assert_array_equal(meta["window_index"], index.numpy(), f"case {case}")
        np.testing.assert_array_equal(meta["cu_window_seqlens"], bounds.numpy(), f"case {case}")
        meta3 = a3.metadata(grid)
        idx, w = vision_utils.get_vision_interpolation_indices_and_weights(
            g, 4, mode="bilinear", align_corners=True, spatial_merge_size=2
        )
        np.testing.assert_array_equal(meta3["interp_indices"], idx.numpy())
        np.testing.assert_array_equal(meta3["interp_weights"], w.numpy())
    assert 0 < len(a25._tables) <= a25._tables.capacity


def test_frame_table_cache_is_bounded_lru():
    from encgraph.models.qwen_grid import FrameTableCache

    computed = []

    def compute(shapes):
        computed.append(shapes.tolist())
        return [{"v": np.array([h * 100 + w])} for h, w in shapes.tolist()]

    cache = FrameTableCache(compute, capacity=2)
    out = cache.lookup([(2, 2), (2, 4), (2, 2)])
    assert [o["v"][0] for o in out] == [202, 204, 202] and computed == [[[2, 2], [2, 4]]]
    cache.lookup([(2, 2)])  # hit: (2, 2) becomes the most recent
    cache.lookup([(4, 4)])  # evicts (2, 4)
    assert len(cache) == 2 and computed[-1] == [[4, 4]]
    cache.lookup([(2, 2)])
    assert len(computed) == 2
    cache.lookup([(2, 4)])
    assert computed[-1] == [[2, 4]]
