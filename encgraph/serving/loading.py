"""The models ``encgraph serve`` serves: the embedded defaults and local Hugging Face checkpoints.

A :class:`ServedModel` is one tower behind one :class:`~encgraph.serving.BatchingFront`, with the image processor
that turns decoded images into the tower's inputs (transformers' own) and the rule that pools the tower's output
into one embedding per image:

- batch towers (SigLIP, CLIP; budgets count images): the tower's ``pooler_output`` where it has one, else the mean
  of ``last_hidden_state`` over tokens; the token sequence is ``last_hidden_state``;
- token towers (Qwen-VL; budgets count merged tokens): the mean of the item's merged tokens (``pooler_output``
  rows); the token sequence is those rows.

Embedded defaults (no ``--model``): the tiny random-weight towers of ``encgraph/configs/<name>.json`` (the ones
``encgraph demo`` builds, seeded) with their processors ``encgraph/configs/<name>_processor.json``; no download.
``--model PATH`` loads a local checkpoint directory: its vision tower only (a full VLM or dual-encoder checkpoint
is read for the tower's weights alone), and its ``preprocessor_config.json``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from encgraph.embedded_towers import build_tower, load_config
from encgraph.errors import ConfigError, UnsupportedModelError, VersionError
from encgraph.serving import checkpoints
from encgraph.serving.checkpoints import Checkpoint
from encgraph.serving.transfer import (
    Handoff,
    HostCopy,
    PinnedBuffers,
    Ready,
    side_stream_work,
    upload,
)

__all__ = ["ServedModel", "Prepared", "Finished", "EMBEDDED", "FAMILIES", "Family", "load_processor", "process_images",
           "embedded_tower", "inspect_checkpoint", "load_tower", "load_checkpoint", "build_model"]

EMBEDDED: dict[str, tuple[int, ...]] = {"siglip": (1, 2, 4, 8, 16), "qwen2_5_vl": (16, 32, 64, 128)}
"""The embedded default models and their ladders (images for SigLIP, merged tokens for Qwen2.5-VL: its processor
resizes an image to at most 128 tokens). Small budgets: on the CPU a static forward's attention costs budget^2."""

_QWEN_KEYS = {r"^(?:model\.)?visual\.": ""}


@attrs.frozen
class Prepared:
    """A request's adapter inputs and, where their device work is still in flight on a side stream, its
    :class:`~encgraph.serving.transfer.Ready` (``None``: ready for any stream)."""

    inputs: Any
    ready: Ready | None = None


@attrs.frozen
class Family:
    """How to load one family's vision tower from a checkpoint directory (data, one row per family).

    ``tower``: ``"module:Class"`` of the tower; ``sub_config``: the attribute of a full model's config holding the
    tower's (``None``: the tower class reads a full checkpoint by itself); ``key_mapping``: checkpoint key
    regexes -> tower keys, for a tower inside a full model; ``unit``: what its budgets count, ``"images"`` (batch
    towers) or ``"tokens"`` (merged tokens, Qwen-VL)."""

    tower: str
    sub_config: str | None = None
    key_mapping: Mapping[str, str] | None = None
    unit: str = "images"


