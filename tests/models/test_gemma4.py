"""Gemma-4 vision tower on the CPU (tiny random tower, fp32): per item, the runner's padded static forward
(``RunMode.STATIC``) equals the tower's own forward and, through ``graphed()``, the full model's
``get_image_features`` / ``get_video_features``; both paths; the image path overflowing its ladder (partial eager)
while the video path keeps its static forward; calls in every grad mode; no host read in the static forward.

Geometry (fixtures_multipath): patch rows of 12 values, pooling kernel 3, ``frame_tokens=4`` so that items of at
most 4 soft tokens (6 x 6 patches) take the video path; ladders image (8, 16), video (4, 8).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the Gemma-4 adapter")

import encgraph
from encgraph.models.own_forward import own_forward
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import ConfigError, InputError, InputTypeError, UnsupportedModelError
from encgraph.models.gemma4 import Gemma4Adapter, Gemma4Patches
from encgraph.models.gemma4_layout import PatchLayouts, pack_patches
from encgraph.models.protocol import StockCall
from encgraph.models.registry import wrap
from tests.models.fixtures_multipath import (  # one_thread: an autouse fixture
    GEMMA_TINY, GRAD_MODES, gemma4_batch, gemma4_model, gemma4_tower, grad_mode, grid_positions, rel_err,
    split_rows,
    static_forwards,
)

OPTIONS = {"frame_tokens": 4, "max_image_tokens": 16, "max_video_tokens": 8}
TOL = 1e-5
C = 12  # 3 channels * patch 2 * 2

IMAGES = [(6, 9), (12, 6), (9, 9), (6, 6), (3, 3), (3, 6)]
"""Soft tokens 6, 8, 9 (image path) and 4, 1, 2 (video path)."""


@pytest.fixture(scope="module")
def tower() -> torch.nn.Module:
    return gemma4_tower()


def reference(tower: torch.nn.Module, pv: torch.Tensor, pos: torch.Tensor) -> Any:
    with torch.no_grad():
        return own_forward(tower)(pv, pos)  # the tower's own forward, wrapped or not


def check_call(fast: torch.nn.Module, tower: torch.nn.Module, grids, rows: int, **batch: Any) -> None:
    pv, pos = gemma4_batch(grids, rows, C, **batch)
    want = reference(tower, pv, pos)
    got = fast(pv, pos)
    assert type(got) is type(want)
    for field, value in want.items():  # every field the tower fills
        assert got[field].shape == value.shape, field
        tokens = [w * h // 9 for w, h in grids]
        for i, (g, w) in enumerate(zip(split_rows(got[field], tokens), split_rows(value, tokens))):
            assert rel_err(g, w) < TOL, f"{field} item {i}: {rel_err(g, w):.3g}"
    assert [k for k, v in got.items() if v is not None] == [k for k, v in want.items() if v is not None]


def test_registry_ladders_and_routing(tower: torch.nn.Module) -> None:
    adapter = wrap(tower)
    assert isinstance(adapter, Gemma4Adapter)
    from encgraph.packing import dense_ladder

    # The runner's dense default ladder, in multiples of each path's smallest budget.
    assert EncoderGraphRunner(adapter, mode=RunMode.STATIC).ladders == {
        "image": dense_ladder(140, 2240, allow_zero=True), "video": dense_ladder(70, 1120, allow_zero=True),
    }
    small = wrap(tower, **OPTIONS)
    inputs = small.inputs(*gemma4_batch(IMAGES, 108, C))
    assert inputs.tokens.tolist() == [6, 8, 9, 4, 1, 2]
    assert inputs.video.tolist() == [False, False, False, True, True, True]
    specs = small.item_specs(inputs)
    assert [s.tokens for s in specs][:4] == [{"image": 6, "video": 0}, {"image": 8, "video": 0},
                                             {"image": 9, "video": 0}, {"image": 0, "video": 4}]
    assert specs[0].input_size == 54
    # Buffer slots: the video path's attention is one frame (36 patches) long; the image path's the budget.
    video = small.buffer_specs("video", 8, 4, 4)
    assert video["cu_seqlens"].chunk == 36 and video["cu_seqlens"].shape == (1 + 4 + 2,)
    image = small.buffer_specs("image", 16, 4, 4)
    assert image["cu_seqlens"].chunk == 144 and image["cu_seqlens"].shape == (1 + 3 + 1,)
    assert image["pixels"].shape == (144, C) and image["pixels"].dtype == torch.float32
    small.unwrap()


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
def test_graphed_tower_equals_tower_per_item(tower: torch.nn.Module, mode: str) -> None:
    """Images of both paths in one call (and a call of frames only), each item equal to the tower's rows."""
    fast = encgraph.graphed(tower, adapter_options=OPTIONS, mode=RunMode.STATIC)
    try:
        with grad_mode(mode):
            check_call(fast, tower, IMAGES, 108, seed=1)
            check_call(fast, tower, [(6, 6)] * 5 + [(3, 3)], 36, seed=2)
        stats = encgraph.graphs(fast).stats
        assert stats["eager_items"] == 0 and stats["graph_items"] == 12
        assert all(sum(stats["paths"][p]["replays"].values()) > 0 for p in ("image", "video"))
    finally:
        assert encgraph.graphs(fast).unwrap() is tower


