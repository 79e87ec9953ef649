"""``encgraph.serving.images``: sizes read from headers alone equal the decoded ones (PNG, JPEG, a JPEG whose
EXIF block is longer than the first peek, data URIs, base64 with line breaks), and a pixel bomb is refused naming
the server's own limit."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from encgraph.serving.images import ImageError, ImageLimits, decode_image, image_size  # noqa: E402


def _encoded(fmt: str, **save) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(buf, format=fmt, **save)
    return buf.getvalue()


CASES = {
    "png": _encoded("PNG"),
    "jpeg": _encoded("JPEG", quality=90),
    "jpeg, 60 KB of EXIF": _encoded("JPEG", exif=b"Exif\x00\x00" + bytes(60_000)),
    "grey png": (lambda b: (Image.new("L", (300, 20), 7).save(b, format="PNG"), b.getvalue())[1])(io.BytesIO()),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("form", ["base64", "data URI", "line breaks"])
def test_the_header_size_is_the_decoded_size(case, form):
    data = CASES[case]
    text = base64.encodebytes(data).decode() if form == "line breaks" else base64.b64encode(data).decode()
    if form == "data URI":
        text = ("data:image/png;base64," if case.endswith("png") else "data:image/jpeg;base64,") + text
    image = decode_image(text, 0, ImageLimits())
    assert image_size(text, 0, ImageLimits()) == image.size and image.mode == "RGB"


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IEND", b"")


@pytest.mark.parametrize("side", [3000, 20_000])  # over our limit; over Pillow's own (2 x 89 M pixels) too
def test_a_pixel_bomb_names_the_servers_limit(side):
    text = base64.b64encode(_png_header(side, side)).decode()
    for read in (image_size, decode_image):
        with pytest.raises(ImageError) as info:
            read(text, 3, ImageLimits(max_pixels=1_000_000))
        err = info.value
        assert (err.status, err.param, err.code) == (413, "input[3]", "image_too_large")
        assert f"{side * side} pixels" in str(err) and "1000000 pixels per image (--max-pixels)" in str(err)
        assert "decompression bomb" not in str(err)
