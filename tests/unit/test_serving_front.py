"""The batching front on the CPU: coalescing into one runner call, each request its own items back, failure
isolation (validation and a raising coalesced call), the bounded queue, shutdown, asyncio, grad modes.

Coalescing is made deterministic by a long ``max_wait_ms`` with ``max_requests`` (the worker closes a call when
it holds that many requests) or by a target that blocks until the test releases it.
"""

from __future__ import annotations

import copy

import asyncio
from itertools import accumulate
import threading
import time

import pytest
import torch

from encgraph.capture.records import RunMode
import encgraph
from encgraph.errors import ConfigError, ConfigTypeError, OverloadedError, ShutdownError
from encgraph.serving import BatchingFront

LONG_WAIT_MS = 5_000.0
TIMEOUT = 30


class Net(torch.nn.Module):
    """A batch-first module that raises on a poisoned row (value 666), to make a coalesced call fail."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 666).any()):
            raise ValueError("poisoned row")
        return torch.tanh(self.lin(x))


class Gate:
    """A callable target that blocks until released, counting its calls."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, x: int) -> int:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return x * 2


def _graphed() -> tuple[Net, torch.nn.Module]:
    """A graphed copy of a net (the first returned is the net as it was: the reference) whose call shape is known
    (the any-module path answers a shape's first call with the module's own forward, then replays it)."""
    net = Net().eval()
    fast = encgraph.graphed(copy.deepcopy(net), budgets=[1, 2, 4, 8, 16], mode=RunMode.STATIC)
    with torch.no_grad():
        fast(torch.randn(1, 6))
    return net, fast


def test_concurrent_requests_coalesce_into_one_call_and_get_their_own_rows():
    net, fast = _graphed()
    sizes = [3, 1, 5, 2]
    xs = [torch.randn(n, 6, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=len(sizes)) as front:
        futures = [front.submit(x) for x in xs]
        outs = [f.result(TIMEOUT) for f in futures]
        stats = front.stats
    for x, out in zip(xs, outs):
        assert out.shape == (x.shape[0], 5)
        torch.testing.assert_close(out, net(x).detach(), rtol=1e-5, atol=1e-6)
    assert stats["calls"] == 1 and stats["requests_per_call"] == {4: 1}
    assert stats["completed"] == 4 and stats["items"] == sum(sizes) and stats["failed"] == 0
    assert stats["runner"]["items"] == sum(sizes)  # one runner call held every request's items


def test_submit_from_many_threads_matches_the_module():
    net, fast = _graphed()
    xs = [torch.randn(1 + i % 4, 6, generator=torch.Generator().manual_seed(i)) for i in range(24)]
    outs: dict[int, torch.Tensor] = {}
    with BatchingFront(fast, max_wait_ms=2.0) as front:
        def client(i: int) -> None:
            outs[i] = front.submit(xs[i]).result(TIMEOUT)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        stats = front.stats
    assert sorted(outs) == list(range(len(xs)))
    for i, x in enumerate(xs):
        torch.testing.assert_close(outs[i], net(x).detach(), rtol=1e-5, atol=1e-6)
    assert stats["completed"] == len(xs) and sum(k * v for k, v in stats["requests_per_call"].items()) == len(xs)


def test_a_bad_request_fails_alone_before_coalescing():
    net, fast = _graphed()
    good = [torch.randn(2, 6), torch.randn(3, 6)]
    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=2) as front:
        fa = front.submit(good[0])
        fb = front.submit(good[1])
        bad = front.submit(torch.randn(2, 7))  # the net refuses this width: its own error, alone
        with pytest.raises(RuntimeError, match="mat1 and mat2"):
            bad.result(TIMEOUT)
        for f, x in zip((fa, fb), good):
            torch.testing.assert_close(f.result(TIMEOUT), net(x).detach(), rtol=1e-5, atol=1e-6)
        stats = front.stats
    # A shape the graphs do not hold runs alone, through the module (which refuses it); the others coalesce.
    assert stats["calls"] == 2 and stats["requests_per_call"] == {2: 1, 1: 1} and stats["failed"] == 1


