"""Empty sequence slots in a captured varlen attention call: what the runner's ``cu_seqlens`` layout costs.

A captured Qwen-layout graph calls the varlen kernel with ``max_seqlen`` = the budget's rows ``R`` (any one sequence
may fill the budget) and a ``cu_seqlens`` buffer of ``min(max_frames, budget) + 2`` slots (34 with the default 16
items x 2 frames, 130 with the 64 items of the default before): the real sequences, one padding sequence, then
zero-length ones. torch's Flash kernel launches ``ceil(R / 128)`` row blocks per sequence slot and head, and an
empty one only returns, so one 896 px Qwen3-VL image at budget 896 (``R`` = 3,584) started about 58,000 blocks a
layer at 130 slots, of which some 460 have rows (``docs/benchmarks.md``). This measures that cost directly: per head
geometry and budget rows ``R``, one real sequence of ``--fill`` x ``R`` rows and the padding sequence, in
``cu_seqlens`` buffers of each of ``--slots`` entries, the attention call replayed from a CUDA graph (``--calls``
calls per graph, median of ``--runs`` replays, CUDA events) through
:func:`encgraph.models.attention.packed_attention`, the call the adapters make (its varlen kernel: torch's Flash
unless capture chose FlashAttention-4 for the geometry, which this script does not measure). Each row reports the
ms, the ratio to the fewest slots and the blocks launched, and the real rows' outputs against the fewest slots' (the
empty slots must change nothing).

One more row per geometry and budget: the same sequence through
:func:`encgraph.models.dense_sequence.counted_dense`, one dense SDPA call over the budget's rows (cuDNN's kernel
on an H200) with the real length read on the device from ``cu_seqlens[1]`` and the padding corrected out: the call
a graph of one single-frame image could make instead of the varlen one (the runner has no such graph yet). Its
rewrite check replays it with the budget as the sequence (no padding), against the eager call at that length.

``--cpu-smoke`` runs the same layouts eagerly on the CPU (the masked SDPA backend, tiny sizes): the outputs'
check, no timing that means anything.

    python benches/varlen_slots.py          # writes benches/results/varlen_slots_<gpu>.json and .md
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.cli import base_parser, run_script
from benches.lib.env import SKIPPED_TIME, Deadline, Env
from benches.lib.results import Results, markdown_table

SCRIPT = "varlen_slots"
GEOMETRIES = {"qwen3_vl 16x72": (16, 72), "qwen2_5_vl 16x80": (16, 80), "glm4v 12x128": (12, 128)}
ROWS = (1024, 3584, 5120, 16384)
"""Budget rows: Qwen's budgets 256, 896, 1280 and 4096 tokens at 2 x 2 merged patches."""
SLOTS = (3, 18, 34, 66, 130)
"""``cu_seqlens`` entries: one real sequence and the padding (3), up to 64 items x 2 frames + 2 (the default before
:data:`encgraph.packing.limits.DEFAULT_MAX_ITEMS`; 34 with its 16 items)."""
SMOKE = {"geometries": {"tiny 2x8": (2, 8)}, "rows": (64,), "slots": (3, 10)}
BLOCK_ROWS = 128
"""Rows of query per block of torch's Flash forward kernel (``kBlockM``) at these head dims."""


def lengths_of(rows: int, slots: int, fill: float) -> list[int]:
    """Sequence lengths of one slot layout: ``round(fill * rows)`` real rows, the padding sequence up to ``rows``,
    then ``slots - 3`` empty sequences (``slots`` entries of ``cu_seqlens``, as the runner's buffers hold).

    >>> lengths_of(3584, 6, 0.875)
    [3136, 448, 0, 0, 0]
    """
    if slots < 3 or not 0.0 < fill <= 1.0:
        raise ValueError(f"slots: expected >= 3 and fill in (0, 1], got {slots} and {fill}")
    real = max(1, min(rows, round(fill * rows)))
    return [real, rows - real] + [0] * (slots - 3)


def blocks(rows: int, slots: int, heads: int) -> int:
    """Row blocks the Flash kernel launches for one call: ``ceil(rows / 128)`` per sequence slot and head."""
    return math.ceil(rows / BLOCK_ROWS) * (slots - 1) * heads


