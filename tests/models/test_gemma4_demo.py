"""``encgraph demo --model gemma4``: the shipped tiny Gemma-4 tower end to end on the CPU, each path's ladder,
plan and replays printed, every item equal to the tower's own forward, an image over the image ladder eager."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the Gemma-4 adapter")

from encgraph.cli import main
from tests.models.fixtures_multipath import one_thread  # noqa: F401  (autouse)


def test_demo_gemma4_prints_each_path(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--model", "gemma4", "--quiet", "--repeats", "1", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "encgraph demo: gemma4" in out and "runner mode static" in out
    assert "ladders, one per path (tokens; 0: the path skipped): image 0, 140, 280; video 0, 70, 140" in out
    assert "items: 6 (5 images, 1 video)" in out
    assert "padded share on path 'image'" in out and "padded share on path 'video'" in out
    image = re.search(r"^  image: (\d+) tokens, replays (.+); (\d+) items? eager", out, re.M)
    video = re.search(r"^  video: (\d+) tokens, replays (.+); (\d+) items? eager", out, re.M)
    assert image and video, out
    assert image.group(3) == "1" and video.group(3) == "0" and video.group(2) != "none"
    rows = re.findall(r"^\s+(\d+)\s+(\S+e[-+]\d+)\s+batch (\d+), (budget .+|eager \(.*\))$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(6)), out
    assert all(float(r[1]) < 1e-5 for r in rows), rows
    assert rows[5][3].startswith("eager") and "video=" in rows[4][3]
    assert "all 6 items agree within 1e-05 (float32)" in out


def test_demo_gemma4_refuses_one_ladder(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--model", "gemma4", "--budgets", "64,128"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "one ladder per path" in err