def test_a_raising_coalesced_call_is_retried_one_by_one():
    net, fast = _graphed()
    xs = [torch.randn(2, 6), torch.full((1, 6), 666.0), torch.randn(3, 6)]
    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=3) as front:
        futures = [front.submit(x) for x in xs]
        with pytest.raises(ValueError, match="poisoned"):
            futures[1].result(TIMEOUT)
        for i in (0, 2):
            torch.testing.assert_close(futures[i].result(TIMEOUT), net(xs[i]).detach(), rtol=1e-5, atol=1e-6)
        stats = front.stats
    assert stats["retried_calls"] == 1 and stats["requests_per_call"] == {3: 1, 1: 3}
    assert stats["completed"] == 2 and stats["failed"] == 1


def test_token_cap_splits_calls_and_a_large_request_runs_alone():
    net, fast = _graphed()  # largest budget 16 rows: the default cap
    sizes = [10, 5, 4, 20]
    xs = [torch.randn(n, 6) for n in sizes]
    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=2) as front:
        assert front.caps == {"default": 16}
        futures = [front.submit(x) for x in xs]
        for f, x in zip(futures, xs):
            torch.testing.assert_close(f.result(TIMEOUT), net(x).detach(), rtol=1e-5, atol=1e-6)
        stats = front.stats
    # [10, 5] fits 16; 4 would make 19: carried into the next call with... 20 over the cap: [4], then [20] alone.
    assert stats["requests_per_call"] == {2: 1, 1: 2}
    with BatchingFront(fast, max_tokens=64, max_wait_ms=0) as front:
        assert front.caps == {"default": 64}


def test_overload_raises_at_once_and_the_queue_recovers():
    gate = Gate()
    front = BatchingFront(gate, max_queue=2)
    try:
        first = front.submit(1)
        assert gate.entered.wait(TIMEOUT)  # the worker holds request 1; the queue is empty
        queued = [front.submit(2), front.submit(3)]
        t0 = time.monotonic()
        with pytest.raises(OverloadedError, match="max_queue=2") as info:
            front.submit(4)
        assert time.monotonic() - t0 < 1.0 and isinstance(info.value, RuntimeError)
        assert front.queue_depth == 2 and front.stats["rejected"] == 1
        gate.release.set()
        assert [first.result(TIMEOUT)] + [f.result(TIMEOUT) for f in queued] == [2, 4, 6]
        assert front.submit(5).result(TIMEOUT) == 10
        assert gate.calls == 4  # a callable target never coalesces
    finally:
        gate.release.set()
        front.close()


def test_close_drains_by_default_and_then_refuses():
    gate = Gate()
    front = BatchingFront(gate)
    futures = [front.submit(i) for i in range(3)]
    assert gate.entered.wait(TIMEOUT)
    closer = threading.Thread(target=front.close)
    closer.start()
    gate.release.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert [f.result(0) for f in futures] == [0, 2, 4]
    with pytest.raises(ShutdownError, match="closed"):
        front.submit(9)


def test_close_without_drain_fails_the_queue_and_never_hangs():
    gate = Gate()
    front = BatchingFront(gate)
    running = front.submit(1)
    assert gate.entered.wait(TIMEOUT)
    queued = [front.submit(i) for i in range(2, 5)]
    t0 = time.monotonic()
    front.close(drain=False, timeout=0.2)  # the call in progress is stuck: close still returns
    assert time.monotonic() - t0 < 5
    for f in queued:
        with pytest.raises(ShutdownError, match="not run"):
            f.result(0)
    gate.release.set()
    assert running.result(TIMEOUT) == 2  # the call in progress still finishes


