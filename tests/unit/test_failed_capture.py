"""What ends a capture that CUDA invalidated (encgraph.capture.graph_steps.end_failed_capture), against fake torch
calls: the pool's routing ended and its reference released, then one small capture that ends torch's generator's
capture state, which runs after every failed capture (a pool no longer recording is left alone). On a GPU:
tests/gpu/test_runner_gpu.py (an invalidated capture of the last budget, then random ops and replays)."""

from __future__ import annotations

import contextlib
import logging

import torch

from encgraph.capture import graph_steps


def _fake(monkeypatch, recording: bool) -> list:
    calls: list = []

    def end(index, pool):
        if not recording:
            raise RuntimeError("not currently recording")
        calls.append(("end routing", index, pool))

    @contextlib.contextmanager
    def graph(g, **kwargs):
        calls.append(("capture", kwargs))
        yield
        calls.append(("captured",))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda index, pool: calls.append(("release", index, pool)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *shape, device: real_zeros(*shape))
    return calls


def test_an_invalidated_capture_is_ended_and_the_generator_with_it(monkeypatch):
    calls = _fake(monkeypatch, recording=True)
    assert graph_steps.end_failed_capture(torch.device("cuda", 1), (0, 7)) is True
    assert calls == [("end routing", 1, (0, 7)), ("release", 1, (0, 7)), ("capture", {}), ("captured",)]


def test_a_capture_whose_routing_ended_still_gets_its_generator_ended(monkeypatch):
    # capture_end ends the allocator's routing before cudaStreamEndCapture, whose error leaves the generator
    # capturing: the pool is left alone (not recording, nothing to release), the small capture still runs.
    calls = _fake(monkeypatch, recording=False)
    assert graph_steps.end_failed_capture(torch.device("cuda", 0), (0, 7)) is False
    assert calls == [("capture", {}), ("captured",)]


def test_a_recovery_that_fails_is_logged_not_raised(monkeypatch, caplog):
    _fake(monkeypatch, recording=True)

    def broken(g, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        assert graph_steps.end_failed_capture(torch.device("cuda", 0), (0, 7)) is True
    assert "generator's capture state" in caplog.text and "not permitted" in caplog.text
