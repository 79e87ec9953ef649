"""The batching front: many concurrent requests, one runner call.

``submit(...)`` (any thread) puts a request on a bounded queue and returns a ``concurrent.futures.Future``;
``await encode(...)`` is the same for asyncio. One worker thread takes the first queued request, keeps taking
more while they fit (until ``max_wait_ms`` after the first one arrived, ``max_tokens`` per path or
``max_requests``), and runs them as one call of the target: the adapter's ``concat(parts)`` joins their inputs,
the runner plans and replays them together and restores their order, and each request gets back its own items.

Waiting adapts (:mod:`encgraph.serving.waiting`): ``max_wait_ms`` is an upper bound. On a CUDA target a call
waits only while the device is still busy with earlier calls, so a lone client, or a server bound by its host
work, never pays it; elsewhere calls stop waiting while recent waits gathered nothing, probing now and then.
``stats["waits_skipped"]`` counts the calls that did not wait (``idle_launches``: because the device was idle);
``adaptive_wait=False`` waits up to ``max_wait_ms`` on every call.

Failure isolation: each request is validated alone (the adapter's ``item_specs``) before it joins a call, so a
bad request fails alone; if a coalesced call raises anyway, its requests run again one by one and only the
culprit fails. Overload: past ``max_queue`` waiting requests, ``submit`` raises
:class:`~encgraph.OverloadedError` at once. Shutdown: ``close()`` stops new requests, then either finishes the
queued ones (``drain=True``) or fails them with :class:`~encgraph.ShutdownError`; nothing waits forever.

Grad mode: the worker runs every call under ``torch.inference_mode()`` (the runner keeps its static buffers
ordinary tensors whatever mode allocates them, so later calls from any grad mode still write them). Results are
inference tensors: they carry no autograd.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from encgraph._validate import check_int, check_optional_int, describe
from encgraph.errors import ConfigError, ConfigTypeError, OverloadedError, ShutdownError
from encgraph.serving.front_stats import FrontStats
from encgraph.serving.targets import Finishing, Parsed, make_target
from encgraph.serving.waiting import IDLE_POLL_S, WaitPolicy, cuda_device

__all__ = ["BatchingFront", "FrontStats"]

log = logging.getLogger("encgraph")


@attrs.define
class _Request:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: concurrent.futures.Future
    arrived: float
    ready: Callable[[], None] | None = None  # the worker calls it before the call that runs this request


class BatchingFront:
    """Coalesce concurrent requests into one call of a runner or a graphed module.

    Args:
        target: an :class:`~encgraph.EncoderGraphRunner` (``submit(inputs)``: the adapter's inputs; result: the
            per-item results of those inputs), a graphed module from :func:`encgraph.graphed`
            (``submit(*args, **kwargs)``: the module's forward arguments; result: its output for them), or any
            other callable (each request ``target(*args, **kwargs)`` alone, serialised on the worker).
        max_wait_ms: how long, after the first request of a call arrived, the worker waits for more while the
            call has room (default 1.0). ``0``: only what is already queued joins.
        adaptive_wait: on a CUDA target, wait only while the device is busy with earlier calls; elsewhere, skip
            the wait while recent waits gathered no request (default ``True``; see the module docs). ``False``:
            every call waits up to ``max_wait_ms``.
        max_tokens: the most budget units per path one call gathers (an int for every path, or ``{path: int}``);
            default the largest budget of each path's ladder. A request larger than that runs alone.
        max_requests: the most requests per call (default: no limit; ``1``: no coalescing).
        max_queue: the most requests waiting for the worker; past it ``submit`` raises
            :class:`~encgraph.OverloadedError` at once (default 1024).
        capture: capture the runner's graphs now, before any request (default ``False``: the first call does).
            On a GPU capture before other threads use the device: a capture fails while another thread runs
            CUDA work.
        finish: called on the worker with each request's result right after the call that made it (in inference
            mode); the request's future gets what it returns, or fails alone with what it raises. For work that
            must follow the request's own replay on the worker's stream: starting its device-to-host copies
            there (:func:`encgraph.serving.transfer.to_host`) lets the caller wait for those copies alone
            rather than, as a ``.cpu()`` on its own thread would, for every replay launched since.
        finish_call: ``finish`` for a whole call at once (instead of ``finish``): the list of the call's requests'
            results in, one value per request out, in order (:class:`~encgraph.serving.targets.Finishing`).
        name: the worker thread's name.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        target: Any,
        *,
        max_wait_ms: float = 1.0,
        adaptive_wait: bool = True,
        max_tokens: int | Mapping[str, int] | None = None,
        max_requests: int | None = None,
        max_queue: int = 1024,
        capture: bool = False,
        finish: Callable[[Any], Any] | None = None,
        finish_call: Callable[[list[Any]], Any] | None = None,
        name: str = "encgraph-front",
    ) -> None:
        self._target = make_target(target)
        self._finishing = Finishing.of(finish, finish_call)
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not max_wait_ms >= 0:
            raise ConfigError(f"max_wait_ms: expected a number of milliseconds >= 0, got {describe(max_wait_ms)}.")
        self.max_wait_s = float(max_wait_ms) / 1e3
        if not isinstance(adaptive_wait, bool):
            raise ConfigTypeError(f"adaptive_wait: expected True or False, got {describe(adaptive_wait)}.")
        self.adaptive_wait = adaptive_wait
        self._waits = WaitPolicy(self.max_wait_s, adaptive_wait, cuda_device(self._target))
        self.max_requests = check_optional_int("max_requests", max_requests, minimum=1)
        self.max_queue = check_int("max_queue", max_queue, minimum=1)
        self.caps = self._resolve_caps(max_tokens)
        if not isinstance(capture, bool):
            raise ConfigTypeError(f"capture: expected True or False, got {describe(capture)}.")
        if capture:
            self._target.capture()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._carry: tuple[_Request, Parsed] | None = None
        self._closing = False
        self._drain = True
        self._stats = FrontStats()
        self._runner_stats: dict[str, Any] = {}
        self._worker = threading.Thread(target=self._main, name=name, daemon=True)
        self._worker.start()

    def _resolve_caps(self, max_tokens: Any) -> dict[str, int]:
        caps = self._target.caps()
        if max_tokens is None:
            return caps
        if isinstance(max_tokens, Mapping):
            unknown = set(max_tokens) - set(caps)
            if unknown:
                raise ConfigError(f"max_tokens: unknown paths {sorted(unknown)}; the target's paths: {sorted(caps)}.")
            return {**caps, **{p: check_int(f"max_tokens[{p!r}]", v, minimum=1) for p, v in max_tokens.items()}}
        value = check_int("max_tokens", max_tokens, minimum=1)
        return dict.fromkeys(caps, value)

    # ------------------------------------------------------------------ callers
    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue one request; the future gets its result (or the exception it raised).

        Raises at once: :class:`~encgraph.OverloadedError` when ``max_queue`` requests are waiting,
        :class:`~encgraph.ShutdownError` after :meth:`close`.
        """
        return self.submit_after(None, *args, **kwargs)

    def submit_after(self, ready: Callable[[], None] | None, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """:meth:`submit` for a request whose inputs are still being made on the device (on another stream):
        the worker calls ``ready()`` on its own thread before launching anything that reads them, so that
        its stream waits for that work there, on the device, and for nothing else
        (:class:`encgraph.serving.transfer.Ready`). It is called when the worker takes the request, before it
        parses the inputs. ``None``: as :meth:`submit`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                self._stats.rejected += 1
                raise ShutdownError("submit: the batching front is closed; it takes no new requests.")
            if len(self._queue) >= self.max_queue:
                self._stats.rejected += 1
                raise OverloadedError(
                    f"submit: the serving queue is full ({len(self._queue)} requests waiting, max_queue="
                    f"{self.max_queue}); retry later, or raise max_queue."
                )
            self._queue.append(_Request(args, kwargs, future, time.monotonic(), ready))
            self._stats.requests += 1
            self._cond.notify()
        return future

    async def encode(self, *args: Any, **kwargs: Any) -> Any:
        """``await`` one request from asyncio (cancelling the await cancels the request if it has not started)."""
        return await asyncio.wrap_future(self.submit(*args, **kwargs))

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the worker (not counting the call in progress)."""
        return len(self._queue)

    @property
    def stats(self) -> dict[str, Any]:
        """The front's counters (:class:`FrontStats`), plus ``queue_depth`` and ``runner``: the runner's
        ``stats`` as of its last call (empty for a callable target)."""
        with self._cond:
            out = self._stats.as_dict()
            out["queue_depth"] = len(self._queue)
            out["runner"] = dict(self._runner_stats)
        return out

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests. ``drain=True``: the queued ones still run; ``False``: they fail with
        :class:`~encgraph.ShutdownError` (the call in progress finishes either way). Waits at most ``timeout``
        seconds for the worker; what it has not started by then fails with :class:`~encgraph.ShutdownError`."""
        with self._cond:
            self._closing = True
            self._drain = self._drain and drain
            self._cond.notify_all()
        self._worker.join(timeout)
        if self._worker.is_alive():
            why = f"the batching front did not finish its queue within {timeout} s of close()"
            with self._cond:
                self._drain = False
                self._fail_queued(why)
                carried, self._carry = self._carry, None
            if carried is not None:
                self._answer(carried, exc=ShutdownError(f"request not run: {why}."))

    def __enter__(self) -> BatchingFront:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BatchingFront({type(self._target).__name__}, max_wait_ms={self.max_wait_s * 1e3:g}, caps={self.caps}, "
            f"max_requests={self.max_requests}, max_queue={self.max_queue}, queued={len(self._queue)})"
        )

    # ------------------------------------------------------------------ worker
    def _main(self) -> None:
        try:
            while True:
                taken = self._take(None)
                if taken is None:
                    return
                group = [taken]
                if not taken[1].alone and self._target.coalesces:
                    self._gather(group)
                self._run(group)
                self._waits.launched()
        except BaseException as exc:  # a bug of the front itself: fail what is left rather than hang callers
            log.exception("encgraph serving: the batching front's worker failed")
            with self._cond:
                self._closing, self._drain = True, False
                self._fail_queued(f"the batching front's worker failed ({type(exc).__name__}: {exc})")
            raise

    def _take(self, deadline: float | None, until: Callable[[], bool] | None = None) -> tuple[_Request, Parsed] | None:
        """The next valid request (the carried one first), or ``None`` when there is none by ``deadline``
        (``None``: wait until one comes or the front closes) or once ``until()`` is true while none is queued.
        Invalid and cancelled requests are answered here."""
        while True:
            with self._cond:
                if self._carry is not None:
                    taken, self._carry = self._carry, None
                    return taken
                while not self._queue:
                    if self._closing:
                        return None
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        return None
                    if until is not None:
                        if until():
                            return None
                        wait = IDLE_POLL_S if wait is None else min(wait, IDLE_POLL_S)
                    self._cond.wait(wait)
                if self._closing and not self._drain:
                    self._fail_queued("the batching front was closed without draining")
                    return None
                request = self._queue.popleft()
            if not request.future.set_running_or_notify_cancel():
                with self._cond:
                    self._stats.cancelled += 1
                continue
            parsed = self._guarded(request, lambda r=request: self._parse(r))
            if parsed is not None:
                return request, parsed

    def _parse(self, request: _Request) -> Parsed:
        """A taken request's parsed inputs; first (:meth:`submit_after`) this thread's stream made to wait for
        the request's device work, before anything the worker launches may read its inputs."""
        if request.ready is not None:
            request.ready()
        return self._target.parse(request.args, request.kwargs)

    def _gather(self, group: list[tuple[_Request, Parsed]]) -> None:
        wait = self._waits.wait(group[0][0].arrived)
        with self._cond:
            submitted = self._stats.requests
            if wait.skipped:
                self._stats.waits_skipped += 1
                self._stats.idle_launches += wait.idle
            self._stats.held_launches += wait.held
        timed_out = self._fill(group, dict(group[0][1].tokens), wait.deadline, wait.until)
        with self._cond:
            arrived = self._stats.requests > submitted  # a request came while this call waited
        self._waits.waited(wait, timed_out, arrived)

    def _fill(self, group: list[tuple[_Request, Parsed]], used: dict[str, int], deadline: float,
              until: Callable[[], bool] | None = None) -> bool:
        """Take requests into ``group`` while they fit; ``True`` when it stopped because ``deadline`` passed (or
        ``until()`` became true: it is polled every :data:`~encgraph.serving.waiting.IDLE_POLL_S` while the queue
        is empty)."""
        while self.max_requests is None or len(group) < self.max_requests:
            if any(used.get(p, 0) >= cap for p, cap in self.caps.items()):
                return False
            taken = self._take(deadline, until)
            if taken is None:
                return True
            parsed = taken[1]
            fits = all(used.get(p, 0) + parsed.tokens.get(p, 0) <= cap for p, cap in self.caps.items())
            if parsed.alone or not fits:
                with self._cond:
                    self._carry = taken
                return False
            group.append(taken)
            for p, n in parsed.tokens.items():
                used[p] = used.get(p, 0) + n
        return False

    def _run(self, group: list[tuple[_Request, Parsed]]) -> None:
        parsed = [p for _, p in group]
        try:
            with _inference_mode():
                results = self._target.run(parsed)
        except Exception as exc:
            self._count_call(len(group))
            if len(group) == 1:
                self._answer(group[0], exc=exc)
                return
            with self._cond:
                self._stats.retried_calls += 1
            log.info("encgraph serving: a call of %d requests raised (%s); running them one by one", len(group), exc)
            for one in group:
                self._run([one])
            return
        self._count_call(len(group))
        with _inference_mode():
            finished = self._finishing(list(results))
        for one, (result, exc) in zip(group, finished):
            self._answer(one, result=result, exc=exc)

    def _guarded(self, request: _Request, fn: Any) -> Any:
        try:
            with _inference_mode():
                return fn()
        except Exception as exc:
            self._answer((request, None), exc=exc)
            return None

    def _count_call(self, requests: int) -> None:
        runner = self._target.runner
        stats = runner.stats if runner is not None else {}
        with self._cond:
            self._stats.calls += 1
            self._stats.requests_per_call[requests] += 1
            self._runner_stats = stats

    def _answer(self, taken: tuple[_Request, Parsed | None], *, result: Any = None, exc: BaseException | None = None) -> None:
        request, parsed = taken
        with self._cond:
            if request.future.done():  # failed by close() after its timeout while the worker was still busy
                return
            if exc is None:
                self._stats.completed += 1
                self._stats.items += len(parsed.specs) if parsed is not None and parsed.specs else 1
            else:
                self._stats.failed += 1
        if exc is None:
            request.future.set_result(result)
        else:
            request.future.set_exception(exc)

    def _fail_queued(self, why: str) -> None:
        """Fail every queued request (the caller holds ``_cond``)."""
        while self._queue:
            request = self._queue.popleft()
            if request.future.set_running_or_notify_cancel():
                self._stats.failed += 1
                request.future.set_exception(ShutdownError(f"request not run: {why}."))
            else:
                self._stats.cancelled += 1


def _inference_mode() -> Any:
    # torch imported here: encgraph.serving itself imports without torch (the front is also used over plain callables).
    import torch

    return torch.inference_mode()
