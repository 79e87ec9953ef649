"""The floor of one request on a packed (Qwen-VL layout) tower: what no forward can beat on this device.

Three parts, each at a rate measured once per tower in the same process (:func:`measure_rates`):

- **matrix products**: ``2 x params x patch rows`` flops (as ``benches/floor.py``: every weight once per row) at
  the dense bf16 matmul rate (``timing.matmul_rate``: an ``8192^3`` product);
- **attention**: per attention sequence of ``L`` rows, ``4 x L^2 x hidden`` flops per full-attention layer (the
  ``QK^T`` and ``PV`` products of every head), and ``4 x L x W x hidden`` per windowed layer of ``W`` rows
  (Qwen2.5-VL: 64-row windows in 28 of 32 layers), at the best kernel's rate: the faster of Flash varlen and dense
  SDPA on one sequence of :data:`ATTENTION_ROWS` rows at the tower's head geometry
  (``encgraph.models.kernel_choice.measure_crossover``);
- **element-wise work**: :data:`VALUES_PER_ROW` x ``hidden`` values read or written per row and layer (two
  norms, two residual adds, the activation, rotary on q and k, the qkv split: an estimate that leaves out the MLP's
  wider intermediate, so a lower bound) at the memory bandwidth of a large device copy.

The parts add (no overlap assumed between them: the kernels of one layer run one after another).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from benches.lib.env import Env
from benches.lib.timing import floor_ms, matmul_rate, time_call

ATTENTION_ROWS = 8192
"""Rows of the one sequence the attention rate is measured on (a 2048-token image at merge 2)."""
SMOKE_ATTENTION_ROWS = 256
VALUES_PER_ROW = 20
COPY_BYTES = 1 << 30
SMOKE_COPY_BYTES = 1 << 22


@attrs.frozen
class TowerShape:
    """What the floor needs of a tower: parameters, depth, width, heads, which layers attend over whole frames
    and the window of the others (rows; ``None``: every layer attends over whole frames)."""

    params: int
    depth: int
    hidden: int
    heads: int
    full_layers: int
    window_rows: int | None

    @classmethod
    def of(cls, config: Any, params: int) -> TowerShape:
        depth = int(getattr(config, "depth", None) or config.num_hidden_layers)
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_heads", None) or config.num_attention_heads)
        full = getattr(config, "fullatt_block_indexes", None)
        window = None
        if full is not None and getattr(config, "window_size", None):
            side = int(config.window_size) // int(config.patch_size)  # patches per window side
            window = side * side
        return cls(params, depth, hidden, heads, depth if full is None else len(full), window)


def measure_rates(env: Env, heads: int, head_dim: int) -> dict[str, Any]:
    """The three rates: ``matmul_tflops``, ``attention_tflops`` (the fastest kernel's, with each kernel's time:
    Flash varlen, dense SDPA, and FlashAttention-4 where it is installed), ``bandwidth_gbs``."""
    import torch

    rate = matmul_rate(env)
    rows = SMOKE_ATTENTION_ROWS if env.tiny else ATTENTION_ROWS
    flops = 4.0 * rows * rows * heads * head_dim
    if env.cuda:
        from encgraph.models.kernel_choice import measure_crossover

        c = measure_crossover(heads, head_dim, env.dtype, env.device, lengths=(rows,), repeats=5)
        kernels = {"varlen_ms": c.varlen_ms[0], "dense_ms": c.dense_ms[0],
                   **({"fa4_ms": c.fa4_ms[0]} if c.fa4_ms else {})}  # FlashAttention-4 where installed
        best = min(kernels.values())
    else:
        q = torch.randn(1, heads, rows, head_dim, device=env.device, dtype=env.dtype)
        best = time_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), env,
                         runs=3, warmup=1).median
        kernels = {"dense_ms": best}
    size = SMOKE_COPY_BYTES if env.tiny else COPY_BYTES
    src = torch.empty(size, dtype=torch.uint8, device=env.device)
    dst = torch.empty_like(src)
    copy = time_call(lambda: dst.copy_(src), env, runs=10, warmup=2).median
    return {"matmul_tflops": rate["tflops"], "matmul": rate, "attention_rows": rows, **kernels,
            "attention_tflops": float(f"{flops / (best * 1e-3) / 1e12:.4g}"),
            "bandwidth_gbs": float(f"{2 * size / (copy * 1e-3) / 1e9:.4g}")}


def request_floor(shape: TowerShape, grids: Sequence[tuple[int, int, int]], rates: dict[str, Any],
                  value_bytes: int = 2) -> dict[str, float]:
    """The floor (ms) of one request of ``grids`` (``(t, h, w)`` patches per item; one attention sequence per
    frame), by part and in total."""
    rows = sum(t * h * w for t, h, w in grids)
    sequences = [h * w for t, h, w in grids for _ in range(t)]
    attention = sum(4.0 * L * L * shape.hidden for L in sequences) * shape.full_layers
    if shape.window_rows is not None:
        attention += sum(4.0 * L * min(L, shape.window_rows) * shape.hidden for L in sequences) * (
            shape.depth - shape.full_layers)
    parts = {
        "matmul_ms": floor_ms(shape.params, rows, rates["matmul_tflops"]),
        "attention_ms": attention / (rates["attention_tflops"] * 1e12) * 1e3,
        "elementwise_ms": rows * shape.depth * VALUES_PER_ROW * shape.hidden * value_bytes
        / (rates["bandwidth_gbs"] * 1e9) * 1e3,
    }
    return {**{k: round(v, 4) for k, v in parts.items()}, "floor_ms": round(sum(parts.values()), 4)}
