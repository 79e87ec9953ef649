"""The cost model corrected while serving (encgraph.capture.feedback), with a fake clock and fake events: samples
are read only once their events completed (never waited for), a model off by a factor converges within the stated
bound, samples of an older model are dropped, exploration replays batches the model keeps eager."""

from __future__ import annotations

import pytest

from encgraph.capture.feedback import MIN_SAMPLES, SAMPLE_EVERY, CostFeedback, RunKind
from encgraph.packing import CostModel

PATH = "default"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.until = float("inf")  # the device has completed the work recorded up to this time

    @property
    def done(self) -> bool:
        return self.until == float("inf")

    @done.setter
    def done(self, value: bool) -> None:
        self.until = float("inf") if value else -1.0


class FakeEvent:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock.now

    def query(self) -> bool:
        return self.t is not None and self.t <= self.clock.until

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before it completed: that would sync the host"
        return (end.t - self.t) * 1e3


def model(graph_ms: float = 1.0, eager_ms: float = 2.0) -> CostModel:
    return CostModel.linear([PATH], graph_fixed_ms=graph_ms, graph_per_budget_ms=0, eager_fixed_ms=eager_ms,
                            eager_per_token_ms=0)


def run(feedback: CostFeedback, clock: Clock, costs: CostModel, kind: RunKind, true_ms: float) -> None:
    if not feedback.sampled(PATH, kind):
        clock.now += true_ms / 1e3
        return
    predicted = costs.graph_cost(PATH, 64) if kind is RunKind.GRAPH else costs.eager_cost(PATH, 64)
    sample = feedback.start(PATH, kind, predicted)
    clock.now += true_ms / 1e3
    feedback.stop(sample)


def test_converges_within_the_bound() -> None:
    """A model measured under contention (replays priced 10x their true 1 ms) is corrected after at most
    SAMPLE_EVERY * MIN_SAMPLES replays plus one call, once; afterwards it predicts the truth and stays."""
    clock = Clock()
    feedback = CostFeedback(lambda: FakeEvent(clock))
    costs = model(graph_ms=10.0)
    calls = 0
    while feedback.corrections["graph"] == 0:
        new = feedback.poll(costs)
        costs = new or costs
        if new is not None:
            break
        run(feedback, clock, costs, RunKind.GRAPH, true_ms=1.0)
        calls += 1
        assert calls <= SAMPLE_EVERY * MIN_SAMPLES + 1
    assert costs.graph_cost(PATH, 64) == pytest.approx(1.0)
    assert feedback.as_dict()["corrections"] == {"graph": 1} and feedback.scale[PATH]["graph"] == pytest.approx(0.1)
    for _ in range(10 * SAMPLE_EVERY * MIN_SAMPLES):
        assert feedback.poll(costs) is None
        run(feedback, clock, costs, RunKind.GRAPH, true_ms=1.05)  # within the threshold: no correction
    assert feedback.corrections["graph"] == 1


def test_pending_samples_wait_for_their_events() -> None:
    clock = Clock()
    feedback = CostFeedback(lambda: FakeEvent(clock), sample_every=1, min_samples=2)
    costs = model(eager_ms=2.0)
    clock.done = False
    for _ in range(3):
        run(feedback, clock, costs, RunKind.EAGER, true_ms=8.0)
        assert feedback.poll(costs) is None and feedback.samples == 0  # not read, not waited for
    clock.done = True
    corrected = feedback.poll(costs)
    assert feedback.samples == 3 and corrected is not None
    assert corrected.eager_cost(PATH, 64) == pytest.approx(8.0) and corrected.graph_cost(PATH, 64) == 1.0


def test_samples_of_an_older_model_are_dropped() -> None:
    clock = Clock()
    feedback = CostFeedback(lambda: FakeEvent(clock), sample_every=1, min_samples=2)
    costs = model()
    for _ in range(2):
        run(feedback, clock, costs, RunKind.GRAPH, true_ms=4.0)
    clock.until = clock.now  # the device finished those two, not the next
    run(feedback, clock, costs, RunKind.GRAPH, true_ms=4.0)  # still pending when the correction is decided
    costs = feedback.poll(costs)
    assert costs is not None and feedback.generation[(PATH, RunKind.GRAPH)] == 1 and feedback.samples == 2
    clock.done = True
    assert feedback.poll(costs) is None and feedback.samples == 2  # predicted by the old model: dropped


