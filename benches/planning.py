"""Greedy vs cost-aware planning on the traffic trace (issue 6, point 3): the same captured ladder, planned two
ways, against the adapter's eager forward, request by request, side by side.

    python benches/planning.py [--requests 300] [--time-budget 150]   # on a CUDA GPU
    python benches/planning.py --cpu-smoke                            # the code path on a tiny CPU tower

The cost-aware runner measures its cost model first (``runner.measure_costs`` on the first ``--samples``
requests of a separate seed: each graph's replay time and the eager forward's time per request), then plans
every request with it. Prints a table last; JSON to benches/results/planning_<gpu>.json.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches import common, traffic
from benches.common import TOWERS, System

SYSTEMS = ("adapter eager", "graphs, greedy plan", "graphs, cost-aware plan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = common.base_parser("planning", __doc__ or "", time_budget=150)
    parser.add_argument("--tower", choices=tuple(TOWERS), default="qwen2_5_vl_7b")
    parser.add_argument("--requests", type=int, default=300, help="trace requests timed (default 300)")
    parser.add_argument("--samples", type=int, default=16, help="requests timed to fit the eager cost model")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        common.smoke_defaults(args, towers=(args.tower,))
        args.requests, args.samples = min(args.requests, 6), min(args.samples, 4)
    env = common.make_env(args)
    deadline = common.Deadline(args.time_budget)
    from encgraph.capture import EncoderGraphRunner

    bench = common.TowerBench(TOWERS[args.tower], env, (System.GRAPH, System.ADAPTER_EAGER))
    caps = traffic.Caps()
    greedy = bench.runner(System.GRAPH)
    eager = bench.runner(System.ADAPTER_EAGER)
    costed = EncoderGraphRunner(bench.adapter, mode=greedy.mode, progress=False)
    costed.capture()
    samples = [caps.inputs(bench, r, seed=10_000 + i).adapter
               for i, r in enumerate(traffic.generate_trace(args.samples, seed=args.seed + 1))]
    model = costed.measure_costs(samples)
    runners = dict(zip(SYSTEMS, (eager, greedy, costed)))
    latencies: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    trace = traffic.generate_trace(args.requests, seed=args.seed)
    for i, request in enumerate(trace):
        if deadline.expired():
            break
        inputs = caps.inputs(bench, request, seed=i).adapter
        for name in (SYSTEMS[i % 3:] + SYSTEMS[: i % 3]):  # rotate the order: no system always goes first
            runners[name](inputs)  # one untimed call (allocator growth on new shapes)
            latencies[name].append(common.time_once(lambda r=runners[name]: r(inputs), env))
    done = len(latencies[SYSTEMS[0]])
    base = np.asarray(latencies["adapter eager"])
    rows = []
    for name in SYSTEMS:
        lat = np.asarray(latencies[name])
        row = {"system": name, "requests": done, "mean_ms": float(lat.mean()), "p50_ms": float(np.percentile(lat, 50)),
               "p99_ms": float(np.percentile(lat, 99))}
        if name != "adapter eager":
            stats = runners[name].stats
            paths = stats["paths"]
            real = sum(p["real_tokens"] for p in paths.values())
            pad = sum(p["padded_tokens"] for p in paths.values())
            row |= {"mean_speedup": float(base.mean() / lat.mean()),
                    "p99_speedup": float(np.percentile(base, 99) / np.percentile(lat, 99)),
                    "worst_ratio": float((lat / base).max()), "slower_than_eager": int((lat > base).sum()),
                    "padded_share": pad / (pad + real) if pad + real else 0.0,
                    "eager_reasons": stats["eager_reasons"], "graph_items": stats["graph_items"],
                    "items": stats["items"]}
        rows.append(row)
    data = {"tower": args.tower, "gpu": env.gpu_name if hasattr(env, "gpu_name") else None,
            "requests": done, "cost_model": model.to_dict(), "rows": rows,
            "median_request_ms": {n: statistics.median(latencies[n]) for n in SYSTEMS if latencies[n]}}
    lines = [f"## planning: {args.tower}, {done} trace requests, greedy vs cost-aware plans", "",
             "| system | mean ms | P50 ms | P99 ms | mean speedup vs eager | P99 speedup | worst ratio | slower than eager "
             "| padded share | eager items (why) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = ("- | - | - | - | - | -" if "mean_speedup" not in r else
                 f"{r['mean_speedup']:.2f} | {r['p99_speedup']:.2f} | {r['worst_ratio']:.2f} | "
                 f"{r['slower_than_eager']} | {r['padded_share']:.2f} | {r['items'] - r['graph_items']} "
                 f"({r['eager_reasons']})")
        lines.append(f"| {r['system']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {extra} |")
    table = "\n".join(lines)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = common.SMOKE_SLUG if args.cpu_smoke else "nvidia-h200"
    import json

    (out / f"planning_{slug}.json").write_text(json.dumps(data, indent=1, default=str))
    (out / f"planning_{slug}.md").write_text(table + "\n")
    print(table)
    return data


if __name__ == "__main__":
    main()
