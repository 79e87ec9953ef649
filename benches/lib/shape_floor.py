"""A second floor per request: the tower's own products and attention calls timed at the sizes a request gives them.

:mod:`benches.lib.request_floor` prices every matrix product at the rate of one ``8192^3`` product and attention at
the rate of one 8,192-row sequence: peak rates, which a 760-row image (a 190-token photo thumbnail) cannot reach,
whatever runs it. This floor keeps element-wise work as there and replaces the two compute parts by measured
times at the request's sizes:

- **block products**: one block's linear layers (their ``(in, out)`` shapes read off the tower's first block), as
  ``x @ W.T`` on ``M`` rows for ``M`` on :data:`ROWS` (doubling), on CUDA all of them in one CUDA graph replayed back
  to back (their device time, as in a replay, without a host launch per product), times the depth; a request
  of ``M`` rows reads the time between ladder points on a log-log line (``encgraph.packing.crossover.loglog_at``,
  as the cost model reads its kernel times; past the ladder's ends with the slope of the nearest pair). The
  products outside the blocks (patch embedding, mergers) stay at the peak rate, as in the first floor.
- **attention**: per full-attention layer and sequence of ``L`` rows, the fastest kernel's time on one sequence of
  ``L`` rows (:func:`encgraph.models.kernel_choice.measure_crossover`: Flash varlen, dense SDPA, FlashAttention-4
  where installed), read off the same kind of line;
  windowed layers (Qwen2.5-VL) stay at the peak rate.

So the gap between a system and this floor is what the system adds on top of cuBLAS and the attention kernels at
those sizes (launches, copies, padding, host work), and the gap between the two floors is what small sizes cost the
kernels themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benches.lib.env import Env
from benches.lib.request_floor import TowerShape
from benches.lib.timing import time_call
from encgraph.packing.crossover import loglog_at

ROWS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SMOKE_ROWS = (16, 32, 64)


def block_linears(tower: Any) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of every ``nn.Linear`` in the first block of ``tower``'s ``blocks`` (the
    packed Qwen-VL layout), each rounded up to a multiple of :data:`~encgraph.models.layout.ALIGN`: the widths
    cuBLAS's fast kernels need, which encgraph's layout rewrites give a misaligned MLP (Qwen2.5-VL's 3420 runs as
    3424; at 3420 every product of the block falls back to slower kernels, and the block products alone came to
    5.2 ms for a 234-token image whose whole request took encgraph 5.0). ``[]`` where the tower has none."""
    import torch

    from encgraph.models.layout import ALIGN

    blocks = getattr(tower, "blocks", None)
    if not blocks:
        return []

    def aligned(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    return [(aligned(m.in_features), aligned(m.out_features)) for m in blocks[0].modules()
            if isinstance(m, torch.nn.Linear)]


def measure_shape_rates(env: Env, linears: Sequence[tuple[int, int]], heads: int, head_dim: int) -> dict[str, Any]:
    """Per row count of the ladder: ``block_matmul_ms`` (one block's products, summed) and ``attention_ms`` (the
    fastest kernel on one sequence of that many rows), with the ladder and the kernels' times."""
    import torch

    # The timing the cost model's kernel measurements use (a graph of the call, replayed back to back).
    from encgraph.models.kernel_choice import _graph_ms

    rows = SMOKE_ROWS if env.tiny else ROWS
    gen = torch.Generator(device=env.device).manual_seed(env.seed)
    weights = [torch.randn(n_out, n_in, device=env.device, dtype=env.dtype, generator=gen) for n_in, n_out in linears]
    block_ms = []
    for m in rows:
        inputs = [torch.randn(m, w.shape[1], device=env.device, dtype=env.dtype, generator=gen) for w in weights]

        def block(inputs=inputs) -> None:
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)

        if env.cuda:
            # Replayed from a CUDA graph, back to back: the kernels' device time with the gaps of a replay between
            # them. One synced call per product would add the host's launch (5-10 us) to each, about what a
            # 256-row product's kernel takes, and the floor would flatter whatever it is compared with.
            block_ms.append(round(_graph_ms(block), 5))
        else:
            block_ms.append(round(time_call(block, env, runs=10, warmup=2).median, 5))
        del inputs
    if env.cuda:
        from encgraph.models.kernel_choice import measure_crossover

        c = measure_crossover(heads, head_dim, env.dtype, env.device, lengths=rows, repeats=5)
        kernels = {"varlen_ms": list(c.varlen_ms), "dense_ms": list(c.dense_ms),
                   **({"fa4_ms": list(c.fa4_ms)} if c.fa4_ms else {})}
    else:
        dense = []
        for n in rows:
            q = torch.randn(1, heads, n, head_dim, device=env.device, dtype=env.dtype, generator=gen)
            dense.append(time_call(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q), env,
                                   runs=3, warmup=1).median)
        kernels = {"dense_ms": dense}
    attention = [round(min(times), 5) for times in zip(*kernels.values())]
    return {"rows": list(rows), "linears": [list(x) for x in linears], "block_matmul_ms": block_ms,
            "attention_ms": attention, "attention_kernels": kernels}


def shape_floor(shape: TowerShape, grids: Sequence[tuple[int, int, int]], peak: dict[str, float],
                rates: dict[str, Any], shape_rates: dict[str, Any], block_params: int) -> dict[str, float]:
    """The floor (ms) of one request of ``grids`` with the block products and full-attention calls at their
    measured times: ``shape_matmul_ms``, ``shape_attention_ms``, ``shape_floor_ms``. ``peak`` is the same request's
    peak-rate floor (:func:`~benches.lib.request_floor.request_floor` at ``rates``), whose products outside the
    blocks, windowed attention and element-wise work it keeps; ``block_params`` is the blocks' linear weights in
    all (their products are timed; the rest of ``shape.params`` stays at peak)."""
    rows = sum(t * h * w for t, h, w in grids)
    sequences = [h * w for t, h, w in grids for _ in range(t)]
    ladder = shape_rates["rows"]
    blocks = loglog_at(ladder, shape_rates["block_matmul_ms"], rows) * shape.depth
    outside = peak["matmul_ms"] * max(shape.params - block_params, 0) / shape.params
    full = sum(loglog_at(ladder, shape_rates["attention_ms"], n) for n in sequences) * shape.full_layers
    windowed = 0.0
    if shape.window_rows is not None:  # the peak floor's windowed part (all of its attention minus the full layers)
        at_peak_full = sum(4.0 * n * n * shape.hidden for n in sequences) * shape.full_layers
        windowed = max(peak["attention_ms"] - at_peak_full / (rates["attention_tflops"] * 1e12) * 1e3, 0.0)
    parts = {"shape_matmul_ms": blocks + outside, "shape_attention_ms": full + windowed}
    total = parts["shape_matmul_ms"] + parts["shape_attention_ms"] + peak["elementwise_ms"]
    return {**{k: round(v, 4) for k, v in parts.items()}, "shape_floor_ms": round(total, 4)}
