"""Where a forward's device time goes: kernels of one call, by category, against its wall latency.

For each case (``benches.lib.cases``) and system (``graph``, ``graph_compile``, ``adapter_eager`` by default) of one
tower: the median latency of ``--runs`` calls (CUDA events, as ``towers.py``), then ``--profile-calls`` calls under
``torch.profiler`` (CPU and CUDA activity). The Chrome trace's kernel, memcpy and memset records are summed per
call and sorted into categories by kernel name (:data:`CATEGORIES`, first match wins): what the matmuls,
attention, fused (Triton) kernels, unfused element-wise and normalisation kernels, copies and the patch
convolution cost. The gap between wall latency and summed kernel time is the time the GPU waited (launch gaps in
eager; around a graph replay, host work: planning, copy-in; inside it, the waits between the graph's own kernels).
Kernels of graph replays are seen by the profiler like any other (CUPTI records them), and the CUDA runtime's
``cudaGraphLaunch`` calls in the same trace tell them apart (:func:`replay_split`): the waits inside replays are
reported on their own.

JSON (``benches/results/kernel_profile_<gpu>.json``)::

    {"environment", "options", "tower",
     "cases": {"<case>": {"patches", "tokens", "floor_ms",
               "systems": {"<system>": {"median_ms", "kernel_ms", "idle_ms", "kernels",
                                        "categories": {"<category>": {"ms", "kernels"}},
                                        "top": [{"name", "ms", "calls"}],
                                        "replay" (graph systems): {"replays", "replay_span_ms", "replay_kernel_ms",
                                                                   "replay_gap_ms", "outside_kernel_ms"}}
                                       | {"skipped"|"error": why}},
               "patch_embed": {"rows", "conv_ms", "linear_ms", "max_abs_diff"} (packed towers)}}}
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.cases import ALL_CASES, CASE_NAMES
from benches.lib.cli import base_parser, parse_names, run_script
from benches.lib.env import Deadline, Env, SKIPPED_TIME, log, short_error
from benches.lib.results import Results, markdown_table, status_of
from benches.lib.systems import System, TowerBench, parse_systems
from benches.lib.timing import floor_ms, matmul_rate, time_call
from benches.lib.towers import TOWERS, TowerKind

SCRIPT = "kernel_profile"
DEFAULT_CASES = ("1x224", "4x224", "8x336", "1x896")
DEFAULT_SYSTEMS = (System.GRAPH, System.GRAPH_COMPILE, System.ADAPTER_EAGER)
TOP_KERNELS = 12

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Attention first: cuDNN's SDPA kernels are named like its convolutions ("cudnn_generated_..._sdpa_..._fprop").
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa", re.IGNORECASE)),
    ("convolution", re.compile(r"conv|cudnn|implicit_gemm|fprop|wgrad|dgrad", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|ampere_|cublas|splitK|Kernel2", re.IGNORECASE)),
    ("fused (triton)", re.compile(r"^triton_|triton", re.IGNORECASE)),
    ("copy / cast", re.compile(r"copy|memcpy|memset|cat_|CatArray|to_copy", re.IGNORECASE)),
    ("reduction / norm", re.compile(r"reduce|norm|softmax|mean", re.IGNORECASE)),
    ("index / gather", re.compile(r"index|gather|scatter|sort|searchsorted", re.IGNORECASE)),
    ("element-wise", re.compile(r"elementwise|vectorized|unrolled|pointwise|silu|gelu|mul|add", re.IGNORECASE)),
)
OTHER = "other"


def category(name: str) -> str:
    """The category of a kernel name (first pattern of :data:`CATEGORIES` that matches, else ``"other"``)."""
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return OTHER


def device_records(trace: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every kernel, memcpy and memset record of a Chrome trace."""
    out = []
    for event in trace.get("traceEvents", ()):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((str(event.get("name", "?")), float(event.get("dur", 0.0))))
    return out


