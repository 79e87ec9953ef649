"""``encgraph tune`` on the CPU through ``encgraph.cli.main``: the tuned ladder against the default one, the log
formats, ``--json``, ``--costs``, and exit 2 with a one-line error for bad arguments and logs."""

from __future__ import annotations

import io
import json
import re
import sys

import numpy as np
import pytest

from encgraph.cli import main
from encgraph.cli.geometry import TOWERS
from encgraph.cli.tune import parse_log
from encgraph.packing import CostModel, dense_ladder

DEFAULT_LADDER = list(dense_ladder(64, 4096))  # what `encgraph plan` and the runner use by default (20 budgets)
SIZES = ["640x480", "1024x768", "448x448", "1280x720", "300x200", "1920x1080"]


def traffic_log(seed: int = 0, requests: int = 120) -> str:
    """A seeded log in the blank-line format: 1-4 items per request, mostly a few common image sizes, some
    short videos."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(requests):
        lines = []
        for _ in range(int(rng.integers(1, 5))):
            if rng.random() < 0.15:
                lines.append(f"{int(rng.integers(2, 5))},{2 * int(rng.integers(4, 12))},{2 * int(rng.integers(4, 12))}")
            else:
                lines.append(SIZES[int(rng.choice(len(SIZES), p=[0.35, 0.2, 0.2, 0.1, 0.1, 0.05]))])
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def run_cli(argv, capsys, monkeypatch, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def tune_json(argv, capsys, monkeypatch, stdin):
    code, out, err = run_cli(["tune", "--json", *argv], capsys, monkeypatch, stdin)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def log():
    return traffic_log()


@pytest.mark.parametrize("max_budgets", [2, 4, 6, 7, 20, None])
def test_known_traffic_never_worse_than_the_default(capsys, monkeypatch, log, max_budgets):
    argv = [] if max_budgets is None else ["--max-budgets", str(max_budgets)]
    report = tune_json(argv, capsys, monkeypatch, log)
    tuned, default = report["tuned"], report["default"]
    limit = max_budgets or len(DEFAULT_LADDER)  # the default --max-budgets: as many as the default ladder has
    assert default["budgets"] == DEFAULT_LADDER
    assert 1 <= len(tuned["budgets"]) <= limit
    assert tuned["budgets"] == sorted(tuned["budgets"]) and all(b % 64 == 0 for b in tuned["budgets"])
    if limit >= len(DEFAULT_LADDER):  # the default is allowed: the tuned ladder is never costlier
        assert tuned["cost_ms"] <= default["cost_ms"]
        assert report["notes"] == []
    elif tuned["cost_ms"] > default["cost_ms"]:  # the dense default's 20 graphs pad less: the report says why
        assert report["notes"] == [f"the default ladder has 20 budgets, more than --max-budgets {max_budgets}; "
                                   "raise --max-budgets for a ladder at least as cheap"], report["notes"]
    assert report["traffic"]["requests"] == 120
    # Issue 54: the options to paste are the tuned ladder's only where it is rated no slower than the default.
    if report["recommended"] == "tuned":
        assert tuned["cost_ms"] <= default["cost_ms"] and tuned["budgets"] != DEFAULT_LADDER
        assert report["runner_options"]["budgets"] == tuned["budgets"]
        assert report["runner_line"] == (
            f"EncoderGraphRunner(adapter, budgets={tuple(tuned['budgets'])!r}, max_items=16, max_frames=32)"
        )
    else:
        assert report["recommended"] == "default"
        assert tuned["cost_ms"] > default["cost_ms"] or tuned["budgets"] == DEFAULT_LADDER
        assert report["runner_options"] == {} and report["runner_line"] == "EncoderGraphRunner(adapter)"


def test_text_output(capsys, monkeypatch, log):
    code, out, err = run_cli(["tune"], capsys, monkeypatch, log)
    assert code == 0, err
    assert out.startswith("tower qwen2_5_vl: patch 14 px")
    assert "traffic: 120 requests" in out
    assert "limits: at most 16 items and 32 frames per batch; cost model: default linear model (no --costs)" in out
    assert re.search(r"default\s+64, 128, 192, 256, [\d, ]+, 3840, 4096 \(20 graphs, 26432 tokens\)", out)
    tuned = re.search(r"tuned\s+([\d, ]+) \((\d+) graphs?", out)
    assert tuned and int(tuned.group(2)) < 20
    costs = [float(m) for m in re.findall(r"^\s+([\d.]+)\s+[\d.]+\s+[\d.]+%", out, flags=re.MULTILINE)]
    assert len(costs) == 2 and costs[1] <= costs[0]
    assert re.search(r"expected cost change: -\d+\.\d%", out)
    assert re.search(rf"recommendation: the tuned ladder \({tuned.group(2)} graphs\), rated \d+\.\d% faster than "
                     r"the default \(20 graphs\)", out)
    runner = f"  EncoderGraphRunner(adapter, budgets=({tuned.group(1)}), max_items=16, max_frames=32)"
    assert out.rstrip().splitlines()[-2:] == ["runner options:", runner]


def _help_example():
    """The log of ``encgraph tune --help``'s piped example, and its extra arguments."""
    line = next(ln for ln in tune_help().splitlines() if "| encgraph tune" in ln)
    printf, command = line.split("|")
    log = printf.strip().removeprefix("printf ").strip("'").encode().decode("unicode_escape")
    return log, command.split()[2:]


