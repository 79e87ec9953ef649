"""MiniCPM-V 4.6 specifics: host metadata (nearest-bucket position ids, the merger's window order) against
transformers' own helpers, a tower without the merger, the strip's checks, and the calls the graphs leave to
the tower (``use_vit_merger=False``, per-layer outputs)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

vision_utils = pytest.importorskip("transformers.vision_utils")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode
from encgraph.errors import InputError, InputTypeError  # noqa: E402
from encgraph.models import wrap  # noqa: E402
from encgraph.models.protocol import StockCall  # noqa: E402
from tests.models.fixtures_families import MINICPM_VISION, rel_err, require, strip  # noqa: E402

MINICPM = require("minicpmv4_6")


def sizes(count=25):
    gen = np.random.default_rng(5)
    for case in range(count):
        yield case, gen.integers(1, 20, (int(gen.integers(1, 6)), 2)) * 2


def test_positions_and_windows_are_transformers_exactly():
    adapter = wrap(MINICPM.tower())
    for case, hw in sizes():
        grid = np.concatenate((np.ones((hw.shape[0], 1), np.int64), hw), axis=1)
        meta = adapter.metadata(grid)
        ts = torch.from_numpy(hw)
        ref = vision_utils.get_vision_nearest_position_ids(ts, adapter.table_side).numpy()
        np.testing.assert_array_equal(meta["position_ids"], ref, f"case {case}")
        index, bounds = vision_utils.get_vision_window_index(torch.from_numpy(grid), 1, 2, 1)
        np.testing.assert_array_equal(meta["window_index"], index.numpy(), f"case {case}")
        np.testing.assert_array_equal(np.arange(0, int(hw.prod(1).sum()) + 1, 4), bounds.numpy())


def test_tower_without_the_merger():
    from transformers.models.minicpmv4_6.configuration_minicpmv4_6 import MiniCPMV4_6VisionConfig
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6VisionModel

    torch.manual_seed(0)
    config = MiniCPMV4_6VisionConfig(**dict(MINICPM_VISION, insert_layer_id=-1))
    tower = MiniCPMV4_6VisionModel._from_config(config).eval()
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=[16, 64], mode=RunMode.STATIC)
    assert encgraph.graphs(fast).adapter.merge == 1 and "window_index" not in encgraph.graphs(fast).adapter.buffer_specs("default", 16, 4, 4)
    grid = np.array([[1, 3, 5], [1, 8, 8], [1, 2, 1]])  # no merger: any size; 64 tokens fill the budget exactly
    rows = MINICPM.pixels(grid)
    with torch.no_grad():
        out = fast(strip(rows), target_sizes=torch.from_numpy(grid[:, 1:]))
        starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
        for i in range(grid.shape[0]):
            ref = reference(strip(rows[starts[i]:starts[i + 1]]), target_sizes=torch.from_numpy(grid[i:i + 1, 1:]))
            assert rel_err(out.last_hidden_state[:, starts[i]:starts[i + 1]], ref.last_hidden_state) < 1e-5


def test_calls_left_to_the_tower():
    adapter = wrap(MINICPM.tower())
    pixels, sizes_ = strip(MINICPM.pixels(np.array([[1, 4, 4]]))), torch.tensor([[4, 4]])
    assert adapter.inputs_from_call(pixels, sizes_, False) == StockCall("use_vit_merger=False")
    assert adapter.inputs_from_call(pixels, sizes_, output_hidden_states=True) == StockCall(
        "output_hidden_states requested"
    )
    assert adapter.inputs_from_call(pixels, sizes_, output_attentions=True) == StockCall("output_attentions requested")
    # Keywords the tower's **kwargs swallows (precomputed metadata, use_cache) are accepted.
    inputs = adapter.inputs_from_call(pixels, target_sizes=sizes_, use_cache=False, position_ids=None)
    assert adapter.item_specs(inputs)[0].tokens["default"] == 4


@pytest.mark.parametrize("pixels, sizes_, error, match", [
    (torch.randn(1, 3, 2, 30), torch.tensor([[4, 4]]), InputError, "describe the same images"),
    (torch.randn(2, 3, 2, 32), torch.tensor([[4, 4]]), InputError, "packed strip"),
    (torch.randn(1, 3, 2, 31), torch.tensor([[4, 4]]), InputError, "packed strip"),
    (torch.randn(1, 3, 2, 32), torch.tensor([[3, 4]]), InputError, "multiples of the merger's window 2"),
    (torch.randn(1, 3, 2, 32), torch.tensor([[4, 4, 1]]), InputError, r"target_sizes: expected shape \(n, 2\)"),
    (torch.randn(1, 3, 2, 32), torch.tensor([[4.0, 4.0]]), InputTypeError, "integer"),
    (np.zeros((1, 3, 2, 32)), torch.tensor([[4, 4]]), InputTypeError, "torch.Tensor"),
], ids=["rows", "batch", "width", "odd", "columns", "float", "numpy"])
def test_bad_strips(pixels, sizes_, error, match):
    fast = encgraph.graphed(MINICPM.tower(), budgets=[8, 16], mode=RunMode.STATIC)
    with pytest.raises(error, match=match):
        fast(pixels, target_sizes=sizes_)



def test_four_x_mode_is_answered_by_the_tower():
    """``use_vit_merger=False`` (the model's "4x" mode: no merge in the tower) runs the tower's own forward."""
    tower = MINICPM.tower()
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=[8, 16], mode=RunMode.STATIC)
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    pixels, sizes_ = strip(MINICPM.pixels(grid)), torch.from_numpy(grid[:, 1:])
    with torch.no_grad():
        got = fast(pixels, sizes_, use_vit_merger=False)
        want = reference(pixels, sizes_, use_vit_merger=False)
    assert got.last_hidden_state.shape == (1, 28, 32)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    assert encgraph.graphs(fast).stats["eager_reasons"] == {"use_vit_merger=False": 1}
