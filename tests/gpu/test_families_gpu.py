"""The families added after the seed on a GPU at real geometry (``family_geometry.GEOMETRY``: random bf16 weights,
depth cut to 8): capture once, poison the shared graph pool with NaN (the largest graph replayed on NaN pixels),
then replay fresh random mixes of images and videos; per item and output field, the replay equals

- the same padded static forward run eagerly (a ``RunMode.STATIC`` runner over the same adapter: same shapes, same
  kernels): counted bit-exact, else within ``STATIC_RTOL`` (max-relative; printed);
- the tower's own Hugging Face forward on the item alone (SDPA, unpadded: other kernels) within ``HF_RTOL``
  (norm-relative; the worst printed),

and the static forward runs under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises). The
default runner (``compile="auto"``: the repeated layers compiled once, a measured cost model) is checked per family
on three budgets within ``HF_RTOL`` of the uncompiled static forward and of the HF tower.

GLM-4V, Qwen3.5, ERNIE-4.5-VL, PaddleOCR-VL, HunYuan-VL, SigLIP2 NaFlex and Llama 4 need transformers >= 5.15 (the GPU image's 5.17 has them); Kimi-K2.5
and MiniCPM-V 4.6 need 5.24 (their 5.17 towers pool and merge differently) and skip below it. Run with
``pytest -s`` for the report; ``python tests/gpu/test_families_gpu.py --cpu-smoke`` runs the same checks on the
CPU (STATIC mode, so nothing compiled; 1 layer, small budgets) in a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encgraph.capture.buffers import PathBuffers  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.capture.runner import EncoderGraphRunner  # noqa: E402
from encgraph.models import wrap  # noqa: E402
from encgraph.models._hf import transformers_version, _parse  # noqa: E402
from tests.gpu.family_geometry import GEOMETRY  # noqa: E402
from tests.models.fixtures_families import FAMILIES, masked, naflex, padded, strip  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGETS = (64, 128, 256, 512, 1024, 2048)
MAX_ITEMS = 16
CASES = 12
HF_CASES = 3  # the HF forward per item is slow (launch-bound, one call per item)
HF_RTOL = 2e-2  # bf16, 8 layers, packed varlen attention vs the tower's own SDPA, per item (norm-relative)
STATIC_RTOL = 1e-3  # where replay and the eager static forward are not bit-exact (max-relative)
STATIC_RTOL_FOR = {("kimi_k25", "pooler_output"): 1e-2}
"""Kimi-K2.5 pools a video's frames with ``index_add_``, float32 atomics on CUDA: their order differs between any
two runs, so a pooled value near a bf16 rounding boundary can differ by one bf16 step (up to 2^-8 relative)."""
NEEDS_524 = {"kimi_k25", "minicpmv4_6"}
PACKED = ("glm4v", "qwen3_5", "ernie4_5_vl", "kimi_k25", "minicpmv4_6", "paddleocr_vl", "pixtral", "hunyuan_vl",
          "siglip2", "smolvlm")


@attrs.frozen
class Run:
    """Where and how big: the GPU test (``cuda``, bf16, graphs) or the CPU smoke (fp32, STATIC, small)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    mode: RunMode = RunMode.GRAPH
    depth: int | None = None
    budgets: tuple[int, ...] = BUDGETS
    max_side: int = 32  # image sides in patches (448 px at patch 14)
    big_side: int = 96  # one item per few cases over the largest budget: eager
    cases: int = CASES


SMOKE = Run(device="cpu", dtype=torch.float32, mode=RunMode.STATIC, depth=1, budgets=(16, 64), max_side=8,
            big_side=18, cases=3)


def skip_unless_supported(name: str) -> None:
    if name in NEEDS_524 and _parse(transformers_version() or "0") < (5, 24):
        pytest.skip(f"{name} needs transformers >= 5.24, found {transformers_version()}")


