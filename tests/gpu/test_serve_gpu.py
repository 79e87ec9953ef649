"""``encgraph serve`` on a GPU, as a subprocess on loopback: the embedded towers on CUDA in float32 (graphs
captured at start-up), images decoded and preprocessed in 2 worker processes (pixels back through shared-memory
slots, then uploaded on the app's upload threads through their side streams), each answer waiting for its own
host copy on the app's answer threads. 32 clients at once, two requests each, both models, float and base64,
with and without token sequences: every embedding and token sequence equals the same tower's own forward on the
CPU on the same pixels, and requests shared runner calls.

What the CPU suite's ``tests/integration`` cannot show: the CUDA side of the server (captured replays, the
stream-ordered copies up and down, several requests' uploads in flight while the worker replays).
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.integration.conftest import MODELS, References, Server, encode, httpx, random_image  # noqa: E402

CLIENTS = 32
TIMEOUT = 120.0
TOL = 1e-3
"""float32 replays on the GPU against the CPU forward: only the summation order differs (a request given another
request's rows, or rows of a stale buffer, is off by O(1))."""


def _coalesced(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "encgraph_coalesced_requests_total")


def test_served_on_cuda_each_request_gets_the_towers_own_embedding():
    refs = References()
    rng = np.random.default_rng(11)
    sizes = [(56, 56), (90, 70), (40, 120), (100, 84), (33, 47), (112, 84), (64, 120), (96, 96)]
    pool = [encode(random_image(rng, w, h), "PNG" if i % 2 else "JPEG", data_uri=i % 3 == 0)
            for i, (w, h) in enumerate(sizes)]
    plans = [[(MODELS[(c + k) % 2], [pool[int(i)] for i in rng.choice(len(pool), int(rng.integers(1, 4)))],
               "base64" if (c + k) % 3 else "float", bool((c + k) % 2)) for k in range(2)] for c in range(CLIENTS)]
    for model, images, _, _ in (p for plan in plans for p in plan):
        for text in images:
            refs.of(model, text)  # computed up front: the clients' threads only talk and compare
    server = Server("--device", "cuda", "--dtype", "float32", "--preprocess-workers", "2").wait_ready()
    try:
        health = httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()
        assert all(m["device"].startswith("cuda") and m["preprocess_workers"] == 2
                   for m in health["models"].values()), health
        before = _coalesced(server.url)
        barrier = threading.Barrier(CLIENTS)

        def client(plan):
            out = []
            with httpx.Client(base_url=server.url) as c:
                barrier.wait(TIMEOUT)
                for model, images, fmt, tokens in plan:
                    body = {"model": model, "input": images, "encoding_format": fmt, "return_tokens": tokens}
                    out.append((model, images, tokens, c.post("/v1/embeddings", json=body, timeout=TIMEOUT)))
            return out

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            answers = [a for f in [ex.submit(client, p) for p in plans] for a in f.result(TIMEOUT * 2)]
        assert len(answers) == 2 * CLIENTS
        for model, images, tokens, r in answers:
            assert r.status_code == 200, r.text
            refs.check(model, images, r.json(), tokens=tokens, tol=TOL)
        assert _coalesced(server.url) > before  # 32 clients at once: requests shared runner calls
    finally:
        code = server.stop()
    assert code == -signal.SIGTERM, server.output()
