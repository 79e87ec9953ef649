"""What the Idefics3 / SmolVLM adapter adds to the family tests (tests/models/test_families.py): its host position ids
equal the tower's for every real-patch shape (fp32 and bf16, transformers' boundaries), the patch gather, the padded
patches' rows equal the tower's (graphs and eager), masks the graphs do not take going to the tower's own forward
(counted), and its refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import encgraph
from encgraph.capture.records import RunMode
from encgraph.errors import InputError, InputTypeError
from encgraph.models import wrap
from encgraph.models.idefics3_layout import padded_layout
from tests.models.fixtures_families import masked, require

FAMILY = require("idefics3")
BUDGETS = [8, 16, 32]


def _positions_of(embeddings, pixels, mask):
    """The position ids the tower's embeddings look up for ``pixels`` / ``mask``."""
    seen = []
    handle = embeddings.position_embedding.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        with torch.no_grad():
            embeddings(pixels, mask)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("tower_name", ["idefics3", "smolvlm"])
@pytest.mark.parametrize(("side", "dtype"), [(8, torch.float32), (27, torch.float32), (26, torch.bfloat16)])
def test_position_ids_equal_the_towers_for_every_shape(tower_name, side, dtype):
    """Every real-patch rectangle up to ``side + 5`` a side (a fraction on a bucket boundary included: ``h`` a
    divisor of ``side``), one image each, against the ids the tower's own embeddings look up (its float32
    boundaries; transformers 5.15 rounds the fractions to the pixels' dtype first)."""
    import transformers as tf

    config_class = {"idefics3": tf.Idefics3VisionConfig, "smolvlm": tf.SmolVLMVisionConfig}[tower_name]
    tower_class = {"idefics3": tf.Idefics3VisionTransformer, "smolvlm": tf.SmolVLMVisionTransformer}[tower_name]
    tower = tower_class(config_class(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                                     image_size=side, patch_size=1)).eval().to(dtype)
    adapter = wrap(tower)
    top = side + 5
    shapes = [(h, w) for h in range(1, top + 1) for w in range(1, top + 1)]
    grid = np.array([(1, h, w) for h, w in shapes])
    pixels = torch.randn(len(shapes), 3, top, top).to(dtype)
    mask = torch.zeros(len(shapes), top, top, dtype=torch.bool)
    for i, (h, w) in enumerate(shapes):
        mask[i, :h, :w] = True
    want = _positions_of(tower.embeddings, pixels, mask).reshape(len(shapes), top, top)
    got = adapter.metadata(grid)["position_ids"]
    starts = np.concatenate(([0], np.cumsum(grid[:, 1] * grid[:, 2])))
    for i, (h, w) in enumerate(shapes):
        assert np.array_equal(got[starts[i]:starts[i + 1]], want[i, :h, :w].reshape(-1).numpy()), (h, w)


def test_patch_gather_takes_each_images_real_patches_in_raster_order():
    adapter = wrap(FAMILY.tower())
    grid = np.array([[1, 4, 6], [1, 2, 2], [1, 6, 3]])
    rows = FAMILY.pixels(grid)
    images, mask = masked(rows, grid)
    inputs = adapter.inputs(images, mask)
    assert np.array_equal(inputs.grid, grid) and inputs.padded == (6, 6)
    assert torch.equal(inputs.pixel_values, rows)
    full = adapter.inputs(images)  # no mask: every patch real, the images' patches as a view
    assert np.array_equal(full.grid, np.array([[1, 6, 6]] * 3)) and full.pixel_values.shape == (108, 3, 2, 2)


def test_padded_layout_puts_real_rows_top_left_and_padding_rows_elsewhere():
    index = padded_layout(np.array([[1, 1, 2], [1, 2, 1]]), 2, 2)
    # 4 real rows in all, so the padding rows are 4 (image 0's) and 5 (image 1's); image 1 is 2 x 1: rows 2, 3
    assert index.tolist() == [0, 1, 4, 4, 2, 5, 3, 5]


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_padded_rows_and_hidden_states_equal_the_towers(mode):
    """Every row of the padded layout, padded patches included (they attend to their image's real patches), and
    every hidden state, from the graphs' static forward (and the eager one for the image over the largest budget) and
    from the eager forward alone (``RunMode.EAGER``); a NaN image leaves the others equal."""
    tower = FAMILY.tower()
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=2, mode=mode)
    grid = np.array([[1, 4, 6], [1, 2, 2], [1, 5, 3], [1, 6, 6], [1, 1, 1]])
    images, mask = masked(FAMILY.pixels(grid), grid)
    images[2, :, :10, :6] = float("nan")  # its real patches (5 x 3); its padding stays zero
    with torch.no_grad():
        want = reference(images, patch_attention_mask=mask, output_hidden_states=True)
        for _ in range(2):  # the first call learns the hidden states, the second answers them as captured
            got = fast(images, patch_attention_mask=mask, output_hidden_states=True)
    stats = encgraph.graphs(fast).stats
    assert (stats["graph_items"] > 0) == (mode is RunMode.STATIC)
    assert not set(stats["eager_reasons"]) - {"tokens over the largest budget", "runner in eager mode"}
    for a, b in zip((got.last_hidden_state, *got.hidden_states), (want.last_hidden_state, *want.hidden_states)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)  # NaN exactly where the tower's
        assert a[[0, 1, 3, 4]].isfinite().all() and a[2, 0].isnan().all()


