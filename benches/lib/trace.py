"""The seeded traffic trace of ``benches/traffic.py`` (and of ``planning.py``, ``data_parallel.py``).

The trace (``generate_trace(n, seed)``; tower-agnostic pixel sizes) draws each request independently:

- with probability ``VIDEO_SHARE`` (0.10) one short video: ``VIDEO_FRAMES`` frames (4-16, even, uniform) of a
  size out of ``VIDEO_SIZES`` (uniform); at most ``VIDEO_FRAME_MAX_TOKENS`` (256) merged tokens per frame pair;
- otherwise 1-8 images (``ITEMS_PER_REQUEST``: 1: 40%, 2: 20%, 3: 12%, 4: 9%, 5: 7%, 6: 5%, 7: 4%, 8: 3%), each
  of a kind (``IMAGE_KINDS``: photo 45%, screenshot 25%, document 15%, icon 15%):
  photo: long side log-uniform in 320-2048 px, aspect 4:3, 3:2, 16:9 or 1:1 (uniform), portrait 30%;
  screenshot: a size out of ``SCREENSHOT_SIZES`` (desktop and phone, uniform);
  document: width uniform in 800-1700 px, height = width x 11 / 8.5 (a letter page at 94-200 dpi);
  icon: a square of side uniform in 32-256 px;
  every image at most ``IMAGE_MAX_TOKENS`` (1280) merged tokens (Qwen's ``max_pixels = 1280 x 28 x 28``).

The **photo** trace (``generate_trace(n, seed, kind="photo")``, issue 32: big images at each processor's default
size) draws 1-3 photos per request (``PHOTO_ITEMS``: 1: 50%, 2: 30%, 3: 20%), long side log-uniform in
``PHOTO_SIDES`` (400-4000 px), aspect and orientation as the chat trace's photos, the short side at least 400 px;
each tower resizes them under its processor's default ``max_pixels`` (:data:`PHOTO_MAX_PIXELS`; :func:`photo_caps`),
so a 4000 x 3000 photo is about 15,000 merged tokens (60,000 patch rows) on Qwen2.5-VL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from benches.lib.cases import Sizes, Visual, sizes_of
from benches.lib.towers import Geometry

ITEMS_PER_REQUEST: dict[int, float] = {1: 0.40, 2: 0.20, 3: 0.12, 4: 0.09, 5: 0.07, 6: 0.05, 7: 0.04, 8: 0.03}
VIDEO_SHARE = 0.10
IMAGE_KINDS: dict[str, float] = {"photo": 0.45, "screenshot": 0.25, "document": 0.15, "icon": 0.15}
PHOTO_LONG_SIDE = (320, 2048)
PHOTO_ASPECTS = (4 / 3, 3 / 2, 16 / 9, 1.0)
PORTRAIT_SHARE = 0.3
SCREENSHOT_SIZES: tuple[tuple[int, int], ...] = (  # (height, width)
    (720, 1280), (1080, 1920), (768, 1366), (900, 1440), (1440, 2560), (844, 390), (2532, 1170),
)
DOCUMENT_WIDTH = (800, 1700)
DOCUMENT_ASPECT = 11 / 8.5
ICON_SIDE = (32, 256)
VIDEO_FRAMES = (4, 6, 8, 10, 12, 14, 16)
VIDEO_SIZES: tuple[tuple[int, int], ...] = ((360, 640), (480, 854), (720, 1280), (640, 360))
IMAGE_MAX_TOKENS = 1280
VIDEO_FRAME_MAX_TOKENS = 256

PHOTO_ITEMS: dict[int, float] = {1: 0.5, 2: 0.3, 3: 0.2}
PHOTO_SIDES = (400, 4000)
PHOTO_MAX_PIXELS: dict[str, int] = {
    "qwen2_5_vl_7b": 12_845_056,  # Qwen2.5-VL-7B-Instruct's preprocessor_config.json: 16,384 x 28 x 28
    "qwen3_vl_8b": 16_777_216,  # Qwen3-VL-8B-Instruct's: size.longest_edge 16,384 x 32 x 32
    "glm4v": 11_760_000,  # transformers' Glm4vImageProcessor default: size.longest_edge 15,000 x 28 x 28
    "paddleocr_vl": 2_359_296,  # transformers 5.25's PaddleOCRVLImageProcessor default: size.longest_edge (1536^2)
    "hunyuan_vl": 4_194_304,  # transformers 5.25's HunYuanVLImageProcessor default: size.longest_edge (2048^2)
}
"""Pixels at most per image under each tower's processor defaults (towers not listed: Qwen2.5-VL's)."""
TRACE_KINDS = ("chat", "photo")

SMOKE_REQUESTS = 12
SMOKE_MAX_TOKENS = 16
"""Requests and caps of a CPU-smoke trace (CPU attention is masked SDPA, quadratic in tokens)."""


def distribution(kind: str = "chat") -> dict[str, Any]:
    """The documented distribution of a trace kind, as stored in the results."""
    if kind == "photo":
        return {"kind": kind, "items_per_request": {str(k): v for k, v in PHOTO_ITEMS.items()},
                "long_side": PHOTO_SIDES, "short_side_min": PHOTO_SIDES[0],
                "photo_aspects": [round(a, 4) for a in PHOTO_ASPECTS], "portrait_share": PORTRAIT_SHARE,
                "max_pixels": PHOTO_MAX_PIXELS}
    return {
        "items_per_request": {str(k): v for k, v in ITEMS_PER_REQUEST.items()},
        "video_share": VIDEO_SHARE,
        "image_kinds": IMAGE_KINDS,
        "photo_long_side": PHOTO_LONG_SIDE,
        "photo_aspects": [round(a, 4) for a in PHOTO_ASPECTS],
        "portrait_share": PORTRAIT_SHARE,
        "screenshot_sizes": SCREENSHOT_SIZES,
        "document_width": DOCUMENT_WIDTH,
        "document_aspect": round(DOCUMENT_ASPECT, 4),
        "icon_side": ICON_SIDE,
        "video_frames": VIDEO_FRAMES,
        "video_sizes": VIDEO_SIZES,
        "image_max_tokens": IMAGE_MAX_TOKENS,
        "video_frame_max_tokens": VIDEO_FRAME_MAX_TOKENS,
    }


def expected_items_per_image_request() -> float:
    return sum(n * p for n, p in ITEMS_PER_REQUEST.items())


def _choice(rng: np.random.Generator, weights: dict[Any, float]) -> Any:
    keys = list(weights)
    return keys[int(rng.choice(len(keys), p=np.asarray(list(weights.values())) / sum(weights.values())))]


def _image(rng: np.random.Generator) -> Visual:
    kind = _choice(rng, IMAGE_KINDS)
    if kind == "photo":
        return _photo(rng, PHOTO_LONG_SIDE)
    if kind == "screenshot":
        h, w = SCREENSHOT_SIZES[int(rng.integers(len(SCREENSHOT_SIZES)))]
        return Visual(h, w, kind=kind)
    if kind == "document":
        w = int(rng.integers(DOCUMENT_WIDTH[0], DOCUMENT_WIDTH[1] + 1))
        return Visual(round(w * DOCUMENT_ASPECT), w, kind=kind)
    side = int(rng.integers(ICON_SIDE[0], ICON_SIDE[1] + 1))
    return Visual(side, side, kind=kind)


def sample_request(rng: np.random.Generator) -> tuple[Visual, ...]:
    """One request: a short video, or 1-8 images (see the module docstring)."""
    if rng.random() < VIDEO_SHARE:
        frames = VIDEO_FRAMES[int(rng.integers(len(VIDEO_FRAMES)))]
        h, w = VIDEO_SIZES[int(rng.integers(len(VIDEO_SIZES)))]
        return (Visual(h, w, frames=frames, kind="video"),)
    n = _choice(rng, ITEMS_PER_REQUEST)
    return tuple(_image(rng) for _ in range(n))


def _photo(rng: np.random.Generator, sides: tuple[int, int], short_min: float = 0.0) -> Visual:
    """A photo: long side log-uniform in ``sides``, one of ``PHOTO_ASPECTS``, the short side at least
    ``short_min``, portrait with ``PORTRAIT_SHARE``."""
    lo, hi = sides
    long_side = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    aspect = PHOTO_ASPECTS[int(rng.integers(len(PHOTO_ASPECTS)))]
    short_side = max(long_side / aspect, short_min)
    portrait = rng.random() < PORTRAIT_SHARE
    h, w = (long_side, short_side) if portrait else (short_side, long_side)
    return Visual(round(h), round(w), kind="photo")


def sample_photo_request(rng: np.random.Generator) -> tuple[Visual, ...]:
    """One request of the photo trace: 1-3 photos (see the module docstring)."""
    return tuple(_photo(rng, PHOTO_SIDES, PHOTO_SIDES[0]) for _ in range(_choice(rng, PHOTO_ITEMS)))


def generate_trace(n: int, seed: int = 0, kind: str = "chat") -> list[tuple[Visual, ...]]:
    """``n`` requests of the trace ``kind`` (``"chat"`` or ``"photo"``) drawn with
    ``numpy.random.default_rng(seed)``: the same ``(n, seed, kind)`` gives the same trace, and a trace of ``n`` is
    the first ``n`` requests of any longer one."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"generate_trace(kind): expected one of {TRACE_KINDS}, got {kind!r}")
    rng = np.random.default_rng(seed)
    sample = sample_photo_request if kind == "photo" else sample_request
    return [sample(rng) for _ in range(n)]


