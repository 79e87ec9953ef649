"""The packed-grid families (GLM-4V, Qwen3.5, ERNIE-4.5-VL, Kimi-K2.5, MiniCPM-V 4.6, PaddleOCR-VL, Pixtral, HunYuan-VL,
SigLIP2 NaFlex, Idefics3, SmolVLM; tiny random towers, CPU,
fp32): ``graphed(tower)`` (the padded static forward, STATIC mode, and eager for what no budget holds) equals the
tower's own forward per item, every field, in every grad mode; the full model's feature functions are unchanged
with the tower replaced by ``graphed(tower)``; the static forward never reads the host (meta device).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.errors import EncgraphError, InputError  # noqa: E402
from encgraph.models import known_configs, wrap  # noqa: E402
from tests.models.fixtures_families import (  # noqa: E402
    FAMILIES,
    masked,
    naflex,
    padded,
    random_grid,
    rel_err,
    strip,
    unpad,
)

BUDGETS = [8, 16, 32]  # an item of 12 x 12 patches (36 tokens) runs eagerly
RTOL = 1e-5
NAMES = sorted(name for name, family in FAMILIES.items() if family.tower_tests)
WITH_MODEL = sorted(name for name, family in FAMILIES.items() if family.model is not None)


@pytest.fixture(params=NAMES)
def family(request):
    FAMILIES[request.param].skip_if_unsupported()
    return FAMILIES[request.param]


def per_item(family, tower, rows, grid):
    starts = np.concatenate(([0], np.cumsum(grid.prod(1))))
    with torch.no_grad():
        return [family.split(family.call(tower, rows[starts[i]:starts[i + 1]], grid[i:i + 1], reference=True),
                             grid[i:i + 1])[0] for i in range(grid.shape[0])]


def assert_items_equal(family, out, refs, grid, what=""):
    for i, (got, ref) in enumerate(zip(family.split(out, grid), refs)):
        for name in ref:
            err = rel_err(got[name], ref[name])
            assert err < RTOL, (what, i, grid[i].tolist(), name, err)


def test_registered(family):
    tower = family.tower()
    assert type(tower.config).__name__ in known_configs()
    assert type(wrap(tower)).__name__ == family.adapter
    assert type(encgraph.graphs(encgraph.graphed(tower, mode=RunMode.STATIC)).adapter).__name__ == family.adapter


def test_default_budgets_are_the_familys_and_the_options_override_them(family):
    """Each budget-ladder family's default ``(min_budget, max_budget)`` is its class's ``default_budgets`` (data, not
    a constructor of its own), and the options still set them."""
    adapter = wrap(family.tower())
    if not hasattr(type(adapter), "default_budgets"):
        pytest.skip(f"{family.adapter} has no token-budget ladder")
    assert (adapter.min_budget, adapter.max_budget) == type(adapter).default_budgets
    low = type(adapter).default_budgets[0]
    adapter = wrap(family.tower(), min_budget=low * 2, max_budget=low * 8)
    assert (adapter.min_budget, adapter.max_budget) == (low * 2, low * 8)


def test_graphed_equals_tower_per_item(family):
    """Random mixes (videos where the family has them), more items than a batch holds and items over the largest
    budget; one call under inference_mode, then one under no_grad, then a plain one; each item against the
    tower's own forward on that item alone."""
    tower = family.tower()  # frozen: no autograd asked for, so every grad mode replays
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=BUDGETS, max_items=4, mode=RunMode.STATIC)
    gen = np.random.default_rng(3)
    for case, mode in enumerate((torch.inference_mode, torch.no_grad, torch.enable_grad)):
        grid = random_grid(gen, 7, family)
        grid[case] = [1, 12, 12]  # over the largest budget: eager
        rows = family.pixels(grid, seed=case)
        with mode():
            out = family.call(fast, rows, grid)
        assert type(out) is type(family.call(reference, rows[:16], np.array([[1, 4, 4]]), reference=True))
        assert all(not t.requires_grad for t in out.values() if t is not None)
        assert_items_equal(family, out, per_item(family, reference, rows, grid), grid, mode.__name__)
    stats = encgraph.graphs(fast).stats
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0
    assert stats["paths"]["default"]["padded_tokens"] > 0
    info = encgraph.graphs(fast).runner.capture_info  # the self-check on the adapter's sample_inputs kept every budget
    assert not info["failed"] and set(info["selfcheck"]["checked"]["default"]) == set(BUDGETS)


def test_return_tuple(family):
    tower = family.tower()
    reference = copy.deepcopy(tower)
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    rows = family.pixels(grid)
    with torch.no_grad():
        want = family.call(reference, rows, grid, reference=True, return_dict=False)
        got = family.call(encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC), rows, grid, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want)
    for a, b in zip(got, want):
        if family.call_style == "naflex":  # padding rows: see tests/models/test_siglip2_naflex.py
            a, b = unpad(a, grid), unpad(b, grid)
        assert rel_err(a, b) < RTOL


