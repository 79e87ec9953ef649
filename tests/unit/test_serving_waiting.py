"""The front's wait policy on a CUDA target, exercised on the CPU with a fake device and a fake CUDA event whose
``query()`` turns true a set time after it is recorded: an idle device launches at once, a busy one gathers the
requests that arrive until it goes idle (never past ``max_wait_ms``), and a call that finds two calls still in flight
gathers until the older is done; the policy off CUDA is in ``test_serving_front.py``."""

from __future__ import annotations

import copy

import threading
import time

import pytest
import torch

from encgraph.capture.records import RunMode
import encgraph
from encgraph.serving import BatchingFront, waiting
from encgraph.serving.waiting import HOLD_LIMIT_S, MAX_IN_FLIGHT, WaitPolicy

TIMEOUT = 30


class FakeEvent:
    """Done ``busy_s`` seconds after it was recorded (a device that takes that long for each call)."""

    def __init__(self, busy_s: float) -> None:
        self.done_at = time.monotonic() + busy_s
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return time.monotonic() >= self.done_at


@pytest.fixture
def fake_device(monkeypatch):
    """Every front built inside the test sees a CUDA device; each call's marker is a FakeEvent of ``busy[0]`` s."""
    busy = [0.0]
    events: list[FakeEvent] = []

    def marker(device):
        events.append(FakeEvent(busy[0]))
        return events[-1]

    monkeypatch.setattr("encgraph.serving.front.cuda_device", lambda target: torch.device("cuda", 0))
    monkeypatch.setattr(waiting, "launch_marker", marker)
    return busy, events


def _graphed():
    """The net as it was (the reference) and a graphed copy whose call shape is known (the any-module path answers a
    shape's first call with the module's own forward, and requests of it are not coalesced until then)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 5).eval()
    fast = encgraph.graphed(copy.deepcopy(net), budgets=[1, 2, 4, 8, 16], mode=RunMode.STATIC)
    with torch.no_grad():
        fast(torch.randn(1, 6))
    return net, fast


def _two_in_one_call(front, net, xs, start):
    """Submit ``xs[0]``, then ``xs[1]`` 0.1 s later, while the front's worker holds the first; check each answer
    against the net; return the seconds from ``start`` to both answers and the front's stats."""
    futures = [front.submit(xs[0])]
    time.sleep(0.1)
    futures.append(front.submit(xs[1]))
    outs = [f.result(TIMEOUT) for f in futures]
    waited = time.perf_counter() - start
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, net(x))
    return waited, front.stats


def test_policy_waits_only_while_the_last_call_runs(fake_device):
    busy, _ = fake_device
    policy = WaitPolicy(0.5, True, torch.device("cuda", 0))
    first = policy.wait(time.monotonic())  # nothing launched yet: idle
    assert first.skipped and first.idle and first.until is None
    busy[0] = 0.2
    policy.launched()
    arrived = time.monotonic()
    during = policy.wait(arrived)
    assert not during.skipped and during.deadline == pytest.approx(arrived + 0.5) and during.until is not None
    assert not during.until()
    time.sleep(0.25)
    assert during.until() and policy.wait(time.monotonic()).idle
    # adaptive_wait=False or max_wait 0: the device is not asked.
    assert WaitPolicy(0.5, False, torch.device("cuda", 0)).wait(arrived).deadline == pytest.approx(arrived + 0.5)
    assert not WaitPolicy(0.0, True, torch.device("cuda", 0)).wait(arrived).skipped


def test_policy_holds_a_call_while_two_calls_are_in_flight(fake_device):
    busy, events = fake_device
    assert MAX_IN_FLIGHT == 2
    policy = WaitPolicy(0.01, True, torch.device("cuda", 0))
    busy[0] = 0.2
    policy.launched()  # the running call
    busy[0] = 60.0
    policy.launched()  # one queued behind it
    arrived = time.monotonic()
    held = policy.wait(arrived)
    assert held.held and not held.skipped and held.deadline == pytest.approx(arrived + HOLD_LIMIT_S)
    assert held.until is not None and not held.until()
    time.sleep(0.25)  # the older call is done, the newer still runs: a plain wait, up to max_wait
    assert held.until()
    after = policy.wait(arrived)
    assert not after.held and after.deadline == pytest.approx(arrived + 0.01) and not after.until()
    assert events[0].queries >= 2