def photo_caps(tower: str, geom: Geometry) -> Caps:
    """The caps of the photo trace on ``tower``: its processor's ``max_pixels`` over ``factor^2`` merged tokens
    per image (videos do not occur)."""
    pixels = PHOTO_MAX_PIXELS.get(tower, PHOTO_MAX_PIXELS["qwen2_5_vl_7b"])
    return Caps(pixels / geom.factor**2, VIDEO_FRAME_MAX_TOKENS)


@attrs.frozen
class Caps:
    """Merged tokens at most per image and per video frame pair."""

    image: int = IMAGE_MAX_TOKENS
    frame: int = VIDEO_FRAME_MAX_TOKENS

    @classmethod
    def default(cls, tiny: bool) -> Caps:
        """The documented caps, or the CPU smoke's (``SMOKE_MAX_TOKENS`` for both) on tiny towers."""
        return cls(SMOKE_MAX_TOKENS, SMOKE_MAX_TOKENS) if tiny else cls()

    def sizes(self, request: Sequence[Visual], geom: Geometry) -> Sizes:
        return sizes_of(request, geom, max_image_tokens=self.image, max_frame_tokens=self.frame)

    def inputs(self, bench: Any, request: Sequence[Visual], seed: int) -> Any:
        """``bench.inputs`` (a :class:`~benches.lib.systems.TowerBench`) for ``request`` under these caps."""
        return bench.inputs(request, max_image_tokens=self.image, max_frame_tokens=self.frame, seed=seed)


