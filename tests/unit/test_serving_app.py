"""``encgraph.serving.app`` in-process, over a fake served model: where a request's answer runs, the
``request_threads`` argument, and an app served again after its lifespan ended (a test client's)."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from encgraph.errors import ConfigError  # noqa: E402
from encgraph.serving.app import create_app  # noqa: E402


class _Front:
    stats: dict = {}
    queue_depth = 0

    def submit(self, inputs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(inputs)
        return future

    def close(self, drain=True, timeout=None):
        pass


class _Model:
    """Each image's embedding is its mean colour; ``answered_on`` records the threads that built answers."""

    name = "fake"
    processor = None
    front = _Front()

    def __init__(self):
        self.answered_on: list[str] = []

    def inputs(self, images):
        return [np.asarray(im, dtype=np.float32).mean(axis=(0, 1)) for im in images]

    def embeddings(self, results, tokens):
        self.answered_on.append(threading.current_thread().name)
        return [(r, None) for r in results]

    def token_count(self, results):
        return len(results)

    def info(self):
        return {}


def _png(color):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_answers_run_on_the_apps_own_threads_and_the_app_serves_again_after_its_lifespan():
    model = _Model()
    app = create_app({"fake": model}, request_threads=2)
    body = {"input": [_png((10, 20, 30)), _png((200, 100, 0))]}
    for _ in range(2):  # the second client runs the lifespan again, after the first one closed the threads
        with TestClient(app) as client:
            got = client.post("/v1/embeddings", json=body)
        assert got.status_code == 200, got.text
        assert [d["embedding"] for d in got.json()["data"]] == [[10.0, 20.0, 30.0], [200.0, 100.0, 0.0]]
    assert len(model.answered_on) == 2
    assert all(name.startswith("encgraph-answer") for name in model.answered_on), model.answered_on


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_request_threads_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="request_threads: expected an int >= 1") as info:
        create_app({"fake": _Model()}, request_threads=bad)
    assert isinstance(info.value, ValueError)
