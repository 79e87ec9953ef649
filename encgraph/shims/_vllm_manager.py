"""vLLM's encoder CUDA graph manager interface over :class:`encgraph.EncoderGraphRunner`, without vLLM.

:class:`ProtocolGraphManager` has the public methods and attributes of vLLM 0.33's ``EncoderCudaGraphManager``
(``capture``, ``clear``, ``execute``, ``is_captured``, ``supports_modality``, ``get_num_graphs_to_capture``,
``get_cumulative_stats``; ``token_budgets``, ``path_token_budgets``, ``max_batch_size``,
``max_frames_per_batch``, ``graph_pool``, ``graph_hits``, ``graph_misses``) for any model implementing vLLM's
``SupportsEncoderCudaGraph`` protocol, with the budgets and limits given directly. The plugin's class
(:func:`encgraph.shims.vllm.manager_class`) is this core and vLLM's own manager class, whose constructor
resolves the budgets and limits from vLLM's config; here the core runs without vLLM (the GPU tests use it so).

vLLM's contracts kept:

- Planning: the runner's plan, unless vLLM's own packing (:func:`encgraph.shims._vllm_packing.vllm_plan`, with
  its budget-cliff deferral) pads fewer tokens on the same items; with a cost model
  (``ENCGRAPH_VLLM_COSTS``) the cost-aware plan. Limits: ``max_batch_size`` items and
  ``max(max_batch_size, max_frames_per_batch)`` attention sequences per batch (vLLM's Qwen models size the
  captured ``cu_seqlens`` for that many), so a frame limit below the item limit never splits images.
- The model's capture tensors are the graph's buffers (:class:`~encgraph.shims._vllm_protocol.VllmProtocolAdapter`);
  ``None`` replay values keep them as captured.
- Outputs: one tensor per item with storage of its own (cloned from the graph's output once, as vLLM's
  ``postprocess_encoder_output(clone=True)``, before a later sub-batch replays), valid after later calls.
- Counters: per sub-batch, ``graph_hits`` grows by its item count once per path that replayed, ``graph_misses``
  by its item count when no path replayed.
- ``execute`` of no items returns ``[]``; before ``capture`` it raises
  :class:`~encgraph.errors.CaptureError` (vLLM's manager fails with an ``AssertionError`` on the first batch a
  budget holds), so a model runner never gets outputs of graphs that do not exist.
"""

from __future__ import annotations

import collections
import logging
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import CaptureError, InputError
from encgraph.packing import ItemSpec, Plan
from encgraph.shims._vllm_packing import fewer_padded, vllm_plan
from encgraph.shims._vllm_protocol import VllmProtocolAdapter

__all__ = ["ProtocolGraphManager", "VllmPlanningRunner"]

log = logging.getLogger("encgraph")


class VllmPlanningRunner(EncoderGraphRunner):
    """The runner, planning as the shim's manager does (module docs); keeps the last call's plan in ``last_plan``
    and which planner made it in ``last_choice`` (``"costs"``, ``"greedy"`` or ``"vllm"``; the manager counts
    hits, misses and choices from them).

    Args:
        order_path: the path whose tokens order items in vLLM's packing (its ``output_tokens``).
        **options: :class:`~encgraph.EncoderGraphRunner`'s.
    """

    def __init__(self, adapter: Any, *, order_path: str, **options: Any) -> None:
        super().__init__(adapter, **options)
        self.order_path = order_path
        self.last_plan: Plan | None = None
        self.last_choice = ""

    def _pack(self, specs: Sequence[ItemSpec]) -> Plan:
        plan = super()._pack(specs)
        choice = "costs"
        if self.costs is None:
            theirs = vllm_plan(
                specs, self.planning_ladders, max_items=self.limits.max_items, max_frames=self.limits.max_frames,
                order=[s.tokens[self.order_path] for s in specs],
            )
            chosen = fewer_padded(plan, theirs)
            choice = "vllm" if chosen is theirs else "greedy"
            plan = chosen
        self.last_plan, self.last_choice = plan, choice
        return plan


