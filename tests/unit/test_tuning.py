"""tune_ladder: never worse than the baseline, constraints, determinism, a known answer, errors, run time."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.strategies import cost_models

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import ItemSpec, pack
from encgraph.packing.tuning import DEFAULT_COSTS, default_cost_model, tune_ladder


def traffic(draw, paths=("default",)) -> list:
    n = draw(st.integers(1, 30))
    out = []
    for _ in range(n):
        k = draw(st.integers(1, 5))
        if paths == ("default",):
            out.append([draw(st.integers(1, 3000)) for _ in range(k)])
        else:
            out.append([ItemSpec({p: draw(st.integers(0, 1500)) for p in paths} | {paths[0]: draw(st.integers(1, 900))},
                                 frames=draw(st.integers(1, 3))) for _ in range(k)])
    return out


def expected(observed, ladders, costs, max_items, max_frames=None) -> float:
    lad = {p: tuple(b for b in lad if b) for p, lad in ladders.items()}
    total = 0.0
    for req in observed:
        items = [it if isinstance(it, ItemSpec) else ItemSpec(it) for it in req]
        total += costs.plan_cost(pack(items, lad, max_items=max_items, max_frames=max_frames, costs=costs), items)
    return total


@settings(max_examples=20)
@given(st.data())
def test_never_worse_than_the_baseline_and_costs_are_the_packs(data) -> None:
    paths = data.draw(st.sampled_from([("default",), ("global", "local")]))
    observed = traffic(data.draw, paths)
    costs = data.draw(st.none() | cost_models(paths))
    max_items = data.draw(st.integers(1, 4))
    tuned = tune_ladder(observed, max_budgets=8, max_items=max_items, costs=costs)
    model = costs or default_cost_model(paths)
    assert tuned.cost_after_ms <= tuned.cost_before_ms + 1e-9 * (1 + tuned.cost_before_ms)
    assert tuned.cost_after_ms == pytest.approx(expected(observed, tuned.ladders, model, max_items), rel=1e-9, abs=1e-9)
    assert tuned.cost_before_ms == pytest.approx(expected(observed, tuned.baseline, model, max_items), rel=1e-9, abs=1e-9)
    assert 0.0 <= tuned.padded_share_after <= 1.0


@settings(max_examples=30)
@given(st.data())
def test_respects_max_budgets_granularity_bounds_and_memory_cap(data) -> None:
    paths = data.draw(st.sampled_from([("default",), ("global", "local")]))
    observed = traffic(data.draw, paths)
    n = data.draw(st.integers(1, 4))
    gran = data.draw(st.sampled_from([1, 16, 64]))
    cap = data.draw(st.none() | st.integers(128 * len(paths), 8000))
    tuned = tune_ladder(observed, max_budgets=n, max_items=2, memory_cap_tokens=cap, granularity=gran, min_budget=32)
    total = 0
    for p, lad in tuned.ladders.items():
        nonzero = [b for b in lad if b]
        assert 1 <= len(nonzero) <= n
        assert all(b % gran == 0 and b >= 32 for b in nonzero)
        total += sum(nonzero)
        need = max((it.tokens[p] if isinstance(it, ItemSpec) else it) for req in observed for it in req)
        if cap is None:
            assert max(nonzero) >= need, "the largest item is covered when no cap binds"
    if cap is not None:
        assert total <= cap


def test_deterministic():
    rng = random.Random(3)
    observed = [[rng.randint(64, 2048) for _ in range(rng.randint(1, 6))] for _ in range(200)]
    assert tune_ladder(observed, max_budgets=4, max_items=4) == tune_ladder(observed, max_budgets=4, max_items=4)


@pytest.mark.parametrize("gran, want", [(64, 320), (1, 300)])
def test_images_of_300_tokens(gran, want):
    tuned = tune_ladder([[300]] * 100, max_budgets=4, max_items=1, granularity=gran)
    assert tuned.ladders == {"default": (want,)}
    assert tuned.cost_after_ms <= tuned.cost_before_ms
    assert tuned.padded_share_after <= tuned.padded_share_before
    assert tuned.to_runner_options() == {"budgets": (want,), "max_items": 1}


def test_over_the_memory_cap_goes_eager():
    tuned = tune_ladder([[300], [5000]], max_budgets=2, max_items=1, memory_cap_tokens=1024)
    assert sum(tuned.ladders["default"]) <= 1024 and max(tuned.ladders["default"]) < 5000


def test_two_paths_options_and_zero_budget():
    observed = [[ItemSpec({"global": 256, "local": 0})], [ItemSpec({"global": 256, "local": 1440})]]
    tuned = tune_ladder(observed, max_budgets=3, max_items=1, max_frames=2, baseline={"global": [256, 512], "local": [144, 2880]})
    opts = tuned.to_runner_options()
    assert set(opts["budgets"]) == {"global", "local"} and opts["budgets"]["local"][0] == 0
    assert opts["max_frames"] == 2
    assert tuned.baseline == {"global": (256, 512), "local": (0, 144, 2880)}


def test_bounded_run_time_for_1000_requests():
    rng = random.Random(0)
    observed = [[rng.randint(64, 2048) for _ in range(rng.randint(1, 8))] for _ in range(1000)]
    t0 = time.process_time()
    tuned = tune_ladder(observed, max_budgets=6, max_items=8)
    # CPU time, which a loaded machine inflates less than wall time. On the 2-core CI-class VM this call takes
    # 0.94-1.45 s (it failed a 1.5 s bound once, at 1.53 s, while a profiled server shared the machine); 3 s still
    # catches what this guards against, a search that grows faster than the traffic.
    assert time.process_time() - t0 < 3.0
    assert tuned.cost_after_ms < tuned.cost_before_ms


def test_default_costs_in_one_place():
    m = default_cost_model(["default"])
    assert m.graph_cost("default", 1000) == pytest.approx(DEFAULT_COSTS["graph_fixed_ms"] + 1000 * DEFAULT_COSTS["graph_per_budget_ms"])
    assert m.eager_cost("default", 1000, 1) == pytest.approx(DEFAULT_COSTS["eager_fixed_ms"] + 1000 * DEFAULT_COSTS["eager_per_token_ms"])


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(observed=[]), ConfigError, "observed"),
        (dict(observed=[[1.5]]), ConfigTypeError, "observed[0][0]"),
        (dict(observed=[[ItemSpec(8)], [ItemSpec({"a": 8})]]), ConfigError, "same paths"),
        (dict(max_budgets=0), ConfigError, "max_budgets"),
        (dict(granularity=0), ConfigError, "granularity"),
        (dict(max_budget=10), ConfigError, "max_budget"),
        (dict(memory_cap_tokens=10), ConfigError, "memory_cap_tokens"),
        (dict(costs="x"), ConfigTypeError, "tune_ladder(costs)"),
        (dict(max_frames=0), ConfigError, "max_frames"),
    ],
)
def test_errors(kwargs, error, text):
    args = dict(observed=[[300]], max_budgets=2, max_items=1) | kwargs
    with pytest.raises(error) as info:
        tune_ladder(**args)
    assert text in str(info.value)
