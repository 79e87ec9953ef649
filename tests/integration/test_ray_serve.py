"""``encgraph serve --ray`` on a real local Ray cluster that this test starts (its own temporary directory and token,
on 127.0.0.1): two replicas of the embedded towers behind Ray's HTTP proxy, with encgraph serve's paths, API key and
error shapes; concurrent HTTP clients; a replica killed with SIGKILL mid-load while it holds requests (every answered
request equals the tower's own embedding, the others are JSON 503s, none hangs; the counts are printed: ``-rP``);
Ray replaces it; SIGTERM stops the command, and after ``serve.shutdown()`` and ``ray.shutdown()`` no process of the
cluster is left.

Skipped without ``ray[serve]`` (the ``[ray]`` extra: .ci/run installs it in a step of its own).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tests.integration.conftest import API_KEY, AUTH, LIMITS, REPO, References, free_port, httpx  # noqa: E402

START_TIMEOUT = 120.0
TIMEOUT = 60.0
CLIENTS = 16
PER_CLIENT = 12
MAX_WAIT_MS = "100"
"""Each replica's fronts wait this long for more requests: every request stays in its replica at least that long, so
that the replica killed mid-load holds requests in flight (the retries and 503s the test counts)."""
MODELS = ("siglip", "qwen2_5_vl")


def _processes_of(marker: str) -> list[int]:
    """PIDs of the live processes whose command line names ``marker`` (the cluster's temporary directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                out.append(int(entry.name))
    return out


def _descendants(pid: int) -> set[int]:
    """The live descendants of ``pid`` (from /proc: a parent's children, recursively)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _replicas() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#EncgraphReplica#" in a["name"])


def _pid(name: str) -> int:
    """The process id of a replica actor (run in the actor: ``__ray_call__``)."""
    return int(ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(lambda self: os.getpid()),
                       timeout=TIMEOUT))


def _busy_replica(names: list[str], timeout: float = 20.0) -> tuple[str, int]:
    """The first replica seen holding at least three requests, and how many: the one to kill, so that the kill hits
    requests in flight. Asked through the replica actor's ``get_num_ongoing_requests``, the probe Ray's own router
    sends (not public API: a test-only dependency on Ray 2.60's replica actor)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in names:
            actor = ray.get_actor(name, namespace="serve")
            ongoing = int(ray.get(actor.get_num_ongoing_requests.remote(), timeout=timeout))
            if ongoing >= 3 or time.monotonic() > deadline:
                return name, ongoing


@pytest.fixture
def cluster(monkeypatch):
    """A local Ray instance on 127.0.0.1 in a short temporary directory (Ray's socket paths are length-limited);
    stopped, and checked gone, at the end. Token authentication off, explicitly: Ray 2.5x turns it on for a new
    local instance and writes a token to ~/.ray, which a test must not touch (the instance is loopback-only and
    lives for one test)."""
    tmp = tempfile.mkdtemp(prefix="egray-", dir="/tmp")
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, _node_ip_address="127.0.0.1",
             logging_level="ERROR", log_to_driver=False)
    mine: set[int] = set()
    try:
        yield ray.get_runtime_context().gcs_address, env
    finally:
        mine = _descendants(os.getpid())
        serve.shutdown()
        ray.shutdown()
        deadline = time.monotonic() + 30
        while (_alive(mine) or _processes_of(tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(_alive(mine) | set(_processes_of(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes left after ray.shutdown(): {left}"


def test_two_replicas_behind_rays_proxy_survive_a_killed_replica(cluster, pool, refs: References):
    address, ray_env = cluster
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", ENCGRAPH_API_KEY=API_KEY, **ray_env)
    log = tempfile.TemporaryFile()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "encgraph", "serve", "--ray", "--address", address, "--replicas", "2",
         "--port", str(port), "--threads", "1", "--graceful-timeout", "5", "--max-wait-ms", MAX_WAIT_MS, *LIMITS],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )

    def output() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    try:
        while "encgraph serve: http://" not in output():
            assert proc.poll() is None, f"encgraph serve --ray exited with {proc.returncode}:\n{output()}"
            assert time.monotonic() - started < START_TIMEOUT, f"no start in {START_TIMEOUT} s:\n{output()}"
            time.sleep(0.2)
        start_s = time.monotonic() - started
        assert "2 replicas of siglip, qwen2_5_vl, on the CPU each; API key: /v1/*" in output(), output()
        first = _replicas()
        assert len(first) == 2, first
        pids = {name: _pid(name) for name in first}

        # The contract of encgraph serve, through Ray's proxy: paths, API key, error shapes.
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            health = client.get("/health")
            assert health.status_code == 200 and set(health.json()["models"]) == set(MODELS), health.text
            assert health.headers["x-encgraph-replica"] in " ".join(first)
            assert client.get("/metrics").text.startswith("# HELP")
            denied = client.post("/v1/embeddings", json={"input": pool[:1]})
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.headers["www-authenticate"] == "Bearer"
            bad = client.post("/v1/embeddings", json={"input": ["not an image"]}, headers=AUTH)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0]", bad.text
            many = client.post("/v1/embeddings", json={"input": pool[:1] * 9}, headers=AUTH)
            assert many.status_code == 413 and many.json()["error"]["code"] == "too_many_images", many.text
            assert client.get("/nope").json()["error"]["code"] == "not_found"

        # Concurrent clients; one replica killed once a few answers are in.
        rng = np.random.default_rng(7)
        plans = [[(MODELS[(c + k) % 2], [pool[int(i)] for i in rng.choice(len(pool), int(rng.integers(1, 3)))])
                  for k in range(PER_CLIENT)] for c in range(CLIENTS)]
        for model, images in (p for plan in plans for p in plan):
            for text in images:
                refs.of(model, text)
        answered = threading.Semaphore(0)

        def client_run(plan):
            out = []
            with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as c:
                for model, images in plan:
                    try:
                        r = c.post("/v1/embeddings", json={"model": model, "input": images})
                        out.append((model, images, r.status_code, r.headers, r.json()))
                    except httpx.HTTPError as exc:  # a dropped connection: counted, and failed below
                        out.append((model, images, None, {}, repr(exc)))
                    answered.release()
            return out

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            futures = [ex.submit(client_run, p) for p in plans]
            for _ in range(2 * CLIENTS):
                assert answered.acquire(timeout=TIMEOUT)
            victim, ongoing = _busy_replica(first)
            os.kill(pids[victim], signal.SIGKILL)  # a crash: no goodbye to Ray
            killed_at = time.monotonic() - t0
            results = [a for f in futures for a in f.result(timeout=3 * TIMEOUT)]
        load_s = time.monotonic() - t0

        counts = {"requests": len(results), "answered": 0, "retried": 0, "503": 0, "wrong": 0, "other": 0}
        by_replica: dict[str, int] = {}
        for model, images, status, headers, body in results:
            if status == 200:
                counts["answered"] += 1
                by_replica[headers["x-encgraph-replica"]] = by_replica.get(headers["x-encgraph-replica"], 0) + 1
                counts["retried"] += "x-encgraph-retried" in headers
                try:
                    refs.check(model, images, body)
                except AssertionError:
                    counts["wrong"] += 1
            elif status == 503 and body["error"]["code"] in ("replica_unavailable", "overloaded"):
                counts["503"] += 1
                assert headers["retry-after"]
            else:
                counts["other"] += 1
        note = (f"start {start_s:.1f} s; {counts} in {load_s:.1f} s; replica {victim} killed (SIGKILL) at "
                f"{killed_at:.1f} s holding {ongoing} requests; answers by replica {by_replica}")
        print(f"\nencgraph serve --ray: {note}")
        assert counts["requests"] == CLIENTS * PER_CLIENT, note
        assert counts["wrong"] == 0 and counts["other"] == 0, note
        assert counts["answered"] + counts["503"] == counts["requests"], note
        assert counts["answered"] > 2 * CLIENTS, note  # the survivor kept answering after the kill
        assert counts["retried"] + counts["503"] > 0, note  # the kill hit requests in flight

        # Ray replaces the killed replica.
        deadline = time.monotonic() + TIMEOUT
        while not (len(_replicas()) == 2 and victim not in _replicas()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_replicas()) == 2 and victim not in _replicas(), _replicas()
        with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as client:
            r = client.post("/v1/embeddings", json={"model": "qwen2_5_vl", "input": pool[:2]})
            assert r.status_code == 200, r.text
            refs.check("qwen2_5_vl", pool[:2], r.json())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"encgraph serve --ray did not exit within {TIMEOUT} s of SIGTERM:\n{output()}")
    assert code == 0, output()
    assert not _replicas(), "the command's SIGTERM left replicas deployed"
