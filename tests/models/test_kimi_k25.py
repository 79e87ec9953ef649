"""Kimi-K2.5 specifics: the host metadata (bicubic position taps, raster rotary positions, the temporal merge
layout) against transformers' own helpers, the time table's frame limit, and where the pooled tokens of a video sit
in the runner's per-item results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

vision_utils = pytest.importorskip("transformers.vision_utils")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode
from encgraph.errors import InputError  # noqa: E402
from encgraph.models import wrap  # noqa: E402
from encgraph.models.kimi_k25 import bicubic_taps, merge_layout  # noqa: E402
from encgraph.models.qwen_grid import raster_positions, unit_grid  # noqa: E402
from tests.models.fixtures_families import random_grid, require  # noqa: E402

KIMI = require("kimi_k25")


def grids(count=25):
    gen = np.random.default_rng(7)
    for case in range(count):
        yield case, random_grid(gen, int(gen.integers(1, 6)), KIMI, max_side=40)


@pytest.mark.parametrize("side", [4, 64])
def test_positions_and_bicubic_taps_are_transformers_exactly(side):
    for case, grid in grids():
        frames = np.concatenate((np.ones((grid.shape[0], 1), np.int64), grid[:, 1:]), axis=1)
        positions = raster_positions(unit_grid(frames, 2))
        g = torch.from_numpy(frames)
        np.testing.assert_array_equal(positions, vision_utils.get_vision_position_ids(g, 1).numpy(), f"case {case}")
        shape = np.repeat(frames[:, 1:], frames.prod(1), axis=0)
        indices, weights = bicubic_taps(positions, shape, side)
        ref_i, ref_w = vision_utils.get_vision_interpolation_indices_and_weights(
            g, side, mode="bicubic", align_corners=False
        )
        np.testing.assert_array_equal(indices, ref_i.numpy(), f"case {case}")
        assert weights.dtype == np.float32
        np.testing.assert_array_equal(weights, ref_w.numpy(), f"case {case}")


def test_merge_layout_is_transformers_up_to_the_unit_offsets():
    from transformers.models.kimi_k25.modeling_kimi_k25 import get_vision_frame_index, get_vision_temporal_merge_index

    for case, grid in grids():
        ours = merge_layout(grid, 2)
        g = torch.from_numpy(grid)
        np.testing.assert_array_equal(ours["frame_index"], get_vision_frame_index(g).numpy(), f"case {case}")
        index, weight, tokens = get_vision_temporal_merge_index(g, 2, 2)
        assert tokens == int((grid[:, 1] * grid[:, 2]).sum()) // 4
        np.testing.assert_array_equal(ours["merge_weight"], weight.numpy(), f"case {case}")
        # transformers packs the pooled tokens item after item (h*w/4 each); encgraph gives item j the unit rows
        # of its t*h*w/4 input units, the pooled ones first.
        rows = grid.prod(1)
        item = np.repeat(np.arange(grid.shape[0]), rows)
        hf_first = np.concatenate(([0], np.cumsum(grid[:, 1] * grid[:, 2] // 4)[:-1]))
        our_first = np.concatenate(([0], np.cumsum(rows // 4)[:-1]))
        np.testing.assert_array_equal(ours["merge_index"] - 4 * our_first[item], index.numpy() - 4 * hf_first[item])


def test_video_longer_than_the_time_table_is_refused():
    fast = encgraph.graphed(KIMI.tower(), budgets=[8, 16], mode=RunMode.STATIC)
    grid = np.array([[5, 2, 2]])  # pos_emb_time is 4
    with pytest.raises(InputError, match="pos_emb_time"):
        fast(KIMI.pixels(grid), torch.from_numpy(grid))


def test_runner_results_hold_the_pooled_tokens_first():
    adapter = wrap(KIMI.tower())
    runner = encgraph.EncoderGraphRunner(adapter, budgets=[16, 32], mode=RunMode.STATIC)
    grid = np.array([[3, 4, 4], [1, 2, 4]])
    inputs = adapter.inputs(KIMI.pixels(grid), grid)
    with torch.no_grad():
        video, image = runner(inputs)
        out = adapter.output_for_call([video, image], inputs)
    assert video["pooler_output"].shape[0] == 12 and video["last_hidden_state"].shape[0] == 12  # t*h*w/4 units
    assert video["pooler_output"][4:].abs().max() == 0 and video["pooler_output"][:4].abs().min() > 0
    torch.testing.assert_close(out.pooler_output, torch.cat([video["pooler_output"][:4], image["pooler_output"]]))