_TOWERS = {
    "siglip": "transformers.models.siglip.modeling_siglip:SiglipVisionModel",
    "clip": "transformers.models.clip.modeling_clip:CLIPVisionModel",
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
    "qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
}
FAMILIES: dict[str, Family] = {
    # A full checkpoint (dual encoder or VLM) and a tower saved alone (its own model_type).
    **{f: Family(_TOWERS[f]) for f in ("siglip", "clip")},
    **{f"{f}_vision_model": Family(_TOWERS[f]) for f in ("siglip", "clip")},
    **{f: Family(_TOWERS[f], "vision_config", _QWEN_KEYS, "tokens") for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")},
    **{f"{f}_vision": Family(_TOWERS[f], unit="tokens") for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")},
}
"""``config.model_type`` of a checkpoint -> how to load its vision tower."""


@attrs.define(eq=False)
class ServedModel:
    """One served tower: ``front`` (its batching front), ``processor`` (a transformers image processor),
    ``adapter`` (for the inputs and the pooling rule), where it runs, and what to report in ``/health``:
    ``engine`` is what runs the tower from the first request on, fixed when it is built (:func:`build_model`):
    the runner's mode (``"graph"``: CUDA graph replays; ``"eager"``: the adapter's eager forward, the CPU default;
    ``"static"``: the padded static forward run eagerly), or ``"hf-eager"`` (``eager``: the tower's own forward)."""

    name: str
    description: str
    processor: Any
    adapter: Any
    front: Any
    device: Any
    dtype: Any
    eager: bool = False
    engine: str | None = None

    def inputs(self, images: Sequence[Any]) -> Any:
        """The adapter's inputs for decoded RGB images (the processor's tensors, on the tower's device and in its
        dtype), ready for any stream. Runs on a request thread."""
        return self.inputs_from_arrays(process_images(self.processor, images))

    def inputs_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> Any:
        """:meth:`prepare`'s inputs, ready for any stream: where their device work is still in flight, this thread
        waits for that work alone (not for the replays)."""
        prepared = self.prepare(arrays)
        if prepared.ready is not None:
            prepared.ready.wait_host()
        return prepared.inputs

    def prepare_images(self, images: Sequence[Any]) -> Prepared:
        """:meth:`prepare` of decoded RGB images (the processor's host half on this thread)."""
        return self.prepare(process_images(self.processor, images))

    def prepare(self, arrays: Mapping[str, np.ndarray]) -> Prepared:
        """The adapter's inputs for :func:`process_images`'s arrays, made in this process or in a preprocessing
        worker's (:mod:`encgraph.serving.preprocess`): the pixels copied to the tower's device and dtype (on the
        CPU in float32 they stay the arrays' memory), the grids as CPU int64 tensors. Decoded bytes
        (``--preprocess-on device``) are processed on this thread's side stream with the adapter's own step after
        them, and left in flight: :meth:`submit` hands ``ready`` to the front's worker."""
        import torch

        if "decoded_sizes" not in arrays:
            # On a GPU through this thread's side stream: a copy on the default stream would wait for every replay
            # the front's worker has queued there (encgraph.serving.transfer).
            pixels = upload(torch.from_numpy(arrays["pixel_values"]), self.device, self.dtype)
            return Prepared(self.adapter_inputs(pixels, arrays.get("image_grid_thw")))
        with side_stream_work(self.device, Handoff.EVENT) as work:
            done = self.processor.on_device(arrays, self.device, self.dtype)
            pixels = work(done["pixel_values"])
            # Every device tensor of the inputs, not only the pixels: the adapter's step may make new ones here.
            inputs = work.keep_all(self.adapter_inputs(pixels, done.get("image_grid_thw")))
        return Prepared(inputs, work.ready)

    def adapter_inputs(self, pixels: Any, grid: Any) -> Any:
        """The adapter's inputs for the processor's ``pixel_values`` (on the device) and ``image_grid_thw``."""
        import torch

        if grid is not None:
            return self.adapter.inputs_from_call(pixels, grid_thw=torch.as_tensor(grid))
        return self.adapter.inputs_from_call(pixel_values=pixels)

    def submit(self, prepared: Prepared) -> Any:
        """Queue :meth:`prepare`'s inputs on the front (its future); the worker waits on the device for work
        still in flight before their call."""
        return self.front.submit_after(prepared.ready, prepared.inputs)

    @property
    def per_item_tokens(self) -> bool:
        """Whether a result's rows are tokens (Qwen-VL) rather than images (batch towers)."""
        return _per_item_tokens(self.adapter)

    def on_host(self, finished: Finished) -> None:
        """Return once a request's result (what its front's future gave) has its pooled embeddings on the host:
        the device's work for its call and the copy down, behind the work queued before them, not later calls'.
        Runs on a request thread (GIL released while it waits)."""
        finished.pooled.wait()

    def embeddings(self, finished: Finished, tokens: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per image of a request's result (what its front's future gave): its pooled embedding ``(dim,)``
        float32 and (``tokens``) its token sequence ``(n, dim)`` float32. Waits as :meth:`on_host` does (at once
        after it); ``tokens`` copies the sequences down on this thread, behind all the device's work queued by then
        (later calls' included). Runs on a request thread."""
        import torch

        per_token = self.per_item_tokens
        out = []
        with torch.inference_mode():
            for p, r in zip(finished.host_rows(), finished.results):
                seq = _sequence(r, per_token).float().cpu().numpy() if tokens else None
                out.append((p, seq))
        return out

    def token_count(self, finished: Finished) -> int:
        per_token = self.per_item_tokens
        return sum(int(_sequence(r, per_token).shape[0]) for r in finished.results)

    def info(self) -> dict[str, Any]:
        runner = self.front.stats.get("runner", {})
        return {
            "description": self.description,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "engine": self.engine or ("hf-eager" if self.eager else runner.get("mode", "unknown")),
            "queue_depth": self.front.queue_depth,
            # Which backend preprocesses (Pillow without torchvision): torchvision's is 1.7-4x faster per image on
            # a CPU (benches/results/preprocess_exactness_cpu.md), a fallback a deployment should be able to see.
            "image_processor": getattr(self.processor, "label", type(self.processor).__name__),
        }


@attrs.frozen
class Finished:
    """A request's result as its front answers it: ``pooled`` (the host copy of its call's pooled embeddings, one
    ``(call's images, dim)`` float32 tensor, in flight, shared by the call's requests), ``rows`` (this request's
    rows of it, its images in order) and ``results`` (the runner's per-image device results, for the token
    sequences; they live as long as this object)."""

    pooled: HostCopy
    rows: slice
    results: Sequence[Mapping[str, Any]]

    def host_rows(self) -> np.ndarray:
        """This request's pooled embeddings ``(images, dim)`` float32, once on the host (:meth:`HostCopy.wait`),
        copied out of the call's buffer (a few KiB: the pinned buffer goes back to the pool when the call's
        requests are done with it, whoever keeps these rows)."""
        (pooled,) = self.pooled.wait()
        return pooled[self.rows].numpy().copy()


def _per_item_tokens(adapter: Any) -> bool:
    from encgraph.capture.protocol import BudgetUnit

    return adapter.config.paths[0].unit is BudgetUnit.TOKENS


def _sequence(result: Mapping[str, Any], per_item_tokens: bool) -> Any:
    """One image's token sequence ``(n, dim)``: a token tower's merged tokens, a batch tower's last hidden state."""
    return result["pooler_output"] if per_item_tokens else result["last_hidden_state"][0]


def _finish_call(per_item_tokens: bool, buffers: PinnedBuffers, calls: Sequence[Sequence[Mapping[str, Any]]]
                 ) -> list[Finished]:
    """The front's ``finish_call`` (on its worker, right after the call; ``calls``: each request's per-image
    results, in the call's order): each image's pooled embedding, computed on the device (a token tower: the mean
    of its merged tokens; a batch tower: its ``pooler_output`` where it has one, else the mean of its last hidden
    state), all the call's images stacked, their one copy to the host (one event, a reused pinned buffer:
    :class:`~encgraph.serving.transfer.PinnedBuffers`) started behind this call's replay; each request gets its
    rows."""
    import torch

    pooled = []
    for r in (r for results in calls for r in results):
        if per_item_tokens or "pooler_output" not in r:
            pooled.append(_sequence(r, per_item_tokens).float().mean(0))
        else:
            pooled.append(r["pooler_output"][0])
    copy = buffers.copy(torch.stack(pooled).float())
    bounds = np.cumsum([0, *(len(results) for results in calls)]).tolist()
    return [Finished(copy, slice(a, b), results) for a, b, results in zip(bounds, bounds[1:], calls)]


PROCESSED = ("pixel_values", "image_grid_thw", "decoded_sizes")
"""The image processor's outputs a served tower reads (what :func:`process_images` keeps; ``decoded_sizes``: the
decoded images' of :class:`~encgraph.serving.device_preprocess.DeviceProcessing`)."""


def process_images(processor: Any, images: Sequence[Any]) -> dict[str, np.ndarray]:
    """``processor``'s outputs for decoded RGB images, as numpy arrays in host memory that the caller owns:
    ``pixel_values`` float32, ``(images, 3, H, W)`` for batch towers or ``(patch rows, 3 * T * P * P)`` for
    Qwen-VL, and Qwen-VL's ``image_grid_thw`` int64 ``(images, 3)``.

    The processor is asked for torch tensors (what every backend, Pillow or torchvision, returns alike) and they
    are viewed as numpy without a copy: the same bits in this process as in a preprocessing worker's, and arrays
    pickle across the process boundary without torch's shared-memory machinery."""
    processed = processor(images=list(images), return_tensors="pt")
    return {key: processed[key].numpy() for key in PROCESSED if key in processed}


def _processor_class(name: str) -> Any:
    import transformers
    from transformers.utils import is_torchvision_available

    # Since transformers' image-processor refactor, ``<Model>ImageProcessor`` names the torchvision backend; without
    # torchvision, ``getattr(transformers, name)`` falls back to ``<Model>ImageProcessorPil`` and logs a warning
    # saying so, once per class: two warnings on every ``encgraph serve`` start (issue 57). torchvision is not a
    # dependency (its PyPI wheels pin one torch each), so ask for the Pillow backend by its own name: the same class
    # that fallback gives, without the warning. With torchvision installed, the named (torchvision) class is used.
    if not is_torchvision_available():
        pil = getattr(transformers, f"{name}Pil", None)
        if pil is not None:
            return pil
    cls = getattr(transformers, name, None)
    if cls is None:
        raise VersionError(f"image processor {name!r}: not in the installed transformers {transformers.__version__}.")
    return cls


def load_processor(name: str) -> Any:
    """The image processor of embedded model ``name`` (``encgraph/configs/<name>_processor.json``)."""
    config = load_config(f"{name}_processor")
    return _processor_class(config["image_processor_type"]).from_dict(config)


def embedded_tower(name: str, *, device: Any, dtype: Any, seed: int = 0) -> tuple[Any, str]:
    """The embedded tower ``name`` (seeded random weights), as ``encgraph demo`` builds it."""
    if name not in EMBEDDED:
        raise ConfigError(f"model: expected one of the embedded models {sorted(EMBEDDED)}, got {name!r}.")
    return build_tower(name, seed=seed, device=device, dtype=dtype)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # Loading a tower from a full checkpoint lists every weight of the other half as "unexpected": expected here.
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def inspect_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checked checkpoint directory ``path`` (config, weights, processor and their sizes; no tower built):
    :func:`encgraph.serving.checkpoints.inspect_checkpoint` over the served families."""
    with _quiet_transformers():
        return checkpoints.inspect_checkpoint(path, FAMILIES)


def load_tower(checkpoint: Checkpoint, *, device: Any, dtype: Any) -> tuple[Any, str]:
    """The vision tower of a checked checkpoint (on ``device`` in ``dtype``, eval mode) and its description."""
    path, config = checkpoint.path, checkpoint.config
    family = FAMILIES[checkpoint.model_type]
    module_name, cls_name = family.tower.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    # use_kernels=False: the tower's own torch forward, what the graphs capture and the answers are checked by.
    # transformers 5.25 otherwise kernelizes by default (layers swapped for hub kernels fetched at start) and, where
    # the ``kernels`` package is missing or of another version, refuses to load at all ("Kernels are not
    # available"); 5.15 takes the argument with the same meaning (its default).
    options: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "use_kernels": False}
    if family.sub_config is not None:
        options["config"] = getattr(config, family.sub_config)
        options["key_mapping"] = dict(family.key_mapping or {})
    with _quiet_transformers():
        tower = cls.from_pretrained(path, **options)
    params = sum(p.numel() for p in tower.parameters())
    return tower.to(device).eval(), f"{cls_name} from {path} ({params / 1e6:.1f}M parameters)"


def load_checkpoint(path: str | os.PathLike[str], *, device: Any, dtype: Any) -> tuple[Any, Any, str]:
    """The vision tower (on ``device`` in ``dtype``, eval mode), the image processor and a description of the
    local Hugging Face checkpoint directory ``path`` (no download: ``local_files_only``), checked first
    (:func:`inspect_checkpoint`)."""
    checkpoint = inspect_checkpoint(path)
    tower, description = load_tower(checkpoint, device=device, dtype=dtype)
    return tower, checkpoint.processor, description


def build_model(
    name: str, tower: Any, processor: Any, description: str, *, budgets: Sequence[int] | None = None,
    eager: bool = False, front_options: Mapping[str, Any] | None = None,
) -> ServedModel:
    """Wrap ``tower`` (its adapter from :func:`encgraph.models.wrap`), capture its graphs (or, on the CPU,
    allocate its static buffers) and put a batching front over the runner.

    ``eager=True`` serves the tower's own forward instead, one request at a time (a benchmark baseline)."""
    import torch

    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.models.registry import wrap
    from encgraph.serving.eager import EagerTower
    from encgraph.serving.front import BatchingFront

    adapter = wrap(tower)
    if len(adapter.config.paths) != 1:
        raise UnsupportedModelError(
            f"model {name!r}: the server serves one-path towers; {type(adapter).__name__} has paths "
            f"{list(adapter.config.path_names)}."
        )
    options = dict(front_options or {})
    if eager:
        adapter.unwrap()  # the tower's own attention and layout; the adapter still parses and describes inputs
        target: Any = EagerTower(tower, adapter)
        options["max_requests"] = 1  # the tower's forward takes one request at a time
    else:
        target = EncoderGraphRunner(adapter, budgets=budgets)
        options["capture"] = True
    engine = "hf-eager" if eager else target.mode.value
    param = next(tower.parameters())
    finish = functools.partial(_finish_call, _per_item_tokens(adapter), PinnedBuffers())
    front = BatchingFront(target, name=f"encgraph-front-{name}", finish_call=finish, **options)
    dtype = param.dtype if isinstance(param.dtype, torch.dtype) else None
    return ServedModel(name, description, processor, adapter, front, param.device, dtype, eager, engine)
