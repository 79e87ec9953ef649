"""Cold and warm capture of ``encgraph.graphed(tower)``: how long a user waits before the first fast call.

- cold: ``capture()`` in the benchmark process, with every compile cache pointed at a fresh, empty directory
  (:func:`cache_env`);
- warm: a second, fresh Python process on the same machine (``python -m benches.lib.startup``) that builds the
  same tower (same seed, device and dtype), wraps it with ``graphed()`` and calls ``capture()`` with the same
  cache directory (:func:`warm_capture`). It reports its own phases; the parent adds the whole process's seconds.

The cache variables: ``ENCGRAPH_CACHE_DIR`` (encgraph's compile cache), ``TORCHINDUCTOR_CACHE_DIR`` (inductor's
FX-graph and AOTAutograd caches) and ``TRITON_CACHE_DIR`` (``<dir>/triton``: kernels; set explicitly so that
no earlier setting in the process points elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benches.lib.env import Env, short_error
from benches.lib.results import REPO, child_env, json_ready

WARM_TIMEOUT = 120.0


def cache_vars(directory: Path) -> dict[str, str]:
    """The environment that points every compile cache at ``directory``."""
    return {"ENCGRAPH_CACHE_DIR": str(directory), "TORCHINDUCTOR_CACHE_DIR": str(directory),
            "TRITON_CACHE_DIR": str(directory / "triton")}


@contextlib.contextmanager
def cache_env(directory: Path | None = None) -> Iterator[Path]:
    """Point the compile caches of this process at ``directory`` (default: a fresh temporary one, removed
    afterwards) for the duration; the previous values come back after."""
    made = directory is None
    path = Path(tempfile.mkdtemp(prefix="encgraph-bench-cache-")) if directory is None else Path(directory)
    saved = {k: os.environ.get(k) for k in cache_vars(path)}
    os.environ.update(cache_vars(path))
    try:
        yield path
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if made:
            shutil.rmtree(path, ignore_errors=True)


def cache_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory`` (what the caches hold)."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def warm_capture(tower: str, env: Env, directory: Path, *, timeout: float = WARM_TIMEOUT) -> dict[str, Any]:
    """Run the warm capture of ``tower`` in a second process with the caches at ``directory``; its report, plus
    ``process_seconds`` (start to exit), or ``{"error": ...}`` (a timeout kills the process)."""
    cmd = [sys.executable, "-m", "benches.lib.startup", "--tower", tower, "--seed", str(env.seed),
           "--device", str(env.device), "--dtype", str(env.dtype).replace("torch.", "")]
    if env.tiny:
        cmd.append("--tiny")
    env_vars = child_env(**cache_vars(Path(directory)))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env_vars, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s (killed)", "process_seconds": round(timeout, 1)}
    seconds = round(time.perf_counter() - t0, 3)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:300]}", "process_seconds": seconds}
    return {**json.loads(lines[-1]), "process_seconds": seconds}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benches.lib.startup",
                                description="the warm capture: build a tower, graphed(tower).capture(), print JSON")
    p.add_argument("--tower", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="the tower's tiny config (the CPU smoke)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The second process: one JSON line on stdout with its phases in seconds and the capture summary."""
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    import torch

    import encgraph
    from benches.lib.towers import TOWERS, build_tower

    env = Env(torch.device(args.device), getattr(torch, args.dtype), args.tiny, 1, 0, args.seed)
    t1 = time.perf_counter()
    tower = build_tower(TOWERS[args.tower], env)
    t2 = time.perf_counter()
    module = encgraph.graphed(tower)
    t3 = time.perf_counter()
    with torch.inference_mode():
        info = encgraph.graphs(module).capture()
    t4 = time.perf_counter()
    report = {"capture_seconds": round(t4 - t3, 3), "graphed_seconds": round(t3 - t2, 3),
              "build_seconds": round(t2 - t1, 3), "import_seconds": round(t1 - t0, 3),
              "capture_info": json_ready(info)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(short_error(exc), file=sys.stderr)
        raise