@pytest.mark.parametrize("name", WITH_MODEL)
def test_model_features_unchanged(name):
    """The model's ``get_image_features`` (and ``get_video_features``), every field, with its tower replaced by
    ``graphed(tower)``: what the README's one-line drop-in changes."""
    family = FAMILIES[name]
    family.skip_if_unsupported()
    model = family.model()
    inputs = family.feature_calls()
    base = getattr(model, family.base_attr) if family.base_attr else model
    images = np.array([[1, 4, 8], [1, 12, 12], [1, 4, 4], [1, 8, 4]])  # feature_calls' (NaFlex: padding rows dropped)
    def run(fn, args):
        return getattr(base, fn)(**args) if isinstance(args, dict) else getattr(base, fn)(*args)

    with torch.no_grad():
        want = [run(fn, args) for fn, args in inputs]
        tower = getattr(base, family.tower_attr)
        setattr(base, family.tower_attr, encgraph.graphed(tower, budgets=BUDGETS, max_items=2, mode=RunMode.STATIC))
        got = [run(fn, args) for fn, args in inputs]
    assert encgraph.graphs(getattr(base, family.tower_attr)).stats["graph_items"] > 0
    for (fn, _), a, b in zip(inputs, got, want):
        assert list(a.keys()) == list(b.keys()), (fn, list(a.keys()), list(b.keys()))
        for key in b.keys():
            x, y = (a[key], b[key]) if isinstance(b[key], (tuple, list)) else ((a[key],), (b[key],))
            assert len(x) == len(y), (fn, key)
            for i, (p, q) in enumerate(zip(x, y)):
                assert (p is None) == (q is None), (fn, key, i)  # hidden states the call did not select
                if family.call_style == "naflex" and key == "last_hidden_state":
                    p, q = unpad(p, images), unpad(q, images)
                assert q is None or rel_err(p, q) < RTOL, (fn, key, i)
    assert encgraph.graphs(getattr(base, family.tower_attr)).unwrap() is tower


def test_static_forward_reads_nothing_on_the_host(family):
    """On the meta device every tensor is data-free: ``.item()``, ``.tolist()``, ``nonzero()``, a data-dependent
    shape or printing a tensor would raise. What runs here is exactly what a CUDA graph captures."""
    with torch.device("meta"):
        tower = family.tower()
    from encgraph.capture.buffers import PathBuffers

    adapter = wrap(tower)
    ladder = (8, 32)
    buffers = PathBuffers("default", {b: adapter.buffer_specs("default", b, 4, 8) for b in ladder},
                          torch.device("meta"))
    outputs = set(adapter.config.path("default").outputs)
    for budget in ladder:  # the runner's own buffers on the meta device, filled by their rules (no item)
        out = adapter.forward_static("default", buffers.fill(budget, None), budget)
        assert set(out) == outputs and all(t.device.type == "meta" and t.shape[0] == budget for t in out.values())


def test_all_padding_batch_is_finite(family):
    """The batch a capture runs (every buffer at its fill rule, no item) gives finite outputs: padding rows never
    divide by a zero grid or index past a table (NaN there would reach the shared pool)."""
    from encgraph.capture.buffers import PathBuffers

    adapter = wrap(family.tower())
    buffers = PathBuffers("default", {16: adapter.buffer_specs("default", 16, 4, 8)}, torch.device("cpu"))
    with torch.no_grad():
        out = adapter.forward_static("default", buffers.fill(16, None), 16)
    assert all(torch.isfinite(t).all() for t in out.values())


def test_sample_inputs_and_concat(family):
    tower = family.tower()
    adapter = wrap(tower)
    runner = encgraph.EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=4, mode=RunMode.STATIC)
    for tokens in (8, 21, 32):
        sample = adapter.sample_inputs("default", tokens)
        (spec,) = adapter.item_specs(sample)
        assert tokens - np.sqrt(tokens) <= spec.tokens["default"] <= tokens
        assert sample.pixel_values.dtype == adapter.config.dtype and sample.pixel_values.abs().sum() > 0
    grid_a, grid_b = np.array([[1, 4, 6], [1, 2, 2]]), np.array([[1, 6, 6]])
    args = {"strip": lambda rows, g: (strip(rows), g[:, 1:]), "padded": padded,
            "naflex": naflex, "mask": masked}.get(family.call_style, lambda *a: a)
    parts = [adapter.inputs(*args(family.pixels(g, seed=i), g)) for i, g in enumerate((grid_a, grid_b))]
    both = adapter.concat(parts)
    assert adapter.item_specs(both) == adapter.item_specs(parts[0]) + adapter.item_specs(parts[1])
    with torch.no_grad():
        separate = runner(parts[0]) + runner(parts[1])
        together = runner(both)
    for a, b in zip(together, separate):
        for name in b:
            assert rel_err(a[name], b[name]) < RTOL


