"""The eager attention kernel choice on the CPU: the crossover data (encgraph.packing.kernels) and its place in the
cost model's JSON, the host plan of encgraph.models.attention (which sequences run dense, which runs of short ones
go to one varlen call, with a stand-in varlen kernel: the CPU has none), and the runner's capture hook. The timing
itself runs on CUDA only (tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import logging

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError
from encgraph.models import attention, kernel_choice, sequence_bounds
from encgraph.packing import CostModel
from encgraph.packing.kernels import Crossover, DenseRule, crossover_rows, kernel_table
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
    # FA4 faster than flash and than dense: every sequence stays varlen (no plans, no buckets), in graphs too.
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


def test_fa4_registry_and_bounds_off_a_hopper():
    from encgraph.models import fa4

    assert not fa4.available(torch.device("cpu"))
    probe = torch.empty(4, 16, 72)
    assert fa4.kernel_of(probe) == "flash"
    with pytest.raises(ConfigError, match=r"fa4.use\(kernel\): expected one of"):
        fa4.use(16, 72, torch.bfloat16, torch.device("cpu"), "fa3")
    with pytest.raises(ConfigError, match=r"fa4.use\(device\): expected a CUDA device"):
        fa4.use(16, 72, torch.bfloat16, torch.device("cpu"), "fa4")
    # Every bound is a power of two, never below the longest sequence: the kernels compiled at capture serve all.
    for n in (1, 127, 128, 129, 1000, 4352, 16384, 16385, 65536):
        b = fa4.bound(n)
        assert b >= max(n, 128) and b & (b - 1) == 0 and b < 2 * max(n, 128)


@pytest.mark.parametrize(("entry", "match"), [
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [2, 1], "varlen_ms": [1, 1],
      "dense_ms": [1, 1]}, "ascending"),
    ({"device": H200, "heads": 16, "head_dim": 72, "dtype": "bfloat16", "lengths": [1, 2], "varlen_ms": [1],
      "dense_ms": [1, 1]}, "one varlen and one dense time per length"),
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
        assert attention._host_plan(cu, q) == (tuple(bounds), (0, 0, 20, 0, 0, 0, 20))
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
        assert attention._host_plan(cu, q) == ((0, 2, 10), (0, 8))
        assert attention._host_plan(cu, q) == ((0, 2, 10), (0, 8))
    assert sum("no kernel crossover measured for 3 heads x 8" in r.message for r in caplog.records) == 1


def test_a_new_length_rents_varlen_until_the_plan_pays_then_runs_dense(fake_varlen, monkeypatch):
    """Rent-or-buy in the host plan: a long sequence at a length new to the thread runs in the varlen call until
    the savings it missed reach the dense kernel's plan cost; from then on it runs dense; the outputs are the same
    attention either way. A long length that saves more than the plan in one forward runs dense at once."""
    monkeypatch.setattr(sequence_bounds, "LEDGER", type(sequence_bounds.LEDGER)())
    c = Crossover("cpu", 3, 8, "float32", (10, 40), (1.0, 16.0), (0.5, 8.0), dense_first_ms=(30.5, 38.0))
    table = {(3, 8, torch.float32): DenseRule(c.min_rows, c, calls=2)}  # plan 30 ms; 20 rows save 2 ms a call
    bounds = [0, 3, 23]
    q, k, v = qkv(23)
    cu = torch.tensor(bounds, dtype=torch.int32)
    dense = dense_spy(monkeypatch)
    outs = []
    with attention.host_bounds([(cu, bounds)], min_rows=table):
        for _ in range(20):
            outs.append(packed_attention_default(q, k, v, cu))
    rented = 20 - len(dense)
    assert dense == [20] * len(dense) and 0 < rented < 20
    gain = table[(3, 8, torch.float32)].gain_ms(20)  # about 2 ms a call
    # rented while the rent paid plus one forward's saving (2 calls) stayed under the 30 ms plan
    assert (rented - 1) * gain + 2 * gain < 30 <= rented * gain + 2 * gain + 1e-9
    # rented: both sequences in one varlen call; bought: the short one in a varlen call of its own
    assert [len(c[1]) for c in fake_varlen] == [3] * rented + [2] * len(dense)
    want = reference(q, k, v, [3, 20])
    for got in outs:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    long_bounds = [0, 80]
    q, k, v = qkv(80)
    cu = torch.tensor(long_bounds, dtype=torch.int32)
    dense.clear()
    with attention.host_bounds([(cu, long_bounds)], min_rows=table):
        packed_attention_default(q, k, v, cu)
    assert dense == [80]  # saves 32 ms a call: over the 30 ms plan at first sight


def test_a_rented_length_stands_in_padded_at_its_held_bucket(fake_varlen, monkeypatch):
    """While a long sequence's own length rents, it runs padded to its bucket where this thread holds that
    bucket's plan and the eager padded call beats varlen there (times as an H200's, rows scaled down); else on
    varlen. The host plan passes the bucket as the dense call's length; the attention is the same."""
    ledger = type(sequence_bounds.LEDGER)()
    monkeypatch.setattr(sequence_bounds, "LEDGER", ledger)
    c = Crossover("cpu", 3, 8, "float32", (16, 32, 64), (0.353, 1.357, 5.241), (0.249, 0.770, 3.062),
                  dense_first_ms=(60.0, 60.0, 60.0), padded_ms=(0.761, 1.088, 3.476))
    assert (c.min_rows, c.stand_in_from, c.bucket_from) == (16, 32, 64)
    table = {(3, 8, torch.float32): DenseRule(c.min_rows, c, calls=2)}
    bounds = [0, 3, 39, 57]  # 36 rows (bucket 40), 18 (under stand_in_from: varlen while it rents)
    q, k, v = qkv(57)
    cu = torch.tensor(bounds, dtype=torch.int32)
    runs: list[tuple[int, int]] = []
    dense_spy(monkeypatch, runs)
    with attention.host_bounds([(cu, bounds)], min_rows=table):
        assert attention._host_plan(cu, q) is None  # nothing held: both rent varlen
        ledger.own(sequence_bounds.ledger_key(3, 8, torch.float32, q.device), 40)
        assert attention._host_plan(cu, q) == (tuple(bounds), (0, 40, 0))
        got = packed_attention_default(q, k, v, cu)
    assert runs == [(36, 40)] and ledger.stats()["stand_in_calls"] == 2
    torch.testing.assert_close(got, reference(q, k, v, [3, 36, 18]), rtol=1e-5, atol=1e-5)


