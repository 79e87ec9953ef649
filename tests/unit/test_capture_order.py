"""The order of a GRAPH-mode capture's phases (``encgraph.capture.capture``, ``encgraph.capture.selfcheck``), on
the CPU: every eager forward (warm-ups, the self-check's references, the cost model's eager timings, an adapter's
own ``check_before_capture``) runs before the first graph is captured, and nothing but replays runs after it, so
that no eager forward's activations sit beside the graphs' pool; the replays are still checked against each
budget's reference, and a budget that disagrees is dropped as before.

CUDA is stood in for: graphs by :class:`tests.shims.cpu_graph.RecordedGraph` (the aten calls of the captured
block, replayed on the same buffers), streams, synchronisation and memory queries by no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import numpy as np
import pytest
import torch

import encgraph.capture.capture
from encgraph.capture import EncoderGraphRunner, RunMode
from encgraph.capture.recording import in_graph_calls
from encgraph.errors import InputError
from tests.shims.cpu_graph import RecordedGraph, recorded_graph
from tests.toy_models import (
    SequenceFirst,
    ToyAdapter,
    ToyInputs,
    ToyTower,
    random_inputs,
    reference,
)

BUDGETS = [16, 32, 64]


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """What ran, in order: ``("eager", path)``, ``("static", budget, capturing)``, ``("capture", budget)``,
    ``("replay",)``, ``("hook",)``; with CUDA's capture API stood in for on the CPU."""
    log: list[tuple] = []
    capturing = [False]

    class Graph(RecordedGraph):
        def replay(self) -> None:
            log.append(("replay",))
            super().replay()

    @contextlib.contextmanager
    def graph(g: Graph, pool: object = None, stream: object = None, **kwargs: object) -> Iterator[None]:
        log.append(("capture",))
        capturing[0] = True
        try:
            with recorded_graph(g):
                yield
        finally:
            capturing[0] = False

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(cuda, "memory_snapshot", list)
    monkeypatch.setattr(cuda, "Stream", lambda device=None: _Stream())
    # The runner's own capture stream (its priming is a capture of its own: tests/unit/test_capture_streams.py).
    monkeypatch.setattr(encgraph.capture.capture, "capture_stream", lambda owner, device: (_Stream(), "own"))
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    log.append(("capturing", capturing))  # the flag, for the adapter (dropped by ``ran``)
    return log


def ran(events: list[tuple]) -> list[tuple]:
    return [e for e in events if e[0] != "capturing"]


class SpyToy(ToyAdapter):
    """The toy tower with ``sample_inputs``, logging its forwards; ``wrong_at``: a budget whose static forward
    is off by one (as a module that is not batch-first would be at some budget); ``refuse_over``: samples over
    that many tokens raise (the adapter's own validation)."""

    def __init__(self, events: list[tuple], *, wrong_at: int | None = None, refuse_over: int = 10**9) -> None:
        torch.manual_seed(0)
        super().__init__({"default": ToyTower()}, min_budget=16, max_budget=64)
        self.events, self.wrong_at, self.refuse_over = events, wrong_at, refuse_over
        self._capturing = events[0][1]

    def sample_inputs(self, path: str, tokens: int) -> ToyInputs:
        if tokens > self.refuse_over:
            raise InputError(f"toy: a sample of {tokens} tokens is outside what this toy accepts")
        return ToyInputs({path: torch.randn(tokens, self.towers[path].lin1.in_features)}, {path: ((tokens,),)})

    def check_before_capture(self, tolerance: float) -> None:
        self.events.append(("hook",))

    def forward_eager(self, path: str, inputs: ToyInputs) -> dict[str, torch.Tensor]:
        self.events.append(("eager", path))
        return super().forward_eager(path, inputs)

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        self.events.append(("static", budget, self._capturing[0]))
        out = super().forward_static(path, buffers, budget)
        return {"out": out["out"] + 1.0} if budget == self.wrong_at else out


