"""Capture: seconds to capture each tower's default ladder, the graph pool's memory against the largest single
graph, and per budget its capture seconds, memory and replay time (``runner.capture()``'s own summary).

Each tower is built (random bf16 weights, real geometry), wrapped, and captured once in a fresh memory state; the
ladder and limits are the adapter's defaults, as a user gets them. The project's target: the whole ladder in
<= 5 s, pool memory <= 1.1x the largest graph (graphs share one pool, captured largest first).

JSON (``benches/results/capture_<gpu>.json``)::

    {"environment", "options",
     "towers": {"<tower>": {"label", "params", "ladders", "limits", "wall_seconds", "graphs", "seconds",
                "pool_bytes", "largest_graph_bytes", "pool_vs_largest", "buffer_bytes", "failed",
                "per_graph": [{"path", "budget", "capture_seconds", "memory_bytes", "replay_ms"}],
                "reserved_before_bytes", "reserved_after_bytes"}}}
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches import common
from benches.common import TOWERS, System

SCRIPT = "capture"
TOWER_MIN_SECONDS = 10.0
MIB = 2**20


def build_parser() -> Any:
    p = common.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=40.0)
    p.add_argument("--towers", type=common.parse_names(TOWERS), default=None,
                   help=f"comma list out of {','.join(TOWERS)} (default all; with --cpu-smoke "
                        f"{','.join(common.SMOKE_TOWERS)})")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    common.smoke_defaults(args, towers=tuple(TOWERS))
    env = common.make_env(args)
    deadline = common.Deadline(args.time_budget)
    results = common.Results(SCRIPT, args, env)
    results.data["towers"] = {}
    with common.inference():
        for name in args.towers:
            results.data["towers"][name] = capture_tower(name, env, deadline)
            results.flush()
    results.data["seconds"] = round(deadline.elapsed(), 1)
    results.finish(render(results.data))
    return results.data


def _reserved(env: common.Env) -> int:
    import torch

    return int(torch.cuda.memory_reserved(env.device)) if env.cuda else 0


def capture_tower(name: str, env: common.Env, deadline: common.Deadline) -> dict[str, Any]:
    spec = TOWERS[name]
    if deadline.expired(TOWER_MIN_SECONDS):
        return {"label": spec.label, "skipped": common.SKIPPED_TIME}
    common.log(f"{name}: building")
    bench = common.TowerBench(spec, env, (System.GRAPH,))
    entry: dict[str, Any] = {"label": spec.label, "params": bench.params}
    if System.GRAPH in bench.unavailable:
        entry["skipped"] = bench.unavailable[System.GRAPH]
        bench.close()
        return entry
    common.free_memory()
    before = _reserved(env)
    try:
        t0 = time.perf_counter()
        runner = bench.runner(System.GRAPH)
        entry["wall_seconds"] = round(time.perf_counter() - t0, 3)
    except Exception as exc:
        traceback.print_exc()
        entry["error"] = common.short_error(exc)
        bench.close()
        return entry
    info = dict(bench.capture_info or {})
    entry["ladders"] = {p: list(ladder) for p, ladder in runner.ladders.items()}
    entry["limits"] = {"max_items": runner.limits.max_items, "max_frames": runner.limits.max_frames}
    entry.update(info)
    largest = info.get("largest_graph_bytes") or 0
    entry["pool_vs_largest"] = round(info.get("pool_bytes", 0) / largest, 3) if largest else None
    entry["reserved_before_bytes"] = before
    entry["reserved_after_bytes"] = _reserved(env)
    common.log(f"{name}: {info.get('graphs')} graphs in {info.get('seconds')} s")
    bench.close()
    return entry


def render(data: dict[str, Any]) -> str:
    env = data["environment"]
    summary = common.markdown_table(
        ["tower", "graphs", "ladder", "capture s", "pool MiB", "largest graph MiB", "pool / largest",
         "static buffers MiB", "failed"],
        [_summary_row(t) for t in data["towers"].values()],
    )
    per_budget = common.markdown_table(
        ["tower", "budget", "capture s", "memory MiB", "replay ms"],
        [[t["label"], g["budget"], g["capture_seconds"], g["memory_bytes"] / MIB, g["replay_ms"]]
         for t in data["towers"].values() for g in t.get("per_graph", [])],
    )
    return (f"## capture: default ladders ({env['gpu']}, {env['dtype']})\n\n{summary}\n\n"
            f"### per budget\n\n{per_budget}")


def _summary_row(t: dict[str, Any]) -> list[Any]:
    if "graphs" not in t:
        return [t["label"], common.status_of(t)] + ["-"] * 7
    ladder = "; ".join(",".join(map(str, v)) for v in t.get("ladders", {}).values())
    return [t["label"], t["graphs"], ladder, t["seconds"], t.get("pool_bytes", 0) / MIB,
            t.get("largest_graph_bytes", 0) / MIB, t.get("pool_vs_largest"), t.get("buffer_bytes", 0) / MIB,
            len(t.get("failed") or {})]


if __name__ == "__main__":
    main()
