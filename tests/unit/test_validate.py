"""encgraph._validate.check_pixels, the adapters' one pixel check: each failure in its order, with its error type
and a message that names the argument, what was expected, what was given and the fix."""

from __future__ import annotations

import pytest
import torch

from encgraph._validate import check_pixels
from encgraph.errors import InputError, InputTypeError

CPU = torch.device("cpu")


def rows_of_3(t: torch.Tensor) -> str | None:
    return None if t.dim() == 2 and t.shape[1] == 3 else f"pixels: expected shape (rows, 3), got {tuple(t.shape)}."


def check(value, **kw):
    options = dict(expected="a tensor (rows, 3)", floating="floating-point patches", device=CPU, shape=rows_of_3)
    return check_pixels("pixels", value, **{**options, **kw})


@pytest.mark.parametrize("value, kw, error, message", [
    ([[0.0, 1.0, 2.0]], {}, InputTypeError, "pixels: expected a tensor (rows, 3), got [[0.0, 1.0, 2.0]] (list)."),
    (torch.zeros(2, 3, dtype=torch.int64), {}, InputTypeError,
     "pixels: expected floating-point patches, got torch.int64."),
    (torch.zeros(2, 3, dtype=torch.int64), {"dtype_fix": "; run the processor"}, InputTypeError,
     "pixels: expected floating-point patches, got torch.int64; run the processor."),
    (torch.zeros(2, 4, dtype=torch.int64), {}, InputTypeError, "floating-point"),  # the dtype first, then the shape
    (torch.zeros(2, 4), {}, InputError, "pixels: expected shape (rows, 3), got (2, 4)."),
    (torch.zeros(2, 4, device="meta"), {}, InputError, "expected shape (rows, 3)"),  # the shape before the device
    (torch.zeros(2, 3, device="meta"), {"owner": "model"}, InputError,
     "pixels: expected a tensor on cpu (where the model is), got meta; move it with .to('cpu')."),
])
def test_check_pixels_failures_in_order(value, kw, error, message):
    with pytest.raises(error) as info:
        check(value, **kw)
    assert message in str(info.value)


def test_check_pixels_returns_what_passes():
    pixels = torch.randn(5, 3, dtype=torch.bfloat16)
    assert check(pixels) is pixels
