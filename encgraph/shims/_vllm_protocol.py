"""vLLM's ``SupportsEncoderCudaGraph`` protocol as an encgraph adapter. Imports no vLLM.

vLLM (0.33, ``vllm/model_executor/models/interfaces.py``) lets a multimodal model describe its vision encoder to
a budget-based CUDA graph manager with ten methods. Each maps onto the adapter protocol
(:mod:`encgraph.capture.protocol`):

==============================================  ==================================================================
vLLM protocol                                   encgraph adapter
==============================================  ==================================================================
``get_encoder_cudagraph_config``                ``config``: one :class:`PathSpec` per ``paths`` entry, frames per
                                                item from ``max_frames_per_video`` when ``"video"`` is a modality
``get_encoder_cudagraph_budget_range``          each path's ``max_budget`` (and ``min_budget`` unless the path has one)
``get_encoder_cudagraph_item_specs``            ``item_specs`` (``output_tokens`` / ``path_output_tokens``,
                                                ``input_size``; frames from ``frames=``, see below)
``select_encoder_cudagraph_items``              ``select``
``prepare_encoder_cudagraph_capture_inputs``    ``buffer_specs`` (see "Buffers")
``prepare_encoder_cudagraph_replay_buffers``    ``replay_values``
``encoder_cudagraph_forward``                   ``forward_static`` (output ``"embeddings"``, budget rows)
``encoder_eager_forward``                       ``forward_eager``
``postprocess_encoder_output`` (the default)    ``assemble``: the item's rows of the output, as vLLM's
                                                ``scatter_output_slices`` cuts them
==============================================  ==================================================================

Buffers. ``prepare_encoder_cudagraph_capture_inputs`` returns the tensors a captured forward reads. The adapter
keeps every value exactly as the model returned it, per path and budget, and the graph of that budget reads those
very tensors (vLLM's buffer-identity invariant: ``encoder_cudagraph_forward`` gets the model's own capture
tensors, never copies); the runner gets no buffers of its own from this adapter (``buffer_specs`` is empty).
Before each replay they are refreshed the way vLLM's manager refreshes them: 0-d tensors are copied, tensors
with a ``padding_logics`` entry go through that function, others are zeroed and their leading rows copied,
``None`` (or a missing key) leaves a buffer as captured (``EncoderCudaGraphReplayBuffers``' contract), host
tensors (``max_seqlen`` kept on the CPU, read with ``.item()`` at capture) stay where they are. So the model's
own metadata layout (its ``cu_seqlens`` padding included) is kept unchanged: the shim adds encgraph's planning,
not a new metadata layout. Memory: one set of capture tensors per budget, as in vLLM.

Not expressible through the protocol, so refused with :class:`~encgraph.errors.UnsupportedModelError`:
``capture_axes`` (one graph per budget and axis key) and an overridden ``postprocess_encoder_output`` (it
post-processes a whole sub-batch with its inputs, while the runner hands the adapter one item at a time).

Frames. vLLM's ``EncoderItemSpec`` has no frame count, so its manager packs by tokens and items only (a batch of
videos can overflow the captured ``cu_seqlens``). ``frames=`` gives one count per item; by default it is the
temporal column of the ``*_grid_thw`` entry of the inputs (vLLM's Qwen-family layout), else 1 per item.

Optional methods: the protocol has no way to build synthetic inputs or to join two inputs objects, so
``sample_inputs`` and ``concat`` exist only when given to the constructor (``sample_inputs=`` /
``concat=`` callables, see :mod:`encgraph.capture.protocol`).

Grad mode: the adapter enters none; vLLM's manager (and :class:`encgraph.shims.vllm.EncoderCudaGraphManager`)
run capture and calls under ``torch.inference_mode()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from encgraph._validate import check_int, describe
from encgraph.capture.protocol import AdapterConfig, BufferSpec, PathSpec
from encgraph.errors import ConfigError, InputError, InputTypeError, UnsupportedModelError
from encgraph.packing import ItemSpec

__all__ = ["VllmProtocolAdapter", "unsupported_reason", "OUTPUT"]

OUTPUT = "embeddings"
"""The name of every path's output tensor."""

_AXIS_KEYS_KWARG = "encoder_cudagraph_axis_keys"  # vLLM's ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG
_DEFAULT_POSTPROCESS = "SupportsEncoderCudaGraph.postprocess_encoder_output"