def test_unwrap_restores_the_tower(family):
    tower = family.tower()
    before = {id(c): c._attn_implementation for c in _configs(tower)}
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    assert encgraph.graphs(fast).unwrap() is tower
    assert {id(c): c._attn_implementation for c in _configs(tower)} == before
    assert all("forward" not in m.__dict__ for m in tower.modules())


def _configs(tower):
    return list({id(m.config): m.config for m in tower.modules() if hasattr(m, "config")}.values())


def test_bad_inputs(family):
    fast = encgraph.graphed(family.tower(), budgets=BUDGETS, mode=RunMode.STATIC)
    grid = np.array([[1, 4, 4]])
    rows = family.pixels(grid)
    with pytest.raises(InputError, match="patches|rows|strip|sum"):
        if family.call_style == "padded":  # an image larger than the padded batch
            fast(*padded(rows, grid)[:1], image_sizes=torch.tensor([[4 * rows.shape[-1], 5 * rows.shape[-1]]]))
        elif family.call_style == "naflex":  # an image of more rows than the padded batch holds
            fast(*naflex(rows, grid)[:2], spatial_shapes=torch.tensor([[4, 5]]))
        elif family.call_style == "mask":  # a mask of another patch grid than the images'
            images, mask = masked(rows, grid)
            fast(images, patch_attention_mask=mask[:, :3])
        else:
            family.call(fast, rows[:-4], grid)
    odd = np.array([[1, 3, 5]])
    if family.tower_merge > 1 and not family.odd_grids_to_tower:
        with pytest.raises(InputError, match="multiples"):
            family.call(fast, family.pixels(odd), odd)
    else:  # no merge inside the tower (any grid is an item), or the tower's own call: answered as the tower answers
        reference = family.tower()
        with torch.no_grad():
            got, want = family.call(fast, family.pixels(odd), odd), family.call(reference, family.pixels(odd), odd)
        for name in family.fields:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    with pytest.raises(EncgraphError):
        family.call(fast, rows.to(torch.int64), grid)
    if family.call_style != "strip":
        what = "images" if family.call_style in ("padded", "naflex", "mask") else "rows"
        with pytest.raises(InputError, match=rf"expected shape \({what}, "):
            fast(rows.reshape(rows.shape[0], -1)[:, :5], torch.from_numpy(grid))
    with torch.no_grad():  # a keyword the tower's **kwargs swallows is ignored, as the tower ignores it
        plain, extra = family.call(fast, rows, grid), family.call(fast, rows, grid, use_cache=False, foo=1)
    for name in family.fields:
        assert torch.equal(plain[name], extra[name])


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.min_transformers != "5.15"))
def test_older_transformers_is_refused(name, monkeypatch):
    """Kimi-K2.5 and MiniCPM-V (whose towers exist, and differ, in older releases) refuse them at wrap time."""
    import transformers

    family = FAMILIES[name]
    tower = family.tower()
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(encgraph.VersionError, match=rf"adapter needs transformers>={family.min_transformers}, found 5\.17"):
        wrap(tower)


def test_calls_the_graphs_leave_to_the_tower(family):
    """Per-layer hidden states, and autograd (a tower whose parameters require grad, called with grad on), are
    answered by the tower's own forward with its own attention, counted in ``eager_reasons``; Pixtral's adapter
    answers hidden states from its graphs (learned from the first call), each equal to the tower's."""
    tower = family.tower()
    reference = copy.deepcopy(tower)
    fast = encgraph.graphed(tower, budgets=BUDGETS, mode=RunMode.STATIC)
    grid = np.array([[1, 4, 6], [1, 2, 2]])
    rows = family.pixels(grid)
    with torch.no_grad():
        got = family.call(fast, rows, grid, output_hidden_states=True)
        want = family.call(reference, rows, grid, reference=True, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) > 1
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert rel_err(a, b) < RTOL if family.holds_hidden else torch.equal(a, b)
    tower.requires_grad_(True)
    out = family.call(fast, rows, grid)
    assert all(t.requires_grad for t in out.values() if t is not None)
    assert sum(encgraph.graphs(fast).stats["eager_reasons"].values()) == 2 - family.holds_hidden
    if family.holds_hidden:
        tower.requires_grad_(False)
        with torch.no_grad():  # attentions: the tower's own forward
            got = family.call(fast, rows, grid, output_attentions=True)
            want = family.call(reference, rows, grid, reference=True, output_attentions=True)
        assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions))
        assert encgraph.graphs(fast).stats["eager_reasons"]["output_attentions requested"] == 1


def test_compile_regions_are_the_repeated_layers(family):
    """What ``compile="auto"`` compiles on a GPU: every layer of the tower's stack, all of one class."""
    from encgraph.models._hf import repeated_blocks

    tower = family.tower()
    regions = wrap(tower).compile_regions()
    assert len(regions) >= 2 and len({type(r) for r in regions}) == 1
    assert [id(r) for r in regions] == [id(b) for b in repeated_blocks(tower)]
