"""Every benchmark script's ``--help`` and ``--cpu-smoke`` run (tiny towers, runner STATIC mode), so that a script
is known to run before it reaches the GPU; the README's blocks render from the results; the compile systems'
bookkeeping with the device faked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import pytest

pytest.importorskip("transformers")

from benches import capture, floor, plot, readme, towers, traffic  # noqa: E402
from benches.lib import cases, cli, compiled, outputs, plots_models, plots_registry, timing  # noqa: E402
from benches.lib.cases import Visual  # noqa: E402
from benches.lib.env import Deadline, inference, make_env  # noqa: E402
from benches.lib.results import SMOKE_SLUG, Results, median_of  # noqa: E402
from benches.lib.systems import System, TowerBench  # noqa: E402
from benches.lib.timing import floor_ms, time_once  # noqa: E402
from benches.lib.towers import FAMILY_TOWERS, SMOKE_TOWERS, TOWERS  # noqa: E402
from tests.unit._helpers import smoke_env  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("towers", "traffic", "capture", "floor", "plot", "kernel_profile", "planning", "data_parallel", "anymodule",
           "generic_compile", "preprocess_exactness", "wrap_cost", "device_preprocess")
FAST = ["--cpu-smoke", "--runs", "1", "--warmup", "0"]


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
    return json.loads((directory / f"{script}_{SMOKE_SLUG}.json").read_text())


def test_towers_smoke(smoke_dir):
    towers.main(FAST + ["--results-dir", str(smoke_dir)])
    data = _load(smoke_dir, "towers")
    assert (smoke_dir / f"towers_{SMOKE_SLUG}.md").exists()
    assert set(data["towers"]) == set(SMOKE_TOWERS)
    for tower in data["towers"].values():
        assert set(tower["cases"]) == set(cases.SMOKE_CASES)
        assert tower["defaults_capture"]["mode"] == "eager"  # graphed(tower)'s CPU default: the eager forward
        for case in tower["cases"].values():
            systems_ = case["systems"]
            for s in (System.HF_SDPA, System.ADAPTER_EAGER, System.GRAPH, System.DEFAULTS):
                assert median_of(systems_[s.value]) is not None, (s, systems_[s.value])
            assert case["floor_ms"] > 0 and case["plan"]
            assert case["graph_vs_eager_max_rel_diff"] < 1e-3
            assert case["speedup"]["graph_vs_hf_sdpa"] > 0 and case["speedup"]["defaults_vs_hf_sdpa"] > 0
            assert 0 <= case["defaults_stats"]["padded_share"] < 1
            assert "defaults_vs_hf_sdpa_max_rel_diff" in case
    qwen = data["towers"]["qwen2_5_vl_7b"]["cases"]["1x224"]
    assert "needs CUDA" in qwen["systems"][System.COMPILE.value]["skipped"]  # a default compile case
    assert median_of(qwen["systems"][System.HF_VARLEN.value]) is not None
    assert qwen["patches"] == 256 and qwen["graph_stats"]["padded_share"] == 0.0


def test_towers_smoke_families(tmp_path, monkeypatch):
    """Every family row on its first case through hf_sdpa, defaults and adapter_eager (tiny widths, real patch
    sizes), the family table rendered; a row the installed transformers is too old for is reported, not raised.
    ``defaults`` is graphed(tower) as a user gets it: on the CPU, the adapter's eager forward (nothing captured)."""
    future = attrs.evolve(TOWERS["llama4"], name="future_family", transformers="99.0")
    monkeypatch.setitem(towers.TOWERS, "future_family", future)
    data = towers.main(FAST + ["--results-dir", str(tmp_path), "--towers", ",".join((*FAMILY_TOWERS, "future_family")),
                               "--cases", "1x448", "--systems", "hf_sdpa,defaults,adapter_eager"])
    assert "needs transformers >= 99.0" in data["towers"]["future_family"]["skipped"]
    for name in FAMILY_TOWERS:
        case = data["towers"][name]["cases"]["1x448"]
        for s in ("hf_sdpa", "defaults", "adapter_eager"):
            assert median_of(case["systems"][s]) is not None, (name, s, case["systems"][s])
        assert case["defaults_vs_hf_sdpa_max_rel_diff"] < 1e-4, name
        # On a CPU graphed() defaults are the tower's own forward (no graphs to gain), each call counted as such; a
        # family benchmarked through its shim runs its runner's eager forward.
        defaults = case["defaults_stats"]
        assert case["speedup"]["defaults_vs_hf_sdpa"] > 0
        assert defaults["stock_calls"] >= 1 or defaults["eager_items_per_call"] >= 1, (name, defaults)
    assert data["towers"]["step3p7"]["cases"]["1x448"]["crops"] == [0]
    table = (tmp_path / f"towers_{SMOKE_SLUG}.md").read_text()
    assert "## towers, the newer families: HF sdpa vs encgraph defaults" in table
    assert "| Gemma-4 vision tower | 1x448 | 1 | 2304 | 256 |" in table


