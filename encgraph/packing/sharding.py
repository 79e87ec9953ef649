"""Data-parallel sharding: items to ranks, largest first, each to the least-loaded rank (LPT)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from encgraph._validate import check_int, check_sequence

__all__ = ["balance"]


def balance(sizes: Sequence[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Assign item indices to ``ranks`` ranks by longest-processing-time-first (DESIGN rule 11).

    Items go largest first (ties: lower index first), each to the least-loaded rank (ties: lowest rank).
    Returns one tuple of item indices per rank, each sorted ascending; idle ranks get ``()`` (they still join
    the collective).  Deterministic.

    >>> balance([1000, 100, 200, 50], 2)
    ((0,), (1, 2, 3))
    >>> balance([5], 3)
    ((0,), (), ())

    Raises:
        ConfigTypeError: ``sizes`` is not a sequence of ints, or ``ranks`` is not an int.
        ConfigError: a size is negative, or ``ranks < 1``.
    """
    check_sequence("balance(sizes)", sizes, hint="Pass a list of per-item sizes (tokens).")
    n_ranks = check_int("balance(ranks)", ranks, minimum=1, hint="Use the data-parallel world size, 1 or more.")
    vals = [
        check_int(f"balance(sizes[{i}])", s, minimum=0, hint="Sizes are token counts, 0 or more.")
        for i, s in enumerate(sizes)
    ]
    heap = [(0, r) for r in range(n_ranks)]
    out: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(len(vals)), key=lambda i: -vals[i]):  # stable: ties keep the lower index first
        load, r = heap[0]
        out[r].append(i)
        heapq.heapreplace(heap, (load + vals[i], r))
    return tuple(tuple(sorted(idx)) for idx in out)
