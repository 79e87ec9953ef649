"""The attention kernel choice on the CPU: the crossover data (encgraph.packing.crossover) and its place in the
cost model's JSON, the varlen kernel it picks, from how many rows an eager forward runs a sequence dense, the host
plan of encgraph.models.attention (which sequences run dense, which runs of short ones go to one varlen call, with
a stand-in varlen kernel: the CPU has none), and the runner's capture hook. The timing itself runs on CUDA only
(tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError
from encgraph.models import attention, kernel_choice, sequence_bounds
from encgraph.packing import CostModel
from encgraph.packing.crossover import Crossover, crossover_rows, kernel_table
from tests.models.test_attention import qkv, reference

H200 = "NVIDIA H200"


@pytest.mark.parametrize(("varlen", "dense", "rows"), [
    ((1, 2, 3, 4), (2, 1, 2, 3), 2048),  # dense wins from the second length on
    ((1, 2, 3, 4), (2, 1, 4, 3), 8192),  # a loss at 4096: only the last length counts
    ((1, 2, 3, 4), (2, 3, 4, 5), None),  # never
    ((1, 2, 3, 4), (1, 2, 3, 4), 1024),  # ties go dense
])
def test_crossover_rows(varlen, dense, rows):
    assert crossover_rows((1024, 2048, 4096, 8192), varlen, dense) == rows


def test_crossover_round_trips_through_the_cost_model():
    c = Crossover(H200, 16, 72, "bfloat16", (1024, 4096), (0.1, 1.0), (0.2, 0.6), dense_first_ms=(9.0, 3.0))
    assert c.min_rows == 4096 and c.key == "NVIDIA H200/16x72/bfloat16"
    model = CostModel.from_measurements({"default": {64: 1.0, 128: 2.0}},
                                        {"default": [(64, 1, 3.0), (128, 1, 4.0)]})
    model = type(model)(model.graph_ms, model.eager, kernels={c.key: c})
    data = model.to_dict()
    assert data["kernels"][c.key]["min_rows"] == 4096
    again = CostModel.from_dict(data)
    assert again.kernels == {c.key: c}
    old = {k: v for k, v in data.items() if k != "kernels"}  # a file of before the crossover
    assert CostModel.from_dict(old).kernels == {}


def test_fa4_runs_a_geometry_only_where_measured_faster_and_its_times_set_the_crossover():
    lengths, flash, dense = (1024, 4096, 16384), (0.1, 1.6, 25.0), (0.15, 1.0, 14.0)
    # Not measured (no wheel): torch's kernel, dense from 4096 rows.
    plain = Crossover(H200, 16, 72, "bfloat16", lengths, flash, dense)
    assert plain.varlen_kernel == "flash" and plain.min_rows == 4096 and plain.chosen_varlen_ms == flash
    # FA4 faster than flash and than dense: every sequence stays varlen, in graphs and eager forwards.
    fast = Crossover(H200, 16, 72, "bfloat16", lengths, flash, dense, fa4_ms=(0.08, 0.9, 12.0))
    assert fast.varlen_kernel == "fa4" and fast.min_rows is None
    assert fast.ms_at(4096) == pytest.approx((0.9, 1.0))
    # Faster by less than the margin at most lengths: kept on flash (noise must not swap kernels).
    close = Crossover(H200, 16, 72, "bfloat16", lengths, flash, dense, fa4_ms=(0.05, 1.55, 24.5))
    assert close.varlen_kernel == "flash" and close.min_rows == 4096
    data = fast.to_dict()
    assert data["varlen_kernel"] == "fa4" and data["fa4_ms"] == [0.08, 0.9, 12.0]
    assert Crossover.from_dict(data) == fast
    old = {k: v for k, v in data.items() if k not in ("fa4_ms", "varlen_kernel")}  # a file of before FA4
    assert Crossover.from_dict(old) == plain
    with pytest.raises(ConfigError, match="fa4_ms.*one time per length"):
        Crossover(H200, 16, 72, "bfloat16", lengths, flash, dense, fa4_ms=(1.0,))


def test_fa4_bounds_off_a_hopper():
    from encgraph.models import fa4

    assert not fa4.available(torch.device("cpu"))
    # Every bound is a power of two, never below the longest sequence: the kernels compiled at capture serve all.
    for n in (1, 127, 128, 129, 1000, 4352, 16384, 16385, 65536):
        b = fa4.bound(n)
        assert b >= max(n, 128) and b & (b - 1) == 0 and b < 2 * max(n, 128)


@pytest.mark.parametrize(("entry", "match"), [
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [2, 1], "varlen_ms": [1, 1],
      "dense_ms": [1, 1]}, "ascending"),
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [1, 2], "varlen_ms": [1],
      "dense_ms": [1, 1]}, "varlen_ms.*one time per length"),
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [1], "varlen_ms": [-1],
      "dense_ms": [1]}, "finite time >= 0"),
    ({"device": H200, "heads": 16, "dtype": "bfloat16", "lengths": [1], "varlen_ms": [1], "dense_ms": [1]},
     "head_dim"),
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [1, 2], "varlen_ms": [1, 1],
      "dense_ms": [1, 1], "dense_first_ms": [5]}, "one time per length"),
])
def test_bad_crossover_entries_are_refused(entry, match):
    with pytest.raises(ConfigError, match=match):
        kernel_table({"k": entry})


def test_a_crossover_under_another_key_is_refused():
    c = Crossover(H200, 16, 72, "bfloat16", (1024,), (0.1,), (0.2,))
    with pytest.raises(ConfigError, match="names another geometry"):
        kernel_table({"NVIDIA H100/16x72/bfloat16": c})


# ---------------------------------------------------------------------------------------------------- the host plan
@pytest.fixture
def fake_varlen(monkeypatch):
    """The CPU stand-in of the varlen kernel: exact per-sequence attention read from its ``cu_seqlens``; records
    ``(rows, cu values, max_seqlen)`` per call. The backend choice then sees a varlen kernel."""
    calls = []

    def varlen(query, key, value, cu, max_seqlen, scale, kernel=None):
        bounds = cu.tolist()
        calls.append((query.shape[0], bounds, max_seqlen))
        assert bounds[-1] == query.shape[0] and max(b - a for a, b in zip(bounds, bounds[1:])) <= max_seqlen
        if key.shape[1] != query.shape[1]:
            key, value = attention.repeat_heads(key, value, query.shape[1])
        return reference(query, key, value, [b - a for a, b in zip(bounds, bounds[1:])], scale)

    monkeypatch.setattr(attention, "_varlen_attention", varlen)
    monkeypatch.setattr(attention, "pick_backend", lambda q: attention.AttentionBackend.VARLEN)
    return calls


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_long_sequences_run_dense_and_runs_of_short_ones_varlen(fake_varlen, kv_heads):
    bounds = [0, 3, 5, 25, 27, 27, 30, 50]
    q, k, v = qkv(52, kv_heads=kv_heads)  # 2 rows past cu[-1]: one more sequence, as in the other backends
    cu = torch.tensor(bounds, dtype=torch.int32)
    with attention.host_bounds([(cu, bounds)], min_rows={(3, 8, torch.float32): 10}):
        assert attention._host_plan(cu, q) == (tuple(bounds), (False, False, True, False, False, False, True))
        got = packed_attention_default(q, k, v, cu)
    assert fake_varlen == [(5, [0, 3, 5], 3), (5, [0, 2, 2, 5], 3)]
    kk, vv = attention.repeat_heads(k, v, 3) if kv_heads else (k, v)
    torch.testing.assert_close(got, reference(q, kk, vv, [3, 2, 20, 2, 0, 3, 20, 2]), rtol=1e-6, atol=1e-6)


def packed_attention_default(q, k, v, cu):
    return attention.packed_attention(q, k, v, cu, 20)


def test_short_sequences_only_keep_one_varlen_call(fake_varlen):
    bounds = [0, 3, 5]
    q, k, v = qkv(5)
    cu = torch.tensor(bounds, dtype=torch.int32)
    for table in ({(3, 8, torch.float32): 10}, {(3, 8, torch.float32): None}):  # short; dense never pays
        with attention.host_bounds([(cu, bounds)], min_rows=table):
            assert attention._host_plan(cu, q) is None
            packed_attention_default(q, k, v, cu)
    assert [c[1] for c in fake_varlen] == [bounds, bounds]  # the whole tensor, as without host bounds


def test_an_unmeasured_geometry_takes_the_default_with_one_log_line(fake_varlen, monkeypatch, caplog):
    monkeypatch.setattr(sequence_bounds, "_FALLBACK_LOGGED", set())
    monkeypatch.setattr(attention, "SEGMENT_MIN_ROWS", 4)
    q = torch.zeros(10, 3, 8)
    cu = torch.tensor([0, 2, 10], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="encgraph"), attention.host_bounds([(cu, [0, 2, 10])]):
        assert attention._host_plan(cu, q) == ((0, 2, 10), (False, True))
        assert attention._host_plan(cu, q) == ((0, 2, 10), (False, True))
    assert sum("no kernel crossover measured for 3 heads x 8" in r.message for r in caplog.records) == 1


def test_dense_from_pays_a_new_lengths_plan_in_one_forward():
    """A sequence runs dense from the first length whose saving over one forward's attention calls pays cuDNN's plan
    of that length (H200 times at 16 x 72: about 13,300 rows over Qwen3-VL's 27 layers, more with fewer calls);
    never where dense loses everywhere or nothing pays; from the kernel crossover where no plan cost was measured."""
    lengths, varlen, dense = (1024, 4096, 16384), (0.05, 0.4, 5.5), (0.06, 0.3, 3.5)
    c = Crossover(H200, 16, 72, "bfloat16", lengths, varlen, dense, dense_first_ms=(35.06, 35.3, 38.5))
    assert c.plan_ms == pytest.approx(35.0) and c.min_rows == 4096
    at27, at4 = c.dense_from(27), c.dense_from(4)
    assert 4096 < at27 < 16384 < at4
    for rows, calls in ((at27, 27), (at4, 4)):  # the first length that pays, within one step of 1/64 doubling
        assert calls * (c.ms_at(rows)[0] - c.ms_at(rows)[1]) >= c.plan_ms
        below = int(rows / 2 ** (1 / 64)) - 1
        assert below < c.min_rows or calls * (c.ms_at(below)[0] - c.ms_at(below)[1]) < c.plan_ms
    assert Crossover(H200, 16, 72, "bfloat16", lengths, varlen, dense).dense_from(1) == 4096  # no plan measured
    assert Crossover(H200, 16, 72, "bfloat16", lengths, varlen, (1.0, 1.0, 9.0)).dense_from(27) is None
    huge = Crossover(H200, 16, 72, "bfloat16", lengths, varlen, dense, dense_first_ms=(1e9, 1e9, 1e9))
    assert huge.dense_from(1) is None
    # rows_table: per geometry, the tower's calls per forward (1 where not given)
    table = kernel_choice.rows_table([c], {(16, 72): 27})
    assert table == {(16, 72, torch.bfloat16): at27}
    assert kernel_choice.rows_table([c]) == {(16, 72, torch.bfloat16): c.dense_from(1)}


def test_cost_models_saved_with_retired_fields_still_load():
    """A cost model saved before dense plans left the graphs (padded times, bucket and stand-in starts) loads; the
    retired fields are dropped."""
    c = Crossover(H200, 16, 72, "bfloat16", (1024, 4096), (0.1, 1.0), (0.2, 0.6))
    old = {**c.to_dict(), "padded_ms": [0.3, 0.7], "padded_replay_ms": [0.2, 0.6], "bucket_from": 4096,
           "replay_bucket_from": None, "stand_in_from": None, "replay_stand_in_from": 4096}
    assert Crossover.from_dict(old) == c


def test_eager_forwards_run_long_sequences_dense_with_equal_outputs(fake_varlen, monkeypatch):
    """With a rows table from the measurement, a sequence from its rows runs dense at its first sight (no rent, no
    ledger: torch keeps the plan), the shorter ones in one varlen call; the attention is the same either way."""
    bounds = [0, 3, 23, 63]
    q, k, v = qkv(63)
    cu = torch.tensor(bounds, dtype=torch.int32)
    dense = dense_spy(monkeypatch)
    for table, want_dense in (({(3, 8, torch.float32): 20}, [20, 40]), ({(3, 8, torch.float32): 30}, [40]),
                              ({(3, 8, torch.float32): None}, [])):
        dense.clear()
        with attention.host_bounds([(cu, bounds)], min_rows=table):
            got = attention.packed_attention(q, k, v, cu, 40)
        assert dense == want_dense
        torch.testing.assert_close(got, reference(q, k, v, [3, 20, 40]), rtol=1e-6, atol=1e-6)


def test_measurement_is_skipped_off_cuda():
    tower = torch.nn.Module()
    tower.attn = torch.nn.Module()
    tower.attn.num_heads, tower.attn.head_dim = 16, 72
    assert kernel_choice.tower_geometries(tower) == ((16, 72),)
    assert kernel_choice.choose(tower, torch.bfloat16, torch.device("cpu")) == {}


def test_a_pooling_heads_multihead_attention_is_not_a_packed_geometry():
    """SigLIP's and SigLIP2's pooling head is an ``nn.MultiheadAttention`` (it has ``num_heads`` and ``head_dim``):
    torch's own dense kernel runs it, so it neither adds a geometry to measure nor counts as a packed call."""
    tower = torch.nn.Module()
    tower.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
    for layer in tower.layers:
        layer.num_heads, layer.head_dim = 16, 72
    tower.head = torch.nn.MultiheadAttention(64, 4, batch_first=True)  # 4 heads x 16
    tower.other_head = torch.nn.MultiheadAttention(16 * 72, 16, batch_first=True)  # the layers' own geometry
    assert (tower.head.num_heads, tower.head.head_dim) == (4, 16)
    assert kernel_choice.tower_geometries(tower) == ((16, 72),)
    assert kernel_choice.attention_calls(tower) == {(16, 72): 3}


def test_capture_hook_hands_given_crossovers_to_the_adapter_and_keeps_them(monkeypatch):
    """The runner's hook: the adapter chooses with the given cost model's crossovers, and the model keeps them."""
    from encgraph.capture import EncoderGraphRunner, RunMode
    from encgraph.models import wrap
    from tests.models import conftest as qwen

    adapter = wrap(qwen.qwen2_vl_tower())
    geometry = kernel_choice.tower_geometries(adapter._module)[0]
    c = Crossover("cpu", *geometry, "float32", (16, 64), (1.0, 2.0), (2.0, 1.0))
    monkeypatch.setattr(kernel_choice, "choose", lambda module, dtype, device, known: dict(known or {}))
    costs = CostModel.linear(["default"], graph_fixed_ms=1, graph_per_budget_ms=0.01, eager_fixed_ms=2,
                             eager_per_token_ms=0.01)
    costs = type(costs)(costs.graph_ms, costs.eager, kernels={c.key: c})
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, budgets=[64, 128], costs=costs, verify=False,
                                progress=False)
    info = runner.capture()
    assert info["kernels"] == {c.key: c.to_dict()}
    depth = adapter._module.config.depth  # every layer attends over whole images: that many calls per forward
    assert adapter.kernel_rows == {(geometry[0], geometry[1], torch.float32): c.dense_from(depth)}
    assert runner.costs.kernels == {c.key: c}


