"""Properties of the cost-aware ``pack(..., costs=...)`` (hypothesis) and a few worked cases."""

from __future__ import annotations

import json
from bisect import bisect_left

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.strategies import Problem, cost_models, problems

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import CostModel, EagerCost, EagerReason, ItemSpec, Plan, pack


def run(p: Problem, costs: CostModel | None) -> Plan:
    return pack(p.items, p.ladders, max_items=p.max_items, max_frames=p.max_frames, costs=costs)


def ladder_of(p: Problem, path: str) -> tuple[int, ...]:
    return tuple(sorted(set(p.ladders[path] if isinstance(p.ladders, dict) else p.ladders)))


def lone(p: Problem, i: int) -> bool:
    item = p.items[i]
    over_frames = p.max_frames is not None and item.frames > p.max_frames
    return over_frames or any(item.tokens[q] > max(ladder_of(p, q)) for q in p.paths)


@given(problems(), st.data())
def test_never_costs_more_than_greedy(p: Problem, data: st.DataObject) -> None:
    model = data.draw(cost_models(p.paths))
    # With the items, plan_cost prices replays by their content as the planner does (the attention term).
    greedy = model.plan_cost(run(p, None), p.items)
    costed = model.plan_cost(run(p, model), p.items)
    assert costed <= greedy + 1e-9 * (1.0 + greedy)


@given(problems(), st.data())
def test_greedy_invariants_hold(p: Problem, data: st.DataObject) -> None:
    model = data.draw(cost_models(p.paths))
    plan = run(p, model)
    # Plan.from_dict re-validates everything (limits, budgets of the ladders, each item once, padding).
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    placed = sorted(i for b in plan.batches for i in b.items)
    assert placed == list(range(len(p.items)))
    for b in plan.batches:
        assert len(b.items) <= p.max_items
        assert b.frames == sum(p.items[i].frames for i in b.items)
        if any(lone(p, i) for i in b.items):
            assert len(b.items) == 1, "an item over a largest budget or max_frames sits alone"
        elif p.max_frames is not None:
            assert b.frames <= p.max_frames
        for path in p.paths:
            ladder = ladder_of(p, path)
            t = b.tokens[path]
            assert t == sum(p.items[i].tokens[path] for i in b.items)
            budget = b.budgets[path]
            if t == 0:
                assert budget == 0 and path not in b.eager
            elif budget is not None:
                assert budget == ladder[bisect_left(ladder, t)], "graph: the smallest fitting budget"
            else:
                reason = b.eager[path]
                fits = t <= ladder[-1] and not (p.max_frames is not None and b.frames > p.max_frames)
                assert (reason is EagerReason.COST) == fits
                if reason is EagerReason.COST:
                    graph = model.graph_cost(path, ladder[bisect_left(ladder, t)])
                    assert model.eager_cost(path, t, len(b.items)) < graph


@given(problems(), st.data())
def test_deterministic_and_order_restored(p: Problem, data: st.DataObject) -> None:
    model = data.draw(cost_models(p.paths))
    plan = run(p, model)
    assert run(p, model) == plan
    results = [[("r", i) for i in b.items] for b in plan.batches]
    assert plan.restore(results) == [("r", i) for i in range(len(p.items))]


@given(problems(), st.data())
def test_batches_are_runs_of_the_sorted_order(p: Problem, data: st.DataObject) -> None:
    model = data.draw(cost_models(p.paths))
    order = sorted(range(len(p.items)), key=lambda i: p.items[i].total_tokens)
    kept = [i for i in order if not lone(p, i)]
    pos = {i: k for k, i in enumerate(kept)}
    firsts = []
    for b in run(p, model).batches:
        if len(b.items) > 1 or not lone(p, b.items[0]):
            ks = [pos[i] for i in b.items]
            assert ks == list(range(ks[0], ks[0] + len(ks)))
        firsts.append(order.index(b.items[0]))
    assert firsts == sorted(firsts)


def _linear(graph_fixed: float, eager_fixed: float) -> CostModel:
    return CostModel.linear(
        ["default"], graph_fixed_ms=graph_fixed, graph_per_budget_ms=0.004, eager_fixed_ms=eager_fixed,
        eager_per_token_ms=0.0045,
    )


