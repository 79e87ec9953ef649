"""Dense attention of one sequence padded to a bucket length (encgraph.models.dense_sequence): the mask column
keeps the padding out exactly, at any scale; on the CPU (fp32), where torch's SDPA is exact enough to compare."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encgraph.models.dense_sequence import dense_sequence, padded_dense
from encgraph.packing.kernels import bucket_rows


@settings(deadline=None, max_examples=25)
@given(rows=st.integers(1, 300), extra=st.integers(0, 40), heads=st.integers(1, 3), dim=st.sampled_from([8, 16, 72]),
       scale=st.sampled_from([None, 0.05, 1.0]), seed=st.integers(0, 2**16))
def test_padding_never_changes_a_real_row(rows, extra, heads, dim, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (3 * torch.randn(rows, heads, dim, generator=gen) for _ in range(3))
    want = dense_sequence(q, k, v, scale)
    got = padded_dense(q, k, v, scale, rows + extra)
    assert got.shape == (rows, heads, dim) and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_default_scale_is_the_sequences_own_head_dim():
    # The widened call must not fall back to 1/sqrt(its own width).
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(50, 2, 72, generator=gen) for _ in range(3))
    torch.testing.assert_close(padded_dense(q, k, v, None, 64), padded_dense(q, k, v, 1 / math.sqrt(72), 64))
    assert not torch.allclose(padded_dense(q, k, v, None, 64), padded_dense(q, k, v, 1 / math.sqrt(80), 64))


def test_a_nan_stays_in_its_sequence_and_padding_adds_none():
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    v[3, 0, 0] = float("nan")
    out = padded_dense(q, k, v, None, bucket_rows(40) + 8)
    assert torch.isnan(out[:, 0]).any() and torch.isfinite(out[:, 1]).all()  # head 0 sees it, head 1 does not


@pytest.mark.parametrize("padded", [10, 5])
def test_no_padding_is_the_plain_call(padded):
    q, k, v = (torch.randn(10, 1, 8) for _ in range(3))
    torch.testing.assert_close(padded_dense(q, k, v, None, padded), dense_sequence(q, k, v, None))
