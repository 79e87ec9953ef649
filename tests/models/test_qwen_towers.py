"""Qwen-VL adapters on tiny random towers (CPU, fp32): ``graphed(tower)`` (the padded static forward, STATIC
mode) and the adapter's eager forward equal the tower's own forward per item; unwrap restores the tower; bad
inputs raise clear errors; the static forward never syncs the host."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from encgraph.capture.records import RunMode
import encgraph
from tests.models.conftest import QWEN_TOWERS
from encgraph.models import wrap
from encgraph.models.attention import ATTENTION_NAME
from encgraph.models.qwen2_5_vl import Qwen25VLAdapter
from encgraph.models.qwen2_vl import Qwen2VLAdapter
from encgraph.models.qwen3_vl import Qwen3VLAdapter

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
ADAPTERS = {"qwen2_vl": Qwen2VLAdapter, "qwen2_5_vl": Qwen25VLAdapter, "qwen3_vl": Qwen3VLAdapter,
            "qwen3_vl_moe": Qwen3VLAdapter}
RTOL = 1e-5
BUDGETS = [8, 16, 32, 64]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def named(out) -> dict[str, torch.Tensor]:
    """The outputs a graphed tower must reproduce: pooler_output and any deepstack features."""
    d = {"pooler_output": out.pooler_output}
    for i, f in enumerate(getattr(out, "deepstack_features", None) or []):
        d[f"deepstack_{i}"] = f
    return d


def per_item_reference(tower, pixels, grid) -> list[dict[str, torch.Tensor]]:
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    refs = []
    with torch.no_grad():
        for i in range(grid.shape[0]):
            out = tower(pixels[starts[i] : starts[i + 1]], grid_thw=torch.from_numpy(grid[i : i + 1]))
            refs.append(named(out))
    return refs


def split(out, grid, merge=2) -> list[dict[str, torch.Tensor]]:
    tokens = (grid.prod(1) // merge**2).tolist()
    parts = {name: torch.split(t, tokens) for name, t in named(out).items()}
    return [{name: p[i] for name, p in parts.items()} for i in range(len(tokens))]


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def towers(family, qwen_towers):
    """``(tower, reference)``: the tower to wrap and an independent deep copy (its own config, so its attention
    stays the original implementation while the first is wrapped)."""
    torch.manual_seed(0)
    tower = qwen_towers[family]()
    return tower, copy.deepcopy(tower)


def test_graphed_equals_tower_per_item(family, towers, make_grid, make_pixels):
    tower, ref_tower = towers
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=4, mode=RunMode.STATIC)
    assert isinstance(encgraph.graphs(fast).adapter, ADAPTERS[family])
    gen = np.random.default_rng(3)
    for case in range(6):
        # Up to 10 items: more than max_items, several batches; some items over the largest budget run eagerly.
        grid = make_grid(gen, int(gen.integers(1, 11)))
        pixels = make_pixels(grid, seed=case)
        out = fast(pixels, grid_thw=torch.from_numpy(grid))
        assert type(out).__name__ == type(ref_tower(pixels[:16], grid_thw=torch.tensor([[1, 4, 4]]))).__name__
        refs = per_item_reference(ref_tower, pixels, grid)
        for i, (got, ref) in enumerate(zip(split(out, grid), refs)):
            assert got.keys() == ref.keys()
            for name in ref:
                assert rel_err(got[name], ref[name]) < RTOL, (case, i, grid[i].tolist(), name)
    stats = encgraph.graphs(fast).stats
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0
    assert stats["paths"]["default"]["padded_tokens"] > 0


def test_eager_forward_equals_tower(towers, make_grid, make_pixels):
    tower, ref_tower = towers
    adapter = wrap(tower)
    grid = make_grid(np.random.default_rng(4), 5)
    pixels = make_pixels(grid)
    inputs = adapter.inputs(pixels, grid)
    refs = per_item_reference(ref_tower, pixels, grid)
    for i, ref in enumerate(refs):
        got = adapter.forward_eager("default", adapter.select(inputs, [i]))
        for name in ref:
            assert rel_err(got[name], ref[name]) < RTOL, (i, name)
    # A non-contiguous selection (items out of order) keeps the rows of each item together.
    got = adapter.forward_eager("default", adapter.select(inputs, [3, 0]))["pooler_output"]
    want = torch.cat([refs[3]["pooler_output"], refs[0]["pooler_output"]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_static_forward_with_stale_buffers_matches(towers, make_grid, make_pixels):
    # A batch after a larger one: every row of every buffer is rewritten (fill rules), nothing stale leaks.
    tower, ref_tower = towers
    adapter = wrap(tower)
    runner = encgraph.EncoderGraphRunner(adapter, budgets=[64], max_items=4, mode=RunMode.STATIC)
    big = np.array([[1, 8, 8], [2, 4, 6], [1, 2, 2]])
    runner(adapter.inputs(make_pixels(big, seed=1) * 1e3, big))
    small = np.array([[1, 2, 4]])
    pixels = make_pixels(small, seed=2)
    got = runner(adapter.inputs(pixels, small))[0]
    ref = per_item_reference(ref_tower, pixels, small)[0]
    for name in ref:
        assert rel_err(got[name], ref[name]) < RTOL


@pytest.mark.parametrize("family", sorted(QWEN_TOWERS))  # the Omni encoders too: they share these adapters
def test_static_forward_never_syncs_the_host(family, qwen_towers):
    # On the meta device every tensor is data-free: .item(), .tolist(), nonzero() or a data-dependent shape
    # would raise. What runs here is exactly what a CUDA graph captures.
    torch.manual_seed(0)
    tower = qwen_towers[family]().to("meta")
    adapter = wrap(tower, min_budget=8, max_budget=32)
    for budget in (8, 32):
        specs = adapter.buffer_specs("default", budget, 4, 8)
        buffers = {n: torch.zeros(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
        out = adapter.forward_static("default", buffers, budget)
        assert set(out) == set(adapter.config.path("default").outputs)
        assert all(t.shape[0] == budget for t in out.values())


def test_unwrap_restores_attention(towers):
    tower, _ = towers
    config = tower.config
    before = config._attn_implementation
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    # The attention modules read the packed implementation from a private copy; the tower's own config (the
    # user's, and the full model's vision_config) is untouched.
    assert tower.config is config and config._attn_implementation == before
    # Switched only inside the adapter's own forwards: between calls the blocks hold the tower's own config.
    assert all(b.attn.config is config for b in tower.blocks)
    adapter = encgraph.graphs(fast).adapter
    with adapter._engaged():
        assert all(b.attn.config._attn_implementation == ATTENTION_NAME for b in tower.blocks)
    assert encgraph.graphs(fast).unwrap() is tower
    assert all(b.attn.config is config for b in tower.blocks)


def test_last_hidden_state_and_tuple_output(towers, make_pixels):
    tower, ref_tower = towers
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=4, adapter_options={"last_hidden_state": True}, mode=RunMode.STATIC)
    grid = np.array([[1, 4, 6], [2, 2, 4], [1, 6, 2]])
    pixels = make_pixels(grid)
    with torch.no_grad():
        ref = ref_tower(pixels, grid_thw=torch.from_numpy(grid))
    out = fast(pixels, torch.from_numpy(grid), return_dict=False)
    assert isinstance(out, tuple)
    assert rel_err(out[0], ref.last_hidden_state) < RTOL  # Qwen2.5-VL: in the tower's own (windowed) order
    assert rel_err(out[1], ref.pooler_output) < RTOL


def test_registry_knows_every_qwen_config():
    from encgraph.models import known_configs

    assert {"Qwen2VLVisionConfig", "Qwen2_5_VLVisionConfig", "Qwen3VLVisionConfig",
            "Qwen3VLMoeVisionConfig"} <= set(known_configs())


BAD = [
    # (description, call kwargs maker, error, message fragment)
    ("wrong channels", lambda p, g: dict(hidden_states=p[:, :10], grid_thw=g), encgraph.InputError, "channels"),
    ("rows vs grid", lambda p, g: dict(hidden_states=p[:-4], grid_thw=g), encgraph.InputError, "sum\\(t\\*h\\*w\\)"),
    ("integer pixels", lambda p, g: dict(hidden_states=p.long(), grid_thw=g), encgraph.InputTypeError, "floating"),
    ("float grid", lambda p, g: dict(hidden_states=p, grid_thw=g.float()), encgraph.InputTypeError, "integer"),
    ("grid shape", lambda p, g: dict(hidden_states=p, grid_thw=g[:, :2]), encgraph.InputError, "\\(n, 3\\)"),
    ("odd h", lambda p, g: dict(hidden_states=p, grid_thw=torch.tensor([[1, 3, 4]])), encgraph.InputError, "multiples"),
    ("zero t", lambda p, g: dict(hidden_states=p[:0], grid_thw=torch.tensor([[0, 2, 2]])), encgraph.InputError, ">= 1"),
    ("device", lambda p, g: dict(hidden_states=p.to("meta"), grid_thw=g), encgraph.InputError, "device|on cpu"),
    ("no grid", lambda p, g: dict(hidden_states=p), encgraph.InputTypeError, "grid_thw"),
    ("return_dict not a bool", lambda p, g: dict(hidden_states=p, grid_thw=g, return_dict="yes"),
     encgraph.InputTypeError, "return_dict"),
]
# Per-layer requests (output_hidden_states=True) and keywords the tower's **kwargs swallows are valid calls now,
# answered like the tower: tests/models/test_dropin.py.


@pytest.mark.parametrize("what, make, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(qwen_towers, make_pixels, what, make, error, match):
    torch.manual_seed(0)
    fast = encgraph.graphed(qwen_towers["qwen2_5_vl"](), budgets=BUDGETS, mode=RunMode.STATIC)
    grid = torch.tensor([[1, 4, 4], [2, 2, 2]])
    pixels = make_pixels(grid.numpy())
    with pytest.raises(error, match=match):
        fast(**make(pixels, grid))


def test_precomputed_metadata_keywords_are_accepted(towers, make_pixels):
    tower, ref_tower = towers
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    grid = torch.tensor([[1, 4, 4]])
    pixels = make_pixels(grid.numpy())
    out = fast(pixels, grid_thw=grid, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32), output_attentions=False)
    with torch.no_grad():
        assert rel_err(out.pooler_output, ref_tower(pixels, grid_thw=grid).pooler_output) < RTOL


def test_tuple_output_needs_last_hidden_state(qwen_towers, make_pixels):
    torch.manual_seed(0)
    fast = encgraph.graphed(qwen_towers["qwen2_5_vl"](), budgets=BUDGETS, adapter_options={"last_hidden_state": False}, mode=RunMode.STATIC)
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(encgraph.InputError, match="last_hidden_state=False"):
        fast(make_pixels(grid.numpy()), grid_thw=grid, return_dict=False)


def test_bad_adapter_options(qwen_towers):
    torch.manual_seed(0)
    with pytest.raises(encgraph.ConfigError, match="max_budget"):
        wrap(qwen_towers["qwen2_vl"](), min_budget=64, max_budget=32)
    with pytest.raises(encgraph.InputTypeError, match="last_hidden_state"):
        wrap(qwen_towers["qwen2_vl"](), last_hidden_state="yes")
    with pytest.raises(encgraph.InputTypeError, match="vision tower"):
        Qwen25VLAdapter(torch.nn.Linear(2, 2))