def dense_spy(monkeypatch) -> list[int]:
    """Records the rows of every dense per-sequence SDPA call of the host plan (CUDA's per-sequence kernel)."""
    rows: list[int] = []
    original = attention.dense_sequence

    def spy(q, k, v, scale):
        rows.append(int(q.shape[0]))
        return original(q, k, v, scale)

    monkeypatch.setattr(attention, "dense_sequence", spy)
    return rows


def test_a_scaled_model_keeps_its_crossovers():
    c = Crossover(H200, 16, 72, "bfloat16", (1024,), (0.1,), (0.2,))
    model = CostModel.linear(["default"], graph_fixed_ms=1, graph_per_budget_ms=0, eager_fixed_ms=2,
                             eager_per_token_ms=0)
    model = type(model)(model.graph_ms, model.eager, kernels={c.key: c})
    assert model.scaled(graph={"default": 2.0}).kernels == {c.key: c}


@given(rows=st.integers(kernel_choice.LENGTHS[0], 1 << 17))
def test_the_plan_is_timed_at_a_length_no_image_has(rows):
    """``probe_rows``: the dense kernel's first call is timed just under each length, at an odd length (never the
    rows of a 2 x 2-merged image), another at each call, so that a plan this thread already holds (the tower's own
    SDPA, a benchmark) cannot make a new length look free."""
    from encgraph.models.kernel_choice import probe_rows

    a, b = probe_rows(rows), probe_rows(rows)
    assert a != b and a % 2 == b % 2 == 1 and rows - 64 <= min(a, b) and max(a, b) < rows


