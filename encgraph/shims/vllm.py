"""encgraph behind vLLM's encoder CUDA graph interface (vLLM 0.33). vLLM is imported only inside functions.

- :class:`VllmProtocolAdapter`: any ``SupportsEncoderCudaGraph`` model as an encgraph adapter (needs no vLLM;
  see :mod:`encgraph.shims._vllm_protocol`).
- :class:`EncoderCudaGraphManager`: a drop-in for ``vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager``
  (same constructor and public methods) backed by :class:`encgraph.EncoderGraphRunner`.
- :func:`register`: the ``vllm.general_plugins`` entry point. With ``ENCGRAPH_VLLM=1`` in the environment it
  replaces the name ``EncoderCudaGraphManager`` in ``vllm.v1.worker.encoder_cudagraph`` (and in
  ``vllm.v1.worker.gpu.model_states.interface`` when that module is already imported) with
  :func:`make_manager`, which builds the encgraph manager, or vLLM's own for what the shim does not serve
  (:func:`fallback_reason`: capture axes, an overridden ``postprocess_encoder_output``, or the data-parallel
  encoder ``mm_encoder_tp_mode="data"``), logging why. Nothing else of vLLM changes.

What vLLM then gets, with its own budgets and limits (``compilation_config.encoder_cudagraph_token_budgets``,
``..._max_vision_items_per_batch``, ``..._max_frames_per_batch``, or the model's budget range, resolved by
vLLM's own constructor so the ladders are identical): the runner's planner (frames per batch enforced,
items over a budget or over the frame limit run eagerly instead of overflowing the captured buffers), capture
in phases into one pool, largest budget first (a budget whose capture fails is dropped, not fatal), and, when
asked for, a cost model (``ENCGRAPH_VLLM_COSTS=costs.json``: eager where a padded replay would cost more) and
compiled graphs (``ENCGRAPH_VLLM_COMPILE=1``). A tuned ladder (``encgraph tune``) goes into vLLM's own
``encoder_cudagraph_token_budgets``.

Differences from vLLM's manager (on purpose, and documented here):
- ``capture(graph_pool)`` keeps ``graph_pool`` for ``is_captured()`` but the runner captures into a pool of
  its own (one pool for all budgets, as vLLM's is).
- ``execute`` before ``capture`` returns ``None`` (vLLM's model runner then calls ``embed_multimodal``), where
  vLLM's manager fails on its first in-budget batch.
- ``graph_hits`` counts items whose every path replayed, ``graph_misses`` items with a path run eagerly (vLLM
  counts hits once per replayed path).
- Each item's tensor is a view of its sub-batch's fresh output (vLLM clones each item): the same values, never
  an alias of a graph buffer.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from encgraph.shims._vllm_protocol import OUTPUT, VllmProtocolAdapter, grid_frames, unsupported_reason

__all__ = [
    "VllmProtocolAdapter", "EncoderCudaGraphManager", "make_manager", "fallback_reason", "register", "install",
    "uninstall", "grid_frames", "OUTPUT", "ENV_ENABLE", "ENV_COSTS", "ENV_COMPILE",
]

log = logging.getLogger("encgraph")

ENV_ENABLE = "ENCGRAPH_VLLM"
"""``1`` (or ``true`` / ``yes`` / ``on``): the plugin installs the encgraph manager."""
ENV_COSTS = "ENCGRAPH_VLLM_COSTS"
"""Path of a saved :class:`encgraph.packing.CostModel` to plan with."""
ENV_COMPILE = "ENCGRAPH_VLLM_COMPILE"
"""``1``: compile each budget's static forward before capturing it (CUDA only); unset: plain graphs."""

_MANAGER_MODULE = "vllm.v1.worker.encoder_cudagraph"
_ALSO_PATCHED = ("vllm.v1.worker.gpu.model_states.interface",)
_ORIGINAL: dict[str, Any] = {}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _vllm_manager_class() -> type:
    """vLLM's own EncoderCudaGraphManager, also while the plugin has replaced the module's name."""
    if _MANAGER_MODULE in _ORIGINAL:
        return _ORIGINAL[_MANAGER_MODULE]
    import importlib

    return importlib.import_module(_MANAGER_MODULE).EncoderCudaGraphManager


