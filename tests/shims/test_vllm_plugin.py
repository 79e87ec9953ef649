"""The vLLM general plugin: vLLM's own loader finds it, ENCGRAPH_VLLM=1 makes vLLM's model runners build the
encgraph manager, anything else (or a model the shim does not serve) keeps vLLM's own manager."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch

pytest.importorskip("vllm.v1.worker.encoder_cudagraph")

import vllm.plugins  # noqa: E402
import vllm.v1.worker.encoder_cudagraph as manager_module  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph  # noqa: E402
from vllm.v1.worker import encoder_cudagraph_defs as defs  # noqa: E402

from encgraph.shims import vllm as shim  # noqa: E402
from tests.shims.protocol_models import toy_model_class  # noqa: E402
from tests.shims.test_vllm_manager import vllm_config  # noqa: E402

ToyVit = toy_model_class(defs, SupportsEncoderCudaGraph)
ORIGINAL = manager_module.EncoderCudaGraphManager


@pytest.fixture
def restore():
    yield
    shim.uninstall()
    assert manager_module.EncoderCudaGraphManager is ORIGINAL


def test_register_does_nothing_unless_enabled(monkeypatch, restore):
    for value in (None, "0", ""):
        if value is None:
            monkeypatch.delenv(shim.ENV_ENABLE, raising=False)
        else:
            monkeypatch.setenv(shim.ENV_ENABLE, value)
        shim.register()
        assert manager_module.EncoderCudaGraphManager is ORIGINAL


def test_vllm_loads_the_plugin_and_its_model_runner_builds_the_encgraph_manager(monkeypatch, restore):
    points = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "encgraph"]
    assert [e.value for e in points] == ["encgraph.shims.vllm:register"], "pip install -e . registers the entry point"
    import vllm.v1.worker.gpu.model_states.interface as model_states  # imported before the plugin runs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    monkeypatch.setenv("VLLM_PLUGINS", "encgraph")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()  # vLLM's own loader, as its engine and workers call it
    assert manager_module.EncoderCudaGraphManager is shim.EncoderCudaGraphManager
    assert model_states.EncoderCudaGraphManager is shim.EncoderCudaGraphManager
    assert issubclass(shim.EncoderCudaGraphManager, ORIGINAL)
    shim.register()  # loaded again in another place: idempotent
    assert shim._vllm_manager_class() is ORIGINAL

    model = ToyVit().eval()
    runner = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mm_encoder=True), supports_mm_inputs=True,
        get_model=lambda: model, vllm_config=vllm_config(budgets=[16, 64], max_items=4), device=torch.device("cpu"),
        dtype=torch.float32,
    )
    built = GPUModelRunner._create_encoder_cudagraph_manager(runner)
    assert type(built) is shim.EncoderCudaGraphManager and built.token_budgets == [16, 64]
    shim.uninstall()
    assert model_states.EncoderCudaGraphManager is ORIGINAL
    assert type(GPUModelRunner._create_encoder_cudagraph_manager(runner)) is ORIGINAL


class WithAxes(ToyVit):
    def get_encoder_cudagraph_config(self):
        config = super().get_encoder_cudagraph_config()
        config.capture_axes = (("a", "b"),)
        return config


@pytest.mark.parametrize("model,config", [
    (WithAxes(), vllm_config(budgets=[16, 64], max_items=4)),
    (ToyVit(), vllm_config(budgets=[16, 64], max_items=4, tp_mode="data", tp=2)),
], ids=["capture_axes", "data_parallel"])
def test_what_the_shim_does_not_serve_keeps_vllms_manager(model, config, caplog):
    reason = shim.fallback_reason(config, model)
    assert reason
    for build in (shim.make_manager, shim.EncoderCudaGraphManager):
        assert type(build(config, torch.device("cpu"), torch.float32, model)) is ORIGINAL


def test_environment_options(monkeypatch, tmp_path):
    from encgraph.packing import CostModel

    runner = shim.EncoderCudaGraphManager(vllm_config(budgets=[16, 64], max_items=4), torch.device("cpu"), torch.float32, ToyVit()).runner
    costs = CostModel.from_measurements({"default": {16: 1.0, 64: 2.0}}, {"default": [(4, 1, 0.5), (64, 2, 3.0)]})
    path = tmp_path / "costs.json"
    costs.save(path)
    monkeypatch.setenv(shim.ENV_COSTS, str(path))
    with_costs = shim.EncoderCudaGraphManager(vllm_config(budgets=[16, 64], max_items=4), torch.device("cpu"), torch.float32, ToyVit()).runner
    assert runner.costs is None and with_costs.costs is not None


def test_compile_is_opt_in(monkeypatch):
    # The runner's own default is compile="auto"; behind vLLM it must be plain graphs unless the variable asks.
    monkeypatch.delenv(shim.ENV_COMPILE, raising=False)
    assert shim._runner_options()["compile"] is False
    for value, want in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(shim.ENV_COMPILE, value)
        assert shim._runner_options()["compile"] is want, value
