"""Plans and batches: validation, totals, ``restore``, ``to_dict`` / ``from_dict``."""

from __future__ import annotations

import copy
import json

import attrs
import pytest

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import Batch, EagerReason, ItemSpec, Limits, Plan, budget_ladder, pack
from tests.unit._helpers import check_bad_argument

TWO = {"global": budget_ladder(272, 13824), "local": budget_ladder(100, 4000, allow_zero=True)}


def sample_plan() -> Plan:
    items = [ItemSpec({"global": 256, "local": 144 * k}) for k in (30, 0, 3, 20, 10)]
    return pack(items, TWO, max_items=4)


def test_plan_fields() -> None:
    plan = sample_plan()
    assert plan.n_items == 5
    assert plan.paths == ("global", "local")
    assert plan.ladders == {p: tuple(v) for p, v in TWO.items()}
    assert plan.limits == Limits(max_items=4, max_frames=4)
    # Tiles 0, 3, 10 (1872 local tokens) fit 4000; 20 more tiles would not; 30 tiles overflow alone.
    assert [b.items for b in plan.batches] == [(1, 2, 4), (3,), (0,)]
    assert [b.budgets for b in plan.batches] == [
        {"global": 1088, "local": 3200},
        {"global": 272, "local": 3200},
        {"global": 272, "local": None},
    ]
    assert plan.batches[2].eager == {"local": EagerReason.TOKENS}


def test_totals() -> None:
    plan = sample_plan()
    local_real = 144 * 63
    local_padded = (3200 - 1872) + (3200 - 2880)
    assert plan.real_tokens("local") == local_real
    assert plan.padded_tokens("local") == local_padded
    assert plan.eager_items("local") == 1
    assert plan.eager_items("global") == 0
    totals = plan.totals()
    assert totals["global"] == {
        "real_tokens": 1280,
        "padded_tokens": (1088 - 768) + 16 + 16,
        "eager_items": 0,
        "padded_share": pytest.approx(352 / (1280 + 352)),
    }
    assert totals["local"]["padded_share"] == pytest.approx(local_padded / (local_real + local_padded))


def test_restore_puts_results_in_the_callers_order() -> None:
    plan = sample_plan()
    results = [[f"r{i}" for i in b.items] for b in plan.batches]
    assert plan.restore(results) == ["r0", "r1", "r2", "r3", "r4"]
    assert plan.restore(tuple(tuple(r) for r in results)) == ["r0", "r1", "r2", "r3", "r4"]


def test_json_round_trip() -> None:
    plan = sample_plan()
    data = plan.to_dict()
    assert data["batches"][2]["eager"] == {"local": "TOKENS"}
    assert data["batches"][2]["budgets"] == {"global": 272, "local": None}
    again = Plan.from_dict(json.loads(json.dumps(data)))
    assert again == plan
    assert again.batches[2].eager["local"] is EagerReason.TOKENS


def test_plan_and_batch_are_frozen() -> None:
    plan = sample_plan()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.n_items = 3  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.batches[0].frames = 3  # type: ignore[misc]


def test_public_constructors_validate() -> None:
    plan = sample_plan()
    rebuilt = Plan(
        batches=[attrs.evolve(b) for b in plan.batches],
        n_items=plan.n_items,
        paths=list(plan.paths),
        ladders=plan.ladders,
        limits=plan.limits,
    )
    assert rebuilt == plan


def test_eager_reason_values() -> None:
    assert EagerReason.TOKENS.value == "tokens over the largest budget"
    assert EagerReason.FRAMES.value == "frames over max_frames"
    assert EagerReason.COST.value == "eager is cheaper"


def good_batch(**changes):
    fields = dict(items=(0,), budgets={"p": 8}, tokens={"p": 5}, padded={"p": 3}, frames=1, eager={})
    fields.update(changes)
    return lambda: Batch(**fields)


def edited(edit):
    def call():
        data = copy.deepcopy(sample_plan().to_dict())
        edit(data)
        return Plan.from_dict(data)

    return call


