"""The eager attention kernel choice on a GPU (issue 32 point 1): the crossover measured per head geometry; the
host plan's two kernels (dense SDPA per long sequence, one varlen call per run of short ones) against Flash
varlen alone and an fp32 reference, NaN isolation on each; an adapter's eager forward on every kernel path against
its padded static forward (run eagerly) and the tower's own forward, per item, after a capture that chose its
kernels. Run with ``pytest -s`` to see the measured crossovers."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from encgraph.capture.execution import run_static
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import attention, kernel_choice, sequence_bounds, wrap
from encgraph.models.dense_sequence import counted_dense, dense_sequence, padded_dense
from encgraph.packing.kernels import LEDGER
from tests.gpu.test_qwen_gpu import HF_RTOL, build, hf_per_item, rel
from tests.models.test_kernel_choice import dense_spy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_RTOL = 2e-2
MAX_FORWARDS_TO_BUY = 200
"""Forwards within which rent-or-buy must have bought the dense plan of a repeated length (a few-layer tower saves
little per forward against cuDNN's plan of about 35 ms)."""
GEOMETRIES = [(16, 72), (16, 80), (12, 128), (16, 64)]  # Qwen3-VL / Qwen2.5-VL / GLM-4.1V / Gemma-4 and SigLIP-B


@pytest.fixture(autouse=True)
def torch_flash_only(monkeypatch):
    """These tests are about the dense kernel against torch's Flash varlen (rent-or-buy, buckets): where
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
    print(f"first dense call at a new length (4999 rows): {start.elapsed_time(end):.2f} ms")
    # Padded to its bucket (the padding's share taken out with cuDNN's log-sum-exp: a wrong one would be off by
    # up to 19% at 6,144 rows): the same attention within bf16 tolerance, rows unmixed.
    assert len(c.padded_ms) == len(c.lengths) and all(t > 0 for t in c.padded_ms)
    print(f"padded / exact dense at {list(c.lengths)}: "
          + ", ".join(f"{p / d:.2f}" for p, d in zip(c.padded_ms, c.dense_ms)) + f"; bucketed {c.bucketed}")
    want = dense_sequence(q, k, v, None).float()
    for padded in (5000, 5120, 6144):
        got = padded_dense(q, k, v, None, padded).float()
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert rel(got, want) < 1e-2, (padded, rel(got, want))
    # Logits all shifted far below 0 (keys sharing a large component against the queries): still exact.
    axis = torch.nn.functional.normalize(torch.randn(dim, device="cuda"), dim=0)
    q2, k2 = (q.float() + 2 * axis).bfloat16(), (k.float() - 40 * axis).bfloat16()
    want2 = dense_sequence(q2, k2, v, None).float()
    assert rel(padded_dense(q2, k2, v, None, 5120).float(), want2) < 1e-2
    if torch.cuda.get_device_capability()[0] == 9 and dim <= 80:
        # Hopper: this repository measured cuDNN ahead at 5,120-12,800 rows (attention_kernels_nvidia-h200.md).
        assert c.min_rows is not None and c.min_rows <= 8192, c.to_dict()


@pytest.mark.parametrize(("heads", "dim"), [(16, 72), (12, 128)])
def test_bucket_plans_built_ahead_cost_no_plan(heads, dim):
    """warm_plans (capture) builds each long bucket's cuDNN plan in this thread: a sequence of a warmed bucket's
    lengths then runs its first call at about its steady time, where one of an unwarmed bucket pays the plan;
    both at every head dim, the padding corrected (128 included: no widened kernel)."""
    from encgraph.packing.kernels import DenseRule, bucket_rows

    device = torch.device("cuda")
    c = kernel_choice.measure_crossover(heads, dim, torch.bfloat16, device)
    # Hopper: buckets from at most 16,384 rows measured (or a little past, extrapolated), well under Qwen's largest.
    assert c.bucket_from is not None and c.bucket_from <= 24576, c.to_dict()
    rule = DenseRule(c.min_rows, c, 1)
    rows = (70_000, 80_000)  # past every capture's warm range (WARM_ROWS): no earlier test built these plans
    expected = kernel_choice.warm_lengths(rule, rows)
    info = kernel_choice.warm_plans({(heads, dim, torch.bfloat16): rule}, device, rows=rows)
    assert expected == [73728, 77824] and info["lengths"] == 2, (info, expected)
    key = sequence_bounds.ledger_key(heads, dim, torch.bfloat16, device)
    warm_rows, cold_rows = 77_000, 85_000
    assert LEDGER.bought(key, bucket_rows(warm_rows)) and not LEDGER.bought(key, bucket_rows(cold_rows))

    def plan_ms(rows):
        """The first call's ms beyond the second's at this length: the plan, where one is built."""
        q, k, v = _qkv([rows], heads, dim, seed=rows)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = padded_dense(q, k, v, None, bucket_rows(rows))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        assert rel(out.float(), dense_sequence(q, k, v, None).float()) < 1e-2
        return times[0] - times[1]

    warmed, cold = plan_ms(warm_rows), plan_ms(cold_rows)
    print(f"\n{heads}x{dim}: first call beyond the second at a warmed bucket {warmed:.2f} ms, at a new one "
          f"{cold:.2f} ms ({info['seconds']:.2f} s for {info['lengths']} plans); bucket_from {c.bucket_from}")
    assert warmed < 10.0 < cold, (warmed, cold)  # cuDNN's plan: 35-75 ms on an H200


@pytest.mark.parametrize("layout", ["fused", "grouped"])
def test_a_deferred_build_is_the_plan_the_real_calls_find(layout):
    """A purchase that falls due in a deferring block (the runner's call) is built afterwards by
    ``dense_plans.plan_build`` on scratch tensors of the call's layout: the real calls at that length (views of a
    fused projection as a tower's, or grouped keys repeated) then run their first call at about their steady
    time, where a length not built pays cuDNN's plan (about 40 ms on an H200); their outputs equal an fp32
    reference per sequence."""
    from encgraph.models import dense_plans

    heads, dim, rows = 16, 72, 6200
    gen = torch.Generator(device="cuda").manual_seed(7)
    if layout == "fused":
        q, k, v = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen).unbind(1)
    else:
        q, k, v = (torch.randn(rows, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h in (heads, 4, 4))
    built, cold = (6007, 6011) if layout == "fused" else (6013, 6017)  # lengths no other test meets
    dense_plans.plan_build(q, k, v, None)(built)
    torch.cuda.synchronize()

    def first_beyond_second(n):
        cu, times = torch.tensor([0, n], device="cuda", dtype=torch.int32), []
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = attention._host_planned_attention(q[:n], k[:n], v[:n], cu, None, (0, n), (n,))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        kk, vv = (k[:n], v[:n]) if layout == "fused" else attention.repeat_heads(k[:n], v[:n], heads)
        assert rel(out.float(), _per_sequence_fp32(q[:n], kk, vv, [n])[0]) < BF16_RTOL
        return times[0] - times[1]

    warm, miss = first_beyond_second(built), first_beyond_second(cold)
    print(f"\n{layout}: first call beyond the second at a length built ahead {warm:.2f} ms, at a new one {miss:.2f}")
    assert warm < 10.0 < miss, (warm, miss)


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


def test_a_rented_length_stands_in_padded_at_its_held_bucket(monkeypatch):
    """A long sequence at a length this thread has no plan for rents: on varlen, or, where the thread holds its
    bucket's plan (capture's warm_plans), padded to that bucket on the dense kernel. Either way every sequence
    equals Flash varlen alone and an fp32 reference (bf16), and NaN in one sequence stays in its rows."""
    from encgraph.packing.kernels import Crossover, DenseRule, bucket_rows

    # H200-like times (16 x 72): the eager padded call beats varlen from 8,192 rows, buckets only from 16,384, and
    # a plan (60 ms) costs more than a forward of 4 calls saves: every length here rents at first.
    c = Crossover("test", 16, 72, "bfloat16", (4096, 8192, 16384), (0.353, 1.357, 5.241), (0.249, 0.770, 3.062),
                  dense_first_ms=(60.0, 60.0, 60.0), padded_ms=(0.761, 1.088, 3.476))
    rule = DenseRule(c.min_rows, c, calls=4)
    lengths = [9000, 300, 8300, 5000, 64]  # 9000 stands in at 9216; 8300 at 8704 is not held; 5000 under 8192
    assert [rule.stand_in_rows(n) for n in lengths] == [9216, None, 8704, None, None]
    bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
    q, k, v = _qkv(lengths)
    table = {(16, 72, torch.bfloat16): rule}
    LEDGER.clear()
    key = sequence_bounds.ledger_key(16, 72, torch.bfloat16, q.device)
    LEDGER.own(key, bucket_rows(9000))
    runs: list[tuple[int, int]] = []
    dense_spy(monkeypatch, runs)
    before = LEDGER.stats()
    plain = _check_sequences(q, k, v, bounds, table)
    assert runs == [(9000, 9216)], runs  # the others rent varlen
    after = LEDGER.stats()
    assert after["stand_in_calls"] - before["stand_in_calls"] == 1
    assert after["rented_calls"] - before["rented_calls"] == 3  # 9000 (padded), 8300, 5000 (varlen)
    assert not LEDGER.bought(key, 9000)
    _check_nan_isolation(q, k, v, bounds, table, plain, {0: 11, 1: 5})  # the padded sequence, a varlen one
    LEDGER.clear()


def test_a_recurring_size_past_the_buckets_ends_on_its_own_length(monkeypatch):
    """A sequence past ``bucket_from`` runs padded at its bucket (held: capture builds them) while its own length
    rents by what the padding costs, then at its own length once that paid the plan: every call equals Flash
    varlen alone and an fp32 reference per sequence (bf16), on both kernels, and NaN stays in its sequence."""
    from encgraph.packing.kernels import Crossover, DenseRule, bucket_rows

    # H200-like times (16 x 72), buckets from 16,384 rows; a 6 ms plan, so that the exact length is bought
    # within a few calls (the padding costs about 0.55 ms a call at 17,000 rows).
    dense = (0.249, 0.770, 3.062)
    c = Crossover("test", 16, 72, "bfloat16", (4096, 8192, 16384), (0.353, 1.357, 5.241), dense,
                  dense_first_ms=tuple(d + 6.0 for d in dense), padded_ms=(0.761, 1.088, 3.476))
    rule = DenseRule(c.min_rows, c, calls=4)
    lengths = [17000, 300]
    assert rule.run_rows(17000) == bucket_rows(17000) == 17408 and 0 < rule.refine_ms(17000)
    bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
    q, k, v = _qkv(lengths, seed=3)
    table = {(16, 72, torch.bfloat16): rule}
    LEDGER.clear()
    key = sequence_bounds.ledger_key(16, 72, torch.bfloat16, q.device)
    LEDGER.own(key, 17408)
    runs: list[tuple[int, int]] = []
    dense_spy(monkeypatch, runs)
    for _ in range(20):
        plain = _check_sequences(q, k, v, bounds, table)
        if LEDGER.bought(key, 17000):
            break
    assert LEDGER.bought(key, 17000) and runs[0] == (17000, 17408) and runs[-1] == (17000, 17000), runs
    _check_nan_isolation(q, k, v, bounds, table, plain, {0: 11})  # at its own length now
    LEDGER.clear()


@pytest.mark.parametrize(("heads", "dim"), GEOMETRIES)
def test_counted_dense_replayed_at_each_length(heads, dim):
    """counted_dense captured once at a budget's rows and replayed with the real length rewritten on the device,
    fresh random inputs each replay and NaN in the padding rows: every replay's real rows against the eager call
    at that length (bf16) and an fp32 reference; the padding reaches no real row."""
    rows = 5120
    q, k, v = (torch.zeros(rows, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    real = torch.tensor([rows], device="cuda", dtype=torch.int32)
    assert counted_dense(q.normal_(), k.normal_(), v.normal_(), real, None) is not None  # cuDNN returns its lse
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        counted_dense(q, k, v, real, None)  # warm-up off the capture: cuDNN's plan for the shape
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = counted_dense(q, k, v, real, None)
    for seed, n in enumerate((4480, 5120, 4097, 2600)):  # from half the budget to all of it
        fresh = _qkv([rows], heads, dim, seed=seed + 1)
        for buf, t in zip((q, k, v), fresh):
            buf.copy_(t)
            buf[n:] = float("nan")
        real.fill_(n)
        graph.replay()
        eager = dense_sequence(*(t[:n] for t in fresh), None)
        (ref,) = _per_sequence_fp32(*(t[:n] for t in fresh), [n])
        got = out[:n]
        assert torch.isfinite(got).all(), n
        assert rel(got, eager) < BF16_RTOL and rel(got, ref) < BF16_RTOL, n


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
    assert LEDGER.stats()["bought"] > 0  # capture timed its eager samples at their steady (dense) kernels
    print(f"\n{family}: crossovers {[(c.heads, c.head_dim, c.min_rows) for c in runner.kernels.values()]}")
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
        # Rent-or-buy: lengths new to this thread run varlen until the savings missed pay cuDNN's plan (how many
        # forwards that takes depends on the margin measured at capture: Qwen2.5-VL's 16 x 80 on an H100 once
        # bought nothing in 201); the first (rented) forward is checked below as ``first``.
        first = adapter.forward_eager("default", inputs)
        # Each image's full-attention sequence (rows = t * h * w) that reaches its geometry's measured crossover
        # runs dense once bought: buying() buys them at once, as capture's timed forwards do.
        reaching = [int(n) for n in grid.prod(1) for rule in adapter.kernel_rows.values()
                    if rule.min_rows is not None and n >= rule.min_rows]
        dense.clear()
        with LEDGER.buying():
            planned = adapter.forward_eager("default", inputs)  # bought: every layer on the dense plans
        print(f"{family}: sequences at or past the crossover {reaching}; dense calls {sorted(set(dense))}")
        assert bool(dense) == bool(reaching), (reaching, sorted(set(dense)))
        dense.clear()
        again = adapter.forward_eager("default", inputs)  # outside buying(): the bought lengths stay dense
        assert bool(dense) == bool(reaching), "a bought length ran varlen again"
        for name in planned:
            assert torch.equal(again[name], planned[name]) or rel(again[name], planned[name]) < BF16_RTOL, name
        monkeypatch.setattr(adapter, "kernel_rows", {key: None for key in adapter.kernel_rows})
        dense.clear()
        varlen = adapter.forward_eager("default", inputs)
        assert not dense
    for name in planned:  # every output is per merged token (last_hidden_state as (tokens, merge^2 * hidden))
        for out in (planned, first):
            for i, (p, f) in enumerate(zip(torch.split(out[name], counts), torch.split(varlen[name], counts))):
                assert torch.isfinite(p).all() and rel(p, f) < BF16_RTOL, (name, i)
    for i, (p, r) in enumerate(zip(torch.split(planned["pooler_output"], counts), refs)):
        assert rel(p, r["pooler_output"]) < HF_RTOL, i
        if statics[i] is not None:
            assert rel(p, statics[i]["pooler_output"]) < HF_RTOL, i


def test_runner_calls_above_the_ladder_equal_the_tower(monkeypatch):
    """An item over the ladder's top runs eagerly on the measured plan; the runner's output equals the tower's."""
    tower, reference, _ = build("qwen3_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[64, 256], max_items=4, compile=False, progress=False)
    runner.capture()
    grid = np.array([[1, 96, 64], [1, 8, 8]])  # 1536 tokens (6144 rows): eager; 16 tokens: a replay
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    dense = dense_spy(monkeypatch)
    refs = hf_per_item(reference, pixels, grid)
    for _ in range(MAX_FORWARDS_TO_BUY + 1):  # rented (varlen) at first sight until the plan pays, then dense
        with torch.inference_mode():
            out = runner(adapter.inputs(pixels, grid))
        for i, (o, r) in enumerate(zip(out, refs)):
            assert rel(o["pooler_output"], r["pooler_output"]) < HF_RTOL, i
        if 6144 in dense:
            break
    assert 6144 in dense
    assert runner.stats["eager_items"] >= 1  # the small item may join the eager batch if the cost model says so


def test_an_eager_batch_that_would_rent_replays_instead(monkeypatch):
    """The cost model prices eager at its steady kernels. An image at a length this thread has not bought would
    rent varlen (the adapter's surcharge): with eager priced a hair under the replay, the runner replays it
    (``rerouted``), piecewise: its long sequence outside the graph, at its run length under the split calls' rule
    (``DenseRule.replayed``: its own length, under the replay buckets' start), renting varlen through the ledger
    while neither that length nor its bucket is held by the thread (capture built the bucket; ``LEDGER.clear()``
    forgot it). Within the calls the rent takes to reach the plan the length is bought, and the same image then
    replays piecewise on the dense kernel at it. The eager length is never bought (no eager run buys it): every
    call is rerouted. Every output equals the tower's own forward; called outside ``inference_mode``
    (``no_grad``, as ``generate()`` does)."""
    import math

    import attrs

    from encgraph.packing import CostModel
    from encgraph.packing.kernels import DenseRule

    tower, reference, _ = build("qwen3_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[64, 1280], max_items=4, compile=False, progress=False)
    runner.capture()
    (key, rule), = adapter.kernel_rows.items()
    assert rule.min_rows is not None and rule.min_rows <= 4560, rule
    # 4,560 rows: a length dense runs faster than varlen, under the lengths capture builds ahead for eager forwards
    # (kernel_choice.WARM_ROWS), so new to this thread after clear(); between segments at the split rule's run
    # length (4,560 where replay buckets start past it, as on an H200; else its bucket, 4,608).
    assert rule.gain_ms(4560) > 0 and rule.run_rows(4560) < kernel_choice.WARM_ROWS[0], rule.crossover.to_dict()
    # The plan as 5 forwards' savings: the crossover's own plan time depends on whether this process built
    # cuDNN plans at its lengths before (earlier tests did), and this test is about the rent, not the device.
    plan = 5 * rule.calls * rule.gain_ms(4560)
    c = attrs.evolve(rule.crossover, dense_first_ms=tuple(d + plan for d in rule.crossover.dense_ms))
    rule = adapter.kernel_rows[key] = DenseRule(rule.min_rows, c, rule.calls)
    split = attrs.evolve(rule, replayed=True)
    assert rule.plan_ms == pytest.approx(plan) and split.gain_ms(4560) > 0, c.to_dict()
    linear = CostModel.linear(["default"], graph_fixed_ms=1.0001, graph_per_budget_ms=0, eager_fixed_ms=1.0,
                              eager_per_token_ms=0)
    runner.costs = CostModel(linear.graph_ms, linear.eager, kernels=runner.costs.kernels)
    # These prices are made up (a replay takes ms, not 1.0001): the feedback would correct them after a few
    # replays and end the reroutes; this test is about the reroute alone.
    runner._feedback.min_samples = 10**9
    LEDGER.clear()  # every length new to this thread, the buckets capture built too
    grid = np.array([[1, 76, 60]])  # 1140 tokens, 4560 rows
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    inputs = adapter.inputs(pixels, grid)
    ref = hf_per_item(reference, pixels, grid)[0]["pooler_output"]
    specs = adapter.item_specs(inputs)
    bound = math.ceil(split.plan_ms / (split.calls * split.gain_ms(4560))) + 1
    cuda = torch.device("cuda")
    eager_key = sequence_bounds.ledger_key(16, 72, torch.bfloat16, cuda)
    split_key = sequence_bounds.ledger_key(16, 72, torch.bfloat16, cuda, replayed=True)
    with torch.no_grad():
        assert adapter.eager_surcharge_ms("default", specs) > 0
        for call in range(bound + 1):
            out = runner(inputs)
            assert rel(out[0]["pooler_output"], ref) < HF_RTOL, call
            if LEDGER.bought(split_key, split.run_rows(4560)):
                break
        assert LEDGER.bought(split_key, split.run_rows(4560)) and call >= 1, (call, bound)
        assert not LEDGER.bought(eager_key, rule.run_rows(4560))
        stats = runner.stats
        assert stats["eager_items"] == 0 and stats["cost_feedback"]["rerouted"] == call + 1, stats
        assert stats["paths"]["default"]["piecewise_replays"] == {1280: call + 1}, stats["paths"]
        assert adapter.eager_surcharge_ms("default", specs) > 0  # the eager length still rents: rerouted again
        dense = dense_spy(monkeypatch)
        out = runner(inputs)  # its run length bought: a piecewise replay on the dense kernel
    assert rel(out[0]["pooler_output"], ref) < HF_RTOL
    stats = runner.stats
    assert stats["cost_feedback"]["rerouted"] == call + 2 and stats["eager_items"] == 0, stats
    assert stats["paths"]["default"]["piecewise_replays"] == {1280: call + 2} and dense == [4560] * rule.calls, dense
