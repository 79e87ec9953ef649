"""What the SigLIP2 NaFlex adapter adds to the family tests (tests/models/test_families.py): the resized position
table from host weights equals the tower's per image, upsampling and downsampling (antialias: more than 2 taps an
axis); the padded call's layout (valid rows back in place, padding rows zero) and its mask; the attention-pooling
head over valid rows only; the headless tower (LFM2-VL's); refusals with messages that name the argument.
"""

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
from encgraph.models.siglip2 import UnusualMask, axis_weights, position_weights
from tests.models.fixtures_families import (
    SIGLIP2_VISION,
    _seeded,
    naflex,
    rel_err,
    require,
)

FAMILY = require("siglip2")
BUDGETS = [8, 16, 32]
GRID8 = dict(SIGLIP2_VISION, num_patches=64)  # an 8 x 8 table: downsampling to 1..7 patches a side is antialiased
SHAPES = [(3, 5), (2, 2), (1, 7), (16, 12), (8, 8), (1, 1), (5, 13)]  # down, down, mixed, up, same, one, up/down


def tower(head: bool = True, **config):
    from transformers.models.siglip2.configuration_siglip2 import Siglip2VisionConfig
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

    values = dict(SIGLIP2_VISION, vision_use_head=head, **config)
    return _seeded(lambda: Siglip2VisionModel._from_config(Siglip2VisionConfig(**values)))


def batch(shapes, seed=0, extra=0, fill=0.0):
    """A padded call of images ``shapes`` (``extra`` padding rows past the largest), padding pixels ``fill``."""
    grid = np.array([(1, h, w) for h, w in shapes])
    rows = FAMILY.pixels(grid, seed=seed)
    pixels, mask, spatial = naflex(rows, grid)
    if extra:
        pixels = torch.cat([pixels, pixels.new_zeros(pixels.shape[0], extra, pixels.shape[2])], 1)
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], 1)
    pixels = torch.where(mask[..., None].bool(), pixels, torch.full_like(pixels, fill))
    return pixels, mask, spatial


