"""Planner cost on the CPU: median time of ``encgraph.packing.pack`` for 8, 64 and 512 items, one and two paths.

Run from the repository root::

    python benches/planner.py            # prints a table, writes benches/results/planner.json

One path: images of 64-2048 tokens over ``budget_ladder(64, 16384)``.  Two paths (a global view and tiles, as in
DeepSeek-OCR): 256 global tokens plus 0-40 tiles of 144 tokens over ``budget_ladder(272, 13824)`` and
``budget_ladder(100, 4000, allow_zero=True)``.  Limits come from ``default_limits``.  Each sample times a loop of
calls (enough to take about 2 ms) and divides; samples of all cases are taken in turn, and the median (with
p10, p90, and the median thread CPU time, which other work on the machine inflates less) is reported.  Item specs are built
outside the timed region (their validation happens once, when the caller describes the items).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import encgraph  # noqa: E402
from encgraph.packing import ItemSpec, budget_ladder, default_limits, pack  # noqa: E402

SIZES = (8, 64, 512)
TARGET_ITEMS, TARGET_US = 64, 100.0


def one_path(n: int, rng: random.Random):
    ladder = budget_ladder(64, 16384)
    return [ItemSpec(rng.randint(64, 2048)) for _ in range(n)], ladder


def two_paths(n: int, rng: random.Random):
    ladders = {"global": budget_ladder(272, 13824), "local": budget_ladder(100, 4000, allow_zero=True)}
    return [ItemSpec({"global": 256, "local": 144 * rng.randint(0, 40)}) for _ in range(n)], ladders


def prepare(items, ladders, costs=None) -> dict:
    """A timed case: ``pack`` of ``items`` over ``ladders`` with ``default_limits`` (and ``costs``, a CostModel or
    None for the greedy plan), its loop length, and the plan it gives (``"plan"``, for the caller to read)."""
    limits = default_limits(ladders)

    def call():
        return pack(items, ladders, max_items=limits.max_items, max_frames=limits.max_frames, costs=costs)

    plan = call()
    # Calibrate the loop so that one sample takes about 2 ms (timer resolution and noise stay small).
    inner = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        if time.perf_counter() - t0 > 2e-3 or inner >= 1 << 16:
            break
        inner *= 2
    return {"call": call, "inner": inner, "batches": len(plan.batches), "max_items": limits.max_items, "plan": plan}


def sample(case: dict) -> tuple[float, float]:
    """One sample: (wall us, CPU us) per call, over ``inner`` calls."""
    call, inner = case["call"], case["inner"]
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for _ in range(inner):
        call()
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    return wall / inner * 1e6, cpu / inner * 1e6


def summarize(case: dict, walls: list[float], cpus: list[float]) -> dict:
    walls = sorted(walls)
    n = len(walls)
    return {
        "median_us": round(statistics.median(walls), 2),
        "p10_us": round(walls[n // 10], 2),
        "p90_us": round(walls[(n * 9) // 10], 2),
        "cpu_median_us": round(statistics.median(cpus), 2),
        "samples": n,
        "calls_per_sample": case["inner"],
        "batches": case["batches"],
        "max_items": case["max_items"],
    }


def measure(cases: list[dict], samples: int) -> list[dict]:
    """``samples`` samples of every case, taken in turn, summarized per case (see :func:`summarize`)."""
    # Round-robin sampling: a burst of other work on the machine hits every case alike.
    walls: list[list[float]] = [[] for _ in cases]
    cpus: list[list[float]] = [[] for _ in cases]
    for _ in range(samples):
        for k, case in enumerate(cases):
            wall, cpu = sample(case)
            walls[k].append(wall)
            cpus[k].append(cpu)
    return [summarize(case, w, c) for case, w, c in zip(cases, walls, cpus)]


def machine(load_before: float) -> dict:
    """The machine a report ran on, with the 1-minute load average before (given) and after (now)."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        # Other work on the machine inflates the tail (p90); the median and p10 are the planner's own cost.
        "load_average_1m_before": load_before,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def parse_args(doc: str, out_name: str) -> argparse.Namespace:
    """The command line of a planner bench (``doc``: its module docstring; ``out_name``: its default JSON)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--samples", type=int, default=101, help="timed samples per case (default 101)")
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results" / out_name)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def problems(seed: int):
    """Every bench problem: ``(row, items, ladders)``, row = ``{"case", "paths", "items"}``, one and two paths."""
    for name, make in (("one path", one_path), ("two paths", two_paths)):
        for n in SIZES:
            items, ladders = make(n, random.Random(seed + n))
            yield {"case": name, "paths": 1 if make is one_path else 2, "items": n}, items, ladders


def main() -> None:
    args = parse_args(__doc__, "planner.json")
    load_before = round(os.getloadavg()[0], 2)
    rows, cases = [], []
    for row, items, ladders in problems(args.seed):
        rows.append(row)
        cases.append(prepare(items, ladders))
    results = [dict(row, **s) for row, s in zip(rows, measure(cases, args.samples))]

    target = [r for r in results if r["items"] == TARGET_ITEMS]
    report = {
        "benchmark": "encgraph.packing.pack, median wall time per call",
        "encgraph": encgraph.__version__,
        "machine": machine(load_before),
        "target": {
            "items": TARGET_ITEMS,
            "median_us_at_most": TARGET_US,
            "met": all(r["median_us"] <= TARGET_US for r in target),
        },
        "results": results,
    }
    from benches.lib.results import write_rows

    write_rows(args.out, report, results, "planner: time per pack() call")

    m = report["machine"]
    print(
        f"machine: {m['platform']}, Python {m['python']}, {m['cpu_count']} CPUs, load {m['load_average_1m_before']}"
        f" -> {m['load_average_1m_after']}; wrote {args.out}"
    )
    print(f"target: {TARGET_ITEMS} items <= {TARGET_US:.0f} us median: {'met' if report['target']['met'] else 'NOT met'}")
    print()
    header = (
        f"{'case':<10} {'items':>5} {'batches':>7} {'median us':>10} {'p10 us':>8} {'p90 us':>8} {'cpu us':>8} "
        f"{'us/item':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['case']:<10} {r['items']:>5} {r['batches']:>7} {r['median_us']:>10.1f} {r['p10_us']:>8.1f} "
            f"{r['p90_us']:>8.1f} {r['cpu_median_us']:>8.1f} {r['median_us'] / r['items']:>8.2f}"
        )


if __name__ == "__main__":
    main()