BAD = [
    # restore
    (lambda: sample_plan().restore([[1, 2], [3]]), ConfigError, r"restore\(batch_results\): expected 3 batch results \(one per batch\), got 2\. Pass"),
    (lambda: sample_plan().restore([[1], [3], [0]]), ConfigError, r"restore\(batch_results\[0\]\): expected 3 results \(one per item of batch 0\), got 1"),
    (lambda: sample_plan().restore(iter([])), ConfigTypeError, r"restore\(batch_results\): expected a sequence"),
    (lambda: sample_plan().restore([[1, 2, 4], 3, [0]]), ConfigTypeError, r"restore\(batch_results\[1\]\): expected a sequence .*got 3 \(int\)"),
    # totals per path
    (lambda: sample_plan().real_tokens("tiles"), ConfigError, r"path: expected one of the plan's paths \['global', 'local'\], got 'tiles'"),
    (lambda: sample_plan().eager_items(3), ConfigTypeError, r"path: expected a path name \(str\), got 3"),
    # Batch
    (good_batch(items=()), ConfigError, r"Batch\(items\): expected at least one item index, got \(\)"),
    (good_batch(items=(-1,)), ConfigError, r"Batch\(items\[0\]\): expected an int >= 0, got -1"),
    (good_batch(budgets={"p": 4}, padded={"p": 0}), ConfigError, r"Batch\(budgets\['p'\]\): expected >= its tokens 5, got 4"),
    (good_batch(padded={"p": 2}), ConfigError, r"Batch\(padded\['p'\]\): expected budget - tokens = 3, got 2"),
    (good_batch(budgets={"p": None}, padded={"p": 0}), ConfigError, r"Batch\(eager\): expected a reason for the eager path 'p'"),
    (good_batch(eager={"p": EagerReason.TOKENS}), ConfigError, r"expected no reason for the replayed path 'p'"),
    (good_batch(budgets={"p": None}, padded={"p": 0}, eager={"p": "TOKENS"}), ConfigTypeError, r"Batch\(eager\['p'\]\): expected an EagerReason, got 'TOKENS'"),
    (good_batch(tokens={"q": 5}), ConfigError, r"Batch\(tokens\): expected the paths of budgets \['p'\], got \['q'\]"),
    (good_batch(frames=0), ConfigError, r"Batch\(frames\): expected an int >= 1, got 0"),
    (good_batch(budgets=[8]), ConfigTypeError, r"Batch\(budgets\): expected a mapping \(dict\), got \[8\] \(list\)\. Use"),
    (good_batch(items=5), ConfigTypeError, r"Batch\(items\): expected a sequence \(list or tuple\), got 5 \(int\)"),
    # from_dict
    (lambda: Plan.from_dict([1]), ConfigTypeError, r"Plan\.from_dict\(data\): expected a mapping \(dict\), got \[1\]"),
    (lambda: Plan.from_dict({"format": "x"}), ConfigError, r"expected format 'encgraph.plan' version 1, got format 'x'"),
    (edited(lambda d: d.pop("limits")), ConfigError, r"Plan\.from_dict\(data\): missing key 'limits'"),
    (edited(lambda d: d["batches"][0].pop("frames")), ConfigError, r"Plan\.from_dict\(data\['batches'\]\[0\]\): missing key 'frames'"),
    (edited(lambda d: d["batches"][2]["eager"].update(local="SLOW")), ConfigError, r"expected one of \['TOKENS', 'FRAMES', 'COST'\], got 'SLOW'"),
    (edited(lambda d: (d["batches"][0]["items"].append(3), d["batches"][0].update(frames=4))), ConfigError, r"Plan\(batches\[1\]\.items\): expected each index in 0\.\.4 exactly once, got 3"),
    (edited(lambda d: d["batches"].pop()), ConfigError, r"Plan\(batches\): expected every item placed, got item 0 missing"),
    (edited(lambda d: d.update(n_items=9)), ConfigError, r"expected every item placed, got item 5 missing"),
    (
        edited(lambda d: d["batches"][1].update(budgets={"global": 300, "local": 3200}, padded={"global": 44, "local": 320})),
        ConfigError,
        r"Plan\(batches\[1\]\.budgets\['global'\]\): expected 0, None or a budget of \(272, ",
    ),
    (edited(lambda d: d["limits"].update(max_items=1, max_frames=1)), ConfigError, r"Plan\(batches\[0\]\.items\): expected at most max_items=1 items, got 3"),
    (edited(lambda d: d["limits"].update(max_frames=1)), ConfigError, r"Limits: expected max_frames >= max_items"),
    (edited(lambda d: d.update(paths=["global"])), ConfigError, r"Plan\(ladders\): expected a ladder for each of \['global'\]"),
    (edited(lambda d: d["ladders"].update(local=[100, 0])), ConfigError, r"Plan\(ladders\['local'\]\): expected a sorted ladder without repeats"),
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)
