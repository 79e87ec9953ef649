"""``benches/serving.py`` on the CPU: ``--help`` as a script, the in-process path in smoke mode (tiny towers,
short points), and its summary and target helpers on known numbers. Its HTTP client runs against the integration
tests' server (tests/integration/test_serve.py), so that no extra server starts for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from benches import serving  # noqa: E402
from benches.lib.load import Run, closed_loop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["--cpu-smoke", "--concurrency", "2", "--duration", "0.2", "--warmup", "0.05"]


def test_help_runs_as_a_script():
    done = subprocess.run([sys.executable, str(REPO / "benches" / "serving.py"), "--help"], capture_output=True,
                          text=True, timeout=60, cwd="/", check=False)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_inprocess_smoke_writes_every_point(tmp_path):
    data = serving.main(SMOKE + ["--transports", "inprocess", "--results-dir", str(tmp_path)])
    written = json.loads((tmp_path / "serving_cpu-smoke_inprocess.json").read_text())
    assert written["towers"].keys() == data["towers"].keys() == set(serving.TOWERS)
    for tower in written["towers"].values():
        result = tower["inprocess"]
        assert result["capture"]["mode"] == "eager"  # the runner's CPU default
        assert set(result["points"]) == set(serving.SYSTEMS)
        for system, by_c in result["points"].items():
            assert set(by_c) == {"2"}
            for p in by_c.values():
                assert p["requests"] >= 1 and p["errors"] == 0 and p["images_per_s"] > 0
                assert p["p50_ms"] <= p["p99_ms"]
                if system in ("hf_eager", "graphed_per_request"):
                    assert p["requests_per_call"] == 1.0
                if system != "hf_eager":
                    assert 0 <= p["padded_share"] < 1
    table = (tmp_path / "serving_cpu-smoke_inprocess.md").read_text()
    assert "| 2 | graphed_coalesce |" in table and "Qwen2.5-VL-7B tower, inprocess" in table


def test_the_window_times_requests_sent_in_it_and_counts_those_answered_in_it():
    # A slow request sent during the warm-up (0.0 -> 2.5) is answered in the window: it counts towards images/s
    # but not towards the latencies, which are the three sent at or after start=1.0.
    run = Run(((0.0, 0.5), (0.0, 2.5), (1.0, 1.1), (1.5, 1.6), (2.0, 3.0)), start=1.0)
    w = serving.window([run])
    assert w["requests"] == 3 and w["images"] == 4 and w["seconds"] == 2.0 and w["images_per_s"] == 2.0
    assert w["p99_ms"] == pytest.approx(1000.0) and w["p50_ms"] == pytest.approx(100.0)
    assert w["mean_ms"] == pytest.approx(400.0) and w["errors"] == 0 and "runs" not in w
    assert serving.window([Run(((0.0, 0.5),), start=1.0)]) == {"requests": 0, "images_per_s": 0.0, "errors": 0}


def test_every_client_times_a_request_even_when_requests_outlast_the_window():
    # Each request (0.15 s) outlasts warm-up + window (0.02 + 0.05 s): without the rule every client's only request
    # is sent in the warm-up and the point has no latency; with it each client sends one more, in the window.
    import time

    run = closed_loop(lambda k: time.sleep(0.15), concurrency=3, warmup=0.02, duration=0.05)
    timed = [(t0, t1) for t0, t1 in run.spans if t0 >= run.start]
    assert len(timed) == 3 and len(run.spans) == 6 and not run.errors
    assert serving.window([run])["requests"] == 3


def test_a_points_runs_pool_their_latencies_answers_and_seconds():
    a = Run(((10.0, 10.1), (10.1, 10.3)), start=10.0)  # 2 answers in 0.3 s
    b = Run(((20.0, 20.5),), start=20.0, errors=("503: overloaded",))  # 1 answer in 0.5 s, one client failed
    w = serving.window([a, b])
    assert w["requests"] == 3 and w["images"] == 3 and w["seconds"] == pytest.approx(0.8)
    assert w["images_per_s"] == pytest.approx(3 / 0.8, rel=1e-3) and w["p99_ms"] == pytest.approx(500.0)
    assert w["errors"] == 1 and w["first_error"] == "503: overloaded"
    assert [r["p99_ms"] for r in w["runs"]] == [pytest.approx(200.0), pytest.approx(500.0)]


def test_repeated_points_interleave_the_systems_and_pool_their_runs(tmp_path, capsys):
    data = serving.main(SMOKE + ["--transports", "inprocess", "--towers", "siglip_so400m_384", "--repeats", "2",
                                 "--systems", "graphed_per_request,graphed_coalesce", "--results-dir", str(tmp_path)])
    points = data["towers"]["siglip_so400m_384"]["inprocess"]["points"]
    for system in ("graphed_per_request", "graphed_coalesce"):
        p = points[system]["2"]
        assert len(p["runs"]) == 2 and p["requests"] >= 2 and p["errors"] == 0
    t = data["towers"]["siglip_so400m_384"]["inprocess"]["targets"]
    assert t["coalesce_p99_not_worse_runs"] in {"0 of 2", "1 of 2", "2 of 2"}
    order = [line.split()[3] for line in capsys.readouterr().err.splitlines() if line.startswith("[serving] siglip")
             and " x2 " in line]
    # Round 1 in the given order, round 2 rotated by one.
    assert order == ["graphed_per_request", "graphed_coalesce", "graphed_coalesce", "graphed_per_request"], order
    assert "2 runs per point" in (tmp_path / "serving_cpu-smoke_inprocess.md").read_text()


def test_summary_and_targets():
    s = serving.summarize([0.001 * i for i in range(1, 101)], 100, 2.0)
    assert s["images_per_s"] == 50.0 and s["p50_ms"] == pytest.approx(51.0) and s["p99_ms"] == pytest.approx(100.0)
    assert serving.summarize([], 0, 1.0)["requests"] == 0
    point = lambda ips, p99: {"requests": 10, "images_per_s": ips, "p99_ms": p99}  # noqa: E731
    points = {"hf_eager": {"8": point(10, 50), "32": point(10, 400), "128": point(10, 900)},
              "graphed_per_request": {"8": point(40, 20), "32": point(40, 90), "128": point(40, 300)},
              "graphed_coalesce": {"8": point(60, 15), "32": point(35, 80), "128": point(200, 100)}}
    t = serving.targets(points)
    assert t == {"clients": 32, "coalesce_vs_hf_eager_images_per_s": 3.5, "coalesce_3x_hf_eager": True,
                 "coalesce_p99_not_worse_than_per_request": True}
    t = serving.targets({**points, "defaults": {"8": point(50, 18), "32": point(45, 100)}})
    assert t["defaults_vs_hf_eager_images_per_s"] == 4.5 and t["defaults_p99_not_worse_than_per_request"] is False
    assert "defaults (no options) / hf_eager images/s = 4.5" in serving.render(
        {"environment": {"gpu": "x", "torch": "t", "transformers": "f"},
         "options": {"duration": 1, "warmup": 0, "max_wait_ms": 2.0},
         "towers": {"siglip_so400m_384": {"server": {"points": {}, "targets": t}}}})



def test_a_run_of_hf_eager_and_defaults_only_states_only_what_it_measured():
    """A run of hf_eager and defaults alone (a profile run): no line about graphed_coalesce, no P99 comparison
    with a system not in the run."""
    point = lambda ips, p99: {"requests": 10, "images_per_s": ips, "p99_ms": p99}
    t = serving.targets({"hf_eager": {"32": point(10, 400)}, "defaults": {"32": point(55, 170)}})
    text = serving.render(
        {"environment": {"gpu": "x", "torch": "t", "transformers": "f"},
         "options": {"duration": 1, "warmup": 0, "max_wait_ms": 2.0},
         "towers": {"siglip_so400m_384": {"server": {"points": {}, "targets": t}}}})
    assert "defaults (no options) / hf_eager images/s = 5.5." in text
    assert "None" not in text and "graphed_coalesce /" not in text and "graphed_per_request" not in text

def test_a_servers_eager_items_are_read_and_flagged(monkeypatch):
    """A graphed server that ran items eagerly (its cost model said the tower's own forward was faster) measured
    the wrong thing: the point says how many items, by reason, and the table says which point."""
    import httpx

    from benches.lib import serving_http

    text = "\n".join([
        "# TYPE encgraph_runner_items counter",
        'encgraph_runner_items_total{model="m",kind="graph"} 5.0',
        'encgraph_runner_items_total{model="m",kind="eager"} 3.0',
        "# TYPE encgraph_eager_items counter",
        'encgraph_eager_items_total{model="m",reason="eager is cheaper"} 2.0',
        'encgraph_eager_items_total{model="m",reason="tokens over the largest budget"} 1.0',
        "# TYPE encgraph_front_calls counter",
        'encgraph_front_calls_total{model="m"} 4.0', ""])
    monkeypatch.setattr(httpx, "get", lambda url, timeout: type("R", (), {"text": text})())
    after = serving_http.server_counters("http://x")
    assert after["graph_items"] == 5 and after["eager_items"] == 3 and after["calls"] == 4
    before = {**after, "eager_items": 1.0, "eager:eager is cheaper": 0.0, "eager:tokens over the largest budget": 1.0}
    summary = serving_http.counter_summary(before, after)
    assert summary["eager_items"] == 2 and summary["eager_reasons"] == {"eager is cheaper": 2}
    point = {"requests": 10, "images_per_s": 50.0, "p50_ms": 10.0, "p99_ms": 20.0, "requests_per_call": 1.0,
             "padded_share": 0.0, "eager_items": 2, "eager_reasons": {"eager is cheaper": 2}}
    clean = {**point, "eager_items": 0, "eager_reasons": {}}
    text = serving.render({"environment": {"gpu": "x", "torch": "t", "transformers": "f"},
                           "options": {"duration": 1, "warmup": 0, "max_wait_ms": 2.0},
                           "towers": {"siglip_so400m_384": {"server": {"points": {
                               "hf_eager": {"8": {**point, "eager_items": 9}},
                               "graphed_per_request": {"8": point, "32": clean}}}}}})
    assert ("Items that a graphed system ran eagerly (the tower's own forward): graphed_per_request x8: 2 "
            "(eager is cheaper: 2).") in text


def test_preprocess_pool_bench_runs_both_modes(tmp_path):
    """``benches/preprocess_pool.py`` end to end, short: each mode in its own process, one worker, fewer slots than
    clients; the pipe mode sends some pixels through the pipe, the shipped one none."""
    from benches import preprocess_pool

    data = preprocess_pool.main(["--workers", "1", "--slots", "1", "--clients", "4", "--seconds", "0.5",
                                 "--repeats", "1", "--size", "64", "--results-dir", str(tmp_path)])
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"wait", "pipe"} and all(r["requests"] > 0 for r in runs.values())
    assert runs["wait"]["pipe_results"] == 0 and runs["pipe"]["pipe_results"] > 0
    assert "| wait | 1 |" in (tmp_path / "preprocess_pool_cpu.md").read_text()
    assert json.loads((tmp_path / "preprocess_pool_cpu.json").read_text())["options"]["slots"] == 1


def test_server_requests_ask_for_the_chosen_encoding_format():
    from benches.lib.serving_http import server_bodies

    assert serving.build_parser().parse_args([]).encoding_format == "base64"
    args = serving.build_parser().parse_args(["--encoding-format", "float"])
    bodies = [json.loads(b) for b in server_bodies(["a", "b"], args.encoding_format)]
    assert bodies == [{"input": ["a"], "encoding_format": "float"}, {"input": ["b"], "encoding_format": "float"}]
    assert json.loads(server_bodies(["a"])[0])["encoding_format"] == "base64"
    with pytest.raises(SystemExit):
        serving.build_parser().parse_args(["--encoding-format", "json"])
