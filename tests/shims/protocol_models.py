"""Objects implementing vLLM's ``SupportsEncoderCudaGraph`` protocol (vLLM 0.33), for the shim tests.

- :func:`toy_model_class` builds a small Qwen-like vision encoder class against a ``defs`` namespace: vLLM's own
  ``vllm.v1.worker.encoder_cudagraph_defs`` (and ``SupportsEncoderCudaGraph`` as base) when vLLM is installed,
  or :data:`LOCAL_DEFS` (plain stand-ins with the fields the shim reads) without it. Its forward mixes every
  row with the mean of its attention sequence (frame), found from ``cu_seqlens`` on the device, so the metadata
  matters and an item's output depends on that item alone; ``max_seqlen`` is a 0-d CPU tensor read with
  ``.item()``, as vLLM's Qwen models keep it, and ``cu_seqlens`` has a ``padding_logics`` entry.
- :class:`HFQwenProtocol` exposes a Hugging Face Qwen-VL vision tower through the protocol methods (metadata
  from encgraph's own Qwen adapter), with no vLLM import: what the GPU test runs at real geometry.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MERGE = 2
HIDDEN = 16
FLAT = 12


@dataclass
class _ItemSpec:
    input_size: int
    output_tokens: int
    path_output_tokens: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _PathConfig:
    min_token_budget: int | None = None
    allow_zero_tokens: bool = False


@dataclass
class _Config:
    modalities: list
    buffer_keys: list
    out_hidden_size: int
    padding_logics: dict = field(default_factory=dict)
    max_frames_per_video: int = 1
    paths: dict = field(default_factory=lambda: {"default": _PathConfig()})
    capture_axes: tuple = ()


@dataclass
class _Values:
    values: dict


LOCAL_DEFS = types.SimpleNamespace(
    EncoderItemSpec=_ItemSpec, EncoderCudaGraphPathConfig=_PathConfig, EncoderCudaGraphConfig=_Config,
    EncoderCudaGraphCaptureInputs=_Values, EncoderCudaGraphReplayBuffers=_Values,
)
"""Stand-ins for vLLM's protocol data classes (the fields the shim reads), for tests without vLLM."""


def pad_repeat_last(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Cumulative buffers: copy, then repeat the last value (zero-length sequences), as vLLM's Qwen models do."""
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:] = src[-1]


def grid_rows(grid: list) -> int:
    return sum(t * h * w for t, h, w in grid)


