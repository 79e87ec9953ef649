"""Charts of the whole-tower results: fixed cases (``towers``, the families' runs), their matmul floor (``floor``),
the traffic traces' CDFs (``traffic``), serving (``serving``), data parallel, planning and Step-3.7's shim. Each
``*_chart(data, path)`` reads one result JSON (``path`` names it; ``floor`` also reads ``towers_*`` beside it)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benches.lib.plots import Cells, Chart, Kind, Panel, long, missing, num, spread_of, titled, wide
from benches.lib.results import median_of, ratio
from benches.lib.serving_towers import SYSTEMS as SERVING_SYSTEMS
from benches.lib.serving_towers import TOWERS as SERVING_TOWERS
from benches.lib.systems import System
from benches.lib.traffic_report import baseline_of, tower_docs

BASELINE = System.HF_SDPA
BAR_SYSTEMS = (System.HF_VARLEN, System.ADAPTER_EAGER, System.DEFAULTS, System.GRAPH, System.COMPILE,
               System.GRAPH_COMPILE)
Lines = dict[str, tuple[np.ndarray, np.ndarray]]


# --- towers: fixed cases ----------------------------------------------------------------------------------------


def _measured(data: Mapping[str, Any]) -> list[System]:
    """The systems of a towers JSON in the table's order: those its options name, else those its cases hold."""
    names = set((data.get("options") or {}).get("systems") or
                [s for t in data.get("towers", {}).values() for c in t.get("cases", {}).values()
                 for s in c.get("systems", {})])
    return [s for s in System if s.value in names]


def _why(tower: Mapping[str, Any], case: Mapping[str, Any], system: System) -> str:
    entry = case.get("systems", {}).get(system.value) or {}
    return str((tower.get("unavailable") or {}).get(system.value) or entry.get("skipped") or entry.get("error")
               or case.get("skipped") or tower.get("skipped") or "not in this run")


def _gaps(data: Mapping[str, Any], systems: Iterable[System]) -> str:
    """The note on the towers' unmeasured cells: per system and reason, the towers it concerns."""
    where: dict[str, dict[str, None]] = {}  # reason -> the towers, in order
    for tower in data.get("towers", {}).values():
        for case in (tower.get("cases") or {"-": {}}).values():  # a tower skipped whole has no cases
            for s in systems:
                if median_of(case.get("systems", {}).get(s.value)) is None:
                    where.setdefault(f"{s.value}: {_why(tower, case, s)}", {})[tower.get("label", "?")] = None
    return missing({k: ", ".join(v) for k, v in where.items()}, width=200)


def speedups(towers: Mapping[str, Any]) -> dict[str, Cells]:
    """``{tower label: {case: {system label: median(hf_sdpa) / median(system)}}}`` from a towers JSON, ``None``
    where either was not measured."""
    out: dict[str, Cells] = {}
    systems = [s for s in BAR_SYSTEMS if s in _measured(towers)]
    for tower in towers.get("towers", {}).values():
        cases: Cells = {}
        for case, c in tower.get("cases", {}).items():
            base = median_of(c.get("systems", {}).get(BASELINE.value))
            cases[case] = {s.label: ratio(base, median_of(c.get("systems", {}).get(s.value))) for s in systems}
        if cases:
            out[tower.get("label", "?")] = cases
    return out


def towers_chart(data: Mapping[str, Any], path: Path) -> Chart:
    # log: 0.5x-50x, equal ratios at equal heights; bars from 1: up when faster than HF, down when slower
    panels = tuple(Panel(label, f"speedup vs {BASELINE.label}", cells=cases, log=True, ref=1.0, base=1.0)
                   for label, cases in speedups(data).items())
    systems = [BASELINE, *(s for s in BAR_SYSTEMS if s in _measured(data))]  # no baseline: no ratio either
    return Chart(titled("median latency speedup per case", data), panels, note=_gaps(data, systems), cols=2,
                 width=13.0)


