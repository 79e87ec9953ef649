"""The benchmark scripts on the CPU: the traffic trace is seeded and follows its documented distribution, the size
helpers match the processors, and every script's ``--help`` and ``--cpu-smoke`` run (tiny towers, runner STATIC
mode), so that a script is known to run before it reaches the GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from benches import capture, common, floor, kernel_profile, plot, towers, traffic  # noqa: E402
from benches.common import System, Visual  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("towers", "traffic", "capture", "floor", "plot", "kernel_profile")
FAST = ["--cpu-smoke", "--runs", "1", "--warmup", "0"]


# ---------------------------------------------------------------------------------------------------- the trace
def test_trace_is_seeded_and_prefix_stable():
    a = traffic.generate_trace(300, seed=3)
    assert a == traffic.generate_trace(300, seed=3)
    assert a != traffic.generate_trace(300, seed=4)
    assert traffic.generate_trace(40, seed=3) == a[:40]


@pytest.fixture(scope="module")
def big_trace():
    return traffic.generate_trace(4000, seed=0)


def test_trace_follows_documented_shares(big_trace):
    videos = [r for r in big_trace if r[0].is_video]
    images = [r for r in big_trace if not r[0].is_video]
    assert abs(len(videos) / len(big_trace) - traffic.VIDEO_SHARE) < 0.02
    counts = Counter(len(r) for r in images)
    assert set(counts) <= set(traffic.ITEMS_PER_REQUEST)
    for n, p in traffic.ITEMS_PER_REQUEST.items():
        assert abs(counts[n] / len(images) - p) < 0.025, n
    mean = np.mean([len(r) for r in images])
    assert abs(mean - traffic.expected_items_per_image_request()) < 0.1
    kinds = Counter(v.kind for r in images for v in r)
    total = sum(kinds.values())
    for kind, p in traffic.IMAGE_KINDS.items():
        assert abs(kinds[kind] / total - p) < 0.025, kind


def test_trace_sizes_stay_in_documented_ranges(big_trace):
    portrait = photos = 0
    for request in big_trace:
        for v in request:
            if v.kind == "video":
                assert len(request) == 1 and v.frames in traffic.VIDEO_FRAMES
                assert (v.height, v.width) in traffic.VIDEO_SIZES
                continue
            assert v.frames == 1
            if v.kind == "icon":
                assert v.height == v.width and traffic.ICON_SIDE[0] <= v.width <= traffic.ICON_SIDE[1]
            elif v.kind == "document":
                assert traffic.DOCUMENT_WIDTH[0] <= v.width <= traffic.DOCUMENT_WIDTH[1]
                assert v.height == round(v.width * traffic.DOCUMENT_ASPECT)
            elif v.kind == "screenshot":
                assert (v.height, v.width) in traffic.SCREENSHOT_SIZES
            else:
                assert v.kind == "photo"
                lo, hi = traffic.PHOTO_LONG_SIDE
                assert lo - 1 <= max(v.height, v.width) <= hi + 1
                ratio = max(v.height, v.width) / min(v.height, v.width)
                assert min(abs(ratio - a) for a in traffic.PHOTO_ASPECTS) < 0.02
                if v.height != v.width:  # squares have no orientation
                    photos += 1
                    portrait += v.height > v.width
    assert abs(portrait / photos - traffic.PORTRAIT_SHARE) < 0.04


def test_caps_bound_tokens_per_image_and_frame(big_trace):
    spec = common.TOWERS["qwen2_5_vl_7b"]
    geom = common.Geometry.of(spec.kind, spec.make_config(False))
    merge2 = geom.merge**2
    for request in big_trace[:500]:
        for v in request:
            t, h, w = common.packed_grid(v, geom, traffic.VIDEO_FRAME_MAX_TOKENS if v.is_video
                                         else traffic.IMAGE_MAX_TOKENS)
            cap = traffic.VIDEO_FRAME_MAX_TOKENS if v.is_video else traffic.IMAGE_MAX_TOKENS
            assert h % geom.merge == 0 and w % geom.merge == 0
            assert common.MIN_TOKENS <= h * w // merge2 <= cap
            assert t == (math.ceil(v.frames / geom.temporal_patch) if v.is_video else 1)
    summary = traffic.trace_summary(big_trace[:200], geom)
    assert summary["requests"] == 200 and summary["items"] == sum(len(r) for r in big_trace[:200])


# ---------------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("size, tower, grid", [
    ((224, 224), "qwen2_5_vl_7b", (1, 16, 16)),
    ((336, 336), "qwen3_vl_8b", (1, 20, 20)),  # 320 px: Python rounds half to even, as the processors do
    ((252, 448), "qwen3_vl_8b", (1, 16, 28)),
    ((10, 10), "qwen2_5_vl_7b", (1, 4, 4)),  # raised to MIN_TOKENS merged tokens
])
def test_packed_grid_rounds_like_the_processors(size, tower, grid):
    spec = common.TOWERS[tower]
    geom = common.Geometry.of(spec.kind, spec.make_config(False))
    assert common.packed_grid(Visual(*size), geom) == grid


def test_packed_grid_caps_the_area():
    spec = common.TOWERS["qwen2_5_vl_7b"]
    geom = common.Geometry.of(spec.kind, spec.make_config(False))
    t, h, w = common.packed_grid(Visual(3000, 4000), geom, 1280)
    assert t == 1 and h * w // 4 <= 1280 and abs(w / h - 4 / 3) < 0.1


def test_case_sizes_at_real_geometry():
    q25, siglip, intern = (common.TOWERS[n] for n in ("qwen2_5_vl_7b", "siglip_so400m_384", "internvit_300m"))
    g = common.Geometry.of(q25.kind, q25.make_config(False))
    by_name = {c.name: c for c in common.CASES}
    assert common.sizes_of(by_name["1x224"].visuals, g).patches == 256
    assert common.sizes_of(by_name["1x896"].visuals, g).tokens == 1024
    video = common.sizes_of(by_name["video8"].visuals, g)
    assert video.grids == ((4, 18, 32),)
    gs = common.Geometry.of(siglip.kind, siglip.make_config(False))
    assert common.sizes_of(by_name["1x896"].visuals, gs).tiles == 3 * 3 + 1
    assert common.sizes_of(by_name["video8"].visuals, gs).tiles == 8
    gi = common.Geometry.of(intern.kind, intern.make_config(False))
    assert common.sizes_of(by_name["1x896"].visuals, gi).tiles == 2 * 2 + 1
    assert common.sizes_of(by_name["8x336"].visuals, gi).tiles == 8


def test_floor_formula():
    assert common.floor_ms(10**9, 1000, 1000.0) == pytest.approx(2.0)


def test_max_rel_diff():
    import torch

    a = [{"x": torch.ones(2, 3)}, torch.zeros(1)]
    assert common.max_rel_diff(a, a) == 0.0
    b = [{"x": torch.ones(2, 3) * 1.01}, torch.zeros(1)]
    assert common.max_rel_diff(b, a) == pytest.approx(0.01, rel=1e-3)
    assert common.max_rel_diff(a[:1], a) == math.inf


def test_parse_lists_reject_unknown_names():
    import argparse

    assert common.parse_systems("graph,adapter_eager") == (System.GRAPH, System.ADAPTER_EAGER)
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_systems("graphs")
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_names(("a", "b"))("a,c")


# ---------------------------------------------------------------------------------------------------- scripts
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_as_a_script(script):
    done = subprocess.run([sys.executable, str(REPO / "benches" / f"{script}.py"), "--help"], capture_output=True,
                          text=True, timeout=60, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_run_all_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(REPO / "benches" / "run_all.sh")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_results")


def _load(directory: Path, script: str) -> dict:
    return json.loads((directory / f"{script}_{common.SMOKE_SLUG}.json").read_text())


def test_towers_smoke(smoke_dir):
    towers.main(FAST + ["--results-dir", str(smoke_dir)])
    data = _load(smoke_dir, "towers")
    assert (smoke_dir / f"towers_{common.SMOKE_SLUG}.md").exists()
    assert set(data["towers"]) == set(common.SMOKE_TOWERS)
    for tower in data["towers"].values():
        assert set(tower["cases"]) == set(common.SMOKE_CASES)
        for case in tower["cases"].values():
            systems = case["systems"]
            for s in (System.HF_SDPA, System.ADAPTER_EAGER, System.GRAPH):
                assert common.median_of(systems[s.value]) is not None, (s, systems[s.value])
            assert case["floor_ms"] > 0 and case["plan"]
            assert case["graph_vs_eager_max_rel_diff"] < 1e-3
            assert case["speedup"]["graph_vs_hf_sdpa"] > 0
    qwen = data["towers"]["qwen2_5_vl_7b"]["cases"]["1x224"]
    assert "needs CUDA" in qwen["systems"][System.COMPILE.value]["skipped"]  # a default compile case
    assert common.median_of(qwen["systems"][System.HF_VARLEN.value]) is not None
    assert qwen["patches"] == 256 and qwen["graph_stats"]["padded_share"] == 0.0


def test_towers_time_budget_skips_and_still_writes(tmp_path):
    data = towers.main(FAST + ["--results-dir", str(tmp_path), "--time-budget", "0", "--tag", "cut-1"])
    assert all(t["skipped"] == common.SKIPPED_TIME for t in data["towers"].values())
    written = json.loads((tmp_path / f"towers_{common.SMOKE_SLUG}_cut-1.json").read_text())
    assert written["towers"].keys() == data["towers"].keys()
    assert plot.find_slug(tmp_path) is None  # tagged and smoke runs are never picked by default


def test_traffic_smoke(smoke_dir):
    traffic.main(FAST + ["--results-dir", str(smoke_dir), "--requests", "6", "--warmup-requests", "1",
                         "--cost-samples", "3"])
    data = _load(smoke_dir, "traffic")
    assert data["trace"]["completed"] == 6
    graph = data["systems"][System.GRAPH.value]
    assert graph["requests"] == 6 and graph["errors"] == 0
    assert graph["p50_ms"] <= graph["p99_ms"] <= graph["max_ms"]
    assert "worst_ratio_vs_adapter_eager" in graph and 0 <= graph["slower_than_adapter_eager"] <= 6
    assert data["systems"][System.ADAPTER_EAGER.value]["requests"] == 6
    assert data["planning"].startswith("cost-aware (3 sample")
    assert data["costs"][System.GRAPH.value]["paths"]["default"]["graph_ms"]
    stats = data["graph_stats"][System.GRAPH.value]
    assert stats["items"] == sum(data["per_request"]["items"]) and 0 <= stats["padded_share"] < 1
    assert all(len(v) == 6 for v in data["per_request"]["latency_ms"].values())


def test_capture_smoke(smoke_dir):
    data = capture.main(FAST + ["--results-dir", str(smoke_dir)])
    for tower in data["towers"].values():
        assert tower["mode"] == "static" and tower["ladders"]["default"]
        assert tower["limits"]["max_items"] >= 1


def test_floor_smoke(smoke_dir, tmp_path):
    data = floor.main(FAST + ["--results-dir", str(smoke_dir), "--mirror-dir", str(tmp_path)])
    for suffix in (".json", ".md"):
        assert (tmp_path / f"floor_{common.SMOKE_SLUG}{suffix}").read_text() == (
            smoke_dir / f"floor_{common.SMOKE_SLUG}{suffix}").read_text()
    tflops = data["matmul"]["tflops"]
    assert tflops > 0
    for tower in data["towers"].values():
        for case in tower["cases"].values():
            assert case["floor_ms"] == pytest.approx(common.floor_ms(tower["params"], case["patches"], tflops),
                                                     abs=1e-4)


def test_plot_reads_the_smoke_results(smoke_dir):
    towers_json, traffic_json = _load(smoke_dir, "towers"), _load(smoke_dir, "traffic")
    bars = plot.speedups(towers_json)
    assert set(bars) == {common.TOWERS[n].label for n in common.SMOKE_TOWERS}
    lines = plot.cdfs(traffic_json)
    assert all(y[-1] == 1.0 and np.all(np.diff(x) >= 0) for x, y in lines.values())
    written = plot.main(["--cpu-smoke", "--results-dir", str(smoke_dir)])
    if importlib.util.find_spec("matplotlib") is None:
        assert written == []
    else:
        assert written and all(p.exists() and p.stat().st_size > 0 for p in written)


def test_compiled_static_adapter_runs_the_same_plan(monkeypatch):
    """The compile system's plumbing (torch.compile itself needs a GPU here): a STATIC runner over
    ``CompiledStatic`` gives the adapter's eager results."""
    import argparse

    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    env = common.make_env(argparse.Namespace(cpu_smoke=True, runs=1, warmup=0, seed=0))
    with common.inference():
        bench = common.TowerBench(common.TOWERS["qwen2_5_vl_7b"], env, (System.ADAPTER_EAGER, System.COMPILE))
        bench.unavailable.pop(System.COMPILE)
        inputs = bench.inputs([Visual(56, 84), Visual(28, 28)])
        got = bench.call(System.COMPILE, inputs)()
        ref = bench.call(System.ADAPTER_EAGER, inputs)()
    assert common.max_rel_diff(got, ref) < 1e-4
    assert isinstance(bench.runner(System.COMPILE).adapter, common.CompiledStatic)