def test_towers_render_marks_what_was_not_measured():
    data = {"environment": {"gpu": "G", "dtype": "bf16"}, "matmul": {"tflops": 1.0},
            "towers": {"minicpmv4_6": {"label": "M", "cases": {"1x896": {"skipped": "n/a: slices"}}},
                       "gemma4": {"label": "G4", "skipped": "error: build failed (X)"}}}
    text = towers.render(data, (System.HF_SDPA, System.DEFAULTS))
    assert "| M | 1x896 | n/a: slices |" in text and "| G4 | error: build failed (X) |" in text
    assert "## towers: median latency" not in text  # no seed tower in this run


def test_towers_time_budget_skips_and_still_writes(tmp_path):
    data = towers.main(FAST + ["--results-dir", str(tmp_path), "--time-budget", "0", "--tag", "cut-1"])
    assert all(t["skipped"] == "skipped: time budget spent" for t in data["towers"].values())
    written = json.loads((tmp_path / f"towers_{SMOKE_SLUG}_cut-1.json").read_text())
    assert written["towers"].keys() == data["towers"].keys()
    assert plot.find_slug(tmp_path) is None  # tagged and smoke runs are never picked by default


def test_traffic_smoke(smoke_dir):
    """One tower, every default system, the warm capture in a second process, a time box that cuts
    hf_compile_dynamic off; plus the graph runner planned with a cost model on a small ladder."""
    traffic.main(FAST + ["--results-dir", str(smoke_dir), "--towers", "qwen2_5_vl_7b", "--requests", "5",
                         "--warmup-requests", "1", "--compile-dynamic-cap", "1",
                         "--systems", "hf_sdpa,defaults,hf_compile_dynamic,adapter_eager,graph,defaults_varlen",
                         "--budgets", "16,32,64", "--cost-samples", "2"])
    data = _load(smoke_dir, "traffic")
    doc = data["towers"]["qwen2_5_vl_7b"]
    assert doc["trace"]["completed"] == 5 and doc["baseline"] == "hf_sdpa"
    for s in ("hf_sdpa", "defaults", "adapter_eager", "graph", "defaults_varlen"):
        e = doc["systems"][s]
        assert e["requests"] == 5 and e["errors"] == 0, (s, e)
        assert e["p50_ms"] <= e["p99_ms"] <= e["max_ms"]
    d = doc["systems"]["defaults"]
    assert 0 <= d["slower_than_hf_sdpa"] <= 5 and d["worst_ratio_vs_hf_sdpa"] > 0 and "speedup_p99_vs_hf_sdpa" in d
    assert "slower_than_adapter_eager" in d
    stats = doc["graph_stats"]["defaults"]
    # On a CPU the defaults are the tower's own forward (no graphs to gain): every request counted as such.
    assert stats["items"] == 0 and stats["stock_calls"] >= len(doc["per_request"]["items"]) and stats["padded_share"] == 0
    # The cost model may send all of it eagerly.
    assert doc["graph_stats"]["graph"]["items"] == sum(doc["per_request"]["items"])
    routes = doc["per_request"]["routes"]
    assert set(routes) == {"defaults", "defaults_varlen", "graph"} and all(len(v) == 5 for v in routes.values())
    assert doc["capture"]["defaults_varlen"]["kernels"] is not None  # captured as defaults are, measured alike
    for r, n in zip(routes["graph"], doc["per_request"]["items"]):  # every item replayed or eager, per request
        assert sum(r["eager"].values()) <= n and (r["replays"] or r["eager"]), r
    assert doc["costs"]["graph"]["paths"]["default"]["graph_ms"]
    cold, warm = doc["startup"]["cold"], doc["startup"]["warm"]
    assert cold["capture_seconds"] >= 0 and cold["capture_info"]["mode"] == "eager"  # the CPU default
    assert "error" not in warm, warm
    assert warm["capture_seconds"] >= 0 and warm["process_seconds"] >= warm["capture_seconds"]
    comp = doc["compile_dynamic"]
    # The box cannot interrupt a compile in progress: the first call overruns the 1 s cap by one compile of the
    # tiny tower (about 10 s on 2 idle cores, 22-31 s measured with another test run on the same cores).
    assert comp["cap_seconds"] == 1 and comp["stopped"] and comp["used_seconds"] < 60
    assert doc["systems"]["hf_compile_dynamic"]["requests"] < 5
    assert all(len(v) == 5 for v in doc["per_request"]["latency_ms"].values())
    assert {t["target"] for t in doc["targets"]} >= {"mean speedup vs HF sdpa", "warm capture s (second process)"}
    table = (smoke_dir / f"traffic_{SMOKE_SLUG}.md").read_text()
    assert "### encgraph defaults vs Hugging Face, per tower" in table and "(target >= 2.5x)" in table
    assert "### targets (issue 13)" in table and "HF + torch.compile(dynamic=True): " in table


