"""encgraph: capture the vision encoder of a multimodal model as CUDA graphs and replay them for batches of
images and videos of any size.

Importing this package imports neither torch nor transformers; the runner and adapters load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from encgraph.errors import (
    CaptureError,
    ConfigError,
    ConfigTypeError,
    EncgraphError,
    InputError,
    InputTypeError,
    OverloadedError,
    ShutdownError,
    UnsupportedModelError,
    VersionError,
)

__version__ = "0.1.0"

__all__ = [
    "EncoderGraphRunner",
    "RunMode",
    "graphed",
    "graphs",
    "EncgraphError",
    "ConfigError",
    "ConfigTypeError",
    "InputError",
    "InputTypeError",
    "CaptureError",
    "UnsupportedModelError",
    "VersionError",
    "OverloadedError",
    "ShutdownError",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from encgraph.capture.records import RunMode
    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.models.graphed import graphed, graphs

_LAZY = {
    "EncoderGraphRunner": ("encgraph.capture.runner", "EncoderGraphRunner"),
    "RunMode": ("encgraph.capture.records", "RunMode"),
    "graphed": ("encgraph.models.graphed", "graphed"),
    "graphs": ("encgraph.models.graphed", "graphs"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that ``import encgraph.packing`` never pulls torch in.
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'encgraph' has no attribute {name!r}")
