"""Compile once, capture many, start fast (issue 13 point 3): the default ``compile="auto"`` runner on the
Qwen2.5-VL-7B tower (depth 32, bf16, random weights) against per-budget static compilation.

Measures, in one run on one GPU:

- **cold**: ``EncoderGraphRunner(wrap(tower)).capture()`` with an empty compile cache (a fresh
  ``ENCGRAPH_CACHE_DIR``): wall seconds, first-compile seconds, Dynamo's graph count (one compilation should
  serve every budget of the dense default ladder), self-check and cost-model seconds, pool and largest graph;
- **warm**: the same in a second, fresh Python process on the same machine with the same cache directory;
- **replay**: median replay time (CUDA events) of the dynamic compiled graphs at a few budgets against graphs of
  the same static forward compiled per budget (``torch.compile(dynamic=False)``, what ``compile=True`` did
  before), and against plain (uncompiled) graphs;
- **ladders**: plain graphs of the old doubling ladder and of the dense default: graphs, capture seconds, pool.

Writes ``benches/results/compile_start_<gpu>.json`` and ``.md`` (and under ``$OUT/results`` when set). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.env import cuda_env
from benches.lib.timing import time_call

REPO = Path(__file__).resolve().parents[1]
TIMED = 30


def qwen2_5_vl_7b(depth: int) -> Any:
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(
        depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
        window_size=112, spatial_merge_size=2, temporal_patch_size=2,
        fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < depth],
    )
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16)
    return tower.cuda().eval()


def median_replay_ms(graph: Any, inputs: dict[str, Any], fill: Any = None) -> float:
    if fill is not None:
        fill()  # every row of the budget's views (padding): indices of another batch would be out of bounds
    for t in inputs.values():
        if t.is_floating_point():
            t.normal_()
    return time_call(graph.replay, cuda_env(TIMED, warmup=3)).summary()["median_ms"]


def capture_default(depth: int, **options: Any) -> dict[str, Any]:
    """Build the tower and capture a runner with ``options``; the capture summary and wall seconds."""
    import torch

    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.models import wrap

    tower = qwen2_5_vl_7b(depth)
    runner = EncoderGraphRunner(wrap(tower), **options)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    info = runner.capture()
    wall = time.perf_counter() - t0
    return {"runner": runner, "wall_seconds": wall, "info": info}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    info = result["info"]
    return {
        "wall_seconds": round(result["wall_seconds"], 2),
        "graphs": info["graphs"],
        "ladder": list(result["runner"].ladders["default"]),
        "compile": info.get("compile"),
        "selfcheck_seconds": info.get("selfcheck", {}).get("seconds"),
        "costs": info.get("costs"),
        "pool_mib": round(info.get("pool_bytes", 0) / 2**20, 1),
        "largest_graph_mib": round(info.get("largest_graph_bytes", 0) / 2**20, 1),
        "output_mib": round(info.get("output_bytes", 0) / 2**20, 1),
        "failed": info.get("failed"),
    }


def child(depth: int) -> None:
    """The warm run: a fresh process, the parent's cache directory (from the environment)."""
    result = capture_default(depth)
    print("CHILD_RESULT " + json.dumps(summary(result), default=str))