def test_traffic_refuses_the_compile_system():
    with pytest.raises(SystemExit, match="compile is not offered"):
        traffic.main(FAST + ["--systems", "compile"])


def test_capture_smoke(smoke_dir):
    from encgraph.packing import budget_ladder

    data = capture.main(FAST + ["--results-dir", str(smoke_dir)])
    for tower in data["towers"].values():
        assert tower["mode"] == "static" and tower["ladders"]["default"]
        assert tower["limits"]["max_items"] >= 1 and tower["runner_options"] == {"compile": False, "mode": "static"}
        doubling = tower["doubling"]
        ladder = doubling["ladders"]["default"]
        assert doubling["runner_options"]["budgets"]["default"] == ladder
        assert tuple(ladder) == budget_ladder(ladder[0], ladder[-1]) and len(ladder) >= 2
    text = (smoke_dir / f"capture_{SMOKE_SLUG}.md").read_text()
    assert text.count("| doubling |") == len(data["towers"]) and text.count("| default |") == len(data["towers"])


def test_floor_smoke(smoke_dir, tmp_path):
    data = floor.main(FAST + ["--results-dir", str(smoke_dir), "--mirror-dir", str(tmp_path)])
    for suffix in (".json", ".md"):
        assert (tmp_path / f"floor_{SMOKE_SLUG}{suffix}").read_text() == (
            smoke_dir / f"floor_{SMOKE_SLUG}{suffix}").read_text()
    tflops = data["matmul"]["tflops"]
    assert tflops > 0
    for tower in data["towers"].values():
        for case in tower["cases"].values():
            assert case["floor_ms"] == pytest.approx(floor_ms(tower["params"], case["patches"], tflops), abs=1e-4)


def test_plot_reads_the_smoke_results(smoke_dir):
    towers_json, traffic_json = _load(smoke_dir, "towers"), _load(smoke_dir, "traffic")
    bars = plots_models.speedups(towers_json)
    assert set(bars) == {TOWERS[n].label for n in SMOKE_TOWERS}
    lines = plots_models.traffic_lines(traffic_json)
    ((baseline, latency, ratios),) = lines.values()
    assert baseline == "hf_sdpa" and "defaults" in ratios and "hf_sdpa" not in ratios
    assert all(y[-1] == 1.0 and np.all(np.diff(x) >= 0) for x, y in latency.values())
    written = plot.main(["--cpu-smoke", "--results-dir", str(smoke_dir), "--dpi", "30"])
    if importlib.util.find_spec("matplotlib") is None:
        assert written == []
    else:  # every smoke result of this module's scripts is drawn: their charts read the smoke's layout too
        smoke = sorted(smoke_dir.glob(f"*_{SMOKE_SLUG}*.json"))
        assert len(smoke) >= 2 and sorted(written) == sorted(plots_registry.parse(p).png for p in smoke)
        assert all(p.stat().st_size > 0 for p in written)


def test_readme_blocks_are_rendered_from_the_committed_results():
    """The README's Benchmarks figures are the committed JSON's, rendered: none typed by hand."""
    assert readme.main(["--check"]) == 0


def test_readme_renders_a_traffic_run_with_defaults(smoke_dir):
    if not (smoke_dir / f"traffic_{SMOKE_SLUG}.json").exists():
        pytest.skip("reads test_traffic_smoke's results (run the whole file)")
    text = "".join(f"<!-- benches/readme.py: {n} -->\nstale\n<!-- end {n} -->\n" for n in readme.BLOCKS)
    new = readme.update(text, smoke_dir, SMOKE_SLUG)
    block = new.split("<!-- benches/readme.py: traffic -->")[1].split("<!-- end traffic -->")[0]
    assert "stale" not in new and "(target >= 2.5x)" in block and "Qwen2.5-VL-7B tower" in block
    assert "mean speedup vs HF sdpa" in block and f"traffic_{SMOKE_SLUG}.json" in block
    bare = smoke_dir / "no-blocks.md"
    bare.write_text("no blocks\n")
    assert readme.main(["--check", "--readme", str(bare)]) == 1


