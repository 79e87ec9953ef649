"""``encgraph serve`` as a subprocess on loopback, talked to with httpx: every embedding equals the tower's own
forward on the same preprocessed pixels; 64 concurrent clients; every bad input (each answered with a JSON error
naming its field) interleaved with good requests that stay correct; overload answered 503 with Retry-After;
SIGTERM under load (what was answered was right, the rest get an error, the process exits).

The correctness and bad-input tests run against a second server that preprocesses in a worker process
(``--preprocess-workers 1``) too.

Bounded: three server processes, a few hundred small requests, every wait with a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import signal
import socket
import threading
import time

import numpy as np
import pytest

from encgraph.serving.metrics import STAGES
from tests.integration.conftest import AUTH, MODELS, References, encode, httpx, random_image

TIMEOUT = 60.0


def post(client, body, **kwargs):
    return client.post("/v1/embeddings", json=body, timeout=TIMEOUT, **kwargs)


def test_health_lists_the_embedded_models(server):
    body = httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()
    assert body["status"] == "ok" and body["default_model"] == "siglip"
    assert set(body["models"]) == set(MODELS)
    assert all(m["device"] == "cpu" and m["dtype"] == "float32" for m in body["models"].values())
    # What really runs them: the runner's CPU default, the adapter's eager forward (issue 54: it said "graphs").
    assert all(m["engine"] == "eager" for m in body["models"].values()), body["models"]
    # Start-up froze its heap (torch, transformers, the towers: ~10^5 objects) out of the collector's reach, and
    # /metrics times the collections that still run.
    assert body["gc_frozen_objects"] > 50_000, body["gc_frozen_objects"]
    metrics = _metrics(server)
    assert {("encgraph_gc_collections_total", g) for g in "012"} <= set(metrics)
    assert metrics[("encgraph_gc_longest_pause_seconds", "2")] < 0.1, metrics


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_embeddings_equal_the_tower(served, refs: References, pool, model, fmt):
    with httpx.Client(base_url=served.url) as client:
        for images in (pool[:1], pool[1:4], pool[4:8]):
            r = post(client, {"model": model, "input": images, "encoding_format": fmt, "return_tokens": True})
            assert r.status_code == 200, r.text
            refs.check(model, images, r.json(), tokens=True)
            assert r.json()["usage"]["total_tokens"] == sum(refs.of(model, t)[1].shape[0] for t in images)
        r = post(client, {"input": pool[2]})  # one string, no model: the default (siglip), no tokens
        assert r.status_code == 200
        refs.check("siglip", [pool[2]], r.json())


def test_64_concurrent_clients_each_get_their_own_correct_embeddings(server, refs: References, pool):
    rng = np.random.default_rng(5)
    plans = [[(MODELS[(c + k) % 2], [pool[int(i)] for i in rng.choice(len(pool), int(rng.integers(1, 4)))])
              for k in range(2)] for c in range(64)]
    for model, images in (p for plan in plans for p in plan):
        for text in images:
            refs.of(model, text)  # computed up front: the clients' threads only talk and compare
    before = _metrics(server)
    barrier = threading.Barrier(64)

    def client(plan):
        out = []
        with httpx.Client(base_url=server.url) as c:
            barrier.wait(TIMEOUT)
            for model, images in plan:
                out.append((model, images, post(c, {"model": model, "input": images})))
        return out

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        answers = [a for f in [ex.submit(client, p) for p in plans] for a in f.result(TIMEOUT * 2)]
    assert len(answers) == 128
    for model, images, r in answers:
        assert r.status_code == 200, r.text
        refs.check(model, images, r.json())
    after = _metrics(server)
    coalesced = sum(after.get(("encgraph_coalesced_requests_total", m), 0)
                    - before.get(("encgraph_coalesced_requests_total", m), 0) for m in MODELS)
    assert coalesced > 0  # 64 clients at once: requests shared runner calls
    for m in MODELS:
        assert after[("encgraph_requests_total", m, "200")] - before.get(("encgraph_requests_total", m, "200"), 0) == 64
        assert ("encgraph_padded_share", m, "default") in after and ("encgraph_queue_depth", m) in after
        assert after[("encgraph_request_latency_seconds_count", m)] >= 64
        _check_stages(before, after, m, 64)


def _check_stages(before: dict, after: dict, model: str, requests: int) -> dict[tuple[str, ...], float]:
    """Every answered request's time split over its stages: each stage counted once per request, and the stages
    together account for the request's latency (the laps run from the same start to the answer). The deltas."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    for stage in STAGES:
        assert delta[("encgraph_request_stage_seconds_count", model, stage)] == requests, stage
        assert delta[("encgraph_request_stage_seconds_sum", model, stage)] >= 0, stage
    staged = sum(delta[("encgraph_request_stage_seconds_sum", model, stage)] for stage in STAGES)
    latency = delta[("encgraph_request_latency_seconds_sum", model)]
    assert 0.9 * latency <= staged <= latency + 1e-6, (staged, latency)
    assert delta[("encgraph_request_stage_seconds_sum", model, "encode")] > 0
    return delta


