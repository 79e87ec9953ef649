"""tests/shims/vllm_private_tests.toml: every vLLM test it lists names the kind of poking and tests of ours that
exist (no vLLM needed)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.shims.vllm_shim_plugin import LIST

ROOT = Path(__file__).resolve().parents[2]


def test_every_listed_private_test_has_public_tests_of_ours():
    listed = tomllib.loads(LIST.read_text())
    assert listed["private"] and listed["deselected"]
    seen = set()
    for entry in listed["private"]:
        assert entry["vllm"].startswith("tests/v1/") and entry["vllm"] not in seen, entry
        seen.add(entry["vllm"])
        assert entry["pokes"] and entry["runs"] in ("cpu", "gpu") and entry["ours"], entry
        for node in entry["ours"]:
            path, name = node.split("::")
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name.startswith("test_") and name in names, node
    for entry in listed["deselected"]:
        assert entry["vllm"].startswith("tests/v1/") and entry["reason"], entry
