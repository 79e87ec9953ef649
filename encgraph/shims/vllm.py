"""encgraph behind vLLM's encoder CUDA graph interface (vLLM 0.33). vLLM is imported only inside functions.

- :class:`VllmProtocolAdapter`: any ``SupportsEncoderCudaGraph`` model as an encgraph adapter (needs no vLLM;
  see :mod:`encgraph.shims._vllm_protocol`).
- :class:`ProtocolGraphManager`: vLLM's manager interface over :class:`encgraph.EncoderGraphRunner` with the
  budgets and limits given directly (needs no vLLM; see :mod:`encgraph.shims._vllm_manager`).
- ``EncoderCudaGraphManager`` (built on first access, :func:`manager_class`): a subclass of vLLM's own
  ``vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager`` and of :class:`ProtocolGraphManager`. vLLM's
  constructor resolves the budgets and limits (so the ladders and its errors are exactly vLLM's); the public
  methods are encgraph's. ``isinstance`` checks and ``MagicMock(spec=...)`` of vLLM's class keep working.
  Building it for a model the shim does not serve (:func:`fallback_reason`: capture axes, an overridden
  ``postprocess_encoder_output``, or the data-parallel encoder ``mm_encoder_tp_mode="data"``) gives vLLM's own
  manager instead, logging why.
- :func:`register`: the ``vllm.general_plugins`` entry point. With ``ENCGRAPH_VLLM=1`` in the environment it
  replaces the name ``EncoderCudaGraphManager`` in ``vllm.v1.worker.encoder_cudagraph`` (and in
  ``vllm.v1.worker.gpu.model_states.interface`` when that module is already imported) with that class. Nothing
  else of vLLM changes.

What vLLM then gets, with its own budgets and limits (``compilation_config.encoder_cudagraph_token_budgets``,
``..._max_vision_items_per_batch``, ``..._max_frames_per_batch``, or the model's budget range): never more
padding than vLLM's own packing on the same items (the runner's plan or vLLM's, whichever pads fewer tokens),
frames per batch enforced, items over a budget or over the frame limit run eagerly instead of overflowing the
captured buffers, capture in phases into one pool, largest budget first (a budget whose capture fails is
dropped, not fatal), and, when asked for, a cost model (``ENCGRAPH_VLLM_COSTS=costs.json``: eager where a
padded replay would cost more) and compiled graphs (``ENCGRAPH_VLLM_COMPILE=1``). A tuned ladder
(``encgraph tune``) goes into vLLM's own ``encoder_cudagraph_token_budgets``.

Differences from vLLM's manager (on purpose): ``capture(graph_pool)`` keeps ``graph_pool`` for
``is_captured()`` but the runner captures into a pool of its own (one pool for all budgets, as vLLM's is);
``execute`` before ``capture`` raises :class:`~encgraph.errors.CaptureError` for any call (vLLM's fails with an
``AssertionError`` on the first batch a budget holds, and runs items over every budget eagerly); vLLM's private
helpers (``_execute_local``, ``_run_budget_graph``, ...) are inherited but unused by the public methods.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import torch

from encgraph.shims._vllm_manager import ProtocolGraphManager
from encgraph.shims._vllm_protocol import OUTPUT, VllmProtocolAdapter, grid_frames, unsupported_reason

__all__ = [
    "VllmProtocolAdapter", "ProtocolGraphManager", "EncoderCudaGraphManager", "manager_class", "make_manager",
    "fallback_reason", "register", "install", "uninstall", "grid_frames", "OUTPUT", "ENV_ENABLE", "ENV_COSTS",
    "ENV_COMPILE",
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
    """vLLM's own EncoderCudaGraphManager, however the module's name is set (by :func:`install`, by hand, to
    this shim's class or to anything else): the class vLLM's module defines, found through the MRO."""
    import importlib

    current = importlib.import_module(_MANAGER_MODULE).EncoderCudaGraphManager
    for candidate in (_ORIGINAL.get(_MANAGER_MODULE), current):
        for cls in getattr(candidate, "__mro__", ()):
            if cls.__module__ == _MANAGER_MODULE and cls.__qualname__ == "EncoderCudaGraphManager":
                return cls
    raise ImportError(
        f"{_MANAGER_MODULE}.EncoderCudaGraphManager is {current!r}, which is neither vLLM's class nor derived "
        "from it; restore vLLM's class (encgraph.shims.vllm.uninstall()) before using the shim."
    )


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


@functools.cache
def manager_class() -> type:
    """The plugin's ``EncoderCudaGraphManager``: :class:`ProtocolGraphManager` and vLLM's own manager class
    (imports vLLM; built once)."""
    base = _vllm_manager_class()

    class EncoderCudaGraphManager(ProtocolGraphManager, base):  # type: ignore[misc, valid-type]
        """Drop-in for vLLM's ``EncoderCudaGraphManager`` (a subclass of it), backed by
        :class:`encgraph.EncoderGraphRunner` (see :mod:`encgraph.shims.vllm`).

        Same constructor; vLLM's resolves budgets, items and frames (no device work), so the ladders and its
        errors (``ValueError``) are exactly vLLM's. Building it for a model :func:`fallback_reason` rejects
        returns vLLM's own manager (logged).
        """

        def __new__(cls, vllm_config: Any, device: torch.device, dtype: torch.dtype, model: Any) -> Any:
            reason = fallback_reason(vllm_config, model)
            if reason is not None:
                log.warning("encgraph: vLLM's own EncoderCudaGraphManager serves %s: %s.", type(model).__name__, reason)
                return base(vllm_config=vllm_config, device=device, dtype=dtype, model=model)
            return super().__new__(cls)

        def __init__(self, vllm_config: Any, device: torch.device, dtype: torch.dtype, model: Any) -> None:
            base.__init__(self, vllm_config=vllm_config, device=device, dtype=dtype, model=model)
            self._attach(_runner_options())
            log.info(
                "encgraph: EncoderCudaGraphManager for %s: paths %s, max %d items and %d frames per batch, %s mode",
                type(model).__name__, self.path_token_budgets, self.max_batch_size, self.runner.limits.max_frames,
                self.runner.mode.value,
            )

    EncoderCudaGraphManager.__module__ = __name__
    EncoderCudaGraphManager.__qualname__ = "EncoderCudaGraphManager"
    return EncoderCudaGraphManager


def __getattr__(name: str) -> Any:
    # ``EncoderCudaGraphManager`` subclasses vLLM's class, so it exists only once vLLM is imported.
    if name == "EncoderCudaGraphManager":
        return manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """The encgraph manager for ``model``, or vLLM's own (logged with the reason) for a model
    :func:`fallback_reason` rejects: what building the plugin's class does."""
    return manager_class()(vllm_config, device, dtype, model)


def install() -> None:
    """Replace vLLM's ``EncoderCudaGraphManager`` name with :func:`manager_class` (idempotent)."""
    import importlib

    cls = manager_class()
    module = importlib.import_module(_MANAGER_MODULE)
    _ORIGINAL.setdefault(_MANAGER_MODULE, _vllm_manager_class())
    module.EncoderCudaGraphManager = cls
    # Modules that imported the name before the plugin ran hold their own reference; later importers get ours.
    for name in _ALSO_PATCHED:
        other = sys.modules.get(name)
        if other is not None and getattr(other, "EncoderCudaGraphManager", None) is not cls:
            _ORIGINAL.setdefault(name, _ORIGINAL[_MANAGER_MODULE])
            other.EncoderCudaGraphManager = cls
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
