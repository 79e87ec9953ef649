"""``encgraph serve`` starts quietly on a standard install (issue 57): a start with the embedded models prints its
one ``encgraph serve:`` line and no warning. A standard install has no torchvision (not a dependency, and not in
the main CI environment); the server here runs with it hidden, so that the check holds wherever the tests run."""

from __future__ import annotations

from tests.integration.conftest import Server


def test_a_start_prints_no_warning(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchvision'] = None\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the Server puts the repository first, then this
    server = Server()
    try:
        server.wait_ready()
    finally:
        code = server.stop()
    lines = server.output().splitlines()
    assert code == server.expected_exit, server.output()
    assert lines and all(line.startswith("encgraph serve:") for line in lines), server.output()
