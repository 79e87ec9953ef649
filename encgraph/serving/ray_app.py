"""``encgraph serve --ray``: the same server on a Ray cluster, one replica per GPU, behind Ray Serve's HTTP proxy.

Two Ray Serve deployments make one application:

- :class:`Replica` (``EncgraphReplica``, one GPU each on CUDA, none on the CPU): ``encgraph serve``'s own app
  (:func:`encgraph.serving.app.create_app`: its batching fronts, runners, limits and error shapes), built in the
  replica's process by a callable it is given, and called in-process with each forwarded request. Ray counts the
  requests a replica holds (queued in its fronts or running) and, with ``max_replicas`` above ``replicas``, scales the
  replicas on that queue depth (``autoscaling_config``: ``target_ongoing_requests``).
- :class:`Gateway` (``EncgraphGateway``, no CPU reserved): the HTTP ingress behind Ray's proxy. It checks the API key
  (before reading a body, as ``encgraph serve`` does), reads the body within the same limits (413, 503), and
  forwards method, path, headers and body to a replica. It exists for one reason: a replica that dies with requests
  in flight makes Ray's proxy answer 500 in plain text; the gateway retries such a request on another replica
  (an embedding is a pure function of the request: a retry gives the same answer) and, when none answers in time,
  answers 503 ``replica_unavailable`` with ``Retry-After`` in the server's error shape. Ray Serve replaces the dead
  replica. The same for Ray's own back-pressure (503 ``overloaded``).

Every answer carries ``x-encgraph-replica``, the id of the replica that made it (and, when its first replica died,
``x-encgraph-retried``, the tries that failed): ``/health`` and ``/metrics`` are one replica's (each replica counts
its own requests), as behind any load balancer.

Ray is imported only by :func:`application` and the deployments' methods: importing this module does not import it,
and the core never imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

from encgraph.errors import ConfigError

__all__ = ["RaySettings", "Forwarded", "Answer", "Replica", "Gateway", "application", "call_app", "APP_NAME"]

APP_NAME = "encgraph"
REPLICA = "EncgraphReplica"
GATEWAY = "EncgraphGateway"
log = logging.getLogger("encgraph.serve")
REPLICA_HEADER = b"x-encgraph-replica"
RETRIED_HEADER = b"x-encgraph-retried"


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name}: expected a positive number, got {value!r}.")


@attrs.frozen
class RaySettings:
    """How the application runs on the cluster.

    ``replicas``: replicas started (and kept at least); ``max_replicas``: the most the autoscaler may run (equal to
    ``replicas``: a fixed count, no autoscaling); ``target_ongoing_requests``: the requests per replica (queued in its
    fronts or running) the autoscaler keeps them near; ``max_ongoing_requests``: the most Ray sends one replica at once
    (its fronts' queue: more wait in Ray's router); ``gpus``: GPUs per replica (1 on CUDA, 0 on the CPU); ``cpus``:
    CPUs Ray reserves per replica; ``gateways``: gateway replicas; ``retry_s``: how long a request whose replica died
    may be retried on others before it is answered 503; ``retry_after_s``: the 503s' ``Retry-After``;
    ``graceful_s``: how long a stopping replica's requests may take to finish (``--graceful-timeout``)."""

    replicas: int = attrs.field(default=1, validator=_positive)
    max_replicas: int | None = None
    target_ongoing_requests: float = attrs.field(default=16.0, validator=_positive)
    max_ongoing_requests: int = attrs.field(default=256, validator=_positive)
    gpus: float = 0.0
    cpus: float = 1.0
    gateways: int = attrs.field(default=1, validator=_positive)
    retry_s: float = attrs.field(default=30.0, validator=_positive)
    retry_after_s: int = 1
    graceful_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(f"max_replicas: expected at least replicas ({self.replicas}), got {self.max_replicas}.")

    def replica_options(self) -> dict[str, Any]:
        """``serve.deployment`` options of the replicas."""
        options: dict[str, Any] = {
            "name": REPLICA,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_gpus": self.gpus, "num_cpus": self.cpus},
            "graceful_shutdown_timeout_s": self.graceful_s,
        }
        if self.max_replicas is None or self.max_replicas == self.replicas:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.replicas, "initial_replicas": self.replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        return options

    def gateway_options(self) -> dict[str, Any]:
        # The gateway only awaits replicas: no CPU reserved (it fits beside them), and no cap of its own on the
        # requests in flight (the replicas' fronts and Ray's router hold the queue).
        return {"name": GATEWAY, "num_replicas": self.gateways, "max_ongoing_requests": 100_000,
                "ray_actor_options": {"num_cpus": 0}}


@attrs.frozen
class Forwarded:
    """One HTTP request as the gateway read it: ``headers`` as ASGI gives them (lower-case byte pairs)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@attrs.frozen
class Answer:
    """An HTTP answer: status, ASGI headers, body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


