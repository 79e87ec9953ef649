"""The attention term the runner measures at capture (``attention_timing.attention_terms``), on the CPU: a stand-in
runner whose "graph" costs a fixed part plus a part per sequence length squared, read from the bounds buffer
as a replay would, so the coefficient, the budget it is measured at, the buffers split (only unchunked bounds)
and every reason to skip are checked without a GPU."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import encgraph.capture.capture
from encgraph.capture.attention_timing import SPLIT_SEQUENCES
from encgraph.capture.attention_timing import attention_terms as _attention_terms
from encgraph.capture.buffers import PathBuffers
from encgraph.capture.protocol import BudgetUnit, BufferSpec, FillRule, PathSpec
from encgraph.capture.selfcheck import SAMPLE_SIZES, timed_budgets
from encgraph.packing import CostModel, EagerCost, ItemSpec, pack

ROWS_PER_TOKEN = 4  # Qwen-VL: 2 x 2 patch rows per merged token
FIXED_MS, MS_PER_ROW2 = 3.0, 2e-6


def _specs(budget: int, slots: int = 66) -> dict[str, BufferSpec]:
    rows = budget * ROWS_PER_TOKEN
    return {
        "pixels": BufferSpec((rows, 8), torch.float32),
        "cu_seqlens": BufferSpec((slots,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows, chunk=rows),
        # Windowed attention: padding chunked into windows; splitting it would change what the layers compute.
        "cu_window_seqlens": BufferSpec((rows // 16 + 2,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows,
                                        chunk=16),
    }


class Graph:
    """A replay's cost from the buffers it reads: fixed + per full-attention row^``power`` (windows cost
    nothing)."""

    def __init__(self, views: dict[str, torch.Tensor], seen: list[np.ndarray], fail: bool = False,
                 power: float = 2.0) -> None:
        self.views, self.seen, self.fail, self.power = views, seen, fail, power
        self.last_ms = 0.0

    def replay(self) -> None:
        if self.fail:
            raise RuntimeError("replay failed")
        cu = self.views["cu_seqlens"].numpy().astype(np.int64)
        self.seen.append(cu.copy())
        self.last_ms = FIXED_MS + MS_PER_ROW2 * float((np.diff(cu).astype(np.float64) ** self.power).sum())


@pytest.fixture(autouse=True)
def simulated_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays are timed by the cost the stand-in graph computes from its buffers, not by the host's clock."""

    def time_host(fn, repeats, device):
        fn()
        return fn.__self__.last_ms

    monkeypatch.setattr(encgraph.capture.capture, "time_host", time_host)


def runner(ladder: tuple[int, ...], *, unit: BudgetUnit = BudgetUnit.TOKENS, slots: int = 66, fail: bool = False,
           power: float = 2.0):
    buffers = PathBuffers("default", {b: _specs(b, slots) for b in ladder}, torch.device("cpu"))
    seen: list[np.ndarray] = []
    records = {}
    for b in ladder:
        graph = Graph(buffers.view(b), seen, fail, power)
        records[b] = types.SimpleNamespace(path="default", budget=b, graph=graph, inputs=buffers.view(b), replay_ms=1.0)
    spec = PathSpec("default", min(ladder), max(ladder), unit=unit)
    r = types.SimpleNamespace(records={"default": records}, buffers={"default": buffers},
                              config=types.SimpleNamespace(path=lambda name: spec), device=torch.device("cpu"))
    return r, seen


