"""What the subcommands share: argument types, the usage error, output (tables, JSON), plan rendering.

Torch-free: ``encgraph plan`` imports only this, the planner and the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, TypeVar

from encgraph.packing import Plan

__all__ = [
    "UsageError",
    "Parser",
    "budget_list",
    "positive_int",
    "bounded_float",
    "add_subcommand",
    "add_output_args",
    "add_pixel_args",
    "read_text",
    "table",
    "emit_json",
    "plan_lines",
    "budget_text",
    "plan_json",
    "progress",
    "count",
]

T = TypeVar("T")


class UsageError(Exception):
    """A bad command line: ``main`` prints the message on one line and exits 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (one line, exit 2) instead of printing the
    usage block and calling ``sys.exit`` from inside a library call."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def bounded_float(most: float, unit: str) -> Any:
    """argparse type: a finite number from 0 to ``most`` (``inf``, ``nan`` and ``1e12`` refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 <= value <= most):
            raise argparse.ArgumentTypeError(f"expected a number of {unit} from 0 to {most:g}, got {text!r}")
        return value

    return parse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def budget_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive int budgets, e.g. ``64,128,256``; sorted, repeats dropped."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints such as 64,128,256, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints such as 64,128,256, got {text!r}")
    return tuple(sorted(set(values)))


def add_subcommand(
    subparsers: Any, name: str, run: Callable[[argparse.Namespace], int], *, help: str, description: str,
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (``run`` called with its parsed arguments); an ``epilog`` keeps its
    line breaks (the log and item formats are laid out by hand)."""
    kwargs: dict[str, Any] = {"help": help, "description": description}
    if epilog is not None:
        kwargs.update(epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser = subparsers.add_parser(name, **kwargs)
    parser.set_defaults(run=run)
    return parser


def add_pixel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-pixels", type=positive_int, help="override the processor's min_pixels")
    parser.add_argument("--max-pixels", type=positive_int, help="override the processor's max_pixels")


def read_text(
    path: str | None, what: str, *, command: str, stdin: bool = True, example: str = ""
) -> tuple[str, str]:
    """The UTF-8 text of the file ``path`` and the name to quote in messages; with ``stdin``, ``'-'`` or ``None``
    (no file given) read standard input.  A one-line :class:`UsageError` of ``encgraph {command}`` naming
    ``what`` when unreadable.

    No file given while standard input is a terminal is a :class:`UsageError` that says what the command expects
    (``example``: a command line that works) rather than a silent wait for typed input; ``'-'`` on a terminal
    reads it, after a line on stderr saying so and how to end it.  Piped or redirected input reads as ever.
    """
    if stdin and path in (None, "-"):
        if _terminal(sys.stdin):
            if path is None:
                raise UsageError(
                    f"encgraph {command}: error: expected {what} as a path or piped to standard input, got neither "
                    f"(standard input is a terminal); e.g. {example} (see 'encgraph {command} --help')"
                )
            print(f"encgraph {command}: reading {what} from the terminal; end it with Ctrl-D", file=sys.stderr)
        return sys.stdin.read(), "<stdin>"
    if path is None:
        raise UsageError(f"encgraph {command}: error: expected {what} as a path, got none")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except OSError as exc:
        raise UsageError(f"encgraph {command}: error: cannot read {what} {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"encgraph {command}: error: {what} {path!r} is not UTF-8 text") from None


def _terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or missing stream is not)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (for machines) instead of text")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, left: int = 1, indent: str = "  ") -> list[str]:
    """Lines of a plain-text table, two spaces between columns: the last ``left`` columns (text) left-aligned,
    the others (numbers) right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    split = len(headers) - left

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if i < split else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return (indent + "  ".join(out)).rstrip()

    return [line(list(headers))] + [line(r) for r in cells]


def emit_json(obj: Any, stream: IO[str] | None = None) -> None:
    json.dump(obj, stream or sys.stdout, indent=2, sort_keys=False, default=_json_default)
    (stream or sys.stdout).write("\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if hasattr(value, "value"):  # enums
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def budget_text(plan: Plan, budgets: dict[str, int | None]) -> str:
    """A batch's budgets: ``"256"`` / ``"eager"`` for one path, ``"global=256 local=eager"`` for several."""

    def one(b: int | None) -> str:
        return "eager" if b is None else str(b)

    if len(plan.paths) == 1:
        return one(budgets[plan.paths[0]])
    return " ".join(f"{p}={one(budgets[p])}" for p in plan.paths)


def plan_lines(plan: Plan, labels: Sequence[str] | None = None, *, unit: str = "tokens") -> list[str]:
    """The plan as text: one row per batch (budget, real units, padding, frames, items), then the padded share
    and the eager items with their reasons.  ``labels[i]`` names item ``i`` in the eager list; ``unit`` is what
    the budgets count ("tokens", or "images" for a batch-size ladder)."""
    one = len(plan.paths) == 1
    rows = []
    for i, b in enumerate(plan.batches):
        tokens = sum(b.tokens.values())
        padded = sum(b.padded.values()) if _replays(b) else "-"
        reasons = sorted({r.value for r in b.eager.values()})
        rows.append(
            (
                i,
                budget_text(plan, b.budgets),
                tokens,
                padded,
                b.frames,
                ", ".join(map(str, b.items)) + (f"  ({'; '.join(reasons)})" if reasons else ""),
            )
        )
    replays = sum(1 for b in plan.batches if _replays(b))
    eager_batches = sum(1 for b in plan.batches if b.eager)
    out = [f"plan: {len(plan.batches)} batches, {replays} replayed, {eager_batches} with an eager path"]
    out += table(("batch", "budget" if one else "budgets", unit, "padded", "frames", "items"), rows)
    for path, t in plan.totals().items():
        where = "" if one else f" on path {path!r}"
        replayed_tokens = t["real_tokens"] + t["padded_tokens"]
        out.append(
            f"padded share{where}: {t['padded_share']:.1%} ({t['padded_tokens']} padding of {replayed_tokens} "
            f"{unit} computed)"
        )
    eager = [(index, r) for b in plan.batches for index in b.items for r in sorted({r.value for r in b.eager.values()})]
    if eager:
        named = [f"{index}" + (f" [{labels[index]}]" if labels else "") + f": {reason}" for index, reason in eager]
        out.append(f"eager items: {len(eager)} ({'; '.join(named)})")
    else:
        out.append("eager items: none")
    return out


def _replays(batch: Any) -> bool:
    """Whether a batch replays a graph on some path: a budget > 0 (None runs eager, 0 skips an empty path)."""
    return any(v for v in batch.budgets.values())


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan for ``--json``: ``Plan.to_dict()`` (round-trips through ``Plan.from_dict``) plus its totals and
    the eager items with their reasons."""
    return {
        **plan.to_dict(),
        "totals": plan.totals(),
        "eager_items": [
            {"item": index, "path": path, "reason": r.name, "why": r.value}
            for b in plan.batches
            for index in b.items
            for path, r in b.eager.items()
        ],
    }


def progress(iterable: Iterable[T], *, desc: str, enabled: bool, total: int | None = None) -> Iterator[T]:
    """A tqdm progress bar on stderr over ``iterable`` (plain iteration when ``enabled`` is false)."""
    if not enabled:
        yield from iterable
        return
    from tqdm.auto import tqdm

    # delay: a bar appears only for a step that runs over a second.
    yield from tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, delay=1.0)


def count(n: int, noun: str) -> str:
    """``"1 video"``, ``"2 videos"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
