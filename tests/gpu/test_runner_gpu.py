"""The runner on a GPU: capture once, replay many random mixes, each equal to eager per item."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from encgraph.capture import EncoderGraphRunner
from encgraph.capture.capture import pool_bytes
from encgraph.capture.runner import CAPTURE_FAILED
from tests.toy_models import ToyAdapter, ToyInputs, ToyTower, random_inputs, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def exact_fp32():
    # Replays and eager runs must agree to fp32 rounding: no TF32 in either.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def make(paths=("default",), empty=(), **kw):
    torch.manual_seed(0)
    towers = {p: ToyTower(channels=32, hidden=64).cuda() for p in paths}
    return ToyAdapter(towers, empty=empty, **kw)


def check(out, ref, tol=2e-5):
    assert len(out) == len(ref)
    for i, (a, b) in enumerate(zip(out, ref)):
        assert a.shape == b.shape
        assert torch.isfinite(a).all(), f"item {i} has non-finite values"
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"item {i}")


@pytest.mark.parametrize("paths, empty", [(("default",), ()), (("global", "local"), ("local",))])
def test_replay_many_random_mixes(paths, empty):
    adapter = make(paths, empty, min_budget=32, max_budget=1024)
    runner = EncoderGraphRunner(adapter)
    info = runner.capture()
    print(f"\ncapture: {info['graphs']} graphs in {info['seconds']} s, pool {info['pool_bytes'] / 2**20:.1f} MiB")
    assert info["graphs"] == sum(1 for p in paths for b in runner.ladders[p] if b > 0)
    gen = np.random.default_rng(0)
    for _ in range(100):
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 40)), max_len=200, max_frames=4)
        check(runner(inputs), reference(adapter, inputs))
    s = runner.stats
    assert s["graph_items"] > 0 and s["graph_items"] + s["eager_items"] == s["items"]
    assert all(n > 0 for p in paths for n in s["paths"][p]["replays"].values())


def test_nan_poisoned_pool_does_not_leak():
    adapter = make(min_budget=32, max_budget=1024)
    runner = EncoderGraphRunner(adapter)
    runner.capture()
    big = ToyInputs({"default": torch.full((1000, 32), float("nan"), device="cuda")}, {"default": ((500, 500),)})
    assert torch.isnan(runner(big)[0]).all()  # the largest graph's intermediates are now NaN in the pool
    gen = np.random.default_rng(1)
    for _ in range(20):
        small = random_inputs(gen, adapter, int(gen.integers(1, 5)), max_len=20, max_frames=2)
        check(runner(small), reference(adapter, small))


def test_zero_copy_views_and_fresh_copies():
    adapter = make(min_budget=32, max_budget=256)
    fresh = EncoderGraphRunner(adapter)
    views = EncoderGraphRunner(adapter, copy_outputs=False)
    gen = np.random.default_rng(2)
    a, b = (random_inputs(gen, adapter, 3, max_len=20, max_frames=1) for _ in range(2))
    first_fresh, first_view = fresh(a), views(a)
    kept = [t.clone() for t in first_view]
    fresh(b), views(b)
    check(first_fresh, reference(adapter, a))  # fresh tensors survive the next call
    check(kept, reference(adapter, a))


@pytest.mark.parametrize("paths, empty", [(("default",), ()), (("global", "local"), ("local",))])
def test_zero_copy_results_of_one_call_with_several_sub_batches(paths, empty):
    # Every budget of a path shares one output buffer: with several sub-batches in one call, the earlier ones'
    # zero-copy results must not be overwritten by the later replays (they are valid until the next call).
    adapter = make(paths, empty, min_budget=32, max_budget=256)
    views = EncoderGraphRunner(adapter, copy_outputs=False, max_items=2)
    views.capture()
    gen = np.random.default_rng(3)
    for _ in range(10):
        inputs = random_inputs(gen, adapter, 7, max_len=20, max_frames=1)
        check(views(inputs), reference(adapter, inputs))
    replays = sum(n for p in paths for n in views.stats["paths"][p]["replays"].values())
    assert replays >= 4 * 10  # 7 items, 2 per sub-batch: at least 4 replays of a path per call


def test_capture_failure_falls_back_cleanly():
    adapter = make(min_budget=32, max_budget=512, fail_budget=("default", 128))
    runner = EncoderGraphRunner(adapter)
    info = runner.capture()
    assert 128 in info["failed"]["default"] and 128 not in runner.records["default"]
    gen = np.random.default_rng(3)
    for _ in range(20):
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 10)), max_len=100, max_frames=2)
        check(runner(inputs), reference(adapter, inputs))
    assert 128 not in runner.stats["paths"]["default"]["replays"]
    # Every budget of a path failing: that path runs eagerly, with the reason in the stats.
    all_fail = make(min_budget=64, max_budget=64, fail_budget=("default", 64))
    r2 = EncoderGraphRunner(all_fail)
    r2.capture()
    inputs = random_inputs(gen, all_fail, 3, max_len=10, max_frames=1)
    check(r2(inputs), reference(all_fail, inputs))
    assert r2.stats["eager_reasons"] == {CAPTURE_FAILED: 3}


class SyncWhileCapturing(ToyAdapter):
    """The toy whose static forward at ``fail_budget`` reads a value on the host while it is being captured: CUDA
    invalidates the capture, and ``torch.cuda.graph``'s exit raises from ``capture_end`` (as an out-of-memory
    during capture does: the allocator's retry synchronises)."""

    def forward_static(self, path, buffers, budget):
        if self.fail_budget == (path, budget) and torch.cuda.is_current_stream_capturing():
            float(buffers["x"].sum())  # a sync: forbidden while capturing
        return super().forward_static(path, buffers, budget)