def families_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """The families' runs: per case, each tower's median ms per system (few cases, many towers)."""
    systems = _measured(data)
    by_case: dict[str, Cells] = {}
    for tower in data.get("towers", {}).values():
        for case, c in tower.get("cases", {}).items():
            by_case.setdefault(case, {})[tower.get("label", "?")] = {
                s.label: median_of(c.get("systems", {}).get(s.value)) for s in systems}
    panels = tuple(Panel(f"case {case}", "median ms per call", cells=cells, log=True)
                   for case, cells in by_case.items())
    towers = len(data.get("towers", {}))
    return Chart(titled("newer tower families: median latency per call", data), panels,
                 note=_gaps(data, systems), width=min(12.0, 4.0 + 1.2 * towers))


# --- floor: the matmul floor against what the towers measured ------------------------------------------------


def floor_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """Per tower and case the matmul floor, and the medians that ``towers_<slug>.json`` beside it measured."""
    towers_path = path.with_name("towers_" + path.stem.split("_", 1)[-1] + ".json")
    measured = json.loads(towers_path.read_text()) if towers_path.exists() and "_" in path.stem else {}
    towers = measured.get("towers", {})
    shown = [s for s in (System.HF_SDPA, System.DEFAULTS, System.GRAPH, System.GRAPH_COMPILE)
             if s in _measured(measured)]
    panels = []
    for name, tower in data.get("towers", {}).items():
        cases = (towers.get(name) or {}).get("cases", {})
        cells = {case: {"matmul floor": num(c.get("floor_ms")),
                        **{s.label: median_of(cases.get(case, {}).get("systems", {}).get(s.value)) for s in shown}}
                 for case, c in tower.get("cases", {}).items()}
        panels.append(Panel(tower.get("label", name), "ms per call", cells=cells, log=True))
    tflops = (data.get("matmul") or {}).get("tflops")
    note = (f"floor: the tower's matmul FLOPs at the measured {tflops} TFLOP/s; measured medians from "
            f"{towers_path.name}. {_gaps(measured, shown)}" if towers else
            f"no {towers_path.name} beside it: the floor alone")
    return Chart(titled("matmul floor against measured latency", data), tuple(panels), note=note, cols=2)


# --- traffic: latency CDFs ----------------------------------------------------------------------------------------


def cdfs(doc: Mapping[str, Any]) -> Lines:
    """Per system: sorted request latencies (ms) and their cumulative shares, from one tower's traffic document."""
    out = {}
    for name, values in doc.get("per_request", {}).get("latency_ms", {}).items():
        x = np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64))
        if x.size:
            out[name] = (x, np.arange(1, x.size + 1) / x.size)
    return out


def ratio_cdfs(doc: Mapping[str, Any]) -> Lines:
    """Per system but the tower's baseline: sorted per-request ratios system / baseline, and their shares."""
    lat = doc.get("per_request", {}).get("latency_ms", {})
    base = lat.get(baseline_of(doc))
    out = {}
    if not base:
        return out
    for name, values in lat.items():
        if name == baseline_of(doc):
            continue
        r = np.sort(np.asarray([a / b for a, b in zip(values, base) if a is not None and b], dtype=np.float64))
        if r.size:
            out[name] = (r, np.arange(1, r.size + 1) / r.size)
    return out


def traffic_lines(traffic: Mapping[str, Any]) -> dict[str, tuple[str, Lines, Lines]]:
    """``{tower label: (baseline, latency CDFs, ratio CDFs)}`` of a traffic JSON (either layout)."""
    out = {}
    for name, doc in tower_docs(traffic).items():
        lines = cdfs(doc)
        if lines:
            out[doc.get("tower", {}).get("label", name)] = (baseline_of(doc), lines, ratio_cdfs(doc))
    return out


