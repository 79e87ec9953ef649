"""Traffic: a seeded trace of requests replayed through each system, request by request, on each tower.

The trace is ``benches.lib.trace.generate_trace(n, seed, kind)`` (its distributions are documented there and stored
in the results): ``--trace chat`` (default) or ``--trace photo`` (1-3 photos of 400-4000 px per request, each tower
at its processor's default ``max_pixels``; issue 32). Towers: Qwen2.5-VL-7B and Qwen3-VL-8B at real geometry
(random bf16 weights; the photo trace adds GLM-4.1V), one after the other in one run, each given an even share
of what is left of ``--time-budget``. Systems (``benches.lib.systems``), by
default ``hf_sdpa`` (the HF tower's own forward), ``defaults`` (``encgraph.graphed(tower)`` with no options),
``hf_compile_dynamic`` (``torch.compile(hf_tower, dynamic=True)``) and ``adapter_eager``; ``--systems`` adds
``graph``, ``graph_compile``, ``hf_varlen`` or ``defaults_varlen`` (the defaults with one packed varlen kernel for
every attention call, eager forwards included: what eager forwards' dense SDPA per long sequence pays).

Per tower, in order:

1. every compile cache (``ENCGRAPH_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) is pointed at a
   fresh empty directory; the tower is built, copied per system, and ``defaults`` is captured: the **cold**
   capture (``graphed(tower).capture()``, seconds timed);
2. the **warm** capture: a second, fresh Python process builds the same tower and calls ``capture()`` with the
   same cache directory (``benches.lib.startup``; killed after ``--warm-capture-timeout``);
3. ``--warmup-requests`` requests of another seed through every system, not recorded (``hf_compile_dynamic``
   compiles here); the outputs of ``defaults``, ``hf_varlen`` and ``hf_compile_dynamic`` on the first of them
   are compared with ``hf_sdpa``'s;
4. the trace: each request is one call of each system (the systems take turns, the first one rotating from
   request to request, so that drift hits all alike), each timed with CUDA events around the call. The trace
   stops at the tower's deadline (recorded). ``--sizes`` says how the calls meet their sizes
   (``benches.lib.trace.SIZES_MODES``): as drawn (the chat trace), each system at sizes no system has run before
   (``new``: the photo trace's top-level results; in one process, a plan a kernel builds for a new shape, as
   cuDNN's attention does in HF's own SDPA, would otherwise serve whichever system came second), or after an
   untimed call of the same request (``seen``: the photo trace's second pass, under ``sizes_passes``).

``hf_compile_dynamic`` runs in a time box of its own (``--compile-dynamic-cap`` seconds per tower, compiles
included): a call that would pass it is cut off (``SIGALRM``) and the system is not run again; its dynamo
counters (graphs compiled, recompiles, graph breaks, compile seconds) are reported for the warm-up and the trace.
When the warm-up latencies say the optional systems (``adapter_eager``, ``hf_varlen``) would not fit the
tower's deadline, they are dropped (recorded), so that the trace itself completes.

Reported per system: mean, P50, P99 latency, speedups against ``hf_sdpa`` and ``adapter_eager``, the worst
per-request ratio and how many requests were slower; with ``--floor`` (default on for the photo trace) each
request's floor (``benches.lib.request_floor``: matrix products, attention and element-wise work at rates measured
in the same process) and each system's mean and worst ratio to it, and to a second floor with the tower's block
products and attention timed at each request's sizes (``benches.lib.shape_floor``); for graph systems the padded
share of replayed tokens and the items that ran eagerly; for ``defaults`` its cold and warm capture, beside issue
13's targets (issue 32's on the photo trace).

JSON (``benches/results/traffic_<gpu>.json``)::

    {"environment", "options", "seconds",
     "towers": {"<tower>": {
        "tower", "baseline", "trace": {"seed", "requests", "completed", "distribution", "summary", "stopped"?},
        "capture": {"<graph system>": {"wall_seconds", ...runner.capture()}}, "planning", "costs"?,
        "startup": {"cold": {"capture_seconds", "cache_bytes", "capture_info"},
                    "warm": {"capture_seconds", "build_seconds", "import_seconds", "process_seconds",
                             "cache_bytes_before", "capture_info"} | {"error"}},
        "compile_dynamic": {"warmup", "trace", "total": {dynamo counters}, "cap_seconds", "used_seconds",
                            "stopped", "calls_that_compiled", "seconds_in_calls_that_compiled"},
        "systems": {"<system>": {"requests", "errors", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms",
                    "speedup_{mean,p50,p99}_vs_<ref>", "worst_ratio_vs_<ref>", "worst_request_vs_<ref>",
                    "slower_than_<ref>", "compared_with_<ref>", "{mean,worst}_ratio_vs_{floor,shape_floor}"?}},
        "graph_stats": {"<graph system>": {"padded_share", "runner_padded_share", "eager_items", "items",
                        "eager_reasons", "replays", "cost_feedback"}},
        "output_check": {"<system>": max relative difference vs hf_sdpa},
        "targets": [{"target", "value", "op", "bound", "met"}],
        "per_request": {"items", "tokens", "latency_ms": {"<system>": [...]},
                        "floor"?: [{"floor_ms", "shape_floor_ms"?, ...}] (at the first system's sizes),
                        "system_floors"? (sizes "new": each system's own copy): {"<system>": {"floor_ms": [...],
                                          "shape_floor_ms"?: [...]}},
                        "routes": {"<graph system>": [{"replays", "eager", "explored"?}]}},
        "floor"?: {"shape", "rates", "shape_rates"? | "shape_error"?},
        "unavailable", "dropped"?, "warmup_mean_ms", "seconds"}}}
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs
import numpy as np

from benches.lib import cli, startup
from benches.lib import traffic_report as report
from benches.lib.compiled import CapExceeded, TimeBox, dynamo_counters
from benches.lib.env import SKIPPED_TIME, Deadline, Env, free_memory, log, short_error
from benches.lib.outputs import max_rel_diff
from benches.lib.request_floor import TowerShape, measure_rates, request_floor
from benches.lib.results import Results
from benches.lib.shape_floor import block_linears, measure_shape_rates, shape_floor
from benches.lib.systems import GRAPH_SYSTEMS, GRAPHED_SYSTEMS, System, TowerBench, parse_systems
from benches.lib.timing import in_fresh_thread
from benches.lib.towers import QWEN_TOWERS, TOWERS
from benches.lib.trace import (
    IMAGE_MAX_TOKENS,
    SIZES_MODES,
    SMOKE_MAX_TOKENS,
    SMOKE_REQUESTS,
    TRACE_KINDS,
    VIDEO_FRAME_MAX_TOKENS,
    Caps,
    distribution,
    generate_trace,
    photo_caps,
    rows_of,
    trace_summary,
)
from benches.lib.traffic_replay import TIME_BOXED, Replay, timed

SCRIPT = "traffic"
DEFAULT_SYSTEMS = (System.HF_SDPA, System.DEFAULTS, System.HF_COMPILE_DYNAMIC, System.ADAPTER_EAGER)
PHOTO_SYSTEMS = (System.HF_SDPA, System.DEFAULTS, System.ADAPTER_EAGER)
PHOTO_TOWERS = ("qwen3_vl_8b", "qwen2_5_vl_7b", "glm4v")
"""The photo trace's towers and systems (issue 32 point 4)."""
PHOTO_SIZES = ("new", "seen")
"""The photo trace's passes (``--sizes``): unique sizes first (its top-level results), then the same requests
again with every size met before."""
REQUESTS = 200
"""Requests per tower: both towers' whole run fits about 6 minutes on an H200 (see benches/README.md)."""
TIME_BUDGET = 330.0
COMPILE_DYNAMIC_CAP = 40.0
SMOKE_COMPILE_DYNAMIC_CAP = 5.0
"""The CPU smoke's box: dynamo alone traces a tiny tower for seconds to tens of seconds on a busy CPU."""
OPTIONAL = (System.ADAPTER_EAGER, System.HF_VARLEN)
"""Systems dropped (last first) when the warm-up says the trace would not fit the tower's deadline."""
CHECKED = (System.DEFAULTS, System.DEFAULTS_VARLEN, System.HF_VARLEN, System.HF_COMPILE_DYNAMIC)
"""Systems with the tower's own output type, whose outputs are compared with ``hf_sdpa``'s on one request."""
MIN_REQUESTS = 50
"""Requests replayed even past the deadline (fewer make no P99)."""