def test_compiled_static_adapter_runs_the_same_plan(monkeypatch):
    """The compile system's plumbing (torch.compile itself needs a GPU here): a STATIC runner over
    ``CompiledStatic`` gives the adapter's eager results."""
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with inference():
        bench = TowerBench(TOWERS["qwen2_5_vl_7b"], smoke_env(), (System.ADAPTER_EAGER, System.COMPILE))
        bench.unavailable.pop(System.COMPILE)
        inputs = bench.inputs([Visual(56, 84), Visual(28, 28)])
        got = bench.call(System.COMPILE, inputs)()
        ref = bench.call(System.ADAPTER_EAGER, inputs)()
    assert outputs.max_rel_diff(got, ref) < 1e-4
    assert isinstance(bench.runner(System.COMPILE).adapter, compiled.CompiledStatic)


def test_compiled_systems_bookkeeping(tmp_path, monkeypatch):
    """Phase 2 of ``towers.py`` (CUDA only) with the device faked: ``compile`` through a STATIC runner with an
    identity ``torch.compile``; ``graph_compile`` needs GRAPH mode, so its failure must be recorded per case."""
    import torch

    from benches.lib import env as env_module

    argv = FAST + ["--results-dir", str(tmp_path), "--towers", "qwen2_5_vl_7b", "--cases", "1x224",
                   "--systems", "adapter_eager,graph"]
    args = towers.build_parser().parse_args(argv)
    cli.smoke_defaults(args, towers=tuple(TOWERS))
    env = make_env(args)
    results = Results("towers", args, env)
    results.data.update(towers.main(argv))
    monkeypatch.setattr(env_module.Env, "cuda", property(lambda self: True))
    for module in (towers, timing):  # towers.py times first calls itself, measure() through timing
        monkeypatch.setattr(module, "time_once", lambda fn, env: (fn(), 1.0)[1])
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with inference():
        towers.run_compile("qwen2_5_vl_7b", [cases.CASES[0]], [System.COMPILE, System.GRAPH_COMPILE], env,
                           Deadline(600), args, results)
    case = _load(tmp_path, "towers")["towers"]["qwen2_5_vl_7b"]["cases"]["1x224"]
    assert case["systems"]["compile"]["median_ms"] == 1.0
    info = case["compile_info"]["compile"]
    assert info["graphs_compiled"] == 0 and info["max_rel_diff_vs_adapter_eager"] < 1e-4
    assert "compile or capture failed" in case["systems"]["graph_compile"]["skipped"]
    assert case["speedup"]["compile_vs_adapter_eager"] > 0
    assert "first call" in towers.render(results.data, tuple(System))


def test_time_once_measures_wall_time_on_the_cpu():
    assert time_once(lambda: time.sleep(0.02), smoke_env()) >= 19.0


