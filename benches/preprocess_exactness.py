"""How exactly transformers' torchvision image processors match the Pillow ones, per image (issue 57 point 1).

Preprocessing on the device means transformers' torchvision ("fast") image processors with ``device="cuda"``: the
same resize, rescale, normalise and patchify as torch ops. Before choosing them, this measures how far their
``pixel_values`` are from the Pillow processors' (what ``encgraph serve`` runs without torchvision, and what the
models were trained with) for the served families at their released processor settings: SigLIP-so400m (384 x 384,
bicubic) and Qwen2.5-VL (its default pixel range, bicubic, 14 px patches merged 2 x 2), on seeded images of
photo-like content (smooth gradients with edges and noise) from thumbnail to 12 MP.

Per family and image size: the largest and the mean absolute difference of the normalised pixel values (units of
one standard deviation of the processor's normalisation; one 8-bit step is 1 / (255 std): 0.0078 for SigLIP's 0.5),
whether Qwen's grids agree, and each backend's seconds per image on this machine's CPU. ``--device cuda`` runs the
torchvision processor on the GPU instead (the same comparison; its kernels are CUDA's). Writes
``benches/results/preprocess_exactness_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
SIZES = ((200, 150), (384, 384), (640, 480), (1024, 768), (1920, 1080), (4000, 3000))
FAMILIES = {
    # (embedded processor config, overrides for the released model's processor)
    "siglip_so400m_384": ("siglip", {"size": {"height": 384, "width": 384}}),
    "qwen2_5_vl": ("qwen2_5_vl", {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}}),
}


def processors(family: str) -> tuple[Any, Any]:
    """The family's Pillow and torchvision processors at its released settings."""
    import transformers

    from encgraph.serving.loading import load_config

    embedded, overrides = FAMILIES[family]
    config = {**load_config(f"{embedded}_processor"), **overrides}
    name = config["image_processor_type"]
    return getattr(transformers, f"{name}Pil").from_dict(config), getattr(transformers, name).from_dict(config)


def photo(width: int, height: int, seed: int) -> Any:
    """A seeded photo-like RGB image: smooth colour gradients, a few sharp-edged shapes, mild noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([np.sin(x / width * rng.uniform(2, 8) + c) * np.cos(y / height * rng.uniform(2, 8) + 2 * c)
                    for c in range(3)], axis=-1) * 90 + 128
    for _ in range(6):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        w, h = rng.integers(width // 20 + 1, width // 4 + 2), rng.integers(height // 20 + 1, height // 4 + 2)
        img[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 4, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def compare(family: str, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    pil, fast = processors(family)
    std = float(np.max(pil.image_std))  # the widest channel: a difference there spans the most 8-bit steps
    rows = {}
    for i, (w, h) in enumerate(SIZES):
        image = photo(w, h, args.seed + i)
        times: dict[str, list[float]] = {"pil": [], "torchvision": []}
        for _ in range(args.runs):
            t = time.perf_counter()
            a = pil(images=[image], return_tensors="pt")
            times["pil"].append(time.perf_counter() - t)
            t = time.perf_counter()
            kwargs = {"device": args.device} if args.device != "cpu" else {}
            b = fast(images=[image], return_tensors="pt", **kwargs)
            if args.device != "cpu":
                torch.cuda.synchronize()
            times["torchvision"].append(time.perf_counter() - t)
        want, got = a["pixel_values"].double(), b["pixel_values"].cpu().double()
        row: dict[str, Any] = {"shape": list(want.shape), "same_shape": want.shape == got.shape}
        if "image_grid_thw" in a:
            row["same_grid"] = bool(torch.equal(a["image_grid_thw"], b["image_grid_thw"].cpu()))
            row["grid"] = a["image_grid_thw"][0].tolist()
        if row["same_shape"]:
            diff = (want - got).abs()
            row["max_abs"] = round(float(diff.max()), 5)
            row["mean_abs"] = round(float(diff.mean()), 6)
            row["max_in_8bit_steps"] = round(float(diff.max()) * std * 255, 2)
        row["pil_ms"] = round(statistics.median(times["pil"]) * 1e3, 2)
        row["torchvision_ms"] = round(statistics.median(times["torchvision"]) * 1e3, 2)
        rows[f"{w}x{h}"] = row
    return {"processor": type(fast).__name__, "sizes": rows}


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = ["# preprocess_exactness: transformers' torchvision image processors against the Pillow ones", "",
             f"transformers {env['transformers']}, torch {env['torch']}, torchvision {env['torchvision']}, "
             f"Pillow {env['pillow']}; torchvision processor on {env['device']}; {env['date']}; commit {env['commit']}",
             "", "| family | image | pixel_values | max abs diff | mean abs diff | max in 8-bit steps | grids agree | "
             "Pillow ms | torchvision ms |", "|---|---|---|---|---|---|---|---|---|"]
    for family, f in doc["families"].items():
        for size, r in f["sizes"].items():
            lines.append(f"| {family} | {size} | {tuple(r['shape'])} | {r.get('max_abs', 'shapes differ')} | "
                         f"{r.get('mean_abs', '-')} | {r.get('max_in_8bit_steps', '-')} | {r.get('same_grid', '-')} | "
                         f"{r['pil_ms']} | {r['torchvision_ms']} |")
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict[str, Any]:
    import datetime
    import os
    import subprocess

    import PIL
    import torch
    import torchvision
    import transformers

    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "pillow": PIL.__version__, "device": device,
            "date": datetime.date.today().isoformat(), "commit": commit or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--device", default="cpu", help="where the torchvision processor runs (cpu or cuda)")
    p.add_argument("--runs", type=int, default=3, help="timed calls per image and backend (the median is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(REPO / "benches" / "results"))
    args = p.parse_args(argv)
    doc: dict[str, Any] = {"environment": environment(args.device), "options": vars(args), "families": {}}
    for family in args.families.split(","):
        doc["families"][family] = compare(family, args)
    return write(doc, f"preprocess_exactness_{args.device}", args.results_dir, render)


def write(doc: dict[str, Any], stem: str, results_dir: str, render: Any) -> dict[str, Any]:
    """``doc`` as ``<stem>.json`` and its ``render``-ed ``<stem>.md`` in ``results_dir``; the markdown printed."""
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(render(doc))
    print(render(doc))
    return doc


if __name__ == "__main__":
    main()