def build(name: str, run: Run) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(tower, reference)``: the tower to wrap and a deep copy that keeps the original (SDPA) attention."""
    geometry = GEOMETRY[name]
    overrides = {"insert_layer_id": 0} if name == "minicpmv4_6" and run.depth == 1 else {}
    with torch.device(run.device):
        tower = geometry.build(run.depth, run.dtype, **overrides)
    return tower, copy.deepcopy(tower)


def random_mix(gen: np.random.Generator, name: str, n: int, run: Run, big: bool) -> np.ndarray:
    """``n`` items of 4..max_side patches a side (even); a third of them videos of 2..4 frames of up to half the
    side where the family takes video through its tower; with ``big``, one more image of ``big_side`` patches."""
    family = FAMILIES[name]
    videos = gen.random(n) < (0.33 if family.max_t > 1 else 0)
    t = np.where(videos, gen.integers(2, max(min(family.max_t, 4), 2) + 1, n), 1)
    top = np.where(videos, run.max_side // 4, run.max_side // 2)
    hw = gen.integers(2, top[:, None] + 1, (n, 2)) * 2
    grid = np.concatenate([t[:, None], hw], axis=1).astype(np.int64)
    if big:
        grid = np.insert(grid, int(gen.integers(0, n + 1)), [1, run.big_side, run.big_side], axis=0)
    return grid


def pixel_rows(adapter: Any, grid: np.ndarray, run: Run) -> torch.Tensor:
    rows = int(grid.prod(1).sum())
    return torch.randn(rows, *adapter.row_shape, device=run.device).to(run.dtype)


def adapter_inputs(name: str, adapter: Any, rows: torch.Tensor, grid: np.ndarray) -> Any:
    if FAMILIES[name].call_style == "strip":
        return adapter.inputs(strip(rows), grid[:, 1:])
    if FAMILIES[name].call_style == "padded":
        return adapter.inputs(*padded(rows, grid))
    if FAMILIES[name].call_style == "naflex":
        return adapter.inputs(*(t.to(rows.device) for t in naflex(rows, grid)))
    if FAMILIES[name].call_style == "mask":
        images, mask = masked(rows, grid)
        return adapter.inputs(images, mask.to(rows.device))
    return adapter.inputs(rows, grid)


def rel(a: torch.Tensor, b: torch.Tensor, kind: str = "norm") -> float:
    a, b = a.float(), b.float()
    if kind == "max":
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def hf_per_item(name: str, reference: torch.nn.Module, rows: torch.Tensor, grid: np.ndarray) -> list[dict]:
    family = FAMILIES[name]
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    with torch.inference_mode():
        return [family.split(family.call(reference, rows[starts[i]:starts[i + 1]], grid[i:i + 1], reference=True),
                             grid[i:i + 1])[0] for i in range(grid.shape[0])]


def replay_mix(name: str, adapter: Any, runners: tuple[Any, Any], gen: np.random.Generator, n: int, run: Run,
               big: bool) -> tuple[torch.Tensor, np.ndarray, list[dict], list[dict]]:
    """A fresh random mix through both runners (the graphs, the eager static forward): rows, grid, results."""
    grid = random_mix(gen, name, n, run, big)
    rows = pixel_rows(adapter, grid, run)
    inputs = adapter_inputs(name, adapter, rows, grid)
    with torch.inference_mode():
        got, want = runners[0](inputs), runners[1](inputs)
    return rows, grid, got, want


def worst_vs_hf(name: str, adapter: Any, reference: torch.nn.Module, rows: torch.Tensor, grid: np.ndarray,
                got: list[dict]) -> float:
    """Per item and field, the replay (as the tower's own output) against the HF tower on the item alone; asserts
    each within ``HF_RTOL`` and returns the worst norm-relative error."""
    worst = 0.0
    for i, (g, ref) in enumerate(zip(got, hf_per_item(name, reference, rows, grid))):
        one = adapter_inputs(name, adapter, *_item(rows, grid, i))
        mine = FAMILIES[name].split(adapter.output_for_call([g], one), grid[i:i + 1])[0]
        for key in ref:
            err = rel(mine[key], ref[key])
            worst = max(worst, err)
            assert err < HF_RTOL, (name, i, grid[i].tolist(), key, err)
    return worst


def check_packed(name: str, run: Run) -> dict[str, Any]:
    """Capture, poison, replay random mixes; compare with the eager static forward and the HF tower per item."""
    tower, reference = build(name, run)
    adapter = wrap(tower)
    if getattr(adapter, "max_side", None):  # Pixtral's rotary table on transformers 5.15 bounds a side
        run = attrs.evolve(run, big_side=min(run.big_side, adapter.max_side))
    # Plain graphs (the compiled default has its own test) planned greedily (a cost model could send the poisoning
    # batch eagerly): the replay must equal the eager static forward on the same kernels.
    graph = EncoderGraphRunner(adapter, budgets=list(run.budgets), max_items=MAX_ITEMS, mode=run.mode,
                               compile=False, costs=False)
    info = graph.capture()
    assert info["graphs"] == (len(run.budgets) if run.mode is RunMode.GRAPH else 0) and not info.get("failed")
    static = EncoderGraphRunner(adapter, budgets=list(run.budgets), max_items=MAX_ITEMS, mode=RunMode.STATIC)

    # NaN-poisoned pool: the largest graph replays NaN pixels, so its intermediates in the shared pool are NaN.
    poison = adapter.sample_inputs("default", run.budgets[-1])
    poison.pixel_values.fill_(float("nan"))
    with torch.inference_mode():
        assert torch.isnan(graph(poison)[0][adapter.output_names[0]]).all()
    assert graph.stats["eager_items"] == 0  # it ran on the largest graph (or its static forward)

    gen = np.random.default_rng(0)
    exact = total = 0
    worst_static = worst_hf = 0.0
    for case in range(run.cases):
        n = int(gen.integers(1, 3 * MAX_ITEMS // 2))
        # Big items run eagerly in both runners, on the same kernels (dense from the rows measured at capture).
        rows, grid, got, want = replay_mix(name, adapter, (graph, static), gen, n, run, big=case % 4 == 1)
        for i, (g, w) in enumerate(zip(got, want)):
            for key in w:
                assert torch.isfinite(g[key]).all(), (name, case, i, key)
                total += 1
                if torch.equal(g[key], w[key]):
                    exact += 1
                else:
                    err = rel(g[key], w[key], "max")
                    worst_static = max(worst_static, err)
                    assert err < STATIC_RTOL_FOR.get((name, key), STATIC_RTOL), (name, case, i, grid[i].tolist(), key, err)
        if case < HF_CASES:
            worst_hf = max(worst_hf, worst_vs_hf(name, adapter, reference, rows, grid, got))
    stats = graph.stats
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0
    return {
        "family": name, "capture_s": round(info["seconds"], 2), "pool_mib": round(info.get("pool_bytes", 0) / 2**20, 1),
        "bit_exact": f"{exact}/{total}", "worst_static_max_rel": worst_static, "worst_hf_norm_rel": worst_hf,
        "eager_items": stats["eager_items"], "graph_items": stats["graph_items"],
        "padded_share": round(stats["paths"]["default"]["padded_share"], 3),
    }


def _item(rows: torch.Tensor, grid: np.ndarray, i: int) -> tuple[torch.Tensor, np.ndarray]:
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    return rows[starts[i]:starts[i + 1]], grid[i:i + 1]


def check_static_forward_does_not_sync(name: str, run: Run) -> None:
    tower, _ = build(name, run)
    adapter = wrap(tower)
    budget = 4 if name == "llama4" else 256  # Llama 4: tiles; the others: tokens
    buffers = PathBuffers("default", {budget: adapter.buffer_specs("default", budget, MAX_ITEMS, 2 * MAX_ITEMS)},
                          torch.device(run.device))
    views = buffers.fill(budget, None)  # an all-padding batch, as at capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = adapter.forward_static("default", views, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.shape[0] == budget for t in out.values())


def check_llama4(run: Run) -> dict[str, Any]:
    """Llama 4 tiles on the batch ladder: poisoned pool, then batches of many sizes (padded, exact, two batches)."""
    tower, reference = build("llama4", run)
    adapter = wrap(tower)
    ladder = [1, 2, 4, 8, 16] if run.mode is RunMode.GRAPH else [1, 2]
    graph = EncoderGraphRunner(adapter, budgets=ladder, mode=run.mode, compile=False, costs=False)
    info = graph.capture()
    static = EncoderGraphRunner(adapter, budgets=ladder, mode=RunMode.STATIC)
    side = int(tower.config.image_size)
    from encgraph.models.fixed import PixelBatch

    def tiles(n: int) -> torch.Tensor:
        return torch.randn(n, 3, side, side, device=run.device).to(run.dtype)

    with torch.inference_mode():
        assert torch.isnan(graph(PixelBatch(tiles(ladder[-1]).fill_(float("nan"))))[0]["last_hidden_state"]).all()
    assert graph.stats["eager_items"] == 0
    exact = total = 0
    worst_static = worst_hf = 0.0
    for n in (1, 3, 8, 13, 16, 21) if run.mode is RunMode.GRAPH else (1, 3):
        x = tiles(n)
        with torch.inference_mode():
            got, want = graph(PixelBatch(x)), static(PixelBatch(x))
            ref = reference(x).last_hidden_state
        for i, (g, w) in enumerate(zip(got, want)):
            a, b = g["last_hidden_state"], w["last_hidden_state"]
            assert torch.isfinite(a).all()
            total += 1
            if torch.equal(a, b):
                exact += 1
            else:
                worst_static = max(worst_static, rel(a, b, "max"))
                assert worst_static < STATIC_RTOL, (n, i, worst_static)
            worst_hf = max(worst_hf, rel(a[0], ref[i]))
            assert worst_hf < HF_RTOL, (n, i, worst_hf)
    return {"family": "llama4", "capture_s": round(info["seconds"], 2), "bit_exact": f"{exact}/{total}",
            "worst_static_max_rel": worst_static, "worst_hf_norm_rel": worst_hf}


def check_compiled_default(name: str, run: Run) -> dict[str, Any]:
    """The default ``compile="auto"`` (the tower's repeated layers compiled once for every budget, then captured)
    and the default cost model, on three budgets: replays within ``HF_RTOL`` of the uncompiled static forward and
    of the HF tower per item."""
    tower, reference = build(name, run)
    adapter = wrap(tower)
    budgets = [64, 256, 1024] if run.mode is RunMode.GRAPH else list(run.budgets)
    graph = EncoderGraphRunner(adapter, budgets=budgets, max_items=8, mode=run.mode)
    info = graph.capture()
    compiled = info["compile"]
    assert not info["failed"], info["failed"]
    if run.mode is RunMode.GRAPH:
        assert info["graphs"] == len(budgets) and compiled.get("status") == "compiled", compiled
    static = EncoderGraphRunner(adapter, budgets=budgets, max_items=8, mode=RunMode.STATIC)
    gen = np.random.default_rng(5)
    worst_static = worst_hf = 0.0
    for case in range(4):
        n = int(gen.integers(1, 9))
        rows, grid, got, want = replay_mix(name, adapter, (graph, static), gen, n, attrs.evolve(run, max_side=24), False)
        for i, (g, w) in enumerate(zip(got, want)):
            for key in w:
                err = rel(g[key], w[key])
                worst_static = max(worst_static, err)
                assert torch.isfinite(g[key]).all() and err < HF_RTOL, (name, case, i, grid[i].tolist(), key, err)
        if case == 0:
            worst_hf = worst_vs_hf(name, adapter, reference, rows, grid, got)
    return {"family": name, "capture_s": round(info["seconds"], 1),
            "first_compile_s": compiled.get("first_compile_seconds"), "dynamo": compiled.get("dynamo"),
            "worst_static_norm_rel": worst_static, "worst_hf_norm_rel": worst_hf,
            "graph_items": graph.stats["graph_items"], "eager_items": graph.stats["eager_items"]}


@pytest.mark.parametrize("name", PACKED)
def test_replay_equals_static_eager_and_hf(name):
    skip_unless_supported(name)
    print(f"\n{check_packed(name, Run())}")


def test_llama4_tiles():
    print(f"\n{check_llama4(Run())}")


@pytest.mark.parametrize("name", PACKED)
def test_compiled_default_equals_static_and_hf(name):
    skip_unless_supported(name)
    print(f"\n{check_compiled_default(name, Run())}")


@pytest.mark.parametrize("name", PACKED + ("llama4",))
def test_static_forward_does_not_sync(name):
    skip_unless_supported(name)
    check_static_forward_does_not_sync(name, Run())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run the checks on the CPU, small and in STATIC mode")
    parser.add_argument("--families", default=",".join(PACKED + ("llama4",)))
    args = parser.parse_args(argv)
    run = SMOKE if args.cpu_smoke else Run()
    if args.cpu_smoke:
        torch.set_num_threads(1)  # a shared 2-core machine: two OpenMP threads spin against each other
    for name in args.families.split(","):
        start = time.perf_counter()
        report = check_llama4(run) if name == "llama4" else check_packed(name, run)
        print(f"{report} ({time.perf_counter() - start:.1f} s)", flush=True)
        if name != "llama4":
            print(f"  default runner: {check_compiled_default(name, run)}", flush=True)


if __name__ == "__main__":
    main()
