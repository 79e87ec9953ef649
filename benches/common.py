"""Shared parts of the benchmark scripts: options, timing, towers at real geometry, inputs, systems, results.

Every script builds its towers from transformers configs with random weights (bf16 on the GPU), measures the
systems side by side in one process, prints a table last and writes ``benches/results/<script>_<gpu>.json``
(and a ``.md`` table beside it), flushed after every measurement so that a run cut short keeps what it measured.

Systems (:class:`System`), all under ``torch.inference_mode()``:

- ``hf_sdpa``: the Hugging Face tower's own forward with ``attn_implementation="sdpa"`` (a separate copy of the
  tower that encgraph never touches);
- ``hf_varlen``: the same forward on the wrapped copy, switched to encgraph's packed varlen attention
  (``encgraph.models.attention.use_packed_attention``); packed (Qwen-VL) towers only;
- ``adapter_eager``: ``EncoderGraphRunner(adapter, mode=RunMode.EAGER)``: the adapter's eager forward per planned
  batch, the baseline graphs must beat;
- ``graph``: ``EncoderGraphRunner(adapter, mode=RunMode.GRAPH)`` after ``capture()`` (``STATIC`` on the CPU);
- ``compile``: the same runner plan and buffers in ``STATIC`` mode, with the adapter's static-shape forward passed
  through ``torch.compile(mode="reduce-overhead", dynamic=False)`` (CUDA only; one compile per budget, counted);
- ``graph_compile``: ``EncoderGraphRunner(adapter, compile=True)``: encgraph's graphs of the compiled (fused)
  static forward, captured only at the budgets the measured cases use (``TowerBench.compile_budgets``: each
  budget compiles for tens of seconds).

``--cpu-smoke`` (alias ``--dry-run``) runs each script's whole code path on tiny towers on the CPU in fp32 (the
graph system then runs the runner's STATIC mode), with 2 timed runs, writing ``<script>_cpu-smoke.json``: it
proves a script runs before it reaches a GPU. Nothing here imports torch at module level, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import enum
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from encgraph.cli.geometry import smart_resize

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benches" / "results"
SMOKE_SLUG = "cpu-smoke"

SMOKE_RUNS = 2
SMOKE_WARMUP = 1
FLOOR_MATMUL_N = 8192
SMOKE_MATMUL_N = 256


# ---------------------------------------------------------------------------------------------------- options
class System(enum.Enum):
    """A way to run a tower's forward, compared side by side."""

    HF_SDPA = "hf_sdpa"
    HF_VARLEN = "hf_varlen"
    ADAPTER_EAGER = "adapter_eager"
    GRAPH = "graph"
    COMPILE = "compile"
    GRAPH_COMPILE = "graph_compile"

    @property
    def label(self) -> str:
        return _SYSTEM_LABELS[self]


_SYSTEM_LABELS = {
    System.HF_SDPA: "HF eager (sdpa)",
    System.HF_VARLEN: "HF eager (encgraph varlen)",
    System.ADAPTER_EAGER: "adapter eager",
    System.GRAPH: "encgraph graphs",
    System.COMPILE: "torch.compile reduce-overhead",
    System.GRAPH_COMPILE: "encgraph graphs of compiled forward",
}
COMPILED = (System.COMPILE, System.GRAPH_COMPILE)
"""Systems that compile (tens of seconds per budget): measured last, on chosen cases only."""


