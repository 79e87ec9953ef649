"""Qwen-VL towers on a GPU at real geometry (random bf16 weights, fewer layers): capture once, replay many fresh
random mixes of images and videos; each replay equals the adapter's static forward run eagerly on the same
kernels, and the Hugging Face tower's own forward within bf16 tolerance; a NaN-poisoned pool does not leak.

Geometry: the Qwen2.5-VL-7B tower (hidden 1280, 16 heads, MLP 3420, window 112 px, patch 14, merge 2, output
3584) at depth 8 with full attention in layers 3 and 7 (the 7B model has 32 layers, full at 7, 15, 23, 31);
Qwen2-VL-7B (embed 1280, 16 heads) and Qwen3-VL (hidden 1152, 16 heads, patch 16, 48 x 48 position grid,
deepstack after layers 2 and 5) at depth 8 too. Run with ``pytest -s`` to see capture time, memory and the
exactness report.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import encgraph
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import wrap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGETS = [64, 128, 256, 512, 1024, 2048]
MAX_ITEMS = 16
HF_RTOL = 2e-2  # bf16, 8 layers, flash varlen vs the tower's own SDPA per item
STATIC_RTOL = 1e-3  # when replay and eager static forward are not bit-exact


def qwen2_5_vl(depth=8):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
        window_size=112, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[3, 7],
    )
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.bfloat16), 14


def qwen2_vl(depth=8):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(depth=depth, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4,
                              patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.bfloat16), 14


def qwen3_vl(depth=8):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(depth=depth, hidden_size=1152, intermediate_size=4304, num_heads=16,
                              out_hidden_size=2048, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                              num_position_embeddings=2304, deepstack_visual_indexes=[2, 5])
    return Qwen3VLVisionModel._from_config(cfg, dtype=torch.bfloat16), 16


FAMILIES = {"qwen2_5_vl": qwen2_5_vl, "qwen2_vl": qwen2_vl, "qwen3_vl": qwen3_vl}


def build(family):
    torch.manual_seed(0)
    tower, patch = FAMILIES[family]()
    tower = tower.cuda().eval()
    reference = copy.deepcopy(tower)  # its own config: keeps the tower's original (sdpa) attention
    return tower, reference, patch


def random_mix(gen, channels, n, big=False):
    """``n`` items: images of 4..32 patches a side (56..448 px at patch 14), a third of them videos of 2..4
    frames of 4..16 patches a side; with ``big``, one more image of 96 x 96 patches (2304 tokens: over the
    largest budget, so it runs eagerly); pixel rows in bf16 on the GPU."""
    videos = gen.random(n) < 0.33
    t = np.where(videos, gen.integers(2, 5, n), 1)
    top = np.where(videos, 8, 16)
    hw = gen.integers(2, top[:, None] + 1, (n, 2)) * 2
    grid = np.concatenate([t[:, None], hw], axis=1).astype(np.int64)
    if big:
        grid = np.insert(grid, int(gen.integers(0, n + 1)), [1, 96, 96], axis=0)
    rows = int(grid.prod(1).sum())
    pixels = torch.randn(rows, channels, device="cuda", dtype=torch.bfloat16)
    return pixels, grid


def outputs(out) -> dict[str, torch.Tensor]:
    d = {"pooler_output": out.pooler_output}
    for i, f in enumerate(getattr(out, "deepstack_features", None) or []):
        d[f"deepstack_{i}"] = f
    return d


def rel(a, b, kind="norm") -> float:
    a, b = a.float(), b.float()
    if kind == "max":
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def hf_per_item(reference, pixels, grid):
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    with torch.inference_mode():
        return [
            outputs(reference(pixels[starts[i] : starts[i + 1]], grid_thw=torch.from_numpy(grid[i : i + 1]).cuda()))
            for i in range(grid.shape[0])
        ]


def cuda_ms(fn, n=5):
    """Mean device milliseconds of ``n`` calls of ``fn`` queued back to back, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def mib(n):
    return f"{n / 2**20:.1f} MiB"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_replay_equals_static_eager_and_hf(family):
    tower, reference, _ = build(family)
    adapter = wrap(tower)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    # Plain graphs here (the compiled default has its own test below): the replay must equal the eager static
    # forward on the same kernels. The greedy planner in both (costs=False): the cost-aware one may send an item
    # eagerly (another attention kernel: HF_RTOL, not STATIC_RTOL) that the static runner pads; the cost-aware
    # default is tests/gpu/test_defaults_gpu.py's.
    graph = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=MAX_ITEMS, compile=False, costs=False)
    info = graph.capture()
    print(f"\n{family}: captured {info['graphs']} graphs in {info['seconds']:.2f} s; pool {mib(info['pool_bytes'])}, "
          f"static buffers {mib(info['buffer_bytes'])}, allocated +{mib(torch.cuda.memory_allocated() - before)}; "
          f"replay ms per budget {[(g['budget'], g['replay_ms']) for g in info['per_graph']]}")
    assert info["graphs"] == len(BUDGETS) and not info["failed"]
    # The same plan, buffers and static forward, run eagerly: the replay's ground truth on the same kernels.
    static = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=MAX_ITEMS, mode=RunMode.STATIC)

    gen = np.random.default_rng(0)
    exact = total = 0
    worst_static = worst_hf = 0.0
    for case in range(30):
        pixels, grid = random_mix(gen, adapter.channels, int(gen.integers(1, 3 * MAX_ITEMS)), big=case % 5 == 1)
        inputs = adapter.inputs(pixels, grid)
        # Items over the ladder run eagerly in both runners, on the same kernels (dense from the measured rows).
        with torch.inference_mode():
            got = graph(inputs)
            want = static(inputs)
        for i, (g, w) in enumerate(zip(got, want)):
            for name in w:
                assert torch.isfinite(g[name]).all(), (case, i, name)
                total += 1
                if torch.equal(g[name], w[name]):
                    exact += 1
                else:
                    err = rel(g[name], w[name], "max")
                    worst_static = max(worst_static, err)
                    assert err < STATIC_RTOL, (case, i, grid[i].tolist(), name, err)
        if case < 4:  # the HF tower per item is slow (one launch-bound forward per item)
            for i, (g, ref) in enumerate(zip(got, hf_per_item(reference, pixels, grid))):
                for name in ref:
                    err = rel(g[name], ref[name])
                    worst_hf = max(worst_hf, err)
                    assert err < HF_RTOL, (case, i, grid[i].tolist(), name, err)
    stats = graph.stats
    print(f"{family}: replay vs eager static forward: {exact}/{total} outputs bit-exact, worst max-relative error "
          f"of the others {worst_static:.2e}; vs HF forward worst norm-relative error {worst_hf:.2e}; "
          f"replays {stats['paths']['default']['replays']}, eager items {stats['eager_items']} "
          f"({stats['eager_reasons']}), padded share {stats['paths']['default']['padded_share']:.2f}")
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0


