"""The runner's own capture stream (encgraph.capture.streams) against a fake CUDA driver: a non-blocking stream in the
device's primary context, the context pushed and popped and its reference released on every path, and a clear
fallback (a torch pool stream, logged and named) where the driver cannot make one. On a GPU,
tests/gpu/test_cublas_workspace_gpu.py checks what the stream is for."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

from encgraph.capture import streams


class FakeDriver:
    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple] = []
        self.current: list[int] = []

    def _result(self, name: str) -> int:
        return 999 if name == self.fail else 0

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self._result("cuInit")

    def cuDeviceGet(self, dev, ordinal):
        dev._obj.value = 10 + ordinal  # byref(x)._obj is x
        self.calls.append(("cuDeviceGet", ordinal))
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        ctx._obj.value = 0xC0
        self.calls.append(("retain", dev.value))
        return self._result("cuDevicePrimaryCtxRetain")

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        self.calls.append(("release", dev.value))
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        if self.fail == "cuCtxPushCurrent":
            return 999
        self.current.append(ctx.value)
        self.calls.append(("push", ctx.value))
        return 0

    def cuCtxPopCurrent_v2(self, out):
        out._obj.value = self.current.pop()
        self.calls.append(("pop",))
        return 0

    def cuStreamCreate(self, stream, flags):
        assert self.current == [0xC0], "the stream must be made in the device's primary context"
        stream._obj.value = 0x5EA
        self.calls.append(("create", flags))
        return self._result("cuStreamCreate")


@pytest.fixture
def driver(monkeypatch):
    def use(fake):
        monkeypatch.setattr(streams, "_driver", lambda: fake)
        return fake
    return use


def test_the_stream_is_non_blocking_in_the_devices_primary_context(driver):
    fake = driver(FakeDriver())
    assert streams._new_stream(1) == 0x5EA
    assert fake.calls == [("cuInit", 0), ("cuDeviceGet", 1), ("retain", 11), ("push", 0xC0), ("create", 1), ("pop",),
                          ("release", 11)]
    assert fake.current == []


@pytest.mark.parametrize("fail", ["cuCtxPushCurrent", "cuStreamCreate"])
def test_a_failing_call_leaves_no_context_pushed_nor_retained(driver, fail):
    fake = driver(FakeDriver(fail))
    with pytest.raises(RuntimeError, match=fail):
        streams._new_stream(0)
    assert fake.current == []
    assert fake.calls[-1] == ("release", 10)


class Owner:  # a runner, as far as the stream's lease goes
    pass


def test_without_the_driver_it_captures_on_a_torch_pool_stream_and_says_so(monkeypatch, caplog):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(streams, "_driver", missing)
    monkeypatch.setattr(streams, "_free", {})
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or "pool stream")
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        stream, kind = streams.capture_stream(Owner(), torch.device("cuda", 0))
    assert stream == "pool stream" and made == [torch.device("cuda", 0)]
    assert kind.startswith("torch pool (OSError: libcuda.so.1")
    assert "reduce-overhead" in caplog.text and "torch pool stream" in caplog.text


class FakeGraph:
    def __init__(self):
        self.captured = None


@pytest.fixture
def fake_cuda(monkeypatch, driver):
    """torch.cuda's stream, pool and capture calls, recording what is captured where."""
    fake = driver(FakeDriver())
    monkeypatch.setattr(streams, "_free", {})
    pools = iter(range(100, 200))
    captured = []
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("external", handle, device))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)

    real_mm, real_addmm = torch.mm, torch.addmm
    eager: list[str] = []  # matmuls run outside a capture
    monkeypatch.setattr(torch, "mm", lambda a, b: eager.append("mm") or real_mm(a, b))
    monkeypatch.setattr(torch, "addmm", lambda c, a, b: eager.append("addmm") or real_addmm(c, a, b))

    @contextlib.contextmanager
    def graph(g, pool, stream):
        g.eager_before = list(eager)
        calls = []
        outside_mm, outside_addmm = torch.mm, torch.addmm
        monkeypatch.setattr(torch, "mm", lambda a, b: calls.append("mm") or real_mm(a, b))
        monkeypatch.setattr(torch, "addmm", lambda c, a, b: calls.append("addmm") or real_addmm(c, a, b))
        try:
            yield
        finally:
            monkeypatch.setattr(torch, "mm", outside_mm)
            monkeypatch.setattr(torch, "addmm", outside_addmm)
        g.captured = (pool, stream, calls)
        captured.append(g)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    real_ones, real_zeros = torch.ones, torch.zeros
    monkeypatch.setattr(torch, "ones", lambda *s, device, dtype: real_ones(*s, dtype=torch.float32))
    monkeypatch.setattr(torch, "zeros", lambda *s, device, dtype: real_zeros(*s, dtype=torch.float32))
    return fake, captured


def test_a_runner_gets_a_primed_stream_of_its_own_and_gives_it_back_when_it_goes(fake_cuda):
    fake, captured = fake_cuda
    device = torch.device("cuda", 2)
    first, second = Owner(), Owner()
    s1, kind = streams.capture_stream(first, device)
    assert (s1, kind) == (("external", 0x5EA, device), "own")
    # Primed: a matmul without bias and one with, captured on the stream into the stream's own pool.
    assert [g.captured for g in captured] == [((0, 100), s1, ["mm", "addmm"])]
    # ... after the same matmuls eagerly, on the calling stream: the thread's cuBLAS handles are made outside any
    # capture (their device allocations invalidate one).
    assert captured[0].eager_before == ["mm", "addmm"]
    s2, _ = streams.capture_stream(second, device)  # the first runner still lives: a new stream, a new pool
    again, _ = streams.capture_stream(first, device)  # recapture(): the first runner's stream, primed again
    assert again is s1 and captured[-1].captured[:2] == ((0, 100), s1)
    captured.pop()
    assert len([c for c in fake.calls if c[0] == "create"]) == 2
    assert captured[1].captured[:2] == ((0, 101), s2)
    del first
    gc.collect()
    third = Owner()
    s3, _ = streams.capture_stream(third, device)  # the first runner's stream, primed again in its pool
    assert s3 is s1 and len([c for c in fake.calls if c[0] == "create"]) == 2
    assert captured[2].captured[:2] == ((0, 100), s1)
    assert not streams._free.get(2)  # two runners live, holding the two streams
    del second, third
    gc.collect()
    assert sorted(id(o.stream) for o in streams._free[2]) == sorted([id(s1), id(s2)])
    assert [len(o.primers) for o in sorted(streams._free[2], key=lambda o: o.pool)] == [3, 1]  # kept, never dropped


def test_a_failed_priming_is_said_and_the_capture_goes_on(fake_cuda, monkeypatch, caplog):
    def broken(g, pool, stream):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    ended = []
    monkeypatch.setattr(streams, "end_failed_capture", lambda device, pool: ended.append(pool) or True)
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        owner = Owner()
        stream, kind = streams.capture_stream(owner, torch.device("cuda", 0))
    assert stream[0] == "external" and kind == "own, not primed (RuntimeError: CUDA error: out of memory)"
    assert ended == [(0, 100)] and "priming" in caplog.text
    assert streams._free == {}  # the runner lives: the stream is its own
    del owner
    gc.collect()
    assert [own.pool for own in streams._free[0]] == [(0, 101)]  # no graph held the first pool: a fresh one
