"""Where a served request's device preprocessing spends its time (issue 57 point 1).

``encgraph serve --preprocess-on device`` measured slower than the host path on an H100 (SigLIP-so400m, 32
clients: 60 ms a request in the preprocess stage against 31 ms on the host, 288 against 366 images/s). This bench
takes the server out of the picture: :meth:`~encgraph.serving.device_preprocess.DeviceProcessing.on_device`, as a
request thread calls it, per request of one decoded photo of mixed size, with

- the GPU idle, or busy as behind a server: a thread replaying a captured graph of bf16 matmuls (about 10 ms a
  replay) on the default stream back to back, as the batching front's worker does;
- 1 or 8 threads calling at once (the server's upload threads);

and, per family, the torchvision processor on the host for one image on one thread (what a preprocessing worker
spends), and a profile of the busy 8-thread case: the CUDA runtime calls and torch ops that took the host's time.
Writes ``benches/results/device_preprocess_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.preprocess_exactness import environment, photo, processors, write

REPO = Path(__file__).resolve().parents[1]
SIZES = ((320, 240), (640, 480), (800, 600), (1024, 768), (1280, 960), (1600, 1200), (1920, 1080), (500, 700))


class Busy:
    """A thread replaying a graph of bf16 matmuls on the default stream until stopped (``None`` off CUDA)."""

    def __init__(self, device: str) -> None:
        import torch

        self.stop = threading.Event()
        self.replays = 0
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                a @ a
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            out = a
            for _ in range(8):
                out = a @ a
        self.out = out
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        self.replay_ms = (time.perf_counter() - t) * 1e3
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self.stop.is_set():
            self.graph.replay()
            self.replays += 1
            if self.replays % 4 == 0:  # the worker waits for its calls' copies now and then; keep the queue short
                torch.cuda.current_stream().synchronize()

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self.stop.set()
        self.thread.join()
        torch.cuda.synchronize()


def run_requests(dp: Any, requests: list[dict[str, Any]], device: str, threads: int, per_thread: int) -> dict:
    """``threads`` threads each calling ``dp.on_device`` on ``per_thread`` requests: the ms each call held its
    thread, and images/s until the device finished them all."""
    import torch

    from encgraph.serving.transfer import Handoff, side_stream_work

    times: list[float] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        mine = []
        for i in range(per_thread):
            arrays = requests[(k * per_thread + i) % len(requests)]
            t = time.perf_counter()
            with side_stream_work(device, Handoff.EVENT):  # as ServedModel.prepare runs it
                dp.on_device(arrays, device, torch.bfloat16)
            mine.append((time.perf_counter() - t) * 1e3)
        with lock:
            times.extend(mine)

    # thread 0's calls run on the calling thread: the one a profiler around this call records
    pool = [threading.Thread(target=work, args=(k,)) for k in range(1, threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    work(0)
    for t in pool:
        t.join()
    if device.startswith("cuda"):  # the work left in flight (an event for the consumer) done too
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times.sort()
    return {"threads": threads, "calls": len(times), "median_ms": round(statistics.median(times), 3),
            "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
            "images_per_s": round(len(times) / wall, 1)}


def profile(dp: Any, requests: list[dict[str, Any]], device: str, threads: int, per_thread: int) -> list[dict]:
    """The ops and runtime calls with the most host time over a run, on the calling thread, one of ``threads``
    (their total ms and count)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:  # CUDA: the runtime calls (cudaMalloc, syncs) too
        run_requests(dp, requests, device, threads, per_thread)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:14]
    return [{"name": e.key, "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "total_ms": round(e.cpu_time_total / 1e3, 2)} for e in rows]


def measure(family: str, args: argparse.Namespace) -> dict[str, Any]:

    from encgraph.serving.device_preprocess import DeviceProcessing

    _, fast = processors(family)
    dp = DeviceProcessing(fast)
    images = [photo(w, h, args.seed + i) for i, (w, h) in enumerate(SIZES)]
    requests = [{k: v.numpy() for k, v in dp([image]).items()} for image in images]
    host = []
    fast(images=[images[0]], return_tensors="pt", device="cpu")  # warm-up
    for image in images:
        t = time.perf_counter()
        fast(images=[image], return_tensors="pt", device="cpu")
        host.append((time.perf_counter() - t) * 1e3)
    row: dict[str, Any] = {"host_torchvision_ms": round(statistics.median(host), 2), "runs": []}
    for _ in range(2):  # warm-up: kernels, the caching allocators, the side streams
        run_requests(dp, requests, args.device, 8, len(requests))
    loads = ("idle", "busy") if args.device.startswith("cuda") else ("idle",)
    for load in loads:
        for threads in (1, 8):
            if load == "busy":
                with Busy(args.device) as busy:
                    r = run_requests(dp, requests, args.device, threads, args.per_thread)
                r["busy_replay_ms"] = round(busy.replay_ms, 2)
            else:
                r = run_requests(dp, requests, args.device, threads, args.per_thread)
            r["load"] = load
            row["runs"].append(r)
            print(family, r, flush=True)
    if args.device.startswith("cuda"):
        with Busy(args.device):
            row["profile_busy_8"] = profile(dp, requests, args.device, 8, 6)
    else:
        row["profile_idle_8"] = profile(dp, requests, args.device, 8, 2)
    return row


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    out = [f"# Device preprocessing per request: {env.get('gpu') or env.get('device')}", "",
           (f"torch {env.get('torch')}, transformers {env.get('transformers')}; {env.get('date')}; "
           f"commit {env.get('commit')}. One decoded photo per request ({len(SIZES)} sizes, 320 x 240 to "
           "1920 x 1080), `DeviceProcessing.on_device` as a request thread calls it."), ""]
    for family, row in doc["families"].items():
        out += [f"## {family}", "", (f"torchvision processor on the host, one image, one thread: median "
                f"{row['host_torchvision_ms']} ms"), "",
                "| GPU | threads | thread held, median ms | P99 ms | images/s |", "|---|---|---|---|---|"]
        out += [f"| {r['load']} | {r['threads']} | {r['median_ms']} | {r['p99_ms']} | {r['images_per_s']} |"
                for r in row["runs"]]
        key = "profile_busy_8" if "profile_busy_8" in row else "profile_idle_8"
        out += ["", f"Host time by op or runtime call, one of the threads ({key}):", "", "| op | count | self ms | total ms |",
                "|---|---|---|---|"]
        out += [f"| `{p['name']}` | {p['count']} | {p['self_ms']} | {p['total_ms']} |" for p in row[key]]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--families", default="siglip_so400m_384,qwen2_5_vl")
    p.add_argument("--per-thread", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(REPO / "benches" / "results"))
    args = p.parse_args(argv)
    import torch

    env = environment(args.device)
    env["gpu"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    doc = {"environment": env,
           "families": {f: measure(f, args) for f in args.families.split(",")}}
    slug = (doc["environment"].get("gpu") or args.device).lower().replace(" ", "-")
    return write(doc, f"device_preprocess_{slug}", args.results_dir, render)


if __name__ == "__main__":
    main()
