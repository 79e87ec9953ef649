"""``graphed(tower)`` as a drop-in, as a new user meets it (issue 14): every grad mode in any order, one item's
bad values never reaching another, the tower's whole output, refusals at wrap time, per-call requests answered
like the tower, and the small edges (unwrap, options, configs). CPU, tiny random towers, STATIC mode."""

from __future__ import annotations

import contextlib
import copy
import logging

import numpy as np
import pytest
import torch

from encgraph.capture.records import RunMode
import encgraph
from tests.toy_models import SequenceFirst
from encgraph.errors import ConfigError, ConfigTypeError
from encgraph.models.graphed import AUTOGRAD
from tests.models.fixtures_fixed import tiny_siglip

BUDGETS = [8, 16, 32, 64]
GRID = np.array([[1, 4, 6], [1, 8, 8], [2, 4, 4], [1, 2, 2]], dtype=np.int64)

MODES = {
    "inference": torch.inference_mode,
    "no_grad": torch.no_grad,
    "plain": contextlib.nullcontext,
}


def leaves(out) -> dict[str, torch.Tensor]:
    """Every tensor of a tower output by name (None fields left out: compared separately)."""
    found = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            found[key] = value
        elif isinstance(value, (list, tuple)):
            found.update({f"{key}.{i}": v for i, v in enumerate(value) if isinstance(v, torch.Tensor)})
    return found


def assert_same_output(out, ref, tol=1e-5):
    assert type(out) is type(ref)
    # The same fields are set (a field the tower fills is never None here).
    assert {k for k, v in out.items() if v is not None} == {k for k, v in ref.items() if v is not None}
    a, b = leaves(out), leaves(ref)
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name].detach(), b[name].detach(), rtol=tol, atol=tol, msg=name)


def pixels_for(grid, seed=0):
    from tests.models.conftest import random_pixels

    return random_pixels(grid, seed=seed)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen(request, qwen_towers):
    torch.manual_seed(0)
    tower = qwen_towers[request.param]()
    return tower, copy.deepcopy(tower)


# ------------------------------------------------------------------ 1. grad modes


@pytest.mark.parametrize("order", [("inference", "no_grad", "plain", "inference"), ("plain", "inference", "no_grad")])
def test_qwen_every_grad_mode_in_any_order(qwen, order):
    tower, ref_tower = qwen
    tower.requires_grad_(False)  # plain calls then need no autograd: the graphs answer them
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, grid = pixels_for(GRID), torch.from_numpy(GRID)
    with torch.no_grad():
        ref = ref_tower(pixels, grid_thw=grid)
    for mode in order:
        with MODES[mode]():
            out = fast(pixels, grid_thw=grid)
        assert_same_output(out, ref)
        assert not out.pooler_output.requires_grad
    assert encgraph.graphs(fast).stats["stock_calls"] == 0 and encgraph.graphs(fast).stats["calls"] == len(order)


@pytest.mark.parametrize("order", [("inference", "no_grad", "plain"), ("no_grad", "inference")])
def test_fixed_and_generic_every_grad_mode(order):
    siglip = tiny_siglip().requires_grad_(False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).requires_grad_(False)
    for module, x in ((siglip, torch.randn(3, 3, 32, 32)), (net, torch.randn(5, 8))):
        fast = encgraph.graphed(module, budgets=[1, 2, 4], mode=RunMode.STATIC)
        with torch.no_grad():
            ref = module(x)
        for mode in order:
            with MODES[mode]():
                out = fast(x)
            if isinstance(out, torch.Tensor):
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            else:
                assert_same_output(out, ref)


def test_autograd_asked_for_runs_the_towers_own_forward(qwen, caplog):
    tower, ref_tower = qwen
    tower.requires_grad_(True)  # as from_pretrained leaves them
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, grid = pixels_for(GRID), torch.from_numpy(GRID)
    with caplog.at_level(logging.INFO, logger="encgraph"):
        out = fast(pixels, grid_thw=grid)
        fast(pixels, grid_thw=grid)
    ref = ref_tower(pixels, grid_thw=grid)
    assert out.pooler_output.requires_grad and out.pooler_output.grad_fn is not None
    assert_same_output(out, ref)
    out.pooler_output.sum().backward()  # a real backward pass through the tower
    assert next(tower.parameters()).grad is not None
    stats = encgraph.graphs(fast).stats
    assert stats["eager_reasons"][AUTOGRAD] == 2 and stats["stock_calls"] == 2 and stats["calls"] == 0
    assert sum(AUTOGRAD in r.message for r in caplog.records) == 1  # logged once
    # An input that requires grad counts as asking for autograd too, parameters frozen or not.
    tower.requires_grad_(False)
    leaf = pixels.clone().requires_grad_(True)
    assert fast(leaf, grid_thw=grid).pooler_output.requires_grad
    with torch.no_grad():
        fast(leaf, grid_thw=grid)  # no_grad: the graphs answer
    assert encgraph.graphs(fast).stats["calls"] == 1