def build_parser() -> Any:
    p = cli.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=TIME_BUDGET)
    p.add_argument("--towers", type=cli.parse_names(TOWERS), default=None,
                   help=f"comma list out of {','.join(TOWERS)} (default {','.join(QWEN_TOWERS)}; tiny with "
                        "--cpu-smoke); each gets an even share of what is left of --time-budget")
    p.add_argument("--tower", choices=tuple(TOWERS), default=None, help="one tower (same as --towers NAME)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests in the trace, per tower (default {REQUESTS}; {SMOKE_REQUESTS} with --cpu-smoke)")
    p.add_argument("--trace", choices=TRACE_KINDS, default="chat",
                   help="the trace: chat (default; benches/lib/trace.py) or photo (1-3 photos of 400-4000 px per "
                        f"request at each processor's default size; towers {','.join(PHOTO_TOWERS)}, systems "
                        f"{','.join(s.value for s in PHOTO_SYSTEMS)}, results tagged 'photo' unless --tag is given)")
    p.add_argument("--systems", type=parse_systems, default=None,
                   help=f"comma list (default {','.join(s.value for s in DEFAULT_SYSTEMS)}; also graph, "
                        "graph_compile, hf_varlen; compile is not offered: it recompiles per shape)")
    p.add_argument("--sizes", type=_sizes_modes, default=None,
                   help=f"comma list of passes over the trace, out of {','.join(SIZES_MODES)} (benches/lib/trace.py "
                        "SIZES_MODES); the first gives the top-level results, each other one its own under "
                        f"'sizes_passes' (default: {','.join(PHOTO_SIZES)} for the photo trace, as-drawn otherwise)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                   help="each request's floor and each system's ratio to it (default: on for the photo trace)")
    p.add_argument("--min-requests", type=int, default=None,
                   help=f"requests per tower replayed even past the deadline (default {MIN_REQUESTS}; 1 with "
                        "--cpu-smoke)")
    p.add_argument("--warmup-requests", type=int, default=8, help="untimed requests first (default 8; 2 with "
                   "--cpu-smoke)")
    p.add_argument("--compile-dynamic-cap", type=float, default=None, metavar="S",
                   help=f"seconds per tower that hf_compile_dynamic may take, compiles included (default "
                        f"{COMPILE_DYNAMIC_CAP:g}; {SMOKE_COMPILE_DYNAMIC_CAP:g} with --cpu-smoke)")
    p.add_argument("--warm-capture", action=argparse.BooleanOptionalAction, default=True,
                   help="measure defaults' warm capture in a second process (default on)")
    p.add_argument("--warm-capture-timeout", type=float, default=startup.WARM_TIMEOUT, metavar="S",
                   help=f"kill the second process after this many seconds (default {startup.WARM_TIMEOUT:g})")
    p.add_argument("--cost-samples", type=int, default=0,
                   help="plan the benchmark's own graph runners (graph, graph_compile) with a measured cost model "
                        "(runner.measure_costs on this many requests of another seed); default 0: their default "
                        "plan. defaults always runs as graphed() makes it")
    p.add_argument("--budgets", type=cli.parse_budgets, default=None,
                   help="the ladder of graph and graph_compile, e.g. 64,448,704,960,1280,1536,2048 (default: the "
                        "runner's); never applied to defaults")
    p.add_argument("--defaults-option", dest="defaults_options", type=_option, action="append", default=None,
                   metavar="NAME=VALUE",
                   help="a runner option for defaults, e.g. max_items=16 (repeatable): an A/B run of one option "
                        "against the committed defaults, recorded under defaults_options and in the table; "
                        "needs --no-warm-capture (the second process builds graphed() bare)")
    p.add_argument("--image-max-tokens", type=int, default=None,
                   help=f"merged tokens per image at most (default {IMAGE_MAX_TOKENS}; {SMOKE_MAX_TOKENS} with "
                        "--cpu-smoke)")
    p.add_argument("--video-frame-max-tokens", type=int, default=None,
                   help=f"merged tokens per video frame pair at most (default {VIDEO_FRAME_MAX_TOKENS}; "
                        f"{SMOKE_MAX_TOKENS} with --cpu-smoke)")
    return p


def _option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` with VALUE a Python literal (``16``, ``False``, ``'auto'``) or else a plain string."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a runner option, e.g. max_items=16), got {text!r}")
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        parsed = value.strip()
    return name.strip(), parsed


def _sizes_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in SIZES_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct names out of {','.join(SIZES_MODES)}, got {text!r}")
    return modes


def resolve_defaults(args: Any) -> Any:
    """Fill the options whose default depends on ``--cpu-smoke`` (the smoke keeps the trace, shrinks its sizes:
    CPU attention is masked SDPA, quadratic in tokens)."""
    smoke = args.cpu_smoke
    photo = args.trace == "photo"
    if args.tower is not None:
        args.towers = (args.tower,)
    if args.towers is None:
        args.towers = PHOTO_TOWERS if photo else QWEN_TOWERS
    if args.systems is None:
        args.systems = PHOTO_SYSTEMS if photo else DEFAULT_SYSTEMS
    if args.floor is None:
        args.floor = photo
    if args.sizes is None:
        args.sizes = PHOTO_SIZES if photo else ("as-drawn",)
    if photo and args.tag is None:
        args.tag = "photo"
    if args.requests is None:
        args.requests = SMOKE_REQUESTS if smoke else REQUESTS
    if args.min_requests is None:
        args.min_requests = 1 if smoke else MIN_REQUESTS
    if smoke:
        args.warmup_requests = min(args.warmup_requests, 2)
    args.defaults_options = dict(args.defaults_options or ())
    if args.defaults_options and args.warm_capture:
        raise SystemExit("--defaults-option: pass --no-warm-capture too (the warm capture's second process builds "
                         "graphed(tower) with no options, so it would not measure the same runner)")
    if args.compile_dynamic_cap is None:
        args.compile_dynamic_cap = SMOKE_COMPILE_DYNAMIC_CAP if smoke else COMPILE_DYNAMIC_CAP
    if args.image_max_tokens is None and not (photo and not smoke):  # photo: each tower's processor cap
        args.image_max_tokens = SMOKE_MAX_TOKENS if smoke else IMAGE_MAX_TOKENS
    if args.video_frame_max_tokens is None:
        args.video_frame_max_tokens = SMOKE_MAX_TOKENS if smoke else VIDEO_FRAME_MAX_TOKENS
    if (args.requests < 1 or args.warmup_requests < 0 or (args.image_max_tokens or 1) < 1
            or args.video_frame_max_tokens < 1):
        raise SystemExit("--requests, --image-max-tokens and --video-frame-max-tokens must be >= 1, "
                         "--warmup-requests >= 0")
    if System.COMPILE in args.systems:
        raise SystemExit("--systems: compile is not offered on traffic (a recompile per request shape)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = resolve_defaults(build_parser().parse_args(argv))
    return cli.run_script(SCRIPT, args, replay_all, report.render)


def replay_all(args: Any, env: Env, deadline: Deadline, results: Results) -> None:
    towers = results.data["towers"] = {}
    for k, name in enumerate(args.towers):
        doc = towers[name] = {}
        missing = TOWERS[name].missing()
        if missing:
            doc.update(tower={"name": name, "label": TOWERS[name].label}, skipped=missing)
            continue
        if deadline.expired(10.0):
            doc.update(tower={"name": name, "label": TOWERS[name].label}, skipped=SKIPPED_TIME)
            continue
        tower_deadline = deadline.share(len(args.towers) - k)
        with startup.cache_env() as cache:
            try:
                replay_tower(name, args, env, tower_deadline, doc, results, cache)
            except Exception as exc:  # keep the other tower's run (and what this one measured)
                traceback.print_exc()
                doc["error"] = short_error(exc)
                free_memory()
        doc["seconds"] = round(tower_deadline.elapsed(), 1)
        doc["targets"] = report.check_targets(name, doc)
        results.flush()
    results.data["seconds"] = round(deadline.elapsed(), 1)


def replay_tower(name: str, args: Any, env: Env, deadline: Deadline, doc: dict[str, Any], results: Results,
                 cache: Path) -> None:
    spec = TOWERS[name]
    log(f"{name}: building")
    bench = TowerBench(spec, env, args.systems, defaults_options=args.defaults_options or None)
    if args.defaults_options:
        doc["defaults_options"] = dict(args.defaults_options)
    if args.budgets is not None:
        bench.graph_budgets = bench.compile_budgets = {"default": args.budgets}
    trace = generate_trace(args.requests, args.seed, args.trace)
    caps = (photo_caps(name, bench.geom) if args.image_max_tokens is None
            else Caps(args.image_max_tokens, args.video_frame_max_tokens))
    baseline = System.HF_SDPA if System.HF_SDPA in args.systems else System.ADAPTER_EAGER
    doc.update(tower={"name": spec.name, "label": spec.label, "params": bench.params}, baseline=baseline.value,
               trace={"seed": args.seed, "kind": args.trace, "requests": len(trace),
                      "distribution": distribution(args.trace), "image_max_tokens": caps.image,
                      "summary": trace_summary(trace, bench.geom, caps)})
    floor = tower_floor(bench, env, doc) if args.floor else None
    if any(s in args.systems for s in (System.GRAPH, System.GRAPH_COMPILE)):
        doc["planning"] = (f"cost-aware ({args.cost_samples} sample requests, seed {args.seed + 2})"
                           if args.cost_samples > 0 else "the runner's default")
    systems = [s for s in args.systems if s not in bench.unavailable]
    doc["unavailable"] = {s.value: why for s, why in bench.unavailable.items() if s in args.systems}
    for s in [s for s in systems if s in GRAPH_SYSTEMS]:
        if not capture(bench, s, args, caps, doc, cache):
            systems.remove(s)
    results.flush()
    if System.DEFAULTS in systems and args.warm_capture:
        log(f"{name}: warm capture in a second process")
        warm = startup.warm_capture(name, env, cache, timeout=max(min(args.warm_capture_timeout, deadline.left()), 1))
        doc["startup"]["warm"] = {**warm, "cache_bytes_before": doc["startup"]["cold"]["cache_bytes"]}
        log(f"{name}: warm capture {warm.get('capture_seconds', warm.get('error'))}")
        results.flush()
    box = TimeBox(args.compile_dynamic_cap) if System.HF_COMPILE_DYNAMIC in systems else None
    start = dynamo_counters()
    warm_ms = warm_up(bench, systems, args, env, caps, box, doc)
    systems = drop_for_time(systems, warm_ms, len(trace), deadline, doc, box)
    seen: set[int] = set()  # patch-row counts any system has run (the warm-up's too): what "new" keeps apart
    for request in generate_trace(args.warmup_requests, args.seed + 1, args.trace):
        seen.update(rows_of(request, bench.geom, caps))
    doc["sizes"] = args.sizes[0]
    for k, mode in enumerate(args.sizes):
        target = doc if k == 0 else doc.setdefault("sizes_passes", {}).setdefault(mode, {})
        log(f"{name}: pass '{mode}'")
        replay = Replay(bench, systems, box, warmed=dynamo_counters(), start=start, floor=floor, sizes=mode,
                        seen=seen)
        replay.run(trace, caps, env, deadline, args.min_requests, target, results)
        if k:
            target["targets"] = report.check_targets(name, report.pass_doc(doc, target))
    bench.close()


def tower_floor(bench: TowerBench, env: Env, doc: dict[str, Any]) -> Any:
    """The per-request floor function of this tower (``benches.lib.request_floor``), its rates measured now;
    ``None`` (recorded) where the tower's config lacks what the floor reads."""
    from encgraph.models.kernel_choice import tower_geometries

    try:
        shape = TowerShape.of(bench.hf.config, bench.params)
        heads, dim = tower_geometries(bench.hf)[0]
        # Timed on threads of their own: the capture after them must find no dense attention plan of theirs.
        rates = in_fresh_thread(lambda: measure_rates(env, heads, dim))
    except Exception as exc:
        traceback.print_exc()
        doc["floor"] = {"error": short_error(exc)}
        return None
    doc["floor"] = {"shape": attrs.asdict(shape), "rates": rates}
    itemsize = env.dtype.itemsize
    try:  # the second floor, at each request's sizes: its failure leaves the first
        linears = block_linears(bench.hf)
        if not linears:
            raise ValueError("the tower has no blocks[0] with nn.Linear layers to time")
        shape_rates = in_fresh_thread(lambda: measure_shape_rates(env, linears, heads, dim))
    except Exception as exc:
        traceback.print_exc()
        doc["floor"]["shape_error"] = short_error(exc)
        return lambda grids: request_floor(shape, grids, rates, itemsize)
    doc["floor"]["shape_rates"] = shape_rates
    block_params = shape.depth * sum(n_in * n_out for n_in, n_out in linears)

    def both(grids: Any) -> dict[str, float]:
        peak = request_floor(shape, grids, rates, itemsize)
        return {**peak, **shape_floor(shape, grids, peak, rates, shape_rates, block_params)}

    return both


def capture(bench: TowerBench, system: System, args: Any, caps: Caps, doc: dict[str, Any], cache: Path) -> bool:
    """Capture one graph system (``defaults``: the cold capture); ``False`` if it failed (recorded)."""
    try:
        if system is System.DEFAULTS:
            bench.defaults()
            info = bench.capture_infos[system]
            doc["startup"] = {"cold": {"capture_seconds": info["wall_seconds"],
                                       "cache_bytes": startup.cache_bytes(cache), "capture_info": info}}
            log(f"{bench.spec.name}: defaults captured (cold) in {info['wall_seconds']} s")
        elif system in GRAPHED_SYSTEMS:  # defaults_varlen: captured as defaults is, not its startup's subject
            bench.defaults(system)
        else:
            runner = bench.runner(system)
            if args.cost_samples > 0:
                samples = [caps.inputs(bench, r, 300_000 + i).adapter
                           for i, r in enumerate(generate_trace(args.cost_samples, args.seed + 2, args.trace))]
                doc.setdefault("costs", {})[system.value] = runner.measure_costs(samples).to_dict()
        doc.setdefault("capture", {})[system.value] = bench.capture_infos.get(system)
    except Exception as exc:
        traceback.print_exc()
        doc["unavailable"][system.value] = f"error: capture failed ({short_error(exc)})"
        return False
    return True


def warm_up(bench: TowerBench, systems: list[System], args: Any, env: Env, caps: Caps, box: TimeBox | None,
            doc: dict[str, Any]) -> dict[str, float]:
    """Run ``--warmup-requests`` requests (seed + 1) through every system; mean latency per system (ms), for the
    time estimate of the trace. The first request also checks outputs against ``hf_sdpa``."""
    warm: dict[str, list[float]] = {s.value: [] for s in systems}
    for index, request in enumerate(generate_trace(args.warmup_requests, args.seed + 1, args.trace)):
        inputs = caps.inputs(bench, request, 200_000 + index)
        for s in systems:
            try:
                warm[s.value].append(timed(bench, s, inputs, env, box))
            except CapExceeded as exc:
                doc.setdefault("errors", {}).setdefault(s.value, []).append(f"warm-up: {exc}")
            except Exception:
                traceback.print_exc()
        if index == 0:
            check_outputs(bench, systems, inputs, box, doc)
    # The first request of each system pays one-time costs (allocator growth, kernel selection): leave it out.
    return {k: float(np.mean(v[1:] if len(v) > 1 else v)) if v else math.nan for k, v in warm.items()}


def check_outputs(bench: TowerBench, systems: list[System], inputs: Any, box: TimeBox | None,
                  doc: dict[str, Any]) -> None:
    """The largest relative difference of each checked system's outputs against ``hf_sdpa``'s, on one request."""
    if System.HF_SDPA not in systems:
        return
    try:
        ref = bench.call(System.HF_SDPA, inputs)()
    except Exception as exc:
        doc["output_check"] = {System.HF_SDPA.value: short_error(exc)}
        return
    for s in (s for s in CHECKED if s in systems):
        try:
            fn = bench.call(s, inputs)
            got = box.run(fn) if s in TIME_BOXED and box is not None else fn()
            doc.setdefault("output_check", {})[s.value] = max_rel_diff([got], [ref])
        except (Exception, CapExceeded) as exc:
            doc.setdefault("output_check", {})[s.value] = short_error(exc)


def drop_for_time(systems: list[System], warm: dict[str, float], requests: int, deadline: Deadline,
                  doc: dict[str, Any], box: TimeBox | None) -> list[System]:
    """Drop optional systems (last first) while the warm-up says the whole trace would not fit the deadline
    (time-boxed systems count with what is left of their box)."""
    kept = list(systems)
    doc["warmup_mean_ms"] = {k: round(v, 3) for k, v in warm.items()}

    def estimate() -> float:
        per_request = sum(warm.get(s.value, 0.0) or 0.0 for s in kept if s not in TIME_BOXED)
        boxed = box.left() if box is not None and any(s in TIME_BOXED for s in kept) else 0.0
        return per_request * requests / 1e3 + max(boxed, 0.0)

    while estimate() > 0.9 * deadline.left():
        optional = [s for s in kept if s in OPTIONAL]
        if not optional:
            break
        dropped = optional[-1]
        kept.remove(dropped)
        doc.setdefault("dropped", {})[dropped.value] = (
            f"dropped: the warm-up predicts {estimate():.0f} s for the trace without it, {deadline.left():.0f} s left")
    return kept


if __name__ == "__main__":
    main()
