"""benches/lib/trace.py and cases.py on the CPU: the traffic trace is seeded and follows its documented
distribution, and the size helpers match the processors."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("transformers")

from benches.lib import cases, trace  # noqa: E402
from benches.lib.cases import Visual  # noqa: E402
from benches.lib.towers import TOWERS  # noqa: E402


def test_trace_is_seeded_and_prefix_stable():
    a = trace.generate_trace(300, seed=3)
    assert a == trace.generate_trace(300, seed=3)
    assert a != trace.generate_trace(300, seed=4)
    assert trace.generate_trace(40, seed=3) == a[:40]


@pytest.fixture(scope="module")
def big_trace():
    return trace.generate_trace(4000, seed=0)


def test_trace_follows_documented_shares(big_trace):
    videos = [r for r in big_trace if r[0].is_video]
    images = [r for r in big_trace if not r[0].is_video]
    assert abs(len(videos) / len(big_trace) - trace.VIDEO_SHARE) < 0.02
    counts = Counter(len(r) for r in images)
    assert set(counts) <= set(trace.ITEMS_PER_REQUEST)
    for n, p in trace.ITEMS_PER_REQUEST.items():
        assert abs(counts[n] / len(images) - p) < 0.025, n
    mean = np.mean([len(r) for r in images])
    assert abs(mean - trace.expected_items_per_image_request()) < 0.1
    kinds = Counter(v.kind for r in images for v in r)
    total = sum(kinds.values())
    for kind, p in trace.IMAGE_KINDS.items():
        assert abs(kinds[kind] / total - p) < 0.025, kind


def test_trace_sizes_stay_in_documented_ranges(big_trace):
    portrait = photos = 0
    for request in big_trace:
        for v in request:
            if v.kind == "video":
                assert len(request) == 1 and v.frames in trace.VIDEO_FRAMES
                assert (v.height, v.width) in trace.VIDEO_SIZES
                continue
            assert v.frames == 1
            if v.kind == "icon":
                assert v.height == v.width and trace.ICON_SIDE[0] <= v.width <= trace.ICON_SIDE[1]
            elif v.kind == "document":
                assert trace.DOCUMENT_WIDTH[0] <= v.width <= trace.DOCUMENT_WIDTH[1]
                assert v.height == round(v.width * trace.DOCUMENT_ASPECT)
            elif v.kind == "screenshot":
                assert (v.height, v.width) in trace.SCREENSHOT_SIZES
            else:
                assert v.kind == "photo"
                lo, hi = trace.PHOTO_LONG_SIDE
                assert lo - 1 <= max(v.height, v.width) <= hi + 1
                ratio = max(v.height, v.width) / min(v.height, v.width)
                assert min(abs(ratio - a) for a in trace.PHOTO_ASPECTS) < 0.02
                if v.height != v.width:  # squares have no orientation
                    photos += 1
                    portrait += v.height > v.width
    assert abs(portrait / photos - trace.PORTRAIT_SHARE) < 0.04


def test_caps_bound_tokens_per_image_and_frame(big_trace):
    geom = TOWERS["qwen2_5_vl_7b"].geometry(False)
    merge2 = geom.merge**2
    for request in big_trace[:500]:
        for v in request:
            cap = trace.VIDEO_FRAME_MAX_TOKENS if v.is_video else trace.IMAGE_MAX_TOKENS
            t, h, w = cases.packed_grid(v, geom, cap)
            assert h % geom.merge == 0 and w % geom.merge == 0
            assert cases.MIN_TOKENS <= h * w // merge2 <= cap
            assert t == (math.ceil(v.frames / geom.temporal_patch) if v.is_video else 1)
    summary = trace.trace_summary(big_trace[:200], geom)
    assert summary["requests"] == 200 and summary["items"] == sum(len(r) for r in big_trace[:200])
    assert trace.Caps.default(True) == trace.Caps(trace.SMOKE_MAX_TOKENS, trace.SMOKE_MAX_TOKENS)


@pytest.mark.parametrize("size, tower, grid", [
    ((224, 224), "qwen2_5_vl_7b", (1, 16, 16)),
    ((336, 336), "qwen3_vl_8b", (1, 20, 20)),  # 320 px: Python rounds half to even, as the processors do
    ((252, 448), "qwen3_vl_8b", (1, 16, 28)),
    ((10, 10), "qwen2_5_vl_7b", (1, 4, 4)),  # raised to MIN_TOKENS merged tokens
])
def test_packed_grid_rounds_like_the_processors(size, tower, grid):
    assert cases.packed_grid(Visual(*size), TOWERS[tower].geometry(False)) == grid


def test_packed_grid_caps_the_area():
    t, h, w = cases.packed_grid(Visual(3000, 4000), TOWERS["qwen2_5_vl_7b"].geometry(False), 1280)
    assert t == 1 and h * w // 4 <= 1280 and abs(w / h - 4 / 3) < 0.1


def test_case_sizes_at_real_geometry():
    g, gs, gi = (TOWERS[n].geometry(False) for n in ("qwen2_5_vl_7b", "siglip_so400m_384", "internvit_300m"))
    by_name = {c.name: c for c in cases.CASES}
    assert cases.sizes_of(by_name["1x224"].visuals, g).patches == 256
    assert cases.sizes_of(by_name["1x896"].visuals, g).tokens == 1024
    assert cases.sizes_of(by_name["video8"].visuals, g).grids == ((4, 18, 32),)
    assert cases.sizes_of(by_name["1x896"].visuals, gs).tiles == 3 * 3 + 1
    assert cases.sizes_of(by_name["video8"].visuals, gs).tiles == 8
    assert cases.sizes_of(by_name["1x896"].visuals, gi).tiles == 2 * 2 + 1
    assert cases.sizes_of(by_name["8x336"].visuals, gi).tiles == 8


@pytest.mark.parametrize("tower, case, grids, tiles, crops", [
    ("glm4v", "1x448", ((1, 32, 32),), 0, ()),
    ("qwen3_5", "8x336", ((1, 20, 20),) * 8, 0, ()),  # patch 16 x merge 2: 336 -> 320 px
    ("ernie4_5_vl_moe", "8x336", ((1, 24, 24),) * 8, 0, ()),
    ("kimi_k25", "1x448", ((1, 32, 32),), 0, ()),
    ("minicpmv4_6", "8x336", ((1, 32, 32),) * 8, 0, ()),  # resized up to about 448 x 448 px, unsliced
    ("llama4", "1x448", (), 5, ()),  # 2 x 2 tiles of 336 px and the global tile
    ("llama4", "8x336", (), 8, ()),
    ("gemma4", "1x448", ((1, 48, 48),), 0, ()),  # the patch budget of 280 soft tokens, sides multiples of 3
    ("step3p7", "8x336", (), 8, (0,) * 8),  # global views only: the processor crops only larger images
    ("step3p7", "1x896", (), 5, (4,)),
])
def test_family_case_sizes_follow_their_processors(tower, case, grids, tiles, crops):
    by_name = {c.name: c for c in cases.ALL_CASES}
    sizes = cases.sizes_of(by_name[case].visuals, TOWERS[tower].geometry(False))
    assert (sizes.grids, sizes.tiles, sizes.crops) == (grids, tiles, crops)
    if grids:
        assert sizes.patches == sum(t * h * w for t, h, w in grids)


def test_family_layouts_refuse_what_they_do_not_model():
    for tower in ("minicpmv4_6", "gemma4", "step3p7"):
        with pytest.raises(cases.CaseError, match="images only"):
            cases.sizes_of([Visual(252, 448, frames=8, kind="video")], TOWERS[tower].geometry(False))
    with pytest.raises(cases.CaseError, match="slices"):
        cases.sizes_of([Visual(896, 896)], TOWERS["minicpmv4_6"].geometry(False))


SIDES = [(448, 448), (336, 336), (224, 448), (640, 360), (300, 1000), (50, 2000), (20, 200), (1000, 3000),
         (4000, 3000), (728, 730), (1100, 800)]
"""Image sizes (h, w) the processor rules are checked on: squares, landscapes, portraits, elongated, tiny, huge."""


def test_the_processor_rules_are_the_processors():
    """The family layouts' resizing and cropping equal the Hugging Face processors' own (where importable)."""
    def load(module, name):
        try:
            return getattr(importlib.import_module(f"transformers.models.{module}"), name)
        except (ImportError, AttributeError) as exc:  # an older transformers, or a backend it needs is missing
            pytest.skip(f"{module}.{name}: {exc}")

    step = load("step3p7.image_processing_step3p7", "Step3p7ImageProcessor")()
    minicpm = load("minicpmv4_6.image_processing_minicpmv4_6", "MiniCPMV4_6ImageProcessor")()
    gemma_size = load("gemma4.image_processing_pil_gemma4", "get_aspect_ratio_preserving_size")
    g_step, g_minicpm, g_gemma = (TOWERS[n].geometry(False) for n in ("step3p7", "minicpmv4_6", "gemma4"))
    for h, w in SIDES:
        v = Visual(h, w)
        assert cases.view_crops(v, g_step) == step.get_number_of_image_patches(h, w), (h, w)
        ph, pw = gemma_size(h, w, 16, cases.GEMMA4_MAX_SOFT_TOKENS * 9, 3)
        assert cases.padded_grid(v, g_gemma) == (1, ph // 16, pw // 16), (h, w)
        if h * w <= cases.MINICPM_SCALE**2:
            mh, mw = minicpm.find_best_resize((h, w), cases.MINICPM_SCALE, 14, "16x", allow_upscale=True)
            assert minicpm.get_sliced_grid((h, w), minicpm.max_slice_nums, cases.MINICPM_SCALE) is None
            assert cases.strip_grid(v, g_minicpm) == (1, mh // 14, mw // 14), (h, w)
