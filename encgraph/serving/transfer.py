"""Copies of a served request between the host and the GPU that never wait behind other requests' replays.

The batching front's worker replays graphs on its thread's stream (the device's default stream: it sets none),
call after call. A request thread that copied on that stream, ``pixels.to("cuda")`` of its inputs or ``.cpu()``
of its embedding, would queue its copy behind every replay the worker had launched by then: on an H200 behind
``encgraph serve`` (SigLIP-so400m, 32 clients) the preprocess stage took 36 ms and the answer stage 9 ms per
request, against 1.3 ms and under 1 ms of work. So:

- :func:`upload` (a request thread): the inputs go through pinned memory on a side stream of that thread, and
  the thread waits for its own copy alone. The device tensor is then marked as used by the replay stream
  (``record_stream``), so the caching allocator does not hand its memory to another upload while a replay's
  copy out of it may still be queued (a request whose client went away is freed before its call runs).
- :func:`side_stream_work` (a request thread): device work of the request's own (the device preprocessing) on the
  same side stream; the thread either waits for it (as :func:`upload` does) or hands it over
  (:attr:`Handoff.EVENT`): an event recorded on the side stream, which the front's worker makes its stream wait
  for on the device right before the call that runs that request (:meth:`Ready.__call__`, handed to
  ``BatchingFront.submit_after``), and the thread goes on at once. Not ``default_stream.wait_stream(side)`` from
  the request thread: that wait lands wherever the worker's launches happen to be, so a replay of earlier
  requests waited for a later request's preprocessing (measured on an H100, Qwen2.5-VL-7B behind ``encgraph
  serve`` at 32 clients: 66 ms of encode a request against 15 with host preprocessing, and the cost feedback,
  timing those replays, sent 243 items eagerly). The side streams have high priority, so that the few small
  kernels of a request's preprocessing start between a replay's kernels instead of behind the replays queued
  before them.
- :func:`to_host` (the worker, in the front's ``finish`` hook right after the call): each result tensor is
  copied into pinned host memory behind that call's own replay, and an event marks the end of the copies;
  :meth:`HostCopy.wait` (the request thread) waits for that event only, not for later replays.
  :meth:`PinnedBuffers.copy` is the same for one tensor per call (all its requests' rows) into pinned buffers
  reused from call to call: one copy, one event and no allocation per call once warm.

On the CPU both are plain copies, and :meth:`HostCopy.wait` returns at once.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

__all__ = ["Handoff", "HostCopy", "PinnedBuffers", "Ready", "SideWork", "side_stream_work", "to_host", "upload"]

_LOCAL = threading.local()


def _side_stream(device: Any) -> Any:
    """This thread's upload stream on ``device`` (one per thread and device, made on first use), of high priority
    (lower numbers are higher; torch maps -1 to its high-priority streams)."""
    import torch

    streams = getattr(_LOCAL, "streams", None)
    if streams is None:
        streams = _LOCAL.streams = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device, priority=-1)
    return stream


def upload(tensor: Any, device: Any, dtype: Any = None) -> Any:
    """``tensor`` (on the host) on ``device`` in ``dtype`` (default: its own), as ``tensor.to(device, dtype)``
    gives it (bit for bit: the dtype conversion runs on the device after the copy), returned once it is there.

    On CUDA the copy runs on this thread's side stream from pinned memory and this call waits for that copy
    alone (the GIL released); the result's memory is not reused before the device's default stream, where the
    front's worker replays, has passed the point where it was freed. Elsewhere: ``tensor.to(device, dtype)``.
    Lifetime: the result is an ordinary device tensor owned by the caller."""
    import torch

    from encgraph.capture.upload import to_device

    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, dtype)
    with side_stream_work(device) as keep:
        out = to_device(tensor, device)  # from pinned memory, queued on the side stream
        if dtype is not None and out.dtype != dtype:
            out = out.to(dtype)
        keep(out)
    return out


class Handoff(enum.Enum):
    """How :func:`side_stream_work` hands its results to the replays on the device's default stream."""

    HOST = "host"  # the calling thread waits for the side stream (its results are then ready for anyone)
    EVENT = "event"  # an event is recorded on the side stream and the thread goes on at once; the results are
    #                  ready for a stream once it waited for that event (SideWork.ready: the worker calls it)


@attrs.frozen
class Ready:
    """A request's device work in flight on a side stream: calling it makes the current stream of ``device`` (the
    front's worker's) wait for ``event`` on the device, without blocking the host. Call it on the thread that will
    use the results, before launching work that reads them."""

    event: Any
    device: Any

    def __call__(self) -> None:
        import torch

        torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait_host(self) -> None:
        """Block this thread until the work is done (that side stream's work up to the event alone; GIL released):
        for a caller that hands the results to code that may use any stream."""
        self.event.synchronize()


