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

from benches.lib.cli import base_parser, smoke_defaults
from benches.lib.env import Deadline, make_env
from benches.lib.results import SMOKE_SLUG
from benches.lib.systems import System, TowerBench
from benches.lib.timing import time_once
from benches.lib.towers import TOWERS
from benches.lib.trace import Caps, generate_trace

SYSTEMS = ("adapter eager", "graphs, greedy plan", "graphs, cost-aware plan", "graphs, tuned ladder, cost-aware")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("planning", __doc__ or "", time_budget=150)
    parser.add_argument("--tower", choices=tuple(TOWERS), default="qwen2_5_vl_7b")
    parser.add_argument("--requests", type=int, default=300, help="trace requests timed (default 300)")
    parser.add_argument("--samples", type=int, default=16, help="requests timed to fit the eager cost model")
    parser.add_argument("--tune-requests", type=int, default=300,
                        help="requests of another seed the ladder is tuned on (default 300)")
    parser.add_argument("--max-budgets", type=int, default=8, help="budgets of the tuned ladder (default 8)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        smoke_defaults(args, towers=(args.tower,))
        args.requests, args.samples = min(args.requests, 6), min(args.samples, 4)
        args.tune_requests = min(args.tune_requests, 8)
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    from encgraph.capture import EncoderGraphRunner

    bench = TowerBench(TOWERS[args.tower], env, (System.GRAPH, System.ADAPTER_EAGER))
    caps = Caps()
    greedy = bench.runner(System.GRAPH)
    eager = bench.runner(System.ADAPTER_EAGER)
    costed = EncoderGraphRunner(bench.adapter, mode=greedy.mode, progress=False)
    costed.capture()
    samples = [caps.inputs(bench, r, seed=10_000 + i).adapter
               for i, r in enumerate(generate_trace(args.samples, seed=args.seed + 1))]
    model = costed.measure_costs(samples)
    # Ladder tuning (issue 6, point 4): sizes of another seed's requests, the measured model, then a new capture
    # and a cost model measured for the tuned budgets.
    from encgraph.packing import tune_ladder

    observed = [bench.adapter.item_specs(caps.inputs(bench, r, seed=20_000 + i).adapter)
                for i, r in enumerate(generate_trace(args.tune_requests, seed=args.seed + 2))]
    tuned = tune_ladder(observed, max_budgets=args.max_budgets, max_items=greedy.limits.max_items,
                        baseline=greedy.ladders, costs=model)
    tuned_runner = EncoderGraphRunner(bench.adapter, mode=greedy.mode, progress=False, **tuned.to_runner_options())
    tuned_runner.capture()
    tuned_model = tuned_runner.measure_costs(samples)
    runners = dict(zip(SYSTEMS, (eager, greedy, costed, tuned_runner)))
    latencies: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    trace = generate_trace(args.requests, seed=args.seed)
    for i, request in enumerate(trace):
        if deadline.expired():
            break
        inputs = caps.inputs(bench, request, seed=i).adapter
        for name in (SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[: i % len(SYSTEMS)]):  # rotate the order: no system always goes first
            runners[name](inputs)  # one untimed call (allocator growth on new shapes)
            latencies[name].append(time_once(lambda r=runners[name]: r(inputs), env))
    done = len(latencies[SYSTEMS[0]])
    if not done:
        raise SystemExit(f"planning: the {args.time_budget:g} s budget was spent before the first request; raise "
                         "--time-budget")
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
            "ladders": {"default": greedy.ladders, "tuned": tuned.ladders},
            "tuned": {"expected_ms_before": tuned.cost_before_ms, "expected_ms_after": tuned.cost_after_ms,
                      "padded_share_before": tuned.padded_share_before, "padded_share_after": tuned.padded_share_after,
                      "capture": tuned_runner.capture_info, "cost_model": tuned_model.to_dict()},
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
    lines += ["", f"- default ladder {dict(greedy.ladders)}; tuned on {len(observed)} other requests: "
              f"{dict(tuned.ladders)} (expected {tuned.cost_before_ms:.0f} -> {tuned.cost_after_ms:.0f} ms on them)"]
    table = "\n".join(lines)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = SMOKE_SLUG if args.cpu_smoke else "nvidia-h200"
    import json

    (out / f"planning_{slug}.json").write_text(json.dumps(data, indent=1, default=str))
    (out / f"planning_{slug}.md").write_text(table + "\n")
    print(table)
    return data


if __name__ == "__main__":
    main()