def parse_systems(text: str) -> tuple[System, ...]:
    """``"graph,adapter_eager"`` -> systems, in that order (argparse ``type``)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = {s.value: s for s in System}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {sorted(known)}, got {text!r}")
    return tuple(known[n] for n in names)


def parse_names(choices: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type`` for a comma list of names out of ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {list(allowed)}, got {text!r}")
        return names

    return parse


def _tag(text: str) -> str:
    if not text or not all(c.isalnum() or c == "-" for c in text):
        raise argparse.ArgumentTypeError(f"expected letters, digits and '-', got {text!r}")
    return text


def base_parser(script: str, description: str, *, time_budget: float) -> argparse.ArgumentParser:
    """The options every script shares; each adds its own."""
    parser = argparse.ArgumentParser(
        prog=f"benches/{script}.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
        help="run the whole code path on tiny CPU towers (fp32, runner STATIC mode, 2 timed runs) in seconds",
    )
    parser.add_argument(
        "--time-budget", type=float, default=time_budget, metavar="S",
        help=f"seconds; no new measurement starts past it, and what is skipped is recorded (default {time_budget:g})",
    )
    parser.add_argument("--runs", type=int, default=30, help="timed runs per measurement (median reported; default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each measurement (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, pixels and traces (default 0)")
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR, help=f"where JSON and tables go (default {RESULTS_DIR})"
    )
    parser.add_argument(
        "--tag", type=_tag, default=None,
        help="appended to the result file names (<script>_<gpu>_<tag>.json), so that a partial or special run "
             "does not overwrite the main one",
    )
    parser.add_argument(
        "--mirror-dir", type=Path, default=None,
        help="a second directory that gets a copy of every result file (default: $OUT/results when $OUT is set)",
    )
    return parser


SMOKE_TOWERS = ("qwen2_5_vl_7b", "siglip_so400m_224")
"""The CPU smoke's default towers: one packed and one fixed-resolution family (every code path, in seconds)."""
SMOKE_CASES = ("1x224", "video4x112")


def smoke_defaults(args: argparse.Namespace, *, towers: tuple[str, ...], cases: tuple[str, ...] | None = None) -> None:
    """Resolve ``--towers`` (and ``--cases``) left unset: everything on a GPU, the smoke's subset on the CPU."""
    if getattr(args, "towers", None) is None:
        args.towers = SMOKE_TOWERS if args.cpu_smoke else towers
    if cases is not None and getattr(args, "cases", None) is None:
        args.cases = SMOKE_CASES if args.cpu_smoke else cases


@attrs.frozen
class Env:
    """Where and how a script measures: device, dtype, tiny towers or real geometry, runs per measurement."""

    device: Any  # torch.device
    dtype: Any  # torch.dtype
    tiny: bool
    runs: int
    warmup: int
    seed: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def make_env(args: argparse.Namespace) -> Env:
    """The :class:`Env` of parsed options: the CUDA device in bf16, or the CPU in fp32 with tiny towers."""
    import torch

    if args.runs < 1 or args.warmup < 0:
        raise SystemExit(f"--runs must be >= 1 and --warmup >= 0, got {args.runs} and {args.warmup}")
    if args.cpu_smoke:
        return Env(torch.device("cpu"), torch.float32, True, min(args.runs, SMOKE_RUNS),
                   min(args.warmup, SMOKE_WARMUP), args.seed)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --cpu-smoke to check the script on the CPU")
    return Env(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, False, args.runs, args.warmup,
               args.seed)


class Deadline:
    """The script's time budget: measurements check ``left()`` before they start (never in the middle)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def expired(self, need: float = 0.0) -> bool:
        return self.left() < need


SKIPPED_TIME = "skipped: time budget spent"


# ---------------------------------------------------------------------------------------------------- timing
@attrs.frozen
class Timing:
    """Samples of one measurement, in milliseconds."""

    samples_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples_ms))

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_ms), q))

    def summary(self) -> dict[str, Any]:
        s = self.samples_ms
        return {
            "median_ms": round(self.median, 4),
            "mean_ms": round(float(np.mean(s)), 4),
            "p10_ms": round(self.percentile(10), 4),
            "p90_ms": round(self.percentile(90), 4),
            "min_ms": round(min(s), 4),
            "runs": len(s),
        }


def time_once(fn: Callable[[], Any], env: Env) -> float:
    """Milliseconds of one call of ``fn``, from before its first host step to the end of its device work.

    On CUDA: events recorded around the call (the device is synchronized first, so the start event fires when
    the host starts, and host gaps inside the call count); on the CPU: wall time.
    """
    import torch

    if env.cuda:
        torch.cuda.synchronize(env.device)
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_call(fn: Callable[[], Any], env: Env, *, runs: int | None = None, warmup: int | None = None) -> Timing:
    """``warmup`` untimed calls, then ``runs`` timed calls, each synchronized (latency, not throughput)."""
    for _ in range(env.warmup if warmup is None else warmup):
        fn()
    return Timing(tuple(time_once(fn, env) for _ in range(env.runs if runs is None else runs)))


def matmul_rate(env: Env, n: int | None = None) -> dict[str, Any]:
    """The measured dense matmul rate: median time of an ``n x n x n`` matmul on random data in ``env.dtype``
    (8192 on a GPU, 256 in the CPU smoke), as TFLOP/s (``2 n^3`` flops per matmul)."""
    import torch

    n = (SMOKE_MATMUL_N if env.tiny else FLOOR_MATMUL_N) if n is None else n
    gen = torch.Generator(device=env.device).manual_seed(env.seed)
    a = torch.randn(n, n, device=env.device, dtype=env.dtype, generator=gen)
    b = torch.randn(n, n, device=env.device, dtype=env.dtype, generator=gen)
    out = torch.empty(n, n, device=env.device, dtype=env.dtype)
    timing = time_call(lambda: torch.matmul(a, b, out=out), env)
    tflops = 2 * n**3 / (timing.median * 1e-3) / 1e12
    return {"n": n, "dtype": str(env.dtype).replace("torch.", ""), "tflops": round(tflops, 3), **timing.summary()}


def floor_ms(params: int, tokens: int, tflops: float) -> float:
    """The matmul floor: ``2 x params x tokens`` flops at the measured matmul rate, in milliseconds."""
    return 2.0 * params * tokens / (tflops * 1e12) * 1e3


# ---------------------------------------------------------------------------------------------------- towers
class TowerKind(enum.Enum):
    """How a tower takes its inputs."""

    PACKED = "packed"
    """Qwen-VL: ``(pixel rows (patches, C*T*P*P), grid_thw (items, 3))``, any image size, videos."""
    FIXED = "fixed"
    """SigLIP, InternViT: ``pixel_values (tiles, C, S, S)`` at the tower's one resolution."""


