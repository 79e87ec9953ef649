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
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from encgraph.cli._common import (
    UsageError,
    add_output_args,
    add_subcommand,
    budget_list,
    emit_json,
    positive_int,
    progress,
)
from encgraph.cli.demo_batches import make_batch
from encgraph.cli.demo_report import DemoReport, path_ladders
from encgraph.cli.demo_timing import CPU_MAX_PAIRS, CPU_MIN_PAIRS, CPU_SECONDS, Timings, time_interleaved
from encgraph.embedded_towers import TOWERS, build_tower

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "run", "THRESHOLDS"]

#: Largest per-item relative error (max |out - ref| / max |ref|) the demo accepts, per dtype. float32 on the CPU
#: agrees to ~1e-7; half precisions differ by kernel choice (varlen vs SDPA attention, batch vs item matmuls).
THRESHOLDS = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}

#: Largest budget the demo takes on a CPU (its padded static forward of a larger one runs for minutes there).
CPU_MAX_BUDGET = 16384

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
    p.add_argument(
        "--repeats",
        type=positive_int,
        help=f"timed calls of each system, interleaved after a warm-up call (default 20 on CUDA; on a CPU as many as "
        f"fit in about {CPU_SECONDS:g} s, {CPU_MIN_PAIRS} to {CPU_MAX_PAIRS})",
    )
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


def _time_both(tower: Callable[[], Any], runner: Callable[[], Any], repeats: int | None, device: torch.device, *,
               show: bool) -> Timings:
    """The tower's own forward and encgraph, timed interleaved (:mod:`encgraph.cli.demo_timing`): ``repeats``
    pairs, or by default 20 on CUDA and on a CPU as many as fit in about a second (5 to 25)."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if repeats is not None:
        pairs, min_seconds, most = repeats, 0.0, repeats
    elif device.type == "cuda":
        pairs, min_seconds, most = 20, 0.0, 20
    else:
        pairs, min_seconds, most = CPU_MIN_PAIRS, CPU_SECONDS, CPU_MAX_PAIRS
    return time_interleaved(
        tower, runner, pairs=pairs, sync=sync, min_seconds=min_seconds, max_pairs=most,
        bar=lambda it: progress(it, desc="timing the tower and encgraph", enabled=show, total=most),
    )


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
            f"({', '.join(spec.budgets)}); the demo uses its own ({path_ladders(spec.budgets)}), drop --budgets"
        )
    show = not args.quiet and sys.stderr.isatty()
    threshold = THRESHOLDS[dtype_name]
    largest = max(max(lad) for lad in ladder.values()) if isinstance(ladder, Mapping) else max(ladder)
    if device.type == "cpu" and largest > CPU_MAX_BUDGET:
        raise UsageError(
            f"encgraph demo: error: --budgets: the CPU runs the padded static forward of each budget eagerly, and "
            f"budgets over {CPU_MAX_BUDGET} take minutes there; got {largest}: use smaller budgets or --device cuda"
        )
    if not args.quiet:
        # Measured wall time of the whole command, imports included: 9-10 s for siglip, qwen2_5_vl and qwen3_vl,
        # 19 s for gemma4 on a 2-core CPU (more when other work shares it); no estimate for a GPU's capture.
        took = " (on a 2-core CPU about 10 s, gemma4 about 20 s; longer on a busy machine)" if device.type == "cpu" else ""
        print(f"encgraph demo: building the {spec.name} tower and a seeded batch on {device}, then wrapping, capturing "
              f"and checking it{took} ...", file=sys.stderr, flush=True)

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
            timings = _time_both(lambda: reference(*batch.args, **batch.kwargs), lambda: runner(inputs),
                                 args.repeats, device, show=show)
        finally:
            adapter.unwrap()

    report = DemoReport(
        args=args, description=description, device=str(device), dtype=dtype_name, runner=runner, batch=batch,
        specs=tuple(specs), plan=plan, errors=tuple(errors), compared=tuple(compared), threshold=threshold,
        timings=timings, capture=capture, stats=stats,
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
