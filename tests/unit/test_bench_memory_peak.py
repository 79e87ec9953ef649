"""benches/lib/memory_peak.py: the allocations alive at a trace's peak, on hand-made allocator traces."""

from __future__ import annotations

import pytest

from benches.lib.memory_peak import live_at_peak, site

MiB = 2**20


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": n} for f, line, n in where]


TORCH = ("/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 125, "forward")
SIGLIP = ("/venv/lib/python3.12/site-packages/transformers/models/siglip/modeling_siglip.py", 400, "forward")
SELFCHECK = ("/repo/encgraph/capture/selfcheck.py", 199, "_eager_budget")
WARMUP = ("/repo/encgraph/capture/capture.py", 120, "warm_up")


def _alloc(addr: int, mib: float, *frames: tuple[str, int, str]) -> dict:
    return {"action": "alloc", "addr": addr, "size": int(mib * MiB), "frames": _frames(*frames)}


def _free(addr: int, mib: float, completed: bool = True) -> dict:
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": int(mib * MiB)}


def test_the_peak_and_what_was_alive_then_by_site():
    trace = [
        _alloc(1, 100, TORCH, SIGLIP, WARMUP),
        _alloc(2, 50, TORCH, SIGLIP, WARMUP),
        _free(2, 50),
        _alloc(3, 30, SELFCHECK),
        _alloc(4, 40, TORCH, SIGLIP, SELFCHECK),  # the peak: 100 + 30 + 40 = 170
        _free(4, 40, completed=False),  # requested only: still counted
        _free(3, 30),
        _alloc(5, 20, WARMUP),
        _free(99, 500),  # a block from before the recording
    ]
    peak = live_at_peak(trace)
    assert peak["peak_mib"] == 170.0 and peak["at_event"] == 4 and peak["live"] == 3
    assert peak["unknown_frees"] == 1 and peak["events"] == len(trace)
    assert peak["end_mib"] == 160.0  # 100 + 40 (requested, not completed) + 20
    by_site = {name: (mib, n) for name, mib, n in peak["sites"]}
    assert by_site == {
        "forward (siglip/modeling_siglip.py:400) <- warm_up (capture/capture.py:120)": (100.0, 1),
        "forward (siglip/modeling_siglip.py:400) <- _eager_budget (capture/selfcheck.py:199)": (40.0, 1),
        "_eager_budget (capture/selfcheck.py:199)": (30.0, 1),
    }
    assert [row[1] for row in peak["sites"]] == [100.0, 40.0, 30.0]  # largest first


def test_the_rest_beyond_top_is_summed_and_an_empty_trace_has_no_peak():
    trace = [_alloc(i, i, (f"/repo/encgraph/m{i}.py", i, "f")) for i in range(1, 6)]
    peak = live_at_peak(trace, top=2)
    assert [row[1] for row in peak["sites"]] == [5.0, 4.0, 6.0]
    assert peak["sites"][-1][0] == "(other)" and peak["sites"][-1][2] == 3
    empty = live_at_peak([])
    assert empty["peak_mib"] == 0 and empty["sites"] == [] and empty["at_event"] == -1
    with pytest.raises(ValueError, match="top: expected an int >= 1"):
        live_at_peak(trace, top=0)


def test_site_without_frames_or_project_code():
    assert site([]) == "?"
    assert site(_frames(TORCH)) == "forward (modules/linear.py:125)"  # only torch: its innermost frame
    assert site(_frames(TORCH, SIGLIP)) == "forward (siglip/modeling_siglip.py:400)"
    assert site(_frames(SELFCHECK, WARMUP)) == "_eager_budget (capture/selfcheck.py:199)"
