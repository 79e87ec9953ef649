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
