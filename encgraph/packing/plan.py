"""The result of planning: batches with a budget (or eager) per path, and the way back to the caller's order."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs

from encgraph._validate import check_int, check_mapping, check_path, check_sequence, describe
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.packing.ladder import normalize_ladder
from encgraph.packing.limits import Limits

__all__ = ["EagerReason", "Batch", "Plan"]

T = TypeVar("T")

_FORMAT = "encgraph.plan"
_VERSION = 1


class EagerReason(enum.Enum):
    """Why a path of a batch runs eager instead of replaying a graph."""

    #: The batch's tokens on this path are over the largest budget of its ladder.
    TOKENS = "tokens over the largest budget"
    #: The item has more frames than ``max_frames``: its metadata cannot fit the captured buffers.
    FRAMES = "frames over max_frames"
    #: Reserved for a cost-aware planner (padding would cost more than eager, vLLM PR 52229); the greedy
    #: :func:`pack` never emits it.
    COST = "eager is cheaper"


def _bad(where: str, expected: str, got: Any, fix: str) -> ConfigError:
    return ConfigError(f"{where}: expected {expected}, got {got}. {fix}")


def _check_batch(b: Batch) -> None:
    where = "Batch"
    if not b.items:
        raise _bad(f"{where}(items)", "at least one item index", "()", "A batch holds one item or more.")
    for i, index in enumerate(b.items):
        check_int(f"{where}(items[{i}])", index, minimum=0, hint="Item indices point into the list given to pack().")
    paths = list(b.budgets)
    for field in ("tokens", "padded"):
        if set(getattr(b, field)) != set(paths):
            raise _bad(
                f"{where}({field})", f"the paths of budgets {paths}", list(getattr(b, field)), "Give every path once."
            )
    for path in paths:
        check_path(f"{where}(budgets) path name", path)
        budget = b.budgets[path]
        tokens = check_int(f"{where}(tokens[{path!r}])", b.tokens[path], minimum=0)
        padded = check_int(f"{where}(padded[{path!r}])", b.padded[path], minimum=0)
        if budget is None:
            if path not in b.eager:
                raise _bad(f"{where}(eager)", f"a reason for the eager path {path!r}", dict(b.eager), "Add an EagerReason.")
            if padded != 0:
                raise _bad(f"{where}(padded[{path!r}])", "0 on an eager path", padded, "Eager runs pad nothing.")
            continue
        check_int(f"{where}(budgets[{path!r}])", budget, minimum=0, hint="Use a budget of the ladder, 0, or None.")
        if budget < tokens:
            raise _bad(f"{where}(budgets[{path!r}])", f">= its tokens {tokens}", budget, "Choose a larger budget or None.")
        if padded != budget - tokens:
            raise _bad(f"{where}(padded[{path!r}])", f"budget - tokens = {budget - tokens}", padded, "Recompute it.")
        if path in b.eager:
            raise _bad(f"{where}(eager)", f"no reason for the replayed path {path!r}", dict(b.eager), "Remove it.")
    for path, reason in b.eager.items():
        if path not in b.budgets:
            raise _bad(f"{where}(eager)", f"paths among {paths}", repr(path), "Remove the unknown path.")
        if not isinstance(reason, EagerReason):
            raise ConfigTypeError(f"{where}(eager[{path!r}]): expected an EagerReason, got {describe(reason)}.")
    check_int(f"{where}(frames)", b.frames, minimum=len(b.items), hint="Every item has at least one frame.")


def _as_tuple(name: str):  # noqa: ANN202
    def convert(value: Any) -> tuple[Any, ...]:
        check_sequence(name, value, hint="Use a tuple.")
        return tuple(value)

    return convert


def _as_dict(name: str):  # noqa: ANN202
    def convert(value: Any) -> dict[Any, Any]:
        return dict(check_mapping(name, value, hint="Use {path: value}."))

    return convert


@attrs.frozen(eq=True)
class Batch:
    """One sub-batch of a plan.

    Attributes:
        items: indices into the ``items`` given to :func:`pack`, in processing order.
        budgets: per path, the captured budget to replay; ``0``: no tokens on this path (skip it);
            ``None``: no budget holds them, run that path eager.
        tokens: real tokens per path.
        padded: per path, ``budget - tokens`` where a budget is chosen, else 0.
        frames: the items' frames summed.
        eager: only the eager (``None``) paths, each with its :class:`EagerReason`.

    Built by :func:`pack`; the constructor validates a hand-made batch.

    >>> Batch(items=(2, 0), budgets={"default": 512}, tokens={"default": 400}, padded={"default": 112}, frames=2)
    Batch(items=(2, 0), budgets={'default': 512}, tokens={'default': 400}, padded={'default': 112}, frames=2, eager={})
    """

    items: tuple[int, ...] = attrs.field(converter=_as_tuple("Batch(items)"))
    budgets: dict[str, int | None] = attrs.field(converter=_as_dict("Batch(budgets)"))
    tokens: dict[str, int] = attrs.field(converter=_as_dict("Batch(tokens)"))
    padded: dict[str, int] = attrs.field(converter=_as_dict("Batch(padded)"))
    frames: int
    eager: dict[str, EagerReason] = attrs.field(factory=dict, converter=_as_dict("Batch(eager)"))

    def __attrs_post_init__(self) -> None:
        _check_batch(self)

    __hash__ = None  # type: ignore[assignment]  # holds dicts


_new = object.__new__
_set = object.__setattr__
# The slot descriptors' setters write a frozen instance's fields directly, faster than object.__setattr__.
_set_items, _set_budgets, _set_tokens, _set_padded, _set_frames, _set_eager = (
    Batch.__dict__[name].__set__ for name in ("items", "budgets", "tokens", "padded", "frames", "eager")
)


def _fast_batch(
    items: tuple[int, ...],
    budgets: dict[str, int | None],
    tokens: dict[str, int],
    padded: dict[str, int],
    frames: int,
    eager: dict[str, EagerReason],
) -> Batch:
    # pack() builds batches that are valid by construction; skipping __init__'s checks keeps it fast.
    b = _new(Batch)
    _set_items(b, items)
    _set_budgets(b, budgets)
    _set_tokens(b, tokens)
    _set_padded(b, padded)
    _set_frames(b, frames)
    _set_eager(b, eager)
    return b


def _check_plan(p: Plan) -> None:
    where = "Plan"
    for i, batch in enumerate(p.batches):
        if not isinstance(batch, Batch):
            raise ConfigTypeError(f"{where}(batches[{i}]): expected a Batch, got {describe(batch)}.")
    check_int(f"{where}(n_items)", p.n_items, minimum=0)
    if not p.paths:
        raise _bad(f"{where}(paths)", "at least one path", "()", "Plans cover one path or more.")
    for path in p.paths:
        check_path(f"{where}(paths)", path)
    if len(set(p.paths)) != len(p.paths):
        raise _bad(f"{where}(paths)", "distinct path names", list(p.paths), "Name each path once.")
    check_mapping(f"{where}(ladders)", p.ladders)
    if set(p.ladders) != set(p.paths):
        raise _bad(f"{where}(ladders)", f"a ladder for each of {list(p.paths)}", list(p.ladders), "Give one per path.")
    for path in p.paths:
        if normalize_ladder(p.ladders[path], name=f"{where}(ladders[{path!r}])") != tuple(p.ladders[path]):
            raise _bad(f"{where}(ladders[{path!r}])", "a sorted ladder without repeats", p.ladders[path], "Normalize it.")
    if not isinstance(p.limits, Limits):
        raise ConfigTypeError(f"{where}(limits): expected a Limits, got {describe(p.limits)}.")
    seen = [False] * p.n_items
    for i, batch in enumerate(p.batches):
        if set(batch.budgets) != set(p.paths):
            raise _bad(f"{where}(batches[{i}].budgets)", f"the paths {list(p.paths)}", list(batch.budgets), "Cover every path.")
        for path in p.paths:
            budget = batch.budgets[path]
            if budget not in (None, 0) and budget not in p.ladders[path]:
                raise _bad(
                    f"{where}(batches[{i}].budgets[{path!r}])", f"0, None or a budget of {p.ladders[path]}", budget,
                    "Replay only captured budgets.",
                )
        if len(batch.items) > p.limits.max_items:
            raise _bad(
                f"{where}(batches[{i}].items)", f"at most max_items={p.limits.max_items} items", len(batch.items),
                "Split the batch.",
            )
        if batch.frames > p.limits.max_frames and len(batch.items) != 1:
            raise _bad(
                f"{where}(batches[{i}].frames)", f"at most max_frames={p.limits.max_frames}", batch.frames,
                "Split the batch (only a lone item may go over, eager).",
            )
        for index in batch.items:
            if index >= p.n_items or seen[index]:
                raise _bad(
                    f"{where}(batches[{i}].items)", f"each index in 0..{p.n_items - 1} exactly once", index,
                    "Place every item in exactly one batch.",
                )
            seen[index] = True
    if not all(seen):
        raise _bad(f"{where}(batches)", "every item placed", f"item {seen.index(False)} missing", "Place it in a batch.")


@attrs.frozen(eq=True)
class Plan:
    """The batches a list of items is split into, with a budget (or eager) per path per batch.

    Attributes:
        batches: the sub-batches, in processing order.
        n_items: how many items were planned (``len(items)`` given to :func:`pack`).
        paths: the path names, in the ladders' order.
        ladders: ``{path: ladder}`` the plan was made for.
        limits: the per-batch limits the plan respects.  A plan made with ``max_frames=None`` records the
            bound that no batch can pass anyway: ``max_items`` x the largest frames of any item.

        >>> from encgraph.packing import ItemSpec, pack
        >>> plan = pack([ItemSpec(300), ItemSpec(100), ItemSpec(900)], (256, 512, 1024), max_items=2)
        >>> [(b.items, b.budgets) for b in plan.batches]
        [((1, 0), {'default': 512}), ((2,), {'default': 1024})]
        >>> plan.restore([["r1", "r0"], ["r2"]])
        ['r0', 'r1', 'r2']
    """

    batches: tuple[Batch, ...] = attrs.field(converter=_as_tuple("Plan(batches)"))
    n_items: int
    paths: tuple[str, ...] = attrs.field(converter=_as_tuple("Plan(paths)"))
    ladders: dict[str, tuple[int, ...]] = attrs.field(converter=_as_dict("Plan(ladders)"))
    limits: Limits

    def __attrs_post_init__(self) -> None:
        _check_plan(self)

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    # -- totals -------------------------------------------------------------------------------------------

    def _path(self, path: Any) -> str:
        if path not in self.ladders:
            check_path("path", path)
            raise ConfigError(
                f"path: expected one of the plan's paths {list(self.paths)}, got {path!r}. Use a path of the plan."
            )
        return path

    def real_tokens(self, path: str = "default") -> int:
        """Real (non-padding) tokens on ``path`` over all batches, eager ones included."""
        p = self._path(path)
        return sum(b.tokens[p] for b in self.batches)

    def padded_tokens(self, path: str = "default") -> int:
        """Padding tokens replayed on ``path`` (budget minus real tokens, over the replayed batches)."""
        p = self._path(path)
        return sum(b.padded[p] for b in self.batches)

    def eager_items(self, path: str = "default") -> int:
        """Items in batches whose ``path`` runs eager."""
        p = self._path(path)
        return sum(len(b.items) for b in self.batches if b.budgets[p] is None)

    def totals(self) -> dict[str, dict[str, float]]:
        """Per path: ``real_tokens``, ``padded_tokens``, ``eager_items`` and ``padded_share``.

        ``padded_share`` is padding / (real + padding) tokens computed on that path (0.0 when nothing is).
        """
        out: dict[str, dict[str, float]] = {}
        for p in self.paths:
            real = self.real_tokens(p)
            padded = self.padded_tokens(p)
            out[p] = {
                "real_tokens": real,
                "padded_tokens": padded,
                "eager_items": self.eager_items(p),
                "padded_share": padded / (real + padded) if real + padded else 0.0,
            }
        return out

    # -- order --------------------------------------------------------------------------------------------

    def restore(self, batch_results: Sequence[Sequence[T]]) -> list[T]:
        """Put per-batch results back in the caller's order.

        ``batch_results[i][j]`` is the result for ``batches[i].items[j]``; the return value's ``k``-th entry is
        the result for ``items[k]`` as given to :func:`pack`.

        Raises:
            ConfigTypeError: ``batch_results`` or one of its entries is not a sequence.
            ConfigError: the number of batches, or of results in a batch, does not match the plan.
        """
        check_sequence("restore(batch_results)", batch_results, hint="Pass one sequence of results per batch.")
        if len(batch_results) != len(self.batches):
            raise ConfigError(
                f"restore(batch_results): expected {len(self.batches)} batch results (one per batch), got "
                f"{len(batch_results)}. Pass the results of every batch of the plan, in the plan's order."
            )
        out: list[Any] = [None] * self.n_items
        for i, (batch, results) in enumerate(zip(self.batches, batch_results)):
            check_sequence(f"restore(batch_results[{i}])", results, hint="Pass one result per item of the batch.")
            if len(results) != len(batch.items):
                raise ConfigError(
                    f"restore(batch_results[{i}]): expected {len(batch.items)} results (one per item of batch "
                    f"{i}), got {len(results)}. Split the batch's output per item before restoring."
                )
            for index, result in zip(batch.items, results):
                out[index] = result
        return out

    # -- serialisation ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_dict` turns it back into an equal plan."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "n_items": self.n_items,
            "paths": list(self.paths),
            "ladders": {p: list(self.ladders[p]) for p in self.paths},
            "limits": {"max_items": self.limits.max_items, "max_frames": self.limits.max_frames},
            "batches": [
                {
                    "items": list(b.items),
                    "budgets": dict(b.budgets),
                    "tokens": dict(b.tokens),
                    "padded": dict(b.padded),
                    "frames": b.frames,
                    "eager": {p: r.name for p, r in b.eager.items()},
                }
                for b in self.batches
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict`'s output (after a JSON round trip too); validates everything.

        Raises:
            ConfigTypeError / ConfigError: ``data`` is not a plan dict of a known format and version.
        """
        check_mapping("Plan.from_dict(data)", data, hint="Pass the dict that Plan.to_dict() returned.")
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ConfigError(
                f"Plan.from_dict(data): expected format {_FORMAT!r} version {_VERSION}, got format "
                f"{data.get('format')!r} version {data.get('version')!r}. Pass the dict that Plan.to_dict() returned."
            )
        missing = [k for k in ("n_items", "paths", "ladders", "limits", "batches") if k not in data]
        if missing:
            raise ConfigError(f"Plan.from_dict(data): missing key {missing[0]!r}. Pass the dict Plan.to_dict() returned.")
        limits = check_mapping("Plan.from_dict(data['limits'])", data["limits"])
        ladders = check_mapping("Plan.from_dict(data['ladders'])", data["ladders"])
        batches = []
        for i, b in enumerate(check_sequence("Plan.from_dict(data['batches'])", data["batches"])):
            check_mapping(f"Plan.from_dict(data['batches'][{i}])", b)
            eager = {}
            for p, name in check_mapping(f"Plan.from_dict(data['batches'][{i}]['eager'])", b.get("eager", {})).items():
                if not isinstance(name, str) or name not in EagerReason.__members__:
                    raise ConfigError(
                        f"Plan.from_dict(data['batches'][{i}]['eager'][{p!r}]): expected one of "
                        f"{list(EagerReason.__members__)}, got {name!r}."
                    )
                eager[p] = EagerReason[name]
            try:
                batches.append(
                    Batch(
                        items=tuple(check_sequence(f"Plan.from_dict(data['batches'][{i}]['items'])", b["items"])),
                        budgets=b["budgets"],
                        tokens=b["tokens"],
                        padded=b["padded"],
                        frames=b["frames"],
                        eager=eager,
                    )
                )
            except KeyError as exc:
                raise ConfigError(f"Plan.from_dict(data['batches'][{i}]): missing key {exc.args[0]!r}.") from None
        try:
            lim = Limits(max_items=limits["max_items"], max_frames=limits["max_frames"])
        except KeyError as exc:
            raise ConfigError(f"Plan.from_dict(data['limits']): missing key {exc.args[0]!r}.") from None
        return cls(
            batches=tuple(batches),
            n_items=data["n_items"],
            paths=tuple(check_sequence("Plan.from_dict(data['paths'])", data["paths"])),
            ladders={p: tuple(check_sequence(f"Plan.from_dict(data['ladders'][{p!r}])", v)) for p, v in ladders.items()},
            limits=lim,
        )


def _fast_plan(
    batches: tuple[Batch, ...], n_items: int, paths: tuple[str, ...], ladders: dict[str, tuple[int, ...]], limits: Limits
) -> Plan:
    # pack() builds plans that are valid by construction.
    p = _new(Plan)
    _set(p, "batches", batches)
    _set(p, "n_items", n_items)
    _set(p, "paths", paths)
    _set(p, "ladders", ladders)
    _set(p, "limits", limits)
    return p
