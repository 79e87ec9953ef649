"""What the Qwen-VL vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) share: inputs, host-side metadata, buffers,
forwards and the Hugging Face output type; the base, too, of the packed-grid families that follow the same
pattern (Qwen3.5, GLM-4V, ERNIE-4.5-VL, Kimi-K2.5, MiniCPM-V), which set its per-family facts (class attributes)
and hooks.

The towers take ``(pixel_values, grid_thw)``: ``pixel_values`` is ``(rows, C*T*P*P)``, one row per patch (``T``
frames of ``P x P`` pixels of ``C`` channels), items concatenated; ``grid_thw`` is ``(n, 3)``, per item its
temporal, height and width grid in patches. An item has ``t`` frames (attention sequences of ``h*w`` rows in the
full-attention layers) and ``t*h*w / merge^2`` output tokens after the patch merger, the budget unit. Patch rows
of a frame come in merge-block order: the ``merge x merge`` patches of one output token are consecutive.

From transformers 5.15 the towers accept all their data-dependent metadata as keyword arguments (``position_ids``,
``cu_seqlens``, integer ``max_seqlen``, ...) and then never read ``grid_thw``; with an attention implementation
whose name contains "flash" they run one packed attention per layer. So the static forward is the tower's own
``forward``, given static buffers, ``grid_thw=None`` (a version that read it would fail loudly, not silently) and
per-layer ``max_seqlen`` fixed by the budget: nothing in it syncs the host.

The inputs (:class:`~encgraph.models.qwen_inputs.QwenVisionInputs`, their validation, item specs and sub-batches)
are :mod:`encgraph.models.qwen_inputs`. All metadata is computed on the host with numpy (the geometry in
:mod:`encgraph.models.qwen_grid`), never by per-image computation loops: per frame shape ``(h, w)`` the tables
(rotary positions, window permutation, interpolation taps) come from a bounded LRU cache, the shapes a call misses
computed together in one vectorized pass; a batch is then a concatenation of its frames' tables with offsets (about
0.02 ms for 8 images on a CPU when the shapes repeat; see benches/host_overhead.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from encgraph._validate import check_int, describe
from encgraph.capture.grad import persistent
from encgraph.capture.upload import to_device
from encgraph.errors import InputTypeError
from encgraph.models._hf import require_transformers, tower_dtype_device
from encgraph.models.attention import MIN_TRANSFORMERS, RowsTable, host_bounds, use_packed_attention
from encgraph.models.layout import LayoutPatch, apply_all, describe_patches, engaged, linear_patch_embed, restore_all
from encgraph.models.own_forward import own_forward
from encgraph.models.protocol import AdapterConfig, BufferSpec, FillRule, PathSpec
from encgraph.models.qwen_grid import (
    FrameTableCache,
    UnitGrid,
    rotary_positions,
    unit_grid,
)
from encgraph.models.qwen_inputs import QwenInputsMixin, QwenVisionInputs
from encgraph.packing import ItemSpec
from encgraph.packing.crossover import Crossover

__all__ = ["QwenVisionAdapter", "QwenVisionInputs"]  # QwenVisionInputs: from encgraph.models.qwen_inputs

PATH = "default"

class QwenVisionAdapter(QwenInputsMixin):
    """The adapter of a Qwen-VL vision tower (one path, ``"default"``, budgets in output tokens).

    Family modules subclass it: :class:`~encgraph.models.qwen2_vl.Qwen2VLAdapter` is this class as is,
    Qwen2.5-VL adds window attention, Qwen3-VL position-embedding interpolation and deepstack outputs.

    Args:
        module: the Hugging Face tower (e.g. ``model.model.visual``); its attention is switched to
            :data:`~encgraph.models.attention.ATTENTION_NAME` until :meth:`unwrap`.
        min_budget, max_budget: bounds of the default ladder, in output tokens (default the family's
            :attr:`default_budgets`; here 64: one 224 x 224 image at patch 14, merge 2; and 4096: one 896 x 896
            image).
        max_frames_per_item: frames one item is expected to bring; the default frame limit per batch is
            ``max_items * max_frames_per_item``, and it sizes the ``cu_seqlens`` buffers. Every slot costs the
            full-attention kernels ``max_seqlen / 128`` empty blocks per head, so keep it small; longer videos
            are split over batches or run eagerly.
        last_hidden_state: return the tower's pre-merger hidden states too (``(rows, hidden)``, in the tower's
            own row order), as the tower does (default). ``False`` saves their output buffer and copy; the
            output's ``last_hidden_state`` is then ``None`` and ``return_dict=False`` calls are refused.
        fast_layout: rewrite layers whose layout keeps the GPU off its fast matmul kernels, exactly and
            reversibly (:mod:`encgraph.models.layout`): the ``Conv3d`` patch embedding as one matmul, and (Qwen2.5-VL)
            the gated MLP padded to an intermediate size that is a multiple of 8. On by default; ``unwrap()``
            undoes it. Off, the tower's layers run as they are.

    Buffers per budget ``B`` (``U = merge^2`` rows per token, ``R = B * U``): ``pixels`` ``(R, C*T*P*P)`` tower
    dtype (ZERO), ``position_ids`` ``(R, 2)`` int64 (ZERO), ``cu_seqlens`` ``(min(max_frames, B) + 2,)`` int32
    (SEQUENCE_BOUNDS over ``R`` rows in one padding sequence: the full-attention ``max_seqlen`` is ``R``).
    """

    family: ClassVar[str] = "Qwen2-VL"
    tower_class: ClassVar[str] = "Qwen2VisionTransformerPretrainedModel"
    # Per-family facts, set by the families built on this class that differ from the Qwen-VL towers (GLM-4V,
    # ERNIE-4.5-VL, Kimi-K2.5, MiniCPM-V; the table of all families is encgraph.models.builtin).
    required_attributes: ClassVar[tuple[str, ...]] = ("patch_embed", "blocks", "merger", "spatial_merge_size")
    """Attributes a tower of this family has (checked at wrap time)."""
    call_names: ClassVar[tuple[str, str]] = ("hidden_states", "grid_thw")
    """The tower forward's two positional parameters: the pixel rows and the grid."""
    flat_rows: ClassVar[bool] = True
    """Pixel rows are ``(rows, C*T*P*P)`` (the patch weight's trailing dims flattened); else ``(rows, *dims)``."""
    clip_attention: ClassVar[bool] = False
    """The full-attention layers attend over a whole item (all its frames: one sequence), not per frame."""
    default_budgets: ClassVar[tuple[int, int]] = (64, 4096)
    """``(min_budget, max_budget)`` where the caller gives none (families counting patch rows start higher)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        min_budget: int | None = None,
        max_budget: int | None = None,
        max_frames_per_item: int = 2,
        last_hidden_state: bool = True,
        fast_layout: bool = True,
    ) -> None:
        require_transformers(MIN_TRANSFORMERS, f"the {self.family} adapter")
        if not isinstance(module, torch.nn.Module):
            raise InputTypeError(f"module: expected a {self.tower_class}, got {describe(module)}.")
        missing = [a for a in self.required_attributes if not hasattr(module, a)]
        if missing:
            raise InputTypeError(
                f"module: expected a {self.family} vision tower ({self.tower_class}), got {type(module).__name__} "
                f"without {missing}."
            )
        for name, flag in (("last_hidden_state", last_hidden_state), ("fast_layout", fast_layout)):
            if not isinstance(flag, bool):
                raise InputTypeError(f"{name}: expected True or False, got {describe(flag)}.")
        self._module = module
        low, high = self.default_budgets
        self.min_budget = check_int("min_budget", low if min_budget is None else min_budget, minimum=1)
        self.max_budget = check_int("max_budget", high if max_budget is None else max_budget, minimum=self.min_budget)
        self.max_frames_per_item = check_int("max_frames_per_item", max_frames_per_item, minimum=1)
        self.with_last_hidden_state = last_hidden_state
        self.merge, weight = self._geometry(module)  # weight: (hidden, C, T, P, P) for the Qwen towers
        self.channels = int(np.prod(weight.shape[1:]))
        self.patch_shape = tuple(int(d) for d in weight.shape[1:])
        self.row_shape = (self.channels,) if self.flat_rows else self.patch_shape
        self.hidden = int(weight.shape[0])  # the width of last_hidden_state (families may change it)
        self._dtype, self._device = tower_dtype_device(module)
        self._init_family(module)
        self._tables = FrameTableCache(self._compute_tables)
        self._specs: dict[tuple[int, int], ItemSpec] = {}
        self.kernel_rows: RowsTable | None = None
        """Per head geometry, the rows from which an eager forward runs a sequence on dense SDPA (set by
        :meth:`choose_kernels`; ``None``: the default crossover)."""
        # Last: nothing above may leave the tower changed if it raises. The rewritten weights live as long as the
        # tower: never inference tensors, whatever mode the caller wraps in.
        with persistent():
            layout = apply_all(self._layout_rewrites(module)) if fast_layout else []
        try:
            self._switch = use_packed_attention(module)
        except BaseException:
            restore_all(layout)
            raise
        # Engaged only inside the adapter's forwards (_engaged): between calls the tower copies, pickles, saves and
        # answers its own calls as it is.
        self._switch.disengage()
        for patch in layout:
            patch.disengage()
        self._layout = layout

    def _layout_rewrites(self, module: torch.nn.Module) -> list[Callable[[], LayoutPatch | None]]:
        """The :mod:`~encgraph.models.layout` rewrites of this family's tower (subclasses add theirs)."""
        return [lambda: linear_patch_embed(module.patch_embed)]

    @property
    def layout(self) -> list[str]:
        """The layout rewrites in force, one line each (empty with ``fast_layout=False`` or after ``unwrap()``)."""
        return describe_patches([p for p in self._layout if not p.restored])

    def _init_family(self, module: torch.nn.Module) -> None:
        """Read family-specific geometry from the tower (subclasses)."""

    def _geometry(self, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
        """``(spatial merge, patch-embedding weight)``: the weight's dim 0 is the hidden size, its other dims one
        pixel row (families whose tower keeps them elsewhere override this)."""
        return int(module.spatial_merge_size), module.patch_embed.proj.weight

    # ------------------------------------------------------------------ description
    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def output_names(self) -> tuple[str, ...]:
        names = ("pooler_output",) + self._extra_outputs()
        return names + (("last_hidden_state",) if self.with_last_hidden_state else ())

    def _extra_outputs(self) -> tuple[str, ...]:
        return ()

    @property
    def config(self) -> AdapterConfig:
        return AdapterConfig(
            paths=PathSpec(PATH, self.min_budget, self.max_budget, outputs=self.output_names),
            max_frames_per_item=self.max_frames_per_item,
            dtype=self._dtype,
            device=self._device,
        )

    # ------------------------------------------------------------------ the adapter's own forwards, compiling
    @contextlib.contextmanager
    def _engaged(self) -> Iterator[None]:
        """The packed attention and the layout rewrites, in place only while the adapter's own forwards run
        (replays run no Python: they cost them nothing); outside, the tower is exactly its own."""
        with self._switch.engaged(), engaged(self._layout):
            yield

    def choose_kernels(self, known: Mapping[str, Crossover] | None = None) -> dict[str, Crossover]:
        """Measure (on CUDA; or take from ``known``) each head geometry's varlen kernel and from how many rows an
        eager forward runs a sequence on dense SDPA, and use them from now on (:mod:`encgraph.models.kernel_choice`;
        the runner calls it at capture, before any graph). Returns the crossovers by key."""
        from encgraph.models.kernel_choice import attention_calls, choose, rows_table

        with self._engaged():
            chosen = choose(self._module, self._dtype, self._device, known)
        self.kernel_rows = rows_table(chosen.values(), attention_calls(self._module)) if chosen else None
        return chosen

    def compile_regions(self) -> list[torch.nn.Module]:
        """The vision blocks: what ``compile="auto"`` compiles (once for all of them and every budget)."""
        return list(self._module.blocks)

    # ------------------------------------------------------------------ buffers and metadata
    def _rows(self, budget: int) -> int:
        return budget * self.merge**2

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        rows = self._rows(budget)
        specs = {
            "pixels": BufferSpec((rows, *self.row_shape), self._dtype, FillRule.ZERO),
            "position_ids": BufferSpec((rows, 2), torch.int64, FillRule.ZERO),
            # A frame has at least one token, so a budget holds at most ``budget`` frames; +1 for the leading 0
            # and +1 for the padding sequence (one, of up to ``rows`` rows: the full-attention max_seqlen).
            "cu_seqlens": BufferSpec(
                (min(max_frames, budget) + 2,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows, chunk=rows
            ),
        }
        specs.update(self._extra_buffer_specs(budget, max_frames))
        return specs

    def _extra_buffer_specs(self, budget: int, max_frames: int) -> dict[str, BufferSpec]:
        return {}

    def metadata(self, grid: np.ndarray) -> dict[str, np.ndarray]:
        """The host metadata of a batch with ``grid`` (``(n, 3)`` int64): numpy arrays named as the tower's
        keyword arguments (``cu_seqlens`` as int64 ``[0, ends...]``).

        Per frame shape ``(h, w)`` the tables (rotary positions, ...) come from a bounded cache, computed for all
        missing shapes of the batch in one vectorized pass; the batch is then a concatenation with offsets.
        """
        t = grid[:, 0]
        tables = self._tables.lookup(list(zip(grid[:, 1].tolist(), grid[:, 2].tolist())))
        frames = [table for table, n in zip(tables, t.tolist()) for _ in range(n)]
        # One attention sequence per frame (per item where the family attends over whole clips).
        frame_rows = grid.prod(1) if self.clip_attention else np.repeat(grid[:, 1] * grid[:, 2], t)
        cu = np.zeros(frame_rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(frame_rows, out=cu[1:])
        meta = {"cu_seqlens": cu, "position_ids": np.concatenate([f["position_ids"] for f in frames])}
        meta.update(self._assemble(frames, cu))
        return meta

    def _compute_tables(self, shapes: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Per-frame tables of frames of the given ``(k, 2)`` shapes ``(h, w)``, one vectorized pass."""
        grid = np.concatenate([np.ones((shapes.shape[0], 1), dtype=np.int64), shapes], axis=1)
        units = unit_grid(grid, self.merge)
        rows = shapes[:, 0] * shapes[:, 1]
        columns = {"position_ids": (self._positions(units), rows)}
        columns.update(self._frame_tables(units))
        out: list[dict[str, np.ndarray]] = [{} for _ in range(shapes.shape[0])]
        for name, (array, sizes) in columns.items():
            for table, part in zip(out, np.split(array, np.cumsum(sizes)[:-1])):
                table[name] = part
        return out

    def _positions(self, units: UnitGrid) -> np.ndarray:
        """The rotary ``position_ids`` of single frames, concatenated (patch rows in merge-block order)."""
        return rotary_positions(units)

    def _frame_tables(self, units: UnitGrid) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Family tables of single frames: ``name -> (array, per-frame sizes in dim 0)`` (subclasses)."""
        return {}

    def _assemble(self, frames: list[dict[str, np.ndarray]], cu: np.ndarray) -> dict[str, np.ndarray]:
        """Family metadata of a batch from its frames' tables (in order) and its ``cu_seqlens`` (subclasses)."""
        return {}

    def replay_values(self, path: str, inputs: Any, budget: int) -> dict[str, Any]:
        inputs = self._coerce(inputs)
        meta = self.metadata(inputs.grid)
        values: dict[str, Any] = {"pixels": inputs.pixel_values, "cu_seqlens": meta.pop("cu_seqlens")}
        values.update(self._replay_extras(meta))
        values.update((name, torch.from_numpy(array)) for name, array in meta.items())
        return values

    def _replay_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        """Values of SEQUENCE_BOUNDS buffers other than ``cu_seqlens`` (popped from ``meta``; host arrays)."""
        return {}

    # ------------------------------------------------------------------ forwards
    def _static_kwargs(self, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, Any]:
        """Keyword arguments of the tower's forward besides ``position_ids``/``cu_seqlens``/``max_seqlen``."""
        return {}

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        kwargs = {
            "position_ids": buffers["position_ids"],
            "cu_seqlens": buffers["cu_seqlens"],
            "max_seqlen": self._rows(budget),
        }
        kwargs.update(self._static_kwargs(buffers, budget))
        with self._engaged():
            return self._run(buffers["pixels"], budget, kwargs)

    def forward_eager(self, path: str, inputs: Any) -> dict[str, torch.Tensor]:
        """The tower's forward on exactly the items' rows, with host metadata and exact ``max_seqlen`` (no
        padding, no host sync)."""
        inputs = self._coerce(inputs)
        meta = self.metadata(inputs.grid)
        host_cu = meta["cu_seqlens"]
        kwargs = self._eager_kwargs(meta)
        tokens = int(inputs.pixel_values.shape[0]) // self.merge**2
        # The full-attention bounds are known here: long images then attend with one dense SDPA call each
        # (cuDNN on an H200, faster than Flash varlen at head dim 72), reading nothing back from the device.
        with host_bounds([(kwargs["cu_seqlens"], host_cu)], min_rows=self.kernel_rows), self._engaged():
            return self._run(inputs.pixel_values, tokens, kwargs)

    def _eager_kwargs(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        cu = meta.pop("cu_seqlens")
        kwargs: dict[str, Any] = {
            "cu_seqlens": self._to_device(cu.astype(np.int32)),
            "max_seqlen": int(np.diff(cu).max()),
        }
        kwargs.update(self._eager_extras(meta))
        kwargs.update((name, self._to_device(array)) for name, array in meta.items())
        return kwargs

    def _eager_extras(self, meta: dict[str, np.ndarray]) -> dict[str, Any]:
        return {}

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # A view, as the static forward's buffers are (slices of the largest budget's): Dynamo guards a view's
        # base, so the blocks compiled for capture then serve this eager forward without tracing it again
        # (encgraph.capture.compiled_eager). Same storage, no copy.
        tensor = to_device(torch.from_numpy(array), self._device)
        return tensor.view(tensor.shape)

    def _run(self, pixels: torch.Tensor, tokens: int, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            # grid_thw stays None (a tower that read it would fail loudly) unless the family passes a static one.
            out = own_forward(self._module)(pixels, grid_thw=kwargs.pop("grid_thw", None), return_dict=True, **kwargs)
        named = {"pooler_output": out.pooler_output}
        named.update(self._extra_named(out))
        if self.with_last_hidden_state:
            named["last_hidden_state"] = out.last_hidden_state.reshape(tokens, -1)
        return named

    def _extra_named(self, out: Any) -> dict[str, torch.Tensor]:
        return {}

    # ------------------------------------------------------------------ results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One item's outputs: ``{"pooler_output": (tokens, out_hidden), ...}``."""
        return dict(parts[PATH])

    def output_for_call(self, results: list[dict[str, torch.Tensor]], inputs: QwenVisionInputs) -> Any:
        """The tower's own output type: ``BaseModelOutputWithPooling`` (``pooler_output``: the merged
        embeddings of all items in order; ``last_hidden_state``: their pre-merger hidden states, ``(rows,
        hidden)``), or its ``to_tuple()`` for ``return_dict=False``."""
        cat = {name: torch.cat([r[name] for r in results]) for name in self.output_names}
        last = cat.pop("last_hidden_state", None)
        if last is not None:
            last = last.reshape(-1, self.hidden)
        out = self._output(last, cat)
        return out if inputs.return_dict else out.to_tuple()

    def _output(self, last: torch.Tensor | None, cat: dict[str, torch.Tensor]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=cat["pooler_output"])

    def unwrap(self) -> torch.nn.Module:
        """Restore the tower's attention implementation and layer layout, and return the tower."""
        self._switch.restore()
        restore_all(self._layout)
        return self._module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.tower_class}, budgets {self.min_budget}..{self.max_budget} tokens, "
            f"merge {self.merge}, {self._dtype}, {self._device})"
        )
