"""vLLM's contracts, the shim's manager beside vLLM's own on the same model and items (vLLM 0.33, CPU platform;
skipped where vLLM is not importable): never more padding than vLLM's packing (its budget-cliff deferral), the
frame limit does not cap images, the model's capture tensors are the graph's buffers, per-item output storage,
hit/miss counting on one and two paths, no items, before capture, the class (isinstance, mocks, the name set
by hand)."""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest
import torch

pytest.importorskip("vllm.v1.worker.encoder_cudagraph")

import vllm.v1.worker.encoder_cudagraph as manager_module  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph  # noqa: E402
from vllm.v1.worker import encoder_cudagraph_defs as defs  # noqa: E402

from encgraph.shims import vllm as shim  # noqa: E402
from tests.shims.protocol_models import MERGE, toy_inputs, toy_model_class  # noqa: E402
from tests.shims.test_vllm_manager import CPU, VllmManager, assert_items_close, eager_per_item, managers, vllm_config  # noqa: E402

ToyVit = toy_model_class(defs, SupportsEncoderCudaGraph)


def image(tokens):
    """One image grid of ``tokens`` output tokens (a 2 x 2*tokens patch strip)."""
    return [1, MERGE, MERGE * tokens]


def replays(theirs, ours, path="default"):
    """{budget: replays} of vLLM's manager (its recorded graphs) and of the shim's runner."""
    mine = {b: n for b, n in ours.runner.stats["paths"][path]["replays"].items() if n}
    vllms = {b: meta.graph.replays for b, meta in theirs.budget_graphs[path].items() if meta.graph.replays}
    return vllms, mine


@pytest.mark.parametrize("tokens,budgets,want,planner", [
    ([4000, 200], [256, 4096, 8192], {256: 1, 4096: 1}, "vllm"),  # vLLM: [200]@256 + [4000]@4096, not both @8192
    ([100] * 4, [256, 4096], {256: 2}, "vllm"),  # 2 x 256, not 1 x 4096
    ([100, 100], [256, 4096], {256: 1}, "greedy"),  # the same plan: encgraph's own is kept
])
def test_never_more_padding_than_vllms_packing(tokens, budgets, want, planner, monkeypatch):
    model = ToyVit(min_budget=4, max_budget=budgets[-1]).eval()
    theirs, ours = managers(model, vllm_config(budgets=budgets), monkeypatch)
    inputs = toy_inputs([image(t) for t in tokens], seed=1)
    with torch.inference_mode():
        want_out = theirs.execute(inputs)
    assert_items_close(ours.execute(inputs), want_out)
    assert replays(theirs, ours) == (want, want)
    assert ours.get_cumulative_stats()["plans"] == {planner: 1}


class TwoPath(ToyVit):
    """Two paths: ``default`` (what vLLM's default postprocess cuts per item) and ``tiles`` with twice the
    tokens (its rows are the default forward's, twice over; only its shape matters)."""

    def get_encoder_cudagraph_config(self):
        config = super().get_encoder_cudagraph_config()
        config.paths = {"default": defs.EncoderCudaGraphPathConfig(), "tiles": defs.EncoderCudaGraphPathConfig()}
        return config

    def get_encoder_cudagraph_item_specs(self, mm_kwargs):
        specs = super().get_encoder_cudagraph_item_specs(mm_kwargs)
        return [defs.EncoderItemSpec(input_size=s.input_size, output_tokens=s.output_tokens,
                                     path_output_tokens={"default": s.output_tokens, "tiles": 2 * s.output_tokens})
                for s in specs]

    def encoder_eager_forward(self, mm_kwargs, path="default"):
        out = super().encoder_eager_forward(mm_kwargs)
        return torch.cat([out, out]) if path == "tiles" else out


@pytest.mark.parametrize("grid,hits,misses,eager_tiles", [
    ([image(4), image(4)], 4, 0, False),  # one sub-batch, both paths replayed: 2 items x 2 paths
    ([image(40), image(40)], 2, 0, True),  # tiles (80) over every budget: eager there, default replays
    ([image(81)], 0, 1, True),  # nothing replayed: a miss
])
def test_two_path_counters_as_vllms(grid, hits, misses, eager_tiles, monkeypatch):
    model = TwoPath(min_budget=4, max_budget=64).eval()
    theirs, ours = managers(model, vllm_config(budgets=[16, 64], max_items=4), monkeypatch)
    inputs = toy_inputs(grid, seed=2)
    with torch.inference_mode():
        want = theirs.execute(inputs)
    assert_items_close(ours.execute(inputs), want)
    assert (theirs.graph_hits, theirs.graph_misses) == (ours.graph_hits, ours.graph_misses) == (hits, misses)
    assert bool(ours.runner.stats["paths"]["tiles"]["eager_items"]) is eager_tiles