def graph_runner(adapter: SpyToy, **kw: object) -> EncoderGraphRunner:
    """A runner on the CPU set to GRAPH mode (its constructor refuses GRAPH off CUDA) that measures its costs as a
    GRAPH-mode runner does by default."""
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, budgets=BUDGETS, **kw)
    runner.mode = RunMode.GRAPH
    runner._measure_costs = kw.get("costs") is None
    return runner


def first(events: list[tuple], kind: str) -> int:
    return next(i for i, e in enumerate(events) if e[0] == kind)


@pytest.mark.parametrize("verify", [True, False])
def test_every_eager_forward_runs_before_the_first_capture_and_only_replays_after(events, verify):
    adapter = SpyToy(events)
    runner = graph_runner(adapter, verify=verify)
    info = runner.capture()
    log = ran(events)
    start = first(log, "capture")
    before, after = log[:start], log[start:]
    # Warm-ups first, largest budget first, twice each (runner.warmup), none inside a capture.
    warm = [e for e in before if e[0] == "static"]
    assert warm == [("static", b, False) for b in (64, 64, 32, 32, 16, 16)]
    assert log.index(("static", 16, False)) < first(log, "eager")  # every warm-up before the first eager run
    assert ("hook",) in before if verify else ("hook",) not in log
    assert any(e[0] == "eager" for e in before)
    # After the first capture: the captures (the static forward inside each) and replays, nothing eager.
    assert [e for e in after if e[0] == "capture"] == [("capture",)] * 3
    assert all(e[0] in ("capture", "replay") or e == ("static", e[1], True) for e in after), after
    assert any(e[0] == "replay" for e in after)
    check = info["selfcheck"]
    assert set(check["checked"]["default"]) == (set(BUDGETS) if verify else set())
    assert all(err < 1e-5 for err in check["checked"]["default"].values())
    assert check["costs"] == "measured" and runner.costs is not None and info["costs"].startswith("cost-aware")
    assert len(check["eager_samples"]["default"]) >= 2 and not info["failed"]
    # The graphs answer calls as the tower does.
    inputs = random_inputs(np.random.default_rng(0), adapter, 3, max_len=20, max_frames=1)
    for got, want in zip(runner(inputs), reference(adapter, inputs)):
        torch.testing.assert_close(got, want)


def test_each_budget_is_compared_with_its_own_reference_after_the_capture(events):
    adapter = SpyToy(events, wrong_at=32)
    runner = graph_runner(adapter)
    info = runner.capture()
    log = ran(events)
    assert all(e[0] != "eager" for e in log[first(log, "capture"):])
    failed = info["failed"]["default"]
    assert list(failed) == [32] and "self-check: output 'out'" in failed[32]
    checked = info["selfcheck"]["checked"]["default"]
    assert set(checked) == set(BUDGETS) and checked[32] > 1e-2 and checked[16] < 1e-5 and checked[64] < 1e-5
    assert set(runner.records["default"]) == {16, 64}  # its graph dropped; its batches move to 64 or run eagerly


def test_a_budget_whose_eager_check_fails_is_not_captured(events):
    adapter = SpyToy(events, refuse_over=40)  # budget 64's sample (33 to 63 tokens) may exceed it
    runner = graph_runner(adapter, costs=False)
    info = runner.capture()
    failed = info["failed"]["default"]
    assert list(failed) == [64] and "InputError" in failed[64] and "self-check" in failed[64]
    assert sum(1 for e in ran(events) if e[0] == "capture") == 2 and set(runner.records["default"]) == {16, 32}
    assert set(info["selfcheck"]["checked"]["default"]) == {16, 32}


