"""The attention kernel choice on a GPU (issue 32 point 1, issue 56): the crossover measured per head geometry
and the rows from which eager forwards run dense; the host plan's two kernels (dense SDPA per long sequence, one
varlen call per run of short ones) against Flash varlen alone and an fp32 reference, NaN isolation on each; an
adapter's eager forward on every kernel path against its padded static forward (run eagerly) and the tower's own
forward, per item, after a capture that chose its kernels. Run with ``pytest -s`` to see the measured
crossovers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from encgraph.capture.execution import run_static
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import attention, kernel_choice, wrap
from encgraph.models.exact_attention import dense_sequence
from tests.gpu.test_qwen_gpu import HF_RTOL, build, hf_per_item, rel
from tests.models.test_kernel_choice import dense_spy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_RTOL = 2e-2
GEOMETRIES = [(16, 72), (16, 80), (12, 128), (16, 64)]  # Qwen3-VL / Qwen2.5-VL / GLM-4.1V / Gemma-4 and SigLIP-B


@pytest.fixture(autouse=True)
def torch_flash_only(monkeypatch):
    """These tests are about the dense kernel of eager forwards against torch's Flash varlen: where
    FlashAttention-4 is installed and measured faster, nothing would run dense. Capture here measures without it
    (tests/gpu/test_fa4_gpu.py tests it, and the tower tests run whatever capture chose)."""
    monkeypatch.setattr(kernel_choice, "_fa4_fits", lambda *args: False)


@pytest.mark.parametrize(("heads", "dim"), GEOMETRIES)
def test_crossover_is_measured(heads, dim):
    c = kernel_choice.measure_crossover(heads, dim, torch.bfloat16, torch.device("cuda"))
    print(f"\n{c.device} {heads}x{dim}: min_rows {c.min_rows}; "
          + ", ".join(f"{n}: varlen {v:.3f} / dense {d:.3f} ms (first {f:.2f})"
                      for n, v, d, f in zip(c.lengths, c.varlen_ms, c.dense_ms, c.dense_first_ms)))
    assert all(t > 0 for t in c.varlen_ms + c.dense_ms)
    # Attention is quadratic: both kernels take longer for the longest sequence than for the shortest.
    assert c.varlen_ms[-1] > c.varlen_ms[0] and c.dense_ms[-1] > c.dense_ms[0]
    # A new sequence length costs the dense kernel a plan on its first call (cuDNN builds one per shape; the
    # tower's own SDPA pays it too): printed, for the crossover's margin.
    q, k, v = _qkv([4999], heads, dim, seed=1)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dense_sequence(q, k, v, None)
    end.record()
    end.synchronize()
    print(f"first dense call at a new length (4999 rows): {start.elapsed_time(end):.2f} ms; plan_ms {c.plan_ms:.2f}; "
          f"eager forwards dense from {c.dense_from(27)} rows at 27 calls, {c.dense_from(4)} at 4")
    assert len(c.dense_first_ms) == len(c.lengths) and c.plan_ms > 0  # a new length's plan is measured
    if torch.cuda.get_device_capability()[0] == 9 and dim <= 80:
        # Hopper: this repository measured cuDNN ahead at 5,120-12,800 rows (attention_kernels_nvidia-h200.md),
        # and one 27-layer forward's saving pays a new length's plan somewhere past that.
        assert c.min_rows is not None and c.min_rows <= 8192, c.to_dict()
        assert c.dense_from(27) is not None and c.min_rows <= c.dense_from(27), c.to_dict()


def _qkv(lengths, heads=16, dim=72, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(lengths)
    return [torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "qkv"]


def _per_sequence_fp32(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        qq, kk, vv = (t[s].float().transpose(0, 1)[None] for t in (q, k, v))
        out.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)[0].transpose(0, 1))
        start += n
    return out


def _plain_and_planned(q, k, v, bounds, table):
    """Flash varlen alone, and the host plan of ``bounds`` under the rows ``table``, on the same inputs."""
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    cu = torch.tensor(bounds, device=q.device, dtype=torch.int32)
    plain = attention.packed_attention(q, k, v, cu, max(lengths))
    with attention.host_bounds([(cu, bounds)], min_rows=table):
        planned = attention.packed_attention(q, k, v, cu, max(lengths))
    return plain, planned


def _check_sequences(q, k, v, bounds, table):
    """Both outputs of :func:`_plain_and_planned` against each other and an fp32 reference, per sequence (bf16).
    Returns the plain one."""
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    plain, planned = _plain_and_planned(q, k, v, bounds, table)
    ref = _per_sequence_fp32(q, k, v, lengths)
    for i, (a, b, r) in enumerate(zip(torch.split(plain, lengths), torch.split(planned, lengths), ref)):
        assert rel(a, r) < BF16_RTOL and rel(b, r) < BF16_RTOL and rel(b, a) < BF16_RTOL, i
    return plain


def _check_nan_isolation(q, k, v, bounds, table, plain, nan_at):
    """NaN values at row ``nan_at[i]`` of each sequence ``i``: through either kernel only those sequences' rows
    turn NaN, the others equal ``plain``."""
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    bad_v = v.clone()
    for i, row in nan_at.items():
        bad_v[bounds[i] + row] = float("nan")
    for out in _plain_and_planned(q, k, bad_v, bounds, table):
        for i, (got, want) in enumerate(zip(torch.split(out, lengths), torch.split(plain, lengths))):
            if i in nan_at:
                assert torch.isnan(got).all(), i
            else:
                assert torch.isfinite(got).all() and rel(got, want) < BF16_RTOL, i


def test_host_plan_equals_varlen_and_isolates_nan(monkeypatch):
    lengths = [6000, 300, 200, 5000, 64]
    bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
    q, k, v = _qkv(lengths)
    table = {(16, 72, torch.bfloat16): 2048}
    dense = dense_spy(monkeypatch)
    plain = _check_sequences(q, k, v, bounds, table)
    assert dense == [6000, 5000]
    # NaN values in a short sequence (a varlen run) and a long one (dense): only their own rows turn NaN.
    _check_nan_isolation(q, k, v, bounds, table, plain, {1: 5, 3: 7})


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_eager_items_on_every_kernel_path(family, monkeypatch):
    """After capture chose the kernels, each item of an eager batch (two long images, two short ones) equals the
    padded static forward of the same item (run eagerly, Flash varlen) and the tower's own forward, on the
    measured plan and with every sequence on varlen."""
    tower, reference, _ = build(family)
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[64, 1280], max_items=4, compile=False, progress=False)
    info = runner.capture()
    assert info["kernels"] and runner.costs is not None and runner.costs.kernels == runner.kernels
    assert adapter.kernel_rows, info["kernels"]
    print(f"\n{family}: crossovers {[(c.heads, c.head_dim, c.min_rows) for c in runner.kernels.values()]}, "
          f"eager dense from {adapter.kernel_rows}")
    # Two of the four images run dense in every forward (no rent, no ledger: a length's first forward too).
    adapter.kernel_rows = {key: 4096 for key in adapter.kernel_rows}
    grid = np.array([[1, 64, 80], [1, 8, 8], [1, 72, 72], [1, 12, 16]])  # 1280 and 1296 tokens; 16 and 48
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    inputs = adapter.inputs(pixels, grid)
    refs = hf_per_item(reference, pixels, grid)
    counts = (grid.prod(1) // 4).tolist()
    statics = []
    with torch.inference_mode():
        for i in range(grid.shape[0]):
            sub = adapter.select(inputs, [i])
            if counts[i] <= 1280:
                statics.append(run_static(runner, "default", 1280 if counts[i] > 64 else 64, sub, counts[i]))
            else:
                statics.append(None)  # over every budget: the tower's own forward is its reference
        dense = dense_spy(monkeypatch)
        planned = adapter.forward_eager("default", inputs)  # the first forward at these lengths: dense already
        assert sorted(set(dense)) == [5120, 5184], sorted(set(dense))
        dense.clear()
        again = adapter.forward_eager("default", inputs)
        assert sorted(set(dense)) == [5120, 5184]
        for name in planned:
            assert torch.equal(again[name], planned[name]) or rel(again[name], planned[name]) < BF16_RTOL, name
        monkeypatch.setattr(adapter, "kernel_rows", {key: None for key in adapter.kernel_rows})
        dense.clear()
        varlen = adapter.forward_eager("default", inputs)
        assert not dense
    for name in planned:  # every output is per merged token (last_hidden_state as (tokens, merge^2 * hidden))
        for out in (planned, again):
            for i, (p, f) in enumerate(zip(torch.split(out[name], counts), torch.split(varlen[name], counts))):
                assert torch.isfinite(p).all() and rel(p, f) < BF16_RTOL, (name, i)
    for i, (p, r) in enumerate(zip(torch.split(planned["pooler_output"], counts), refs)):
        assert rel(p, r["pooler_output"]) < HF_RTOL, i
        if statics[i] is not None:
            assert rel(p, statics[i]["pooler_output"]) < HF_RTOL, i


def test_runner_calls_above_the_ladder_equal_the_tower(monkeypatch):
    """An item over the ladder's top runs eagerly, its long sequence dense at first sight where it reaches the
    rows measured at capture (here forced to 4,096); the runner's output equals the tower's either way."""
    tower, reference, _ = build("qwen3_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[64, 256], max_items=4, compile=False, progress=False)
    runner.capture()
    grid = np.array([[1, 96, 64], [1, 8, 8]])  # 1536 tokens (6144 rows): eager; 16 tokens: a replay
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    dense = dense_spy(monkeypatch)
    refs = hf_per_item(reference, pixels, grid)
    measured = dict(adapter.kernel_rows)
    for rows, want in ((measured, None), ({key: 4096 for key in measured}, [6144])):
        adapter.kernel_rows = rows
        dense.clear()
        with torch.inference_mode():
            out = runner(adapter.inputs(pixels, grid))
        for i, (o, r) in enumerate(zip(out, refs)):
            assert rel(o["pooler_output"], r["pooler_output"]) < HF_RTOL, i
        if want is not None:
            assert sorted(set(dense)) == want, dense
    assert runner.stats["eager_items"] >= 1  # the small item may join the eager batch if the cost model says so


def test_attend_per_sequence_equals_the_masked_sdpa_per_slot():
    """Idefics3's padding queries on CUDA: one varlen call (queries bounded 0, 1, ..., keys by cu_seqlens) against
    the CPU path's masked SDPA and an fp32 SDPA of each slot's own rows, in a CUDA graph; a NaN key in one
    sequence makes only that sequence's query NaN; a zero-length slot's output is zero."""
    from encgraph.models.idefics3_layout import pad_query_attention, slot_mask

    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    lengths = [729, 5, 1, 729, 300]
    cu = torch.tensor([0, *itertools.accumulate(lengths)] + [sum(lengths)], dtype=torch.int32, device="cuda")
    rows, slots = sum(lengths), cu.shape[0] - 1
    q, k, v = (torch.randn(n, 16, 72, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (slots, rows, rows))
    mask, _ = slot_mask(cu, rows)
    fast = pad_query_attention(q, k, v, mask, 72 ** -0.5, cu, max(lengths))
    masked = pad_query_attention(q.float(), k.float(), v.float(), mask, 72 ** -0.5, cu, max(lengths))
    for slot, (a, b) in enumerate(zip(cu[:-2].tolist(), cu[1:-1].tolist())):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[slot:slot + 1].float().transpose(0, 1), k[a:b].float().transpose(0, 1), v[a:b].float().transpose(0, 1),
            scale=72 ** -0.5).transpose(0, 1)[0]
        assert rel(fast[slot].float(), want) < BF16_RTOL, slot
        assert rel(masked[slot], want) < 1e-5, slot
    assert (fast[-1] == 0).all()  # the trailing zero-length slot

    static_q, static_k = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = pad_query_attention(static_q, static_k, v, mask, 72 ** -0.5, cu, max(lengths))
    static_k[cu[3]] = float("nan")  # a row of the fourth sequence
    graph.replay()
    bad = static_out.isnan().flatten(1).any(-1).tolist()
    assert bad == [False, False, False, True, False, False]
    torch.testing.assert_close(static_out[:3], fast[:3])
