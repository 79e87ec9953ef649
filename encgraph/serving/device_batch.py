"""The device half of preprocessing (``encgraph serve --preprocess-on device``) run once per group of requests.

Run per request on the server's request threads, the torchvision processor's device half cost each request its
fixed Python overhead (grouping by shape, a resize / rescale / normalise call per group, a pinned copy, an event)
under the GIL: on an H100 (SigLIP-so400m 384 px, 32 clients) its stage took ~54 ms a request against 3.4 ms of
decoding (issue 57). A :class:`DeviceBatcher` (one thread per served model) takes every request waiting for it,
as the batching front takes its calls: whatever is queued when its previous group is done, at most
``max_images`` images and ``max_bytes`` decoded bytes, never waiting for more (an idle server adds no wait). For a
group it

- reads each request's arrays (``read``: a preprocessing worker's pixels out of their shared-memory slot, on this
  thread rather than the event loop);
- runs the processor once over all the group's images on this thread's side stream
  (:meth:`~encgraph.serving.device_preprocess.DeviceProcessing.on_device_many`: one upload, one processor call),
  then each request's adapter step on its own rows, and records one event after all of it
  (:func:`~encgraph.serving.transfer.side_stream_work`, :attr:`~encgraph.serving.transfer.Handoff.EVENT`): each
  request's :class:`~encgraph.serving.loading.Prepared` carries that event, and the front's worker makes its
  stream wait for it on the device before the call that runs the request, as for a request prepared alone;
- answers each request's future with its own inputs, in order.

If the group's call raises (an image the processor refuses, an adapter that refuses a request's rows), each
request of the group runs again alone (its ``alone`` function: what the server ran per request before, which
names the refused image), so only the culprit fails, with the error it got before; ``stats["retried_groups"]``
counts those groups. A processor whose images may come out in several sizes
(:attr:`~encgraph.serving.device_preprocess.DeviceProcessing.batches` false) runs every request alone, counted
in ``stats["alone"]`` and logged once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from encgraph.serving.loading import Prepared
from encgraph.serving.transfer import Handoff, side_stream_work

__all__ = ["DeviceBatcher", "prepare_many"]

log = logging.getLogger("encgraph.serve")

MAX_IMAGES = 64
"""Images of one group at most (a SigLIP-so400m group of 64 is 57 MB of bf16 pixels on the device)."""
MAX_BYTES = 256 << 20
"""Decoded bytes of one group at most (its pinned staging buffer); a request larger than that runs alone."""


def prepare_many(model: Any, parts: Sequence[Mapping[str, np.ndarray]]) -> list[Prepared]:
    """``model.prepare(arrays)`` for each of ``parts`` (the host half's arrays of several requests), with the
    device half run once over all of them on this thread's side stream: each request's inputs (its own rows, in
    order) with the one :class:`~encgraph.serving.transfer.Ready` of the group. Raises what the processor or the
    adapter raises for any of them."""
    with side_stream_work(model.device, Handoff.EVENT) as work:
        done = model.processor.on_device_many(parts, model.device, model.dtype)
        # Every device tensor of the inputs, not only the pixels: the adapter's step may make new ones here.
        inputs = [work.keep_all(model.adapter_inputs(work(d["pixel_values"]), d.get("image_grid_thw"))) for d in done]
    return [Prepared(i, work.ready) for i in inputs]


@attrs.define(eq=False)
class _Job:
    read: Callable[[], Mapping[str, np.ndarray]]
    alone: Callable[[Mapping[str, np.ndarray]], Prepared]
    future: concurrent.futures.Future
    arrays: Mapping[str, np.ndarray] | None = None


class DeviceBatcher:
    """One served model's device preprocessing, run per group of waiting requests (module docs) on one thread.

    ``model``: a :class:`~encgraph.serving.loading.ServedModel` whose processor is a
    :class:`~encgraph.serving.device_preprocess.DeviceProcessing`. The thread starts on the first :meth:`submit`
    (again after :meth:`close`); it is a daemon."""

    def __init__(self, model: Any, *, max_images: int = MAX_IMAGES, max_bytes: int = MAX_BYTES) -> None:
        self.model = model
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.batches = bool(getattr(model.processor, "batches", False))
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stats = {"groups": 0, "requests": 0, "images": 0, "largest_group": 0, "retried_groups": 0, "alone": 0}
        self._warned = False

    @property
    def stats(self) -> dict[str, int]:
        """``groups`` (processor calls over several requests or one), ``requests`` and ``images`` in them,
        ``largest_group`` (requests), ``retried_groups`` (calls that raised: their requests ran alone) and
        ``alone`` (requests run alone: a retried group's, or every request of a processor that does not batch)."""
        with self._cond:
            return dict(self._stats)

    def submit(self, read: Callable[[], Mapping[str, np.ndarray]], alone: Callable[[Mapping[str, np.ndarray]], Prepared]
               ) -> concurrent.futures.Future:
        """Queue one request: ``read()`` gives its host half's arrays (called on the batcher's thread; what it
        raises fails this request alone), ``alone()`` its :class:`~encgraph.serving.loading.Prepared` made by itself
        (the fallback, given the arrays). The future gets its :class:`~encgraph.serving.loading.Prepared`, or the
        exception of its own failure."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._main, name=f"encgraph-preprocess-{self.model.name}",
                                                daemon=True)
                self._thread.start()
            self._queue.append(_Job(read, alone, future))
            self._cond.notify()
        return future

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread once the queued requests are done (at most ``timeout`` seconds)."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._closing = True
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _main(self) -> None:
        while True:
            group = self._take()
            if group is None:
                return
            try:
                self._run(group)
            except BaseException as exc:  # a bug here: fail the group's requests rather than leave them waiting
                log.exception("encgraph serve: the device preprocessing thread failed on a group")
                for job in group:
                    _settle(job.future, exc=exc)

    def _take(self) -> list[_Job] | None:
        """The requests queued now, read (their arrays), within the bounds (a full group runs at once, the rest
        are returned); waits only for the first. ``None``: closed and nothing queued."""
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            jobs = []
            while self._queue and len(jobs) < (self.max_images if self.batches else 1):
                jobs.append(self._queue.popleft())
        try:
            return self._group(jobs)
        except BaseException as exc:  # a bug here: fail the taken requests rather than leave them waiting
            log.exception("encgraph serve: the device preprocessing thread failed while grouping requests")
            for job in jobs:
                _settle(job.future, exc=exc)
            return []

    def _group(self, jobs: list[_Job]) -> list[_Job]:
        """``jobs`` read (their arrays) and grouped within the bounds: a full group runs at once, the rest are
        returned."""
        group, images, size = [], 0, 0
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.arrays = job.read()
            except Exception as exc:
                _settle(job.future, exc=exc)
                continue
            n, b = len(job.arrays["decoded_sizes"]), job.arrays["pixel_values"].nbytes
            if group and (images + n > self.max_images or size + b > self.max_bytes):
                self._run(group)  # a full group: the rest start the next one
                group, images, size = [], 0, 0
            group.append(job)
            images, size = images + n, size + b
        return group

    def _run(self, group: list[_Job]) -> None:
        if not group:
            return
        if not self.batches:
            self._count(group, alone=len(group))
            if not self._warned:
                self._warned = True
                log.warning("encgraph serve: %s: the image processor may make images of several sizes; its device "
                            "preprocessing runs per request (stats: alone)", self.model.name)
            self._alone(group)
            return
        try:
            prepared = prepare_many(self.model, [job.arrays for job in group])
        except Exception as exc:
            self._count(group, alone=len(group), retried=1)
            if len(group) > 1:
                log.info("encgraph serve: device preprocessing of %d requests raised (%s: %s); running them one by "
                         "one", len(group), type(exc).__name__, exc)
            self._alone(group)
            return
        self._count(group)
        for job, p in zip(group, prepared, strict=True):
            _settle(job.future, result=p)

    def _alone(self, group: list[_Job]) -> None:
        for job in group:
            try:
                prepared = job.alone(job.arrays)
            except Exception as exc:
                _settle(job.future, exc=exc)
            else:
                _settle(job.future, result=prepared)

    def _count(self, group: list[_Job], *, alone: int = 0, retried: int = 0) -> None:
        with self._cond:
            s = self._stats
            s["groups"] += 1
            s["requests"] += len(group)
            s["images"] += sum(len(job.arrays["decoded_sizes"]) for job in group)
            s["largest_group"] = max(s["largest_group"], len(group))
            s["alone"] += alone
            s["retried_groups"] += retried


def _settle(future: concurrent.futures.Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
