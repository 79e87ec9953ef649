"""A real ``encgraph serve`` subprocess on 127.0.0.1 (a free port) and the references its answers are checked
against: the same embedded towers (seeded random weights) built in this process, run with their own forward on
the pixels the same image processor makes from the same image bytes.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("PIL")
pytest.importorskip("transformers")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from encgraph.serving.images import ImageLimits, decode_image  # noqa: E402
from encgraph.serving.loading import embedded_tower, load_processor  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90.0
MODELS = ("siglip", "qwen2_5_vl")
TOL = 1e-4
"""Largest relative error (max |served - reference| / max |reference|) of an embedding; float32 on the CPU."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``python -m encgraph serve`` process; ``url``; ``stop()`` sends SIGTERM and waits for the exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The repository first, then what the caller's path holds (a GPU machine's carried wheels, say).
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **(env or {}))
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: a pipe nobody reads could fill and block it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "encgraph", "serve", "--port", str(self.port), "--threads", "1", *args],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.started = time.monotonic()
        self.ready = False
        self.expected_exit = -signal.SIGTERM  # what the session's end expects (a test that kills it says otherwise)

    def wait_ready(self) -> Server:
        """Wait until ``/health`` answers (the process imports torch and builds its towers first)."""
        deadline = self.started + START_TIMEOUT
        while not self.ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"encgraph serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                self.ready = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
                continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"encgraph serve did not answer /health in {START_TIMEOUT} s:\n{self.output()}")
            time.sleep(0.2)
        return self

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit status (uvicorn re-raises the signal after its graceful shutdown: -SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"encgraph serve did not exit within {timeout} s of SIGTERM")
        return int(self.proc.returncode)


def encode(image: Image.Image, fmt: str, *, data_uri: bool = False) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    text = base64.b64encode(buf.getvalue()).decode()
    return f"data:image/{fmt.lower()};base64,{text}" if data_uri else text


def random_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


class References:
    """The embedded towers in this process and the expected embedding (and tokens) of an encoded image."""

    def __init__(self) -> None:
        self.towers = {n: embedded_tower(n, device=torch.device("cpu"), dtype=torch.float32)[0] for n in MODELS}
        self.processors = {n: load_processor(n) for n in MODELS}
        self._cache: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    def of(self, model: str, text: str) -> tuple[np.ndarray, np.ndarray]:
        key = (model, text)
        if key not in self._cache:
            image = decode_image(text, 0, ImageLimits())
            processed = self.processors[model](images=[image], return_tensors="pt")
            with torch.no_grad():
                if model == "qwen2_5_vl":  # pooled: the mean of the image's merged tokens
                    tokens = self.towers[model](processed["pixel_values"],
                                                grid_thw=processed["image_grid_thw"]).pooler_output
                    pooled = tokens.mean(0)
                else:
                    out = self.towers[model](pixel_values=processed["pixel_values"])
                    tokens, pooled = out.last_hidden_state[0], out.pooler_output[0]
            self._cache[key] = (pooled.numpy(), tokens.numpy())
        return self._cache[key]

    def check(self, model: str, images: list[str], body: dict, *, tokens: bool = False, tol: float = TOL) -> None:
        """Every embedding (and token sequence) of a 200 answer equals the tower's own (relative error < ``tol``)."""
        assert body["object"] == "list" and body["model"] == model and len(body["data"]) == len(images)
        for i, (entry, text) in enumerate(zip(body["data"], images)):
            assert entry["index"] == i
            pooled, seq = self.of(model, text)
            got = decode_vector(entry["embedding"])
            assert got.shape == pooled.shape and rel(got, pooled) < tol, (model, i, rel(got, pooled))
            if tokens:
                got_seq = decode_vector(entry["tokens"]).reshape(entry["tokens_shape"])
                assert got_seq.shape == seq.shape and rel(got_seq, seq) < tol, (model, i, rel(got_seq, seq))
            else:
                assert "tokens" not in entry


def decode_vector(value: list | str) -> np.ndarray:
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, dtype=np.float32)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.reshape(b.shape) - b).max() / max(float(np.abs(b).max()), 1e-12))


@pytest.fixture(scope="session")
def refs() -> References:
    return References()


@pytest.fixture(scope="session")
def pool() -> list[str]:
    """Encoded test images of several sizes (below and above the towers' sizes), PNG and JPEG, raw and data URI."""
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (90, 70), (40, 120), (100, 84), (33, 47), (112, 84), (64, 120), (96, 96)]
    return [encode(random_image(rng, w, h), "PNG" if i % 2 else "JPEG", data_uri=i % 3 == 0)
            for i, (w, h) in enumerate(sizes)]


LIMITS = ("--max-images", "8", "--max-image-bytes", "200000", "--max-pixels", "1000000",
          "--max-request-pixels", "3000000", "--max-pixels-in-flight", "6000000")
API_KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, Server]]:
    """The servers, started together (their start-up overlaps), shared by the integration modules:
    ``main``, the embedded default with small limits (so that the limit tests send little data) and a graceful
    timeout of 2 s (the SIGTERM test, which stops it); ``workers``, the same with its images decoded and
    preprocessed in a worker process (on the CPU the default is the server's threads; the SIGKILL test, last,
    kills it); ``tight``, a queue of one request (the overload test), otherwise the default limits (the memory
    test), and an API key from the environment (the authentication test)."""
    started = {"main": Server(*LIMITS, "--graceful-timeout", "2"),
               "workers": Server(*LIMITS, "--preprocess-workers", "1"),
               "tight": Server("--max-queue", "1", "--max-wait-ms", "0", env={"ENCGRAPH_API_KEY": API_KEY})}
    try:
        yield started
    finally:
        codes = {name: srv.stop() for name, srv in started.items()}
    assert codes == {name: srv.expected_exit for name, srv in started.items()}, codes


@pytest.fixture(scope="session")
def server(servers: dict[str, Server]) -> Server:
    return servers["main"].wait_ready()


@pytest.fixture(params=["main", "workers"])
def served(request, servers: dict[str, Server]) -> Server:
    """Each of the servers that differ only in where they preprocess: the tests that take it run against both."""
    return servers[request.param].wait_ready()
