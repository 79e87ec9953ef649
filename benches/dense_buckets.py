"""Dense cuDNN attention at bucketed lengths: can an eager forward skip cuDNN's plan for each new length?

torch keeps one cuDNN attention plan per exact shape (``MHA.cpp``'s thread-local cache), and building one costs
about 35 ms on an H200 whatever the length, so every new image size pays it once (Hugging Face's sdpa does too)
or runs Flash varlen at about 0.65x cuDNN's rate (encgraph's rent-or-buy). Padding each long sequence up to a
bucket length (:func:`encgraph.packing.kernels.bucket_rows`, ``--per-octave`` buckets per power of two) lets a
handful of plans serve every size, if the padding rows can be masked cheaply. For one sequence of each length,
per head geometry, this measures:

- ``flash``: ``varlen_attn`` over the exact rows (what a rented call runs);
- ``exact``: cuDNN dense SDPA at the exact length (``aten._scaled_dot_product_cudnn_attention``);
- ``dense``: :func:`encgraph.models.dense_sequence.dense_sequence` at the exact length (torch's SDPA, the kernel
  its flags pick: what encgraph's exact dense calls run);
- ``padded``: :func:`encgraph.models.dense_sequence.padded_dense` at the bucket length (what encgraph runs): the
  padding keys are each head's mean key, and the kernel's log-sum-exp takes their share out of the output;
- ``cols``: cuDNN dense at the bucket length with one extra head-dim column (rounded to a multiple of 8) masking
  the padding keys (encgraph's first bucketed kernel: 128 widens to 136, a slower kernel);
- ``bias``: cuDNN dense at the bucket length with a ``(1, 1, 1, bucket)`` additive key-padding bias broadcast
  over heads and queries.

For each: the first call at that shape (``first_ms``: a new plan, where the kernel builds one) and the median of
``--runs`` later calls (``ms``), and each padded variant's max relative difference from ``exact`` on the real
rows. The plan cache is per shape, so every length is new to every variant here.

    python benches/dense_buckets.py           # CUDA only; writes benches/results/dense_buckets_<gpu>.json and .md
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.results import markdown_table, write_rows

GEOMETRIES = {"qwen3_vl 16x72": (16, 72), "qwen2_5_vl 16x80": (16, 80), "glm4v 12x128": (12, 128)}
LENGTHS = (1100, 2300, 4100, 9204, 13700, 27000)  # rows of one image's attention (patches): 450 px ... 3000 px
MASK_LOGIT = 1.0e4
VARIANTS = ("flash", "exact", "dense", "padded", "cols", "bias")


def _cudnn(q: Any, k: Any, v: Any, bias: Any, scale: float) -> Any:
    import torch

    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, 0.0, False, False,
                                                              scale=scale)[0]


def variants(q: Any, k: Any, v: Any, padded: int) -> dict[str, Any]:
    """``{name: fn()}`` over one sequence ``q, k, v`` of ``(rows, heads, dim)``; each returns ``(rows, heads,
    dim)``."""
    import torch
    from torch.nn.attention.varlen import varlen_attn

    from encgraph.models.dense_sequence import dense_sequence, padded_dense

    rows, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim)
    cu = torch.tensor([0, rows], device=q.device, dtype=torch.int32)
    four = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  (1, heads, rows, dim) views
    real = torch.zeros(padded, device=q.device, dtype=q.dtype)
    real[rows:] = 1.0

    def flash() -> Any:
        return varlen_attn(q, k, v, cu, cu, rows, rows, scale=scale)

    def exact() -> Any:
        return _cudnn(four(q), four(k), four(v), None, scale)[0].transpose(0, 1)

    def cols() -> Any:
        width = -(-(dim + 1) // 8) * 8
        qp, kp, vp = (t.new_zeros(padded, heads, width) for t in (q, k, v))
        qp[:rows, :, :dim], kp[:rows, :, :dim], vp[:rows, :, :dim] = q, k, v
        qp[:rows, :, dim] = MASK_LOGIT / scale
        kp[rows:, :, dim] = -1.0
        return dense_sequence(qp, kp, vp, scale)[:rows, :, :dim]

    def bias() -> Any:
        qp, kp, vp = (t.new_zeros(padded, heads, dim) for t in (q, k, v))
        qp[:rows], kp[:rows], vp[:rows] = q, k, v
        mask = (real * -MASK_LOGIT).view(1, 1, 1, padded).expand(1, heads, padded, padded)
        return _cudnn(four(qp), four(kp), four(vp), mask, scale)[0, :, :rows].transpose(0, 1)

    return {"flash": flash, "exact": exact, "dense": lambda: dense_sequence(q, k, v, scale),
            "padded": lambda: padded_dense(q, k, v, scale, padded), "cols": cols, "bias": bias}


def measure(heads: int, dim: int, rows: int, per_octave: int, runs: int) -> dict[str, Any]:
    import torch

    from benches.lib.env import cuda_env
    from benches.lib.timing import time_call

    gen = torch.Generator(device="cuda").manual_seed(rows)
    q, k, v = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    from encgraph.packing.kernels import bucket_rows

    padded = bucket_rows(rows, per_octave)
    row: dict[str, Any] = {"rows": rows, "bucket": padded, "flops": 4.0 * rows * rows * heads * dim}
    ref = None
    for name, fn in variants(q, k, v, padded).items():
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            row[f"{name}_first_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            row[f"{name}_ms"] = time_call(fn, cuda_env(runs, 2)).summary()["median_ms"]
            if name == "exact":
                ref = out.float()
            elif ref is not None:
                row[f"{name}_rel"] = float(((out.float() - ref).abs().max() / ref.abs().max()).item())
        except Exception as exc:  # report, keep measuring the other variants
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:160]
    return row


def render(rows: list[dict[str, Any]], gpu: str, per_octave: int) -> str:
    def cell(r: dict[str, Any], name: str) -> str:
        if f"{name}_ms" not in r:
            return r.get(f"{name}_error", "-")
        tf = r["flops"] / (r[f"{name}_ms"] * 1e9)
        rel = f", err {r[f'{name}_rel']:.1e}" if f"{name}_rel" in r else ""
        return f"{r[f'{name}_ms']:.3f} ({tf:.0f} TF/s; first {r[f'{name}_first_ms']:.1f}{rel})"

    head = ["geometry", "rows", "bucket"] + [f"{n} ms" for n in VARIANTS]
    body = [[r["geometry"], str(r["rows"]), str(r["bucket"])] + [cell(r, n) for n in VARIANTS] for r in rows]
    return (f"## dense cuDNN attention at bucketed lengths ({gpu}, bfloat16, {per_octave} buckets per octave)\n\n"
            "TF/s count the exact rows' work; `first`: the first call at that shape, ms (a new plan). `dense` runs "
            "after `exact` at the same shape and its first call reuses that plan (torch's SDPA dispatches the same "
            "cuDNN kernel): a plan belongs to the shape, not to the caller. `bias` reaches only Flash's rate: "
            "cuDNN's kernel with a bias is a slower one.\n\n"
            + markdown_table(head, body) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-octave", type=int, default=16)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("dense_buckets: CUDA only", file=sys.stderr)
        return 2
    rows = []
    for label, (heads, dim) in GEOMETRIES.items():
        for length in LENGTHS:
            row = {"geometry": label, **measure(heads, dim, length, args.per_octave, args.runs)}
            rows.append(row)
            print(row, flush=True)
    gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "per_octave": args.per_octave}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    text = render(rows, env["gpu"], args.per_octave)
    write_rows(args.results_dir / f"dense_buckets_{gpu}.json", {"environment": env, "rows": rows}, rows,
               "dense cuDNN attention at bucketed lengths")
    (args.results_dir / f"dense_buckets_{gpu}.md").write_text(text)  # the readable table over write_rows' flat one
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
