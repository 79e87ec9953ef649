"""benches/preprocess_exactness.py on one small image per family (the vision libraries' CI step: it needs
torchvision, which the main step's CPU torch cannot import beside it)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchvision")


def test_the_two_backends_agree_on_a_small_image(tmp_path, monkeypatch):
    """The script on one small image per family: both backends ran, their shapes and Qwen's grids agree, and the
    differences are a few 8-bit steps at most (the full run is committed)."""
    from benches import preprocess_exactness as pe

    monkeypatch.setattr(pe, "SIZES", ((160, 120),))
    doc = pe.main(["--runs", "1", "--results-dir", str(tmp_path)])
    for family in pe.FAMILIES:
        row = doc["families"][family]["sizes"]["160x120"]
        assert row["same_shape"] and row.get("same_grid", True), row
        assert row["max_in_8bit_steps"] <= 8, row
    assert "| qwen2_5_vl | 160x120 |" in (tmp_path / "preprocess_exactness_cpu.md").read_text()


def test_device_preprocess_bench_times_and_profiles_the_device_half(tmp_path, monkeypatch):
    """benches/device_preprocess.py on the CPU with two small images: every run has its calls (threads x
    per-thread) and a rate, the profile names torch ops, and the markdown has each family's table."""
    from benches import device_preprocess as dp

    monkeypatch.setattr(dp, "SIZES", ((160, 120), (90, 200)))
    doc = dp.main(["--device", "cpu", "--per-thread", "2", "--results-dir", str(tmp_path)])
    for family in ("siglip_so400m_384", "qwen2_5_vl"):
        row = doc["families"][family]
        assert [(r["load"], r["threads"], r["calls"]) for r in row["runs"]] == [("idle", 1, 2), ("idle", 8, 16)]
        assert all(r["images_per_s"] > 0 and r["p99_ms"] >= r["median_ms"] > 0 for r in row["runs"])
        assert any(p["name"].startswith("aten::") for p in row["profile_idle_8"])
        assert row["host_torchvision_ms"] > 0
    text = (tmp_path / "device_preprocess_cpu.md").read_text()
    assert "## siglip_so400m_384" in text and "| idle | 8 |" in text
