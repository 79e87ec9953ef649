"""Serving throughput and latency: closed-loop clients against the batching front (in-process) and against
``encgraph serve`` (HTTP on loopback), SigLIP-so400m (384 px) and Qwen2.5-VL-7B towers at real geometry.

Systems, each at concurrency 1 / 8 / 32 / 128 (clients that send one request, wait for its answer, send the next):

- ``hf_eager``: the tower's own forward (Hugging Face's, sdpa attention), one request at a time
  (``encgraph serve --eager``);
- ``defaults``: ``encgraph serve`` (in-process: ``BatchingFront(runner)``) with no options: what a user starts;
- ``graphed_per_request``: graphs, each request its own runner call (``max_requests=1``);
- ``graphed_nowait``: graphs, coalescing only what is already queued (``max_wait_ms=0``);
- ``graphed_coalesce``: graphs, coalescing with ``max_wait_ms`` (default 2).

A request is one image (SigLIP: 384 x 384; Qwen: a seeded mix of 224-640 px photos). Per point: images/s over the
measured window (requests answered after the warm-up; none starts after the window, those in flight drain),
P50 / P99 / mean latency of the requests sent in the window (``benches.lib.load``), requests per runner call,
padded share. The points interleave the systems (``run_points``); ``--repeats N`` runs each point N times, in
rounds of one run per system, and pools the runs. In-process clients are threads calling
``front.submit(...).result()`` on preprocessed tensors and copying the embedding to the host (what a server does);
server clients are asyncio aiohttp tasks posting base64 JPEGs (so the server's decoding and preprocessing are in
the figures; ``--preprocess-workers`` is passed to every server, and recorded in the options). Target:
``graphed_coalesce`` >= 3x the images/s of ``hf_eager`` at concurrency 32 with a P99 no worse than
``graphed_per_request``.

Writes ``benches/results/serving_<gpu>[_<transport>].json`` and ``.md`` (+ ``_images_per_s.png`` with matplotlib;
the transport is in the name when one is run alone). Self-contained
(no ``benches.common``); ``--cpu-smoke`` runs the whole path on tiny CPU towers in seconds. The server transport
needs the ``[serve]`` and ``[bench]`` extras (FastAPI, uvicorn, prometheus_client, Pillow; httpx, aiohttp).
"""

from __future__ import annotations

import argparse
import base64
import copy
import importlib
import io
import json
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benches.lib.load import Run, closed_loop, http_closed_loop, summarize, window  # noqa: E402, F401
from benches.lib.results import child_env, git_commit, result_dirs  # noqa: E402
from encgraph.serving.metrics import STAGES  # noqa: E402

SCRIPT = "serving"
SYSTEMS = ("hf_eager", "defaults", "graphed_per_request", "graphed_nowait", "graphed_coalesce")
TRANSPORTS = ("inprocess", "server")
SMOKE_SLUG = "cpu-smoke"
_SIGLIP = ("transformers:SiglipVisionModel", "transformers:SiglipVisionConfig", "SiglipImageProcessor")
_QWEN = ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
         "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl:Qwen2_5_VLVisionConfig", "Qwen2VLImageProcessor")
TOWERS: dict[str, dict[str, Any]] = {
    "siglip_so400m_384": dict(
        label="SigLIP-so400m 384 px", refs=_SIGLIP, sizes=[(384, 384)],
        full=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  patch_size=14, image_size=384),
        tiny=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28),
    ),
    "qwen2_5_vl_7b": dict(
        label="Qwen2.5-VL-7B tower", refs=_QWEN,
        sizes=[(224, 224), (336, 336), (448, 448), (448, 336), (640, 480), (512, 384)],
        full=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
        tiny=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, window_size=56,
                  fullatt_block_indexes=[1]),
    ),
}
TINY_SIZES = {"siglip_so400m_384": [(28, 28)], "qwen2_5_vl_7b": [(56, 56), (84, 56), (112, 84)]}


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _csv(cast: Any, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        values = tuple(cast(v.strip()) for v in text.split(",") if v.strip())
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list{f' out of {choices}' if choices else ''}, got {text!r}")
        return values
    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--towers", type=_csv(str, tuple(TOWERS)), default=tuple(TOWERS))
    p.add_argument("--systems", type=_csv(str, SYSTEMS), default=SYSTEMS)
    p.add_argument("--transports", type=_csv(str, TRANSPORTS), default=TRANSPORTS)
    p.add_argument("--concurrency", type=_csv(int), default=(1, 8, 32, 128))
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point (default 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run (default 1)")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="runs per point, the systems interleaved; latencies pooled over the runs (default 1)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="graphed_coalesce's max_wait_ms (default 2)")
    p.add_argument("--compile", choices=("default", "off"), default="default",
                   help="default: the runner's own compile default (compile='auto': regional compile on CUDA); "
                        "off: compile=False, plain graphs")
    p.add_argument("--preprocess-workers", metavar="N|auto",
                   help="encgraph serve's --preprocess-workers for every server started (default: the server's own, "
                        "auto: worker processes when the tower is on a GPU)")
    p.add_argument("--time-budget", type=float, default=540.0, help="start no point past this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benches" / "results")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--cpu-smoke", "--dry-run", action="store_true",
                   help="tiny towers on the CPU, concurrency 1,4, 0.3 s points: the whole path in seconds")
    return p


