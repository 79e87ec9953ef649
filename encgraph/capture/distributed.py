"""Data-parallel encoding on ``torch.distributed`` (DESIGN rule 11, vLLM's ``mm_encoder_tp_mode="data"``).

Every rank of a process group receives the same call (the same items in the same order). The items are assigned
to ranks with :func:`encgraph.packing.balance` (largest first, each to the least-loaded rank) on their sizes
(``ItemSpec.input_size`` when the adapter gives it, else the item's total tokens); each rank selects its share
with ``adapter.select`` and runs it through its local runner; then every item's result is gathered to every rank
and the results come back in the caller's order, on every rank.

The gather, per call (``W`` ranks):

1. **meta**: one ``all_gather`` of a fixed-size ``int64`` row per rank: a status, a checksum of the call's item
   specs (so that ranks given different inputs all fail together), and per local item the id of its result
   *structure* and the shape of each tensor leaf. The row's length is ``2 + max_items_per_rank * K`` (``K``:
   the most words any known structure needs), which every rank computes from the plan alone.
2. **payload**: one ``all_gather`` of a ``uint8`` buffer per rank holding the bytes of its items' leaves, each
   leaf 16-byte aligned, padded to the largest rank's size; every rank then trims and reinterprets the bytes
   (exact: no arithmetic touches them). Skipped when every leaf is empty.

So the steady state costs **2 tensor collectives per call** (1 when every result is empty), plus one host sync
(the meta's copy to the host). A structure seen for the first time (the first call) adds one
``all_gather_object`` (the structure description: container types, keys, dtypes, ranks) and a second meta
gather; the structure then gets a small id that every rank assigns in the same order. A rank whose local work
fails reports it in its status, and every rank raises after one ``all_gather_object`` of the error messages, so
that no rank is left waiting in a collective.

Result types (:mod:`encgraph.capture.result_structure`): a tensor, or any nesting of ``dict`` / ``OrderedDict`` /
``list`` / ``tuple`` / named tuple / dataclass (a Hugging Face ``ModelOutput`` included) with tensor leaves; dim 0
(and every other dim) may differ from item to item. Anything else as a leaf raises
:class:`~encgraph.errors.ConfigTypeError` on every rank.

Tensors travel on the communication device: the rank's CUDA device for NCCL, the CPU for gloo. Results are
views into one buffer received per call (never reused, so they stay valid however long the caller keeps them;
the buffer is freed when the call's last result is dropped), on the results device (the runner's device).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from encgraph._validate import describe
from encgraph.capture.result_structure import ResultStructure, flatten_result
from encgraph.capture.stats import sum_counters
from encgraph.errors import ConfigError, ConfigTypeError, EncgraphError, InputError
from encgraph.packing import ItemSpec, balance

__all__ = ["DataParallelEncoder", "RemoteRankError", "ResultStructure", "flatten_result"]

_OK, _NEW_STRUCTURE, _FAILED = 0, 1, 2
_HEADER = 2  # status, checksum
_ALIGN = 16  # bytes: every leaf starts at a multiple, so a uint8 slice can be viewed as any dtype


class RemoteRankError(EncgraphError, RuntimeError):
    """Another rank of the group failed during a data-parallel call; its error message is in this one's."""


# ---------------------------------------------------------------------------------------------- the encoder
@attrs.frozen
class _Local:
    """One local item's result, flattened; ``sid`` is its structure's id (``None`` until registered)."""

    structure: ResultStructure
    leaves: list[torch.Tensor]
    sid: int | None