@attrs.frozen
class TowerSpec:
    """A vision tower at real geometry (``full``: config kwargs) and the overrides that make it tiny for the CPU
    smoke (``tiny``)."""

    name: str
    label: str
    kind: TowerKind
    model: str  # "module:Class"
    config: str  # "module:Class"
    full: Mapping[str, Any]
    tiny: Mapping[str, Any]

    def config_class(self) -> Any:
        return _load(self.config)

    def model_class(self) -> Any:
        return _load(self.model)

    def make_config(self, tiny: bool) -> Any:
        """The config at real geometry, or with ``tiny``'s overrides on top."""
        return self.config_class()(**{**self.full, **(self.tiny if tiny else {})})


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


_Q25 = "transformers.models.qwen2_5_vl"
_Q3 = "transformers.models.qwen3_vl"
_SIGLIP_CONFIG = "transformers:SiglipVisionConfig"
_SIGLIP_MODEL = "transformers:SiglipVisionModel"
_SIGLIP_FULL = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    patch_size=14)
_TINY_PACKED = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48)
_TINY_FIXED = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)

TOWERS: dict[str, TowerSpec] = {
    spec.name: spec
    for spec in (
        TowerSpec(
            "qwen2_5_vl_7b", "Qwen2.5-VL-7B tower", TowerKind.PACKED,
            f"{_Q25}.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
            f"{_Q25}.configuration_qwen2_5_vl:Qwen2_5_VLVisionConfig",
            full=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
            tiny=dict(_TINY_PACKED, depth=2, window_size=56, fullatt_block_indexes=[1]),
        ),
        TowerSpec(
            "qwen3_vl_8b", "Qwen3-VL-8B tower", TowerKind.PACKED,
            f"{_Q3}.modeling_qwen3_vl:Qwen3VLVisionModel",
            f"{_Q3}.configuration_qwen3_vl:Qwen3VLVisionConfig",
            full=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
            tiny=dict(_TINY_PACKED, depth=3, num_position_embeddings=64, deepstack_visual_indexes=[1]),
        ),
        TowerSpec(
            "siglip_so400m_224", "SigLIP-so400m 224 px", TowerKind.FIXED, _SIGLIP_MODEL, _SIGLIP_CONFIG,
            full=dict(_SIGLIP_FULL, image_size=224), tiny=dict(_TINY_FIXED, image_size=28),
        ),
        TowerSpec(
            "siglip_so400m_384", "SigLIP-so400m 384 px", TowerKind.FIXED, _SIGLIP_MODEL, _SIGLIP_CONFIG,
            full=dict(_SIGLIP_FULL, image_size=384), tiny=dict(_TINY_FIXED, image_size=42),
        ),
        TowerSpec(
            "internvit_300m", "InternViT-300M 448 px", TowerKind.FIXED,
            "transformers.models.internvl.modeling_internvl:InternVLVisionModel",
            "transformers.models.internvl.configuration_internvl:InternVLVisionConfig",
            full=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      patch_size=[14, 14], image_size=[448, 448], attention_bias=True, use_qk_norm=False,
                      hidden_act="gelu", layer_scale_init_value=0.1, norm_type="layer_norm", use_mean_pooling=True),
            tiny=dict(_TINY_FIXED, image_size=[56, 56]),
        ),
    )
}


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


