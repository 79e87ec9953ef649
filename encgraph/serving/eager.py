"""The tower's own forward as a serving target (``encgraph serve --eager``: the baseline a benchmark compares the
graphs against): adapter inputs in, the same per-item results a runner gives out, one request at a time."""

from __future__ import annotations

from typing import Any

__all__ = ["EagerTower"]


class EagerTower:
    """Call ``tower`` (unwrapped: its own attention and layout) on a request's adapter inputs and split its output
    per item into the adapter's named outputs (rows per item: the item's tokens on the adapter's one path).

    ``adapter`` parses and describes the inputs only (host work); it must have been unwrapped."""

    def __init__(self, tower: Any, adapter: Any) -> None:
        self.tower = tower
        self.adapter = adapter
        self.path = adapter.config.paths[0].name
        self.names = adapter.config.paths[0].outputs

    def __call__(self, inputs: Any) -> list[dict[str, Any]]:
        import torch

        specs = self.adapter.item_specs(inputs)
        if hasattr(inputs, "grid"):  # Qwen-VL: pixel rows and their grids
            grid = torch.from_numpy(inputs.grid).to(inputs.pixel_values.device)
            out = self.tower(inputs.pixel_values, grid_thw=grid)
        else:
            out = self.tower(pixel_values=inputs.pixel_values)
        named = {n: getattr(out, n) for n in self.names if isinstance(getattr(out, n, None), torch.Tensor)}
        sizes = [spec.tokens[self.path] for spec in specs]
        total = sum(sizes)
        # Per-patch outputs (a Qwen tower's last_hidden_state: merge^2 rows per token) come out per token, as the
        # adapter's own forwards give them: (tokens, merge^2 * hidden).
        named = {n: t if t.shape[0] == total else t.reshape(total, -1) for n, t in named.items()}
        parts = {n: torch.split(t, sizes) for n, t in named.items()}
        return [{n: parts[n][i] for n in named} for i in range(len(sizes))]
