"""benches/lib/server_profile.py: py-spy's raw stacks grouped by what holds the server's GIL."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benches.lib import server_profile
from benches.lib.server_profile import GilProfile, group_of, summarize_raw

SERVER = 'process 100:"/venv/bin/python -m encgraph serve --model bench=/ck"'
WORKER = 'process 200:"/venv/bin/python -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=11)"'
T = "thread (7): MainThread"


def test_a_stack_goes_to_the_group_of_its_innermost_matching_frame():
    inside_serving = ["run (encgraph/cli/serve.py:1)", "_embeddings (encgraph/serving/app.py:5)",
                      "loads (json/__init__.py:346)", "decode (json/decoder.py:337)"]
    assert group_of(inside_serving) == "JSON"  # the leaf's group, not the caller's
    assert group_of(inside_serving[:2]) == "serving front and answers"
    assert group_of(["decode_image (encgraph/serving/images.py:9)", "b64decode (base64.py:88)"]) == "base64"
    assert group_of(["x (/usr/lib/python3.11/site-packages/PIL/ImageFile.py:425)"]) == "image decode (Pillow)"
    assert group_of(["plan (encgraph/packing/cost_pack.py:3)"]) == "runner: planning, replay, copies"
    assert group_of(["f (mylib/thing.py:1)"]) == "other"
    assert group_of([]) == "other"


def test_raw_lines_are_split_by_process_even_where_a_command_line_holds_a_semicolon():
    raw = "\n".join([
        f"{SERVER};{T};run (encgraph/cli/serve.py:1);b64decode (base64.py:88) 30",
        f"{SERVER};{T};run (encgraph/cli/serve.py:1);_run_once (asyncio/base_events.py:1) 10",
        f"{SERVER};{WORKER};prepare (encgraph/serving/preprocess_worker.py:3);resize (PIL/Image.py:2) 50",
        "not a sample line",
        "",
    ])
    out = summarize_raw(raw, rate=100, seconds=2, server_pid=100)
    assert out["samples"] == 40
    assert out["gil_held_share"] == 0.2  # 40 of 100 Hz x 2 s
    assert out["groups"] == {"base64": 0.75, "event loop (asyncio)": 0.25}
    assert out["workers_gil_share"] == 0.25  # the worker's 50 samples counted apart, not in the server's groups
    assert out["top_encgraph"] == {"run (encgraph/cli/serve.py)": 1.0}


def test_each_sample_names_the_innermost_encgraph_function_whatever_library_it_called():
    """``top_encgraph``: which of encgraph's functions held the GIL (lines merged, paths cut to the package), so
    that 'threads and queues' or 'torch' samples point at the caller in encgraph."""
    app = "/srv/repo/encgraph/serving/app.py"
    raw = "\n".join([
        f"{T};main (/srv/repo/encgraph/cli/serve.py:9);answer ({app}:251);dumps (/usr/lib/python3.12/json/__init__.py:231) 6",
        f"{T};answer ({app}:260);tolist (/venv/lib/python3.12/site-packages/torch/_tensor.py:1) 2",
        f"{T};submit (/srv/repo/encgraph/serving/front.py:80);notify (/usr/lib/python3.12/threading.py:400) 3",
        f"{T};_run_once (/usr/lib/python3.12/asyncio/base_events.py:1900) 1",
    ])
    out = summarize_raw(raw, rate=100, seconds=1, server_pid=1)
    assert out["top_encgraph"] == {"answer (encgraph/serving/app.py)": round(8 / 12, 3),
                                   "submit (encgraph/serving/front.py)": 0.25, "(no encgraph frame)": round(1 / 12, 3)}
    assert out["groups"]["JSON"] == 0.5 and out["groups"]["threads and queues"] == 0.25
    assert server_profile.frame_name("get (/usr/lib/python3.12/queue.py:171)") == "get (queue.py)"
    assert server_profile.frame_name("not a frame") == "not a frame"


def test_one_process_recorded_without_subprocesses_has_no_process_prefix():
    out = summarize_raw(f"{T};loads (json/__init__.py:346) 5\n", rate=10, seconds=1, server_pid=1)
    assert out == {"rate_hz": 10, "seconds": 1, "samples": 5, "gil_held_share": 0.5, "groups": {"JSON": 1.0},
                   "top_encgraph": {"(no encgraph frame)": 1.0}, "workers_gil_share": 0.0}
    assert summarize_raw("", rate=10, seconds=1, server_pid=1)["groups"] == {}


def test_without_py_spy_the_profile_says_why(monkeypatch):
    monkeypatch.setattr(server_profile.shutil, "which", lambda name: None)
    assert GilProfile(pid=1, seconds=1).result() == {"skipped": "py-spy is not on PATH (pip install py-spy)"}


def test_the_serving_table_says_what_held_the_gil_or_why_no_profile_was_taken():
    from benches.lib.serving_report import _profile_line

    line = _profile_line("defaults", "32", {"rate_hz": 200, "seconds": 4, "samples": 640, "gil_held_share": 0.8,
                                            "groups": {"base64": 0.5, "JSON": 0.49, "metrics": 0.01},
                                            "workers_gil_share": 1.5})
    assert "at least 80% of the time" in line and "1.50 GILs busy on average" in line
    assert "base64 50%, JSON 49%" in line and "metrics" not in line  # groups under 2% left out
    assert "innermost function" not in line  # a profile of before top_encgraph renders as it did
    line = _profile_line("defaults", "32", {"rate_hz": 200, "seconds": 4, "samples": 640, "gil_held_share": 0.8,
                                            "groups": {"JSON": 1.0}, "workers_gil_share": 0.0,
                                            "top_encgraph": {"answer (encgraph/serving/app.py)": 0.9, "x (y)": 0.01}})
    assert line.endswith("encgraph's innermost function in them: answer (encgraph/serving/app.py) 90%.")
    assert "not taken (py-spy is not on PATH" in _profile_line("defaults", "32", {"skipped": "py-spy is not on PATH"})


def test_profiling_without_a_server_transport_is_refused(capsys):
    import pytest

    from benches.serving import main

    with pytest.raises(SystemExit):
        main(["--cpu-smoke", "--transports", "inprocess", "--profile", "defaults"])
    assert "--profile defaults: profiles a server; add server to --transports (got inprocess)" in capsys.readouterr().err
