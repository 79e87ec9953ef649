"""Cost-aware planner on the CPU: median time of ``pack(..., costs=...)`` against greedy ``pack`` for 8/64/512 items.

Run from the repository root::

    python benches/planner_cost.py       # prints a table, writes benches/results/planner_cost.json

Same items, ladders and limits as ``benches/planner.py`` (one path: 64-2048-token images over
``budget_ladder(64, 16384)``; two paths: a global view plus 0-40 tiles), same sampling (loops of about 2 ms,
cases in turn, median wall and thread-CPU time).  The cost model is the tuner's default linear model
(:data:`encgraph.packing.tuning.DEFAULT_COSTS`); the table also gives each plan's expected cost, greedy vs costed.
Target: 64 items <= 200 us median (the machine is shared: read the CPU-time median too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

import encgraph  # noqa: E402
from encgraph.packing.tuning import default_cost_model  # noqa: E402
from planner import machine, measure, parse_args, prepare, problems  # noqa: E402

TARGET_ITEMS, TARGET_US = 64, 200.0


def main() -> None:
    args = parse_args(__doc__, "planner_cost.json")
    load_before = round(os.getloadavg()[0], 2)
    rows, cases = [], []
    for row, items, ladders in problems(args.seed):
        model = default_cost_model(ladders if isinstance(ladders, dict) else ["default"])
        for planner, costs in (("greedy", None), ("costed", model)):
            # Key order as before: case, planner, paths, items.
            rows.append({"case": row["case"], "planner": planner, "paths": row["paths"], "items": row["items"]})
            case = prepare(items, ladders, costs)
            case["expected_ms"] = round(model.plan_cost(case.pop("plan")), 3)
            cases.append(case)
    results = [
        dict(row, **summary, expected_ms=case["expected_ms"])
        for row, case, summary in zip(rows, cases, measure(cases, args.samples))
    ]
    target = [r for r in results if r["items"] == TARGET_ITEMS and r["planner"] == "costed"]
    report = {
        "benchmark": "encgraph.packing.pack(costs=default_cost_model), median wall time per call, against greedy",
        "encgraph": encgraph.__version__,
        "machine": machine(load_before),
        "target": {
            "items": TARGET_ITEMS,
            "median_us_at_most": TARGET_US,
            "met": all(r["median_us"] <= TARGET_US for r in target),
            "met_cpu": all(r["cpu_median_us"] <= TARGET_US for r in target),
        },
        "results": results,
    }
    from benches.lib.results import write_rows

    write_rows(args.out, report, results, "planner: greedy against cost-aware packing, time per call and expected cost")
    m = report["machine"]
    print(f"machine: {m['platform']}, {m['cpu_count']} CPUs, load {load_before} -> {m['load_average_1m_after']}; wrote {args.out}")
    print(f"target: costed, {TARGET_ITEMS} items <= {TARGET_US:.0f} us median: wall {report['target']['met']}, cpu {report['target']['met_cpu']}")
    header = f"{'case':<10} {'planner':<7} {'items':>5} {'batches':>7} {'median us':>10} {'p10 us':>8} {'cpu us':>8} {'exp. ms':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['case']:<10} {r['planner']:<7} {r['items']:>5} {r['batches']:>7} {r['median_us']:>10.1f} "
            f"{r['p10_us']:>8.1f} {r['cpu_median_us']:>8.1f} {r['expected_ms']:>9.2f}"
        )


if __name__ == "__main__":
    main()
