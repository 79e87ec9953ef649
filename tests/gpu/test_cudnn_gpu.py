"""cuDNN's packed SDPA through the ``nvidia-cudnn-frontend`` wheel as the graphs' varlen kernel
(:mod:`encgraph.models.cudnn_varlen`, issue 56), where the wheel is installed: per sequence against an fp32
reference, replayed from a CUDA graph after its lengths were rewritten, NaN kept within its sequence, chosen by
measurement at capture (FlashAttention-4 left out, as on a torch-only install with the frontend), and a Qwen-VL
tower captured on it equal to its own forward per item, a NaN image between clean ones on one shared pool
included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encgraph.capture.recording import graph_calls
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import attention, cudnn_varlen, kernel_choice, varlen_kernel, wrap
from encgraph.packing.crossover import faster_varlen
from tests.gpu.test_fa4_gpu import (
    LENGTHS, OTHER, _cu, _one_projection, check_nan_stays_in_its_sequence, measured_crossover, registered,
)
from tests.gpu.test_kernels_gpu import BF16_RTOL, GEOMETRIES, _per_sequence_fp32, _qkv
from tests.gpu.test_qwen_gpu import HF_RTOL, build, hf_per_item, random_mix, rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and not cudnn_varlen.available(torch.device("cuda")),
                       reason="needs nvidia-cudnn-frontend>=1.32 (pip install nvidia-cudnn-frontend) on an Ampere "
                              "or newer GPU"),
]


@pytest.fixture
def on_cudnn():
    """cuDNN's packed SDPA as the graph kernel of every geometry the tests use (eager calls keep Flash)."""
    yield from registered("cudnn")


@pytest.mark.parametrize("layout", ["separate", "one projection"])
@pytest.mark.parametrize(("heads", "dim"), GEOMETRIES)
def test_cudnn_replay_equals_each_sequence_after_a_rewrite(heads, dim, layout, on_cudnn):
    make = _qkv if layout == "separate" else _one_projection
    q, k, v = make(LENGTHS, heads, dim, seed=heads + dim)
    assert varlen_kernel.kernel_of(q) == "flash"  # an eager call
    cu = _cu(LENGTHS)
    budget = max(max(LENGTHS), max(OTHER))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), graph_calls():  # the warm-up: builds the plan of this shape
        assert varlen_kernel.kernel_of(q) == "cudnn"
        warm = attention.packed_attention(q, k, v, cu, budget)
    torch.cuda.current_stream().wait_stream(stream)
    for i, (got, want) in enumerate(zip(torch.split(warm, LENGTHS), _per_sequence_fp32(q, k, v, LENGTHS))):
        assert rel(got, want) < BF16_RTOL, (i, rel(got, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), graph_calls():
        out = attention.packed_attention(q, k, v, cu, budget)
    assert cudnn_varlen.pinned() >= 1
    for lengths in (LENGTHS, OTHER):
        cu.copy_(_cu(lengths))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        flash = attention.packed_attention(q, k, v, cu, budget)  # outside graph calls: torch's Flash
        refs = _per_sequence_fp32(q, k, v, lengths)
        for i, (got, want, fl) in enumerate(zip(torch.split(out, lengths), refs, torch.split(flash, lengths))):
            assert torch.isfinite(got).all() and rel(got, want) < BF16_RTOL, (lengths, i, rel(got, want))
            assert rel(got, fl) < BF16_RTOL, (lengths, i)


def test_cudnn_keeps_nan_within_its_sequence(on_cudnn):
    check_nan_stays_in_its_sequence(graph_calls)


def test_capture_measures_cudnn_and_graphs_run_the_fastest(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_fa4_fits", lambda *args: False)  # a torch-only install with the frontend
    c = measured_crossover("cudnn")
    assert c.graph_kernel == faster_varlen(c.varlen_ms, (), c.cudnn_ms) and c.varlen_kernel == "flash"
    # Replayed from graphs on an H100, cuDNN ran at 1.4-1.6x torch's Flash at 16 x 72 (one 896 px image, 16 x
    # 256, one 27,000-row photo: benches/results/attention_kernels_nvidia-h100-80gb-hbm3.md): chosen there.
    assert c.graph_kernel == "cudnn", c.to_dict()


def test_a_tower_captured_on_cudnn_equals_its_own_forward_per_item(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_fa4_fits", lambda *args: False)
    tower, reference, _ = build("qwen2_5_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[256, 1024, 2048], max_items=8, compile=False, costs=False)
    device = torch.device("cuda")
    try:
        info = runner.capture()
        chosen = {c.graph_kernel for c in runner.kernels.values()}
        print(f"\nqwen2_5_vl on cuDNN: kernels {info['kernels']}; plans kept {cudnn_varlen.pinned()}; failed "
              f"{info['failed']}")
        assert chosen == {"cudnn"} and not info["failed"] and cudnn_varlen.pinned() >= 3
        gen = np.random.default_rng(5)
        worst = 0.0
        for case in range(5):
            pixels, grid = random_mix(gen, adapter.channels, int(gen.integers(1, 9)))
            if case == 2:  # a NaN image between clean ones, on the pool the others replay on
                grid = np.array([[1, 16, 16], [1, 64, 64], [1, 12, 20]])  # 64, 1024 and 60 tokens
                pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda",
                                     dtype=torch.bfloat16)
                poisoned = pixels.clone()
                poisoned[256:256 + 4096] = float("nan")
                with torch.inference_mode():
                    out = runner(adapter.inputs(poisoned, grid))
                refs = hf_per_item(reference, pixels, grid)
                assert torch.isnan(out[1]["pooler_output"]).all()
                for i in (0, 2):
                    for name, want in refs[i].items():
                        assert torch.isfinite(out[i][name]).all() and rel(out[i][name], want) < HF_RTOL, (i, name)
                continue
            with torch.inference_mode():
                out = runner(adapter.inputs(pixels, grid))
            for i, (got, want) in enumerate(zip(out, hf_per_item(reference, pixels, grid))):
                for name in want:
                    worst = max(worst, rel(got[name], want[name]))
                    assert rel(got[name], want[name]) < HF_RTOL, (case, i, name, grid[i].tolist())
        print(f"worst per-item error against the tower's own forward: {worst:.2e}; stats {runner.stats}")
        assert runner.stats["graph_items"] == runner.stats["items"]
    finally:
        for c in runner.kernels.values():
            varlen_kernel.use(c.heads, c.head_dim, torch.bfloat16, device, "flash")
