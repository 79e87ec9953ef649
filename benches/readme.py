"""Render the README's headline table and the tables of docs/benchmarks.md from the committed result JSON.

Each block sits between ``<!-- benches/readme.py: NAME -->`` and ``<!-- end NAME -->`` and is rewritten whole
from ``benches/results/<script>_<slug>.json`` (default slug ``nvidia-h200``). Blocks name the machine, versions,
date and file of their numbers; commits, command lines and run notes stay in the JSON (``environment``).

README.md:

- ``headline`` (:mod:`benches.lib.headline`): encgraph with no options against the tower's own forward, one row
  per workload (the traffic trace per tower, the families at one 448 px image and the newer ones also on one photo
  at the processor's maximum, the server at 32 clients), each row linking its result file.

docs/benchmarks.md (links through ``docs/results``, a link to ``benches/results``):

- ``traffic``: per tower, ``graphed(tower)`` with no options against HF's own forward beside the targets, then
  every system of the run;
- ``towers``: median latency per fixed case of HF sdpa, ``defaults``, encgraph's graphs, compiled graphs and the
  matmul floor;
- ``capture``: graphs, capture seconds and pool memory of the doubling and the default ladders;
- ``families``: HF sdpa against ``defaults`` on the families added after the seed (``towers.py --tag families``);
- ``serving``: images/s and latency per closed-loop concurrency of the batching front (``serving.py
  --transports inprocess``), with its plot;
- ``serving_server``: the same through ``encgraph serve`` over loopback HTTP (``--transports server``);
- ``serving_repeats``: the server at 32 clients, every system measured in rounds and pooled (``--transports server
  --concurrency 32 --repeats 3``);
- ``traffic_runs``: every traffic result (the chat and photo traces, each without and with FlashAttention-4), one
  row per tower and pass: ``defaults`` against HF, the varlen kernel capture chose, and the floor at the requests'
  sizes;
- ``photo_capture``: what capture measured in the photo run: each budget's graph whole and split at its attention
  calls, and the attention kernels at the lengths where dense cuDNN and its buckets take over.

    python benches/readme.py           # rewrite the blocks
    python benches/readme.py --check   # exit 1 if a block differs from its rendering (CI: no hand-typed figures)
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches import capture
from benches.lib import plots_registry
from benches.lib import traffic_report as report
from benches.lib.headline import (
    SIZES_SHORT,
    date_of,
    headline_block,
    load_result,
    short_label,
)
from benches.lib.results import REPO, RESULTS_DIR, fmt, markdown_table, median_of, ratio
from benches.lib.systems import System

README = REPO / "README.md"
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"
SLUG = "nvidia-h200"
TOWER_COLUMNS = (System.HF_SDPA, System.DEFAULTS, System.GRAPH, System.GRAPH_COMPILE)
# Where a document finds the result files: the README from the repository root, the docs pages through
# docs/results, a link to benches/results that MkDocs follows.
LINK_PREFIX = {README.name: "benches/results/", BENCHMARKS_PAGE.name: "results/"}


def provenance(data: Mapping[str, Any], script: str, slug: str) -> str:
    """Where a block's numbers come from: machine, versions, date and file. The commit and the run's notes stay
    in the file (``environment``)."""
    env = data["environment"]
    runs = env.get("towers_from")
    dates = sorted({date_of(run) for run in runs.values()} if runs else {date_of(env)})
    versions = ", ".join(f"{name} {env[name]}" for name in ("torch", "transformers") if env.get(name))
    dtype = f", {env['dtype']}" if env.get("dtype") else ""
    return f"{env['gpu']}, {versions}{dtype}; {' and '.join(dates)}; `benches/results/{script}_{slug}.json`"


def traffic_block(data: Mapping[str, Any], slug: str) -> str:
    parts = [provenance(data, "traffic", slug), report.headline(data), "\n".join(report.target_lines(data))]
    for name, doc in report.tower_docs(data).items():  # every system of the run (old runs: what they measured)
        trace = doc.get("trace", {})
        planning = f", planning: {doc['planning']}" if doc.get("planning") else ""
        compiled = [n for n in report.tower_notes(doc) if System.HF_COMPILE_DYNAMIC.label in n]
        parts += [f"{doc.get('tower', {}).get('label', name)}, {trace.get('completed')} of {trace.get('requests')} "
                  f"requests{planning}:", report.system_table(doc), "\n".join(compiled)]
    plot = RESULTS_DIR / f"traffic_{slug}_cdf.png"
    if plot.exists():
        parts.append(f"![latency and per-request ratio CDFs](benches/results/{plot.name})")
    return "\n\n".join(p for p in parts if p)


def towers_block(data: Mapping[str, Any], slug: str) -> str:
    shown = [s for s in TOWER_COLUMNS
             if any(median_of(c["systems"].get(s.value)) is not None
                    for t in data.get("towers", {}).values() for c in t.get("cases", {}).values())]
    rows = []
    for tower in data.get("towers", {}).values():
        for name, c in tower.get("cases", {}).items():
            hf = median_of(c["systems"].get(System.HF_SDPA.value))
            cells = [median_of(c["systems"].get(s.value)) for s in shown]
            best = min((v for v in cells[1:] if v is not None), default=None)
            rows.append([tower["label"], name, c["patches"], *cells, c["floor_ms"],
                         None if best is None else f"{ratio(hf, best):.1f}x"])
    table = markdown_table(["tower", "case", "patches", *(f"{s.label} ms" for s in shown), "matmul floor ms",
                            "fastest vs HF sdpa"], rows)
    return provenance(data, "towers", slug) + "; medians of timed calls after warm-up\n\n" + table


def capture_block(data: Mapping[str, Any], slug: str) -> str:
    return provenance(data, "capture", slug) + "\n\n" + capture.summary_table(data)


def families_block(data: Mapping[str, Any], slug: str) -> str:
    from benches import towers

    return provenance(data, "towers", f"{slug}_families") + "\n\n" + towers._family_table(data.get("towers", {}))


def serving_block(data: Mapping[str, Any], slug: str, transport: str = "inprocess") -> str:
    from benches import serving

    head = provenance(data, "serving", f"{slug}_{transport}")
    body = serving.render(dict(data)).split("\n", 2)[2]  # without its own title
    body = body.replace("\n## ", "\n#### ")
    parts = [head, body.strip()]
    plot = RESULTS_DIR / f"serving_{slug}_{transport}_images_per_s.png"
    if plot.exists():
        parts.append(f"![images/s against closed-loop clients](benches/results/{plot.name})")
    return "\n\n".join(p for p in parts if p)


def anymodule_block(results_dir: Path, slug: str) -> str:
    """Any module through ``graphed()`` against its eager forward and ``torch.compile(mode="reduce-overhead")``
    (``benches/anymodule.py``), at batch 1 and 32 and over the mixed stream; from the untagged ``anymodule_<gpu>.json``
    of the latest date (a tagged run measures a change on part of the modules; file times mean nothing in a clone)."""
    found = []
    for path in Path(results_dir).glob("anymodule_*.json"):
        parsed = plots_registry.parse(path)
        if parsed is not None and not parsed.tag:
            data = json.loads(path.read_text())
            found.append((data.get("environment", {}).get("date", ""), path.name, path, data))
    if not found:
        return "No results yet: `benches/results/anymodule_<gpu>.json` is missing."
    _, _, path, data = max(found, key=lambda f: f[:2])
    env = data["environment"]
    rows = []
    for name, m in data["models"].items():
        if "batches" not in m:
            rows.append([name, "-", "-", "-", m.get("skipped") or m.get("error", "")])
            continue
        one, top = m["batches"]["1"], m["batches"]["32"]
        stream, warm = m["stream"], m["warmup"]
        rows.append([name, f"{fmt(one['eager'])} / {fmt(one['reduce_overhead'])} / {fmt(one['encgraph'])} ms",
                     f"{fmt(top['eager'])} / {fmt(top['reduce_overhead'])} / {fmt(top['encgraph'])} ms",
                     f"{fmt(stream['eager']['mean_ms'])} / {fmt(stream['reduce_overhead']['mean_ms'])} / "
                     f"{fmt(stream['encgraph']['mean_ms'])} ms; worst request {stream['encgraph_worst_vs_eager']:.2f}x "
                     f"eager, {stream['encgraph_worst_vs_reduce_overhead']:.2f}x reduce-overhead",
                     f"{fmt(warm['reduce_overhead']['seconds'])} / {fmt(warm['encgraph']['seconds'])} s"])
    table = markdown_table(["module", "batch 1: eager / reduce-overhead / encgraph", "batch 32", "mixed stream, mean",
                            "warm-up: reduce-overhead / encgraph"], rows)
    return (f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, bf16, random weights; "
            f"{env['date']}; [`{path.name}`](benches/results/{path.with_suffix('.md').name})\n\n{table}")


TRAFFIC_RUNS = ("", "_chat-fa4", "_photo", "_photo-fa4")
"""The traffic results of one GPU that ``traffic_runs`` compares (``traffic_<slug><tag>.json``): the chat and the
photo trace, each without and with FlashAttention-4 installed."""


def _tree(env: Mapping[str, Any]) -> str:
    """The commit a run's library code was at: its ``tree`` where the device copy's git lagged, else ``commit``."""
    return str(env.get("tree") or env.get("commit") or "?").split()[0][:7]


def _varlen_kernels(tower: Mapping[str, Any]) -> str:
    """The packed attention kernel capture chose for the graphs per head geometry of ``defaults`` (the graph kernel;
    in files of before cuDNN's, the one varlen kernel; ``-`` in older files)."""
    kernels = tower.get("capture", {}).get(System.DEFAULTS.value, {}).get("kernels") or {}
    chosen = sorted({k.get("graph_kernel", k.get("varlen_kernel", "flash")) for k in kernels.values()
                     if isinstance(k, dict) and "heads" in k})
    return ", ".join(chosen) or "-"


def _floor_cell(entry: Mapping[str, Any]) -> str | None:
    """A system's time over the floor at each request's sizes: mean / worst (requests within 1.2x)."""
    if "mean_ratio_vs_shape_floor" not in entry:
        return None
    return (f"{entry['mean_ratio_vs_shape_floor']:.2f}x / {entry['worst_ratio_vs_shape_floor']:.2f}x "
            f"({entry['within_shape_floor_bound']} of {entry['compared_with_shape_floor']})")


def traffic_runs_block(results_dir: Path, slug: str) -> str:
    """One row per tower and pass of every traffic result of ``slug``: ``defaults`` against HF sdpa, the kernel
    capture chose, and both systems against the floor at the requests' sizes (photo trace)."""
    rows, envs = [], []
    for tag in TRAFFIC_RUNS:
        stem = f"traffic_{slug}{tag}"
        data = load_result(results_dir, stem)
        if not data:
            continue
        env = data["environment"]
        envs.append(env)
        trace = f"[{'photo' if report.is_photo(data) else 'chat'}](benches/results/{stem}.md)"
        for name, tower in report.tower_docs(data).items():
            kernel = _varlen_kernels(tower)
            for mode, doc in report.passes(tower):
                hf, d = (doc.get("systems", {}).get(s.value) for s in (System.HF_SDPA, System.DEFAULTS))
                if not (hf and d):
                    continue
                gs = doc.get("graph_stats", {}).get(System.DEFAULTS.value, {})
                rows.append([trace, _tree(env), kernel, short_label(doc.get("tower", {}).get("label", name)),
                             SIZES_SHORT.get(mode or "", "as drawn"), d.get("requests"), hf.get("mean_ms"),
                             d.get("mean_ms"), *(None if d.get(k) is None else f"{d[k]:.2f}x" for k in (
                                 "speedup_mean_vs_hf_sdpa", "speedup_p99_vs_hf_sdpa", "worst_ratio_vs_hf_sdpa")),
                             d.get("slower_than_hf_sdpa"),
                             None if gs.get("padded_share") is None else f"{100 * gs['padded_share']:.1f}%",
                             f"{gs.get('eager_items')} of {gs.get('items')}" if gs else None,
                             _floor_cell(hf), _floor_cell(d)])
    if not rows:
        return f"No results yet: `benches/results/traffic_{slug}*.json` are missing."
    gpus = ", ".join(sorted({e["gpu"] for e in envs}))
    versions = ", ".join(f"{n} {', '.join(sorted({e[n] for e in envs if e.get(n)}))}"
                         for n in ("torch", "transformers"))
    dtypes = ", ".join(sorted({str(e["dtype"]) for e in envs if e.get("dtype")}))
    dates = sorted({date_of(e) for e in envs})
    head = (f"{gpus}, {versions}, {dtypes}; {' to '.join(dict.fromkeys((dates[0], dates[-1])))}; one row per "
            f"tower and pass of each `benches/results/traffic_{slug}*.json`")
    table = markdown_table(
        ["trace", "library at", "varlen kernel", "tower", "sizes", "requests", "HF sdpa mean ms", "defaults mean ms",
         "mean speedup", "P99 speedup", "worst request (defaults / HF)", "requests slower than HF",
         "padded share", "eager items", "HF / floor at its sizes: mean / worst (within 1.2x)",
         "defaults / floor at its sizes: mean / worst (within 1.2x)"], rows)
    return head + "\n\n" + table


PIECEWISE_BUDGETS = (1088, 1280, 2240, 4096)
"""The budgets ``photo_capture`` shows of each split graph (those the page names)."""


def photo_capture_block(data: Mapping[str, Any], slug: str) -> str:
    """What capture measured in the photo run (``defaults``' ``capture_info``): each split budget's replay whole,
    split with long sequences dense, and split all varlen; the kernels at 4,096-16,384 rows, with the lengths from
    which the runner runs dense cuDNN, stands in at a bucket and runs at buckets."""
    split_rows, kernel_rows = [], []
    for name, tower in report.tower_docs(data).items():
        cap = tower.get("capture", {}).get(System.DEFAULTS.value, {})
        label = short_label(tower.get("tower", {}).get("label", name))
        graphs = {g["budget"]: g["piecewise"] for g in cap.get("per_graph", []) if g.get("piecewise")}
        shown = [b for b in PIECEWISE_BUDGETS if b in graphs]
        if shown:
            split_rows.append([label, len(graphs), " / ".join(f"{b:,}" for b in shown)]
                              + [" / ".join(fmt(graphs[b][k]) for b in shown)
                                 for k in ("whole_ms", "dense_ms", "varlen_ms")])
        for key, k in (cap.get("kernels") or {}).items():
            if not (isinstance(k, dict) and "heads" in k):
                continue
            first = {n: k.get(n) for n in ("min_rows", "stand_in_from", "replay_stand_in_from", "bucket_from")}
            for i, rows in enumerate(k.get("lengths", [])):
                if rows < 4096:
                    continue
                cells = [k.get(c)[i] if len(k.get(c) or []) > i else None
                         for c in ("varlen_ms", "dense_ms", "dense_first_ms", "padded_ms", "padded_replay_ms")]
                kernel_rows.append([f"{label} {k['heads']}x{k['head_dim']}", f"{rows:,}", *cells,
                                    " / ".join(fmt(v) for v in first.values())])
    parts = [provenance(data, "traffic", f"{slug}_photo") + "; `capture_info` of `defaults`"]
    if split_rows:
        parts.append(markdown_table(["tower", "split budgets", "budgets shown (tokens)", "whole graph ms",
                                     "split, long sequences dense ms", "split, all varlen ms"], split_rows))
    if kernel_rows:
        parts.append(markdown_table(
            ["geometry", "rows", "varlen ms", "dense ms", "dense, first call (its plan) ms", "dense padded to a "
             "bucket ms", "padded, replayed ms", "dense from / stand-in from (eager / replay) / buckets from, rows"],
            kernel_rows))
    return "\n\n".join(parts)


BLOCKS: dict[str, tuple[str, Callable[[Mapping[str, Any], str], str]]] = {
    "traffic": ("traffic_{slug}", traffic_block),
    "towers": ("towers_{slug}", towers_block),
    "capture": ("capture_{slug}", capture_block),
    "families": ("towers_{slug}_families", families_block),
    "serving": ("serving_{slug}_inprocess", serving_block),
    "serving_server": ("serving_{slug}_server", functools.partial(serving_block, transport="server")),
    "serving_repeats": ("serving_{slug}_server_repeats", functools.partial(serving_block, transport="server_repeats")),
    "photo_capture": ("traffic_{slug}_photo", photo_capture_block),
}
MULTI: dict[str, Callable[[Path, str], str]] = {"headline": headline_block, "traffic_runs": traffic_runs_block,
                                                "anymodule": anymodule_block}
"""Blocks rendered from several result files (each reads the ones it finds)."""
# The blocks each document holds: the README only its headline table, the benchmarks page every table.
DOCUMENTS: dict[Path, tuple[str, ...]] = {README: ("headline", "anymodule"),
                                          BENCHMARKS_PAGE: (*BLOCKS, "traffic_runs", "anymodule")}


def render_block(name: str, results_dir: Path, slug: str) -> str:
    if name in MULTI:
        return MULTI[name](results_dir, slug)
    stem, render = BLOCKS[name]
    path = Path(results_dir) / f"{stem.format(slug=slug)}.json"
    if not path.exists():
        return f"No results yet: `{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` is missing."
    return render(json.loads(path.read_text()), slug)


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- benches/readme.py: {name} -->\n)(.*?)(<!-- end {name} -->)", re.S)


