"""The stream a runner captures on: a CUDA stream of its own, on which nothing but its captures ever runs.

Why: cuBLAS's workspaces. torch caches one cuBLAS (and cuBLASLt) workspace per handle and stream, allocated at the
first matmul on that stream, and every matmul captured on the stream bakes that workspace's address into its graph.
Captured on a stream that ran eager matmuls before (a warm-up; torch's pool streams, which ``torch.cuda.Stream()``
hands out round-robin to everyone in the process), the graphs use a workspace in ordinary memory that they do not
own, and two things free it while they live:

- ``torch._C._cuda_clearCublasWorkspaces()``, which ``torch.compile(mode="reduce-overhead")`` runs before and after
  each of its warm-ups and recordings: any model in the process compiled that way (an LLM beside the vision tower)
  frees every stream's workspace;
- ``CUDAGraph.reset()`` on torch versions that clear the capture stream's workspaces there (pytorch issue 193402):
  another user of the same pool stream dropping its graphs.

Each replay then writes the matmuls' scratch into memory the allocator has since given to someone else. Measured on
an H100 (torch 2.11, ``tests/gpu/test_cublas_workspace_gpu.py``): after the global clear, replays of a split-K-prone
MLP changed 196,607 elements of tensors allocated over the freed memory (their own outputs stayed right).

Each runner captures on a stream of its own instead, which no eager work ever uses, and whose workspaces live in a
graph pool of the stream's own: before the runner's captures, a small capture of a matmul with and without bias (the
cuBLAS and the cuBLASLt paths) on the stream, into that pool, makes the calling thread's workspaces for the stream
there, where no ordinary allocation can take them, and every later capture on the stream finds and bakes them. A
clear gives a workspace back to that pool (kept alive by those small graphs, which are never replayed nor dropped),
and the next priming makes it again there, in the same block. Not in the runner's own pool: on torch versions whose
``CUDAGraph.reset()`` does not clear its capture stream's workspaces (2.11 does not), the workspace cached for a
stream would keep a dropped runner's pool alive (33 MiB per runner, measured), and a recycled stream would bake a
workspace that a clear frees into that dead pool, and on to anyone.

The streams are made through the CUDA driver (torch makes none but its pool's and, through ``torch.cuda.cudart()``,
blocking ones, which any work on the legacy default stream in another thread would break while capturing),
non-blocking as torch's own are. A runner keeps its stream while it lives (two runners' graphs can replay at once on
different streams: each has its own workspace); when it goes, the stream goes back to a free list for the next
runner on the device, never destroyed (a new stream given the same handle would inherit its cached workspaces).

Limit: a clear *during* a runner's captures, from another thread, makes its next capture allocate the workspace in
the runner's pool; on torch 2.11 that workspace then outlives the runner, and a clear after that frees it under the
graphs of the stream's next runner.

Where the driver library cannot be loaded, the runner captures on a torch pool stream, with a warning, and
``capture_info["capture_stream"]`` says so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import weakref
from typing import Any

import torch

from encgraph.capture.graph_steps import end_failed_capture, error_line

__all__ = ["capture_stream"]

log = logging.getLogger("encgraph")

_CU_STREAM_NON_BLOCKING = 1


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")  # the CUDA driver API, installed with every NVIDIA driver on Linux
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} returned CUDA driver error {result}")


def _new_stream(ordinal: int) -> int:
    """A new non-blocking stream in the primary context of device ``ordinal`` (the one torch's runtime uses)."""
    lib = _driver()
    _check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            stream = ctypes.c_void_p()
            _check(lib.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        finally:
            popped = ctypes.c_void_p()
            lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)  # the runtime holds its own reference to the primary context
    if not stream.value:
        raise RuntimeError("cuStreamCreate returned a null stream")
    return int(stream.value)


class _OwnStream:
    """One stream we made, the pool its workspaces live in, and the small graphs that keep that pool alive."""

    def __init__(self, device: torch.device, handle: int) -> None:
        self.device = device
        self.stream = torch.cuda.ExternalStream(handle, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.primers: list[torch.cuda.CUDAGraph] = []

    def prime(self) -> None:
        """Make the calling thread's cuBLAS and cuBLASLt workspaces for the stream, in the stream's pool (or find
        them there): a matmul without bias and one with, run eagerly on the calling stream, then captured on it. Its
        graph is kept (never replayed): dropping it would let the pool go, and on some torch versions clear the
        stream's workspaces."""
        # float16: cuBLAS and cuBLASLt run it on every CUDA device torch supports (bfloat16 needs sm80); the
        # workspaces are the handle's and the stream's, whatever the dtype.
        a = torch.ones(16, 16, device=self.device, dtype=torch.float16)
        bias = torch.zeros(16, device=self.device, dtype=torch.float16)
        # First eagerly, on the calling stream: the thread's cuBLAS and cuBLASLt handles are created at their first
        # use, with device allocations that no capture may make (in a fresh process's first capture, the priming
        # failed with "operation failed due to a previous error during capture").
        torch.mm(a, a)
        torch.addmm(bias, a, a)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            torch.mm(a, a)
            torch.addmm(bias, a, a)
        self.primers.append(graph)


_free: dict[int, list[_OwnStream]] = {}
_leased: weakref.WeakKeyDictionary[object, _OwnStream] = weakref.WeakKeyDictionary()  # a runner captures again
_free_lock = threading.RLock()  # a runner collected while it is held gives its stream back in this thread


def _give_back(ordinal: int, own: _OwnStream) -> None:
    with _free_lock:
        _free.setdefault(ordinal, []).append(own)


def capture_stream(owner: object, device: torch.device) -> tuple[torch.cuda.Stream, str]:
    """A stream for ``owner`` (a runner) to capture on that no other work uses while ``owner`` lives (the same one
    each time ``owner`` captures), its cuBLAS workspaces primed in its own pool (see the module's docstring), and
    how it was made: ``"own"``, or ``"torch pool (<why>)"`` where the driver could not make one (logged)."""
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    with _free_lock:
        own = _leased.get(owner)  # ``recapture()``: the runner's stream, primed again
        fresh = own is None
        if fresh:
            free = _free.get(ordinal)
            own = free.pop() if free else None
    if own is None:
        try:
            own = _OwnStream(device, _new_stream(ordinal))
        except (OSError, AttributeError, RuntimeError) as exc:
            reason = error_line(exc)
            log.warning(
                "encgraph: could not make a CUDA stream of its own to capture on (%s); capturing on a torch pool "
                "stream, whose cuBLAS workspace other code in the process can free under the graphs "
                "(torch.compile(mode='reduce-overhead') does): see encgraph/capture/streams.py.", reason
            )
            return torch.cuda.Stream(device), f"torch pool ({reason})"
    if fresh:
        with _free_lock:
            _leased[owner] = own
        weakref.finalize(owner, _give_back, ordinal, own)
    try:
        own.prime()
    except Exception as exc:  # noqa: BLE001 - the captures can go on; the hazard above is back, and said
        end_failed_capture(device, own.pool)
        if not own.primers:  # no graph holds the pool: the next priming starts a fresh one
            own.pool = torch.cuda.graph_pool_handle()
        reason = error_line(exc)
        log.warning("encgraph: priming the capture stream's cuBLAS workspaces failed (%s); the captured matmuls use "
                    "workspaces in the graphs' own pool: see encgraph/capture/streams.py.", reason)
        return own.stream, f"own, not primed ({reason})"
    return own.stream, "own"
