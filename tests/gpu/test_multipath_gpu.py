"""The multi-path towers of issue 16 on a GPU (bf16, random weights, real geometry, 4 layers): Gemma-4's vision tower
(image and video paths) and Step-3.7 (global views and local crops). Each captures its default ladders once and
replays fresh random mixes; per item, three checks:

- the same padded static forward run eagerly (a ``RunMode.STATIC`` runner over its own adapter: same shapes, same
  kernels): replay within ``STATIC_TOL`` of it, and whether they are equal bit for bit is printed;
- the Hugging Face forward (Gemma-4: the tower on the processor's padded batch; Step-3.7: the model's
  ``get_image_features``): norm-relative error ``||replay - hf|| / ||hf||`` within ``HF_TOL`` (printed);
- finite after NaN poisoning: every graph first replays NaN inputs (its intermediates in the shared pool become
  NaN), and every static buffer is filled with NaN before each call.

Also: a batch whose tokens overflow one path's ladder runs that path eagerly while the other path replays
(partial eager), and torch's sync-debug mode around each path's static forward. Run with ``pytest -s`` for the
capture summary, exactness and errors. Needs transformers >= 5.17 (the GPU image's 5.17 has both families). About a
minute on one H200 (20 graphs of 4 layers, ~10 s of capture).

Real geometry: the benchmarks' rows (``benches.lib.towers.TOWERS``, through ``tests.models.fixtures_multipath``),
the depth cut to ``DEPTH``.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models.registry import wrap
from tests.models.fixtures_multipath import (
    gemma4_batch, gemma4_tower, norm_rel_err, rel_err, split_rows, static_forwards, step3p7_model, step3p7_views,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEPTH = 4
STATIC_TOL = 1e-3
HF_TOL = 3e-2
"""bf16, 4 layers, packed varlen attention (Gemma-4) or other batch shapes against the Hugging Face forward."""

IMAGE_GRIDS = [(48, 48), (60, 42), (30, 48), (72, 33), (24, 24), (15, 15), (42, 60), (9, 6)]
"""Patch grids the processor makes at max_soft_tokens=280 (sides multiples of 3, at most 2520 patches): 256, 280,
160, 264, 64, 25, 280, 6 soft tokens (the last three on the video path, at most 70 tokens)."""
FRAME_GRIDS = [(21, 30), (30, 21), (24, 24), (18, 33), (3, 3), (21, 30)]
"""Video frames at max_soft_tokens=70 (at most 630 patches): 70, 70, 64, 66, 1, 70 tokens."""


def poison(graph: EncoderGraphRunner) -> None:
    """NaN in every graph's intermediates (each replays on NaN inputs first) and in every floating buffer."""
    for path, records in graph.records.items():
        for record in records.values():
            # Valid metadata for this budget first, as the runner writes before every replay: the buffers are
            # shared by the path's budgets, and the capture's self-check leaves a larger budget's sequence bounds
            # in them (replaying a smaller graph on those read past its rows: an illegal memory access on the H200).
            graph.buffers[path].fill(record.budget, None)
            for t in record.inputs.values():
                if t.is_floating_point():
                    t.fill_(float("nan"))
            record.graph.replay()
            for out in record.outputs.values():
                assert torch.isnan(out).all()


def refill_nan(graph: EncoderGraphRunner) -> None:
    for buffers in graph.buffers.values():
        for t in buffers.storage.values():
            if t.is_floating_point():
                t.fill_(float("nan"))


class Report:
    """Worst errors and bit-exactness over every compared item."""

    def __init__(self, name: str) -> None:
        self.name, self.exact, self.static, self.hf, self.items = name, True, 0.0, 0.0, 0

    def check(self, got: torch.Tensor, same: torch.Tensor, hf: torch.Tensor, what: str) -> None:
        assert got.shape == same.shape == hf.shape, what
        assert torch.isfinite(got).all(), f"{what}: non-finite"
        e_static, e_hf = rel_err(got, same), norm_rel_err(got, hf)
        assert e_static < STATIC_TOL, f"{what}: replay vs static {e_static:.3e}"
        assert e_hf < HF_TOL, f"{what}: replay vs Hugging Face {e_hf:.3e}"
        self.exact = self.exact and torch.equal(got, same)
        self.static, self.hf, self.items = max(self.static, e_static), max(self.hf, e_hf), self.items + 1

    def print(self, graph: EncoderGraphRunner) -> None:
        print(
            f"\n{self.name}: {self.items} item fields; replay == static bit for bit: {self.exact}; worst replay vs "
            f"static {self.static:.2e} (max-relative), vs Hugging Face {self.hf:.2e} (norm-relative); "
            f"paths {graph.stats['paths']}"
        )