def traffic_chart(data: Mapping[str, Any], path: Path) -> Chart:
    panels = []
    for label, (baseline, lines, ratios) in traffic_lines(data).items():
        named = {System(n).label: v for n, v in lines.items()}
        panels.append(Panel(label, "share of requests", lines=named, kind=Kind.LINES, xlog=10, steps=True,
                            xlabel="request latency (ms)"))
        panels.append(Panel(label, "share of requests", lines={System(n).label: v for n, v in ratios.items()},
                            kind=Kind.LINES, xlog=10, ref=1.0, steps=True,
                            xlabel=f"latency / {System(baseline).label} latency, per request (left of 1: faster)"))
    return Chart(titled("traffic trace: latency CDFs", data), tuple(panels), cols=2, width=11.0)


# --- serving --------------------------------------------------------------------------------------------------


def serving_chart(data: Mapping[str, Any], path: Path | None = None) -> Chart:
    """images/s against closed-loop clients per tower and transport; a run of one concurrency (``--repeats``) as
    bars per system, whiskers spanning its rounds."""
    results = [(t, tr, r) for t, by in data.get("towers", {}).items() for tr, r in by.items() if "points" in r]
    skipped = {f"{t} {tr}": r["skipped"] for t, by in data.get("towers", {}).items() for tr, r in by.items()
               if "skipped" in r}
    clients = {c for _, _, r in results for by_c in r["points"].values() for c, p in by_c.items() if p.get("requests")}
    title = titled("serving: images/s", data)
    if len(clients) > 1:
        panels = tuple(Panel(f"{SERVING_TOWERS[t]['label']} ({tr})", "images/s", kind=Kind.LINES, xlog=2,
                             markers=True, xlabel="closed-loop clients", lines=_by_clients(r["points"]))
                       for t, tr, r in results)
        return Chart(title, panels, note=missing(skipped), cols=2)
    rows = [dict(p, tower=f"{SERVING_TOWERS[t]['label']} ({tr})", system=s, **_run_range(p))
            for t, tr, r in results for s in _systems(r["points"]) for p in r["points"][s].values()]
    shown = ", ".join(sorted(clients)) or "-"
    panels = tuple(Panel(f"{what} at {shown} clients", unit, cells=long(rows, "tower", "system", key),
                         spread=spread_of(rows, "tower", "system", f"{key}_low", f"{key}_high"))
                   for what, unit, key in (("throughput", "images/s", "images_per_s"), ("P99", "P99 ms", "p99_ms")))
    return Chart(titled("serving: throughput and P99 latency", data), panels, cols=2, width=12.0,
                 note=" ".join(filter(None, ["bar: pooled over the rounds; whisker: the rounds' range.",
                                             missing(skipped)])))


def _systems(points: Mapping[str, Any]) -> list[str]:
    """The measured systems, the table's order first (one colour per system in every panel)."""
    return sorted(points, key=lambda s: SERVING_SYSTEMS.index(s) if s in SERVING_SYSTEMS else len(SERVING_SYSTEMS))


