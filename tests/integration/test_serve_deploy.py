"""``encgraph serve`` as deployed: memory limits (pixels per request counted before decoding, the resident memory
bounded), authentication, the error shape of every status, base64 with line breaks, and nothing left behind when
the server is killed with SIGKILL. Subprocesses on 127.0.0.1 (the session's servers of conftest.py, after
test_serve.py; its SIGTERM test checks the graceful timeout's JSON 503); the SIGKILL test comes last.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import re
import signal
import struct
import time
import zlib
from pathlib import Path

import pytest

from encgraph.serving.admission import BYTES_PER_PIXEL, InFlightLimits
from tests.integration.conftest import API_KEY, AUTH, References, httpx

TIMEOUT = 60.0


def _status(pid: int) -> dict[str, str]:
    """/proc/PID/status as {field: value}; {} when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _kib(pid: int, field: str) -> int:
    return int(_status(pid)[field].split()[0]) * 1024


def _idle(pid: int) -> int:
    """The process's resident memory now, its peak (VmHWM) reset to it where the kernel allows (clear_refs 5),
    so that the peak measured next is this test's."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    return max(_kib(pid, "VmRSS"), _kib(pid, "VmHWM"))


def _png_header(width: int, height: int) -> bytes:
    """A PNG of ``width`` x ``height`` RGB pixels that holds no pixel data: its header alone (a pixel bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _solid_png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _post(url: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=TIMEOUT)


def test_pixels_per_request_are_counted_before_decoding_and_memory_stays_bounded(servers):
    """The default limits (``tight``): the issue's request (32 solid-colour 6300 x 6300 PNGs, 39.7 M pixels each,
    under the 40 M per image: 1.27 G pixels in 4.2 MB, which took 52 s and 9.2 GB before) and four of it at once
    are refused from the headers, before any pixel is decoded; a request within the limits is served; the server's
    peak resident memory grows by at most BYTES_PER_PIXEL per decoded pixel, and stays within the stated bound."""
    srv = servers["tight"].wait_ready()
    pid = srv.proc.pid
    issue = {"input": [_solid_png(6300)] * 32}
    idle = _idle(pid)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(lambda _: _post(srv.url, issue), range(5)))
    refused_s = time.monotonic() - t0
    for r in answers:
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["code"] == "request_too_large", err
        assert "--max-request-pixels" in err["message"] and "1270080000 pixels" in err["message"], err
    assert refused_s < 10, refused_s
    assert _kib(pid, "VmHWM") - idle < 64 * 2**20  # nothing decoded: the bodies only
    pixels = 2 * 3000 * 3000
    idle = _idle(pid)
    r = _post(srv.url, {"input": [_solid_png(3000)] * 2})
    assert r.status_code == 200, r.text
    grown = _kib(pid, "VmHWM") - idle
    assert grown <= BYTES_PER_PIXEL * pixels, (grown, grown / pixels)
    assert grown <= InFlightLimits().bound_bytes()


def test_a_pixel_bomb_names_our_limit_and_base64_with_line_breaks_is_accepted(servers, refs: References, pool):
    server = servers["workers"].wait_ready()
    bomb = base64.b64encode(_png_header(20_000, 20_000)).decode()  # 400 M pixels: over Pillow's own limit too
    r = _post(server.url, {"input": [bomb]})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "input[0]" and "400000000 pixels" in err["message"], err
    assert "--max-pixels" in err["message"] and "decompression bomb" not in err["message"], err
    wrapped = base64.encodebytes(base64.b64decode(pool[1])).decode()  # a line break every 76 characters
    assert "\n" in wrapped
    r = _post(server.url, {"input": [wrapped, "data:image/png;base64," + wrapped]})
    assert r.status_code == 200, r.text
    refs.check("siglip", [pool[1], pool[1]], r.json())


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/nope", 404, "not_found"),
    ("GET", "/v1/embeddings", 405, "method_not_allowed"),
    ("DELETE", "/health", 405, "method_not_allowed"),
    ("POST", "/v1/nope", 404, "not_found"),
])
def test_every_status_has_the_documented_error_shape(servers, method, path, status, code):
    server = servers["workers"].wait_ready()
    r = httpx.request(method, f"{server.url}{path}", timeout=TIMEOUT)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert err["message"].startswith(f"{method} {path}: ")


def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(servers, refs: References, pool):
    srv = servers["tight"].wait_ready()
    body = {"input": pool[:2], "model": "siglip"}
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        r = _post(srv.url, body, headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["param"] == "authorization", err
    r = httpx.get(f"{srv.url}/v1/models", timeout=TIMEOUT)  # every path under /v1/, known or not
    assert r.status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{srv.url}{path}", timeout=TIMEOUT).status_code == 200, path
    r = _post(srv.url, body, AUTH)
    assert r.status_code == 200, r.text
    refs.check("siglip", pool[:2], r.json())


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(c) for c in (task / "children").read_text().split())
    return out


def test_sigkill_leaves_no_worker_tracker_or_shared_memory_behind(servers):
    """``workers`` (last use): killed with SIGKILL, its preprocessing worker and multiprocessing's resource tracker
    exit by themselves, and its shared-memory file is gone."""
    srv = servers["workers"].wait_ready()
    pid = srv.proc.pid
    children = _children(pid)
    assert len(children) >= 2, children  # the worker and the resource tracker
    shm = [n for n in os.listdir("/dev/shm") if re.fullmatch(rf"encgraph-preprocess-{pid}-.*", n)] \
        if os.path.isdir("/dev/shm") else []
    assert shm == []  # unlinked once the worker mapped it
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)
    srv.expected_exit = -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = {c for c in children if _status(c).get("State", "Z").split()[0] not in ("Z", "X")}
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, {c: _status(c).get("Name") for c in alive}