def test_measurement_is_skipped_off_cuda():
    tower = torch.nn.Module()
    tower.attn = torch.nn.Module()
    tower.attn.num_heads, tower.attn.head_dim = 16, 72
    assert kernel_choice.tower_geometries(tower) == ((16, 72),)
    assert kernel_choice.choose(tower, torch.bfloat16, torch.device("cpu")) == {}


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
    assert adapter.kernel_rows == {(geometry[0], geometry[1], torch.float32): DenseRule(64, c, calls=depth)}
    assert runner.costs.kernels == {c.key: c}


def dense_spy(monkeypatch, runs: list[tuple[int, int]] | None = None) -> list[int]:
    """Records the rows of every dense per-sequence SDPA call of the host plan (CUDA's per-sequence kernel), and in
    ``runs`` (where given) each call's ``(rows, rows it ran at)``: its bucket where padded."""
    rows: list[int] = []
    original = attention.padded_dense

    def spy(q, k, v, scale, padded):
        rows.append(int(q.shape[0]))
        if runs is not None:
            runs.append((int(q.shape[0]), int(padded)))
        return original(q, k, v, scale, padded)

    monkeypatch.setattr(attention, "padded_dense", spy)
    return rows


def test_a_scaled_model_keeps_its_crossovers():
    c = Crossover(H200, 16, 72, "bfloat16", (1024,), (0.1,), (0.2,))
    model = CostModel.linear(["default"], graph_fixed_ms=1, graph_per_budget_ms=0, eager_fixed_ms=2,
                             eager_per_token_ms=0)
    model = type(model)(model.graph_ms, model.eager, kernels={c.key: c})
    assert model.scaled(graph={"default": 2.0}).kernels == {c.key: c}


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("padded_ms", [(), (0.8, 10.0)])
def test_the_adapters_surcharge_is_what_its_eager_forward_then_pays(fake_varlen, monkeypatch, padded_ms, deferred):
    """The runner decides eager-or-replay with the adapter's ``eager_surcharge_ms`` before the forward runs: over
    a stream of calls (new lengths renting, then bought; an image and a video's frames), it must be exactly what
    the forward's attention calls then lose to rent, per frame sequence, and reading it changes nothing. A
    replay in place of the forward (``rent_replayed``) pays the same rent. Off CUDA nothing rents: 0. With padded
    times the 36-row frames stand in at their bucket (40 rows, held as capture would build it) while renting.
    ``deferred``: each forward runs in a deferring block, as the runner's calls do: a length bought falls due and
    rents to the forward's end, the surcharge counting those calls too, and is built (once) as the block ends."""
    import contextlib

    import numpy as np

    from encgraph.models import wrap
    from encgraph.models.qwen_vl import QwenVisionInputs
    from encgraph.packing.kernels import PlanLedger
    from tests.models import conftest as qwen

    ledger = PlanLedger()
    monkeypatch.setattr(sequence_bounds, "LEDGER", ledger)
    torch.manual_seed(0)
    adapter = wrap(qwen.qwen2_vl_tower())
    grid = np.array([[1, 8, 8], [1, 4, 6], [2, 6, 6], [1, 2, 2]], dtype=np.int64)  # frames of 64, 24, 36, 36, 4 rows
    inputs = QwenVisionInputs(qwen.random_pixels(grid), grid)
    specs = adapter.item_specs(inputs)
    heads, head_dim = kernel_choice.tower_geometries(adapter._module)[0]
    c = Crossover("cpu", heads, head_dim, "float32", (16, 64), (1.0, 16.0), (0.5, 8.0), dense_first_ms=(30.5, 38.0),
                  padded_ms=padded_ms)
    rule = DenseRule(c.min_rows, c, calls=adapter._module.config.depth)
    assert [rule.stand_in_rows(n) for n in (64, 24, 36, 4)] == ([None, None, 40, None] if padded_ms else [None] * 4)
    adapter.kernel_rows = {(heads, head_dim, torch.float32): rule}
    key = sequence_bounds.ledger_key(heads, head_dim, torch.float32, torch.device("cpu"))

    def cleared(ledger):  # a thread that has bought no length, holding the buckets capture builds
        ledger.clear()
        if padded_ms:
            ledger.own(key, 40)
        return ledger

    assert adapter.eager_surcharge_ms("default", specs) == 0.0  # the CPU: no varlen kernel, nothing rents
    monkeypatch.setattr(sequence_bounds, "_rents", lambda device: True)  # the stand-in varlen kernel rents

    paid: list[float] = []
    run_length = ledger.run_length

    built: list[int] = []

    due_before: set = set()  # lengths due when the forward began: their rent counts, a purchase's after it not

    def spy(key, rows, r, builder=None):
        assert builder is not None  # an eager forward's host plan can always defer its purchase
        out = run_length(key, rows, r, lambda: (lambda n: (built.append(n), builder()(n))[0]))
        fallen = (entry := (key, r.run_rows(rows))) in ledger._state()[2] and entry not in due_before
        if rows >= r.min_rows and out not in (r.run_rows(rows), rows) and not fallen:  # rented: varlen, standing in
            paid.append(r.gain_ms(rows, stand_in=out > 0))
        return out

    def block():
        return ledger.deferring() if deferred else contextlib.nullcontext()

    monkeypatch.setattr(ledger, "run_length", spy)
    want = adapter.forward_eager("default", inputs)["pooler_output"]
    cleared(ledger)
    for call in range(6):
        with block():
            predicted = adapter.eager_surcharge_ms("default", specs)
            assert adapter.eager_surcharge_ms("default", specs) == predicted  # reading changed nothing
            paid.clear()
            due_before = set(ledger._state()[2])
            got = adapter.forward_eager("default", inputs)["pooler_output"]
        assert predicted == pytest.approx(sum(paid), abs=1e-9), call
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ledger.bought(key, 64) and ledger.bought(key, 36) and ledger.stats()["rented_calls"] > 0
    # deferred: each length bought was built once, after its forward (the 64-row frame's and the 36-row ones')
    assert sorted(built) == ([36, 64] if deferred else []) and ledger.stats()["deferred"] == len(built)
    assert ledger.due() == 0
    assert (ledger.stats()["stand_in_calls"] > 0) == bool(padded_ms)
    cleared(ledger)  # a replay in place of the first forward pays what that forward would have lost
    first = adapter.eager_surcharge_ms("default", specs)
    adapter.rent_replayed("default", specs)
    paid.clear()
    adapter.forward_eager("default", inputs)
    assert first > 0 and adapter.eager_surcharge_ms("default", specs) < first
    held = [("k", 40)] if padded_ms else []
    assert sum(paid) == pytest.approx(ledger_after_one_forward(c, rule, [64, 24, 36, 36, 4], held), abs=1e-9)


