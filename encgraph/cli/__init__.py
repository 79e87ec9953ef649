"""The ``encgraph`` command line: ``encgraph demo``, ``plan``, ``tune`` and ``serve`` (also ``python -m encgraph``).

Exit codes: 0 on success; 2 for a bad command line, a bad input file or any :class:`~encgraph.EncgraphError`
(one line on stderr that says what to fix); 1 for an unexpected failure (with its traceback).

Importing this package and running ``plan`` or ``tune`` never imports torch; ``demo`` and ``serve`` import it when
they run (``serve`` also its HTTP stack, the ``[serve]`` extra).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from encgraph import __version__
from encgraph.cli import demo, plan, serve, tune
from encgraph.cli._common import Parser, UsageError
from encgraph.errors import EncgraphError

__all__ = ["main", "build_parser"]

_COMMANDS = (demo, plan, tune, serve)


def build_parser() -> Parser:
    parser = Parser(
        prog="encgraph",
        description="Capture vision encoders as CUDA graphs and replay them for batches of any size.",
    )
    parser.add_argument("--version", action="version", version=f"encgraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(_one_line(str(exc)), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version print and exit 0
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        print(
            f"encgraph: error: choose a command: {', '.join(c.__name__.rsplit('.', 1)[-1] for c in _COMMANDS)} "
            f"(see 'encgraph --help')",
            file=sys.stderr,
        )
        return 2
    prog = f"encgraph {args.command}"
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(_one_line(str(exc)), file=sys.stderr)
        return 2
    except EncgraphError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``encgraph plan ... | head``): not a failure of ours.
        return 0
    except Exception as exc:  # an encgraph bug or a broken environment: show everything
        traceback.print_exc()
        print(f"{prog}: unexpected failure: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return 1