def test_runner_buffers_never_become_inference_tensors(qwen):
    tower, _ = qwen
    runner = encgraph.EncoderGraphRunner(encgraph.models.wrap(tower), budgets=BUDGETS, mode=RunMode.STATIC)
    inputs = (pixels_for(GRID), torch.from_numpy(GRID))
    with torch.inference_mode():
        first = runner(inputs)  # allocates and "captures" lazily inside inference_mode
    assert not any(t.is_inference() for b in runner.buffers.values() for t in b.storage.values())
    second = runner(inputs)  # outside it: the buffers are written again
    for a, b in zip(first, second):
        torch.testing.assert_close(a["pooler_output"], b["pooler_output"])


# ------------------------------------------------------------------ 2. isolation and memory


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_a_poisoned_item_never_reaches_the_others(qwen, poison):
    tower, ref_tower = qwen
    fast = encgraph.graphed(tower, budgets=[64], max_items=8, mode=RunMode.STATIC)  # one batch holds every item
    pixels = pixels_for(GRID, seed=1)
    starts = np.concatenate(([0], np.cumsum(GRID.prod(1))))
    bad = pixels.clone()
    bad[starts[1] + 3] = poison  # one patch row of item 1
    with torch.no_grad():
        out = fast(bad, grid_thw=torch.from_numpy(GRID))
        assert len(encgraph.graphs(fast).runner.plan((bad, torch.from_numpy(GRID))).batches) == 1
        tokens = (GRID.prod(1) // 4).tolist()
        mine = torch.split(out.pooler_output, tokens)
        for i in (0, 2, 3):
            ref = ref_tower(pixels[starts[i] : starts[i + 1]], grid_thw=torch.from_numpy(GRID[i : i + 1]))
            assert bool(torch.isfinite(mine[i]).all()), f"item {i} was reached by item 1's {poison}"
            torch.testing.assert_close(mine[i], ref.pooler_output, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ 3. the whole output


def test_qwen_returns_every_field_and_tuples(qwen):
    tower, ref_tower = qwen
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, grid = pixels_for(GRID), torch.from_numpy(GRID)
    with torch.no_grad():
        out, ref = fast(pixels, grid_thw=grid), ref_tower(pixels, grid_thw=grid)
        assert out.last_hidden_state is not None
        assert_same_output(out, ref)
        as_tuple = fast(pixels, grid_thw=grid, return_dict=False)
        ref_tuple = ref_tower(pixels, grid_thw=grid, return_dict=False)
    assert len(as_tuple) == len(ref_tuple)
    for a, b in zip(as_tuple, ref_tuple):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_siglip_returns_every_field():
    tower = tiny_siglip()
    ref_tower = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=[1, 2, 4], mode=RunMode.STATIC)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert_same_output(fast(x), ref_tower(x))


# ------------------------------------------------------------------ 4. refusals at wrap time


def test_hf_model_without_an_adapter_takes_the_any_module_path():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16))
    model.eval()
    ref = copy.deepcopy(model)
    fast = encgraph.graphed(model, budgets=[1, 2, 4], mode=RunMode.STATIC)
    assert fast is model and not encgraph.graphs(model).family
    ids = torch.randint(0, 100, (3, 7))
    with torch.no_grad():
        for _ in range(3):  # first call: the model's own forward; then the graphs of this shape
            assert_same_output(fast(input_ids=ids), ref(input_ids=ids))
    stats = encgraph.graphs(model).stats
    assert stats["calls"] == 2 and stats["graph_items"] == 6 and stats["eager_reasons"] == {"first call of this shape": 1}


def test_generic_keeps_a_model_output_type():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return BaseModelOutputWithPooling(last_hidden_state=h, pooler_output=h.mean(-1))

    head = Head().requires_grad_(False)
    fast = encgraph.graphed(head, budgets=[1, 2, 4], mode=RunMode.STATIC)
    x = torch.randn(5, 4)
    out = fast(x)
    assert isinstance(out, BaseModelOutputWithPooling)
    assert_same_output(out, head(x))


# ------------------------------------------------------------------ 5. self-check


def test_self_check_drops_budgets_of_a_module_that_mixes_rows(caplog):
    net = SequenceFirst().requires_grad_(False).eval()
    fast = encgraph.graphed(net, budgets=[1, 2, 4, 8], mode=RunMode.STATIC)
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        for n in (3, 5, 7, 40):
            x = torch.randn(n, 6)
            torch.testing.assert_close(fast(x), encgraph.graphs(net).original_forward(x), rtol=1e-5, atol=1e-5)
    # No split or padded batch can stand in for a module that mixes rows: the shape's graphs go at their self-check,
    # and every call (the first included) is answered by the module's own forward on all its rows.
    assert any("self-check" in r.message for r in caplog.records)
    stats = encgraph.graphs(fast).stats
    assert stats["stock_calls"] == 4 and stats["calls"] == 0 and stats["shapes"]["live"] == []
    assert {k for k in stats["eager_reasons"] if "not batch-first" in k}
    # Off by choice: the budgets stay (and the module is silently wrong: why the check is on by default).
    fast = encgraph.graphed(net, budgets=[1, 2, 4, 8], verify=False, mode=RunMode.STATIC)
    x = torch.randn(3, 6)
    fast(x)  # the first call of a shape is the module's own
    assert not torch.allclose(fast(x), encgraph.graphs(net).original_forward(x), atol=1e-3)