def test_compiled_systems_bookkeeping(tmp_path, monkeypatch):
    """Phase 2 of ``towers.py`` (CUDA only) with the device faked: ``compile`` through a STATIC runner with an
    identity ``torch.compile``; ``graph_compile`` needs GRAPH mode, so its failure must be recorded per case."""
    import torch

    args = towers.build_parser().parse_args(FAST + ["--results-dir", str(tmp_path), "--towers", "qwen2_5_vl_7b",
                                                   "--cases", "1x224", "--systems", "adapter_eager,graph"])
    common.smoke_defaults(args, towers=tuple(common.TOWERS))
    env = common.make_env(args)
    results = common.Results("towers", args, env)
    results.data.update(towers.main(FAST + ["--results-dir", str(tmp_path), "--towers", "qwen2_5_vl_7b",
                                            "--cases", "1x224", "--systems", "adapter_eager,graph"]))
    monkeypatch.setattr(common.Env, "cuda", property(lambda self: True))
    monkeypatch.setattr(common, "time_once", lambda fn, env: (fn(), 1.0)[1])
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with common.inference():
        towers.run_compile("qwen2_5_vl_7b", [common.CASES[0]], [System.COMPILE, System.GRAPH_COMPILE], env,
                           common.Deadline(600), args, results)
    case = _load(tmp_path, "towers")["towers"]["qwen2_5_vl_7b"]["cases"]["1x224"]
    assert case["systems"]["compile"]["median_ms"] == 1.0
    info = case["compile_info"]["compile"]
    assert info["graphs_compiled"] == 0 and info["max_rel_diff_vs_adapter_eager"] < 1e-4
    assert "compile or capture failed" in case["systems"]["graph_compile"]["skipped"]
    assert case["speedup"]["compile_vs_adapter_eager"] > 0
    assert "first call" in towers.render(results.data, tuple(System))


