"""Charts of the host-side results, measured on a CPU: the planner's time per ``pack()`` call (greedy, and against
cost-aware planning), a Qwen-VL call's host overhead against HF's helpers, and ``encgraph serve``'s preprocessing
pool. Each ``*_chart(data, path)`` reads one result JSON."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benches.lib.plots import Chart, Panel, long, spread_of, titled, wide
from benches.lib.results import ratio


def _target(data: Mapping[str, Any], key: str, unit: str) -> tuple[float | None, str]:
    """A target line from the JSON's ``target``: its value and its legend label."""
    target = data.get("target") or {}
    if key not in target:
        return None, ""
    return target[key], f"target: {target[key]:g} {unit} at {target.get('images', target.get('items'))} " + (
        "images" if "images" in target else "items")


def host_overhead_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = data.get("results", [])
    ref, label = _target(data, "host_ms_at_most", "ms")
    columns = {"encgraph: plan + metadata + metadata copy": "host_ms", "HF's own helpers": "hf_helpers_ms"}
    panels = tuple(Panel(f"{shapes} shapes", "median ms per call", log=True, ref=ref, ref_label=label,
                         cells=wide([r for r in rows if r.get("shapes") == shapes],
                                    lambda r: f"{r.get('family')}\n{r.get('images')} img", columns))
                   for shapes in dict.fromkeys(r.get("shapes") for r in rows))
    return Chart(titled("host overhead per Qwen-VL call", data), panels, cols=2, width=13.0)


def planner_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = data.get("results", [])
    ref, label = _target(data, "median_us_at_most", "us")
    return Chart(titled("planner: time per pack() call", data), (
        Panel("median, whisker P10 to P90", "us per call", log=True, ref=ref, ref_label=label, xlabel="items",
              cells=long(rows, "items", "case", "median_us"),
              spread=spread_of(rows, "items", "case", "p10_us", "p90_us")),
    ), width=8.0)


def _case_items(row: Mapping[str, Any]) -> str:
    return f"{row.get('case')}\n{row.get('items')} items"


def planner_cost_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = data.get("results", [])
    ref, label = _target(data, "median_us_at_most", "us (costed)")
    expected = long(rows, _case_items, "planner", "expected_ms")
    return Chart(titled("planner: greedy against cost-aware packing", data), (
        Panel("time per pack() call (whisker: P10 to P90)", "us per call", log=True, ref=ref, ref_label=label,
              cells=long(rows, _case_items, "planner", "median_us"),
              spread=spread_of(rows, _case_items, "planner", "p10_us", "p90_us")),
        Panel("the plan's expected cost (below 1: the costed plan is cheaper)", "expected ms, costed / greedy", ref=1.0,
              cells={g: {"costed / greedy": ratio(by.get("costed"), by.get("greedy"))} for g, by in expected.items()}),
    ), cols=2, width=12.0)


def preprocess_pool_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """Each round's run of each mode (the modes alternate: run k of each mode is round k)."""
    seen: dict[str, int] = {}
    rows = []
    for run in data.get("runs", []):
        seen[run.get("mode")] = seen.get(run.get("mode"), 0) + 1
        rows.append(dict(run, round=f"round {seen[run.get('mode')]}"))
    opts = data.get("options") or {}
    panels = tuple(Panel(title, unit, xlabel="mode", cells=long(rows, "mode", "round", key)) for title, unit, key in (
        ("throughput", "requests/s", "requests_per_s"), ("tail latency", "P99 ms", "p99_ms"),
        ("server CPU", "CPU ms per request", "server_cpu_ms")))
    return Chart(titled(f"preprocessing pool of {opts.get('workers')} workers, {opts.get('slots')} slots, "
                        f"{opts.get('clients')} clients: waiting for a slot against the pipe", data),
                 panels, cols=3, width=13.0)


def preprocess_exactness_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """``benches/preprocess_exactness.py``: per family, the largest difference from the Pillow processor in 8-bit
    steps, and each backend's milliseconds per image, against the image size."""
    fams = data.get("families", {})
    steps = {f: {size: r.get("max_in_8bit_steps") for size, r in f_data.get("sizes", {}).items()}
             for f, f_data in fams.items()}
    times = {f"{f}, {backend}": {size: r.get(f"{key}_ms") for size, r in f_data.get("sizes", {}).items()}
             for f, f_data in fams.items() for backend, key in (("Pillow", "pil"), ("torchvision", "torchvision"))}
    panels = (Panel("largest difference from Pillow", "8-bit steps", xlabel="image", cells=_by_size(steps)),
              Panel("time per image", "ms", xlabel="image", cells=_by_size(times), log=True))
    device = (data.get("environment") or {}).get("device", "?")
    return Chart(titled(f"torchvision image processors (on {device}) against Pillow", data), panels, cols=2,
                 width=13.0)


def _by_size(series: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{series: {size: value}}`` as cells grouped by size."""
    out: dict[str, dict[str, Any]] = {}
    for name, values in series.items():
        for size, value in values.items():
            out.setdefault(size, {})[name] = value
    return out


def wrap_cost_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """``benches/wrap_cost.py``: per tiny tower, the module's and the graphed module's median time per CPU call."""
    rows = data.get("results", [])
    columns = {"the module": "module_us", "graphed(module)": "wrapped_us"}
    panels = tuple(Panel(f"tiny {tower}", "median us per call", xlabel="batch, grad mode",
                         cells=wide([r for r in rows if r.get("tower") == tower],
                                    lambda r: f"{r.get('batch')}, {r.get('grad')}", columns))
                   for tower in dict.fromkeys(r.get("tower") for r in rows))
    return Chart(titled("graphed(module) on the CPU against the module", data), panels, cols=2, width=13.0)


def device_preprocess_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """``benches/device_preprocess.py``: per family, how long a request's device half held its thread (median and
    P99 ms) and images/s, on an idle GPU and behind replays, by thread count."""
    fams = data.get("families", {})
    columns = {"median ms held": "median_ms", "P99 ms held": "p99_ms"}
    panels = []
    for fam, f_data in fams.items():
        runs = f_data.get("runs", [])
        label = lambda r: f"{r.get('load')}, {r.get('threads')} thr"  # noqa: E731
        panels.append(Panel(f"{fam}: thread held (host processor {f_data.get('host_torchvision_ms')} ms)", "ms",
                            xlabel="GPU, threads", cells=wide(runs, label, columns)))
        panels.append(Panel(f"{fam}: throughput", "images/s", xlabel="GPU, threads",
                            cells=wide(runs, label, {"images/s": "images_per_s"})))
    return Chart(titled("device preprocessing per request", data), tuple(panels), cols=2, width=13.0)
