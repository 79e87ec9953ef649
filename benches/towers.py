r"""Fixed cases per tower, every system side by side: median latency of each call (CUDA events, 30 timed runs after
5 warm-ups), the matmul floor beside it, and the graph's speedups.

Towers (random bf16 weights at real geometry, ``benches.lib.towers``): Qwen2.5-VL-7B, Qwen3-VL-8B, SigLIP-so400m
at 224 and 384 px, InternViT-300M at 448 px. Cases (``benches.lib.cases``): 1 x 224 px, 4 x 224, 8 x 336, 1 x 896, one
8-frame 448 x 252 video. Qwen-VL towers resize each side to a multiple of patch x merge as their processors do
(Qwen3-VL: 336 -> 320, 252 -> 256); fixed-resolution towers see tiles of their own side (an image that does not
fit: min(ceil(h/S) ceil(w/S), 12) tiles plus a thumbnail; a video: one tile per frame).

The families added after the seed are rows too, run only when named (``--towers``), each at its full released
depth, on the cases 1 x 448 px and 8 x 336 px unless ``--cases`` says otherwise, as its processor makes them:
GLM-4.1V, Qwen3.5, ERNIE-4.5-VL, Kimi-K2.5 (packed patch rows; Qwen3.5 sees 336 as 320), MiniCPM-V 4.6 (one
strip; both sizes become 448 px, 32 x 32 patches, unsliced), Llama 4 (336 px tiles: 2 x 2 plus a global tile for
448 px, one tile for 336), Gemma-4 (patches padded to 2520 rows: any square image is 48 x 48 patches, 256 soft
tokens) and Step-3.7 (the model's ``get_image_features``: a 728 px global view per image; neither size gets 504 px
crops, ``1x896`` gets 4). Their table beside the main one: HF sdpa, ``defaults``, the speedup and the largest
relative difference of the outputs::

    python benches/towers.py --towers glm4v,qwen3_5,ernie4_5_vl_moe,kimi_k25,minicpmv4_6,llama4,gemma4 \
        --systems hf_sdpa,defaults,adapter_eager --runs 10 --warmup 2 --time-budget 240 --tag families
    python benches/towers.py --towers step3p7 --systems hf_sdpa,defaults,adapter_eager --runs 10 --warmup 2 \
        --time-budget 540 --tag families-step3p7

(Step-3.7 on its own: its adapter names no ``compile_regions``, so the default ``compile="auto"`` compiles its whole
static forward, once per path: on an H200 with empty caches the local path's first graph took 200 s.) A family
whose module the installed transformers lacks is reported unavailable, and the run goes on.

Two phases, so that the core table is complete before the slow part: (1) every tower through hf_sdpa, hf_varlen,
adapter_eager, defaults (``encgraph.graphed(tower)`` with no options, captured first) and graph; (2) the compiled systems, only for ``--compile-towers`` x ``--compile-cases`` (default
Qwen2.5-VL-7B at 1x224 and 4x224: each new budget is a compile of tens of seconds), in ``--systems`` order while
the time budget lasts: ``compile`` (``torch.compile(mode="reduce-overhead")`` of the static forward) and
``graph_compile`` (encgraph's graphs of the compiled forward, captured at the cases' budgets only), with first-call
seconds and dynamo's counters (graphs compiled: the recompiles; graph breaks) recorded.

JSON (``benches/results/towers_<gpu>.json``)::

    {"environment": {...}, "options": {...}, "matmul": {"tflops", "n", "median_ms", ...},
     "towers": {"<tower>": {"label", "params", "geometry", "build_seconds", "capture": {runner.capture()},
                "defaults_capture": {"wall_seconds", graphed(tower).capture()},
                "cases": {"<case>": {"items", "patches", "tokens", "grids" | "tiles", "floor_ms", "plan",
                          "systems": {"<system>": {"median_ms", "mean_ms", "p10_ms", "p90_ms", "min_ms", "runs"}
                                      | {"skipped": why} | {"error": what}},
                          "graph_stats" | "defaults_stats": {"padded_share", "eager_items_per_call", ...},
                          "graph_vs_eager_max_rel_diff", "defaults_vs_hf_sdpa_max_rel_diff", "compared_rows"?,
                          "compile_info": {"compile" | "graph_compile": {"first_call_seconds", "graphs_compiled",
                                           "graphs_compiled_total", "graph_breaks", "frames_ok", "cudagraph_skips",
                                           "max_rel_diff_vs_adapter_eager"}},
                          "speedup": {"defaults_vs_hf_sdpa", "graph_vs_hf_sdpa", "graph_vs_adapter_eager", ...}}},
                "graph_compile_capture": {"wall_seconds", runner.capture() of the compiled graphs}}}}
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs

from benches.lib.cases import (
    ALL_CASES,
    CASE_NAMES,
    DEFAULT_CASE_NAMES,
    PHOTO_CASE,
    SMOKE_CASES,
    BenchInputs,
    Case,
    CaseError,
)
from benches.lib.cli import base_parser, parse_names, smoke_defaults
from benches.lib.compiled import counter_delta, dynamo_counters
from benches.lib.env import Deadline, Env, SKIPPED_TIME, free_memory, inference, log, make_env, short_error
from benches.lib.outputs import max_rel_diff, without_padding_rows
from benches.lib.results import Results, fmt, markdown_table, median_of, ratio, status_of
from benches.lib.startup import cache_env
from benches.lib.systems import COMPILED, System, TowerBench, parse_systems
from benches.lib.timing import floor_ms, matmul_rate, measure, time_once
from benches.lib.towers import CORE_TOWERS, FAMILY_TOWERS, SMOKE_TOWERS, TOWERS
from benches.lib.trace import photo_caps

SCRIPT = "towers"
PHASE1 = (System.HF_SDPA, System.HF_VARLEN, System.ADAPTER_EAGER, System.DEFAULTS, System.GRAPH)
"""Everything but the compiled systems, measured first for every tower."""
DEFAULT_SYSTEMS = (*PHASE1, *COMPILED)
STATS_KEYS = {System.GRAPH: "graph_stats", System.DEFAULTS: "defaults_stats"}
"""Where each graph system's padded share and eager items of a case go."""
"""``hf_compile_dynamic`` is traffic's: on fixed cases it would compile once per case."""
TOWER_MIN_SECONDS = 15.0
"""A tower is not started with less time left than this (building and capturing alone take seconds)."""


