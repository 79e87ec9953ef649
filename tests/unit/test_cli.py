"""The ``encgraph`` command line on the CPU: ``plan`` and ``demo`` through ``encgraph.cli.main`` (stdout captured)
and through ``python -m encgraph``; exit codes 0 / 1 / 2 with one-line errors."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from encgraph.cli import main
from encgraph.cli.geometry import TOWERS, smart_resize
from encgraph.packing import Plan

ROOT = Path(__file__).resolve().parents[2]

# Five items for the Qwen2.5-VL geometry (factor 28): tokens 391, 999, 192 (a 2-frame video), 77, 2500.
ITEMS = "640x480\n1024x768\n# a comment, then a blank line\n\n2,16,24\n{\"width\": 300, \"height\": 200}\n{\"grid\": [1, 100, 100]}\n"


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code, err, *words):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


# ------------------------------------------------------------------------------------------- plan


def test_plan_numbers_for_known_items(capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--budgets", "1024,256,512"], capsys, ITEMS, monkeypatch)
    assert code == 0, err
    assert "ladder: 256, 512, 1024 tokens; at most 16 items and 32 frames per batch" in out
    assert "items: 5 (4 images, 1 video), 4159 tokens" in out
    # item rows: index, tokens, frames, grid, size (resized by the processor rule)
    assert re.search(r"0\s+391\s+1\s+1,34,46\s+640x480 -> 644x476", out)
    assert re.search(r"1\s+999\s+1\s+1,54,74\s+1024x768 -> 1036x756", out)
    assert re.search(r"2\s+192\s+2\s+2,16,24\s+grid 2,16,24", out)
    assert re.search(r"3\s+77\s+1\s+1,14,22\s+300x200 -> 308x196", out)
    # batches: ascending tokens, next-fit under the largest budget
    assert re.search(r"0\s+1024\s+660\s+364\s+4\s+3, 2, 0\n", out)
    assert re.search(r"1\s+1024\s+999\s+25\s+1\s+1\n", out)
    assert re.search(r"2\s+eager\s+2500\s+-\s+1\s+4\s+\(tokens over the largest budget\)", out)
    assert "padded share: 8.6% (389 padding of 4548 tokens computed)" in out
    assert "eager items: 1 (4 [grid 1,100,100]: tokens over the largest budget)" in out


def test_plan_json_round_trips(capsys, monkeypatch, tmp_path):
    path = tmp_path / "sizes.txt"
    path.write_text(ITEMS)
    code, out, err = run_cli(["plan", str(path), "--budgets", "256,512,1024", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["tower"]["name"] == "qwen2_5_vl" and data["tower"]["patch_size"] == 14
    assert [it["tokens"] for it in data["items"]] == [391, 999, 192, 77, 2500]
    assert data["items"][0]["source"] == f"{path}:1" and data["items"][2]["source"] == f"{path}:5"
    plan = Plan.from_dict(data["plan"])
    assert [(b.items, b.budgets["default"]) for b in plan.batches] == [((3, 2, 0), 1024), ((1,), 1024), ((4,), None)]
    totals = data["plan"]["totals"]["default"]
    assert (totals["real_tokens"], totals["padded_tokens"], totals["eager_items"]) == (4159, 389, 1)
    assert data["plan"]["eager_items"] == [{"item": 4, "path": "default", "reason": "TOKENS", "why": "tokens over the largest budget"}]


def test_plan_default_ladder_limits_and_qwen3_geometry(capsys, monkeypatch):
    code, out, _ = run_cli(["plan", "--tower", "qwen3_vl", "--json"], capsys, "640x480\n10x10\n", monkeypatch)
    assert code == 0
    data = json.loads(out)
    # The runner's default ladder for the tower: the dense one (test_plan_defaults_match_the_qwen_adapter)
    assert data["plan"]["ladders"]["default"] == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1088, 1280,
                                                  1536, 1856, 2240, 2688, 3200, 3840, 4096]
    assert data["plan"]["limits"] == {"max_items": 16, "max_frames": 32}
    # Qwen3-VL: multiples of 32 px, at least 65536 pixels -> 10x10 becomes 256x256 (8x8 tokens)
    assert data["items"][0]["resized"] == [640, 480] and data["items"][0]["tokens"] == 300
    assert data["items"][1]["resized"] == [256, 256] and data["items"][1]["tokens"] == 64
    code, out, _ = run_cli(
        ["plan", "--min-budget", "100", "--max-budget", "300", "--max-items", "2", "--max-frames", "3",
         "--max-pixels", "200000", "--json"],
        capsys, "4000x3000\n", monkeypatch,
    )
    data = json.loads(out)
    assert data["plan"]["ladders"]["default"] == [100, 200, 300]
    assert data["plan"]["limits"] == {"max_items": 2, "max_frames": 3}
    assert data["items"][0]["resized"] == [504, 364]  # scaled down under --max-pixels


def test_plan_defaults_match_the_qwen_adapter():
    pytest.importorskip("transformers")
    import torch
    from transformers import Qwen2_5_VLVisionConfig

    from encgraph.cli import plan as plan_cmd
    from encgraph.models.qwen2_5_vl import adapter as make_adapter

    tower_cls = __import__("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", fromlist=["x"])
    tower = tower_cls.Qwen2_5_VisionTransformerPretrainedModel._from_config(
        Qwen2_5_VLVisionConfig(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32)
    )
    adapter = make_adapter(tower)
    try:
        path = adapter.config.paths[0]
        assert (path.min_budget, path.max_budget) == (plan_cmd.DEFAULT_MIN_BUDGET, plan_cmd.DEFAULT_MAX_BUDGET)
        assert adapter.config.max_frames_per_item == TOWERS["qwen2_5_vl"].max_frames_per_item
        # What "default" means in plan and tune: the ladder the runner captures when given none.
        from encgraph import EncoderGraphRunner

        assert EncoderGraphRunner(adapter).ladders == {path.name: plan_cmd.default_ladder()}
    finally:
        adapter.unwrap()
    assert isinstance(tower, torch.nn.Module)


def _transformers_smart_resize():
    """transformers' own ``smart_resize`` (Qwen2-VL image processor). Its module needs torchvision or PIL; without
    them, the function's source is compiled from the installed file (it needs only ``math``)."""
    import ast
    import importlib.util
    import math

    for name in ("image_processing_qwen2_vl", "image_processing_pil_qwen2_vl"):
        try:
            return importlib.import_module(f"transformers.models.qwen2_vl.{name}").smart_resize
        except ImportError:
            continue
    spec = importlib.util.find_spec("transformers")
    if spec is None:
        pytest.skip("transformers is not installed")
    source = Path(spec.submodule_search_locations[0], "models", "qwen2_vl", "image_processing_qwen2_vl.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    namespace = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "smart_resize", "exec"), namespace)
    return namespace["smart_resize"]


def test_smart_resize_matches_transformers():
    hf_smart_resize = _transformers_smart_resize()
    gen = np.random.default_rng(0)
    for _ in range(500):
        h, w = (int(v) for v in gen.integers(1, 5000, size=2))
        if max(h, w) / min(h, w) > 200:
            continue
        for g in TOWERS.values():
            ours = smart_resize(h, w, g.factor, g.min_pixels, g.max_pixels)
            assert ours == hf_smart_resize(h, w, factor=g.factor, min_pixels=g.min_pixels, max_pixels=g.max_pixels)


@pytest.mark.parametrize(
    "argv, stdin, words",
    [
        (["plan", "--budgets", "64,x"], "", ["--budgets", "comma-separated positive ints"]),
        (["plan", "--budgets", "0,64"], "", ["--budgets"]),
        (["plan", "--tower", "llava"], "", ["--tower", "invalid choice"]),
        (["plan", "--budgets", "64", "--max-budget", "128"], "1,2,2\n", ["--budgets or --min-budget/--max-budget"]),
        (["plan", "--min-budget", "512", "--max-budget", "64"], "1,2,2\n", ["--max-budget (64) is below --min-budget (512)"]),
        (["plan"], "640x480\nfoo\n", ["<stdin>:2", "'WxH'", "'foo'"]),
        (["plan"], "1,3,4\n", ["<stdin>:1", "multiples of the merge size 2"]),
        (["plan"], '{"grid": [1, 2]}\n', ["<stdin>:1", "three ints"]),
        (["plan"], '{"width": 3}\n', ["<stdin>:1", '"width" and "height"']),
        (["plan"], "{nope\n", ["<stdin>:1", "invalid JSON"]),
        (["plan"], "1x500\n", ["<stdin>:1", "aspect ratio"]),
        (["plan"], "# only a comment\n", ["no items in <stdin>"]),
        (["plan", "--budgets", "64,128", "--max-items", "100"], "64x64\n", ["max_items", "64"]),
        (["plan", "--max-items", "4", "--max-frames", "2"], "64x64\n", ["max_frames"]),
        (["plan", "--min-pixels", "900", "--max-pixels", "100"], "64x64\n", ["--max-pixels"]),
        (["plan", "/nonexistent/sizes.txt"], None, ["cannot read the items file", "No such file"]),
        (["nope"], None, ["invalid choice"]),
        ([], None, ["choose a command"]),
    ],
)
def test_bad_plan_arguments_exit_2_with_one_line(capsys, monkeypatch, argv, stdin, words):
    code, out, err = run_cli(argv, capsys, stdin, monkeypatch)
    assert out == ""
    assert_usage_error(code, err, *words)


def test_help_and_version_exit_0(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["plan", "--help"]) == 0
    assert "t,h,w" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("encgraph ")


def test_unexpected_failure_exits_1(capsys, monkeypatch):
    from encgraph.cli import plan as plan_cmd

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(plan_cmd, "make_plan", broken)
    code, _, err = run_cli(["plan"], capsys, "64x64\n", monkeypatch)
    assert code == 1
    assert "Traceback" in err and err.strip().splitlines()[-1] == "encgraph plan: unexpected failure: RuntimeError: boom"


def _python(*args, stdin=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


def test_python_dash_m_plan_without_torch():
    done = _python("-m", "encgraph", "plan", "--budgets", "256,512,1024", stdin=ITEMS)
    assert done.returncode == 0, done.stderr
    assert "padded share: 8.6%" in done.stdout
    code = (
        "import sys, io; sys.stdin = io.StringIO('640x480\\n'); from encgraph.cli import main; "
        "rc = main(['plan', '--json']); assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)"
    )
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
    done = _python("-m", "encgraph", "demo", "--budgets", "x")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--budgets" in done.stderr


class _Terminal(io.StringIO):
    """Standard input that is an interactive terminal (with ``text`` typed into it)."""

    def isatty(self):
        return True


@pytest.mark.parametrize("command, example", [
    ("plan", "e.g. encgraph plan sizes.txt, or printf '640x480\\n2,16,24\\n' | encgraph plan"),
    ("tune", "e.g. encgraph tune sizes.log, or printf '640x480\\n\\n2,16,24\\n' | encgraph tune"),
], ids=["plan", "tune"])
def test_no_file_on_a_terminal_says_what_it_expects(capsys, monkeypatch, command, example):
    """Issue 54: `encgraph plan` / `tune` with no file, on a terminal, waited silently on stdin."""
    monkeypatch.setattr(sys, "stdin", _Terminal("640x480\n"))
    code, out, err = run_cli([command], capsys)
    assert_usage_error(code, err, f"encgraph {command}: error: expected the", "as a path or piped to standard input",
                       "got neither (standard input is a terminal)", example, f"'encgraph {command} --help'")
    assert out == "" and sys.stdin.tell() == 0  # nothing read
    # '-' asks for the terminal explicitly: read, after a line that says so and how to end it.
    monkeypatch.setattr(sys, "stdin", _Terminal("640x480\n"))
    code, out, err = run_cli([command, "-"], capsys)
    assert code == 0 and "tower qwen2_5_vl" in out
    assert err == f"encgraph {command}: reading the {'items file' if command == 'plan' else 'log'} from the terminal; " \
                  "end it with Ctrl-D\n"
    # Piped (not a terminal): read as ever, with or without '-'.
    for argv in ([command], [command, "-"]):
        code, out, err = run_cli(argv, capsys, "640x480\n", monkeypatch)
        assert code == 0 and err == "" and "tower qwen2_5_vl" in out


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_plan_on_a_real_terminal_exits_at_once():
    master, slave = os.openpty()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        try:
            done = subprocess.run([sys.executable, "-m", "encgraph", "plan"], stdin=slave, capture_output=True,
                                  text=True, cwd=ROOT, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("encgraph plan waited on the terminal with no word of what it expects")
    finally:
        os.close(slave)
        os.close(master)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "standard input is a terminal" in done.stderr


# ------------------------------------------------------------------------------------------- demo

FAST = ["--quiet", "--repeats", "1"]


@pytest.fixture(autouse=True)
def one_thread():
    # The demo towers are tiny: with other suites running on the same cores, OpenMP threads spinning over
    # 64-wide matmuls cost ten times the work itself.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_demo_qwen2_5_vl_agrees_on_cpu(capsys):
    pytest.importorskip("transformers")
    code, out, err = run_cli(["demo", *FAST, "--device", "cpu"], capsys)
    assert code == 0, err
    assert "encgraph demo: qwen2_5_vl" in out
    assert "ladder: 32, 64, 128 tokens" in out
    assert "items: 6 (5 images, 1 video)" in out
    assert "runner mode static" in out and "CUDA graphs need a CUDA GPU" in out
    assert "eager items: 1 (5 [" in out and "tokens over the largest budget" in out
    rows = re.findall(r"^\s+(\d+)\s+(\S+e[-+]\d+)\s+batch (\d+), (budget \d+|eager \(.*\))$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(6)), out
    assert all(float(r[1]) < 1e-5 for r in rows), rows
    assert rows[5][3].startswith("eager")
    assert "all 6 items agree within 1e-05 (float32)" in out
    assert re.search(r"tower's own forward \(eager\)\s+[\d.]+ ms", out)
    assert re.search(r"encgraph, static mode\s+[\d.]+ ms", out)


@pytest.mark.parametrize("model", ["qwen3_vl", "siglip"])
def test_demo_other_towers_json(capsys, model):
    pytest.importorskip("transformers")
    code, out, err = run_cli(["demo", "--model", model, "--json", "--seed", "3", *FAST], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["model"] == model and data["mode"] == "static" and data["dtype"] == "float32"
    assert data["agreement"]["ok"] and data["agreement"]["max_rel_error"] < 1e-5
    assert all(item["max_rel_error"] < 1e-5 for item in data["items"])
    plan = Plan.from_dict(data["plan"])
    assert sorted(i for b in plan.batches for i in b.items) == list(range(len(data["items"])))
    assert data["stats"]["items"] == len(data["items"])  # the stats of the checked call
    if model == "qwen3_vl":
        assert "deepstack_features.0" in data["agreement"]["outputs"]
        assert [it["budgets"]["default"] for it in data["items"]].count(None) == 1
    else:
        assert data["unit"] == "items" and data["ladders"]["default"] == [1, 2, 4, 8]
        assert [b.budgets["default"] for b in plan.batches] == [8, 4]


def test_demo_budgets_and_max_items(capsys):
    pytest.importorskip("transformers")
    code, out, err = run_cli(["demo", *FAST, "--json", "--budgets", "64,256", "--max-items", "2"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["ladders"]["default"] == [64, 256]
    assert data["limits"]["max_items"] == 2
    assert all(len(b["items"]) <= 2 for b in data["plan"]["batches"])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--model", "llava"], ["--model", "invalid choice"]),
        (["demo", "--budgets", "0"], ["--budgets"]),
        (["demo", "--max-items", "-1"], ["--max-items", "positive int"]),
        (["demo", "--device", "tpu"], ["--device", "cpu, cuda or cuda:N"]),
        (["demo", "--dtype", "int8"], ["--dtype"]),
        (["demo", "--budgets", "32,64", "--max-items", "40", *FAST], ["max_items", "32"]),
    ],
)
def test_bad_demo_arguments_exit_2_with_one_line(capsys, argv, words):
    code, out, err = run_cli(argv, capsys)
    assert out == ""
    assert_usage_error(code, err, *words)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without CUDA")
def test_demo_cuda_without_cuda_exits_2(capsys):
    code, _, err = run_cli(["demo", "--device", "cuda"], capsys)
    assert_usage_error(code, err, "CUDA is not available", "--device cpu")


def test_relative_error_counts_nan_as_infinite():
    import torch

    from encgraph.cli.demo import _relative_error

    ref = {"pooler_output": torch.ones(3, 4), "extra": torch.ones(2)}
    assert _relative_error({"pooler_output": torch.ones(3, 4), "extra": torch.ones(2)}, ref) == (
        0.0, ["extra", "pooler_output"])
    # Every field the tower returns is compared: one missing, one extra, or one of another shape is no agreement.
    assert _relative_error({"pooler_output": torch.ones(3, 4)}, ref)[0] == float("inf")
    assert _relative_error({**ref, "other": torch.zeros(1)}, ref)[0] == float("inf")
    assert _relative_error({"pooler_output": torch.ones(3, 4), "extra": torch.ones(3)}, ref)[0] == float("inf")
    mine = {"pooler_output": torch.ones(3, 4), "extra": torch.ones(2)}
    mine["pooler_output"][1, 2] = float("nan")
    assert _relative_error(mine, ref)[0] == float("inf")


def test_demo_disagreement_exits_1(capsys, monkeypatch):
    pytest.importorskip("transformers")
    from encgraph.cli import demo

    monkeypatch.setitem(demo.THRESHOLDS, "float32", -1.0)
    code, out, err = run_cli(["demo", "--model", "siglip", *FAST], capsys)
    assert code == 1
    assert "DO NOT all agree" in out
    assert "differ from the tower's own forward" in err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["qwen2_5_vl", "qwen3_vl", "siglip"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_demo_on_cuda_replays_graphs(capsys, model, dtype):
    code, out, err = run_cli(["demo", "--model", model, "--dtype", dtype, "--json", "--quiet", "--repeats", "5"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["mode"] == "graph" and data["device"].startswith("cuda") and data["dtype"] == dtype
    ladder = data["ladders"]["default"]
    assert data["capture"]["graphs"] == len(ladder) and not data["capture"]["failed"], data["capture"]
    assert data["agreement"]["ok"], data["items"]
    eager = [it for it in data["items"] if it["eager_reason"]]
    assert data["stats"]["graph_items"] == len(data["items"]) - len(eager)
    assert data["timings_ms"]["encgraph"] > 0 and data["timings_ms"]["tower_eager"] > 0


def test_demo_refuses_a_budget_the_cpu_cannot_run(capsys):
    # Issue 14: `encgraph demo --budgets 100000` died with a 160 GB allocation; on the CPU it exits 2, one line.
    from encgraph.cli import main

    assert main(["demo", "--budgets", "100000", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budgets" in err[0] and "100000" in err[0]


def test_plan_lines_count_a_batch_as_replayed_only_where_a_path_replays():
    """Gemma-4's demo plan: a batch whose image path runs eager and whose video path is empty (budget 0) replays
    nothing (it said "3 replayed" for 2)."""
    from encgraph.cli._common import plan_lines
    from encgraph.packing import ItemSpec, pack

    items = [ItemSpec({"image": 96, "video": 30}), ItemSpec({"image": 289, "video": 0})]
    plan = pack(items, {"image": (0, 140, 280), "video": (0, 70, 140)}, max_items=16)
    assert [b.budgets for b in plan.batches] == [{"image": 140, "video": 70}, {"image": None, "video": 0}]
    lines = plan_lines(plan)
    assert lines[0] == "plan: 2 batches, 1 replayed, 1 with an eager path"
    assert lines[3].split()[:5] == ["1", "image=eager", "video=0", "289", "-"], lines


def test_demo_banner_says_the_time_measured_on_a_cpu(capsys):
    """It promised "a few seconds on a CPU" where 9-87 s were measured."""
    pytest.importorskip("transformers")
    code, _, err = run_cli(["demo", "--model", "siglip", "--repeats", "1", "--device", "cpu"], capsys)
    assert code == 0, err
    assert "(on a 2-core CPU about 10 s, gemma4 about 20 s; longer on a busy machine)" in err
    assert "a few seconds" not in err