def test_encode_from_asyncio_and_cancel_a_queued_request():
    net, fast = _graphed()
    gate = Gate()
    x = torch.randn(3, 6)

    async def main() -> torch.Tensor:
        with BatchingFront(fast, max_wait_ms=0) as front:
            return await front.encode(x)

    torch.testing.assert_close(asyncio.run(main()), net(x).detach(), rtol=1e-5, atol=1e-6)

    async def cancelled() -> dict:
        front = BatchingFront(gate)
        front.submit(0)
        assert await asyncio.to_thread(gate.entered.wait, TIMEOUT)
        task = asyncio.ensure_future(front.encode(1))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.release.set()
        front.close()
        return front.stats

    stats = asyncio.run(cancelled())
    assert stats["cancelled"] == 1 and gate.calls == 1


@pytest.mark.parametrize("mode", ["plain", "no_grad", "inference_mode"])
def test_the_runner_still_answers_every_grad_mode_after_the_front(mode):
    """The front's first call allocates the static buffers outside inference mode (rule 12)."""
    net, fast = _graphed()
    x = torch.randn(3, 6)
    with BatchingFront(fast) as front:
        out = front.submit(x).result(TIMEOUT)  # the first call allocates the buffers under no_grad
        assert front.submit(x).result(TIMEOUT).is_inference()  # later calls run under inference_mode
    ctx = {"plain": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        again = fast(x)
    torch.testing.assert_close(again.detach(), out.clone(), rtol=1e-5, atol=1e-6)


def test_runner_target_returns_per_item_results():
    net = Net().eval()
    from encgraph.models.generic import GenericModuleAdapter

    adapter = GenericModuleAdapter.of_call(net, torch.randn(1, 6), max_batch=8)
    runner = encgraph.EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    xs = [torch.randn(2, 6), torch.randn(1, 6)]
    with BatchingFront(runner, max_wait_ms=LONG_WAIT_MS, max_requests=2, capture=True) as front:
        outs = [f.result(TIMEOUT) for f in [front.submit(adapter.inputs_from_call(x)) for x in xs]]
        with pytest.raises(Exception, match="one argument"):
            front.submit((xs[0],), extra=1).result(TIMEOUT)
    for x, out in zip(xs, outs):
        assert len(out) == x.shape[0]
        torch.testing.assert_close(torch.cat([r["out0"] for r in out]), net(x).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_wait_ms": -1}, ConfigError, "max_wait_ms"),
    ({"max_wait_ms": "1"}, ConfigError, "max_wait_ms"),
    ({"max_queue": 0}, ConfigError, "max_queue"),
    ({"max_requests": 0}, ConfigError, "max_requests"),
    ({"max_tokens": {"other": 4}}, ConfigError, "unknown paths"),
    ({"capture": 1}, ConfigTypeError, "capture"),
])
def test_bad_options(kwargs, error, match):
    _, fast = _graphed()
    with pytest.raises(error, match=match):
        BatchingFront(fast, **kwargs)


def test_bad_target():
    with pytest.raises(ConfigTypeError, match="target"):
        BatchingFront(42)


def _sequential(front: BatchingFront, n: int) -> list[float]:
    """``n`` requests one after another (a lone closed-loop client): each one's latency (s)."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(n):
        start = time.perf_counter()
        front.submit(x).result(TIMEOUT)
        out.append(time.perf_counter() - start)
    return out


def _waited(front: BatchingFront, n: int, wait_s: float) -> list[int]:
    """``n`` requests one after another: the indices of those whose call waited, read from the front's own count
    of skipped waits (a stall of the machine cannot pass for a wait), each checked to have taken the wait."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    waited = []
    for i in range(n):
        skipped, start = front.stats["waits_skipped"], time.perf_counter()
        front.submit(x).result(TIMEOUT)
        if front.stats["waits_skipped"] == skipped:
            assert time.perf_counter() - start >= wait_s, i
            waited.append(i)
    return waited


