"""Qwen2.5-Omni and Qwen3-Omni-MoE (issue 58). Their thinkers' vision encoders (``model.thinker.model.visual``) are
the Qwen2.5-VL and Qwen3-VL towers under another config class, so they share those adapters' table entries
(:mod:`encgraph.models.builtin`) and add no code. On tiny random towers (CPU, fp32, STATIC mode: the padded plan a
GPU replays): ``graphed(tower)`` equals the tower's own forward per item, every field (``pooler_output``,
``last_hidden_state``, the deepstack features), on images, videos and mixes; the thinker's ``get_image_features``
and ``get_video_features`` are unchanged with its tower graphed in place.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import encgraph
from encgraph.capture.records import RunMode
from encgraph.models import known_configs, wrap
from encgraph.models.registry import supported_families
from encgraph.models.qwen2_5_vl import Qwen25VLAdapter
from encgraph.models.qwen3_vl import Qwen3VLAdapter

OMNI = {"qwen2_5_omni": (Qwen25VLAdapter, "Qwen2.5-Omni"), "qwen3_omni_moe": (Qwen3VLAdapter, "Qwen3-Omni-MoE")}
BUDGETS = [8, 16, 32]  # an item of 12 x 12 patches (36 tokens) runs eagerly
RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def fields(out) -> dict[str, torch.Tensor]:
    """Every field of a tower's output: ``last_hidden_state`` (rows), ``pooler_output`` and deepstack (tokens)."""
    named = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}
    for i, feature in enumerate(getattr(out, "deepstack_features", None) or []):
        named[f"deepstack_{i}"] = feature
    return named


def split(out, grid: np.ndarray) -> list[dict[str, torch.Tensor]]:
    rows = grid.prod(1).tolist()
    tokens = (grid.prod(1) // 4).tolist()
    parts = {name: torch.split(t, rows if name == "last_hidden_state" else tokens) for name, t in fields(out).items()}
    return [{name: p[i] for name, p in parts.items()} for i in range(grid.shape[0])]


def per_item(tower, pixels: torch.Tensor, grid: np.ndarray) -> list[dict[str, torch.Tensor]]:
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    with torch.no_grad():
        return [fields(tower(pixels[starts[i]:starts[i + 1]], grid_thw=torch.from_numpy(grid[i:i + 1])))
                for i in range(grid.shape[0])]


@pytest.fixture(params=sorted(OMNI))
def family(request) -> str:
    return request.param


@pytest.fixture
def towers(family, qwen_towers):
    torch.manual_seed(0)
    tower = qwen_towers[family]()
    with torch.no_grad():  # a random learned position table (Qwen3-Omni), so that resampling it matters
        for name, param in tower.named_parameters():
            if name.startswith("pos_embed"):
                param.normal_()
    return tower, copy.deepcopy(tower)


def test_the_omni_encoders_share_the_qwen_vl_entries(family, towers):
    tower, _ = towers
    adapter_class, name = OMNI[family]
    assert type(tower.config).__name__ in known_configs() and name in supported_families()
    assert type(wrap(tower)) is adapter_class
    assert type(encgraph.graphs(encgraph.graphed(tower, mode=RunMode.STATIC)).adapter) is adapter_class


def test_graphed_equals_tower_per_item(family, towers, make_grid, make_pixels):
    """Mixes of images and videos, more items than a batch holds and items over the largest budget; one call under
    inference_mode, one under no_grad, one plain; every field of each item against the tower on that item alone."""
    tower, reference = towers
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=4, mode=RunMode.STATIC)
    gen = np.random.default_rng(5)
    videos = 0
    for case, mode in enumerate((torch.inference_mode, torch.no_grad, torch.enable_grad)):
        grid = make_grid(gen, 7, max_t=3, video_share=0.5)
        grid[case] = [1, 12, 12]  # over the largest budget: eager
        videos += int((grid[:, 0] > 1).sum())
        pixels = make_pixels(grid, seed=case)
        with mode():
            out = fast(pixels, grid_thw=torch.from_numpy(grid))
        assert type(out) is type(reference(pixels[:16], grid_thw=torch.tensor([[1, 4, 4]])))
        for i, (got, want) in enumerate(zip(split(out, grid), per_item(reference, pixels, grid))):
            assert got.keys() == want.keys()
            for name in want:
                assert not got[name].requires_grad
                assert rel_err(got[name], want[name]) < RTOL, (mode.__name__, i, grid[i].tolist(), name)
    assert videos > 0
    stats = encgraph.graphs(fast).stats
    assert stats["graph_items"] > 0 and set(stats["eager_reasons"]) == {"tokens over the largest budget"}