def _attention(q: Any, k: Any, v: Any, cu: Any, max_len: int, lengths: Any, backend: Any = None) -> Any:
    """The adapters' call, in :func:`benches.attention_kernels.measure`'s kernel signature."""
    from encgraph.models.attention import packed_attention

    return packed_attention(q, k, v, cu, max_seqlen=max_len, backend=backend)


def _counted(q: Any, k: Any, v: Any, cu: Any, max_len: int, lengths: Any) -> Any:
    """:func:`~encgraph.models.dense_sequence.counted_dense` of the first sequence (``cu[1]`` real rows), in the
    same signature; ``None`` where torch's SDPA picks a kernel without a log-sum-exp."""
    from encgraph.models.dense_sequence import counted_dense

    return counted_dense(q, k, v, cu[1:2], None)


def _exact(q: Any, k: Any, v: Any, cu: Any, max_len: int, lengths: Any) -> Any:
    """The first sequence alone through dense SDPA at its own rows: the tower's own call per image (HF's sdpa),
    which a graph cannot make for images of other sizes."""
    from encgraph.models.dense_sequence import dense_sequence

    n = lengths[0]
    return dense_sequence(q[:n], k[:n], v[:n], None)


VARLEN = "varlen"
DENSE = "dense (counted)"
HF_CALL = "dense, exact rows (HF's call)"
"""The ``kernel`` of each row: the slot rows' varlen call (torch's Flash on CUDA; the defaults' layout at
:data:`DEFAULT_SLOTS`), :func:`_counted` and :func:`_exact`."""
DEFAULT_SLOTS = 34
"""The defaults' ``cu_seqlens`` entries: 16 items x 2 frames + 2 (:data:`encgraph.packing.limits.DEFAULT_MAX_ITEMS`)."""
REWRITE_KEYS = ("rewritten_lengths_vs_eager", "rewrite_error")


def _timed(fn: Any, q: Any, k: Any, v: Any, lengths: list[int], other: list[int], calls: int,
           env: Env) -> tuple[dict[str, Any], Any]:
    """``(fields, eager output)`` of one layout: on CUDA captured and replayed by
    :func:`benches.attention_kernels.measure` (``ms``, ``replay_vs_eager`` and its rewrite check's fields: the
    graph replayed with ``other`` written into ``cu_seqlens``); on the CPU smoke eager, one call a run."""
    from benches import attention_kernels
    from benches.lib.timing import time_call

    rows = q.shape[0]
    if env.cuda:
        got = attention_kernels.measure(fn, q, k, v, lengths, other, calls, env)
        keys = ("replay_vs_eager",) + REWRITE_KEYS
        return {"ms": got["median_ms"], **{key: got[key] for key in keys if key in got}}, got["out"]
    cu = attention_kernels._cu(lengths, q.device)
    eager = fn(q, k, v, cu, rows, lengths)
    return {"ms": round(time_call(lambda: fn(q, k, v, cu, rows, lengths), env).summary()["median_ms"], 5)}, eager


def measure(heads: int, dim: int, rows: int, slots: Sequence[int], fill: float, calls: int, env: Env,
            deadline: Deadline) -> list[dict[str, Any]]:
    """One row per slot count (see the module docs), then a :func:`_counted` and an :func:`_exact` row of the
    same sequence; ``{"skipped": ...}`` past the deadline. Each row's ratio is to the fewest slots' ms and its
    real rows are compared with theirs (bf16 apart on the GPU between two kernels). The slot rows' and the
    counted row's rewrite check replays the graph with the budget as one sequence (for the varlen call that also
    makes its ``max_seqlen`` the budget's rows; for the counted one, the length read on the device, not baked
    in)."""
    import functools

    import torch

    from encgraph.models.attention import AttentionBackend

    backend = AttentionBackend.VARLEN if env.cuda else AttentionBackend.MASKED_SDPA
    varlen = functools.partial(_attention, backend=backend)
    gen = torch.Generator(device=env.device).manual_seed(env.seed * 7919 + rows)
    q, k, v = (torch.randn(rows, heads, dim, device=env.device, dtype=env.dtype, generator=gen) for _ in range(3))
    one = lengths_of(rows, 3, fill)
    layouts = [(VARLEN, varlen, lengths_of(rows, n, fill), [rows] + [0] * (n - 2)) for n in slots]
    layouts += [(DENSE, _counted, one, [rows, 0]), (HF_CALL, _exact, one, one)]
    cu = torch.tensor([0, one[0], rows], dtype=torch.int32, device=env.device)
    out: list[dict[str, Any]] = []
    reference = fewest_ms = None
    for kernel, fn, lengths, other in layouts:
        row: dict[str, Any] = {"kernel": kernel, "rows": rows, "real": lengths[0],
                               "slots": None if kernel == HF_CALL else len(lengths) + 1,
                               "blocks": blocks(rows, len(lengths) + 1, heads) if kernel == VARLEN else None}
        if deadline.expired():
            out.append({**row, "skipped": SKIPPED_TIME})
            continue
        if kernel == DENSE and _counted(q, k, v, cu, rows, one) is None:
            out.append({**row, "skipped": "torch's SDPA picks a kernel without a log-sum-exp here"})
            continue
        fields, eager = _timed(fn, q, k, v, lengths, other, calls, env)
        if kernel == HF_CALL:  # its call reads no cu_seqlens: a rewritten replay would check nothing
            fields = {key: value for key, value in fields.items() if key not in REWRITE_KEYS}
        row.update(fields)
        real = eager[: lengths[0]].float()
        if reference is None:
            reference, fewest_ms = real, row["ms"]
        row["ratio"] = round(row["ms"] / fewest_ms, 3)
        row["vs_fewest_slots"] = float(((real - reference).abs().max() / reference.abs().max()).item())
        out.append(row)
    return out


