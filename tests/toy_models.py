"""Toy towers and adapters for runner tests (CPU and GPU): variable-length items made of attention-like
sequences, one or two paths, exercising every fill rule.

The toy tower, per sequence ``s`` of rows ``x_s`` (``L`` rows, ``C`` channels)::

    h = lin1(x_s) + mean_rows(lin1(x_s)) + emb[0..L-1]      # mean within the sequence: wrong cu_seqlens show
    out = lin2(h)

The static forward reads a permuted row order (``perm``: each sequence reversed; padding rows map to themselves,
FillRule.ARANGE), segment ids from ``cu_seqlens`` (FillRule.SEQUENCE_BOUNDS) and position ids (FillRule.ZERO),
and scatters the result back to the original order, all without a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph.errors import InputError, InputTypeError
from encgraph.models.protocol import AdapterConfig, BufferSpec, FillRule, PathSpec
from encgraph.packing import ItemSpec

CHUNK = 16  # the toy's "max_seqlen" for padding sequences


class ToyTower(torch.nn.Module):
    def __init__(self, channels: int = 6, hidden: int = 10, max_len: int = 4096) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(channels, hidden)
        self.lin2 = torch.nn.Linear(hidden, hidden)
        self.emb = torch.nn.Embedding(max_len, hidden)

    def forward_static(self, x: torch.Tensor, cu: torch.Tensor, pos: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        xp = x.index_select(0, perm)
        h = self.lin1(xp)
        idx = torch.arange(rows, device=x.device)
        seg = torch.searchsorted(cu[1:].to(torch.int64), idx, right=True).clamp(max=cu.shape[0] - 2)
        sums = torch.zeros(cu.shape[0] - 1, h.shape[1], device=x.device, dtype=h.dtype).index_add_(0, seg, h)
        lens = (cu[1:] - cu[:-1]).clamp(min=1).to(h.dtype)
        h = h + (sums / lens[:, None]).index_select(0, seg) + self.emb(pos.index_select(0, perm))
        outp = self.lin2(h)
        return torch.empty_like(outp).index_copy_(0, perm, outp)

    def forward_sequence(self, xs: torch.Tensor) -> torch.Tensor:
        h = self.lin1(xs)
        h = h + h.mean(0, keepdim=True) + self.emb(torch.arange(xs.shape[0], device=xs.device))
        return self.lin2(h)


@attrs.frozen
class ToyInputs:
    """``rows[path]``: (R, C) rows of all items on that path; ``seqs[path][i]``: item i's sequence lengths."""

    rows: dict[str, torch.Tensor]
    seqs: dict[str, tuple[tuple[int, ...], ...]]

    @property
    def n(self) -> int:
        return len(next(iter(self.seqs.values())))


