"""The defaults on a GPU (issues 13 and 14): ``EncoderGraphRunner(adapter)`` / ``graphed(tower)`` with no options
compile the static forward once for every budget of the dense ladder, build a cost model at capture that the
first call plans with, keep the pool near the largest graph, and stay a drop-in in every grad mode with one
item's NaN never reaching another. Qwen2.5-VL-7B geometry at depth 4 (random bf16 weights).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import encgraph
from encgraph.models.own_forward import own_forward
from tests.toy_models import SequenceFirst
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import wrap
from encgraph.packing import CostModel, pack
from tests.gpu.test_qwen_gpu import HF_RTOL, hf_per_item, qwen2_5_vl, random_mix, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tower_pair(depth=4):
    torch.manual_seed(0)
    tower = qwen2_5_vl(depth=depth)[0].cuda().eval()
    return tower, copy.deepcopy(tower)


def test_defaults_compile_once_measure_costs_and_share_the_pool():
    tower, reference = tower_pair()
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter)  # no options at all
    info = runner.capture()
    ladder = runner.ladders["default"]
    compiled, check = info["compile"], info["selfcheck"]
    print(
        f"\ndefaults: ladder {ladder}; {info['graphs']} graphs in {info['seconds']:.1f} s (first compile "
        f"{compiled.get('first_compile_seconds')} s, dynamo {compiled.get('dynamo')}, cache {compiled.get('cache_dir')}); "
        f"self-check + cost model {check['seconds']} s, worst self-check error {max(check['checked']['default'].values()):.2e}; "
        f"pool {info['pool_bytes'] / 2**20:.0f} MiB = {info['pool_bytes'] / max(info['largest_graph_bytes'], 1):.2f}x "
        f"the largest graph; outputs {info['output_bytes'] / 2**20:.0f} MiB"
    )
    print(f"self-check phases (s): {check['phase_seconds']}")
    assert len(ladder) >= 15 and info["graphs"] == len(ladder) and not info["failed"]
    assert compiled["status"] == "compiled" and compiled["regions"]["count"] == 4
    assert compiled["dynamo"]["unique_graphs"] <= 2 and compiled["dynamo"]["graph_breaks"] == 0
    assert info["pool_bytes"] <= 1.1 * info["largest_graph_bytes"]
    assert check["seconds"] < 3.0 + 0.1 * len(ladder)  # extra capture time for the cost model and the check
    assert isinstance(runner.costs, CostModel) and info["costs"].startswith("cost-aware")
    # The attention term: replays split into equal sequences, at a quarter of the largest budget or above and at
    # the largest (the power fitted from the two).
    term = check["attention"]["default"]
    print(f"attention term: {term}")
    assert "coef" in term and 1.5 <= term["power"] <= 2.0, term
    # Splitting the full-attention bounds never makes a replay dearer (timing noise aside; windows untouched).
    assert term["split_ms"] <= term["full_ms"] * 1.25 and 4 * term["budget"] >= max(ladder)
    assert runner.costs.attention.get("default", 0.0) == term["coef"]
    assert runner.costs.power("default") == term["power"]
    # The first call is planned with that model; costs=False keeps the greedy planner.
    pixels, grid = random_mix(np.random.default_rng(7), adapter.channels, 12, big=True)
    inputs = adapter.inputs(pixels, grid)
    specs = adapter.item_specs(inputs)
    lim = runner.limits
    planned = runner.plan(inputs)
    assert planned == pack(specs, runner.planning_ladders, max_items=lim.max_items, max_frames=lim.max_frames,
                           costs=runner.costs)
    greedy = EncoderGraphRunner(adapter, costs=False, compile=False)
    assert greedy.costs is None
    assert greedy.plan(inputs) == pack(specs, greedy.planning_ladders, max_items=greedy.limits.max_items,
                                       max_frames=greedy.limits.max_frames)
    # Replays of the compiled graphs vs the eager static forward and the HF forward, per item, every field.
    static = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    gen = np.random.default_rng(11)
    worst_static = worst_hf = 0.0
    for case in range(6):
        pixels, grid = random_mix(gen, adapter.channels, int(gen.integers(1, 20)), big=case == 2)
        inputs = adapter.inputs(pixels, grid)
        with torch.inference_mode():
            got, want = runner(inputs), static(inputs)
        for g, w in zip(got, want):
            for name in w:
                assert torch.isfinite(g[name]).all()
                worst_static = max(worst_static, rel(g[name], w[name]))
        if case < 2:
            for g, r in zip(got, hf_per_item(reference, pixels, grid)):
                for name in r:
                    worst_hf = max(worst_hf, rel(g[name], r[name]))
    print(f"defaults vs eager static: worst {worst_static:.2e}; vs HF: worst {worst_hf:.2e}; stats {runner.stats}")
    assert worst_static < HF_RTOL and worst_hf < HF_RTOL


def test_graphed_every_grad_mode_and_autograd():
    tower, reference = tower_pair(depth=2)
    tower.requires_grad_(False)
    fast = encgraph.graphed(tower, compile=False)
    pixels, grid = random_mix(np.random.default_rng(3), encgraph.graphs(fast).adapter.channels, 5)
    grid_t = torch.from_numpy(grid).cuda()
    with torch.inference_mode():
        ref = reference(pixels, grid_thw=grid_t)
    for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad, torch.inference_mode, torch.no_grad):
        with mode():
            out = fast(pixels, grid_thw=grid_t)
        for name in ("pooler_output", "last_hidden_state"):
            assert rel(getattr(out, name), getattr(ref, name)) < HF_RTOL, (mode, name)
    assert encgraph.graphs(fast).stats["stock_calls"] == 0 and encgraph.graphs(fast).stats["calls"] == 5
    tower.requires_grad_(True)
    out = fast(pixels, grid_thw=grid_t)
    assert out.pooler_output.requires_grad and encgraph.graphs(fast).stats["eager_reasons"] == {"autograd requested": 1}


def test_a_nan_item_never_reaches_its_batch_mates():
    tower, reference = tower_pair(depth=2)
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[1024], max_items=8, compile=False, costs=False)
    runner.capture()
    grid = np.array([[1, 16, 16], [1, 20, 12], [2, 8, 8], [1, 12, 12]])
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    poisoned = pixels.clone()
    poisoned[starts[1] : starts[1] + 5] = float("nan")
    inputs = adapter.inputs(poisoned, grid)
    assert len(runner.plan(inputs).batches) == 1  # one replay holds all four
    with torch.inference_mode():
        out = runner(inputs)
    refs = hf_per_item(reference, pixels, grid)
    for i in (0, 2, 3):
        for name, want in refs[i].items():
            assert torch.isfinite(out[i][name]).all(), (i, name)
            assert rel(out[i][name], want) < HF_RTOL, (i, name)


def test_self_check_catches_a_module_that_mixes_rows_on_the_gpu():
    net = SequenceFirst(16).cuda().requires_grad_(False)
    fast = encgraph.graphed(net, budgets=[1, 2, 4, 8])
    for n in (3, 6):
        x = torch.randn(n, 16, device="cuda")
        torch.testing.assert_close(fast(x), own_forward(net)(x), rtol=1e-4, atol=1e-4)
    # The first call of the shape learns it; the second captures it, and the self-check finds rows mixing.
    stats = encgraph.graphs(fast).stats
    assert stats["stock_calls"] == 2 and stats["calls"] == 0 and stats["shapes"]["live"] == []