def replay_split(trace: Mapping[str, Any], calls: int) -> dict[str, Any] | None:
    """Where a graph system's device time goes between and around its replays, per call, from a Chrome trace that
    holds the CUDA runtime's calls: the device records a ``cudaGraphLaunch`` started (same ``correlation``) are the
    replay's; per launch, their span from the first start to the last end (``replay_span_ms``), the sum of their
    durations (``replay_kernel_ms``) and the difference, the GPU's waits between the graph's own kernels
    (``replay_gap_ms``); the other records' durations (``outside_kernel_ms``: copies in and out, eager work).
    ``None`` where the trace has no graph launch (an eager system, or a trace without runtime calls)."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X"]
    launches = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in str(e.get("name", ""))}
    launches.discard(None)
    if not launches:
        return None
    spans: dict[Any, list[float]] = {}
    outside = 0.0
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        key = e.get("args", {}).get("correlation")
        if key not in launches:
            outside += dur
            continue
        span = spans.setdefault(key, [start, start + dur, 0.0])
        span[0], span[1], span[2] = min(span[0], start), max(span[1], start + dur), span[2] + dur
    width = sum(b - a for a, b, _ in spans.values())
    busy = sum(k for _, _, k in spans.values())
    return {"replays": round(len(spans) / calls, 2), "replay_span_ms": round(width / 1e3 / calls, 4),
            "replay_kernel_ms": round(busy / 1e3 / calls, 4), "replay_gap_ms": round((width - busy) / 1e3 / calls, 4),
            "outside_kernel_ms": round(outside / 1e3 / calls, 4)}


def summarize(records: Sequence[tuple[str, float]], calls: int, median_ms: float) -> dict[str, Any]:
    """Per-call sums of ``records`` (from ``calls`` profiled calls) by category, and the top kernels."""
    per_cat: dict[str, list[float]] = {}
    per_name: dict[str, list[float]] = {}
    for name, us in records:
        c = per_cat.setdefault(category(name), [0.0, 0])
        c[0] += us
        c[1] += 1
        n = per_name.setdefault(name, [0.0, 0])
        n[0] += us
        n[1] += 1
    kernel_ms = sum(us for _, us in records) / 1e3 / calls
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "median_ms": round(median_ms, 4),
        "kernel_ms": round(kernel_ms, 4),
        "idle_ms": round(max(median_ms - kernel_ms, 0.0), 4),
        "kernels": round(len(records) / calls, 1),
        "categories": {
            label: {"ms": round(ms / 1e3 / calls, 4), "kernels": round(n / calls, 1)}
            for label, (ms, n) in sorted(per_cat.items(), key=lambda kv: -kv[1][0])
        },
        "top": [{"name": name[:160], "ms": round(ms / 1e3 / calls, 4), "calls": round(n / calls, 1)}
                for name, (ms, n) in top],
    }


def profile_call(fn: Any, env: Env, calls: int) -> dict[str, Any]:
    """The Chrome trace of ``calls`` calls of ``fn`` (after one untimed call), from ``torch.profiler``: device
    records (:func:`device_records`) and the CUDA runtime's calls (:func:`replay_split` links replays to them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(env.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(env.device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text())
    finally:
        os.unlink(path)


def patch_embed_ab(patch_embed: Any, pixels: Any, env: Env) -> dict[str, Any]:
    """The tower's patch embedding (a ``Conv3d`` whose stride is its kernel) against the same weights as one
    ``F.linear`` on the flattened patch rows: median ms of each and the largest difference of their outputs."""
    import torch.nn.functional as F

    proj = patch_embed.proj
    weight = proj.weight.reshape(proj.weight.shape[0], -1)

    def linear() -> Any:
        return F.linear(pixels.to(weight.dtype), weight, proj.bias)

    def conv() -> Any:  # the class's forward: the adapter's layout may have replaced the instance's
        return type(patch_embed).forward(patch_embed, pixels)

    conv_t = time_call(conv, env)
    lin = time_call(linear, env)
    diff = (conv().float() - linear().float()).abs().max().item()
    return {"conv_ms": round(conv_t.median, 4), "linear_ms": round(lin.median, 4), "max_abs_diff": diff,
            "rows": int(pixels.shape[0])}