def run(args: argparse.Namespace, env: Env, deadline: Deadline, results: Results) -> None:
    plan = SMOKE if env.tiny else {"geometries": GEOMETRIES, "rows": ROWS, "slots": SLOTS}
    rows_out: list[dict[str, Any]] = results.data.setdefault("rows", [])
    results.data["fill"] = args.fill
    for label, (heads, dim) in plan["geometries"].items():
        for rows in plan["rows"]:
            for row in measure(heads, dim, rows, plan["slots"], args.fill, args.calls, env, deadline):
                rows_out.append({"geometry": label, **row})
                print(rows_out[-1], flush=True)
            results.flush()


def render(data: Mapping[str, Any]) -> str:
    head = ["geometry", "budget rows", "real rows", "kernel", "cu_seqlens slots", "blocks launched", "ms per call",
            "x fewest slots", "real rows vs fewest slots", "rewritten replay vs eager"]
    body = []
    for r in data.get("rows", []):
        first = [r["geometry"], r["rows"], r["real"], r.get("kernel", VARLEN),
                 "-" if r["slots"] is None else r["slots"], "-" if r.get("blocks") is None else f"{r['blocks']:,}"]
        if "ms" not in r:
            body.append(first + [r.get("skipped", "-"), "-", "-", "-"])
            continue
        rewritten = r.get("rewritten_lengths_vs_eager")
        body.append(first + [f"{r['ms']:.4f}", "-" if r.get("ratio") is None else f"{r['ratio']:.2f}",
                             "-" if r.get("vs_fewest_slots") is None else f"{r['vs_fewest_slots']:.1e}",
                             r.get("rewrite_error", "-") if rewritten is None else f"{rewritten:.1e}"])
    return (f"## varlen attention with empty sequence slots ({data.get('environment', {}).get('gpu', '?')})\n\n"
            f"One real sequence of {data.get('fill', '?')} x the budget's rows and the padding sequence, the "
            "rest of the slots empty, `max_seqlen` = the budget's rows (the runner's captured layout); replayed "
            f"from a CUDA graph; the defaults' layout has {DEFAULT_SLOTS} slots. `{DENSE}`: the same sequence as "
            "one dense SDPA call over the budget's rows, its length read on the device and the padding corrected "
            f"out (`counted_dense`). `{HF_CALL}`: the sequence alone at its own rows, the call the tower's own "
            "forward (HF, sdpa) makes per image, also replayed (a graph of it serves one image size only). "
            "`x fewest slots` against the varlen call at 3 slots; the rewritten replay: the graph replayed with "
            "the budget as the sequence.\n\n"
            + markdown_table(head, body) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=120.0)
    p.add_argument("--calls", type=int, default=10, help="attention calls per captured graph (default 10)")
    p.add_argument("--fill", type=float, default=0.875,
                   help="the real sequence's share of the budget's rows (default 0.875: 3,136 of 3,584)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_script(SCRIPT, build_parser().parse_args(argv), run, render)


if __name__ == "__main__":
    main()
