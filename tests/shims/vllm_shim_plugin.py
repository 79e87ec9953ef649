"""A pytest plugin that runs vLLM's own test files with the encgraph manager in place of vLLM's.

Used by the vLLM step of ``.ci/run`` on the tests of vLLM's source distribution (not copied here)::

    cd vllm-0.33.0 && PYTHONPATH=<checkout>/tests/shims VLLM_TARGET_DEVICE=cpu \
        python -m pytest -p vllm_shim_plugin tests/v1/cudagraph/test_encoder_cudagraph.py ...

- Turns the plugin on (``ENCGRAPH_VLLM=1``) and loads vLLM's general plugins with vLLM's own loader before any
  test module is collected, so every ``from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager``
  in those files gets the encgraph class, as in a vLLM process with the plugin installed.
  ``ENCGRAPH_VLLM_SUITE_MANAGER=vllm`` leaves vLLM's own manager in place (the same run, for comparison).
- Reads ``vllm_private_tests.toml`` beside this file: deselects its ``[[deselected]]`` tests and, at the end,
  counts the outcomes of the tests of public behaviour apart from the ``[[private]]`` ones.
"""

from __future__ import annotations

import collections
import os
import tomllib
from pathlib import Path

LIST = Path(__file__).with_name("vllm_private_tests.toml")
_outcomes: dict[str, collections.Counter] = {"public": collections.Counter(), "private": collections.Counter()}


def _listed() -> dict:
    return tomllib.loads(LIST.read_text())


def pytest_configure(config):  # noqa: ANN001, ANN201 - pytest hook
    if os.environ.get("ENCGRAPH_VLLM_SUITE_MANAGER", "encgraph") == "vllm":
        print("vllm_shim_plugin: vLLM's own EncoderCudaGraphManager (ENCGRAPH_VLLM_SUITE_MANAGER=vllm)")
        return
    os.environ["ENCGRAPH_VLLM"] = "1"
    import vllm.plugins
    import vllm.v1.worker.encoder_cudagraph as manager_module

    vllm.plugins.load_general_plugins()
    from encgraph.shims import vllm as shim

    replaced = manager_module.EncoderCudaGraphManager
    if replaced is not shim.manager_class():
        raise RuntimeError(
            "vllm_shim_plugin: vLLM's plugin loader did not install encgraph's manager; is encgraph installed "
            "(pip install -e .) in this environment, so that its vllm.general_plugins entry point is found?"
        )
    print(f"vllm_shim_plugin: vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager is {replaced.__module__}."
          f"{replaced.__qualname__}")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201 - pytest hook
    listed = _listed()
    drop = tuple(entry["vllm"] for entry in listed.get("deselected", []))
    private = tuple(entry["vllm"] for entry in listed.get("private", []))
    kept, gone = [], []
    for item in items:
        node = item.nodeid[item.nodeid.find("tests/v1/"):]  # the same ids whatever pytest took as its rootdir
        (gone if node.startswith(drop) else kept).append(item)
        if node.startswith(private):
            item.user_properties.append(("encgraph_kind", "private"))
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = kept


def pytest_runtest_logreport(report):  # noqa: ANN001, ANN201 - pytest hook
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        kind = dict(report.user_properties).get("encgraph_kind", "public")
        _outcomes[kind][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):  # noqa: ANN001, ANN201 - pytest hook
    for kind, counts in _outcomes.items():
        line = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped"))
        terminalreporter.write_line(f"vllm_shim_plugin: {kind} tests ({LIST.name}): {line}")