class SideWork:
    """What :func:`side_stream_work` yields: ``keep(tensor) -> tensor`` (call it as ``work(tensor)``) marks a
    result as used by the default stream, :meth:`keep_all` every tensor of a structure; after the block,
    ``ready`` is the :class:`Ready` to hand to the consumer under :attr:`Handoff.EVENT` (``None`` otherwise, and
    off CUDA: nothing to wait for)."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self.ready: Ready | None = None

    def __call__(self, tensor: Any) -> Any:
        self.kept.append(tensor)
        return tensor

    def keep_all(self, value: Any) -> Any:
        """Keep every device tensor reachable from ``value`` (mappings, lists and tuples, attrs and dataclass
        instances' fields) and return ``value``: what the consumer reads may hold more than the tensors kept
        one by one (an adapter's inputs built on the side stream: pixels cast or reshaped, grids and sequence
        bounds copied to the device), and a tensor not kept may have its memory reused by this side stream while
        a replay still reads it."""
        from encgraph.capture.grad import tensors_in

        for tensor in tensors_in(value):
            if tensor.device.type != "cpu":
                self.kept.append(tensor)
        return value


@contextlib.contextmanager
def side_stream_work(device: Any, handoff: Handoff = Handoff.HOST) -> Iterator[SideWork]:
    """Run the block's device work on this thread's side stream of ``device`` (as :func:`upload` runs its copy),
    then hand it over per ``handoff``: wait for that stream alone (:attr:`Handoff.HOST`), or record an event there
    for the consumer to wait on (:attr:`Handoff.EVENT`, ``work.ready``). Yields a :class:`SideWork`: ``work(t)``
    marks a result as used by the default stream, where the front's worker replays, so that its memory is not
    reused while a replay may still read it. Off CUDA: the block runs as it is and ``work(t)`` returns ``t``."""
    import torch

    device = torch.device(device)
    work = SideWork()
    if device.type != "cuda":
        yield work
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _side_stream(device)
    with torch.cuda.stream(stream):
        yield work
    if handoff is Handoff.EVENT:
        event = torch.cuda.Event()
        event.record(stream)
        work.ready = Ready(event, device)
    else:
        stream.synchronize()
    replays = torch.cuda.default_stream(device)
    for tensor in work.kept:
        tensor.record_stream(replays)


@attrs.frozen
class HostCopy:
    """Host copies of some device tensors, in flight: ``tensors`` (pinned CPU tensors, the sources' shapes and
    dtypes) are valid once :meth:`wait` returned. ``event``: the CUDA event recorded after the copies (``None``
    on the CPU: nothing to wait for)."""

    tensors: tuple[Any, ...]
    event: Any = None

    def wait(self) -> tuple[Any, ...]:
        """The host tensors, once their copies are done (blocks on this copy's event alone, GIL released)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


def to_host(tensors: Sequence[Any]) -> HostCopy:
    """Start copying ``tensors`` (all on one device) to the host behind the work already queued on the current
    stream (call it on the thread that launched that work, right after); wait with :meth:`HostCopy.wait`.
    CPU tensors are returned as they are (no copy)."""
    import torch

    tensors = tuple(tensors)
    if not tensors or tensors[0].device.type != "cuda":
        return HostCopy(tensors)
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)  # the host allocator keeps this block until the copy is done
        out.append(host)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(tuple(out), event)


MIN_PINNED_ELEMENTS = 1 << 16
"""The smallest pinned buffer :class:`PinnedBuffers` makes (elements; 256 KiB of float32): a call of SigLIP-so400m's
16 images is 18,432; larger calls get the next power of two, so a few sizes serve every call."""


@attrs.define(eq=False)
class _Pinned:
    buffer: Any  # 1-D pinned CPU tensor
    copy: Any  # weakref.ref to the HostCopy that views it (dead: no request holds it any more)
    event: Any  # recorded after the copy into it


class PinnedBuffers:
    """Pinned host buffers for the device-to-host copies of one front's calls, reused from call to call.

    :meth:`copy` copies a tensor into a free buffer (one of its dtype, large enough, no longer held by a
    :class:`HostCopy`, its last copy done), or into a new one (the next power of two elements, at least
    :data:`MIN_PINNED_ELEMENTS`) that replaces a free one too small. A buffer is held as long as the
    :class:`HostCopy` that :meth:`copy` returned is alive: the tensors of its :meth:`HostCopy.wait` are views into
    the buffer, valid while it is (copy what must outlive it). As many buffers are kept as calls were ever held at
    once. Call :meth:`copy` from one thread (the front's worker): the buffers are not locked."""

    def __init__(self) -> None:
        self._kept: list[_Pinned] = []

    @property
    def buffers(self) -> int:
        """The pinned buffers made so far and kept."""
        return len(self._kept)

    def copy(self, tensor: Any) -> HostCopy:
        """Start copying ``tensor`` to the host behind the work queued on the current stream, as :func:`to_host`
        does, into a reused buffer (``HostCopy.tensors``: one tensor, ``tensor``'s shape and dtype, a view of that
        buffer). A CPU tensor is returned as it is (no copy, nothing to wait for)."""
        import torch

        if tensor.device.type != "cuda":
            return HostCopy((tensor,))
        pinned = self._free(tensor.numel(), tensor.dtype)
        host = pinned.buffer[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        pinned.event = torch.cuda.Event()
        pinned.event.record()
        out = HostCopy((host,), pinned.event)
        pinned.copy = weakref.ref(out)
        return out

    def _free(self, numel: int, dtype: Any) -> _Pinned:
        import torch

        small = None
        for pinned in self._kept:
            done = pinned.event is None or pinned.event.query()  # None: no copy was queued into it
            if pinned.copy() is not None or pinned.buffer.dtype != dtype or not done:
                continue
            if pinned.buffer.numel() >= numel:
                return pinned
            small = pinned
        if small is not None:
            self._kept.remove(small)  # free and too small: a larger one takes its place
        size = max(MIN_PINNED_ELEMENTS, 1 << (numel - 1).bit_length())
        pinned = _Pinned(torch.empty(size, dtype=dtype, pin_memory=True), _dead, None)
        self._kept.append(pinned)
        return pinned


def _dead() -> None:
    """A dead ``weakref.ref``'s stand-in: a new buffer is held by no copy yet."""
    return None
