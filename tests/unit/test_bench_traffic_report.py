"""benches/lib/traffic_report.py: the traffic report computes its ratios and targets, and reads the committed
runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benches.lib import plots_models  # noqa: E402
from benches.lib import traffic_report as report  # noqa: E402
from benches.lib.systems import System  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benches" / "results"


def _latencies(**values):
    return {System(k): v for k, v in values.items()}


def test_summarize_compares_with_every_reference_on_shared_requests():
    lat = _latencies(hf_sdpa=[10.0, 20.0, 30.0, 40.0], defaults=[2.0, 4.0, 45.0, math.nan],
                     adapter_eager=[8.0, 16.0, 24.0, 32.0])
    s = report.summarize(lat, {System.DEFAULTS: 1})
    d = s["defaults"]
    assert d["requests"] == 3 and d["errors"] == 1 and d["mean_ms"] == pytest.approx(17.0)
    assert d["compared_with_hf_sdpa"] == 3
    assert d["speedup_mean_vs_hf_sdpa"] == pytest.approx(60 / 51, abs=1e-3)
    assert d["worst_ratio_vs_hf_sdpa"] == pytest.approx(1.5) and d["worst_request_vs_hf_sdpa"] == 2
    assert d["slower_than_hf_sdpa"] == 1 and d["slower_than_adapter_eager"] == 1
    assert "speedup_mean_vs_hf_sdpa" not in s["hf_sdpa"]
    assert s["adapter_eager"]["speedup_mean_vs_hf_sdpa"] == pytest.approx(1.25)


def test_summarize_takes_a_floor_per_system():
    """Under sizes "new" each system ran a copy of its own: each is compared with the floor at its sizes."""
    lat = _latencies(hf_sdpa=[10.0, 20.0], defaults=[4.0, 6.0])
    shared = report.summarize(lat, {}, [2.0, 4.0])
    own = report.summarize(lat, {}, {System.HF_SDPA: [2.0, 4.0], System.DEFAULTS: [4.0, 5.0]})
    assert shared["defaults"]["mean_ratio_vs_floor"] == pytest.approx(1.75)
    assert own["defaults"]["mean_ratio_vs_floor"] == pytest.approx(1.1)
    assert own["defaults"]["worst_ratio_vs_floor"] == pytest.approx(1.2)
    assert own["hf_sdpa"]["mean_ratio_vs_floor"] == shared["hf_sdpa"]["mean_ratio_vs_floor"] == pytest.approx(5.0)
    assert "mean_ratio_vs_shape_floor" not in own["defaults"]


def test_targets_read_the_defaults_row():
    doc = {"systems": {"defaults": {"speedup_mean_vs_hf_sdpa": 2.7, "speedup_p99_vs_hf_sdpa": 2.4,
                                    "slower_than_hf_sdpa": 0}},
           "graph_stats": {"defaults": {"padded_share": 0.12}},
           "startup": {"cold": {"capture_seconds": 50.0}, "warm": {"error": "timed out"}}}
    got = {t["target"]: t["met"] for t in report.check_targets("qwen2_5_vl_7b", doc)}
    assert got == {"mean speedup vs HF sdpa": True, "P99 speedup vs HF sdpa": False,
                   "requests slower than HF sdpa": True, "padded share": False, "cold capture s": True,
                   "warm capture s (second process)": None}
    assert "cold capture s" not in {t["target"] for t in report.check_targets("qwen3_vl_8b", doc)}


def test_the_report_reads_a_single_tower_document():
    """The traffic JSON of before both towers ran in one file held one tower's document at the top level (the
    files of that layout are in git's history); the system table, the plot's lines and the README block read
    that layout as they read a tower of the two-tower file."""
    two = json.loads((RESULTS / "traffic_nvidia-h200.json").read_text())
    data = {"environment": two["environment"], **two["towers"]["qwen2_5_vl_7b"]}
    assert list(report.tower_docs(data)) == ["qwen2_5_vl_7b"]
    assert report.render(data).count("| HF eager (sdpa) | ") == 1
    assert "Qwen2.5-VL-7B" in report.headline(data) and "Qwen3-VL-8B" not in report.headline(data)
    ((baseline, latency, ratios),) = plots_models.traffic_lines(data).values()
    assert baseline == report.baseline_of(data) == "hf_sdpa" and "defaults" in ratios
    assert all(y[-1] == 1.0 for _, y in latency.values())


def test_the_report_reads_the_committed_two_tower_run():
    data = json.loads((RESULTS / "traffic_nvidia-h200.json").read_text())
    assert list(report.tower_docs(data)) == ["qwen2_5_vl_7b", "qwen3_vl_8b"]
    headline = report.headline(data)
    assert "Qwen2.5-VL-7B" in headline and "Qwen3-VL-8B" in headline and "target" in headline


def test_route_is_the_difference_of_two_stats_over_every_path():
    from benches.lib.traffic_report import route

    before = {"paths": {"a": {"replays": {"64": 2}}, "b": {"replays": {}}}, "eager_reasons": {"x": 1},
              "cost_feedback": {"explored": 4}}
    after = {"paths": {"a": {"replays": {"64": 3, "128": 1}}, "b": {"replays": {"64": 1}}},
             "eager_reasons": {"x": 1, "y": 2}, "cost_feedback": {"explored": 5}}
    assert route(before, after) == {"replays": {"64": 2, "128": 1}, "eager": {"y": 2}, "explored": 1}
    assert route(after, after) == {"replays": {}, "eager": {}}
