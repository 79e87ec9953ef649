"""A tower call's arguments as the model adapters read them: its leading parameters bound by position or keyword,
and the switches (``return_dict``, ``output_hidden_states``, ``output_attentions``) that the call sets or leaves to
the tower's config.

HF vision towers take ``forward(<inputs>..., **kwargs)``: one to three named inputs, then keywords the tower reads
from the call when given and from its config otherwise. The adapters that answer such calls themselves (the Qwen-VL
base, Pixtral, SigLIP2 NaFlex, Idefics3) read them here, so that a call is bound, and its errors worded, the same
way in every family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from encgraph.errors import InputTypeError

__all__ = ["RECORDING_SWITCHES", "bind", "recording_requested", "return_dict", "switch"]

RECORDING_SWITCHES = ("output_hidden_states", "output_attentions")
"""The switches that ask a tower for per-layer outputs."""


def bind(where: str, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's values of the parameters ``names`` (in order), from ``args`` by position and from ``kwargs`` by
    name; those found in ``kwargs`` are popped from it, the rest of ``kwargs`` stays for the caller. A parameter
    given neither way is absent from the result. ``where`` names the call in errors (``"SiglipVisionModel.forward"``).

    Raises:
        InputTypeError: more positional arguments than ``names``, or a parameter given both ways.
    """
    if len(args) > len(names):
        raise InputTypeError(f"{where}: expected ({', '.join(names)}), got {len(args)} positional arguments.")
    values = dict(zip(names, args))
    for name in names:
        if name in kwargs:
            if name in values:
                raise InputTypeError(f"{where}: got {name!r} both positionally and by keyword.")
            values[name] = kwargs.pop(name)
    return values


def switch(config: Any, kwargs: dict[str, Any], name: str, default: Any = False) -> Any:
    """The call's ``name`` keyword where it is given and not ``None``, else the config's attribute (``default``
    where the config has none), as HF towers read their switches."""
    value = kwargs.get(name)
    return getattr(config, name, default) if value is None else value


def return_dict(config: Any, kwargs: dict[str, Any]) -> Any:
    """Whether the call asks for the tower's output class (true) or its tuple: the call's value as given (the
    adapter checks it), else the config's as a bool, else ``True``."""
    value = kwargs.get("return_dict")
    return bool(getattr(config, "return_dict", True)) if value is None else value


def recording_requested(config: Any, kwargs: dict[str, Any]) -> str | None:
    """The first of :data:`RECORDING_SWITCHES` that the call (or the config's default) turns on, or ``None``."""
    return next((name for name in RECORDING_SWITCHES if switch(config, kwargs, name)), None)
