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
    stats: dict = {"queue_depth": 0, "calls": 0, "completed": 0, "failed": 0, "rejected": 0, "cancelled": 0,
                   "requests_per_call": {}}
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

    def prepare_images(self, images):
        from encgraph.serving.loading import Prepared

        return Prepared(self.inputs(images))

    def submit(self, prepared):
        return self.front.submit(prepared.inputs)

    def on_host(self, results):
        pass

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


def test_the_wait_for_the_device_is_encode_time_and_answer_is_the_json_alone():
    """The stage clock (``encgraph_request_stage_seconds``): a request's wait for its embeddings on the host
    (``on_host``, where a CUDA call's device work and copy down are waited for) ends its encode stage; its answer
    stage is the JSON reply after that, here a slow one. Each stage is counted once per request."""
    import time

    class Slow(_Model):
        def on_host(self, results):
            time.sleep(0.3)

        def embeddings(self, results, tokens):
            time.sleep(0.1)
            return super().embeddings(results, tokens)

    app = create_app({"fake": Slow()})
    with TestClient(app) as client:
        assert _post(client, 1).status_code == 200
    registry = app.state.metrics.registry

    def stage(name, kind):
        return registry.get_sample_value(f"encgraph_request_stage_seconds_{kind}", {"model": "fake", "stage": name})

    assert all(stage(s, "count") == 1 for s in ("read", "decode", "preprocess", "encode", "answer"))
    assert 0.3 <= stage("encode", "sum") and 0.1 <= stage("answer", "sum") < 0.3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_request_threads_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="request_threads: expected an int >= 1") as info:
        create_app({"fake": _Model()}, request_threads=bad)
    assert isinstance(info.value, ValueError)


