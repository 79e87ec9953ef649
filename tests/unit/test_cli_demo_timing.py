"""How ``encgraph demo`` times the tower against encgraph (:mod:`encgraph.cli.demo_timing`), on a simulated machine
whose load comes and goes (a fake clock: no real time measured), and through the demo itself on the CPU.

Issue 54: on a loaded 2-core machine the same command printed eager/encgraph 313/13 ms, 87/228 ms and 92/8.7 ms:
three calls of one system, then three of the other, so a burst of other work landed on one side only.
"""

from __future__ import annotations

import json
import statistics

import pytest

from encgraph.cli import main
from encgraph.cli.demo_timing import NOISY, Timing, Timings, time_interleaved


class Machine:
    """A fake clock and two systems whose calls take ``ms`` times the load at the time they start; ``burst``:
    the load in ``[start, end)`` seconds (other work arriving), 1 elsewhere."""

    def __init__(self, tower_ms=10.0, runner_ms=5.0, burst=(0.0, 0.0, 1.0)):
        self.now = 0.0
        self.log: list[str] = []
        self.tower_ms, self.runner_ms, self.burst = tower_ms, runner_ms, burst

    def clock(self):
        return self.now

    def _run(self, name, ms):
        start, end, load = self.burst
        self.log.append(name)
        self.now += ms / 1e3 * (load if start <= self.now < end else 1.0)

    def tower(self):
        self._run("T", self.tower_ms)

    def runner(self):
        self._run("R", self.runner_ms)


def test_calls_alternate_after_an_untimed_warmup_of_each():
    m = Machine()
    t = time_interleaved(m.tower, m.runner, pairs=4, clock=m.clock)
    assert m.log == ["T", "R", "T", "R", "R", "T", "T", "R", "R", "T"]  # warm-up, then pairs in alternating order
    assert t.pairs == 4 and t.warmup == 1
    assert t.tower.calls_ms == pytest.approx((10.0,) * 4) and t.runner.calls_ms == pytest.approx((5.0,) * 4)
    assert t.speedup == pytest.approx(2.0) and not t.noisy and t.noise_note() is None


def _blockwise(m, repeats):
    """The old demo's timing: ``repeats`` tower calls, then ``repeats`` encgraph calls; their medians (ms)."""
    medians = []
    for fn in (m.tower, m.runner):
        times = []
        for _ in range(repeats):
            start = m.clock()
            fn()
            times.append((m.clock() - start) * 1e3)
        medians.append(statistics.median(times))
    return medians


def test_a_burst_of_load_lands_on_both_systems_alike():
    # Ten times the load for the first 0.3 s of timing: the old blocks put it on the tower's three calls alone
    # (an apparent 20x speed-up); interleaved, each pair sees the same load and the ratio stays the true 2x.
    tower, runner = _blockwise(Machine(burst=(0.0, 0.3, 10.0)), 3)
    assert tower / runner == pytest.approx(20.0)
    m = Machine(burst=(0.015, 0.315, 10.0))  # from the end of the warm-up on
    t = time_interleaved(m.tower, m.runner, pairs=9, clock=m.clock)
    assert t.speedup == pytest.approx(2.0)
    assert t.noisy and t.tower.spread == pytest.approx(10.0)
    note = t.noise_note()
    assert note is not None and "varied by up to 10.0x" in note and "(2.00x tower/encgraph) is steadier" in note


def test_a_time_budget_adds_pairs_up_to_a_limit():
    m = Machine(tower_ms=110.0, runner_ms=110.0)
    t = time_interleaved(m.tower, m.runner, pairs=2, min_seconds=1.0, max_pairs=25, clock=m.clock)
    assert t.pairs == 5  # 0.22 s a pair: past 1 s after five
    m = Machine(tower_ms=1.0, runner_ms=1.0)
    assert time_interleaved(m.tower, m.runner, pairs=2, min_seconds=1.0, max_pairs=25, clock=m.clock).pairs == 25
    m = Machine()
    assert time_interleaved(m.tower, m.runner, pairs=3, min_seconds=0.0, max_pairs=25, clock=m.clock).pairs == 3


def test_few_calls_say_there_is_no_noise_measure():
    one = Timings(Timing((3.0,)), Timing((2.0,)), 1)
    assert one.tower.text() == "3.00 ms"
    assert one.noise_note() == ("one timed call of each: no measure of the noise; rerun with --repeats 10 or more "
                                "for a figure to compare")
    steady = Timings(Timing((3.0, 3.1, 2.9)), Timing((2.0, 2.0, 2.1)), 1)
    assert steady.tower.text() == "3.00 ms (2.90-3.10)" and steady.noise_note() is None
    assert Timings(Timing((1.0, 1.0, NOISY + 0.01)), Timing((1.0, 1.0, 1.0)), 1).noisy


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cpu_demo_reports_interleaved_medians_with_their_spread(capsys, one_thread):
    pytest.importorskip("transformers")
    assert main(["demo", "--model", "siglip", "--device", "cpu", "--quiet", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["timings_ms"]
    assert 5 <= t["pairs"] <= 25 and t["repeats"] == t["pairs"] and t["warmup"] == 1 and t["interleaved"]
    assert len(t["tower_eager_calls"]) == len(t["encgraph_calls"]) == t["pairs"]
    assert t["tower_eager"] == statistics.median(t["tower_eager_calls"])
    assert t["tower_eager_range"] == [min(t["tower_eager_calls"]), max(t["tower_eager_calls"])]
    assert t["encgraph_range"] == [min(t["encgraph_calls"]), max(t["encgraph_calls"])]
    assert t["noisy"] == (t["note"] is not None)
    assert main(["demo", "--model", "siglip", "--device", "cpu", "--quiet", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "timings on the whole batch, 3 calls of each (interleaved, after 1 untimed call of each); median " \
           "(min-max):" in out
    assert __import__("re").search(r"tower's own forward \(eager\)\s+[\d.]+ ms \([\d.]+-[\d.]+\)", out)
