"""Data-parallel scaling: each request's images spread over 1, 2 and 4 GPUs (``DataParallelEncoder`` over NCCL,
NVLink multicast off), adapter eager against encgraph graphs, mean and P99 latency per request.

Tower: Qwen2.5-VL-7B at real geometry with random bf16 weights (``benches.lib.towers``; the same seed on every GPU,
checked). Workloads: ``fixed``, 20 images of 336 x 336 px per request (the seed's multi-GPU case; ``--runs``
timed requests after ``--warmup``), and ``trace``, the first ``--trace-requests`` requests of the mixed traffic
trace (``benches.lib.trace``, each request once). For each GPU count the script spawns one process per GPU
(``torch.distributed`` over NCCL on localhost, with ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
and ``NVSHMEM_DISABLE_NVLS=1`` set before the spawn); every rank builds the same tower and runners (the graph
runner captures its default ladder), and each request is timed from a barrier to the end of the data-parallel
call (host clock after a device sync; a request's latency is the slowest rank's). The first ``--check-requests``
requests of each workload are also run through the rank's own runner on the whole request (the single-GPU run)
and compared per item (largest relative difference; items equal to the bit).

``--cpu-smoke`` runs the same path with gloo on CPU processes (tiny tower, fp32, the runner's STATIC mode
standing in for graphs, 1 and 2 ranks, small requests).

JSON (``benches/results/data_parallel_<gpu>.json``)::

    {"environment": {...}, "options": {...}, "tower": {...}, "workloads": {...},
     "gpus": {"<n>": {"world_size", "weights_identical", "build_seconds",
                      "modes": {"eager" | "graph": {"capture": {...} (graph),
                                "workloads": {"fixed" | "trace": {"mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms",
                                    "min_ms", "requests", "items_per_request", "tokens_per_request",
                                    "items_per_rank" (fixed), "check": {"requests", "items", "exact_items",
                                    "max_rel_diff_vs_single_gpu"}, "stats": {runner counters summed over the
                                    ranks, timed requests only}, "dp_stats": {rank 0's DataParallelEncoder.stats}}
                                    | {"skipped": why}}}
                                | {"skipped": why}}}
               | {"skipped": why} | {"error": what}},
     "speedup": {"<workload>/<mode>/<n>": {"vs_1_gpu_mean", "vs_1_gpu_p99", "graph_vs_eager_mean"}}}
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib.cases import Visual
from benches.lib.cli import base_parser, parse_names
from benches.lib.env import Deadline, Env, SKIPPED_TIME, inference, log, make_env, short_error
from benches.lib.outputs import flatten_tensors, max_rel_diff
from benches.lib.results import Results, json_ready, markdown_table, ratio
from benches.lib.systems import System, TowerBench
from benches.lib.timing import Timing
from benches.lib.towers import TOWERS, TowerKind, count_params
from benches.lib.trace import SMOKE_REQUESTS, Caps, generate_trace

SCRIPT = "data_parallel"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the shared machines: set in the environment before any rank starts."""
MODES = {"eager": System.ADAPTER_EAGER, "graph": System.GRAPH}
WORKLOADS = ("fixed", "trace")
SMOKE_GPUS = (1, 2)
SMOKE_IMAGES, SMOKE_SIDE = 4, 112
COLLECTIVE_TIMEOUT_S = 600


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise SystemExit(f"--gpus: expected a comma list of GPU counts >= 1 such as 1,2,4, got {text!r}")
    return counts


