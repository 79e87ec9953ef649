"""Per-batch limits: ``Limits`` and ``default_limits``."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import Limits, budget_ladder, default_limits
from encgraph.packing.limits import DEFAULT_MAX_ITEMS
from tests.strategies import path_ladders
from tests.unit._helpers import check_bad_argument

TWO = {"global": budget_ladder(272, 13824), "local": budget_ladder(100, 4000, allow_zero=True)}


def test_defaults_one_path() -> None:
    # A wide ladder no longer batches b_max // b_min items: each item's frames are cu_seqlens slots of every
    # captured attention call, and an empty slot still launches its thread blocks (benches/varlen_slots.py).
    assert default_limits(budget_ladder(64, 8192)) == Limits(max_items=DEFAULT_MAX_ITEMS, max_frames=16)
    assert default_limits((64, 2048), max_frames_per_item=4) == Limits(16, 64)
    assert default_limits((64, 2048), max_frames_per_item=2) == Limits(16, 32)


def test_default_items_never_exceed_the_smallest_budget() -> None:
    # The smallest budget holds only 4 or 8 items (vLLM PR 38040).
    assert default_limits((8, 100_000)).max_items == 8
    assert default_limits((4, 1024)).max_items == 4
    assert default_limits({"global": (272,), "local": (0, 12, 576)}).max_items == 12


def test_a_narrow_ladder_still_batches_small_items() -> None:
    # One budget, or (1024, 2048): every small image of a request would otherwise replay alone in a large graph.
    assert default_limits((896,)) == Limits(DEFAULT_MAX_ITEMS, DEFAULT_MAX_ITEMS)
    assert default_limits((1024, 2048)).max_items == DEFAULT_MAX_ITEMS
    assert default_limits({"global": (272,), "local": (0, 144, 576)}).max_items == DEFAULT_MAX_ITEMS


def test_defaults_two_paths() -> None:
    # Both paths' smallest budgets (272 and 100, budget 0 ignored) hold more than the default.
    assert default_limits(TWO) == Limits(max_items=DEFAULT_MAX_ITEMS, max_frames=DEFAULT_MAX_ITEMS)


def test_user_items_only_scales_frames() -> None:
    assert default_limits((64, 800), max_items=2, max_frames_per_item=4) == Limits(2, 8)
    assert default_limits((64, 800), max_items=64) == Limits(64, 64)


def test_user_frames_only_caps_items() -> None:
    assert default_limits((64, 800), max_frames=5) == Limits(5, 5)
    assert default_limits((64, 800), max_frames=100) == Limits(16, 100)


def test_both_user_values_kept() -> None:
    assert default_limits((64, 800), max_items=3, max_frames=7, max_frames_per_item=9) == Limits(3, 7)


@given(path_ladders(), st.integers(1, 8))
def test_defaults_are_consistent(lads, per_item: int) -> None:
    lim = default_limits(lads[0], max_frames_per_item=per_item)
    assert 1 <= lim.max_items <= lim.max_frames == lim.max_items * per_item


def test_limits_is_frozen() -> None:
    lim = Limits(max_items=2, max_frames=3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        lim.max_items = 5  # type: ignore[misc]


BAD = [
    (lambda: Limits(max_items=0, max_frames=4), ConfigError, r"Limits\(max_items\): expected an int >= 1, got 0"),
    (lambda: Limits(max_items=2, max_frames=1.0), ConfigTypeError, r"Limits\(max_frames\): expected an int, got 1\.0"),
    (lambda: Limits(max_items=4, max_frames=2), ConfigError, r"expected max_frames >= max_items .*got max_items=4, max_frames=2\. Raise"),
    (
        lambda: default_limits((64, 800), max_items=65),
        ConfigError,
        r"default_limits\(max_items\): expected at most 64 \(the smallest non-zero budget, path 'default'\), got 65\..*lower max_items to 64",
    ),
    (
        lambda: default_limits(TWO, max_items=200),
        ConfigError,
        r"expected at most 100 \(the smallest non-zero budget, path 'local'\), got 200",
    ),
    (
        lambda: default_limits((64, 800), max_items=8, max_frames=4),
        ConfigError,
        r"default_limits\(max_frames\): expected at least max_items=8 .*got 4\. Raise max_frames to 8",
    ),
    (lambda: default_limits((64, 800), max_items=0), ConfigError, r"default_limits\(max_items\): expected an int >= 1, got 0"),
    (lambda: default_limits((64, 800), max_items="4"), ConfigTypeError, r"max_items\): expected an int, got '4' \(str\)"),
    (lambda: default_limits((64, 800), max_frames=0), ConfigError, r"default_limits\(max_frames\): expected an int >= 1, got 0"),
    (lambda: default_limits((64, 800), max_frames=2.5), ConfigTypeError, r"max_frames\): expected an int, got 2\.5"),
    (
        lambda: default_limits((64, 800), max_frames_per_item=0),
        ConfigError,
        r"max_frames_per_item\): expected an int >= 1, got 0\. An image has 1 frame",
    ),
    (lambda: default_limits([]), ConfigError, r"ladders: expected at least one positive budget"),
    (lambda: default_limits(64), ConfigTypeError, r"ladders: expected an iterable of int budgets, got 64"),
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)
