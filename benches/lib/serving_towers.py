"""The towers of ``benches/serving.py`` (SigLIP-so400m at 384 px, the Qwen2.5-VL-7B tower; tiny twins for the CPU
smoke), its systems, and :class:`Bench`: one tower's HF instance, its captured runner and its request pools."""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import io
import time
from typing import Any

from benches.lib.towers import TOWERS as TOWER_SPECS

SYSTEMS = ("hf_eager", "defaults", "graphed_per_request", "graphed_nowait", "graphed_coalesce")
TRANSPORTS = ("inprocess", "server", "ray")
"""``inprocess``: the batching front in the bench's process; ``server``: ``encgraph serve`` over loopback HTTP;
``ray``: ``encgraph serve --ray --replicas 1`` (a Ray instance of its own, Ray Serve's proxy in front), what Ray
adds to one replica."""
DEFAULT_TRANSPORTS = ("inprocess", "server")


def front_options(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """A graphed system's options of the batching front, in-process as ``BatchingFront`` keywords and through the
    server as the same ``encgraph serve`` flags (``hf_eager``, the tower's own forward, has none)."""
    return {"defaults": {}, "graphed_per_request": {"max_requests": 1}, "graphed_nowait": {"max_wait_ms": 0.0},
            "graphed_coalesce": {"max_wait_ms": args.max_wait_ms}}.get(system, {})


_ROWS: dict[str, dict[str, Any]] = {
    # Each tower's image processor, the request sizes of its pool, and those of the CPU smoke's tiny twin; its
    # label, classes and configs come from ``benches.lib.towers``, the table every benchmark shares.
    "siglip_so400m_384": dict(processor="SiglipImageProcessor", sizes=[(384, 384)], tiny_sizes=[(42, 42)]),
    "qwen2_5_vl_7b": dict(processor="Qwen2VLImageProcessor",
                          sizes=[(224, 224), (336, 336), (448, 448), (448, 336), (640, 480), (512, 384)],
                          tiny_sizes=[(56, 56), (84, 56), (112, 84)]),
}
TOWERS: dict[str, dict[str, Any]] = {name: dict(row, spec=TOWER_SPECS[name], label=TOWER_SPECS[name].label)
                                     for name, row in _ROWS.items()}


class Bench:
    """One tower: an HF instance (its own forward), a wrapped twin with a captured runner (for the in-process
    transport only: ``capture`` is ``None`` without it), and request pools."""

    def __init__(self, name: str, args: argparse.Namespace, device: Any, dtype: Any) -> None:
        import numpy as np
        import torch

        import encgraph
        from encgraph.models.registry import wrap

        row = TOWERS[name]
        self.name, self.device, self.dtype = name, device, dtype
        self.processor_name = row["processor"]
        spec = row["spec"]
        torch.manual_seed(args.seed)
        with torch.device(device):
            self.hf = spec.model_class()._from_config(spec.make_config(args.cpu_smoke)).to(dtype).eval()
        self.capture: dict[str, Any] | None = None
        if "inprocess" in args.transports:  # through the server, each server captures its own
            self.graph_tower = copy.deepcopy(self.hf)  # before wrapping: a wrapped tower must not be copied
            self.adapter = wrap(self.graph_tower)
            options = {} if args.compile == "default" else {"compile": False}
            self.runner = encgraph.EncoderGraphRunner(self.adapter, **options)  # the defaults unless --compile off
            t0 = time.perf_counter()
            self.capture = dict(self.runner.capture(), wall_seconds=round(time.perf_counter() - t0, 2))
        self.sizes = row["tiny_sizes"] if args.cpu_smoke else row["sizes"]
        rng = np.random.default_rng(args.seed)
        self.pool = [self.sizes[int(i)] for i in rng.integers(len(self.sizes), size=32)]
        self.processor = self._processor()
        self.requests = [self._tensors(w, h) for w, h in self.pool]

    def _processor(self) -> Any:
        # The class the server loads (the Pillow backend by its own name without torchvision, no fallback warning).
        from encgraph.serving.loading import _processor_class

        cls = _processor_class(self.processor_name)
        if self.processor_name.startswith("Siglip"):
            side = self.hf.config.image_size
            return cls(size={"height": side, "width": side})
        largest = max(w * h for w, h in self.sizes)
        return cls(size={"shortest_edge": 56 * 56, "longest_edge": max(largest, 56 * 56)})

    def _tensors(self, width: int, height: int) -> tuple[Any, ...]:
        """A preprocessed request of one image: ``(pixel_values,)`` or ``(pixel_rows, grid_thw)``."""
        images = [_noise_image(width, height, seed=width * 7 + height)]
        out = self.processor(images=images, return_tensors="pt")
        pixels = out["pixel_values"].to(self.device, self.dtype)
        if "image_grid_thw" in out:
            return pixels, out["image_grid_thw"].to(self.device)
        return (pixels,)

    def hf_forward(self, request: tuple[Any, ...]) -> Any:
        if len(request) == 2:
            return self.hf(request[0], grid_thw=request[1]).pooler_output
        return self.hf(pixel_values=request[0]).pooler_output

    @functools.cached_property
    def runner_inputs(self) -> list[Any]:
        """:meth:`inputs` of every request of the pool, made once for all the runs of the graphed systems."""
        return [self.inputs(r) for r in self.requests]

    def inputs(self, request: tuple[Any, ...]) -> Any:
        if len(request) == 2:
            return self.adapter.inputs(request[0], request[1])
        return self.adapter.inputs_from_call(pixel_values=request[0])

    def save(self, directory: str) -> None:
        """The HF tower and its processor as a checkpoint directory for ``encgraph serve --model``."""
        self.hf.save_pretrained(directory)
        self.processor.save_pretrained(directory)


def _noise_image(width: int, height: int, seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _jpeg(width: int, height: int, seed: int) -> str:
    buf = io.BytesIO()
    _noise_image(width, height, seed).save(buf, format="JPEG", quality=90)
    return base64.b64encode(buf.getvalue()).decode()
