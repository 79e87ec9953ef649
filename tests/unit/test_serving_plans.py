"""The batching front builds the dense attention plans its calls bought after it has answered their requests, in
its worker thread (torch keeps cuDNN's plans per thread), when no request waits, or once a plan has waited
``waiting.DUE_CALLS`` calls under a queue that never empties. On the CPU, with a target that consults the
process's plan ledger as the attention of an eager forward does."""

from __future__ import annotations

import threading
import time

from encgraph.packing.kernels import LEDGER, Crossover, DenseRule
from encgraph.serving import BatchingFront, waiting

TIMEOUT = 30
# saves 8 ms a call at 64 rows, 16 a forward of 2 calls, against a 30 ms plan: rents twice, falls due at the third
RULE = DenseRule(16, Crossover("gpu", 1, 8, "bfloat16", (16, 64), (1.0, 16.0), (0.5, 8.0),
                               dense_first_ms=(30.5, 38.0)), calls=2)


class Buyer:
    """A callable target: each request ``rows`` is one attention call at that length, consulting the ledger with
    a builder as an eager forward's host plan does; returns the rows it ran dense at (0: it rented). ``more``:
    requests it submits to the front while it runs (a queue that never empties). Builds block on ``hold``."""

    def __init__(self, key: str) -> None:
        self.key, self.front, self.more = key, None, 0
        self.calls = 0
        self.built: list[tuple[int, str, int]] = []  # (rows, thread, calls run by then)
        self.threads: set[str] = set()
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, rows: int) -> int:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.more:
            self.more -= 1
            self.front.submit(rows)
        return LEDGER.run_length(self.key, rows, RULE, lambda: self.build)

    def build(self, rows: int) -> None:
        self.built.append((rows, threading.current_thread().name, self.calls))
        assert self.hold.wait(TIMEOUT)


def wait_until(check, timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_plan_bought_in_a_call_is_built_after_its_request_is_answered():
    buyer = Buyer("front idle")
    buyer.hold.clear()  # the build blocks until the test has its answer: it must come first
    with BatchingFront(buyer) as front:
        assert [front.submit(64).result(TIMEOUT) for _ in range(3)] == [0, 0, 0]  # the third fell due and rented
        wait_until(lambda: buyer.built)
        buyer.hold.set()
        wait_until(lambda: front.stats["plans_built"] == 1)
        assert buyer.built == [(64, *buyer.threads, 3)]  # in the worker, the thread that runs the calls
        assert front.submit(64).result(TIMEOUT) == 64  # held: dense at once
        assert front.stats["plans_built"] == 1


def test_under_a_queue_that_never_empties_a_plan_is_built_after_due_calls(monkeypatch):
    monkeypatch.setattr(waiting, "DUE_CALLS", 2)
    buyer = Buyer("front busy")
    with BatchingFront(buyer) as front:
        buyer.front, buyer.more = front, 6  # each of the first 6 calls queues the next request
        assert front.submit(64).result(TIMEOUT) == 0
        wait_until(lambda: front.stats["completed"] == 7)
        # due at call 3, the queue never empty after it: built after call 4 (2 calls waited), not when idle
        assert [(rows, calls) for rows, _, calls in buyer.built] == [(64, 4)]
        assert front.stats["plans_built"] == 1
