"""The forward a module had before ``encgraph.graphed`` hooked it: what adapters and the stock path call.

``graphed(module)`` installs its hook as the instance attribute ``module.forward`` (the class is untouched, as with
accelerate's ``add_hook_to_module``). An adapter that runs the module (its eager forward, the static forward it
captures) must reach the module's own computation, not the hook again: :func:`own_forward` gives it. It bypasses
``nn.Module.__call__`` and with it the module's forward hooks, which the caller's own call of the module already
ran once around the whole call (they never see the sub-batches, the scratch inputs of a capture or its padding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["own_forward", "HOOK_MARK"]

HOOK_MARK = "_encgraph_hook"
"""An attribute every encgraph forward hook sets to ``True`` (how a hook is told from a user's instance forward)."""


def own_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """``module``'s forward as it was before it was graphed: the instance forward it held then (another library's
    hook, say), else its class's ``forward`` bound to it. For a module that is not graphed, ``module.forward``."""
    hook = module.__dict__.get("forward")
    if hook is not None and getattr(hook, HOOK_MARK, False):
        return hook.original_forward
    return module.forward
