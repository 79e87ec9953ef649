"""encgraph behind SGLang's ViT CUDA graph interface (SGLang 0.5.23). SGLang is imported only inside functions.

SGLang's Qwen2.5-VL and Qwen3-VL vision towers (``sglang/srt/models/qwen2_5_vl.py``, ``qwen3_vl.py``), with
``SGLANG_VIT_ENABLE_CUDA_GRAPH=1``, patch-embed the images, compute positions and attention bounds, and hand
"blocks + merger (+ deepstack mergers)" to ``ViTCudaGraphRunner(vit).run(...)``, which captures one graph per
exact sequence layout (every new image size is a new capture). :class:`ViTGraphRunner` has the same
constructor and ``run`` signature and backs it with :class:`encgraph.EncoderGraphRunner`: each full-attention
sequence of the call is an item, items are packed into a ladder of token budgets, padded with real padding
sequences (``cu_seqlens[-1]`` covers every row; windowed layers get window-sized padding sequences), and the
window permutation's inverse (``output_indices``) is applied inside the graph. Outputs are in the caller's order,
as SGLang's runner returns them.

Attention: inside a graph the blocks get SGLang's capturable argument form (``triton_attn``:
``[cu_seqlens, lengths, max_len]``, ``fa3``/``fa4``: ``[cu_seqlens, max_len]``, ``max_len`` fixed per budget:
the budget's rows for full layers, one window for windowed layers). Other backends (``sdpa`` on a CPU) run the
same padded batches with the eager argument form (``cu_seqlens`` and ``forward_metadata``) in ``RunMode.STATIC``.

:func:`install` makes SGLang's model modules build :class:`ViTGraphRunner` instead of their own runner (in the
process that builds the model; SGLang still needs ``SGLANG_VIT_ENABLE_CUDA_GRAPH=1`` to call it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph.capture.protocol import AdapterConfig, BufferSpec, FillRule, PathSpec
from encgraph.errors import ConfigError, InputError
from encgraph.packing import ItemSpec

__all__ = ["ViTBatch", "SglangViTAdapter", "ViTGraphRunner", "install", "uninstall", "CAPTURABLE_BACKENDS"]

CAPTURABLE_BACKENDS = ("triton_attn", "fa3", "fa4")
"""SGLang vision attention backends that run inside a CUDA graph (as SGLang's own runner supports them)."""


def _bounds(layout: Sequence[int] | None) -> np.ndarray | None:
    """Sequence bounds without zero-length sequences (SGLang's Qwen2.5-VL starts with ``[0, 0, ...]``)."""
    if layout is None:
        return None
    b = np.asarray(list(layout), dtype=np.int64)
    return b[np.concatenate(([True], np.diff(b) > 0))]


@attrs.frozen(eq=False)
class ViTBatch:
    """The inputs of one ``run`` call (or a sub-batch of it).

    ``x``: ``(rows, hidden)`` patch embeddings in windowed order; ``cos``/``sin``: ``(rows, d)`` rotary tables;
    ``bounds``: host int64 ``[0, end_1, ..., end_n]`` of the full-attention sequences (the items);
    ``windows``: host bounds of the attention windows (Qwen2.5-VL) or ``None``; ``reverse``: ``(rows / merge^2,)``
    int64 on the device, output row ``j`` is merged row ``reverse[j]`` (or ``None``).
    """

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    bounds: np.ndarray
    windows: np.ndarray | None = None
    reverse: torch.Tensor | None = None


class SglangViTAdapter:
    """The adapter for a SGLang Qwen-VL vision tower's blocks and mergers (inputs: :class:`ViTBatch`)."""

    def __init__(self, vit: torch.nn.Module, *, min_budget: int = 64, max_budget: int = 4096) -> None:
        self.vit = vit
        self.unit = int(vit.spatial_merge_size) ** 2
        self.full_layers = set(getattr(vit, "fullatt_block_indexes", ()) or ())
        self.window_rows = (int(vit.window_size) // int(vit.patch_size)) ** 2 if self.full_layers else 0
        self.deepstack = list(getattr(vit, "deepstack_visual_indexes", ()) or ())
        self.backend = getattr(vit.blocks[0].attn, "qkv_backend_name", None)
        self.rotary_kwargs = "rotary_pos_emb_cos" in _parameters(vit.blocks[0].forward)
        param = next(iter(vit.parameters()))
        self._config = AdapterConfig(PathSpec("default", min_budget, max_budget), dtype=param.dtype, device=param.device)
        self._dims: tuple[int, int] | None = None

    @property
    def config(self) -> AdapterConfig:
        return self._config

    @property
    def capturable(self) -> bool:
        return self.backend in CAPTURABLE_BACKENDS

    def item_specs(self, batch: ViTBatch) -> list[ItemSpec]:
        rows = np.diff(batch.bounds)
        if rows.size == 0 or int(batch.bounds[-1]) != batch.x.shape[0] or (rows % self.unit).any():
            raise InputError(
                f"cu_seqlens: expected sequences of whole merge units ({self.unit} rows) covering the "
                f"{batch.x.shape[0]} rows, got bounds {batch.bounds.tolist()[:8]}..."
            )
        self._dims = (batch.x.shape[1], batch.cos.shape[1])
        return [ItemSpec(int(r) // self.unit, input_size=int(r)) for r in rows]

    def select(self, batch: ViTBatch, indices: Sequence[int]) -> ViTBatch:
        b, u = batch.bounds, self.unit
        rows = [slice(int(b[i]), int(b[i + 1])) for i in indices]
        ends = np.cumsum([0] + [s.stop - s.start for s in rows])
        windows = None
        if batch.windows is not None:
            parts = []
            for s, start in zip(rows, ends[:-1]):
                w = batch.windows[(batch.windows > s.start) & (batch.windows <= s.stop)]
                parts.append(w - s.start + start)
            windows = np.concatenate([[0], *parts])
        reverse = None
        if batch.reverse is not None:  # windows stay inside an item, so does the inverse permutation
            reverse = torch.cat([batch.reverse[s.start // u : s.stop // u] - s.start // u + int(e) // u
                                 for s, e in zip(rows, ends[:-1])])
        cat = lambda t: torch.cat([t[s] for s in rows])  # noqa: E731
        return ViTBatch(cat(batch.x), cat(batch.cos), cat(batch.sin), ends.astype(np.int64), windows, reverse)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        if self._dims is None:
            raise ConfigError("buffer_specs: the hidden and rotary sizes are learnt from the first run(); capture lazily.")
        rows, (hidden, rot) = budget * self.unit, self._dims
        dtype = self._config.dtype
        specs = {
            "x": BufferSpec((rows, hidden), dtype), "cos": BufferSpec((rows, rot), dtype),
            "sin": BufferSpec((rows, rot), dtype),
            "cu": BufferSpec((min(max_items, budget) + 2,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows, chunk=rows),
        }
        if self.full_layers:
            slots = budget + 2 + -(-rows // self.window_rows)
            specs["cu_window"] = BufferSpec((slots,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows, chunk=self.window_rows)
            specs["reverse"] = BufferSpec((budget,), torch.int64, FillRule.ARANGE)
        return specs

    def replay_values(self, path: str, batch: ViTBatch, budget: int) -> dict[str, Any]:
        values: dict[str, Any] = {"x": batch.x, "cos": batch.cos, "sin": batch.sin, "cu": batch.bounds}
        if self.full_layers:
            values["cu_window"] = batch.windows
            values["reverse"] = batch.reverse
        return values

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        rows = budget * self.unit
        return {"out": self._forward(buffers["x"], buffers["cos"], buffers["sin"], buffers["cu"], rows,
                                     buffers.get("cu_window"), self.window_rows, buffers.get("reverse"))}

    def forward_eager(self, path: str, batch: ViTBatch) -> dict[str, torch.Tensor]:
        device = batch.x.device
        cu = torch.from_numpy(batch.bounds.astype(np.int32)).to(device)
        windows = None if batch.windows is None else torch.from_numpy(batch.windows.astype(np.int32)).to(device)
        longest = lambda b: int(np.diff(b).max())  # noqa: E731
        return {"out": self._forward(batch.x, batch.cos, batch.sin, cu, longest(batch.bounds), windows,
                                     0 if batch.windows is None else longest(batch.windows), batch.reverse)}

    def _attention_args(self, cu: torch.Tensor, max_len: int) -> dict[str, Any]:
        if self.backend == "triton_attn":
            return {"cu_seqlens": [cu, cu[1:] - cu[:-1], max_len]}
        if self.capturable:
            return {"cu_seqlens": [cu, max_len]}
        from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata

        return {"cu_seqlens": cu, "forward_metadata": prepare_vision_attention_metadata(cu, device=cu.device)}

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor, max_full: int,
                 cu_window: torch.Tensor | None, max_window: int, reverse: torch.Tensor | None) -> torch.Tensor:
        vit = self.vit
        full = self._attention_args(cu, max_full)
        window = self._attention_args(cu_window, max_window) if cu_window is not None else full
        pos = {"rotary_pos_emb_cos": cos, "rotary_pos_emb_sin": sin} if self.rotary_kwargs else {"position_embeddings": (cos, sin)}
        y = x.unsqueeze(1)
        deep = []
        with torch.no_grad():
            for layer, blk in enumerate(vit.blocks):
                y = blk(y, **(full if not self.full_layers or layer in self.full_layers else window), **pos)
                if layer in self.deepstack:
                    deep.append(vit.deepstack_merger_list[len(deep)](y))
            out = vit.merger(y)
            if deep:
                out = torch.cat([out, *deep], dim=1)
            if reverse is not None:
                out = out.index_select(0, reverse)
        return out

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        return parts["default"]["out"]


class ViTGraphRunner:
    """Drop-in for SGLang's ``ViTCudaGraphRunner(vit)``: same constructor and ``run`` signature.

    ``runner_options`` go to :class:`encgraph.EncoderGraphRunner` (``budgets``, ``max_items``, ``costs``,
    ``compile``, ``mode``, ...); ``min_budget``/``max_budget`` bound the default ladder (output tokens).
    Graphs are captured on the first ``run`` (the hidden and rotary sizes come from it).
    """

    def __init__(self, vit: torch.nn.Module, *, min_budget: int = 64, max_budget: int = 4096, **runner_options: Any) -> None:
        from encgraph.capture.records import RunMode
        from encgraph.capture.runner import EncoderGraphRunner

        self.vit = vit
        self.adapter = SglangViTAdapter(vit, min_budget=min_budget, max_budget=max_budget)
        mode = runner_options.get("mode")
        graph = mode is RunMode.GRAPH or (mode is None and self.adapter.config.device.type == "cuda")
        if graph and not self.adapter.capturable:
            raise ConfigError(
                f"vit: its attention backend {self.adapter.backend!r} cannot run inside a CUDA graph (SGLang's own "
                f"runner supports {list(CAPTURABLE_BACKENDS)}); pick one with --mm-attention-backend, or pass "
                "mode=RunMode.STATIC."
            )
        self.runner = EncoderGraphRunner(self.adapter, lazy=True, **runner_options)

    @property
    def device(self) -> torch.device:
        return self.adapter.config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.config.dtype

    def run(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cu_window_seqlens: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        rotary_pos_emb_cos: torch.Tensor | None = None,
        rotary_pos_emb_sin: torch.Tensor | None = None,
        output_indices: torch.Tensor | None = None,
        attention_layout_key: Any = None,
    ) -> torch.Tensor:
        """Blocks + merger (+ deepstack) of the call's sequences: ``(rows / merge^2, out)``, in the caller's order.

        ``attention_layout_key`` (SGLang passes the host bounds there) avoids reading ``cu_seqlens`` back."""
        if attention_layout_key is not None:
            full, window = attention_layout_key
        else:
            full = cu_seqlens.tolist()
            window = None if cu_window_seqlens is None else cu_window_seqlens.tolist()
        cos, sin = position_embeddings if position_embeddings is not None else (rotary_pos_emb_cos, rotary_pos_emb_sin)
        batch = ViTBatch(x, cos, sin, _bounds(full), _bounds(window) if self.adapter.full_layers else None,
                         output_indices if self.adapter.full_layers else None)
        return torch.cat(self.runner(batch))


def _parameters(fn: Any) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)


_PATCHED: dict[str, Any] = {}


def install() -> None:
    """Make SGLang's Qwen2.5-VL and Qwen3-VL vision towers built from now on (in this process) use
    :class:`ViTGraphRunner`."""
    import sglang.srt.models.qwen2_5_vl as q25
    import sglang.srt.models.qwen3_vl as q3

    if "qwen2_5_vl" not in _PATCHED:
        _PATCHED["qwen2_5_vl"] = q25.ViTCudaGraphRunner
        _PATCHED["qwen3_vl"] = (q3.graph_runners_dict.default_factory, dict(q3.graph_runners_dict))
    q25.ViTCudaGraphRunner = ViTGraphRunner
    q3.graph_runners_dict.default_factory = lambda: ViTGraphRunner
    for key in ("cuda", "cpu"):
        q3.graph_runners_dict[key] = ViTGraphRunner


def uninstall() -> None:
    """Put SGLang's own runner back."""
    if "qwen2_5_vl" not in _PATCHED:
        return
    import sglang.srt.models.qwen2_5_vl as q25
    import sglang.srt.models.qwen3_vl as q3

    q25.ViTCudaGraphRunner = _PATCHED.pop("qwen2_5_vl")
    factory, entries = _PATCHED.pop("qwen3_vl")
    q3.graph_runners_dict.clear()
    q3.graph_runners_dict.update(entries)
    q3.graph_runners_dict.default_factory = factory