def test_axis_weights_are_antialiased_and_normalised():
    up, down = axis_weights(4, 7), axis_weights(8, 3)
    assert up.dtype == np.float32 and up.shape == (7, 4) and (np.count_nonzero(up, axis=1) <= 2).all()
    assert down.shape == (3, 8) and np.count_nonzero(down, axis=1).max() > 2  # wider than bilinear's 2 taps
    np.testing.assert_allclose(down.sum(1), 1, rtol=1e-6)
    np.testing.assert_array_equal(axis_weights(8, 8), np.eye(8, dtype=np.float32))
    h, w = position_weights(8, 2, 3)
    assert h.shape == w.shape == (6, 8)  # raster order: row k // 3, column k % 3
    np.testing.assert_array_equal(h, axis_weights(8, 2)[[0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(w, axis_weights(8, 3)[[0, 1, 2, 0, 1, 2]])


@pytest.mark.parametrize("config", [SIGLIP2_VISION, GRID8], ids=["4x4", "8x8"])
def test_position_embeddings_equal_the_towers_per_image(config):
    """The host weights' outer product times the table (what the graph runs) against the tower's own
    ``resize_positional_embeddings`` on the padded batch (transformers 5.25: the same weights; 5.15:
    ``F.interpolate(antialias=True)`` in float32 on the CPU)."""
    module = tower(**{k: v for k, v in config.items() if k == "num_patches"})
    embeddings = module.embeddings
    side = embeddings.position_embedding_size
    table = embeddings.position_embedding.weight
    spatial = torch.tensor(SHAPES)
    length = int(spatial.prod(1).max())
    with torch.no_grad():
        want = embeddings.resize_positional_embeddings(table.reshape(side, side, -1), spatial, length)
    worst = 0.0
    for i, (h, w) in enumerate(SHAPES):
        pos_h, pos_w = (torch.from_numpy(a) for a in position_weights(side, h, w))
        got = ((pos_h[:, :, None] * pos_w[:, None, :]).flatten(1) @ table.float()).to(table.dtype)
        worst = max(worst, float((got - want[i, : h * w]).abs().max()))
    assert worst < 2e-6, worst


@pytest.mark.parametrize("head", [True, False], ids=["head", "no head"])
def test_padded_call_matches_the_tower_on_valid_rows_and_pooler(head):
    """Odd sizes and counts, more padding than any image needs, padding pixels that are not zero: the valid
    rows and the pooled vector equal the tower's (which masks the padding); the padding rows are zero."""
    module = tower(head)
    reference = copy.deepcopy(module)
    fast = encgraph.graphed(module, budgets=BUDGETS, max_items=3, mode=RunMode.STATIC)
    shapes = [(3, 5), (1, 1), (5, 6), (2, 7), (7, 3), (1, 9)]  # 30 rows: a budget; 21 rows with others
    pixels, mask, spatial = batch(shapes, extra=5, fill=0.5)
    with torch.no_grad():
        got = fast(pixels, mask, spatial)
        want = reference(pixels, mask, spatial)
    assert got.last_hidden_state.shape == want.last_hidden_state.shape == (6, 35, 32)
    assert (got.pooler_output is None) == (not head)
    for i, (h, w) in enumerate(shapes):
        assert rel_err(got.last_hidden_state[i, : h * w], want.last_hidden_state[i, : h * w]) < 1e-5, i
        assert not got.last_hidden_state[i, h * w:].any()  # the tower's: what its attention makes of them
        assert h * w == 35 or want.last_hidden_state[i, h * w:].abs().amax() > 0.1
        if head:
            assert rel_err(got.pooler_output[i], want.pooler_output[i]) < 1e-5, i
    assert encgraph.graphs(fast).stats["graph_items"] == len(shapes)


def test_pooler_reads_only_its_images_valid_rows():
    """Changing another image, or an image's padding pixels, leaves an image's pooled vector as it was."""
    adapter = wrap(tower())
    runner = encgraph.EncoderGraphRunner(adapter, budgets=[32], max_items=4, mode=RunMode.STATIC)
    pixels, mask, spatial = batch([(2, 3), (4, 4), (1, 5)], extra=2)
    with torch.no_grad():
        base = runner(adapter.inputs(pixels, mask, spatial))
        changed = pixels.clone()
        changed[1] += 1  # image 1
        changed[0, 6:] = 3.0  # image 0's padding rows
        other = runner(adapter.inputs(changed, mask, spatial))
    for i in (0, 2):
        assert torch.equal(base[i]["pooler_output"], other[i]["pooler_output"]), i
        assert torch.equal(base[i]["last_hidden_state"], other[i]["last_hidden_state"]), i
    assert not torch.equal(base[1]["pooler_output"], other[1]["pooler_output"])


def test_unusual_masks_are_the_towers_own_calls():
    """A mask that is not each image's first h*w rows, or none, is answered by the tower's forward, counted."""
    module = tower()
    reference = copy.deepcopy(module)
    fast = encgraph.graphed(module, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, mask, spatial = batch([(2, 3), (3, 3)])
    holes = mask.clone()
    holes[1, 0] = 0
    with torch.no_grad():
        for m in (holes, None):
            got, want = fast(pixels, m, spatial), reference(pixels, m, spatial)
            assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    reasons = encgraph.graphs(fast).stats["eager_reasons"]
    assert reasons == {"pixel_attention_mask not each image's first h*w rows": 1, "no pixel_attention_mask": 1}


def test_bad_arguments_are_refused_by_name():
    adapter = wrap(tower())
    pixels, mask, spatial = batch([(2, 3), (3, 3)])
    cases = [
        ((pixels[0], mask, spatial), InputError, r"pixel_values: expected shape \(images, max_patches, 12\)"),
        ((pixels.long(), mask, spatial), InputTypeError, "pixel_values: expected a floating-point tensor"),
        ((pixels, mask, spatial.float()), InputError, r"spatial_shapes: expected an integer \(2, 2\) tensor"),
        ((pixels, mask, spatial[:1]), InputError, r"spatial_shapes: expected an integer \(2, 2\)"),
        ((pixels, mask, torch.tensor([[2, 3], [4, 3]])), InputError, r"spatial_shapes: image 1 is \[4, 3\] patches"),
        ((pixels, mask, torch.tensor([[0, 3], [3, 3]])), InputError, r"h, w >= 1"),
        ((pixels, None, spatial), InputError, "pixel_attention_mask: expected .* got None"),
        ((pixels, mask[:, :4], spatial), InputError, r"pixel_attention_mask: expected an integer \(2, 9\)"),
        ((pixels, 1 - mask, spatial), UnusualMask, "pixel_attention_mask: image 0 must be 1 on its first 6 rows"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            adapter.inputs(*args)
    with pytest.raises(InputTypeError, match="return_dict: expected True or False"):
        adapter.inputs(pixels, mask, spatial, return_dict=1)
    assert adapter.inputs(pixels, mask.bool(), spatial.tolist()).grid.tolist() == [[1, 2, 3], [1, 3, 3]]
    fast = encgraph.graphed(tower(), budgets=BUDGETS, mode=RunMode.STATIC)
    with pytest.raises(InputTypeError, match="got 'pixel_values' both positionally and by keyword"):
        fast(pixels, mask, spatial, pixel_values=pixels)


def test_unwrap_restores_every_attention_forward():
    module = tower()
    fast = encgraph.graphed(module, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, mask, spatial = batch([(2, 3)])
    with torch.no_grad():
        fast(pixels, mask, spatial)
    assert all("forward" not in m.__dict__ for m in module.modules() if m is not module)
    assert encgraph.graphs(fast).unwrap() is module
    assert all("forward" not in m.__dict__ for m in module.modules())


def test_axis_weights_are_transformers_5_25_weights_bit_for_bit():
    """transformers 5.25's helper, written out here (5.15 has ``F.interpolate`` in its place): the same float32
    operations on the padded batch give the same weights, so only the matmul's blocking differs from the tower."""
    spatial = torch.tensor(SHAPES)
    length = int(spatial.prod(1).max())
    for side in (4, 8, 16):
        sizes = spatial.float()[:, None]
        positions = torch.arange(length, dtype=torch.float32)[None, :, None]
        rows = torch.div(positions, sizes[..., 1:], rounding_mode="floor")
        index = torch.cat([rows, positions - rows * sizes[..., 1:]], dim=-1) * (positions < sizes.prod(-1, keepdim=True))
        scale = side / sizes
        center = (index + 0.5) * scale - 0.5
        source = torch.arange(side, dtype=torch.float32)
        weights = (1 - (source - center[..., None]).abs_().div_(scale.clamp(min=1)[..., None])).clamp_(min=0)
        weights = weights / weights.sum(-1, keepdim=True)
        weights = (weights[..., 0, :, None] * weights[..., 1, None, :]).flatten(-2)
        for i, (h, w) in enumerate(SHAPES):
            pos_h, pos_w = (torch.from_numpy(a) for a in position_weights(side, h, w))
            assert torch.equal((pos_h[:, :, None] * pos_w[:, None, :]).flatten(1), weights[i, : h * w]), (side, h, w)
