"""The encgraph manager against vLLM's real classes (vLLM 0.33; skipped where vLLM is not importable).

What runs for real: vLLM's ``EncoderCudaGraphManager`` (constructor, budgets, greedy packing, buffer copies,
padding logics, ``scatter_output_slices``), its protocol data classes, ``CompilationConfig``, ``SupportsEncoderCudaGraph``,
the plugin loader and ``GPUModelRunner._create_encoder_cudagraph_manager``, on vLLM's CPU platform. What is
replaced: ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` by a CPU recorder (``tests/shims/cpu_graph.py``) in the
tests that capture with vLLM's manager; the model/parallel configs by small stand-ins (as vLLM's own tests do).
The encgraph manager runs its STATIC mode here (the same plan, buffers and static forward, without graphs).

Scenarios ported from vLLM's ``tests/v1/cudagraph/test_encoder_cudagraph.py`` are marked "(vLLM: ...)".
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm.v1.worker.encoder_cudagraph")

from vllm.config.compilation import CompilationConfig  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph, supports_encoder_cudagraph  # noqa: E402
from vllm.v1.worker import encoder_cudagraph_defs as defs  # noqa: E402
from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager as VllmManager  # noqa: E402

from encgraph.shims import vllm as shim  # noqa: E402
from tests.shims.cpu_graph import RecordedGraph, patch_cuda_graphs  # noqa: E402
from tests.shims.protocol_models import HIDDEN, toy_inputs, toy_model_class  # noqa: E402

ToyVit = toy_model_class(defs, SupportsEncoderCudaGraph)
CPU = torch.device("cpu")


def vllm_config(budgets=None, max_items=0, max_frames=None, video_limit=4, tp_mode="replicate", tp=1):
    """A VllmConfig stand-in with a real CompilationConfig (model and parallel configs as vLLM's tests mock them)."""
    compilation = CompilationConfig(
        encoder_cudagraph_token_budgets=budgets or [], encoder_cudagraph_max_vision_items_per_batch=max_items,
        encoder_cudagraph_max_frames_per_batch=max_frames,
    )
    mm = types.SimpleNamespace(mm_encoder_tp_mode=tp_mode, get_limit_per_prompt=lambda modality: video_limit if modality == "video" else 8)
    return types.SimpleNamespace(
        compilation_config=compilation, model_config=types.SimpleNamespace(multimodal_config=mm),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
    )


def managers(model, config, monkeypatch):
    """vLLM's manager (captured with the CPU graph recorder) and the encgraph manager, on the same model."""
    patch_cuda_graphs(monkeypatch)
    theirs = VllmManager(vllm_config=config, device=CPU, dtype=torch.float32, model=model)
    ours = shim.EncoderCudaGraphManager(vllm_config=config, device=CPU, dtype=torch.float32, model=model)
    with torch.inference_mode():
        theirs.capture(graph_pool=object())
    ours.capture(graph_pool=object())
    return theirs, ours


def eager_per_item(model, inputs):
    with torch.inference_mode():
        n = len(model.get_encoder_cudagraph_item_specs(inputs))
        return [model.encoder_eager_forward(model.select_encoder_cudagraph_items(inputs, [i])) for i in range(n)]


def assert_items_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


MIXES = [
    ([[1, 2, 4], [1, 4, 4], [1, 2, 2], [1, 6, 4]], False),  # images, several sub-batches
    ([[1, 2, 2]] * 9, False),  # more items than a batch holds (vLLM: chunking)
    ([[1, 2, 4], [1, 18, 18], [1, 4, 4]], False),  # 81 tokens > the largest budget: eager inside the call
    ([[2, 2, 4], [1, 4, 4], [2, 4, 2]], True),  # videos within max_frames_per_video
]


def test_the_toy_implements_vllms_protocol():
    assert supports_encoder_cudagraph(ToyVit())


@pytest.mark.parametrize("grid,video", MIXES, ids=["images", "chunking", "eager_inside", "videos"])
def test_same_per_item_outputs_as_vllms_manager(grid, video, monkeypatch):
    model = ToyVit(min_budget=4, max_budget=64).eval()
    theirs, ours = managers(model, vllm_config(budgets=[16, 64], max_items=4), monkeypatch)
    assert ours.token_budgets == theirs.token_budgets == [16, 64]
    assert (ours.max_batch_size, ours.max_frames_per_batch) == (theirs.max_batch_size, theirs.max_frames_per_batch)
    inputs = toy_inputs(grid, video=video, seed=3)
    with torch.inference_mode():
        want = theirs.execute(inputs)
    got = ours.execute(inputs)
    assert_items_close(got, want)
    assert_items_close(got, eager_per_item(model, inputs))
    graphs = [g.graph for g in theirs.budget_graphs["default"].values()]
    assert all(isinstance(g, RecordedGraph) for g in graphs) and sum(g.replays for g in graphs) > 0
    assert ours.graph_hits + ours.graph_misses == theirs.graph_hits + theirs.graph_misses == len(grid)


def test_vllms_eager_path_needs_no_graph_at_all():
    # Without the recorder: vLLM's manager, never captured, runs an item over every budget eagerly.
    model = ToyVit().eval()
    config = vllm_config(budgets=[16, 64], max_items=4)
    theirs = VllmManager(vllm_config=config, device=CPU, dtype=torch.float32, model=model)
    ours = shim.EncoderCudaGraphManager(vllm_config=config, device=CPU, dtype=torch.float32, model=model)
    ours.capture(graph_pool=object())
    inputs = toy_inputs([[1, 18, 18], [1, 20, 16]], seed=4)  # 81 and 80 tokens
    with torch.inference_mode():
        want = theirs.execute(inputs)
    assert_items_close(ours.execute(inputs), want)
    assert theirs.graph_misses == ours.graph_misses == 2


def test_a_video_longer_than_max_frames_per_video(monkeypatch):
    # vLLM packs by tokens and items only: a 5-frame video beside others overflows the captured cu_seqlens.
    model = ToyVit(max_frames_per_video=2).eval()
    theirs, ours = managers(model, vllm_config(budgets=[16, 64], max_items=4), monkeypatch)
    inputs = toy_inputs([[2, 2, 2], [5, 2, 2], [2, 2, 2], [2, 2, 2]], video=True, seed=5)
    with pytest.raises(RuntimeError, match="size of tensor"), torch.inference_mode():
        theirs.execute(inputs)  # 11 frames into a cu_seqlens captured for 8
    assert_items_close(ours.execute(inputs), eager_per_item(model, inputs))
    for batch in ours.runner.plan(inputs).batches:  # the planner splits by frames
        assert sum(inputs["video_grid_thw"][i][0] for i in batch.items) <= ours.max_frames_per_batch
    assert ours.runner.stats["eager_items"] == 0


# ------------------------------------------------------------------ ported from vLLM's manager tests


def shim_manager(budgets=None, max_items=0, min_budget=4, max_budget=128, **config):
    model = ToyVit(min_budget=min_budget, max_budget=max_budget).eval()
    return shim.EncoderCudaGraphManager(
        vllm_config=vllm_config(budgets, max_items, **config), device=CPU, dtype=torch.float32, model=model
    )


@pytest.mark.parametrize("low,high,expected", [
    (64, 1024, [64, 128, 256, 512, 1024]), (64, 800, [64, 128, 256, 512, 800]), (64, 64, [64]),
    (64, 8192, [64, 128, 256, 512, 1024, 2048, 4096, 8192]),
])
def test_generated_budgets(low, high, expected):  # (vLLM: TestGenerateBudgets)
    assert shim_manager(min_budget=low, max_budget=high).token_budgets == expected == VllmManager._generate_budgets(low, high)


@pytest.mark.parametrize("tokens,budgets,expected", [
    (2048, [2048, 4096, 8192], 2048), (100, [2048, 4096, 8192], 2048), (2049, [2048, 4096, 8192], 4096),
    (4097, [2048, 4096, 8192], 8192), (9000, [2048, 4096, 8192], None), (1000, [2048], 2048), (3000, [2048], None),
])
def test_smallest_fitting_budget(tokens, budgets, expected):  # (vLLM: TestFindBudgetGraph; 0 tokens is no item)
    mgr = shim_manager(budgets=budgets)
    plan = mgr.runner.plan(toy_inputs([[1, 2, 2 * tokens]]))
    assert plan.batches[0].budgets["default"] == expected


def test_budgets_are_sorted_and_counted():  # (vLLM: test_budgets_are_sorted, test_num_graphs_to_capture_tracks_budgets)
    mgr = shim_manager(budgets=[8192, 2048, 4096])
    assert mgr.token_budgets == [2048, 4096, 8192] and mgr.get_num_graphs_to_capture() == 3
    assert mgr.runner.plan(toy_inputs([[1, 2, 6000]])).batches[0].budgets["default"] == 4096


def test_cumulative_stats():  # (vLLM: TestGetCumulativeStats, with real calls instead of set counters)
    mgr = shim_manager(budgets=[16, 64], max_items=4)
    stats = mgr.get_cumulative_stats()
    assert (stats["graph_hits"], stats["graph_misses"], stats["hit_rate"], stats["num_budgets"]) == (0, 0, 0.0, 0)
    assert stats["token_budgets"] == [16, 64]
    mgr.capture(graph_pool=object())
    assert mgr.get_cumulative_stats()["num_budgets"] == 2
    mgr.execute(toy_inputs([[1, 4, 4]] * 3))  # all hits
    assert mgr.get_cumulative_stats()["hit_rate"] == pytest.approx(1.0)
    mgr.execute(toy_inputs([[1, 18, 18]]))  # one miss: 3 / 4
    stats = mgr.get_cumulative_stats()
    assert (stats["graph_hits"], stats["graph_misses"], stats["hit_rate"]) == (3, 1, pytest.approx(0.75))
    assert stats["encgraph"]["items"] == 4


@pytest.fixture
def captured():
    mgr = shim_manager(budgets=[16, 64], max_items=4, max_frames=8)
    pool = object()
    mgr.capture(graph_pool=pool)
    return mgr, pool


def test_capture_uses_the_pool_and_clear_releases(captured):  # (vLLM: capture / clear tests)
    mgr, pool = captured
    assert mgr.graph_pool is pool and mgr.is_captured()
    assert mgr.get_cumulative_stats()["num_budgets"] == len([16, 64])
    mgr.clear()
    assert mgr.graph_pool is None and not mgr.is_captured() and not mgr.runner.captured
    with pytest.raises(RuntimeError, match="before capture"):  # vLLM's manager fails there too
        mgr.execute(toy_inputs([[1, 4, 4]]))
    mgr.capture(graph_pool=pool)
    assert len(mgr.execute(toy_inputs([[1, 4, 4]]))) == 1


@pytest.mark.parametrize("grid,video,shapes,hits,misses", [
    ([[1, 4, 4], [1, 4, 4]], False, [(4, HIDDEN)] * 2, 2, 0),  # one tensor per image, hit counter
    ([[1, 4, 4], [1, 8, 8]], False, [(4, HIDDEN), (16, HIDDEN)], 2, 0),  # output tokens per image
    ([[1, 18, 18]], False, [(81, HIDDEN)], 0, 1),  # eager fallback over every budget, miss counter
    ([[1, 4, 4]] * 8, False, [(4, HIDDEN)] * 8, 8, 0),  # chunking: 8 images > max batch 4
    ([[2, 4, 4], [1, 4, 4]], True, [(8, HIDDEN), (4, HIDDEN)], 2, 0),  # video tokens per item
    ([[2, 18, 18]], True, [(162, HIDDEN)], 0, 1),  # oversized video: eager
])
def test_execute_scenarios(captured, grid, video, shapes, hits, misses):  # (vLLM: capture/replay and video tests)
    mgr, _ = captured
    out = mgr.execute(toy_inputs(grid, video=video, seed=6))
    assert [tuple(o.shape) for o in out] == shapes
    assert (mgr.graph_hits, mgr.graph_misses) == (hits, misses)
    assert_items_close(out, eager_per_item(mgr.model, toy_inputs(grid, video=video, seed=6)))


def test_images_and_videos_share_a_manager(captured):  # (vLLM: test_image_and_video_share_manager)
    mgr, _ = captured
    assert mgr.supports_modality("image") and mgr.supports_modality("video") and not mgr.supports_modality("audio")
    images = mgr.execute(toy_inputs([[1, 4, 4], [1, 4, 4]]))
    videos = mgr.execute(toy_inputs([[2, 4, 4]], video=True))
    assert [o.shape for o in images] == [(4, HIDDEN)] * 2 and [o.shape for o in videos] == [(8, HIDDEN)]


@pytest.mark.parametrize("kwargs,check", [
    (dict(min_budget=64, max_budget=16384), lambda m: m.max_batch_size <= min(m.token_budgets)),
    (dict(min_budget=4, max_budget=128), lambda m: m.max_batch_size <= min(m.token_budgets)),
    (dict(budgets=[64, 128], max_items=32), lambda m: (m.max_batch_size, m.token_budgets) == (32, [64, 128])),
    (dict(budgets=[64, 128], max_items=64), lambda m: m.max_batch_size == 64),
    (dict(max_items=128, min_budget=64, max_budget=16384), lambda m: m.max_batch_size == 128 and min(m.token_budgets) >= 128),
    (dict(max_items=2, min_budget=4, max_budget=128), lambda m: m.max_batch_size == 2 and min(m.token_budgets) >= 2),
    (dict(budgets=[32, 64], min_budget=64, max_budget=16384), lambda m: m.max_batch_size == 32),
])
def test_init_invariants(kwargs, check):  # (vLLM: TestInitInvariantValidation)
    mgr = shim_manager(**kwargs)
    assert check(mgr)
    assert mgr.runner.limits.max_items <= min(mgr.token_budgets)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budgets=[64], max_items=256), "must be <= smallest token budget"),
    (dict(min_budget=0, max_budget=128), "Both must be positive"),
    (dict(min_budget=4, max_budget=-1), "Both must be positive"),
    (dict(min_budget=200, max_budget=100), "min_budget=200 > max_budget=100"),
])
def test_init_errors(kwargs, match):  # (vLLM: TestInitInvariantValidation)
    with pytest.raises(ValueError, match=match):
        shim_manager(**kwargs)


def test_videos_disabled_gives_image_limits():
    mgr = shim_manager(budgets=[16, 64], max_items=4, video_limit=0)
    assert mgr.max_frames_per_batch == 0 and mgr.runner.limits.max_frames == 4 and mgr.runner.limits.max_items == 4
    mgr.capture(graph_pool=object())
    assert_items_close(mgr.execute(toy_inputs([[1, 4, 4]] * 5)), eager_per_item(mgr.model, toy_inputs([[1, 4, 4]] * 5)))