def captured(adapter_of: Any, **runner_options: Any) -> tuple[EncoderGraphRunner, EncoderGraphRunner]:
    """A captured runner and a STATIC reference runner, each over its own adapter."""
    # Plain graphs and the greedy plan, as the STATIC reference has: the replay must match it on the same kernels
    # and batch compositions (a cost-aware plan may batch items otherwise, and bf16 sums then round otherwise).
    graph = EncoderGraphRunner(adapter_of(), **{"compile": False, "costs": False, **runner_options})
    info = graph.capture()
    print(
        f"\n{type(graph.adapter).__name__}: {info['graphs']} graphs in {info['seconds']} s, pool "
        f"{info['pool_bytes'] / 2**20:.0f} MiB, buffers {info['buffer_bytes'] / 2**20:.0f} MiB, ladders {graph.ladders}"
    )
    assert not info["failed"], info["failed"]
    return graph, EncoderGraphRunner(adapter_of(), mode=RunMode.STATIC, **runner_options)


# ---------------------------------------------------------------------------------------------------- Gemma-4
def gemma_mixes(seed: int) -> list[tuple[list[tuple[int, int]], int]]:
    gen = np.random.default_rng(seed)
    images = [IMAGE_GRIDS[i] for i in gen.permutation(len(IMAGE_GRIDS))]
    return [(images[:3], 2520), (images[3:], 2520), (FRAME_GRIDS, 630), (FRAME_GRIDS[:2] * 8, 630)]


