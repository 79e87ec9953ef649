"""Images of an embeddings request: base64 or ``data:`` URI strings -> decoded Pillow images, with one clear error
per bad input that names its field (``input[3]``) and carries the HTTP status it deserves.

Pillow does the decoding and the format detection; this module only enforces the server's limits (encoded bytes,
pixels) and the formats it accepts (PNG, JPEG), and turns Pillow's failures into :class:`ImageError`.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

__all__ = ["ImageError", "ImageLimits", "decode_image", "name_the_refused", "FORMATS"]

T = TypeVar("T")

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg"}
"""The formats accepted: Pillow's format name -> the media type a data URI names."""

_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),$")


@attrs.frozen
class ImageLimits:
    """Per-image limits: ``max_bytes`` decoded (before decompression), ``max_pixels`` (width * height)."""

    max_bytes: int = 8 * 2**20
    max_pixels: int = 40_000_000


class ImageError(Exception):
    """One bad image: ``status`` (400, 413 or 415), ``param`` (``input[i]``), ``code`` (a short machine name)."""

    def __init__(self, status: int, param: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[int, str, str, str]]:
        # Pickled by a preprocessing worker process (encgraph.serving.preprocess): Exception's own pickling
        # would call __init__ with the message alone.
        return type(self), (self.status, self.param, self.code, str(self))


def _payload(text: str, param: str) -> bytes:
    """The raw bytes of a base64 string or a base64 ``data:`` URI."""
    if text.startswith("data:"):
        head, sep, data = text.partition(",")
        match = _DATA_URI.match(head + ",")
        if match is None or not sep:
            raise ImageError(400, param, "invalid_data_uri",
                             f"{param}: expected a data URI 'data:image/png;base64,...', got {text[:40]!r}...")
        mime = match.group("mime").strip().lower()
        if mime not in FORMATS.values():
            raise ImageError(415, param, "unsupported_format",
                             f"{param}: unsupported media type {mime or '(none)'!r}; send image/png or image/jpeg.")
        if ";base64" not in match.group("params").lower():
            raise ImageError(400, param, "invalid_data_uri", f"{param}: the data URI must be base64 (';base64,').")
        text = data
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(400, param, "invalid_base64",
                         f"{param}: not valid base64 (send the PNG or JPEG file's bytes, base64-encoded, or a data URI).")


def decode_image(text: Any, index: int, limits: ImageLimits) -> Any:
    """Decode ``input[index]`` into an RGB ``PIL.Image.Image`` (fully loaded), or raise :class:`ImageError`."""
    from PIL import Image, UnidentifiedImageError

    param = f"input[{index}]"
    if not isinstance(text, str) or not text:
        raise ImageError(422, param, "invalid_type", f"{param}: expected a non-empty base64 string or data URI.")
    if len(text) > limits.max_bytes * 4 // 3 + 1024:  # refuse before decoding what is plainly too large
        raise ImageError(413, param, "image_too_large",
                         f"{param}: the image is over the server's limit of {limits.max_bytes} bytes.")
    data = _payload(text, param)
    if len(data) > limits.max_bytes:
        raise ImageError(413, param, "image_too_large",
                         f"{param}: the image has {len(data)} bytes, over the server's limit of {limits.max_bytes}.")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(400, param, "corrupt_image", f"{param}: not a readable image (expected PNG or JPEG bytes).")
    except Image.DecompressionBombError as exc:
        raise ImageError(413, param, "image_too_large", f"{param}: {exc}")
    except (OSError, SyntaxError, ValueError) as exc:  # a header cut short or damaged (a truncated JPEG's tables)
        raise ImageError(400, param, "corrupt_image", f"{param}: the image's header is damaged ({exc}).")
    if image.format not in FORMATS:
        raise ImageError(415, param, "unsupported_format",
                         f"{param}: unsupported image format {image.format}; send PNG or JPEG.")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(413, param, "image_too_large",
                         f"{param}: {width}x{height} pixels is over the server's limit of {limits.max_pixels} pixels.")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or damaged data
        raise ImageError(400, param, "corrupt_image", f"{param}: the {image.format} data is damaged ({exc}).")
    return image.convert("RGB")


def name_the_refused(fn: Callable[[list[Any]], T], images: Sequence[Any]) -> T:
    """``fn(images)`` (the model's image processor, or all of a model's preprocessing) over decoded images; when it
    raises, the :class:`ImageError` (400, ``unprocessable_image``) naming the first image it refuses alone, with
    its size and ``fn``'s message; ``fn``'s own error when every image passes alone."""
    try:
        return fn(list(images))
    except Exception:
        for i, image in enumerate(images):  # the rare failure path: find the culprit
            try:
                fn([image])
            except Exception as one:
                raise ImageError(400, f"input[{i}]", "unprocessable_image",
                                 f"input[{i}]: the model's image processor refused this image "
                                 f"({image.width}x{image.height}): {one}") from None
        raise
