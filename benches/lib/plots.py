"""One picture of a result as data, and the one renderer that draws it.

A ``Chart`` is a title, a note and panels; a ``Panel`` holds grouped bars (``cells``: group -> series -> value),
stacked bars (the same cells, summed per group) or lines (``lines``: series -> (x, y)). The per-benchmark modules
(``plots_models``, ``plots_kernels``, ``plots_host``) only turn a result JSON into a Chart, so that every plotted
value is one read from the JSON; ``render`` and ``save`` hold every matplotlib call. A cell that is ``None`` was
not measured: its bar is an ``x`` on the axis, and the chart's note says why (from the JSON).
"""

from __future__ import annotations

import enum
import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

Value = float | None
Cells = dict[str, dict[str, Value]]
"""Group (an x tick) -> series -> value; ``None``: not measured (an x); a series a group lacks: does not apply
there (nothing drawn)."""
Row = Mapping[str, Any]
Key = str | Callable[[Row], Any]
"""A row's field by name, or a function of the row."""

DPI = 100
MISSING = "x: not measured"


class Kind(enum.Enum):
    BARS = "bars"
    STACKED = "stacked"
    LINES = "lines"


@attrs.frozen
class Panel:
    """One axes. ``spread`` (group -> series -> (low, high)) adds a whisker to a bar; ``ref`` a reference line
    (horizontal for bars, vertical for lines) named ``ref_label`` in the legend when given; ``log`` / ``xlog``
    (the base) log axes; ``markers`` dots on lines; ``steps`` lines as steps (an empirical CDF); ``base`` where
    bars start (a ratio's 1: up when above it, down when below; default 0, or on a log axis the power of ten below
    the least value)."""

    title: str
    ylabel: str
    cells: Cells = attrs.field(factory=dict)
    lines: dict[str, tuple[Sequence[float], Sequence[float]]] = attrs.field(factory=dict)
    kind: Kind = Kind.BARS
    xlabel: str = ""
    log: bool = False
    xlog: int = 0
    ref: float | None = None
    ref_label: str = ""
    spread: dict[str, dict[str, tuple[float, float]]] = attrs.field(factory=dict)
    markers: bool = False
    steps: bool = False
    base: float | None = None

    @property
    def series(self) -> list[str]:
        """Series names in first-seen order."""
        names = list(self.lines) if self.kind is Kind.LINES else [s for g in self.cells.values() for s in g]
        return list(dict.fromkeys(names))

    @property
    def empty(self) -> bool:
        if self.kind is Kind.LINES:
            return not any(len(x) for x, _ in self.lines.values())
        return not any(v is not None for g in self.cells.values() for v in g.values())


@attrs.frozen
class Chart:
    """A PNG: ``panels`` in a grid of ``cols`` columns under ``title``; ``note`` (what is missing, what a whisker
    means) and ``source`` (the JSON's name) under the panels."""

    title: str
    panels: tuple[Panel, ...]
    note: str = ""
    source: str = ""
    cols: int = 1
    width: float = 11.0


# --- building cells from rows ---------------------------------------------------------------------------------


def get(row: Row, key: Key) -> Any:
    return key(row) if callable(key) else row.get(key)


def num(value: Any) -> Value:
    """A plottable float, or ``None`` (absent, an error string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def long(rows: Iterable[Row], group: Key, series: Key, value: Key) -> Cells:
    """Cells from rows that each hold one value: ``group`` and ``series`` name where it goes."""
    out: Cells = {}
    for row in rows:
        out.setdefault(str(get(row, group)), {})[str(get(row, series))] = num(get(row, value))
    return out


def wide(rows: Iterable[Row], group: Key, columns: Mapping[str, Key]) -> Cells:
    """Cells from rows that each hold one value per series: ``columns`` maps a series' name to its field."""
    return {str(get(row, group)): {name: num(get(row, key)) for name, key in columns.items()} for row in rows}


