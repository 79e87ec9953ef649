"""FlashAttention-4 as the packed varlen kernel (:mod:`encgraph.models.fa4`), where the optional wheel is installed
on a Hopper or Blackwell GPU: per sequence against an fp32 reference, replayed from a CUDA graph after its lengths
were rewritten, NaN kept within its sequence, and chosen by measurement at capture."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from encgraph.models import attention, fa4, kernel_choice, varlen_kernel
from encgraph.packing.crossover import faster_varlen
from tests.gpu.test_kernels_gpu import BF16_RTOL, GEOMETRIES, _per_sequence_fp32, _qkv
from tests.gpu.test_qwen_gpu import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and not fa4.available(torch.device("cuda")),
                       reason="needs flash-attn-4 (pip install flash-attn-4) on a Hopper or Blackwell GPU"),
]

LENGTHS = [3000, 300, 64, 1700, 936]  # the last one the padding sequence, as in encgraph's layouts
OTHER = [1000, 2000, 700, 1364, 936]  # another split of the same rows (a later replay's batch)


def registered(kernel):
    """``kernel`` registered for every geometry the tests use (a fixture's body), taken back after."""
    device = torch.device("cuda")
    for heads, dim in GEOMETRIES:
        varlen_kernel.use(heads, dim, torch.bfloat16, device, kernel)
    yield
    for heads, dim in GEOMETRIES:
        varlen_kernel.use(heads, dim, torch.bfloat16, device, "flash")


@pytest.fixture
def on_fa4():
    """FA4 for every geometry the tests use, in graphs and eager calls."""
    yield from registered("fa4")


def _cu(lengths):
    return torch.tensor(np.concatenate(([0], np.cumsum(lengths))).tolist(), device="cuda", dtype=torch.int32)


def _one_projection(lengths, heads, dim, seed):
    """q, k, v as the towers pass them: strided views of one ``(rows, 3, heads, head_dim)`` qkv projection."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return list(qkv.unbind(1))


@pytest.mark.parametrize("layout", ["separate", "one projection"])
@pytest.mark.parametrize(("heads", "dim"), GEOMETRIES)
def test_fa4_replay_equals_each_sequence_after_a_rewrite(heads, dim, layout, on_fa4):
    make = _qkv if layout == "separate" else _one_projection
    q, k, v = make(LENGTHS, heads, dim, seed=heads + dim)
    assert varlen_kernel.kernel_of(q) == "fa4" and (layout == "separate") == q.is_contiguous()
    cu = _cu(LENGTHS)
    budget = max(max(LENGTHS), max(OTHER))
    eager = attention.packed_attention(q, k, v, cu, budget)
    flash = attention._varlen_attention(q, k, v, cu, budget, None, "flash")
    for i, (got, want, fl) in enumerate(zip(torch.split(eager, LENGTHS), _per_sequence_fp32(q, k, v, LENGTHS),
                                            torch.split(flash, LENGTHS))):
        assert rel(got, want) < BF16_RTOL and rel(got, fl) < BF16_RTOL, (i, rel(got, want), rel(got, fl))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention.packed_attention(q, k, v, cu, budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.packed_attention(q, k, v, cu, budget)
    for lengths in (LENGTHS, OTHER):
        cu.copy_(_cu(lengths))
        fresh = [torch.randn_like(t) for t in (q, k, v)]
        for t, f in zip((q, k, v), fresh):
            t.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(torch.split(out, lengths), _per_sequence_fp32(q, k, v, lengths))):
            assert torch.isfinite(got).all() and rel(got, want) < BF16_RTOL, (lengths, i, rel(got, want))


def test_fa4_keeps_nan_within_its_sequence(on_fa4):
    check_nan_stays_in_its_sequence(contextlib.nullcontext)


def check_nan_stays_in_its_sequence(calls):
    """A NaN value in one sequence's row, through the geometry's kernel within ``calls()``: only that sequence's
    rows turn NaN, the others equal their clean output."""
    q, k, v = _qkv(LENGTHS)
    cu = _cu(LENGTHS)
    with calls():
        clean = attention.packed_attention(q, k, v, cu, max(LENGTHS))
        bad = v.clone()
        bad[LENGTHS[0] + 3] = float("nan")  # a row of the second sequence
        out = attention.packed_attention(q, k, bad, cu, max(LENGTHS))
    for i, (got, want) in enumerate(zip(torch.split(out, LENGTHS), torch.split(clean, LENGTHS))):
        if i == 1:
            assert torch.isnan(got).all()
        else:
            assert torch.isfinite(got).all() and rel(got, want) < BF16_RTOL, i


def measured_crossover(kernel: str) -> kernel_choice.Crossover:
    """Capture's measurement at 16 heads x 72 (Qwen3-VL's geometry), printed (``-s``), with a time of ``kernel``
    (``"fa4"`` or ``"cudnn"``) at every length."""
    c = kernel_choice.measure_crossover(16, 72, torch.bfloat16, torch.device("cuda"))
    times = list(c.fa4_ms if kernel == "fa4" else c.cudnn_ms)
    print(f"\n16x72 at {list(c.lengths)}: flash {list(c.varlen_ms)}, {kernel} {times}, dense {list(c.dense_ms)}; "
          f"graph kernel {c.graph_kernel}, eager {c.varlen_kernel}, dense from {c.min_rows}")
    assert len(times) == len(c.lengths) and all(t > 0 for t in times)
    return c


def test_capture_measures_fa4_and_runs_the_faster_kernel():
    c = measured_crossover("fa4")
    assert c.varlen_kernel == faster_varlen(c.varlen_ms, c.fa4_ms)
    # Timed on the device (replayed from a graph), FA4 is 1.08-2.25x torch's Flash at every length on an H200
    # (benches/results/attention_kernels_nvidia-h200_fa4.md, in git at 280d20c): capture must choose it there.
    assert c.varlen_kernel == "fa4", c.to_dict()
    heads, dim, device = c.heads, c.head_dim, torch.device("cuda")
    module = torch.nn.Module()
    module.attn = torch.nn.Module()
    module.attn.num_heads, module.attn.head_dim = heads, dim
    try:
        chosen = kernel_choice.choose(module, torch.bfloat16, device, known={c.key: c})
        assert chosen[c.key] is c  # measured with FA4 already: taken as given
        probe = torch.empty(1, heads, dim, device=device, dtype=torch.bfloat16)
        assert varlen_kernel.kernel_of(probe) == c.varlen_kernel
        # A cost model measured without FA4 is measured again here, with it.
        plain = kernel_choice.Crossover(c.device, heads, dim, c.dtype, c.lengths, c.varlen_ms, c.dense_ms)
        again = kernel_choice.choose(module, torch.bfloat16, device, known={c.key: plain})[c.key]
        assert again is not plain and len(again.fa4_ms) == len(again.lengths)
    finally:
        varlen_kernel.use(heads, dim, torch.bfloat16, device, "flash")


def test_importing_and_compiling_fa4_leaves_process_state_as_it_was():
    # In a fresh process (this one imported the wheel when it collected this module): every setting of
    # tests/models/test_global_state.snapshot before the wheel is imported, and after it is imported and has
    # compiled a kernel.
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent("""
        import json, torch
        from tests.models.test_global_state import snapshot
        from encgraph.models import fa4
        before = snapshot()
        device = torch.device("cuda")
        assert fa4.available(device)
        fa4.warm(16, 72, torch.bfloat16, device, max_rows=256)
        after = snapshot()
        print(json.dumps({k: [str(before[k]), str(after[k])] for k in before if before[k] != after[k]}))
    """)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == {}, {k: [v[0][:300], v[1][:300]] for k, v in changed.items()}
