"""Host overhead of a Qwen-VL call on the CPU: validate + plan + metadata + copy-in, for 1, 8 and 32 images.

Run from the repository root::

    python benches/host_overhead.py      # prints a table, writes benches/results/host_overhead_cpu.json

What one call of the runner does on the host before the forward, timed by phase (median over samples):

- ``plan``: ``adapter.inputs`` (validation, ``grid_thw`` to numpy), ``item_specs`` and ``pack``;
- ``metadata``: per planned batch, ``replay_values`` (cu_seqlens, rotary positions, the Qwen2.5-VL window
  permutation and bounds, the Qwen3-VL interpolation taps: per-frame-shape tables from a cache, computed for the
  missing shapes in one numpy pass, then concatenated);
- ``copy_meta``: the runner's ``PathBuffers.fill`` of every metadata buffer (values and fill rules);
- ``select`` and ``copy_pixels``: the pixel rows of a batch (a view when the planner keeps the items in one run,
  else a ``torch.cat``), then their fill into the pixel buffer. On the CPU both are memcpys that grow with the
  images; on a GPU the pixels are already on the device and each is one asynchronous device-to-device copy, so
  the target counts ``plan + metadata + copy_meta``.

``shapes``: ``same`` (all images one size: after the first call every frame table is cached) or ``distinct``
(every image its own size and the cache cleared before each call: every table is computed).

Towers: real patch geometry (patch 14, merge 2, 3 channels x 2 frames, so 1176 values per pixel row;
Qwen2.5-VL windows of 112 px; Qwen3-VL patch 16 with a 48 x 48 position grid) with a tiny width: the host work
does not depend on the width or depth. Images are 224 x 224 px (Qwen3-VL: 256 x 256), 64 tokens each; budgets the
default ladder (64 ... 4096 tokens). For comparison, ``hf_helpers`` times transformers' own metadata helpers
(``transformers.vision_utils``) for the same grids.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import encgraph  # noqa: E402

SIZES = (1, 8, 32)
TARGET_IMAGES, TARGET_MS = 8, 0.3
PHASES = ("plan", "metadata", "copy_meta", "select", "copy_pixels")


def towers():
    """``{family: (tower, patch)}`` with real patch geometry and a tiny width."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    small = dict(depth=1, num_heads=2, temporal_patch_size=2, spatial_merge_size=2)
    return {
        "qwen2_5_vl": (Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(
            hidden_size=32, intermediate_size=64, out_hidden_size=32, patch_size=14, window_size=112,
            fullatt_block_indexes=[0], **small)).eval(), 14),
        "qwen2_vl": (Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(
            embed_dim=32, hidden_size=32, mlp_ratio=2, patch_size=14, **small)).eval(), 14),
        "qwen3_vl": (Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(
            hidden_size=32, intermediate_size=64, out_hidden_size=32, patch_size=16, num_position_embeddings=2304,
            deepstack_visual_indexes=[0], **small)).eval(), 16),
    }


def hf_helpers(family: str, tower, grid) -> None:
    from transformers import vision_utils as vu

    vu.get_vision_cu_seqlens(grid)
    vu.get_vision_position_ids(grid, 2)
    if family == "qwen2_5_vl":
        vu.get_vision_window_index(grid, 2, tower.window_size, tower.patch_size)
    if family == "qwen3_vl":
        vu.get_vision_interpolation_indices_and_weights(
            grid, tower.num_grid_per_side, mode="bilinear", align_corners=True, spatial_merge_size=2
        )


