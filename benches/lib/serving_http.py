"""``encgraph serve`` (or ``encgraph serve --ray``) as ``benches/serving.py`` drives it: one server process per system
(started, waited for, stopped), the request bodies, and the server's own counters read from ``/metrics`` (requests per runner call,
padded share, the stages of a request)."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from benches.lib.load import http_closed_loop, window
from benches.lib.results import REPO, child_env
from benches.lib.serving_towers import front_options
from encgraph.serving.metrics import STAGES

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(checkpoint: str, system: str, args: argparse.Namespace, device: str,
                 dtype: str, ray: bool = False) -> tuple[Any, str, Any]:
    """Start ``encgraph serve`` for ``system`` (returns at once): the process, its URL and its log file. ``ray``:
    ``--ray --replicas 1``, one replica behind Ray Serve's proxy on that URL, in a Ray instance of its own (no
    ``--address``: started and stopped by the command)."""
    port = _free_port()
    options = front_options(system, args)  # the same as the in-process front's, as encgraph serve's flags
    flags = ["--eager"] if system == "hf_eager" else [
        part for key, value in options.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    cmd = [sys.executable, "-m", "encgraph", "serve", "--model", f"bench={checkpoint}", "--device", device,
           "--dtype", dtype, "--port", str(port), "--max-queue", "4096", *flags]
    if args.preprocess_workers is not None:
        cmd += ["--preprocess-workers", args.preprocess_workers]
    if getattr(args, "request_threads", None) is not None:
        cmd += ["--request-threads", str(args.request_threads)]
    if getattr(args, "preprocess_on", "host") != "host":
        cmd += ["--preprocess-on", args.preprocess_on]
    if ray:
        cmd += ["--ray", "--replicas", "1"]
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


def server_bodies(images: list[str], encoding_format: str = "base64") -> list[bytes]:
    """One request body per image (base64 JPEG), its answer in ``encoding_format`` (``base64``: the embedding's
    float32 bytes; ``float``: JSON numbers, OpenAI's default, which the server writes with its GIL held)."""
    return [json.dumps({"input": [image], "encoding_format": encoding_format}).encode() for image in images]


def run_server(url: str, images: list[str], concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """One point of ``concurrency`` closed-loop HTTP clients against the server at ``url``: :func:`window`'s."""
    bodies = server_bodies(images, getattr(args, "encoding_format", "base64"))
    return window([http_closed_loop(url, "/v1/embeddings", bodies, concurrency, args.warmup, args.duration)])


def server_counters(url: str) -> dict[str, float]:
    """The server's ``/metrics`` counters this script reads: completed requests, runner calls, real and padded
    units, results through the preprocessing pool's pipe (``pipe``), and per request stage its seconds and count
    (``stage_s:<stage>``, ``stage_n:<stage>``), summed over models."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(("completed", "calls", "real", "padded", "pipe", "graph_items", "eager_items"), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "encgraph_front_requests_total" and s.labels.get("outcome") == "completed":
                out["completed"] += s.value
            elif s.name == "encgraph_front_calls_total":
                out["calls"] += s.value
            elif s.name == "encgraph_preprocess_pipe_results_total":
                out["pipe"] += s.value
            elif s.name == "encgraph_runner_items_total":
                out[f"{s.labels['kind']}_items"] += s.value
            elif s.name == "encgraph_eager_items_total":
                key = f"eager:{s.labels['reason']}"
                out[key] = out.get(key, 0.0) + s.value
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
            "pipe_results": int(d["pipe"]),
            # Items the server's runner ran eagerly (the tower's own forward), by reason: a graphed system that
            # ran eagerly measured the wrong thing.
            "eager_items": int(d.get("eager_items", 0)),
            "eager_reasons": {k.split(":", 1)[1]: int(v) for k, v in d.items() if k.startswith("eager:") and v}}


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


def server_missing(transport: str = "server") -> str | None:
    """Why ``transport`` (``server`` or ``ray``) cannot run here, or ``None``."""
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "PIL", "httpx", "aiohttp")
               if importlib.util.find_spec(m) is None]
    if transport == "ray" and importlib.util.find_spec("ray") is None:
        return "skipped: needs ray[serve] (pip install 'encgraph[ray,bench]')"
    return f"skipped: needs {', '.join(missing)} (pip install 'encgraph[serve,bench]')" if missing else None