# ---------------------------------------------------------------------------------------------------- towers
class Bench:
    """One tower: an HF instance (its own forward), a wrapped twin with a captured runner, and request pools."""

    def __init__(self, name: str, args: argparse.Namespace, device: Any, dtype: Any) -> None:
        import numpy as np
        import torch

        import encgraph
        from encgraph.models.registry import wrap

        spec = TOWERS[name]
        self.name, self.spec, self.device, self.dtype = name, spec, device, dtype
        model_ref, config_ref, self.processor_name = spec["refs"]
        config = _load(config_ref)(**{**spec["full"], **(spec["tiny"] if args.cpu_smoke else {})})
        torch.manual_seed(args.seed)
        with torch.device(device):
            self.hf = _load(model_ref)._from_config(config).to(dtype).eval()
        self.graph_tower = copy.deepcopy(self.hf)  # before wrapping: a wrapped tower must not be copied
        self.adapter = wrap(self.graph_tower)
        options = {} if args.compile == "default" else {"compile": False}
        self.runner = encgraph.EncoderGraphRunner(self.adapter, **options)  # the defaults unless --compile off
        t0 = time.perf_counter()
        self.capture = dict(self.runner.capture(), wall_seconds=round(time.perf_counter() - t0, 2))
        self.sizes = TINY_SIZES[name] if args.cpu_smoke else spec["sizes"]
        rng = np.random.default_rng(args.seed)
        self.pool = [self.sizes[int(i)] for i in rng.integers(len(self.sizes), size=32)]
        self.processor = self._processor()
        self.requests = [self._tensors(w, h) for w, h in self.pool]

    def _processor(self) -> Any:
        import transformers

        cls = getattr(transformers, self.processor_name)
        if self.processor_name.startswith("Siglip"):
            side = self.hf.config.image_size
            return cls(size={"height": side, "width": side})
        largest = max(w * h for w, h in self.sizes)
        return cls(size={"shortest_edge": 56 * 56, "longest_edge": max(largest, 56 * 56)})

    def _tensors(self, width: int, height: int) -> tuple[Any, ...]:
        """A preprocessed request of one image: ``(pixel_values,)`` or ``(pixel_rows, grid_thw)``."""
        import torch

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


# ---------------------------------------------------------------------------------------------------- points
def front_options(system: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"defaults": {}, "graphed_per_request": {"max_requests": 1}, "graphed_nowait": {"max_wait_ms": 0.0},
            "graphed_coalesce": {"max_wait_ms": args.max_wait_ms}}.get(system, {"max_requests": 1})


