"""The vLLM protocol adapter on a GPU, without vLLM: a real-geometry Hugging Face Qwen2.5-VL tower (7B geometry,
depth 8, random bf16 weights) exposed through vLLM's ``SupportsEncoderCudaGraph`` methods
(``tests/shims/protocol_models.HFQwenProtocol``), behind ``VllmProtocolAdapter`` and the runner in GRAPH mode.

Each replay equals the same adapter's static forward run eagerly (per item) and the untouched HF tower's own
forward per item within bf16 tolerance; the model's own capture tensors, which the graphs read (kept per
budget as vLLM's manager keeps them; ``cu_seqlens``, ``cu_window_seqlens``, ``window_index`` refreshed through
vLLM ``padding_logics``, the others zeroed then copied), survive a NaN-poisoned pool. Needs transformers >= 5.15 (the GPU image's 5.17 works); vLLM must not be needed (asserted).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.shims.vllm import VllmProtocolAdapter
from tests.gpu.test_qwen_gpu import BUDGETS, HF_RTOL, MAX_ITEMS, STATIC_RTOL, qwen2_5_vl, random_mix, rel
from tests.shims.protocol_models import HFQwenProtocol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    tower, _ = qwen2_5_vl()
    return HFQwenProtocol(tower.cuda().eval(), max_frames_per_video=4)


def mm_kwargs(pixels, grid):
    return {"pixel_values": pixels, "image_grid_thw": grid.tolist()}


def runner(model, mode=None):
    # One adapter per runner: the adapter keeps the model's per-budget capture tensors for the runner it serves.
    # Plain graphs, as the shim's manager builds them unless ENCGRAPH_VLLM_COMPILE=1: replays must then equal
    # the eager static forward within STATIC_RTOL.
    adapter = VllmProtocolAdapter(model, budget_range=(BUDGETS[0], BUDGETS[-1]))
    return EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=MAX_ITEMS, mode=mode, compile=False)


def test_replay_equals_static_eager_and_hf(model):
    graph = runner(model)
    info = graph.capture()
    print(f"\nvLLM protocol, Qwen2.5-VL-7B geometry: {info['graphs']} graphs in {info['seconds']:.2f} s, pool "
          f"{info['pool_bytes'] / 2**20:.1f} MiB, replay ms {[(g['budget'], g['replay_ms']) for g in info['per_graph']]}")
    assert info["graphs"] == len(BUDGETS) and not info["failed"] and info["compile"]["mode"] == "off"
    static = runner(model, RunMode.STATIC)
    gen = np.random.default_rng(0)
    worst_static = worst_hf = 0.0
    for case in range(12):
        pixels, grid = random_mix(gen, model.qwen.channels, int(gen.integers(1, 3 * MAX_ITEMS)), big=case % 4 == 1)
        inputs = mm_kwargs(pixels, grid)
        with torch.inference_mode():
            got = graph(inputs)
            want = static(inputs)
            hf = model.hf_per_item(inputs) if case < 3 else None
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.isfinite(g).all(), (case, i)
            if not torch.equal(g, w):
                worst_static = max(worst_static, rel(g, w, "max"))
                assert rel(g, w, "max") < STATIC_RTOL, (case, i, grid[i].tolist())
            if hf is not None:
                worst_hf = max(worst_hf, rel(g, hf[i]))
                assert rel(g, hf[i]) < HF_RTOL, (case, i, grid[i].tolist())
    stats = graph.stats
    print(f"worst max-relative error vs static {worst_static:.2e}, norm-relative vs HF {worst_hf:.2e}; replays "
          f"{stats['paths']['default']['replays']}, eager items {stats['eager_items']} ({stats['eager_reasons']})")
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0
    assert "vllm" not in sys.modules


def test_nan_poisoned_pool_does_not_leak(model):
    graph = runner(model)
    graph.capture()
    big = np.array([[1, 64, 64]])  # 1024 tokens: the 1024 budget's graph fills the pool with NaN
    nan_pixels = torch.full((int(big.prod()), model.qwen.channels), float("nan"), device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.isnan(graph(mm_kwargs(nan_pixels, big))[0]).all()
        for grid in (np.array([[1, 8, 8]]), np.array([[1, 16, 12], [2, 4, 4]]), np.array([[1, 32, 32]])):
            pixels = torch.randn(int(grid.prod(1).sum()), model.qwen.channels, device="cuda", dtype=torch.bfloat16)
            out = graph(mm_kwargs(pixels, grid))
            for o, ref in zip(out, model.hf_per_item(mm_kwargs(pixels, grid))):
                assert torch.isfinite(o).all(), grid.tolist()
                assert rel(o, ref) < HF_RTOL
    assert graph.stats["graph_items"] == graph.stats["items"]
