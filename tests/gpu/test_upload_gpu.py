"""Host-to-device copies that never wait for the device (encgraph.capture.upload): with a spinning kernel queued
on the stream, a copy from the host returns at once, and lands once the stream reaches it, correct; a replay of a
Qwen2.5-VL tower whose metadata (cu_seqlens, rotary positions) is built on the host queues behind the same spin
without waiting, and equals its replay on an idle device. A copy from pageable memory is timed too and printed
(``-s``), not asserted: the driver decides when it stages synchronously."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from encgraph.capture.runner import EncoderGraphRunner
from encgraph.capture.upload import copy_into, to_device
from encgraph.models import wrap
from tests.gpu.test_qwen_gpu import BUDGETS, MAX_ITEMS, build, random_mix

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPIN_CYCLES = 4 * 10**8
"""At least 200 ms at the H200's top clock (1.98 GHz)."""


def _spin_ms() -> float:
    """One spin's device milliseconds, measured on an idle device."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SPIN_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _host_ms(fn) -> float:
    """Host milliseconds ``fn`` takes with a spin queued before it on the current stream."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    start = time.perf_counter()
    fn()
    host = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return host


def test_copies_from_the_host_do_not_wait_for_queued_work():
    spin = _spin_ms()
    host = torch.arange(1 << 20, dtype=torch.int64)  # 8 MiB: staged, not inlined, when pageable
    view = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    moved = {}
    copy_ms = _host_ms(lambda: copy_into(view, host))
    to_ms = _host_ms(lambda: moved.setdefault("t", to_device(host, torch.device("cuda"))))
    pageable_ms = _host_ms(lambda: view.copy_(host.to(torch.int32), non_blocking=True))
    print(f"\nspin {spin:.1f} ms; host ms with it queued: copy_into {copy_ms:.2f}, to_device {to_ms:.2f}, "
          f"pageable non_blocking copy_ {pageable_ms:.2f}")
    assert copy_ms < spin / 4 and to_ms < spin / 4, (spin, copy_ms, to_ms)
    assert torch.equal(view.cpu(), host.to(torch.int32))
    assert torch.equal(moved["t"].cpu(), host)


def test_replay_with_host_metadata_does_not_wait_for_queued_work():
    tower, _, _ = build("qwen2_5_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=MAX_ITEMS, compile=False, costs=False)
    runner.capture()
    pixels, grid = random_mix(np.random.default_rng(5), adapter.channels, 6)  # grid on the host, as served
    with torch.inference_mode():
        idle = [o["pooler_output"].clone() for o in runner(adapter.inputs(pixels, grid))]
        spin = _spin_ms()
        got = {}
        call_ms = _host_ms(lambda: got.setdefault("out", runner(adapter.inputs(pixels, grid))))
    print(f"\nspin {spin:.1f} ms; a 6-item call queued behind it took {call_ms:.2f} ms on the host")
    assert runner.stats["graph_items"] == runner.stats["items"]
    assert call_ms < spin / 2, (spin, call_ms)
    assert len(got["out"]) == len(idle) == grid.shape[0]
    for item, (out, ref) in enumerate(zip(got["out"], idle)):
        assert torch.equal(out["pooler_output"], ref), item