def test_preprocess_workers_in_health_metrics_and_stages(servers, pool):
    """``/health`` gives each model's worker count (0: the server's threads); with a worker, decode is the worker's
    own decoding time and preprocess the rest of the round trip, and the stages still add up."""
    main, srv = servers["main"].wait_ready(), servers["workers"].wait_ready()
    for server, workers in ((main, 0), (srv, 1)):
        body = httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()
        assert {m["preprocess_workers"] for m in body["models"].values()} == {workers}
    before = _metrics(srv)
    with httpx.Client(base_url=srv.url) as c:
        for i in range(4):
            assert post(c, {"model": "qwen2_5_vl", "input": pool[i : i + 2]}).status_code == 200
    after = _metrics(srv)
    delta = _check_stages(before, after, "qwen2_5_vl", 4)
    assert all(delta[("encgraph_request_stage_seconds_sum", "qwen2_5_vl", s)] > 0 for s in ("decode", "preprocess"))
    assert after[("encgraph_preprocess_restarts_total",)] == 0
    # Each request's pixels (2 Qwen images, ~0.2 MB) came back through a shared-memory slot, not the pipe.
    assert after[("encgraph_preprocess_pipe_results_total",)] == before[("encgraph_preprocess_pipe_results_total",)]
    assert ("encgraph_preprocess_restarts_total",) not in _metrics(main)


def _metrics(server) -> dict[tuple[str, ...], float]:
    """``/metrics`` parsed into {(name, label values...): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(v for k, v in sorted(s.labels.items(), key=lambda kv: (kv[0] != "model", kv[0])))
            out[(s.name, *labels)] = s.value
    return out


def _bad_requests(pool) -> list[tuple[str, bytes | dict, int, str]]:
    """(what, body, status, param) of every kind of bad input."""
    rng = np.random.default_rng(9)
    png = base64.b64decode(pool[1])
    gif = io.BytesIO()
    random_image(rng, 20, 20).save(gif, format="GIF")
    big = encode(random_image(rng, 300, 300), "PNG")  # ~270 KB > the 200000-byte limit
    wide = io.BytesIO()
    random_image(np.random.default_rng(0), 1, 1).resize((1100, 1000)).save(wide, format="PNG")  # 1.1 Mpx, tiny file
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    thin = encode(random_image(rng, 2000, 3), "PNG")  # Qwen's processor takes aspect ratios below 200
    return [
        ("corrupt image", {"input": [pool[0], b64(rng.bytes(500)), pool[2]]}, 400, "input[1]"),
        ("truncated PNG", {"input": [b64(png[: len(png) // 2])]}, 400, "input[0]"),
        ("JPEG cut in its header", {"input": [pool[1], b64(base64.b64decode(pool[2])[:300])]}, 400, "input[1]"),
        ("not base64", {"input": ["not base64 at all!"]}, 400, "input[0]"),
        ("GIF", {"input": [pool[0], b64(gif.getvalue())]}, 415, "input[1]"),
        ("gif data URI", {"input": ["data:image/gif;base64," + pool[1]]}, 415, "input[0]"),
        ("image over the byte limit", {"input": [big]}, 413, "input[0]"),
        ("image over the pixel limit", {"input": [b64(wide.getvalue())]}, 413, "input[0]"),
        ("too many images", {"input": [pool[0]] * 9}, 413, "input"),
        ("an aspect ratio the processor refuses", {"model": "qwen2_5_vl", "input": [pool[0], thin]}, 400, "input[1]"),
        ("body over the limit", {"input": [pool[0]], "user": "x" * 2_500_000}, 413, "body"),
        ("empty list", {"input": []}, 422, "input"),
        ("input not a list", {"input": 5}, 422, "input"),
        ("a non-string image", {"input": [pool[0], 3]}, 422, "input[1]"),
        ("unknown field", {"inputs": [pool[0]]}, 422, "inputs"),
        ("bad encoding_format", {"input": [pool[0]], "encoding_format": "hex"}, 422, "encoding_format"),
        ("unknown model", {"input": [pool[0]], "model": "gpt-4"}, 404, "model"),
        ("invalid JSON", b'{"input": [', 400, "body"),
        ("JSON not an object", b"[1, 2]", 422, "body"),
    ]


def test_bad_inputs_interleaved_with_good_ones(served, refs: References, pool):
    bad = _bad_requests(pool)
    good = [(MODELS[i % 2], pool[i % len(pool): i % len(pool) + 2]) for i in range(len(bad))]
    jobs = [job for pair in zip(bad, good) for job in pair]

    def send(job):
        with httpx.Client(base_url=served.url) as c:
            if len(job) == 4:
                body = job[1]
                if isinstance(body, bytes):
                    return c.post("/v1/embeddings", content=body, headers={"content-type": "application/json"},
                                  timeout=TIMEOUT)
                return post(c, body)
            return post(c, {"model": job[0], "input": job[1]})

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(send, jobs))
    for job, r in zip(jobs, answers):
        if len(job) == 2:
            assert r.status_code == 200, r.text
            refs.check(job[0], job[1], r.json())
            continue
        what, _, status, param = job
        assert r.status_code == status, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param), (what, err)
        assert err["type"] == "invalid_request_error" and err["code"]
    # The server still answers correctly afterwards.
    with httpx.Client(base_url=served.url) as c:
        r = post(c, {"model": "qwen2_5_vl", "input": pool[:3]})
    refs.check("qwen2_5_vl", pool[:3], r.json())


def test_overload_answers_503_with_retry_after_and_recovers(servers, refs: References, pool):
    srv = servers["tight"].wait_ready()
    images = pool[5:8]

    async def burst() -> list:
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT, headers=AUTH,
                                     limits=httpx.Limits(max_connections=32)) as c:
            body = {"model": "qwen2_5_vl", "input": images}
            return await asyncio.gather(*(c.post("/v1/embeddings", json=body) for _ in range(32)))

    answers = asyncio.run(burst())
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
        else:
            refs.check("qwen2_5_vl", images, r.json())
    with httpx.Client(base_url=srv.url, headers=AUTH) as c:
        r = post(c, {"model": "qwen2_5_vl", "input": images})
    assert r.status_code == 200
    refs.check("qwen2_5_vl", images, r.json())


def test_the_serving_bench_client_measures_this_server(server, pool):
    """benches/serving.py's closed loop over HTTP and its /metrics deltas, against the running server."""
    from benches import serving

    args = serving.build_parser().parse_args(["--duration", "0.3", "--warmup", "0.05"])
    before = serving.server_counters(server.url)
    point = serving.run_server(server.url, pool[:4], 4, args)
    summary = serving.counter_summary(before, serving.server_counters(server.url))
    assert point["requests"] >= 4 and point["errors"] == 0 and point["p50_ms"] <= point["p99_ms"]
    assert summary["requests_per_call"] >= 1.0 and 0 <= summary["padded_share"] < 1
    assert set(summary["stage_ms"]) == set(STAGES) and all(v >= 0 for v in summary["stage_ms"].values())
    assert sum(summary["stage_ms"].values()) <= point["mean_ms"] * 1.5  # the server's share of the client's time


