"""Traffic: a seeded trace of requests replayed through each system, request by request, on one tower.

The trace (``generate_trace(n, seed)``; tower-agnostic pixel sizes) draws each request independently:

- with probability ``VIDEO_SHARE`` (0.10) one short video: ``VIDEO_FRAMES`` frames (4-16, even, uniform) of a
  size out of ``VIDEO_SIZES`` (uniform); at most ``VIDEO_FRAME_MAX_TOKENS`` (256) merged tokens per frame pair;
- otherwise 1-8 images (``ITEMS_PER_REQUEST``: 1: 40%, 2: 20%, 3: 12%, 4: 9%, 5: 7%, 6: 5%, 7: 4%, 8: 3%), each
  of a kind (``IMAGE_KINDS``: photo 45%, screenshot 25%, document 15%, icon 15%):
  photo: long side log-uniform in 320-2048 px, aspect 4:3, 3:2, 16:9 or 1:1 (uniform), portrait 30%;
  screenshot: a size out of ``SCREENSHOT_SIZES`` (desktop and phone, uniform);
  document: width uniform in 800-1700 px, height = width x 11 / 8.5 (a letter page at 94-200 dpi);
  icon: a square of side uniform in 32-256 px;
  every image at most ``IMAGE_MAX_TOKENS`` (1280) merged tokens (Qwen's ``max_pixels = 1280 x 28 x 28``).

Each request is one call of each system (the systems take turns, the first one rotating from request to request,
so that drift hits all alike); its latency is CUDA events around the call. Reported per system: mean, P50, P99
latency, speedups against the adapter's eager forward, the worst per-request ratio against it and how many
requests were slower; for the graph runners (``graph``, and ``graph_compile``: graphs of the compiled forward, the
whole ladder compiled) the padded share of replayed tokens and the items that ran eagerly. Graph runners plan
greedily (the runner's default) or, with ``--cost-samples N``, with a cost model measured on N requests of
another seed (``runner.measure_costs``).
Warm-up: ``--warmup-requests`` requests of another seed through every system first, not recorded. When the
warm-up latencies say the optional systems (all but graph and adapter_eager) would not fit the time budget, they
are dropped (recorded), so that the trace itself completes.

JSON (``benches/results/traffic_<gpu>.json``)::

    {"environment", "options", "tower", "capture": {"<graph system>": {...}}, "planning", "costs"?,
     "trace": {"seed", "requests", "completed", "distribution": {...}, "summary": {"items", "tokens", ...}},
     "systems": {"<system>": {"requests", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "errors",
                 "speedup_mean_vs_adapter_eager", "speedup_p50_vs_adapter_eager", "speedup_p99_vs_adapter_eager",
                 "worst_ratio_vs_adapter_eager", "worst_request", "slower_than_adapter_eager"}},
     "graph_stats": {"<graph system>": {"padded_share", "runner_padded_share", "eager_items", "items",
                     "eager_reasons", "replays"}},
     "per_request": {"items", "tokens", "latency_ms": {"<system>": [...]}}}
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs
import numpy as np

from benches import common
from benches.common import TOWERS, System, Visual

SCRIPT = "traffic"

# ---------------------------------------------------------------------------------------------------- the trace
ITEMS_PER_REQUEST: dict[int, float] = {1: 0.40, 2: 0.20, 3: 0.12, 4: 0.09, 5: 0.07, 6: 0.05, 7: 0.04, 8: 0.03}
VIDEO_SHARE = 0.10
IMAGE_KINDS: dict[str, float] = {"photo": 0.45, "screenshot": 0.25, "document": 0.15, "icon": 0.15}
PHOTO_LONG_SIDE = (320, 2048)
PHOTO_ASPECTS = (4 / 3, 3 / 2, 16 / 9, 1.0)
PORTRAIT_SHARE = 0.3
SCREENSHOT_SIZES: tuple[tuple[int, int], ...] = (  # (height, width)
    (720, 1280), (1080, 1920), (768, 1366), (900, 1440), (1440, 2560), (844, 390), (2532, 1170),
)
DOCUMENT_WIDTH = (800, 1700)
DOCUMENT_ASPECT = 11 / 8.5
ICON_SIDE = (32, 256)
VIDEO_FRAMES = (4, 6, 8, 10, 12, 14, 16)
VIDEO_SIZES: tuple[tuple[int, int], ...] = ((360, 640), (480, 854), (720, 1280), (640, 360))
IMAGE_MAX_TOKENS = 1280
VIDEO_FRAME_MAX_TOKENS = 256

SMOKE_REQUESTS = 12
SMOKE_MAX_TOKENS = 16

GRAPH_SYSTEMS = (System.GRAPH, System.GRAPH_COMPILE)
"""Systems that replay captured graphs (padding and eager items reported)."""
REQUIRED = (System.GRAPH, System.GRAPH_COMPILE, System.ADAPTER_EAGER)
"""Systems never dropped for time: the ratios the project's targets are about."""
MAX_ERRORS = 3
"""A system that fails on this many requests is dropped from the rest of the replay."""


