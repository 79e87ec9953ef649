"""``encgraph serve --ray``: deploy the server on a Ray cluster (:mod:`encgraph.serving.ray_app`) and keep it up
until SIGINT or SIGTERM. Needs the ``[ray]`` extra (``ray[serve]``); Ray is imported only when ``--ray`` runs.

What needs no cluster is checked first (the arguments, each ``--model`` checkpoint, the ladders), each failure one
line and exit 2; then the cluster is joined (``--address``) and its GPUs counted: on CUDA one replica per GPU unless
``--replicas`` says otherwise. Every replica builds the models itself from this command line (the same function as
``encgraph serve``, :func:`encgraph.cli.serve.make_app`, which ``run`` is handed); ``serve.run`` returns once all of
them answer.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import threading
from typing import Any

from encgraph.cli._common import UsageError, bounded_float, positive_int

__all__ = ["add_arguments", "check_args", "run", "build_replica_app"]

MAX_TARGET = 100_000.0
OPTIONS = ("address", "replicas", "max_replicas", "target_ongoing_requests", "gateways")
"""The flags that mean something only with ``--ray`` (their dests)."""

HELP = (
    "With --ray the same server runs on a Ray cluster: each replica builds the models as encgraph serve does, on one "
    "GPU of its own (none on the CPU), behind Ray Serve's HTTP proxy on --host/--port (on every node of the cluster) "
    "with the same paths, limits, API key and error shapes. A request whose replica dies is retried on another one, "
    "or answered 503 (code replica_unavailable); Ray replaces the replica. --model paths must exist on every node. "
    "SIGINT/SIGTERM deletes the application (the replicas finish their requests within --graceful-timeout) and exits."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("Ray Serve (pip install 'encgraph[ray]')", HELP)
    ray.add_argument("--ray", action="store_true",
                     help="serve on a Ray cluster: one replica per GPU behind Ray's HTTP proxy (--host, --port)")
    ray.add_argument("--address", help="the Ray cluster to join, as 'ray start --head' printed it (HOST:PORT, or "
                     "'auto' for the one running on this machine; default: RAY_ADDRESS, else a new Ray instance on "
                     "this machine, stopped on exit)")
    ray.add_argument("--replicas", type=positive_int,
                     help="replicas started (default: one per GPU of the cluster on CUDA, 1 on the CPU)")
    ray.add_argument("--max-replicas", type=positive_int,
                     help="let Ray's autoscaler add replicas up to this many while their queues are deep (default: "
                     "--replicas, a fixed count)")
    ray.add_argument("--target-ongoing-requests", type=bounded_float(MAX_TARGET, "requests"),
                     help="the requests per replica (queued in its fronts or running) that autoscaling keeps them "
                     "near (default 16)")
    ray.add_argument("--gateways", type=positive_int,
                     help="gateway replicas between Ray's proxy and the model replicas (default 1; no CPU reserved)")


def check_args(args: argparse.Namespace) -> None:
    given = [name for name in OPTIONS if getattr(args, name, None) is not None]
    if given and not args.ray:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"encgraph serve: error: {flags}: only with --ray")
    if args.ray and args.target_ongoing_requests is not None and args.target_ongoing_requests <= 0:
        raise UsageError("encgraph serve: error: --target-ongoing-requests: expected a number above 0")
    if args.ray and None not in (args.max_replicas, args.replicas) and args.max_replicas < args.replicas:
        raise UsageError(f"encgraph serve: error: --max-replicas {args.max_replicas}: expected at least --replicas "
                         f"({args.replicas})")


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        from encgraph.errors import VersionError

        raise VersionError("encgraph serve --ray needs ray[serve]; install it with pip install 'encgraph[ray]'.") from None


def plan(args: argparse.Namespace, cluster_gpus: float) -> tuple[argparse.Namespace, Any]:
    """The replicas' command line (the device made explicit, no API key: the gateway checks it) and the
    :class:`~encgraph.serving.ray_app.RaySettings`, for a cluster with ``cluster_gpus`` GPUs."""
    from encgraph.serving.ray_app import RaySettings

    embedded = not args.model
    device = args.device or ("cuda" if cluster_gpus >= 1 and not embedded else "cpu")
    if device.startswith("cuda"):
        if device not in ("cuda", "cuda:0"):
            raise UsageError(f"encgraph serve: error: --device {device}: with --ray each replica sees the one GPU Ray "
                             "gives it; use --device cuda")
        if cluster_gpus < 1:
            raise UsageError(f"encgraph serve: error: --device {device}: the Ray cluster has no GPU; use --device cpu")
    elif device != "cpu":
        raise UsageError(f"encgraph serve: error: --device: expected cpu, cuda or cuda:N, got {device!r}")
    gpus = 1.0 if device.startswith("cuda") else 0.0
    replicas = args.replicas or (max(1, int(cluster_gpus)) if gpus else 1)
    if args.max_replicas is not None and args.max_replicas < replicas:
        raise UsageError(f"encgraph serve: error: --max-replicas {args.max_replicas}: expected at least the replicas "
                         f"started ({replicas})")
    settings = RaySettings(
        replicas=replicas, max_replicas=args.max_replicas, gpus=gpus, gateways=args.gateways or 1,
        target_ongoing_requests=args.target_ongoing_requests or 16.0, max_ongoing_requests=args.max_queue,
        graceful_s=args.graceful_timeout,
    )
    replica_args = copy.copy(args)
    replica_args.device = "cuda" if gpus else "cpu"
    replica_args.resolved_api_key = None
    replica_args.run = None  # the replicas need the options only
    return replica_args, settings


def build_replica_app(make_app: Any, args: argparse.Namespace) -> Any:
    """One replica's app (runs in the replica's process): ``make_app`` (:func:`encgraph.cli.serve.make_app`) without
    the key, its start-up heap frozen as ``encgraph serve`` does."""
    from encgraph.serving import heap

    app = make_app(args, authenticate=False)
    heap.freeze()
    return app


def run(args: argparse.Namespace, server: Any) -> int:
    """Deploy, wait for SIGINT/SIGTERM, delete. ``server``: the :mod:`encgraph.cli.serve` module (its
    ``check_models``, ``make_app``, ``server_limits``, ``auth_scope``), handed over by it rather than imported here,
    so that the two modules do not import each other."""
    import functools
    import logging

    _require_ray()
    sources, _ = server.check_models(args)  # every checkpoint and ladder, before the cluster is touched
    import ray
    from ray import serve

    from encgraph.serving.ray_app import APP_NAME, application

    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its start-up chatter; warnings and errors still show
    owned = args.address is None and not os.environ.get("RAY_ADDRESS")  # ray.init started a new instance
    deployed = False
    try:
        replica_args, settings = plan(args, ray.cluster_resources().get("GPU", 0.0))
        serve.start(http_options={"host": args.host, "port": args.port})
        build = functools.partial(build_replica_app, server.make_app, replica_args)
        app = application(build, server.server_limits(args), settings,
                          api_key=args.resolved_api_key, protect_all=args.api_key_everywhere)
        deployed = True
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)  # returns once every replica answers
        scaling = (f"{settings.replicas} to {settings.max_replicas} replicas (autoscaled near "
                   f"{settings.target_ongoing_requests:g} ongoing requests each)"
                   if settings.max_replicas not in (None, settings.replicas)
                   else f"{settings.replicas} replica{'s' if settings.replicas > 1 else ''}")
        print(f"encgraph serve: http://{args.host}:{args.port}/v1/embeddings on Ray "
              f"({ray.get_runtime_context().gcs_address}) - {scaling} of {', '.join(n for n, _ in sources)}, "
              f"{'one GPU' if settings.gpus else 'on the CPU'} each; API key: {server.auth_scope(args)}",
              file=sys.stderr, flush=True)
        _wait_for_a_signal()
    finally:
        # Also after a failed or interrupted start (Ray's own SIGTERM handler raises SystemExit): nothing is left
        # deployed on a cluster that outlives this command.
        if deployed:
            serve.delete(APP_NAME)  # the replicas drain (graceful_shutdown_timeout_s) and stop
            # The proxies and the controller too, unless other applications use them; in a Ray instance of this
            # command's own, ray.shutdown() stops them with everything else.
            if not owned and not serve.status().applications:
                serve.shutdown()
        ray.shutdown()  # a Ray instance this command started stops with it
    return 0


def _wait_for_a_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
