"""Issue 55 on the CPU: wrapping is invisible to everything around the module (names, checkpoints, PEFT, copies,
moves, modes), and any batch-first module is answered by graphs, exactly, only once verified. Tiny random
Hugging Face models and plain torch modules; STATIC mode runs the padded plan a GPU would replay."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.utils._pytree as pytree

import encgraph
from encgraph.capture.records import RunMode
from encgraph.models.graphed_forward import AUTOGRAD, FIRST_SIGHT, TRAIN_MODE
from encgraph.models.own_forward import own_forward
from tests.models.fixtures_fixed import tiny_vlm

tf = pytest.importorskip("transformers")

QWEN_BUDGETS = [8, 16, 32, 64]
GRID = torch.tensor([[1, 4, 6], [1, 2, 2], [2, 4, 4]])


def assert_same(got, want, tol=1e-5):
    """Every leaf of two outputs of the same structure equal (tensors within ``tol`` per element)."""
    a, spec_a = pytree.tree_flatten(got)
    b, spec_b = pytree.tree_flatten(want)
    assert type(got) is type(want) and spec_a == spec_b
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=tol, atol=tol)
        else:
            assert x == y


# ------------------------------------------------------------------ tiny models around a tower
def tiny_qwen25():
    """Qwen2.5-VL with a vision MLP of 36 (not a multiple of 8): the adapter pads it, parameters become views."""
    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=36, num_heads=2, out_hidden_size=32,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8,
                           fullatt_block_indexes=[1]),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )
    torch.manual_seed(0)
    return tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def tiny_gemma3():
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    text = tf.Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, vocab_size=300)
    cfg = tf.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, image_token_index=290,
                          boi_token_index=291, eoi_token_index=292)
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(cfg).eval()


MODELS = {
    "qwen2_5_vl": (tiny_qwen25, lambda m: m.model.visual),
    "gemma3": (tiny_gemma3, lambda m: m.model.vision_tower),
    "llava": (lambda: tiny_vlm("clip")[0], lambda m: m.model.vision_tower),
}


def tower_call(family, seed=0):
    g = torch.Generator().manual_seed(seed)
    if family == "qwen2_5_vl":
        return (torch.randn(int(GRID.prod(-1).sum()), 24, generator=g),), {"grid_thw": GRID}
    return (torch.randn(3, 3, 32, 32, generator=g),), {}


def wrap(tower, family):
    options = {"budgets": QWEN_BUDGETS} if family == "qwen2_5_vl" else {"budgets": [1, 2, 4]}
    return encgraph.graphed(tower, mode=RunMode.STATIC, **options)


def wrapped_qwen_tower(model=None):
    """A tiny Qwen2.5-VL model's tower, graphed (STATIC), its call's arguments, and its hook."""
    tower = (model or tiny_qwen25()).model.visual
    wrap(tower, "qwen2_5_vl")
    args, kwargs = tower_call("qwen2_5_vl")
    return tower, args, kwargs, encgraph.graphs(tower)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_wrapping_keeps_names_checkpoints_and_save_pretrained(family, tmp_path):
    build, tower_of = MODELS[family]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules()])
    tower = tower_of(model)
    assert wrap(tower, family) is tower
    args, kwargs = tower_call(family)
    with torch.no_grad():
        for _ in range(2):  # the adapter built, its rewrites made (Qwen2.5-VL: the MLP padded) and run
            tower(*args, **kwargs)
    assert encgraph.graphs(tower).stats["stock_calls"] == 0
    assert ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules()]) == names
    state = model.state_dict()
    assert list(state) == list(before) and all(torch.equal(state[k], v) for k, v in before.items())
    model.load_state_dict(before, strict=True)  # the original checkpoint loads strictly into the wrapped model
    model.save_pretrained(tmp_path / "saved")
    loaded = type(model).from_pretrained(tmp_path / "saved")
    assert set(loaded.state_dict()) == set(before)
    for k, v in before.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    plain = build()
    plain.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())), strict=True)
    with torch.no_grad():
        assert_same(tower(*args, **kwargs), tower_of(plain)(*args, **kwargs))


def test_peft_lora_targets_the_tower_by_name_and_the_graphs_hold_the_adapted_layers():
    peft = pytest.importorskip("peft")
    model, plain = tiny_qwen25(), tiny_qwen25()
    tower, args, kwargs, _ = wrapped_qwen_tower(model)
    with torch.no_grad():
        tower(*args, **kwargs)
    config = dict(r=4, target_modules=["qkv", "down_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**config))
    torch.manual_seed(1)
    adapted_plain = peft.get_peft_model(plain, peft.LoraConfig(**config))
    lora = [n for n, m in adapted.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert lora and lora == [n for n, m in adapted_plain.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert any(".visual." in n for n in lora)
    adapted_plain.load_state_dict(adapted.state_dict())
    with torch.no_grad():
        for _ in range(2):  # the graphs are built again (new submodules) and hold the LoRA layers
            assert_same(tower(*args, **kwargs), adapted_plain.base_model.model.model.visual(*args, **kwargs))
    stats = encgraph.graphs(tower).stats
    assert stats["rebuilds"] == {"parameters, buffers or submodules replaced": 1}
    assert stats["stock_calls"] == 0 and stats["graph_items"] == 3 * len(GRID)


def test_copies_capture_their_own_graphs():
    model = tiny_qwen25()
    tower, args, kwargs, _ = wrapped_qwen_tower(model)
    with torch.no_grad():
        want = tower(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(tower, buffer)
        for other in (copy.deepcopy(tower), pickle.loads(pickle.dumps(tower)),
                      torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
            hook = encgraph.graphs(other)
            assert hook is not encgraph.graphs(tower) and not hook.engines  # nothing shared, nothing captured yet
            assert all(a.data_ptr() != b.data_ptr() for a, b in zip(other.parameters(), tower.parameters()))
            assert_same(other(*args, **kwargs), want)
            assert hook.stats["graph_items"] == len(GRID)
            assert list(other.state_dict()) == list(tower.state_dict())


def test_moves_modes_and_grad_are_honoured():
    tower, args, kwargs, hook = wrapped_qwen_tower()
    with torch.no_grad():
        tower(*args, **kwargs)
        tower.double()  # graphs of float32 buffers cannot hold it: dropped, built again
        got = tower(args[0].double(), **kwargs)
        assert got.pooler_output.dtype == torch.float64
        assert_same(got, own_forward(tower)(args[0].double(), **kwargs))
        tower.float()
        tower.train()
        assert_same(tower(*args, **kwargs), own_forward(tower)(*args, **kwargs))
        tower.eval()
        tower(*args, **kwargs)
    tower.requires_grad_(True)
    out = tower(*args, **kwargs)  # grad enabled and parameters that require it: the tower's own forward
    assert out.pooler_output.requires_grad
    stats = hook.stats
    assert stats["rebuilds"] == {"module moved or cast (.to, .half, .cuda)": 2}
    assert stats["eager_reasons"] == {TRAIN_MODE: 1, AUTOGRAD: 1} and stats["calls"] == 3


class Peak(torch.nn.Module):
    """Batch-first, with state: BatchNorm (statistics in train mode) and a buffer of the largest input it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.register_buffer("peak", torch.zeros(()))

    def forward(self, x):
        self.peak.copy_(torch.maximum(self.peak, x.abs().max()))
        return self.norm(self.lin(x))