def _slow_request(server, pool) -> socket.socket:
    """A request whose body stops after its first bytes: in flight until the server gives up on it."""
    body = json.dumps({"input": [pool[0]]}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:20])
    return sock


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_sigterm_under_load(server, refs: References, pool):
    """Last use of ``main``: SIGTERM under load. The requests in flight finish (200) or get an error; one still
    reading its body at the graceful timeout (2 s) is answered 503 in JSON just before it."""
    stop = threading.Event()
    answered = threading.Semaphore(0)
    records: list[tuple[str, list[str], object]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        with httpx.Client(base_url=server.url) as c:
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                model = MODELS[int(rng.integers(2))]
                images = [pool[int(i)] for i in rng.choice(len(pool), int(rng.integers(1, 3)))]
                try:
                    outcome: object = post(c, {"model": model, "input": images})
                except httpx.HTTPError as exc:
                    outcome = exc
                with lock:
                    records.append((model, images, outcome))
                answered.release()
                if not isinstance(outcome, httpx.Response) or outcome.status_code != 200:
                    if stop.is_set():
                        return  # the server is going away: this client has seen its error
                    raise AssertionError(f"an error before SIGTERM: {outcome!r}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for _ in range(24):
        assert answered.acquire(timeout=TIMEOUT)
    slow = _slow_request(server, pool)
    time.sleep(0.3)  # it is in its handler, waiting for the rest of its body
    stop.set()
    t0 = time.monotonic()
    assert server.stop(timeout=30) == -signal.SIGTERM
    exit_s = time.monotonic() - t0
    status, answer = _read_answer(slow)
    assert status == 503 and answer["error"]["code"] == "shutting_down", answer
    assert "--graceful-timeout" in answer["error"]["message"]
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    ok = errors = 0
    for model, images, outcome in records:
        if isinstance(outcome, httpx.Response) and outcome.status_code == 200:
            refs.check(model, images, outcome.json())
            ok += 1
        else:
            assert isinstance(outcome, httpx.HTTPError) or outcome.status_code == 503, outcome
            errors += 1
    assert ok >= 24 and errors >= 1 and 1.4 < exit_s < 30, (ok, errors, exit_s)