def test_any_row_order_and_return_dict(tower: torch.nn.Module) -> None:
    """Real and padding rows in any order (the tower pools by position): the host layout finds every block."""
    fast = encgraph.graphed(tower, adapter_options=OPTIONS, mode=RunMode.STATIC)
    try:
        check_call(fast, tower, IMAGES[:4], 108, seed=3, shuffle=True)
        pv, pos = gemma4_batch(IMAGES[:2], 108, C, seed=4)
        as_tuple = fast(pv, pos, return_dict=False, use_cache=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 1
        assert rel_err(as_tuple[0], reference(tower, pv, pos).last_hidden_state) < TOL
    finally:
        encgraph.graphs(fast).unwrap()


def video_features(model: torch.nn.Module, frames: torch.Tensor, positions: torch.Tensor) -> Any:
    """``get_video_features`` on ``(videos, frames, P, C)``: transformers 5.17 takes that layout, 5.24 the frames
    flattened with ``num_frames_per_video``."""
    if "num_frames_per_video" in inspect.signature(model.get_video_features).parameters:
        counts = torch.full((frames.shape[0],), frames.shape[1])
        return model.get_video_features(frames.flatten(0, 1), positions.flatten(0, 1), num_frames_per_video=counts)
    return model.get_video_features(frames, positions)


@pytest.mark.parametrize("mode", ["no_grad", "plain"])
def test_full_model_feature_functions(mode: str) -> None:
    """With the graphed tower in place, the model's own image and video feature functions give the same
    per-item outputs (every field) as with the original tower."""
    model = gemma4_model()
    pv, pos = gemma4_batch(IMAGES, 108, C, seed=5)
    frames, frame_pos = gemma4_batch([(6, 6), (6, 6), (3, 6), (3, 6), (6, 3), (6, 3)], 36, C, seed=6)
    frames, frame_pos = frames.view(3, 2, 36, C), frame_pos.view(3, 2, 36, 2)
    with torch.no_grad():
        want_image = model.get_image_features(pv, pos)
        want_video = video_features(model, frames, frame_pos)
    original = model.vision_tower
    model.vision_tower = encgraph.graphed(original, adapter_options=OPTIONS, mode=RunMode.STATIC)
    try:
        with grad_mode(mode):
            got_image = model.get_image_features(pv, pos)
            got_video = video_features(model, frames, frame_pos)
        for got, want in ((got_image, want_image), (got_video, want_video)):
            assert type(got) is type(want)
            assert rel_err(got.last_hidden_state, want.last_hidden_state) < TOL
            assert len(got.pooler_output) == len(want.pooler_output)
            for g, w in zip(got.pooler_output, want.pooler_output):
                assert g.shape == w.shape and rel_err(g, w) < TOL
        assert [p.shape[0] for p in got_video.pooler_output] == [8, 4, 4]
        assert encgraph.graphs(model.vision_tower).stats["graph_items"] == len(IMAGES) + 6
    finally:
        model.vision_tower = encgraph.graphs(model.vision_tower).unwrap()


def test_partial_eager_image_path(tower: torch.nn.Module) -> None:
    """An image over the image ladder (36 tokens > 16) runs its path eagerly; the frames batched with it replay."""
    adapter = wrap(tower, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    grids = [(18, 18), (6, 6), (3, 6), (6, 3)]
    pv, pos = gemma4_batch(grids, 324, C, seed=7)
    out = runner(adapter.inputs(pv, pos))
    want = split_rows(reference(tower, pv, pos).last_hidden_state, [36, 4, 2, 2])
    for g, w in zip(out, want):
        assert g.shape == w.shape and rel_err(g, w) < TOL
    paths = runner.stats["paths"]
    assert paths["image"]["eager_items"] == 1 and sum(paths["image"]["replays"].values()) == 0
    assert paths["video"]["eager_items"] == 0 and sum(paths["video"]["replays"].values()) >= 1
    # Each path's eager forward gives the same rows as its static forward.
    inputs = adapter.inputs(pv, pos)
    eager = adapter.forward_eager("video", inputs)["last_hidden_state"]
    assert rel_err(eager, torch.cat(want[1:])) < TOL
    adapter.unwrap()


def test_sample_inputs_and_concat(tower: torch.nn.Module) -> None:
    adapter = wrap(tower, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    for path, tokens, expected in (("image", 12, [12]), ("image", 2, [5]), ("video", 10, [4, 4, 2])):
        sample = adapter.sample_inputs(path, tokens)
        specs = adapter.item_specs(sample)
        assert [s.tokens[path] for s in specs] == expected
        assert all(sum(s.tokens.values()) == s.tokens[path] for s in specs)
        assert sample.pixel_values.dtype == torch.float32 and bool((sample.pixel_values != 0).any())
    a = adapter.inputs(*gemma4_batch(IMAGES[:3], 108, C, seed=8))
    b = adapter.inputs(*gemma4_batch(IMAGES[3:], 36, C, seed=9))
    joined = adapter.concat([a, b])
    assert joined.tokens.tolist() == a.tokens.tolist() + b.tokens.tolist()
    for g, w in zip(runner(joined), runner(a) + runner(b)):
        assert torch.allclose(g, w, atol=1e-6)
    adapter.unwrap()


def test_stock_calls(tower: torch.nn.Module) -> None:
    """Per-layer outputs and unknown keywords go to the tower's own forward."""
    adapter = wrap(tower, **OPTIONS)
    pv, pos = gemma4_batch(IMAGES[:2], 108, C)
    assert adapter.inputs_from_call(pv, pos, output_hidden_states=True) == StockCall("output_hidden_states requested")
    assert adapter.inputs_from_call(pv, pos, output_attentions=True).reason == "output_attentions requested"
    assert adapter.inputs_from_call(pv, pos, seq_idx=None).reason == "keyword arguments ['seq_idx']"
    assert isinstance(adapter.inputs_from_call(pv, pos, output_hidden_states=False, use_cache=True), Gemma4Patches)
    # The tower is never left switched: its own forward (what a StockCall runs) keeps its attention setting.
    original = tower.config._attn_implementation
    EncoderGraphRunner(adapter, mode=RunMode.STATIC)(adapter.inputs(pv, pos))
    assert tower.config._attn_implementation == original and original != "encgraph_flash_varlen"
    with torch.no_grad():
        assert len(tower(pv, pos, output_hidden_states=True).hidden_states) == 3
    adapter.unwrap()


def test_pack_patches_layout() -> None:
    """Each soft token's k x k patches are consecutive, tokens in the tower's order (x-blocks fastest)."""
    pos = np.full((1, 63, 2), -1)
    pos[0, :54] = grid_positions(6, 9)
    tokens, source, packed, starts = pack_patches(pos, 3, 64)
    assert tokens.tolist() == [6] and starts.tolist() == [0, 54]
    blocks = packed.reshape(6, 9, 2) // 3
    assert (blocks == blocks[:, :1]).all()  # one block per token
    assert [tuple(b) for b in blocks[:, 0]] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert sorted(source.tolist()) == list(range(54))


def test_layout_fast_path_equals_general_path() -> None:
    """The processor's layout takes the cached fast path; the result is the general path's, and any other layout
    (shuffled rows) falls back to it."""
    pos = np.full((4, 108, 2), -1)
    for i, (w, h) in enumerate(IMAGES[:4]):
        pos[i, : w * h] = grid_positions(w, h)
    layouts = PatchLayouts(3, 64)
    fast = layouts.pack(pos)
    assert len(layouts._grids) == 4  # the fast path ran: one cached table per grid shape
    for got, want in zip(fast, pack_patches(pos, 3, 64)):
        assert np.array_equal(got, want)
    shuffled = pos[:, np.random.default_rng(0).permutation(108)]
    for got, want in zip(PatchLayouts(3, 64).pack(shuffled), pack_patches(shuffled, 3, 64)):
        assert np.array_equal(got, want)


def test_no_host_sync() -> None:
    """Both paths' static forwards run on the ``meta`` device, where reading a tensor value on the host raises."""
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    with torch.device("meta"):
        meta = Gemma4VisionModel(Gemma4VisionConfig(**GEMMA_TINY)).eval()
    outputs = static_forwards(Gemma4Adapter(meta, **OPTIONS), (("image", 16), ("video", 8)), "meta")
    assert {p: tuple(o["last_hidden_state"].shape) for p, o in outputs.items()} == {"image": (16, 32), "video": (8, 32)}
    assert all(o["last_hidden_state"].device.type == "meta" for o in outputs.values())


def test_bad_inputs(tower: torch.nn.Module) -> None:
    adapter = wrap(tower, **OPTIONS)
    pv, pos = gemma4_batch(IMAGES[:2], 108, C)
    gap = pos.clone()
    gap[0, 5] = -1  # a hole in the grid
    dup = pos.clone()
    dup[0, 1] = dup[0, 0]
    odd = torch.full((1, 108, 2), -1)
    odd[0, :20] = torch.from_numpy(grid_positions(4, 5))
    half = pos.clone()
    half[0, 3, 0] = -1
    cases = [
        ((pv, gap), InputError, "full grid"),
        ((pv, dup), InputError, "same patch position twice"),
        ((pv[:1], odd), InputError, "multiples of the pooling kernel"),
        ((pv, half), InputError, "outside"),
        ((pv, torch.full_like(pos, -1)), InputError, "no patches"),
        ((pv[:, :100], pos[:, :100]), InputError, "not a multiple of 9"),
        ((pv, pos[:, :54]), InputError, "expected shape"),
        ((pv[..., :8], pos), InputError, "expected shape"),
        ((pv.long(), pos), InputTypeError, "floating-point"),
        ((pv, pos.float()), InputTypeError, "integers"),
        (([pv], pos), InputTypeError, "expected a tensor"),
        ((pv, None), InputTypeError, "pixel_position_ids"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            adapter.inputs_from_call(*args)
    with pytest.raises(InputTypeError, match="Gemma4Patches"):
        adapter.item_specs((pv, pos))
    with pytest.raises(InputTypeError, match="multiple values for argument 'pixel_values'"):
        adapter.inputs_from_call(pv, pos, pixel_values=pv)
    with pytest.raises(ConfigError, match="max_video_tokens"):
        Gemma4Adapter(tower, frame_tokens=8, max_video_tokens=4)
    with pytest.raises(ConfigError, match="path"):
        adapter.sample_inputs("audio", 4)
    with pytest.raises(UnsupportedModelError, match="Gemma4VisionModel"):
        Gemma4Adapter(torch.nn.Linear(2, 2))
    adapter.unwrap()