def test_coefficient_at_a_quarter_of_the_largest_budget() -> None:
    r, seen = runner((64, 256, 1024, 2048, 4096))
    terms = _attention_terms(r)["default"]
    assert terms["budget"] == 1024 and terms["sequences"] == SPLIT_SEQUENCES  # smallest >= 4096 / 4
    rows = 1024 * ROWS_PER_TOKEN
    assert terms["full_ms"] == pytest.approx(FIXED_MS + MS_PER_ROW2 * rows**2, abs=1e-4)  # reported to 4 places
    assert terms["split_ms"] == pytest.approx(FIXED_MS + MS_PER_ROW2 * rows**2 / SPLIT_SEQUENCES, abs=1e-4)
    # In tokens^2: the row coefficient times rows per token squared.
    assert terms["coef"] == pytest.approx(MS_PER_ROW2 * ROWS_PER_TOKEN**2)
    assert terms["power"] == 2.0 and terms["fit"]["budget"] == 4096  # and the largest, for the power
    full, split, full_top, split_top = seen
    assert np.diff(full_top[:2]).tolist() == [4096 * ROWS_PER_TOKEN] and split_top[SPLIT_SEQUENCES] == 4 * rows
    assert np.diff(full[full <= rows]).tolist()[:1] == [rows]  # the one-sequence fill
    assert np.unique(np.diff(split[: SPLIT_SEQUENCES + 1])).tolist() == [rows // SPLIT_SEQUENCES]
    assert split[SPLIT_SEQUENCES] == rows and (split[SPLIT_SEQUENCES:] == rows).all()


def test_the_measured_term_prices_replays_by_their_content() -> None:
    """With the measured coefficient the model predicts the stand-in's cost of any packing exactly (a ladder
    of two budgets, less than twice apart: one split replay, power 2)."""
    r, _ = runner((1024, 2048))
    coef = _attention_terms(r)["default"]["coef"]
    full = {b: FIXED_MS + MS_PER_ROW2 * (b * ROWS_PER_TOKEN) ** 2 for b in (1024, 2048)}
    model = CostModel(graph_ms={"default": full}, eager={"default": EagerCost(500.0, 0.0)},
                      attention={"default": coef})
    items = [ItemSpec(900), ItemSpec(1000)]
    plan = pack(items, (1024, 2048), max_items=4, costs=model)
    assert [b.budgets["default"] for b in plan.batches] == [2048]  # together: cheaper than 2 x 1024
    truth = FIXED_MS + MS_PER_ROW2 * ROWS_PER_TOKEN**2 * (900**2 + 1000**2 + 148**2)
    assert model.plan_cost(plan, items) == pytest.approx(truth)


@pytest.mark.parametrize("kwargs, why", [
    ({"unit": BudgetUnit.ITEMS}, "budgets count items"),
    ({"slots": 2}, "too few sequence slots"),
])
def test_skipped_paths_say_why(kwargs, why) -> None:
    r, seen = runner((64, 256), **kwargs)
    assert _attention_terms(r) == {"default": {"skipped": why}} and not seen


def test_a_failed_timing_is_logged_and_leaves_the_path_without_the_term(caplog) -> None:
    r, _ = runner((64, 256), fail=True)
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        terms = _attention_terms(r)["default"]
    assert "coef" not in terms and "RuntimeError" in terms["skipped"]
    assert "attention term of the cost model was not measured" in caplog.text


def test_any_error_in_a_path_leaves_only_that_path_without_the_term(caplog) -> None:
    r, _ = runner((64, 256))
    r.buffers = {}  # a runner state the measurement does not expect: KeyError before any timing
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        assert "KeyError" in _attention_terms(r)["default"]["skipped"]
    assert "attention term of the cost model was not measured" in caplog.text


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=1, max_value=20000), min_size=1, max_size=40, unique=True))
def test_eager_samples_cover_the_ladder_by_index_and_by_tokens(budgets):
    """The eager curve is a chord between timed samples: no two consecutive ones may be farther apart in tokens
    than a SAMPLE_SIZES-th of the span plus the ladder's widest step, and the ends are always timed."""
    ladder = sorted(budgets)
    picks = sorted(timed_budgets(ladder))
    assert set(picks) <= set(ladder) and picks[0] == ladder[0] and picks[-1] == ladder[-1]
    widest = max((b - a for a, b in zip(ladder, ladder[1:])), default=0)
    assert all(b - a <= (ladder[-1] - ladder[0]) / SAMPLE_SIZES + widest for a, b in zip(picks, picks[1:]))
    assert len(picks) <= 2 * SAMPLE_SIZES + 1


def test_the_power_is_fitted_from_two_budgets() -> None:
    """A stand-in whose attention costs rows^1.8 (a kernel more efficient on longer sequences): the fit finds 1.8,
    and the model prices packings of any sizes the stand-in runs as it does; the square law fitted at 1024 would
    price three 1,300-token images in one 4096 replay at 12.8 ms, 40% of the 32.6 they cost."""
    r, _ = runner((1024, 2048, 4096), power=1.8)
    term = _attention_terms(r)["default"]
    assert term["power"] == pytest.approx(1.8, abs=1e-4) and term["fit"]["budget"] == 4096

    def truth(seqs: list[int]) -> float:
        return FIXED_MS + MS_PER_ROW2 * sum(float(n * ROWS_PER_TOKEN) ** 1.8 for n in seqs)

    full = {b: truth([b]) for b in (1024, 2048, 4096)}
    model = CostModel(graph_ms={"default": full}, eager={"default": EagerCost(500.0, 0.0)},
                      attention={"default": term["coef"]}, attention_power={"default": term["power"]})
    items = [ItemSpec(1300), ItemSpec(1300), ItemSpec(1300)]
    plan = pack(items, (1024, 2048, 4096), max_items=4, costs=model)
    assert [b.budgets["default"] for b in plan.batches] == [4096]
    assert model.plan_cost(plan, items) == pytest.approx(truth([1300, 1300, 1300, 196]), rel=1e-3)
    square = CostModel(graph_ms={"default": full}, eager=model.eager,
                       attention={"default": (full[1024] - truth([64] * 16)) / (1024**2 * (1 - 1 / 16))})
    assert square.plan_cost(plan, items) < 0.5 * truth([1300, 1300, 1300, 196])
