"""What ``encgraph.graphed(module)`` costs per call on the CPU, where it runs the module's own forward (issue 55
point 6: at most 1.1x the module + 50 us on the tiny SigLIP and CLIP towers, and no extra first-call work).

Run from the repository root::

    python benches/wrap_cost.py      # prints a table, writes benches/results/wrap_cost_cpu.json and .md

One thread (``torch.set_num_threads(1)``). Per tower (tiny random HF SigLIP and CLIP vision models: 2 layers of
32, 32 px images of 8 px patches), batch size and grad mode (``no_grad``, ``inference_mode``): a copy of the module
and a graphed copy, called in turn ``--calls`` times after ``--warmup`` calls each; the medians of each side and
their difference. First call: a fresh module's first call against a fresh graphed copy's first call, each side's
median over ``--first`` fresh pairs (in turn, after one throwaway call of another copy so that torch's own lazy
initialisation is paid before either).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benches" / "results"
RATIO, OVER_US = 1.1, 50.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benches/wrap_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=400, help="alternating timed calls per case (default 400)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--first", type=int, default=5, help="fresh pairs for the first-call time (default 5)")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes (default 1,8)")
    p.add_argument("--out", type=Path, default=RESULTS / "wrap_cost_cpu.json")
    return p


def tiny(kind: str) -> Any:
    import transformers as tf

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "image_size": 32, "patch_size": 8}
    if kind == "siglip":
        return tf.SiglipVisionModel(tf.SiglipVisionConfig(**shape)).eval()
    return tf.CLIPVisionModel(tf.CLIPVisionConfig(**shape)).eval()


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def steady(module: Any, calls: int, warmup: int, batch: int, grad: str) -> dict[str, Any]:
    import torch

    import encgraph

    plain, wrapped = copy.deepcopy(module), encgraph.graphed(copy.deepcopy(module))
    x = torch.randn(batch, 3, 32, 32)
    mode = torch.no_grad if grad == "no_grad" else torch.inference_mode
    a: list[float] = []
    b: list[float] = []
    with mode():
        for _ in range(warmup):
            plain(pixel_values=x), wrapped(pixel_values=x)
        for _ in range(calls):
            t = time.perf_counter()
            plain(pixel_values=x)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            wrapped(pixel_values=x)
            b.append(time.perf_counter() - t)
    module_us, wrapped_us = _median_us(a), _median_us(b)
    return {"module_us": module_us, "wrapped_us": wrapped_us, "over_us": round(wrapped_us - module_us, 1),
            "ratio": round(wrapped_us / module_us, 3), "target_us": round(RATIO * module_us + OVER_US, 1),
            "met": wrapped_us <= RATIO * module_us + OVER_US}


def first_call(kind: str, pairs: int) -> dict[str, Any]:
    import torch

    import encgraph

    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        tiny(kind)(pixel_values=x)  # torch's and transformers' own first-use work, paid by neither side
        a: list[float] = []
        b: list[float] = []
        for _ in range(pairs):
            plain, wrapped = tiny(kind), encgraph.graphed(tiny(kind))
            t = time.perf_counter()
            plain(pixel_values=x)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            wrapped(pixel_values=x)
            b.append(time.perf_counter() - t)
    module_us, wrapped_us = _median_us(a), _median_us(b)
    return {"first_module_us": module_us, "first_wrapped_us": wrapped_us,
            "first_over_us": round(wrapped_us - module_us, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import torch

    import encgraph
    from benches.lib.results import write_rows

    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_before = round(os.getloadavg()[0], 2)
    rows = []
    for kind in ("siglip", "clip"):
        module = tiny(kind)
        for batch in (int(b) for b in args.batches.split(",")):
            for grad in ("no_grad", "inference_mode"):
                rows.append({"tower": kind, "batch": batch, "grad": grad,
                             **steady(module, args.calls, args.warmup, batch, grad)})
        rows[-1].update(first_call(kind, args.first))
    import transformers

    report = {
        "benchmark": "encgraph.graphed(module) on the CPU (the module's own forward) against the module, per call",
        "encgraph": encgraph.__version__,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__, "threads": 1,
                        "cpu_count": os.cpu_count(), "load_average_1m_before": load_before,
                        "load_average_1m_after": round(os.getloadavg()[0], 2)},
        "options": vars(args) | {"out": str(args.out)},
        "target": {"ratio_at_most": RATIO, "plus_us": OVER_US, "met": all(r["met"] for r in rows)},
        "results": rows,
    }
    md = write_rows(args.out, report, rows, "graphed(module) on the CPU against the module: median us per call")
    for r in rows:
        print(f"{r['tower']:<7} batch {r['batch']:>2} {r['grad']:<14} module {r['module_us']:>8.1f} us  wrapped "
              f"{r['wrapped_us']:>8.1f} us  x{r['ratio']:.3f}  target {r['target_us']:.0f}: "
              f"{'met' if r['met'] else 'NOT met'}")
    print(f"wrote {args.out} and {md}")
    return report


if __name__ == "__main__":
    main()
