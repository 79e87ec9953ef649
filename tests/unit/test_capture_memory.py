"""encgraph.capture.memory: how far a capture phase raised the device's peak memory, without resetting it."""

from __future__ import annotations

import contextlib

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


def test_release_cached_empties_the_cache_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext(calls.append(str(device))))
    memory.release_cached(torch.device("cpu"))
    assert calls == []
    memory.release_cached(torch.device("cuda", 1))
    assert calls == ["cuda:1", "emptied"]  # on the runner's device, not the current one
