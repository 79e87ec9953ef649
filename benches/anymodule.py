"""Any module, wrapped with ``encgraph.graphed(module)`` and no options, against what its user would run instead
(issue 55 point 5): the module's own eager forward and ``torch.compile(module, mode="reduce-overhead")``.

Modules (random weights at each model's released geometry, bf16, one GPU), most important first: ViT-B/16 224
(Hugging Face ``ViTModel`` and timm ``vit_base_patch16_224``), ConvNeXt-B 224 (HF), DINOv2-L/14 224 (HF),
CLIP-L/14 336 (HF ``CLIPVisionModel``: encgraph's CLIP adapter) and SigLIP-so400m 384 (HF: its SigLIP adapter). Per
module, the three systems side by side in one process, each on a copy of its own:

- **warm-up**: wall seconds of the calls each system needs before its timings are steady: every batch size of
  1, 2, 4, 8, 16, 32 called three times in turn (reduce-overhead compiles on a new shape, recompiles with dynamic
  shapes on the second, records a CUDA graph per shape; encgraph answers a shape's first call with the module and
  captures its ladder on the second), with Dynamo's frames compiled and recompiles counted, and the peak memory
  the system held;
- **fixed batch sizes**: median latency of 20 calls per batch size (each call timed to completion, the systems
  interleaved call by call);
- **stream**: a seeded stream of requests mixing those batch sizes, each request through every system in turn:
  mean, P50, P99, the worst per-request ratio, recompiles during the stream;
- the per-item agreement of encgraph's outputs with the eager module's on one batch;
- each warm-up starts with the calling stream's cuBLAS workspaces allocated (``calling_stream_workspace``);
- with ``--memory-history``: what was alive at each system's warm-up peak of allocated memory, grouped by where it
  was made (torch's allocator history, ``benches/lib/memory_peak.py``; the warm-up seconds then include the
  recording's cost).

A time budget (``--budget-s``) stops starting new modules past it; skipped modules are recorded as such. Writes
``benches/results/anymodule_<gpu>.json`` and ``.md`` (and under ``$OUT/results`` when set); ``python benches/plot.py``
draws its ``.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.plots_models import ANYMODULE_SYSTEMS as LABELS  # noqa: E402 - after the path above

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 2, 4, 8, 16, 32)
SYSTEMS = ("eager", "reduce_overhead", "encgraph")


def build(name: str, tiny: bool) -> tuple[Any, int, str]:
    """The module, its image side and how it is called ("pixel_values" keyword or positional)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    if name == "vit_b16_hf":
        cfg = tf.ViTConfig(**(small if tiny else {}), image_size=224, patch_size=16)
        return tf.ViTModel(cfg), 224, "pixel_values"
    if name == "vit_b16_timm":
        import timm

        kw = dict(embed_dim=64, depth=2, num_heads=2) if tiny else {}
        return timm.create_model("vit_base_patch16_224", pretrained=False, **kw), 224, "positional"
    if name == "convnext_b":
        cfg = tf.ConvNextConfig(hidden_sizes=[16, 32] if tiny else [128, 256, 512, 1024],
                                depths=[1, 1] if tiny else [3, 3, 27, 3], num_stages=2 if tiny else 4)
        return tf.ConvNextModel(cfg), 224, "pixel_values"
    if name == "dinov2_l14":
        cfg = tf.Dinov2Config(**(small if tiny else dict(hidden_size=1024, num_hidden_layers=24,
                                                         num_attention_heads=16)), image_size=224, patch_size=14)
        return tf.Dinov2Model(cfg), 224, "pixel_values"
    if name == "clip_l14_336":
        cfg = tf.CLIPVisionConfig(**(small if tiny else dict(hidden_size=1024, intermediate_size=4096,
                                                             num_hidden_layers=24, num_attention_heads=16)),
                                  image_size=336, patch_size=14)
        return tf.CLIPVisionModel(cfg), 336, "pixel_values"
    if name == "siglip_so400m_384":
        cfg = tf.SiglipVisionConfig(**(small if tiny else dict(hidden_size=1152, intermediate_size=4304,
                                                               num_hidden_layers=27, num_attention_heads=16)),
                                    image_size=384, patch_size=14)
        return tf.SiglipVisionModel(cfg), 384, "pixel_values"
    raise SystemExit(f"--models: unknown module {name!r}")


