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

Writes ``benches/results/serving_<gpu>[_<transport>][_<tag>].json`` and ``.md``, and with matplotlib a plot beside
them (``_images_per_s.png``; a tagged run's ``.png``: the names ``benches/plot.py`` draws them under); the
transport is in the name when one is run alone. The towers' classes and configs are ``benches.lib.towers``'
(``benches.lib.serving_towers`` adds their processors and request sizes); ``--cpu-smoke`` runs the whole path on
tiny CPU towers in seconds. The server transport
needs the ``[serve]`` and ``[bench]`` extras (FastAPI, uvicorn, prometheus_client, Pillow; httpx, aiohttp).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

# What tests and benches/readme.py reach through this script are re-exported (F401).
from benches.lib.gpu_busy import GpuBusy, merge_busy, nvml_index  # noqa: E402
from benches.lib.load import Run, closed_loop, http_closed_loop, summarize, window  # noqa: E402, F401
from benches.lib.plots_registry import parse  # noqa: E402
from benches.lib.results import git_commit, result_dirs  # noqa: E402
from benches.lib.server_profile import GilProfile  # noqa: E402
from benches.lib.serving_http import (  # noqa: E402, F401
    counter_delta, counter_summary, delta_summary, run_server, server_bodies, server_counters, server_missing,
    start_server, stop_servers, wait_server,
)
from benches.lib.serving_report import plot, render, targets  # noqa: E402, F401
from benches.lib.serving_towers import (  # noqa: E402, F401
    DEFAULT_TRANSPORTS, SYSTEMS, TOWERS, TRANSPORTS, Bench, _jpeg, front_options,
)

SCRIPT = "serving"
SMOKE_SLUG = "cpu-smoke"


def _csv(cast: Any, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        values = tuple(cast(v.strip()) for v in text.split(",") if v.strip())
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            among = f" out of {choices}" if choices else ""
            raise argparse.ArgumentTypeError(f"expected a comma list{among}, got {text!r}")
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
    p.add_argument("--transports", type=_csv(str, TRANSPORTS), default=DEFAULT_TRANSPORTS,
                   help="comma list out of inprocess, server, ray (default inprocess,server); ray: one replica "
                        "through encgraph serve --ray, one system a run (its Ray instance holds Serve's one proxy)")
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
    p.add_argument("--preprocess-on", choices=("host", "device"), default="host",
                   help="encgraph serve's --preprocess-on for every server started (device: transformers' torchvision "
                        "processor on the GPU; recorded in the options; use --tag to keep both runs)")
    p.add_argument("--encoding-format", choices=("base64", "float"), default="base64",
                   help="the answers' encoding_format in the server transports' requests (default base64; float: "
                        "JSON numbers, OpenAI's default; recorded in the options; use --tag to keep both runs)")
    p.add_argument("--request-threads", type=_positive, default=None, metavar="N",
                   help="encgraph serve's --request-threads for every server started (default: the server's own, 4)")
    p.add_argument("--start", choices=("sequential", "concurrent"), default="sequential",
                   help="the systems' servers: each started once the one before answers (default), or all at once "
                        "(faster, but their capture-time timings then share the GPU: see run_points)")
    p.add_argument("--profile", choices=SYSTEMS, default=None,
                   help="with --transports server: sample this system's server with py-spy (--gil) during its "
                        "first run at the largest concurrency, where the server process's Python time goes "
                        "(benches/lib/server_profile.py; py-spy on PATH)")
    p.add_argument("--time-budget", type=float, default=540.0, help="start no point past this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benches" / "results")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--cpu-smoke", "--dry-run", action="store_true",
                   help="tiny towers on the CPU, concurrency 1,4, 0.3 s points: the whole path in seconds")
    return p


# ---------------------------------------------------------------------------------------------------- points
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
        inputs = bench.runner_inputs
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.profile and "server" not in args.transports:
        parser.error(f"--profile {args.profile}: profiles a server; add server to --transports (got "
                     f"{','.join(args.transports)})")
    if "ray" in args.transports and len(args.systems) != 1:
        parser.error(f"--transports ray: runs one system (each server --ray starts a Ray instance and Serve proxy of "
                     f"its own); got --systems {','.join(args.systems)}. Pass one, e.g. --systems defaults.")
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
            # The bench process's own capture: the in-process systems run on it; each server captures its own.
            result: dict[str, Any] = {"capture": bench.capture if transport == "inprocess" else None, "points": {}}
            data["towers"][tower][transport] = result
            skipped = server_missing(transport) if transport != "inprocess" else None
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
    picture = plot(data, parse(args.results_dir / f"{name}.json").png)  # the name benches/plot.py draws it under
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
    Through the server each system's ``encgraph serve`` starts once, before the first point, and stops after the
    last (an idle server costs the measured one nothing: its threads wait on queues and sockets, its heap is
    frozen). They start one after another (``--start sequential``): a server times its graph replays and its
    tower's eager forward at capture, and the runner routes a batch to whichever its cost model says is faster.
    Started together on one GPU, five servers timed those while the others captured: on the H200 the SigLIP
    server with ``--max-requests 1`` then encoded at HF eager's speed (57 images/s at 32 clients against 293 when
    started one after another, 530 ms of its 580 ms P50 in the encode stage), and in another such start
    (``--start concurrent``; that run's file is in git history) the ``graphed_nowait`` server ran
    its 772 items eagerly ("eager is cheaper"). ``eager_items`` in each point counts the server's eagerly run
    items, so a run like that shows."""
    points: dict[str, dict[str, Any]] = result["points"]
    for system in args.systems:
        points.setdefault(system, {})
    with tempfile.TemporaryDirectory() as checkpoint:
        servers: dict[str, tuple[Any, str, Any]] = {}
        bodies: list[bytes] = []
        profiles: dict[tuple[str, int], dict[str, Any]] = {}
        try:
            if transport != "inprocess":
                bench.save(checkpoint)
                bodies = server_bodies([_jpeg(w, h, seed=i) for i, (w, h) in enumerate(bench.pool)],
                                       args.encoding_format)
                kind = str(dtype).replace("torch.", "")
                # Seconds from a server's start (each, or all together) until it answered.
                starts: dict[str, float] = result.setdefault("server_start_s", {})
                t0 = time.monotonic()
                for system in args.systems:
                    servers[system] = start_server(checkpoint, system, args, device.type, kind, ray=transport == "ray")
                    if args.start == "sequential":
                        wait_server(*servers[system])
                        starts[system] = round(time.monotonic() - t0, 1)
                        t0 = time.monotonic()
                if args.start == "concurrent":
                    for server in servers.values():
                        wait_server(*server)
                    starts["all"] = round(time.monotonic() - t0, 1)
            for c in args.concurrency:
                runs: dict[str, list[Run]] = {s: [] for s in args.systems}
                extras: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
                busy: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
                for r in range(args.repeats):
                    k = r % len(args.systems)
                    for system in args.systems[k:] + args.systems[:k]:
                        if time.monotonic() > deadline:
                            if not runs[system]:
                                points[system][str(c)] = {"skipped": "skipped: time budget"}
                            continue
                        print(f"[serving] {bench.name} {transport} {system} x{c} run {r + 1}", file=sys.stderr,
                              flush=True)
                        # The device's busy share over the run's measured window (benches/lib/gpu_busy.py).
                        sampler = (GpuBusy(args.duration, delay=args.warmup, index=nvml_index(device.index or 0))
                                   if device.type == "cuda" else None)
                        if transport == "inprocess":
                            run, extra = run_inprocess(bench, system, c, args)
                        else:
                            url = servers[system][1]
                            before = server_counters(url)
                            profile = (GilProfile(servers[system][0].pid, args.duration, delay=args.warmup)
                                       if system == args.profile and transport == "server" and
                                       c == max(args.concurrency) and r == 0 else None)
                            run = http_closed_loop(url, "/v1/embeddings", bodies, c, args.warmup, args.duration)
                            extra = counter_delta(before, server_counters(url))
                            if profile is not None:
                                profiles[(system, c)] = profile.result()
                        runs[system].append(run)
                        extras[system].append(extra)
                        points[system][str(c)] = _point(runs[system], extras[system], transport)
                        if sampler is not None:
                            busy[system].append(sampler.result())
                            points[system][str(c)]["gpu_busy"] = merge_busy(busy[system])
                        if (system, c) in profiles:
                            points[system][str(c)]["gil_profile"] = profiles[(system, c)]
                        flush()
        finally:
            stop_servers([proc for proc, _, _ in servers.values()])


def _point(runs: list[Run], extras: list[dict[str, Any]], transport: str) -> dict[str, Any]:
    """A point from its runs (:func:`window`) and, per run, the server's counter deltas (summed) or the front's
    summary (:func:`_merge_fronts`)."""
    out = window(runs)
    if transport != "inprocess":
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
