"""Checks of a ``--model`` checkpoint directory that ``encgraph serve`` runs before it builds any tower, so that a
broken checkpoint is one line and exit 2 in a second, not a traceback after minutes of loading.

:func:`inspect_checkpoint` reads the directory's ``config.json`` (valid JSON, a model type transformers knows and
the server serves), its weight files (each safetensors file's header and size: a file cut short, by a failed
copy or download, is found without reading its tensors; a ``.bin`` file's zip directory), its
``preprocessor_config.json`` (transformers' own image processor), and whether the processor makes images of the
tower's size (SigLIP and CLIP: the processor's output height and width against the tower's ``image_size``;
Qwen-VL: the patch, merge and temporal patch sizes). Every failure is a :class:`~encgraph.errors.ConfigError` (or
:class:`~encgraph.errors.UnsupportedModelError`) whose message starts with ``--model PATH:``.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any

import attrs

from encgraph.errors import ConfigError, UnsupportedModelError

__all__ = ["Checkpoint", "inspect_checkpoint", "check_weights", "check_processor_fits"]

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@attrs.frozen
class Checkpoint:
    """A checked checkpoint directory: its transformers ``config``, ``model_type`` and image ``processor``."""

    path: str
    config: Any
    model_type: str
    processor: Any


def _fail(path: str, what: str) -> ConfigError:
    return ConfigError(f"--model {path}: {what}")


def _read_json(path: str, name: str) -> Any:
    try:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(path, f"cannot read {name} ({exc}).") from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"{name} is not valid JSON ({exc}); re-save it with save_pretrained.") from None


def inspect_checkpoint(path: str | os.PathLike[str], families: Any) -> Checkpoint:
    """Check the checkpoint directory ``path`` (see the module docs); ``families``: the served ``model_type``s."""
    from transformers import AutoConfig, AutoImageProcessor

    path = os.fspath(path)
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"--model: expected a local checkpoint directory with a config.json (saved with "
                          f"save_pretrained), got {path!r}.")
    if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
        raise _fail(path, "no preprocessor_config.json; save the model's image processor there too "
                    "(processor.save_pretrained(PATH)).")
    raw = _read_json(path, "config.json")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in families:
        raise UnsupportedModelError(f"--model {path}: model_type {model_type!r} is not served; known: "
                                    f"{sorted(families)}.")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers' own refusal (an unknown type, a bad field): its words, on one line
        raise _fail(path, f"transformers cannot read config.json ({type(exc).__name__}: {exc}).") from None
    check_weights(path)
    _read_json(path, "preprocessor_config.json")
    try:
        processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise _fail(path, f"transformers cannot read preprocessor_config.json ({type(exc).__name__}: {exc}).") from None
    check_processor_fits(path, getattr(config, "vision_config", None) or config, processor)
    return Checkpoint(path, config, model_type, processor)


def check_weights(path: str) -> None:
    """Every weight file of ``path`` is whole: a safetensors file as long as its header says, a ``.bin`` a
    readable zip; at least one weight file."""
    names = [n for n in _WEIGHTS if os.path.exists(os.path.join(path, n))]
    if not names:
        raise _fail(path, f"no weights (expected one of {', '.join(_WEIGHTS)}).")
    files = set()
    for name in names:
        if name.endswith(".index.json"):
            index = _read_json(path, name)
            shards = index.get("weight_map", {}).values() if isinstance(index, dict) else ()
            files.update(shards)
            if not files:
                raise _fail(path, f"{name} lists no weight files.")
        else:
            files.add(name)
    for name in sorted(files):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise _fail(path, f"weight file {name} is missing.")
        problem = _safetensors_problem(file) if name.endswith(".safetensors") else _zip_problem(file)
        if problem:
            raise _fail(path, f"weight file {name} is damaged: {problem}; copy or download it again.")


def _safetensors_problem(file: str) -> str | None:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"its header claims {length} bytes, the file has {size}"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "its header is not valid JSON"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    need = 8 + length + max(ends, default=0)
    if size < need:
        return f"truncated: {size} bytes, its tensors need {need}"
    return None


def _zip_problem(file: str) -> str | None:
    try:
        with zipfile.ZipFile(file):
            return None
    except (zipfile.BadZipFile, OSError) as exc:
        return f"not a readable torch.save zip ({exc})"


def _processor_size(processor: Any) -> tuple[int, int] | None:
    """(height, width) of the processor's output images, where it is fixed (resize to a size, or a crop)."""
    for field in ("crop_size", "size"):
        if field == "crop_size" and not getattr(processor, "do_center_crop", False):
            continue
        size = getattr(processor, field, None)
        if isinstance(size, dict):  # a plain dict (older processors), else transformers' SizeDict
            height, width = size.get("height"), size.get("width")
        else:
            height, width = getattr(size, "height", None), getattr(size, "width", None)
        if height and width:
            return int(height), int(width)
    return None


def check_processor_fits(path: str, tower_config: Any, processor: Any) -> None:
    """The processor makes what the tower reads: a start-up error naming both sizes where they differ."""
    pairs: list[tuple[str, Any, str, Any]] = []
    if hasattr(tower_config, "spatial_merge_size"):  # Qwen-VL: patch rows
        for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
            pairs.append((ours, getattr(processor, ours, None), theirs, getattr(tower_config, theirs, None)))
    elif hasattr(tower_config, "image_size"):  # a fixed-size tower (SigLIP, CLIP)
        side = tower_config.image_size
        made = _processor_size(processor)
        if made is not None:
            pairs.append(("height x width", f"{made[0]}x{made[1]}", "image_size", f"{side}x{side}"))
    for ours, made, theirs, wanted in pairs:
        if made != wanted:
            raise _fail(path, f"the image processor's {ours} is {made}, but the tower's {theirs} is {wanted}: "
                        f"preprocessor_config.json belongs to another model; save this model's image processor "
                        "there.")
