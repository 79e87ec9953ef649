"""``encgraph tune``: the ladder that minimises the expected cost of a log of observed sizes, without a model.

Reads a log of requests (each a list of item sizes, in the formats of ``encgraph plan``), turns every item into
its token count for a named tower geometry, and runs :func:`encgraph.packing.tune_ladder` against the default
ladder that ``encgraph plan`` and the runner use (the dense one, :func:`encgraph.cli.plan.default_ladder`).  Prints
both ladders with their expected cost and padded share, and a recommendation: the tuned ladder with the runner
options to paste only where the cost model rates it no slower than the default ladder, else the default ladder
(with a plain statement that no ladder within the limits given is better).  Torch-free.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

import attrs

from encgraph.cli._common import (
    UsageError,
    add_output_args,
    add_pixel_args,
    add_subcommand,
    count,
    emit_json,
    positive_int,
    read_text,
    table,
)
from encgraph.cli.geometry import TOWERS, TowerGeometry
from encgraph.cli.items import SizedItem, parse_item, parse_items
from encgraph.cli.plan import default_ladder
from encgraph.errors import ConfigError, InputError
from encgraph.packing import (
    CostModel,
    TunedLadder,
    default_limits,
    tune_ladder,
)

__all__ = ["DEFAULT_MAX_BUDGETS", "add_parser", "parse_log", "run"]

#: ``--max-budgets`` default: graphs to capture per path, as many as the default ladder has (20), so that the
#: default ladder is itself a candidate and the tuned one is never rated slower; a smaller limit may leave no
#: ladder as fast as the default (the dense default pads less), and ``tune`` then says so.
DEFAULT_MAX_BUDGETS = len(default_ladder())

_EPILOG = """\
log formats (one request per block or line; '#' comment lines skipped):
  items, one per line, requests separated by blank lines:
    640x480                       an image, width x height in pixels
    2,16,24                       a patch grid t,h,w as in grid_thw (t > 1: a video)
    {"width": 640, "height": 480} / {"grid": [2, 16, 24]}   the same as JSON
  or JSON lines, one request per line:
    {"items": ["640x480", "2,16,24", {"width": 300, "height": 200}, {"grid": [1, 16, 16]}]}
  The two forms may be mixed: a {"items": [...]} line is a request of its own.

cost model: --costs reads a CostModel saved after measuring on the GPU, e.g.
    runner.measure_costs(...); runner.costs.save("costs.json")
  without it, a linear model shaped after the Qwen2.5-VL-7B tower on an H200.

recommendation: the tuned ladder, with the runner options to paste, only where the cost model rates it no
  slower than the default ladder; else the default ladder (nothing to paste), with the tuned one's cost beside it.

examples:
  encgraph tune sizes.log
  printf '640x480\\n1024x768\\n\\n2,16,24\\n' | encgraph tune --max-budgets 4
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_subcommand(
        subparsers,
        "tune",
        run,
        help="choose the ladder that minimises the expected cost of a log of observed sizes (no model, no GPU)",
        description="Print the ladder (at most --max-budgets graphs, within --memory-cap-tokens) that minimises "
        "the expected cost of the logged requests, compared with the default ladder, and the runner options to "
        "paste when it is rated no slower than the default ladder (else: keep the default).",
        epilog=_EPILOG,
    )
    p.add_argument(
        "log", nargs="?", help="the log of observed requests; '-' or none: stdin (piped; on a terminal, '-' only)"
    )
    p.add_argument("--tower", choices=sorted(TOWERS), default="qwen2_5_vl", help="tower geometry (default qwen2_5_vl)")
    p.add_argument(
        "--max-budgets",
        type=positive_int,
        default=DEFAULT_MAX_BUDGETS,
        help=f"most budgets (captured graphs) in the ladder (default {DEFAULT_MAX_BUDGETS}: as many as the default "
        f"ladder)",
    )
    p.add_argument(
        "--memory-cap-tokens", type=positive_int, help="most tokens summed over the ladder's budgets (default: none)"
    )
    p.add_argument("--granularity", type=positive_int, default=64, help="budgets are multiples of it (default 64)")
    p.add_argument("--min-budget", type=positive_int, help="smallest budget allowed (default: --max-items)")
    p.add_argument(
        "--max-budget",
        type=positive_int,
        help="largest budget allowed; bigger items run eager (default: the largest item)",
    )
    p.add_argument(
        "--max-items", type=positive_int, help="most items per batch (default: the runner's for the default ladder)"
    )
    p.add_argument("--max-frames", type=positive_int, help="most frames per batch (default: the runner's)")
    p.add_argument("--costs", metavar="COSTS_JSON", help="a saved CostModel (runner.costs.save(path)) to plan with")
    add_pixel_args(p)
    add_output_args(p)
    return p


