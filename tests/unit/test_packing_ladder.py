"""Budget ladders: ``budget_ladder``, ``dense_ladder``, ``normalize_ladder``, ``normalize_ladders``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import budget_ladder, dense_ladder, normalize_ladder, normalize_ladders
from tests.unit._helpers import check_bad_argument


@pytest.mark.parametrize(
    "lo, hi, zero, expected",
    [
        (64, 1024, False, (64, 128, 256, 512, 1024)),
        (64, 800, False, (64, 128, 256, 512, 800)),
        (64, 64, False, (64,)),
        (272, 13824, False, (272, 544, 1088, 2176, 4352, 8704, 13824)),
        (100, 4000, True, (0, 100, 200, 400, 800, 1600, 3200, 4000)),
        (1, 1, True, (0, 1)),
        (3, 7, False, (3, 6, 7)),
    ],
)
def test_budget_ladder_examples(lo: int, hi: int, zero: bool, expected: tuple[int, ...]) -> None:
    assert budget_ladder(lo, hi, allow_zero=zero) == expected


@given(st.integers(1, 10_000), st.integers(0, 10_000), st.booleans())
def test_budget_ladder_shape(lo: int, extra: int, zero: bool) -> None:
    hi = lo + extra
    ladder = budget_ladder(lo, hi, allow_zero=zero)
    positive = [b for b in ladder if b]
    assert positive[0] == lo and positive[-1] == hi
    assert list(ladder) == sorted(set(ladder))
    assert (0 in ladder) == zero
    assert all(b == lo * 2**i for i, b in enumerate(positive[:-1]))
    assert normalize_ladder(ladder) == ladder


def test_normalize_ladder_sorts_and_dedupes() -> None:
    assert normalize_ladder([512, 64, 256, 64]) == (64, 256, 512)
    assert normalize_ladder(iter([4, 0, 2])) == (0, 2, 4)
    assert normalize_ladder(np.array([8, 2, 8], dtype=np.int64)) == (2, 8)
    assert all(type(b) is int for b in normalize_ladder(np.array([8, 2])))
    assert normalize_ladder((0, 100)) == (0, 100)


def test_normalize_ladders_forms() -> None:
    assert normalize_ladders((256, 64)) == {"default": (64, 256)}
    two = normalize_ladders({"local": [0, 100], "global": [544, 272]})
    assert two == {"local": (0, 100), "global": (272, 544)}
    assert list(two) == ["local", "global"]  # the mapping's order
    ordered = normalize_ladders({"local": [0, 100], "global": [272]}, paths=("global", "local"))
    assert list(ordered) == ["global", "local"]
    assert normalize_ladders((1, 2), paths=["default"]) == {"default": (1, 2)}


BAD = [
    (lambda: budget_ladder(0, 10), ConfigError, r"budget_ladder\(min_budget\): expected an int >= 1, got 0\. Budgets"),
    (lambda: budget_ladder(-5, 10), ConfigError, r"min_budget\): expected an int >= 1, got -5"),
    (lambda: budget_ladder(10, 0), ConfigError, r"max_budget\): expected an int >= 1, got 0"),
    (lambda: budget_ladder(64, 32), ConfigError, r"expected max_budget >= min_budget, got min_budget=64, max_budget=32\. Swap"),
    (lambda: budget_ladder(64.0, 128), ConfigTypeError, r"min_budget\): expected an int, got 64\.0 \(float\)"),
    (lambda: budget_ladder(True, 128), ConfigTypeError, r"min_budget\): expected an int, got True \(bool\)"),
    (lambda: budget_ladder(64, "128"), ConfigTypeError, r"max_budget\): expected an int, got '128' \(str\)"),
    (lambda: budget_ladder(64, 128, allow_zero=1), ConfigTypeError, r"allow_zero\): expected a bool, got 1 \(int\)"),
    (lambda: normalize_ladder(2048), ConfigTypeError, r"ladder: expected an iterable of int budgets, got 2048 \(int\)\. Wrap"),
    (lambda: normalize_ladder("64,128"), ConfigTypeError, r"ladder: expected an iterable, got '64,128' \(str\)"),
    (lambda: normalize_ladder({"a": 1}), ConfigTypeError, r"got a mapping"),
    (lambda: normalize_ladder([]), ConfigError, r"ladder: expected at least one positive budget, got \[\] \(list\)\. Add"),
    (lambda: normalize_ladder([0]), ConfigError, r"expected at least one positive budget, got \[0\]"),
    (lambda: normalize_ladder([64, -1]), ConfigError, r"ladder\[1\]: expected an int >= 0, got -1"),
    (lambda: normalize_ladder([64, 1.5]), ConfigTypeError, r"ladder\[1\]: expected an int, got 1\.5 \(float\)"),
    (lambda: normalize_ladder([64, None], name="budgets"), ConfigTypeError, r"budgets\[1\]: expected an int, got None"),
    (lambda: normalize_ladders({}), ConfigError, r"ladders: expected at least one path, got an empty mapping"),
    (lambda: normalize_ladders({1: (64,)}), ConfigTypeError, r"expected a path name \(str\), got 1 \(int\)"),
    (lambda: normalize_ladders({"": (64,)}), ConfigError, r"expected a non-empty path name, got ''"),
    (lambda: normalize_ladders({"g": (0,)}), ConfigError, r"ladders\['g'\]: expected at least one positive budget"),
    (lambda: normalize_ladders({"g": 64}), ConfigTypeError, r"ladders\['g'\]: expected an iterable of int budgets"),
    (
        lambda: normalize_ladders({"g": (64,), "x": (8,)}, paths=("g", "l")),
        ConfigError,
        r"ladders: unknown path 'x'; expected exactly the paths \['g', 'l'\], got \['g', 'x'\]\. Remove 'x'",
    ),
    (
        lambda: normalize_ladders({"g": (64,)}, paths=("g", "l")),
        ConfigError,
        r"ladders: missing path 'l'; expected exactly the paths \['g', 'l'\], got \['g'\]\. Add a ladder for 'l'",
    ),
    (lambda: normalize_ladders((64,), paths=("g",)), ConfigError, r"unknown path 'default'"),
    (lambda: normalize_ladders((64,), paths="default"), ConfigTypeError, r"paths: expected a sequence of path names"),
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)


@given(st.integers(1, 2_000), st.integers(0, 20_000), st.sampled_from([1.1, 1.2, 1.25, 1.5]), st.booleans(),
       st.one_of(st.none(), st.integers(1, 64)))
def test_dense_ladder_bounds_the_padding_of_one_item(lo: int, extra: int, ratio: float, zero: bool, step) -> None:
    hi = lo + extra
    ladder = dense_ladder(lo, hi, ratio=ratio, granularity=step, allow_zero=zero)
    positive = [b for b in ladder if b]
    g = lo if step is None else step
    assert positive[0] == lo and positive[-1] == hi and (0 in ladder) == zero
    assert list(ladder) == sorted(set(ladder)) and normalize_ladder(ladder) == ladder
    assert all(b % g == 0 for b in positive[1:-1])  # every budget past the first is a multiple of the step
    # A single item of any size up to the maximum pads by at most about (ratio - 1) of its budget, or by less
    # than one granularity step where the ladder steps linearly.
    for below, budget in zip(positive, positive[1:]):
        assert budget - below <= max(g, below * (ratio - 1) + g / 2 + 1), (below, budget)


def test_dense_ladder_default_is_denser_than_doubling() -> None:
    dense, doubling = dense_ladder(64, 4096), budget_ladder(64, 4096)
    assert dense[0] == doubling[0] and dense[-1] == doubling[-1] and len(dense) == 20
    def worst(ladder):  # an item one token over a budget of at least 384 tokens, padded to the next one
        return max((b - a - 1) / b for a, b in zip(ladder, ladder[1:]) if a >= 384)

    assert worst(dense) < 0.22 < 0.49 < worst(doubling)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: dense_ladder(0, 10), ConfigError, "min_budget"),
        (lambda: dense_ladder(10, 5), ConfigError, "max_budget >= min_budget"),
        (lambda: dense_ladder(1, 5, ratio=1.0), ConfigError, "ratio"),
        (lambda: dense_ladder(1, 5, ratio="2"), ConfigTypeError, "ratio"),
        (lambda: dense_ladder(1, 5, granularity=0), ConfigError, "granularity"),
        (lambda: dense_ladder(1, 5, allow_zero=1), ConfigTypeError, "allow_zero"),
    ],
)
def test_dense_ladder_bad_arguments(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()
