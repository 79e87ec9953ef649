"""The options every script shares (:func:`base_parser`), argparse types for comma lists, and the skeleton of a
script's ``main`` (:func:`run_script`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benches.lib.cases import SMOKE_CASES
from benches.lib.env import Deadline, Env, inference, make_env
from benches.lib.results import RESULTS_DIR, Results
from benches.lib.towers import SMOKE_TOWERS


def parse_names(choices: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type`` for a comma list of names out of ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {list(allowed)}, got {text!r}")
        return names

    return parse


def _tag(text: str) -> str:
    if not text or not all(c.isalnum() or c == "-" for c in text):
        raise argparse.ArgumentTypeError(f"expected letters, digits and '-', got {text!r}")
    return text


def base_parser(script: str, description: str, *, time_budget: float) -> argparse.ArgumentParser:
    """The options every script shares; each adds its own."""
    parser = argparse.ArgumentParser(
        prog=f"benches/{script}.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
        help="run the whole code path on tiny CPU towers (fp32, runner STATIC mode, 2 timed runs) in seconds",
    )
    parser.add_argument(
        "--time-budget", type=float, default=time_budget, metavar="S",
        help=f"seconds; no new measurement starts past it, and what is skipped is recorded (default {time_budget:g})",
    )
    parser.add_argument("--runs", type=int, default=30, help="timed runs per measurement (median reported; default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each measurement (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, pixels and traces (default 0)")
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR, help=f"where JSON and tables go (default {RESULTS_DIR})"
    )
    parser.add_argument(
        "--tag", type=_tag, default=None,
        help="appended to the result file names (<script>_<gpu>_<tag>.json), so that a partial or special run "
             "does not overwrite the main one",
    )
    parser.add_argument(
        "--mirror-dir", type=Path, default=None,
        help="a second directory that gets a copy of every result file (default: $OUT/results when $OUT is set)",
    )
    return parser


def smoke_defaults(args: argparse.Namespace, *, towers: tuple[str, ...], cases: tuple[str, ...] | None = None) -> None:
    """Resolve ``--towers`` (and ``--cases``) left unset: everything on a GPU, the smoke's subset on the CPU."""
    if getattr(args, "towers", None) is None:
        args.towers = SMOKE_TOWERS if args.cpu_smoke else towers
    if cases is not None and getattr(args, "cases", None) is None:
        args.cases = SMOKE_CASES if args.cpu_smoke else cases


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"64,448,2048"`` -> ``(64, 448, 2048)`` (argparse ``type``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected budgets >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def run_script(script: str, args: argparse.Namespace,
               body: Callable[[argparse.Namespace, Env, Deadline, Results], None],
               render: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """The skeleton of a script's ``main``: the :class:`Env` and :class:`Deadline` of ``args``, ``body`` filling a
    :class:`Results` under inference mode, then the table printed last; returns the JSON document."""
    env = make_env(args)
    deadline = Deadline(args.time_budget)
    results = Results(script, args, env)
    with inference():
        body(args, env, deadline, results)
    results.finish(render(results.data))
    return results.data
