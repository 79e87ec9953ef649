"""The dense attention plans built ahead of their calls (encgraph.models.dense_plans): a deferred purchase's build
(:func:`plan_build`) hands torch's SDPA inputs of the very sizes, strides and dtype the real calls hand it (torch
keys cuDNN's plan by those), whatever views the tower's attention passes, and keeps no tensor of the call. On
the CPU, spying on the SDPA call; that the plan is then found on the device is tests/gpu/test_kernels_gpu.py's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from encgraph.models import attention, dense_plans


def sdpa_spy(monkeypatch) -> list[tuple]:
    """Records each SDPA call's ``(sizes, strides, dtype, requires_grad)`` of query, key and value."""
    seen: list[tuple] = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in (q, k, v)))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("layout", ["fused", "contiguous", "grouped"])
def test_a_build_hands_sdpa_the_real_calls_layout(monkeypatch, layout):
    """Views of a fused projection (row stride 3 x heads x dim), plain contiguous tensors, and grouped keys (fewer
    heads: repeated to the query's into contiguous tensors before the dense call): the build's SDPA inputs at a
    length match the real host-planned dense call's at that length."""
    torch.manual_seed(0)
    heads, dim, tokens = 4, 8, 19
    if layout == "fused":
        q, k, v = torch.randn(tokens, 3, heads, dim).unbind(1)
    elif layout == "contiguous":
        q, k, v = (torch.randn(tokens, heads, dim) for _ in range(3))
    else:
        q, (k, v) = torch.randn(tokens, heads, dim), (torch.randn(tokens, 2, dim) for _ in range(2))
    bounds = (0, 7, 19)
    cu = torch.tensor(bounds, dtype=torch.int32)
    seen = sdpa_spy(monkeypatch)
    with torch.no_grad():
        real = attention._host_planned_attention(q, k, v, cu, 0.3, bounds, (7, 12))
        build = dense_plans.plan_build(q, k, v, 0.3)
        build(7)
        build(12)
    assert len(seen) == 4 and seen[2:] == seen[:2]  # the two real dense calls, then the two builds
    assert real.shape == q.shape


def test_a_build_keeps_no_tensor_of_its_call_and_runs_on_its_own():
    fused = torch.randn(10, 3, 2, 8)
    q, k, v = fused.unbind(1)
    ref = weakref.ref(fused)
    build = dense_plans.plan_build(q, k, v, None)
    del fused, q, k, v
    gc.collect()
    assert ref() is None  # a due length waits with its layout only, not the call's activations
    assert build(6) is None  # uninitialised scratch inputs; the output is dropped
