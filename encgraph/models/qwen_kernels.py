"""Which attention kernel the Qwen-VL towers' eager forwards run each sequence on, and what that costs the plan.

A mixin of :class:`~encgraph.models.qwen_vl.QwenVisionAdapter`: the crossovers measured at capture
(:mod:`encgraph.models.kernel_choice`), the eager surcharge and rent the runner prices a batch with
(:mod:`encgraph.models.sequence_bounds`), and the rows of each full-attention sequence a piecewise replay is priced
by (:mod:`encgraph.capture.piecewise`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from encgraph.models import sequence_bounds
from encgraph.packing import ItemSpec
from encgraph.packing.kernels import Crossover

__all__ = ["QwenKernelsMixin"]


class QwenKernelsMixin:
    """Kernel choice of a Qwen-VL adapter; the adapter sets ``kernel_rows``, ``warmed_plans``, ``_module``,
    ``_dtype``, ``_device`` and ``_engaged()``."""

    kernel_rows: Any
    warmed_plans: Any
    _module: Any
    _dtype: Any
    _device: Any

    def eager_surcharge_ms(self, path: str, specs: Sequence[ItemSpec]) -> float:
        """What :meth:`forward_eager` of items ``specs`` would lose now against its steady kernels (the cost
        model's eager price): its long frames at lengths whose dense plan this thread has not bought yet rent
        Flash varlen (:func:`~encgraph.models.sequence_bounds.eager_surcharge_ms`). The runner replays such a
        batch instead where that is cheaper, and then calls :meth:`rent_replayed`."""
        return sequence_bounds.eager_surcharge_ms(self.kernel_rows, self._device, self._frame_rows(specs))

    def rent_replayed(self, path: str, specs: Sequence[ItemSpec]) -> None:
        """The runner replayed items ``specs`` in place of an eager forward that would have rented: their lengths'
        rent grows as that forward's would, so that each is bought (and runs eagerly on the dense kernel) once
        its rent pays the plan (:func:`~encgraph.models.sequence_bounds.rent_replayed`)."""
        sequence_bounds.rent_replayed(self.kernel_rows, self._device, self._frame_rows(specs))

    def attention_rows(self, path: str, specs: Sequence[ItemSpec]) -> list[int]:
        """The rows of each full-attention sequence of items ``specs``, in order (the runner prices a piecewise
        replay by them: :mod:`encgraph.capture.piecewise`)."""
        return self._frame_rows(specs)

    def _frame_rows(self, specs: Sequence[ItemSpec]) -> list[int]:
        """The rows of each full-attention sequence of items ``specs``: one per frame (per item where the family
        attends over whole clips), ``input_size / frames`` each."""
        return [s.input_size // s.frames for s in specs if s.input_size for _ in range(s.frames)]

    def choose_kernels(self, known: Mapping[str, Crossover] | None = None) -> dict[str, Crossover]:
        """Measure (on CUDA; or take from ``known``) from how many rows a sequence of :meth:`forward_eager` runs
        faster on dense SDPA than on Flash varlen, per head geometry of the tower, and use it from now on
        (:mod:`encgraph.models.kernel_choice`; the runner calls it at capture). Returns the crossovers by key."""
        from encgraph.models.dense_plans import warm_plans
        from encgraph.models.kernel_choice import attention_calls, choose, rows_table

        with self._engaged():
            chosen = choose(self._module, self._dtype, self._device, known)
        self.kernel_rows = rows_table(chosen.values(), attention_calls(self._module)) if chosen else None
        # The long images' bucket plans, built now in the capturing thread rather than by the first such images.
        self.warmed_plans = warm_plans(self.kernel_rows, self._device) if self.kernel_rows else None
        return chosen