class ToyAdapter:
    """One or more paths of :class:`ToyTower`. ``fail_budget``: (path, budget) whose capture raises OOM."""

    def __init__(self, towers: Mapping[str, ToyTower], *, min_budget: int = 16, max_budget: int = 256,
                 empty: Sequence[str] = (), max_frames_per_item: int = 4, fail_budget: tuple[str, int] | None = None):
        self.towers = dict(towers)
        p0 = next(iter(self.towers.values())).lin1.weight
        self._config = AdapterConfig(
            paths=tuple(PathSpec(p, min_budget, max_budget, allow_empty=p in empty) for p in self.towers),
            max_frames_per_item=max_frames_per_item, dtype=p0.dtype, device=p0.device,
        )
        self.fail_budget = fail_budget

    @property
    def config(self) -> AdapterConfig:
        return self._config

    def item_specs(self, inputs: ToyInputs) -> list[ItemSpec]:
        if not isinstance(inputs, ToyInputs):
            raise InputTypeError(f"inputs: expected ToyInputs, got {type(inputs).__name__}")
        specs = []
        for path, rows in inputs.rows.items():
            if rows.dtype != self._config.dtype:
                raise InputTypeError(f"rows[{path!r}]: expected {self._config.dtype}, got {rows.dtype}")
            if rows.device != self._config.device:
                raise InputError(f"rows[{path!r}]: expected device {self._config.device}, got {rows.device}")
            if rows.shape[0] != sum(map(sum, inputs.seqs[path])):
                raise InputError(f"rows[{path!r}]: {rows.shape[0]} rows, the sequences need {sum(map(sum, inputs.seqs[path]))}")
        for i in range(inputs.n):
            tokens = {p: sum(inputs.seqs[p][i]) for p in self.towers}
            frames = max(1, max(len(inputs.seqs[p][i]) for p in self.towers))
            specs.append(ItemSpec(tokens, frames=frames))
        return specs

    def select(self, inputs: ToyInputs, indices: Sequence[int]) -> ToyInputs:
        rows, seqs = {}, {}
        for p in self.towers:
            lens = [sum(s) for s in inputs.seqs[p]]
            starts = np.concatenate([[0], np.cumsum(lens)])
            parts = [inputs.rows[p][starts[i] : starts[i] + lens[i]] for i in indices]
            rows[p] = torch.cat(parts) if parts else inputs.rows[p][:0]
            seqs[p] = tuple(inputs.seqs[p][i] for i in indices)
        return ToyInputs(rows, seqs)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        c = self.towers[path].lin1.in_features
        slots = max_frames + -(-budget // CHUNK) + 1
        return {
            "x": BufferSpec((budget, c), self._config.dtype),
            "cu": BufferSpec((slots,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=budget, chunk=CHUNK),
            "pos": BufferSpec((budget,), torch.int64, FillRule.ZERO),
            "perm": BufferSpec((budget,), torch.int64, FillRule.ARANGE),
        }

    def replay_values(self, path: str, inputs: ToyInputs, budget: int) -> dict[str, Any]:
        lens = np.array([n for item in inputs.seqs[path] for n in item if n], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)])
        starts = np.repeat(cu[:-1], lens)
        local = np.arange(cu[-1]) - starts
        perm = starts + np.repeat(lens, lens) - 1 - local  # each sequence reversed
        return {
            "x": inputs.rows[path],
            "cu": torch.from_numpy(cu),
            "pos": torch.from_numpy(local),
            "perm": torch.from_numpy(perm),
        }

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        if self.fail_budget == (path, budget) and torch.cuda.is_current_stream_capturing():
            raise torch.cuda.OutOfMemoryError("toy: simulated out of memory during capture")
        return {"out": self.towers[path].forward_static(buffers["x"], buffers["cu"], buffers["pos"], buffers["perm"])}

    def forward_eager(self, path: str, inputs: ToyInputs) -> dict[str, torch.Tensor]:
        outs, offset = [], 0
        for item in inputs.seqs[path]:
            for n in item:
                outs.append(self.towers[path].forward_sequence(inputs.rows[path][offset : offset + n]))
                offset += n
        tower = self.towers[path]
        empty = torch.zeros(0, tower.lin2.out_features, device=self._config.device, dtype=self._config.dtype)
        return {"out": torch.cat(outs) if outs else empty}

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        return torch.cat([parts[p]["out"] for p in self.towers if p in parts])


def random_inputs(gen: np.random.Generator, adapter: ToyAdapter, n: int, *, max_len: int = 80,
                  max_frames: int = 3, empty_share: float = 0.3) -> ToyInputs:
    """``n`` random items: each path gets 1..max_frames sequences of 1..max_len rows (an empty-allowed path
    gets none with probability ``empty_share``)."""
    cfg = adapter.config
    rows, seqs = {}, {}
    for p in cfg.paths:
        items = []
        for _ in range(n):
            if p.allow_empty and gen.random() < empty_share:
                items.append(())
            else:
                items.append(tuple(int(v) for v in gen.integers(1, max_len + 1, size=gen.integers(1, max_frames + 1))))
        seqs[p.name] = tuple(items)
        c = adapter.towers[p.name].lin1.in_features
        rows[p.name] = torch.randn(sum(map(sum, items)), c, generator=None, dtype=cfg.dtype).to(cfg.device)
    return ToyInputs(rows, seqs)


def reference(adapter: ToyAdapter, inputs: ToyInputs) -> list[torch.Tensor]:
    """Each item alone through the eager forward."""
    return [adapter.assemble({p: adapter.forward_eager(p, adapter.select(inputs, [i]))
                              for p in adapter.towers if sum(inputs.seqs[p][i])}) for i in range(inputs.n)]


class SequenceFirst(torch.nn.Module):
    """Mixes rows along dim 0 (``y - mean_over_batch(y)``): not batch-first, so a generic adapter is right for it
    only when the batch equals a budget; the runner's self-check must find that out."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y - y.mean(0, keepdim=True)
