"""Step-3.7 two-path adapter on the CPU (tiny random model, fp32): per image, the runner's padded static forward
(``RunMode.STATIC``) equals the model's own ``get_image_features`` (every field), with 0..N crops per image, in
every grad mode; the local path overflowing its ladder (partial eager) while the global path keeps its static
forward; the shim inside the model's forward; no host read in the static forwards. The tower alone through ``graphed(tower)``
as the model calls it (global views, then crops with ``output_hidden_states=False``): the model's
``get_image_features`` with the graphed tower equals its own, every field, in every grad mode; other view sizes and
per-layer outputs go to the tower's own forward, counted; views of both sizes concatenated (the serving front).

Geometry (fixtures_multipath): patch 4, 56 px global views (16 tokens) and 40 px crops (9 tokens, the position
table interpolated); ladders global 16 * (1, 2, 4), local 0, 9 * (1, 2, 4).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the Step-3.7 adapter")

import encgraph
from encgraph.models.own_forward import own_forward
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import ConfigError, InputError, UnsupportedModelError
from encgraph.models.deepseek_ocr2 import OcrImages
from encgraph.models.protocol import StockCall
from encgraph.models.registry import wrap
from encgraph.models.step3p7 import Step3p7Adapter, view_tokens
from encgraph.models.step3p7_tower import Step3p7TowerAdapter, TowerViews
from tests.models.fixtures_multipath import (  # one_thread: an autouse fixture
    GRAD_MODES, STEP_IMAGE_TOKEN, STEP_LOCAL, STEP_TEXT, STEP_TINY, grad_mode, rel_err, static_forwards,
    step3p7_model,
    step3p7_views,
)

GLOBAL_SIZE = STEP_TINY["image_size"]
OPTIONS = {"max_images": 4, "max_tiles": 4, "local_size": STEP_LOCAL}
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return step3p7_model()


def views(tiles: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    return step3p7_views(tiles, GLOBAL_SIZE, STEP_LOCAL, seed=seed)


def assert_same_output(got: Any, want: Any) -> None:
    """Every field of ``get_image_features``' output: last_hidden_state, pooler_output per image, and the
    per-layer fields (None unless asked for)."""
    assert type(got) is type(want)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < TOL
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    assert len(got.pooler_output) == len(want.pooler_output)
    for i, (g, w) in enumerate(zip(got.pooler_output, want.pooler_output)):
        assert g.shape == w.shape and rel_err(g, w) < TOL, f"image {i}: {rel_err(g, w):.3g}"
    assert got.hidden_states is None and want.hidden_states is None
    assert got.attentions is None and want.attentions is None


def test_geometry_and_registry(model: torch.nn.Module) -> None:
    adapter = wrap(model, **OPTIONS)
    assert isinstance(adapter, Step3p7Adapter) and isinstance(wrap(model.model, **OPTIONS), Step3p7Adapter)
    assert adapter.tokens == {"global": 16, "local": 9}
    assert (view_tokens(728, 14), view_tokens(504, 14)) == (169, 81)
    assert Step3p7Adapter(model).sizes == {"global": 56, "local": 144}  # the tower's image_size; 36 patches
    from encgraph.packing import dense_ladder

    # The dense default ladder, in multiples of one view's tokens.
    assert EncoderGraphRunner(adapter, mode=RunMode.STATIC).ladders == {
        "global": dense_ladder(16, 64), "local": dense_ladder(9, 36, allow_zero=True)}
    assert adapter.config.path("local").allow_empty and not adapter.config.path("global").allow_empty
    regions = adapter.compile_regions()  # compile="auto" compiles the tower's layers, not the whole forward
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and m and m[0] is regions[0]]
    assert len(regions) >= 2 and len({type(r) for r in regions}) == 1 and list(layers[0]) == regions
    assert all(any(r is m for m in adapter.tower.modules()) for r in regions)


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("tiles", [[0], [2], [0, 1, 3, 2], [3, 0, 0, 1]])
def test_static_equals_get_image_features(model: torch.nn.Module, tiles: list[int], mode: str) -> None:
    adapter = wrap(model, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = views(tiles, seed=len(tiles) + sum(tiles))
    with torch.no_grad():
        want = model.get_image_features(pv, local, counts)
    with grad_mode(mode):
        inputs = adapter.inputs_from_call(pv, local, torch.tensor(counts))
        got = adapter.output_for_call(runner(inputs), inputs)
    assert_same_output(got, want)
    assert [p.shape[0] for p in got.pooler_output] == [9 * t + 16 for t in tiles]
    assert runner.stats["eager_items"] == 0 and runner.stats["graph_items"] == len(tiles)


def test_partial_eager_local_overflow(model: torch.nn.Module) -> None:
    """An image with more crops than the local ladder holds (6 > 4) runs its local path eagerly; the global views
    still take the static forward; every image still equals the model's."""
    adapter = wrap(model, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = views([6, 0, 1, 2], seed=7)
    inputs = adapter.inputs_from_call(pv, local, counts)
    with torch.no_grad():
        assert_same_output(adapter.output_for_call(runner(inputs), inputs), model.get_image_features(pv, local, counts))
    paths = runner.stats["paths"]
    assert paths["local"]["eager_items"] > 0
    assert paths["global"]["eager_items"] == 0 and sum(paths["global"]["replays"].values()) > 0


def test_shim_inside_the_model_forward(model: torch.nn.Module) -> None:
    """The docstring's shim: the model's forward (and its generate) encode through the graphs; logits unchanged.
    Per-layer outputs go to the model's own function, counted."""
    adapter = wrap(model, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = views([2, 0], seed=3)
    image_tokens = sum(9 * c + 16 for c in counts)
    input_ids = torch.tensor([[1] + [STEP_IMAGE_TOKEN] * image_tokens + [2, 3]])
    with torch.no_grad():
        want = model(input_ids=input_ids, pixel_values=pv, pixel_values_local=local, num_local_patches=counts).logits
    model.model.get_image_features = adapter.shim(runner)
    try:
        got = model(input_ids=input_ids, pixel_values=pv, pixel_values_local=local, num_local_patches=counts).logits
        assert rel_err(got, want) < TOL and runner.stats["graph_items"] == 2
        as_tuple = model.get_image_features(pv, None, None, return_dict=False)
        assert isinstance(as_tuple, tuple) and [t.shape[0] for t in as_tuple[1]] == [16, 16]
        with torch.no_grad():
            stock = model.get_image_features(pv, local, counts, output_hidden_states=True)
        assert len(stock.hidden_states) == STEP_TINY["num_hidden_layers"] + 1
        assert adapter.stock_calls == {"output_hidden_states requested": 1}
    finally:
        del model.model.get_image_features


def test_stock_calls_and_keywords(model: torch.nn.Module) -> None:
    adapter = wrap(model, **OPTIONS)
    pv, local, counts = views([1], seed=4)
    stock = adapter.inputs_from_call(pv, local, counts, output_attentions=True)
    assert stock == StockCall("output_attentions requested")
    assert adapter.inputs_from_call(pv, local, counts, seq_idx=0).reason == "keyword arguments ['seq_idx']"
    inputs = adapter.inputs_from_call(pv, local, counts, use_cache=False, output_hidden_states=False)
    assert isinstance(inputs, OcrImages) and inputs.return_dict


def test_sample_inputs_and_concat(model: torch.nn.Module) -> None:
    adapter = wrap(model, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    for path, tokens, images, crops in (("global", 48, 3, 0), ("global", 5, 1, 0), ("local", 27, 1, 3)):
        sample = adapter.sample_inputs(path, tokens)
        specs = adapter.item_specs(sample)
        assert len(specs) == images and sum(s.tokens["local"] for s in specs) == 9 * crops
        assert sample.pixel_values.dtype == torch.float32 and bool((sample.pixel_values != 0).any())
    a = adapter.inputs_from_call(*views([1, 0], seed=5))
    b = adapter.inputs_from_call(*views([0], seed=6))
    c = adapter.inputs_from_call(*views([2], seed=8))
    joined = adapter.concat([a, b, c])
    assert joined.num_local_patches == (1, 0, 0, 2)
    for g, w in zip(runner(joined), runner(a) + runner(b) + runner(c)):
        assert torch.allclose(g["features"], w["features"], atol=1e-6)
        assert torch.allclose(g["last_hidden_state"], w["last_hidden_state"], atol=1e-6)


def test_no_host_sync() -> None:
    """Both paths' static forwards run on the ``meta`` device, where reading a tensor value on the host raises."""
    from transformers import Step3p7Config, Step3p7Model

    with torch.device("meta"):
        meta = Step3p7Model(Step3p7Config(vision_config=dict(STEP_TINY), text_config=dict(STEP_TEXT)))
    outputs = static_forwards(Step3p7Adapter(meta, **OPTIONS), (("global", 32), ("local", 18)), "meta")
    assert sorted(outputs["global"]) == ["features", "last_hidden_state"] and sorted(outputs["local"]) == ["features"]
    for path, budget in (("global", 32), ("local", 18)):
        assert all(t.device.type == "meta" and t.shape[0] == budget for t in outputs[path].values())
        assert outputs[path]["features"].shape == (budget, STEP_TEXT["hidden_size"])


def test_bad_inputs(model: torch.nn.Module) -> None:
    adapter = wrap(model, **OPTIONS)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = views([1, 2])
    with pytest.raises(InputError, match="sum to 2 tiles"):
        runner(adapter.inputs_from_call(pv, local, [1, 1]))
    with pytest.raises(InputError, match="expected shape"):
        runner(adapter.inputs_from_call(pv, local[:, :, :32, :32], counts))
    with pytest.raises(ConfigError, match="multiples of 9"):
        EncoderGraphRunner(adapter, budgets={"global": [16], "local": [10]}, mode=RunMode.STATIC).capture()
    with pytest.raises(ConfigError, match="path"):
        adapter.sample_inputs("tiles", 9)
    with pytest.raises(UnsupportedModelError, match="Step3p7Model"):
        Step3p7Adapter(model.model.vision_model)


def test_graphed_refuses_the_model(model: torch.nn.Module) -> None:
    """graphed() cannot stand in for the model (its forward is the language model): it refuses, naming the shim.
    The tower alone takes the one line (the tower tests below)."""

    with pytest.raises(UnsupportedModelError, match="shim"):
        encgraph.graphed(model, mode=RunMode.STATIC)


# ---------------------------------------------------------------------------------------------------- the tower alone
# graphed(model.model.vision_model), as the model calls it: global views, then crops with output_hidden_states=False.
def graphed_tower(model: torch.nn.Module, **options: Any) -> Any:
    return encgraph.graphed(model.model.vision_model, mode=RunMode.STATIC, adapter_options=OPTIONS, **options)


def test_tower_registry_and_geometry(model: torch.nn.Module) -> None:
    tower = model.model.vision_model
    adapter = wrap(tower, **OPTIONS)
    assert isinstance(adapter, Step3p7TowerAdapter) and adapter.module is tower
    assert adapter.tokens == {"global": 16, "local": 9} and adapter.config.path_names == ("global", "local")
    assert all(p.allow_empty and p.outputs == ("last_hidden_state",) for p in adapter.config.paths)
    same = Step3p7TowerAdapter(tower, local_size=GLOBAL_SIZE)  # crops of the global size: one path
    assert same.config.path_names == ("global",) and same.sizes == {"global": GLOBAL_SIZE}
    with pytest.raises(UnsupportedModelError, match="Step3p7VisionModel"):
        Step3p7TowerAdapter(model.model)


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("tiles", [[0], [2], [0, 1, 3, 2], [3, 0, 0, 1]])
def test_model_calls_the_graphed_tower(model: torch.nn.Module, tiles: list[int], mode: str) -> None:
    """The model's get_image_features (global views, then crops with output_hidden_states=False) through the
    graphed tower: every field equal to the model's own, each view on the static forward."""
    pv, local, counts = step3p7_views(tiles, GLOBAL_SIZE, STEP_LOCAL, seed=len(tiles) + sum(tiles))
    with torch.no_grad():
        want = model.model.get_image_features(pv, local, counts)
    fast = graphed_tower(model)
    hook = encgraph.graphs(fast)
    model.model.vision_model = fast
    try:
        with grad_mode(mode):
            got = model.model.get_image_features(pv, local, counts)
    finally:
        model.model.vision_model = encgraph.graphs(fast).unwrap()
    assert type(got) is type(want)
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < TOL
    assert len(got.pooler_output) == len(want.pooler_output)
    for g, w in zip(got.pooler_output, want.pooler_output):
        assert g.shape == w.shape and rel_err(g, w) < TOL
    assert got.hidden_states is None and want.hidden_states is None
    assert got.attentions is None and want.attentions is None
    assert not got.last_hidden_state.requires_grad
    stats = hook.stats
    assert stats["eager_items"] == 0 and stats["stock_calls"] == 0
    assert stats["graph_items"] == len(tiles) + sum(tiles)  # one item per view


def test_tower_calls_equal_the_tower(model: torch.nn.Module) -> None:
    tower = model.model.vision_model
    fast = graphed_tower(model)
    pv, local, _ = step3p7_views([3, 2], GLOBAL_SIZE, STEP_LOCAL, seed=11)
    with torch.no_grad():
        for views, kwargs in ((pv, {}), (local, {"output_hidden_states": False}), (pv, {"return_dict": False})):
            got, want = fast(views, **kwargs), own_forward(tower)(views, **kwargs)
            assert type(got) is type(want)
            got = got if isinstance(got, tuple) else got.to_tuple()
            want = want if isinstance(want, tuple) else want.to_tuple()
            assert len(got) == len(want) == 1
            assert got[0].shape == want[0].shape and rel_err(got[0], want[0]) < TOL
    assert encgraph.graphs(fast).stats["stock_calls"] == 0 and encgraph.graphs(fast).stats["graph_items"] == 2 + 5 + 2  # views: 2 global, 5 crops, 2 global


def test_tower_stock_calls(model: torch.nn.Module) -> None:
    """Another view size (the tower interpolates its table), per-layer outputs: the tower's own forward, counted."""
    tower = model.model.vision_model
    fast = graphed_tower(model)
    odd = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert rel_err(fast(odd).last_hidden_state, own_forward(tower)(odd).last_hidden_state) == 0
        hidden = fast(torch.randn(1, 3, GLOBAL_SIZE, GLOBAL_SIZE), output_hidden_states=True)
    assert len(hidden.hidden_states) == STEP_TINY["num_hidden_layers"] + 1
    assert encgraph.graphs(fast).stats["eager_reasons"] == {"view size 48x48 not captured": 1, "output_hidden_states requested": 1}


def test_tower_concat_mixes_sizes(model: torch.nn.Module) -> None:
    adapter = wrap(model.model.vision_model, **OPTIONS)
    runner = encgraph.EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, _ = step3p7_views([2, 1], GLOBAL_SIZE, STEP_LOCAL, seed=12)
    a, b, c = (adapter.inputs_from_call(x) for x in (pv[:1], local, pv[1:]))
    joined = adapter.concat([a, b, c])
    assert isinstance(joined, TowerViews) and joined.paths == ("global", "local", "local", "local", "global")
    for got, want in zip(runner(joined), runner(a) + runner(b) + runner(c)):
        assert torch.allclose(got["last_hidden_state"], want["last_hidden_state"], atol=1e-6)
    sample = adapter.sample_inputs("local", 20)
    assert sample.paths == ("local",) * 2 and bool((sample.pixels["local"] != 0).any())


def test_select_views_consecutive_items_and_gathers_others(model: torch.nn.Module) -> None:
    """Both adapters' ``select``: a sub-batch of consecutive items is a view of the caller's views (no copy, no
    index to send), others are gathered in the order asked; tests/gpu checks that neither waits for the device."""
    pv, local, counts = views([1, 2, 0, 1], seed=13)
    tower = wrap(model.model.vision_model, **OPTIONS)
    inputs = tower.inputs_from_call(pv)
    sub = tower.select(inputs, [1, 2])
    assert sub.pixels["global"].data_ptr() == pv[1].data_ptr() and torch.equal(sub.pixels["global"], pv[1:3])
    assert torch.equal(tower.select(inputs, [3, 0, 2]).pixels["global"], pv[[3, 0, 2]])
    adapter = wrap(model, **OPTIONS)
    images = adapter.inputs_from_call(pv, local, counts)
    sub = adapter.select(images, [1, 2])
    assert sub.pixel_values.data_ptr() == pv[1].data_ptr() and sub.pixel_values_local.data_ptr() == local[1].data_ptr()
    assert torch.equal(sub.pixel_values_local, local[1:3]) and sub.num_local_patches == (2, 0)
    sub = adapter.select(images, [3, 1])
    assert torch.equal(sub.pixel_values, pv[[3, 1]]) and torch.equal(sub.pixel_values_local, local[[3, 1, 2]])


def test_tower_bad_inputs(model: torch.nn.Module) -> None:
    fast = graphed_tower(model)
    with pytest.raises(InputError, match="expected shape"):
        fast(torch.randn(3, GLOBAL_SIZE, GLOBAL_SIZE))
    with pytest.raises(TypeError, match="pixel_values"):
        fast([1, 2])


def test_tower_no_host_sync() -> None:
    """Both paths' static forwards run on the ``meta`` device, where reading a tensor value on the host raises."""
    from transformers import Step3p7Config, Step3p7Model

    with torch.device("meta"):
        meta = Step3p7Model(Step3p7Config(vision_config=dict(STEP_TINY), text_config=dict(STEP_TEXT)))
    outputs = static_forwards(Step3p7TowerAdapter(meta.vision_model, **OPTIONS), (("global", 32), ("local", 18)), "meta")
    for path, budget in (("global", 32), ("local", 18)):
        (out,) = outputs[path].values()
        assert out.device.type == "meta" and out.shape == (budget, 4 * STEP_TINY["hidden_size"])