def test_a_lone_client_stops_paying_the_wait_and_probes_now_and_then():
    from encgraph.serving.waiting import PROBE_EVERY, USELESS_WAITS

    _, fast = _graphed()
    wait_s = 0.2
    n = USELESS_WAITS + PROBE_EVERY + 1
    with BatchingFront(fast, max_wait_ms=wait_s * 1e3) as front:
        waited = _waited(front, n, wait_s)
        stats = front.stats
    # The first waits see no other request; then calls go at once, except one probe that waits again.
    assert waited == [*range(USELESS_WAITS), USELESS_WAITS + PROBE_EVERY - 1]
    assert stats["waits_skipped"] == PROBE_EVERY and stats["requests_per_call"] == {1: n}


def test_useless_probes_back_off_to_the_longest_interval():
    from encgraph.serving.waiting import MAX_PROBE_EVERY, PROBE_EVERY, USELESS_WAITS

    _, fast = _graphed()
    wait_s = 0.15
    intervals = [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_PROBE_EVERY, MAX_PROBE_EVERY]
    with BatchingFront(fast, max_wait_ms=wait_s * 1e3) as front:
        waited = _waited(front, USELESS_WAITS + sum(intervals), wait_s)
    # The first waits; then one probe per interval, each interval twice the last, up to the longest.
    probes = list(accumulate(intervals, initial=USELESS_WAITS - 1))[1:]
    assert waited == [*range(USELESS_WAITS), *probes]


def test_adaptive_wait_off_waits_on_every_call():
    _, fast = _graphed()
    with BatchingFront(fast, max_wait_ms=100.0, adaptive_wait=False) as front:
        lat = _sequential(front, 5)
        assert front.stats["waits_skipped"] == 0
    assert min(lat) >= 0.1
    with pytest.raises(ConfigTypeError, match="adaptive_wait"):
        BatchingFront(fast, adaptive_wait=1)


def test_finish_runs_on_the_worker_after_the_call_and_fails_its_request_alone():
    net, fast = _graphed()
    xs = [torch.randn(2, 6), torch.randn(1, 6), torch.randn(3, 6)]
    seen: list[tuple[str, int, bool]] = []

    def finish(out: torch.Tensor) -> tuple[torch.Tensor, int]:
        seen.append((threading.current_thread().name, out.shape[0], torch.is_inference_mode_enabled()))
        if out.shape[0] == 1:
            raise RuntimeError("finishing failed")
        return out.sum(1), out.shape[0]

    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=3, finish=finish, name="front-x") as front:
        futures = [front.submit(x) for x in xs]
        with pytest.raises(RuntimeError, match="finishing failed"):
            futures[1].result(TIMEOUT)
        for i in (0, 2):
            total, n = futures[i].result(TIMEOUT)
            assert n == xs[i].shape[0]
            torch.testing.assert_close(total, net(xs[i]).detach().sum(1), rtol=1e-5, atol=1e-5)
        stats = front.stats
    assert seen == [("front-x", 2, True), ("front-x", 1, True), ("front-x", 3, True)]  # in order, on the worker
    assert stats["calls"] == 1 and stats["completed"] == 2 and stats["failed"] == 1
    with pytest.raises(ConfigTypeError, match="finish: expected a callable"):
        BatchingFront(fast, finish=3)


