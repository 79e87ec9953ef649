"""CostModel: costs, interpolation, the non-negative least-squares eager fit, JSON round trips, errors."""

from __future__ import annotations

import json

import pytest

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import CostModel, EagerCost, ItemSpec, pack


def _model() -> CostModel:
    return CostModel(graph_ms={"default": {256: 1.0, 1024: 3.0}}, eager={"default": EagerCost(5.0, 0.004, 0.5)})


def test_graph_cost_measured_interpolated_and_extrapolated():
    m = _model()
    assert m.graph_cost("default", 256) == 1.0
    assert m.graph_cost("default", 640) == pytest.approx(2.0)
    assert m.graph_cost("default", 1792) == pytest.approx(5.0)  # last segment's slope
    assert m.graph_cost("default", 0) == 0.0
    assert m.graph_cost("default", 1) >= 0.0  # clamped
    one = CostModel(graph_ms={"p": {100: 2.0}}, eager={"p": EagerCost(1, 0)})
    assert one.graph_cost("p", 50) == 2.0 and one.graph_cost("p", 200) == 4.0


def test_eager_and_batch_cost():
    m = _model()
    assert m.eager_cost("default", 0, 3) == 0.0
    assert m.eager_cost("default", 1000, 2) == pytest.approx(5.0 + 4.0 + 1.0)
    assert m.batch_cost({"default": 300}, {"default": 1024}) == 3.0
    assert m.batch_cost({"default": 300}, {"default": None}, items=2) == pytest.approx(5.0 + 1.2 + 1.0)
    assert m.batch_cost({"default": 0}, {"default": 0}) == 0.0


def test_plan_cost_sums_batches():
    m = _model()
    plan = pack([ItemSpec(200), ItemSpec(900), ItemSpec(5000)], (256, 1024), max_items=1)
    assert m.plan_cost(plan) == pytest.approx(1.0 + 3.0 + 5.0 + 20.0 + 0.5)


def test_fit_recovers_exact_linear_model():
    samples = [(t, i, 2.0 + 0.01 * t + 0.25 * i) for t, i in [(64, 1), (512, 2), (1024, 1), (4096, 4), (2048, 3)]]
    m = CostModel.from_measurements({"default": {512: 1.0}}, {"default": samples})
    e = m.eager["default"]
    assert (e.fixed_ms, e.per_token_ms, e.per_item_ms) == pytest.approx((2.0, 0.01, 0.25))


def test_fit_clamps_to_non_negative_and_drops_unidentifiable_terms():
    # Time falls with tokens: the unconstrained slope is negative; NNLS keeps it at 0 and fits the mean.
    m = CostModel.from_measurements({"p": {8: 1.0}}, {"p": [(10, 1, 5.0), (20, 1, 4.0), (30, 1, 3.0)]})
    e = m.eager["p"]
    assert e.per_token_ms == 0.0 and e.fixed_ms == pytest.approx(4.0) and e.per_item_ms == 0.0
    # Negative intercept: fitted through the origin instead.
    m = CostModel.from_measurements({"p": {8: 1.0}}, {"p": [(100, 1, 0.5), (200, 1, 1.5)]})
    assert m.eager["p"].fixed_ms == 0.0 and m.eager["p"].per_token_ms > 0


def test_json_round_trip(tmp_path):
    m = CostModel.from_measurements(
        {"global": {272: 1.5, 544: 2.5}, "local": {100: 0.5}},
        {"global": [(256, 1, 3.0), (512, 2, 4.0)], "local": [(144, 1, 2.0), (1440, 1, 6.0)]},
    )
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    m.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == m


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: CostModel(graph_ms={"p": {}}, eager={"p": EagerCost(1, 1)}), ConfigError, "graph_ms['p']"),
        (lambda: CostModel(graph_ms={"p": {0: 1.0}}, eager={"p": EagerCost(1, 1)}), ConfigError, "budget"),
        (lambda: CostModel(graph_ms={"p": {8: -1.0}}, eager={"p": EagerCost(1, 1)}), ConfigError, ">= 0 ms"),
        (lambda: CostModel(graph_ms={"p": {8: "x"}}, eager={"p": EagerCost(1, 1)}), ConfigTypeError, "milliseconds"),
        (lambda: CostModel(graph_ms={"p": {8: 1.0}}, eager={"q": EagerCost(1, 1)}), ConfigError, "same paths"),
        (lambda: CostModel(graph_ms={"p": {8: 1.0}}, eager={"p": (1, 1)}), ConfigTypeError, "EagerCost"),
        (lambda: EagerCost(float("nan"), 1), ConfigError, "fixed_ms"),
        (lambda: CostModel.from_measurements({"p": {8: 1}}, {"p": [(8, 1, 1.0)]}), ConfigError, "at least 2"),
        (lambda: CostModel.from_measurements({"p": {8: 1}}, {"p": [(8, 1)]}), ConfigTypeError, "eager_samples['p']"),
        (lambda: CostModel.from_dict({"format": "x"}), ConfigError, "format"),
        (lambda: _model().graph_cost("nope", 8), ConfigError, "'nope'"),
        (lambda: _model().batch_cost({"default": 300}, {"default": 256}), ConfigError, ">= the path's 300"),
        (lambda: _model().batch_cost({"default": 300}, {}), ConfigError, "missing path"),
    ],
)
def test_errors_name_the_argument(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_load_rejects_non_json(tmp_path):
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="not JSON"):
        CostModel.load(tmp_path / "bad.json")