def ledger_after_one_forward(c, rule, rows, held=()):
    """What a second forward over ``rows`` loses to rent on a fresh ledger holding the run lengths ``held``
    (its first forward already rented)."""
    from encgraph.packing.kernels import PlanLedger

    ledger = PlanLedger()
    for entry in held:
        ledger.own(*entry)
    for _ in range(rule.calls):
        for n in rows:
            ledger.dense("k", n, rule)
    return ledger.surcharge_ms("k", rows, rule)


def _bucketed(bucket_from_ok: tuple[bool, ...]) -> DenseRule:
    lengths, dense = (4096, 8192, 16384), (0.3, 1.1, 4.0)
    padded = tuple(d * (1.1 if ok else 2.0) for d, ok in zip(dense, bucket_from_ok))
    c = Crossover(H200, 16, 72, "bfloat16", lengths, tuple(1.6 * d for d in dense), dense, padded_ms=padded)
    return DenseRule(c.min_rows, c, 27)


def test_warm_lengths_are_the_bucket_lengths_from_bucket_from():
    from encgraph.packing.kernels import bucket_rows

    rule = _bucketed((False, True, True))
    assert rule.crossover.bucket_from == 8192
    got = kernel_choice.warm_lengths(rule)
    assert got[0] == 8192 and got[-1] == 65536 and len(got) == 3 * 16 + 1  # 16 per octave, three octaves, and 65,536
    assert all(bucket_rows(n) == n for n in got) and got == sorted(set(got))
    # every length a sequence in the range runs at is among them
    assert {bucket_rows(n) for n in range(8192, 65537, 97)} <= set(got)
    assert kernel_choice.warm_lengths(rule, (10_000, 12_000)) == [10240, 10752, 11264, 11776]
    assert kernel_choice.warm_lengths(_bucketed((True, True, True)), (1, 8192))[0] == 4096  # from bucket_from
    # over the slack at the longest length: from where the ratio falls within it (2.0 at 16,384: 81,920 rows)
    assert kernel_choice.warm_lengths(_bucketed((True, True, False))) == []
    assert kernel_choice.warm_lengths(DenseRule(4096)) == []  # nothing measured