def parse_log(lines: Iterable[str], geometry: TowerGeometry, *, name: str = "<stdin>") -> list[list[SizedItem]]:
    """The requests of a log (see the module's epilog for the formats), empty requests dropped.

    Raises:
        InputError: an item in none of the accepted forms, or a malformed ``{"items": [...]}`` line; the message
            names ``name:line`` (and ``items[k]`` in a JSON request).
    """
    lines = list(lines)
    ordered: list[list[SizedItem]] = []
    # Text item lines are parsed by one parse_items call over the whole log (blanking the other lines), so its
    # messages keep the file's line numbers; `request_of` says which request each of its items belongs to.
    text = [""] * len(lines)
    request_of: list[int] = []
    in_block = False
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        if not stripped:
            in_block = False
            continue
        if stripped.startswith("#"):
            continue
        request = _json_request(stripped, geometry, f"{name}:{number}")
        if request is not None:
            ordered.append(request)
            in_block = False
            continue
        if not in_block:
            ordered.append([])
            in_block = True
        text[number - 1] = raw
        request_of.append(len(ordered) - 1)
    for index, item in zip(request_of, parse_items(text, geometry, name=name)):
        ordered[index].append(item)
    return [r for r in ordered if r]


def _json_request(text: str, geometry: TowerGeometry, where: str) -> list[SizedItem] | None:
    """The items of a ``{"items": [...]}`` line, or ``None`` when ``text`` is not one (an item line)."""
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None  # parse_items reports it with the item forms
    if not isinstance(obj, dict) or "items" not in obj:
        return None
    values = obj["items"]
    if not isinstance(values, list):
        raise InputError(
            f'{where}: "items" must be a list of item sizes such as ["640x480", {{"grid": [2, 16, 24]}}], got '
            f"{type(values).__name__}."
        )
    out = []
    for k, value in enumerate(values):
        if isinstance(value, str):
            item_text = value.strip()
        elif isinstance(value, dict):
            item_text = json.dumps(value)
        else:
            raise InputError(
                f'{where}: items[{k}]: expected a string such as "640x480" or "2,16,24", or an object '
                f'{{"width":..,"height":..}} / {{"grid":[t,h,w]}}, got {type(value).__name__} {value!r}.'
            )
        out.append(parse_item(item_text, geometry, f"{where}: items[{k}]"))
    return out


def _load_costs(path: str | None) -> CostModel | None:
    """The :class:`CostModel` that ``runner.costs.save(path)`` wrote, or ``None`` (the default model)."""
    if path is None:
        return None
    try:
        data = json.loads(read_text(path, "--costs", command="tune", stdin=False)[0])
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--costs: {path!r} is not JSON ({exc.msg} at line {exc.lineno}); pass the file that "
            f"runner.costs.save(path) wrote."
        ) from None
    return CostModel.from_dict(data)


def runner_line(tuned: TunedLadder) -> str:
    """``EncoderGraphRunner(adapter, budgets=(...), max_items=..., max_frames=...)`` for the tuned ladder."""
    options = tuned.to_runner_options()
    return "EncoderGraphRunner(adapter, " + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"


def _ladder_text(ladder: tuple[int, ...]) -> str:
    return f"{', '.join(map(str, ladder))} ({count(len(ladder), 'graph')}, {sum(ladder)} tokens)"


