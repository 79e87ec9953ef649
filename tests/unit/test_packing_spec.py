"""Item specs: ``ItemSpec``."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing import ItemSpec
from tests.unit._helpers import check_bad_argument


def test_int_tokens_are_the_default_path() -> None:
    spec = ItemSpec(256)
    assert spec.tokens == {"default": 256}
    assert spec.total_tokens == 256
    assert spec.paths == ("default",)
    assert spec.frames == 1 and spec.input_size is None


def test_mapping_tokens() -> None:
    spec = ItemSpec({"local": 5760, "global": 256}, frames=2, input_size=1024)
    assert spec.tokens == {"global": 256, "local": 5760}
    assert spec.paths == ("global", "local")
    assert spec.total_tokens == 6016
    assert (spec.frames, spec.input_size) == (2, 1024)


def test_zero_on_one_path_is_allowed() -> None:
    assert ItemSpec({"global": 256, "local": 0}).total_tokens == 256


def test_numpy_ints_are_accepted_as_ints() -> None:
    spec = ItemSpec(np.int64(7), frames=np.int32(2))
    assert spec.tokens == {"default": 7} and type(spec.tokens["default"]) is int


def test_equality_and_hash() -> None:
    a = ItemSpec({"b": 1, "a": 2}, frames=3)
    b = ItemSpec({"a": 2, "b": 1}, frames=3)
    assert a == b and hash(a) == hash(b)
    assert a != ItemSpec({"a": 2, "b": 1}, frames=4)
    assert len({a, b}) == 1


def test_frozen() -> None:
    spec = ItemSpec(3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.frames = 2  # type: ignore[misc]


BAD = [
    (lambda: ItemSpec(0), ConfigError, r"ItemSpec\(tokens\): expected an int >= 1, got 0\. An item has at least one token"),
    (lambda: ItemSpec(-3), ConfigError, r"ItemSpec\(tokens\): expected an int >= 1, got -3"),
    (lambda: ItemSpec(2.5), ConfigTypeError, r"ItemSpec\(tokens\): expected an int or a mapping \{path: int\}, got 2\.5 \(float\)\. Pass"),
    (lambda: ItemSpec(True), ConfigTypeError, r"expected an int or a mapping \{path: int\}, got True \(bool\)"),
    (lambda: ItemSpec([1, 2]), ConfigTypeError, r"got \[1, 2\] \(list\)"),
    (lambda: ItemSpec({}), ConfigError, r"ItemSpec\(tokens\): expected at least one path, got an empty mapping"),
    (lambda: ItemSpec({"g": 0, "l": 0}), ConfigError, r"expected at least one token in total, got \{'g': 0, 'l': 0\}\. .*drop it"),
    (lambda: ItemSpec({"g": -1}), ConfigError, r"ItemSpec\(tokens\['g'\]\): expected an int >= 0, got -1"),
    (lambda: ItemSpec({"g": "5"}), ConfigTypeError, r"ItemSpec\(tokens\['g'\]\): expected an int, got '5' \(str\)"),
    (lambda: ItemSpec({3: 5}), ConfigTypeError, r"expected a path name \(str\), got 3 \(int\)"),
    (lambda: ItemSpec({"": 5}), ConfigError, r"expected a non-empty path name, got ''"),
    (lambda: ItemSpec(4, frames=0), ConfigError, r"ItemSpec\(frames\): expected an int >= 1, got 0\. An image has 1 frame"),
    (lambda: ItemSpec(4, frames=1.0), ConfigTypeError, r"ItemSpec\(frames\): expected an int, got 1\.0 \(float\)"),
    (lambda: ItemSpec(4, input_size=-1), ConfigError, r"ItemSpec\(input_size\): expected an int >= 0, got -1"),
    (lambda: ItemSpec(4, input_size="9"), ConfigTypeError, r"ItemSpec\(input_size\): expected an int or None, got '9'"),
    (lambda: ItemSpec(4, 2), TypeError, r"positional argument"),  # frames is keyword-only
]


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_arguments(call, exc, match) -> None:
    check_bad_argument(call, exc, match)
