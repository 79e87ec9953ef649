"""DeepSeek-OCR2 on a GPU (bf16, random weights, small widths at the real view sizes: 1024 px global views and
768 px tiles, patch 16): capture both paths once, replay fresh random mixes of images with 0..3 tiles.

Per image, two references:

- the same padded static forward run eagerly (a ``RunMode.STATIC`` runner over its own adapter: same shapes,
  same kernels): the replay must match within ``STATIC_TOL`` (bit-exactness is printed);
- the model's own ``get_image_features`` on the unpadded batch (other batch shapes): within bf16 tolerance
  (the largest relative error is printed; run with ``-s``).

Also: a mix whose tiles overflow the local ladder (local path eager, global path replayed), stale NaN in every
static buffer before each call, and a sync-debug run of each path's static forward. Whole file: well under a
minute on one H200 (7 graphs, ~3 s of capture).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models.registry import wrap
from tests.models.test_deepseek_ocr2 import deepseek_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STATIC_TOL = 1e-3
"""Per image, max |replay - static| / max |static| (same kernels: expected 0)."""
BF16_TOL = 5e-2
"""Per image, max |replay - get_image_features| / max |reference| in bf16 (other batch shapes round differently)."""
OPTIONS = {"max_images": 4, "max_tiles": 8}
"""Ladders: global 256 * (1, 2, 4); local 0, 144 * (1, 2, 4, 8)."""


def small_model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from transformers import DeepseekOcr2ForConditionalGeneration

    config = deepseek_config(
        sam_hidden=64, encoder_hidden=128, text_hidden=64, patch_size=16, image_size=1024, window_size=14
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekOcr2ForConditionalGeneration(config)
    return model.to(dtype).eval()


def mix(tiles: list[int], gen: torch.Generator, device: str, dtype: torch.dtype) -> tuple[Any, ...]:
    pv = torch.randn(len(tiles), 3, 1024, 1024, device=device, generator=gen).to(dtype)
    local = torch.randn(sum(tiles), 3, 768, 768, device=device, generator=gen).to(dtype) if sum(tiles) else None
    return pv, local, tiles


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def runners(model: torch.nn.Module, graph_mode: RunMode = RunMode.GRAPH) -> tuple[EncoderGraphRunner, EncoderGraphRunner]:
    """A captured runner and a STATIC reference runner, each over its own adapter of ``model``."""
    # Plain graphs: these tests check replay against the eager static forward on the same kernels.
    graph = EncoderGraphRunner(wrap(model, **OPTIONS), mode=graph_mode, compile=False, costs=False)
    info = graph.capture()
    print(
        f"\nDeepSeek-OCR2: {info['graphs']} graphs in {info['seconds']} s, pool "
        f"{info.get('pool_bytes', 0) / 2**20:.0f} MiB, buffers {info.get('buffer_bytes', 0) / 2**20:.0f} MiB, "
        f"failed {info.get('failed')}"
    )
    assert not info.get("failed")
    return graph, EncoderGraphRunner(wrap(model, **OPTIONS), mode=RunMode.STATIC)


def check_mixes(
    model: torch.nn.Module, graph: EncoderGraphRunner, static: EncoderGraphRunner, mixes: list[list[int]], seed: int
) -> dict[str, float]:
    """Every image of every mix: finite, replay ~ static (STATIC_TOL), replay ~ get_image_features (BF16_TOL).
    Every static buffer is poisoned with NaN before each call (padding views must be rewritten as zeros)."""
    device, dtype = str(graph.device), graph.config.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    worst = {"static": 0.0, "model": 0.0}
    exact = True
    for tiles in mixes:
        pv, local, counts = mix(tiles, gen, device, dtype)
        for buffers in graph.buffers.values():
            for t in buffers.storage.values():
                t.fill_(float("nan"))
        inputs = graph.adapter.inputs_from_call(pv, local, counts)
        got = graph(inputs)
        same = static(static.adapter.inputs_from_call(pv, local, counts))
        with torch.no_grad():
            ref = model.get_image_features(pv, local, counts).pooler_output
        for i, (g, s, r) in enumerate(zip(got, same, ref)):
            assert g.shape == r.shape == (144 * tiles[i] + 257, model.config.text_config.hidden_size)
            assert torch.isfinite(g).all(), f"mix {tiles} image {i}: non-finite"
            e_static, e_model = rel_err(g, s), rel_err(g, r)
            exact = exact and torch.equal(g, s)
            assert e_static < STATIC_TOL, f"mix {tiles} image {i}: replay vs static {e_static:.3e}"
            assert e_model < BF16_TOL, f"mix {tiles} image {i}: replay vs get_image_features {e_model:.3e}"
            worst = {"static": max(worst["static"], e_static), "model": max(worst["model"], e_model)}
    print(f"replay == static bit for bit: {exact}; worst relative errors {worst}; paths {graph.stats['paths']}")
    return worst


MIXES = [[0], [1], [3, 0, 2], [0, 0, 0, 0], [2, 2, 2, 2], [1, 3], [0, 2, 1]]
"""Fresh random pixels each round; tiles 0..3 per image, within the ladders (8 tiles, 4 images per batch)."""
OVERFLOW = [[9, 0], [12, 1, 0]]
"""An image with more tiles than the local ladder's 8: its batch runs the local path eagerly."""


def run_all(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, graph_mode: RunMode = RunMode.GRAPH) -> None:
    """The checks of this file, on any device (the CPU dry run uses ``RunMode.STATIC`` for the captured runner)."""
    model = small_model(device, dtype)
    graph, static = runners(model, graph_mode)
    for seed in range(2):
        check_mixes(model, graph, static, MIXES, seed)
    assert graph.stats["eager_items"] == 0 and graph.stats["graph_items"] == graph.stats["items"]
    graph.reset_stats()
    check_mixes(model, graph, static, OVERFLOW, seed=5)
    paths = graph.stats["paths"]
    assert paths["local"]["eager_items"] > 0, paths
    assert paths["global"]["eager_items"] == 0 and sum(paths["global"]["replays"].values()) > 0, paths


def test_replays_equal_static_and_model_with_partial_eager() -> None:
    run_all()


def test_static_forward_never_syncs() -> None:
    adapter = wrap(small_model(), **OPTIONS)
    for path, budget in (("global", 512), ("local", 288)):
        specs = adapter.buffer_specs(path, budget, 4, 4)
        buffers = {k: torch.zeros(s.shape, dtype=s.dtype, device="cuda") for k, s in specs.items()}
        adapter.forward_static(path, buffers, budget)  # warm-up: lazy init may sync once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            adapter.forward_static(path, buffers, budget)
        finally:
            torch.cuda.set_sync_debug_mode("default")