def test_a_call_behind_two_in_flight_gathers_until_the_older_is_done(fake_device):
    busy, _ = fake_device
    net, fast = _graphed()
    busy[0] = 0.5  # each call keeps the fake device busy this long
    xs = [torch.randn(n, 6) for n in (1, 2, 3, 1)]
    with BatchingFront(fast, max_wait_ms=20.0) as front:
        start = time.perf_counter()
        front.submit(xs[0]).result(TIMEOUT)  # idle: launched at once
        front.submit(xs[1]).result(TIMEOUT)  # one in flight: launched after max_wait, now two are
        # held: launched now, it would only queue behind the two
        waited, stats = _two_in_one_call(front, net, xs[2:], start)
    # Both in one call, launched once the first call's device work was done (0.5 s after it), not after 20 ms.
    assert stats["requests_per_call"] == {1: 2, 2: 1}, stats["requests_per_call"]
    assert stats["held_launches"] == 1 and stats["idle_launches"] == 1
    assert 0.4 < waited < 0.5 + HOLD_LIMIT_S, waited


def test_a_lone_client_on_an_idle_device_never_waits(fake_device):
    net, fast = _graphed()
    x = torch.randn(3, 6)
    with BatchingFront(fast, max_wait_ms=300.0) as front:
        lat = []
        for _ in range(6):
            start = time.perf_counter()
            out = front.submit(x).result(TIMEOUT)
            lat.append(time.perf_counter() - start)
            torch.testing.assert_close(out, net(x))
        stats = front.stats
    assert max(lat) < 0.3, lat
    assert stats["waits_skipped"] == stats["idle_launches"] == 6 and stats["requests_per_call"] == {1: 6}


def test_a_busy_device_gathers_what_arrives_until_it_goes_idle(fake_device):
    busy, events = fake_device
    net, fast = _graphed()
    busy[0] = 0.4  # each call keeps the fake device busy this long
    xs = [torch.randn(n, 6) for n in (1, 2, 3)]
    with BatchingFront(fast, max_wait_ms=5_000.0) as front:
        first = front.submit(xs[0])
        first.result(TIMEOUT)  # launched at once (idle); its marker is busy for 0.4 s
        # the worker holds the second request, waiting on the busy device
        waited, stats = _two_in_one_call(front, net, xs[1:], time.perf_counter())
    # One call for both, launched when the device went idle (about 0.4 s), long before max_wait_ms.
    assert stats["requests_per_call"] == {1: 1, 2: 1}, stats["requests_per_call"]
    assert 0.25 < waited < 2.0, waited
    assert stats["idle_launches"] == 1 and events[0].queries >= 2


def test_a_busy_device_never_holds_a_call_past_max_wait(fake_device):
    busy, _ = fake_device
    net, fast = _graphed()
    busy[0] = 60.0  # a device that stays busy
    with BatchingFront(fast, max_wait_ms=150.0) as front:
        front.submit(torch.randn(1, 6)).result(TIMEOUT)
        start = time.perf_counter()
        x = torch.randn(2, 6)
        out = front.submit(x).result(TIMEOUT)
        waited = time.perf_counter() - start
    torch.testing.assert_close(out, net(x))
    assert 0.14 < waited < 1.5, waited


def test_closing_ends_a_wait_on_a_busy_device(fake_device):
    busy, _ = fake_device
    _, fast = _graphed()
    busy[0] = 60.0
    front = BatchingFront(fast, max_wait_ms=20_000.0)
    front.submit(torch.randn(1, 6)).result(TIMEOUT)
    pending = front.submit(torch.randn(1, 6))
    time.sleep(0.05)
    closer = threading.Thread(target=front.close)
    start = time.perf_counter()
    closer.start()
    closer.join(TIMEOUT)
    assert not closer.is_alive() and time.perf_counter() - start < 5
    assert pending.result(TIMEOUT).shape == (1, 5)  # drained: the queued request still ran


def test_a_marker_that_fails_does_not_stop_the_worker(fake_device, monkeypatch, caplog):
    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(waiting, "launch_marker", broken)
    net, fast = _graphed()
    xs = [torch.randn(n, 6) for n in (1, 2)]
    with BatchingFront(fast, max_wait_ms=5_000.0) as front:
        outs = [front.submit(x).result(TIMEOUT) for x in xs]
        stats = front.stats
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, net(x))
    assert stats["idle_launches"] == 2 and "could not mark" in caplog.text