MODELS = ("vit_b16_hf", "vit_b16_timm", "convnext_b", "dinov2_l14", "clip_l14_336", "siglip_so400m_384")


def first_tensor(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    return out.last_hidden_state


class Timer:
    def __init__(self, device: Any) -> None:
        self.device = device

    def __call__(self, fn: Any) -> float:
        import torch

        torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t) * 1e3


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"].get("ok", 0)),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
            # reduce-overhead runs a compiled frame without CUDA graphs where it skips them (logged by torch)
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import encgraph

    device = torch.device("cuda")
    base, side, style = build(name, args.tiny)
    base = base.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    systems = {"eager": base, "reduce_overhead": torch.compile(copy.deepcopy(base), mode="reduce-overhead"),
               "encgraph": encgraph.graphed(copy.deepcopy(base))}
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def images(n: int) -> Any:
        return torch.randn(n, 3, side, side, device=device, dtype=torch.bfloat16, generator=gen)

    def call(system: str, x: Any) -> Any:
        module = systems[system]
        return module(x) if style == "positional" else module(pixel_values=x)

    timer = Timer(device)
    out: dict[str, Any] = {"image_size": side, "params_m": round(sum(p.numel() for p in base.parameters()) / 1e6, 1),
                           # the module's own forward: for HF towers, their attention implementation (sdpa)
                           "attn_implementation": getattr(getattr(base, "config", None), "_attn_implementation", None),
                           "warmup": {}, "batches": {}, "stream": {}}
    with torch.inference_mode():
        for system in SYSTEMS:  # warm-up, one system at a time: its own peak memory and compile counters
            release_cached(device)  # synchronises first
            calling_stream_workspace(device)
            torch.cuda.reset_peak_memory_stats(device)
            before_mem, before = torch.cuda.memory_allocated(device), dynamo_counts()
            before_reserved = torch.cuda.memory_reserved(device)
            history = MemoryHistory(device) if args.memory_history else None
            t0 = time.perf_counter()
            for _ in range(3):
                for n in BATCHES:
                    call(system, images(n))
            torch.cuda.synchronize(device)
            after = dynamo_counts()
            at_peak = history.stop() if history is not None else None
            out["warmup"][system] = {
                "seconds": round(time.perf_counter() - t0, 2),
                "frames_compiled": after["frames"] - before["frames"],
                "recompiles": after["recompiles"] - before["recompiles"],
                "cudagraph_skips": after["cudagraph_skips"] - before["cudagraph_skips"],
                "peak_mib": round((torch.cuda.max_memory_allocated(device) - before_mem) / 2**20, 1),
                "held_mib": round((torch.cuda.memory_allocated(device) - before_mem) / 2**20, 1),
                "peak_reserved_mib": round((torch.cuda.max_memory_reserved(device) - before_reserved) / 2**20, 1),
            }
            if at_peak is not None:  # recorded: its warm-up seconds include the recording's cost
                out["warmup"][system]["at_peak"] = at_peak
            torch.cuda.empty_cache()
            out["warmup"][system]["held_reserved_mib"] = round(
                (torch.cuda.memory_reserved(device) - before_reserved) / 2**20, 1)
        x = images(8)
        want = first_tensor(call("eager", x)).float()
        got = first_tensor(call("encgraph", x)).float()
        out["max_item_rel_diff"] = max(float((got[i] - want[i]).norm() / want[i].norm()) for i in range(8))
        for n in BATCHES:
            times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
            replays_before = replay_counts(encgraph.graphs(systems["encgraph"]).stats)
            for _ in range(args.runs):
                x = images(n)
                for system in SYSTEMS:
                    times[system].append(timer(lambda: call(system, x)))
            out["batches"][n] = {s: round(statistics.median(v), 3) for s, v in times.items()}
            # What encgraph ran for this batch size: replays per budget and eager items over the timed calls
            replays_after = replay_counts(encgraph.graphs(systems["encgraph"]).stats)
            out["batches"][n]["encgraph_ran"] = {
                k: replays_after[k] - replays_before.get(k, 0) for k in replays_after
                if replays_after[k] - replays_before.get(k, 0)}
        if args.profile_batches:
            out["profile"] = profile_systems(systems, call, images, args, device)
        import random

        rng = random.Random(args.seed)
        stream = [rng.choice(BATCHES) for _ in range(args.stream)]
        lat: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        before = dynamo_counts()
        for n in stream:
            x = images(n)
            for system in SYSTEMS:
                lat[system].append(timer(lambda: call(system, x)))
        after = dynamo_counts()
        for system in SYSTEMS:
            v = sorted(lat[system])
            out["stream"][system] = {"mean_ms": round(statistics.fmean(v), 3), "p50_ms": round(v[len(v) // 2], 3),
                                     "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))], 3)}
        for other in ("eager", "reduce_overhead"):
            ratios = [o / e for o, e in zip(lat[other], lat["encgraph"])]
            out["stream"][f"encgraph_worst_vs_{other}"] = round(min(ratios), 3)
        out["stream"]["requests"] = len(stream)
        out["stream"]["recompiles_during"] = after["recompiles"] - before["recompiles"]
        out["encgraph_stats"] = {k: v for k, v in encgraph.graphs(systems["encgraph"]).stats.items()
                                 if k in ("calls", "stock_calls", "graph_items", "eager_items", "eager_reasons",
                                          "rebuilds")}
        capture_info = encgraph.graphs(systems["encgraph"]).runner.capture_info
        info = capture_info.get("compile", {})
        out["encgraph_compile"] = {k: info.get(k) for k in ("status", "regions", "dynamo")}
        # Per capture phase, how far it raised the peak memory (None where the library does not report it).
        out["encgraph_memory_peak_rise_mib"] = capture_info.get("memory_peak_rise_mib")
        out["encgraph_pool_mib"] = round(capture_info.get("pool_bytes", 0) / 2**20, 1)
        # The cost model the planner chose graphs or eager by (replay ms per budget, the eager fit): why a batch
        # size ran eagerly ("eager is cheaper") where the table shows it.
        costs = getattr(encgraph.graphs(systems["encgraph"]).runner, "costs", None)
        out["encgraph_costs"] = costs.to_dict() if costs is not None else None
        shapes = encgraph.graphs(systems["encgraph"]).stats.get("shapes")
        if shapes:
            out["encgraph_stats"]["graph_mib"] = round(shapes["graph_bytes"] / 2**20, 1)
    systems.clear()  # the copies and their graphs go before the next module
    del base
    torch._dynamo.reset()
    release_cached(device, trees=True)
    return out


def replay_counts(stats: dict[str, Any]) -> dict[str, int]:
    """From a runner's ``stats``: replays per ``"<path> replay <budget>"`` and eager items per path, as counts."""
    found: dict[str, int] = {}
    for path, p in stats.get("paths", {}).items():
        for budget, n in p.get("replays", {}).items():
            found[f"{path} replay {budget}"] = int(n)
        found[f"{path} eager items"] = int(p.get("eager_items", 0))
    return found


def calling_stream_workspace(device: Any) -> None:
    """Two matmuls on the calling stream, so that its cuBLAS workspaces (32 MiB and cuBLASLt's 1 MiB on Hopper)
    exist before a system's warm-up is measured, as in any process that has run a matmul on it (the language
    model, the module itself). A system's peak and held memory then count the workspaces it adds, not the calling
    stream's, which the first system's warm-up would otherwise pay alone and reduce-overhead's (its CUDA-graph
    trees clear every stream's workspaces when they capture) would leave to the next system's."""
    import torch

    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    # a plain matmul (cuBLAS's workspace) and one with a bias (cuBLASLt's gemm-and-bias, its own workspace)
    ((a @ a).sum() + torch.nn.functional.linear(a, a, a[0]).sum()).item()


class MemoryHistory:
    """``--memory-history``: torch's allocator history (Python stacks) from construction to :meth:`stop`, which
    returns what was alive at the peak of what it saw allocated (``benches.lib.memory_peak.live_at_peak``)."""

    ENTRIES = 300_000  # alloc/free events kept; a full history drops its oldest (``unknown_frees`` then counts them)

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                  max_entries=self.ENTRIES)

    def stop(self) -> dict[str, Any]:
        import torch

        from benches.lib.memory_peak import live_at_peak

        try:
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traces = snapshot.get("device_traces") or []
        return live_at_peak(traces[index] if index < len(traces) else [])


def release_cached(device: Any, trees: bool = False) -> None:
    """What no longer has a reference given back to the driver, so that the next system's memory figures start
    from what is really held; ``trees``: the reduce-overhead CUDA-graph trees too (between modules only: the
    module's own reduce-overhead system replays its tree). torch 2.11's ``torch._dynamo.reset()`` could leave a
    previous module's tree and its pool alive, which the next module's reduce-overhead run then reused (its peak
    read 0.3 MiB allocated) or freed midway (its held memory read negative)."""
    import gc

    import torch

    gc.collect()
    if trees:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def heading(title: str, doc: dict[str, Any], setting: str = "") -> list[str]:
    """A result page's title and the line naming its run's machine and versions."""
    env = doc["environment"]
    return [title, "", f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, bfloat16, random "
            f"weights{setting}; {env['date']}; commit {env['commit']}", ""]


def profile_systems(systems: dict[str, Any], call: Callable[[str, Any], Any], images: Callable[[int], Any],
                    args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Where each system's device time goes at each of ``--profile-batches``: ``--profile-calls`` calls under
    ``torch.profiler`` (``benches/kernel_profile.py``'s summary: kernel time, the GPU's idle time against the
    median latency, categories, top kernels; for graph replays, the waits inside and the work around them)."""
    import types

    from benches.kernel_profile import device_records, profile_call, replay_split, summarize

    env = types.SimpleNamespace(device=device)
    timer = Timer(device)
    found: dict[str, Any] = {}
    for n in (int(b) for b in args.profile_batches.split(",")):
        x = images(n)
        found[n] = {}
        for system in SYSTEMS:
            median = statistics.median(timer(lambda s=system: call(s, x)) for _ in range(args.runs))
            trace = profile_call(lambda s=system: call(s, x), env, args.profile_calls)
            row = summarize(device_records(trace), args.profile_calls, median)
            replay = replay_split(trace, args.profile_calls)
            if replay is not None:
                row["replay"] = replay
            found[n][system] = row
    return found


def render(doc: dict[str, Any]) -> str:
    lines = heading('# anymodule: graphed(module) against the module and torch.compile(mode="reduce-overhead")', doc)
    lines += ["| module | batch | eager ms | reduce-overhead ms | encgraph ms | vs eager | vs reduce-overhead | "
              "encgraph ran (over the timed calls) |", "|---|---|---|---|---|---|---|---|"]
    for name, m in doc["models"].items():
        if "skipped" in m or "error" in m:
            lines.append(f"| {name} | - | {m.get('skipped') or m.get('error')} | | | | | |")
            continue
        for n, t in m["batches"].items():
            ran = ", ".join(f"{k} x{v}" for k, v in t.get("encgraph_ran", {}).items()) or "-"
            lines.append(f"| {name} | {n} | {t['eager']} | {t['reduce_overhead']} | {t['encgraph']} | "
                         f"{t['eager'] / t['encgraph']:.2f}x | {t['reduce_overhead'] / t['encgraph']:.2f}x | {ran} |")
    lines += ["", "| module | system | warm-up s | frames compiled | recompiles | peak MiB allocated | "
              "peak / held MiB reserved | stream mean ms | P50 ms | P99 ms |", "|---" * 10 + "|"]
    for name, m in doc["models"].items():
        if "warmup" not in m:
            continue
        for s in SYSTEMS:
            w, st = m["warmup"][s], m["stream"][s]
            lines.append(f"| {name} | {LABELS[s]} | {w['seconds']} | {w['frames_compiled']} | {w['recompiles']} | "
                         f"{w['peak_mib']} | {w.get('peak_reserved_mib', '-')} / {w.get('held_reserved_mib', '-')} | "
                         f"{st['mean_ms']} | {st['p50_ms']} | {st['p99_ms']} |")
    lines += [""]
    for name, m in doc["models"].items():
        for n, by_system in m.get("profile", {}).items():
            for s, row in by_system.items():
                cats = ", ".join(f"{c} {v['ms']}" for c, v in list(row["categories"].items())[:4])
                lines.append(f"- {name} at batch {n}, {LABELS[s]}: median {row['median_ms']} ms, kernels "
                             f"{row['kernel_ms']} ms ({row['kernels']} a call), GPU idle {row['idle_ms']} ms; {cats}"
                             + (f"; replay {row['replay']}" if "replay" in row else ""))
    if lines[-1]:  # after the profile lines, where there were any
        lines += [""]
    for name, m in doc["models"].items():
        for s in SYSTEMS:
            peak = m.get("warmup", {}).get(s, {}).get("at_peak")
            if peak:
                sites = "; ".join(f"{where} {mib} MiB ({n})" for where, mib, n in peak["sites"])
                lines.append(f"- {name}, {LABELS[s]}, alive at its warm-up's allocated peak ({peak['peak_mib']} "
                             f"MiB over the recording, {peak['live']} blocks; {peak['unknown_frees']} frees of older "
                             f"blocks): {sites}")
    if lines[-1]:
        lines += [""]
    for name, m in doc["models"].items():
        if "stream" in m:
            s = m["stream"]
            lines.append(f"- {name}: stream of {s['requests']} requests, worst per-request ratio encgraph vs eager "
                         f"{s['encgraph_worst_vs_eager']}, vs reduce-overhead {s['encgraph_worst_vs_reduce_overhead']}"
                         f"; recompiles during the stream {s['recompiles_during']}; max per-item relative difference "
                         f"vs eager {m['max_item_rel_diff']:.2e}; encgraph {m['encgraph_stats']}")
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    import datetime
    import os
    import subprocess

    import torch
    import transformers

    # BENCH_COMMIT: the commit the tree was copied from, where the tree is a copy whose git history is not its own
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "commit": commit or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, in order (default: all)")
    p.add_argument("--runs", type=int, default=20, help="timed calls per batch size and system")
    p.add_argument("--stream", type=int, default=60, help="requests in the mixed stream")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no module past this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-batches", default="8,32",
                   help="batch sizes whose calls are profiled per system (comma-separated; empty: none)")
    p.add_argument("--profile-calls", type=int, default=5, help="calls under the profiler per batch size and system")
    p.add_argument("--tiny", action="store_true", help="tiny modules (a quick check of the script)")
    p.add_argument("--memory-history", action="store_true",
                   help="record torch's allocator history over each system's warm-up and report what was alive at "
                        "its allocated peak, by where it was made (warm-up seconds then include the recording)")
    p.add_argument("--results-dir", default=str(REPO / "benches" / "results"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("anymodule.py needs CUDA (it times CUDA graphs and torch.compile's reduce-overhead).")
    return run_modules("anymodule", args, measure, render, lambda kind, why: {kind: f"{kind}: {why}"})


def run_modules(stem: str, args: argparse.Namespace, measure: Callable[[str, argparse.Namespace], Any],
                render: Callable[[dict[str, Any]], str], entry: Callable[[str, str], Any]) -> dict[str, Any]:
    """Each of ``args.models`` measured in turn: none started past ``args.budget_s`` and a module's failure
    recorded (``entry("skipped" | "error", why)``), the others still run; the document is written to
    ``<results-dir>/<stem>_<gpu>.json`` and ``.md`` (and under ``$OUT/results``) after each module."""
    import os

    import torch

    slug = "-".join("".join(c if c.isalnum() else " " for c in torch.cuda.get_device_name().lower()).split())
    dirs = [Path(args.results_dir)] + ([Path(os.environ["OUT"]) / "results"] if os.environ.get("OUT") else [])
    doc: dict[str, Any] = {"environment": environment(), "options": vars(args), "models": {}}
    t0 = time.perf_counter()
    for name in args.models.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            doc["models"][name] = entry("skipped", "time budget spent")
        else:
            print(f"[{time.perf_counter() - t0:.0f} s] {name}", flush=True)
            try:
                doc["models"][name] = measure(name, args)
            except Exception as exc:  # one module's failure is recorded; the others still run
                doc["models"][name] = entry("error", f"{type(exc).__name__}: {str(exc)[:300]}")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{stem}_{slug}.json").write_text(json.dumps(doc, indent=1, default=str))
            (d / f"{stem}_{slug}.md").write_text(render(doc))
    print(render(doc), flush=True)
    return doc


if __name__ == "__main__":
    main()