def run_inprocess(bench: Bench, system: str, concurrency: int,
                  args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    """One run of a point in this process, and the front's requests per call, padded share and replays."""
    import torch

    from encgraph.serving import BatchingFront

    if system == "hf_eager":
        front = BatchingFront(bench.hf_forward, max_queue=4096)
        submit = lambda k: front.submit(bench.requests[k % len(bench.requests)])  # noqa: E731
        host = lambda out: out.float().mean(0).cpu()  # noqa: E731
    else:
        front = BatchingFront(bench.runner, max_queue=4096, **front_options(system, args))
        inputs = [bench.inputs(r) for r in bench.requests]
        submit = lambda k: front.submit(inputs[k % len(inputs)])  # noqa: E731
        host = lambda out: out[0]["pooler_output"].float().mean(0).cpu()  # noqa: E731
    bench.runner.reset_stats()
    try:
        with torch.inference_mode():
            run = closed_loop(lambda k: host(submit(k).result()), concurrency, args.warmup, args.duration)
        summary = _front_summary(front.stats)
    finally:
        front.close()
    return run, summary


def _front_summary(stats: dict[str, Any]) -> dict[str, Any]:
    calls = sum(stats["requests_per_call"].values())
    out: dict[str, Any] = {"requests_per_call": round(stats["completed"] / calls, 2) if calls else None}
    runner = stats.get("runner") or {}
    if runner:
        p = runner["paths"]["default"]
        out.update(padded_share=round(p["padded_share"], 4), eager_items=runner["eager_items"],
                   replays={str(b): n for b, n in p["replays"].items()})
    return out


# ---------------------------------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(checkpoint: str, system: str, args: argparse.Namespace, device: str, dtype: str) -> tuple[Any, str, Any]:
    """Start ``encgraph serve`` for ``system`` (returns at once): the process, its URL and its log file."""
    port = _free_port()
    flags = {"hf_eager": ["--eager"], "defaults": [], "graphed_per_request": ["--max-requests", "1"],
             "graphed_nowait": ["--max-wait-ms", "0"], "graphed_coalesce": ["--max-wait-ms", str(args.max_wait_ms)]}
    cmd = [sys.executable, "-m", "encgraph", "serve", "--model", f"bench={checkpoint}", "--device", device,
           "--dtype", dtype, "--port", str(port), "--max-queue", "4096", *flags[system]]
    if args.preprocess_workers is not None:
        cmd += ["--preprocess-workers", args.preprocess_workers]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    return proc, f"http://127.0.0.1:{port}", log


def wait_server(proc: Any, url: str, log: Any, timeout: float = 600.0) -> None:
    """Wait until the server's ``/health`` answers; if it exits or does not answer in time, kill it and raise
    with the end of its log."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.25)
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"encgraph serve did not start: {log.read().decode(errors='replace')[-2000:]}")


def server_bodies(images: list[str]) -> list[bytes]:
    """One request body per image (base64 JPEG, base64 answers)."""
    return [json.dumps({"input": [image], "encoding_format": "base64"}).encode() for image in images]


def run_server(url: str, images: list[str], concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """One point of ``concurrency`` closed-loop HTTP clients against the server at ``url``: :func:`window`'s."""
    return window([http_closed_loop(url, "/v1/embeddings", server_bodies(images), concurrency, args.warmup,
                                    args.duration)])


def server_counters(url: str) -> dict[str, float]:
    """The server's ``/metrics`` counters this script reads: completed requests, runner calls, real and padded
    units, results through the preprocessing pool's pipe (``pipe``), and per request stage its seconds and count
    (``stage_s:<stage>``, ``stage_n:<stage>``), summed over models."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(("completed", "calls", "real", "padded", "pipe"), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "encgraph_front_requests_total" and s.labels.get("outcome") == "completed":
                out["completed"] += s.value
            elif s.name == "encgraph_front_calls_total":
                out["calls"] += s.value
            elif s.name == "encgraph_preprocess_pipe_results_total":
                out["pipe"] += s.value
            elif s.name == "encgraph_tokens_total":
                out[s.labels["kind"]] += s.value
            elif s.name in ("encgraph_request_stage_seconds_sum", "encgraph_request_stage_seconds_count"):
                key = f"stage_{'s' if s.name.endswith('_sum') else 'n'}:{s.labels['stage']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def counter_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A point's counter deltas: requests per runner call, padded share, and the server's mean ms per request in
    each stage (``stage_ms``: where a host-bound server spends its time)."""
    return delta_summary(counter_delta(before, after))


def delta_summary(d: dict[str, float]) -> dict[str, Any]:
    """:func:`counter_summary` of deltas (summed over a point's runs)."""
    units = d["real"] + d["padded"]
    stages = {s: round(1e3 * d[f"stage_s:{s}"] / d[f"stage_n:{s}"], 3) for s in STAGES if d.get(f"stage_n:{s}")}
    return {"requests_per_call": round(d["completed"] / d["calls"], 2) if d["calls"] else None,
            "padded_share": round(d["padded"] / units, 4) if units else None, "stage_ms": stages,
            # Requests whose pixels came back through the preprocessing pool's pipe, not a shared-memory slot.
            "pipe_results": int(d["pipe"])}


def stop_servers(procs: list[Any]) -> None:
    """SIGTERM to every server, then wait for each (killed past 60 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------------------------------------------- main
def environment(device: Any) -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(),
            "argv": sys.argv[1:]}


def slug(env: dict[str, Any], smoke: bool) -> str:
    return SMOKE_SLUG if smoke else "-".join("".join(c if c.isalnum() else " " for c in env["gpu"].lower()).split())


def server_missing() -> str | None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "PIL", "httpx", "aiohttp")
               if importlib.util.find_spec(m) is None]
    return f"skipped: needs {', '.join(missing)} (pip install 'encgraph[serve,bench]')" if missing else None


def targets(points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's target at concurrency 32 (or the largest measured below it)."""
    def at(system: str) -> dict[str, Any] | None:
        by_c = points.get(system, {})
        cs = [int(c) for c, p in by_c.items() if p.get("requests")]
        pick = max((c for c in cs if c <= 32), default=None)  # the same for every system: one concurrency list
        return by_c[str(pick)] if pick is not None else None

    hf, per, co = at("hf_eager"), at("graphed_per_request"), at("graphed_coalesce")
    out: dict[str, Any] = {"clients": max((int(c) for c in points.get("graphed_coalesce", {}) if int(c) <= 32),
                                          default=None)}
    if hf and co:
        out["coalesce_vs_hf_eager_images_per_s"] = round(co["images_per_s"] / max(hf["images_per_s"], 1e-9), 2)
        out["coalesce_3x_hf_eager"] = out["coalesce_vs_hf_eager_images_per_s"] >= 3.0
    if per and co:
        out["coalesce_p99_not_worse_than_per_request"] = co["p99_ms"] <= per["p99_ms"]
        if "runs" in co and "runs" in per:  # the k-th runs of both ran in the same round
            pairs = list(zip(co["runs"], per["runs"]))
            out["coalesce_p99_not_worse_runs"] = f"{sum(a['p99_ms'] <= b['p99_ms'] for a, b in pairs)} of {len(pairs)}"
    default = at("defaults")  # the same targets for what a user starts with no options
    if hf and default:
        out["defaults_vs_hf_eager_images_per_s"] = round(default["images_per_s"] / max(hf["images_per_s"], 1e-9), 2)
    if per and default:
        out["defaults_p99_not_worse_than_per_request"] = default["p99_ms"] <= per["p99_ms"]
    return out


def render(data: dict[str, Any]) -> str:
    workers = data["options"].get("preprocess_workers")  # absent from runs before the option
    servers = "" if workers is None else f"; servers with --preprocess-workers {workers}"
    repeats = data["options"].get("repeats", 1)  # absent from runs before the option
    rounds = "" if repeats == 1 else (f", {repeats} runs per point in rounds of one run per system (latencies "
                                      "pooled over a point's runs)")
    lines = [f"# Serving: {data['environment']['gpu']}", "",
             f"torch {data['environment']['torch']}, transformers {data['environment']['transformers']}; "
             f"{data['options']['duration']} s per {'point' if repeats == 1 else 'run'} after "
             f"{data['options']['warmup']} s warm-up{rounds}; one image per request; graphed_coalesce "
             f"max_wait_ms={data['options']['max_wait_ms']}{servers}.", ""]
    for tower, by_transport in data["towers"].items():
        for transport, result in by_transport.items():
            lines += [f"## {TOWERS[tower]['label']}, {transport}", ""]
            if "skipped" in result:
                lines += [result["skipped"], ""]
                continue
            # The server's own split of a request's time, where the run measured it (servers with stage metrics).
            staged = any(p.get("stage_ms") for by_c in result["points"].values() for p in by_c.values())
            extra = (" server ms per request: " + " / ".join(STAGES) + " |") if staged else ""
            lines += ["| clients | system | images/s | P50 ms | P99 ms | requests/call | padded share |" + extra,
                      "|---|---|---|---|---|---|---|" + ("---|" if staged else "")]
            for system, by_c in result["points"].items():
                for c, p in by_c.items():
                    if not p.get("requests"):
                        lines.append(f"| {c} | {system} | {p.get('skipped') or p.get('first_error') or 'no answer'} "
                                     "| | | | |" + (" |" if staged else ""))
                        continue
                    share = "" if p.get("padded_share") is None else f"{100 * p['padded_share']:.1f}%"
                    split = p.get("stage_ms") or {}
                    cell = (" " + " / ".join(f"{split[k]:.2f}" if k in split else "-" for k in STAGES) + " |"
                            if staged else "")
                    lines.append(f"| {c} | {system} | {p['images_per_s']:.1f} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} "
                                 f"| {p.get('requests_per_call') or ''} | {share} |" + cell)
            t = result.get("targets", {})
            if len(t) > 1:
                ratio = ("hf_eager not in this run" if "coalesce_vs_hf_eager_images_per_s" not in t else
                         f"{t['coalesce_vs_hf_eager_images_per_s']} (target >= 3: "
                         f"{'met' if t.get('coalesce_3x_hf_eager') else 'not met'})")
                runs = t.get("coalesce_p99_not_worse_runs")
                lines += ["", f"At {t['clients']} clients: graphed_coalesce / hf_eager images/s = {ratio}; P99 no "
                          f"worse than graphed_per_request: {t.get('coalesce_p99_not_worse_than_per_request')}"
                          + (f" (pooled; in {runs} runs of a round)." if runs else ".")]
                if "defaults_vs_hf_eager_images_per_s" in t or "defaults_p99_not_worse_than_per_request" in t:
                    lines += ["", f"defaults (no options) / hf_eager images/s = "
                              f"{t.get('defaults_vs_hf_eager_images_per_s', 'hf_eager not in this run')}; P99 no "
                              f"worse than graphed_per_request: {t.get('defaults_p99_not_worse_than_per_request')}."]
            lines.append("")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> Path | None:
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, tr, r) for t, by in data["towers"].items() for tr, r in by.items() if "points" in r]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (tower, transport, result) in zip(axes[0], panels):
        for system, by_c in result["points"].items():
            cs = [int(c) for c, p in by_c.items() if p.get("requests")]
            # One colour per system in every panel, whatever order a run measured them in: the legend is the
            # first panel's.
            ax.plot(cs, [by_c[str(c)]["images_per_s"] for c in cs], marker="o", label=system,
                    color=f"C{SYSTEMS.index(system)}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("closed-loop clients")
        ax.set_ylabel("images/s")
        ax.set_title(f"{TOWERS[tower]['label']} ({transport})", fontsize=9)
        ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}  # every system of every panel
    axes[0][0].legend([handles[n] for n in SYSTEMS if n in handles], [n for n in SYSTEMS if n in handles],
                      fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = build_parser().parse_args(argv)
    if args.cpu_smoke:
        args.concurrency = (1, 4) if args.concurrency == (1, 8, 32, 128) else args.concurrency
        args.duration, args.warmup = min(args.duration, 0.3), min(args.warmup, 0.1)
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        raise SystemExit("serving.py: no CUDA device; run with --cpu-smoke for the CPU path")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    deadline = time.monotonic() + args.time_budget
    env = environment(device)
    data: dict[str, Any] = {"environment": env, "options": {k: (list(v) if isinstance(v, tuple) else str(v) if
                            isinstance(v, Path) else v) for k, v in vars(args).items()}, "towers": {}}
    # One transport alone gets its own files, so that the two runs of a GPU session do not overwrite each other.
    only = f"_{args.transports[0]}" if len(args.transports) == 1 else ""
    name = f"{SCRIPT}_{slug(env, args.cpu_smoke)}{only}{'_' + args.tag if args.tag else ''}"
    dirs = result_dirs(args.results_dir, tiny=args.cpu_smoke)  # + $OUT/results under the device tool
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)

    def write(suffix: str, text: str) -> None:
        for d in dirs:
            (d / f"{name}{suffix}").write_text(text)

    def flush() -> None:
        write(".json", json.dumps(data, indent=1))

    for tower in args.towers:
        print(f"[serving] {tower}: building and capturing", file=sys.stderr, flush=True)
        bench = Bench(tower, args, device, dtype)
        data["towers"][tower] = {}
        for transport in args.transports:
            result: dict[str, Any] = {"capture": bench.capture, "points": {}}
            data["towers"][tower][transport] = result
            skipped = server_missing() if transport == "server" else None
            if skipped:
                data["towers"][tower][transport] = {"skipped": skipped}
                continue
            run_points(bench, transport, args, device, dtype, result, deadline, flush)
            result["targets"] = targets(result["points"])
            flush()
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flush()
    write(".md", render(data))
    picture = plot(data, args.results_dir / f"{name}_images_per_s.png")
    for d in dirs[1:]:
        if picture:
            shutil.copy(picture, d / picture.name)
    data["plot"] = str(picture) if picture else None
    flush()
    print(render(data))
    return data