@attrs.frozen
class Geometry:
    """What input sizes a tower takes: patch side, merge factor, temporal patch, fixed image side (or None)."""

    kind: TowerKind
    patch: int
    merge: int
    temporal_patch: int
    image_size: int | None
    channels: int

    @classmethod
    def of(cls, kind: TowerKind, config: Any) -> Geometry:
        if kind is TowerKind.PACKED:
            return cls(kind, int(config.patch_size), int(config.spatial_merge_size), int(config.temporal_patch_size),
                       None, int(config.in_channels))
        return cls(kind, _first(config.patch_size), 1, 1, _first(config.image_size), int(config.num_channels))

    @property
    def factor(self) -> int:
        """Image sides are rounded to multiples of this (patch x merge)."""
        return self.patch * self.merge

    @property
    def row_size(self) -> int:
        """Values per pixel row of a packed tower (``C * T * P * P``)."""
        return self.channels * self.temporal_patch * self.patch * self.patch


def build_tower(spec: TowerSpec, env: Env, *, seed_offset: int = 0) -> Any:
    """The tower with random weights (the transformers init, seeded), in ``env.dtype`` on ``env.device``,
    ``attn_implementation="sdpa"``, in eval mode. Built on the device directly (no CPU copy of the weights)."""
    import torch

    torch.manual_seed(env.seed + seed_offset)
    with torch.device(env.device):
        model = spec.model_class()._from_config(spec.make_config(env.tiny), attn_implementation="sdpa",
                                                dtype=env.dtype)
    param = next(model.parameters())
    if param.device != env.device or param.dtype != env.dtype:  # an older transformers ignored the device context
        model = model.to(device=env.device, dtype=env.dtype)
    return model.eval().requires_grad_(False)