def test_calls_between_segments_stand_in_from_the_padded_calls_device_time():
    """A replayed rule (a piecewise replay's split calls) runs a long sequence at its own length, standing in at
    its bucket while that length rents from where the padded call's device time beats varlen, and buckets (for
    good) only where the padded call stays within the slack of the exact one, as an eager forward's rule does
    with the queued times; it is priced at its steady kernel, the exact one. The cost model's JSON keeps the
    replay times, and a file without them loads with no replay buckets or stand-ins."""
    lengths, dense = (4096, 8192, 16384), (0.25, 0.8, 3.1)
    queued = (0.5, 1.1, 3.5)  # host-bound: buckets from 16,384 only, stands in from 8,192
    replay = (0.33, 0.99, 3.5)  # the device alone: 1.1-1.3x the exact kernel, under varlen from 4,096
    c = Crossover(H200, 16, 72, "bfloat16", lengths, (0.36, 1.36, 5.3), dense, padded_ms=queued,
                  padded_replay_ms=replay, dense_first_ms=(40.0, 40.0, 40.0))
    assert (c.min_rows, c.bucket_from, c.replay_bucket_from) == (4096, 16384, 16384)
    assert (c.stand_in_from, c.replay_stand_in_from) == (8192, 4096)
    eager, split = DenseRule(c.min_rows, c, 27), DenseRule(c.min_rows, c, 27, replayed=True)
    assert eager.run_rows(4999) == 4999 and split.run_rows(4999) == 4999 and split.run_rows(17000) == 17408
    assert eager.stand_in_rows(4999) is None and split.stand_in_rows(4999) == 5120
    assert eager.stand_in_rows(9000) == split.stand_in_rows(9000) == 9216
    assert split.bucket_from == eager.bucket_from == 16384
    # steady: the exact kernel, against varlen at the sequence's own rows; standing in: the padded call's device
    # time at its bucket
    from encgraph.packing.crossover import loglog_at

    assert split.gain_ms(4999) == pytest.approx(c.ms_at(4999)[0] - c.ms_at(4999)[1]) == eager.gain_ms(4999)
    want = loglog_at(lengths, replay, 5120) - c.ms_at(4999)[1]
    assert split.gain_ms(4999, stand_in=True) == pytest.approx(want) and 0 < want < split.gain_ms(4999)
    got = kernel_choice.warm_lengths(split, (4096, 16384))
    assert got[0] == 4096 and got[-1] == 16384 and len(got) == 2 * 16 + 1
    assert eager.warm_from == 8192 and split.warm_from == 4096
    got = kernel_choice.warm_lengths(eager, (4096, 16384))
    assert got[0] == 8192 and got[-1] == 16384 and len(got) == 16 + 1
    again = Crossover.from_dict(c.to_dict())
    assert again == c and again.to_dict()["replay_stand_in_from"] == 4096 and again.to_dict()["stand_in_from"] == 8192
    old = {k: v for k, v in c.to_dict().items() if k != "padded_replay_ms"}  # a cost model of before
    assert (Crossover.from_dict(old).replay_bucket_from, Crossover.from_dict(old).replay_stand_in_from) == (None, None)
    assert DenseRule(c.min_rows, Crossover.from_dict(old), replayed=True).stand_in_rows(4999) is None
    slow = attrs.evolve(c, padded_replay_ms=(0.4, 0.99, 3.5))  # over varlen at 4,096: from 8,192
    assert slow.replay_stand_in_from == 8192 and DenseRule(4096, slow, replayed=True).stand_in_rows(4999) is None
    with pytest.raises(ConfigError, match="padded_replay_ms"):
        Crossover(H200, 16, 72, "bfloat16", lengths, (1, 2, 3), dense, padded_replay_ms=(1.0,))