class DataParallelEncoder:
    """Spread each call's items over the ranks of a process group; return every item's result on every rank.

    Args:
        runner: a callable ``runner(sub_inputs) -> list`` giving one result per item of ``sub_inputs`` (an
            :class:`~encgraph.EncoderGraphRunner`, or the runner's local call). It is never called with an
            empty share: a rank without items only joins the collectives.
        group: the ``torch.distributed`` process group (default: the world group); gloo (CPU) or NCCL (CUDA:
            call ``torch.cuda.set_device(local_rank)`` first). Every member must call with the same inputs, in
            the same order of calls.
        adapter: gives ``item_specs(inputs)`` and ``select(inputs, indices)``; default ``runner.adapter``.
        device: where results are returned; default ``runner.device`` (else the communication device).
        local_stats: a callable giving the local runner's stats dict, merged by :meth:`global_stats`;
            default ``lambda: runner.stats`` when the runner has ``stats``.

    Collectives per call: 2 tensor ``all_gather`` s (meta, payload; see the module docstring), plus one
    ``all_gather_object`` and one more meta gather when a new result structure appears, plus one
    ``all_gather_object`` when a rank fails. Calls are serialised by a lock (collectives must be issued in the
    same order on every rank).

    >>> # on every rank, after torch.distributed.init_process_group(...):
    >>> # dp = DataParallelEncoder(EncoderGraphRunner(adapter)); results = dp(inputs)
    Results come back on the communication device (the rank's CUDA device with NCCL, the CPU with gloo), also
    for a leaf the local runner produced on another device.
    """

    def __init__(
        self,
        runner: Callable[[Any], list[Any]],
        group: Any = None,
        *,
        adapter: Any = None,
        device: torch.device | str | None = None,
        local_stats: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        if not callable(runner):
            raise ConfigTypeError(
                f"runner: expected a callable runner(sub_inputs) -> list (an EncoderGraphRunner), got {describe(runner)}."
            )
        adapter = adapter if adapter is not None else getattr(runner, "adapter", None)
        missing = [m for m in ("item_specs", "select") if not callable(getattr(adapter, m, None))]
        if missing:
            raise ConfigTypeError(
                f"adapter: expected an adapter with item_specs() and select(), got {describe(adapter)} (missing "
                f"{missing}); pass adapter=... when the runner has no .adapter."
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "group: torch.distributed is not initialised; call torch.distributed.init_process_group(...) on "
                "every rank first (backend 'gloo' on the CPU, 'nccl' on GPUs)."
            )
        self.runner = runner
        self.adapter = adapter
        # None stays None (the default group, looked up at each collective): holding the world group object
        # would keep it alive past destroy_process_group().
        self.group = group
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ConfigError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group.")
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group)).lower()
        self.device, self.comm_device = self._devices(device)
        if local_stats is None and hasattr(type(runner), "stats"):
            def local_stats() -> Mapping[str, Any]:
                return runner.stats  # type: ignore[attr-defined]

        self._local_stats = local_stats
        self._structures: list[ResultStructure] = []  # id - 1 -> structure; identical on every rank
        self._ids: dict[ResultStructure, int] = {}
        self._words = 0  # the most meta words any known structure needs
        self._lock = threading.RLock()
        self._counts = {
            "calls": 0, "items": 0, "local_items": 0, "idle_calls": 0, "tensor_collectives": 0,
            "object_collectives": 0, "payload_bytes": 0, "padding_bytes": 0,
        }
        self._items_per_rank = [0] * self.world_size

    def _devices(self, device: torch.device | str | None) -> tuple[torch.device, torch.device]:
        if device is None:
            device = getattr(self.runner, "device", None)
            if device is None:
                device = getattr(getattr(self.adapter, "config", None), "device", None)
        try:
            results = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ConfigTypeError(f"device: expected a torch.device or a string like 'cuda:0', got {describe(device)}.") from exc
        if results is not None and results.type == "cuda" and results.index is None:
            results = torch.device("cuda", torch.cuda.current_device())
        if "nccl" in self.backend and (results is None or results.type == "cuda" or "gloo" not in self.backend):
            if not torch.cuda.is_available():
                raise ConfigError(f"group: backend {self.backend!r} needs CUDA, which is not available; use 'gloo'.")
            comm = results if results is not None and results.type == "cuda" else torch.device(
                "cuda", torch.cuda.current_device()
            )
        else:
            comm = torch.device("cpu")
        return (results if results is not None else comm), comm

    # ------------------------------------------------------------------------------------------ calling
    def __call__(self, inputs: Any) -> list[Any]:
        """Encode ``inputs`` (the same on every rank); return every item's result, in order, on every rank.

        Raises what the local work raised on the rank where it failed, and :class:`RemoteRankError` on the
        others; :class:`~encgraph.errors.InputError` on every rank when the ranks were given different items.
        """
        with self._lock:
            specs = self.adapter.item_specs(inputs)
            if not specs:
                raise InputError("inputs: expected at least one item, got an empty batch.")
            shares = balance([_size(s) for s in specs], self.world_size)
            mine = shares[self.rank]
            local, failure = self._run_local(inputs, mine)
            rows = self._exchange_meta(shares, local, failure, _checksum(specs))
            results = self._gather_payload(shares, local, rows, len(specs))
            c = self._counts
            c["calls"] += 1
            c["items"] += len(specs)
            c["local_items"] += len(mine)
            c["idle_calls"] += not mine
            for r, share in enumerate(shares):
                self._items_per_rank[r] += len(share)
            return results

    def _run_local(self, inputs: Any, mine: tuple[int, ...]) -> tuple[list[_Local], BaseException | None]:
        if not mine:
            return [], None
        try:
            results = self.runner(self.adapter.select(inputs, mine))
            if not isinstance(results, Sequence) or len(results) != len(mine):
                raise ConfigError(
                    f"runner: expected a list of {len(mine)} results (one per item of the share), got "
                    f"{describe(results)}."
                )
            local = []
            for i, r in zip(mine, results):
                structure, leaves = flatten_result(r, f"result of item {i}")
                local.append(_Local(structure, leaves, self._ids.get(structure)))
            return local, None
        except Exception as exc:  # noqa: BLE001 - reported to every rank, so that none waits in a collective that never comes
            return [], exc

    def _exchange_meta(
        self, shares: tuple[tuple[int, ...], ...], local: list[_Local], failure: BaseException | None, checksum: int
    ) -> list[list[int]]:
        """Gather every rank's meta row; register new structures (then gather again); raise on any failure."""
        max_items = max(len(s) for s in shares)
        for _ in range(2):
            status = _FAILED if failure is not None else (_NEW_STRUCTURE if any(x.sid is None for x in local) else _OK)
            row = [status, checksum]
            if status == _OK:
                for x in local:
                    row.append(x.sid)
                    for t in x.leaves:
                        row.extend(t.shape)
            row.extend([0] * (_HEADER + max_items * self._words - len(row)))
            rows = self._all_gather_tensor(torch.tensor(row, dtype=torch.int64)).view(self.world_size, -1).tolist()
            if any(r[1] != checksum for r in rows):
                raise InputError(
                    f"inputs: the ranks of the group were given different items (checksums of the item specs by "
                    f"rank: {[r[1] for r in rows]}); every rank must call with the same inputs in the same order."
                )
            statuses = [r[0] for r in rows]
            if _FAILED in statuses:
                self._raise_failure(failure)
            if _NEW_STRUCTURE not in statuses:
                return rows
            self._register([x.structure for x in local if x.sid is None])
            local[:] = [attrs.evolve(x, sid=self._ids[x.structure]) for x in local]
        raise EncgraphError("data-parallel meta exchange: structures still unknown after registration (a bug).")

    def _register(self, new: list[ResultStructure]) -> None:
        unique = list(dict.fromkeys(new))
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, unique, group=self.group)
        self._counts["object_collectives"] += 1
        for structures in everyone:  # rank order: every rank assigns the same ids
            for s in structures:
                if s not in self._ids:
                    self._structures.append(s)
                    self._ids[s] = len(self._structures)
                    self._words = max(self._words, s.words)

    def _raise_failure(self, failure: BaseException | None) -> None:
        message = None if failure is None else f"{type(failure).__name__}: {failure}"
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, message, group=self.group)
        self._counts["object_collectives"] += 1
        failed = {r: m for r, m in enumerate(everyone) if m is not None}
        if failure is not None:
            failure.add_note(f"encgraph data-parallel call: failed on ranks {sorted(failed)}; every rank raises.")
            raise failure
        text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise RemoteRankError(
            f"data-parallel call: the local work failed on rank(s) {sorted(failed)} ({text}); every rank of the "
            f"group raises, none is left waiting."
        )

    def _gather_payload(
        self, shares: tuple[tuple[int, ...], ...], local: list[_Local], rows: list[list[int]], n_items: int
    ) -> list[Any]:
        """Decode every rank's meta, gather the leaves' bytes, and rebuild every item's result."""
        decoded = [self._decode(rows[r], len(shares[r])) for r in range(self.world_size)]
        sizes = [size for _, size in decoded]
        width = max(sizes)
        self._counts["payload_bytes"] += width * self.world_size
        self._counts["padding_bytes"] += width * self.world_size - sum(sizes)
        if width:
            send = torch.empty(width, dtype=torch.uint8, device=self.comm_device)
            if local:
                torch.cat(self._byte_pieces(local), out=send[: sizes[self.rank]])
            received = self._all_gather_tensor(send).to(self.device)
        else:
            received = torch.empty(0, dtype=torch.uint8, device=self.device)
        results: list[Any] = [None] * n_items
        for r, (items, _) in enumerate(decoded):
            base = r * width
            for index, (structure, leaves) in zip(shares[r], items):
                results[index] = structure.rebuild(
                    [received[base + start : base + end].view(dtype).view(shape) for dtype, shape, start, end in leaves]
                )
        return results

    def _decode(self, row: list[int], count: int) -> tuple[list[tuple[ResultStructure, list[Any]]], int]:
        """One rank's items from its meta row: per item its structure and, per leaf, ``(dtype, shape, start,
        end)`` (byte range in the rank's buffer); and the rank's buffer size (leaves 16-byte aligned)."""
        items = []
        pos, offset = _HEADER, 0
        for _ in range(count):
            structure = self._structures[row[pos] - 1]
            pos += 1
            leaves = []
            for dtype, ndim in zip(structure.dtypes, structure.ndims):
                shape = tuple(row[pos : pos + ndim])
                pos += ndim
                nbytes = math.prod(shape) * dtype.itemsize
                leaves.append((dtype, shape, offset, offset + nbytes))
                offset += nbytes + (-nbytes) % _ALIGN
            items.append((structure, leaves))
        return items, offset

    def _byte_pieces(self, local: list[_Local]) -> list[torch.Tensor]:
        pad = torch.zeros(_ALIGN, dtype=torch.uint8, device=self.comm_device)
        pieces = []
        for x in local:
            for t in x.leaves:
                # resolve_*: a lazily conjugated or negated view has no plain bytes to reinterpret.
                raw = t.detach().resolve_conj().resolve_neg().to(self.comm_device).contiguous().reshape(-1)
                raw = raw.view(torch.uint8)
                pieces.append(raw)
                if raw.numel() % _ALIGN:
                    pieces.append(pad[: _ALIGN - raw.numel() % _ALIGN])
        return pieces

    def _all_gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``W`` copies of ``t``'s size, concatenated in rank order (a host tensor in, a host tensor out for
        the int64 meta)."""
        host = t.device.type == "cpu" and self.comm_device.type != "cpu"
        src = t.to(self.comm_device) if host else t
        out = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=self.comm_device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, src, group=self.group)
        self._counts["tensor_collectives"] += 1
        return out.cpu() if host else out

    # ------------------------------------------------------------------------------------------ reporting
    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this rank, no collective. ``items`` counts each item of each call once (the same on every
        rank); ``local_items`` the items this rank ran; ``items_per_rank`` the assignment so far;
        ``tensor_collectives`` / ``object_collectives`` issued; ``payload_bytes`` received (padding included);
        ``local``: the local runner's own stats (when it has them). For summed runner counters, use
        :meth:`global_stats` (a collective)."""
        out: dict[str, Any] = {"world_size": self.world_size, "rank": self.rank, **self._counts}
        out["items_per_rank"] = list(self._items_per_rank)
        out["structures"] = len(self._structures)
        out["local"] = dict(self._local_stats()) if self._local_stats is not None else None
        return out

    def global_stats(self) -> dict[str, Any]:
        """A collective (every rank must call it): the local runners' counters summed over the ranks (``items``,
        ``graph_items``, ``eager_items``, ``eager_reasons``, per path ``replays`` and tokens). Each item ran on
        one rank, so each counts once; calls made to a runner directly (not through this encoder) count too.
        ``calls`` and ``dp_items`` are this encoder's calls and their items; ``per_rank`` every rank's
        :attr:`stats`. Without local stats, ``items`` is ``dp_items``."""
        with self._lock:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, self.stats, group=self.group)
            self._counts["object_collectives"] += 1
        locals_ = [s["local"] for s in everyone if s["local"] is not None]
        out = sum_counters(locals_) if locals_ else {}
        for p in out.get("paths", {}).values():
            total = p.get("real_tokens", 0) + p.get("padded_tokens", 0)
            if "padded_share" in p:  # a share does not sum: recompute it from the summed tokens
                p["padded_share"] = p["padded_tokens"] / total if total else 0.0
        out.pop("capture", None)
        out["calls"] = self._counts["calls"]
        out["dp_items"] = self._counts["items"]
        out.setdefault("items", self._counts["items"])
        out["world_size"] = self.world_size
        out["per_rank"] = everyone
        return out

    def reset_stats(self) -> None:
        """Zero this encoder's counters (not the runner's: call ``runner.reset_stats()`` for those)."""
        with self._lock:
            self._counts = dict.fromkeys(self._counts, 0)
            self._items_per_rank = [0] * self.world_size

    def __repr__(self) -> str:
        return (
            f"DataParallelEncoder(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"device={self.device}, comm_device={self.comm_device})"
        )


def _size(spec: ItemSpec) -> int:
    return spec.input_size if spec.input_size is not None else spec.total_tokens


def _checksum(specs: Sequence[ItemSpec]) -> int:
    # repr of ints and path names is the same in every process (unlike hash(), salted per process for str).
    return zlib.crc32(repr([(tuple(s.tokens.items()), s.frames, s.input_size) for s in specs]).encode())
