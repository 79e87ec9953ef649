"""Budget ladders: the token capacities that graphs are captured for, one sorted ladder per path.

A *budget* is the token capacity of one captured graph; a *ladder* is the sorted tuple of budgets of one
path.  Budget ``0`` is never captured: it marks a path that may be empty in a batch (the runner skips it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from encgraph._validate import check_int, check_iterable, check_path, describe
from encgraph.errors import ConfigError, ConfigTypeError

__all__ = ["DEFAULT_PATH", "budget_ladder", "dense_ladder", "normalize_ladder", "normalize_ladders"]

#: The name of the only path of a one-tower encoder (and of an ``int``-token :class:`ItemSpec`).
DEFAULT_PATH = "default"


def _check_bounds(name: str, min_budget: Any, max_budget: Any, allow_zero: Any) -> tuple[int, int]:
    lo = check_int(f"{name}(min_budget)", min_budget, minimum=1, hint="Budgets are token counts: use 1 or more.")
    hi = check_int(f"{name}(max_budget)", max_budget, minimum=1, hint="Budgets are token counts: use 1 or more.")
    if not isinstance(allow_zero, bool):
        raise ConfigTypeError(f"{name}(allow_zero): expected a bool, got {describe(allow_zero)}.")
    if hi < lo:
        raise ConfigError(
            f"{name}: expected max_budget >= min_budget, got min_budget={lo}, max_budget={hi}. "
            f"Swap the bounds, or pass equal bounds for a one-budget ladder."
        )
    return lo, hi


def budget_ladder(min_budget: int, max_budget: int, *, allow_zero: bool = False) -> tuple[int, ...]:
    """The default ladder: ``min_budget`` doubled while it stays <= ``max_budget``, ``max_budget`` always last.

    With ``allow_zero`` the ladder starts with ``0`` (the path may be empty in a batch).

    >>> budget_ladder(64, 800)
    (64, 128, 256, 512, 800)
    >>> budget_ladder(64, 1024)
    (64, 128, 256, 512, 1024)
    >>> budget_ladder(64, 64)
    (64,)
    >>> budget_ladder(100, 400, allow_zero=True)
    (0, 100, 200, 400)

    Raises:
        ConfigTypeError: a bound is not an int, or ``allow_zero`` is not a bool.
        ConfigError: a bound is < 1, or ``max_budget < min_budget``.
    """
    lo, hi = _check_bounds("budget_ladder", min_budget, max_budget, allow_zero)
    ladder = [0] if allow_zero else []
    budget = lo
    while budget < hi:
        ladder.append(budget)
        budget *= 2
    ladder.append(hi)
    return tuple(ladder)


def dense_ladder(
    min_budget: int,
    max_budget: int,
    *,
    ratio: float = 1.2,
    granularity: int | None = None,
    allow_zero: bool = False,
) -> tuple[int, ...]:
    """The runner's default ladder: neighbours about ``ratio`` apart, every budget a multiple of
    ``granularity`` (default ``min_budget``), ``max_budget`` always last.

    Each budget after ``min_budget`` is ``ratio`` times the previous one rounded to the nearest multiple of
    ``granularity``, and at least the next multiple up; so the ladder steps by ``granularity`` while that is
    the larger step, and geometrically above ``granularity / (ratio - 1)``. A single item then pads by at most
    about ``ratio - 1`` of its budget (where doubling pads by up to half).

    >>> dense_ladder(64, 4096)
    (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1088, 1280, 1536, 1856, 2240, 2688, 3200, 3840, 4096)
    >>> dense_ladder(1, 32, ratio=1.25)
    (1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25, 31, 32)
    >>> dense_ladder(100, 400, allow_zero=True)
    (0, 100, 200, 300, 400)

    Raises:
        ConfigTypeError: a bound or ``granularity`` is not an int, ``ratio`` not a number, ``allow_zero`` not a
            bool.
        ConfigError: a bound is < 1, ``max_budget < min_budget``, ``ratio <= 1`` or ``granularity < 1``.
    """
    lo, hi = _check_bounds("dense_ladder", min_budget, max_budget, allow_zero)
    step = lo if granularity is None else check_int("dense_ladder(granularity)", granularity, minimum=1)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ConfigTypeError(f"dense_ladder(ratio): expected a number > 1, got {describe(ratio)}.")
    if not ratio > 1:
        raise ConfigError(f"dense_ladder(ratio): expected a number > 1 (1.2: neighbours 20% apart), got {ratio!r}.")
    ladder = [0] if allow_zero else []
    budget = lo
    while budget < hi:
        ladder.append(budget)
        # Round half up (not to even), in integers: budgets are exact multiples of the step.
        budget = max((budget // step + 1) * step, int(budget * ratio / step + 0.5) * step)
    ladder.append(hi)
    return tuple(ladder)


def normalize_ladder(ladder: Iterable[int], *, name: str = "ladder") -> tuple[int, ...]:
    """Validate a user-given ladder and return it sorted and de-duplicated.

    ``0`` is allowed (the path may be empty); at least one budget must be positive.

    >>> normalize_ladder([512, 64, 256, 64])
    (64, 256, 512)
    >>> normalize_ladder((0, 100))
    (0, 100)

    Raises:
        ConfigTypeError: ``ladder`` is not an iterable of ints (a bare int, a str, a float budget).
        ConfigError: a budget is negative, or no budget is positive.
    """
    if type(ladder) is tuple or type(ladder) is list:
        # Fast path (pack() normalizes its ladders on every call): already sorted, distinct, plain ints.
        prev = -1
        for b in ladder:
            if type(b) is not int or b <= prev:
                break
            prev = b
        else:
            if prev > 0:
                return tuple(ladder)
    if isinstance(ladder, (bool, int)) or (not isinstance(ladder, Iterable)):
        raise ConfigTypeError(
            f"{name}: expected an iterable of int budgets, got {describe(ladder)}. "
            f"Wrap a single budget in a tuple, e.g. (2048,), or use budget_ladder(min_budget, max_budget)."
        )
    if isinstance(ladder, Mapping):
        raise ConfigTypeError(
            f"{name}: expected an iterable of int budgets, got a mapping {describe(ladder)}. "
            f"Pass per-path ladders where several paths are accepted (pack, normalize_ladders)."
        )
    check_iterable(name, ladder, hint="Use a tuple of int budgets such as (64, 128, 256).")
    budgets = set()
    for i, value in enumerate(ladder):
        budgets.add(
            check_int(f"{name}[{i}]", value, minimum=0, hint="Budgets are token counts (0 marks a path that may be empty).")
        )
    if not budgets or max(budgets) == 0:
        raise ConfigError(
            f"{name}: expected at least one positive budget, got {describe(ladder)}. "
            f"Add a budget that can hold the largest batch, e.g. budget_ladder(64, 4096)."
        )
    return tuple(sorted(budgets))


def normalize_ladders(
    ladders: Iterable[int] | Mapping[str, Iterable[int]], paths: Sequence[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """Per-path ladders as ``{path: ladder}``, each ladder normalized by :func:`normalize_ladder`.

    A single ladder is the ladder of the path ``"default"``; a mapping gives one ladder per path, in the
    mapping's order.  When ``paths`` is given, the keys must be exactly those paths (the result then follows
    the order of ``paths``).

    >>> normalize_ladders((256, 64))
    {'default': (64, 256)}
    >>> normalize_ladders({"global": [272, 544], "local": [0, 100]}, paths=("global", "local"))
    {'global': (272, 544), 'local': (0, 100)}

    Raises:
        ConfigTypeError: a path name is not a str, or a ladder is not an iterable of ints.
        ConfigError: no path, an unknown or missing path, or a bad ladder.
    """
    if isinstance(ladders, Mapping):
        if not ladders:
            raise ConfigError(
                "ladders: expected at least one path, got an empty mapping. "
                "Pass one ladder, e.g. budget_ladder(64, 4096), or {path: ladder} for each path."
            )
        out = {}
        for path, ladder in ladders.items():
            if type(path) is not str or not path:
                check_path("ladders (path name)", path)
            out[path] = normalize_ladder(ladder, name=f"ladders[{path!r}]")
    else:
        out = {DEFAULT_PATH: normalize_ladder(ladders, name="ladders")}
    if paths is None:
        return out
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Iterable):
        raise ConfigTypeError(f"paths: expected a sequence of path names, got {describe(paths)}.")
    wanted = tuple(paths)
    for path in wanted:
        check_path("paths (path name)", path)
    unknown = [p for p in out if p not in wanted]
    if unknown:
        raise ConfigError(
            f"ladders: unknown path {unknown[0]!r}; expected exactly the paths {list(wanted)}, got {list(out)}. "
            f"Remove {unknown[0]!r} or rename it to one of {list(wanted)}."
        )
    missing = [p for p in wanted if p not in out]
    if missing:
        raise ConfigError(
            f"ladders: missing path {missing[0]!r}; expected exactly the paths {list(wanted)}, got {list(out)}. "
            f"Add a ladder for {missing[0]!r}."
        )
    return {p: out[p] for p in wanted}