def per_budget_static(runner: Any, budgets: list[int]) -> dict[int, dict[str, float]]:
    """Graphs of the same static forward compiled per budget (dynamic=False), as compile=True did before."""
    import torch
    import torch._dynamo

    out: dict[int, dict[str, float]] = {}
    adapter = runner.adapter
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    for budget in budgets:
        views = runner.buffers["default"].fill(budget, None)
        fn = torch.compile(lambda bufs, b=budget: adapter.forward_static("default", bufs, b), dynamic=False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn(views)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
            fn(views)
        torch.cuda.synchronize()
        out[budget] = {
            "compile_seconds": round(compile_s, 2),
            "replay_ms": median_replay_ms(graph, views, lambda b=budget: runner.buffers["default"].fill(b, None)),
        }
        del graph
    return out


def warm_start(depth: int) -> dict[str, Any]:
    """The cold capture again in a second, fresh process sharing the compile cache (``ENCGRAPH_CACHE_DIR``)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", "--depth", str(depth)],
        capture_output=True, text=True, env=dict(os.environ), cwd=str(REPO), timeout=300,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("CHILD_RESULT ")), None)
    warm = json.loads(line.split(" ", 1)[1]) if line else {"error": proc.stderr[-2000:]}
    warm["process_seconds"] = round(time.perf_counter() - t0, 2)
    return warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--budgets", default="256,1088,4096", help="budgets whose replays are compared")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-static", action="store_true", help="skip the per-budget static compiles")
    parser.add_argument("--skip-warm", action="store_true", help="skip the second-process (warm cache) capture")
    parser.add_argument("--skip-ladders", action="store_true", help="skip the plain doubling ladder's capture")
    args = parser.parse_args()
    if args.child:
        child(args.depth)
        return
    import torch

    from encgraph.packing import budget_ladder

    cache = tempfile.mkdtemp(prefix="encgraph-cache-")
    os.environ["ENCGRAPH_CACHE_DIR"] = cache
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    os.environ.pop("TRITON_CACHE_DIR", None)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "depth": args.depth}
    import transformers

    results["transformers"] = transformers.__version__
    cold = capture_default(args.depth)
    results["cold"] = summary(cold)
    print("cold:", json.dumps(results["cold"], default=str), flush=True)
    write(results)  # after every stage: a run cut short keeps what it measured
    if args.skip_warm:
        results["warm"] = {"skipped": "--skip-warm"}
    else:
        results["warm"] = warm_start(args.depth)
        print("warm:", json.dumps(results["warm"], default=str), flush=True)
        write(results)

    runner = cold["runner"]
    budgets = [int(b) for b in args.budgets.split(",")]
    results["replay_ms"] = {"dynamic_compiled": {}, "plain": {}, "static_compiled": {}}
    for b in budgets:
        record = runner.records["default"].get(b)
        if record is not None:
            results["replay_ms"]["dynamic_compiled"][b] = median_replay_ms(
                record.graph, record.inputs, lambda b=b: runner.buffers["default"].fill(b, None))
    plain = capture_default(args.depth, compile=False, costs=False, verify=False)
    for b in budgets:
        record = plain["runner"].records["default"].get(b)
        if record is not None:
            results["replay_ms"]["plain"][b] = median_replay_ms(
                record.graph, record.inputs, lambda b=b, r=plain["runner"]: r.buffers["default"].fill(b, None))
    results["ladders"] = {"dense_plain": summary(plain)}
    write(results)
    if not args.skip_static:
        # On the plain runner's adapter: the regional compile of the cold runner must not be traced into.
        results["static_compiled"] = per_budget_static(plain["runner"], budgets)
        results["replay_ms"]["static_compiled"] = {b: v["replay_ms"] for b, v in results["static_compiled"].items()}
        write(results)
    del plain
    torch.cuda.empty_cache()
    if not args.skip_ladders:
        doubling = capture_default(args.depth, compile=False, costs=False, verify=False,
                                   budgets=budget_ladder(64, 4096))
        results["ladders"]["doubling_plain"] = summary(doubling)
        write(results)
        del doubling
        torch.cuda.empty_cache()


def write(results: dict[str, Any]) -> None:
    slug = results["gpu"].lower().replace(" ", "-")
    lines = [
        f"# Compile once, capture many ({results['gpu']}, torch {results['torch']}, transformers "
        f"{results['transformers']}, Qwen2.5-VL-7B tower depth {results['depth']})",
        "",
        "| start | wall s | graphs | first compile s | dynamo graphs | self-check + costs s | pool MiB | largest MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("cold", "warm"):
        r = results.get(name, {})
        comp = r.get("compile") or {}
        lines.append(
            f"| {name} | {r.get('wall_seconds')} | {r.get('graphs')} | {comp.get('first_compile_seconds')} | "
            f"{(comp.get('dynamo') or {}).get('unique_graphs')} | {r.get('selfcheck_seconds')} | {r.get('pool_mib')} | "
            f"{r.get('largest_graph_mib')} |"
        )
    lines += ["", "| budget | dynamic compiled ms | per-budget static compiled ms | plain ms |", "|---|---|---|---|"]
    rep = results.get("replay_ms", {})
    for b in sorted(rep.get("dynamic_compiled", {})):
        lines.append(
            f"| {b} | {rep['dynamic_compiled'].get(b, float('nan')):.3f} | "
            f"{rep.get('static_compiled', {}).get(b, float('nan')):.3f} | {rep.get('plain', {}).get(b, float('nan')):.3f} |"
        )
    lines += ["", "| ladder (plain graphs) | graphs | capture s | pool MiB | largest MiB |", "|---|---|---|---|---|"]
    for name, r in results.get("ladders", {}).items():
        lines.append(f"| {name} | {r['graphs']} | {r['wall_seconds']} | {r['pool_mib']} | {r['largest_graph_mib']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    for base in [REPO / "benches" / "results"] + ([Path(os.environ["OUT"]) / "results"] if os.environ.get("OUT") else []):
        base.mkdir(parents=True, exist_ok=True)
        (base / f"compile_start_{slug}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (base / f"compile_start_{slug}.md").write_text(text)


if __name__ == "__main__":
    main()
