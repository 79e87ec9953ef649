"""``encgraph serve``'s command line: every bad argument, address and device is one line on stderr and exit 2,
before any model is built (the towers' builders are replaced by ones that fail the test)."""

from __future__ import annotations

import socket
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from encgraph.cli import build_parser, main  # noqa: E402
from encgraph.serving import loading  # noqa: E402


@pytest.fixture
def no_model_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    for name in ("embedded_tower", "load_tower", "build_model"):
        monkeypatch.setattr(loading, name, refuse)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


BAD = [
    # argv, words of the one-line error
    (["--port", "-1"], "expected a TCP port from 1 to 65535, got '-1'"),
    (["--port", "99999"], "expected a TCP port from 1 to 65535, got '99999'"),
    (["--port", "0"], "expected a TCP port from 1 to 65535"),
    (["--port", "http"], "expected a TCP port"),
    (["--host", "999.1.1.1"], "--host '999.1.1.1': not an address to listen on"),
    (["--host", "192.0.2.1"], "cannot listen there"),  # TEST-NET-1: no interface here has it
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "cuda:x"], "--device: expected cpu, cuda or cuda:N"),
    (["--budgets", "siglip=99999999999"], "expected budgets of at most 1048576"),
    (["--budgets", "siglip=99999"], "99999 images is more than one call can hold (at most 8192"),
    (["--budgets", "nope=4"], "no model 'nope'"),
    (["--budgets", "0,1"], "expected comma-separated positive ints"),
    (["--max-wait-ms", "inf"], "expected a number of milliseconds from 0 to 60000, got 'inf'"),
    (["--max-wait-ms", "1e12"], "from 0 to 60000, got '1e12'"),
    (["--max-wait-ms", "nan"], "from 0 to 60000, got 'nan'"),
    (["--max-wait-ms", "-1"], "from 0 to 60000, got '-1'"),
    (["--graceful-timeout", "inf"], "expected a number of seconds from 0 to 3600, got 'inf'"),
    (["--max-request-pixels", "300000000"], "--max-pixels-in-flight 200000000: expected at least"),
    (["--api-key", ""], "--api-key: expected a non-empty key without spaces"),
    (["--api-key", "a b"], "--api-key: expected a non-empty key without spaces"),
    (["--api-key-everywhere"], "--api-key-everywhere: no key given"),
    (["--model", "/nonexistent/ckpt"], "--model: expected a local checkpoint directory"),
    # Ray Serve's flags (issue 57): only with --ray, and checked before Ray is imported or a cluster joined.
    (["--replicas", "2"], "--replicas: only with --ray"),
    (["--address", "h:6379", "--gateways", "2"], "--address, --gateways: only with --ray"),
    (["--ray", "--replicas", "0"], "expected a positive int, got 0"),
    (["--ray", "--replicas", "4", "--max-replicas", "2"], "--max-replicas 2: expected at least --replicas (4)"),
    (["--ray", "--target-ongoing-requests", "0"], "--target-ongoing-requests: expected a number above 0"),
    (["--ray", "--target-ongoing-requests", "inf"], "expected a number of requests from 0 to 100000"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_and_exit_2_before_any_model(argv, words, capsys, no_model_built, monkeypatch):
    monkeypatch.delenv("ENCGRAPH_API_KEY", raising=False)
    port = [] if "--port" in argv else ["--port", str(free_port())]
    assert main(["serve", *port, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encgraph serve: error: ") and err.count("\n") == 1 and words in err, err


def test_ray_without_the_ray_extra_is_one_line_and_exit_2(capsys, no_model_built, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where `ray[serve]` is not installed
    assert main(["serve", "--ray", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs ray[serve]; install it with pip install 'encgraph[ray]'" in err, err


def test_help_documents_the_ray_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--ray", "--address", "--replicas", "--max-replicas", "--target-ongoing-requests", "--gateways",
                  "one replica per GPU", "replica_unavailable", "pip install 'encgraph[ray]'"):
        assert words in text, words


def test_cuda_on_a_machine_without_it_is_refused_before_any_model(capsys, no_model_built):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--port", str(free_port()), "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_any_model(busy_port, capsys, no_model_built):
    assert main(["serve", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {busy_port}: cannot listen there" in err and "choose another --port" in err, err


def test_an_empty_api_key_in_the_environment_is_refused(monkeypatch, capsys, no_model_built):
    monkeypatch.setenv("ENCGRAPH_API_KEY", "")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "ENCGRAPH_API_KEY: expected a non-empty key" in capsys.readouterr().err


def test_help_documents_authentication_limits_and_shutdown(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("ENCGRAPH_API_KEY", "Authorization: Bearer KEY", "--api-key-everywhere", "401",
                  "--graceful-timeout", "(default 10)", "--max-request-pixels", "--max-pixels-in-flight",
                  "about 4 GiB"):
        assert words in text, words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_idle_memory_is_stated_only_with_a_figure_from_a_result_file(capsys):
    """Issue 54: the idle server's memory read 0.43 GB in docs/serving.md and 0.45 GB in `serve --help`, and no
    result under benches/results holds either: a figure given for the idle server must be one a result file
    records, the same in both places."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert main(["serve", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    docs = " ".join((root / "docs" / "serving.md").read_text().split())
    idle = re.compile(r"idle (?:size|server) \(([^)]*)\)")  # the parenthesis that says how large it is
    size = re.compile(r"(\d+(?:\.\d+)?) ?([GM]i?B)")
    said = {where: idle.findall(text) for where, text in (("help", help_text), ("docs", docs))}
    assert all(len(s) == 1 for s in said.values()), said  # the sentences are still there
    figures = {where: set(size.findall(s[0])) for where, s in said.items()}
    assert figures["help"] == figures["docs"], figures
    results = " ".join(p.read_text(errors="replace") for p in (root / "benches" / "results").glob("*.md"))
    for value, unit in figures["help"]:
        assert f"{value} {unit}" in results, (value, unit)
