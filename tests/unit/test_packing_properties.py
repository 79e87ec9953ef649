"""Properties of ``pack`` that must hold for every valid input (hypothesis)."""

from __future__ import annotations

import json

from hypothesis import given
from tests.strategies import Problem, problems

from encgraph.packing import EagerReason, Plan, pack


def run(p: Problem) -> Plan:
    return pack(p.items, p.ladders, max_items=p.max_items, max_frames=p.max_frames)


def ladder_of(p: Problem, path: str) -> tuple[int, ...]:
    return tuple(sorted(set(p.ladders[path] if isinstance(p.ladders, dict) else p.ladders)))


def frames_over(p: Problem, frames: int) -> bool:
    return p.max_frames is not None and frames > p.max_frames


def alone_reason(p: Problem, index: int) -> bool:
    """Whether item ``index`` must sit alone: over some path's largest budget, or over max_frames."""
    item = p.items[index]
    return frames_over(p, item.frames) or any(item.tokens[q] > max(ladder_of(p, q)) for q in p.paths)


@given(problems())
def test_every_item_placed_exactly_once(p: Problem) -> None:
    plan = run(p)
    placed = [i for b in plan.batches for i in b.items]
    assert sorted(placed) == list(range(len(p.items)))
    assert plan.n_items == len(p.items)
    assert plan.paths == p.paths


@given(problems())
def test_items_processed_in_stable_ascending_token_order(p: Problem) -> None:
    plan = run(p)
    placed = [i for b in plan.batches for i in b.items]
    assert placed == sorted(range(len(p.items)), key=lambda i: p.items[i].total_tokens)


@given(problems())
def test_no_batch_over_any_limit(p: Problem) -> None:
    plan = run(p)
    for b in plan.batches:
        assert 1 <= len(b.items) <= p.max_items
        assert b.frames == sum(p.items[i].frames for i in b.items)
        if frames_over(p, b.frames):
            assert len(b.items) == 1, "only a lone item may exceed max_frames"
        for path in p.paths:
            assert b.tokens[path] == sum(p.items[i].tokens[path] for i in b.items)
            budget = b.budgets[path]
            if budget is not None:
                assert b.tokens[path] <= budget
                assert b.padded[path] == budget - b.tokens[path]
            else:
                assert b.padded[path] == 0
                assert len(b.items) == 1, "only a lone item runs eager in the greedy pack"


@given(problems())
def test_chosen_budget_is_the_smallest_that_fits(p: Problem) -> None:
    plan = run(p)
    for b in plan.batches:
        for path in p.paths:
            tokens, budget = b.tokens[path], b.budgets[path]
            fitting = [x for x in ladder_of(p, path) if x >= tokens and x > 0]
            if tokens == 0:
                assert budget == 0
            elif budget is not None:
                assert budget == min(fitting)
                assert budget in ladder_of(p, path)


@given(problems())
def test_eager_only_where_nothing_fits(p: Problem) -> None:
    plan = run(p)
    for b in plan.batches:
        assert set(b.eager) == {q for q in p.paths if b.budgets[q] is None}
        for path, reason in b.eager.items():
            assert reason in (EagerReason.TOKENS, EagerReason.FRAMES)
            assert b.tokens[path] > 0
            if reason is EagerReason.TOKENS:
                assert b.tokens[path] > max(ladder_of(p, path))
                assert not frames_over(p, b.frames)
            else:
                assert frames_over(p, b.frames)
        # Conversely: a path with tokens where a budget fits is replayed, unless the frames do not fit.
        for path in p.paths:
            fits = b.tokens[path] <= max(ladder_of(p, path))
            if b.tokens[path] and fits and not frames_over(p, b.frames):
                assert b.budgets[path] is not None


@given(problems(min_paths=2))
def test_partial_eager_only_on_the_overflowing_path(p: Problem) -> None:
    plan = run(p)
    for b in plan.batches:
        if any(r is EagerReason.TOKENS for r in b.eager.values()):
            for path in p.paths:
                over = b.tokens[path] > max(ladder_of(p, path))
                assert (b.budgets[path] is None) == over


