"""Shared-memory slots through which preprocessing workers hand a request's pixels to the server process.

Through the process pool's pipe, a request's float32 ``pixel_values`` (1.8 MB for one 384 px SigLIP image) is
pickled, written in 64 KB pieces, read back into fresh (page-faulting) buffers and unpickled: on this
repository's 2-core CPU 2.9 ms of the server process's CPU per image, most of the 4.4-5.7 ms a pool round trip
cost it, while the server process is the one whose GIL the replays, the HTTP parsing and the answers share (an
H200 host served at most ~260 images/s through 8 workers). Through a slot the worker writes the array into memory
both processes map, and the server copies it out once.

An :class:`Arena` is ``count`` slots of ``size`` bytes in one file under ``/dev/shm`` (the temporary directory
where there is none), created by the server process, mapped by it and by each worker (:func:`attach`), removed
by :meth:`Arena.close`. The server takes a free slot for each request it submits and gives it back after it
copied the result out, or, for a request whose task was cancelled, once the worker is done with it. A request
that finds every slot taken waits for one (:class:`~encgraph.serving.preprocess.PreprocessPool`: the pool's
workers hold far fewer requests than there are slots, so the wait costs nothing the pool's own queue would not);
pixels larger than a slot come through the pipe as before (counted: ``Arena.overflows``). Measured on an H200
host with 8 workers and 32 slots, when a free slot was taken or else the pipe used: at 128 clients 80-90% of the
requests found none free, and throughput fell back to the pipe's ~260 images/s. On this repository's 2-core VM
(``benches/preprocess_pool.py``: 2 workers, 4 slots, 16 clients, 384 px SigLIP; medians of 3 runs each) waiting
for a slot served 154 requests/s at P99 123 ms and 1.18 ms of the server's CPU per request, the pipe 129 at
155 ms and 2.84 ms.
A pool that restarts after a worker died makes a new arena: a slot of the old one is never handed out again,
whatever a dying worker was writing there.

The file's name is removed as soon as every worker has mapped it (:meth:`Arena.unlink`; the mappings stay), so
that a server killed by any signal leaves no file behind; a file left by a server killed while its workers were
starting names that server's pid and is removed by the next arena made on the machine (:func:`sweep`).
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Arena", "FreeSlots", "SLOT_BYTES", "attach", "directory", "sweep", "write", "read"]

_PREFIX = "encgraph-preprocess-"

SLOT_BYTES = 8 * 2**20
"""Bytes per slot (default): four 384 px SigLIP images, or a Qwen2.5-VL image of about 2.5 megapixels, in float32."""


def directory() -> str:
    """Where arenas live: /dev/shm (memory), or the temporary directory where there is none."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Arena:
    """``count`` slots of ``size`` bytes, mapped in this process (the server's); see the module's docstring.
    Thread-safe: slots are taken on the event loop and given back from the executor's threads."""

    def __init__(self, count: int, size: int = SLOT_BYTES) -> None:
        self.count, self.size = count, size
        sweep()
        fd, self.path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory())
        try:
            os.ftruncate(fd, count * size)
            self.map = mmap.mmap(fd, count * size)
        finally:
            os.close(fd)
        self._free = collections.deque(range(count))
        self._lock = threading.Lock()
        self._closed = False
        self.overflows = 0  # results that came through the pipe, larger than a slot

    def take(self) -> int | None:
        """A free slot, or ``None`` (none free, or the arena is closed); nothing is counted."""
        with self._lock:
            if self._free and not self._closed:
                return self._free.popleft()
            return None

    @property
    def closed(self) -> bool:
        return self._closed

    def give(self, slot: int | None) -> None:
        """Give ``slot`` back (``None``: nothing to give)."""
        if slot is None:
            return
        with self._lock:
            if not self._closed:
                self._free.append(slot)

    def note_overflow(self) -> None:
        with self._lock:
            self.overflows += 1

    def read(self, slot: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A copy (owned by the caller) of the array a worker wrote into ``slot``."""
        return read(self.map, slot, self.size, shape, dtype).copy()

    def unlink(self) -> None:
        """Remove the file's name (idempotent): the memory stays mapped here and in the workers that attached."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Remove the file; the mapping goes with the last reference (a reader in flight still reads it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free.clear()
        self.unlink()


def sweep() -> list[str]:
    """Remove the arena files whose server process is gone (one killed before its workers had mapped its arena);
    the paths removed."""
    where = directory()
    removed = []
    for name in os.listdir(where):
        pid_text = name[len(_PREFIX):].split("-", 1)[0] if name.startswith(_PREFIX) else ""
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(where, name))
            removed.append(os.path.join(where, name))
        except OSError:  # another user's, or removed meanwhile
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class FreeSlots:
    """Requests waiting for a free slot of a pool's current arena, first come, first served (the server's event
    loop side: :meth:`take` and :meth:`give` run on the loop; :meth:`give` with ``threadsafe`` and
    :meth:`wake_threadsafe` from other threads). ``current`` returns the pool's arena now (``None``: none, or
    closed), read again after each wait: a restart replaces it.

    A slot given back while requests wait goes to the first of them directly, never to the free list: otherwise
    the request that gave it, taking its next slot in the same step of the loop, would take it again before the
    woken one runs, and a few requests would keep the slots while the others starved (measured: 4 slots among 16
    requests on the CPU, a P50 of 10 ms for the requests that completed and the rest stalled)."""

    def __init__(self, current: Callable[[], Arena | None]) -> None:
        self.current = current
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self) -> tuple[Arena | None, int | None]:
        """A free slot and its arena, waiting while every slot is in use or others wait before; ``(None, None)``
        when there is no open arena (the result comes through the pipe)."""
        self._loop = asyncio.get_running_loop()
        arena = self.current()
        while arena is not None and not arena.closed:
            slot = None if self._waiters else arena.take()  # no overtaking those who wait
            if slot is not None:
                return arena, slot
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self.give(*waiter.result())  # handed a slot, then cancelled: it goes to the next one
                raise
            if handed is not None:
                return handed
            arena = self.current()  # woken to look again: the arena was replaced or closed
        return None, None

    def give(self, arena: Arena | None, slot: int | None, *, threadsafe: bool = False) -> None:
        """Give ``slot`` of ``arena`` to the first request waiting, or back to ``arena`` (``threadsafe``: from a
        thread other than the loop's)."""
        if arena is None or slot is None:
            return
        if threadsafe:
            if not self._on_loop(self.give, arena, slot):
                arena.give(slot)
            return
        if arena is self.current() and not arena.closed:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result((arena, slot))
                    return
        arena.give(slot)

    def wake(self, every: bool = False) -> None:
        """Wake the first request waiting (``every``: all) to look again: the arena was replaced or closed."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if not every:
                    return

    def wake_threadsafe(self, every: bool = False) -> None:
        self._on_loop(self.wake, every)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> bool:
        """Schedule ``fn(*args)`` on the waiters' loop from another thread; ``False`` when there is no such loop
        (no request ever waited, or it is closed): then nobody waits."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            return False
        return True


def attach(path: str) -> mmap.mmap:
    """The arena at ``path`` mapped in this process (a worker's)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def read(mapped: Any, slot: int, size: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A view of ``shape`` and ``dtype`` at the start of ``slot`` (slots of ``size`` bytes) of ``mapped``."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mapped, dtype=dt, count=count, offset=slot * size).reshape(shape)


def write(mapped: Any, slot: int, size: int, array: np.ndarray) -> bool:
    """Copy ``array`` into ``slot`` of ``mapped``; ``False`` (nothing written) when it does not fit."""
    if array.nbytes > size:
        return False
    read(mapped, slot, size, array.shape, array.dtype.str)[...] = array
    return True
