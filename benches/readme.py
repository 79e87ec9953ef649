"""Render the figures of the README's Benchmarks section from the committed result JSON.

Each block sits between ``<!-- benches/readme.py: NAME -->`` and ``<!-- end NAME -->`` in README.md and is
rewritten whole from ``benches/results/<script>_<slug>.json`` (default slug ``nvidia-h200``):

- ``traffic``: per tower, ``graphed(tower)`` with no options against HF's own forward beside issue 13's targets,
  then every system of the run (runs of before ``defaults`` existed: what they measured), with the run's
  machine, versions and commit;
- ``towers``: median latency per fixed case of HF sdpa, ``defaults``, encgraph's graphs, compiled graphs and the
  matmul floor;
- ``capture``: graphs, capture seconds and pool memory of the doubling and the default ladders;
- ``families``: HF sdpa against ``defaults`` on the families added after the seed (``towers.py --tag families``);
- ``serving``: images/s and latency per closed-loop concurrency of the batching front (``serving.py
  --transports inprocess``), with its plot;
- ``serving_server``: the same through ``encgraph serve`` over loopback HTTP (``--transports server``);
- ``serving_repeats``: the server at 32 clients, every system measured in rounds and pooled (``--transports server
  --concurrency 32 --repeats 3 --tag repeats``).

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
from benches.lib import traffic_report as report
from benches.lib.results import REPO, RESULTS_DIR, markdown_table, median_of, ratio
from benches.lib.systems import System

README = REPO / "README.md"
SLUG = "nvidia-h200"
TOWER_COLUMNS = (System.HF_SDPA, System.DEFAULTS, System.GRAPH, System.GRAPH_COMPILE)


def provenance(data: Mapping[str, Any], script: str, slug: str) -> str:
    """Where a block's numbers come from: versions, commit and date (per tower when the file merges runs)."""
    env = data["environment"]
    runs = env.get("towers_from")
    if runs:
        labels = {name: doc.get("tower", {}).get("label", name) for name, doc in data.get("towers", {}).items()}
        when = "; ".join(f"{labels.get(name, name)} from commit {run['commit'][:7]}, {run['date_utc'][:10]}"
                         for name, run in runs.items())
    else:
        when = f"commit {(env.get('commit') or '?')[:7]}, {env.get('date_utc', '?')[:10]}"
    return (f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, {env['dtype']}; {when}; "
            f"`benches/results/{script}_{slug}.json`")


def traffic_block(data: Mapping[str, Any], slug: str) -> str:
    parts = [provenance(data, "traffic", slug), data["environment"].get("commit_note") if data["environment"].get(
        "towers_from") else None, report.headline(data), "\n".join(report.target_lines(data))]
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

    note = data["environment"].get("commit_note")
    return "\n\n".join(p for p in (provenance(data, "towers", f"{slug}_families"), note,
                                    towers._family_table(data.get("towers", {}))) if p)


def serving_block(data: Mapping[str, Any], slug: str, transport: str = "inprocess") -> str:
    from benches import serving

    env = data["environment"]
    runs = env.get("towers_from")  # a file that merges runs names each tower's
    when = ("; ".join(f"{serving.TOWERS.get(name, {}).get('label', name)} from commit {run['commit'][:7]}, "
                      f"{run['time'][:10]}" for name, run in runs.items()) if runs else
            f"commit {(env.get('commit') or '?')[:7]}, {str(env.get('time', '?'))[:10]}")
    head = f"{env['gpu']}; {when}; `benches/results/serving_{slug}_{transport}.json`"
    body = serving.render(dict(data)).split("\n", 2)[2]  # without its own title
    body = body.replace("\n## ", "\n#### ")
    parts = [head, env.get("commit_note"), body.strip()]
    plot = RESULTS_DIR / f"serving_{slug}_{transport}_images_per_s.png"
    if plot.exists():
        parts.append(f"![images/s against closed-loop clients](benches/results/{plot.name})")
    return "\n\n".join(p for p in parts if p)


BLOCKS: dict[str, tuple[str, Callable[[Mapping[str, Any], str], str]]] = {
    "traffic": ("traffic_{slug}", traffic_block),
    "towers": ("towers_{slug}", towers_block),
    "capture": ("capture_{slug}", capture_block),
    "families": ("towers_{slug}_families", families_block),
    "serving": ("serving_{slug}_inprocess", serving_block),
    "serving_server": ("serving_{slug}_server", functools.partial(serving_block, transport="server")),
    "serving_repeats": ("serving_{slug}_server_repeats", functools.partial(serving_block, transport="server_repeats")),
}


def render_block(name: str, results_dir: Path, slug: str) -> str:
    stem, render = BLOCKS[name]
    path = Path(results_dir) / f"{stem.format(slug=slug)}.json"
    if not path.exists():
        return f"No results yet: `{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` is missing."
    return render(json.loads(path.read_text()), slug)


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- benches/readme.py: {name} -->\n)(.*?)(<!-- end {name} -->)", re.S)


def update(text: str, results_dir: Path = RESULTS_DIR, slug: str = SLUG) -> str:
    """``text`` with every block it has rendered anew."""
    for name in BLOCKS:
        body = render_block(name, results_dir, slug)
        text = _pattern(name).sub(lambda m: m.group(1) + body + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benches/readme.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if the README differs")
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--slug", default=SLUG, help=f"machine part of the result file names (default {SLUG})")
    args = p.parse_args(argv)
    old = args.readme.read_text()
    missing = [n for n in BLOCKS if not _pattern(n).search(old)]
    if missing:
        print(f"readme: {args.readme} has no block for {missing}", file=sys.stderr)
        return 1
    new = update(old, args.results_dir, args.slug)
    if args.check:
        if new != old:
            print(f"readme: the Benchmarks blocks of {args.readme} differ from their results; run "
                  "python benches/readme.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"readme: rewrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