def tune_help():
    import contextlib

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["tune", "--help"]) == 0
    return text.getvalue()


@pytest.mark.parametrize("source", ["help example", "300 requests"])
def test_no_runner_options_for_a_ladder_rated_slower_than_the_default(capsys, monkeypatch, source):
    """Issue 54: `tune --max-budgets 4` on the --help example (+3.1%) and `--max-budgets 6` on a 300-request log
    (+1.8%... +5%) printed "runner options" to paste for a ladder its own model rates slower than the default."""
    if source == "help example":
        log, argv = _help_example()
        assert argv == ["--max-budgets", "4"]
    else:
        log, argv = traffic_log(seed=2, requests=300), ["--max-budgets", "6"]
    report = tune_json(argv, capsys, monkeypatch, log)
    assert report["tuned"]["cost_ms"] > report["default"]["cost_ms"]  # what the search finds within the limit
    assert report["recommended"] == "default" and report["runner_options"] == {}
    code, out, err = run_cli(["tune", *argv], capsys, monkeypatch, log)
    assert code == 0, err
    assert "runner options:" not in out and "EncoderGraphRunner" not in out
    change = re.search(r"expected cost change: \+(\d+\.\d)%", out).group(1)
    assert out.rstrip().splitlines()[-1] == (
        "recommendation: keep the default ladder (nothing to paste) unless the limits given must hold: no ladder "
        f"within them is rated as fast; the best found, {', '.join(map(str, report['tuned']['budgets']))}, is "
        f"rated {change}% slower"
    )


def test_a_default_ladder_kept_still_gives_the_limits_the_user_set(capsys, monkeypatch, log):
    report = tune_json(["--max-budgets", "3", "--max-items", "8"], capsys, monkeypatch, log)
    assert report["recommended"] == "default"
    assert report["runner_options"] == {"max_items": 8}
    assert report["runner_line"] == "EncoderGraphRunner(adapter, max_items=8)"
    # The default ladder found cheapest (nothing better within 20 graphs): said so, nothing to paste.
    code, out, _ = run_cli(["tune"], capsys, monkeypatch, "640x480\n1024x768\n\n2,16,24\n")
    assert code == 0 and "runner options:" not in out
    assert out.rstrip().endswith("recommendation: keep the default ladder (nothing to paste): it is the cheapest found")


def test_limits_memory_cap_granularity_and_a_file(capsys, monkeypatch, log, tmp_path):
    path = tmp_path / "sizes.log"
    path.write_text(log)
    report = tune_json(
        [str(path), "--memory-cap-tokens", "3000", "--granularity", "128", "--max-items", "4", "--tower", "qwen3_vl"],
        capsys,
        monkeypatch,
        "",
    )
    budgets = report["tuned"]["budgets"]
    assert sum(budgets) <= 3000 and all(b % 128 == 0 for b in budgets) and min(budgets) >= 4
    assert report["limits"] == {"max_items": 4, "max_frames": 8}
    assert report["tower"] == "qwen3_vl"
    # The default ladder (26432 tokens) is over the cap: said so; no options to paste for a slower ladder.
    if report["tuned"]["cost_ms"] > report["default"]["cost_ms"]:
        assert report["recommended"] == "default" and report["runner_options"] == {"max_items": 4}
        assert any("over --memory-cap-tokens 3000" in note for note in report["notes"]), report["notes"]


def test_measured_costs_file(capsys, monkeypatch, log, tmp_path):
    # A model that differs from the default one (graphs nearly free, eager costly): loaded and used, and the
    # tuned ladder is still no worse than the default under it.
    costs = CostModel.linear(["default"], graph_fixed_ms=0.01, graph_per_budget_ms=0.0001, eager_fixed_ms=50.0,
                             eager_per_token_ms=0.01)
    path = tmp_path / "costs.json"
    costs.save(path)
    report = tune_json(["--costs", str(path), "--max-budgets", "20"], capsys, monkeypatch, log)
    assert report["cost_model"] == str(path)
    assert report["tuned"]["cost_ms"] <= report["default"]["cost_ms"]
    code, out, _ = run_cli(["tune", "--costs", str(path)], capsys, monkeypatch, log)
    assert code == 0 and f"cost model: measured ({path})" in out