def spread_of(rows: Iterable[Row], group: Key, series: Key, low: Key, high: Key) -> dict[str, dict[str, tuple]]:
    """Whiskers (low, high) from rows, placed as ``long`` places values; rows without both ends are left out."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for row in rows:
        lo, hi = num(get(row, low)), num(get(row, high))
        if lo is not None and hi is not None:
            out.setdefault(str(get(row, group)), {})[str(get(row, series))] = (lo, hi)
    return out


def missing(reasons: Mapping[str, str], width: int = 70) -> str:
    """``not measured: a (why), b (why)`` of the series whose cells are ``None``, each reason cut to ``width``."""
    parts = [f"{name} ({_cut(why, width)})" if why else name for name, why in reasons.items()]
    return "not measured: " + "; ".join(parts) if parts else ""


def _cut(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def titled(what: str, data: Mapping[str, Any]) -> str:
    """``what (where)``: where the result was measured, as its JSON says (the GPU's name, else the host's cores);
    ``what`` alone when it does not say."""
    env = data.get("environment") or {}
    where = env.get("gpu") or data.get("gpu") or env.get("cpu")
    cores = (data.get("machine") or {}).get("cpu_count")
    where = where or (f"CPU, {cores} cores" if cores else "")
    return f"{what} ({where})" if where else what


# --- drawing ----------------------------------------------------------------------------------------------------


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, chart: Chart, path: Path, dpi: int = DPI) -> Path:
    fig = render(plt, chart)
    try:
        # No version stamp: the same data, the same bytes; optimize: smaller files for the repository, lossless.
        fig.savefig(path, dpi=dpi, metadata={"Software": None}, pil_kwargs={"optimize": True})
    finally:
        plt.close(fig)
    return path


def render(plt: Any, chart: Chart) -> Any:
    """The figure of ``chart``: one colour per series name across all its panels, and one legend (in the panel
    when there is one, else in a band under the title)."""
    cols = max(1, min(chart.cols, len(chart.panels)))
    rows = math.ceil(len(chart.panels) / cols) or 1
    names = list(dict.fromkeys(s for p in chart.panels for s in p.series))
    colours = {s: _colour(plt, i, len(names)) for i, s in enumerate(names)}
    note = "\n".join(textwrap.wrap(" ".join(p for p in (chart.note, _from(chart.source)) if p),
                                   int(chart.width * 15)))
    note_in = 0.16 * (note.count("\n") + 1) if note else 0.0
    ncol = max(1, min(len(names) + 2, int(chart.width // 2.2)))
    band_in = 0.17 * math.ceil((len(names) + 2) / ncol) if len(chart.panels) > 1 else 0.0
    height = 3.3 * rows + 0.5 + band_in + note_in
    fig, axes = plt.subplots(rows, cols, figsize=(chart.width, height), squeeze=False)
    for ax, panel in zip(axes.flat, chart.panels):
        _draw(ax, panel, colours)
    for ax in list(axes.flat)[len(chart.panels):]:
        ax.set_visible(False)
    if not chart.panels:
        fig.text(0.5, 0.5, "nothing measured", ha="center", va="center", fontsize=10)
    fig.suptitle(chart.title, fontsize=11, y=1 - 0.08 / height, va="top")
    legend = _legend(chart, colours, axes.flat)
    if legend and band_in:
        fig.legend(legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 1 - 0.34 / height),
                   ncol=ncol, fontsize=7, frameon=False)
    elif legend:
        axes[0][0].legend(legend.values(), legend.keys(), fontsize=7)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, va="bottom", ha="left")
    fig.tight_layout(rect=(0, note_in / height + 0.01, 1, 1 - (0.36 + band_in) / height))
    return fig


def _legend(chart: Chart, colours: Mapping[str, Any], axes: Iterable[Any]) -> dict[str, Any]:
    """Label -> handle: every series in its colour (a series no panel measured too: its x's need a key), then the
    panels' own entries (reference lines, the x)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    bars = {s for p in chart.panels if p.kind is not Kind.LINES for s in p.series}
    out = {s: Patch(color=c) if s in bars else Line2D([], [], color=c) for s, c in colours.items()}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            out.setdefault(label, handle)
    return out


def _from(source: str) -> str:
    return f"(from {source})" if source else ""


def _colour(plt: Any, i: int, n: int) -> Any:
    return plt.get_cmap("tab10" if n <= 10 else "tab20")(i % (10 if n <= 10 else 20))


def _draw(ax: Any, panel: Panel, colours: Mapping[str, Any]) -> None:
    ax.set_title(panel.title, fontsize=9)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.set_xlabel(panel.xlabel, fontsize=8)
    ax.tick_params(which="both", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    if panel.empty:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes, fontsize=9)
        return
    if panel.kind is Kind.LINES:
        _lines(ax, panel, colours)
    else:
        _bars(ax, panel, colours)
    if panel.log:
        ax.set_yscale("log")
        positive = [v for g in panel.cells.values() for v in g.values() if v is not None and v > 0]
        if positive and panel.kind is not Kind.LINES and panel.base is None:
            ax.set_ylim(bottom=10 ** math.floor(math.log10(min(positive))))
    if panel.ref is not None:
        line = ax.axvline if panel.kind is Kind.LINES else ax.axhline
        line(panel.ref, color="black", linewidth=0.8, linestyle="--", label=panel.ref_label or None)
    if panel.log:
        _plain_log_labels(ax.yaxis, ax.get_ylim())
    if panel.xlog:
        _plain_log_labels(ax.xaxis, ax.get_xlim())


def _plain_log_labels(axis: Any, limits: tuple[float, float]) -> None:
    """Log-axis labels as plain numbers (0.5, 2, 10, not 5 x 10^-1); on an axis of less than 1.5 decades also
    the 2s, 3s and 5s between the powers of ten, so that it has labels at all."""
    from matplotlib.ticker import FuncFormatter

    low, high = limits
    narrow = math.log10(high / low) < 1.5 if low > 0 else False

    def minor(v: float, _: Any) -> str:
        return f"{v:g}" if narrow and v > 0 and round(v / 10 ** math.floor(math.log10(v)), 6) in (2, 3, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _lines(ax: Any, panel: Panel, colours: Mapping[str, Any]) -> None:
    for name, (x, y) in panel.lines.items():
        ax.plot(x, y, color=colours[name], marker="o" if panel.markers else None, markersize=4,
                drawstyle="steps-post" if panel.steps else "default")
    if panel.xlog:
        ax.set_xscale("log", base=panel.xlog)
    ax.grid(axis="x", alpha=0.3)


def _bars(ax: Any, panel: Panel, colours: Mapping[str, Any]) -> None:
    groups, series = list(panel.cells), panel.series
    stacked = panel.kind is Kind.STACKED
    width = 0.8 if stacked else 0.8 / len(series)
    bottoms = [0.0] * len(groups)
    gaps = False
    for k, name in enumerate(series):
        offset = 0.0 if stacked else (k - (len(series) - 1) / 2) * width
        values = [panel.cells[g].get(name) for g in groups]
        xs = [i + offset for i, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        if stacked:
            ax.bar(xs, ys, width, bottom=[bottoms[i] for i, v in enumerate(values) if v is not None],
                   color=colours[name])
            bottoms = [b + (v or 0.0) for b, v in zip(bottoms, values)]
            continue
        base = panel.base or 0.0
        ax.bar(xs, [y - base for y in ys], width, bottom=base, color=colours[name])
        for i, v in enumerate(values):
            whisker = panel.spread.get(groups[i], {}).get(name)
            if v is None and name in panel.cells[groups[i]]:  # None: not measured; absent: does not apply
                gaps = True
                ax.text(i + offset, 0.01, "x", color=colours[name], ha="center", va="bottom", fontsize=8,
                        fontweight="bold", transform=ax.get_xaxis_transform())
            elif whisker is not None:  # a range, which need not hold the bar's value (a mean beside P50-P99)
                ax.plot([i + offset] * 2, whisker, color="black", linewidth=0.8, marker="_", markersize=5)
    if gaps:
        ax.plot([], [], "x", color="gray", label=MISSING)
    # Wrap each tick label to its share of the axes' width (about 17 characters an inch at this size).
    share = ax.get_position().width * ax.figure.get_figwidth() * 17 / max(1, len(groups))
    wrap = max(6, int(share))
    labels = ["\n".join(textwrap.fill(part, wrap, break_long_words=False) for part in g.split("\n")) for g in groups]
    ax.set_xticks(range(len(groups)), labels)