def test_small_item_in_a_huge_budget_goes_eager_by_cost():
    # vLLM PR 52229: 64 tokens padded to 4096 cost far more than running them eager.
    plan = pack([ItemSpec(64)], (4096,), max_items=1, costs=_linear(0.5, 1.0))
    assert plan.batches[0].budgets == {"default": None}
    assert plan.batches[0].eager == {"default": EagerReason.COST}


@pytest.mark.parametrize("eager_over_graph", [0.9, 0.97, 1.0])
@pytest.mark.parametrize("shape", ["one item", "a run", "lone on another path"])
def test_eager_must_beat_the_replay_by_the_margin(eager_over_graph: float, shape: str) -> None:
    """A replay predicted within EAGER_MARGIN of eager is taken (eager's calls read slower than its capture
    timing); eager only where it is clearly cheaper, on every planner route: one item, a run the dynamic
    programme prices, an item alone because it is over another path's largest budget."""
    from encgraph.packing.cost_pack import EAGER_MARGIN

    graph = 20.0
    eager = EagerCost(graph * eager_over_graph, 0.0)  # every run the same expected time
    paths = ["a", "b"] if shape == "lone on another path" else ["a"]
    model = CostModel(graph_ms={p: {64: graph, 128: graph} for p in paths}, eager={p: eager for p in paths})
    if shape == "one item":
        items = [ItemSpec({"a": 50})]
    elif shape == "a run":
        items = [ItemSpec({"a": 30}), ItemSpec({"a": 40}), ItemSpec({"a": 50})]
    else:
        items = [ItemSpec({"a": 50, "b": 500})]  # over b's 128: alone, b eager by tokens
    plan = pack(items, {p: (64, 128) for p in paths}, max_items=4, costs=model)
    want_eager = eager_over_graph * EAGER_MARGIN < 1.0
    assert eager_over_graph == 0.9 and want_eager or eager_over_graph >= 0.97 and not want_eager
    assert sorted(i for b in plan.batches for i in b.items) == list(range(len(items)))
    for b in plan.batches:
        assert (b.budgets["a"] is None) == want_eager
        assert b.eager.get("a") == (EagerReason.COST if want_eager else None)
    # The planner's own total is what the plan costs under the model, whichever side the margin chose.
    assert model.plan_cost(plan) == pytest.approx(sum(
        (graph * eager_over_graph if want_eager else graph) + (graph * eager_over_graph if len(paths) == 2 else 0)
        for _ in plan.batches))


def test_splits_where_padding_a_shared_budget_costs_more():
    items = [ItemSpec(200), ItemSpec(200), ItemSpec(300)]
    model = CostModel(graph_ms={"default": {256: 1.0, 512: 1.5, 1024: 8.0}}, eager={"default": EagerCost(50, 0)})
    greedy = pack(items, (256, 512, 1024), max_items=4)
    costed = pack(items, (256, 512, 1024), max_items=4, costs=model)
    assert [b.items for b in greedy.batches] == [(0, 1, 2)]
    assert [(b.items, b.budgets["default"]) for b in costed.batches] == [((0,), 256), ((1, 2), 512)]
    assert model.plan_cost(costed) == 2.5 < model.plan_cost(greedy) == 8.0


def test_costs_errors():
    with pytest.raises(ConfigTypeError, match=r"pack\(costs\)"):
        pack([ItemSpec(8)], (8,), max_items=1, costs={"default": 1})
    other = CostModel(graph_ms={"global": {8: 1.0}}, eager={"global": EagerCost(1, 0)})
    with pytest.raises(ConfigError, match="missing path 'default'"):
        pack([ItemSpec(8)], (8,), max_items=1, costs=other)


def test_no_items():
    assert pack([], (8,), max_items=1, costs=_linear(1, 1)).batches == ()