def test_no_hidden_forward_state_restored_and_train_mode_is_the_modules_own():
    torch.manual_seed(0)
    net, ref = Peak(), None
    ref = copy.deepcopy(net)
    calls = []
    net.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    encgraph.graphed(net, mode=RunMode.STATIC, budgets=[1, 2, 4, 8])
    xs = [torch.rand(n, 8) * 0.5 for n in (40, 3, 3, 6, 11)]
    with torch.no_grad():
        assert_same(net(xs[0]), ref(xs[0]))  # train mode: BatchNorm over all 40 rows, statistics updated alike
        assert torch.equal(net.norm.running_mean, ref.norm.running_mean)
        net.eval(), ref.eval()
        for x in xs[1:]:
            assert_same(net(x), ref(x))
    # One hook call per user call, on all its rows: no probe, no sub-batch reaches the module's hooks; the
    # capture's scratch inputs (noise of the inputs' scale) left the peak as the real inputs set it.
    assert calls == [len(x) for x in xs]
    assert torch.equal(net.peak, ref.peak) and torch.equal(net.norm.running_var, ref.norm.running_var)
    stats = encgraph.graphs(net).stats
    assert stats["eager_reasons"] == {TRAIN_MODE: 1, FIRST_SIGHT: 1} and stats["graph_items"] == 3 + 6 + 11