def test_the_frame_limit_does_not_cap_images(monkeypatch):
    model = ToyVit().eval()
    theirs, ours = managers(model, vllm_config(budgets=[16, 64], max_items=4, max_frames=2), monkeypatch)
    inputs = toy_inputs([[1, 4, 4]] * 4, seed=3)
    assert [b.items for b in ours.runner.plan(inputs).batches] == [(0, 1, 2, 3)]  # one sub-batch, as vLLM
    with torch.inference_mode():
        want = theirs.execute(inputs)
    assert_items_close(ours.execute(inputs), want)
    assert replays(theirs, ours) == ({16: 1}, {16: 1})


class Recording(ToyVit):
    """Remembers the capture tensors it handed out and the tensors each static forward read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: dict[int, dict] = {}
        self.read: list[dict] = []

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, *args, **kwargs):
        out = super().prepare_encoder_cudagraph_capture_inputs(token_budget, *args, **kwargs)
        self.handed[token_budget] = dict(out.values)
        return out

    def encoder_cudagraph_forward(self, values, path="default"):
        self.read.append(dict(values))
        return super().encoder_cudagraph_forward(values, path)


def test_the_graph_reads_the_models_own_capture_tensors():
    model = Recording().eval()
    mgr = shim.EncoderCudaGraphManager(vllm_config(budgets=[16, 64], max_items=4), CPU, torch.float32, model)
    mgr.capture(graph_pool=object())
    model.read.clear()
    mgr.execute(toy_inputs([[1, 4, 4]], seed=4))  # 4 tokens: budget 16
    (read,) = model.read
    assert read.keys() == model.handed[16].keys()
    assert all(read[k] is model.handed[16][k] for k in read)


def test_each_item_owns_its_output_storage_and_later_calls_change_nothing(monkeypatch):
    theirs, ours = managers(ToyVit().eval(), vllm_config(budgets=[16, 64], max_items=4), monkeypatch)
    inputs = toy_inputs([[1, 4, 4], [1, 4, 8], [1, 2, 4]], seed=5)
    with torch.inference_mode():
        vllm_out = theirs.execute(inputs)
    out = ours.execute(inputs)
    for outs in (vllm_out, out):
        assert len({o.untyped_storage().data_ptr() for o in outs}) == len(outs)
        assert [o.untyped_storage().nbytes() for o in outs] == [o.numel() * o.element_size() for o in outs]
    kept = [o.clone() for o in out]
    ours.execute(toy_inputs([[1, 4, 4], [1, 8, 8]], seed=6))
    ours.execute(toy_inputs([[1, 18, 18]], seed=7))
    assert all(torch.equal(a, b) for a, b in zip(out, kept))


def test_no_items_and_before_capture(monkeypatch):
    config = vllm_config(budgets=[16, 64], max_items=4)
    model = ToyVit().eval()
    ours = shim.EncoderCudaGraphManager(config, CPU, torch.float32, model)
    theirs = VllmManager(vllm_config=config, device=CPU, dtype=torch.float32, model=model)
    inputs = toy_inputs([[1, 4, 4]])
    with pytest.raises(AssertionError), torch.inference_mode():
        theirs.execute(inputs)  # vLLM's manager: no graph for the batch's budget
    with pytest.raises(RuntimeError, match="before capture"):
        ours.execute(inputs)
    ours.capture(graph_pool=object())
    empty = toy_inputs([])
    with torch.inference_mode():
        assert theirs.execute(empty) == []
    assert ours.execute(empty) == [] and ours.execute({}) == [] and ours.execute([]) == []
    assert (ours.graph_hits, ours.graph_misses) == (0, 0)
    assert_items_close(ours.execute(inputs), eager_per_item(model, inputs))


@pytest.fixture
def restore():
    original = shim._vllm_manager_class()
    yield original
    shim.uninstall()
    manager_module.EncoderCudaGraphManager = original


def test_the_class_is_vllms_and_any_name_setting_is_safe(restore, monkeypatch):
    original = restore
    cls = shim.EncoderCudaGraphManager
    assert issubclass(cls, original) and cls.__name__ == "EncoderCudaGraphManager"
    mock = MagicMock(spec=cls)
    assert isinstance(mock, original) and callable(mock.execute)
    config = vllm_config(budgets=[16, 64], max_items=4)

    class Derived(cls):  # a user's own subclass put in the name
        pass

    for value in (cls, Derived):
        monkeypatch.setattr(manager_module, "EncoderCudaGraphManager", value)  # by hand, without install()
        assert shim._vllm_manager_class() is original
        built = manager_module.EncoderCudaGraphManager(config, CPU, torch.float32, ToyVit())
        assert isinstance(built, (cls, original)) and type(built) is value
        built.capture(graph_pool=object())
        assert len(built.execute(toy_inputs([[1, 4, 4]]))) == 1
    shim.install()
    shim.install()  # idempotent
    assert manager_module.EncoderCudaGraphManager is cls and shim._vllm_manager_class() is original
