"""``encgraph plan``: how a list of item sizes would be split into batches and budgets, without a model.

Reads one item size per line (see :mod:`encgraph.cli.items`), turns each into its token count for a named tower
geometry, and prints the plan the runner would make with the same ladder and limits.  Torch-free.
"""

from __future__ import annotations

import argparse
from typing import Any

from encgraph.cli._common import (
    UsageError,
    add_output_args,
    add_pixel_args,
    add_subcommand,
    budget_list,
    count,
    emit_json,
    plan_json,
    plan_lines,
    positive_int,
    read_text,
    table,
)
from encgraph.cli.geometry import TOWERS
from encgraph.cli.items import SizedItem, parse_items
from encgraph.packing import Limits, Plan, default_limits, dense_ladder, pack

__all__ = ["add_parser", "run", "DEFAULT_MIN_BUDGET", "DEFAULT_MAX_BUDGET", "default_ladder"]

DEFAULT_MIN_BUDGET = 64
DEFAULT_MAX_BUDGET = 4096


def default_ladder(min_budget: int = DEFAULT_MIN_BUDGET, max_budget: int = DEFAULT_MAX_BUDGET) -> tuple[int, ...]:
    """The ladder the runner captures by default for a Qwen-VL tower (token budgets): the dense ladder, neighbours
    about 1.2x apart (64 to 4096: 20 budgets), not the doubling one."""
    return dense_ladder(min_budget, max_budget)

_EPILOG = """\
item lines (blank lines and '#' comments skipped):
  640x480                         an image, width x height in pixels (resized by the tower's processor rule)
  2,16,24                         a patch grid t,h,w as in grid_thw (t > 1: a video)
  {"width": 640, "height": 480}   the same as JSON lines
  {"grid": [2, 16, 24]}

example:
  printf '640x480\\n1024x768\\n2,16,24\\n' | encgraph plan --budgets 256,512,1024
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_subcommand(
        subparsers,
        "plan",
        run,
        help="plan batches and budgets for a list of image/video sizes (no model, no GPU)",
        description="Print how the runner would split items into sub-batches, which budget each replays (or why "
        "it runs eager), and the padded share.",
        epilog=_EPILOG,
    )
    p.add_argument(
        "items", nargs="?", help="file with one item size per line; '-' or none: stdin (piped; on a terminal, '-' only)"
    )
    p.add_argument("--tower", choices=sorted(TOWERS), default="qwen2_5_vl", help="tower geometry (default qwen2_5_vl)")
    ladder = p.add_mutually_exclusive_group()
    ladder.add_argument("--budgets", type=budget_list, help="the ladder, comma-separated token budgets (e.g. 256,512,1024)")
    ladder.add_argument(
        "--min-budget", type=positive_int, help=f"smallest budget of the default (dense, ~1.2x steps) ladder (default {DEFAULT_MIN_BUDGET})"
    )
    p.add_argument(
        "--max-budget", type=positive_int, help=f"largest budget of the default ladder (default {DEFAULT_MAX_BUDGET})"
    )
    p.add_argument("--max-items", type=positive_int, help="most items per batch (default: the runner's)")
    p.add_argument("--max-frames", type=positive_int, help="most frames per batch (default: the runner's)")
    add_pixel_args(p)
    add_output_args(p)
    return p


def _ladder(args: argparse.Namespace) -> tuple[int, ...]:
    if args.budgets is not None:
        if args.max_budget is not None:
            raise UsageError("encgraph plan: error: give --budgets or --min-budget/--max-budget, not both")
        return args.budgets
    lo = DEFAULT_MIN_BUDGET if args.min_budget is None else args.min_budget
    hi = DEFAULT_MAX_BUDGET if args.max_budget is None else args.max_budget
    if hi < lo:
        raise UsageError(f"encgraph plan: error: --max-budget ({hi}) is below --min-budget ({lo}); swap them")
    return default_ladder(lo, hi)


def make_plan(items: list[SizedItem], ladder: tuple[int, ...], limits: Limits) -> Plan:
    return pack([it.spec() for it in items], ladder, max_items=limits.max_items, max_frames=limits.max_frames)


def run(args: argparse.Namespace) -> int:
    geometry = TOWERS[args.tower].with_pixels(args.min_pixels, args.max_pixels)
    ladder = _ladder(args)
    text, name = read_text(
        args.items, "the items file", command="plan",
        example="encgraph plan sizes.txt, or printf '640x480\\n2,16,24\\n' | encgraph plan",
    )
    items = parse_items(text.splitlines(), geometry, name=name)
    if not items:
        raise UsageError(f"encgraph plan: error: no items in {name}; give one size per line (see 'encgraph plan --help')")
    # The same limits the runner derives for this ladder (or the user's).
    limits = default_limits(
        ladder, max_frames_per_item=geometry.max_frames_per_item, max_items=args.max_items, max_frames=args.max_frames
    )
    plan = make_plan(items, ladder, limits)
    if args.json:
        emit_json(
            {
                "tower": {
                    "name": geometry.name,
                    "patch_size": geometry.patch_size,
                    "merge_size": geometry.merge_size,
                    "temporal_patch_size": geometry.temporal_patch_size,
                    "min_pixels": geometry.min_pixels,
                    "max_pixels": geometry.max_pixels,
                },
                "items": [{"item": i, "source": it.source, **it.to_json()} for i, it in enumerate(items)],
                "plan": plan_json(plan),
            }
        )
        return 0
    videos = sum(1 for it in items if it.kind == "video")
    out = [
        f"tower {geometry.describe()}",
        f"ladder: {', '.join(map(str, ladder))} tokens; at most {limits.max_items} items and {limits.max_frames} "
        f"frames per batch",
        f"items: {len(items)} ({count(len(items) - videos, 'image')}, {count(videos, 'video')}), "
        f"{sum(it.tokens for it in items)} tokens",
    ]
    out += table(
        ("item", "tokens", "frames", "grid t,h,w", "size"),
        ((i, it.tokens, it.grid[0], ",".join(map(str, it.grid)), it.label) for i, it in enumerate(items)),
        left=2,
    )
    out += plan_lines(plan, [it.label for it in items])
    print("\n".join(out))
    return 0
