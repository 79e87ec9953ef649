"""What the HunYuan-VL adapter adds to the family tests (tests/models/test_families.py): its host metadata equals
transformers' helper bit for bit (the taps in raster order, ``align_corners=False``), the merger's gathers are
well formed for any mix of image shapes, and what the tower cannot take (videos, another interpolation) is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

vision_utils = pytest.importorskip("transformers.vision_utils")

from encgraph.errors import ConfigError, InputError
from encgraph.models import wrap
from encgraph.models.hunyuan_vl import merger_layout, pooled_rows
from tests.models.fixtures_families import require

FAMILY = require("hunyuan_vl")  # the whole module skips below the transformers the adapter takes


def image_grid(gen: np.random.Generator, n: int, max_side: int = 14) -> np.ndarray:
    hw = gen.integers(1, max_side // 2 + 1, (n, 2)) * 2
    return np.concatenate([np.ones((n, 1), np.int64), hw], axis=1)


def test_interpolation_taps_equal_transformers_bit_for_bit():
    adapter = wrap(FAMILY.tower())
    gen = np.random.default_rng(0)
    for case in range(20):  # repeated and new shapes: the frame-table cache's hits and misses
        grid = image_grid(gen, int(gen.integers(1, 7)))
        meta = adapter.metadata(grid)
        idx, w = vision_utils.get_vision_interpolation_indices_and_weights(
            torch.from_numpy(grid), adapter.grid_side, mode="bilinear", align_corners=False, spatial_merge_size=1
        )
        np.testing.assert_array_equal(meta["interp_indices"], idx.numpy(), f"case {case}")
        np.testing.assert_array_equal(meta["interp_weights"], w.numpy(), f"case {case}")
        np.testing.assert_array_equal(meta["cu_seqlens"], vision_utils.get_vision_cu_seqlens(torch.from_numpy(grid)))
        assert "position_ids" not in meta


def test_merger_gathers_are_well_formed():
    gen = np.random.default_rng(1)
    for _ in range(50):
        grid = image_grid(gen, int(gen.integers(1, 8)), max_side=20)
        units = int(grid.prod(1).sum()) // 4
        layout = merger_layout(grid, 2)
        # Every patch row merged exactly once; the projection reads merged rows or the separator (row 0).
        assert sorted(layout["merge_index"].tolist()) == list(range(4 * units))
        assert layout["slot_index"].shape == (2 * units,) and 0 <= layout["slot_index"].min()
        assert layout["slot_index"].max() <= units
        # Per image: begin, its slots, end within its 4 rows per unit, then the zero row.
        pooler = layout["pooler_index"].reshape(-1)
        start = 0
        for (_, h, w), rows in zip(grid, pooled_rows(grid, 2)):
            own = pooler[start:start + h * w]
            assert own[0] == 1 and own[rows - 1] == 2 and (own[rows:] == 0).all() and (own[1:rows - 1] >= 3).all()
            start += h * w
        assert pooler.max() < 3 + 2 * units


def test_an_odd_grid_is_the_towers_own_call():
    """The tower's merger drops an odd last row or column of patches: graphed(tower) leaves such a call to it,
    counted; the adapter's own inputs refuse it."""
    import encgraph
    from encgraph.capture.records import RunMode
    from encgraph.models.hunyuan_vl import UnmergedGrid

    tower = FAMILY.tower()
    reference = FAMILY.tower()
    fast = encgraph.graphed(tower, budgets=[8, 16], mode=RunMode.STATIC)
    grid = np.array([[1, 4, 4], [1, 3, 6]])
    rows = FAMILY.pixels(grid)
    with torch.no_grad():
        got, want = FAMILY.call(fast, rows, grid), FAMILY.call(reference, rows, grid)
    assert torch.equal(got.pooler_output, want.pooler_output)
    assert encgraph.graphs(fast).stats["eager_reasons"] == {"h or w not a multiple of the merge size": 1}
    with pytest.raises(UnmergedGrid, match="multiples"):
        wrap(FAMILY.tower()).inputs(rows, grid)


def test_videos_and_other_interpolations_are_refused():
    tower = FAMILY.tower()
    adapter = wrap(tower)
    grid = np.array([[2, 4, 4]])
    with pytest.raises(InputError, match="images only"):
        adapter.inputs(FAMILY.pixels(grid), grid)
    tower.config.interpolate_mode = "bicubic"
    with pytest.raises(ConfigError, match="bilinear"):
        wrap(tower)