def trace_summary(trace: Sequence[tuple[Visual, ...]], geom: Geometry, caps: Caps = Caps()) -> dict[str, Any]:
    """Counts of the trace on one tower: items and tokens per request, kinds, videos."""
    sizes = [caps.sizes(r, geom) for r in trace]
    tokens = np.array([s.tokens for s in sizes], dtype=np.float64)
    kinds: dict[str, int] = {}
    for request in trace:
        for v in request:
            kinds[v.kind] = kinds.get(v.kind, 0) + 1
    return {
        "requests": len(trace),
        "items": int(sum(len(r) for r in trace)),
        "items_per_request_mean": round(float(np.mean([len(r) for r in trace])), 3) if trace else 0.0,
        "kinds": kinds,
        "tokens_mean": round(float(tokens.mean()), 1) if trace else 0.0,
        "tokens_p50": round(float(np.percentile(tokens, 50)), 1) if trace else 0.0,
        "tokens_p99": round(float(np.percentile(tokens, 99)), 1) if trace else 0.0,
        "tokens_max": int(tokens.max()) if trace else 0,
    }


SIZES_MODES = ("as-drawn", "new", "seen")
"""How the replay meets each request's sizes (``benches/traffic.py --sizes``):

- ``as-drawn``: every system runs the request as drawn, in rotating order (the chat trace's default);
- ``new``: every system meets every image at a patch-row count no system of the process has run before
  (:func:`fresh_request`), as a stream of unique photos does: attention kernels that build a plan per new
  shape (cuDNN's, in HF's own SDPA too) pay it, and none rides on a plan another system built;
- ``seen``: every system runs the request once untimed right before its timed run: sizes met before, every plan
  built (steady traffic of recurring sizes)."""

SHIFT_STEPS = 4
"""Each side of an image moves by at most this many ``geom.factor``-pixel steps in :func:`fresh_request`."""


def fresh_request(request: Sequence[Visual], geom: Geometry, caps: Caps, seen: set[int]
                  ) -> tuple[tuple[Visual, ...], int]:
    """``(request with each image resized by whole geom.factor-pixel steps, at most SHIFT_STEPS a side, to the
    patch-row count nearest its own (the larger on a tie; its own first) that is not in seen, which is then
    added; the number of images for which no such count was left)``. So each copy is the request as drawn where
    its sizes are new, else the nearest new size (a photo of 2,000 x 1,500 px moves by about 1%; a small one
    more, as fewer counts lie near it). An image with no new count in reach (tiny caps: the CPU smoke) is kept
    as drawn and counted."""
    out, reused = [], 0
    steps = range(-SHIFT_STEPS, SHIFT_STEPS + 1)
    for v in request:
        drawn = int(np.prod(caps.sizes([v], geom).grids[0]))
        options = {}
        for dh in steps:
            for dw in steps:
                if v.height + dh * geom.factor < geom.factor or v.width + dw * geom.factor < geom.factor:
                    continue
                moved = attrs.evolve(v, height=v.height + dh * geom.factor, width=v.width + dw * geom.factor)
                rows = int(np.prod(caps.sizes([moved], geom).grids[0]))
                if rows not in seen:
                    options.setdefault(rows, moved if (dh, dw) != (0, 0) else v)
                    if (dh, dw) == (0, 0):
                        options[rows] = v
        if not options:
            out.append(v)
            reused += 1
            continue
        rows = min(options, key=lambda r: (abs(r - drawn), -r))
        seen.add(rows)
        out.append(options[rows])
    return tuple(out), reused


def rows_of(request: Sequence[Visual], geom: Geometry, caps: Caps) -> list[int]:
    """Patch rows per image of ``request`` under ``caps`` (what :func:`fresh_request` keeps apart)."""
    return [int(np.prod(g)) for g in caps.sizes(request, geom).grids]
