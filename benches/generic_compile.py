"""How a batch-ladder tower is compiled before capture: which regions, and which sizes symbolic.

A batch ladder (the any-module path, SigLIP, CLIP) changes one size between budgets: the batch. Ways to
compile it before the graphs are captured, each measured on one module in one process:

- ``blocks/symbolic``: the repeated blocks (``repeated_blocks``), every size symbolic (``dynamic=True``);
- ``blocks/automatic``: the repeated blocks, torch's automatic dynamic (``dynamic=None``): the largest budget,
  captured first, compiles with static sizes, the next makes the batch alone symbolic, batch 1 specialises;
- ``blocks/static``: the repeated blocks, every budget compiled with its own static sizes (``dynamic=False``: one
  frame per budget; more warm-up, and each budget's kernels tuned for its own batch where the automatic default
  runs every budget but the largest through one batch-symbolic kernel set);
- ``blocks/batch`` and ``stack/batch``: the batch alone symbolic from the first trace (``Sizes.BATCH``: one frame
  for every budget, batch 1 included); ``blocks/batch`` is the default;
- ``blocks/top-static`` and ``stack/top-static``: the largest budget with static sizes in a frame of its own, every
  smaller one through ``Sizes.BATCH``'s batch-symbolic frame (``Sizes.TOP_STATIC``: two frames; the batch-32 graph
  is captured from the static one, where ``stack/automatic``'s is captured from its later symbolic entry, which
  Dynamo tries first); not yet measured on a GPU;
- ``whole/symbolic`` and ``whole/automatic``: the adapter's whole static forward instead of its blocks;
- ``stack/automatic``: one region, the outermost submodule that holds every repeated block (SigLIP's and CLIP's
  ``encoder`` in transformers 5 and ConvNeXt's and DINOv2's, timm's ``blocks``; the blocks where no such submodule is
  one with a forward), so that Inductor fuses across the blocks' edges as reduce-overhead does: a block's last
  residual add into the next block's LayerNorm (SigLIP-so400m at 32 images: 2.1 ms of 52 that reduce-overhead
  saves, ``docs/benchmarks.md``), without the hook's bound method that broke the whole forward's graph.

Per variant: the warm-up (every batch size of 1, 2, 4, 8, 16, 32 three times in turn; the capture happens on a
shape's second call) in wall seconds with Dynamo's frames and graph breaks, and the median of ``--runs`` calls per
batch size, interleaved call by call with the module's eager forward (the per-phase reference: each variant runs
after ``torch._dynamo.reset()``, so ``torch.compile(mode="reduce-overhead")`` is measured once, first, against the
same eager forward). Inductor's caches are off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), so every compile is
cold. Writes ``benches/results/generic_compile_<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.anymodule import BATCHES, Timer, build, dynamo_counts, first_tensor, heading, run_modules  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"blocks/symbolic": ("blocks", True), "blocks/automatic": ("blocks", None),
            "blocks/static": ("blocks", False), "blocks/batch": ("blocks", "batch"),
            "blocks/top-static": ("blocks", "top-static"), "whole/symbolic": ("whole", True),
            "whole/automatic": ("whole", None), "stack/automatic": ("stack", None), "stack/batch": ("stack", "batch"),
            "stack/top-static": ("stack", "top-static")}
TIMED = (1, 2, 8, 32)


def adapter_classes() -> list[type]:
    from encgraph.models.fixed import FixedResolutionAdapter
    from encgraph.models.generic import GenericModuleAdapter

    return [GenericModuleAdapter, FixedResolutionAdapter]


def block_stack(module: Any) -> list[Any]:
    """The "stack" regions: the outermost submodule of ``module`` that holds every one of its repeated blocks
    (never ``module`` itself, whose forward the wrapper hooks), as a one-region list, so that Inductor fuses across
    the blocks' edges (a block's last residual add into the next block's LayerNorm) as a whole-module compile does;
    the blocks themselves where that submodule is a ``ModuleList`` (no forward of its own) or ``module`` alone holds
    them; ``[]`` where there are none."""
    import torch

    from encgraph.models._hf import repeated_blocks

    blocks = repeated_blocks(module)
    for child in module.children() if blocks else ():
        inside = {id(m) for m in child.modules()}
        if all(id(b) in inside for b in blocks):
            return blocks if isinstance(child, torch.nn.ModuleList) else [child]
    return blocks


def set_variant(regions: str, dynamic: bool | str | None) -> list[tuple[type, str, Any]]:
    """Patch the batch-ladder adapters' classes (``regions``: "blocks", "whole" or "stack"; ``dynamic``: torch's
    ``dynamic=``, or a :class:`~encgraph.capture.compiling.Sizes` value: "batch", "top-static"); returns what to
    put back."""
    from encgraph.capture.compiling import Sizes
    from encgraph.models._hf import repeated_blocks

    saved = []
    for cls in adapter_classes():
        for name in ("compile_dynamic", "compile_regions"):
            saved.append((cls, name, cls.__dict__.get(name)))
        cls.compile_dynamic = Sizes(dynamic) if isinstance(dynamic, str) else dynamic
        cls.compile_regions = {"whole": lambda self: [], "blocks": lambda self: repeated_blocks(self._module),
                               "stack": lambda self: block_stack(self._module)}[regions]
    return saved


def restore(saved: list[tuple[type, str, Any]]) -> None:
    for cls, name, value in saved:
        if value is None:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, value)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import encgraph

    device = torch.device("cuda")
    base, side, style = build(name, args.tiny)
    base = base.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    timer = Timer(device)

    def images(n: int) -> Any:
        return torch.randn(n, 3, side, side, device=device, dtype=torch.bfloat16, generator=gen)

    def call(module: Any, x: Any) -> Any:
        return module(x) if style == "positional" else module(pixel_values=x)

    def phase(system: Any, label: str) -> dict[str, Any]:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        before, t0 = dynamo_counts(), time.perf_counter()
        for _ in range(3):
            for n in BATCHES:
                call(system, images(n))
        torch.cuda.synchronize(device)
        row: dict[str, Any] = {"warmup_s": round(time.perf_counter() - t0, 2),
                               "frames": dynamo_counts()["frames"] - before["frames"], "batches": {},
                               # the warm-up's peaks over what was held before it (capture included), MiB
                               "peak_mib": round((torch.cuda.max_memory_allocated(device) - allocated) / 2**20, 1),
                               "peak_reserved_mib": round((torch.cuda.max_memory_reserved(device) - reserved) / 2**20,
                                                          1)}
        for n in TIMED:
            own, eager = [], []
            for _ in range(args.runs):
                x = images(n)
                eager.append(timer(lambda: call(base, x)))
                own.append(timer(lambda: call(system, x)))
            row["batches"][n] = {"eager_ms": round(statistics.median(eager), 3),
                                 label + "_ms": round(statistics.median(own), 3)}
        x = images(8)
        want, got = first_tensor(call(base, x)).float(), first_tensor(call(system, x)).float()
        row["max_item_rel_diff"] = max(float((got[i] - want[i]).norm() / want[i].norm()) for i in range(8))
        return row

    out: dict[str, Any] = {}
    with torch.inference_mode():
        ro = torch.compile(copy.deepcopy(base), mode="reduce-overhead")
        out["reduce_overhead"] = phase(ro, "system")
        del ro
        for variant in args.variants.split(","):
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            saved = set_variant(*VARIANTS[variant])
            try:
                module = encgraph.graphed(copy.deepcopy(base))
                row = phase(module, "system")
                info = encgraph.graphs(module).runner.capture_info
                row["compile"] = {k: info.get("compile", {}).get(k) for k in ("status", "regions", "dynamo")}
                row["stats"] = {k: v for k, v in encgraph.graphs(module).stats.items()
                                if k in ("graph_items", "eager_items", "eager_reasons", "stock_calls")}
                out[variant] = row
                del module
            except Exception as exc:  # one variant's failure is recorded; the others still run
                out[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            finally:
                restore(saved)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def render(doc: dict[str, Any]) -> str:
    lines = heading("# generic_compile: how a batch-ladder tower is compiled before capture", doc,
                    ", inductor caches off")
    lines += ["| module | system | warm-up s | frames | peak MiB allocated / reserved | "
              + " | ".join(f"batch {n}: ms (eager ms)" for n in TIMED) + " | max item rel diff |",
              "|---|---|---|---|---|" + "---|" * len(TIMED) + "---|"]
    for name, rows in doc["models"].items():
        for system, row in rows.items():
            if "error" in row or "skipped" in row:
                lines.append(f"| {name} | {system} | {row.get('error') or row.get('skipped')} | | | | | | |")
                continue
            cells = [f"{b['system_ms']} ({b['eager_ms']})" for b in row["batches"].values()]
            peaks = f"{row.get('peak_mib', '-')} / {row.get('peak_reserved_mib', '-')}"  # older runs have none
            lines.append(f"| {name} | {system} | {row['warmup_s']} | {row['frames']} | {peaks} | "
                         + " | ".join(cells) + f" | {row['max_item_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit_b16_timm,convnext_b,vit_b16_hf")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=300.0, help="start no module past this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--results-dir", default=str(REPO / "benches" / "results"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("generic_compile.py needs CUDA.")
    return run_modules("generic_compile", args, measure, render, lambda kind, why: {"-": {kind: why}})


if __name__ == "__main__":
    main()
