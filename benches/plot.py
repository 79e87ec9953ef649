"""Plots from the result JSON: one PNG per result file in ``benches/results``, beside it, drawn by the row of
``benches/lib/plots_registry.py``'s ``REGISTRY`` that its name matches (``python benches/plot.py`` redraws every
one of the newest GPU's results and the host-side ones; ``--slug`` one machine's or one tagged run's;
``--cpu-smoke`` the CPU smoke's).

Each row names a function in ``benches/lib/plots_*.py`` that turns the JSON into a ``Chart`` (panels of bars,
stacked bars or lines: every plotted value is read from the JSON); ``benches/lib/plots.py`` draws it. Needs
matplotlib (the ``bench`` extra: ``pip install matplotlib``); without it the script says so and exits 0 (the JSON
and tables are the results, the plots only draw them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.plots import DPI, pyplot, save
from benches.lib.plots_registry import Result, find_slug, known, select
from benches.lib.results import RESULTS_DIR, SMOKE_SLUG

SCRIPT = "plot"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benches/plot.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON is and PNGs go")
    p.add_argument("--slug", default=None,
                   help="the machine part of the file names: every result of that machine, its tagged runs too "
                        "(default: the newest untagged GPU result's, plus the host-side results); <gpu>_<tag>: that "
                        "tagged run's alone")
    p.add_argument("--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
                   help=f"plot the CPU smoke's results (slug {SMOKE_SLUG})")
    p.add_argument("--dpi", type=int, default=DPI, help="resolution of the PNGs")
    return p


def draw(result: Result, plt: Any, dpi: int = DPI) -> Path:
    data = json.loads(result.path.read_text())
    chart = attrs.evolve(result.plot.chart(data, result.path), source=result.path.name)
    return save(plt, chart, result.png, dpi)


def main(argv: list[str] | None = None) -> list[Path]:
    args = build_parser().parse_args(argv)
    if args.cpu_smoke or args.slug:
        chosen = select(args.results_dir, SMOKE_SLUG if args.cpu_smoke else args.slug, host=False)
    else:
        chosen = select(args.results_dir, find_slug(args.results_dir), host=True)
    drawable = {r.path.name for r in known(args.results_dir)}
    for path in sorted(Path(args.results_dir).glob("*.json")):
        if path.name not in drawable:
            print(f"plot: no row of benches/lib/plots_registry.py's REGISTRY draws {path.name}; it is not plotted")
    if not chosen:
        print(f"plot: no result JSON to plot in {args.results_dir}; run the benchmarks first")
        return []
    plt = pyplot()
    if plt is None:
        print("plot: matplotlib is not installed (pip install matplotlib, the 'bench' extra); no PNG written. "
              f"Results found: {', '.join(r.path.name for r in chosen)}.")
        return []
    written = [draw(r, plt, args.dpi) for r in chosen]
    for path in written:
        print(f"plot: wrote {path}")
    return written


if __name__ == "__main__":
    main()
