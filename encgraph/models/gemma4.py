"""Gemma-4 (``transformers.models.gemma4``): the vision tower ``Gemma4VisionModel``, two paths, packed sequences.

The tower takes ``pixel_values (B, P, C)`` (``C = 3 * patch^2``: each image or video frame a row of ``P`` patches,
padded by the processor to ``max_soft_tokens * k^2`` with ``k`` the pooling kernel: 2520 for images, 630 for video
frames by default) and ``pixel_position_ids (B, P, 2)`` (the ``(x, y)`` patch of each row, ``(-1, -1)`` marks
padding). It runs every row of ``B x P`` through the encoder with a padding mask, averages each ``k x k`` block
of patches into one soft token, then strips the padding with a boolean mask (a data-dependent shape, which a
CUDA graph cannot hold) and returns ``last_hidden_state (sum of soft tokens, hidden)``. The full model's
``get_image_features`` / ``get_video_features`` project those rows (``embed_vision``) and split them per image or
video, so ``model.model.vision_tower = encgraph.graphed(model.model.vision_tower)`` serves both unchanged.

This adapter's own static forward never sees the padding: on the host (numpy, from the positions read once per
call, as the model itself reads them) it packs the real patches of each item (one image or one frame: one batch
row of the call) into one attention sequence, in pooling-block order (the ``k^2`` patches of a soft token
consecutive, soft tokens in the tower's order), so that the pooling is a reshape and a mean, and attention is
packed variable-length attention over ``cu_seqlens`` (design rules 1-3, 9). Budgets count soft tokens; a budget
``b`` holds ``b * k^2`` patch rows, which bound the cost of every layer.

Two paths, because per-layer ``max_seqlen`` is fixed at capture (rule 3) and flash varlen attention launches
``ceil(max_seqlen / 128)`` blocks per sequence slot and head, empty or not:

- ``video``: items of at most ``frame_tokens`` soft tokens (default 70, the video processor's ``max_soft_tokens``:
  video frames, and images as small as one); ``max_seqlen`` is one frame's patches (630), and a budget holds many
  frames. Default ladder 70 .. 1120 (1 to 16 frames).
- ``image``: larger items; ``max_seqlen`` is the budget's rows (one image may fill it), and since every item here
  has more than ``frame_tokens`` tokens, a budget has few sequence slots. Default ladder 140 .. 2240 (an image of
  the default processor has at most 280 soft tokens).

One path would give a batch of 16 frames at budget 1120 an attention ``max_seqlen`` of 10080 rows instead of 630:
79 blocks per frame slot and head instead of 5, all but 5 of them empty (``tests/gpu/test_multipath_gpu.py`` times
the same frames through both paths' graphs). Both paths may be empty in a batch; an image over the image ladder
runs that path eagerly while the frames batched with it still replay.

Result per item: ``(tokens, hidden)`` in the tower's dtype, equal to the item's rows of the tower's
``last_hidden_state``; ``graphed()`` returns the tower's own output class with the items' rows concatenated.
Calls asking for per-layer outputs (``output_hidden_states`` / ``output_attentions``) or passing keywords the
graphs do not model return :class:`~encgraph.models.protocol.StockCall` (the tower's own forward answers them).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from encgraph._validate import check_int, check_pixels, describe
from encgraph.capture.upload import to_device
from encgraph.errors import ConfigError, InputError, InputTypeError, UnsupportedModelError
from encgraph.models.own_forward import own_forward
from encgraph.models._hf import require_transformers, tower_dtype_device
from encgraph.models.attention import use_packed_attention
from encgraph.models.gemma4_layout import Gemma4Patches, PatchLayouts, grid_positions
from encgraph.models.batch_ladder import take_rows
from encgraph.models.protocol import AdapterConfig, BufferSpec, FillRule, PathSpec, StockCall
from encgraph.packing import ItemSpec

__all__ = ["Gemma4Adapter", "Gemma4Patches", "adapter"]  # Gemma4Patches: from encgraph.models.gemma4_layout

IMAGE = "image"
VIDEO = "video"
OUTPUT = "last_hidden_state"
MIN_TRANSFORMERS = "5.17"
"""Lowest version tested (5.17 and 5.24 have the same vision encoder; 5.24 returns BaseModelOutputWithPooling,
5.17 BaseModelOutputWithPast, which the adapter reads from the tower itself)."""
_IGNORED = frozenset({"use_cache", "num_items_in_batch", "output_router_logits"})
"""Keywords the tower's forward accepts and ignores (they reach only its attention functions' ``**kwargs``)."""


class Gemma4Adapter:
    """Two-path adapter (``image``, ``video``) for ``Gemma4VisionModel`` (``model.model.vision_tower``).

    Args:
        module: the tower; its attention is switched to packed attention only while the adapter's forwards run.
        frame_tokens: soft tokens of the largest item on the video path (its attention ``max_seqlen`` is
            ``frame_tokens * k^2`` patches); default 70, the video processor's ``max_soft_tokens``.
        max_image_tokens, max_video_tokens: the largest budget of each path (ladders from ``2 * frame_tokens`` and
            from ``frame_tokens``, doubling).

    Buffers per budget ``b`` (``R = b * k^2`` rows): ``pixels (R, C)`` float32 (the tower computes ``2 * (x - 0.5)``
    in the pixels' dtype before casting; float32 keeps the processor's values), ``position_ids (R, 2)`` int64, both
    ZERO; ``cu_seqlens`` int32 SEQUENCE_BOUNDS over ``R`` rows in chunks of the path's ``max_seqlen``.
    """

    def __init__(self, module: torch.nn.Module, *, frame_tokens: int = 70, max_image_tokens: int = 2240,
                 max_video_tokens: int = 1120) -> None:
        require_transformers(MIN_TRANSFORMERS, "the Gemma-4 adapter")
        if not any(c.__name__ == "Gemma4VisionModel" for c in type(module).__mro__):
            raise UnsupportedModelError(
                "module: the Gemma-4 adapter takes a Gemma4VisionModel (model.model.vision_tower), got "
                f"{describe(module)}."
            )
        self.frame_tokens = check_int("frame_tokens", frame_tokens, minimum=1)
        self.max_budgets = {
            IMAGE: check_int("max_image_tokens", max_image_tokens, minimum=2 * self.frame_tokens,
                             hint="The image ladder starts at 2 * frame_tokens."),
            VIDEO: check_int("max_video_tokens", max_video_tokens, minimum=self.frame_tokens,
                             hint="The video ladder starts at frame_tokens."),
        }
        config = module.config
        self._module = module
        self.kernel = int(config.pooling_kernel_size)
        self.channels = int(module.patch_embedder.input_proj.in_features)
        self.hidden = int(config.hidden_size)
        self.table = int(config.position_embedding_size)
        self._dtype, self._device = tower_dtype_device(module)
        self.pixel_dtype = torch.float32 if self._dtype.itemsize < 4 else self._dtype
        self._output_class = self._probe_output_class()
        self._specs: dict[tuple[int, bool], ItemSpec] = {}
        self._layouts = PatchLayouts(self.kernel, self.table)
        ft = self.frame_tokens
        self._config = AdapterConfig(
            paths=(
                PathSpec(IMAGE, 2 * ft, self.max_budgets[IMAGE], allow_empty=True, outputs=(OUTPUT,)),
                PathSpec(VIDEO, ft, self.max_budgets[VIDEO], allow_empty=True, outputs=(OUTPUT,)),
            ),
            dtype=self._dtype,
            device=self._device,
        )

    def _probe_output_class(self) -> type:
        # transformers changed the tower's output class (5.17: BaseModelOutputWithPast; 5.24: ...WithPooling) and its
        # forward's annotation does not say which: ask the tower once, on one soft token.
        if self._device.type == "meta":
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            return BaseModelOutputWithPooling
        k = self.kernel
        pos = torch.from_numpy(grid_positions(k, k)[None]).to(self._device)
        with torch.no_grad():
            pv = torch.zeros(1, k * k, self.channels, dtype=self.pixel_dtype, device=self._device)
            return type(own_forward(self._module)(pv, pos, return_dict=True))

    # ------------------------------------------------------------------ description
    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> AdapterConfig:
        return self._config

    # ------------------------------------------------------------------ inputs
    def inputs(self, pixel_values: Any, pixel_position_ids: Any, *, return_dict: bool = True) -> Gemma4Patches:
        """Validate the tower's own arguments into :class:`Gemma4Patches` (reads the positions on the host once)."""
        hint = f"(B, P, {self.channels})"

        def patches_shape(pv: torch.Tensor) -> str | None:
            if pv.dim() == 3 and pv.shape[-1] == self.channels:
                return None
            return f"pixel_values: expected shape {hint}, got {tuple(pv.shape)}."

        check_pixels(
            "pixel_values", pixel_values, expected=f"a tensor {hint} (the processor's patches)",
            floating="floating-point patches in [0, 1]", device=self._device, shape=patches_shape,
        )
        if not isinstance(pixel_position_ids, (torch.Tensor, np.ndarray)):
            raise InputTypeError(
                f"pixel_position_ids: expected an int tensor (B, P, 2), got {describe(pixel_position_ids)}."
            )
        pos = pixel_position_ids
        pos = pos.detach().to("cpu").numpy() if isinstance(pos, torch.Tensor) else np.asarray(pos)
        if pos.dtype.kind not in "iu":
            raise InputTypeError(f"pixel_position_ids: expected integers, got {pos.dtype}.")
        if pos.shape != (*pixel_values.shape[:2], 2) or pos.shape[0] == 0:
            raise InputError(
                f"pixel_position_ids: expected shape {(*pixel_values.shape[:2], 2)} (one (x, y) per row of "
                f"pixel_values, at least one item), got {tuple(pos.shape)}."
            )
        pos = pos.astype(np.int64, copy=False)
        tokens, source, packed, starts = self._layouts.pack(pos)
        video = tokens <= self.frame_tokens
        return Gemma4Patches(pixel_values, pos, tokens, video, source, packed, starts, bool(return_dict))

    def inputs_from_call(self, *args: Any, **kwargs: Any) -> Gemma4Patches | StockCall:
        """The tower's ``forward(pixel_values, pixel_position_ids, **kwargs)`` arguments as inputs, or a
        :class:`StockCall` for what the graphs do not model (per-layer outputs, unknown keywords)."""
        try:  # bound as the tower's forward binds them
            pixel_values, pixel_position_ids, kwargs = _forward_arguments(*args, **kwargs)
        except TypeError as exc:
            raise InputTypeError(f"Gemma4VisionModel.forward: {exc}.") from None
        config = self._module.config
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(config, "return_dict", True) if return_dict is None else bool(return_dict)
        for name in ("output_hidden_states", "output_attentions"):
            value = kwargs.pop(name, None)
            if (getattr(config, name, False) if value is None else value):
                return StockCall(f"{name} requested")
        unknown = sorted(k for k in kwargs if k not in _IGNORED)
        if unknown:
            return StockCall(f"keyword arguments {unknown}")
        if pixel_values is None or pixel_position_ids is None:
            raise InputTypeError(
                "Gemma4VisionModel.forward: expected pixel_values (B, P, C) and pixel_position_ids (B, P, 2), got "
                f"{'pixel_values' if pixel_position_ids is None else 'pixel_position_ids'} None."
            )
        return self.inputs(pixel_values, pixel_position_ids, return_dict=return_dict)

    def item_specs(self, inputs: Gemma4Patches) -> list[ItemSpec]:
        """One spec per item (an image or a frame): its soft tokens on its path, its patch rows as input size."""
        if not isinstance(inputs, Gemma4Patches):
            raise InputTypeError(
                "inputs: expected Gemma4Patches (adapter.inputs(pixel_values, pixel_position_ids)), got "
                f"{describe(inputs)}."
            )
        out = []
        for tokens, video in zip(inputs.tokens.tolist(), inputs.video.tolist()):
            spec = self._specs.get((tokens, video))
            if spec is None:
                if len(self._specs) > 4096:
                    self._specs.clear()
                path = {IMAGE: 0, VIDEO: tokens} if video else {IMAGE: tokens, VIDEO: 0}
                spec = self._specs[(tokens, video)] = ItemSpec(path, input_size=tokens * self.kernel**2)
            out.append(spec)
        return out

    def select(self, inputs: Gemma4Patches, indices: Sequence[int]) -> Gemma4Patches:
        """Items ``indices`` (in that order): index arrays only, the pixel tensor is shared."""
        idx = np.asarray(list(indices), dtype=np.int64)
        rows = inputs.rows_of(idx)
        sizes = inputs.starts[idx + 1] - inputs.starts[idx]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return attrs.evolve(
            inputs, tokens=inputs.tokens[idx], video=inputs.video[idx], source=inputs.source[rows],
            packed_positions=inputs.packed_positions[rows], starts=starts,
        )

    def sample_inputs(self, path: str, tokens: int) -> Gemma4Patches:
        """Random patches in [0, 1] putting about ``tokens`` soft tokens on ``path`` (nothing elsewhere): one image
        (at least ``frame_tokens + 1`` tokens) on the image path, frames of ``frame_tokens`` on the video path."""
        tokens = check_int("tokens", tokens, minimum=1)
        if path == IMAGE:
            sizes = [max(tokens, self.frame_tokens + 1)]
        elif path == VIDEO:
            full, rest = divmod(tokens, self.frame_tokens)
            sizes = [self.frame_tokens] * full + [rest] * bool(rest)
        else:
            raise ConfigError(f"path: expected {IMAGE!r} or {VIDEO!r}, got {path!r}.")
        k = self.kernel
        side = max(1, self.table // k)  # pooled cells a side that fit the position table
        grids = []
        for t in sizes:
            # An a x b pooled grid with a * b == t where the table allows it, else the largest that fits (the
            # adapter refuses coordinates outside the table: a sample must be an input the tower accepts).
            fits = [d for d in range(1, math.isqrt(t) + 1) if t % d == 0 and t // d <= side]
            a = max(fits) if fits else min(side, math.isqrt(t))
            b = t // a if fits else min(side, t // a)
            grids.append(grid_positions(b * k, a * k))
        p = max(g.shape[0] for g in grids)
        pos = np.full((len(grids), p, 2), -1, np.int64)
        for i, g in enumerate(grids):
            pos[i, : g.shape[0]] = g
        pv = torch.rand(len(grids), p, self.channels, device=self._device).to(self._dtype)
        return self.inputs(pv, pos)

    def concat(self, parts: Sequence[Gemma4Patches]) -> Gemma4Patches:
        """One call holding every part's items in order (rows padded to the longest part, positions with -1)."""
        p = max(part.positions.shape[1] for part in parts)
        pvs = [torch.nn.functional.pad(part.pixel_values, (0, 0, 0, p - part.positions.shape[1])) for part in parts]
        pos = [np.pad(part.positions, ((0, 0), (0, p - part.positions.shape[1]), (0, 0)), constant_values=-1)
               for part in parts]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in pvs))
        return self.inputs(torch.cat([t.to(dtype) for t in pvs]), np.concatenate(pos), return_dict=parts[0].return_dict)

    # ------------------------------------------------------------------ buffers and forwards
    def _max_seqlen(self, path: str, budget: int) -> int:
        rows = budget * self.kernel**2
        return rows if path == IMAGE else min(rows, self.frame_tokens * self.kernel**2)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        rows = budget * self.kernel**2
        chunk = self._max_seqlen(path, budget)
        # Sequences per batch: every video-path item has >= 1 token, every image-path item > frame_tokens.
        real = min(max_frames, budget if path == VIDEO else budget // (self.frame_tokens + 1))
        slots = 1 + real + -(-rows // chunk)
        return {
            "pixels": BufferSpec((rows, self.channels), self.pixel_dtype, FillRule.ZERO),
            "position_ids": BufferSpec((rows, 2), torch.int64, FillRule.ZERO),
            "cu_seqlens": BufferSpec((slots,), torch.int32, FillRule.SEQUENCE_BOUNDS, total=rows, chunk=chunk),
        }

    def _path_rows(self, path: str, inputs: Gemma4Patches) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The path's items' patches ``(rows, C)`` (gathered on the device), positions ``(rows, 2)`` and
        ``cu_seqlens`` ``[0, ends...]`` (host)."""
        items = np.flatnonzero(inputs.video == (path == VIDEO))
        rows = inputs.rows_of(items)
        flat = inputs.pixel_values.reshape(-1, self.channels)
        pixels = take_rows(flat, inputs.source[rows])
        sizes = inputs.starts[items + 1] - inputs.starts[items]
        return pixels, inputs.packed_positions[rows], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def replay_values(self, path: str, inputs: Gemma4Patches, budget: int) -> dict[str, Any]:
        pixels, positions, cu = self._path_rows(path, inputs)
        return {"pixels": pixels, "position_ids": torch.from_numpy(positions), "cu_seqlens": cu}

    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        """The encoder on the packed buffers; output ``(budget, hidden)`` (rows past the real tokens: padding)."""
        max_seqlen = self._max_seqlen(path, budget)
        return self._encode(buffers["pixels"], buffers["position_ids"], buffers["cu_seqlens"], max_seqlen)

    def forward_eager(self, path: str, inputs: Gemma4Patches) -> dict[str, torch.Tensor]:
        pixels, positions, cu = self._path_rows(path, inputs)
        cu_dev = to_device(torch.from_numpy(cu.astype(np.int32)), self._device)
        positions_dev = to_device(torch.from_numpy(positions), self._device)
        return self._encode(pixels, positions_dev, cu_dev, int(np.diff(cu).max()))

    def _encode(
        self, pixels: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, max_seqlen: int
    ) -> dict[str, torch.Tensor]:
        # (R, C) packed patches -> the tower's patch embedding, rotary table and layers (one batch row, sequences
        # bounded by cu_seqlens) -> (R / k^2, k^2, hidden) blocks -> the pooler's mean, sqrt(hidden) scaling and
        # standardisation, in the dtypes the tower uses (the mean in float32, cast back, then float32 again).
        tower = self._module
        k2 = self.kernel**2
        with torch.no_grad(), self._packed_attention():
            pos = positions.unsqueeze(0)
            padding = torch.zeros(pos.shape[:2], dtype=torch.bool, device=pos.device)
            hidden = tower.patch_embedder(pixels.unsqueeze(0), pos, padding)
            dtype = hidden.dtype
            rope = tower.encoder.rotary_emb(hidden, pos)
            packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_seqlen, "max_length_k": max_seqlen}
            for layer in tower.encoder.layers[: tower.encoder.config.num_hidden_layers]:
                hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=pos, **packed)
            blocks = hidden[0].reshape(-1, k2, self.hidden).float()
            pooled = (blocks * (1.0 / k2)).sum(dim=1).to(dtype).float() * tower.pooler.root_hidden_size
            if tower.config.standardize:
                pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
            return {OUTPUT: pooled.to(dtype)}

    def compile_regions(self) -> list[torch.nn.Module]:
        """The encoder layers: what ``compile="auto"`` compiles, once for every layer, budget and path. Without
        them the whole static forward was compiled per path (6 graph breaks); on transformers 5.24 that left the
        layers' kernels uncompiled (H200, 8 x 336 px: 59.3 ms against 32.4 ms on 5.17, the adapter's eager
        forward 55.3 ms)."""
        return list(self._module.encoder.layers[: self._module.encoder.config.num_hidden_layers])

    @contextlib.contextmanager
    def _packed_attention(self) -> Iterator[None]:
        # Switched for the adapter's own forwards only: the tower's forward builds a padding mask by the attention
        # name, and under a "flash" name its mask does not suit SDPA, so a tower left switched would answer its own
        # calls (a StockCall, or the user's) wrongly. Replays run no Python, so the switch costs them nothing.
        switch = use_packed_attention(self._module)
        try:
            yield
        finally:
            switch.restore()

    # ------------------------------------------------------------------ results
    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """An item's ``(tokens, hidden)`` rows (it lives on one path)."""
        (named,) = parts.values()
        return named[OUTPUT]

    def output_for_call(self, results: list[torch.Tensor], inputs: Gemma4Patches) -> Any:
        """The tower's own output class, ``last_hidden_state`` = the items' rows in order (a tuple for
        ``return_dict=False``)."""
        out = self._output_class(last_hidden_state=torch.cat(results))
        return out if inputs.return_dict else out.to_tuple()

    def unwrap(self) -> torch.nn.Module:
        """The tower (the adapter never leaves it changed)."""
        return self._module

    def __repr__(self) -> str:
        return (
            f"Gemma4Adapter(frame_tokens {self.frame_tokens}, max budgets {self.max_budgets}, kernel {self.kernel}, "
            f"{self._dtype}, {self._device})"
        )


def _forward_arguments(
    pixel_values: Any = None, pixel_position_ids: Any = None, **kwargs: Any
) -> tuple[Any, Any, dict[str, Any]]:
    # The tower's forward(pixel_values, pixel_position_ids, **kwargs), without self.
    return pixel_values, pixel_position_ids, kwargs


def adapter(module: torch.nn.Module, **options: Any) -> Gemma4Adapter:
    """Registry factory: ``Gemma4Adapter(module, **options)``."""
    return Gemma4Adapter(module, **options)
