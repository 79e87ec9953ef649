"""encgraph.capture.agreement.relative_error: the self-check's norm-relative error, computed in chunks."""

from __future__ import annotations

import math

import pytest
import torch

from encgraph.capture import agreement
from encgraph.capture.agreement import relative_error


def _whole(static: torch.Tensor, eager: torch.Tensor) -> float:
    """The error as one float64 expression over the entries where eager is finite."""
    a, b = static.double(), eager.double()
    finite = torch.isfinite(b)
    if not bool(torch.isfinite(a[finite]).all()):
        return math.inf
    diff, ref = torch.linalg.vector_norm((a - b)[finite]), torch.linalg.vector_norm(b[finite])
    return float(diff / ref) if float(ref) > 0 else float(diff)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chunks_give_the_whole_tensors_error(monkeypatch, chunk, dtype):
    monkeypatch.setattr(agreement, "ERROR_CHUNK", chunk)
    gen = torch.Generator().manual_seed(chunk)
    eager = torch.randn(5, 9, 4, generator=gen).to(dtype)
    static = (eager.float() + 1e-2 * torch.randn(5, 9, 4, generator=gen)).to(dtype)
    eager[1, 2, 3] = float("nan")  # not compared, whatever static holds there
    static[1, 2, 3] = float("inf")
    # float32 arithmetic with float64 sums (float64 throughout for float64 inputs)
    rel = 1e-12 if dtype is torch.float64 else 1e-6
    assert relative_error(static, eager) == pytest.approx(_whole(static, eager), rel=rel)
    assert relative_error(eager, eager) == 0.0


def test_what_fails_the_comparison(monkeypatch):
    monkeypatch.setattr(agreement, "ERROR_CHUNK", 3)
    eager = torch.ones(4, 5)
    static = eager.clone()
    static[3, 4] = float("nan")  # a non-finite static entry where eager is finite, in the last chunk
    assert relative_error(static, eager) == math.inf
    assert relative_error(torch.ones(4, 4), eager) == math.inf  # shapes differ
    assert relative_error(torch.full((2,), 0.5), torch.zeros(2)) == pytest.approx(math.sqrt(0.5))  # ref 0: the diff
    assert relative_error(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0