async def call_app(app: Any, request: Forwarded) -> Answer:
    """``app``'s answer to ``request``, called in this process (an ASGI call with the whole body at once)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query, "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    sent = False
    done = asyncio.Event()
    start: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await done.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return Answer(int(start["status"]), tuple(start.get("headers", ())), b"".join(chunks))


class Replica:
    """One replica: the app that ``build()`` returns (``encgraph serve``'s, without an API key: the gateway checks
    it), its lifespan entered (preprocessing workers started) and, when the replica stops, left (the fronts drained,
    then closed)."""

    async def __init__(self, build: Callable[[], Any]) -> None:
        from ray import serve

        # Building and capturing the towers takes seconds: off the replica's event loop.
        self.app = await asyncio.to_thread(build)
        self.id = serve.get_replica_context().replica_id.unique_id.encode()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

    async def forward(self, request: Forwarded) -> Answer:
        answer = await call_app(self.app, request)
        return attrs.evolve(answer, headers=(*answer.headers, (REPLICA_HEADER, self.id)))

    async def __del__(self) -> None:
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)


class Gateway:
    """The ingress (module docs): an ASGI app (``__serve_build_asgi_app__``) that forwards every request to a
    replica through ``replicas`` (a deployment handle), retrying those whose replica died."""

    def __init__(self, replicas: Any, limits: Any, settings: RaySettings, api_key: str | None = None,
                 protect_all: bool = False) -> None:
        from encgraph.serving.admission import InFlight

        self.replicas = replicas
        self.limits = limits
        self.settings = settings
        self.api_key, self.protect_all = api_key, protect_all
        self.in_flight = InFlight(limits.in_flight)

    def __serve_build_asgi_app__(self) -> Any:
        from encgraph.serving.auth import BearerAuth

        app: Any = _Asgi(self._asgi)  # uvicorn's lifespan runner wants an object with __call__, not a method
        if self.api_key is not None:
            app = BearerAuth(app, self.api_key, protect_all=self.protect_all)
        return app

    async def _asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop: the replicas own the models
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return  # Ray's proxy sends nothing else to an HTTP app; a websocket is not answered
        from starlette.requests import Request

        from encgraph.serving.protocol import ApiError, read_body

        ticket = self.in_flight.ticket()
        try:
            try:
                body = await read_body(Request(scope, receive), self.limits, ticket)
                answer = await self._forward(Forwarded(scope["method"], scope["path"], scope.get("query_string", b""),
                                                       tuple(scope["headers"]), body))
            except ApiError as exc:
                await exc.response()(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": answer.status, "headers": list(answer.headers)})
            await send({"type": "http.response.body", "body": answer.body})
        finally:
            ticket.release()

    async def _forward(self, request: Forwarded) -> Answer:
        """The replicas' answer to ``request``; retried on another replica while the one it ran on died, for at
        most ``retry_s`` seconds; an :class:`ApiError` 503 when none answered."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        from encgraph.serving.protocol import ApiError

        retry = {"Retry-After": str(self.settings.retry_after_s)}
        deadline = time.monotonic() + self.settings.retry_s
        died = 0
        while True:
            try:
                answer = await self.replicas.forward.remote(request)
                if died:
                    answer = attrs.evolve(answer, headers=(*answer.headers, (RETRIED_HEADER, str(died).encode())))
                return answer
            except RayActorError as exc:
                died += 1
                if time.monotonic() >= deadline:
                    raise ApiError(503, None, "replica_unavailable",
                                   f"the replica running this request stopped ({type(exc).__name__}) and no other "
                                   f"answered within {self.settings.retry_s:g} s ({died} tries); retry later.",
                                   retry) from None
                await asyncio.sleep(min(0.05 * died, 1.0))
            except BackPressureError:
                raise ApiError(503, None, "overloaded", "the server is overloaded (every replica's queue is full); "
                               "retry later.", retry) from None
            except DeploymentUnavailableError:
                raise ApiError(503, None, "replica_unavailable", "no replica is running; retry later.",
                               retry) from None
            except Exception:  # the replica's own failure (its app answers its errors itself): a JSON 500
                log.exception("encgraph serve --ray: forwarding a request failed")
                raise ApiError(500, None, "internal_error", "internal error: see the replicas' logs.") from None


class _Asgi:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.call(scope, receive, send)


def application(build: Callable[[], Any], limits: Any, settings: RaySettings, *, api_key: str | None = None,
                protect_all: bool = False) -> Any:
    """The Ray Serve application (for ``serve.run``): the replicas, each building its app with ``build`` (a
    picklable callable: it runs in the replicas' processes), behind the gateway with ``limits`` and the API key."""
    from ray import serve

    replica = serve.deployment(**settings.replica_options())(Replica)
    gateway = serve.deployment(**settings.gateway_options())(serve.ingress()(Gateway))
    return gateway.bind(replica.bind(build), limits, settings, api_key, protect_all)