def test_exploration_every_nth_cheaper_batch() -> None:
    from encgraph.packing import ItemSpec, Limits

    feedback = CostFeedback(lambda: FakeEvent(Clock()), explore_every=4)
    specs, limits = [ItemSpec(40), ItemSpec(30)], Limits(max_items=4, max_frames=4)
    picks = [feedback.explore(PATH, (64, 128), specs, limits) for _ in range(12)]
    assert picks == [None, None, None, 128] * 3 and feedback.explored == 3
    assert [feedback.explore(PATH, (64,), specs, limits) for _ in range(4)] == [None] * 4  # nothing holds it
    assert [feedback.explore(PATH, (128,), specs, Limits(max_items=1, max_frames=1)) for _ in range(4)] == [None] * 4


def test_scaled_model_keeps_paths_and_rejects_bad_factors() -> None:
    costs = CostModel.from_measurements({"a": {64: 1.0, 128: 2.0}, "b": {8: 1.0}},
                                        {"a": [(10, 1, 1.0), (100, 1, 3.0)], "b": [(1, 1, 1.0), (8, 1, 2.0)]},
                                        {"a": 1e-4})
    s = costs.scaled(graph={"a": 2.0}, eager={"b": 0.5})
    assert s.graph_ms["a"] == {64: 2.0, 128: 4.0} and s.attention["a"] == pytest.approx(2e-4)
    assert s.graph_ms["b"] == costs.graph_ms["b"] and s.eager["a"] == costs.eager["a"]
    assert s.eager_cost("b", 8) == pytest.approx(costs.eager_cost("b", 8) / 2)
    with pytest.raises(ValueError, match="factor > 0"):
        costs.scaled(graph={"a": 0.0})
    with pytest.raises(ValueError, match="paths"):
        costs.scaled(eager={"c": 2.0})


def test_reset_forgets_what_the_old_model_taught() -> None:
    """Ratios measured against one model (read and still pending) never correct the model that replaces it; the
    totals stay (they are counters), the cumulative scale restarts."""
    clock = Clock()
    feedback = CostFeedback(lambda: FakeEvent(clock), sample_every=1, min_samples=2)
    old = model(graph_ms=10.0)
    run(feedback, clock, old, RunKind.GRAPH, true_ms=1.0)
    assert feedback.poll(old) is None and feedback.samples == 1  # one ratio of 0.1, one short of a correction
    clock.until = clock.now
    run(feedback, clock, old, RunKind.GRAPH, true_ms=1.0)  # pending: its events have not completed
    feedback.scale[PATH] = {"graph": 0.5, "eager": 1.0}  # as a correction of the old model leaves it
    feedback.reset()
    clock.done = True
    new = model(graph_ms=1.0)  # right about replays
    run(feedback, clock, new, RunKind.GRAPH, true_ms=1.0)
    assert feedback.poll(new) is None  # the old model's ratios (read and pending) are gone: nothing to correct
    assert feedback.samples == 2 and feedback.scale == {} and feedback.as_dict()["corrections"] == {}
    run(feedback, clock, new, RunKind.GRAPH, true_ms=4.0)
    run(feedback, clock, new, RunKind.GRAPH, true_ms=4.0)
    corrected = feedback.poll(new)  # the new model's own samples still correct it
    assert corrected is not None and corrected.graph_cost(PATH, 64) == pytest.approx(4.0)


def test_cuda_timing_is_on_the_runners_device_not_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner on cuda:1 while cuda:0 is current: its feedback events record on cuda:1's stream and the host
    timing synchronises cuda:1 (CUDA's defaults name the current device). Fakes stand in for torch.cuda here;
    tests/gpu/test_cost_feedback_gpu.py times real work on a second GPU."""
    import torch

    from encgraph.capture.feedback import event_factory
    from encgraph.capture.timing import time_host

    calls: list[tuple[str, object]] = []

    class CudaEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream: object = None) -> None:
            calls.append(("record", stream))

    monkeypatch.setattr(torch.cuda, "Event", CudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    second = torch.device("cuda", 1)
    event_factory(second)().record()
    assert calls == [("record", "stream of cuda:1")]
    calls.clear()
    time_host(lambda: calls.append(("run", None)), 2, second)
    assert calls == [("run", None)] + [("sync", second), ("run", None), ("sync", second)] * 2
