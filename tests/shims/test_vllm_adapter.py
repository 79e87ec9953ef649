"""VllmProtocolAdapter without vLLM: protocol objects (the toy encoder with stand-in data classes, and a Hugging
Face Qwen2.5-VL tower exposed through the protocol) behind the runner on the CPU, per item against the model's
own eager forward (and the HF forward); frames limits, held buffers, errors; the manager core's outputs copied
once per item in GRAPH mode (recorded graphs on the CPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import ConfigError, InputError, InputTypeError, UnsupportedModelError
from encgraph.shims.vllm import OUTPUT, ProtocolGraphManager, VllmProtocolAdapter
from tests.shims.cpu_graph import graph_mode_on_cpu
from tests.shims.protocol_models import HIDDEN, LOCAL_DEFS, toy_inputs, toy_model_class

ToyVit = toy_model_class(LOCAL_DEFS)
GRIDS = [[1, 2, 4], [1, 4, 4], [1, 2, 2], [1, 6, 4], [1, 2, 8]]
VIDEOS = [[2, 2, 4], [1, 4, 4], [2, 4, 2], [3, 2, 2]]


def runner_for(model, **options):
    adapter = VllmProtocolAdapter(model)
    return adapter, EncoderGraphRunner(adapter, **{"mode": RunMode.STATIC, **options})


@pytest.mark.parametrize("grad", ["inference_mode", "no_grad", "plain"])
@pytest.mark.parametrize("grid,video", [(GRIDS, False), (VIDEOS, True)], ids=["images", "videos"])
def test_runner_equals_eager_forward_per_item(grid, video, grad):
    model = ToyVit().eval()
    adapter, runner = runner_for(model, budgets=[4, 8, 16], max_items=4, max_frames=6)
    inputs = toy_inputs(grid, video=video, seed=1)
    mode = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}.get(grad)
    with mode() if mode else torch.enable_grad():
        got = runner(inputs)
        want = [model.encoder_eager_forward(model.select_encoder_cudagraph_items(inputs, [i])) for i in range(len(grid))]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    stats = runner.stats
    assert stats["items"] == len(grid) and stats["graph_items"] > 0
    assert sum(stats["paths"]["default"]["replays"].values()) > 0


def test_capture_values_are_the_models_own_and_follow_vllm_rules():
    model = ToyVit()
    adapter = VllmProtocolAdapter(model)
    # No runner buffers: every capture value is kept per budget as the model returned it (buffer identity).
    assert adapter.buffer_specs("default", 8, 2, 4) == {}
    held = adapter.captured_values("default", 8)
    assert sorted(held) == ["cu_seqlens", "max_seqlen", "pixel_values", "pos"] and int(held["max_seqlen"]) == 8 * 4
    assert held["cu_seqlens"].shape == (5,)
    pixels = held["pixel_values"]
    inputs = toy_inputs([[1, 2, 2], [1, 2, 4]])
    assert adapter.replay_values("default", inputs, 8) == {}
    assert held["pixel_values"] is pixels  # refreshed in place, never replaced
    assert held["cu_seqlens"].tolist() == [0, 4, 12, 12, 12]  # repeat-last padding logic, in place
    assert int(held["max_seqlen"]) == 8  # 0-d values are copied, as vLLM's manager does
    torch.testing.assert_close(pixels[:12], inputs["pixel_values"])
    assert not pixels[12:].any()  # no padding logic: zeroed past the replay's rows (vLLM's _copy_padded_buffer)


def test_frames_over_the_limit_run_eagerly():
    model = ToyVit(max_frames_per_video=2)
    adapter, runner = runner_for(model, budgets=[4, 8, 16], max_items=4, max_frames=4)
    grid = [[2, 2, 4], [3, 2, 2], [2, 2, 2], [5, 2, 2]]  # the 5-frame video exceeds max_frames=4
    inputs = toy_inputs(grid, video=True, seed=2)
    with torch.inference_mode():
        got = runner(inputs)
        want = [model.encoder_eager_forward(model.select_encoder_cudagraph_items(inputs, [i])) for i in range(4)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for batch in runner.plan(inputs).batches:
        assert sum(grid[i][0] for i in batch.items) <= 4 or batch.budgets["default"] is None
    assert runner.stats["eager_items"] >= 1


def test_item_specs_and_select():
    adapter = VllmProtocolAdapter(ToyVit())
    inputs = toy_inputs(VIDEOS, video=True)
    specs = adapter.item_specs(inputs)
    assert [s.tokens["default"] for s in specs] == [4, 4, 4, 3]
    assert [s.frames for s in specs] == [2, 1, 2, 3] and [s.input_size for s in specs] == [16, 16, 16, 12]
    sub = adapter.select(inputs, [3, 0])
    assert sub["video_grid_thw"] == [VIDEOS[3], VIDEOS[0]] and sub["pixel_values_videos"].shape[0] == 12 + 16
    frames = VllmProtocolAdapter(ToyVit(), frames=lambda kw: [1] * len(kw["video_grid_thw"]))
    assert [s.frames for s in frames.item_specs(inputs)] == [1, 1, 1, 1]


def test_budget_range_and_config():
    adapter = VllmProtocolAdapter(ToyVit(min_budget=8, max_budget=40))
    path = adapter.config.path("default")
    assert (path.min_budget, path.max_budget, path.outputs) == (8, 40, (OUTPUT,))
    assert adapter.config.max_frames_per_item == 2
    from encgraph.packing import dense_ladder

    assert EncoderGraphRunner(adapter, mode=RunMode.STATIC).ladders == {"default": dense_ladder(8, 40)}
    assert VllmProtocolAdapter(ToyVit(), budget_range=(16, 16)).config.path("default").min_budget == 16


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: VllmProtocolAdapter(object()), UnsupportedModelError, "missing methods"),
        (lambda: VllmProtocolAdapter(ToyVit(min_budget=0)), ConfigError, "Both must be positive"),
        (lambda: VllmProtocolAdapter(ToyVit(min_budget=200, max_budget=100)), ConfigError, "min_budget=200 > max_budget=100"),
        (lambda: VllmProtocolAdapter(ToyVit(), budget_range=(4,)), ConfigError, "expected \\(min_budget, max_budget\\)"),
        (lambda: VllmProtocolAdapter(ToyVit()).item_specs([1, 2]), InputTypeError, "mm_kwargs"),
        (lambda: VllmProtocolAdapter(ToyVit(), frames=lambda kw: [1]).item_specs(toy_inputs(GRIDS)), InputError, "one per item"),
        (lambda: VllmProtocolAdapter(ToyVit()).replay_values("default", toy_inputs(GRIDS), 8), ConfigError, "buffer_specs was never called"),
    ],
)
def test_bad_models_and_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_unsupported_protocol_features_are_refused():
    class WithAxes(ToyVit):
        def get_encoder_cudagraph_config(self):
            config = super().get_encoder_cudagraph_config()
            config.capture_axes = ((1, 2),)
            return config

    class CustomPost(ToyVit):
        def postprocess_encoder_output(self, outputs, indices, per_item_out_tokens, dest, clone=False, batch_mm_kwargs=None):
            raise AssertionError("never called")

    with pytest.raises(UnsupportedModelError, match="capture_axes"):
        VllmProtocolAdapter(WithAxes())
    with pytest.raises(UnsupportedModelError, match="overrides postprocess_encoder_output"):
        VllmProtocolAdapter(CustomPost())


def test_none_or_a_missing_replay_value_keeps_the_captured_buffer():
    # vLLM's EncoderCudaGraphReplayBuffers: a None value leaves the captured buffer as it is.
    class Forgetful(ToyVit):
        def prepare_encoder_cudagraph_replay_buffers(self, mm_kwargs, *args, **kwargs):
            out = super().prepare_encoder_cudagraph_replay_buffers(mm_kwargs, *args, **kwargs)
            out.values["pos"] = None
            del out.values["max_seqlen"]
            return out

    adapter, runner = runner_for(Forgetful(), budgets=[8])
    runner.capture()
    held = adapter.captured_values("default", 8)
    before = {k: held[k].clone() for k in ("pos", "max_seqlen")}
    assert len(runner(toy_inputs([[1, 2, 2]]))) == 1
    for key, value in before.items():
        assert torch.equal(held[key], value), key


def test_optional_methods_only_when_given():
    plain = VllmProtocolAdapter(ToyVit())
    assert not hasattr(plain, "sample_inputs") and not hasattr(plain, "concat")
    hooked = VllmProtocolAdapter(ToyVit(), sample_inputs=lambda path, tokens: toy_inputs([[1, 2, 2 * tokens]]),
                                 concat=lambda parts: parts[0])
    assert hooked.item_specs(hooked.sample_inputs("default", 8))[0].tokens["default"] == 8


def test_imports_no_engine():
    # The shim modules import their engine only inside functions.
    assert "vllm" not in sys.modules or "encgraph.shims.vllm" in sys.modules
    import subprocess

    code = "import encgraph.shims.vllm, encgraph.shims, sys; print('vllm' in sys.modules, 'sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def tiny_qwen2_5_vl():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=48,
                                    fullatt_block_indexes=[1], window_size=56)
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()


def test_hf_tower_through_the_protocol_equals_hf_forward():
    from tests.shims.protocol_models import HFQwenProtocol

    model = HFQwenProtocol(tiny_qwen2_5_vl(), max_frames_per_video=2)
    adapter = VllmProtocolAdapter(model, budget_range=(8, 64))
    assert set(adapter._padding) == {"cu_seqlens", "cu_window_seqlens", "window_index"}
    runner = EncoderGraphRunner(adapter, budgets=[8, 16, 32], max_items=4, mode=RunMode.STATIC)
    grid = [[1, 4, 6], [1, 8, 8], [2, 4, 4], [1, 12, 12], [1, 2, 4]]  # 144 tokens: over the largest budget
    channels = adapter.model.qwen.channels
    inputs = {"pixel_values": torch.randn(sum(t * h * w for t, h, w in grid), channels), "image_grid_thw": grid}
    with torch.inference_mode():
        got = runner(inputs)
        hf = model.hf_per_item(inputs)
    for g, h in zip(got, hf):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5)
    stats = runner.stats
    assert stats["graph_items"] == 4 and stats["eager_items"] == 1


def test_the_manager_copies_each_item_once_and_later_replays_change_none(monkeypatch):
    """GRAPH mode (recorded graphs on the CPU: every replay writes the path's one shared output buffer) with
    several sub-batches on the path: each item is copied out of the graph's output once (vLLM's clone=True), not
    also with its whole sub-batch first; every item owns its storage and equals the model's eager forward after
    the later sub-batches and calls replayed over the buffer."""
    model = ToyVit().eval()
    manager = ProtocolGraphManager(model, device="cpu", dtype=torch.float32, token_budgets=[4, 8, 16],
                                   max_batch_size=4, max_frames_per_batch=4)
    manager.capture(graph_pool=object())
    graph_mode_on_cpu(manager.runner)
    inputs = toy_inputs(GRIDS, seed=7)  # 17 tokens: two sub-batches or more, each within a budget
    copied = []
    clone = torch.Tensor.clone

    def counting_clone(t, *args, **kwargs):
        if t.dim() == 2 and t.shape[-1] == HIDDEN:  # output rows (the model's inputs are wider)
            copied.append(t.shape[0])
        return clone(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    with torch.inference_mode():
        got = manager.execute(inputs)
    monkeypatch.undo()
    plan = manager.runner.last_plan
    assert len(plan.batches) >= 2 and all(b.budgets["default"] for b in plan.batches)  # every sub-batch replayed
    assert sorted(copied) == sorted(o.shape[0] for o in got)  # one copy per item, of its rows alone
    assert len({o.untyped_storage().data_ptr() for o in got}) == len(got)
    kept = [o.clone() for o in got]
    manager.execute(toy_inputs([[1, 4, 8], [1, 2, 6]], seed=8))  # replays over the same output buffer
    with torch.inference_mode():
        want = [model.encoder_eager_forward(model.select_encoder_cudagraph_items(inputs, [i])) for i in range(len(GRIDS))]
    for g, k, w in zip(got, kept, want):
        assert torch.equal(g, k)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
