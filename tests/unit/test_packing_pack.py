"""The greedy planner ``pack``: the issue's examples and bad arguments (properties: test_packing_properties)."""

from __future__ import annotations

import pytest

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import EagerReason, ItemSpec, Limits, Plan, budget_ladder, default_limits, pack
from tests.unit._helpers import check_bad_argument

LADDER = (2048, 4096, 8192)
GLOBAL = budget_ladder(272, 13824)
LOCAL = budget_ladder(100, 4000, allow_zero=True)
TWO = {"global": GLOBAL, "local": LOCAL}
TILE = 144


def test_2049_tokens_take_the_4096_budget() -> None:
    (batch,) = pack([ItemSpec(2049)], LADDER, max_items=4).batches
    assert batch.items == (0,)
    assert batch.budgets == {"default": 4096}
    assert batch.tokens == {"default": 2049}
    assert batch.padded == {"default": 2047}
    assert batch.eager == {}


def test_9000_tokens_run_eager() -> None:
    (batch,) = pack([ItemSpec(9000)], LADDER, max_items=4).batches
    assert batch.budgets == {"default": None}
    assert batch.padded == {"default": 0}
    assert batch.eager == {"default": EagerReason.TOKENS}


def test_exact_fit_and_smallest_budget() -> None:
    plan = pack([ItemSpec(2048), ItemSpec(1), ItemSpec(8192)], LADDER, max_items=1)
    assert [(b.items, b.budgets["default"]) for b in plan.batches] == [((1,), 2048), ((0,), 2048), ((2,), 8192)]


def test_eight_equal_items_with_max_items_4_make_two_batches() -> None:
    plan = pack([ItemSpec(100)] * 8, LADDER, max_items=4)
    assert [b.items for b in plan.batches] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [b.budgets["default"] for b in plan.batches] == [2048, 2048]
    assert plan.totals()["default"] == {
        "real_tokens": 800,
        "padded_tokens": 2 * 2048 - 800,
        "eager_items": 0,
        "padded_share": (4096 - 800) / 4096,
    }


def test_token_overflow_closes_the_batch() -> None:
    plan = pack([ItemSpec(5000), ItemSpec(4000)], LADDER, max_items=4)
    assert [(b.items, b.budgets["default"]) for b in plan.batches] == [((1,), 4096), ((0,), 8192)]


def test_sorted_ascending_and_stable() -> None:
    plan = pack([ItemSpec(30), ItemSpec(10), ItemSpec(20), ItemSpec(10)], (64,), max_items=1)
    assert [b.items for b in plan.batches] == [(1,), (3,), (2,), (0,)]


def test_empty_items_give_an_empty_plan() -> None:
    plan = pack([], LADDER, max_items=4)
    assert plan.batches == () and plan.n_items == 0
    assert plan.restore([]) == []
    assert plan.totals() == {"default": {"real_tokens": 0, "padded_tokens": 0, "eager_items": 0, "padded_share": 0.0}}


def test_frames_limit_splits_batches() -> None:
    items = [ItemSpec(10, frames=3), ItemSpec(11, frames=3), ItemSpec(12, frames=2)]
    plan = pack(items, (64,), max_items=3, max_frames=5)
    assert [b.items for b in plan.batches] == [(0,), (1, 2)]
    assert [b.frames for b in plan.batches] == [3, 5]
    assert plan.limits == Limits(max_items=3, max_frames=5)


def test_item_over_max_frames_runs_eager_alone() -> None:
    items = [ItemSpec(10), ItemSpec(20, frames=9), ItemSpec(30)]
    plan = pack(items, (64,), max_items=3, max_frames=4)
    assert [b.items for b in plan.batches] == [(0,), (1,), (2,)]
    lone = plan.batches[1]
    assert lone.budgets == {"default": None} and lone.eager == {"default": EagerReason.FRAMES}
    assert lone.frames == 9
    assert plan.eager_items("default") == 1


def test_no_frame_limit_records_the_bound_no_batch_can_pass() -> None:
    plan = pack([ItemSpec(10, frames=7), ItemSpec(10, frames=2)], (64,), max_items=2)
    assert [b.items for b in plan.batches] == [(0, 1)]
    assert plan.limits == Limits(max_items=2, max_frames=14)


def test_max_items_is_not_tied_to_budgets_in_the_planner() -> None:
    # An item-count ladder (budget = items) may hold more items per batch than its smallest budget.
    plan = pack([ItemSpec(1)] * 5, (1, 2, 4, 8), max_items=8)
    assert [(b.items, b.budgets["default"]) for b in plan.batches] == [((0, 1, 2, 3, 4), 8)]


def two_path_items() -> list[ItemSpec]:
    return [ItemSpec({"global": 256, "local": TILE * k}) for k in range(41)]


