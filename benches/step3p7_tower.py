"""Step-3.7 on a GPU: the model's ``get_image_features`` three ways, to show where the whole-model shim is faster
than the one line on the tower.

Run from the repository root (one GPU, about a minute at the default depth)::

    python benches/step3p7_tower.py --depth 8 --runs 20   # prints a table, writes benches/results/step3p7_tower_<gpu>.json

Systems, each on its own copy of one random bf16 model (real geometry: 728 px global views, 504 px crops, the
tower's width; the vision depth cut to ``--depth``; a one-layer text model):

- ``hf``: the model's own ``get_image_features``;
- ``tower``: ``model.model.vision_model = encgraph.graphed(model.model.vision_model)`` (defaults, captured
  first): two runner calls per batch (global views, then crops), the projector eager;
- ``shim``: ``encgraph.models.wrap(model)`` with its ``get_image_features`` shim (defaults): one runner call per
  batch, tower and projector captured together.

Cases: images x crops per image (the processor makes 0 crops up to 728 px and more for larger images). Median ms
over ``--runs`` calls after ``--warmup`` calls, device synchronised around each.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"1x0": [0], "1x4": [4], "4x0": [0] * 4, "4x4": [4] * 4, "8x2": [2] * 8}
"""Case name -> crops of each image."""


def main(argv: list[str] | None = None) -> dict:
    import torch

    import encgraph
    from benches.lib.env import Env
    from encgraph.models import wrap
    from tests.models.fixtures_multipath import step3p7_model, step3p7_views

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--results-dir", default=str(ROOT / "benches" / "results"))
    p.add_argument("--device", default="cuda", help="cuda (the bench), or cpu for a smoke run of the script")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = step3p7_model(depth=args.depth, device=args.device, dtype=dtype, real=cuda, text_hidden=4096 if cuda else 24)
    systems = {"hf": copy.deepcopy(model.model), "tower": copy.deepcopy(model.model), "shim": model.model}
    t0 = time.perf_counter()
    systems["tower"].vision_model = encgraph.graphed(systems["tower"].vision_model)
    systems["tower"].vision_model.capture()
    capture = {"tower": round(time.perf_counter() - t0, 2)}
    t0 = time.perf_counter()
    adapter = wrap(systems["shim"])
    runner = encgraph.EncoderGraphRunner(adapter)
    runner.capture()
    systems["shim"].get_image_features = adapter.shim(runner)
    capture["shim"] = round(time.perf_counter() - t0, 2)
    sizes = adapter.sizes
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    env = Env(torch.device(args.device), dtype, not cuda, args.runs, args.warmup, 0)
    results: dict = {"depth": args.depth, "gpu": gpu, "environment": _provenance(env), "capture_seconds": capture,
                     "cases": {}}
    print(f"Step-3.7, vision depth {args.depth}, {results['gpu']}; capture s {capture}")
    print("| case | hf ms | tower ms | shim ms | tower / shim |\n|---|---|---|---|---|")
    for name, crops in CASES.items():
        pv, local, counts = step3p7_views(crops, sizes["global"], sizes["local"], seed=1, device=args.device,
                                          dtype=dtype)
        row = {}
        for system, base in systems.items():
            times = []
            with torch.inference_mode():
                for i in range(args.warmup + args.runs):
                    sync()
                    t = time.perf_counter()
                    base.get_image_features(pv, local, counts)
                    sync()
                    if i >= args.warmup:
                        times.append((time.perf_counter() - t) * 1e3)
            row[system] = round(statistics.median(times), 3)
        results["cases"][name] = row
        print(f"| {name} | {row['hf']} | {row['tower']} | {row['shim']} | {row['tower'] / row['shim']:.2f} |")
    slug = results["gpu"].lower().replace(" ", "-")
    out = Path(args.results_dir) / f"step3p7_tower_{slug}.json"
    from benches.lib.results import write_rows

    write_rows(out, results, [{"case": name, **row, "tower / shim": round(row["tower"] / row["shim"], 3)}
                              for name, row in results["cases"].items()],
               f"Step-3.7 get_image_features: HF, graphed(vision tower), the whole-model shim (ms, depth {args.depth})")
    print(f"wrote {out}")
    return results


def _provenance(env: Any) -> dict:
    """Versions, commit and date of this run (the result's provenance lives in its JSON): the shared
    ``environment()`` without its device fields (this result names its GPU at the top level)."""
    from benches.lib.results import environment

    return {k: v for k, v in environment(env).items() if k not in ("gpu", "device", "dtype", "tiny_towers")}


if __name__ == "__main__":
    main()
