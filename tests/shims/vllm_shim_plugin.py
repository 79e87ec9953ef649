"""A pytest plugin that runs vLLM's own test files with the encgraph manager in place of vLLM's.

Used by the vLLM step of ``.ci/run`` on the tests of vLLM's source distribution (not copied here)::

    cd vllm-0.33.0 && PYTHONPATH=<checkout>/tests/shims VLLM_TARGET_DEVICE=cpu \
        python -m pytest -p vllm_shim_plugin tests/v1/cudagraph/test_encoder_cudagraph.py ...

It turns the plugin on (``ENCGRAPH_VLLM=1``) and loads vLLM's general plugins with vLLM's own loader before
any test module is collected, so every ``from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager``
in those files gets the encgraph class, as a vLLM process with the plugin installed would.
"""

from __future__ import annotations

import os


def pytest_configure(config):  # noqa: ANN001, ANN201 - pytest hook
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
    print(f"vllm_shim_plugin: vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager is {replaced!r}")