def test_replayed_lengths_are_kept_apart_in_the_ledger():
    """The split calls read contiguous static tensors, an eager forward the tower's own views: cuDNN builds each
    its own plan, so a length bought by one is not bought for the other."""
    cpu = torch.device("cpu")
    eager = sequence_bounds.ledger_key(16, 72, torch.bfloat16, cpu)
    split = sequence_bounds.ledger_key(16, 72, torch.bfloat16, cpu, replayed=True)
    assert eager != split and split[:4] == eager


def test_warm_plans_builds_nothing_off_cuda():
    rule = _bucketed((False, True, True))
    assert kernel_choice.warm_plans({(16, 72, torch.bfloat16): rule}, torch.device("cpu")) == {
        "lengths": 0, "seconds": 0.0}


@given(rows=st.integers(kernel_choice.LENGTHS[0], 1 << 17))
def test_the_plan_is_timed_at_a_length_no_image_or_bucket_has(rows):
    """``probe_rows``: the dense kernel's first call is timed just under each length, at an odd length (never the
    rows of a 2 x 2-merged image nor a bucket), another at each call, so that a plan this thread already holds (the
    tower's own SDPA, a benchmark) cannot make a new length look free."""
    from encgraph.models.kernel_choice import probe_rows
    from encgraph.packing.kernels import bucket_rows

    a, b = probe_rows(rows), probe_rows(rows)
    assert a != b and a % 2 == b % 2 == 1 and rows - 64 <= min(a, b) and max(a, b) < rows
    assert bucket_rows(a) != a


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