class ProtocolGraphManager:
    """vLLM's ``EncoderCudaGraphManager`` interface for a ``SupportsEncoderCudaGraph`` model, without vLLM.

    Args:
        model: the protocol object (a vLLM model, or anything with its methods).
        device, dtype: where the graphs run and the capture inputs' dtype.
        token_budgets: the ladder (ascending ints, > 0); ``path_token_budgets`` (``{path: ladder}``, ``0`` for
            a path that may be skipped) overrides it per path, as vLLM resolves it.
        max_batch_size: most items per sub-batch.
        max_frames_per_batch: vLLM's frame limit (``0``: videos disabled), handed to the model's capture and
            replay methods as vLLM's manager hands it.
        runner_options: more :class:`~encgraph.EncoderGraphRunner` options (``costs``, ``compile``, ...).

    The runner (``self.runner``; ``None`` until the constructor attached one) runs GRAPH mode on CUDA, the same
    plan and static forward without graphs (STATIC mode) on a CPU. Buffer lifetime: the model's capture tensors
    live until ``clear()``; outputs are the caller's.
    """

    runner: VllmPlanningRunner | None = None
    plan_choices: Mapping[str, int] = types.MappingProxyType({})  # a Counter once a runner is attached
    graph_pool: Any = None
    graph_hits = 0
    graph_misses = 0

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        token_budgets: Sequence[int],
        max_batch_size: int,
        max_frames_per_batch: int,
        path_token_budgets: Mapping[str, Sequence[int]] | None = None,
        runner_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.config = model.get_encoder_cudagraph_config()
        self.token_budgets = sorted(int(b) for b in token_budgets)
        self.path_token_budgets = (
            {p: list(b) for p, b in path_token_budgets.items()} if path_token_budgets is not None
            else {p: list(self.token_budgets) for p in self.config.paths}
        )
        self.max_batch_size = int(max_batch_size)
        self.max_frames_per_batch = int(max_frames_per_batch)
        self.use_dp = False
        self._attach(runner_options)

    def _attach(self, runner_options: Mapping[str, Any] | None) -> None:
        """Build the adapter and runner from the resolved budgets and limits (the vLLM class calls this after
        vLLM's own constructor resolved them)."""
        self.device = torch.device(self.device)
        self.graph_pool = None
        self.graph_hits = self.graph_misses = 0
        self.plan_choices = collections.Counter()
        positive = sorted({b for ladder in self.path_token_budgets.values() for b in ladder if b > 0})
        self.adapter = VllmProtocolAdapter(
            self.model, budget_range=(positive[0], positive[-1]), device=self.device, dtype=self.dtype,
            model_frames=self.max_frames_per_batch, clone_items=True,
        )
        self._runner_options = dict(runner_options or {})
        self.runner = self._new_runner()

    def _new_runner(self) -> VllmPlanningRunner:
        names = self.adapter.config.path_names
        return VllmPlanningRunner(
            self.adapter, order_path="default" if "default" in names else names[0],
            budgets=self.path_token_budgets, max_items=self.max_batch_size,
            # Attention sequences per batch: vLLM's models size cu_seqlens for max(items, frames) of them.
            max_frames=max(self.max_batch_size, self.max_frames_per_batch),
            device=self.device, lazy=False, copy_outputs=False,
            # vLLM's manager runs padded batches; on a CPU that is STATIC (the runner's own CPU default is eager).
            **{"mode": None if self.device.type == "cuda" else RunMode.STATIC, **self._runner_options},
        )

    # ------------------------------------------------------------------ vLLM's public methods
    def supports_modality(self, modality: str) -> bool:
        return modality in self.config.modalities

    def is_captured(self) -> bool:
        return self.graph_pool is not None

    def get_num_graphs_to_capture(self) -> int:
        return sum(1 for ladder in self.path_token_budgets.values() for b in ladder if b > 0)

    def capture(self, graph_pool: Any) -> None:
        """Capture every budget of every path (largest first, one shared pool of the runner's own; ``graph_pool``
        is kept for ``is_captured``); on a CPU only prepare the static forward."""
        with torch.inference_mode():
            info = self.runner.capture()
        self.graph_pool = graph_pool
        log.info("encgraph: encoder capture done: %s", {k: v for k, v in info.items() if k != "per_graph"})

    def clear(self) -> None:
        """Release the graphs, the model's capture tensors and the pool; a fresh, uncaptured runner takes their
        place (``capture`` works again)."""
        self.runner = None
        self.adapter.release()
        self.runner = self._new_runner()
        self.graph_pool = None

    def execute(self, mm_kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """One ``(output_tokens, hidden)`` tensor per item, in order, each with its own storage.

        Raises:
            CaptureError: called before ``capture`` (with at least one item).
        """
        if not mm_kwargs:
            return []
        runner = self.runner
        if not runner.captured:
            if not self.adapter.item_specs(mm_kwargs):
                return []
            raise CaptureError(
                "EncoderCudaGraphManager.execute: called before capture(graph_pool); vLLM's own manager fails "
                "there too (on the first batch a budget holds). Call capture() first."
            )
        with torch.inference_mode():
            # clone_items (the adapter's assemble_copies): each item is copied out of its sub-batch's output right
            # after that sub-batch ran (before the next replay reuses the graph's output buffer), once, as vLLM's
            # postprocess_encoder_output(clone=True) copies it; the runner copies nothing before that.
            try:
                out = runner(mm_kwargs)
            except InputError:
                if self.adapter.item_specs(mm_kwargs):
                    raise
                return []  # no items: the runner's input error, vLLM's manager's empty result
        self._count(runner.last_plan, runner)
        return out

    def _count(self, plan: Plan, runner: VllmPlanningRunner) -> None:
        self.plan_choices[runner.last_choice] += 1
        graph_mode = runner.mode is RunMode.GRAPH
        for batch in plan.batches:
            replayed = sum(
                1 for p, b in batch.budgets.items()
                if b and batch.tokens[p] and (not graph_mode or b in runner.records[p])
            )
            if replayed:
                self.graph_hits += replayed * len(batch.items)
            else:
                self.graph_misses += len(batch.items)

    def get_cumulative_stats(self) -> dict[str, Any]:
        """vLLM's keys (``num_budgets``: graphs captured; on a CPU, budgets ready to run) plus ``encgraph``
        (the runner's stats) and ``plans`` (calls per planner that made their plan: ``greedy``, ``vllm``: vLLM's
        packing padded fewer tokens, ``costs``)."""
        total = self.graph_hits + self.graph_misses
        runner = self.runner
        if runner is not None and runner.captured and runner.mode is RunMode.GRAPH:
            num = sum(len(r) for r in runner.records.values())
        elif runner is not None and runner.captured:
            num = self.get_num_graphs_to_capture()
        else:
            num = 0
        return {
            "graph_hits": self.graph_hits,
            "graph_misses": self.graph_misses,
            "hit_rate": self.graph_hits / total if total else 0.0,
            "num_budgets": num,
            "token_budgets": self.token_budgets,
            "encgraph": runner.stats if runner is not None else {},
            "plans": dict(self.plan_choices),
        }
