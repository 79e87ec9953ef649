"""The ``encgraph serve`` HTTP app (FastAPI): parsing, status codes and metrics only; the batching front owns
queueing and coalescing, the runner planning and replay.

``POST /v1/embeddings`` takes the OpenAI embeddings request shape with images as inputs::

    {"model": "siglip", "input": ["data:image/png;base64,...", "<base64 JPEG>"],
     "encoding_format": "float" | "base64", "return_tokens": false}

and answers one pooled embedding per image, in input order (``encoding_format="base64"``: little-endian float32
bytes, as OpenAI's API), with each image's token sequence too when ``return_tokens`` is true::

    {"object": "list", "model": "siglip", "usage": {"prompt_tokens": N, "total_tokens": N},
     "data": [{"object": "embedding", "index": 0, "embedding": [...], "tokens": [[...], ...]}]}

``usage`` counts the images' output tokens. Errors, of every status and every path, are
``{"error": {"message", "type", "param", "code"}}``: 400 (corrupt image, bad base64, invalid JSON), 401 (no or a
wrong API key, :mod:`encgraph.serving.auth`), 404 (unknown model or path), 405 (wrong method), 413 (body, image
bytes, pixels of an image or of the request over the limits; too many images), 415 (a format other than PNG or
JPEG), 422 (wrong JSON shape, an unknown field, empty input list), 500, and 503 with ``Retry-After`` (queue full,
too much in flight (:mod:`encgraph.serving.admission`), shutting down, a preprocessing worker died).
``GET /health`` (per model its device, dtype, queue depth and ``engine``, what runs it from the first request on:
``graph`` (CUDA graph replays), ``eager`` (the adapter's eager forward, the CPU default), ``static`` or ``hf-eager``
(``--eager``)); ``GET /metrics`` (Prometheus).

A request's pixels are counted from its images' headers before any is decoded: over ``max_request_pixels`` it is
refused (413), and it is decoded only while the pixels of all requests being decoded stay within the in-flight
limit (else 503).

Shutdown: :meth:`Draining.begin` (``encgraph serve`` calls it on SIGTERM/SIGINT with its ``--graceful-timeout``)
lets the requests in flight finish; those still running shortly before the timeout are answered 503
``shutting_down`` (JSON), so that none is cut off with the HTTP server's plain-text error.

Decoding and the image processor run in the server's threads, or with ``preprocess_workers`` in a pool of worker
processes (:mod:`encgraph.serving.preprocess`): the same images, errors and arrays either way.

A request's two short steps beside the device, the copy of its pixels up (after a preprocessing worker) and its
answer (waiting for its own embedding's copy down, then the JSON), run in two small pools of their own
(``request_threads`` threads each, first in first out), not in the framework's shared pool of 40 threads: a server
bound by its host work holds one GIL, and forty threads that each want it for a fraction of a millisecond get it in
no order, a waiting thread up to a switch interval (5 ms) after it asked; a few threads fed from a FIFO queue keep
the waiting in arrival order. Two pools, so that answers blocked on their calls' copies never hold back the
uploads of the next call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from encgraph.errors import ConfigError, InputError, InputTypeError, OverloadedError, ShutdownError
from encgraph.serving.admission import InFlight, Ticket
from encgraph.serving.auth import BearerAuth
from encgraph.serving.device_batch import DeviceBatcher
from encgraph.serving.device_preprocess import DeviceProcessing
from encgraph.serving.metrics import Metrics
from encgraph.serving.preprocess import PreprocessPool
from encgraph.serving.protocol import (
    ApiError,
    EmbeddingRequest,
    ServerLimits,
    answer,
    count_pixels,
    parse_request,
    read_body,
    retry_headers,
    take,
)
from encgraph.serving.request_inputs import decode_in_threads, prepare_in_pool, prepare_in_threads

__all__ = ["create_app", "ServerLimits", "EmbeddingRequest", "Draining"]

log = logging.getLogger("encgraph.serve")


def _answer_on_host(model: Any, results: Any, req: EmbeddingRequest) -> tuple[Response, float]:
    """The request's answer (on an answer thread) and when its embeddings reached the host
    (``time.perf_counter()``): the device's work for its call ends the encode stage, not the answer's
    (:data:`encgraph.serving.metrics.STAGES`)."""
    model.on_host(results)
    on_host = time.perf_counter()
    return answer(model, results, req), on_host


def create_app(models: Mapping[str, Any], limits: ServerLimits = ServerLimits(), *,
               close_timeout_s: float = 10.0, preprocess_workers: int = 0, request_threads: int = 4,
               api_key: str | None = None, protect_all: bool = False) -> FastAPI:
    """The app over ``models`` (name -> :class:`~encgraph.serving.loading.ServedModel`; the first is the default
    for a request without ``model``).

    ``api_key``: requests under ``/v1/`` (every path with ``protect_all``) need ``Authorization: Bearer <key>``
    (:mod:`encgraph.serving.auth`).

    ``preprocess_workers``: 0 decodes and preprocesses in the server's threads; N > 0 in one pool of N worker
    processes for all the models (:class:`~encgraph.serving.preprocess.PreprocessPool`), started and warm before
    the server answers. ``request_threads``: the threads of the requests' uploads, and as many of their answers
    (see the module docs). On shutdown it closes the fronts (queued requests finish first, at most
    ``close_timeout_s`` seconds), then the pools."""
    if not models:
        raise ValueError("models: expected at least one served model.")
    if isinstance(request_threads, bool) or not isinstance(request_threads, int) or request_threads < 1:
        raise ConfigError(f"request_threads: expected an int >= 1 (threads for the requests' uploads and answers), "
                          f"got {request_threads!r}.")
    default = next(iter(models))
    pool = None
    if preprocess_workers:
        pool = PreprocessPool({n: m.processor for n, m in models.items()}, preprocess_workers, limits.image)
    batchers = {n: DeviceBatcher(m) for n, m in models.items() if isinstance(m.processor, DeviceProcessing)}
    metrics = Metrics(models, preprocess=pool, batchers=batchers)
    threads = _RequestThreads(request_threads)
    in_flight = InFlight(limits.in_flight)
    draining = Draining()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            await run_in_threadpool(pool.start)
        yield
        for batcher in batchers.values():  # before the fronts: what it still holds goes to an open front
            await run_in_threadpool(batcher.close, close_timeout_s)
        for model in models.values():
            await run_in_threadpool(model.front.close, drain=True, timeout=close_timeout_s)
        if pool is not None:
            await run_in_threadpool(pool.close)
        threads.close()  # the fronts are closed: no request is left to run there

    app = FastAPI(title="encgraph", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.models = models
    app.state.metrics = metrics
    app.state.preprocess = pool
    app.state.batchers = batchers
    app.state.in_flight = in_flight
    app.state.draining = draining
    workers = pool.workers if pool is not None else 0

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # The framework's own answers (404 unknown path, 405 wrong method) in the documented error shape.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        where = f"{request.method} {request.url.path}"
        message = {404: f"{where}: no such path; the server answers POST /v1/embeddings, GET /health and GET /metrics.",
                   405: f"{where}: method not allowed on this path."}.get(exc.status_code, f"{where}: {exc.detail}")
        return ApiError(exc.status_code, None, code, message, dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        return ApiError(500, None, "internal_error", "internal error: see the server log.").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "default_model": default, "gc_frozen_objects": gc.get_freeze_count(),
                "models": {n: {**m.info(), "preprocess_workers": workers,
                               **({"device_preprocess": batchers[n].stats} if n in batchers else {})}
                           for n, m in models.items()}}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        content, media_type = await run_in_threadpool(metrics.render)
        return Response(content, media_type=media_type)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        task = asyncio.current_task()
        draining.tasks.add(task)
        ticket = in_flight.ticket()
        try:
            return await _embeddings(request, ticket)
        except asyncio.CancelledError:
            if not draining.expired or task is None:
                raise
            task.uncancel()  # cancelled by Draining at the graceful timeout: answer, in JSON
            metrics.observe("-", 503)
            return ApiError(503, None, "shutting_down", "the server shut down before this request finished "
                            "(--graceful-timeout); retry on another replica.", retry_headers(limits)).response()
        finally:
            draining.tasks.discard(task)
            ticket.release()

    async def _embeddings(request: Request, ticket: Ticket) -> Response:
        t0 = time.perf_counter()
        clock = _StageClock(t0)
        label = "-"
        try:
            req = parse_request(await read_body(request, limits, ticket))
            clock.lap("read")
            name = default if req.model is None else req.model
            model = models.get(name)
            if model is None:
                raise ApiError(404, "model", "model_not_found",
                               f"model: expected one of {sorted(models)}, got {name!r}.")
            label = name
            if not req.input:
                raise ApiError(422, "input", "empty_input", "input: expected at least one image, got an empty list.")
            if len(req.input) > limits.max_images:
                raise ApiError(413, "input", "too_many_images",
                               f"input: {len(req.input)} images is over the server's limit of {limits.max_images} "
                               "per request; split the request.")
            take(ticket.take_pixels, count_pixels(req.input, limits), limits)
            batcher = batchers.get(name)
            if pool is None:
                images, arrays = await decode_in_threads(model, req.input, limits.image, batcher)
                clock.lap("decode")
                inputs = await prepare_in_threads(model, images, arrays, batcher)
                del images, arrays
                clock.lap("preprocess")
            else:
                inputs, decode_s = await prepare_in_pool(pool, model, req.input, limits, threads.uploads, batcher)
                clock.split("decode", "preprocess", decode_s)
            ticket.release_pixels()  # decoded and processed: what is left is the tower's (small) inputs
            results = await _encode_on(model, inputs, limits)
            response, on_host = await asyncio.get_running_loop().run_in_executor(
                threads.answers, _answer_on_host, model, results, req)
            clock.lap("encode", on_host)
            clock.lap("answer")
        except ApiError as exc:
            metrics.observe(label, exc.status)
            return exc.response()
        except Exception:
            log.exception("encgraph serve: request failed")
            metrics.observe(label, 500)
            return ApiError(500, None, "internal_error", "internal error: see the server log.").response()
        metrics.observe(label, 200, images=len(req.input), seconds=time.perf_counter() - t0, stages=clock.spent)
        return response

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, protect_all=protect_all)
    return app


class Draining:
    """The requests in flight (their tasks) and the end of a graceful shutdown: :meth:`begin` (on the event loop)
    arms a timer that, shortly before ``timeout_s`` (when the HTTP server would cut them off), cancels the requests
    still running; each then answers a JSON 503 itself."""

    def __init__(self) -> None:
        self.tasks: set[Any] = set()
        self.expired = False

    def begin(self, timeout_s: float) -> None:
        margin = min(0.5, timeout_s / 2)  # time to write the 503s before the server's own deadline
        asyncio.get_running_loop().call_later(max(0.0, timeout_s - margin), self._expire)

    def _expire(self) -> None:
        self.expired = True
        for task in list(self.tasks):
            task.cancel("encgraph: graceful shutdown timeout")


class _RequestThreads:
    """The requests' upload and answer threads (module docs): two pools of ``count`` threads each, made on first
    use, so that an app whose lifespan ended (a test client's) makes new ones if it serves again."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pools: tuple[concurrent.futures.ThreadPoolExecutor, ...] = ()

    def _get(self, i: int) -> concurrent.futures.ThreadPoolExecutor:
        if not self._pools:  # on the event loop's thread only: no lock needed
            self._pools = tuple(concurrent.futures.ThreadPoolExecutor(self.count, thread_name_prefix=f"encgraph-{n}")
                                for n in ("upload", "answer"))
        return self._pools[i]

    @property
    def uploads(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._get(0)

    @property
    def answers(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._get(1)

    def close(self) -> None:
        pools, self._pools = self._pools, ()
        for pool in pools:
            pool.shutdown(wait=False)


class _StageClock:
    """Seconds per stage of one request (:data:`encgraph.serving.metrics.STAGES`), lap by lap."""

    def __init__(self, start: float) -> None:
        self.last = start
        self.spent: dict[str, float] = {}

    def lap(self, stage: str, now: float | None = None) -> None:
        """End ``stage`` now, or at ``now`` (``time.perf_counter()`` of another thread: the stage ended there)."""
        now = time.perf_counter() if now is None else now
        self.spent[stage] = now - self.last
        self.last = now

    def split(self, first: str, second: str, first_s: float) -> None:
        """One lap shared by two stages: ``first_s`` of it to ``first`` (measured elsewhere: a worker's
        decoding), the rest to ``second``."""
        now = time.perf_counter()
        self.spent[first] = min(max(first_s, 0.0), now - self.last)
        self.spent[second] = now - self.last - self.spent[first]
        self.last = now


async def _encode_on(model: Any, inputs: Any, limits: ServerLimits) -> list[Any]:
    retry = retry_headers(limits)
    try:
        future = model.submit(inputs)  # a Prepared: its device work, if any, waited for by the worker
    except OverloadedError as exc:
        raise ApiError(503, None, "overloaded", f"the server is overloaded ({exc}); retry later.", retry) from None
    except ShutdownError:
        raise ApiError(503, None, "shutting_down", "the server is shutting down; retry on another replica.",
                       retry) from None
    try:
        return await asyncio.wrap_future(future)
    except ShutdownError:
        raise ApiError(503, None, "shutting_down", "the server shut down before running this request.", retry) from None
    except (InputError, InputTypeError) as exc:
        raise ApiError(400, "input", "invalid_image", f"input: {exc}") from None