def test_the_probe_slices_queries_keys_and_values_alike():
    """``probe_slices``: one probe length for the three tensors (cuDNN's SDPA does not check that keys and values
    agree: a length drawn per tensor failed the capture and then crashed the process on an H200)."""
    q, k, v = (torch.randn(300, 2, 8) for _ in "qkv")
    for _ in range(40):  # across the probe offsets' whole cycle
        got = kernel_choice.probe_slices([q, k, v], 300)
        assert len({t.shape for t in got}) == 1 and got[0].shape[0] % 2 == 1 and got[0].shape[0] < 300
        assert all(g.data_ptr() == t.data_ptr() for g, t in zip(got, (q, k, v)))


def test_a_hopper_without_flash_attention_4_says_once_what_it_leaves(monkeypatch, caplog):
    """Issue 56: a capture on a Hopper or Blackwell GPU without the flash-attn-4 wheel logs once the measured
    ratio it leaves and the install command; other GPUs, and a second device, say nothing more."""
    import logging

    from encgraph.models import fa4

    monkeypatch.setattr(fa4, "_AVAILABLE", {})
    monkeypatch.setattr(fa4, "_HINTED", [])
    monkeypatch.setattr(fa4, "_importable", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (9, 0), 1: (9, 0), 2: (8, 0)}[index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        assert not fa4.available(torch.device("cuda", 2))
        assert not caplog.records  # an Ampere GPU: FlashAttention-4 does not run there
        assert not fa4.available(torch.device("cuda", 0))
        assert not fa4.available(torch.device("cuda", 1))
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "NVIDIA H100" in message and "2.3x" in message and "pip install 'encgraph[fa4]'" in message