def toy_model_class(defs: Any, base: type = object) -> type:
    """The toy encoder class, built against ``defs`` (vLLM's ``encoder_cudagraph_defs`` or :data:`LOCAL_DEFS`)."""

    class ToyVit(torch.nn.Module, base):  # type: ignore[misc, valid-type]
        def __init__(self, min_budget: int = 4, max_budget: int = 64, max_frames_per_video: int = 2) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.proj = torch.nn.Linear(FLAT, HIDDEN)
            self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
            self.pos_table = torch.nn.Parameter(torch.randn(64, HIDDEN, generator=gen) * 0.1)
            self.budget_range = (min_budget, max_budget)
            self.max_frames_per_video = max_frames_per_video

        # -- config
        def get_encoder_cudagraph_config(self) -> Any:
            return defs.EncoderCudaGraphConfig(
                modalities=["image", "video"], buffer_keys=["pixel_values", "pos", "cu_seqlens", "max_seqlen"],
                out_hidden_size=HIDDEN, padding_logics={"cu_seqlens": pad_repeat_last},
                max_frames_per_video=self.max_frames_per_video,
            )

        def get_input_modality(self, mm_kwargs: dict) -> str:
            return "video" if "video_grid_thw" in mm_kwargs else "image"

        def get_max_frames_per_video(self) -> int:
            return self.max_frames_per_video

        def get_encoder_cudagraph_budget_range(self, vllm_config: Any) -> tuple[int, int]:
            return self.budget_range

        # -- items
        def _keys(self, mm_kwargs: dict) -> tuple[str, str]:
            video = self.get_input_modality(mm_kwargs) == "video"
            return ("pixel_values_videos", "video_grid_thw") if video else ("pixel_values", "image_grid_thw")

        def _grid(self, mm_kwargs: dict) -> list:
            grid = mm_kwargs[self._keys(mm_kwargs)[1]]
            return [list(map(int, g)) for g in (grid.tolist() if isinstance(grid, torch.Tensor) else grid)]

        def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict) -> list:
            m = MERGE
            return [defs.EncoderItemSpec(input_size=t * h * w, output_tokens=t * (h // m) * (w // m))
                    for t, h, w in self._grid(mm_kwargs)]

        def select_encoder_cudagraph_items(self, mm_kwargs: dict, indices: list) -> dict:
            pv_key, grid_key = self._keys(mm_kwargs)
            grid, pixels = self._grid(mm_kwargs), mm_kwargs[pv_key]
            starts = np.concatenate(([0], np.cumsum([t * h * w for t, h, w in grid])))
            if not indices:
                return {pv_key: pixels[:0], grid_key: []}
            rows = torch.cat([pixels[int(starts[i]) : int(starts[i + 1])] for i in indices])
            return {pv_key: rows, grid_key: [grid[i] for i in indices]}

        # -- metadata and buffers
        def _metadata(self, grid: list, pad_to: int | None, device: torch.device) -> dict:
            frame_rows = np.repeat([h * w for _, h, w in grid], [t for t, _, _ in grid]).astype(np.int64)
            cu = np.concatenate(([0], np.cumsum(frame_rows))).astype(np.int32)
            if pad_to is not None and len(cu) - 1 < pad_to:
                cu = np.concatenate((cu, np.full(pad_to - (len(cu) - 1), cu[-1], np.int32)))
            local = np.concatenate([np.arange(r) % self.pos_table.shape[0] for r in frame_rows]) if len(frame_rows) else np.zeros(0, np.int64)
            pos = self.pos_table.detach()[torch.from_numpy(local.astype(np.int64))].to(device)
            return {
                "cu_seqlens": torch.from_numpy(cu).to(device),
                "pos": pos,
                "max_seqlen": torch.tensor(int(frame_rows.max()) if len(frame_rows) else 0, dtype=torch.int32),
            }

        def prepare_encoder_cudagraph_capture_inputs(
            self, token_budget: int, max_batch_size: int, max_frames_per_batch: int, device: torch.device,
            dtype: torch.dtype, path: str = "default", axis_keys: Any = None,
        ) -> Any:
            per_item = -(-token_budget // max_batch_size)
            frames = max(max_frames_per_batch // max_batch_size, 1)
            width = -(-per_item // frames)
            grid = [[frames, MERGE, width * MERGE]] * max_batch_size
            meta = self._metadata(grid, max(max_frames_per_batch, max_batch_size), device)
            meta["max_seqlen"] = torch.tensor(token_budget * MERGE**2, dtype=torch.int32)  # baked at capture
            meta["pixel_values"] = torch.randn(grid_rows(grid), FLAT, device=device, dtype=dtype)
            return defs.EncoderCudaGraphCaptureInputs(values=meta)

        def prepare_encoder_cudagraph_replay_buffers(
            self, mm_kwargs: dict, max_batch_size: int, max_frames_per_batch: int, path: str = "default"
        ) -> Any:
            pv_key, _ = self._keys(mm_kwargs)
            meta = self._metadata(self._grid(mm_kwargs), None, self.pos_table.device)  # padding logic pads
            meta["pixel_values"] = mm_kwargs[pv_key]
            return defs.EncoderCudaGraphReplayBuffers(values=meta)

        # -- forwards
        def _forward(self, pixel_values: torch.Tensor, cu_seqlens: torch.Tensor, pos: torch.Tensor,
                     max_seqlen: torch.Tensor) -> torch.Tensor:
            limit = int(max_seqlen.item())  # a host constant, as attention kernels read it
            h = self.proj(pixel_values) + pos
            rows = torch.arange(h.shape[0], device=h.device, dtype=cu_seqlens.dtype)
            seg = torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)  # frame of each row
            sums = h.new_zeros(cu_seqlens.shape[0], HIDDEN).index_add_(0, seg, h)
            counts = h.new_zeros(cu_seqlens.shape[0]).index_add_(0, seg, torch.ones_like(h[:, 0]))
            mean = sums / counts.clamp(min=1, max=max(limit, 1)).unsqueeze(1)
            h = h + self.mix(torch.tanh(mean))[seg]
            return h.view(-1, MERGE**2, HIDDEN).mean(dim=1)

        def encoder_cudagraph_forward(self, values: dict, path: str = "default") -> torch.Tensor:
            return self._forward(values.pop("pixel_values"), **values)

        def encoder_eager_forward(self, mm_kwargs: dict, path: str = "default") -> torch.Tensor:
            pv_key, _ = self._keys(mm_kwargs)
            meta = self._metadata(self._grid(mm_kwargs), None, self.pos_table.device)
            return self._forward(mm_kwargs[pv_key], **meta)

    return ToyVit


def toy_inputs(grid: list, *, video: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """vLLM-style mm_kwargs for the toy: random pixel rows and a list grid."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(grid_rows(grid), FLAT, generator=gen, dtype=dtype)
    return {"pixel_values_videos": pixels, "video_grid_thw": grid} if video else {"pixel_values": pixels, "image_grid_thw": grid}


# ---------------------------------------------------------------------------------------- a HF tower, via vLLM's protocol


class HFQwenProtocol(torch.nn.Module):
    """A Hugging Face Qwen-VL vision tower exposed through vLLM's ``SupportsEncoderCudaGraph`` methods.

    Metadata comes from encgraph's own Qwen adapter (``encgraph.models.wrap``): its runner-filled buffers become
    capture tensors, and the buffers whose fill rule is not zeros (``cu_seqlens``: a real trailing padding
    sequence; ``window_index``: padding rows map to themselves) get a ``padding_logics`` entry that applies
    that rule, so the shim keeps them per budget as vLLM's manager would. ``reference`` is an untouched copy
    of the tower for the HF forward.
    """

    def __init__(self, tower: torch.nn.Module, *, max_frames_per_video: int = 4) -> None:
        super().__init__()
        from encgraph.models import wrap

        self.reference = copy.deepcopy(tower)
        self.qwen = wrap(tower)
        self.tower = tower
        self.max_frames_per_video = max_frames_per_video
        self._rules: dict[int, Any] = {}  # capture tensor (data_ptr) -> its encgraph BufferSpec
        from encgraph.models.protocol import FillRule

        specs = self.qwen.buffer_specs("default", 64, 1, 1)
        self._keys = list(specs)
        self._padded = [name for name, spec in specs.items() if spec.fill is not FillRule.ZERO]

    def get_encoder_cudagraph_config(self) -> Any:
        return _Config(modalities=["image", "video"], buffer_keys=self._keys, out_hidden_size=int(self.tower.config.out_hidden_size),
                       padding_logics=dict.fromkeys(self._padded, self._pad), max_frames_per_video=self.max_frames_per_video)

    def _pad(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        from encgraph.capture.buffers import sequence_bounds
        from encgraph.models.protocol import FillRule

        spec = self._rules[dst.data_ptr()]
        if spec.fill is FillRule.SEQUENCE_BOUNDS:
            full = sequence_bounds(src.cpu().numpy().astype(np.int64), dst.shape[0], spec.total, spec.chunk)
            dst.copy_(torch.from_numpy(full))
            return
        n = src.shape[0]
        dst[:n].copy_(src)
        if spec.fill is FillRule.ARANGE:
            dst[n:].copy_(torch.arange(n, dst.shape[0], device=dst.device))
        elif spec.fill is FillRule.REPEAT_LAST and n:
            dst[n:] = dst[n - 1]
        else:
            dst[n:].zero_()

    def get_input_modality(self, mm_kwargs: dict) -> str:
        return "video" if "video_grid_thw" in mm_kwargs else "image"

    def _split(self, mm_kwargs: dict) -> tuple[torch.Tensor, np.ndarray]:
        video = self.get_input_modality(mm_kwargs) == "video"
        pixels = mm_kwargs["pixel_values_videos" if video else "pixel_values"]
        grid = mm_kwargs["video_grid_thw" if video else "image_grid_thw"]
        return pixels, np.asarray(grid.tolist() if isinstance(grid, torch.Tensor) else grid, dtype=np.int64).reshape(-1, 3)

    def _qwen_inputs(self, mm_kwargs: dict) -> Any:
        return self.qwen.inputs(*self._split(mm_kwargs))

    def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict) -> list:
        m = self.qwen.merge
        return [_ItemSpec(input_size=int(t * h * w), output_tokens=int(t * h * w // m**2)) for t, h, w in self._split(mm_kwargs)[1]]

    def select_encoder_cudagraph_items(self, mm_kwargs: dict, indices: list) -> dict:
        pixels, grid = self._split(mm_kwargs)
        starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
        rows = torch.cat([pixels[int(starts[i]) : int(starts[i + 1])] for i in indices])
        keys = ("pixel_values_videos", "video_grid_thw") if "video_grid_thw" in mm_kwargs else ("pixel_values", "image_grid_thw")
        return {keys[0]: rows, keys[1]: grid[list(indices)].tolist()}

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget: int, max_batch_size: int, max_frames_per_batch: int,
                                                 device: Any, dtype: Any, path: str = "default", axis_keys: Any = None) -> Any:
        values = {}
        for name, spec in self.qwen.buffer_specs(path, token_budget, max_batch_size, max(max_frames_per_batch, max_batch_size)).items():
            t = torch.randn(spec.shape, device=device).to(spec.dtype) if spec.dtype.is_floating_point else torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            self._rules[t.data_ptr()] = spec
            values[name] = t
            if name in self._padded:  # a valid all-padding layout, as a model's dummy metadata would be
                self._pad(t, t[:0])
        return _Values(values=values)

    def prepare_encoder_cudagraph_replay_buffers(self, mm_kwargs: dict, max_batch_size: int, max_frames_per_batch: int,
                                                 path: str = "default") -> Any:
        values = self.qwen.replay_values(path, self._qwen_inputs(mm_kwargs), 0)
        return _Values(values={k: torch.as_tensor(v) for k, v in values.items()})

    def encoder_cudagraph_forward(self, values: dict, path: str = "default") -> torch.Tensor:
        budget = values["pixels"].shape[0] // self.qwen.merge**2
        return self.qwen.forward_static(path, values, budget)["pooler_output"]

    def encoder_eager_forward(self, mm_kwargs: dict, path: str = "default") -> torch.Tensor:
        return self.qwen.forward_eager(path, self._qwen_inputs(mm_kwargs))["pooler_output"]

    def hf_per_item(self, mm_kwargs: dict) -> list[torch.Tensor]:
        """The untouched tower's own forward, one item at a time (pooler_output)."""
        pixels, grid = self._split(mm_kwargs)
        starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
        device = pixels.device
        return [self.reference(pixels[int(starts[i]) : int(starts[i + 1])],
                               grid_thw=torch.from_numpy(grid[i : i + 1]).to(device)).pooler_output
                for i in range(grid.shape[0])]