def measure(family: str, tower, side: int, n: int, samples: int, distinct: bool) -> dict:
    import numpy as np
    import torch

    from encgraph.capture.buffers import PathBuffers
    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.models import wrap
    from encgraph.packing import pack

    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter)
    ladders, limits = runner.planning_ladders, runner.limits
    ladder = ladders["default"]
    specs = {b: adapter.buffer_specs("default", b, limits.max_items, limits.max_frames) for b in ladder}
    # Metadata buffers apart from the pixel buffer, to time their copy-in alone.
    meta_buffers = PathBuffers("default", {b: {k: v for k, v in s.items() if k != "pixels"} for b, s in specs.items()},
                               torch.device("cpu"))
    pixel_buffers = PathBuffers("default", {b: {"pixels": s["pixels"]} for b, s in specs.items()}, torch.device("cpu"))
    gen = np.random.default_rng(0)
    if distinct:
        # Every image a different shape around ``side`` (even sides): every frame table is a cache miss.
        hw = gen.integers(side // 2 - 2, side // 2 + 3, (n, 2)) * 2
        grid = torch.from_numpy(np.concatenate([np.ones((n, 1), dtype=np.int64), hw], axis=1))
    else:
        grid = torch.tensor([[1, side, side]] * n)
    pixels = torch.randn(int(grid.prod(-1).sum()), adapter.channels)

    def one_call() -> dict[str, float]:
        if distinct:
            adapter._tables._entries.clear()
        t0 = time.perf_counter()
        inputs = adapter.inputs(pixels, grid)
        plan = pack(adapter.item_specs(inputs), ladders, max_items=limits.max_items, max_frames=limits.max_frames)
        t1 = time.perf_counter()
        subs = [(batch.budgets["default"], adapter.select(inputs, batch.items)) for batch in plan.batches]
        t1b = time.perf_counter()
        batches = [(budget, adapter.replay_values("default", sub, budget)) for budget, sub in subs]
        t2 = time.perf_counter()
        for budget, values in batches:
            meta_buffers.fill(budget, {k: v for k, v in values.items() if k != "pixels"})
        t3 = time.perf_counter()
        for budget, values in batches:
            pixel_buffers.fill(budget, {"pixels": values["pixels"]})
        t4 = time.perf_counter()
        return {"plan": t1 - t0, "select": t1b - t1, "metadata": t2 - t1b, "copy_meta": t3 - t2,
                "copy_pixels": t4 - t3,
                "batches": len(plan.batches)}

    for _ in range(5):
        one_call()
    runs = [one_call() for _ in range(samples)]
    hf = []
    for _ in range(max(samples // 4, 5)):
        t0 = time.perf_counter()
        hf_helpers(family, tower, grid)
        hf.append(time.perf_counter() - t0)
    row = {"family": family, "shapes": "distinct" if distinct else "same", "images": n,
           "image_px": side * int(tower.patch_embed.patch_size), "tokens": int(grid.prod(-1).sum()) // 4,
           "batches": runs[0]["batches"]}
    for phase in PHASES:
        row[f"{phase}_ms"] = round(statistics.median(r[phase] for r in runs) * 1e3, 4)
    totals = sorted(sum(r[p] for p in PHASES[:3]) for r in runs)
    row["host_ms"] = round(statistics.median(totals) * 1e3, 4)
    row["host_p90_ms"] = round(totals[(len(totals) * 9) // 10] * 1e3, 4)
    row["hf_helpers_ms"] = round(statistics.median(hf) * 1e3, 4)
    row["samples"] = samples
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=101, help="timed calls per case (default 101)")
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results" / "host_overhead_cpu.json")
    args = parser.parse_args()

    import torch
    import transformers

    torch.set_num_threads(1)  # the host path is single-threaded work; keep the numbers stable on shared machines
    results = []
    for family, (tower, patch) in towers().items():
        side = 224 // 14 if patch == 14 else 256 // 16
        for distinct in (False, True):
            for n in SIZES:
                results.append(measure(family, tower, side, n, args.samples, distinct))

    target = [r for r in results if r["images"] == TARGET_IMAGES and r["shapes"] == "same"]
    report = {
        "benchmark": "host overhead of a Qwen-VL call: validate + plan + metadata + copy-in (median ms per call)",
        "encgraph": encgraph.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or None,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "target": {
            "images": TARGET_IMAGES,
            "host_ms_at_most": TARGET_MS,
            "counts": "plan + metadata + copy_meta (the pixel copy is one async device copy on a GPU)",
            "met": all(r["host_ms"] <= TARGET_MS for r in target),
        },
        "results": results,
    }
    from benches.lib.results import write_rows

    write_rows(args.out, report, results, "host overhead per call (CPU): planning, metadata and copies")

    m = report["machine"]
    print(f"machine: {m['platform']}, Python {m['python']}, {m['cpu_count']} CPUs, load {m['load_average']}; "
          f"wrote {args.out}")
    print(f"target: {TARGET_IMAGES} images, plan + metadata + copy_meta <= {TARGET_MS} ms: "
          f"{'met' if report['target']['met'] else 'NOT met'}")
    print()
    header = (f"{'family':<11} {'shapes':<8} {'images':>6} {'tokens':>6} {'batches':>7} {'plan':>7} {'metadata':>8} "
              f"{'copy_meta':>9} {'host':>7} {'host p90':>8} {'select':>7} {'pixels':>7} {'HF helpers':>10}")
    print(header + "   (ms)")
    print("-" * len(header))
    for r in results:
        print(f"{r['family']:<11} {r['shapes']:<8} {r['images']:>6} {r['tokens']:>6} {r['batches']:>7} "
              f"{r['plan_ms']:>7.3f} {r['metadata_ms']:>8.3f} {r['copy_meta_ms']:>9.3f} {r['host_ms']:>7.3f} {r['host_p90_ms']:>8.3f} "
              f"{r['select_ms']:>7.3f} {r['copy_pixels_ms']:>7.3f} {r['hf_helpers_ms']:>10.3f}")


if __name__ == "__main__":
    main()
