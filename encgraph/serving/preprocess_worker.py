"""What runs inside a preprocessing worker process of :class:`~encgraph.serving.preprocess.PreprocessPool`: its
set-up, its start-up task and the preprocessing of one request, and what it hands back (:class:`Prepared`, or a
:class:`WorkerError`).

A worker is spawned, never forked (see :mod:`encgraph.serving.preprocess`). It imports torch and transformers (a
few hundred MB of host memory), runs with one torch thread and no visible CUDA device, and ignores SIGINT: a
terminal's Ctrl-C reaches the whole process group, and the server's graceful shutdown still needs the workers for
the requests it drains; the pool shuts them down after that. SIGTERM ends a worker as usual (the executor itself
stops the workers of a broken pool with it). A worker watches its parent: when the server process dies by any
signal, SIGKILL included, the worker exits within a second (:data:`WATCH_S`), and with the last of them
multiprocessing's resource tracker; the shared-memory file is already gone (:mod:`encgraph.serving.slots`).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import numpy as np

from encgraph.errors import EncgraphError
from encgraph.serving import heap, slots
from encgraph.serving.images import ImageError, ImageLimits, decode_image, name_the_refused

__all__ = ["Prepared", "WorkerError", "WATCH_S", "init_worker", "started", "prepare"]

WATCH_S = 0.5
"""How often a worker checks that the server process, its parent, is still alive."""


class WorkerError(EncgraphError, RuntimeError):
    """An unexpected error in a worker (not a bad image), carried back as text with the worker's traceback: the
    original exception may not pickle, and one that fails to unpickle would break the pool."""


@attrs.frozen(eq=False)
class Prepared:
    """One request's preprocessed images: ``arrays`` (:func:`~encgraph.serving.loading.process_images`'s,
    owned by the receiver: unpickled copies) and ``decode_s``, the worker's seconds decoding the images."""

    arrays: Mapping[str, np.ndarray]
    decode_s: float
    pixels: tuple[int, tuple[int, ...], str] | None = None
    """Where ``pixel_values`` is while the result crosses over: ``(slot, shape, dtype)`` in the pool's shared
    memory (:mod:`encgraph.serving.slots`), ``None``: in ``arrays``. The pool puts it into ``arrays`` before a
    caller sees the result."""


@attrs.define
class _Worker:
    processors: dict[str, Any]
    limits: ImageLimits
    started: Any  # a multiprocessing.Barrier of the pool's workers (see started())
    timeout_s: float
    arena: Any = None  # the pool's shared-memory slots, mapped here (slots.attach), or None
    slot_size: int = 0


_WORKER: _Worker | None = None
"""This worker process's processors and limits (set by :func:`init_worker`; ``None`` in the server process)."""


def init_worker(processors: Mapping[str, Any], limits: ImageLimits, started: Any, timeout_s: float,
                arena_path: str | None = None, slot_size: int = 0) -> None:
    """The executor's initializer: set a worker up, then warm it: each processor preprocesses one tiny image, so
    that a request's first call pays no lazy import."""
    global _WORKER
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CUDA context would cost GPU memory per worker; none is needed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # see the module's docstring
    # Tearing torch and transformers down at exit takes 1-2 s per process (measured on a 2-core host), which the
    # server's shutdown would wait for. A worker owns no files or state that needs it: multiprocessing has run its
    # own exit hooks and flushed the streams before the interpreter's atexit callbacks, the callbacks registered
    # after this one (the libraries') still run first, and the executor reads no exit status.
    atexit.register(os._exit, 0)
    import torch
    from PIL import Image

    from encgraph.serving.loading import process_images

    _watch_parent(os.getppid())
    torch.set_num_threads(1)  # one core per worker: the pool's size is its share of the host
    arena = slots.attach(arena_path) if arena_path else None
    _WORKER = _Worker(dict(processors), limits, started, timeout_s, arena, slot_size)
    tiny = Image.new("RGB", (64, 64), (127, 127, 127))
    for processor in _WORKER.processors.values():
        process_images(processor, [tiny])
    # Warm: out of the garbage collector's reach, so that a full collection does not stall a request for the
    # ~200 ms of walking torch's and transformers' objects (encgraph.serving.heap).
    heap.freeze()


def _watch_parent(parent: int) -> None:
    """Exit this worker when its parent (the server) is gone: a worker orphaned by a killed server would otherwise
    wait on the executor's queue for ever, holding its memory and the resource tracker. A thread, not
    PR_SET_PDEATHSIG: that signal follows the parent thread that spawned the worker, which may end first."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="encgraph-watch-parent", daemon=True).start()


def started() -> int:
    """A start-up task: this worker's pid, once every worker of the pool holds one such task. A worker runs one
    task at a time, so the pool's tasks are then held by as many distinct workers: every one is spawned and warm,
    and the pids are all of the pool's."""
    assert _WORKER is not None
    _WORKER.started.wait(_WORKER.timeout_s)
    return os.getpid()


def prepare(model: str, texts: Sequence[str], slot: int | None = None) -> Prepared:
    """Decode ``texts`` (``input[i]``, i from 0) and run ``model``'s processor over them, in a worker; the pixels
    go into shared-memory ``slot`` when given and they fit."""
    from encgraph.serving.loading import process_images

    worker = _WORKER
    if worker is None:  # pragma: no cover - only reached if the module is misused in the server process
        raise WorkerError("encgraph.serving.preprocess_worker.prepare runs in a pool worker only.")
    try:
        t0 = time.perf_counter()
        images = [decode_image(text, i, worker.limits) for i, text in enumerate(texts)]
        decode_s = time.perf_counter() - t0
        arrays = name_the_refused(partial(process_images, worker.processors[model]), images)
        pixels = arrays["pixel_values"]
        if (slot is not None and worker.arena is not None and pixels.flags.c_contiguous
                and slots.write(worker.arena, slot, worker.slot_size, pixels)):
            rest = {k: v for k, v in arrays.items() if k != "pixel_values"}
            return Prepared(rest, decode_s, (slot, tuple(pixels.shape), pixels.dtype.str))
        return Prepared(arrays, decode_s)
    except ImageError:
        raise
    except Exception as exc:
        raise WorkerError(f"preprocessing in worker process {os.getpid()} failed: {type(exc).__name__}: {exc}\n"
                          f"{traceback.format_exc()}") from None