def test_attention_term_packs_large_images_into_one_larger_replay() -> None:
    """Measured shape of the Qwen3-VL-8B tower on the H200 (budgets 1280 / 2240 as one attention sequence:
    29.6 / 67.6 ms; the 1280 replay split into 16 sequences about 14 ms cheaper): two images of 1100 tokens
    cost 59.2 ms in two 1280 replays, and about 50 ms in one 2240 replay, where each image attends only to
    itself. Without the attention term the 2240 replay looks like 67.6 ms and the planner keeps them apart."""
    graph = {"default": {1280: 29.6, 2240: 67.6}}
    eager = {"default": EagerCost(0.0, 0.0, curve=((30, 13.0), (1406, 37.7), (3968, 184.0)))}
    items = [ItemSpec(1100), ItemSpec(1100)]
    plain = CostModel(graph_ms=graph, eager=eager)
    a = 14.0 / (1280**2 * (1 - 1 / 16))  # ms per token^2, as the runner derives it from the split replay
    aware = CostModel(graph_ms=graph, eager=eager, attention={"default": a})
    apart = pack(items, (1280, 2240), max_items=8, costs=plain)
    assert [b.budgets["default"] for b in apart.batches] == [1280, 1280]
    together = pack(items, (1280, 2240), max_items=8, costs=aware)
    assert [b.budgets["default"] for b in together.batches] == [2240]
    assert aware.plan_cost(together, items) < aware.plan_cost(apart, items) == pytest.approx(
        2 * (29.6 - a * (1280**2 - 1100**2 - 180**2)))
    # A video attends frame by frame: its squares are tokens^2 / frames.
    video = [ItemSpec(2000, frames=8)]
    assert aware.plan_cost(pack(video, (1280, 2240), max_items=8, costs=aware), video) == pytest.approx(
        67.6 - a * (2240**2 - 2000**2 / 8 - 240**2))


@given(problems(), st.data())
def test_the_planners_own_total_is_what_plan_cost_prices(p: Problem, data: st.DataObject) -> None:
    """The planner's vectorised prices (the ladder tuner ranks ladders by them) agree with ``plan_cost`` on the
    plan it returns, with the attention term at any power."""
    import encgraph.packing.greedy as greedy

    model = data.draw(cost_models(p.paths))
    totals: list[float] = []
    real = greedy.cost_batches

    def recording(*args, **kw):
        batches, total = real(*args, **kw)
        totals.append(total)
        return batches, total

    greedy.cost_batches = recording
    try:
        plan = run(p, model)
    finally:
        greedy.cost_batches = real
    expected = model.plan_cost(plan, p.items)
    assert totals == [pytest.approx(expected, rel=1e-9, abs=1e-9)]


@given(problems(), st.data())
def test_a_remembered_plan_is_the_plan_computed_afresh(p: Problem, data: st.DataObject) -> None:
    """pack keeps least-cost plans by their items, ladders, limits and cost model object: the plan it finds kept
    is the one it computes with nothing kept, and a model with equal fields but another identity plans afresh."""
    from encgraph.packing import greedy

    model = data.draw(cost_models(p.paths))
    greedy._COSTED.clear()
    fresh = run(p, model)
    assert run(p, model) == fresh  # from the memo
    twin = CostModel.from_dict(model.to_dict())
    assert run(p, twin) == fresh
    other = data.draw(cost_models(p.paths))
    greedy._COSTED.clear()
    want = run(p, other)
    greedy._COSTED.clear()
    run(p, model)
    assert run(p, other) == want


def test_the_plan_memo_is_bounded_and_answers_only_its_cost_model():
    from encgraph.packing import greedy

    memo = greedy._CostedPlans(2)
    a, b = CostModel.linear(["default"], graph_fixed_ms=1, graph_per_budget_ms=0.1, eager_fixed_ms=2,
                            eager_per_token_ms=0.1), CostModel.linear(["default"], graph_fixed_ms=1,
                                                                      graph_per_budget_ms=0.1, eager_fixed_ms=2,
                                                                      eager_per_token_ms=0.1)
    memo.put(("k1",), a, [])
    assert memo.get(("k1",), a) == [] and memo.get(("k1",), b) is None
    memo.put(("k2",), a, [])
    memo.put(("k3",), a, [])
    assert memo.get(("k1",), a) is None and memo.get(("k3",), a) == []
