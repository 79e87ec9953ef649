"""The photo trace of ``benches/traffic.py`` (issue 32) on the CPU: the trace follows its documented distribution
and each tower's processor cap, the per-request floor adds its three parts as documented, and a smoke run of the
photo trace writes the floor ratios and the issue's targets."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benches import traffic  # noqa: E402
from benches.lib import trace  # noqa: E402
from benches.lib.request_floor import VALUES_PER_ROW, TowerShape, request_floor  # noqa: E402
from benches.lib.results import SMOKE_SLUG  # noqa: E402
from benches.lib.systems import TowerBench  # noqa: E402
from benches.lib.towers import TOWERS  # noqa: E402

FAST = ["--cpu-smoke", "--runs", "1", "--warmup", "0"]


def test_photo_trace_follows_its_distribution():
    photos = trace.generate_trace(3000, seed=1, kind="photo")
    assert photos == trace.generate_trace(3000, seed=1, kind="photo")
    assert trace.generate_trace(50, seed=1, kind="photo") == photos[:50]
    assert photos[:50] != trace.generate_trace(50, seed=1)  # another distribution than the chat trace
    counts = np.bincount([len(r) for r in photos], minlength=4)[1:] / len(photos)
    assert np.allclose(counts, list(trace.PHOTO_ITEMS.values()), atol=0.03)
    sides = np.array([(v.height, v.width) for r in photos for v in r])
    assert sides.min() >= trace.PHOTO_SIDES[0] and sides.max() <= trace.PHOTO_SIDES[1]
    assert {v.kind for r in photos for v in r} == {"photo"}
    with pytest.raises(ValueError, match="expected one of"):
        trace.generate_trace(1, kind="video")


@pytest.mark.parametrize("tower", ["qwen2_5_vl_7b", "qwen3_vl_8b", "glm4v"])
def test_photo_caps_are_the_processors(tower):
    geom = TOWERS[tower].geometry(False)
    caps = trace.photo_caps(tower, geom)
    assert caps.image * geom.factor**2 == trace.PHOTO_MAX_PIXELS[tower]
    sizes = caps.sizes([trace.Visual(3000, 4000)], geom)  # 12 MP: at or just under the cap
    assert sizes.tokens * geom.factor**2 <= trace.PHOTO_MAX_PIXELS[tower]
    assert sizes.tokens * geom.factor**2 > 0.85 * min(12e6, trace.PHOTO_MAX_PIXELS[tower])


@pytest.mark.parametrize("tower", ["qwen3_vl_8b", "glm4v"])
def test_fresh_requests_meet_only_new_sizes_near_the_drawn_ones(tower):
    """``--sizes new``: every system's copy of a request has patch-row counts no earlier call had, near the drawn
    ones (a few percent for photos), and the first copy is the request as drawn where its sizes are new."""
    geom = TOWERS[tower].geometry(False)
    caps = trace.photo_caps(tower, geom)
    seen: set[int] = set()
    met: list[int] = []
    shifts: list[float] = []
    moved = total = 0
    for request in trace.generate_trace(40, seed=3, kind="photo"):
        drawn = trace.rows_of(request, geom, caps)
        fresh_drawn = all(r not in seen for r in drawn) and len(set(drawn)) == len(drawn)
        copies = []
        for _ in range(3):  # three systems
            copy, reused = trace.fresh_request(request, geom, caps, seen)
            assert reused == 0 and len(copy) == len(request)
            copies.append(copy)
            rows = trace.rows_of(copy, geom, caps)
            shifts += [abs(r / d - 1) for r, d in zip(rows, drawn)]
            moved, total = moved + sum(abs(r - d) for r, d in zip(rows, drawn)), total + sum(drawn)
            met += rows
        if fresh_drawn:
            assert copies[0] == tuple(request)
    assert len(met) == len(set(met)) and seen == set(met)  # no count met twice
    # the rows that carry the time barely move; a small image may move more (fewer counts lie near it)
    assert moved / total < 0.01 and np.median(shifts) < 0.02 and max(shifts) < 0.5, (moved / total, max(shifts))


def test_request_floor_adds_its_parts():
    shape = TowerShape(params=10**9, depth=4, hidden=1024, heads=16, full_layers=1, window_rows=64)
    rates = {"matmul_tflops": 500.0, "attention_tflops": 400.0, "bandwidth_gbs": 4000.0}
    grids = [(1, 32, 32), (2, 8, 16)]  # a 1024-row image and a two-frame video of 128 rows each
    rows = 1024 + 256
    got = request_floor(shape, grids, rates)
    attention = 4.0 * 1024 * (1024**2 + 2 * 128**2) + 3 * 4.0 * 1024 * (1024 * 64 + 2 * 128 * 64)
    assert got["matmul_ms"] == pytest.approx(2e9 * rows / 500e12 * 1e3, abs=1e-4)
    assert got["attention_ms"] == pytest.approx(attention / 400e12 * 1e3, abs=1e-4)
    assert got["elementwise_ms"] == pytest.approx(rows * 4 * VALUES_PER_ROW * 1024 * 2 / 4000e9 * 1e3, abs=1e-4)
    assert got["floor_ms"] == pytest.approx(got["matmul_ms"] + got["attention_ms"] + got["elementwise_ms"], abs=1e-3)


def test_tower_shapes_read_each_config():
    q25 = TowerShape.of(TOWERS["qwen2_5_vl_7b"].make_config(False), 1)
    assert (q25.depth, q25.hidden, q25.heads, q25.full_layers, q25.window_rows) == (32, 1280, 16, 4, 64)
    q3 = TowerShape.of(TOWERS["qwen3_vl_8b"].make_config(False), 1)
    assert (q3.depth, q3.full_layers, q3.window_rows) == (27, 27, None)
    glm = TowerShape.of(TOWERS["glm4v"].make_config(False), 1)
    assert (glm.depth, glm.hidden, glm.heads, glm.window_rows) == (24, 1536, 12, None)


def test_traffic_photo_smoke(tmp_path, monkeypatch):
    monkeypatch.setattr(TowerBench, "defaults_options", {"verify": False})
    traffic.main(FAST + ["--trace", "photo", "--results-dir", str(tmp_path), "--towers", "glm4v", "--requests", "2",
                         "--warmup-requests", "1", "--no-warm-capture", "--min-requests", "2"])
    data = json.loads((tmp_path / f"traffic_{SMOKE_SLUG}_photo.json").read_text())
    doc = data["towers"]["glm4v"]
    assert doc["trace"]["kind"] == "photo" and doc["trace"]["completed"] == 2
    assert set(doc["systems"]) == {"hf_sdpa", "defaults", "adapter_eager"}
    assert len(doc["per_request"]["floor"]) == 2 and all(f["floor_ms"] > 0 for f in doc["per_request"]["floor"])
    for s, e in doc["systems"].items():
        assert e["compared_with_floor"] == 2 and e["worst_ratio_vs_floor"] >= e["mean_ratio_vs_floor"] > 0, s
    assert math.isfinite(doc["floor"]["rates"]["attention_tflops"])
    # the second floor, at each request's sizes: the tiny tower's block products and attention timed on its ladder
    shape_rates = doc["floor"]["shape_rates"]
    assert len(shape_rates["block_matmul_ms"]) == len(shape_rates["rows"]) == len(shape_rates["attention_ms"])
    assert shape_rates["linears"] and all(f["shape_floor_ms"] > 0 for f in doc["per_request"]["floor"])
    assert all(e["compared_with_shape_floor"] == 2 for e in doc["systems"].values())
    assert {t["target"] for t in doc["targets"]} == {"mean speedup vs HF sdpa", "requests slower than HF sdpa",
                                                     "worst request / its floor"}
    table = (tmp_path / f"traffic_{SMOKE_SLUG}_photo.md").read_text()
    assert "### targets (issue 32)" in table and "worst x floor" in table and "floor rates: matmul" in table
    assert "against the floor at each request's sizes" in table
    assert "worst request / floor" in table and "(target >= 2.5x)" not in table
    # two passes: sizes new to every system (the top level), then the same requests at sizes seen before
    assert doc["sizes"] == "new" and set(doc["per_request"]["extra_tokens"]) == set(doc["systems"])
    # ... each system against the floor at the sizes it ran (its copy a few rows wider or narrower than the first's)
    own = doc["per_request"]["system_floors"]
    assert set(own) == set(doc["systems"]) and all(len(v["floor_ms"]) == len(v["shape_floor_ms"]) == 2
                                                    for v in own.values())
    for s, extra in doc["per_request"]["extra_tokens"].items():
        for i, x in enumerate(extra):
            if x == 0:  # the same sizes as the first system's: the request's own floor
                assert own[s]["floor_ms"][i] == pytest.approx(doc["per_request"]["floor"][i]["floor_ms"], abs=1e-4)
    seen = doc["sizes_passes"]["seen"]
    assert seen["sizes"] == "seen" and seen["trace"]["completed"] == 2 and set(seen["systems"]) == set(doc["systems"])
    assert {t["target"] for t in seen["targets"]} == {t["target"] for t in doc["targets"]}
    assert "sizes new to every system:" in table and "sizes seen before" in table


def test_long_items_smoke(tmp_path):
    from benches import long_items

    assert [long_items.grid_of(b) for b in (16, 32, 2048, 16384)] == [
        (1, 8, 8), (1, 8, 16), (1, 64, 128), (1, 256, 256)]
    data = long_items.main(FAST + ["--results-dir", str(tmp_path), "--runs", "1"])
    budgets = data["towers"]["qwen3_vl_8b"]["budgets"]
    assert set(budgets) == {"16", "32", "64"}
    for b, e in budgets.items():
        assert e["rows"] == 4 * int(b) and all(isinstance(e[k], float) for k in (
            "hf_sdpa_ms", "eager_ms", "eager_varlen_ms", "graph_ms")), e
        assert "eager_compiled_ms" not in e  # the CPU smoke captures nothing: no compiled blocks to run
    doc = data["towers"]["qwen3_vl_8b"]
    assert doc["compiled_eager"]["status"] == "off" and "static mode" in doc["compiled_eager"]["reason"]
    table = (tmp_path / f"long_items_{SMOKE_SLUG}.md").read_text()
    assert "graph replay ms" in table and "compiled blocks off (runner in static mode" in table


def test_neighbour_smoke(tmp_path, monkeypatch):
    from benches import neighbour

    monkeypatch.setattr(neighbour, "GRAPHED_OPTIONS", {"verify": False})
    data = neighbour.main(FAST + ["--results-dir", str(tmp_path), "--rounds", "2"])
    assert set(data["phases"]) == set(neighbour.PHASES)
    for phase in data["phases"].values():
        assert phase["lm_first"]["runs"] == 2 and phase["tower"]["median_ms"] > 0


def test_shape_floor_reads_its_measured_times_between_ladder_points():
    """``benches.lib.shape_floor``: block products at the request's rows on the log-log line between ladder
    points (depth times), products outside the blocks at the peak rate, full-attention layers at the measured
    time of each sequence's length (scaled by L^2 past the ladder), windowed layers and element-wise work as the
    peak floor has them; and never below what the peak floor's rates allow where the times were measured at peak."""
    from benches.lib.shape_floor import shape_floor
    from encgraph.packing.crossover import loglog_at  # the cost model's own reading of measured times

    assert loglog_at([100, 400], [1.0, 4.0], 200) == pytest.approx(2.0)  # a straight line in log-log
    assert loglog_at([100, 400], [1.0, 16.0], 200) == pytest.approx(4.0)
    assert loglog_at([100, 400], [1.0, 4.0], 50) == pytest.approx(0.5)  # below: the nearest pair's slope (1)
    assert loglog_at([100, 400], [1.0, 16.0], 800) == pytest.approx(64.0)  # above: its slope (2, as L^2)

    shape = TowerShape(params=10**9, depth=4, hidden=1024, heads=16, full_layers=1, window_rows=64)
    rates = {"matmul_tflops": 500.0, "attention_tflops": 400.0, "bandwidth_gbs": 4000.0}
    grids = [(1, 32, 32), (2, 8, 16)]  # 1024 + 2 x 128 rows
    ladder = {"rows": [128, 1024, 2048], "block_matmul_ms": [0.1, 0.4, 0.8], "attention_ms": [0.01, 0.2, 0.8]}
    block_params = 6 * 10**8  # 60% of the weights in the blocks: 40% stay at the peak rate
    got = shape_floor(shape, grids, request_floor(shape, grids, rates), rates, ladder, block_params)
    peak = request_floor(shape, grids, rates)
    rows = 1024 + 256
    blocks = math.exp(math.log(0.4) + math.log(rows / 1024) / math.log(2) * math.log(2.0)) * 4
    assert got["shape_matmul_ms"] == pytest.approx(blocks + 0.4 * peak["matmul_ms"], abs=1e-4)
    windowed = 3 * 4.0 * 1024 * (1024 * 64 + 2 * 128 * 64) / 400e12 * 1e3
    assert got["shape_attention_ms"] == pytest.approx(0.2 + 2 * 0.01 + windowed, abs=1e-4)
    assert got["shape_floor_ms"] == pytest.approx(
        got["shape_matmul_ms"] + got["shape_attention_ms"] + peak["elementwise_ms"], abs=1e-3)


