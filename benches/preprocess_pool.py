"""The preprocessing pool of ``encgraph serve`` on its own, on the CPU: requests/s, latency and the server
process's CPU per request when more requests are in flight than the pool has shared-memory slots.

Run from the repository root::

    python benches/preprocess_pool.py   # prints a table, writes benches/results/preprocess_pool_cpu.json and .md

One :class:`~encgraph.serving.preprocess.PreprocessPool` of ``--workers`` processes with ``--slots`` slots and
SigLIP-so400m's image processor at 384 px; ``--clients`` asyncio tasks each send one 384 x 384 JPEG (base64, as a
request holds it), wait for its arrays, and send the next, for ``--seconds``. Two modes, each in its own process,
alternating ``--repeats`` times:

- ``wait``: the pool as shipped: a request that finds every slot taken waits for one (``slots.FreeSlots``);
- ``pipe``: the pool before that: such a request's pixels come back through the executor's pipe (emulated by a
  ``FreeSlots.take`` that never waits), as at 128 clients on the H200, where 80-90% of the requests did.

``server_cpu_ms`` is the measuring process's own CPU time per request (its event loop, the executor's threads,
unpickling and copying the results): what the server process pays, on the same GIL as its replays and answers.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benches.lib.load import summarize  # noqa: E402

RESULTS = ROOT / "benches" / "results"
MODES = ("wait", "pipe")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benches/preprocess_pool.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--size", type=int, default=384, help="image and processor size in px (default 384)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process: one mode, JSON on stdout
    return p


def _jpeg(size: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return base64.b64encode(out.getvalue()).decode()


def one_mode(args: argparse.Namespace) -> dict:
    from transformers import SiglipImageProcessor

    from encgraph.serving import slots
    from encgraph.serving.preprocess import PreprocessPool

    if args.one == "pipe":
        async def never_wait(self):  # the pool of c22624d: no free slot, through the pipe
            arena = self.current()
            slot = arena.take() if arena is not None and not arena.closed else None
            if slot is None:
                if arena is not None:
                    arena.note_overflow()
                return None, None
            return arena, slot

        slots.FreeSlots.take = never_wait
    processor = SiglipImageProcessor(size={"height": args.size, "width": args.size})
    pool = PreprocessPool({"siglip": processor}, args.workers, slot_count=args.slots).start()
    texts = [_jpeg(args.size, i) for i in range(8)]

    async def main() -> tuple[list[float], float, float]:
        latencies: list[float] = []
        stop = time.perf_counter() + args.seconds

        async def client(k: int) -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await pool.prepare("siglip", [texts[k % len(texts)]])
                latencies.append(time.perf_counter() - t0)
                k += 1

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(args.clients)))
        return latencies, time.perf_counter() - wall0, time.process_time() - cpu0

    try:
        latencies, wall, cpu = asyncio.run(main())
        pipe = pool.stats["overflows"]
    finally:
        pool.close()
    n = len(latencies)
    point = summarize(latencies, n, wall)  # the serving bench's percentiles
    return {"mode": args.one, "requests": n, "requests_per_s": round(n / wall, 1),
            "p50_ms": round(point["p50_ms"], 1), "p99_ms": round(point["p99_ms"], 1),
            "server_cpu_ms": round(1e3 * cpu / n, 2), "pipe_results": pipe}


def render(data: dict) -> str:
    o = data["options"]
    lines = [f"## preprocessing pool ({data['environment']['cpu']}): {o['workers']} workers, {o['slots']} slots, "
             f"{o['clients']} clients, {o['size']} px, {o['seconds']} s per run", "",
             "| mode | runs | requests/s | P50 ms | P99 ms | server CPU ms per request | through the pipe |",
             "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        runs = [r for r in data["runs"] if r["mode"] == mode]
        if not runs:
            continue
        keys = ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms")
        med = {k: statistics.median(r[k] for r in runs) for k in keys}
        share = sum(r["pipe_results"] for r in runs) / max(1, sum(r["requests"] for r in runs))
        lines.append(f"| {mode} | {len(runs)} | {med['requests_per_s']:.1f} | {med['p50_ms']:.1f} "
                     f"| {med['p99_ms']:.1f} | {med['server_cpu_ms']:.2f} | {100 * share:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.one:
        print(json.dumps(one_mode(args)))
        return None
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("workers", "slots", "clients", "seconds", "size")]
    runs = []
    for _ in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, *forwarded, "--one", mode], capture_output=True, text=True,
                                 check=True, timeout=120 + 2 * args.seconds)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[preprocess_pool] {runs[-1]}", file=sys.stderr)
    data = {"environment": {"cpu": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
            "options": {k: getattr(args, k) for k in ("workers", "slots", "clients", "seconds", "size", "repeats")},
            "runs": runs}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "preprocess_pool_cpu.json").write_text(json.dumps(data, indent=1))
    (args.results_dir / "preprocess_pool_cpu.md").write_text(render(data))
    print(render(data))
    return data


if __name__ == "__main__":
    main()
