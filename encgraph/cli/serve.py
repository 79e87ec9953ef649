"""``encgraph serve``: an image-embedding HTTP server (OpenAI embeddings shape) whose requests a batching front
coalesces into graph replays. Needs the ``[serve]`` extra (FastAPI, uvicorn, prometheus_client, Pillow).

With no ``--model`` it serves the embedded defaults (tiny random-weight SigLIP and Qwen2.5-VL towers with their
processors, on the CPU): ``POST /v1/embeddings`` with ``"model": "siglip"`` (the default) or ``"qwen2_5_vl"``.

Everything that can be checked without building a tower is checked first, each failure one line on stderr and exit
2: the arguments (ranges, finite waits), the address (the listening socket is bound before the models are built
and handed to uvicorn), the device, and each ``--model`` checkpoint (:mod:`encgraph.serving.checkpoints`).
``--ray`` serves the same app on a Ray cluster instead (:mod:`encgraph.cli.serve_ray`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
from typing import Any

from encgraph.cli import serve_ray
from encgraph.cli._common import UsageError, add_subcommand, bounded_float, budget_list, positive_int

__all__ = ["add_parser", "run"]

DTYPES = ("float32", "bfloat16", "float16")
MAX_BUDGET = 2**20
"""The largest budget accepted in merged tokens (Qwen-VL): 32 images of 16,384 tokens (Qwen's largest) twice over.
A budget in images is at most what the queue can hold (--max-images x --max-queue): a larger one is never
filled, only allocated."""
MAX_WAIT_MS = 60_000.0
MAX_GRACEFUL_S = 3600.0

AUTH_HELP = (
    "Authentication (optional): with --api-key KEY, or the environment variable ENCGRAPH_API_KEY (which, unlike a "
    "flag, does not show in the process list), every request under /v1/ must send the header 'Authorization: "
    "Bearer KEY'; one without it or with another key is answered 401 with a JSON error (code invalid_api_key) and "
    "'WWW-Authenticate: Bearer'. GET /health and GET /metrics stay open for probes and scrapers unless "
    "--api-key-everywhere. Without a key nothing is checked; the server listens on 127.0.0.1 unless --host says "
    "otherwise."
)
LIMITS_HELP = (
    "Memory: a request's pixels are counted from its images' headers before any is decoded; over "
    "--max-request-pixels it is refused (413), and it is decoded only while the requests being decoded hold at most "
    "--max-pixels-in-flight pixels and the bodies being read or held at most --max-body-bytes-in-flight bytes "
    "(else 503 with Retry-After). With the defaults the requests in flight hold at most about 4 GiB (16 bytes "
    "counted per decoded pixel, 10.4-10.9 measured; bodies counted twice) on top of the idle server (its resident "
    "memory after start-up, which depends on the models served): a 24 GB machine cannot be pushed out of memory by "
    "any sequence of requests."
)


def _named(text: str, value_type: Any) -> tuple[str | None, Any]:
    """``NAME=VALUE`` or ``VALUE`` (for every model)."""
    name, sep, value = text.partition("=")
    if sep and name and os.sep not in name:
        return name, value_type(value)
    return None, value_type(text)


def _budgets(text: str) -> tuple[str | None, tuple[int, ...]]:
    return _named(text, _budget_list)


def _model(text: str) -> tuple[str | None, str]:
    return _named(text, str)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return value


def _budget_list(text: str) -> tuple[int, ...]:
    values = budget_list(text)
    if values[-1] > MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"expected budgets of at most {MAX_BUDGET} (images, or merged tokens for "
                                         f"Qwen-VL), got {values[-1]} in {text!r}")
    return values


def _workers(text: str) -> int | None:
    """``auto`` (None: decided by the towers' device) or a number of processes >= 0."""
    if text in ("auto", "0"):
        return None if text == "auto" else 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of processes >= 0, got {text!r}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_subcommand(
        subparsers, "serve", run,
        help="serve image embeddings over HTTP (OpenAI embeddings shape), batching requests into graph replays",
        description="Serve POST /v1/embeddings (base64 PNG/JPEG images in, one pooled embedding per image out), "
        "GET /health and GET /metrics. Concurrent requests are coalesced into one runner call. Without --model: "
        "the embedded tiny random-weight SigLIP and Qwen2.5-VL towers on the CPU. Needs pip install "
        "'encgraph[serve]'. Bad arguments, addresses, devices and checkpoints are refused (one line, exit 2) before "
        "any model is built. " + AUTH_HELP + " " + LIMITS_HELP,
    )
    p.add_argument("--model", action="append", type=_model, metavar="[NAME=]PATH",
                   help="a local Hugging Face checkpoint directory (its vision tower and preprocessor_config.json); "
                   "repeat for several models; NAME defaults to the directory's name")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu for the embedded models; for --model cuda "
                   "when available)")
    p.add_argument("--dtype", choices=DTYPES, help="tower dtype (default float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--budgets", action="append", type=_budgets, metavar="[NAME=]LIST",
                   help="a model's ladder, comma-separated (images for batch towers, merged tokens for Qwen-VL); "
                   "without NAME= for every model")
    p.add_argument("--max-wait-ms", type=bounded_float(MAX_WAIT_MS, "milliseconds"), default=1.0,
                   help="how long a call waits for more requests after its first (default 1; 0: only what is queued; "
                   f"at most {MAX_WAIT_MS:g})")
    p.add_argument("--max-requests", type=positive_int,
                   help="requests coalesced into one call at most (default: no limit; 1: no coalescing)")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests waiting per model before answering 503 (default 256)")
    p.add_argument("--max-images", type=positive_int, default=32, help="images per request (default 32)")
    p.add_argument("--max-image-bytes", type=positive_int, default=8 * 2**20,
                   help="bytes of one encoded image (default 8 MiB)")
    p.add_argument("--max-pixels", type=positive_int, default=40_000_000, help="pixels of one image (default 40M)")
    p.add_argument("--max-request-pixels", type=positive_int, default=100_000_000,
                   help="pixels of one request, its images together, counted before decoding (default 100M)")
    p.add_argument("--max-pixels-in-flight", type=positive_int, default=200_000_000,
                   help="pixels being decoded and preprocessed at once over all requests; a request past it is "
                   "answered 503 (default 200M, at least --max-request-pixels)")
    p.add_argument("--max-body-bytes-in-flight", type=positive_int, default=512 * 2**20,
                   help="bytes of request bodies read or held at once (default 512 MiB, raised to one request's "
                   "largest body when that is more)")
    p.add_argument("--preprocess-workers", type=_workers, default=None, metavar="N|auto",
                   help="worker processes that decode the images and run the image processors, off the server "
                   "process's GIL (0: in the server's threads; default auto: 0 when the towers are on the CPU, whose "
                   "forward needs those cores, else half the cores, 1 to 8)")
    p.add_argument("--preprocess-on", choices=("host", "device"), default="host",
                   help="where the image processor resizes and normalises: host (default), or device (the host only "
                   "decodes; transformers' torchvision processor runs on the towers' device; needs torchvision)")
    p.add_argument("--request-threads", type=positive_int, default=4, metavar="N",
                   help="threads for the requests' copies to the device, and as many for their answers (default 4)")
    p.add_argument("--eager", action="store_true",
                   help="serve the towers' own forward, one request at a time (a baseline for benchmarks)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument("--graceful-timeout", type=bounded_float(MAX_GRACEFUL_S, "seconds"), default=10.0,
                   help="on SIGTERM or SIGINT: seconds the requests in flight may take to finish; those still running "
                   "then are answered 503 (JSON, code shutting_down) and the server exits (default 10)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the environment variable "
                   "ENCGRAPH_API_KEY, else no authentication)")
    p.add_argument("--api-key-everywhere", action="store_true",
                   help="require the key on /health and /metrics too (default: they stay open)")
    p.add_argument("--seed", type=int, default=0, help="seed of the embedded models' random weights (default 0)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    serve_ray.add_arguments(p)
    return p


def _require_serve_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client", "PIL"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        from encgraph.errors import VersionError

        raise VersionError(f"encgraph serve needs {', '.join(missing)}; install them with pip install 'encgraph[serve]'.")


def _per_model(values: list[tuple[str | None, Any]] | None, names: list[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values or []:
        if name is not None and name not in names:
            raise UsageError(f"encgraph serve: error: {what} {name}=...: no model {name!r} (models: {', '.join(names)})")
        for n in names if name is None else [name]:
            out[n] = value
    return out


def check_device(text: str | None, embedded: bool) -> Any:
    """The ``torch.device`` of ``--device`` (default: the CPU for the embedded models, else CUDA when there is
    one); a :class:`UsageError` for a device this torch cannot use."""
    import torch

    if text is None:
        return torch.device("cuda" if not embedded and torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"encgraph serve: error: --device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"encgraph serve: error: --device {text}: no CUDA device is available to this torch "
                             f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise UsageError(f"encgraph serve: error: --device {text}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    return device


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound to ``host``:``port`` (not yet listening), or a :class:`UsageError` saying why
    it cannot be: checked before any model is built, and handed to uvicorn, so that nobody takes the port between."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"encgraph serve: error: --host {host!r}: not an address to listen on "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port is free
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "another process listens there; choose another --port" if exc.errno == 98 else "choose another --host"
        raise UsageError(f"encgraph serve: error: --host {host} --port {port}: cannot listen there "
                         f"({exc.strerror}); {hint}") from None
    return sock


def check_args(args: argparse.Namespace) -> None:
    """The checks of the arguments that need no model (see the module docs), in the order a user fixes them."""
    if args.max_request_pixels > args.max_pixels_in_flight:
        raise UsageError(f"encgraph serve: error: --max-pixels-in-flight {args.max_pixels_in_flight}: expected at "
                         f"least --max-request-pixels ({args.max_request_pixels}), or a request could never run")
    from encgraph.serving.auth import API_KEY_ENV, valid_key

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not valid_key(key):
        where = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise UsageError(f"encgraph serve: error: {where}: expected a non-empty key without spaces")
    serve_ray.check_args(args)
    if args.api_key_everywhere and key is None:
        raise UsageError(f"encgraph serve: error: --api-key-everywhere: no key given (--api-key or {API_KEY_ENV})")
    args.resolved_api_key = key


def _sources(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, checked checkpoint or None for an embedded model) of every served model."""
    from encgraph.serving import loading

    if not args.model:
        return [(name, None) for name in loading.EMBEDDED]
    sources = [(name or os.path.basename(os.path.normpath(path)), path) for name, path in args.model]
    names = [n for n, _ in sources]
    if len(set(names)) != len(names):
        raise UsageError(f"encgraph serve: error: --model: two models named alike ({names}); use NAME=PATH")
    return [(name, loading.inspect_checkpoint(path)) for name, path in sources]


def check_models(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """The served models' sources (:func:`_sources`: every checkpoint checked) and ladders, no tower built."""
    from encgraph.serving import loading

    sources = _sources(args)
    names = [n for n, _ in sources]
    budgets = _per_model(args.budgets, names, "--budgets")
    most = args.max_images * args.max_queue  # budgets in tokens were held to MAX_BUDGET when parsed
    for name, checkpoint in sources:
        unit = loading.FAMILIES[checkpoint.model_type if checkpoint else name].unit
        if unit == "images" and name in budgets and budgets[name][-1] > most:
            raise UsageError(f"encgraph serve: error: --budgets {name}=...: {budgets[name][-1]} {unit} is more than "
                             f"one call can hold (at most {most}: --max-images x --max-queue)")
    return sources, budgets


def build_models(args: argparse.Namespace) -> dict[str, Any]:
    """The served models of the command line, captured and ready: every checkpoint is checked before the first
    tower is built."""
    import torch

    from encgraph.serving import loading

    if args.threads:
        torch.set_num_threads(args.threads)
    embedded = not args.model
    device = check_device(args.device, embedded)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sources, budgets = check_models(args)
    options = {"max_wait_ms": args.max_wait_ms, "max_queue": args.max_queue, "max_requests": args.max_requests}
    models = {}
    for name, checkpoint in sources:
        if checkpoint is None:
            tower, description = loading.embedded_tower(name, device=device, dtype=dtype, seed=args.seed)
            processor = loading.load_processor(name)
            ladder = budgets.get(name, loading.EMBEDDED[name])
        else:
            tower, description = loading.load_tower(checkpoint, device=device, dtype=dtype)
            processor = checkpoint.processor
            ladder = budgets.get(name)
        if args.preprocess_on == "device":
            from encgraph.serving.device_preprocess import device_processing

            processor = device_processing(processor)
        models[name] = loading.build_model(name, tower, processor, description, budgets=ladder, eager=args.eager,
                                           front_options=options)
    return models


def run(args: argparse.Namespace) -> int:
    _require_serve_extra()
    check_args(args)
    if args.ray:
        return serve_ray.run(args, sys.modules[__name__])
    sock = bind(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def server_limits(args: argparse.Namespace) -> Any:
    """The :class:`~encgraph.serving.app.ServerLimits` of the command line."""
    from encgraph.serving.admission import InFlightLimits
    from encgraph.serving.app import ServerLimits
    from encgraph.serving.images import ImageLimits

    max_body = args.max_images * (args.max_image_bytes * 4 // 3 + 1024) + 65536
    in_flight = InFlightLimits(max_body_bytes=max(args.max_body_bytes_in_flight, max_body),
                               max_pixels=args.max_pixels_in_flight)
    return ServerLimits(max_images=args.max_images, image=ImageLimits(args.max_image_bytes, args.max_pixels),
                        max_body_bytes=max_body, max_request_pixels=args.max_request_pixels, in_flight=in_flight)


def make_app(args: argparse.Namespace, *, authenticate: bool = True) -> Any:
    """The server's app for the (checked) command line: its models built and captured, its limits, preprocessing
    workers and (``authenticate``) API key. ``encgraph serve --ray`` builds one in each replica (without the key:
    its gateway checks it)."""
    from encgraph.serving.app import create_app
    from encgraph.serving.preprocess import default_workers

    models = build_models(args)
    workers = args.preprocess_workers
    if workers is None:
        workers = default_workers(m.device for m in models.values())
    return create_app(models, server_limits(args), preprocess_workers=workers, close_timeout_s=args.graceful_timeout,
                      request_threads=args.request_threads, api_key=args.resolved_api_key if authenticate else None,
                      protect_all=args.api_key_everywhere)


def describe(app: Any) -> str:
    """The start line's middle: the models and where their images are preprocessed."""
    listed = ", ".join(f"{n} ({m.description})" for n, m in app.state.models.items())
    workers = app.state.preprocess.workers if app.state.preprocess is not None else 0
    where = f"in {workers} worker processes" if workers else "in the server threads"
    if any(hasattr(m.processor, "on_device") for m in app.state.models.values()):
        where = f"decoding {where}, resizing and normalising on the device"
    return f"models: {listed}; preprocessing {where}"


def auth_scope(args: argparse.Namespace) -> str:
    return "off" if args.resolved_api_key is None else ("every path" if args.api_key_everywhere else "/v1/*")


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from encgraph.serving import heap

    app = make_app(args)
    if importlib.util.find_spec("httptools") is None:
        # uvicorn then falls back to h11 (pure Python): measured 2-4x slower per 60 KB request on a 2-core CPU.
        print("encgraph serve: httptools is not installed, so uvicorn parses HTTP in pure Python (h11), several "
              "times slower per request; pip install httptools (part of encgraph[serve]).", file=sys.stderr, flush=True)
    # The models are built and captured: freeze that heap, so that a full garbage collection under load does not
    # walk it (220-250 ms with every request waiting: encgraph.serving.heap).
    frozen = heap.freeze()
    print(f"encgraph serve: http://{args.host}:{args.port}/v1/embeddings - {describe(app)}; API key: "
          f"{auth_scope(args)}; {frozen} start-up objects frozen out of the garbage collector's reach",
          file=sys.stderr, flush=True)
    # uvicorn starts the app (its preprocessing workers) before it listens on the socket bound above. It stops on
    # SIGINT/SIGTERM: it stops accepting, lets the requests in flight finish (--graceful-timeout; the app answers
    # those left 503 just before), then the app's shutdown closes the fronts and the workers; the process then
    # re-raises the signal.
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.graceful_timeout)
    draining = app.state.draining

    class Server(uvicorn.Server):
        """uvicorn's server, telling the app when its graceful shutdown starts (``Draining``)."""

        async def shutdown(self, sockets: Any = None) -> None:
            draining.begin(self.config.timeout_graceful_shutdown)
            await super().shutdown(sockets=sockets)

    Server(config).run(sockets=[sock])
    return 0