# ---------------------------------------------------------------------------------------------------- kernel profile
@pytest.mark.parametrize("name, kind", [
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>", "matmul"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
    ("void implicit_convolveNd_sgemm<__nv_bfloat16, 3, 128>", "convolution"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128>>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_9", "fused (triton)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copy / cast"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps>>", "reduction / norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "element-wise"),
    ("Memcpy HtoD (Pinned -> Device)", "copy / cast"),
    ("some_custom_kernel", "other"),
])
def test_kernel_categories(name, kind):
    assert kernel_profile.category(name) == kind


def test_kernel_profile_summary_and_table():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 300.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0},  # host ops are not device time
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]}
    records = kernel_profile.device_records(trace)
    assert len(records) == 4
    s = kernel_profile.summarize(records, calls=2, median_ms=0.5)
    assert s["kernel_ms"] == pytest.approx(0.23) and s["idle_ms"] == pytest.approx(0.27)
    assert s["kernels"] == 2.0
    assert list(s["categories"]) == ["matmul", "attention", "copy / cast"]
    assert s["categories"]["matmul"] == {"ms": 0.2, "kernels": 1.0}
    assert s["top"][0] == {"name": "nvjet_sm90_gemm", "ms": 0.2, "calls": 1.0}
    data = {"tower": {"label": "T"}, "environment": {"gpu": "G"},
            "cases": {"1x224": {"floor_ms": 0.25, "systems": {"graph": s, "graph_compile": {"skipped": "skipped: x"}},
                                "patch_embed": {"rows": 256, "conv_ms": 0.2, "linear_ms": 0.03, "max_abs_diff": 0.0}}}}
    table = kernel_profile.render(data)
    assert "| 1x224 | graph | 0.50 | 0.23 | 0.27 | 2.00 | matmul 0.20, attention 0.03, copy / cast 0.01 | 2.00 |" in table
    assert "| 1x224 | graph_compile | skipped |" in table
    assert "| 1x224 | 256 | 0.20 | 0.03 | 0 |" in table


def test_kernel_profile_refuses_the_cpu_smoke():
    with pytest.raises(SystemExit, match="no CPU smoke"):
        kernel_profile.main(["--cpu-smoke"])