def build_parser() -> Any:
    p = base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=900.0)
    p.add_argument("--gpus", type=parse_counts, default=None,
                   help="comma list of GPU counts (default 1,2,4; a count over the visible GPUs is recorded as "
                        "skipped; with --cpu-smoke 1,2 CPU ranks)")
    p.add_argument("--modes", type=parse_names(MODES), default=tuple(MODES),
                   help="comma list out of eager,graph (default both)")
    p.add_argument("--workloads", type=parse_names(WORKLOADS), default=WORKLOADS,
                   help="comma list out of fixed,trace (default both)")
    p.add_argument("--tower", choices=sorted(t for t, s in TOWERS.items() if s.kind is TowerKind.PACKED),
                   default="qwen2_5_vl_7b", help="the tower (default qwen2_5_vl_7b)")
    p.add_argument("--images", type=int, default=None, help=f"images per fixed request (default 20; smoke {SMOKE_IMAGES})")
    p.add_argument("--side", type=int, default=None, help=f"their side in px (default 336; smoke {SMOKE_SIDE})")
    p.add_argument("--trace-requests", type=int, default=None,
                   help=f"requests of the traffic trace (default 200; smoke {SMOKE_REQUESTS})")
    p.add_argument("--check-requests", type=int, default=3,
                   help="requests per workload also run on the single GPU and compared per item (default 3)")
    return p


def resolve_defaults(args: Any) -> Any:
    if args.gpus is None:
        args.gpus = SMOKE_GPUS if args.cpu_smoke else (1, 2, 4)
    if args.images is None:
        args.images = SMOKE_IMAGES if args.cpu_smoke else 20
    if args.side is None:
        args.side = SMOKE_SIDE if args.cpu_smoke else 336
    if args.trace_requests is None:
        args.trace_requests = SMOKE_REQUESTS if args.cpu_smoke else 200
    if min(args.images, args.side, args.trace_requests) < 1 or args.check_requests < 0:
        raise SystemExit("--images, --side and --trace-requests must be >= 1, --check-requests >= 0")
    return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------- parent
def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = resolve_defaults(build_parser().parse_args(argv))
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    results = Results(SCRIPT, args, env)
    data = results.data
    spec = TOWERS[args.tower]
    data["tower"] = {"name": spec.name, "label": spec.label, "params": count_params(spec, env.tiny),
                     "geometry": dict(spec.full), "tiny": env.tiny}
    data["workloads"] = {
        "fixed": {"images": args.images, "side": args.side, "timed_requests": env.runs, "warmup": env.warmup},
        "trace": {"requests": args.trace_requests, "seed": args.seed,
                  "caps": {"image": Caps.default(env.tiny).image, "frame": Caps.default(env.tiny).frame}},
    }
    data["gpus"] = {}
    visible = torch.cuda.device_count() if env.cuda else max(os.cpu_count() or 1, max(args.gpus))
    os.environ.update(NO_MULTICAST)  # inherited by every spawned rank, before NCCL starts
    opts = {k: v for k, v in vars(args).items() if k not in ("results_dir", "mirror_dir")}
    opts.update(runs=env.runs, warmup=env.warmup)
    for n in args.gpus:
        if n > visible:
            data["gpus"][str(n)] = {"skipped": f"needs {n} GPUs, {visible} visible"}
        elif deadline.expired(30.0):
            data["gpus"][str(n)] = {"skipped": SKIPPED_TIME}
        else:
            log(f"{n} {'GPU' if env.cuda else 'CPU rank'}(s): spawning")
            data["gpus"][str(n)] = spawn(n, {**opts, "end_time": time.time() + deadline.left()})
        results.flush()
    data["speedup"] = speedups(data["gpus"])
    results.finish(render(data))
    return data