def count_params(spec: TowerSpec, tiny: bool = False) -> int:
    """The tower's parameter count, built on the ``meta`` device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        model = spec.model_class()._from_config(spec.make_config(tiny))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- inputs
@attrs.frozen
class Visual:
    """One image or video as a user sends it: ``frames == 1`` is an image; ``kind`` names its category."""

    height: int
    width: int
    frames: int = 1
    kind: str = "image"

    @property
    def is_video(self) -> bool:
        return self.frames > 1


@attrs.frozen
class Case:
    """A fixed benchmark case: a name and the visuals of one call."""

    name: str
    visuals: tuple[Visual, ...]


CASES: tuple[Case, ...] = (
    Case("1x224", (Visual(224, 224),)),
    Case("4x224", (Visual(224, 224),) * 4),
    Case("8x336", (Visual(336, 336),) * 8),
    Case("1x896", (Visual(896, 896),)),
    Case("video8", (Visual(252, 448, frames=8, kind="video"),)),
)
SMOKE_VIDEO = Case("video4x112", (Visual(112, 112, frames=4, kind="video"),))
"""A small video for the CPU smoke (the video path without the quadratic cost of masked attention on a CPU)."""
ALL_CASES = CASES + (SMOKE_VIDEO,)
CASE_NAMES = tuple(c.name for c in ALL_CASES)
DEFAULT_CASE_NAMES = tuple(c.name for c in CASES)

MIN_TOKENS = 4
"""Fewest merged tokens per frame a packed tower is given (Qwen's processors: 56 x 56 px at factor 28)."""
MAX_TILES = 12
"""Most tiles a fixed-resolution tower cuts one image into (InternVL's ``max_dynamic_patch``), thumbnail aside."""


def packed_grid(visual: Visual, geom: Geometry, max_tokens: float = math.inf) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches for a packed tower: the frame resized (``smart_resize``, at most ``max_tokens``
    merged tokens per temporal slice), ``t = ceil(frames / temporal_patch)`` for a video, 1 for an image."""
    f = geom.factor
    h, w = smart_resize(visual.height, visual.width, f, MIN_TOKENS * f * f, max_tokens * f * f)
    t = -(-visual.frames // geom.temporal_patch) if visual.is_video else 1
    return t, h // geom.patch, w // geom.patch


def fixed_tiles(visual: Visual, geom: Geometry) -> int:
    """Tiles a fixed-resolution tower sees: one per video frame; for an image one when it fits the tower's side,
    else ``min(ceil(h/S) * ceil(w/S), 12)`` tiles plus a thumbnail (InternVL's dynamic tiling)."""
    side = int(geom.image_size)  # type: ignore[arg-type]
    if visual.is_video:
        return visual.frames
    if max(visual.height, visual.width) <= side:
        return 1
    return min(-(-visual.height // side) * -(-visual.width // side), MAX_TILES) + 1


@attrs.frozen
class Sizes:
    """Token counts of one call on one tower: ``items`` (images/videos), ``patches`` (rows through the blocks),
    ``tokens`` (the tower's output tokens: merged patches, or tiles x patches per tile), ``grids``."""

    items: int
    patches: int
    tokens: int
    grids: tuple[tuple[int, int, int], ...] = ()
    tiles: int = 0


def sizes_of(visuals: Sequence[Visual], geom: Geometry, *, max_image_tokens: float = math.inf,
             max_frame_tokens: float = math.inf) -> Sizes:
    """The :class:`Sizes` of ``visuals`` on a tower of ``geom`` (caps in merged tokens per frame)."""
    if geom.kind is TowerKind.PACKED:
        grids = tuple(packed_grid(v, geom, max_frame_tokens if v.is_video else max_image_tokens) for v in visuals)
        patches = sum(t * h * w for t, h, w in grids)
        return Sizes(len(visuals), patches, patches // geom.merge**2, grids)
    tiles = sum(fixed_tiles(v, geom) for v in visuals)
    per_tile = (int(geom.image_size) // geom.patch) ** 2  # type: ignore[arg-type]
    return Sizes(len(visuals), tiles * per_tile, tiles * per_tile, tiles=tiles)


@attrs.frozen
class BenchInputs:
    """One call's tensors for every system: ``hf`` (args, kwargs) for the tower's own forward, ``adapter`` for the
    runners (``None`` without an adapter), and its :class:`Sizes`."""

    hf_args: tuple[Any, ...]
    hf_kwargs: Mapping[str, Any]
    adapter: Any
    sizes: Sizes


# ---------------------------------------------------------------------------------------------------- systems
def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:400]


class CompiledStatic:
    """An adapter whose static-shape forward runs through ``torch.compile(mode="reduce-overhead")``; every other
    method is the wrapped adapter's. Run by a runner in ``STATIC`` mode, it gets exactly the plan, buffers and
    padding of the graph runner, with torch's own CUDA graphs instead of encgraph's.

    Outputs are cloned: cudagraph trees overwrite them at the next replay.
    """

    def __init__(self, adapter: Any) -> None:
        import torch

        self.inner = adapter
        self._compiled = torch.compile(adapter.forward_static, mode="reduce-overhead", dynamic=False)

    @property
    def config(self) -> Any:
        return self.inner.config

    def item_specs(self, inputs: Any) -> Any:
        return self.inner.item_specs(inputs)

    def select(self, inputs: Any, indices: Sequence[int]) -> Any:
        return self.inner.select(inputs, indices)

    def buffer_specs(self, path: str, budget: int, max_items: int, max_frames: int) -> Any:
        return self.inner.buffer_specs(path, budget, max_items, max_frames)

    def replay_values(self, path: str, inputs: Any, budget: int) -> Any:
        return self.inner.replay_values(path, inputs, budget)

    def forward_static(self, path: str, buffers: Mapping[str, Any], budget: int) -> dict[str, Any]:
        import torch

        torch.compiler.cudagraph_mark_step_begin()
        return {name: t.clone() for name, t in self._compiled(path, dict(buffers), budget).items()}

    def forward_eager(self, path: str, inputs: Any) -> Any:
        return self.inner.forward_eager(path, inputs)

    def assemble(self, parts: Any) -> Any:
        return self.inner.assemble(parts)


def dynamo_counters() -> dict[str, int]:
    """Snapshot of torch._dynamo's counters: graphs compiled, frames, graph breaks, cudagraph skips."""
    from torch._dynamo.utils import counters

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


def counter_delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


class TowerBench:
    """One tower and everything a script runs it through.

    ``hf`` is the plain tower (sdpa, never wrapped); ``enc`` a deep copy with the same weights that the adapter
    wraps and that ``hf_varlen`` runs with encgraph's packed attention. Runners are made on first use. Where the
    adapter is missing (``encgraph.models.wrap`` raised) the adapter systems report ``unavailable``.
    """

    def __init__(self, spec: TowerSpec, env: Env, systems: Iterable[System]) -> None:
        self.spec = spec
        self.env = env
        self.systems = tuple(systems)
        t0 = time.perf_counter()
        tower = build_tower(spec, env)
        self.params = sum(p.numel() for p in tower.parameters())
        self.geom = Geometry.of(spec.kind, tower.config)
        wants_enc = any(s is not System.HF_SDPA for s in self.systems)
        self.hf = tower if System.HF_SDPA in self.systems else None
        self.enc = (copy.deepcopy(tower) if self.hf is not None else tower) if wants_enc else None
        del tower
        self.adapter: Any = None
        self.unavailable: dict[System, str] = {}
        self.attention_switch: Any = None
        if self.enc is not None:
            self._wrap()
        for system in COMPILED:
            if system in self.systems and not env.cuda:
                self.unavailable[system] = "skipped: needs CUDA (torch.compile into CUDA graphs)"
        self.build_seconds = time.perf_counter() - t0
        self._runners: dict[System, Any] = {}
        self.capture_info: dict[str, Any] | None = None
        self.graph_budgets: dict[str, tuple[int, ...]] | None = None
        """Ladders of the ``graph`` runner (default: the adapter's)."""
        self.compile_budgets: dict[str, tuple[int, ...]] | None = None
        """Ladders of the ``graph_compile`` runner (default: the ``graph`` runner's)."""
        self.compile_capture_info: dict[str, Any] | None = None

    def _wrap(self) -> None:
        try:
            from encgraph.models import wrap

            self.adapter = wrap(self.enc)
        except Exception as exc:  # the adapter of this family may not exist yet: measure the rest
            reason = f"unavailable: no adapter ({short_error(exc)})"
            for s in (System.ADAPTER_EAGER, System.GRAPH, *COMPILED):
                self.unavailable[s] = reason
        if self.spec.kind is TowerKind.FIXED:
            self.unavailable[System.HF_VARLEN] = "n/a: a fixed-size tower has no packed sequences"
        elif System.HF_VARLEN in self.systems:
            try:
                from encgraph.models.attention import use_packed_attention

                self.attention_switch = use_packed_attention(self.enc)
            except Exception as exc:
                self.unavailable[System.HF_VARLEN] = f"unavailable: {short_error(exc)}"

    # -- inputs
    def inputs(self, visuals: Sequence[Visual], *, max_image_tokens: float = math.inf,
               max_frame_tokens: float = math.inf, seed: int = 0) -> BenchInputs:
        """Random pixels (standard normal, seeded) for ``visuals`` in the layout of this tower."""
        import torch

        env, geom = self.env, self.geom
        sizes = sizes_of(visuals, geom, max_image_tokens=max_image_tokens, max_frame_tokens=max_frame_tokens)
        gen = torch.Generator(device=env.device).manual_seed(env.seed * 1_000_003 + seed)
        if geom.kind is TowerKind.PACKED:
            pixels = torch.randn(sizes.patches, geom.row_size, device=env.device, dtype=env.dtype, generator=gen)
            grid_host = torch.tensor(sizes.grids, dtype=torch.int64)
            # HF's own callers move grid_thw to the device with the pixels; the adapter takes the host copy
            # (its planning reads the grid, and a host grid spares a device sync).
            grid_dev = grid_host.to(env.device)
            hf_args, hf_kwargs = (pixels,), {"grid_thw": grid_dev}
            adapter = None if self.adapter is None else self.adapter.inputs_from_call(pixels, grid_thw=grid_host)
        else:
            side = int(geom.image_size)  # type: ignore[arg-type]
            pixels = torch.randn(sizes.tiles, geom.channels, side, side, device=env.device, dtype=env.dtype,
                                 generator=gen)
            hf_args, hf_kwargs = (), {"pixel_values": pixels}
            adapter = None if self.adapter is None else self.adapter.inputs_from_call(pixel_values=pixels)
        return BenchInputs(hf_args, hf_kwargs, adapter, sizes)

    # -- runners
    def runner(self, system: System) -> Any:
        """The runner of an adapter system (made on first use; the graph runner is captured then)."""
        if system in self._runners:
            return self._runners[system]
        from encgraph.capture import EncoderGraphRunner, RunMode

        if system is System.ADAPTER_EAGER:
            runner = EncoderGraphRunner(self.adapter, mode=RunMode.EAGER, progress=False)
        elif system is System.GRAPH:
            mode = RunMode.GRAPH if self.env.cuda else RunMode.STATIC
            runner = EncoderGraphRunner(self.adapter, mode=mode, budgets=self.graph_budgets, progress=False)
            self.capture_info = _json_ready(runner.capture())
        elif system is System.COMPILE:
            ref = self.reference_runner()
            runner = EncoderGraphRunner(CompiledStatic(self.adapter), budgets=ref.ladders,
                                        max_items=ref.limits.max_items, max_frames=ref.limits.max_frames,
                                        mode=RunMode.STATIC, progress=False)
            runner.capture()
        elif system is System.GRAPH_COMPILE:
            ref = self.reference_runner()
            # Limits follow from the ladders as for the graph runner (a subset of its ladder keeps its smallest
            # budgets' item cap).
            runner = EncoderGraphRunner(self.adapter, budgets=self.compile_budgets or ref.ladders, compile=True,
                                        progress=False)
            self.compile_capture_info = _json_ready(runner.capture())
        else:
            raise ValueError(f"runner: {system} is not an adapter system")
        self._runners[system] = runner
        return runner

    def reference_runner(self) -> Any:
        """A runner with the graph runner's ladders and limits (they depend on the adapter, not on the mode),
        never captured: what the compiled systems plan with."""
        if System.GRAPH in self._runners:
            return self._runners[System.GRAPH]
        from encgraph.capture import EncoderGraphRunner, RunMode

        return EncoderGraphRunner(self.adapter, mode=RunMode.STATIC, progress=False)

    def call(self, system: System, inputs: BenchInputs) -> Callable[[], Any]:
        """A no-argument callable running ``inputs`` through ``system`` (raises if the system is unavailable)."""
        if system in self.unavailable:
            raise RuntimeError(self.unavailable[system])
        if system is System.HF_SDPA:
            tower = self.hf
            return lambda: tower(*inputs.hf_args, **inputs.hf_kwargs)
        if system is System.HF_VARLEN:
            tower = self.enc
            return lambda: tower(*inputs.hf_args, **inputs.hf_kwargs)
        runner = self.runner(system)
        return lambda: runner(inputs.adapter)

    def plan_summary(self, inputs: BenchInputs) -> list[dict[str, Any]]:
        """The graph runner's plan for ``inputs``: per batch its items and budget per path (None: eager)."""
        plan = self.reference_runner().plan(inputs.adapter)
        return [{"items": len(b.items), "budgets": dict(b.budgets)} for b in plan.batches]

    def plan_budgets(self, inputs: Iterable[BenchInputs]) -> dict[str, tuple[int, ...]]:
        """Per path, the budgets the graph runner's plans of ``inputs`` replay (what ``compile_budgets`` needs)."""
        used: dict[str, set[int]] = {}
        for batch in (b for i in inputs for b in self.plan_summary(i)):
            for path, budget in batch["budgets"].items():
                used.setdefault(path, set())
                if budget:
                    used[path].add(int(budget))
        return {path: tuple(sorted(b)) for path, b in used.items() if b}

    def close(self) -> None:
        """Drop towers, runners and graphs, and return their memory to the device."""
        self._runners.clear()
        self.adapter = self.hf = self.enc = None
        free_memory()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def flatten_tensors(value: Any) -> list[Any]:
    """Every tensor in a result (tensor, mapping, ModelOutput, tuple or list), in a stable order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for k in sorted(value) for t in flatten_tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten_tensors(v)]
    return []


def max_rel_diff(results: Sequence[Any], reference: Sequence[Any]) -> float:
    """``max |a - b| / max |b|`` over every tensor of every item (fp32); ``inf`` when the layouts differ."""
    worst = 0.0
    if len(results) != len(reference):
        return math.inf
    for a_item, b_item in zip(results, reference):
        a_list, b_list = flatten_tensors(a_item), flatten_tensors(b_item)
        if len(a_list) != len(b_list):
            return math.inf
        for a, b in zip(a_list, b_list):
            if a.shape != b.shape:
                return math.inf
            b32 = b.float()
            scale = float(b32.abs().max()) if b32.numel() else 0.0
            diff = float((a.float() - b32).abs().max()) if b32.numel() else 0.0
            worst = max(worst, diff / scale if scale else diff)
    return worst


def measure(fn: Callable[[], Any], env: Env, **kw: Any) -> dict[str, Any]:
    """:func:`time_call` with failures caught: a summary, or ``{"error": ...}`` (the traceback goes to stderr)."""
    try:
        return time_call(fn, env, **kw).summary()
    except Exception as exc:
        traceback.print_exc()
        free_memory()
        return {"error": short_error(exc)}


# ---------------------------------------------------------------------------------------------------- results
def gpu_name(env: Env) -> str:
    import torch

    return torch.cuda.get_device_name(env.device) if env.cuda else f"CPU ({platform.processor() or platform.machine()})"


def gpu_slug(env: Env) -> str:
    """File-name part naming the machine: ``nvidia-h200``; ``cpu-smoke`` in the CPU smoke."""
    if env.tiny:
        return SMOKE_SLUG
    return "-".join("".join(c if c.isalnum() else " " for c in gpu_name(env).lower()).split())


def environment(env: Env) -> dict[str, Any]:
    """Versions, device and commit, stored with every result."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=5, check=False).stdout.strip() or None
    return {
        "gpu": gpu_name(env),
        "device": str(env.device),
        "dtype": str(env.dtype).replace("torch.", ""),
        "tiny_towers": env.tiny,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": tf_version,
        "python": platform.python_version(),
        "commit": commit,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": sys.argv[1:],
    }


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class Results:
    """The result files of one script run: ``<script>_<slug>.json`` and ``.md`` in ``--results-dir`` (and the
    mirror directory). ``data`` is the JSON document; ``flush()`` rewrites it (atomically) after each
    measurement."""

    def __init__(self, script: str, args: argparse.Namespace, env: Env) -> None:
        self.script = script
        self.slug = gpu_slug(env) + (f"_{args.tag}" if getattr(args, "tag", None) else "")
        mirror = args.mirror_dir
        if mirror is None and os.environ.get("OUT") and not env.tiny:
            mirror = Path(os.environ["OUT"]) / "results"
        self.dirs = [Path(args.results_dir)] + ([Path(mirror)] if mirror is not None else [])
        self.data: dict[str, Any] = {
            "script": script,
            "environment": environment(env),
            "options": {k: _json_ready(v) for k, v in vars(args).items() if k not in ("results_dir", "mirror_dir")},
        }

    @property
    def json_path(self) -> Path:
        return self.dirs[0] / f"{self.script}_{self.slug}.json"

    def _write(self, suffix: str, text: str) -> None:
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{self.script}_{self.slug}{suffix}"
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    def flush(self) -> None:
        self._write(".json", json.dumps(_json_ready(self.data), indent=1) + "\n")

    def finish(self, table: str) -> None:
        """Write the JSON and the markdown table, and print the table last."""
        self.flush()
        self._write(".md", table + "\n")
        print(table)
        print(f"\nresults: {self.json_path}")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats with up to 3 significant decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"
    return str(value)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def median_of(entry: Mapping[str, Any] | None) -> float | None:
    """The median of a measurement entry, ``None`` if it was skipped or failed."""
    return None if not entry or "median_ms" not in entry else float(entry["median_ms"])


def status_of(entry: Mapping[str, Any] | None) -> str:
    """A table cell for a measurement that has no median: its skip or error reason, shortened."""
    if not entry:
        return "-"
    if "error" in entry:
        return "error"
    return str(entry.get("skipped") or "-").split(":")[0]


def run_script(script: str, args: argparse.Namespace,
               body: Callable[[argparse.Namespace, Env, Deadline, Results], None],
               render: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """The skeleton of a script's ``main``: the :class:`Env` and :class:`Deadline` of ``args``, ``body`` filling a
    :class:`Results` under inference mode, then the table printed last; returns the JSON document."""
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    results = Results(script, args, env)
    with inference():
        body(args, env, deadline, results)
    results.finish(render(results.data))
    return results.data


@contextlib.contextmanager
def inference() -> Iterator[None]:
    import torch

    with torch.inference_mode():
        yield


def log(message: str) -> None:
    """Progress to stderr (stdout keeps the table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