def test_two_path_ladder_with_0_to_40_tiles() -> None:
    items = two_path_items()
    limits = default_limits(TWO)
    assert limits == Limits(max_items=16, max_frames=16)  # DEFAULT_MAX_ITEMS; no batch here needs more than 7
    plan = pack(items, TWO, max_items=limits.max_items, max_frames=limits.max_frames)
    assert plan.paths == ("global", "local")
    got = [(b.items, b.budgets["global"], b.budgets["local"]) for b in plan.batches]
    # Local tiles fill 4000 first: 0..6 tiles sum to 21 tiles = 3024 tokens; 7 more would be 4032.
    assert got[:5] == [
        ((0, 1, 2, 3, 4, 5, 6), 2176, 3200),
        ((7, 8, 9), 1088, 4000),
        ((10, 11), 544, 3200),
        ((12, 13), 544, 4000),
        ((14,), 272, 3200),
    ]
    assert plan.batches[0].tokens == {"global": 7 * 256, "local": 21 * TILE}
    # 28 tiles (4032) or more overflow the local ladder: local eager, global still replayed (partial eager).
    for b in plan.batches:
        (k,) = b.items if len(b.items) == 1 else (None,)
        if k is not None and TILE * k > 4000:
            assert b.budgets == {"global": 272, "local": None}
            assert b.eager == {"local": EagerReason.TOKENS}
            assert b.padded == {"global": 16, "local": 0}
    assert plan.eager_items("local") == 13 and plan.eager_items("global") == 0
    assert plan.real_tokens("local") == TILE * sum(range(41))


def test_item_without_tiles_skips_the_local_path() -> None:
    plan = pack([ItemSpec({"global": 256, "local": 0})], TWO, max_items=4)
    (batch,) = plan.batches
    assert batch.budgets == {"global": 272, "local": 0}
    assert batch.padded == {"global": 16, "local": 0}


def test_frames_over_limit_keeps_an_empty_path_skipped() -> None:
    plan = pack([ItemSpec({"global": 256, "local": 0}, frames=5)], TWO, max_items=2, max_frames=4)
    (batch,) = plan.batches
    assert batch.budgets == {"global": None, "local": 0}
    assert batch.eager == {"global": EagerReason.FRAMES}


def test_ladder_given_as_any_iterable() -> None:
    a = pack([ItemSpec(5)], [8192, 2048, 4096, 2048], max_items=1)
    b = pack([ItemSpec(5)], LADDER, max_items=1)
    assert a == b
    assert isinstance(a, Plan)


BAD = [
    (lambda: pack(iter([ItemSpec(1)]), LADDER, max_items=1), ConfigTypeError, r"pack\(items\): expected a sequence \(list or tuple\), got <list_iterator"),
    (lambda: pack(ItemSpec(1), LADDER, max_items=1), ConfigTypeError, r"pack\(items\): expected a sequence"),
    (lambda: pack([ItemSpec(1), 5], LADDER, max_items=1), ConfigTypeError, r"pack\(items\[1\]\): expected an ItemSpec, got 5 \(int\)\. Describe each item"),
    (lambda: pack([{"default": 1}], LADDER, max_items=1), ConfigTypeError, r"pack\(items\[0\]\): expected an ItemSpec, got \{'default': 1\} \(dict\)"),
    (
        lambda: pack([ItemSpec(1)], TWO, max_items=1),
        ConfigError,
        r"pack\(items\[0\]\): unknown path 'default'; expected exactly the ladders' paths \['global', 'local'\], got \['default'\]",
    ),
    (
        lambda: pack([ItemSpec({"global": 3})], TWO, max_items=1),
        ConfigError,
        r"pack\(items\[0\]\): missing path 'local'; .*got \['global'\]\. Give the item a token count \(0 if none\) on 'local'",
    ),
    (
        lambda: pack([ItemSpec({"global": 3, "local": 1, "x": 1})], TWO, max_items=1),
        ConfigError,
        r"unknown path 'x'.*add a ladder for 'x'",
    ),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=0), ConfigError, r"pack\(max_items\): expected an int >= 1, got 0\. A batch holds"),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=2.0), ConfigTypeError, r"pack\(max_items\): expected an int, got 2\.0 \(float\)"),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=None), ConfigTypeError, r"pack\(max_items\): expected an int, got None"),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=4, max_frames=0), ConfigError, r"pack\(max_frames\): expected an int >= 1, got 0\. Use None"),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=4, max_frames="8"), ConfigTypeError, r"pack\(max_frames\): expected an int or None, got '8'"),
    (lambda: pack([ItemSpec(1)], LADDER, max_items=4, max_frames=3), ConfigError, r"pack\(max_frames\): expected at least max_items=4 .*got 3\. Raise max_frames to 4"),
    (lambda: pack([ItemSpec(1)], 2048, max_items=1), ConfigTypeError, r"ladders: expected an iterable of int budgets, got 2048 \(int\)\. Wrap a single budget"),
    (lambda: pack([ItemSpec(1)], (0,), max_items=1), ConfigError, r"ladders: expected at least one positive budget"),
    (lambda: pack([ItemSpec(1)], {"default": (-1, 4)}, max_items=1), ConfigError, r"ladders\['default'\]\[0\]: expected an int >= 0, got -1"),
    (lambda: pack([ItemSpec(1)], LADDER), TypeError, r"max_items"),
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)