def run_points(bench: Bench, transport: str, args: argparse.Namespace, device: Any, dtype: Any,
               result: dict[str, Any], deadline: float, flush: Any) -> None:
    """Every point of ``bench`` over ``transport``, interleaved: at each concurrency, ``--repeats`` rounds of one
    run per system (each round in another rotation of the systems), so that the systems compared at a point ran
    seconds apart under the same host conditions, and a cut by the time budget leaves them the same points.
    Through the server each system's ``encgraph serve`` starts once, all of them together before the first
    point, and stops after the last (an idle server costs the measured one nothing: its threads wait on queues
    and sockets, its heap is frozen)."""
    points: dict[str, dict[str, Any]] = result["points"]
    for system in args.systems:
        points.setdefault(system, {})
    with tempfile.TemporaryDirectory() as checkpoint:
        servers: dict[str, tuple[Any, str, Any]] = {}
        bodies: list[bytes] = []
        try:
            if transport == "server":
                bench.save(checkpoint)
                bodies = server_bodies([_jpeg(w, h, seed=i) for i, (w, h) in enumerate(bench.pool)])
                kind = str(dtype).replace("torch.", "")
                for system in args.systems:
                    servers[system] = start_server(checkpoint, system, args, device.type, kind)
                for proc, url, log in servers.values():
                    wait_server(proc, url, log)
            for c in args.concurrency:
                runs: dict[str, list[Run]] = {s: [] for s in args.systems}
                extras: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
                for r in range(args.repeats):
                    k = r % len(args.systems)
                    for system in args.systems[k:] + args.systems[:k]:
                        if time.monotonic() > deadline:
                            if not runs[system]:
                                points[system][str(c)] = {"skipped": "skipped: time budget"}
                            continue
                        print(f"[serving] {bench.name} {transport} {system} x{c} run {r + 1}", file=sys.stderr,
                              flush=True)
                        if transport == "inprocess":
                            run, extra = run_inprocess(bench, system, c, args)
                        else:
                            url = servers[system][1]
                            before = server_counters(url)
                            run = http_closed_loop(url, "/v1/embeddings", bodies, c, args.warmup, args.duration)
                            extra = counter_delta(before, server_counters(url))
                        runs[system].append(run)
                        extras[system].append(extra)
                        points[system][str(c)] = _point(runs[system], extras[system], transport)
                        flush()
        finally:
            stop_servers([proc for proc, _, _ in servers.values()])


def _point(runs: list[Run], extras: list[dict[str, Any]], transport: str) -> dict[str, Any]:
    """A point from its runs (:func:`window`) and, per run, the server's counter deltas (summed) or the front's
    summary (:func:`_merge_fronts`)."""
    out = window(runs)
    if transport == "server":
        total: dict[str, float] = {}
        for delta in extras:
            for key, value in delta.items():
                total[key] = total.get(key, 0.0) + value
        out.update(delta_summary(total))
    else:
        out.update(_merge_fronts(extras))
    return out


def _merge_fronts(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`_front_summary` over several runs: the mean requests per call and padded share, the eager items and
    the replays per budget summed."""
    if len(summaries) == 1:
        return summaries[0]
    out: dict[str, Any] = {}
    for key in ("requests_per_call", "padded_share"):
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = round(statistics.fmean(values), 4) if values else None
    if any("eager_items" in s for s in summaries):
        out["eager_items"] = sum(s.get("eager_items", 0) for s in summaries)
        replays: dict[str, int] = {}
        for s in summaries:
            for budget, n in s.get("replays", {}).items():
                replays[budget] = replays.get(budget, 0) + n
        out["replays"] = replays
    return out


if __name__ == "__main__":
    main()