def update(text: str, results_dir: Path = RESULTS_DIR, slug: str = SLUG, link_prefix: str = "benches/results/") -> str:
    """``text`` with every block it has rendered anew, its links to result files starting with ``link_prefix``."""
    for name in (*MULTI, *BLOCKS):
        pattern = _pattern(name)
        if not pattern.search(text):  # a block of the other document
            continue
        body = render_block(name, results_dir, slug).replace("](benches/results/", f"]({link_prefix}")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benches/readme.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a document differs")
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--benchmarks-page", type=Path, default=BENCHMARKS_PAGE)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--slug", default=SLUG, help=f"machine part of the result file names (default {SLUG})")
    args = p.parse_args(argv)
    status = 0
    for path, names in ((args.readme, DOCUMENTS[README]), (args.benchmarks_page, DOCUMENTS[BENCHMARKS_PAGE])):
        old = path.read_text()
        missing = [n for n in names if not _pattern(n).search(old)]
        if missing:
            print(f"readme: {path} has no block for {missing}", file=sys.stderr)
            status = 1
            continue
        new = update(old, args.results_dir, args.slug, LINK_PREFIX.get(path.name, "benches/results/"))
        if args.check:
            if new != old:
                print(f"readme: the blocks of {path} differ from their results; run python benches/readme.py",
                      file=sys.stderr)
                status = 1
        elif new != old:
            path.write_text(new)
            print(f"readme: rewrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