def check_gemma(tower: torch.nn.Module, graph: EncoderGraphRunner, static: EncoderGraphRunner, calls: Any,
                report: Report, seed: int) -> None:
    c = graph.adapter.channels
    for n, (grids, rows) in enumerate(calls):
        pv, pos = gemma4_batch(grids, rows, c, seed=1000 * seed + n, device=str(graph.device))
        refill_nan(graph)
        got = graph(graph.adapter.inputs(pv, pos))
        same = static(static.adapter.inputs(pv, pos))
        with torch.no_grad():
            hf = split_rows(tower(pv, pos).last_hidden_state, [w * h // 9 for w, h in grids])
        for i, (g, s, r) in enumerate(zip(got, same, hf)):
            report.check(g, s, r, f"call {n} item {i} {grids[i]}")


def test_gemma4_replays_equal_static_and_tower() -> None:
    tower = gemma4_tower(depth=DEPTH, device="cuda", dtype=torch.bfloat16, real=True)
    graph, static = captured(lambda: wrap(tower))
    poison(graph)
    report = Report("Gemma-4")
    for seed in range(2):
        check_gemma(tower, graph, static, gemma_mixes(seed), report, seed)
    assert graph.stats["eager_items"] == 0 and graph.stats["graph_items"] == graph.stats["items"]
    assert all(sum(graph.stats["paths"][p]["replays"].values()) for p in ("image", "video"))
    report.print(graph)


def test_gemma4_partial_eager() -> None:
    """An image of 552 soft tokens over an image ladder of (140, 280) runs the image path eagerly; the frames and
    small images batched with it replay on the video path."""
    tower = gemma4_tower(depth=DEPTH, device="cuda", dtype=torch.bfloat16, real=True)
    graph, static = captured(lambda: wrap(tower), budgets={"image": [140, 280], "video": [70, 140, 280]})
    report = Report("Gemma-4 partial eager")
    check_gemma(tower, graph, static, [([(72, 69), (24, 24), (9, 6), (15, 15)], 4968)], report, seed=5)
    paths = graph.stats["paths"]
    assert paths["image"]["eager_items"] == 1, paths
    assert paths["video"]["eager_items"] == 0 and sum(paths["video"]["replays"].values()) > 0, paths
    report.print(graph)


def test_gemma4_frames_through_each_path() -> None:
    """The two-path design in numbers: the same 15 frames (70 tokens each) replayed by the video path's graph at
    budget 1120 (attention max_seqlen 630) and by the image path's (max_seqlen 10080); same rows, printed times."""
    tower = gemma4_tower(depth=DEPTH, device="cuda", dtype=torch.bfloat16, real=True)
    adapter = wrap(tower)
    graph = EncoderGraphRunner(adapter, budgets={"image": [1120], "video": [1120]}, max_items=16)
    graph.capture()
    pv, pos = gemma4_batch([(21, 30)] * 15, 630, adapter.channels, seed=9, device="cuda")
    frames = adapter.inputs(pv, pos)
    routes = {"video": frames, "image": attrs.evolve(frames, video=~frames.video)}
    rows, times = {}, {}
    for path, inputs in routes.items():
        record = graph.records[path][1120]
        graph.buffers[path].fill(1120, adapter.replay_values(path, inputs, 1120))
        times[path] = replay_ms(record.graph)
        rows[path] = record.outputs["last_hidden_state"][:1050].clone()
    assert norm_rel_err(rows["image"], rows["video"]) < HF_TOL
    print(f"\nGemma-4, 15 frames at budget 1120, {DEPTH} layers: video path {times['video']:.3f} ms, image path "
          f"{times['image']:.3f} ms per replay")


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


# ---------------------------------------------------------------------------------------------------- Step-3.7
STEP_OPTIONS = {"max_images": 4, "max_tiles": 8}
"""Ladders: global 169 * (1, 2, 4); local 0, 81 * (1, 2, 4, 8)."""


def check_step(model: torch.nn.Module, graph: EncoderGraphRunner, static: EncoderGraphRunner, mixes: Any,
               report: Report, seed: int) -> None:
    sizes = graph.adapter.sizes
    for n, tiles in enumerate(mixes):
        pv, local, counts = step3p7_views(tiles, sizes["global"], sizes["local"], seed=100 * seed + n,
                                          device=str(graph.device), dtype=graph.config.dtype)
        refill_nan(graph)
        got = graph(graph.adapter.inputs_from_call(pv, local, counts))
        same = static(static.adapter.inputs_from_call(pv, local, counts))
        with torch.no_grad():
            hf = model.get_image_features(pv, local, counts)
        for i, (g, s) in enumerate(zip(got, same)):
            report.check(g["features"], s["features"], hf.pooler_output[i], f"mix {tiles} image {i} features")
            report.check(g["last_hidden_state"], s["last_hidden_state"], hf.last_hidden_state[i],
                         f"mix {tiles} image {i} last_hidden_state")


def test_step3p7_replays_equal_static_and_model_with_partial_eager() -> None:
    model = step3p7_model(depth=DEPTH, device="cuda", dtype=torch.bfloat16, real=True, text_hidden=64)
    graph, static = captured(lambda: wrap(model, **STEP_OPTIONS))
    poison(graph)
    report = Report("Step-3.7")
    for seed in range(2):
        check_step(model, graph, static, [[0], [2], [3, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2], [1, 4]], report, seed)
    assert graph.stats["eager_items"] == 0 and graph.stats["graph_items"] == graph.stats["items"]
    graph.reset_stats()
    check_step(model, graph, static, [[9, 0], [12, 1, 0]], report, seed=5)  # over the local ladder's 8 crops
    paths = graph.stats["paths"]
    assert paths["local"]["eager_items"] > 0, paths
    assert paths["global"]["eager_items"] == 0 and sum(paths["global"]["replays"].values()) > 0, paths
    report.print(graph)


# ---------------------------------------------------------------------------------------------------- both
@pytest.mark.parametrize("family", ["gemma4", "step3p7"])
def test_static_forward_never_syncs(family: str) -> None:
    if family == "gemma4":
        adapter = wrap(gemma4_tower(depth=2, device="cuda", dtype=torch.bfloat16, real=True))
        cases = (("image", 560), ("video", 280))
    else:
        adapter = wrap(step3p7_model(depth=2, device="cuda", dtype=torch.bfloat16, real=True), **STEP_OPTIONS)
        cases = (("global", 338), ("local", 162))
    static_forwards(adapter, cases, "cuda", items=8)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation now raises
    try:
        static_forwards(adapter, cases, "cuda", items=8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