def distribution() -> dict[str, Any]:
    """The documented distribution, as stored in the results."""
    return {
        "items_per_request": {str(k): v for k, v in ITEMS_PER_REQUEST.items()},
        "video_share": VIDEO_SHARE,
        "image_kinds": IMAGE_KINDS,
        "photo_long_side": PHOTO_LONG_SIDE,
        "photo_aspects": [round(a, 4) for a in PHOTO_ASPECTS],
        "portrait_share": PORTRAIT_SHARE,
        "screenshot_sizes": SCREENSHOT_SIZES,
        "document_width": DOCUMENT_WIDTH,
        "document_aspect": round(DOCUMENT_ASPECT, 4),
        "icon_side": ICON_SIDE,
        "video_frames": VIDEO_FRAMES,
        "video_sizes": VIDEO_SIZES,
        "image_max_tokens": IMAGE_MAX_TOKENS,
        "video_frame_max_tokens": VIDEO_FRAME_MAX_TOKENS,
    }


def expected_items_per_image_request() -> float:
    return sum(n * p for n, p in ITEMS_PER_REQUEST.items())


def _choice(rng: np.random.Generator, weights: dict[Any, float]) -> Any:
    keys = list(weights)
    return keys[int(rng.choice(len(keys), p=np.asarray(list(weights.values())) / sum(weights.values())))]


def _image(rng: np.random.Generator) -> Visual:
    kind = _choice(rng, IMAGE_KINDS)
    if kind == "photo":
        lo, hi = PHOTO_LONG_SIDE
        long_side = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        aspect = PHOTO_ASPECTS[int(rng.integers(len(PHOTO_ASPECTS)))]
        short_side = long_side / aspect
        portrait = rng.random() < PORTRAIT_SHARE
        h, w = (long_side, short_side) if portrait else (short_side, long_side)
        return Visual(round(h), round(w), kind=kind)
    if kind == "screenshot":
        h, w = SCREENSHOT_SIZES[int(rng.integers(len(SCREENSHOT_SIZES)))]
        return Visual(h, w, kind=kind)
    if kind == "document":
        w = int(rng.integers(DOCUMENT_WIDTH[0], DOCUMENT_WIDTH[1] + 1))
        return Visual(round(w * DOCUMENT_ASPECT), w, kind=kind)
    side = int(rng.integers(ICON_SIDE[0], ICON_SIDE[1] + 1))
    return Visual(side, side, kind=kind)


def sample_request(rng: np.random.Generator) -> tuple[Visual, ...]:
    """One request: a short video, or 1-8 images (see the module docstring)."""
    if rng.random() < VIDEO_SHARE:
        frames = VIDEO_FRAMES[int(rng.integers(len(VIDEO_FRAMES)))]
        h, w = VIDEO_SIZES[int(rng.integers(len(VIDEO_SIZES)))]
        return (Visual(h, w, frames=frames, kind="video"),)
    n = _choice(rng, ITEMS_PER_REQUEST)
    return tuple(_image(rng) for _ in range(n))