def spawn(world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`rank_main` on ``world`` spawned processes; rank 0's record (or the error)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        error = None
        try:
            mp.start_processes(rank_main, args=(world, free_port(), str(out), opts), nprocs=world, join=True,
                               start_method="spawn")
        except Exception as exc:  # noqa: BLE001 - a failed GPU count is recorded; the others still run
            error = short_error(exc)
        record = json.loads(out.read_text()) if out.exists() else {}
    if error is not None:
        record["error"] = error
    return record


# ---------------------------------------------------------------------------------------------------- ranks
def rank_main(rank: int, world: int, port: int, out: str, opts: dict[str, Any]) -> None:
    """One rank: join the group, build the tower and runners, time every workload in every mode."""
    import torch
    import torch.distributed as dist

    cuda = not opts["cpu_smoke"]
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra: dict[str, Any] = {"device_id": device}
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # several ranks share the CPU
        extra = {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **extra)
    env = Env(device, torch.bfloat16 if cuda else torch.float32, not cuda, opts["runs"], opts["warmup"],
                     opts["seed"])
    record: dict[str, Any] = {"world_size": world, "modes": {}}
    try:
        with inference():
            run_rank(rank, world, env, opts, record, out)
    except Exception:
        record["error"] = traceback.format_exc().splitlines()[-1][:400]
        _save(rank, record, out)
        raise
    _save(rank, record, out)
    dist.barrier()
    dist.destroy_process_group()


def run_rank(rank: int, world: int, env: Env, opts: dict[str, Any], record: dict[str, Any], out: str) -> None:
    from encgraph.capture.distributed import DataParallelEncoder

    modes = [MODES[m] for m in opts["modes"]]
    bench = TowerBench(TOWERS[opts["tower"]], env, modes)
    record["build_seconds"] = round(bench.build_seconds, 3)
    record["weights_identical"] = _same_everywhere(_fingerprint(bench.enc), world)
    for name, system in zip(opts["modes"], modes):
        if system in bench.unavailable:
            record["modes"][name] = {"skipped": bench.unavailable[system]}
            continue
        if _agree(time.time() > opts["end_time"] - 20):
            record["modes"][name] = {"skipped": SKIPPED_TIME}
            continue
        runner = bench.runner(system)  # the graph runner captures its ladder here
        dp = DataParallelEncoder(runner, device=env.device)
        entry: dict[str, Any] = {"workloads": {}}
        if system is System.GRAPH:
            entry["capture"] = bench.capture_infos.get(System.GRAPH)
        record["modes"][name] = entry
        for workload in opts["workloads"]:
            if _agree(time.time() > opts["end_time"] - 10):
                entry["workloads"][workload] = {"skipped": SKIPPED_TIME}
                continue
            log(f"rank {rank}/{world}: {name} {workload}")
            entry["workloads"][workload] = run_workload(workload, bench, runner, dp, env, opts, world)
            _save(rank, record, out)
    bench.close()


def requests_of(workload: str, bench: TowerBench, env: Env, opts: dict[str, Any]) -> list[Any]:
    """The workload's requests as lazily built inputs (``() -> BenchInputs``), the same on every rank."""
    if workload == "fixed":
        visuals = (Visual(opts["side"], opts["side"]),) * opts["images"]
        fixed = bench.inputs(visuals, seed=1)
        return [lambda: fixed] * (env.warmup + env.runs)
    caps = Caps.default(env.tiny)
    trace = generate_trace(opts["trace_requests"], seed=opts["seed"])
    return [lambda r=r, i=i: caps.inputs(bench, r, seed=10_000 + i) for i, r in enumerate(trace)]


def run_workload(workload: str, bench: TowerBench, runner: Any, dp: Any, env: Env,
                 opts: dict[str, Any], world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from encgraph.packing import balance

    requests = requests_of(workload, bench, env, opts)
    check = _check(requests[: opts["check_requests"]], runner, dp)
    timed = requests[env.warmup :] if workload == "fixed" else requests
    if workload == "fixed":
        for make in requests[: env.warmup]:
            dp(make().adapter)
    runner.reset_stats()  # the counters below cover the timed requests only
    dp.reset_stats()
    latencies, items, tokens = [], [], []
    for make in timed:
        inputs = make()
        dist.barrier()
        if env.cuda:
            torch.cuda.synchronize(env.device)
        t0 = time.perf_counter()
        dp(inputs.adapter)
        if env.cuda:
            torch.cuda.synchronize(env.device)
        latencies.append((time.perf_counter() - t0) * 1e3)
        items.append(inputs.sizes.items)
        tokens.append(inputs.sizes.tokens)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, latencies)
    slowest = [max(per_rank[i] for per_rank in everyone) for i in range(len(latencies))]
    out = Timing(tuple(slowest)).summary()
    out.update(p50_ms=round(Timing(tuple(slowest)).percentile(50), 4),
               p99_ms=round(Timing(tuple(slowest)).percentile(99), 4),
               max_ms=round(max(slowest), 4), requests=len(slowest),
               items_per_request=round(sum(items) / len(items), 3),
               tokens_per_request=round(sum(tokens) / len(tokens), 1), check=check,
               stats={k: v for k, v in dp.global_stats().items() if k != "per_rank"},
               dp_stats={k: v for k, v in dp.stats.items() if k != "local"})
    if workload == "fixed":
        specs = bench.adapter.item_specs(requests[0]().adapter)
        sizes = [s.input_size if s.input_size is not None else s.total_tokens for s in specs]
        out["items_per_rank"] = [len(s) for s in balance(sizes, world)]
    return out


def _check(requests: list[Any], runner: Any, dp: Any) -> dict[str, Any]:
    """The data-parallel results against this rank's runner on the whole request (the single-GPU run)."""
    worst, exact, count = 0.0, 0, 0
    for make in requests:
        inputs = make().adapter
        out, single = dp(inputs), runner(inputs)
        worst = max(worst, max_rel_diff(out, single))
        for a, b in zip(out, single):
            ta, tb = flatten_tensors(a), flatten_tensors(b)
            exact += len(ta) == len(tb) and all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(ta, tb))
        count += len(out)
    return {"requests": len(requests), "items": count, "exact_items": exact, "max_rel_diff_vs_single_gpu": worst}