def test_shape_floor_is_reported_beside_the_floor():
    """``traffic_report.summarize`` with a second floor: its own keys, requests without one left out."""
    from benches.lib import traffic_report as report
    from benches.lib.systems import System

    lat = {System.DEFAULTS: [2.0, 3.0, 6.0]}
    got = report.summarize(lat, {}, [1.0, 2.0, 5.0], [1.8, float("nan"), 5.5])[System.DEFAULTS.value]
    assert got["worst_ratio_vs_floor"] == 2.0 and got["within_floor_bound"] == 1  # 2.0, 1.5, 1.2
    assert got["compared_with_shape_floor"] == 2 and got["worst_ratio_vs_shape_floor"] == pytest.approx(1.111, abs=1e-3)
    assert got["within_shape_floor_bound"] == 2


def test_block_linears_are_timed_at_aligned_widths():
    """The second floor times a block's products at the widths encgraph runs them (a misaligned MLP is padded to a
    multiple of 8: Qwen2.5-VL's 3420 runs as 3424), not at a width that keeps cuBLAS off its fast kernels."""
    import torch

    from benches.lib.shape_floor import block_linears

    block = torch.nn.Sequential(torch.nn.Linear(1280, 3420), torch.nn.Linear(3420, 1280), torch.nn.Linear(16, 48))
    tower = torch.nn.Module()
    tower.blocks = torch.nn.ModuleList([block])
    assert block_linears(tower) == [(1280, 3424), (3424, 1280), (16, 48)]
    assert block_linears(torch.nn.Module()) == []