def build_parser() -> Any:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=180.0)
    p.add_argument("--tower", choices=tuple(TOWERS), default="qwen2_5_vl_7b", help="the tower (default qwen2_5_vl_7b)")
    p.add_argument("--cases", type=parse_names(CASE_NAMES), default=DEFAULT_CASES,
                   help=f"comma list (default {','.join(DEFAULT_CASES)})")
    p.add_argument("--systems", type=parse_systems, default=DEFAULT_SYSTEMS,
                   help="comma list (default graph,graph_compile,adapter_eager; hf_sdpa and hf_varlen too)")
    p.add_argument("--profile-calls", type=int, default=5, help="calls under the profiler per measurement (default 5)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.cpu_smoke:
        raise SystemExit("kernel_profile.py reads CUDA kernel records; it has no CPU smoke (run it on a GPU)")
    if System.COMPILE in args.systems:
        raise SystemExit("--systems: compile is not offered (a recompile per shape); graph_compile is")
    return run_script(SCRIPT, args, run, render)


def run(args: Any, env: Env, deadline: Deadline, results: Results) -> None:
    import torch

    data = results.data
    spec = TOWERS[args.tower]
    bench = TowerBench(spec, env, args.systems)
    data["tower"] = {"name": spec.name, "label": spec.label, "params": bench.params}
    rate = matmul_rate(env)
    data["matmul"] = rate
    cases = [c for c in ALL_CASES if c.name in args.cases]
    inputs = {c.name: bench.inputs(c.visuals, seed=i) for i, c in enumerate(cases)}
    if System.GRAPH_COMPILE in args.systems:
        bench.compile_budgets = bench.plan_budgets(inputs.values())
    out: dict[str, Any] = data.setdefault("cases", {})
    for case in cases:
        x = inputs[case.name]
        entry = out.setdefault(case.name, {
            "patches": x.sizes.patches, "tokens": x.sizes.tokens,
            "floor_ms": round(floor_ms(bench.params, x.sizes.patches, rate["tflops"]), 4),
            "systems": {},
        })
        if spec.kind is TowerKind.PACKED and "patch_embed" not in entry and bench.enc is not None:
            entry["patch_embed"] = patch_embed_ab(bench.enc.patch_embed, x.hf_args[0], env)
            results.flush()
        for system in args.systems:
            if deadline.expired():
                entry["systems"][system.value] = {"skipped": SKIPPED_TIME}
                continue
            log(f"{case.name} {system.value}")
            try:
                fn = bench.call(system, x)
                timing = time_call(fn, env)
                trace = profile_call(fn, env, args.profile_calls)
                summary = summarize(device_records(trace), args.profile_calls, timing.median)
                split = replay_split(trace, args.profile_calls)
                if split is not None:
                    summary["replay"] = split
                entry["systems"][system.value] = summary
            except Exception as exc:
                traceback.print_exc()
                entry["systems"][system.value] = {"error": short_error(exc)}
                torch.cuda.synchronize(env.device)
            results.flush()
    bench.close()


def _rows(data: Mapping[str, Any]) -> Iterable[list[Any]]:
    for case, entry in data.get("cases", {}).items():
        for system, s in entry["systems"].items():
            if "median_ms" not in s:
                yield [case, system, status_of(s)] + ["-"] * 6
                continue
            cats = s["categories"]
            largest = ", ".join(f"{k} {v['ms']:.2f}" for k, v in list(cats.items())[:4])
            gaps = s["replay"]["replay_gap_ms"] if "replay" in s else "-"
            yield [case, system, s["median_ms"], s["kernel_ms"], s["idle_ms"], gaps, s["kernels"], largest,
                   round(s["median_ms"] / entry["floor_ms"], 2) if entry["floor_ms"] else None]


def render(data: Mapping[str, Any]) -> str:
    tower = data.get("tower", {}).get("label", "?")
    gpu = data.get("environment", {}).get("gpu", "?")
    lines = [f"## profile: {tower}, device time per call by kernel category ({gpu})", ""]
    lines.append(markdown_table(
        ["case", "system", "median ms", "kernel ms", "GPU idle ms", "of which between a replay's kernels ms", "kernels",
         "largest categories (ms)", "x floor"], _rows(data)))
    embeds = [[case, e["patch_embed"]["rows"], e["patch_embed"]["conv_ms"], e["patch_embed"]["linear_ms"],
               e["patch_embed"]["max_abs_diff"]] for case, e in data.get("cases", {}).items() if "patch_embed" in e]
    if embeds:
        lines += ["", "### patch embedding: the tower's Conv3d against one F.linear of the same weights", ""]
        lines.append(markdown_table(["case", "rows", "Conv3d ms", "F.linear ms", "max abs diff"], embeds))
    for case, entry in data.get("cases", {}).items():
        for system, s in entry["systems"].items():
            if "top" in s:
                lines += ["", f"### {case} / {system}: top kernels", ""]
                lines.append(markdown_table(
                    ["kernel", "category", "ms per call", "launches per call"],
                    ([k["name"][:90], category(k["name"]), k["ms"], k["calls"]] for k in s["top"])))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