def _fingerprint(module: Any) -> float:
    return float(sum(float(p.double().sum()) for p in module.parameters()))


def _same_everywhere(value: Any, world: int) -> bool:
    import torch.distributed as dist

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, value)
    return all(v == everyone[0] for v in everyone)


def _agree(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a time-budget decision must be the same everywhere, or ranks would wait
    in different collectives)."""
    import torch.distributed as dist

    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _save(rank: int, record: dict[str, Any], out: str) -> None:
    if rank == 0:
        Path(out).write_text(json.dumps(json_ready(record)))


# ---------------------------------------------------------------------------------------------------- report
def speedups(gpus: dict[str, Any]) -> dict[str, Any]:
    """Per workload, mode and GPU count: mean and P99 against 1 GPU in the same mode; graphs against eager."""

    def cell(n: str, mode: str, workload: str) -> dict[str, Any] | None:
        entry = gpus.get(n, {}).get("modes", {}).get(mode, {}).get("workloads", {}).get(workload)
        return entry if entry and "mean_ms" in entry else None

    out = {}
    for n in gpus:
        for mode in MODES:
            for workload in WORKLOADS:
                here, one, eager = cell(n, mode, workload), cell("1", mode, workload), cell(n, "eager", workload)
                if here is None:
                    continue
                out[f"{workload}/{mode}/{n}"] = {
                    "vs_1_gpu_mean": ratio(one and one["mean_ms"], here["mean_ms"]),
                    "vs_1_gpu_p99": ratio(one and one["p99_ms"], here["p99_ms"]),
                    "graph_vs_eager_mean": ratio(eager and eager["mean_ms"], here["mean_ms"])
                    if mode == "graph" else None,
                }
    return out


def render(data: dict[str, Any]) -> str:
    rows = []
    for n, run in data["gpus"].items():
        if "modes" not in run:
            rows.append([n, "-", "-", None, None, None, None, None, None, run.get("skipped") or run.get("error")])
            continue
        for mode, entry in run["modes"].items():
            for workload, w in entry.get("workloads", {}).items():
                if "mean_ms" not in w:
                    rows.append([n, mode, workload, None, None, None, None, None, None, w.get("skipped", "-")])
                    continue
                s = data["speedup"].get(f"{workload}/{mode}/{n}", {})
                rows.append([n, mode, workload, w["mean_ms"], w["p50_ms"], w["p99_ms"], s.get("vs_1_gpu_mean"),
                             s.get("graph_vs_eager_mean"), w["check"]["max_rel_diff_vs_single_gpu"],
                             f"{w['requests']} requests, {w['items_per_request']:g} items"])
    table = markdown_table(
        ["GPUs", "mode", "workload", "mean ms", "P50 ms", "P99 ms", "x vs 1 GPU", "graph x vs eager",
         "max rel diff vs 1 GPU", "notes"], rows)
    tower = data["tower"]
    return f"### Data-parallel encoding: {tower['label']} ({'tiny, CPU' if tower['tiny'] else 'bf16'})\n\n{table}"


if __name__ == "__main__":
    main()
