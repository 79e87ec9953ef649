"""Where and how a script measures (:class:`Env`), its time budget (:class:`Deadline`), and small process helpers
(progress log, memory release, one-line errors, inference mode)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs

SMOKE_RUNS = 2
SMOKE_WARMUP = 1
SKIPPED_TIME = "skipped: time budget spent"


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


def cuda_env(runs: int, warmup: int = 0) -> Env:
    """An :class:`Env` of the current CUDA device (bf16) for scripts without the common options: timing only."""
    import torch

    return Env(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, False, runs, warmup, 0)


class Deadline:
    """A time budget: measurements check ``left()`` before they start (never in the middle)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def expired(self, need: float = 0.0) -> bool:
        return self.left() < need

    def share(self, parts: int) -> Deadline:
        """A deadline of this one's remaining time split evenly over ``parts`` (for the first of them): what is
        left unused by one part goes to the next ones."""
        return Deadline(max(self.left(), 0.0) / max(parts, 1))


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:400]


def free_memory() -> None:
    """Collect garbage and return cached device memory (between towers and after a failure)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def inference() -> Iterator[None]:
    import torch

    with torch.inference_mode():
        yield


def log(message: str) -> None:
    """Progress to stderr (stdout keeps the table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