def generate_trace(n: int, seed: int = 0) -> list[tuple[Visual, ...]]:
    """``n`` requests drawn with ``numpy.random.default_rng(seed)``: the same ``(n, seed)`` gives the same trace,
    and a trace of ``n`` is the first ``n`` requests of any longer one with that seed."""
    rng = np.random.default_rng(seed)
    return [sample_request(rng) for _ in range(n)]


@attrs.frozen
class Caps:
    """Merged tokens at most per image and per video frame pair."""

    image: int = IMAGE_MAX_TOKENS
    frame: int = VIDEO_FRAME_MAX_TOKENS

    def sizes(self, request: Sequence[Visual], geom: common.Geometry) -> common.Sizes:
        return common.sizes_of(request, geom, max_image_tokens=self.image, max_frame_tokens=self.frame)

    def inputs(self, bench: common.TowerBench, request: Sequence[Visual], seed: int) -> common.BenchInputs:
        return bench.inputs(request, max_image_tokens=self.image, max_frame_tokens=self.frame, seed=seed)


def trace_summary(trace: Sequence[tuple[Visual, ...]], geom: common.Geometry, caps: Caps = Caps()) -> dict[str, Any]:
    """Counts of the trace on one tower: items and tokens per request, kinds, videos."""
    sizes = [caps.sizes(r, geom) for r in trace]
    tokens = np.array([s.tokens for s in sizes], dtype=np.float64)
    kinds: dict[str, int] = {}
    for request in trace:
        for v in request:
            kinds[v.kind] = kinds.get(v.kind, 0) + 1
    return {
        "requests": len(trace),
        "items": int(sum(len(r) for r in trace)),
        "items_per_request_mean": round(float(np.mean([len(r) for r in trace])), 3) if trace else 0.0,
        "kinds": kinds,
        "tokens_mean": round(float(tokens.mean()), 1) if trace else 0.0,
        "tokens_p50": round(float(np.percentile(tokens, 50)), 1) if trace else 0.0,
        "tokens_p99": round(float(np.percentile(tokens, 99)), 1) if trace else 0.0,
        "tokens_max": int(tokens.max()) if trace else 0,
    }


# ---------------------------------------------------------------------------------------------------- replay
def _budgets(text: str) -> tuple[int, ...]:
    """``"64,448,2048"`` -> ``(64, 448, 2048)`` (argparse ``type``)."""
    import argparse

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected budgets >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def build_parser() -> Any:
    p = common.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=185.0)
    p.add_argument("--tower", choices=tuple(TOWERS), default="qwen2_5_vl_7b", help="the tower (default qwen2_5_vl_7b)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the trace (default 1000; 12 with --cpu-smoke)")
    p.add_argument("--systems", type=common.parse_systems,
                   default=(System.GRAPH, System.ADAPTER_EAGER, System.HF_VARLEN),
                   help="comma list (default graph,adapter_eager,hf_varlen; compile is not offered: it recompiles "
                        "per shape)")
    p.add_argument("--warmup-requests", type=int, default=8, help="untimed requests first (default 8; 2 with "
                   "--cpu-smoke)")
    p.add_argument("--cost-samples", type=int, default=0,
                   help="plan the graph systems with a measured cost model (runner.measure_costs on this many "
                        "requests of another seed, so the planner sends a batch eagerly where that is cheaper); "
                        "default 0: the runner's default greedy plan")
    p.add_argument("--budgets", type=_budgets, default=None,
                   help="the graph runners' ladder, e.g. 64,448,704,960,1280,1536,2048 (a ladder from "
                        "encgraph tune / tune_ladder; default: the adapter's)")
    p.add_argument("--image-max-tokens", type=int, default=None,
                   help=f"merged tokens per image at most (default {IMAGE_MAX_TOKENS}; {SMOKE_MAX_TOKENS} with --cpu-smoke)")
    p.add_argument("--video-frame-max-tokens", type=int, default=None,
                   help=f"merged tokens per video frame pair at most (default {VIDEO_FRAME_MAX_TOKENS}; "
                        f"{SMOKE_MAX_TOKENS} with --cpu-smoke)")
    return p