def test_calls_the_graphs_do_not_take_go_to_the_tower(monkeypatch):
    """A mask that is not a top-left rectangle, an image with no real patch, masked patches with non-zero pixels,
    and padded patches under a flash attention implementation (the tower zeroes their attention): the tower's own
    forward answers each, counted by reason."""
    tower = FAMILY.tower()
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    grid = np.array([[1, 4, 4], [1, 2, 4]])
    images, mask = masked(FAMILY.pixels(grid), grid)
    holed, empty, stray = mask.clone(), mask.clone(), images.clone()
    holed[0, 1, 1] = False
    empty[1] = False
    stray[1, :, -1, -1] = 1.0
    with torch.no_grad():
        for pixels, m in ((images, holed), (images, empty), (stray, mask)):
            got, want = fast(pixels, patch_attention_mask=m), reference(pixels, patch_attention_mask=m)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, equal_nan=True)
    reasons = encgraph.graphs(fast).stats["eager_reasons"]
    assert reasons == {"patch_attention_mask not a top-left rectangle": 2, "masked patches with non-zero pixels": 1}
    adapter = encgraph.graphs(fast).adapter
    monkeypatch.setattr(type(tower.config), "_attn_implementation", "flash_attention_2", raising=False)
    assert adapter.inputs_from_call(images, mask).reason == "padded patches under flash attention"
    full = torch.ones_like(mask)
    assert adapter.inputs_from_call(images, full).grid.tolist() == [[1, 4, 4]] * 2  # nothing padded: the graphs'


def test_refusals_name_the_argument():
    adapter = wrap(FAMILY.tower())
    grid = np.array([[1, 4, 4]])
    images, mask = masked(FAMILY.pixels(grid), grid)
    cases = [
        ((images, mask[:, :3]), InputError, r"patch_attention_mask: expected a bool tensor \(1, 4, 4\)"),
        ((images, mask.float()), InputError, "patch_attention_mask: expected a bool tensor"),
        ((images, mask.tolist()), InputError, "patch_attention_mask: expected a bool tensor"),
        ((images[0], mask), InputError, r"pixel_values: expected shape \(images, 3, height, width\)"),
        ((images[:, :, :1], None), InputError, "at least one 2 px patch a side"),
        ((images.long(), mask), InputTypeError, "pixel_values: expected a floating-point tensor"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            adapter.inputs(*args)
    with pytest.raises(InputTypeError, match="return_dict: expected True or False"):
        adapter.inputs(images, mask, return_dict=1)
    with pytest.raises(InputTypeError, match="both positionally and by keyword"):
        adapter.inputs_from_call(images, mask, patch_attention_mask=mask)


def test_output_type_follows_the_installed_tower():
    """5.25's tower returns BaseModelOutputWithPooling, 5.15's BaseModelOutput: the adapter returns the tower's."""
    tower = FAMILY.tower()
    grid = np.array([[1, 2, 2]])
    images, mask = masked(FAMILY.pixels(grid), grid)
    with torch.no_grad():
        want = type(copy.deepcopy(tower)(images, patch_attention_mask=mask))
        got = type(encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)(images, patch_attention_mask=mask))
    assert got is want


def test_padding_queries_attend_to_their_own_sequence_only():
    """Each slot's query against its sequence's rows alone; a non-finite value in one sequence (here an inf value
    only) makes that sequence's query NaN and no other's; a zero-length slot stays finite."""
    import torch.nn.functional as F

    from encgraph.models.idefics3_layout import pad_query_attention, slot_mask

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, generator=gen) for n in (3, 6, 6))
    v[4, 1, 2] = float("inf")
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    cu = torch.cat([cu, cu[-1:]])  # a zero-length slot at the end
    q = torch.cat([q, torch.randn(1, 2, 4, generator=gen)])
    mask, seg = slot_mask(cu, 6)
    assert seg.tolist() == [0, 0, 0, 1, 1, 2]
    out = pad_query_attention(q, k, v, mask, 0.5, cu, 3)
    for slot, (a, b) in enumerate(((0, 3), (5, 6))):
        want = F.scaled_dot_product_attention(q[[slot * 2]].transpose(0, 1), k[a:b].transpose(0, 1),
                                              v[a:b].transpose(0, 1), scale=0.5).transpose(0, 1)
        torch.testing.assert_close(out[slot * 2], want[0])
    assert out[1].isnan().all() and out[3].isfinite().all()