def test_anymodule_renders_every_system_and_the_skipped_modules():
    from benches import anymodule

    batches = {n: {"eager": 2.0 * n, "reduce_overhead": 1.0 * n, "encgraph": 0.5 * n} for n in anymodule.BATCHES}
    batches[32]["encgraph_ran"] = {"default replay 32": 20}
    system = {"seconds": 1.0, "frames_compiled": 1, "recompiles": 0, "peak_mib": 10.0, "held_mib": 1.0}
    stream = {s: {"mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0} for s in anymodule.SYSTEMS}
    stream.update(encgraph_worst_vs_eager=1.5, encgraph_worst_vs_reduce_overhead=0.9, requests=3, recompiles_during=0)
    doc = {"environment": {"gpu": "GPU", "torch": "2.11", "transformers": "5.25", "date": "2026-12-06", "commit": "abc"},
           "models": {"vit_b16_hf": {"batches": batches, "warmup": dict.fromkeys(anymodule.SYSTEMS, system),
                                     "stream": stream, "max_item_rel_diff": 1e-3, "encgraph_stats": {"calls": 3},
                                     "profile": {8: {"encgraph": {
                                         "median_ms": 1.5, "kernel_ms": 1.2, "idle_ms": 0.3, "kernels": 90.0,
                                         "categories": {"matmul": {"ms": 0.8, "kernels": 48.0}},
                                         "replay": {"replays": 1.0, "replay_gap_ms": 0.05}}}}},
                      "dinov2_l14": {"skipped": "skipped: time budget spent"}}}
    doc["models"]["vit_b16_hf"]["warmup"]["encgraph"] = {**system, "at_peak": {
        "peak_mib": 12.5, "live": 4, "unknown_frees": 0, "sites": [["forward (vit/modeling_vit.py:10)", 8.0, 3],
                                                                  ["(other)", 4.5, 1]]}}
    table = anymodule.render(doc)
    assert ("- vit_b16_hf, encgraph.graphed(module), alive at its warm-up's allocated peak (12.5 MiB over the "
            "recording, 4 blocks; 0 frees of older blocks): forward (vit/modeling_vit.py:10) 8.0 MiB (3); (other) "
            "4.5 MiB (1)") in table
    assert ("- vit_b16_hf at batch 8, encgraph.graphed(module): median 1.5 ms, kernels 1.2 ms (90.0 a call), GPU "
            "idle 0.3 ms; matmul 0.8; replay") in table
    assert "| vit_b16_hf | 32 | 64.0 | 32.0 | 16.0 | 4.00x | 2.00x | default replay 32 x20 |" in table
    assert "| vit_b16_hf | 1 | 2.0 | 1.0 | 0.5 | 4.00x | 2.00x | - |" in table
    assert "| dinov2_l14 | - | skipped: time budget spent | | | | | |" in table
    assert 'torch.compile(mode="reduce-overhead")' in table and "worst per-request ratio" in table


def test_anymodule_counts_what_encgraph_ran_from_its_stats():
    from benches import anymodule

    stats = {"paths": {"default": {"replays": {16: 3, 32: 2}, "eager_items": 5}}}
    assert anymodule.replay_counts(stats) == {"default replay 16": 3, "default replay 32": 2,
                                              "default eager items": 5}
    assert anymodule.replay_counts({}) == {}


def test_wrap_cost_measures_both_sides_of_every_case(tmp_path):
    """``benches/wrap_cost.py`` on a few calls: every tower, batch and grad mode, both sides timed, the target
    judged from the measured medians (not written in), and the first call of each tower."""
    from benches import wrap_cost

    report = wrap_cost.main(["--calls", "3", "--warmup", "1", "--first", "1", "--batches", "1",
                             "--out", str(tmp_path / "wrap_cost_cpu.json")])
    rows = report["results"]
    assert [(r["tower"], r["grad"]) for r in rows] == [
        ("siglip", "no_grad"), ("siglip", "inference_mode"), ("clip", "no_grad"), ("clip", "inference_mode")]
    for r in rows:
        assert r["module_us"] > 0 and r["wrapped_us"] > 0
        assert r["met"] == (r["wrapped_us"] <= 1.1 * r["module_us"] + 50)
    assert all("first_wrapped_us" in r for r in rows if r["grad"] == "inference_mode")
    assert (tmp_path / "wrap_cost_cpu.md").exists()


def test_readme_anymodule_block_takes_the_latest_untagged_run(tmp_path):
    """A tagged any-module run (a change measured on part of the modules) never replaces the README's table, and
    of the untagged runs the latest by date wins, whatever the files' times (a clone sets them all alike)."""
    import json

    from benches import readme

    def doc(date, module):
        batch = {"eager": 2.0, "reduce_overhead": 1.0, "encgraph": 0.5}
        stream = {s: {"mean_ms": 1.0} for s in ("eager", "reduce_overhead", "encgraph")}
        stream.update(encgraph_worst_vs_eager=1.0, encgraph_worst_vs_reduce_overhead=1.0)
        return {"environment": {"gpu": "G", "torch": "t", "transformers": "x", "date": date},
                "models": {module: {"batches": {"1": batch, "32": batch}, "stream": stream,
                                    "warmup": {"reduce_overhead": {"seconds": 1.0}, "encgraph": {"seconds": 1.0}}}}}

    for name, date, module in (("anymodule_gpu-b.json", "2026-12-07", "newest_untagged"),
                               ("anymodule_gpu-a.json", "2026-12-01", "older"),
                               ("anymodule_gpu-b_part.json", "2026-12-09", "tagged")):
        (tmp_path / name).write_text(json.dumps(doc(date, module)))
    block = readme.anymodule_block(tmp_path, "gpu-b")
    assert "newest_untagged" in block and "anymodule_gpu-b.json" in block
    assert "tagged" not in block.replace("newest_untagged", "") and "older" not in block
