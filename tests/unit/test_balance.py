"""Data-parallel sharding: ``balance`` (LPT)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import balance
from tests.strategies import sizes
from tests.unit._helpers import check_bad_argument


def loads(sizes_: list[int], shards) -> list[int]:
    return [sum(sizes_[i] for i in shard) for shard in shards]


def test_issue_example() -> None:
    shards = balance([1000, 100, 200, 50], 2)
    assert shards == ((0,), (1, 2, 3))
    assert loads([1000, 100, 200, 50], shards) == [1000, 350]


def test_idle_ranks_get_empty_tuples() -> None:
    assert balance([5], 3) == ((0,), (), ())
    assert balance([], 2) == ((), ())


def test_ties_go_to_the_lowest_rank_and_lower_index_first() -> None:
    # Equal sizes: index 0 to rank 0, 1 to rank 1, 2 to rank 0 (loads tie again: lowest rank), ...
    assert balance([7, 7, 7, 7, 7], 2) == ((0, 2, 4), (1, 3))
    assert balance([0, 0, 0], 3) == ((0, 1, 2), (), ())  # zero loads keep tying: rank 0


def test_one_rank_takes_everything() -> None:
    assert balance([3, 1, 2], 1) == ((0, 1, 2),)


def reference_lpt(sizes_: list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes_)), key=lambda i: (-sizes_[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += sizes_[i]
    return tuple(tuple(sorted(x)) for x in out)


@given(sizes(), st.integers(1, 9))
def test_properties(sizes_: list[int], ranks: int) -> None:
    shards = balance(sizes_, ranks)
    assert len(shards) == ranks
    assert sorted(i for s in shards for i in s) == list(range(len(sizes_)))
    assert all(list(s) == sorted(s) for s in shards)
    assert shards == balance(list(sizes_), ranks)  # deterministic
    assert shards == reference_lpt(sizes_, ranks)
    # List scheduling bound: no rank exceeds the mean load by more than the largest item.
    if sizes_:
        assert max(loads(sizes_, shards)) <= sum(sizes_) / ranks + max(sizes_)


BAD = [
    (lambda: balance([1, 2], 0), ConfigError, r"balance\(ranks\): expected an int >= 1, got 0\. Use the data-parallel world size"),
    (lambda: balance([1, 2], 2.0), ConfigTypeError, r"balance\(ranks\): expected an int, got 2\.0 \(float\)"),
    (lambda: balance([1, -2], 2), ConfigError, r"balance\(sizes\[1\]\): expected an int >= 0, got -2\. Sizes are token counts"),
    (lambda: balance([1, 2.5], 2), ConfigTypeError, r"balance\(sizes\[1\]\): expected an int, got 2\.5 \(float\)"),
    (lambda: balance(iter([1]), 2), ConfigTypeError, r"balance\(sizes\): expected a sequence \(list or tuple\), got <list_iterator"),
    (lambda: balance(5, 2), ConfigTypeError, r"balance\(sizes\): expected a sequence .*got 5 \(int\)"),
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)