@pytest.mark.parametrize("mixes", [False, True])
def test_the_generic_split_check_runs_before_the_capture_and_its_verdict_is_read_after(mixes):
    from encgraph.models.generic import GenericModuleAdapter

    module = (SequenceFirst() if mixes else torch.nn.Sequential(torch.nn.Linear(6, 6))).eval()
    adapter = GenericModuleAdapter.of_call(module, torch.randn(5, 6), max_batch=8)
    calls: list[int] = []
    next(module.children()).register_forward_hook(lambda *args: calls.append(1))  # the module's own runs
    adapter.check_before_capture(1e-3)
    ran_before = len(calls)
    verdict = adapter.split_check(1e-3)
    assert ran_before > 1 and len(calls) == ran_before  # the verdict needs no forward after the capture
    assert (verdict is not None) is mixes and (adapter.stock_reason is not None) is mixes
    assert verdict is None or "batch mates" in verdict


def test_capture_info_reports_the_peak_rise_of_each_phase_in_order(events, monkeypatch):
    import encgraph.capture.capture
    import encgraph.capture.selfcheck

    @contextlib.contextmanager
    def peak_rise(device: object, into: dict, phase: str) -> Iterator[None]:
        events.append(("phase", phase))
        yield
        into[phase] = {"reserved": 0.0, "allocated": 0.0}

    monkeypatch.setattr(encgraph.capture.capture, "peak_rise", peak_rise)
    monkeypatch.setattr(encgraph.capture.selfcheck, "peak_rise", peak_rise)
    info = graph_runner(SpyToy(events)).capture()
    order = ["warm-up", "selfcheck eager", "capture", "selfcheck replays and costs"]
    assert list(info["memory_peak_rise_mib"]) == order
    log = ran(events)
    assert [e[1] for e in log if e[0] == "phase"] == order
    eager_phase, capture_phase = log.index(("phase", "selfcheck eager")), log.index(("phase", "capture"))
    assert all(eager_phase < i < capture_phase for i, e in enumerate(log) if e[0] == "eager")


class _MeanMixer(torch.nn.Module):
    """Not batch-first: every row depends on its batch mates (``y - y.mean(0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y - y.mean(0)


@pytest.mark.parametrize("mixes", [False, True])
def test_the_reference_of_a_batch_ladders_top_budgets_runs_in_halves(mixes):
    """A batch ladder's self-check runs the module's plain eager forward on each budget's sample in chunks of at
    most the largest budget up to half the top one (``reference_chunk``: 4 of 1..8), rows joined in order, so that
    its peak is about half a top-budget forward's; a batch-first module still passes every budget, and a module
    that mixes rows still fails the self-check."""
    from encgraph.capture import selfcheck
    from encgraph.models.generic import GenericModuleAdapter

    torch.manual_seed(0)
    module = (_MeanMixer() if mixes else torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU())).eval()
    adapter = GenericModuleAdapter.of_call(module, torch.randn(5, 6), max_batch=8)
    sizes: list[int] = []
    forward_eager = adapter.forward_eager

    def spy(path, inputs):
        sizes.append(int(inputs.tensors[0].shape[0]))
        return forward_eager(path, inputs)

    adapter.forward_eager = spy
    assert selfcheck.reference_chunk([1, 2, 4, 8]) == 4 and selfcheck.reference_chunk([16]) == 16
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, budgets=[1, 2, 4, 8])
    runner.capture()
    # After the adapter's own split check (the call's 5 items, then each alone): one reference per budget's
    # sample (1, 2, 3 items), and budget 8's 7 items as 4 + 3.
    assert 7 not in sizes and sizes[-5:] == [1, 2, 3, 4, 3]
    info = runner.capture_info["selfcheck"]
    if mixes:
        assert adapter.stock_reason is not None  # found mixing rows: the module's own forward answers
    else:
        assert adapter.stock_reason is None and info["checked"]["default"] == {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0}


class _CheckSpy:
    """Stands in for the runner's compiled eager forward: records the items of each check and of each timed
    forward, and answers with the plain eager forward."""

    def __init__(self) -> None:
        self.checked: list[int] = []
        self.forwarded: list[int] = []

    def check(self, adapter, path, inputs, reference, error, tolerance) -> None:
        self.checked.append(int(inputs.tensors[0].shape[0]))
        assert all(t.shape[0] == self.checked[-1] for t in reference.values())  # the part's own reference

    def forward(self, adapter, path, inputs):
        self.forwarded.append(int(inputs.tensors[0].shape[0]))
        return adapter.forward_eager(path, inputs)


def test_the_compiled_eager_check_runs_on_the_references_parts_and_the_phases_are_timed():
    """The compiled eager forward is checked part by part against the plain forward's parts (4 + 3 items for
    budget 8's sample on 1..8), while the cost model's timing runs the whole sample (what a batch of eager items
    costs); ``phase_seconds`` splits the self-check's seconds by phase."""
    from encgraph.capture.selfcheck import check_and_measure
    from encgraph.models.generic import GenericModuleAdapter

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU()).eval()
    adapter = GenericModuleAdapter.of_call(module, torch.randn(5, 6), max_batch=8)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, budgets=[1, 2, 4, 8])
    runner.capture()
    spy = _CheckSpy()
    runner.compiled_eager = spy
    info = check_and_measure(runner, verify=True, measure=True)
    assert spy.checked == [1, 2, 3, 4, 3]
    assert 7 in spy.forwarded and all(n in (1, 2, 3, 7) or n == 4 for n in spy.forwarded)
    phases = info["phase_seconds"]
    assert {"reference", "compiled eager check", "reference to host", "eager timing", "replay values",
            "replay check"} <= set(phases)
    assert all(s >= 0 for s in phases.values()) and sum(phases.values()) <= info["seconds"] + 0.01
    assert info["checked"]["default"] == {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0}


