"""The error hierarchy.

Every error encgraph raises derives from :class:`EncgraphError`, and also from the builtin a caller would
catch for that kind of mistake (``ValueError`` for a bad value, ``TypeError`` for a bad type), so that code
written against plain Python exceptions keeps working.
"""

from __future__ import annotations

__all__ = [
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
]


class EncgraphError(Exception):
    """Root of every error raised by encgraph."""


class ConfigError(EncgraphError, ValueError):
    """A configuration or argument has a value that cannot work (bad budget, limit, ladder, path name)."""


class ConfigTypeError(EncgraphError, TypeError):
    """A configuration or argument has the wrong type."""


class InputError(EncgraphError, ValueError):
    """Call-time inputs are inconsistent (shapes, grids, empty batch, device)."""


class InputTypeError(EncgraphError, TypeError):
    """Call-time inputs have the wrong type or dtype."""


class CaptureError(EncgraphError, RuntimeError):
    """Capturing a CUDA graph failed and no fallback applies."""


class UnsupportedModelError(EncgraphError, TypeError):
    """No adapter knows this module."""


class VersionError(EncgraphError, ImportError):
    """An installed dependency is older than the feature needs."""


class OverloadedError(EncgraphError, RuntimeError):
    """A serving queue is full: the request was refused at once (an HTTP server answers 503 with Retry-After)."""


class ShutdownError(EncgraphError, RuntimeError):
    """The serving front is shut down (or shutting down without draining): the request was not run."""