def test_measurements_run_on_a_thread_of_their_own():
    """``in_fresh_thread``: the floor's kernels are timed off the capturing thread (torch keeps cuDNN's attention
    plans per thread), with the result or the exception handed back."""
    import threading

    import pytest

    from benches.lib.timing import in_fresh_thread

    caller = threading.get_ident()
    assert in_fresh_thread(threading.get_ident) != caller
    assert in_fresh_thread(lambda: 41 + 1) == 42

    def boom():
        raise KeyError("measured nothing")

    with pytest.raises(KeyError, match="measured nothing"):
        in_fresh_thread(boom)


def test_traffic_defaults_option_is_an_ab_run(tmp_path):
    """``--defaults-option NAME=VALUE``: defaults built with that runner option, recorded and named in the table;
    refused beside the warm capture, whose second process builds graphed() bare."""
    assert traffic._option("max_items=16") == ("max_items", 16)
    assert traffic._option("compile='auto'") == ("compile", "auto")
    assert traffic._option("mode=graph") == ("mode", "graph")  # not a literal: the plain string
    with pytest.raises(argparse.ArgumentTypeError):
        traffic._option("16")
    with pytest.raises(SystemExit, match="--no-warm-capture"):
        traffic.main(FAST + ["--defaults-option", "max_items=4", "--results-dir", str(tmp_path)])
    traffic.main(FAST + ["--trace", "photo", "--results-dir", str(tmp_path), "--towers", "qwen3_vl_8b", "--requests",
                         "1", "--warmup-requests", "0", "--no-warm-capture", "--min-requests", "1", "--sizes", "new",
                         "--defaults-option", "verify=False", "--defaults-option", "max_items=2", "--tag", "ab"])
    doc = json.loads((tmp_path / f"traffic_{SMOKE_SLUG}_ab.json").read_text())["towers"]["qwen3_vl_8b"]
    assert doc["defaults_options"] == {"verify": False, "max_items": 2} and doc["systems"]["defaults"]["requests"] == 1
    table = (tmp_path / f"traffic_{SMOKE_SLUG}_ab.md").read_text()
    assert "defaults built with graphed(tower, verify=False, max_items=2): not the library's defaults" in table
