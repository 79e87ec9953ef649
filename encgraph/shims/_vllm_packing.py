"""vLLM 0.33's packing rule as an encgraph :class:`~encgraph.packing.Plan`, and the choice between two plans.

Imports neither torch nor vLLM (like :mod:`encgraph.packing`). The shim's manager plans every call twice: with
the runner's own planner (greedy, or cost-aware when a cost model is given) and with :func:`vllm_plan`, the
rule vLLM's ``EncoderCudaGraphManager._execute_local`` applies (``vllm/v1/worker/encoder_cudagraph.py``):

1. items sorted ascending by their output tokens (ties keep the input order);
2. next-fit: an item joins the open batch while the batch stays within ``max_items`` and every path within its
   largest budget, **unless deferring it is cheaper** ("budget-cliff deferral"): on some path where the item has
   tokens, the budget of the open batch plus the budget of the item alone is strictly less than the budget of
   both together, and the item alone needs at least the open batch's budget. Budgets 256/4096/8192 with items of
   200 and 4000 tokens: [200]@256 + [4000]@4096 instead of both @8192;
3. each path of a closed batch gets its smallest fitting budget, ``0`` without tokens, eager (``None``) where none
   fits.

encgraph adds its frame limit (a batch never holds more attention sequences than the captured ``cu_seqlens``;
an item with more frames than the limit runs eagerly alone), which vLLM's manager does not check.

Without a cost model the manager keeps whichever plan pads fewer tokens (:func:`fewer_padded`), so it never pads
more than vLLM's own manager would on the same items.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence

from encgraph.packing import Batch, EagerReason, ItemSpec, Limits, Plan

__all__ = ["vllm_plan", "fewer_padded", "padded_tokens"]


def _fit(ladder: tuple[int, ...], tokens: int) -> int | None:
    # vLLM's _path_fitting_budget: 0 when the path is idle, None when no budget holds the tokens.
    if tokens == 0:
        return 0
    i = bisect_left(ladder, tokens)
    return ladder[i] if i < len(ladder) else None


def vllm_plan(
    items: Sequence[ItemSpec],
    ladders: Mapping[str, Sequence[int]],
    *,
    max_items: int,
    max_frames: int,
    order: Sequence[int] | None = None,
) -> Plan:
    """The plan vLLM 0.33's manager would run for ``items`` (plus encgraph's frame limit; see the module).

    Args:
        items: the item specs (tokens on every path of ``ladders``).
        ladders: ``{path: ascending budgets}`` (a ``0`` entry is ignored: it means "skip the path").
        max_items, max_frames: the batch limits (``max_frames >= max_items``).
        order: the sort key per item, vLLM's ``output_tokens`` (the tokens of the path its default
            ``postprocess_encoder_output`` cuts); default: the item's tokens summed over paths.
    """
    paths = tuple(ladders)
    lad = {p: tuple(b for b in sorted(ladders[p]) if b > 0) for p in paths}
    caps = {p: lad[p][-1] for p in paths}
    keys = [it.total_tokens for it in items] if order is None else list(order)
    batches: list[Batch] = []
    cur: list[int] = []
    tok = dict.fromkeys(paths, 0)
    frames = 0

    def close() -> None:
        budgets: dict[str, int | None] = {}
        padded: dict[str, int] = {}
        eager: dict[str, EagerReason] = {}
        lone_frames = len(cur) == 1 and items[cur[0]].frames > max_frames
        for p in paths:
            b = _fit(lad[p], tok[p])
            if tok[p] and lone_frames:
                b, eager[p] = None, EagerReason.FRAMES
            elif b is None:
                eager[p] = EagerReason.TOKENS
            budgets[p] = b
            padded[p] = 0 if b is None else b - tok[p]
        batches.append(Batch(items=tuple(cur), budgets=budgets, tokens=dict(tok), padded=padded, frames=frames,
                             eager=eager))

    def defer(add: Mapping[str, int]) -> bool:
        for p in paths:
            if add[p] == 0:
                continue
            b_cur, b_alone, b_both = _fit(lad[p], tok[p]), _fit(lad[p], add[p]), _fit(lad[p], tok[p] + add[p])
            if b_cur + b_alone < b_both and b_alone >= b_cur:  # type: ignore[operator]  # all fit here
                return True
        return False

    for i in sorted(range(len(items)), key=keys.__getitem__):
        add = {p: items[i].tokens[p] for p in paths}
        f = items[i].frames
        fits = (
            len(cur) < max_items and frames + f <= max_frames and all(tok[p] + add[p] <= caps[p] for p in paths)
        )
        if cur and (not fits or defer(add)):
            close()
            cur, tok, frames = [], dict.fromkeys(paths, 0), 0
        cur.append(i)
        tok = {p: tok[p] + add[p] for p in paths}
        frames += f
    if cur:
        close()
    return Plan(batches=tuple(batches), n_items=len(items), paths=paths,
                ladders={p: tuple(sorted(ladders[p])) for p in paths},
                limits=Limits(max_items=max_items, max_frames=max_frames))


def padded_tokens(plan: Plan) -> int:
    """Padding rows replayed by ``plan``, summed over its paths."""
    return sum(plan.padded_tokens(p) for p in plan.paths)


def fewer_padded(ours: Plan, theirs: Plan) -> Plan:
    """``theirs`` when it pads fewer tokens than ``ours`` (or as many, eager on fewer items, in fewer replays),
    else ``ours``."""
    def key(plan: Plan) -> tuple[int, int, int]:
        eager = sum(plan.eager_items(p) for p in plan.paths)
        replays = sum(1 for b in plan.batches for v in b.budgets.values() if v)
        return padded_tokens(plan), eager, replays

    return theirs if key(theirs) < key(ours) else ours
