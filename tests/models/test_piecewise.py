"""Piecewise replays on the CPU (``encgraph.capture.piecewise``, ``encgraph.models.piece_attention``): the parts
that need no CUDA graph. Which calls split (a measured crossover and a ``max_seqlen`` that reaches it), the
discovery's notes, the attention a split call runs between two segments (real sequences by the host bounds, long
ones dense, padding rows zero, nothing leaking between sequences), the bounds the fill keeps for it, when a replay
pays, and the route that replays a cost-eager batch piecewise. Capture and replay themselves: tests/gpu."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from encgraph.capture import piecewise
from encgraph.capture.buffers import PathBuffers
from encgraph.capture.execution import _piecewise_budget
from encgraph.capture.protocol import BufferSpec, FillRule
from encgraph.capture.records import RunMode
from encgraph.models import attention, piece_attention, sequence_bounds
from encgraph.packing import CostModel, ItemSpec, Limits
from encgraph.packing.kernels import LEDGER, Crossover, DenseRule
from tests.models.test_attention import qkv, reference
from tests.models.test_kernel_choice import H200, dense_spy, fake_varlen  # noqa: F401 (a fixture)

GEO = (2, 8, torch.float32)
CROSS = Crossover(H200, 2, 8, "float32", (16, 64), (1.0, 8.0), (0.5, 2.0))  # dense from 16 rows, saves 0.5-6 ms


@given(st.lists(st.integers(1, 9), min_size=0, max_size=6), st.integers(0, 6), st.integers(1, 4))
def test_trim_bounds_keeps_the_real_sequences(lengths, pad, repeats):
    ends = np.cumsum([0, *lengths])
    full = np.concatenate([ends, [ends[-1] + pad] * repeats])  # as a fill writes it: padding, then the end repeated
    assert piecewise.trim_bounds(full, int(ends[-1])) == tuple(int(e) for e in ends)


def test_the_fill_keeps_each_bounds_buffers_host_values():
    specs = {8: {"cu": BufferSpec((5,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=12, chunk=12),
                 "x": BufferSpec((12, 2), torch.float32, FillRule.ZERO)}}
    buffers = PathBuffers("default", specs, torch.device("cpu"))
    buffers.fill(8, {"cu": np.array([0, 3, 7]), "x": torch.ones(7, 2)})
    full, end = buffers.host_bounds["cu"]
    assert full.tolist() == [0, 3, 7, 12, 12] and end == 7 and set(buffers.host_bounds) == {"cu"}
    assert piecewise.trim_bounds(full, end) == (0, 3, 7)
    buffers.fill(8, None)  # all padding: no real sequence
    assert piecewise.trim_bounds(*buffers.host_bounds["cu"]) == (0,)


def _splitter(cu, table, discover=True):
    return piecewise.Splitter({"cu_seqlens": cu}, table, discover=discover)


def test_only_calls_that_reach_the_measured_crossover_are_offered(monkeypatch):
    q, k, v = qkv(40, 2, 8)
    cu = torch.tensor([0, 40, 40], dtype=torch.int32)
    table = {(2, 8, torch.float32): DenseRule(CROSS.min_rows, CROSS, calls=2)}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    split = _splitter(cu, table)
    with piecewise.active(split):
        assert piece_attention.offer(q, k, v, cu, 40, None, attention._host_planned_attention) is None  # discovery: noted, runs in the graph
        assert piece_attention.offer(q, k, v, cu, 8, None, attention._host_planned_attention) is None  # max_seqlen under the crossover: not noted
    assert split.shapes == [((2, 8), (2, 8), torch.float32)] and split.rows == 40 and split.refused is None
    # No crossover measured for the geometry: never split (its gain would be unknown).
    split = _splitter(cu, {(2, 8, torch.float32): 16})
    with piecewise.active(split):
        assert piece_attention.offer(q, k, v, cu, 40, None, attention._host_planned_attention) is None
    assert split.shapes == []
    # A call attending by a tensor that is not one of the path's bounds buffers cannot split: noted, never used.
    split = _splitter(cu.clone(), table)
    with piecewise.active(split):
        piece_attention.offer(q, k, v, cu, 40, None, attention._host_planned_attention)
    assert split.refused and not split.shapes
    # Outside a capture (or without a splitter) nothing is offered.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    split = _splitter(cu, table)
    with piecewise.active(split):
        assert piece_attention.offer(q, k, v, cu, 40, None, attention._host_planned_attention) is None
    assert split.shapes == [] and piecewise.splitter() is None


@pytest.mark.parametrize("dense", [True, False])
def test_a_split_call_attends_the_real_sequences_and_zeroes_the_padding(monkeypatch, fake_varlen, dense):  # noqa: F811
    calls = fake_varlen
    spied = dense_spy(monkeypatch)
    LEDGER.clear()
    rows, lengths = 48, [20, 5, 3, 12]  # 40 real rows, 8 padding
    q, k, v = qkv(rows, 2, 8)
    q[40:] = float("nan")  # stale values in the padding rows reach nothing
    k[40:], v[40:] = float("inf"), float("nan")
    v[20:25] = float("nan")  # one sequence's NaN stays in it
    bounds = tuple(int(x) for x in np.cumsum([0, *lengths]))
    cu = torch.tensor([*bounds, rows, rows], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    call = piece_attention.SplitCall({GEO: DenseRule(10)}, GEO, 0.3, attention._host_planned_attention)  # no plan cost: dense from 10 rows at once
    call.run(q, k, v, cu, bounds, out, dense)
    want = reference(q[:40], k[:40], v[:40], lengths, 0.3)
    assert torch.equal(out[40:], torch.zeros_like(out[40:]))
    assert torch.isnan(out[20:25]).all() and torch.isfinite(out[:20]).all() and torch.isfinite(out[25:40]).all()
    keep = torch.ones(40, dtype=torch.bool)
    keep[20:25] = False
    torch.testing.assert_close(out[:40][keep], want[keep], rtol=1e-5, atol=1e-5)
    if dense:  # the two long sequences on the dense kernel, the runs between them on varlen
        assert sorted(spied) == [12, 20] and [c[1] for c in calls] == [[0, 5, 8]]
    else:
        assert spied == [] and [c[1] for c in calls] == [list(bounds)]


def test_a_split_call_runs_long_sequences_at_warmed_bucket_lengths(monkeypatch, fake_varlen):  # noqa: F811
    """Between segments a long sequence runs dense at its bucket (from the crossover's replay times), at once where
    capture built that bucket's plan, and renting varlen where only an eager forward's plan of that length is held
    (another layout: another cuDNN plan); the output is the attention of the real rows either way."""
    calls = fake_varlen
    padded: list[tuple[int, int]] = []
    dense_spy(monkeypatch, padded)
    cross = Crossover(H200, 2, 8, "float32", (16, 64), (1.0, 8.0), (0.5, 2.0), dense_first_ms=(90.0, 90.0),
                      padded_replay_ms=(0.55, 2.1))
    assert cross.replay_bucket_from == 16 and cross.bucket_from is None
    call = piece_attention.SplitCall({GEO: DenseRule(cross.min_rows, cross, calls=1)}, GEO, None,
                                     attention._host_planned_attention)
    assert call.rule.replayed and call.rule.run_rows(20) == 24
    lengths = [20, 6]
    q, k, v = qkv(32, 2, 8)
    bounds = (0, 20, 26)
    cu = torch.tensor([0, 20, 26, 32], dtype=torch.int32)
    want = reference(q[:26], k[:26], v[:26], lengths, None)
    cpu = torch.device("cpu")
    LEDGER.clear()
    LEDGER.own(sequence_bounds.ledger_key(2, 8, torch.float32, cpu), 24)  # an eager forward's plan: not this one
    out = torch.empty_like(q)
    call.run(q, k, v, cu, bounds, out, True)
    assert padded == [] and [c[1] for c in calls] == [[0, 20, 26]]  # rented: all varlen
    torch.testing.assert_close(out[:26], want, rtol=1e-5, atol=1e-5)
    LEDGER.own(sequence_bounds.ledger_key(2, 8, torch.float32, cpu, replayed=True), 24)  # what warm() marks
    calls.clear()
    call.run(q, k, v, cu, bounds, out, True)
    assert padded == [(20, 24)] and [c[1] for c in calls] == [[0, 6]]
    torch.testing.assert_close(out[:26], want, rtol=1e-5, atol=1e-5)
    assert call.warm(64, cpu) == {"lengths": 0, "seconds": 0.0}  # plans are CUDA's: none off it
    LEDGER.clear()


def test_a_split_call_stands_in_at_its_bucket_until_its_own_length_is_bought(monkeypatch, fake_varlen):  # noqa: F811
    """Where the padded call beats varlen but costs well over the exact kernel (an H200's times, rows scaled
    down), a split call runs a long sequence at its own length once this thread holds that plan; until then at
    its bucket where capture built it (renting the difference), else on varlen. The attention is the same."""
    calls = fake_varlen
    runs: list[tuple[int, int]] = []
    dense_spy(monkeypatch, runs)
    cross = Crossover(H200, 2, 8, "float32", (16, 32, 64), (0.353, 1.357, 5.241), (0.249, 0.770, 3.062),
                      dense_first_ms=(60.0, 60.0, 60.0), padded_replay_ms=(0.333, 0.991, 3.529))
    assert (cross.replay_stand_in_from, cross.replay_bucket_from) == (16, 64)
    call = piece_attention.SplitCall({GEO: DenseRule(cross.min_rows, cross, calls=1)}, GEO, None,
                                     attention._host_planned_attention)
    assert call.rule.run_rows(30) == 30 and call.rule.stand_in_rows(30) == 32
    q, k, v = qkv(40, 2, 8)
    bounds = (0, 30, 36)
    cu = torch.tensor([0, 30, 36, 40], dtype=torch.int32)
    want = reference(q[:36], k[:36], v[:36], [30, 6], None)
    key = sequence_bounds.ledger_key(2, 8, torch.float32, torch.device("cpu"), replayed=True)
    LEDGER.clear()
    before = LEDGER.stats()["stand_in_calls"]
    out = torch.empty_like(q)
    for held, expected in ((None, []), (32, [(30, 32)]), (30, [(30, 30)])):  # nothing; the bucket; the length
        if held is not None:
            LEDGER.own(key, held)
        runs.clear()
        calls.clear()
        call.run(q, k, v, cu, bounds, out, True)
        assert runs == expected, held
        assert [c[1] for c in calls] == ([[0, 30, 36]] if not expected else [[0, 6]]), held
        torch.testing.assert_close(out[:36], want, rtol=1e-5, atol=1e-5)
    assert LEDGER.stats()["stand_in_calls"] == before + 1
    LEDGER.clear()


def test_each_kind_of_split_call_warms_once_up_to_its_longest_site():
    seen: list[int] = []

    class Kind:
        def warm(self, rows, device):
            seen.append(rows)
            return {"lengths": rows // 8, "seconds": 0.5}

    a, b = Kind(), Kind()

    def site(kind, rows):
        return types.SimpleNamespace(attention=kind, query=torch.empty(rows, 1, 1))

    records = [types.SimpleNamespace(sites=[site(a, 64), site(b, 16)]), types.SimpleNamespace(sites=[site(a, 128)])]
    assert piecewise.warm_plans(records, torch.device("cpu")) == {"lengths": 18, "seconds": 1.0}
    assert sorted(seen) == [16, 128]


def test_the_gain_counts_the_long_sequences_and_a_replay_pays_past_the_overhead():
    rule = DenseRule(CROSS.min_rows, CROSS, calls=1)
    call = piece_attention.SplitCall({GEO: rule}, GEO, None, attention._host_planned_attention)
    assert call.gain_ms((0, 8, 16)) == 0.0  # under the crossover
    assert call.gain_ms((0, 64)) == pytest.approx(6.0) and call.gain_ms((0, 64, 80)) > 6.0
    site = types.SimpleNamespace(attention=call, bounds_name="cu_seqlens")
    record = piecewise.PiecewiseRecord("default", 16, [None, None, None], [site, site], 0.0, whole_ms=20.0,
                                       dense_ms=10.0, varlen_ms=21.0)
    assert record.overhead_ms == pytest.approx(1.0)
    assert record.pays([(0, 64)] * 2) and not record.pays([(0, 8, 16)] * 2)
    assert not piecewise.PiecewiseRecord("default", 16, [None], [], 0.0).pays([])  # not timed: never
    assert record.site_bounds({"cu_seqlens": (np.array([0, 30, 64, 64]), 30)}) == [(0, 30), (0, 30)]


def test_a_cost_eager_batch_replays_piecewise_where_that_is_predicted_cheaper():
    rule = DenseRule(CROSS.min_rows, CROSS, calls=1)
    site = types.SimpleNamespace(attention=piece_attention.SplitCall({GEO: rule}, GEO, None, attention._host_planned_attention), bounds_name="cu_seqlens")
    pieces = piecewise.PiecewiseRecord("default", 16, [None] * 5, [site] * 4, 0.0, 30.0, 20.0, 31.0)
    costs = CostModel.linear(["default"], graph_fixed_ms=30, graph_per_budget_ms=0, eager_fixed_ms=20,
                             eager_per_token_ms=0)
    state = types.SimpleNamespace(
        mode=RunMode.GRAPH, costs=costs, limits=Limits(8, 16),
        records={"default": {16: types.SimpleNamespace(piecewise=pieces)}},
        adapter=types.SimpleNamespace(attention_rows=lambda path, specs: [s.input_size for s in specs]),
    )
    one = [ItemSpec({"default": 16}, frames=1, input_size=64)]
    # 4 calls x 6 ms saved, 1 ms of overhead: 30 - 24 + 1 = 7 ms against eager's 20.
    assert _piecewise_budget(state, "default", [16], one) == 16
    short = [ItemSpec({"default": 16}, frames=1, input_size=12)]  # nothing long: no gain
    assert _piecewise_budget(state, "default", [16], short) is None
    state.adapter = types.SimpleNamespace()  # no attention_rows: no pricing, no piecewise route
    assert _piecewise_budget(state, "default", [16], one) is None


@pytest.mark.parametrize("long", [True, False])
def test_a_rerouted_batch_pays_eager_rent_only_where_its_replay_is_whole(long):
    """A batch the cost model sends eagerly, whose eager run would rent, is rerouted to a replay. A whole replay
    runs the same varlen kernel the eager forward would have rented, so it pays that rent into the ledger (the
    eager length is bought once it pays its plan); a split replay runs its long sequences dense at buckets of its
    own, so it pays none (docs/runner.md)."""
    from encgraph.capture.execution import route
    from encgraph.capture.feedback import CostFeedback
    from encgraph.packing.plan import Batch, EagerReason

    rule = DenseRule(CROSS.min_rows, CROSS, calls=1)
    call = piece_attention.SplitCall({GEO: rule}, GEO, None, attention._host_planned_attention)
    site = types.SimpleNamespace(attention=call, bounds_name="cu_seqlens")
    pieces = piecewise.PiecewiseRecord("default", 16, [None] * 5, [site] * 4, 0.0, 30.0, 20.0, 31.0)
    costs = CostModel.linear(["default"], graph_fixed_ms=21, graph_per_budget_ms=0, eager_fixed_ms=20,
                             eager_per_token_ms=0)
    rented: list[int] = []
    adapter = types.SimpleNamespace(
        attention_rows=lambda path, specs: [s.input_size for s in specs],
        eager_surcharge_ms=lambda path, specs: 5.0,  # the eager run would rent: 25 ms against the replay's 21
        rent_replayed=lambda path, specs: rented.append(len(specs)),
    )
    state = types.SimpleNamespace(mode=RunMode.GRAPH, costs=costs, limits=Limits(8, 16),
                                  planning_ladders={"default": (16,)}, adapter=adapter,
                                  records={"default": {16: types.SimpleNamespace(piecewise=pieces)}})
    specs = [ItemSpec({"default": 16}, frames=1, input_size=64 if long else 12)]
    batch = Batch(items=(0,), budgets={"default": None}, tokens={"default": 16}, padded={"default": 0}, frames=1,
                  eager={"default": EagerReason.COST})
    feedback = CostFeedback(lambda: None)  # no timed runs here: events are never made
    assert route(state, feedback, batch, "default", specs) == (16, None)
    assert feedback.rerouted == 1
    assert rented == ([] if long else [1])  # 64 rows split (no eager rent); 12 rows replay whole (rent paid)


class _FakePieces:
    """A piecewise record's surface as run_static uses it; counts replays."""

    def __init__(self, pays: bool) -> None:
        self.answer, self.replays, self.seen = pays, 0, None

    def site_bounds(self, host_bounds):
        return [piecewise.trim_bounds(*host_bounds["cu_seqlens"])]

    def pays(self, bounds):
        self.seen = bounds
        return self.answer

    def replay(self, bounds, *, dense=True):
        self.replays += 1


@pytest.mark.parametrize(("pays", "forced", "split"), [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False),
])
def test_run_static_replays_split_where_it_pays_or_is_forced(monkeypatch, pays, forced, split):
    """GRAPH mode's choice in run_static between the whole graph and its piecewise record, on the bounds the fill
    wrote: by the record's price (``piecewise=None``), always (``True``: the self-check) or never (``False``)."""
    from encgraph.capture.execution import run_static

    specs = {64: {"cu_seqlens": BufferSpec((6,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=64, chunk=64)}}
    buffers = PathBuffers("default", specs, torch.device("cpu"))
    whole = types.SimpleNamespace(replays=0)
    whole.replay = lambda: setattr(whole, "replays", whole.replays + 1)
    out = {"y": torch.arange(64.0)}
    pieces = _FakePieces(pays)
    record = types.SimpleNamespace(graph=whole, outputs=out, piecewise=pieces)
    adapter = types.SimpleNamespace(replay_values=lambda path, sub, budget: {"cu_seqlens": np.array([0, 10, 30])})
    state = types.SimpleNamespace(mode=RunMode.GRAPH, adapter=adapter, buffers={"default": buffers},
                                  records={"default": {64: record}}, copy_outputs=True)
    ran = []
    got = run_static(state, "default", 64, None, 30, piecewise=forced, on_piecewise=lambda: ran.append(1))
    assert (pieces.replays, whole.replays, len(ran)) == ((1, 0, 1) if split else (0, 1, 0))
    assert torch.equal(got["y"], torch.arange(30.0))
    if forced is None:
        assert pieces.seen == [(0, 10, 30)]  # priced on the real sequences the fill wrote, padding dropped
