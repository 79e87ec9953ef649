"""``encgraph demo``: encgraph doing its job on a tiny random-weight tower, with no download and no GPU needed.

Builds a shipped tower (``encgraph/configs/<model>.json``, seeded random weights), sends it a seeded mixed
batch, and prints the ladder, the plan, the per-item agreement of encgraph's outputs with the tower's own
forward, and timings: captured CUDA graphs against the tower's eager forward on a GPU; on a CPU the runner's
STATIC mode (the same plan, padded buffers and static forward as a replay, run eagerly).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from encgraph.cli._common import (
    UsageError,
    add_output_args,
    add_subcommand,
    budget_list,
    budget_text,
    count,
    emit_json,
    plan_json,
    plan_lines,
    positive_int,
    progress,
    table,
)
from encgraph.cli.demo_batches import DemoBatch, make_batch
from encgraph.embedded_towers import TOWERS, build_tower
from encgraph.packing import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "run", "THRESHOLDS"]

#: Largest per-item relative error (max |out - ref| / max |ref|) the demo accepts, per dtype. float32 on the CPU
#: agrees to ~1e-7; half precisions differ by kernel choice (varlen vs SDPA attention, batch vs item matmuls).
THRESHOLDS = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}

#: Largest budget the demo takes on a CPU (its padded static forward of a larger one runs for minutes there).
CPU_MAX_BUDGET = 16384

_NOTE_CPU = (
    "CUDA graphs need a CUDA GPU: on the CPU the runner runs in STATIC mode (the same plan, padded buffers and "
    "static forward that a graph would replay, run eagerly), so the agreement above checks what a replay "
    "computes, not its speed; run 'encgraph demo' on a GPU machine for the speed-up."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_subcommand(
        subparsers,
        "demo",
        run,
        help="run a tiny random-weight tower through encgraph and check it against the tower's own forward",
        description="Build a small random-weight vision tower from a config shipped with encgraph (no download), "
        "send it a seeded mixed batch, and print the ladder, the plan, per-item agreement with the tower's own "
        "forward, and timings (CUDA graphs on a GPU; the CPU static mode otherwise).",
    )
    p.add_argument("--model", choices=sorted(TOWERS), default="qwen2_5_vl", help="shipped tower (default qwen2_5_vl)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype", choices=sorted(THRESHOLDS), help="tower dtype (default: float32 on the CPU, bfloat16 on CUDA)"
    )
    p.add_argument(
        "--budgets", type=budget_list, help="the ladder, comma-separated (tokens; images for siglip); default per model"
    )
    p.add_argument("--max-items", type=positive_int, help="most items per batch (default: the runner's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default 0)")
    p.add_argument("--repeats", type=positive_int, help="timed calls per measurement (default 3 on CPU, 20 on CUDA)")
    add_output_args(p)
    return p


# ---------------------------------------------------------------------------------------------- setup


def _device(text: str | None) -> torch.device:
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"encgraph demo: error: --device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"encgraph demo: error: --device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("encgraph demo: error: --device cuda: CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"encgraph demo: error: --device {text}: only {torch.cuda.device_count()} CUDA devices; use "
                f"cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    return device


@contextlib.contextmanager
def _exact_float32(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """On CUDA in float32, turn TF32 off while the demo runs (and put the settings back), so that the agreement
    check compares float32 results rather than TF32 rounding of differently shaped batches."""
    import torch

    if device.type != "cuda" or dtype != torch.float32:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------------------------------------- measuring


def _leaves(out: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a tower output (ModelOutput, dict, tuple, list, tensor) by dotted name; ``None`` skipped."""
    import torch

    if isinstance(out, torch.Tensor):
        return {prefix or "out": out}
    if isinstance(out, Mapping):
        items = list(out.items())
    elif isinstance(out, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(out)]
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        if value is not None:
            found.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def _relative_error(mine: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> tuple[float, list[str]]:
    """max |mine - ref| / max |ref| over every output the tower returns, and their names; an output encgraph
    does not return (or returns with another shape, or where the tower returns none) counts as an infinite
    error, so a missing field can never pass as agreement."""
    names = sorted(set(ref) | set(mine))
    worst = 0.0
    for k in names:
        if k not in mine or k not in ref or tuple(mine[k].shape) != tuple(ref[k].shape):
            worst = math.inf
            continue
        a, b = mine[k].double(), ref[k].double()
        scale = b.abs().max().item() or 1.0
        err = (a - b).abs().max().item() / scale
        # A NaN anywhere (stale padding leaking into real rows: design rule 1) must not compare as small.
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst, names


def _median_ms(fn: Callable[[], Any], repeats: int, device: torch.device, *, desc: str, show: bool) -> float:
    import torch

    # The checked call (and the per-item reference forwards) already ran both sides once on these inputs; on
    # CUDA one more untimed call settles the caching allocator and lazy kernel loading.
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        fn()
        sync()
    times = []
    for _ in progress(range(repeats), desc=desc, enabled=show):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    import torch

    from encgraph import EncoderGraphRunner
    from encgraph.capture.records import RunMode
    from encgraph.models import wrap

    spec = TOWERS[args.model]
    device = _device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    ladder = args.budgets or spec.budgets
    if args.budgets and isinstance(spec.budgets, Mapping):
        raise UsageError(
            f"encgraph demo: error: --budgets: --model {spec.name} has one ladder per path "
            f"({', '.join(spec.budgets)}); the demo uses its own ({_path_ladders(spec.budgets)}), drop --budgets"
        )
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    show = not args.quiet and sys.stderr.isatty()
    threshold = THRESHOLDS[dtype_name]
    largest = max(max(lad) for lad in ladder.values()) if isinstance(ladder, Mapping) else max(ladder)
    if device.type == "cpu" and largest > CPU_MAX_BUDGET:
        raise UsageError(
            f"encgraph demo: error: --budgets: the CPU runs the padded static forward of each budget eagerly, and "
            f"budgets over {CPU_MAX_BUDGET} take minutes there; got {largest}: use smaller budgets or --device cuda"
        )
    if not args.quiet:
        print(f"encgraph demo: building the {spec.name} tower and a seeded batch on {device}, then wrapping, capturing "
              "and checking it (a few seconds on a CPU) ...", file=sys.stderr, flush=True)

    tower, description = build_tower(spec.name, seed=args.seed, device=device, dtype=dtype)
    batch = make_batch(spec, tower, seed=args.seed, ladder=ladder)
    # The reference is the tower's own forward: an untouched copy, since wrapping switches the attention
    # implementation of the wrapped tower.
    reference = copy.deepcopy(tower)
    with torch.no_grad(), _exact_float32(device, dtype):
        adapter = wrap(tower)
        try:
            # Built first so that bad --budgets / --max-items fail before any model work.
            # The demo shows the padded plan: on a CPU (whose default is the eager forward) it asks for it.
            mode = None if device.type == "cuda" else RunMode.STATIC
            runner = EncoderGraphRunner(adapter, budgets=ladder, max_items=args.max_items, device=device, progress=show,
                                        mode=mode)
            inputs = adapter.inputs_from_call(*batch.args, **batch.kwargs)
            capture = runner.capture()
            plan = runner.plan(inputs)
            specs = adapter.item_specs(inputs)
            results = runner(inputs)
            stats = runner.stats
            refs = [
                _leaves(reference(*item.args, **item.kwargs))
                for item in progress(batch.items, desc="reference forwards", enabled=show)
            ]
            errors, compared = [], []
            for i, ref in enumerate(refs):
                mine = _leaves(adapter.output_for_call([results[i]], adapter.select(inputs, [i])))
                err, compared = _relative_error(mine, ref)
                errors.append(err)
            eager_ms = _median_ms(
                lambda: reference(*batch.args, **batch.kwargs), repeats, device, desc="timing the tower", show=show
            )
            runner_ms = _median_ms(lambda: runner(inputs), repeats, device, desc="timing encgraph", show=show)
        finally:
            adapter.unwrap()

    report = _Report(
        args=args, description=description, device=str(device), dtype=dtype_name, runner=runner, batch=batch,
        specs=tuple(specs), plan=plan, errors=tuple(errors), compared=tuple(compared), threshold=threshold,
        eager_ms=eager_ms, runner_ms=runner_ms, repeats=repeats, capture=capture, stats=stats,
    )
    if args.json:
        emit_json(report.json())
    else:
        print("\n".join(report.lines()))
    bad = [i for i, e in enumerate(errors) if not e <= threshold]
    if bad:
        print(
            f"encgraph demo: items {bad} differ from the tower's own forward by more than {threshold:g} "
            f"(largest {max(errors[i] for i in bad):.3g}); please report this with the output above",
            file=sys.stderr,
        )
        return 1
    return 0


def _path_ladders(ladders: Mapping[str, Any]) -> str:
    return "; ".join(f"{path} {', '.join(map(str, ladder))}" for path, ladder in ladders.items())


def _path_lines(paths: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per path of a multi-path tower, what the checked call ran there: replays per budget and eager items."""
    out = ["per path:"]
    for path, p in paths.items():
        replays = ", ".join(f"{n} at {b}" for b, n in sorted(p["replays"].items())) or "none"
        out.append(
            f"  {path}: {p['real_tokens']} tokens, replays {replays}; {count(p['eager_items'], 'item')} eager; "
            f"padded share {p['padded_share']:.1%}"
        )
    return out


@attrs.frozen
class _Report:
    """What the demo measured, as text lines or as one JSON object.

    ``errors[i]``: item ``i``'s max |encgraph - tower| / max |tower| over the outputs named in ``compared``;
    ``eager_ms`` / ``runner_ms``: medians over ``repeats`` calls on the whole batch; ``stats``: the runner's
    counters after the checked call.
    """

    args: argparse.Namespace
    description: str
    device: str
    dtype: str
    runner: Any
    batch: DemoBatch
    specs: tuple[Any, ...]
    plan: Plan
    errors: tuple[float, ...]
    compared: tuple[str, ...]
    threshold: float
    eager_ms: float
    runner_ms: float
    repeats: int
    capture: dict[str, Any]
    stats: dict[str, Any]

    @property
    def name(self) -> str:
        return self.args.model

    @property
    def mode(self) -> str:
        return self.runner.mode.value

    @property
    def unit(self) -> str:
        return self.runner.config.paths[0].unit.value

    def _ran(self, i: int) -> tuple[int, dict[str, int | None], str | None]:
        """Item ``i``'s batch, that batch's budgets, and why it runs eager (``None``: it replays)."""
        for index, b in enumerate(self.plan.batches):
            if i in b.items:
                return index, b.budgets, "; ".join(sorted({r.value for r in b.eager.values()})) or None
        raise AssertionError(f"item {i} is in no batch")  # pragma: no cover  (Plan guarantees it)

    def _versions(self) -> dict[str, str]:
        import torch
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}

    def lines(self) -> list[str]:
        v = self._versions()
        lim = self.runner.limits
        ladder = next(iter(self.runner.ladders.values()))
        unit = "images per batch" if self.unit == "items" else "tokens"
        out = [
            f"encgraph demo: {self.name}, {self.description}; random weights, seed {self.args.seed}",
            f"device {self.device}, {self.dtype}, torch {v['torch']}, transformers {v['transformers']}; runner mode "
            f"{self.mode}",
            f"ladder: {', '.join(map(str, ladder))} {unit}; at most {lim.max_items} items and {lim.max_frames} "
            f"frames per batch",
        ]
        if len(self.runner.ladders) > 1:
            out[-1] = (
                f"ladders, one per path ({unit}; 0: the path skipped): {_path_ladders(self.runner.ladders)}; at most "
                f"{lim.max_items} items and {lim.max_frames} frames per batch"
            )
        items = self.batch.items
        if self.unit == "items":
            sizes = sorted({it.label for it in items})
            out.append(f"items: {count(len(items), 'image')} of {', '.join(sizes)} (a fixed-resolution tower)")
        else:
            videos = sum(1 for it in items if it.kind == "video")
            out.append(
                f"items: {len(items)} ({count(len(items) - videos, 'image')}, {count(videos, 'video')}), "
                f"{sum(s.total_tokens for s in self.specs)} tokens"
            )
            out += table(
                ("item", "tokens", "frames", "kind", "grid t,h,w", "size"),
                (
                    (i, s.total_tokens, s.frames, it.kind, ",".join(map(str, it.grid)) if it.grid else "-", it.label)
                    for i, (it, s) in enumerate(zip(items, self.specs))
                ),
                left=3,
            )
        out += plan_lines(self.plan, [it.label for it in items], unit="images" if self.unit == "items" else "tokens")
        if len(self.runner.ladders) > 1:
            out += _path_lines(self.stats["paths"])
        out.append(
            f"agreement with the tower's own forward, per item (max |encgraph - tower| / max |tower| over "
            f"{', '.join(self.compared)}):"
        )
        out += table(
            ("item", "max rel err", "ran"),
            ((i, f"{e:.2e}", self._ran_text(i)) for i, e in enumerate(self.errors)),
        )
        worst = max(self.errors)
        verdict = "agree" if worst <= self.threshold else "DO NOT all agree"
        out.append(f"all {len(self.errors)} items {verdict} within {self.threshold:g} ({self.dtype}); largest {worst:.2e}")
        out.append(f"timings, median of {count(self.repeats, 'call')} on the whole batch:")
        label = "encgraph, CUDA graphs" if self.mode == "graph" else f"encgraph, {self.mode} mode"
        rows = [("tower's own forward (eager)", f"{self.eager_ms:.2f} ms"), (label, f"{self.runner_ms:.2f} ms")]
        if self.mode == "graph":
            rows.append(("speed-up", f"{self.eager_ms / self.runner_ms:.2f}x"))
        width = max(len(name) for name, _ in rows)
        out += [f"  {name.ljust(width)}  {value}" for name, value in rows]
        if self.mode == "graph":
            c = self.capture
            out.append(
                f"capture: {c.get('graphs', 0)} graphs in {c.get('seconds', 0.0):.2f} s, graph pool "
                f"{c.get('pool_bytes', 0) / 2**20:.1f} MiB, static buffers {c.get('buffer_bytes', 0) / 2**20:.1f} MiB"
                + (f"; failed: {c['failed']}" if c.get("failed") else "")
            )
        else:
            out.append(f"note: {_NOTE_CPU}")
        return out

    def _ran_text(self, i: int) -> str:
        batch, budgets, reason = self._ran(i)
        return f"batch {batch}, " + (f"eager ({reason})" if reason else f"budget {budget_text(self.plan, budgets)}")

    def json(self) -> dict[str, Any]:
        lim = self.runner.limits
        return {
            "model": self.name,
            "description": self.description,
            "seed": self.args.seed,
            "device": str(self.device),
            "dtype": self.dtype,
            "mode": self.mode,
            "versions": self._versions(),
            "unit": self.unit,
            "ladders": {p: list(lad) for p, lad in self.runner.ladders.items()},
            "limits": {"max_items": lim.max_items, "max_frames": lim.max_frames},
            "items": [
                {
                    "item": i,
                    "kind": it.kind,
                    "label": it.label,
                    "grid": list(it.grid) if it.grid else None,
                    "tokens": s.total_tokens,
                    "frames": s.frames,
                    "batch": self._ran(i)[0],
                    "budgets": self._ran(i)[1],
                    "eager_reason": self._ran(i)[2],
                    "max_rel_error": self.errors[i],
                }
                for i, (it, s) in enumerate(zip(self.batch.items, self.specs))
            ],
            "plan": plan_json(self.plan),
            "agreement": {
                "outputs": self.compared,
                "max_rel_error": max(self.errors),
                "threshold": self.threshold,
                "ok": max(self.errors) <= self.threshold,
            },
            "timings_ms": {
                "repeats": self.repeats,
                "tower_eager": self.eager_ms,
                "encgraph": self.runner_ms,
                "encgraph_mode": self.mode,
            },
            "capture": self.capture,
            "stats": self.stats,
            "note": None if self.mode == "graph" else _NOTE_CPU,
        }
