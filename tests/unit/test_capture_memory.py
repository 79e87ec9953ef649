"""encgraph.capture.memory: how far a capture phase raised the device's peak memory, without resetting it."""

from __future__ import annotations

import torch

from encgraph.capture import memory


def test_off_cuda_nothing_is_recorded():
    into: dict = {}
    with memory.peak_rise(torch.device("cpu"), into, "capture"):
        pass
    with memory.peak_rise(None, into, "capture"):
        pass
    assert into == {}


def test_the_rise_of_each_peak_counter_in_mib(monkeypatch):
    peaks = iter([{"reserved_bytes.all.peak": 100 * 2**20, "allocated_bytes.all.peak": 80 * 2**20},
                  {"reserved_bytes.all.peak": 612 * 2**20, "allocated_bytes.all.peak": 80 * 2**20}])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: next(peaks))
    into: dict = {}
    with memory.peak_rise(torch.device("cuda", 0), into, "selfcheck and costs"):
        pass
    assert into == {"selfcheck and costs": {"reserved": 512.0, "allocated": 0.0}}
