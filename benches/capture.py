"""Capture: per tower, the runner's default ladder next to the old doubling ladder: graphs, capture seconds, the
graph pool's memory against the largest single graph, and per budget its capture seconds, memory and replay time
(``runner.capture()``'s own summary).

Each tower is built (random bf16 weights, real geometry) and wrapped once; each ladder is captured by a fresh
``EncoderGraphRunner(adapter)`` in a fresh memory state, with every compile cache pointed at a fresh empty
directory:

- ``doubling``: ``encgraph.packing.budget_ladder(min_budget, max_budget)`` of each path (the adapter's bounds):
  the minimum doubled until it passes the maximum (the ladder of before issue 13);
- ``default``: no ``budgets=``: whatever ``EncoderGraphRunner(adapter).ladders`` is when it runs.

Only the ladder differs between the two. ``--compile off`` (the default) passes ``compile=False`` to both, so
that the seconds compare ladders, not compilers; ``--compile default`` leaves the runner's own default. The
project's targets: pool memory <= 1.1x the largest graph (graphs share one pool, captured largest first).

JSON (``benches/results/capture_<gpu>.json``)::

    {"environment", "options", "seconds",
     "towers": {"<tower>": {"label", "params", <the default ladder's entry, below>,
                            "doubling": <the doubling ladder's entry>}}}

    entry: {"ladders", "limits", "runner_options", "wall_seconds", "graphs", "seconds", "pool_bytes",
            "largest_graph_bytes", "pool_vs_largest", "buffer_bytes", "failed",
            "per_graph": [{"path", "budget", "capture_seconds", "memory_bytes", "replay_ms"}],
            "reserved_before_bytes", "reserved_after_bytes"}
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.cli import base_parser, parse_names, smoke_defaults
from benches.lib.env import SKIPPED_TIME, Deadline, Env, free_memory, inference, log, make_env, short_error
from benches.lib.results import Results, json_ready, markdown_table, status_of
from benches.lib.startup import cache_env
from benches.lib.systems import System, TowerBench
from benches.lib.towers import CORE_TOWERS, SMOKE_TOWERS, TOWERS

SCRIPT = "capture"
TOWER_MIN_SECONDS = 10.0
MIB = 2**20
LADDERS = ("doubling", "default")


def build_parser() -> Any:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=60.0)
    p.add_argument("--towers", type=parse_names(TOWERS), default=None,
                   help=f"comma list out of {','.join(TOWERS)} (default {','.join(CORE_TOWERS)}; with --cpu-smoke "
                        f"{','.join(SMOKE_TOWERS)})")
    p.add_argument("--ladders", type=parse_names(LADDERS), default=LADDERS,
                   help="comma list out of doubling,default (default both, in that order)")
    p.add_argument("--compile", choices=("off", "default"), default="off",
                   help="off: compile=False for every ladder (default; compares ladders alone); default: the "
                        "runner's own compile default")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    smoke_defaults(args, towers=CORE_TOWERS)
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    results = Results(SCRIPT, args, env)
    results.data["towers"] = {}
    with inference():
        for name in args.towers:
            results.data["towers"][name] = capture_tower(name, args, env, deadline, results)
            results.flush()
    results.data["seconds"] = round(deadline.elapsed(), 1)
    results.finish(render(results.data))
    return results.data


def _reserved(env: Env) -> int:
    import torch

    return int(torch.cuda.memory_reserved(env.device)) if env.cuda else 0


def capture_tower(name: str, args: Any, env: Env, deadline: Deadline, results: Results) -> dict[str, Any]:
    spec = TOWERS[name]
    skipped = SKIPPED_TIME if deadline.expired(TOWER_MIN_SECONDS) else spec.missing()
    if skipped:
        return {"label": spec.label, "skipped": skipped}
    log(f"{name}: building")
    bench = TowerBench(spec, env, (System.ADAPTER_EAGER,))  # the adapter's copy only; runners made here
    tower: dict[str, Any] = {"label": spec.label, "params": bench.params}
    if bench.adapter is None:
        tower["skipped"] = bench.unavailable[System.ADAPTER_EAGER]
    else:
        for which in args.ladders:
            if deadline.expired():
                entry: dict[str, Any] = {"skipped": SKIPPED_TIME}
            else:
                entry = capture_ladder(bench.adapter, which, args.compile, env)
                log(f"{name}, {which} ladder: {entry.get('graphs')} graphs in {entry.get('seconds')} s")
            if which == "default":
                tower.update(entry)
            else:
                tower[which] = entry
            results.data["towers"][name] = tower
            results.flush()
    bench.close()
    return tower


def ladder_options(adapter: Any, which: str, compile_option: str) -> dict[str, Any]:
    """The runner options of one ladder: ``budgets`` of the doubling ladder, or none (the runner's default)."""
    from encgraph.packing import budget_ladder

    from encgraph.capture.records import RunMode

    options: dict[str, Any] = {} if compile_option == "default" else {"compile": False}
    if adapter.config.device.type != "cuda":
        options["mode"] = RunMode.STATIC  # what a capture does, without graphs (the CPU default captures nothing)
    if which == "doubling":
        options["budgets"] = {p.name: budget_ladder(p.min_budget, p.max_budget, allow_zero=p.allow_empty)
                              for p in adapter.config.paths}
    return options


def capture_ladder(adapter: Any, which: str, compile_option: str, env: Env) -> dict[str, Any]:
    """Capture one ladder with a fresh runner (and fresh compile caches); its summary, then free its memory."""
    from encgraph.capture import EncoderGraphRunner

    options = ladder_options(adapter, which, compile_option)
    entry: dict[str, Any] = {"runner_options": json_ready(options)}
    free_memory()
    before = _reserved(env)
    runner = None
    try:
        with cache_env():
            t0 = time.perf_counter()
            runner = EncoderGraphRunner(adapter, progress=False, **options)
            info = json_ready(runner.capture())
            entry["wall_seconds"] = round(time.perf_counter() - t0, 3)
    except Exception as exc:
        traceback.print_exc()
        entry["error"] = short_error(exc)
        return entry
    finally:
        entry["reserved_after_bytes"] = _reserved(env)
    entry["ladders"] = {p: list(ladder) for p, ladder in runner.ladders.items()}
    entry["limits"] = {"max_items": runner.limits.max_items, "max_frames": runner.limits.max_frames}
    entry.update(info)
    largest = info.get("largest_graph_bytes") or 0
    entry["pool_vs_largest"] = round(info.get("pool_bytes", 0) / largest, 3) if largest else None
    entry["reserved_before_bytes"] = before
    del runner
    free_memory()
    return entry


def ladder_entries(tower: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(ladder name, entry)`` of a tower, doubling first (results of before the comparison: one ``default``)."""
    out = [("doubling", tower["doubling"])] if "doubling" in tower else []
    return out + [("default", tower)]


def summary_table(data: dict[str, Any]) -> str:
    """Per tower, a row per ladder (doubling first): graphs, budgets, seconds, pool and largest graph MiB."""
    return markdown_table(
        ["tower", "ladder", "graphs", "budgets", "capture s", "pool MiB", "largest graph MiB", "pool / largest",
         "static buffers MiB", "failed"],
        [_summary_row(t, which, e) for t in data["towers"].values() for which, e in ladder_entries(t)],
    )


def render(data: dict[str, Any]) -> str:
    env = data["environment"]
    summary = summary_table(data)
    per_budget = markdown_table(
        ["tower", "ladder", "budget", "capture s", "memory MiB", "replay ms"],
        [[t["label"], which, g["budget"], g["capture_seconds"], g["memory_bytes"] / MIB, g["replay_ms"]]
         for t in data["towers"].values() for which, e in ladder_entries(t) for g in e.get("per_graph", [])],
    )
    return (f"## capture: the doubling ladder and the runner's default ladder ({env['gpu']}, {env['dtype']})\n\n"
            f"{summary}\n\n### per budget\n\n{per_budget}")


def _summary_row(t: dict[str, Any], which: str, e: dict[str, Any]) -> list[Any]:
    if "graphs" not in e:
        return [t["label"], which, status_of(e)] + ["-"] * 7
    ladder = "; ".join(",".join(map(str, v)) for v in e.get("ladders", {}).values())
    return [t["label"], which, e["graphs"], ladder, e["seconds"], e.get("pool_bytes", 0) / MIB,
            e.get("largest_graph_bytes", 0) / MIB, e.get("pool_vs_largest"), e.get("buffer_bytes", 0) / MIB,
            len(e.get("failed") or {})]


if __name__ == "__main__":
    main()
