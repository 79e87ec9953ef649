"""``encgraph serve --ray``'s parts that need no cluster: the deployments' options (a fixed count, or autoscaling on
the requests a replica holds; one GPU per replica on CUDA), the in-process ASGI call a replica answers with, the
gateway's answers (API key first, body limits, a retry when a replica died, a JSON 503 when none answers), the
replicas' command line per cluster, and that importing the module does not import Ray."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from encgraph.cli import build_parser, serve_ray  # noqa: E402
from encgraph.cli._common import UsageError  # noqa: E402
from encgraph.errors import ConfigError  # noqa: E402
from encgraph.serving.admission import InFlightLimits  # noqa: E402
from encgraph.serving.protocol import ServerLimits  # noqa: E402
from encgraph.serving.ray_app import REPLICA_HEADER, Answer, Forwarded, Gateway, RaySettings, call_app  # noqa: E402


def test_importing_the_ray_module_does_not_import_ray():
    code = "import sys, encgraph.serving.ray_app, encgraph.cli.serve_ray; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_a_fixed_count_or_autoscaling_on_queue_depth():
    fixed = RaySettings(replicas=2, gpus=1.0).replica_options()
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_gpus": 1.0, "num_cpus": 1.0}
    scaled = RaySettings(replicas=2, max_replicas=8, target_ongoing_requests=24, max_ongoing_requests=256)
    options = scaled.replica_options()
    assert "num_replicas" not in options and options["max_ongoing_requests"] == 256
    assert options["autoscaling_config"] == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 8,
                                             "target_ongoing_requests": 24}
    assert RaySettings().gateway_options()["ray_actor_options"] == {"num_cpus": 0}
    with pytest.raises(ConfigError, match="max_replicas: expected at least replicas"):
        RaySettings(replicas=4, max_replicas=2)
    with pytest.raises(ValueError, match="replicas: expected a positive number, got 0"):
        RaySettings(replicas=0)


def _echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "q": request.url.query,
                             "h": request.headers.get("x-test")}, headers={"x-out": "1"})

    return app


def test_call_app_answers_in_process():
    request = Forwarded("POST", "/echo", b"a=1", ((b"x-test", b"yes"),), b"hello")
    answer = asyncio.run(call_app(_echo_app(), request))
    assert answer.status == 200 and (b"x-out", b"1") in answer.headers
    assert answer.body == b'{"body":"hello","q":"a=1","h":"yes"}'
    missing = asyncio.run(call_app(_echo_app(), Forwarded("GET", "/nope", b"", (), b"")))
    assert missing.status == 404


class _Replicas:
    """A deployment handle's stand-in: ``forward.remote`` gives each outcome in turn (an answer or an error)."""

    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), 0
        self.forward = argparse.Namespace(remote=self._remote)

    def _remote(self, request):
        self.calls += 1
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]

        async def answer():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return answer()


OK = Answer(200, ((b"content-type", b"application/json"), (REPLICA_HEADER, b"r1")), b'{"ok":true}')
LIMITS = ServerLimits(max_body_bytes=1000, in_flight=InFlightLimits(max_body_bytes=4000))


async def _post(gateway, path="/v1/embeddings", **kwargs):
    transport = httpx.ASGITransport(app=gateway.__serve_build_asgi_app__())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post(path, **kwargs)


def test_a_request_whose_replica_died_is_retried_on_another():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    replicas = _Replicas(ray_exceptions.ActorDiedError(), OK)
    r = asyncio.run(_post(Gateway(replicas, LIMITS, RaySettings()), content=b'{"input": []}'))
    assert r.status_code == 200 and r.json() == {"ok": True} and replicas.calls == 2
    assert r.headers["x-encgraph-replica"] == "r1" and r.headers["x-encgraph-retried"] == "1"


def test_when_no_replica_answers_in_time_the_answer_is_a_json_503():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    replicas = _Replicas(ray_exceptions.ActorDiedError())
    r = asyncio.run(_post(Gateway(replicas, LIMITS, RaySettings(retry_s=0.2)), content=b"{}"))
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and replicas.calls >= 2
    error = r.json()["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error", error
    assert "ActorDiedError" in error["message"]


def test_rays_back_pressure_is_the_servers_overloaded_503():
    serve_exceptions = pytest.importorskip("ray.serve.exceptions")
    replicas = _Replicas(serve_exceptions.BackPressureError(num_queued_requests=9, max_queued_requests=8))
    r = asyncio.run(_post(Gateway(replicas, LIMITS, RaySettings()), content=b"{}"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"


def test_a_replica_that_fails_otherwise_is_a_json_500():
    pytest.importorskip("ray")
    r = asyncio.run(_post(Gateway(_Replicas(RuntimeError("boom")), LIMITS, RaySettings()), content=b"{}"))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


def test_the_gateway_checks_the_key_and_the_body_before_any_replica_sees_the_request():
    pytest.importorskip("ray")
    replicas = _Replicas(OK)
    gateway = Gateway(replicas, LIMITS, RaySettings(), api_key="k1")
    r = asyncio.run(_post(gateway, content=b"{}"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = asyncio.run(_post(gateway, content=b"x" * 1001, headers={"Authorization": "Bearer k1"}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert replicas.calls == 0
    r = asyncio.run(_post(gateway, content=b"{}", headers={"Authorization": "Bearer k1"}))
    assert r.status_code == 200 and replicas.calls == 1


def _args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", "--ray", *argv])
    args.resolved_api_key = "secret"
    return args


def test_the_replicas_command_line_per_cluster():
    replica, settings = serve_ray.plan(_args(), cluster_gpus=0)
    assert (replica.device, settings.gpus, settings.replicas) == ("cpu", 0.0, 1)
    assert replica.resolved_api_key is None  # the gateway checks the key; the replicas never see it
    # Embedded models stay on the CPU (as encgraph serve); checkpoints take one GPU per replica, one replica per GPU.
    assert serve_ray.plan(_args(), cluster_gpus=8)[1].gpus == 0.0
    args = _args("--max-queue", "64")
    args.model = [(None, "/ckpt")]
    replica, settings = serve_ray.plan(args, cluster_gpus=8)
    assert (replica.device, settings.gpus, settings.replicas, settings.max_ongoing_requests) == ("cuda", 1.0, 8, 64)
    args = _args("--replicas", "2", "--max-replicas", "6", "--target-ongoing-requests", "8", "--device", "cuda")
    settings = serve_ray.plan(args, cluster_gpus=2)[1]
    assert settings.replica_options()["autoscaling_config"]["max_replicas"] == 6
    for argv, gpus, words in ((("--device", "cuda:1"), 2, "use --device cuda"),
                              (("--device", "cuda"), 0, "the Ray cluster has no GPU"),
                              (("--max-replicas", "2"), 4, "expected at least the replicas started (4)")):
        args = _args(*argv)
        args.model = [(None, "/ckpt")]
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            serve_ray.plan(args, cluster_gpus=gpus)
