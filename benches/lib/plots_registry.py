"""Which chart draws which result file, and where its PNG goes: ``REGISTRY``, one row per kind of result, matched
by the file's name (``<script>``, ``<script>_<slug>``, ``<script>_<slug>_<tag>``). ``benches/plot.py`` draws every
result a row matches; ``tests/unit/test_bench_plots.py`` fails for a committed result no row matches."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from benches.lib import plots_host, plots_kernels, plots_models
from benches.lib.plots import Chart
from benches.lib.results import SMOKE_SLUG

HOST_SLUGS = ("", "cpu")
"""The slugs of host-side results (``planner.json``, ``host_overhead_cpu.json``): drawn with the default slug's."""


@attrs.frozen
class Plot:
    """How one kind of result file is drawn: the stems of ``script`` whose tag (``""`` when untagged) matches one
    of ``tags`` (fnmatch), by ``chart`` into ``png`` (``{stem}``: the JSON's stem) beside the JSON."""

    script: str
    chart: Callable[[Mapping[str, Any], Path], Chart]
    tags: tuple[str, ...] = ("*",)
    png: str = "{stem}.png"

    def png_path(self, json_path: Path) -> Path:
        return json_path.with_name(self.png.format(stem=json_path.stem))


REGISTRY: tuple[Plot, ...] = (
    Plot("anymodule", plots_models.anymodule_chart),
    Plot("attention_kernels", plots_kernels.attention_chart),
    Plot("capture", plots_kernels.capture_chart),
    Plot("compile_start", plots_kernels.compile_start_chart),
    Plot("data_parallel", plots_models.data_parallel_chart),
    Plot("dense_buckets", plots_kernels.dense_buckets_chart),
    Plot("device_preprocess", plots_host.device_preprocess_chart),
    Plot("flex_attention", plots_kernels.flex_chart),
    Plot("generic_compile", plots_models.generic_compile_chart),
    Plot("floor", plots_models.floor_chart),
    Plot("host_overhead", plots_host.host_overhead_chart),
    Plot("kernel_profile", plots_kernels.kernel_profile_chart),
    Plot("long_items", plots_kernels.long_items_chart),
    Plot("neighbour", plots_kernels.neighbour_chart),
    Plot("planner", plots_host.planner_chart),
    Plot("planner_cost", plots_host.planner_cost_chart),
    Plot("planning", plots_models.planning_chart),
    Plot("preprocess_exactness", plots_host.preprocess_exactness_chart),
    Plot("preprocess_pool", plots_host.preprocess_pool_chart),
    Plot("wrap_cost", plots_host.wrap_cost_chart),
    # The untagged serving runs' plots kept their names of before this table (readme.py embeds them by name).
    Plot("serving", plots_models.serving_chart, tags=("", "inprocess", "server"), png="{stem}_images_per_s.png"),
    Plot("serving", plots_models.serving_chart),
    Plot("step3p7_tower", plots_models.step3p7_chart),
    Plot("towers", plots_models.families_chart, tags=("families*",)),  # first match wins: before the towers row
    Plot("towers", plots_models.towers_chart, png="{stem}_speedup.png"),
    Plot("traffic", plots_models.traffic_chart, png="{stem}_cdf.png"),
    Plot("varlen_slots", plots_kernels.varlen_slots_chart),
)


@attrs.frozen
class Result:
    """A result file's name, parsed: the row that draws it, the machine's slug and the run's tag."""

    path: Path
    plot: Plot
    slug: str
    tag: str

    @property
    def rest(self) -> str:
        """``<slug>_<tag>``, or ``<slug>`` when untagged: what ``--slug`` names."""
        return f"{self.slug}_{self.tag}" if self.tag else self.slug

    @property
    def png(self) -> Path:
        return self.plot.png_path(self.path)


def parse(path: Path) -> Result | None:
    """``path``'s row, slug and tag; ``None`` if no row draws it. The longest script name that prefixes the stem
    wins (``planner_cost`` is not ``planner`` of slug ``cost``)."""
    stem = Path(path).stem
    for script in sorted({p.script for p in REGISTRY}, key=len, reverse=True):
        if stem == script or stem.startswith(script + "_"):
            slug, _, tag = stem[len(script) + 1:].partition("_")
            plot = next((p for p in REGISTRY if p.script == script
                         and any(fnmatch.fnmatchcase(tag, t) for t in p.tags)), None)
            return Result(Path(path), plot, slug, tag) if plot else None
    return None


def known(results_dir: Path) -> list[Result]:
    """Every result JSON in ``results_dir`` that a row draws."""
    return [r for r in map(parse, sorted(Path(results_dir).glob("*.json"))) if r is not None]


def find_slug(results_dir: Path) -> str | None:
    """The slug of the newest untagged result of a GPU: neither the CPU smoke's, nor a host-side one, nor a tagged
    run's (``<script>_<gpu>_<tag>``: ``--slug <gpu>_<tag>`` draws those alone, ``--slug <gpu>`` with the rest)."""
    found = [r for r in known(results_dir) if not r.tag and r.slug not in (*HOST_SLUGS, SMOKE_SLUG)]
    return max(found, key=lambda r: r.path.stat().st_mtime).slug if found else None


def select(results_dir: Path, slug: str | None, host: bool) -> list[Result]:
    """The results of ``slug`` (its tagged runs too) and, with ``host``, the host-side ones."""
    return [r for r in known(results_dir)
            if (slug is not None and (r.rest == slug or r.rest.startswith(slug + "_")))
            or (host and r.slug in HOST_SLUGS)]