def resolve_defaults(args: Any) -> Any:
    """Fill the options whose default depends on ``--cpu-smoke`` (the smoke keeps the trace, shrinks its sizes:
    CPU attention is masked SDPA, quadratic in tokens)."""
    smoke = args.cpu_smoke
    if args.requests is None:
        args.requests = SMOKE_REQUESTS if smoke else 1000
    if smoke:
        args.warmup_requests = min(args.warmup_requests, 2)
    if args.image_max_tokens is None:
        args.image_max_tokens = SMOKE_MAX_TOKENS if smoke else IMAGE_MAX_TOKENS
    if args.video_frame_max_tokens is None:
        args.video_frame_max_tokens = SMOKE_MAX_TOKENS if smoke else VIDEO_FRAME_MAX_TOKENS
    if args.requests < 1 or args.warmup_requests < 0 or args.image_max_tokens < 1 or args.video_frame_max_tokens < 1:
        raise SystemExit("--requests, --image-max-tokens and --video-frame-max-tokens must be >= 1, "
                         "--warmup-requests >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if System.COMPILE in args.systems:
        raise SystemExit("--systems: compile is not offered on traffic (a recompile per request shape)")
    resolve_defaults(args)
    return common.run_script(SCRIPT, args, replay, render)


def _order(systems: Sequence[System], index: int) -> list[System]:
    k = index % len(systems)
    return list(systems[k:]) + list(systems[:k])


def replay(args: Any, env: common.Env, deadline: common.Deadline, results: common.Results) -> None:
    data = results.data
    spec = TOWERS[args.tower]
    common.log(f"{args.tower}: building")
    bench = common.TowerBench(spec, env, args.systems)
    if args.budgets is not None:
        bench.graph_budgets = bench.compile_budgets = {"default": args.budgets}
    trace = generate_trace(args.requests, args.seed)
    caps = Caps(args.image_max_tokens, args.video_frame_max_tokens)
    data["tower"] = {"name": spec.name, "label": spec.label, "params": bench.params}
    data["trace"] = {"seed": args.seed, "requests": len(trace), "distribution": distribution(),
                     "summary": trace_summary(trace, bench.geom, caps)}
    systems = [s for s in args.systems if s not in bench.unavailable]
    data["unavailable"] = {s.value: why for s, why in bench.unavailable.items() if s in args.systems}
    for s in [s for s in systems if s in GRAPH_SYSTEMS]:
        try:
            runner = bench.runner(s)
            data.setdefault("capture", {})[s.value] = (
                bench.capture_info if s is System.GRAPH else bench.compile_capture_info)
            if args.cost_samples > 0:
                samples = [caps.inputs(bench, r, 300_000 + i).adapter
                           for i, r in enumerate(generate_trace(args.cost_samples, args.seed + 2))]
                data.setdefault("costs", {})[s.value] = runner.measure_costs(samples).to_dict()
        except Exception as exc:
            traceback.print_exc()
            data["unavailable"][s.value] = f"error: capture failed ({common.short_error(exc)})"
            systems.remove(s)
    data["planning"] = (f"cost-aware ({args.cost_samples} sample requests, seed {args.seed + 2})"
                        if args.cost_samples > 0 else "greedy (the runner's default)")
    results.flush()
    if not systems:
        return
    warm = warm_up(bench, systems, args, env, caps)
    systems = drop_for_time(systems, warm, len(trace), deadline, data)
    latencies: dict[System, list[float]] = {s: [] for s in systems}
    errors: dict[System, int] = {s: 0 for s in systems}
    per_request: dict[str, Any] = {"items": [], "tokens": []}
    for s in systems:
        if s in (*GRAPH_SYSTEMS, System.ADAPTER_EAGER):
            bench.runner(s).reset_stats()
    completed = 0
    for index, request in enumerate(trace):
        if deadline.expired():
            data["trace"]["stopped"] = common.SKIPPED_TIME
            break
        inputs = caps.inputs(bench, request, 100_000 + index)
        for s in _order(systems, index):
            if errors[s] >= MAX_ERRORS:
                latencies[s].append(math.nan)
                continue
            try:
                latencies[s].append(common.time_once(bench.call(s, inputs), env))
            except Exception as exc:
                errors[s] += 1
                latencies[s].append(math.nan)
                data.setdefault("errors", {}).setdefault(s.value, []).append(f"request {index}: {common.short_error(exc)}")
                common.free_memory()
        per_request["items"].append(inputs.sizes.items)
        per_request["tokens"].append(inputs.sizes.tokens)
        completed += 1
        del inputs
        if completed % 100 == 0:
            common.log(f"{completed}/{len(trace)} requests")
    data["trace"]["completed"] = completed
    per_request["latency_ms"] = {s.value: [round(x, 4) if math.isfinite(x) else None for x in v]
                                 for s, v in latencies.items()}
    data["per_request"] = per_request
    data["systems"] = summarize(latencies, errors)
    for s in (s for s in systems if s in GRAPH_SYSTEMS):
        data.setdefault("graph_stats", {})[s.value] = graph_stats(bench.runner(s).stats)
    data["seconds"] = round(deadline.elapsed(), 1)
    bench.close()


def warm_up(bench: common.TowerBench, systems: list[System], args: Any, env: common.Env,
            caps: Caps) -> dict[str, float]:
    """Run ``--warmup-requests`` requests (seed + 1) through every system; mean latency per system (ms), for the
    time estimate of the trace."""
    warm: dict[str, list[float]] = {s.value: [] for s in systems}
    for index, request in enumerate(generate_trace(args.warmup_requests, args.seed + 1)):
        inputs = caps.inputs(bench, request, 200_000 + index)
        for s in systems:
            try:
                warm[s.value].append(common.time_once(bench.call(s, inputs), env))
            except Exception:
                traceback.print_exc()
    # The first request of each system pays one-time costs (allocator growth, kernel selection): leave it out.
    return {k: float(np.mean(v[1:] if len(v) > 1 else v)) if v else math.nan for k, v in warm.items()}


def drop_for_time(systems: list[System], warm: dict[str, float], requests: int, deadline: common.Deadline,
                  data: dict[str, Any]) -> list[System]:
    """Drop optional systems (last first) while the warm-up says the whole trace would not fit the budget."""
    kept = list(systems)
    data["warmup_mean_ms"] = {k: round(v, 3) for k, v in warm.items()}

    def estimate() -> float:
        return sum(warm.get(s.value, 0.0) or 0.0 for s in kept) * requests / 1e3

    while estimate() > 0.9 * deadline.left():
        optional = [s for s in kept if s not in REQUIRED]
        if not optional:
            break
        dropped = optional[-1]
        kept.remove(dropped)
        data.setdefault("dropped", {})[dropped.value] = (
            f"dropped: the warm-up predicts {estimate():.0f} s for the trace without it, {deadline.left():.0f} s left")
    return kept


def summarize(latencies: dict[System, list[float]], errors: dict[System, int]) -> dict[str, Any]:
    base = np.asarray(latencies.get(System.ADAPTER_EAGER, []), dtype=np.float64)
    out = {}
    for s, values in latencies.items():
        lat = np.asarray(values, dtype=np.float64)
        ok = lat[np.isfinite(lat)]
        entry: dict[str, Any] = {"requests": int(ok.size), "errors": errors[s]}
        if ok.size:
            entry.update({
                "mean_ms": round(float(ok.mean()), 4),
                "p50_ms": round(float(np.percentile(ok, 50)), 4),
                "p90_ms": round(float(np.percentile(ok, 90)), 4),
                "p99_ms": round(float(np.percentile(ok, 99)), 4),
                "max_ms": round(float(ok.max()), 4),
            })
        if base.size and s is not System.ADAPTER_EAGER and ok.size:
            both = np.isfinite(lat) & np.isfinite(base)
            if both.any():
                b, x = base[both], lat[both]
                ratios = x / b
                worst = int(np.flatnonzero(both)[int(np.argmax(ratios))])
                entry.update({
                    "speedup_mean_vs_adapter_eager": round(float(b.mean() / x.mean()), 3),
                    "speedup_p50_vs_adapter_eager": round(float(np.percentile(b, 50) / np.percentile(x, 50)), 3),
                    "speedup_p99_vs_adapter_eager": round(float(np.percentile(b, 99) / np.percentile(x, 99)), 3),
                    "worst_ratio_vs_adapter_eager": round(float(ratios.max()), 3),
                    "worst_request": worst,
                    "slower_than_adapter_eager": int((ratios > 1.0).sum()),
                })
        out[s.value] = entry
    return out


def graph_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Padding and eager fallbacks of the graph runner over the replayed trace. ``padded_share`` counts padded
    rows over all replayed rows (budget x replays); the runner's own share also counts eager tokens as real."""
    paths = stats["paths"]
    padded = sum(p["padded_tokens"] for p in paths.values())
    replayed = sum(int(b) * n for p in paths.values() for b, n in p["replays"].items())
    return {
        "padded_share": round(padded / replayed, 4) if replayed else 0.0,
        "runner_padded_share": {k: round(p["padded_share"], 4) for k, p in paths.items()},
        "items": stats["items"],
        "eager_items": stats["eager_items"],
        "eager_reasons": stats["eager_reasons"],
        "replays": {k: p["replays"] for k, p in paths.items()},
    }


def render(data: dict[str, Any]) -> str:
    headers = ["system", "requests", "errors", "mean ms", "P50 ms", "P99 ms", "mean speedup vs adapter eager",
               "P99 speedup vs adapter eager", "worst request ratio vs adapter eager", "requests slower than eager",
               "padded share", "eager items"]
    rows = []
    all_stats = data.get("graph_stats", {})
    if "padded_share" in all_stats:  # results of before graph_compile was offered: one graph system
        all_stats = {System.GRAPH.value: all_stats}
    for name, e in data.get("systems", {}).items():
        gs = all_stats.get(name, {})
        graph = name in all_stats
        rows.append([System(name).label, e["requests"], e["errors"], e.get("mean_ms"), e.get("p50_ms"), e.get("p99_ms"),
                     e.get("speedup_mean_vs_adapter_eager"), e.get("speedup_p99_vs_adapter_eager"),
                     e.get("worst_ratio_vs_adapter_eager"), e.get("slower_than_adapter_eager"),
                     gs.get("padded_share") if graph else None,
                     f"{gs.get('eager_items')} of {gs.get('items')}" if graph and gs else None])
    trace = data.get("trace", {})
    summary = trace.get("summary", {})
    env = data["environment"]
    title = (f"## traffic: {data.get('tower', {}).get('label')}, {trace.get('completed', 0)} of "
             f"{trace.get('requests', 0)} requests, seed {trace.get('seed')} ({env['gpu']}, {env['dtype']})\n\n"
             f"trace: {summary.get('items_per_request_mean')} items per request, tokens per request mean "
             f"{summary.get('tokens_mean')}, P50 {summary.get('tokens_p50')}, P99 {summary.get('tokens_p99')}\n\n")
    notes = [f"- {k}: {v}" for k, v in {**data.get("unavailable", {}), **data.get("dropped", {})}.items()]
    if trace.get("stopped"):
        notes.append(f"- trace stopped early: {trace['stopped']}")
    return title + common.markdown_table(headers, rows) + ("\n\n" + "\n".join(notes) if notes else "")


if __name__ == "__main__":
    main()
