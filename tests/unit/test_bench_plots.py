"""benches/plot.py and benches/lib/plots*.py (the registry, the charts, the renderer): every committed result JSON
has a plot, drawn from the JSON; file names parse into rows, slugs and tags; a chart's values are the JSON's,
unmeasured cells are marked and named; without matplotlib the script says so and writes nothing."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import shutil
from pathlib import Path

import pytest

from benches import plot
from benches.lib import plots, plots_kernels, plots_models
from benches.lib import plots_registry as registry
from benches.lib.results import SMOKE_SLUG, median_of
from benches.lib.systems import System

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benches" / "results"
COMMITTED = sorted(RESULTS.glob("*.json"))
TEST_DPI = 30  # the layout and every value are drawn as at 100 dpi; fewer pixels keep the test fast


def test_the_committed_results_are_found():
    assert len(COMMITTED) >= 20  # a glob that finds nothing would pass the per-file tests vacuously


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_every_committed_result_has_a_plot_entry(path):
    """A new benchmark's result without a row in ``REGISTRY`` fails here."""
    assert registry.parse(path) is not None, f"no row of benches/lib/plots_registry.py's REGISTRY draws {path.name}"


def _draw_all(paths: list[Path]) -> dict[str, Path]:
    """``paths`` drawn in this process (one of :func:`drawn`'s workers)."""
    plt = plots.pyplot()
    return {path.name: plot.draw(registry.parse(path), plt, TEST_DPI) for path in paths}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every committed result drawn in a copy of the results directory (a result may read its siblings), in two
    processes (about 0.4 s a chart, most of it matplotlib's layout: 27 s in one process for 65 results)."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("results")
    for path in COMMITTED:
        shutil.copy(path, out / path.name)
    paths = [out / path.name for path in COMMITTED if registry.parse(path) is not None]
    spawn = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:
        return {name: png for part in pool.map(_draw_all, [paths[0::2], paths[1::2]]) for name, png in part.items()}


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_every_committed_result_draws_a_png(drawn, path):
    png = drawn[path.name]
    assert png.parent != RESULTS and png.name == registry.parse(path).png.name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000


def test_every_committed_plot_is_in_the_repository():
    """The PNGs beside the results are the ones the registry draws (``python benches/plot.py`` made them)."""
    missing = [r.png.name for r in map(registry.parse, COMMITTED) if r is not None and not r.png.exists()]
    assert not missing, f"run `python benches/plot.py` and commit {missing}"


@pytest.mark.parametrize(("name", "script", "slug", "tag", "png"), [
    ("planner.json", "planner", "", "", "planner.png"),
    ("planner_cost.json", "planner_cost", "", "", "planner_cost.png"),
    ("host_overhead_cpu.json", "host_overhead", "cpu", "", "host_overhead_cpu.png"),
    ("towers_nvidia-h200.json", "towers", "nvidia-h200", "", "towers_nvidia-h200_speedup.png"),
    ("towers_gpu-a_families-step3p7.json", "towers", "gpu-a", "families-step3p7",
     "towers_gpu-a_families-step3p7.png"),
    ("serving_nvidia-h200_server.json", "serving", "nvidia-h200", "server",
     "serving_nvidia-h200_server_images_per_s.png"),
    ("serving_nvidia-h200_server_repeats.json", "serving", "nvidia-h200", "server_repeats",
     "serving_nvidia-h200_server_repeats.png"),
    ("traffic_nvidia-h200_photo.json", "traffic", "nvidia-h200", "photo", "traffic_nvidia-h200_photo_cdf.png"),
])
def test_result_names_parse(name, script, slug, tag, png):
    result = registry.parse(Path("/r") / name)
    assert (result.plot.script, result.slug, result.tag, result.png.name) == (
        script, slug, tag, png)


def test_families_and_seed_towers_runs_have_their_own_charts():
    assert registry.parse(Path("towers_g_families.json")).plot.chart is plots_models.families_chart
    assert registry.parse(Path("towers_g_cut-1.json")).plot.chart is plots_models.towers_chart
    assert registry.parse(Path("unknown_bench_g.json")) is None


def test_selection_by_slug(tmp_path):
    for stem in ("towers_gpu-a", "traffic_gpu-a_photo", "capture_gpu-b", "planner", "host_overhead_cpu",
                 f"towers_{SMOKE_SLUG}"):
        (tmp_path / f"{stem}.json").write_text("{}")

    def names(results: list[registry.Result]) -> list[str]:
        return sorted(r.path.stem for r in results)

    assert registry.find_slug(tmp_path) in ("gpu-a", "gpu-b")  # the newest untagged GPU result's
    assert names(registry.select(tmp_path, "gpu-a", host=True)) == [
        "host_overhead_cpu", "planner", "towers_gpu-a", "traffic_gpu-a_photo"]
    assert names(registry.select(tmp_path, "gpu-a_photo", host=False)) == ["traffic_gpu-a_photo"]
    assert names(registry.select(tmp_path, SMOKE_SLUG, host=False)) == [f"towers_{SMOKE_SLUG}"]


def test_without_matplotlib_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    shutil.copy(RESULTS / "planner.json", tmp_path / "planner.json")
    monkeypatch.setattr(plot, "pyplot", lambda: None)
    assert plot.main(["--results-dir", str(tmp_path)]) == []
    assert "matplotlib is not installed" in capsys.readouterr().out and not list(tmp_path.glob("*.png"))


def test_the_speedup_bars_are_the_json_medians_ratios():
    data = json.loads((RESULTS / "towers_nvidia-h200.json").read_text())
    chart = plots_models.towers_chart(data, RESULTS / "towers_nvidia-h200.json")
    run = [s for s in plots_models.BAR_SYSTEMS if s.value in data["options"]["systems"]]
    for panel, tower in zip(chart.panels, data["towers"].values(), strict=True):
        assert panel.title == tower["label"] and list(panel.cells) == list(tower["cases"])
        for case, cells in panel.cells.items():
            systems = tower["cases"][case]["systems"]
            assert list(cells) == [s.label for s in run]
            for s in run:
                want = systems.get(s.value)
                value = cells[s.label]
                if median_of(want) is None:
                    assert value is None and s.value in chart.note  # marked, and named in the note
                else:
                    assert value == pytest.approx(median_of(systems["hf_sdpa"]) / median_of(want))


def test_the_attention_bars_are_the_json_rates_and_the_unmeasured_kernels_are_named():
    data = json.loads((RESULTS / "attention_kernels_nvidia-h200.json").read_text())
    chart = plots_kernels.attention_chart(data, RESULTS / "attention_kernels_nvidia-h200.json")
    plotted = {(p.title.split(":")[0], g, s): v for p in chart.panels for g, c in p.cells.items() for s, v in c.items()}
    for row in data["rows"]:
        for kernel, entry in row.items():
            if isinstance(entry, dict) and ("tflops" in entry or "eager_tflops" in entry):
                rate = entry.get("tflops", entry.get("eager_tflops"))
                assert plotted[(row["geometry"], row["layout"], kernel.replace("_eager", " eager"))] == rate
    kernels = {k for r in data["rows"] for k, v in r.items() if isinstance(v, dict)}
    never = {k for k in kernels if all("error" in r.get(k, {"error": "absent"}) for r in data["rows"])}
    assert never  # this run holds kernels that failed in every row
    for kernel in never:
        name = kernel.replace("_eager", " eager")
        assert name in chart.note and all(name not in c for p in chart.panels for c in p.cells.values())


def test_a_missing_cell_is_an_x_in_the_legend_and_an_absent_one_is_nothing():
    pytest.importorskip("matplotlib")
    plt = plots.pyplot()
    chart = plots.Chart("t", (plots.Panel("p", "ms", cells={"a": {"x": 1.0, "y": None}, "b": {"x": 2.0}}),))
    fig = plots.render(plt, chart)
    try:
        ax = fig.axes[0]
        assert plots.MISSING in ax.get_legend_handles_labels()[1]
        assert [t.get_text() for t in ax.texts] == ["x"]  # a's y, not b's
    finally:
        plt.close(fig)


def test_the_floor_reads_the_towers_run_beside_it(tmp_path):
    data = json.loads((RESULTS / "floor_nvidia-h200.json").read_text())
    alone = plots_models.floor_chart(data, tmp_path / "floor_nvidia-h200.json")
    beside = plots_models.floor_chart(data, RESULTS / "floor_nvidia-h200.json")
    assert all(set(next(iter(p.cells.values()))) == {"matmul floor"} for p in alone.panels)
    assert "the floor alone" in alone.note and System.HF_SDPA.label in next(iter(beside.panels[0].cells.values()))


@pytest.mark.parametrize("row", registry.REGISTRY, ids=lambda p: f"{p.script}-{'|'.join(p.tags)}")
def test_a_run_cut_short_before_any_measurement_still_draws(row, tmp_path):
    """A script flushes its JSON as it goes: a run that ended before measuring anything still gets a picture."""
    pytest.importorskip("matplotlib")
    plt = plots.pyplot()
    chart = row.chart({"environment": {"gpu": "G"}}, tmp_path / f"{row.script}_g.json")
    assert plots.save(plt, chart, tmp_path / "cut.png", TEST_DPI).stat().st_size > 0


def test_the_long_items_bars_are_the_json_times_and_its_errors_are_named():
    """No long_items result is committed yet: its chart reads the layout its script documents."""
    doc = {"environment": {"gpu": "G"}, "towers": {"t": {"label": "T", "budgets": {
        "4096": {"hf_sdpa_ms": 9.5, "eager_ms": 7.25, "eager_varlen_ms": 8.0, "graph_ms": "OutOfMemoryError: x"},
        "1024": {"hf_sdpa_ms": 2.5, "eager_ms": 2.0, "eager_varlen_ms": 2.25, "eager_compiled_ms": 1.75,
                 "graph_ms": 1.5},
        "16384": {"skipped": "skipped: time budget spent"}}}}}
    chart = plots_kernels.long_items_chart(doc, Path("long_items_g.json"))
    (panel,) = chart.panels
    assert list(panel.cells) == ["1024", "4096", "16384"]  # by budget, not as measured (largest first)
    assert panel.cells["1024"] == {"HF sdpa": 2.5, "eager (measured kernels)": 2.0, "eager (Flash varlen)": 2.25,
                                   "eager (compiled blocks)": 1.75, "graph replay": 1.5}
    assert panel.cells["4096"]["graph replay"] is None and panel.cells["4096"]["eager (measured kernels)"] == 7.25
    assert panel.cells["4096"]["eager (compiled blocks)"] is None  # not engaged (or not measured): no bar
    assert "OutOfMemoryError" in chart.note and "time budget spent" in chart.note
