"""Result files: ``<script>_<slug>.json`` and a ``.md`` table beside it, flushed after every measurement so that a
run cut short keeps what it measured; the machine and versions stored with every result; table formatting."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benches.lib.env import Env

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "benches" / "results"
SMOKE_SLUG = "cpu-smoke"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a bench's child process: this one's, the repository first on ``PYTHONPATH`` (so the
    child imports this checkout) and what was already there after it (wheels installed with ``--target``)."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, **extra, "PYTHONPATH": path}


def result_dirs(results_dir: Any, mirror_dir: Any = None, *, tiny: bool = False) -> list[Path]:
    """Where a script writes its result files: ``results_dir``, and a mirror (``mirror_dir``, else
    ``$OUT/results`` when ``$OUT`` is set and the towers are real): the device tool copies back only ``$OUT``."""
    mirror = mirror_dir
    if mirror is None and os.environ.get("OUT") and not tiny:
        mirror = Path(os.environ["OUT"]) / "results"
    return [Path(results_dir)] + ([Path(mirror)] if mirror is not None else [])


def gpu_name(env: Env) -> str:
    import torch

    return torch.cuda.get_device_name(env.device) if env.cuda else f"CPU ({platform.processor() or platform.machine()})"


def gpu_slug(env: Env) -> str:
    """File-name part naming the machine: ``nvidia-h200``; ``cpu-smoke`` in the CPU smoke."""
    if env.tiny:
        return SMOKE_SLUG
    return "-".join("".join(c if c.isalnum() else " " for c in gpu_name(env).lower()).split())


def git_commit() -> str | None:
    """The checkout's HEAD (``None`` outside a git checkout). A device copy of a working tree reports the HEAD
    it was copied at: result files note the tree they really ran on where that differs."""
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip() or None
    return None


def flash_attn_4_version() -> str | None:
    """The installed flash-attn-4 wheel's version (FlashAttention-4 changes which attention kernel capture picks),
    ``"importable, no package metadata"`` for a tree on the path without its ``dist-info``, else ``None``.
    Imports nothing."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        pass
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("flash_attn")  # a top-level package: found, not imported
        if spec is not None and any((Path(p) / "cute").is_dir() for p in spec.submodule_search_locations or ()):
            return "importable, no package metadata"
    return None


def environment(env: Env) -> dict[str, Any]:
    """Versions, device and commit, stored with every result."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    commit = git_commit()
    return {
        "gpu": gpu_name(env),
        "device": str(env.device),
        "dtype": str(env.dtype).replace("torch.", ""),
        "tiny_towers": env.tiny,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": tf_version,
        "flash_attn_4": flash_attn_4_version(),
        "python": platform.python_version(),
        "commit": commit,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": sys.argv[1:],
    }


def json_ready(value: Any) -> Any:
    """``value`` with enums, numpy scalars and non-finite floats made JSON-safe (recursively)."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class Results:
    """The result files of one script run: ``<script>_<slug>.json`` and ``.md`` in ``--results-dir`` (and the
    mirror directory). ``data`` is the JSON document; ``flush()`` rewrites it (atomically) after each
    measurement."""

    def __init__(self, script: str, args: argparse.Namespace, env: Env) -> None:
        self.script = script
        self.slug = gpu_slug(env) + (f"_{args.tag}" if getattr(args, "tag", None) else "")
        self.dirs = result_dirs(args.results_dir, args.mirror_dir, tiny=env.tiny)
        self.data: dict[str, Any] = {
            "script": script,
            "environment": environment(env),
            "options": {k: json_ready(v) for k, v in vars(args).items() if k not in ("results_dir", "mirror_dir")},
        }

    @property
    def json_path(self) -> Path:
        return self.dirs[0] / f"{self.script}_{self.slug}.json"

    def _write(self, suffix: str, text: str) -> None:
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{self.script}_{self.slug}{suffix}"
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    def flush(self) -> None:
        self._write(".json", json.dumps(json_ready(self.data), indent=1) + "\n")

    def finish(self, table: str) -> None:
        """Write the JSON and the markdown table, and print the table last."""
        self.flush()
        self._write(".md", table + "\n")
        print(table)
        print(f"\nresults: {self.json_path}")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats with up to 3 significant decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"
    return str(value)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def median_of(entry: Mapping[str, Any] | None) -> float | None:
    """The median of a measurement entry, ``None`` if it was skipped or failed."""
    return None if not entry or "median_ms" not in entry else float(entry["median_ms"])


def status_of(entry: Mapping[str, Any] | None) -> str:
    """A table cell for a measurement that has no median: its skip or error reason, shortened."""
    if not entry:
        return "-"
    if "error" in entry:
        return "error"
    return str(entry.get("skipped") or "-").split(":")[0]


def write_rows(json_path: Path, report: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], title: str) -> Path:
    """Write ``report`` as JSON at ``json_path`` and, beside it (``.md``), ``title`` and a table of ``rows`` (flat
    dicts, one column per key in first-seen order): for the benchmarks whose result is one list of rows."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(json_ready(report), indent=2) + "\n", encoding="utf-8")
    headers: list[str] = []
    for row in rows:
        headers += [k for k in row if k not in headers]
    table = markdown_table(headers, [[row.get(h) for h in headers] for row in rows])
    md = json_path.with_suffix(".md")
    md.write_text(f"## {title}\n\n{table}\n\nJSON (with the run's environment): `{json_path.name}`\n", encoding="utf-8")
    return md
