"""Dense attention of one sequence padded to a bucket length (encgraph.models.dense_sequence): the log-sum-exp
correction takes the padding keys out exactly, at any scale and whatever the logits; on the CPU (fp32, where
torch's SDPA is exact enough to compare; bf16 within one more rounding than the unpadded call's)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encgraph.models.dense_sequence import counted_dense, dense_sequence, padded_dense
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
    # The correction divides by at least rows / padded: float32's rounding grows by at most that much, on the
    # scale of the values averaged (an output near zero is a sum of terms up to max |v|: rows=130, extra=2 once
    # differed by 2e-5 at an output of 0.06). A padding key left in moves outputs by about extra / padded x |v|.
    tol = 2e-5 * (rows + extra) / rows * float(v.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("shift", [-60.0, -20.0, 0.0, 20.0])
def test_exact_whatever_the_logits(shift):
    # Keys sharing a large component along (or against) every query move all of a query's logits by about
    # `shift`: with zero padding keys a query whose logits are all very negative would be mostly padding and
    # the correction would cancel; the mean key keeps the padding's share under p / padded.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(200, 2, 16, generator=gen) for _ in range(3))
    axis = torch.nn.functional.normalize(torch.randn(16, generator=gen), dim=0)
    q, k = q + 4 * axis, k + shift * axis
    want = dense_sequence(q.double(), k.double(), v.double(), None)
    for padded in (201, 212, 256):
        got = padded_dense(q, k, v, None, padded)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_within_one_more_rounding():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(300, 2, 72, generator=gen) for _ in range(3))
    want = dense_sequence(q, k, v, None)
    got = padded_dense(*(t.bfloat16() for t in (q, k, v)), None, 320)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 2 * 2**-8  # two roundings to 8 bits


def test_a_kernel_without_log_sum_exp_runs_the_exact_length():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(50, 2, 8) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):  # math SDPA returns no log-sum-exp: nothing to correct with
        got = padded_dense(q, k, v, None, 64)
    torch.testing.assert_close(got, dense_sequence(q, k, v, None))


def test_the_default_scale_is_the_sequences_own_head_dim():
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


@settings(deadline=None, max_examples=25)
@given(rows=st.integers(1, 300), data=st.data(), heads=st.integers(1, 3), dim=st.sampled_from([8, 16, 72]),
       scale=st.sampled_from([None, 0.05, 1.0]), seed=st.integers(0, 2**16))
def test_counted_padding_never_changes_a_real_row(rows, data, heads, dim, scale, seed):
    # The length on the device, as a captured one-image call reads it from cu_seqlens[1]; the padding rows hold
    # NaN and inf (a graph's buffers hold whatever the last replay left): none of it reaches a real row.
    real = data.draw(st.integers(1, rows), label="real")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (3 * torch.randn(rows, heads, dim, generator=gen) for _ in range(3))
    want = dense_sequence(q[:real], k[:real], v[:real], scale)
    q[real:], k[real:], v[real:] = float("nan"), float("inf"), float("nan")
    got = counted_dense(q, k, v, torch.tensor([real], dtype=torch.int32), scale)
    assert got.shape == (rows, heads, dim) and got.dtype == q.dtype
    # As for padded_dense, the correction's rounding grows by at most rows / real, on the values' scale.
    tol = 2e-5 * rows / real * float(v[:real].abs().max())
    torch.testing.assert_close(got[:real], want, rtol=0, atol=tol)


def test_counted_dense_reads_no_host_value(monkeypatch):
    # Inside a CUDA graph a host read of the length would sync (and fail capture): every path from a tensor to
    # a host number raises here, and the call still runs.
    q, k, v = (torch.randn(50, 2, 8) for _ in range(3))
    want = dense_sequence(q[:30], k[:30], v[:30], None)
    real = torch.tensor(30)

    def refuse(*args, **kwargs):
        raise AssertionError("counted_dense read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = counted_dense(q, k, v, real, None)
    monkeypatch.undo()
    torch.testing.assert_close(got[:30], want, rtol=1e-5, atol=1e-5)


def test_counted_dense_bf16_within_one_more_rounding():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(320, 2, 72, generator=gen) for _ in range(3))
    want = dense_sequence(q[:300], k[:300], v[:300], None)
    got = counted_dense(*(t.bfloat16() for t in (q, k, v)), torch.tensor(300), None)
    assert got.dtype == torch.bfloat16
    assert ((got[:300].float() - want).abs().max() / want.abs().max()).item() < 2 * 2**-8


def test_counted_dense_without_log_sum_exp_is_none():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(50, 2, 8) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):  # the caller keeps its varlen call
        assert counted_dense(q, k, v, torch.tensor(40), None) is None