def _by_clients(points: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for system in _systems(points):
        measured = sorted((int(c), p["images_per_s"]) for c, p in points[system].items() if p.get("requests"))
        out[system] = ([c for c, _ in measured], [v for _, v in measured])
    return out


def _run_range(point: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key in ("images_per_s", "p99_ms"):
        values = [r[key] for r in point.get("runs", []) if num(r.get(key)) is not None]
        if values:
            out[f"{key}_low"], out[f"{key}_high"] = min(values), max(values)
    return out


# --- data parallel, planning, Step-3.7 ------------------------------------------------------------------------


def data_parallel_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = [dict(stats, gpus=f"{n} GPU" + ("s" if n != "1" else ""), mode=mode, workload=w)
            for n, g in data.get("gpus", {}).items() for mode, m in g.get("modes", {}).items()
            for w, stats in m.get("workloads", {}).items()]
    panels = tuple(
        Panel(f"workload: {w}", "mean ms per request", xlabel="data-parallel ranks",
              cells=long([r for r in rows if r["workload"] == w], "gpus", "mode", "mean_ms"),
              spread=spread_of([r for r in rows if r["workload"] == w], "gpus", "mode", "p50_ms", "p99_ms"))
        for w in dict.fromkeys(r["workload"] for r in rows))
    tower = (data.get("tower") or {}).get("label", "")
    return Chart(titled(f"data parallel: {tower}", data), panels, cols=2, note="whisker: P50 to P99")


def planning_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = data.get("rows", [])
    return Chart(titled(f"planning: {data.get('tower', '')}, {data.get('requests', '?')} trace requests", data), (
        Panel("latency per request", "ms", cells=wide(rows, "system", {"mean": "mean_ms", "P50": "p50_ms",
                                                                        "P99": "p99_ms"})),
        Panel("padding (the graph systems)", "padded share of graph tokens (%)",
              cells=wide([r for r in rows if "padded_share" in r], "system",
                         {"padded share": lambda r: _percent(r["padded_share"])})),
    ), cols=2, width=12.0)


def _percent(share: Any) -> float | None:
    return None if num(share) is None else 100.0 * share


def step3p7_chart(data: Mapping[str, Any], path: Path) -> Chart:
    cases = [dict(c, case=name) for name, c in data.get("cases", {}).items()]
    systems = {"HF get_image_features": "hf", "graphed(vision tower)": "tower", "whole-model shim": "shim"}
    capture = data.get("capture_seconds") or {}
    return Chart(titled(f"Step-3.7 get_image_features, vision depth {data.get('depth', '?')}", data), (
        Panel("median ms per call", "ms", xlabel="case (images x crops per image)", cells=wide(cases, "case", systems)),
        Panel("capture", "seconds",
              cells={"capture": {n: num(capture[k]) for n, k in systems.items() if k in capture}}),
    ), cols=2)


ANYMODULE_SYSTEMS = {"eager": "the module's own forward (HF towers: sdpa)",
                     "reduce_overhead": 'torch.compile(mode="reduce-overhead")',
                     "encgraph": "encgraph.graphed(module)"}
"""``benches/anymodule.py``'s systems and their labels (its tables and this chart); ``graphed(module)`` with no options
is the defaults."""


def anymodule_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """``benches/anymodule.py``: per module, median ms against batch size for each system (log-log)."""
    panels = []
    for name, m in data.get("models", {}).items():
        batches = m.get("batches") or {}
        if not batches:
            continue
        sizes = [int(n) for n in batches]
        lines = {label: (sizes, [num(batches[n].get(key)) for n in batches]) for key, label in ANYMODULE_SYSTEMS.items()}
        panels.append(Panel(name, "median ms per call", kind=Kind.LINES, lines=lines, xlabel="batch", log=True,
                            xlog=2, markers=True))
    skipped = [f"{n}: {m.get('skipped') or m.get('error')}" for n, m in data.get("models", {}).items()
               if not m.get("batches")]
    return Chart(titled("any module: graphed(module) against eager and reduce-overhead", data), tuple(panels),
                 cols=3, note="; ".join(skipped))


def generic_compile_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """``benches/generic_compile.py``: per module, median ms against batch size for reduce-overhead and each way
    of compiling a batch ladder (log-log)."""
    panels = []
    for name, rows in data.get("models", {}).items():
        lines = {}
        for system, row in rows.items():
            batches = row.get("batches") or {}
            if batches:
                sizes = [int(n) for n in batches]
                lines[system] = (sizes, [num(batches[n].get("system_ms")) for n in batches])
        if lines:
            panels.append(Panel(name, "median ms per call", kind=Kind.LINES, lines=lines, xlabel="batch", log=True,
                                xlog=2, markers=True))
    return Chart(titled("batch ladders: compiled blocks or the whole forward, sizes symbolic or automatic", data),
                 tuple(panels), cols=3)
