"""The README's headline table (``benches/readme.py``'s ``headline`` block): encgraph with no options against the
tower's own forward, one row per workload, each linking the result file it comes from."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benches.lib import traffic_report as report
from benches.lib.results import fmt, markdown_table, median_of, ratio
from benches.lib.systems import System


def date_of(run: Mapping[str, Any]) -> str:
    """The day a run's environment records (``date_utc``; the serving bench's ``time``)."""
    return str(run.get("date_utc") or run.get("time", "?"))[:10]


def load_result(results_dir: Path, stem: str) -> Mapping[str, Any] | None:
    path = Path(results_dir) / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else None


SIZES_SHORT = {"new": "every size new", "seen": "sizes seen before"}
"""How the headline names a traffic pass's sizes (``benches/traffic.py --sizes``; as drawn: nothing)."""


def short_label(label: str) -> str:
    return label.removesuffix(" tower").removesuffix(" vision")


_FAMILY_CASES = {"1x448": "one 448 px image", "photo": "one photo at the processor's default maximum"}


def _family_rows(data: Mapping[str, Any], what: str, stem: str) -> list[list[str]]:
    """One headline row per case of ``_FAMILY_CASES`` that a family run measured: the range over its towers of HF
    sdpa and the defaults (median latency), their speedups, and the towers slower than HF by name."""
    rows = []
    for case, words in _FAMILY_CASES.items():
        pairs = [(t["label"], median_of(c["systems"].get(System.HF_SDPA.value)),
                  median_of(c["systems"].get(System.DEFAULTS.value)))
                 for t in data.get("towers", {}).values() for name, c in t.get("cases", {}).items()
                 if name == case and "systems" in c]
        pairs = [(label, hf, d) for label, hf, d in pairs if hf is not None and d is not None]
        if not pairs:
            continue
        hfs, ds = [p[1] for p in pairs], [p[2] for p in pairs]
        xs = [hf / d for _, hf, d in pairs]
        slower = [f"{short_label(label)} {hf / d:.2f}x" for label, hf, d in pairs if hf < d]
        rows.append([f"{len(pairs)} {what} ({', '.join(short_label(p[0]) for p in pairs)}): {words}, median latency"
                     + (f"; slower than HF: {', '.join(slower)}" if slower else ""),
                     f"{fmt(min(hfs))}-{fmt(max(hfs))} ms", f"{fmt(min(ds))}-{fmt(max(ds))} ms",
                     f"**{min(xs):.{2 if min(xs) < 1 else 1}f}-{max(xs):.1f}x**",
                     f"[families](benches/results/{stem}.md)"])
    return rows


def headline_block(results_dir: Path, slug: str) -> str:
    """The README's table: encgraph with no options against the tower's own forward, one row per workload, each
    linking the result file it comes from; then the conditions shared by every row."""
    rows, envs, best = [], [], {}  # best: {"latency" | "throughput": (speedup, tower label)}
    chat = "chat-like trace of {n} requests (1-8 images of any size, or a short video)"
    photo = "photo trace of {n} requests (1-3 photos of 400-4000 px at the processor's default maximum)"
    fa4 = ", FlashAttention-4 installed (the `fa4` extra)"
    traces = ((f"traffic_{slug}", chat), (f"traffic_{slug}_photo", photo),
              (f"traffic_{slug}_chat-fa4", chat + fa4), (f"traffic_{slug}_photo-fa4", photo + fa4))
    for stem, workload in traces:
        traffic = load_result(results_dir, stem)
        if not traffic:
            continue
        envs.append(traffic["environment"])
        for name, tower in report.tower_docs(traffic).items():
            for mode, doc in report.passes(tower):
                hf, d = (doc.get("systems", {}).get(s.value) for s in (System.HF_SDPA, System.DEFAULTS))
                if not (hf and d):
                    continue
                x = ratio(hf["mean_ms"], d["mean_ms"])
                if stem == f"traffic_{slug}":
                    best["latency"] = max(best.get("latency", (0.0, "")), (x, short_label(doc["tower"]["label"])))
                worst = d.get("worst_ratio_vs_hf_sdpa")  # every trace's row states its worst request
                slower = f"; worst request {worst:.2f}x HF's" if worst is not None else ""
                sizes = f", {SIZES_SHORT[mode]}" if mode in SIZES_SHORT else ""
                rows.append([f"{short_label(doc['tower']['label'])}: {workload.format(n=d['requests'])}{sizes}, mean "
                             f"latency{slower}", f"{fmt(hf['mean_ms'])} ms", f"{fmt(d['mean_ms'])} ms",
                             f"**{x:.1f}x**", f"[traffic](benches/results/{stem}.md)"])
    for stem, what in ((f"towers_{slug}_families", "more towers"),
                       (f"towers_{slug}_families-photo", "newer towers, no FlashAttention-4")):
        families = load_result(results_dir, stem)
        if families:
            envs.append(families["environment"])
            rows += _family_rows(families, what, stem)
    serving = load_result(results_dir, f"serving_{slug}_server_repeats")
    if serving:
        from benches import serving as serving_bench

        envs.append(serving["environment"])
        for tower, by_transport in serving.get("towers", {}).items():
            points = by_transport.get("server", {}).get("points", {})
            hf, d = points.get("hf_eager", {}).get("32"), points.get("defaults", {}).get("32")
            if hf and d and hf.get("requests") and d.get("requests"):
                x = d["images_per_s"] / hf["images_per_s"]
                label = short_label(serving_bench.TOWERS[tower]["label"])
                best["throughput"] = max(best.get("throughput", (0.0, "")), (x, label))
                rows.append([f"{label} behind `encgraph serve`, 32 concurrent "
                             "clients, images/s", f"{hf['images_per_s']:.0f}/s", f"{d['images_per_s']:.0f}/s",
                             f"**{x:.1f}x**",
                             f"[serving](benches/results/serving_{slug}_server_repeats.md)"])
    if not rows:
        return f"No results yet: `benches/results/*_{slug}.json` are missing."
    table = markdown_table(["workload", "tower's own forward (HF, sdpa)", "encgraph, no options", "speedup",
                            "result"], rows)
    gpus = sorted({e["gpu"] for e in envs})
    versions = "; ".join(f"{name} {', '.join(sorted({e[name] for e in envs if e.get(name)}))}"
                         for name in ("torch", "transformers"))
    dates = sorted(date_of(e) for e in envs)
    lead = [f"**{best['latency'][0]:.1f}x** lower mean latency than the tower's own forward on a chat-like trace "
            f"({best['latency'][1]})" if "latency" in best else None,
            f"**{best['throughput'][0]:.1f}x** the images/s behind `encgraph serve` ({best['throughput'][1]})"
            if "throughput" in best else None]
    lead_line = f"With no options, on one {', '.join(gpus)}: " + " and ".join(filter(None, lead)) + ".\n\n"
    return (f"{lead_line if any(lead) else ''}{table}\n\n<sub>One {', '.join(gpus)}; {versions}; bfloat16 towers at each model's released geometry "
            f"with random weights; each row's systems measured side by side in one process, {dates[0]} to "
            f"{dates[-1]}. The latency rows call the tower directly (`graphed(tower)`); the serving rows go through "
            "the HTTP server, its `--eager` baseline against its defaults. Commits, options and every other "
            "system are in each result file.</sub>")