def run(args: argparse.Namespace) -> int:
    geometry = TOWERS[args.tower].with_pixels(args.min_pixels, args.max_pixels)
    costs = _load_costs(args.costs)
    text, name = read_text(
        args.log, "the log", command="tune",
        example="encgraph tune sizes.log, or printf '640x480\\n\\n2,16,24\\n' | encgraph tune",
    )
    requests = parse_log(text.splitlines(), geometry, name=name)
    if not requests:
        raise UsageError(
            f"encgraph tune: error: no requests in {name}; give one item size per line with a blank line between "
            f"requests, or one {{\"items\": [...]}} JSON line per request (see 'encgraph tune --help')"
        )
    # The default ladder and limits are the ones `encgraph plan` and the runner use; the user's --max-items /
    # --max-frames replace them for both ladders, so the comparison plans the same batches.
    default = default_ladder()
    limits = default_limits(
        default, max_frames_per_item=geometry.max_frames_per_item, max_items=args.max_items, max_frames=args.max_frames
    )
    tuned = tune_ladder(
        [[it.spec() for it in request] for request in requests],
        max_budgets=args.max_budgets,
        max_items=limits.max_items,
        max_frames=limits.max_frames,
        min_budget=args.min_budget,
        max_budget=args.max_budget,
        memory_cap_tokens=args.memory_cap_tokens,
        costs=costs,
        granularity=args.granularity,
        baseline=default,
    )
    ladder = next(iter(tuned.ladders.values()))
    items = [it for request in requests for it in request]
    videos = sum(1 for it in items if it.kind == "video")
    tokens = sum(it.tokens for it in items)
    distinct = len({tuple(it.grid for it in request) for request in requests})
    n = len(requests)
    change = (tuned.cost_after_ms / tuned.cost_before_ms - 1) if tuned.cost_before_ms else 0.0
    model = f"measured ({args.costs})" if args.costs else "default linear model (no --costs)"
    verdict = _verdict(tuned, ladder, default, args)
    if args.json:
        emit_json(
            {
                "tower": geometry.name,
                "traffic": {
                    "requests": n,
                    "distinct_requests": distinct,
                    "items": len(items),
                    "videos": videos,
                    "tokens": tokens,
                },
                "limits": {"max_items": tuned.max_items, "max_frames": tuned.max_frames},
                "cost_model": args.costs or "default",
                "default": {
                    "budgets": list(default),
                    "cost_ms": tuned.cost_before_ms,
                    "cost_ms_per_request": tuned.cost_before_ms / n,
                    "padded_share": tuned.padded_share_before,
                },
                "tuned": {
                    "budgets": list(ladder),
                    "cost_ms": tuned.cost_after_ms,
                    "cost_ms_per_request": tuned.cost_after_ms / n,
                    "padded_share": tuned.padded_share_after,
                },
                "cost_change": change,
                "recommended": verdict.recommended,
                "runner_options": {k: list(v) if k == "budgets" else v for k, v in verdict.options.items()},
                "runner_line": verdict.line,
                "notes": list(verdict.notes),
            }
        )
        return 0
    out = [
        f"tower {geometry.describe()}",
        (
            f"traffic: {count(n, 'request')} ({distinct} distinct), {len(items)} items "
            f"({count(len(items) - videos, 'image')}, {count(videos, 'video')}), {tokens} tokens"
        ),
        f"limits: at most {tuned.max_items} items and {tuned.max_frames} frames per batch; cost model: {model}",
    ]
    out += table(
        ("expected ms", "ms/request", "padded share", "ladder", "budgets"),
        (
            (f"{cost:.1f}", f"{cost / n:.2f}", f"{share:.1%}", title, _ladder_text(lad))
            for title, cost, share, lad in (
                ("default", tuned.cost_before_ms, tuned.padded_share_before, default),
                ("tuned", tuned.cost_after_ms, tuned.padded_share_after, ladder),
            )
        ),
        left=2,
    )
    out.append(f"expected cost change: {change:+.1%}")
    out += [f"note: {note}" for note in verdict.notes]
    out.append(f"recommendation: {verdict.text}")
    if verdict.options:
        out += ["runner options:", f"  {verdict.line}"]
    print("\n".join(out))
    return 0


@attrs.frozen
class Verdict:
    """What ``tune`` recommends: ``recommended`` ``"tuned"`` (rated no slower than the default ladder) or
    ``"default"``; ``options`` the runner options to paste for it (``{}``: none, the runner's defaults), ``line``
    them as ``EncoderGraphRunner(...)``; ``text`` the recommendation in words; ``notes`` why no tuned ladder wins."""

    recommended: str
    options: dict[str, Any]
    line: str
    text: str
    notes: tuple[str, ...] = ()


def _verdict(
    tuned: TunedLadder, ladder: tuple[int, ...], default: tuple[int, ...], args: argparse.Namespace
) -> Verdict:
    """The tuned ladder where it differs from the default and is rated no slower; else the default ladder, saying
    plainly that no ladder within the limits given is better (and which limit kept the default out)."""
    change = tuned.cost_after_ms / tuned.cost_before_ms - 1 if tuned.cost_before_ms else 0.0
    if ladder != default and tuned.cost_after_ms <= tuned.cost_before_ms:
        rated = f"{-change:.1%} faster than" if change < 0 else "as fast as"
        return Verdict("tuned", tuned.to_runner_options(), runner_line(tuned),
                       f"the tuned ladder ({count(len(ladder), 'graph')}), rated {rated} the default "
                       f"({count(len(default), 'graph')})")
    # The runner's default ladder: only limits the user set differ from what the runner would use.
    options = {k: v for k, v in (("max_items", args.max_items), ("max_frames", args.max_frames)) if v is not None}
    line = "EncoderGraphRunner(adapter" + "".join(f", {k}={v!r}" for k, v in options.items()) + ")"
    paste = "with the runner options below" if options else "nothing to paste"
    if ladder == default:
        return Verdict("default", options, line, f"keep the default ladder ({paste}): it is the cheapest found")
    notes = []
    if len(default) > args.max_budgets:
        notes.append(
            f"the default ladder has {len(default)} budgets, more than --max-budgets {args.max_budgets}; "
            f"raise --max-budgets for a ladder at least as cheap"
        )
    if args.memory_cap_tokens is not None and sum(default) > args.memory_cap_tokens:
        notes.append(
            f"the default ladder sums to {sum(default)} tokens, over --memory-cap-tokens "
            f"{args.memory_cap_tokens}; the tuned ladder is the cheapest under the cap"
        )
    return Verdict(
        "default", options, line,
        f"keep the default ladder ({paste}) unless the limits given must hold: no ladder within them is rated as "
        f"fast; the best found, {', '.join(map(str, ladder))}, is rated {change:.1%} slower",
        tuple(notes),
    )