def test_self_check_keeps_correct_budgets_and_reports_its_cost(qwen):
    tower, _ = qwen
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    info = encgraph.graphs(fast).capture()
    check = info["selfcheck"]
    assert set(check["checked"]["default"]) == set(BUDGETS)
    assert max(check["checked"]["default"].values()) < 1e-4
    assert check["seconds"] >= 0 and not info["failed"]


# ------------------------------------------------------------------ 6. calls the tower accepts


def test_keywords_the_tower_swallows_are_accepted(qwen):
    tower, ref_tower = qwen
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, grid = pixels_for(GRID), torch.from_numpy(GRID)
    with torch.no_grad():
        out = fast(pixels, grid_thw=grid, use_cache=False, output_attentions=False)
        assert_same_output(out, ref_tower(pixels, grid_thw=grid))
    assert encgraph.graphs(fast).stats["stock_calls"] == 0


@pytest.mark.parametrize("request_", ["output_hidden_states", "output_attentions"])
def test_per_layer_requests_are_answered_by_the_tower(qwen, request_):
    tower, ref_tower = qwen
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    pixels, grid = pixels_for(GRID), torch.from_numpy(GRID)
    with torch.no_grad():
        out = fast(pixels, grid_thw=grid, **{request_: True})
        ref = ref_tower(pixels, grid_thw=grid, **{request_: True})
    assert_same_output(out, ref)
    assert encgraph.graphs(fast).stats["eager_reasons"] == {f"{request_} requested": 1}
    # The next plain call replays; between calls the tower keeps its own attention (switched only inside the
    # adapter's forwards).
    with torch.no_grad():
        fast(pixels, grid_thw=grid)
    assert encgraph.graphs(fast).stats["calls"] == 1
    assert all(b.attn.config._attn_implementation == ref_tower.blocks[0].attn.config._attn_implementation
               for b in tower.blocks)


def test_fixed_hidden_states_asked_after_capture_are_answered_by_the_tower():
    tower = tiny_siglip()
    ref_tower = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=[1, 2, 4], mode=RunMode.STATIC)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fast(x)  # captures without hidden states
        out = fast(x, output_hidden_states=True)
        assert_same_output(out, ref_tower(x, output_hidden_states=True))
        out = fast(x, output_attentions=True)
        ref = ref_tower(x, output_attentions=True)
    assert type(out) is type(ref)
    assert encgraph.graphs(fast).stats["stock_calls"] == 2


# ------------------------------------------------------------------ 7. small edges


def test_unwrap_gives_the_module_back_as_it_was(qwen):
    tower, ref_tower = qwen
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    with torch.no_grad():
        fast(pixels_for(GRID), grid_thw=torch.from_numpy(GRID))
    assert encgraph.graphs(fast).unwrap() is tower
    assert "forward" not in tower.__dict__
    with pytest.raises(ConfigError, match="encgraph.graphed"):
        encgraph.graphs(tower)
    with torch.no_grad():
        assert_same_output(tower(pixels_for(GRID), grid_thw=torch.from_numpy(GRID)),
                           ref_tower(pixels_for(GRID), grid_thw=torch.from_numpy(GRID)))


def test_unknown_graphed_option_lists_the_valid_ones(qwen):
    tower, _ = qwen
    with pytest.raises(ConfigTypeError, match="budgets") as err:
        encgraph.graphed(tower, budget=[8], mode=RunMode.STATIC)
    assert "'budget'" in str(err.value) and isinstance(err.value, TypeError)
    # Nothing stays changed on the tower after a refused option.
    assert all(b.attn.config is tower.config for b in tower.blocks)
    with pytest.raises(ConfigError):
        encgraph.graphed(tower, budgets=[0], mode=RunMode.STATIC)
    assert all(b.attn.config is tower.config for b in tower.blocks)


def test_wrapping_leaves_the_users_config_alone(qwen):
    tower, _ = qwen
    config = tower.config
    before = config._attn_implementation
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    assert tower.config is config and config._attn_implementation == before and fast.config is config
    twin = type(tower)._from_config(tower.config)  # a second tower from the same config, while wrapped
    assert twin.config._attn_implementation == before


def test_measure_costs_takes_the_call_form(qwen):
    tower, _ = qwen
    runner = encgraph.EncoderGraphRunner(encgraph.models.wrap(tower), budgets=BUDGETS, mode=RunMode.STATIC)
    grids = [np.array([[1, 4, 4]]), np.array([[1, 8, 8], [1, 4, 6]]), np.array([[2, 6, 6]])]
    samples = [(pixels_for(g, seed=i), torch.from_numpy(g)) for i, g in enumerate(grids)]
    costs = runner.measure_costs(samples)
    assert costs.paths == ("default",) and runner.costs is costs


def test_run_mode_is_exported():
    assert encgraph.RunMode.STATIC.value == "static"