class _Gated(_Model):
    """Preprocessing waits for ``gate`` (``entered`` once it waits): a request that stays in flight."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def inputs(self, images):
        self.entered.set()
        assert self.gate.wait(10)
        return super().inputs(images)


def _post(client, n, **kwargs):
    return client.post("/v1/embeddings", json={"input": [_png((n, 0, 0))] * n}, **kwargs)


def test_pixels_are_limited_per_request_and_in_flight_and_given_back():
    """8x8 images (64 pixels): at most 128 per request and 150 in flight. While a 2-image request is held in its
    preprocessing, a 1-image request is busy (503, naming --max-pixels-in-flight); a 3-image one is too large
    (413, naming --max-request-pixels); once the first is done, all it held is given back."""
    from encgraph.serving.admission import InFlightLimits
    from encgraph.serving.app import ServerLimits

    model = _Gated()
    app = create_app({"fake": model}, ServerLimits(max_request_pixels=128, in_flight=InFlightLimits(max_pixels=150)))
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as ex:
        first = ex.submit(_post, client, 2)
        assert model.entered.wait(10)
        busy = _post(client, 1)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json()["error"]["code"] == "overloaded" and "--max-pixels-in-flight" in busy.text
        large = _post(client, 3)
        assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"
        assert "192 pixels" in large.text and "--max-request-pixels" in large.text
        model.gate.set()
        assert first.result(10).status_code == 200
        assert _post(client, 1).status_code == 200
    assert app.state.in_flight.held() == {"body_bytes": 0, "pixels": 0}


def test_bodies_in_flight_are_limited():
    """At most 1000 body bytes per request and in flight: while a request of ~250 bytes is held, one of ~900 is
    busy (503 naming --max-body-bytes-in-flight); afterwards it is served."""
    from encgraph.serving.admission import InFlightLimits
    from encgraph.serving.app import ServerLimits

    model = _Gated()
    limits = ServerLimits(max_body_bytes=1000, in_flight=InFlightLimits(max_body_bytes=1000))
    app = create_app({"fake": model}, limits)
    padded = {"input": [_png((1, 0, 0))], "user": "x" * 700}
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as ex:
        first = ex.submit(_post, client, 2)
        assert model.entered.wait(10)
        busy = client.post("/v1/embeddings", json=padded)
        assert busy.status_code == 503 and "--max-body-bytes-in-flight" in busy.text, busy.text
        model.gate.set()
        assert first.result(10).status_code == 200
        assert client.post("/v1/embeddings", json=padded).status_code == 200
    assert app.state.in_flight.held() == {"body_bytes": 0, "pixels": 0}


@pytest.mark.parametrize("reverse", [False, True])
def test_an_unknown_field_is_named_whatever_order_pydantic_lists_its_errors_in(monkeypatch, reverse):
    """A misspelt "inputs" makes two errors (the unknown field, the missing "input"); pydantic 2.13 listed the
    first first, 2.14 the second: either way the answer names "inputs"."""
    from pydantic import ValidationError

    from encgraph.serving import app as app_module

    real = app_module.EmbeddingRequest

    class Reordered:
        @staticmethod
        def model_validate_json(body):
            try:
                return real.model_validate_json(body)
            except ValidationError as exc:
                errors = [{"type": e["type"], "loc": e["loc"], "input": e["input"]} for e in exc.errors()]
                assert {e["type"] for e in errors} == {"extra_forbidden", "missing"}
                errors.sort(key=lambda e: e["type"] == "extra_forbidden", reverse=reverse)
                raise ValidationError.from_exception_data(exc.title, errors) from None

    monkeypatch.setattr(app_module, "EmbeddingRequest", Reordered)
    with TestClient(create_app({"fake": _Model()})) as client:
        got = client.post("/v1/embeddings", json={"inputs": [_png((1, 2, 3))]})
    assert got.status_code == 422
    assert got.json()["error"]["param"] == "inputs" and got.json()["error"]["message"].startswith("inputs: ")


@pytest.mark.parametrize("everywhere", [False, True])
def test_the_api_key_guards_v1_and_optionally_health_and_metrics(everywhere):
    app = create_app({"fake": _Model()}, api_key="k3y", protect_all=everywhere)
    good = {"Authorization": "Bearer k3y"}
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "bearer k3y"}):
            got = _post(client, 1, headers=headers)
            assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key", got.text
        assert _post(client, 1, headers=good).status_code == 200
        for path in ("/health", "/metrics"):
            assert client.get(path).status_code == (401 if everywhere else 200)
            assert client.get(path, headers=good).status_code == 200


def test_a_request_in_flight_at_the_graceful_timeout_answers_a_json_503():
    model = _Gated()
    app = create_app({"fake": model})
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as ex:
        first = ex.submit(_post, client, 1)
        assert model.entered.wait(10)
        client.portal.call(app.state.draining.begin, 0.2)
        got = first.result(10)
        model.gate.set()
    assert got.status_code == 503 and got.json()["error"]["code"] == "shutting_down", got.text


@pytest.mark.parametrize("name", ["siglip", "qwen2_5_vl"])
def test_health_reports_the_engine_the_model_really_runs(name):
    """Issue 54: ``/health`` said ``"engine": "graphs"`` for CPU models (before a first call) while ``/metrics``
    counted every item eager. On the CPU the runner's default is the adapter's eager forward: ``"eager"`` from the
    start, and every item in /metrics eager too."""
    torch = pytest.importorskip("torch")
    from encgraph.serving import loading

    tower, description = loading.embedded_tower(name, device=torch.device("cpu"), dtype=torch.float32)
    served = loading.build_model(name, tower, loading.load_processor(name), description,
                                 budgets=loading.EMBEDDED[name])
    app = create_app({name: served})
    try:
        with TestClient(app) as client:
            health = client.get("/health").json()["models"][name]
            assert health["engine"] == "eager"  # before any request
            assert health["image_processor"] == type(served.processor).__name__  # the Pillow one without torchvision
            got = client.post("/v1/embeddings", json={"model": name, "input": [_png((10, 20, 30))] * 2})
            assert got.status_code == 200, got.text
            assert client.get("/health").json()["models"][name]["engine"] == "eager"
            metrics = client.get("/metrics").text
    finally:
        served.front.close()
    assert f'encgraph_runner_items_total{{kind="eager",model="{name}"}} 2.0' in metrics, metrics
    assert f'encgraph_runner_items_total{{kind="graph",model="{name}"}} 0.0' in metrics, metrics
