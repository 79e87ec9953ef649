"""Plots from the result JSON: speedup bars per tower and case (``towers_<gpu>_speedup.png``), and per tower of
the traffic run its latency CDFs and per-request ratio CDFs against its baseline (``traffic_<gpu>_cdf.png``).

Needs matplotlib (the ``bench`` extra: ``pip install matplotlib``); without it the script says so and exits 0
(the JSON and tables are the results, the plots only draw them). Every plotted value is read from the JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse

import numpy as np

from benches.lib.results import RESULTS_DIR, SMOKE_SLUG, median_of, ratio
from benches.lib.systems import System
from benches.lib.traffic_report import baseline_of, tower_docs

SCRIPT = "plot"
BASELINE = System.HF_SDPA
BAR_SYSTEMS = (System.HF_VARLEN, System.ADAPTER_EAGER, System.DEFAULTS, System.GRAPH, System.COMPILE,
               System.GRAPH_COMPILE)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benches/plot.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON is and PNGs go")
    p.add_argument("--slug", default=None,
                   help="the machine part of the file names (default: the newest towers_/traffic_ JSON's, not the "
                        "CPU smoke's)")
    p.add_argument("--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
                   help=f"plot the CPU smoke's results (slug {SMOKE_SLUG})")
    return p


def find_slug(results_dir: Path) -> str | None:
    """The slug of the newest ``towers_*.json`` or ``traffic_*.json`` that is neither the CPU smoke's nor a tagged
    run's (``<script>_<gpu>_<tag>``: pass ``--slug <gpu>_<tag>`` for those)."""
    found = [p for pattern in ("towers_*.json", "traffic_*.json") for p in results_dir.glob(pattern)
             if not p.stem.endswith(SMOKE_SLUG) and "_" not in p.stem.split("_", 1)[1]]
    if not found:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime)
    return newest.stem.split("_", 1)[1]


def speedups(towers: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """``{tower label: {case: {system: median(hf_sdpa) / median(system)}}}`` from ``towers_<gpu>.json``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for tower in towers.get("towers", {}).values():
        cases = {}
        for case, c in tower.get("cases", {}).items():
            base = median_of(c["systems"].get(BASELINE.value))
            row = {}
            for s in BAR_SYSTEMS:
                r = ratio(base, median_of(c["systems"].get(s.value)))
                if r is not None:
                    row[s.value] = r
            cases[case] = row
        if cases:
            out[tower["label"]] = cases
    return out


def cdfs(doc: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per system: sorted request latencies (ms) and their cumulative shares, from one tower's traffic document."""
    out = {}
    for name, values in doc.get("per_request", {}).get("latency_ms", {}).items():
        x = np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64))
        if x.size:
            out[name] = (x, np.arange(1, x.size + 1) / x.size)
    return out


def ratio_cdfs(doc: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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


Lines = dict[str, tuple[np.ndarray, np.ndarray]]


def traffic_lines(traffic: Mapping[str, Any]) -> dict[str, tuple[str, Lines, Lines]]:
    """``{tower label: (baseline, latency CDFs, ratio CDFs)}`` of a traffic JSON (either layout)."""
    out = {}
    for name, doc in tower_docs(traffic).items():
        lines = cdfs(doc)
        if lines:
            out[doc.get("tower", {}).get("label", name)] = (baseline_of(doc), lines, ratio_cdfs(doc))
    return out


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> list[Path]:
    args = build_parser().parse_args(argv)
    slug = SMOKE_SLUG if args.cpu_smoke else (args.slug or find_slug(args.results_dir))
    if slug is None:
        print(f"plot: no towers_*.json or traffic_*.json in {args.results_dir}; run the benchmarks first")
        return []
    towers = _load(args.results_dir / f"towers_{slug}.json")
    traffic = _load(args.results_dir / f"traffic_{slug}.json")
    bars = speedups(towers) if towers else {}
    lines = traffic_lines(traffic) if traffic else {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed (pip install matplotlib, the 'bench' extra); no PNG written. "
              f"Data found: {len(bars)} towers of fixed cases, {len(lines)} towers of traffic.")
        return []
    written = []
    if bars:
        written.append(draw_bars(plt, bars, args.results_dir / f"towers_{slug}_speedup.png", slug))
    if lines:
        written.append(draw_cdfs(plt, lines, args.results_dir / f"traffic_{slug}_cdf.png", slug))
    for path in written:
        print(f"plot: wrote {path}")
    return written


def draw_bars(plt: Any, bars: dict[str, dict[str, dict[str, float]]], path: Path, slug: str) -> Path:
    fig, axes = plt.subplots(len(bars), 1, figsize=(10, 3.2 * len(bars)), squeeze=False)
    width = 0.8 / len(BAR_SYSTEMS)
    for ax, (label, cases) in zip(axes[:, 0], bars.items()):
        names = list(cases)
        x = np.arange(len(names))
        for k, s in enumerate(BAR_SYSTEMS):
            values = [cases[c].get(s.value, np.nan) for c in names]
            ax.bar(x + (k - (len(BAR_SYSTEMS) - 1) / 2) * width, values, width, label=s.label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")  # speedups span 0.5x-50x: equal ratios, equal heights
        ax.set_xticks(x, names)
        ax.set_ylabel(f"speedup vs {BASELINE.label}")
        ax.set_title(label)
        ax.legend(fontsize=7, ncol=len(BAR_SYSTEMS))
    fig.suptitle(f"median latency speedup ({slug})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_cdfs(plt: Any, towers: dict[str, tuple[str, Lines, Lines]], path: Path, slug: str) -> Path:
    fig, axes = plt.subplots(len(towers), 2, figsize=(12, 4.5 * len(towers)), squeeze=False)
    for (left, right), (label, (baseline, lines, ratios)) in zip(axes, towers.items()):
        for name, (x, y) in lines.items():
            left.plot(x, y, label=System(name).label)
        left.set_xscale("log")
        left.set_xlabel("request latency (ms)")
        left.set_ylabel("share of requests")
        left.set_title(label)
        left.legend(fontsize=8)
        for name, (x, y) in ratios.items():
            right.plot(x, y, label=System(name).label)
        right.axvline(1.0, color="black", linewidth=0.8)
        right.set_xscale("log")
        right.set_xlabel(f"latency / {System(baseline).label} latency, per request (left of 1: faster)")
        right.set_title(label)
        right.legend(fontsize=8)
    fig.suptitle(f"traffic trace ({slug})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