def test_an_invalidated_capture_fails_its_budget_alone():
    """A budget whose capture CUDA invalidated fails alone: the smaller budgets captured after it and a later
    runner's capture() all work (they failed with "already recording to mempool_id" while the failed capture left
    the pool recording); the stream is the default again; replays equal eager; the first pool's memory goes with
    the runner (the failed capture's reference on it was released)."""
    torch.manual_seed(0)
    adapter = SyncWhileCapturing({"default": ToyTower(channels=32, hidden=64).cuda()}, min_budget=32,
                                 max_budget=512, fail_budget=("default", 256))
    runner = EncoderGraphRunner(adapter, budgets=[32, 64, 128, 256, 512], compile=False)
    info = runner.capture()
    print(f"\ninvalidated capture at 256: failed {info['failed']}, pools {info['pools']}")
    assert list(info["failed"]["default"]) == [256], info["failed"]
    assert sorted(runner.records["default"]) == [32, 64, 128, 512]
    assert torch.cuda.current_stream() == torch.cuda.default_stream() and not torch.cuda.is_current_stream_capturing()
    gen = np.random.default_rng(4)
    for _ in range(10):
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 10)), max_len=100, max_frames=2)
        check(runner(inputs), reference(adapter, inputs))
    torch.rand(4, device="cuda")  # the failed capture left torch's generator in no capture state
    later = make(min_budget=32, max_budget=512)
    second = EncoderGraphRunner(later, budgets=[32, 64, 128, 256, 512], compile=False)
    assert not second.capture()["failed"]
    inputs = random_inputs(gen, later, 6, max_len=100, max_frames=2)
    check(second(inputs), reference(later, inputs))
    # The failed capture's reference on the pool was released: once the runner goes, so does the pool's memory.
    pool, device = runner._pool, runner.device
    del runner
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert pool_bytes(device, pool) == 0


def test_pool_memory_reported():
    adapter = make(min_budget=64, max_budget=4096)
    runner = EncoderGraphRunner(adapter)
    info = runner.capture()
    largest = info["largest_graph_bytes"]
    print(f"\npool {info['pool_bytes']} B, largest graph {largest} B, per graph {info['per_graph']}")
    assert info["pool_bytes"] >= largest > 0
    assert all(g["replay_ms"] is not None and g["replay_ms"] > 0 for g in info["per_graph"])


def test_an_invalidated_capture_of_the_last_budget_leaves_random_ops_working():
    """The smallest budget is captured last: after its invalidated capture, nothing ends torch's generator's capture
    state but the runner (random ops raised "Offset increment outside graph capture encountered unexpectedly"): the
    replay timings (random floats in the buffers), a random op of the caller's, and the replays all work."""
    torch.manual_seed(0)
    adapter = SyncWhileCapturing({"default": ToyTower(channels=32, hidden=64).cuda()}, min_budget=32,
                                 max_budget=128, fail_budget=("default", 32))
    runner = EncoderGraphRunner(adapter, budgets=[32, 64, 128], compile=False)
    info = runner.capture()
    assert list(info["failed"]["default"]) == [32], info["failed"]
    assert all(r.replay_ms > 0 for r in runner.records["default"].values())
    assert torch.rand(1000, device="cuda").std() > 0.2
    gen = np.random.default_rng(5)
    for _ in range(5):
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 6)), max_len=60, max_frames=2)
        check(runner(inputs), reference(adapter, inputs))
