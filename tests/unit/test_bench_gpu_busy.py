"""benches/lib/gpu_busy.py on the CPU: nvidia-smi's utilization samples parsed, summarised and pooled over runs, the
sampler driven against a stand-in ``nvidia-smi`` (a script that prints like the real one, forever, until stopped),
and the serving report's line."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benches import serving  # noqa: E402
from benches.lib.gpu_busy import GpuBusy, merge_busy, nvml_index, parse_samples, summarize_busy  # noqa: E402


def test_samples_are_parsed_and_what_is_not_a_number_is_left_out():
    assert parse_samples("87\n100\n[N/A]\n\n 42 \n") == [87.0, 100.0, 42.0]
    assert summarize_busy([50.0, 100.0, 100.0, 70.0]) == {"busy_pct_mean": 80.0, "busy_pct_p50": 85.0,
                                                          "share_at_100": 0.5, "samples": 4}
    assert "skipped" in summarize_busy([])


def test_runs_pool_weighted_by_their_samples():
    a = {"busy_pct_mean": 90.0, "busy_pct_p50": 90.0, "share_at_100": 0.5, "samples": 30}
    b = {"busy_pct_mean": 60.0, "busy_pct_p50": 60.0, "share_at_100": 0.0, "samples": 10}
    assert merge_busy([a, b, {"skipped": "x"}]) == {"busy_pct_mean": 82.5, "busy_pct_p50": 75.0,
                                                    "share_at_100": 0.375, "samples": 40}
    assert merge_busy([{"skipped": "no nvidia-smi"}]) == {"skipped": "no nvidia-smi"}


def test_the_nvidia_smi_index_follows_cuda_visible_devices():
    assert nvml_index(0, "") == 0 and nvml_index(1, "") == 1
    assert nvml_index(0, "3,1") == 3 and nvml_index(1, "3,1") == 1
    assert nvml_index(0, "GPU-8f2a") == 0  # UUIDs: left as torch numbers them


def _fake_smi(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for nvidia-smi")
def test_the_sampler_reads_the_window_after_the_delay(tmp_path):
    tool = _fake_smi(tmp_path, "while true; do echo 75; echo 100; sleep 0.05; done")
    t0 = time.monotonic()
    busy = GpuBusy(0.6, delay=0.2, index=2, interval_ms=50, tool=tool)
    result = busy.result()
    assert time.monotonic() - t0 >= 0.8
    assert result["samples"] >= 4 and 75.0 <= result["busy_pct_mean"] <= 100.0
    assert 0.3 <= result["share_at_100"] <= 0.7
    argv = (tmp_path / "argv").read_text().split()
    assert "--id=2" in argv and "--loop-ms=50" in argv and "--query-gpu=utilization.gpu" in argv


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for nvidia-smi")
def test_a_sampler_that_exits_early_says_why_and_none_is_skipped(tmp_path):
    tool = _fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed'; exit 9")
    assert GpuBusy(5.0, tool=tool).result()["skipped"].endswith("exited 9 before the window's end: NVIDIA-SMI has "
                                                                  "failed")
    assert GpuBusy(1.0, tool=None).result() == {"skipped": "nvidia-smi is not on PATH"}
    with pytest.raises(ValueError, match="seconds > 0"):
        GpuBusy(0.0, tool=None)


def test_the_serving_report_gives_the_busy_share_of_each_measured_point():
    point = {"requests": 10, "images_per_s": 50.0, "p50_ms": 10.0, "p99_ms": 20.0, "requests_per_call": 1.0,
             "padded_share": 0.0}
    busy = {"busy_pct_mean": 96.4, "busy_pct_p50": 100.0, "share_at_100": 0.81, "samples": 80}
    text = serving.render({"environment": {"gpu": "x", "torch": "t", "transformers": "f"},
                           "options": {"duration": 1, "warmup": 0, "max_wait_ms": 2.0},
                           "towers": {"siglip_so400m_384": {"server": {"points": {"defaults": {
                               "32": {**point, "gpu_busy": busy}, "128": {**point, "gpu_busy": {"skipped": "x"}},
                               "8": point}}}}}})
    assert ("GPU busy over the measured windows (NVML utilization: the share of time some kernel ran; mean / median "
            "/ share of samples at 100%): defaults x32: 96% / 100% / 0.81.") in text
    assert "x128" not in text and "x8:" not in text
