"""Static input buffers: allocated once per path at the largest budget, filled before each replay.

Lifetime: the buffers live as long as the runner; every budget's graph of a path reads views of their leading
rows, so a replay must be filled (``fill``) right before it and never concurrently with another batch of the
same path (the runner's lock serialises calls; copies and replays are ordered on one stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from encgraph.capture.grad import persistent
from encgraph.capture.protocol import BufferSpec, FillRule
from encgraph.capture.upload import copy_into
from encgraph.errors import CaptureError, ConfigError, InputError

__all__ = ["PathBuffers", "PathOutputs", "sequence_bounds"]


def sequence_bounds(values: np.ndarray, slots: int, total: int, chunk: int) -> np.ndarray:
    """The full contents of a ``cu_seqlens`` buffer of ``slots`` entries.

    ``values``: int array ``[0, e1, e2, ..., ek]`` (ends of the real sequences; may be empty, meaning no real
    sequence). Appends padding sequences of at most ``chunk`` rows up to ``total``, then repeats ``total``.

    >>> sequence_bounds(np.array([0, 5, 9]), 8, 20, 8).tolist()
    [0, 5, 9, 17, 20, 20, 20, 20]
    """
    real = values if values.size else np.zeros(1, dtype=np.int64)
    end = int(real[-1])
    if end > total:
        raise InputError(f"cu_seqlens: the real sequences end at row {end}, past the buffer's {total} rows.")
    pad = np.arange(end + chunk, total, chunk, dtype=np.int64) if end < total else np.zeros(0, np.int64)
    if end < total:
        pad = np.append(pad, total)
    used = real.size + pad.size
    if used > slots:
        raise InputError(
            f"cu_seqlens: {real.size - 1} sequences plus {pad.size} padding sequences need {used} slots; the "
            f"captured buffer has {slots}. Lower max_frames or raise the adapter's slot count."
        )
    out = np.full(slots, total, dtype=np.int64)
    out[: real.size] = real
    out[real.size : used] = pad
    return out


class PathBuffers:
    """The static buffers of one path: ``name -> tensor`` at the largest budget, with per-budget specs.

    ``specs[budget][name]`` is the adapter's :class:`BufferSpec` at that budget; ``view(budget)`` gives the
    tensors a graph at that budget reads (views, shape ``specs[budget][name].shape``).
    """

    def __init__(self, path: str, specs: Mapping[int, Mapping[str, BufferSpec]], device: torch.device) -> None:
        self.path = path
        self.specs = {b: dict(s) for b, s in specs.items()}
        self.device = device
        budgets = sorted(self.specs)
        names = set(self.specs[budgets[0]])
        for b in budgets:
            if set(self.specs[b]) != names:
                raise ConfigError(
                    f"buffer_specs({path!r}, {b}): buffer names {sorted(self.specs[b])} differ from "
                    f"{sorted(names)} at budget {budgets[0]}; every budget of a path must declare the same buffers."
                )
        self.storage: dict[str, torch.Tensor] = {}
        self._budgets, self._names = budgets, names
        with persistent():  # never inference tensors: later calls in any grad mode write them (rule 12)
            self._allocate(path, budgets, names)

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """The buffers' memory given back for the block, allocated again after it (zeros: every fill writes all
        the rows a graph reads): the capture's eager phase (the self-check's references and timings, between
        the warm-ups and the first capture) reads no buffer, and its forwards at the top budget would otherwise
        peak with the buffers beside them (27 MiB of pixels on SigLIP-so400m at 32 images). Only before the
        first capture: a captured graph reads the buffers' addresses."""
        self.storage = {}
        try:
            yield
        finally:
            with persistent():
                self._allocate(self.path, self._budgets, self._names)

    def _allocate(self, path: str, budgets: list[int], names: set[str]) -> None:
        for name in sorted(names):
            ref = self.specs[budgets[0]][name]
            rows = 0
            for b in budgets:
                spec = self.specs[b][name]
                if spec.shape[1:] != ref.shape[1:] or spec.dtype != ref.dtype or spec.fill != ref.fill:
                    raise ConfigError(
                        f"buffer {name!r} of path {path!r}: only dim 0 may change with the budget; budget {b} "
                        f"gives {spec.shape} {spec.dtype} {spec.fill.name}, budget {budgets[0]} {ref.shape} "
                        f"{ref.dtype} {ref.fill.name}."
                    )
                rows = max(rows, spec.shape[0])
            self.storage[name] = torch.zeros((rows, *ref.shape[1:]), dtype=ref.dtype, device=self.device)
        self._arange = torch.arange(max((t.shape[0] for t in self.storage.values()), default=0), device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())

    def view(self, budget: int) -> dict[str, torch.Tensor]:
        return {name: self.storage[name][: spec.shape[0]] for name, spec in self.specs[budget].items()}

    def fill(self, budget: int, values: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Write a sub-batch's ``values`` (``None``: an all-padding batch, used for warm-up and capture) into
        the views of ``budget``, every row of them, and return the views."""
        views = self.view(budget)
        values = values or {}
        unknown = set(values) - set(views)
        if unknown:
            raise ConfigError(
                f"replay_values({self.path!r}): unknown buffers {sorted(unknown)}; declared: {sorted(views)}."
            )
        for name, view in views.items():
            spec = self.specs[budget][name]
            _fill_one(name, view, values.get(name), spec, self._arange)
        return views


class PathOutputs:
    """The output buffers every captured graph of one path writes: ``name -> (rows, ...)`` tensors, shaped at the
    first warm-up (:meth:`learn`) and made at the path's first capture, the largest budget's: outside the pool
    before it (:meth:`allocate`), or, where the ladder allows (:attr:`adopts`), in it (:meth:`adopt`): there the
    forward's own outputs become the buffers, in the graphs' pool, where each owns its whole storage and
    shares it with nothing else; another output (a view, or one that aliases an input or a parameter) is copied
    into a buffer made there. No buffer sits beside the forward's own outputs at that capture, the path's peak
    (SigLIP-so400m at 32 images: 51 MiB), and none beside the self-check's eager forwards, which run between the
    warm-ups and the captures.

    Every smaller budget's graph copies its outputs into ``view(budget)`` (the leading ``budget`` rows) as its last
    kernels, so the graphs hold no other outputs in the pool (whose memory then stays that of the largest graph,
    however many budgets the ladder has). Lifetime: valid until the next replay of any graph of the path; the
    runner copies the used rows out unless ``copy_outputs=False``.
    """

    def __init__(self, path: str, device: torch.device) -> None:
        self.path = path
        self.device = device
        self.storage: dict[str, torch.Tensor] = {}
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._ladder: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())

    def learn(self, outputs: Mapping[str, torch.Tensor], ladder: tuple[int, ...]) -> None:
        """Note the buffers' shapes (``max(ladder)`` rows, the trailing shape and dtype of ``outputs``) once."""
        if not self._specs:
            rows = max(ladder)
            self._specs = {name: ((rows, *t.shape[1:]), t.dtype) for name, t in outputs.items()}
            self._ladder = tuple(sorted(set(ladder)))

    @property
    def adopts(self) -> bool:
        """Whether the path's first capture adopts its outputs (:meth:`adopt`) rather than copying into buffers
        made outside the pool (:meth:`allocate`): where the ladder's next budget is at most half its largest (the
        batch ladders: 16 after 32), or it has one budget. Adopted outputs stay in the pool for the path's life,
        inside the segments the largest capture made; a next budget nearly as large (a token ladder: 3840 after 4096)
        does not fit the space they split and grows the pool (Qwen2.5-VL at depth 4, H100 2026-12-07: 740 MiB, 1.38x
        its largest graph, against 1.0x with the buffers outside), where one at most half as large fits beside them."""
        return len(self._ladder) < 2 or 2 * self._ladder[-2] <= self._ladder[-1]

    def allocate(self) -> None:
        """Allocate the learned buffers, once."""
        if self.storage:
            return
        if not self._specs:
            raise CaptureError(f"path {self.path!r}: its output buffers were never shaped (no warm-up ran before "
                               "its capture); this is a bug in encgraph, please report it.")
        with persistent():
            for name, (shape, dtype) in self._specs.items():
                self.storage[name] = torch.empty(shape, dtype=dtype, device=self.device)

    def adopt(self, produced: Mapping[str, torch.Tensor], foreign: set[int]) -> dict[str, torch.Tensor]:
        """Inside the path's first capture: ``produced`` (the forward's outputs at that budget, every learned name)
        as the path's buffers, each as it is where it is contiguous, owns its whole storage and shares it with
        nothing in ``foreign`` (storage addresses: the input buffers, the module's parameters and buffers) or with
        another output, and has the learned shape and dtype (the ladder's rows: the largest budget, captured first);
        else a buffer of that shape made in the capture, this budget's rows copied in. Returns the buffers."""
        if self.storage:
            raise CaptureError(f"path {self.path!r}: its output buffers exist already; adopt() runs at the path's "
                               "first capture only. This is a bug in encgraph, please report it.")
        if not self._specs:
            raise CaptureError(f"path {self.path!r}: its output buffers were never shaped (no warm-up ran before "
                               "its capture); this is a bug in encgraph, please report it.")
        taken = set(foreign)
        with persistent():
            for name, (shape, dtype) in self._specs.items():
                t = produced[name]
                data = t.untyped_storage()
                owns = (tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous() and t.storage_offset() == 0
                        and data.data_ptr() not in taken and data.nbytes() == t.numel() * t.element_size())
                if owns:
                    self.storage[name] = t
                else:  # the buffer's learned shape (the ladder's rows), this budget's rows copied in
                    self.storage[name] = torch.empty(shape, dtype=dtype, device=self.device)
                    self.storage[name][: t.shape[0]].copy_(t)
                taken.add(self.storage[name].untyped_storage().data_ptr())
        return dict(self.storage)

    def ensure(self, outputs: Mapping[str, torch.Tensor], ladder: tuple[int, ...]) -> None:
        """:meth:`learn`, then :meth:`allocate`."""
        self.learn(outputs, ladder)
        self.allocate()

    def view(self, budget: int) -> dict[str, torch.Tensor]:
        return {name: t[:budget] for name, t in self.storage.items()}


def _fill_one(
    name: str, view: torch.Tensor, value: torch.Tensor | None, spec: BufferSpec, arange: torch.Tensor
) -> None:
    """Fill one buffer's view."""
    rows = view.shape[0]
    if spec.fill is FillRule.SEQUENCE_BOUNDS:
        host = np.zeros(0, np.int64) if value is None else np.asarray(value, dtype=np.int64).reshape(-1)
        full = sequence_bounds(host, rows, int(spec.total), int(spec.chunk))  # type: ignore[arg-type]
        copy_into(view, torch.from_numpy(full))  # ordered before the replay; no host wait on the previous one
        return
    n = 0 if value is None else value.shape[0]
    if n > rows or (value is not None and tuple(value.shape[1:]) != tuple(view.shape[1:])):
        raise InputError(
            f"buffer {name!r}: values of shape {tuple(value.shape)} do not fit its static shape "  # type: ignore[union-attr]
            f"{tuple(view.shape)}; the sub-batch is larger than the budget it was planned for."
        )
    if n:
        copy_into(view[:n], value)  # type: ignore[arg-type]
    if n == rows:
        return
    tail = view[n:]
    if spec.fill is FillRule.ZERO or (spec.fill is FillRule.REPEAT_LAST and n == 0):
        tail.zero_()
    elif spec.fill is FillRule.REPEAT_LAST:
        tail.copy_(view[n - 1 : n].expand_as(tail))
    else:  # ARANGE
        shape = (rows - n,) + (1,) * (tail.dim() - 1)
        tail.copy_(arange[n:rows].view(shape).expand_as(tail))
