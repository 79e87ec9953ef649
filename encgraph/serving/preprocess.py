"""Decoding and preprocessing of request images in worker processes (``encgraph serve --preprocess-workers N``).

Why processes: a request's host work (base64, Pillow's decode, the transformers image processor; about 12 ms per
384 px SigLIP image) is Python that holds the GIL. Run in the server's threads it competes with the batching
front's worker thread that launches the graph replays, so the server slows down as clients are added. In a
:class:`PreprocessPool` it runs in other processes, on other cores; the server process keeps the parsing, the
copy to the device, the replays and the answers.

One pool per server, shared by every served model: each worker holds every model's image processor (a few KB of
configuration each) and a request names its model. The pool's size is a budget of host cores, not a property of a
model, and one pool lets a busy model use all of it; a pool per model would leave the cores of an idle model's
pool unused, or oversubscribe the host with several.

What crosses the process boundary:

- to a worker (pickled through the executor's pipe): the model's name, the request's image strings (base64, as the
  request sent them) and a free shared-memory slot, if any;
- back: a :class:`Prepared`: the processor's arrays of :func:`~encgraph.serving.loading.process_images` (float32
  ``pixel_values``: ``(images, 3, H, W)`` for batch towers, about 1.8 MB per 384x384 image; Qwen-VL's patch rows
  and int64 ``image_grid_thw``) and the seconds the worker spent decoding; or the request's
  :class:`~encgraph.serving.images.ImageError` (a bad image, or the image the processor refused). The pixels are
  written into the slot (:mod:`encgraph.serving.slots`) and copied out once by the server (a request waits for a
  free slot while all are in use); the rest, and pixels over a slot's size, are pickled through the pipe.

Through the pipe, one 384 px image's trip back cost the worker 8-11 ms of system time on this repository's 2-core
VM (pipe writes, page faults of fresh buffers) on top of its 12 ms of work, and the server process 1-4 ms: 8
workers' ~30 ms per image matches the ~260 images/s at which the H200 server stopped. Through slots, 2 workers at
8 concurrent requests went from 85 to 114 requests/s (from 42 to 99 in a run beside another test run), and the
server's CPU per request from 3.0 to 1.9 ms.

Workers are started with the ``spawn`` method, never forked: the server process holds a CUDA context and threads,
which a forked child would inherit broken (so a program that makes a pool must guard its main module with
``if __name__ == "__main__"``, as ``python -m encgraph`` does: each worker imports it). What a worker runs, how it
ignores Ctrl-C and exits when the server dies: :mod:`encgraph.serving.preprocess_worker`. The pool shuts the workers
down after the server's graceful shutdown has drained its requests (:meth:`PreprocessPool.close`).

A worker that dies (killed, out of memory, a crash in a native decoder) breaks the executor: every request it
held fails with :class:`WorkerDiedError` (the server answers 503 with ``Retry-After``), and the first of them
replaces the executor with a new one, once per death (``restarts``); the requests after it run on the new workers.
On CPython before 3.11.5 (Debian 12's 3.11.2 among them) a broken executor's thread could wait for good on its
call queue's feeder, blocked writing to a pipe no worker reads any more (python/cpython#94777), and the process
then hung at exit: :func:`unblock_broken` does what CPython's fix does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from encgraph.errors import ConfigError, EncgraphError, ShutdownError
from encgraph.serving import preprocess_worker, slots
from encgraph.serving.images import ImageLimits
from encgraph.serving.preprocess_worker import Prepared, WorkerError

__all__ = ["PreprocessPool", "Prepared", "WorkerDiedError", "WorkerError", "default_workers"]

log = logging.getLogger("encgraph.serve")


FEEDER_FIXED = (3, 11, 5)
"""The first CPython of 3.11 whose ``ProcessPoolExecutor`` closes a broken pool's call-queue reader itself
(python/cpython#94777, in 3.12.0 too)."""


def call_queue(executor: concurrent.futures.ProcessPoolExecutor) -> Any:
    """``executor``'s call queue (the pipe its workers read requests from), read before ``shutdown()``, which
    drops it; None where this CPython's executor has none."""
    return getattr(executor, "_call_queue", None)


def unblock_broken(queue: Any) -> bool:
    """On a CPython before :data:`FEEDER_FIXED`, close the parent's read end of a broken executor's call ``queue``
    (:func:`call_queue`), as CPython's fix does: once the workers' own copies of that end are gone with them, its
    feeder thread, blocked writing a queued request to a pipe nobody reads, fails that write and ends, so the
    executor's thread ends and the interpreter can exit (without it, the tests that kill a worker passed, then
    their process waited forever at exit on Debian 12's Python 3.11.2). Workers still alive keep reading their own
    copies, so this is safe at any time after the pool broke. Returns whether it closed anything (never on a fixed
    CPython, where the executor does it itself and a second close could race with it)."""
    if sys.version_info >= FEEDER_FIXED:
        return False
    reader = getattr(queue, "_reader", None)
    if reader is None or reader.closed:
        return False
    try:
        reader.close()
    except OSError:
        return False
    return True


class WorkerDiedError(EncgraphError, RuntimeError):
    """A preprocessing worker process died while the pool held this request: it was not run; retry it."""


def default_workers(devices: Iterable[Any]) -> int:
    """``--preprocess-workers auto``: 0 (the server's threads) when every served tower is on the CPU, whose
    forward needs those cores; else half the cores this process may run on, 1 to 8."""
    if all(getattr(d, "type", str(d)) == "cpu" for d in devices):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return min(8, max(1, cores // 2))


# ------------------------------------------------------------------------------------------ in the server process
class PreprocessPool:
    """``workers`` spawned processes that turn one request's image strings into its processor's arrays.

    ``processors``: model name -> the transformers image processor the server built for it (pickled to each
    worker, so a worker's is the same configuration); ``limits``: the server's per-image limits. Use: ``start()``
    (blocks until every worker is warm), then ``await prepare(model, texts)`` from the server's event loop, then
    ``close()``. ``restarts`` counts the executors replaced after a worker died; ``pids`` are the current
    workers' process ids (after a restart, once the new workers are warm)."""

    def __init__(self, processors: Mapping[str, Any], workers: int, limits: ImageLimits = ImageLimits(), *,
                 start_timeout_s: float = 300.0, slot_bytes: int = slots.SLOT_BYTES,
                 slot_count: int | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers: expected an int >= 1 (preprocessing processes), got {workers!r}; use no pool "
                              "to preprocess in the server's threads.")
        if not processors:
            raise ConfigError("processors: expected at least one model's image processor, got none.")
        self.processors = dict(processors)
        self.workers = workers
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.pids: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._generation = 0
        self._closed = False
        # Shared-memory slots for the pixels coming back (encgraph.serving.slots): enough for every request a
        # busy server has queued at the pool; 0 bytes: all through the pipe.
        self.slot_bytes = slot_bytes
        self.slot_count = slot_count if slot_count is not None else max(8, 4 * workers)
        self._arena: slots.Arena | None = None
        self._past_overflows = 0  # of the arenas of earlier generations
        self._free = slots.FreeSlots(lambda: self._arena)  # requests waiting for a free slot

    @property
    def stats(self) -> dict[str, int]:
        """``slots`` and ``slot_bytes`` of the current arena (0: none), ``overflows``: results that came through
        the pipe instead (pixels larger than a slot), over the pool's life."""
        arena = self._arena
        return {"slots": arena.count if arena else 0, "slot_bytes": arena.size if arena else 0,
                "overflows": self._past_overflows + (arena.overflows if arena else 0)}

    def _make_arena(self) -> slots.Arena | None:
        """A new arena (the old one closed), as large as half the free space of its directory allows."""
        old, self._arena = self._arena, None
        if old is not None:
            self._past_overflows += old.overflows
            old.close()
        if not self.slot_bytes or not self.slot_count:
            return None
        where = slots.directory()
        room = os.statvfs(where)
        # Half the free space at most: a container's /dev/shm is often 64 MB, and a write past it is a SIGBUS.
        count = min(self.slot_count, room.f_bavail * room.f_frsize // (2 * self.slot_bytes))
        if count < self.slot_count:
            log.warning("encgraph serve: %s has room for %d of %d preprocessing slots of %d MiB; the other results "
                        "come through the pipe (slower)", where, count, self.slot_count, self.slot_bytes >> 20)
        if count < 1:
            return None
        self._arena = slots.Arena(count, self.slot_bytes)
        return self._arena

    def start(self) -> PreprocessPool:
        """Spawn the workers and wait until each has loaded its processors and preprocessed a tiny image."""
        with self._lock:
            if self._closed or self._executor is not None:
                raise ConfigError("start: the pool was already started (or closed); make a new PreprocessPool.")
            self._executor, warm = self._spawn(self._generation)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            pids = [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in warm]
        except (BrokenProcessPool, threading.BrokenBarrierError, TimeoutError) as exc:
            self.close()
            raise ConfigError(f"--preprocess-workers {self.workers}: the worker processes did not start "
                              f"({type(exc).__name__}: {exc or 'timed out'}; the limit is {self.start_timeout_s} s); "
                              "see the log above for a worker's traceback, or use --preprocess-workers 0.") from None
        self.pids = tuple(pids)
        log.info("encgraph serve: %d preprocessing workers ready (pids %s)", self.workers, pids)
        return self

    def _spawn(self, generation: int) -> tuple[concurrent.futures.ProcessPoolExecutor, list[concurrent.futures.Future]]:
        context = multiprocessing.get_context("spawn")
        # A barrier reaches a spawned worker only as an argument of its process: the initializer's.
        started = context.Barrier(self.workers)
        arena = self._make_arena()  # a new one per generation: a dead worker's slots are never reused
        executor = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=preprocess_worker.init_worker,
            initargs=(self.processors, self.limits, started, self.start_timeout_s,
                      arena.path if arena is not None else None, self.slot_bytes))
        # Submitted together, before any worker can have started: the executor spawns a process for each
        # submission while none is idle, so all of them start (and warm up) now, not on a request.
        warm = [executor.submit(preprocess_worker.started) for _ in range(self.workers)]

        def ready(_: concurrent.futures.Future) -> None:  # on the executor's thread, as each worker is warm
            if all(f.done() for f in warm) and generation == self._generation:
                self.pids = tuple(f.result() for f in warm if not f.cancelled() and f.exception() is None)
                if arena is not None and len(self.pids) == self.workers:
                    arena.unlink()  # every worker has mapped it: no file to leave behind, whatever kills us

        for future in warm:
            future.add_done_callback(ready)
        return executor, warm

    async def prepare(self, model: str, texts: Sequence[str]) -> Prepared:
        """``model``'s arrays for one request's image strings. Raises the request's
        :class:`~encgraph.serving.images.ImageError`, :class:`WorkerDiedError` (a worker died: retry),
        :class:`WorkerError`, or :class:`~encgraph.errors.ShutdownError` (the pool is closed or closing)."""
        closed = ShutdownError("the preprocessing pool is closed (the server is shutting down).")
        if self._executor is None:
            raise closed
        while True:
            arena, slot = await self._free.take()
            # Read after the wait, with no await in between (the event loop runs one task at a time), so that the
            # slot, the executor and the generation belong together.
            executor, generation = self._executor, self._generation
            if arena is None or arena is self._arena:
                break
            # A slot of an arena that a restart replaced while this request waited: the new workers map the new
            # arena, where this index may be another request's. Take one of the new arena.
        if executor is None:
            self._free.give(arena, slot)
            raise closed
        try:
            future = executor.submit(preprocess_worker.prepare, model, list(texts), slot)
        except BrokenProcessPool:  # the executor broke since its last request: this one is the first to see it
            # The slot is not given back: its arena goes with this generation, and the requests waiting for one
            # take a slot of the new arena once the restart wakes them.
            raise await self._died(generation) from None
        except RuntimeError:  # shut down by close() since the read above
            self._free.give(arena, slot)
            raise closed from None
        out: dict[str, Any] = {}
        if slot is not None:  # registered before the loop's own callback: it runs first, on the executor's thread
            future.add_done_callback(lambda f: self._settle_slot(f, arena, slot, out))
        try:
            prepared = await asyncio.wrap_future(future)
        except BrokenProcessPool:
            raise await self._died(generation) from None
        except asyncio.CancelledError:  # the slot is given back once the worker is done with it (_settle_slot)
            if future.cancelled() and self._closed:  # cancelled by close(), not by the request's own task
                raise closed from None
            raise
        if prepared.pixels is None:
            return prepared
        if "pixels" not in out:  # the copy out of the slot raised (logged by the executor's thread)
            raise WorkerError("the preprocessed pixels could not be read out of their shared-memory slot.")
        return Prepared({**prepared.arrays, "pixel_values": out["pixels"]}, prepared.decode_s)

    def _settle_slot(self, future: concurrent.futures.Future, arena: slots.Arena, slot: int,
                     out: dict[str, Any]) -> None:
        """Once a request's worker is done (on the executor's thread, before the event loop hears of it): its
        pixels copied out of ``slot`` into ``out["pixels"]`` and the slot given back, so that neither the copy nor
        the slot's wait for the loop is the event loop's. A broken pool's slot is not given back (its arena goes
        with its generation)."""
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, BrokenProcessPool):
            return
        try:
            if not future.cancelled() and exc is None:
                prepared = future.result()
                if prepared.pixels is not None:
                    out["pixels"] = arena.read(*prepared.pixels)
                else:  # larger than a slot: it came through the pipe
                    arena.note_overflow()
        finally:
            self._free.give(arena, slot, threadsafe=True)

    async def _died(self, generation: int) -> WorkerDiedError:
        restart = await asyncio.to_thread(self._restart, generation)
        self._free.wake(every=True)  # those waiting for a slot of the old arena take one of the new
        return WorkerDiedError(f"a preprocessing worker process died while this request was queued or running; it "
                               f"was not run: retry it ({restart}).")

    def _restart(self, generation: int) -> str:
        """Replace the broken executor of ``generation`` (once: the other requests it failed find it replaced)."""
        with self._lock:
            if self._closed:
                return "the server is shutting down"
            if generation != self._generation:
                return f"the pool was restarted already, restart {self.restarts}"
            broken = self._executor
            self.pids = ()
            self._generation += 1
            self._executor, _ = self._spawn(self._generation)  # its workers warm up while requests queue behind
            self.restarts += 1
            restart = self.restarts
        log.warning("encgraph serve: a preprocessing worker died; restarted the pool of %d workers (restart %d)",
                    self.workers, restart)
        if broken is not None:
            unblock_broken(call_queue(broken))
            broken.shutdown(wait=False)  # its processes are gone or terminated; this lets its thread finish
        return f"the pool restarted, restart {restart}"

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what is queued, let each worker finish its current request and exit; past ``timeout_s``,
        kill the workers. Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            pids = self.pids
        if executor is None:
            return
        queue = call_queue(executor)  # before shutdown() drops it
        waiter = threading.Thread(target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                  name="encgraph-preprocess-close", daemon=True)
        waiter.start()
        waiter.join(timeout_s)
        if waiter.is_alive():
            log.warning("encgraph serve: preprocessing workers %s still busy after %s s; killing them", pids, timeout_s)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            unblock_broken(queue)  # every worker is dead: nothing reads the call queue's pipe
            waiter.join(timeout_s)
        with self._lock:
            arena, self._arena = self._arena, None
            if arena is not None:
                self._past_overflows += arena.overflows
        if arena is not None:
            arena.close()  # its file goes; a request still reading keeps its mapping
        self._free.wake_threadsafe(every=True)  # those waiting for a slot find the pool closed
