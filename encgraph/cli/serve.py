"""``encgraph serve``: an image-embedding HTTP server (OpenAI embeddings shape) whose requests a batching front
coalesces into graph replays. Needs the ``[serve]`` extra (FastAPI, uvicorn, prometheus_client, Pillow).

With no ``--model`` it serves the embedded defaults (tiny random-weight SigLIP and Qwen2.5-VL towers with their
processors, on the CPU): ``POST /v1/embeddings`` with ``"model": "siglip"`` (the default) or ``"qwen2_5_vl"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from encgraph.cli._common import UsageError, add_subcommand, budget_list, positive_int

__all__ = ["add_parser", "run"]

DTYPES = ("float32", "bfloat16", "float16")


def _named(text: str, value_type: Any) -> tuple[str | None, Any]:
    """``NAME=VALUE`` or ``VALUE`` (for every model)."""
    name, sep, value = text.partition("=")
    if sep and name and os.sep not in name:
        return name, value_type(value)
    return None, value_type(text)


def _budgets(text: str) -> tuple[str | None, tuple[int, ...]]:
    return _named(text, budget_list)


def _model(text: str) -> tuple[str | None, str]:
    return _named(text, str)


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


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
        "'encgraph[serve]'.",
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
    p.add_argument("--max-wait-ms", type=_nonneg_float, default=1.0,
                   help="how long a call waits for more requests after its first (default 1; 0: only what is queued)")
    p.add_argument("--max-requests", type=positive_int,
                   help="requests coalesced into one call at most (default: no limit; 1: no coalescing)")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests waiting per model before answering 503 (default 256)")
    p.add_argument("--max-images", type=positive_int, default=32, help="images per request (default 32)")
    p.add_argument("--max-image-bytes", type=positive_int, default=8 * 2**20,
                   help="bytes of one encoded image (default 8 MiB)")
    p.add_argument("--max-pixels", type=positive_int, default=40_000_000, help="pixels of one image (default 40M)")
    p.add_argument("--preprocess-workers", type=_workers, default=None, metavar="N|auto",
                   help="worker processes that decode the images and run the image processors, off the server "
                   "process's GIL (0: in the server's threads; default auto: 0 when the towers are on the CPU, whose "
                   "forward needs those cores, else half the cores, 1 to 8)")
    p.add_argument("--eager", action="store_true",
                   help="serve the towers' own forward, one request at a time (a baseline for benchmarks)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the embedded models' random weights (default 0)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
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


def build_models(args: argparse.Namespace) -> dict[str, Any]:
    """The served models of the command line, captured and ready."""
    import torch

    from encgraph.serving import loading

    if args.threads:
        torch.set_num_threads(args.threads)
    embedded = not args.model
    device = torch.device(args.device or ("cuda" if not embedded and torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if embedded:
        sources = [(name, None) for name in loading.EMBEDDED]
    else:
        sources = [(name or os.path.basename(os.path.normpath(path)), path) for name, path in args.model]
    names = [n for n, _ in sources]
    if len(set(names)) != len(names):
        raise UsageError(f"encgraph serve: error: --model: two models named alike ({names}); use NAME=PATH")
    budgets = _per_model(args.budgets, names, "--budgets")
    options = {"max_wait_ms": args.max_wait_ms, "max_queue": args.max_queue, "max_requests": args.max_requests}
    models = {}
    for name, path in sources:
        if path is None:
            tower, description = loading.embedded_tower(name, device=device, dtype=dtype, seed=args.seed)
            processor = loading.load_processor(name)
            ladder = budgets.get(name, loading.EMBEDDED[name])
        else:
            tower, processor, description = loading.load_checkpoint(path, device=device, dtype=dtype)
            ladder = budgets.get(name)
        models[name] = loading.build_model(name, tower, processor, description, budgets=ladder, eager=args.eager,
                                           front_options=options)
    return models


def run(args: argparse.Namespace) -> int:
    _require_serve_extra()
    import uvicorn

    from encgraph.serving import heap
    from encgraph.serving.app import ServerLimits, create_app
    from encgraph.serving.images import ImageLimits
    from encgraph.serving.preprocess import default_workers

    models = build_models(args)
    limits = ServerLimits(max_images=args.max_images, image=ImageLimits(args.max_image_bytes, args.max_pixels),
                          max_body_bytes=args.max_images * (args.max_image_bytes * 4 // 3 + 1024) + 65536)
    workers = args.preprocess_workers
    if workers is None:
        workers = default_workers(m.device for m in models.values())
    app = create_app(models, limits, preprocess_workers=workers)
    if importlib.util.find_spec("httptools") is None:
        # uvicorn then falls back to h11 (pure Python): measured 2-4x slower per 60 KB request on a 2-core CPU.
        print("encgraph serve: httptools is not installed, so uvicorn parses HTTP in pure Python (h11), several "
              "times slower per request; pip install httptools (part of encgraph[serve]).", file=sys.stderr, flush=True)
    # The models are built and captured: freeze that heap, so that a full garbage collection under load does not
    # walk it (220-250 ms with every request waiting: encgraph.serving.heap).
    frozen = heap.freeze()
    listed = ", ".join(f"{n} ({m.description})" for n, m in models.items())
    print(f"encgraph serve: http://{args.host}:{args.port}/v1/embeddings - models: {listed}; preprocessing "
          f"{f'in {workers} worker processes' if workers else 'in the server threads'}; {frozen} start-up objects "
          "frozen out of the garbage collector's reach", file=sys.stderr, flush=True)
    # uvicorn starts the app (its preprocessing workers) before it listens. It stops on SIGINT/SIGTERM: it stops
    # accepting, lets the requests in flight finish (at most 10 s), then the app's shutdown closes the fronts and
    # the workers; the process then exits 0.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=10)
    return 0
