"""Long items: where do graphs stop paying? One image of exactly each budget's tokens, per tower, through the
tower's own forward (``hf_sdpa``), the adapter's eager forward on the kernels measured at capture (dense SDPA per
long sequence: ``eager``), the same forward with every sequence on Flash varlen (``eager_varlen``), the runner's
eager forward through the blocks compiled for capture (``eager_compiled``: what an item past the ladder runs, where
capture engaged it; :mod:`encgraph.capture.compiled_eager`), and the graph captured for that budget (``graph``: the
replay of the item, padding and copies included), with each budget's capture seconds and the pool's size
(issue 32 point 2: the default ladder tops at 4096 tokens while Qwen's processors go to 16,384; it should reach
there only where graphs still pay).

The runner is captured as ``graphed()`` would capture it (``compile="auto"``) on the ladder ``--budgets``.
A budget of ``B`` tokens is one image of ``2a x 2b`` patches with ``a * b = B`` (merge 2), as square as powers of
two allow.

JSON (``benches/results/long_items_<gpu>.json``)::

    {"environment", "options", "towers": {"<tower>": {"label", "capture": {...runner.capture()},
        "kernels": {key: crossover}, "compiled_eager": {...}, "budgets": {"<B>": {"grid", "rows", "hf_sdpa_ms",
        "eager_ms", "eager_varlen_ms", "eager_compiled_ms", "graph_ms", "graph_vs_eager"}}}}}

``graph_vs_eager`` is the replay against the eager forward the runner would run instead: ``eager_compiled_ms``
where capture engaged it, else ``eager_ms``.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib import cli
from benches.lib.env import SKIPPED_TIME, Deadline, Env, free_memory, log, short_error
from benches.lib.results import Results, fmt, markdown_table
from benches.lib.timing import time_call
from benches.lib.towers import TOWERS, build_tower

SCRIPT = "long_items"
TOWER_NAMES = ("qwen3_vl_8b",)
BUDGETS = (1024, 2048, 4096, 8192, 16384)
SMOKE_BUDGETS = (16, 32, 64)


def build_parser() -> Any:
    p = cli.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=60.0)
    p.add_argument("--towers", type=cli.parse_names(("qwen3_vl_8b", "qwen2_5_vl_7b", "glm4v")), default=TOWER_NAMES,
                   help=f"comma list (default {','.join(TOWER_NAMES)})")
    p.add_argument("--budgets", type=cli.parse_budgets, default=None,
                   help=f"the ladder (default {','.join(map(str, BUDGETS))}; {SMOKE_BUDGETS} with --cpu-smoke)")
    p.set_defaults(runs=3, warmup=1)
    return p


def grid_of(budget: int, merge: int = 2) -> tuple[int, int, int]:
    """``(1, h, w)`` patches of an image of ``budget`` merged tokens, as square as powers of two allow."""
    a = 1 << (max(budget.bit_length() - 1, 0) // 2)
    while budget % a:
        a //= 2
    return 1, merge * a, merge * (budget // a)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.budgets is None:
        args.budgets = SMOKE_BUDGETS if args.cpu_smoke else BUDGETS
    return cli.run_script(SCRIPT, args, run, render)


def run(args: Any, env: Env, deadline: Deadline, results: Results) -> None:
    towers = results.data["towers"] = {}
    for k, name in enumerate(args.towers):
        spec = TOWERS[name]
        doc = towers[name] = {"label": spec.label}
        if deadline.expired(10.0):
            doc["skipped"] = SKIPPED_TIME
            continue
        try:
            one_tower(name, args, env, deadline.share(len(args.towers) - k), doc, results)
        except Exception as exc:
            traceback.print_exc()
            doc["error"] = short_error(exc)
        free_memory()
        results.flush()


def one_tower(name: str, args: Any, env: Env, deadline: Deadline, doc: dict[str, Any], results: Results) -> None:
    import copy

    import numpy as np
    import torch

    from encgraph.capture import EncoderGraphRunner, RunMode
    from encgraph.capture.execution import run_static
    from encgraph.models import wrap

    spec = TOWERS[name]
    hf = build_tower(spec, env)
    adapter = wrap(copy.deepcopy(hf))
    # The CPU smoke: the static forward run eagerly stands in for the graphs (the CPU's default runs no padding).
    mode = RunMode.GRAPH if env.cuda else RunMode.STATIC
    runner = EncoderGraphRunner(adapter, budgets=args.budgets, max_items=1, mode=mode, progress=False)
    log(f"{name}: capturing {args.budgets}")
    doc["capture"] = {k: v for k, v in runner.capture().items() if k != "selfcheck"}
    doc["kernels"] = doc["capture"].get("kernels")
    doc["compiled_eager"] = runner.compiled_eager.as_dict()
    measured = dict(adapter.kernel_rows or {})
    rows_doc = doc["budgets"] = {}
    gen = torch.Generator(device=env.device).manual_seed(env.seed)
    for budget in sorted(args.budgets, reverse=True):  # the largest first: the question is about them
        if deadline.expired():
            rows_doc[str(budget)] = {"skipped": SKIPPED_TIME}
            continue
        grid = np.array([grid_of(budget, adapter.merge)])
        rows = int(grid.prod())
        pixels = torch.randn(rows, *adapter.row_shape, device=env.device, dtype=env.dtype, generator=gen)
        inputs = adapter.inputs(pixels, grid)
        grid_t = torch.from_numpy(grid).to(env.device)
        entry: dict[str, Any] = {"grid": grid[0].tolist(), "rows": rows}
        calls = {
            "hf_sdpa_ms": lambda: hf(pixels, grid_thw=grid_t),
            "eager_ms": lambda: adapter.forward_eager("default", inputs),
            "graph_ms": lambda: run_static(runner, "default", budget, inputs, budget),
        }
        if runner.compiled_eager.engaged:
            calls["eager_compiled_ms"] = lambda: runner.compiled_eager.forward(adapter, "default", inputs)
        for key, fn in calls.items():
            try:
                entry[key] = round(time_call(fn, env).median, 3)
            except Exception as exc:
                traceback.print_exc()
                entry[key] = short_error(exc)
        adapter.kernel_rows = {g: None for g in measured} or None  # every sequence on Flash varlen
        try:
            entry["eager_varlen_ms"] = round(time_call(lambda: adapter.forward_eager("default", inputs), env).median, 3)
        finally:
            adapter.kernel_rows = measured or None
        runner_eager = entry.get("eager_compiled_ms", entry.get("eager_ms"))
        if isinstance(entry.get("graph_ms"), float) and isinstance(runner_eager, float):
            entry["graph_vs_eager"] = round(entry["graph_ms"] / runner_eager, 3)
        rows_doc[str(budget)] = entry
        log(f"{name} {budget}: {entry}")
        pixels = inputs = None  # this budget's tensors go before the next (smaller) one is made
        results.flush()


def render(data: dict[str, Any]) -> str:
    parts = [f"## long items: graph replay vs eager per budget ({data['environment']['gpu']})"]
    for name, doc in data["towers"].items():
        parts.append(f"### {doc['label']}")
        if "budgets" not in doc:
            parts.append(f"not measured: {doc.get('skipped') or doc.get('error')}")
            continue
        rows = [[b, "x".join(map(str, e.get("grid", []))), e.get("hf_sdpa_ms"), e.get("eager_ms"),
                 e.get("eager_varlen_ms"), e.get("eager_compiled_ms"), e.get("graph_ms"), e.get("graph_vs_eager")]
                for b, e in sorted(doc["budgets"].items(), key=lambda kv: int(kv[0]))]
        parts.append(markdown_table(["budget (tokens)", "grid (t x h x w patches)", "HF sdpa ms",
                                     "eager ms (measured kernels)", "eager ms (all varlen)",
                                     "eager ms (compiled blocks)", "graph replay ms", "graph / runner's eager"],
                                    rows))
        paying = [int(b) for b, e in doc["budgets"].items() if isinstance(e.get("graph_vs_eager"), float)
                  and e["graph_vs_eager"] < 1.0]
        parts.append(f"graphs beat the eager forward up to budget {max(paying)}" if paying
                     else "graphs beat the eager forward at no measured budget")
        cap = doc.get("capture", {})
        compiled = doc.get("compiled_eager") or {}
        parts.append(f"the runner's eager forward: compiled blocks {compiled.get('status', 'not recorded')}"
                     + (f" ({compiled['reason']})" if compiled.get("reason") else ""))
        parts.append(f"capture: {fmt(cap.get('seconds'))} s, pool {fmt(cap.get('pool_bytes'))} bytes, compile "
                     f"{cap.get('compile', {}).get('status', cap.get('compile', {}).get('mode'))}; kernels: "
                     + ", ".join(f"{k} from {v.get('min_rows')} rows" for k, v in (doc.get("kernels") or {}).items()
                                 if isinstance(v, dict)))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
