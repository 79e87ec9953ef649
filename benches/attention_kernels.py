"""Packed (varlen) attention kernels at the towers' head geometry, inside CUDA graphs: which kernel the captured
forward should call.

For each head geometry (heads x head_dim of a tower) and packed layout (sequence lengths filling a budget, the
last one the padding sequence), the median time of one attention call replayed from a CUDA graph (CUDA events,
``--runs`` replays of a graph holding ``--calls`` calls), for:

- ``flash``: ``torch.nn.attention.varlen.varlen_attn`` (torch's Flash Attention 2 build), what the adapters call;
- ``cudnn_ragged``: ``aten._cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k`` (cuDNN's ragged-offset
  SDPA, the kernel nested-tensor SDPA uses), same ``(tokens, heads, head_dim)`` layout. torch 2.11's varlen path
  looks its cuDNN graph up but never stores it, so every call builds and compiles the graph again (pytorch PR
  191576, after 2.11), inside a capture too: why its capture fails;
- ``cudnn_frontend``: the same cuDNN SDPA through NVIDIA's ``nvidia-cudnn-frontend`` wheel
  (``cudnn.sdpa_torch``: ``(tokens, heads, head_dim)`` with ``cu_seqlens``, element offsets derived from them
  by tensor ops), whose graph is built once per (sequences, longest sequence, heads, head dim) and cached, the
  handle set to the current stream at each call: after a warm-up of the same shapes a capture holds only its
  ``execute``;
- ``efficient``: ``aten._efficient_attention_forward`` with ``cu_seqlens`` (the memory-efficient kernel);
- ``cudnn_dense``: one dense ``(1, heads, len, head_dim)`` SDPA call per sequence on the cuDNN backend (what
  Hugging Face's sdpa path runs per image), a reference that a single packed graph cannot use as is;
- ``fa4``: FlashAttention-4's varlen forward (``flash_attn.cute.interface.flash_attn_varlen_func``, the
  ``flash-attn-4`` wheel, CuTe DSL kernels compiled at the first call of each configuration) as
  :func:`encgraph.models.fa4.varlen_attn` calls it, directly: torch's
  own hook (``torch.nn.attention.activate_flash_attention_impl("FA4")``) swaps the kernel for every module of the
  process, which a wrapped tower must not do;
- ``cudnn_dense_cols``: ONE dense cuDNN SDPA call over every packed row, the sequences kept apart by extra
  head-dim columns (:func:`segment_columns`) built from ``cu_seqlens`` with tensor ops: a packed graph can call
  it, and it reads the lengths from the buffer. It does ``tokens^2`` work whatever the split, so it can only pay
  where one or two long sequences fill the budget (dense cuDNN ran 1.6-1.8x Flash's TF/s at head dim 72);
- ``flashinfer``: FlashInfer's ragged prefill (``flashinfer-python``, kernels compiled by nvcc on the machine at
  the first call of each head geometry), :class:`benches.lib.flashinfer_kernel.FlashInferRagged`: its lengths
  are planned on the host, so its rewrite check re-plans the new split on the host before the replay (what the
  runner's host plan could do before each replay); the backend FlashInfer chose (FA2 or FA3) is in each row.

Each kernel's output is compared with ``flash`` (max relative difference over valid rows), and each graph is
replayed a second time after the cumulative lengths are rewritten in place (a different split of the same
tokens) and compared with a fresh eager call: a kernel that baked the lengths into the graph fails that check.

Each kernel is also timed eagerly (``eager_ms``: median of ``--runs`` synchronized runs of ``--calls`` calls,
divided by ``--calls``) and checked for host syncs (``syncs_host``: whether a call raises under
``torch.cuda.set_sync_debug_mode("error")``), in a process of its own that captures nothing, so a kernel whose
capture fails still gets both: what a piecewise design (graphs between eager attention calls) would pay.

Writes ``benches/results/attention_kernels_<gpu>.json`` and ``.md``. CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.cli import base_parser, parse_names
from benches.lib.env import Env, make_env
from benches.lib.results import Results, gpu_name, markdown_table
from benches.lib.timing import time_call

SCRIPT = "attention_kernels"
# kernels()' keys, in order
KERNELS = ("flash", "cudnn_ragged", "cudnn_frontend", "efficient", "cudnn_dense", "cudnn_dense_cols", "fa4",
           "flashinfer")
# The kernels that read the lengths from a buffer: the rewrite check applies.
REWRITABLE = ("flash", "cudnn_ragged", "cudnn_frontend", "efficient", "cudnn_dense_cols", "fa4", "flashinfer")
MODES = ("graph", "eager")
GEOMETRIES = {  # tower: (heads, head_dim)
    "qwen3_vl / siglip / qwen3_5 / kimi / minicpm": (16, 72),
    "qwen2_5_vl / ernie": (16, 80),
    "glm4v": (12, 128),
    "internvit_300m": (16, 64),
}
LAYOUTS = {  # name: (sequence lengths, another split of the same rows into as many sequences, for the rewrite)
    "1 x 5120 (one 896 px image)": ([5120, 0], [2560, 2560]),
    "4 x 1280 + pad 256": ([1280] * 4 + [256], [2000, 1000, 840, 1280, 256]),
    "2 x 4096 + pad 896": ([4096, 4096, 896], [4096, 2048, 2944]),
    "16 x 256 + pad 1024": ([256] * 16 + [1024], [512] * 8 + [0] * 8 + [1024]),
    "1 x 12800": ([12800, 0], [6400, 6400]),
    "1 x 27000 (a 2.4k x 2.8k photo)": ([27000, 0], [13500, 13500]),
    # The runner's own layout: unused sequence slots are empty (zero-length) sequences after the padding one.
    "4 x 1280 + pad 256 + 12 empty slots": ([1280] * 4 + [256] + [0] * 12, [2560, 2560, 256] + [0] * 14),
}

# A rewrite must cover the same rows: a split past the tensors' end reads out of bounds (an earlier version of
# this table did, and every kernel "failed" that row with a wrong output or an illegal memory access).
assert all(sum(a) == sum(b) and len(a) == len(b) for a, b in LAYOUTS.values()), "LAYOUTS: splits must match"


def _cu(lengths: list[int], device: Any) -> Any:
    import torch

    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


MASK_LOGIT = 1e4
"""How far below its own sequence's logits :func:`segment_columns` puts another sequence's: exp(-1e4) is 0."""


def segment_columns(q: Any, k: Any, v: Any, cu: Any, scale: float) -> tuple[Any, Any, Any]:
    """``q, k, v`` (``(tokens, heads, D)``) widened to ``E`` columns (``D`` + one per sequence slot of ``cu``,
    rounded up to a multiple of 8) so that one dense attention over all rows, at softmax ``scale``, equals
    attention within each sequence. Query row i gets ``MASK_LOGIT / scale`` in the column of its sequence, key row
    j gets -1 in every column but its own (0 there): the extra product is exactly 0 within a sequence (its logits
    are untouched) and ``-MASK_LOGIT / scale`` across, so across-sequence weights are exp(-1e4) = 0. ``v`` gets
    zero columns (the output's extra columns are 0; callers keep ``[..., :D]``). Tensor ops only: no host sync,
    capturable, the lengths read from ``cu`` at run time. A kernel for the runner would also need the masked
    backend's sanitising (``encgraph.models.attention``): a zero weight times another sequence's NaN value is NaN."""
    import torch

    tokens, heads, dim = q.shape
    slots = cu.numel() - 1
    width = -(-(dim + slots) // 8) * 8
    rows = torch.arange(tokens, device=q.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)  # row -> its sequence's slot
    hot = (seq[:, None] == torch.arange(slots, device=q.device)[None, :]).to(q.dtype)  # (tokens, slots)
    pad = width - dim - slots

    def widen(t: Any, extra: Any) -> Any:
        parts = [t, extra[:, None, :].expand(tokens, heads, slots), t.new_zeros(tokens, heads, pad)]
        return torch.cat(parts, dim=-1)

    wide_v = torch.cat([v, v.new_zeros(tokens, heads, width - dim)], dim=-1)
    return widen(q, hot * (MASK_LOGIT / scale)), widen(k, hot - 1), wide_v


def kernels() -> dict[str, Callable[..., Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    def flash(q, k, v, cu, max_len, lengths):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len)

    def cudnn_ragged(q, k, v, cu, max_len, lengths):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False, 0.0, False,
                                                       False)[0]

    def cudnn_frontend(q, k, v, cu, max_len, lengths):
        import cudnn  # nvidia-cudnn-frontend (>= 1.32: its torch op); not a dependency of encgraph

        return cudnn.sdpa_torch(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                                max_seqlen_kv=max_len)

    def efficient(q, k, v, cu, max_len, lengths):
        out = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu, cu, max_len, max_len,
                                                          0.0, 0, False)[0]
        return out[0]

    def cudnn_dense(q, k, v, cu, max_len, lengths):  # static split: the lengths are baked in (reference only)
        outs, start = [], 0
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for n in (n for n in lengths if n):
                s = slice(start, start + n)
                outs.append(F.scaled_dot_product_attention(*(t[s].transpose(0, 1)[None] for t in (q, k, v)))[0]
                            .transpose(0, 1))
                start += n
        return torch.cat(outs)

    def cudnn_dense_cols(q, k, v, cu, max_len, lengths):
        scale = q.shape[-1] ** -0.5
        wide = segment_columns(q, k, v, cu, scale)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in wide), scale=scale)[0]
        return out.transpose(0, 1)[..., : q.shape[-1]]

    def fa4(q, k, v, cu, max_len, lengths):  # as encgraph calls it (its max_seqlen rounded up: fa4.bound)
        from encgraph.models import fa4 as fa4_kernel

        return fa4_kernel.varlen_attn(q, k, v, cu, cu, max_len, max_len)

    from benches.lib.flashinfer_kernel import FlashInferRagged

    return {"flash": flash, "cudnn_ragged": cudnn_ragged, "cudnn_frontend": cudnn_frontend, "efficient": efficient,
            "cudnn_dense": cudnn_dense, "cudnn_dense_cols": cudnn_dense_cols, "fa4": fa4,
            "flashinfer": FlashInferRagged()}


def _text(stream: str | bytes | None) -> str:
    """A stream a timed-out ``subprocess.run`` kept (bytes on some Pythons despite ``text=True``)."""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _rel(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def measure_eager(fn: Callable[..., Any], q: Any, k: Any, v: Any, lengths: list[int], calls: int,
                  env: Env) -> dict[str, Any]:
    """Eager calls only: ``eager_ms`` per call and ``syncs_host``."""
    import torch

    cu = _cu(lengths, q.device)
    max_len = max(lengths)
    reference = fn(q, k, v, cu, max_len, lengths)  # also builds any kernel plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(q, k, v, cu, max_len, lengths)
        syncs = False
    except RuntimeError as exc:  # the sync debug mode raises at the first synchronizing call
        syncs = "synchroniz" in str(exc)
        if not syncs:
            raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    timing = time_call(lambda: [fn(q, k, v, cu, max_len, lengths) for _ in range(calls)], env, warmup=1)
    return {"eager_ms": round(timing.summary()["median_ms"] / calls, 5), "syncs_host": syncs, "out": reference}


def measure(fn: Callable[..., Any], q: Any, k: Any, v: Any, lengths: list[int], other: list[int], calls: int,
            env: Env) -> dict[str, Any]:
    import torch

    cu = _cu(lengths, q.device)
    max_len = max(max(lengths), max(other))
    reference = fn(q, k, v, cu, max_len, lengths)  # eager, also the warm-up (builds any kernel plans)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(q, k, v, cu, max_len, lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(q, k, v, cu, max_len, lengths) for _ in range(calls)]
    graph.replay()
    torch.cuda.synchronize()
    replay_vs_eager = _rel(outs[0], reference)
    median_ms = time_call(graph.replay, env, warmup=0).summary()["median_ms"] / calls
    got = {"median_ms": round(median_ms, 5), "replay_vs_eager": replay_vs_eager, "out": reference}
    try:  # timed already: a rewrite the kernel cannot run still leaves the row its timing
        cu.copy_(_cu(other, q.device))  # a different split of the same rows, written into the captured buffer
        if hasattr(fn, "replan"):  # a kernel planned on the host (FlashInfer): the plan of the new split first
            fn.replan(q, k, cu, other)
        graph.replay()
        fresh = fn(q, k, v, cu, max_len, other)
        torch.cuda.synchronize()
        got["rewritten_lengths_vs_eager"] = _rel(outs[0], fresh)
    except Exception as exc:  # noqa: BLE001 -- recorded with the row
        got["rewrite_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        got["context_lost"] = isinstance(exc, torch.AcceleratorError)
    return got


ROWS = [(geometry, heads, dim, layout) for geometry, (heads, dim) in GEOMETRIES.items() for layout in LAYOUTS]


def child(name: str, calls: int, env: Env, eager: bool = False, skip: int = 0) -> None:
    """One kernel over the rows of :data:`ROWS` from ``skip`` on, in this process: prints one ``ROW <json>`` line
    per row (with ``eager``: :func:`measure_eager`, nothing captured)."""
    import torch

    fn, flash = kernels()[name], kernels()["flash"]
    for geometry, heads, dim, layout in ROWS[skip:]:
        lengths, other = LAYOUTS[layout]
        gen = torch.Generator(device="cuda").manual_seed(0)
        total = sum(lengths)
        q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        reference = flash(q, k, v, _cu(lengths, q.device), max(lengths), lengths)
        try:
            if eager:
                got = measure_eager(fn, q, k, v, lengths, calls, env)
            else:
                got = measure(fn, q, k, v, lengths, lengths if name == "cudnn_dense" else other, calls, env)
        except Exception as exc:  # noqa: BLE001 -- a kernel this build or geometry lacks: recorded
            traceback.print_exc()
            got = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print("ROW " + json.dumps({"geometry": geometry, "layout": layout, "result": got}), flush=True)
            if isinstance(exc, torch.AcceleratorError):
                return  # the context is gone: the parent starts a fresh child at the next row
            continue
        out = got.pop("out")
        if got.pop("context_lost", False):  # the rewrite killed the context: nothing more can run here
            print("ROW " + json.dumps({"geometry": geometry, "layout": layout, "result": got}), flush=True)
            return
        got["vs_flash"] = _rel(out, reference)
        if hasattr(fn, "describe"):
            got["kernel"] = fn.describe()
        print("ROW " + json.dumps({"geometry": geometry, "layout": layout, "result": got}), flush=True)


def main() -> int:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=120.0)
    p.add_argument("--calls", type=int, default=10, help="attention calls per captured graph (default 10)")
    p.add_argument("--child-timeout", type=float, default=300.0,
                   help="seconds one kernel's process may run (default 300; FlashInfer compiles its kernels there)")
    p.add_argument("--kernel", choices=tuple(kernels()), default=None, help=argparse.SUPPRESS)
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--kernels", type=parse_names(tuple(KERNELS)), default=KERNELS,
                   help=f"comma-separated subset of {','.join(KERNELS)} (default all)")
    p.add_argument("--modes", type=parse_names(MODES), default=MODES,
                   help="graph (captured), eager, or both (default graph,eager)")
    args = p.parse_args()
    if args.cpu_smoke:
        print("attention_kernels.py times CUDA kernels; it has no CPU smoke (run it on a GPU)")
        return 2
    env = make_env(args)
    if args.kernel:
        child(args.kernel, args.calls, env, eager=args.eager, skip=args.skip)
        return 0
    results = Results(SCRIPT, args, env)
    rows = {(g, lay): {"geometry": g, "heads": h, "head_dim": d, "layout": lay, "tokens": sum(lengths),
                       "tflop": 4 * h * d * sum(n * n for n in lengths) / 1e12}
            for g, (h, d) in GEOMETRIES.items() for lay, (lengths, _) in LAYOUTS.items()}
    assert tuple(kernels()) == KERNELS, "KERNELS must list kernels()"
    names = list(args.kernels)
    # Each kernel in its own process, captured, then eagerly in another: a failed capture can poison the CUDA
    # context, and the eager run must not depend on it.
    for name, eager in [(n, m == "eager") for n in names for m in args.modes]:
        key = f"{name}_eager" if eager else name
        done, returncode = 0, 0
        # An error that kills the CUDA context ends the child after its row (recorded); a fresh child goes on
        # from the next row, so one layout a kernel cannot run does not hide the others.
        while done < len(ROWS):
            command = [sys.executable, __file__, "--kernel", name, "--runs", str(env.runs), "--calls",
                       str(args.calls), "--skip", str(done), *(["--eager"] if eager else [])]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout,
                                      check=False)
                out, err, returncode = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:  # a kernel build or a hang: the rows it printed still count
                out, err = (_text(exc.stdout), _text(exc.stderr))
                returncode = f"killed after {args.child_timeout:.0f} s"
            sys.stderr.write(err[-4000:])
            before = done
            for line in out.splitlines():
                if line.startswith("ROW "):
                    row = json.loads(line[4:])
                    entry = rows[(row["geometry"], row["layout"])]
                    got = row["result"]
                    for ms, tf in (("median_ms", "tflops"), ("eager_ms", "eager_tflops")):
                        if ms in got:
                            got[tf] = round(entry["tflop"] / (got[ms] / 1e3), 1)
                    entry[key] = got
                    done += 1
                    print(key, row["geometry"], row["layout"], got, flush=True)
            if done == before:  # no row came back: the child cannot start; the rest are recorded as not run
                break
        for entry in rows.values():
            entry.setdefault(key, {"error": f"not run (the {key} process exited {returncode} before it)"})
        results.data["rows"] = list(rows.values())
        results.flush()
    results.finish(render(results.data["rows"], names, gpu_name(env)))
    return 0


def render(rows: list[dict[str, Any]], names: list[str], gpu: str) -> str:
    """The two markdown tables (captured, eager) of ``rows`` for the kernels ``names``; a kernel a row lacks
    is shown as not measured."""
    not_run = {"error": "not measured in this run"}

    def get(r: dict[str, Any], key: str) -> dict[str, Any]:
        return r.get(key, not_run)

    captured = [n for n in names if n in REWRITABLE]
    table = [[r["geometry"], r["layout"], *(
        f"{get(r, n)['median_ms']:.3f} ({get(r, n)['tflops']:.0f} TF/s)" if "median_ms" in get(r, n)
        else get(r, n)["error"][:60] for n in names), *(
        f"{get(r, n)['rewritten_lengths_vs_eager']:.1e}" if "rewritten_lengths_vs_eager" in get(r, n)
        else get(r, n).get("rewrite_error", "-")[:60] for n in captured)]
        for r in rows]
    eager = [[r["geometry"], r["layout"], *(
        f"{get(r, n + '_eager')['eager_ms']:.3f} ({get(r, n + '_eager')['eager_tflops']:.0f} TF/s"
        f"{', syncs' if get(r, n + '_eager')['syncs_host'] else ''})" if "eager_ms" in get(r, n + "_eager")
        else get(r, n + "_eager")["error"][:60] for n in names)] for r in rows]
    return "\n".join([
        f"## attention kernels in CUDA graphs ({gpu}, bfloat16): ms per call (useful TFLOP/s)", "",
        markdown_table(["heads x dim", "layout", *names, *(f"{n}: rewritten lengths vs eager" for n in captured)],
                       table), "",
        "### the same kernels called eagerly: ms per call (useful TFLOP/s; 'syncs': the call syncs the host)", "",
        markdown_table(["heads x dim", "layout", *names], eager)])


if __name__ == "__main__":
    raise SystemExit(main())
