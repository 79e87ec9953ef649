"""The vLLM shim's manager on CUDA, without vLLM (vLLM cannot be installed on the GPU machine).

The plugin's ``EncoderCudaGraphManager`` is vLLM's class plus :class:`encgraph.shims.vllm.ProtocolGraphManager`,
the vLLM-independent core that holds every public method (``capture``, ``execute``, ``clear``, counters); vLLM's
part only resolves budgets and limits from its config. This test drives that core with the budgets given
directly, on a real-geometry Hugging Face Qwen2.5-VL tower (7B geometry, depth 8, random bf16 weights) exposed
through vLLM's ``SupportsEncoderCudaGraph`` methods (``tests/shims/protocol_models.HFQwenProtocol``): capture in
GRAPH mode, replays equal to the same manager run without graphs (STATIC mode) and to the model's eager forward,
per item; every item with storage of its own, copied once out of the graph's output (not with its whole sub-batch
first), unchanged by later calls; vLLM's counters; ``clear()`` then ``capture()`` again. Needs transformers >= 5.15.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.errors import CaptureError
from encgraph.shims.vllm import ProtocolGraphManager
from tests.gpu.test_qwen_gpu import BUDGETS, HF_RTOL, MAX_ITEMS, STATIC_RTOL, qwen2_5_vl, random_mix, rel
from tests.shims.protocol_models import HFQwenProtocol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAMES = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    tower, _ = qwen2_5_vl()
    return HFQwenProtocol(tower.cuda().eval(), max_frames_per_video=FRAMES)


def manager(model, **runner_options):
    return ProtocolGraphManager(
        model, device="cuda", dtype=torch.bfloat16, token_budgets=BUDGETS, max_batch_size=MAX_ITEMS,
        max_frames_per_batch=MAX_ITEMS * FRAMES, runner_options=runner_options,
    )


def eager_per_item(model, inputs, n):
    with torch.inference_mode():
        return [model.encoder_eager_forward(model.select_encoder_cudagraph_items(inputs, [i])) for i in range(n)]


def check_calls(graph, static, model, gen, calls):
    """``calls`` random mixes through ``graph``; returns the first call's inputs and outputs."""
    first = None
    for case in range(calls):
        pixels, grid = random_mix(gen, model.qwen.channels, int(gen.integers(1, 3 * MAX_ITEMS)), big=case % 4 == 1)
        inputs = {"pixel_values": pixels, "image_grid_thw": grid.tolist()}
        hits, misses = graph.graph_hits, graph.graph_misses
        got = graph.execute(inputs)
        want = static.execute(inputs)
        eager = eager_per_item(model, inputs, len(grid)) if case < 3 else None
        assert len(got) == len(grid) == graph.graph_hits - hits + graph.graph_misses - misses
        assert len({o.untyped_storage().data_ptr() for o in got}) == len(got)  # own storage per item
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.isfinite(g).all(), (case, i)
            assert torch.equal(g, w) or rel(g, w, "max") < STATIC_RTOL, (case, i, grid[i].tolist())
            if eager is not None:
                assert rel(g, eager[i]) < HF_RTOL, (case, i, grid[i].tolist())
        if first is None:
            first = (inputs, got, [o.clone() for o in got])
    return first


def copied_rows(graph, model, monkeypatch, inputs):
    """The rows of each output-wide tensor cloned while ``graph`` executes ``inputs``, and the outputs."""
    width = int(model.tower.config.out_hidden_size)
    copied = []
    clone = torch.Tensor.clone

    def counting_clone(t, *args, **kwargs):
        if t.dim() == 2 and t.shape[-1] == width:
            copied.append(t.shape[0])
        return clone(t, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "clone", counting_clone)
        out = graph.execute(inputs)
    return copied, out


def test_manager_capture_replay_clear_on_cuda(model, monkeypatch):
    graph = manager(model, compile=False)
    static = manager(model, mode=RunMode.STATIC)
    pool = object()
    graph.capture(graph_pool=pool)
    static.capture(graph_pool=pool)
    stats = graph.get_cumulative_stats()
    assert graph.is_captured() and stats["num_budgets"] == len(BUDGETS)
    assert stats["encgraph"]["items"] == 0 and graph.runner.mode is RunMode.GRAPH
    gen = np.random.default_rng(0)
    _, outputs, kept = check_calls(graph, static, model, gen, calls=8)
    for o, k in zip(outputs, kept):  # later calls replayed the same graphs: the first call's outputs stand
        assert torch.equal(o, k)
    # 20 images of 16 tokens: two sub-batches or more (16 items at most each), a replayed one before the last;
    # each item copied once, alone (an eager sub-batch's items too).
    grid = np.array([[1, 8, 8]] * (MAX_ITEMS + 4))
    pixels = torch.randn(int(grid.prod(1).sum()), model.qwen.channels, device="cuda", dtype=torch.bfloat16)
    copied, got = copied_rows(graph, model, monkeypatch, {"pixel_values": pixels, "image_grid_thw": grid.tolist()})
    batches = graph.runner.last_plan.batches
    assert any(b.budgets["default"] in graph.runner.records["default"] for b in batches[:-1]), batches
    assert sorted(copied) == sorted(o.shape[0] for o in got) == [16] * len(grid), copied
    stats = graph.get_cumulative_stats()
    print(f"\nvLLM shim manager on CUDA: hits {stats['graph_hits']}, misses {stats['graph_misses']}, runner "
          f"{stats['encgraph']['graph_items']} graph items, {stats['encgraph']['eager_items']} eager")
    assert stats["graph_hits"] > 0 and stats["graph_misses"] > 0  # the big images run eagerly
    assert graph.execute({}) == []

    graph.clear()
    assert not graph.is_captured() and graph.get_cumulative_stats()["num_budgets"] == 0
    with pytest.raises(CaptureError):
        graph.execute({"pixel_values": outputs[0].new_zeros((16, model.qwen.channels)), "image_grid_thw": [[1, 4, 4]]})
    graph.capture(graph_pool=pool)
    assert graph.get_cumulative_stats()["num_budgets"] == len(BUDGETS)
    check_calls(graph, static, model, gen, calls=4)
    assert "vllm" not in sys.modules