# ------------------------------------------------------------------ Hugging Face backbones without an adapter
BACKBONES = {
    "vit": lambda: tf.ViTModel(tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=37, image_size=32, patch_size=8)),
    "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     mlp_ratio=2, image_size=32, patch_size=8)),
    "dinov3": lambda: tf.DINOv3ViTModel(tf.DINOv3ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                           intermediate_size=64, image_size=32, patch_size=8,
                                                           num_register_tokens=2)),
    "aimv2": lambda: tf.Aimv2VisionModel(tf.Aimv2VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                              intermediate_size=64, image_size=32, patch_size=8)),
    "convnext": lambda: tf.ConvNextModel(tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2)),
    "swin": lambda: tf.SwinModel(tf.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1],
                                               num_heads=[1, 2], window_size=4)),
    "clip_projection": lambda: tf.CLIPVisionModelWithProjection(tf.CLIPVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, image_size=32, patch_size=8,
        projection_dim=16)),
}


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_hf_backbones_without_an_adapter_replay_exactly(name):
    torch.manual_seed(0)
    model = BACKBONES[name]().eval()
    ref = copy.deepcopy(model)
    encgraph.graphed(model, mode=RunMode.STATIC, budgets=[1, 2, 4, 8])
    assert not encgraph.graphs(model).family

    def call(n, seed, **flags):
        return {"pixel_values": torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))} | flags

    plan = [(3, {}), (5, {}), (11, {}), (2, {"return_dict": False}), (3, {"return_dict": False}),
            (2, {"output_hidden_states": True}), (6, {"output_hidden_states": True})]
    with torch.no_grad():
        for i, (n, flags) in enumerate(plan):
            kwargs = call(n, seed=i, **flags)
            assert_same(model(**kwargs), ref(**kwargs))
    stats = encgraph.graphs(model).stats
    # Three call shapes, each learned from its first call; every later item replayed (verified batch-first).
    assert stats["eager_reasons"] == {FIRST_SIGHT: 3}, stats["eager_reasons"]
    assert stats["graph_items"] == 5 + 11 + 3 + 6 and len(stats["shapes"]["live"]) == 3


def test_an_adapter_that_repoints_parameters_is_not_rebuilt_by_unrelated_registrations():
    """Qwen2.5-VL's adapter pads its MLP and re-points the parameters at views of the padding: the module's state is
    taken after that, so that registrations elsewhere (any module built anywhere) are absorbed, not rebuilds."""
    tower, args, kwargs, hook = wrapped_qwen_tower()
    with torch.no_grad():
        tower(*args, **kwargs)
        hook.reset()  # dropped and built again on the next call: the padding made anew
        for _ in range(3):
            torch.nn.Linear(2, 2)  # an unrelated registration
            tower(*args, **kwargs)
    assert hook.stats["rebuilds"] == {"reset() called": 1} and hook.stats["calls"] == 4