def unsupported_reason(model: Any, config: Any = None) -> str | None:
    """Why ``model`` (a ``SupportsEncoderCudaGraph`` object) cannot run behind the runner, or ``None``."""
    config = model.get_encoder_cudagraph_config() if config is None else config
    if tuple(getattr(config, "capture_axes", ()) or ()):
        return "its EncoderCudaGraphConfig has capture_axes (one graph per budget and axis key)"
    fn = getattr(type(model), "postprocess_encoder_output", None)
    if fn is not None and getattr(fn, "__qualname__", "") != _DEFAULT_POSTPROCESS:
        return (
            f"{type(model).__name__} overrides postprocess_encoder_output (it post-processes whole sub-batches "
            "with their inputs; the runner assembles one item at a time)"
        )
    if not getattr(config, "paths", None):
        return "its EncoderCudaGraphConfig has no paths"
    return None


def _zero_then_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # vLLM's EncoderCudaGraphManager._copy_padded_buffer, for held buffers without a padding logic.
    dst.zero_()
    dst[: src.shape[0]].copy_(src)


def _path_tokens(spec: Any, path: str) -> int:
    # EncoderItemSpec.get_path_output_tokens, for spec objects that are not vLLM's own.
    per_path = getattr(spec, "path_output_tokens", None) or {}
    if path == "default" and not per_path:
        return int(spec.output_tokens)
    return int(per_path.get(path, 0))


def grid_frames(inputs: Mapping[str, Any], items: int) -> list[int]:
    """Frames per item from the one ``*_grid_thw`` entry of ``inputs`` (its first column), else 1 per item."""
    keys = [k for k in inputs if isinstance(k, str) and k.endswith("grid_thw")]
    if len(keys) != 1:
        return [1] * items
    grid = inputs[keys[0]]
    rows = grid.tolist() if isinstance(grid, torch.Tensor) else list(grid)
    if len(rows) != items:
        raise InputError(
            f"inputs[{keys[0]!r}]: expected one (t, h, w) row per item ({items} items), got {len(rows)} rows; "
            "pass frames= to VllmProtocolAdapter if this entry is not the per-item grid."
        )
    return [max(1, int(row[0])) for row in rows]