def test_log_formats_group_requests():
    geometry = TOWERS["qwen2_5_vl"]
    lines = [
        "# header comment",
        "640x480",
        "# a comment inside a request",
        "2,16,24",
        "",
        "",
        '{"items": ["300x200", {"grid": [1, 16, 16]}, {"width": 64, "height": 64}]}',
        "1,4,4",
        '{"width": 640, "height": 480}',
        '{"items": []}',
        "",
        "# only comments",
        "",
    ]
    requests = parse_log(lines, geometry)
    assert [[it.grid for it in r] for r in requests] == [
        [(1, 34, 46), (2, 16, 24)],
        [(1, 14, 22), (1, 16, 16), (1, 4, 4)],
        [(1, 4, 4), (1, 34, 46)],
    ]
    assert requests[0][1].source == "<stdin>:4"  # line numbers of the file, not of the request
    assert requests[1][1].source == "<stdin>:7: items[1]"


def test_json_lines_log_gives_the_same_ladder_as_blank_lines(capsys, monkeypatch, log):
    as_json = "\n".join(json.dumps({"items": block.split("\n")}) for block in log.strip().split("\n\n")) + "\n"
    assert tune_json([], capsys, monkeypatch, as_json) == tune_json([], capsys, monkeypatch, log)


@pytest.mark.parametrize(
    "argv, stdin, words",
    [
        (["tune", "--max-budgets", "0"], "64x64\n", ["--max-budgets", "positive int"]),
        (["tune", "--granularity", "x"], "64x64\n", ["--granularity", "'x'"]),
        (["tune", "--memory-cap-tokens", "-5"], "64x64\n", ["--memory-cap-tokens"]),
        (["tune", "--tower", "llava"], "64x64\n", ["--tower", "invalid choice"]),
        (["tune", "--memory-cap-tokens", "10"], "64x64\n", ["memory_cap_tokens", "10"]),
        (["tune", "--max-budget", "100", "--min-budget", "200"], "64x64\n", ["max_budget"]),
        (["tune", "--max-items", "4", "--max-frames", "2"], "64x64\n", ["max_frames"]),
        (["tune"], "640x480\n\nfoo\n", ["<stdin>:3", "'WxH'", "'foo'"]),
        (["tune"], '64x64\n{"items": ["64x64", 5]}\n', ["<stdin>:2: items[1]", "got int 5"]),
        (["tune"], '{"items": ["1,3,4"]}\n', ["<stdin>:1: items[0]", "merge size 2"]),
        (["tune"], '{"items": "64x64"}\n', ["<stdin>:1", '"items" must be a list']),
        (["tune", "/nonexistent/sizes.log"], "", ["cannot read the log", "No such file"]),
        (["tune", "--costs", "/nonexistent/costs.json"], "64x64\n", ["cannot read --costs", "No such file"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, monkeypatch, argv, stdin, words):
    code, out, err = run_cli(argv, capsys, monkeypatch, stdin)
    assert out == ""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error" in lines[0], err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bad_costs_file_exits_2(capsys, monkeypatch, tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text("{not json")
    code, _, err = run_cli(["tune", "--costs", str(bad)], capsys, monkeypatch, "64x64\n")
    assert code == 2 and err.count("\n") == 1 and "is not JSON" in err
    other = tmp_path / "other.json"
    CostModel.linear(["global"], graph_fixed_ms=1, graph_per_budget_ms=0.1, eager_fixed_ms=1,
                     eager_per_token_ms=0.1).save(other)
    code, _, err = run_cli(["tune", "--costs", str(other)], capsys, monkeypatch, "64x64\n")
    assert code == 2 and err.count("\n") == 1 and "missing path 'default'" in err


@pytest.mark.parametrize("stdin", ["", "\n\n", "# only comments\n\n# here\n", '{"items": []}\n'])
def test_empty_log_exits_2_with_a_clear_message(capsys, monkeypatch, stdin):
    code, out, err = run_cli(["tune"], capsys, monkeypatch, stdin)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("encgraph tune: error: no requests in <stdin>; give one item size per line")


def test_help_lists_tune_and_its_formats(capsys):
    assert main(["--help"]) == 0
    assert "tune" in capsys.readouterr().out
    assert main(["tune", "--help"]) == 0
    out = capsys.readouterr().out
    assert '{"items": [' in out and "blank lines" in out and "runner.costs.save" in out


def test_tune_does_not_import_torch():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, io; sys.stdin = io.StringIO('640x480\\n\\n2,16,24\\n'); from encgraph.cli import main; "
        "rc = main(['tune', '--json']); assert 'torch' not in sys.modules, 'tune imported torch'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tuned"]["budgets"]
