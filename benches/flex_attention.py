"""Packed attention backends inside CUDA graphs: ``varlen_attn`` (what encgraph uses) against FlexAttention with
a block-diagonal block mask (issue 4: a second CUDA backend only "if it proves faster on some tower").

Shapes of the Qwen2.5-VL-7B tower (16 heads, head dim 80, bf16): full-attention layers over images of 1024
patches (224 px... 448 px) and windowed layers over 64-patch windows, at 1024 and 4096 patch rows. For each
backend: the attention call captured in a CUDA graph and replayed (median of 50 replays, CUDA events); for
FlexAttention also the host time to rebuild its block mask for a new batch (done outside the graph, then
copied in), which every replay of a new batch would pay.

    python benches/flex_attention.py          # on a CUDA GPU; prints a table, writes benches/results/flex_attention_<gpu>.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.env import cuda_env  # noqa: E402
from benches.lib.timing import time_call  # noqa: E402

HEADS, HEAD_DIM = 16, 80
CASES = [  # (name, rows, sequence length)
    ("full, 1024 rows, 4 x 256", 1024, 256),
    ("full, 4096 rows, 4 x 1024", 4096, 1024),
    ("window, 1024 rows, 16 x 64", 1024, 64),
    ("window, 4096 rows, 64 x 64", 4096, 64),
]


def replay_ms(fn, runs: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_call(graph.replay, cuda_env(runs)).summary()["median_ms"]


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.attention.varlen import varlen_attn

    flex = torch.compile(flex_attention, dynamic=False)
    rows_out = []
    for name, rows, seq in CASES:
        row = {"case": name}
        q, k, v = (torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, rows + 1, seq, device="cuda", dtype=torch.int32)
        try:
            out_v = varlen_attn(q, k, v, cu, cu, seq, seq)
            row["varlen_ms"] = replay_ms(lambda: varlen_attn(q, k, v, cu, cu, seq, seq))
        except Exception as exc:  # report, keep measuring the other backend
            row["varlen_error"] = f"{type(exc).__name__}: {exc}"[:200]
            out_v = None
        seg = torch.arange(rows, device="cuda") // seq

        def same_sequence(b, h, q_idx, kv_idx):
            return seg[q_idx] == seg[kv_idx]

        try:
            t0 = time.perf_counter()
            mask = create_block_mask(same_sequence, None, None, rows, rows, device="cuda")
            torch.cuda.synchronize()
            row["flex_first_mask_s"] = round(time.perf_counter() - t0, 3)
            mask_times = []
            for _ in range(10):
                t0 = time.perf_counter()
                create_block_mask(same_sequence, None, None, rows, rows, device="cuda")
                torch.cuda.synchronize()
                mask_times.append((time.perf_counter() - t0) * 1e3)
            row["flex_mask_rebuild_ms"] = statistics.median(mask_times)
            qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            t0 = time.perf_counter()
            out_f = flex(qf, kf, vf, block_mask=mask)
            torch.cuda.synchronize()
            row["flex_compile_s"] = round(time.perf_counter() - t0, 1)
            row["flex_ms"] = replay_ms(lambda: flex(qf, kf, vf, block_mask=mask))
            if out_v is not None:
                ref = out_v.float()
                got = out_f[0].transpose(0, 1).float()
                row["flex_vs_varlen_rel_err"] = float((got - ref).norm() / ref.norm())
        except Exception as exc:
            row["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
    out = Path(__file__).resolve().parent / "results"
    if len(sys.argv) > 1:
        out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    from benches.lib.results import write_rows

    write_rows(out / f"flex_attention_{gpu}.json", {"environment": env, "rows": rows_out}, rows_out,
               "FlexAttention against varlen attention inside CUDA graphs")
    print("\n| case | varlen_attn replay ms | flex replay ms | flex mask rebuild ms (host, per new batch) | rel err |")
    print("|---|---|---|---|---|")
    for r in rows_out:
        fmt = lambda key: f"{r[key]:.3f}" if isinstance(r.get(key), float) else r.get(key.replace("_ms", "_error"), "-")
        print(f"| {r['case']} | {fmt('varlen_ms')} | {fmt('flex_ms')} | {fmt('flex_mask_rebuild_ms')} | "
              f"{r.get('flex_vs_varlen_rel_err', '-')} |")


if __name__ == "__main__":
    main()