@given(problems())
def test_lone_items_sit_alone_and_next_fit_is_maximal(p: Problem) -> None:
    plan = run(p)
    for b in plan.batches:
        if any(alone_reason(p, i) for i in b.items):
            assert len(b.items) == 1
    # Next-fit: a batch closes only because the next item would not fit in it.
    for a, nxt in zip(plan.batches, plan.batches[1:]):
        first = nxt.items[0]
        if alone_reason(p, first) or any(alone_reason(p, i) for i in a.items):
            continue
        item = p.items[first]
        too_many = len(a.items) + 1 > p.max_items
        too_many_frames = frames_over(p, a.frames + item.frames)
        too_many_tokens = any(a.tokens[q] + item.tokens[q] > max(ladder_of(p, q)) for q in p.paths)
        assert too_many or too_many_frames or too_many_tokens


@given(problems())
def test_deterministic(p: Problem) -> None:
    assert run(p) == run(p)
    assert run(p).to_dict() == run(p).to_dict()


@given(problems())
def test_order_restored(p: Problem) -> None:
    plan = run(p)
    tags = [f"item-{i}" for i in range(len(p.items))]
    per_batch = [[tags[i] for i in b.items] for b in plan.batches]
    assert plan.restore(per_batch) == tags


@given(problems())
def test_json_round_trip(p: Problem) -> None:
    plan = run(p)
    text = json.dumps(plan.to_dict())
    again = Plan.from_dict(json.loads(text))
    assert again == plan
    assert again.to_dict() == plan.to_dict()


@given(problems())
def test_totals_agree_with_batches(p: Problem) -> None:
    plan = run(p)
    totals = plan.totals()
    assert list(totals) == list(p.paths)
    for path in p.paths:
        real = sum(item.tokens[path] for item in p.items)
        assert totals[path]["real_tokens"] == plan.real_tokens(path) == real
        assert totals[path]["padded_tokens"] == plan.padded_tokens(path) >= 0
        assert totals[path]["eager_items"] == plan.eager_items(path)
        assert 0.0 <= totals[path]["padded_share"] < 1.0 or real == 0


@given(problems(min_paths=2, max_paths=3))
def test_path_order_of_ladders_does_not_change_decisions(p: Problem) -> None:
    plan = run(p)
    reordered = dict(reversed(list(p.ladders.items())))
    other = pack(p.items, reordered, max_items=p.max_items, max_frames=p.max_frames)
    assert other.paths == tuple(reversed(p.paths))
    assert [b.items for b in other.batches] == [b.items for b in plan.batches]
    assert [b.budgets for b in other.batches] == [b.budgets for b in plan.batches]


def reference_pack(p: Problem) -> list[dict]:
    """The rules of ``pack`` written as plainly as possible, as an oracle for the fast implementation."""
    lads = {q: ladder_of(p, q) for q in p.paths}
    limit = p.max_frames if p.max_frames is not None else float("inf")
    order = sorted(range(len(p.items)), key=lambda i: p.items[i].total_tokens)
    groups: list[list[int]] = []
    for i in order:
        item = p.items[i]
        if alone_reason(p, i):
            groups.append([i])
            groups.append([])  # nothing joins a lone item
            continue
        if groups and groups[-1]:
            cur = groups[-1]
            ok = (
                len(cur) + 1 <= p.max_items
                and sum(p.items[j].frames for j in cur) + item.frames <= limit
                and all(sum(p.items[j].tokens[q] for j in cur) + item.tokens[q] <= max(lads[q]) for q in p.paths)
            )
            if ok:
                cur.append(i)
                continue
        groups.append([i])
    out = []
    for g in (g for g in groups if g):
        frames = sum(p.items[j].frames for j in g)
        budgets, tokens, padded, eager = {}, {}, {}, {}
        for q in p.paths:
            t = sum(p.items[j].tokens[q] for j in g)
            tokens[q] = t
            if t == 0:
                budgets[q], padded[q] = 0, 0
            elif frames > limit:
                budgets[q], padded[q], eager[q] = None, 0, "FRAMES"
            elif t > max(lads[q]):
                budgets[q], padded[q], eager[q] = None, 0, "TOKENS"
            else:
                budgets[q] = min(b for b in lads[q] if b >= t)
                padded[q] = budgets[q] - t
        out.append(
            {"items": g, "budgets": budgets, "tokens": tokens, "padded": padded, "frames": frames, "eager": eager}
        )
    return out


@given(problems())
def test_matches_the_reference_rules(p: Problem) -> None:
    assert run(p).to_dict()["batches"] == reference_pack(p)