def test_finish_call_runs_once_per_call_on_the_worker_and_hands_each_request_its_own_value():
    """``finish_call`` gets the whole call's results, in the requests' order, once, on the worker (in inference
    mode); each request gets the value at its place in what it returns."""
    net, fast = _graphed()
    xs = [torch.randn(2, 6), torch.randn(1, 6), torch.randn(3, 6)]
    seen: list[tuple[str, list[int], bool]] = []

    def finish_call(outs: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        seen.append((threading.current_thread().name, [o.shape[0] for o in outs], torch.is_inference_mode_enabled()))
        return [(i, o) for i, o in enumerate(outs)]

    options = dict(max_wait_ms=LONG_WAIT_MS, max_requests=3, finish_call=finish_call, name="front-c")
    with BatchingFront(fast, **options) as front:
        got = [f.result(TIMEOUT) for f in [front.submit(x) for x in xs]]
        stats = front.stats
    assert seen == [("front-c", [2, 1, 3], True)]
    for i, (x, (place, out)) in enumerate(zip(xs, got)):
        assert place == i
        torch.testing.assert_close(out, net(x).detach(), rtol=1e-5, atol=1e-6)
    assert stats["calls"] == 1 and stats["completed"] == 3 and stats["items"] == 6


@pytest.mark.parametrize("broken", ["raises", "short"])
def test_a_failing_finish_call_fails_every_request_of_its_call_clearly(broken):
    """A ``finish_call`` that raises (or returns fewer values than requests) fails each request of its call with
    an error of its own that names the call and the cause; the next call is served."""
    _, fast = _graphed()
    calls = []

    def finish_call(outs):
        calls.append(len(outs))
        if len(calls) == 1:
            if broken == "raises":
                raise ValueError("copy failed")
            return outs[:-1]
        return outs

    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=2, finish_call=finish_call) as front:
        futures = [front.submit(torch.randn(n, 6)) for n in (1, 2)]
        errors = [f.exception(TIMEOUT) for f in futures]
        after = [front.submit(torch.randn(1, 6)) for _ in range(2)]  # a full call: launched without the long wait
        assert [f.result(TIMEOUT).shape for f in after] == [(1, 5), (1, 5)]
        stats = front.stats
    cause = "ValueError: copy failed" if broken == "raises" else "returned 1 values for 2 requests"
    for exc in errors:
        assert isinstance(exc, RuntimeError) and "call of 2 requests failed" in str(exc) and cause in str(exc)
    assert errors[0] is not errors[1] and (broken != "raises" or isinstance(errors[0].__cause__, ValueError))
    assert calls == [2, 2] and stats["failed"] == 2 and stats["completed"] == 2


def test_finish_and_finish_call_are_checked():
    _, fast = _graphed()
    with pytest.raises(ConfigTypeError, match="finish_call: expected a callable"):
        BatchingFront(fast, finish_call=3)
    with pytest.raises(ConfigError, match="finish, finish_call: expected at most one of them"):
        BatchingFront(fast, finish=list, finish_call=list)


def test_submit_after_calls_ready_on_the_worker_before_the_call_and_a_failing_one_fails_alone():
    """``submit_after(ready, ...)``: the worker calls each request's ``ready`` on its own thread once it takes the
    request, before the call that runs it (where the server's device preprocessing makes the worker's stream wait
    for that request's side-stream work); a ``ready`` that raises fails its own request alone."""
    net, fast = _graphed()
    xs = [torch.randn(2, 6), torch.randn(1, 6), torch.randn(3, 6)]
    log: list[tuple[str, str]] = []

    def ready(i: int):
        def call() -> None:
            log.append((f"ready {i}", threading.current_thread().name))
            if i == 1:
                raise RuntimeError("device work failed")
        return call

    def finish(out: torch.Tensor) -> torch.Tensor:
        log.append((f"finish {out.shape[0]}", threading.current_thread().name))
        return out

    with BatchingFront(fast, max_wait_ms=LONG_WAIT_MS, max_requests=2, finish=finish, name="front-r") as front:
        futures = [front.submit_after(ready(i), x) for i, x in enumerate(xs)]
        with pytest.raises(RuntimeError, match="device work failed"):
            futures[1].result(TIMEOUT)
        outs = [futures[i].result(TIMEOUT) for i in (0, 2)]
        stats = front.stats
    for x, out in zip((xs[0], xs[2]), outs):
        torch.testing.assert_close(out, net(x).detach(), rtol=1e-5, atol=1e-6)
    assert {name for _, name in log} == {"front-r"}
    events = [e for e, _ in log]
    assert events == ["ready 0", "ready 1", "ready 2", "finish 2", "finish 3"]  # every ready before the call
    assert stats["calls"] == 1 and stats["completed"] == 2 and stats["failed"] == 1