class VllmProtocolAdapter:
    """Any object implementing vLLM's ``SupportsEncoderCudaGraph`` protocol, as an encgraph adapter.

    Inputs are vLLM's ``mm_kwargs`` dicts (one modality per call, as vLLM groups them); results are one
    ``(output_tokens, hidden)`` tensor per item, as vLLM's manager returns them.

    Args:
        model: the protocol object (a vLLM model, or anything with the same methods; vLLM is never imported).
        vllm_config: passed to ``get_encoder_cudagraph_budget_range`` when ``budget_range`` is not given.
        budget_range: ``(min_budget, max_budget)`` in output tokens; default: the model's own range.
        device, dtype: where the captured buffers live and their dtype (vLLM passes the model runner's);
            default: the model's parameters' (CPU / float32 for an object without parameters).
        frames: ``frames(mm_kwargs) -> one frame count per item``; default :func:`grid_frames`.
        model_frames: the ``max_frames_per_batch`` value handed to the model's capture and replay methods
            instead of the runner's frame limit (vLLM's manager passes 0 when videos are disabled).
        sample_inputs, concat: the optional adapter methods, when the caller can provide them.
        clone_items: ``assemble`` copies each item's rows into storage of its own, as vLLM's
            ``postprocess_encoder_output(clone=True)`` does, while the sub-batch's output is still valid; the
            adapter then says so (``assemble_copies``), and the runner copies nothing before it: one copy per
            item, whatever the runner's ``copy_outputs`` and however many sub-batches a call has.

    One adapter serves one runner: it keeps the model's per-budget capture values for the graphs of the runner
    that called ``buffer_specs`` (a second runner on the same model needs its own adapter).

    Raises:
        UnsupportedModelError: capture axes or an overridden ``postprocess_encoder_output`` (see the module).
        ConfigError: a bad budget range or path minimum.
    """

    def __init__(
        self,
        model: Any,
        *,
        vllm_config: Any = None,
        budget_range: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        frames: Callable[[Mapping[str, Any]], Sequence[int]] | None = None,
        model_frames: int | None = None,
        sample_inputs: Callable[[str, int], Any] | None = None,
        concat: Callable[[Sequence[Any]], Any] | None = None,
        clone_items: bool = False,
    ) -> None:
        missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(model, m, None))]
        if missing:
            raise UnsupportedModelError(
                f"model: expected an object implementing vLLM's SupportsEncoderCudaGraph protocol, got "
                f"{describe(model)}; missing methods: {missing}."
            )
        self.model = model
        vconfig = model.get_encoder_cudagraph_config()
        reason = unsupported_reason(model, vconfig)
        if reason is not None:
            raise UnsupportedModelError(f"model: VllmProtocolAdapter cannot run {describe(model)}: {reason}.")
        self.vllm_encoder_config = vconfig
        low, high = _budget_range(model, vllm_config, budget_range)
        param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = torch.device(device) if device is not None else (param.device if param is not None else torch.device("cpu"))
        self.dtype = dtype if dtype is not None else (param.dtype if param is not None else torch.float32)
        paths = []
        for name, pconf in vconfig.paths.items():
            floor = getattr(pconf, "min_token_budget", None)
            if floor is not None and not 0 < floor <= high:
                raise ConfigError(
                    f"paths[{name!r}].min_token_budget: expected 1..{high} (the max budget), got {floor}."
                )
            paths.append(PathSpec(
                name, min_budget=low if floor is None else floor, max_budget=high,
                allow_empty=bool(getattr(pconf, "allow_zero_tokens", False)), outputs=(OUTPUT,),
            ))
        video = "video" in list(vconfig.modalities)
        per_item = max(1, int(getattr(vconfig, "max_frames_per_video", 1) or 1)) if video else 1
        self._config = AdapterConfig(paths, max_frames_per_item=per_item, dtype=self.dtype, device=self.device)
        names = self._config.path_names
        self._single = names == ("default",)
        if "default" not in names and len(names) > 1:
            raise UnsupportedModelError(
                f"model: vLLM's default postprocess_encoder_output reads the path 'default', this model has {list(names)}."
            )
        self._result_path = "default" if "default" in names else names[0]
        self._padding = dict(getattr(vconfig, "padding_logics", {}) or {})
        self._frames = frames
        self.model_frames = None if model_frames is None else check_int("model_frames", model_frames, minimum=0)
        self._limits: tuple[int, int] | None = None
        self._held: dict[tuple[str, int], dict[str, Any]] = {}
        if sample_inputs is not None:
            self.sample_inputs = sample_inputs
        if concat is not None:
            self.concat = concat
        self.clone_items = bool(clone_items)

    @property
    def config(self) -> AdapterConfig:
        return self._config

    @property
    def assemble_copies(self) -> bool:
        """``clone_items``: ``assemble``'s results never share storage with the rows it is given."""
        return self.clone_items

    # ------------------------------------------------------------------ items
    def item_specs(self, inputs: Any) -> list[ItemSpec]:
        """One :class:`ItemSpec` per item of ``inputs`` (an ``mm_kwargs`` mapping)."""
        if not isinstance(inputs, Mapping):
            raise InputTypeError(f"inputs: expected vLLM's mm_kwargs (a dict), got {describe(inputs)}.")
        specs = list(self.model.get_encoder_cudagraph_item_specs(inputs))
        frames = grid_frames(inputs, len(specs)) if self._frames is None else list(self._frames(inputs))
        if len(frames) != len(specs):
            raise InputError(f"frames(inputs): expected {len(specs)} counts (one per item), got {len(frames)}.")
        out = []
        for spec, f in zip(specs, frames):
            if self._single:
                tokens: int | dict[str, int] = int(spec.output_tokens)
            else:
                tokens = {p: _path_tokens(spec, p) for p in self._config.path_names}
                if tokens.get(self._result_path, 0) != int(spec.output_tokens):
                    raise InputError(
                        f"item spec {spec!r}: output_tokens ({spec.output_tokens}) must equal the tokens of path "
                        f"{self._result_path!r} ({tokens.get(self._result_path, 0)}), which the default "
                        "postprocess_encoder_output cuts per item."
                    )
            out.append(ItemSpec(tokens, frames=int(f), input_size=int(spec.input_size)))
        return out

    def select(self, inputs: Mapping[str, Any], indices: Sequence[int]) -> dict[str, Any]:
        selected = dict(self.model.select_encoder_cudagraph_items(inputs, list(indices)))
        selected.pop(_AXIS_KEYS_KWARG, None)
        return selected

    # ------------------------------------------------------------------ buffers
    def _model_limits(self, max_items: int, max_frames: int) -> tuple[int, int]:
        return max_items, (max_frames if self.model_frames is None else self.model_frames)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> dict[str, BufferSpec]:
        """No runner buffers: keeps the model's capture values of ``path`` at ``budget`` (module docs)."""
        items, frames = self._model_limits(max_items, max_frames)
        self._limits = (items, frames)
        capture = self.model.prepare_encoder_cudagraph_capture_inputs(budget, items, frames, self.device, self.dtype, path)
        self._held[(path, budget)] = dict(capture.values)
        return {}

    def captured_values(self, path: str, budget: int) -> dict[str, Any]:
        """The model's own capture values of ``path`` at ``budget``, which that budget's graph reads."""
        return self._held[(path, budget)]

    def release(self) -> None:
        """Drop the capture values kept per budget (after the runner that used them is gone)."""
        self._held.clear()

    def replay_values(self, path: str, inputs: Mapping[str, Any], budget: int) -> dict[str, torch.Tensor]:
        """Refresh the model's capture tensors of ``path`` at ``budget`` in place, as vLLM's manager does before
        a replay (module docs); nothing for the runner's (empty) buffers."""
        if self._limits is None:
            raise ConfigError("replay_values: buffer_specs was never called; capture the runner first.")
        replay = self.model.prepare_encoder_cudagraph_replay_buffers(inputs, *self._limits, path)
        values = replay.values
        for key, buf in self._held[(path, budget)].items():
            src = values.get(key)
            if not isinstance(buf, torch.Tensor) or src is None:
                continue
            if src.dim() == 0:
                buf.copy_(src)
            else:
                self._padding.get(key, _zero_then_copy)(buf, src)
        return {}

    # ------------------------------------------------------------------ forwards
    def forward_static(self, path: str, buffers: Mapping[str, torch.Tensor], budget: int) -> dict[str, torch.Tensor]:
        # The model's own capture tensors, as vLLM's manager passes them (``buffers`` is empty: no runner buffers).
        out = self.model.encoder_cudagraph_forward({**self._held[(path, budget)]}, path=path)
        rows = out.shape[0]
        if rows > budget:  # e.g. whole tiles: rows past the budget are padding too
            out = out[:budget]
        elif rows < budget:  # e.g. InternVL: budget // tokens-per-tile tiles; the planner never uses these rows
            out = torch.cat([out, out.new_zeros((budget - rows, *out.shape[1:]))])
        return {OUTPUT: out}

    def forward_eager(self, path: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {OUTPUT: self.model.encoder_eager_forward(inputs, path=path)}

    def assemble(self, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        # vLLM's default postprocess_encoder_output: scatter_output_slices(outputs["default"], ...).
        rows = parts[self._result_path][OUTPUT]
        return rows.clone() if self.clone_items else rows

    def __repr__(self) -> str:
        return f"VllmProtocolAdapter({type(self.model).__name__}, paths={list(self._config.path_names)})"


_PROTOCOL_METHODS = (
    "get_encoder_cudagraph_config", "get_encoder_cudagraph_item_specs", "select_encoder_cudagraph_items",
    "prepare_encoder_cudagraph_capture_inputs", "prepare_encoder_cudagraph_replay_buffers",
    "encoder_cudagraph_forward", "encoder_eager_forward",
)


def _budget_range(model: Any, vllm_config: Any, given: tuple[int, int] | None) -> tuple[int, int]:
    if given is None:
        if not callable(getattr(model, "get_encoder_cudagraph_budget_range", None)):
            raise ConfigError("budget_range: the model has no get_encoder_cudagraph_budget_range; pass budget_range=(min, max).")
        given = model.get_encoder_cudagraph_budget_range(vllm_config)
    if not isinstance(given, (tuple, list)) or len(given) != 2 or not all(isinstance(v, int) for v in given):
        raise ConfigError(f"budget_range: expected (min_budget, max_budget) ints, got {describe(given)}.")
    low, high = given
    if low <= 0 or high <= 0:
        raise ConfigError(
            f"Invalid encoder cudagraph budget range: min_budget={low}, max_budget={high}. Both must be positive."
        )
    if low > high:
        raise ConfigError(f"Invalid encoder cudagraph budget range: min_budget={low} > max_budget={high}.")
    return int(low), int(high)
