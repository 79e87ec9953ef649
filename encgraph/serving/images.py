"""Images of an embeddings request: base64 or ``data:`` URI strings -> decoded Pillow images, with one clear error
per bad input that names its field (``input[3]``) and carries the HTTP status it deserves.

Pillow does the decoding and the format detection; this module only enforces the server's limits (encoded bytes,
pixels) and the formats it accepts (PNG, JPEG), and turns Pillow's failures into :class:`ImageError`.

:func:`image_size` reads an image's width and height from its header alone (Pillow opens lazily; only the first
64 KB of the base64 text are decoded), so that a request's pixels are counted, and refused, before any is decoded.
Base64 may hold line breaks (what ``base64.encodebytes`` and MIME tools write): whitespace is dropped first.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

__all__ = ["ImageError", "ImageLimits", "decode_image", "image_size", "name_the_refused", "FORMATS"]

T = TypeVar("T")

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg"}
"""The formats accepted: Pillow's format name -> the media type a data URI names."""

_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),$")
_SPACES = ("\n", "\r", " ", "\t")
_PEEK_CHARS = (4096, 65536)
"""Base64 characters :func:`image_size` decodes first (3 KB, then 48 KB of bytes): a PNG's size is in its first 24
bytes, a JPEG's after its metadata segments (an EXIF block can take tens of KB); a header longer than this is read
from the whole image."""
_BOMB = re.compile(r"\((\d+) pixels\)")


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


def _base64_text(text: str, param: str) -> str:
    """The base64 text of a base64 string or a base64 ``data:`` URI."""
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
    return text


def _b64decode(text: str, param: str) -> bytes:
    if not text.isascii():
        raise _not_base64(param)
    if _has_space(text):  # line breaks (base64.encodebytes, MIME): strict decoding refuses them
        text = "".join(text.split())
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _not_base64(param) from None


def _has_space(text: str) -> bool:
    return any(c in text for c in _SPACES)  # str's own search: ~20x faster than a regex over a long string


def _not_base64(param: str) -> ImageError:
    return ImageError(400, param, "invalid_base64",
                      f"{param}: not valid base64 (send the PNG or JPEG file's bytes, base64-encoded, or a data URI).")


def _payload(text: str, param: str) -> bytes:
    """The raw bytes of a base64 string or a base64 ``data:`` URI."""
    return _b64decode(_base64_text(text, param), param)


def _check_text(text: Any, param: str, limits: ImageLimits) -> None:
    if not isinstance(text, str) or not text:
        raise ImageError(422, param, "invalid_type", f"{param}: expected a non-empty base64 string or data URI.")
    if len(text) > limits.max_bytes * 4 // 3 + 1024:  # refuse before decoding what is plainly too large
        raise ImageError(413, param, "image_too_large", f"{param}: the image is over the server's limit of "
                         f"{limits.max_bytes} bytes (--max-image-bytes).")


def _open(data: bytes, param: str, limits: ImageLimits) -> Any:
    """Pillow's lazy image over ``data`` (its header read, no pixel decoded), of an accepted format and within the
    per-image pixel limit."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(400, param, "corrupt_image", f"{param}: not a readable image (expected PNG or JPEG bytes).")
    except Image.DecompressionBombError as exc:  # Pillow's own limit (2 x 89 M pixels), far over ours
        found = _BOMB.search(str(exc))
        size = f"{found.group(1)} pixels" if found else "the image"
        raise ImageError(413, param, "image_too_large", f"{param}: {size} is over the server's limit of "
                         f"{limits.max_pixels} pixels per image (--max-pixels).") from None
    except (OSError, SyntaxError, ValueError) as exc:  # a header cut short or damaged (a truncated JPEG's tables)
        raise ImageError(400, param, "corrupt_image", f"{param}: the image's header is damaged ({exc}).")
    if image.format not in FORMATS:
        raise ImageError(415, param, "unsupported_format",
                         f"{param}: unsupported image format {image.format}; send PNG or JPEG.")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(413, param, "image_too_large", f"{param}: {width}x{height} = {width * height} pixels is over "
                         f"the server's limit of {limits.max_pixels} pixels per image (--max-pixels).")
    return image


def image_size(text: Any, index: int, limits: ImageLimits) -> tuple[int, int]:
    """``(width, height)`` of ``input[index]`` from its header, decoding no pixel; raises the same
    :class:`ImageError` as :func:`decode_image` for a bad type, format, header, byte or pixel count."""
    param = f"input[{index}]"
    _check_text(text, param, limits)
    b64 = _base64_text(text, param)
    for chars in _PEEK_CHARS:
        if len(b64) <= chars:
            break
        head = "".join(b64[:chars].split())
        try:
            return _open(_b64decode(head[: len(head) // 4 * 4], param), param, limits).size
        except ImageError:
            pass  # a header longer than the peek, or an error that the whole image names as well
    data = _b64decode(b64, param)
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(param, len(data), limits)
    return _open(data, param, limits).size


def _too_many_bytes(param: str, size: int, limits: ImageLimits) -> ImageError:
    return ImageError(413, param, "image_too_large", f"{param}: the image has {size} bytes, over the server's "
                      f"limit of {limits.max_bytes} (--max-image-bytes).")


def decode_image(text: Any, index: int, limits: ImageLimits) -> Any:
    """Decode ``input[index]`` into an RGB ``PIL.Image.Image`` (fully loaded), or raise :class:`ImageError`."""
    param = f"input[{index}]"
    _check_text(text, param, limits)
    data = _payload(text, param)
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(param, len(data), limits)
    image = _open(data, param, limits)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or damaged data
        raise ImageError(400, param, "corrupt_image", f"{param}: the {image.format} data is damaged ({exc}).")
    # convert() copies even an RGB image: 3 more bytes per pixel at the peak, for nothing.
    return image if image.mode == "RGB" else image.convert("RGB")


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