def test_return_tuple(towers, make_pixels):
    tower, reference = towers
    grid = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 6, 2]])
    pixels = make_pixels(grid.numpy())
    with torch.no_grad():
        want = reference(pixels, grid, return_dict=False)
        got = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)(pixels, grid, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want)
    for a, b in zip(got, want):
        for x, y in zip(*((a, b) if isinstance(b, list) else ([a], [b]))):
            assert rel_err(x, y) < RTOL


# ------------------------------------------------------------------ the thinker calls its tower
_AUDIO = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16,
              output_dim=24, n_window=4, max_source_positions=16)
_TEXT = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


def thinker(family: str, vision_config) -> torch.nn.Module:
    """The tiny thinker (``model.thinker`` of the full Omni model) around a tower of ``vision_config``."""
    torch.manual_seed(0)
    if family == "qwen2_5_omni":
        from transformers.models.qwen2_5_omni import configuration_qwen2_5_omni as c
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        config = c.Qwen2_5OmniThinkerConfig(vision_config=vision_config, audio_config=_AUDIO, text_config=_TEXT)
        return m.Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as c
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    text = dict(_TEXT, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1)
    config = c.Qwen3OmniMoeThinkerConfig(vision_config=vision_config, audio_config=_AUDIO, text_config=text)
    return m.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()


def test_thinker_features_unchanged_with_its_tower_graphed(family, qwen_towers, make_pixels):
    """``get_image_features`` (four images, one over the largest budget) and ``get_video_features`` (two videos),
    every field, as the thinker computes them with its own tower and with the tower graphed in place."""
    model = thinker(family, qwen_towers[family]().config)
    images = np.array([[1, 4, 8], [1, 12, 12], [1, 4, 4], [1, 8, 4]])
    videos = np.array([[2, 4, 4], [3, 2, 4]])
    calls = [("get_image_features", make_pixels(images), images), ("get_video_features", make_pixels(videos, seed=1), videos)]
    with torch.no_grad():
        want = [getattr(model, fn)(pixels, torch.from_numpy(grid)) for fn, pixels, grid in calls]
        # The thinker's tower: model.visual up to transformers 5.15's layout, model.model.visual in 5.25's.
        own = model.model.visual if hasattr(model.model, "visual") else model.visual
        tower = encgraph.graphed(own, budgets=BUDGETS, max_items=2, mode=RunMode.STATIC)
        got = [getattr(model, fn)(pixels, torch.from_numpy(grid)) for fn, pixels, grid in calls]
    assert encgraph.graphs(tower).stats["graph_items"] > 0
    for (fn, _, _), a, b in zip(calls, got, want):
        assert type(a) is type(b) and list(a.keys()) == list(b.keys()), fn
        for key in b:  # pooler_output: a tuple per item; deepstack_features: a list of such tuples
            (flat_a, spec_a), (flat_b, spec_b) = pytree.tree_flatten(a[key]), pytree.tree_flatten(b[key])
            assert spec_a == spec_b, (fn, key)
            for i, (x, y) in enumerate(zip(flat_a, flat_b)):
                assert rel_err(x, y) < RTOL, (fn, key, i)


def test_unwrap_restores_the_encoder(towers):
    tower, _ = towers
    config = tower.config
    before = config._attn_implementation
    state = {k: v.clone() for k, v in tower.state_dict().items()}
    hook = encgraph.graphs(encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC))
    grid = torch.tensor([[1, 4, 4], [2, 2, 4]])
    with torch.no_grad():
        tower(torch.randn(int(grid.prod(-1).sum()), 24), grid)  # the adapter's rewrites engaged, then put back
    assert hook.unwrap() is tower
    assert list(tower.state_dict()) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in tower.state_dict().items())
    assert tower.config is config and config._attn_implementation == before
    assert all(b.attn.config is config for b in tower.blocks)
    assert all("forward" not in m.__dict__ for m in tower.modules())