def test_the_capture_never_unwraps_the_adapter(events):
    # The first capture keeps the forward's own outputs where they alias no input, parameter or buffer; it reads
    # the module from the adapter's ``module`` property. ``unwrap()`` undoes what wrapping changed (a Qwen-VL
    # adapter's attention and layer layout): called there, the capture ran the tower's own host-syncing attention.
    class Guarded(SpyToy):
        @property
        def module(self) -> torch.nn.Module:
            return self.towers["default"]

        def unwrap(self) -> torch.nn.Module:
            raise AssertionError("the capture called unwrap()")

    adapter = Guarded(events)
    runner = graph_runner(adapter, costs=False)
    info = runner.capture()
    assert not info["failed"] and set(runner.records["default"]) == set(BUDGETS)
    weights = {p.untyped_storage().data_ptr() for p in adapter.module.parameters()}
    assert not weights & {t.untyped_storage().data_ptr() for t in runner.outputs["default"].storage.values()}
    inputs = random_inputs(np.random.default_rng(1), adapter, 3, max_len=20, max_frames=1)
    for got, want in zip(runner(inputs), reference(adapter, inputs)):
        torch.testing.assert_close(got, want)


def test_the_warm_ups_and_the_capture_make_graph_calls_and_nothing_else_does(events):
    # Kernels that build a plan per shape (cuDNN's packed SDPA) run only where a graph's calls are made: the
    # budget's warm-ups, which build what its capture then records, and the capture itself; eager forwards (the
    # self-check's references, a batch the planner runs eagerly) never do.
    seen: list[tuple[str, bool, bool]] = []

    class Recording(SpyToy):
        def forward_eager(self, path: str, inputs: ToyInputs) -> dict[str, torch.Tensor]:
            seen.append(("eager", False, in_graph_calls()))
            return super().forward_eager(path, inputs)

        def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int
                           ) -> dict[str, torch.Tensor]:
            seen.append(("static", self._capturing[0], in_graph_calls()))
            return super().forward_static(path, buffers, budget)

    runner = graph_runner(Recording(events), costs=False)
    runner.capture()
    runner(random_inputs(np.random.default_rng(2), runner.adapter, 3, max_len=20, max_frames=1))
    assert any(kind == "eager" for kind, _, _ in seen) and not in_graph_calls()
    assert all(graph for kind, capturing, graph in seen if capturing)  # every capture
    assert sum(graph for kind, capturing, graph in seen if kind == "static" and not capturing) >= len(BUDGETS)
    assert not any(graph for kind, _, graph in seen if kind == "eager")
