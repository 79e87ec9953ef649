"""Image preprocessing on the tower's device (``encgraph serve --preprocess-on device``, issue 57).

By default a request's images are resized, rescaled, normalised and (Qwen-VL) cut into patch rows on the host,
by the model's transformers image processor, in the server's threads or in preprocessing worker processes; the
float32 result is copied to the device. With :class:`DeviceProcessing` the host only decodes: each image crosses
to the device as its 8-bit RGB pixels, and transformers' torchvision image processor (the "fast" one, which takes
``device=``) does the rest there, with the same torch ops as on the host. The two halves:

- host (:meth:`DeviceProcessing.__call__`, where the processor ran before: a request thread or a worker): decoded
  RGB images -> ``pixel_values``: one flat ``uint8`` array of every image's ``H x W x 3`` bytes, and
  ``decoded_sizes`` ``(images, 2)`` int64. Named as the processor's outputs are, so that the worker pool, its
  shared-memory slots and :func:`~encgraph.serving.loading.process_images` carry them unchanged;
- device (:meth:`DeviceProcessing.on_device`, a request thread, inside ``ServedModel.prepare``'s side-stream
  block): the bytes uploaded on the thread's side stream (:mod:`encgraph.serving.transfer`), each image viewed as
  ``(3, H, W)``, the processor and then the adapter's input step run on them on that stream; an event recorded
  after them travels with the request (``BatchingFront.submit_after``), and the front's worker makes its stream
  wait for it right before the call that runs that request. The thread does not wait, and no replay waits for
  another request's preprocessing.

How exactly the torchvision processor matches the Pillow one (what the models were trained with), and its speed on
a CPU: ``benches/results/preprocess_exactness_cpu.md``. Behind the server on an H100 (2026-12-06, 32 clients), with
each request thread waiting for its own side stream, the device path was slower than the host path (SigLIP-so400m
288 against 366 images/s); with the default stream made to wait for the side stream from the request thread it
was even for SigLIP (400 against 406) and slower for Qwen2.5-VL-7B (215 against 340; docs/benchmarks.md). Whether
the per-request event makes it faster is for ``benches/serving.py`` on a GPU to say; until then the host path is
the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from encgraph._validate import describe
from encgraph.errors import ConfigError

__all__ = ["DeviceProcessing", "device_processing"]


def device_processing(processor: Any) -> DeviceProcessing:
    """``processor`` (a transformers image processor) run on the tower's device: a :class:`DeviceProcessing`.

    Raises:
        ConfigError: ``processor`` is a Pillow processor (``...ImageProcessorPil``: torchvision is not installed,
            or the processor was built as that class): it has no device to run on.
    """
    name = type(processor).__name__
    if not any(k.__name__ == "TorchvisionBackend" for k in type(processor).__mro__):
        raise ConfigError(
            f"preprocess on device: expected transformers' torchvision image processor, got {name} (the Pillow one, "
            "chosen where torchvision is not installed); install torchvision matching your torch, or preprocess "
            "on the host (the default)."
        )
    return DeviceProcessing(processor)


class DeviceProcessing:
    """A transformers torchvision image processor split into a host half (decode only) and a device half.

    Pickles to preprocessing workers as the processor it wraps does. ``processor``: the wrapped processor
    (its configuration: sizes, mean and std, patching).
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __repr__(self) -> str:
        return f"DeviceProcessing({type(self.processor).__name__})"

    @property
    def label(self) -> str:
        """What ``/health`` names as the model's image processor."""
        return f"{type(self.processor).__name__} (on the device)"

    # -- host half: what process_images calls as it calls a processor
    def __call__(self, images: Sequence[Any], return_tensors: str = "pt") -> dict[str, Any]:
        """Decoded RGB images (``PIL.Image``) as ``pixel_values`` (every image's ``H x W x 3`` bytes, one flat
        ``uint8`` tensor) and ``decoded_sizes`` (``(images, 2)`` int64 ``(H, W)``)."""
        import torch

        if return_tensors != "pt":
            raise ConfigError(f"return_tensors: expected 'pt', got {describe(return_tensors)}.")
        arrays = [np.asarray(image.convert("RGB") if getattr(image, "mode", "RGB") != "RGB" else image, np.uint8)
                  for image in images]
        sizes = np.array([a.shape[:2] for a in arrays], dtype=np.int64).reshape(-1, 2)
        flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.uint8)
        return {"pixel_values": torch.from_numpy(flat), "decoded_sizes": torch.from_numpy(sizes)}

    # -- device half
    @property
    def batches(self) -> bool:
        """Whether the device half can run once over several requests' images and split the result back per
        request (:meth:`on_device_many`): the processor concatenates variable patch rows (Qwen-VL: ``merge_size``)
        or makes every image one fixed size (a resize to a height and width, or a center crop). Another
        processor's images may come out in several sizes, which one tensor cannot hold."""
        p = self.processor
        if getattr(p, "merge_size", None) is not None:
            return True
        size, crop = getattr(p, "size", None) or {}, getattr(p, "crop_size", None) or {}
        fixed = bool(getattr(p, "do_resize", False)) and bool(size.get("height") and size.get("width"))
        cropped = bool(getattr(p, "do_center_crop", False)) and bool(crop.get("height") and crop.get("width"))
        return fixed or cropped

    def on_device(self, arrays: Mapping[str, np.ndarray], device: Any, dtype: Any) -> dict[str, Any]:
        """The processor's outputs for the host half's ``arrays``, computed on ``device`` on the calling thread's
        current stream: ``pixel_values`` in ``dtype`` on ``device`` and (Qwen-VL) ``image_grid_thw`` as a CPU int64
        tensor. On CUDA it returns once the work is queued (the bytes are copied from pinned memory), so call it
        inside :func:`~encgraph.serving.transfer.side_stream_work` (``ServedModel.prepare`` does, with
        :attr:`~encgraph.serving.transfer.Handoff.EVENT`): not on the default stream, where it would queue behind
        the replays, and with the pixels handed over only once that stream's work is done."""
        return self.on_device_many([arrays], device, dtype)[0]

    def on_device_many(self, parts: Sequence[Mapping[str, np.ndarray]], device: Any, dtype: Any
                       ) -> list[dict[str, Any]]:
        """:meth:`on_device` for several requests' ``arrays`` at once: one upload of all their bytes (on CUDA, one
        pinned staging buffer), one processor call over all their images, and each request's outputs in order:
        its ``pixel_values`` rows (views of the call's tensor: its images, or its images' patch rows for Qwen-VL)
        and its ``image_grid_thw`` rows. Raises what the processor raises (for any of the images), and
        ``RuntimeError`` when the processor's output does not split into the requests' images (only a
        :attr:`batches` processor is checked to)."""
        import torch

        sizes = [np.asarray(a["decoded_sizes"], dtype=np.int64).reshape(-1, 2) for a in parts]
        images = [view for flat, hw in zip(_upload(parts, torch.device(device)), sizes)
                  for view in _views(flat, hw)]
        out = self.processor(images=images, return_tensors="pt", device=torch.device(device))
        pixels = out["pixel_values"].to(dtype)
        counts = [len(hw) for hw in sizes]
        grid = None
        if "image_grid_thw" in out:  # on the host already (made from Python ints): no wait for the stream
            grid = out["image_grid_thw"].to("cpu", torch.int64)
            rows = [int(n) for n in grid.prod(-1).tolist()]  # patch rows per image
            bounds = np.cumsum([0, *counts]).tolist()
            per_part = [sum(rows[a:b]) for a, b in zip(bounds, bounds[1:])]
        else:
            per_part = counts
        if len(grid if grid is not None else pixels) != sum(counts) or pixels.shape[0] != sum(per_part):
            raise RuntimeError(f"{type(self.processor).__name__} gave {pixels.shape[0]} pixel rows for {sum(counts)} "
                               f"images; expected {sum(per_part)}: its output cannot be split per request.")
        result = [{"pixel_values": p} for p in torch.split(pixels, per_part)]
        if grid is not None:
            for r, g in zip(result, torch.split(grid, counts)):
                r["image_grid_thw"] = g
        return result


def _upload(parts: Sequence[Mapping[str, np.ndarray]], device: Any) -> list[Any]:
    """Each part's flat ``uint8`` bytes on ``device``: on CUDA all of them in one copy from one pinned buffer
    (queued on the current stream; the host allocator keeps the buffer until the copy is done), elsewhere the
    parts' own memory."""
    import torch

    flats = [torch.from_numpy(np.asarray(a["pixel_values"]).reshape(-1)) for a in parts]
    if device.type != "cuda":
        return [flat.to(device) for flat in flats]
    staged = torch.empty(sum(f.numel() for f in flats), dtype=torch.uint8, pin_memory=True)
    torch.cat(flats, out=staged)
    return list(torch.split(staged.to(device, non_blocking=True), [f.numel() for f in flats]))


def _views(flat: Any, sizes: np.ndarray) -> list[Any]:
    """One request's images, ``(3, H, W)`` views of its flat ``H x W x 3`` bytes."""
    import torch

    counts = (sizes[:, 0] * sizes[:, 1] * 3).tolist()
    return [part.view(int(h), int(w), 3).permute(2, 0, 1) for part, (h, w) in zip(torch.split(flat, counts),
                                                                                 sizes.tolist())]
