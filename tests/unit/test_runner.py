"""The runner on the CPU (STATIC mode: the same plan, padded buffers and static forward as a replay)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import encgraph
from encgraph.capture import EncoderGraphRunner, RunMode
from encgraph.capture.runner import CAPTURE_FAILED
from encgraph.errors import ConfigError, ConfigTypeError, EncgraphError, InputError, InputTypeError
from encgraph.packing import EagerReason
from tests.toy_models import ToyAdapter, ToyInputs, ToyTower, random_inputs, reference


def one_path(**kw):
    torch.manual_seed(0)
    return ToyAdapter({"default": ToyTower()}, **kw)


def two_path(**kw):
    torch.manual_seed(1)
    return ToyAdapter({"global": ToyTower(), "local": ToyTower()}, empty=("local",), **kw)


def assert_same(out, ref, tol=1e-5):
    assert len(out) == len(ref)
    for i, (a, b) in enumerate(zip(out, ref)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"item {i}")


@pytest.mark.parametrize("make", [one_path, two_path])
def test_random_mixes_equal_eager_per_item(make):
    adapter = make(min_budget=16, max_budget=128)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    gen = np.random.default_rng(0)
    for _ in range(25):
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 24)), max_len=70, max_frames=3)
        assert_same(runner(inputs), reference(adapter, inputs))
    stats = runner.stats
    assert stats["graph_items"] + stats["eager_items"] == stats["items"]
    assert stats["eager_items"] > 0  # items over 128 rows exist at max_len 70 x 3 frames
    assert stats["graph_items"] > 0


def test_partial_eager_only_on_overflowing_path():
    adapter = two_path(min_budget=16, max_budget=64)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    # Item 0: global fits, local overflows (100 rows > 64). Item 1: both fit.
    seqs = {"global": ((10,), (12,)), "local": ((50, 50), (20,))}
    rows = {p: torch.randn(sum(map(sum, s)), 6) for p, s in seqs.items()}
    inputs = ToyInputs(rows, seqs)
    plan = runner.plan(inputs)
    lone = [b for b in plan.batches if b.budgets["local"] is None]
    assert len(lone) == 1 and lone[0].budgets["global"] is not None
    assert lone[0].eager == {"local": EagerReason.TOKENS}
    assert_same(runner(inputs), reference(adapter, inputs))
    paths = runner.stats["paths"]
    assert paths["local"]["eager_items"] == 1 and paths["global"]["eager_items"] == 0


def test_frames_over_limit_run_eagerly_alone():
    adapter = one_path(min_budget=16, max_budget=256)
    runner = EncoderGraphRunner(adapter, max_items=4, max_frames=4, mode=RunMode.STATIC)
    seqs = {"default": ((3, 3, 3, 3, 3, 3), (5,), (7, 2))}
    inputs = ToyInputs({"default": torch.randn(32, 6)}, seqs)
    assert_same(runner(inputs), reference(adapter, inputs))
    assert runner.stats["eager_reasons"] == {EagerReason.FRAMES.value: 1}


def test_empty_path_items_have_only_global_rows():
    adapter = two_path()
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    seqs = {"global": ((8,), (9,)), "local": ((), ())}
    inputs = ToyInputs({"global": torch.randn(17, 6), "local": torch.randn(0, 6)}, seqs)
    out = runner(inputs)
    assert [o.shape[0] for o in out] == [8, 9]
    assert runner.stats["paths"]["local"]["replays"] == {}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 60)), min_size=1, max_size=30), st.integers(1, 8))
def test_stats_never_lose_or_double_count(sizes, max_items):
    adapter = one_path(min_budget=16, max_budget=128)
    runner = EncoderGraphRunner(adapter, max_items=max_items, mode=RunMode.STATIC)
    seqs = {"default": tuple((n,) * f for f, n in sizes)}
    inputs = ToyInputs({"default": torch.randn(sum(f * n for f, n in sizes), 6)}, seqs)
    out = runner(inputs)
    s = runner.stats
    assert len(out) == len(sizes) == s["items"]
    assert s["graph_items"] + s["eager_items"] == s["items"]
    p = s["paths"]["default"]
    assert p["real_tokens"] == sum(f * n for f, n in sizes)
    assert sum(p["replays"].values()) + p["eager_runs"] == len(runner.plan(inputs).batches)


def test_eager_mode_and_static_mode_agree():
    adapter = two_path(min_budget=16, max_budget=128)
    gen = np.random.default_rng(3)
    inputs = random_inputs(gen, adapter, 12)
    static = EncoderGraphRunner(adapter, mode=RunMode.STATIC)(inputs)
    eager_runner = EncoderGraphRunner(adapter, mode=RunMode.EAGER)
    assert_same(eager_runner(inputs), static)
    assert eager_runner.stats["graph_items"] == 0


def test_concurrent_calls_are_serialised():
    adapter = one_path(min_budget=16, max_budget=128)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    gen = np.random.default_rng(4)
    batches = [random_inputs(gen, adapter, 10) for _ in range(6)]
    refs = [reference(adapter, b) for b in batches]
    results: dict[int, list] = {}

    def work(i: int) -> None:
        results[i] = runner(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        assert_same(results[i], refs[i])
    assert runner.stats["calls"] == 6


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"budgets": [0, 16]}, ConfigError, "may be empty"),
        ({"budgets": {"nope": [16]}}, ConfigError, "nope"),
        ({"mode": "graph"}, ConfigTypeError, "RunMode"),
        ({"mode": RunMode.GRAPH}, ConfigError, "CUDA"),
        ({"device": "cuda"}, ConfigError, "(?i)cuda"),  # no CUDA here, or a tower on the CPU
        ({"device": 3.5}, ConfigTypeError, "device"),
        ({"lazy": 1}, ConfigTypeError, "lazy"),
        ({"warmup": 0}, ConfigError, "warmup"),
        ({"max_items": 64}, ConfigError, "max_items"),
    ],
)
def test_bad_runner_arguments(kwargs, error, words):
    with pytest.raises(error, match=words) as info:
        EncoderGraphRunner(one_path(), **{"mode": RunMode.STATIC, **kwargs})
    assert isinstance(info.value, EncgraphError)


def test_not_an_adapter():
    with pytest.raises(ConfigTypeError, match="EncoderAdapter"):
        EncoderGraphRunner(object(), mode=RunMode.STATIC)


def test_bad_inputs_raise_clear_errors():
    adapter = one_path()
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    with pytest.raises(InputError, match="empty"):
        runner(ToyInputs({"default": torch.randn(0, 6)}, {"default": ()}))
    with pytest.raises(InputTypeError):
        runner(ToyInputs({"default": torch.randn(4, 6, dtype=torch.float64)}, {"default": ((4,),)}))
    with pytest.raises(InputError):
        runner(ToyInputs({"default": torch.randn(5, 6)}, {"default": ((4,),)}))
    with pytest.raises(InputTypeError):
        runner([torch.randn(4, 6)])
    # Nothing was half-done: the runner still answers correctly afterwards.
    inputs = ToyInputs({"default": torch.randn(4, 6)}, {"default": ((4,),)})
    assert_same(runner(inputs), reference(adapter, inputs))
    assert runner.stats["items"] == 1


def test_failed_budget_is_dropped_from_planning():
    adapter = one_path(min_budget=16, max_budget=128)
    runner = EncoderGraphRunner(adapter, budgets=(16, 32, 64, 128), mode=RunMode.STATIC)
    runner.failed["default"][32] = "simulated"
    assert 32 not in runner.planning_ladders["default"]
    inputs = ToyInputs({"default": torch.randn(20, 6)}, {"default": ((20,),)})
    assert runner.plan(inputs).batches[0].budgets == {"default": 64}
    assert CAPTURE_FAILED  # the reason string used in GRAPH mode when every capture of a path failed


def test_generic_graphed_module_any_batch_size():
    torch.manual_seed(0)
    # Frozen, as an inference module: with parameters that require grad a plain call asks for autograd and is
    # answered by the module's own forward (tests/models/test_dropin.py).
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    net.requires_grad_(False)
    fast = encgraph.graphed(net, budgets=[1, 2, 4, 8], mode=RunMode.STATIC)
    for b in (1, 3, 8, 9, 21):
        x = torch.randn(b, 8)
        torch.testing.assert_close(fast(x), encgraph.graphs(net).original_forward(x), rtol=1e-6, atol=1e-6)
    # The first call of the shape is the module's own; the graphs answer the rest.
    assert encgraph.graphs(fast).stats["items"] == 3 + 8 + 9 + 21
    assert encgraph.graphs(fast).runner.limits.max_items == 8


def test_measure_costs_on_an_eager_runner_names_the_mode():
    # The CPU default (EAGER) has no padded buffers to time: a clear error, not a KeyError from inside.
    adapter = one_path(min_budget=16, max_budget=256)
    runner = EncoderGraphRunner(adapter, budgets=(16, 32))
    assert runner.mode is RunMode.EAGER
    samples = [random_inputs(np.random.default_rng(0), adapter, n, max_len=20, max_frames=1) for n in (1, 2)]
    with pytest.raises(ConfigError, match=r"measure_costs: .*mode=RunMode.EAGER; .*mode=RunMode.STATIC"):
        runner.measure_costs(samples)


def test_measured_costs_tuning_and_recapture():
    from encgraph.packing import CostModel

    adapter = one_path(min_budget=16, max_budget=256)
    runner = EncoderGraphRunner(adapter, record=50, budgets=(16, 32, 64, 128, 256), mode=RunMode.STATIC)
    gen = np.random.default_rng(5)
    samples = [random_inputs(gen, adapter, n, max_len=40, max_frames=1) for n in (1, 2, 4, 8)]
    costs = runner.measure_costs(samples, repeats=1)
    assert isinstance(costs, CostModel) and runner.costs is costs
    assert set(costs.graph_ms["default"]) == {16, 32, 64, 128, 256}
    for _ in range(10):  # cost-aware plans still give eager-equal outputs
        inputs = random_inputs(gen, adapter, int(gen.integers(1, 12)), max_len=60, max_frames=2)
        assert_same(runner(inputs), reference(adapter, inputs))
    assert len(runner.observed) == 10
    tuned = runner.tune(max_budgets=3)
    assert len([b for b in tuned.ladders["default"] if b]) <= 3
    runner.recapture(**tuned.to_runner_options())
    assert runner.ladders["default"] == tuned.ladders["default"] and runner.costs is None
    inputs = random_inputs(gen, adapter, 7, max_len=60, max_frames=2)
    assert_same(runner(inputs), reference(adapter, inputs))


def test_tune_without_records_raises():
    with pytest.raises(ConfigError, match="record"):
        EncoderGraphRunner(one_path(), mode=RunMode.STATIC).tune(max_budgets=2)


def test_process_group_option_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        adapter = two_path(min_budget=16, max_budget=128)
        runner = EncoderGraphRunner(adapter, process_group=dist.group.WORLD)
        inputs = random_inputs(np.random.default_rng(6), adapter, 9)
        assert_same(runner(inputs), reference(adapter, inputs))
        assert runner.global_stats()["items"] == 9
        assert runner.stats["data_parallel"]["items"] == 9
    finally:
        dist.destroy_process_group()


class _SharedOutputToy(ToyAdapter):
    """Outputs written into one persistent buffer per path, as replays write a graph's output buffer, and an
    ``assemble`` that copies each item (``assemble_copies``): the runner hands it views, which the next sub-batch
    overwrites, so each sub-batch must be cut into its items before the next one runs."""

    assemble_copies = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shared: dict[str, torch.Tensor] = {}

    def forward_static(self, path, buffers, budget):
        out = super().forward_static(path, buffers, budget)["out"]
        held = self.shared.get(path)
        if held is None or held.shape[0] < out.shape[0]:
            held = self.shared[path] = torch.empty((max(out.shape[0], 1024), *out.shape[1:]), dtype=out.dtype)
        held[: out.shape[0]].copy_(out)
        return {"out": held[: out.shape[0]]}

    def assemble(self, parts):
        return super().assemble(parts).clone()


def test_each_sub_batch_is_cut_into_items_before_the_next_one_runs():
    torch.manual_seed(0)
    adapter = _SharedOutputToy({"default": ToyTower()}, min_budget=16, max_budget=64)
    inputs = random_inputs(np.random.default_rng(5), adapter, 9)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    assert len(runner.plan(inputs).batches) > 1
    assert runner.call_rows(inputs) is None  # its outputs are views until its own copy: the per-item path
    assert_same(runner(inputs), reference(adapter, inputs))


def test_call_rows_equals_the_per_item_results_in_the_callers_order(monkeypatch):
    """A batch ladder's call as rows: several sub-batches joined, and a plan that reorders the items put back in
    the caller's order."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    net.requires_grad_(False)
    fast = encgraph.graphed(net, budgets=[1, 2, 4], mode=RunMode.STATIC)
    x = torch.randn(7, 8)
    fast(x)  # first sight: the module's own forward
    fast(x)  # the second builds the shape's runner
    runner = encgraph.graphs(fast).runner
    split = runner.adapter.inputs_from_call(x)
    rows = runner.call_rows(split)
    torch.testing.assert_close(rows["out0"], torch.cat([r["out0"] for r in runner(split)]), rtol=0, atol=0)
    assert len(runner.plan(split).batches) > 1
    plan = runner._pack
    monkeypatch.setattr(runner, "_pack", lambda specs: _reversed(plan(specs)))
    own = encgraph.graphs(fast).original_forward  # fast is net, hooked in place
    torch.testing.assert_close(runner.call_rows(split)["out0"], own(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast(x), own(x), rtol=1e-6, atol=1e-6)


def _reversed(plan):
    """The same plan with every batch's items in reverse order and the batches reversed."""
    import attrs

    batches = tuple(attrs.evolve(b, items=tuple(reversed(b.items))) for b in reversed(plan.batches))
    return attrs.evolve(plan, batches=batches)


@pytest.mark.parametrize("eager_ms", [0.0, 0.3, 100.0], ids=["all eager", "mixed", "all replayed"])
def test_call_rows_with_eager_sub_batches_equals_the_module(eager_ms):
    """Sub-batches the cost model sends eagerly (the eager forward's fresh tensors) and replayed ones (the static
    forward's outputs) joined in one call's rows, in order, equal the module; the counters count every item once."""
    from encgraph.packing import CostModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    net.requires_grad_(False)
    fast = encgraph.graphed(net, budgets=[1, 2, 4], mode=RunMode.STATIC)
    x = torch.randn(11, 8)
    fast(x), fast(x)
    runner = encgraph.graphs(fast).runner
    runner.costs = CostModel.linear(["default"], graph_fixed_ms=0.5, graph_per_budget_ms=0.01,
                                    eager_fixed_ms=eager_ms, eager_per_token_ms=0.1 if eager_ms else 0.0)
    before = dict(runner.stats)
    own = encgraph.graphs(fast).original_forward  # fast is net, hooked in place
    for n in (1, 3, 11):
        torch.testing.assert_close(fast(x[:n]), own(x[:n]), rtol=1e-6, atol=1e-6)
    gained = {k: runner.stats[k] - before[k] for k in ("items", "eager_items", "graph_items")}
    assert gained["items"] == 15 and gained["eager_items"] + gained["graph_items"] == 15, gained
    assert {0.0: gained["graph_items"] == 0, 0.3: 0 < gained["eager_items"] < 15,
            100.0: gained["eager_items"] == 0}[eager_ms], gained