def fallback_reason(vllm_config: Any, model: Any) -> str | None:
    """Why vLLM's own manager should serve ``model``, or ``None`` when the encgraph manager can."""
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    mm = vllm_config.model_config.multimodal_config
    if (mm is not None and getattr(mm, "mm_encoder_tp_mode", None) == "data"
            and vllm_config.parallel_config.tensor_parallel_size > 1):
        return "the data-parallel encoder (mm_encoder_tp_mode='data' with tensor_parallel_size > 1)"
    return None


class EncoderCudaGraphManager:
    """Drop-in for vLLM's ``EncoderCudaGraphManager``, backed by :class:`encgraph.EncoderGraphRunner`.

    Same constructor, attributes read by vLLM's model runners (``token_budgets``, ``path_token_budgets``,
    ``max_batch_size``, ``max_frames_per_batch``, ``config``, ``graph_pool``, ``graph_hits``,
    ``graph_misses``, ``use_dp``) and public methods. The runner is ``self.runner`` (its ``stats`` say what
    ran where); on a CPU it runs the same padded static forward without graphs (``RunMode.STATIC``).

    Raises what vLLM's constructor raises for bad budgets (``ValueError``), and
    :class:`~encgraph.errors.UnsupportedModelError` for a model :func:`fallback_reason` rejects.
    """

    def __init__(self, vllm_config: Any, device: torch.device, dtype: torch.dtype, model: Any) -> None:
        from encgraph.errors import UnsupportedModelError

        reason = fallback_reason(vllm_config, model)
        if reason is not None:
            raise UnsupportedModelError(
                f"model: the encgraph manager cannot serve {type(model).__name__}: {reason}; use vLLM's own "
                "EncoderCudaGraphManager (make_manager() picks it)."
            )
        # vLLM's own constructor resolves budgets, items and frames from the config (no device work), so the
        # ladders and its errors are exactly vLLM's.
        reference = _vllm_manager_class()(vllm_config=vllm_config, device=device, dtype=dtype, model=model)
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model
        self.config = reference.config
        self.token_budgets: list[int] = list(reference.token_budgets)
        self.path_token_budgets: dict[str, list[int]] = {p: list(b) for p, b in reference.path_token_budgets.items()}
        self.max_batch_size: int = reference.max_batch_size
        self.max_frames_per_batch: int = reference.max_frames_per_batch
        self.use_dp = False
        self.graph_pool: Any = None
        self.graph_hits = 0
        self.graph_misses = 0
        positive = sorted({b for ladder in self.path_token_budgets.values() for b in ladder if b > 0})
        self.adapter = VllmProtocolAdapter(
            model, budget_range=(positive[0], positive[-1]), device=self.device, dtype=dtype,
            model_frames=self.max_frames_per_batch,
        )
        self._options = _runner_options()
        self.runner = self._new_runner()
        log.info(
            "encgraph: EncoderCudaGraphManager for %s: paths %s, max %d items and %d frames per batch, %s mode",
            type(model).__name__, self.path_token_budgets, self.max_batch_size, self.runner.limits.max_frames,
            self.runner.mode.value,
        )

    def _new_runner(self) -> Any:
        from encgraph.capture.records import RunMode
        from encgraph.capture.runner import EncoderGraphRunner

        # vLLM gives 0 frames when videos are disabled (images have one frame each); and never more items
        # per batch than the captured frames can hold (every item has at least one).
        frames = self.max_frames_per_batch or self.max_batch_size
        return EncoderGraphRunner(
            self.adapter, budgets=self.path_token_budgets, max_items=min(self.max_batch_size, frames),
            max_frames=frames, device=self.device, lazy=False,
            # vLLM's manager runs padded batches; on a CPU that is STATIC (the runner's own CPU default is eager).
            **{"mode": None if torch.device(self.device).type == "cuda" else RunMode.STATIC, **self._options},
        )

    # ------------------------------------------------------------------ vLLM's public methods
    def supports_modality(self, modality: str) -> bool:
        return modality in self.config.modalities

    def is_captured(self) -> bool:
        return self.graph_pool is not None

    def get_num_graphs_to_capture(self) -> int:
        return sum(1 for ladder in self.path_token_budgets.values() for b in ladder if b > 0)

    def capture(self, graph_pool: Any) -> None:
        """Capture every budget of every path (largest first, one shared pool); on a CPU only allocate."""
        with torch.inference_mode():
            info = self.runner.capture()
        self.graph_pool = graph_pool
        log.info("encgraph: encoder capture done: %s", {k: v for k, v in info.items() if k != "per_graph"})

    def clear(self) -> None:
        """Release the graphs, buffers and pool (a fresh, uncaptured runner takes their place)."""
        self.runner = None
        self.adapter.release()
        self.runner = self._new_runner()
        self.graph_pool = None

    def execute(self, mm_kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """One ``(output_tokens, hidden)`` tensor per item, in order; ``None`` before ``capture``."""
        if not self.runner.captured:
            return None
        before = self.runner.stats
        with torch.inference_mode():
            out = self.runner(mm_kwargs)
        after = self.runner.stats
        self.graph_hits += after["graph_items"] - before["graph_items"]
        self.graph_misses += after["eager_items"] - before["eager_items"]
        return out

    def get_cumulative_stats(self) -> dict[str, Any]:
        """vLLM's keys (``num_budgets``: graphs captured; on a CPU, budgets ready to run) plus ``encgraph``
        (the runner's stats)."""
        total = self.graph_hits + self.graph_misses
        runner = self.runner
        if runner.captured and runner.mode.value == "graph":
            num = sum(len(r) for r in runner.records.values())
        elif runner.captured:
            num = self.get_num_graphs_to_capture()
        else:
            num = 0
        return {
            "graph_hits": self.graph_hits,
            "graph_misses": self.graph_misses,
            "hit_rate": self.graph_hits / total if total else 0.0,
            "num_budgets": num,
            "token_budgets": self.token_budgets,
            "encgraph": runner.stats,
        }


def _runner_options() -> dict[str, Any]:
    options: dict[str, Any] = {}
    costs = os.environ.get(ENV_COSTS, "").strip()
    if costs:
        options["costs"] = costs
    # Plain graphs unless asked for: the protocol model's buffers carry no symbolic token dimension, so the
    # runner's default compile="auto" would recompile once per budget (torch's recompile limit, 8, then runs
    # the rest uncompiled), inside a vLLM process that may compile the model itself.
    options["compile"] = _truthy(ENV_COMPILE)
    return options


def make_manager(vllm_config: Any, device: torch.device, dtype: torch.dtype, model: Any) -> Any:
    """What the plugin puts in place of ``EncoderCudaGraphManager``: the encgraph manager, or vLLM's own
    (logged with the reason) for a model :func:`fallback_reason` rejects."""
    reason = fallback_reason(vllm_config, model)
    if reason is not None:
        log.warning("encgraph: vLLM's own EncoderCudaGraphManager serves %s: %s.", type(model).__name__, reason)
        return _vllm_manager_class()(vllm_config=vllm_config, device=device, dtype=dtype, model=model)
    return EncoderCudaGraphManager(vllm_config=vllm_config, device=device, dtype=dtype, model=model)


def install() -> None:
    """Replace vLLM's ``EncoderCudaGraphManager`` name with :func:`make_manager` (idempotent)."""
    import importlib

    module = importlib.import_module(_MANAGER_MODULE)
    if _MANAGER_MODULE not in _ORIGINAL:
        _ORIGINAL[_MANAGER_MODULE] = module.EncoderCudaGraphManager
    module.EncoderCudaGraphManager = make_manager
    # Modules that imported the name before the plugin ran hold their own reference; later importers get ours.
    for name in _ALSO_PATCHED:
        other = sys.modules.get(name)
        if other is not None and getattr(other, "EncoderCudaGraphManager", None) is not make_manager:
            _ORIGINAL.setdefault(name, other.EncoderCudaGraphManager)
            other.EncoderCudaGraphManager = make_manager
    log.info("encgraph: vLLM's encoder CUDA graphs now run on encgraph (%s=1).", ENV_ENABLE)


def uninstall() -> None:
    """Put vLLM's own ``EncoderCudaGraphManager`` back everywhere :func:`install` replaced it."""
    for name, original in list(_ORIGINAL.items()):
        module = sys.modules.get(name)
        if module is not None:
            module.EncoderCudaGraphManager = original
        del _ORIGINAL[name]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: :func:`install` when ``ENCGRAPH_VLLM=1``, else nothing.

    vLLM loads general plugins in every process (engine core, workers), possibly more than once; this is
    idempotent and imports nothing of vLLM unless enabled.
    """
    if _truthy(ENV_ENABLE):
        install()