def build_parser() -> Any:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=150.0)
    p.add_argument("--towers", type=parse_names(TOWERS), default=None,
                   help=f"comma list out of {','.join(TOWERS)} (default {','.join(CORE_TOWERS)}, in that order; "
                        f"with --cpu-smoke {','.join(SMOKE_TOWERS)}; the families {','.join(FAMILY_TOWERS)} run "
                        "when named)")
    p.add_argument("--cases", type=parse_names(CASE_NAMES), default=None,
                   help=f"comma list out of {','.join(CASE_NAMES)} (default {','.join(DEFAULT_CASE_NAMES)}; with "
                        f"--cpu-smoke {','.join(SMOKE_CASES)}; a family tower: its own, 1x448,8x336)")
    p.add_argument("--systems", type=parse_systems, default=DEFAULT_SYSTEMS,
                   help="comma list out of " + ",".join(s.value for s in (*PHASE1, *COMPILED)) + " (default all)")
    p.add_argument("--compile-towers", type=parse_names(TOWERS), default=("qwen2_5_vl_7b",),
                   help="towers that get the torch.compile system (default qwen2_5_vl_7b)")
    p.add_argument("--compile-cases", type=parse_names(CASE_NAMES), default=("1x224", "4x224"),
                   help="cases that get the torch.compile system (default 1x224,4x224)")
    p.add_argument("--compile-min-seconds", type=float, default=30.0,
                   help="start a torch.compile case only with this much of the time budget left (default 30)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    own_cases = args.cases is None  # each tower its own cases where its row names them
    smoke_defaults(args, towers=CORE_TOWERS, cases=DEFAULT_CASE_NAMES)
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    results = Results(SCRIPT, args, env)
    data = results.data
    cases = [c for c in ALL_CASES if c.name in args.cases]
    by_name = {c.name: c for c in ALL_CASES}
    with inference():
        data["matmul"] = matmul_rate(env)
        log(f"matmul rate {data['matmul']['tflops']} TFLOP/s")
        data["towers"] = {}
        results.flush()
        phase1 = [s for s in args.systems if s in PHASE1]
        for name in args.towers:
            spec_cases = TOWERS[name].cases if own_cases else None
            tower_cases = [by_name[n] for n in spec_cases] if spec_cases else cases
            with cache_env():  # defaults' capture starts from empty compile caches, as in a fresh install
                run_tower(name, tower_cases, phase1, env, deadline, results)
        compiled = [s for s in args.systems if s in COMPILED]
        if compiled:
            for name in args.towers:
                if name in args.compile_towers:
                    run_compile(name, [c for c in cases if c.name in args.compile_cases], compiled, env, deadline,
                                args, results)
        data["seconds"] = round(deadline.elapsed(), 1)
    results.finish(render(data, args.systems))
    return data


def _case_entry(bench: TowerBench, inputs: BenchInputs, tflops: float) -> dict[str, Any]:
    s = inputs.sizes
    entry: dict[str, Any] = {"items": s.items, "patches": s.patches, "tokens": s.tokens}
    if s.grids:
        entry["grids"] = [list(g) for g in s.grids]
    else:
        entry["tiles"] = s.tiles
    if s.crops:
        entry["crops"] = list(s.crops)
    entry["floor_ms"] = round(floor_ms(bench.params, s.patches, tflops), 4)
    entry["systems"] = {}
    return entry


def run_tower(name: str, cases: list[Case], systems: list[System], env: Env,
              deadline: Deadline, results: Results) -> None:
    spec = TOWERS[name]
    towers = results.data["towers"]
    skipped = SKIPPED_TIME if deadline.expired(TOWER_MIN_SECONDS) else spec.missing()
    if skipped:
        towers[name] = {"label": spec.label, "skipped": skipped}
        results.flush()
        return
    log(f"{name}: building")
    try:
        bench = TowerBench(spec, env, systems)
    except Exception as exc:  # noqa: BLE001 (one tower that cannot be built must not end the run)
        traceback.print_exc()
        towers[name] = {"label": spec.label, "skipped": f"error: build failed ({short_error(exc)})"}
        free_memory()
        results.flush()
        return
    entry = towers[name] = {
        "label": spec.label,
        "params": bench.params,
        "geometry": {k: (v.value if hasattr(v, "value") else v) for k, v in attrs.asdict(bench.geom).items()},
        "build_seconds": round(bench.build_seconds, 2),
        "unavailable": {s.value: why for s, why in bench.unavailable.items()},
        "cases": {},
    }
    for system, key in ((System.GRAPH, "capture"), (System.DEFAULTS, "defaults_capture")):
        if system in systems and system not in bench.unavailable:
            try:
                bench.defaults() if system is System.DEFAULTS else bench.runner(system)
                entry[key] = bench.capture_infos.get(system)
                log(f"{name}: {system.value} captured in {entry[key]['wall_seconds']:.1f} s")
            except Exception as exc:
                bench.unavailable[system] = f"error: capture failed ({short_error(exc)})"
    for case in cases:
        try:
            seed = CASE_NAMES.index(case.name)
            if case is PHOTO_CASE:  # sized by the processor's default maximum
                inputs = photo_caps(name, bench.geom).inputs(bench, case.visuals, seed)
            else:
                inputs = bench.inputs(case.visuals, seed=seed)
        except CaseError as exc:
            entry["cases"][case.name] = {"skipped": f"n/a: {exc}"}
            continue
        c = entry["cases"][case.name] = _case_entry(bench, inputs, results.data["matmul"]["tflops"])
        if bench.adapter is not None and System.GRAPH not in bench.unavailable:
            c["plan"] = bench.plan_summary(inputs)
        for system in systems:
            c["systems"][system.value] = measure_system(bench, system, inputs, env, deadline, c)
        check_outputs(bench, inputs, c)
        c["speedup"] = speedups(c["systems"])
        results.flush()
        log(f"{name} {case.name}: " + ", ".join(
            f"{k} {fmt(median_of(v))}" for k, v in c["systems"].items()))
    bench.close()


def measure_system(bench: TowerBench, system: System, inputs: BenchInputs, env: Env,
                   deadline: Deadline, case: dict[str, Any]) -> dict[str, Any]:
    if system in bench.unavailable:
        return {"skipped": bench.unavailable[system]}
    if deadline.expired():
        return {"skipped": SKIPPED_TIME}
    try:
        fn = bench.call(system, inputs)
    except Exception as exc:
        return {"error": short_error(exc)}
    key = STATS_KEYS.get(system)
    if key is not None:
        bench.reset_stats(system)
    out = measure(fn, env)
    if key is not None and "error" not in out:
        stats = bench.stats(system)
        paths = stats["paths"].values()
        padded = sum(p["padded_tokens"] for p in paths)
        replayed = sum(b * n for p in paths for b, n in p["replays"].items())
        case[key] = {
            "padded_share": round(padded / replayed, 4) if replayed else 0.0,
            "eager_items_per_call": stats["eager_items"] / max(stats["calls"], 1),
            # Calls the tower's own forward answered (all of them on a CPU under the defaults: no graphs there).
            "stock_calls": stats.get("stock_calls", 0),
            "eager_reasons": stats["eager_reasons"],
        }
    return out


def check_outputs(bench: TowerBench, inputs: BenchInputs, case: dict[str, Any]) -> None:
    """One call each of the graph and the adapter's eager forward on the case's inputs, and of ``defaults`` and
    ``hf_sdpa``: their largest relative difference (a benchmark of wrong outputs would be worthless)."""
    systems = case["systems"]
    for fast, ref, key in ((System.GRAPH, System.ADAPTER_EAGER, "graph_vs_eager_max_rel_diff"),
                           (System.DEFAULTS, System.HF_SDPA, "defaults_vs_hf_sdpa_max_rel_diff")):
        if not all(median_of(systems.get(s.value)) is not None for s in (fast, ref)):
            continue
        try:
            got, want = bench.call(fast, inputs)(), bench.call(ref, inputs)()
            # Runners return one result per item; the graphed module returns the tower's own output.
            if fast is System.GRAPH:
                case[key] = max_rel_diff(got, want)
                continue
            mask = inputs.hf_kwargs.get("pixel_attention_mask")
            if mask is not None and not bool(mask.bool().all()):
                # SigLIP2 NaFlex: the padding rows are zero by design (the tower's are its padding queries').
                got, want = without_padding_rows(got, mask), without_padding_rows(want, mask)
                case["compared_rows"] = "valid rows: padding rows of a pixel_attention_mask are zero by design"
            case[key] = max_rel_diff([got], [want])
        except Exception as exc:
            case[key] = short_error(exc)


def speedups(systems: dict[str, Any]) -> dict[str, float]:
    out = {}
    for fast in (System.DEFAULTS, System.GRAPH, *COMPILED):
        for base in (System.HF_SDPA, System.HF_VARLEN, System.ADAPTER_EAGER):
            r = ratio(median_of(systems.get(base.value)), median_of(systems.get(fast.value)))
            if r is not None:
                out[f"{fast.value}_vs_{base.value}"] = round(r, 3)
    return out


def run_compile(name: str, cases: list[Case], systems: list[System], env: Env,
                deadline: Deadline, args: Any, results: Results) -> None:
    """Phase 2: the compiled systems on the chosen cases of one tower (a fresh build with the same seed: the same
    weights and inputs as phase 1). ``compile``: the first call of each case compiles; ``graph_compile``: the
    runner compiles and captures the cases' budgets when it is made. Both record dynamo's counters."""
    entry = results.data["towers"].get(name, {})
    todo = [c for c in cases if "systems" in entry.get("cases", {}).get(c.name, {})]
    if not todo:
        return

    def record(case: Case, system: System, value: dict[str, Any], info: dict[str, Any] | None = None) -> None:
        c = entry["cases"][case.name]
        c["systems"][system.value] = value
        if info is not None:
            c.setdefault("compile_info", {})[system.value] = info
        c["speedup"] = speedups(c["systems"])
        results.flush()

    if deadline.expired(args.compile_min_seconds) or not env.cuda:
        why = SKIPPED_TIME if env.cuda else "skipped: needs CUDA (torch.compile into CUDA graphs)"
        for system in systems:
            for case in todo:
                record(case, system, {"skipped": why})
        return
    log(f"{name}: building for {', '.join(s.value for s in systems)}")
    bench = TowerBench(TOWERS[name], env, (System.ADAPTER_EAGER, *systems))
    inputs = {case.name: bench.inputs(case.visuals, seed=CASE_NAMES.index(case.name)) for case in todo}
    for system in systems:
        import torch._dynamo

        torch._dynamo.reset()
        start = dynamo_counters()
        if system is System.GRAPH_COMPILE and system not in bench.unavailable:
            prepare_graph_compile(bench, list(inputs.values()), deadline, args, entry)
        for case in todo:
            if system in bench.unavailable:
                record(case, system, {"skipped": bench.unavailable[system]})
                continue
            if deadline.expired(args.compile_min_seconds):
                record(case, system, {"skipped": SKIPPED_TIME})
                continue
            x = inputs[case.name]
            before = dynamo_counters()
            try:
                fn = bench.call(system, x)
                first = time_once(fn, env) / 1e3  # compile: compiles (and records torch's graphs) here
            except Exception as exc:
                traceback.print_exc()
                record(case, system, {"error": short_error(exc)})
                continue
            value = measure(fn, env)
            after = dynamo_counters()
            info: dict[str, Any] = {"first_call_seconds": round(first, 2), **counter_delta(after, before),
                                    "graphs_compiled_total": after["graphs_compiled"] - start["graphs_compiled"]}
            with contextlib.suppress(Exception):
                info["max_rel_diff_vs_adapter_eager"] = max_rel_diff(
                    fn(), bench.call(System.ADAPTER_EAGER, x)())
            record(case, system, value, info)
            log(f"{name} {case.name}: {system.value} {fmt(median_of(value))} ms "
                       f"(first call {first:.1f} s)")
    bench.close()


def prepare_graph_compile(bench: TowerBench, inputs: list[BenchInputs], deadline: Deadline,
                          args: Any, entry: dict[str, Any]) -> None:
    """Make the ``graph_compile`` runner for the budgets the cases use (compile + capture, timed), if the time
    budget allows one compile per budget; otherwise mark the system skipped."""
    bench.compile_budgets = bench.plan_budgets(inputs)
    count = sum(len(b) for b in bench.compile_budgets.values())
    if deadline.expired(args.compile_min_seconds * max(count, 1)):
        bench.unavailable[System.GRAPH_COMPILE] = SKIPPED_TIME
        return
    try:
        t0 = time.perf_counter()
        bench.runner(System.GRAPH_COMPILE)
        entry["graph_compile_capture"] = {**bench.capture_infos.get(System.GRAPH_COMPILE, {}),
                                          "wall_seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        traceback.print_exc()
        bench.unavailable[System.GRAPH_COMPILE] = f"error: compile or capture failed ({short_error(exc)})"


def render(data: dict[str, Any], systems: tuple[System, ...]) -> str:
    """The markdown tables: one row per tower and case, median ms per system, speedups and the floor (the seed's
    towers); HF sdpa against ``defaults`` (the family towers). Notes on captures and compiles after them."""
    towers = data.get("towers", {})
    core = {k: v for k, v in towers.items() if k not in FAMILY_TOWERS}
    families = {k: v for k, v in towers.items() if k in FAMILY_TOWERS}
    mm = data.get("matmul", {})
    where = f"{data['environment']['gpu']}, {data['environment']['dtype']}"
    parts = []
    if core or not families:
        parts.append(f"## towers: median latency per call ({where}, matmul {mm.get('tflops')} TFLOP/s)\n\n"
                     + _core_table(core, systems))
    if families:
        parts.append(f"## towers, the newer families: HF sdpa vs encgraph defaults ({where})\n\n"
                     + _family_table(families))
    notes = _notes(data)
    return "\n\n".join(parts) + ("\n\n" + notes if notes else "")


def _unmeasured(tower: dict[str, Any], width: int) -> list[list[Any]]:
    """Rows of a tower, or of its cases, that were not measured (skipped, not applicable, failed)."""
    if "cases" not in tower:
        return [[tower["label"], tower.get("skipped", "-")] + ["-"] * (width - 2)]
    return [[tower["label"], name, c["skipped"]] + ["-"] * (width - 3)
            for name, c in tower["cases"].items() if "systems" not in c]


def _family_table(towers: dict[str, Any]) -> str:
    headers = ["tower", "case", "items", "patches", "tokens", "HF eager (sdpa) ms", "encgraph defaults ms",
               "adapter eager ms", "defaults vs HF sdpa", "max rel diff defaults vs HF", "defaults capture s"]
    rows = []
    for tower in towers.values():
        rows += _unmeasured(tower, len(headers))
        capture = (tower.get("defaults_capture") or {}).get("wall_seconds")
        for case_name, c in tower.get("cases", {}).items():
            if "systems" not in c:
                continue
            cells = []
            for s in (System.HF_SDPA, System.DEFAULTS, System.ADAPTER_EAGER):
                entry = c["systems"].get(s.value)
                m = median_of(entry)
                cells.append(m if m is not None else status_of(entry))
            diff = c.get("defaults_vs_hf_sdpa_max_rel_diff")
            rows.append([tower["label"], case_name, c["items"], c["patches"], c["tokens"], *cells,
                         c["speedup"].get("defaults_vs_hf_sdpa"), diff if diff is not None else "-", capture])
    return markdown_table(headers, rows)


def _core_table(towers: dict[str, Any], systems: tuple[System, ...]) -> str:
    headers = ["tower", "case", "items", "patches"] + [s.label + " ms" for s in systems] + [
        "defaults vs HF sdpa", "graph vs HF sdpa", "graph vs adapter eager", "matmul floor ms", "graph / floor"]
    rows = []
    for tower in towers.values():
        rows += _unmeasured(tower, len(headers))
        for case_name, c in tower.get("cases", {}).items():
            if "systems" not in c:
                continue
            cells = []
            for s in systems:
                entry = c["systems"].get(s.value)
                m = median_of(entry)
                cells.append(m if m is not None else status_of(entry))
            graph = median_of(c["systems"].get(System.GRAPH.value))
            rows.append([tower["label"], case_name, c["items"], c["patches"], *cells,
                         c["speedup"].get("defaults_vs_hf_sdpa"), c["speedup"].get("graph_vs_hf_sdpa"),
                         c["speedup"].get("graph_vs_adapter_eager"),
                         c["floor_ms"], ratio(graph, c["floor_ms"])])
    return markdown_table(headers, rows)


def _notes(data: dict[str, Any]) -> str:
    lines = []
    for tower in data.get("towers", {}).values():
        for key, what in (("capture", "graphs"), ("defaults_capture", "defaults (graphed(tower))")):
            cap = tower.get(key)
            if cap and cap.get("graphs"):
                lines.append(f"- {tower['label']}, {what}: {cap['graphs']} graphs captured in {cap['seconds']} s, "
                             f"pool {cap.get('pool_bytes', 0) / 2**20:.0f} MiB")
        gc_cap = tower.get("graph_compile_capture")
        if gc_cap and gc_cap.get("graphs"):
            lines.append(f"- {tower['label']}: graphs of the compiled forward at budgets "
                         f"{[g['budget'] for g in gc_cap.get('per_graph', [])]}: compiled and captured in "
                         f"{gc_cap['wall_seconds']} s")
        for case_name, c in tower.get("cases", {}).items():
            for system, comp in c.get("compile_info", {}).items():
                lines.append(f"- {tower['label']} {case_name}, {System(system).label}: first call "
                             f"{comp['first_call_seconds']} s, {comp['graphs_compiled']} graph(s) compiled for this "
                             f"case ({comp['graphs_compiled_total']} in all), {comp['graph_breaks']} graph breaks")
            if c.get("compared_rows"):
                lines.append(f"- {tower['label']} {case_name}: defaults vs HF compared on {c['compared_rows']}")
            diff = c.get("graph_vs_eager_max_rel_diff")
            if isinstance(diff, (int, float)) and diff > 0.05:
                lines.append(f"- {tower['label']} {case_name}: graph vs adapter eager max relative diff {diff:.3g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