def test_graphed_module_drop_in():
    tower, reference, _ = build("qwen2_5_vl")
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=MAX_ITEMS, compile=False)
    encgraph.graphs(fast).capture()
    pixels, grid = random_mix(np.random.default_rng(1), encgraph.graphs(fast).adapter.channels, 6)
    with torch.inference_mode():
        out = fast(pixels, grid_thw=torch.from_numpy(grid).cuda())
        ref = reference(pixels, grid_thw=torch.from_numpy(grid).cuda())
    assert rel(out.pooler_output, ref.pooler_output) < HF_RTOL
    assert encgraph.graphs(fast).unwrap() is tower


def test_nan_poisoned_pool_does_not_leak():
    tower, reference, _ = build("qwen2_5_vl")
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=MAX_ITEMS, compile=False, costs=False)
    runner.capture()
    # The largest graph runs on NaN pixels: its intermediates in the shared pool are now NaN.
    big = np.array([[1, 64, 64]])  # 1024 tokens: the 1024 budget
    nan_pixels = torch.full((int(big.prod()), adapter.channels), float("nan"), device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.isnan(runner(adapter.inputs(nan_pixels, big))[0]["pooler_output"]).all()
        for grid in (np.array([[1, 8, 8]]), np.array([[1, 16, 12], [2, 4, 4]]), np.array([[1, 32, 32]])):
            pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
            out = runner(adapter.inputs(pixels, grid))
            refs = hf_per_item(reference, pixels, grid)
            for o, r in zip(out, refs):
                assert torch.isfinite(o["pooler_output"]).all(), grid.tolist()
                assert rel(o["pooler_output"], r["pooler_output"]) < HF_RTOL
    assert runner.stats["graph_items"] == runner.stats["items"]


def test_static_forward_does_not_sync():
    # torch's sync debug mode raises on any host-device synchronisation inside the static forward.
    from encgraph.capture.buffers import PathBuffers

    tower, _, _ = build("qwen2_5_vl")
    adapter = wrap(tower)
    buffers = PathBuffers("default", {256: adapter.buffer_specs("default", 256, MAX_ITEMS, MAX_ITEMS)},
                          torch.device("cuda"))
    views = buffers.fill(256, None)  # an all-padding batch, as at capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = adapter.forward_static("default", views, 256)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out["pooler_output"].shape == (256, 3584)


def test_fast_layout_equals_plain_layout():
    # The padded gated MLP and the patch embedding as one matmul (encgraph.models.layout) against the tower's own
    # layers, per item, on the same weights: bf16 rounding apart, the same sums.
    tower, reference, _ = build("qwen2_5_vl")
    fast, plain = wrap(tower), wrap(reference, fast_layout=False)
    assert len(fast.layout) == 1 + len(tower.blocks) and plain.layout == []
    assert "3420 -> 3424" in fast.layout[1]
    pixels, grid = random_mix(np.random.default_rng(2), fast.channels, 10)
    inputs = fast.inputs(pixels, grid)
    worst = 0.0
    with torch.inference_mode():
        for i in range(grid.shape[0]):
            got = fast.forward_eager("default", fast.select(inputs, [i]))["pooler_output"]
            want = plain.forward_eager("default", plain.select(inputs, [i]))["pooler_output"]
            worst = max(worst, rel(got, want))
    print(f"\nfast vs plain layout, eager forward per item: worst norm-relative error {worst:.2e}")
    assert worst < HF_RTOL
    plain.unwrap()
    fast.unwrap()
    assert all("forward" not in m.__dict__ for m in tower.modules())


def test_compiled_graphs_equal_static_eager():
    # The default compile="auto": the static forward is compiled once for every budget (a symbolic token
    # dimension), then each budget is captured from the same compiled code; replays are compared per item with
    # the uncompiled static forward run eagerly, on fresh random inputs.
    torch.manual_seed(0)
    tower = qwen2_5_vl(depth=4)[0].cuda().eval()
    adapter = wrap(tower)
    budgets = [64, 192, 256, 448, 1024]
    graph = EncoderGraphRunner(adapter, budgets=budgets, max_items=8)
    info = graph.capture()
    compiled = info["compile"]
    print(f"\ncompiled graphs: {info['graphs']} in {info['seconds']:.1f} s (first compile "
          f"{compiled.get('first_compile_seconds')} s, dynamo {compiled.get('dynamo')}); replay ms "
          f"{[(g['budget'], g['replay_ms']) for g in info['per_graph']]}")
    assert info["graphs"] == len(budgets) and not info["failed"] and compiled["status"] == "compiled"
    # One compilation per kind of block (windowed, full attention) served every block and every budget.
    assert compiled["dynamo"]["unique_graphs"] <= 2 and compiled["dynamo"]["graph_breaks"] == 0, compiled
    static = EncoderGraphRunner(adapter, budgets=budgets, max_items=8, mode=RunMode.STATIC)
    gen = np.random.default_rng(5)
    worst = 0.0
    for case in range(8):
        pixels, grid = random_mix(gen, adapter.channels, int(gen.integers(1, 9)), big=case == 3)
        inputs = adapter.inputs(pixels, grid)
        with torch.inference_mode():
            got, want = graph(inputs), static(inputs)
        for i, (g, w) in enumerate(zip(got, want)):
            for name in w:
                assert torch.isfinite(g[name]).all(), (case, i, name)
                err = rel(g[name], w[name])
                worst = max(worst, err)
                assert err < HF_RTOL, (case, i, grid[i].tolist(), name, err)
    print(f"compiled replay vs eager static forward: worst norm-relative error {worst:.2e}")
    assert graph.stats["graph_items"] > 0


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_eager_forward_attends_long_images_densely(family, monkeypatch):
    # Eager items carry their bounds from the host: full-attention layers of long images run one dense SDPA call
    # per image (cuDNN here) instead of Flash varlen. Each item still equals the tower's own forward; the time
    # of both kernels is printed (the cost model measures the eager forward at capture and plans with it).
    from encgraph.models import attention
    from tests.models.test_kernel_choice import dense_spy

    tower, reference, patch = build(family)
    adapter = wrap(tower)
    grid = np.array([[1, 64, 80], [1, 48, 64], [1, 8, 8]])  # 5120 and 3072 patches: dense; 64: not
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    inputs = adapter.inputs(pixels, grid)
    dense = dense_spy(monkeypatch)
    with torch.inference_mode():
        got = adapter.forward_eager("default", inputs)
    # Full-attention layers only (Qwen2.5-VL's window layers stay varlen), the 64-row image in a varlen call.
    assert dense and set(dense) == {5120, 3072}, sorted(set(dense))
    refs = hf_per_item(reference, pixels, grid)
    counts = (grid.prod(1) // 4).tolist()
    for i, (g, want) in enumerate(zip(torch.split(got["pooler_output"], counts), refs)):
        assert torch.isfinite(g).all() and rel(g, want["pooler_output"]) < HF_RTOL, (i, grid[i].tolist())

    with torch.inference_mode():
        dense_ms = cuda_ms(lambda: adapter.forward_eager("default", inputs))
        monkeypatch.setattr(attention, "SEGMENT_MIN_ROWS", 10**9)
        varlen_ms = cuda_ms(lambda: adapter.forward_eager("default", inputs))
    print(f"\n{family} eager, {grid.tolist()}: dense per image {dense_ms:.2f} ms, Flash varlen {varlen_ms:.2f} ms")
