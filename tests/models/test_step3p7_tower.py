"""``graphed(tower)`` for Step-3.7's vision tower alone, on the CPU (tiny random model, fp32), as the model calls it:
``get_image_features`` with the graphed tower equals the model's own (every field) with 0..N crops per image, in
every grad mode, through the padded static forward (``RunMode.STATIC``); the tower's own calls (global views, crops
with ``output_hidden_states=False``) equal the tower's forward per view; sizes the graphs do not hold and per-layer
outputs go to the tower's own forward, counted; mixed-size concatenation (the serving front); no host read in the
static forward.

Geometry (fixtures_multipath): patch 4, 56 px global views (16 tokens), 40 px crops (9 tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the Step-3.7 adapter")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.errors import InputError, UnsupportedModelError  # noqa: E402
from encgraph.models.registry import wrap  # noqa: E402
from encgraph.models.step3p7_tower import Step3p7TowerAdapter, TowerViews  # noqa: E402
from tests.models.fixtures_multipath import (  # noqa: E402  one_thread: an autouse fixture
    one_thread, GRAD_MODES, STEP_LOCAL, STEP_TEXT, STEP_TINY, grad_mode, rel_err, static_forwards, step3p7_model,
    step3p7_views,
)

GLOBAL_SIZE = STEP_TINY["image_size"]
OPTIONS = {"max_images": 4, "max_tiles": 4, "local_size": STEP_LOCAL}
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return step3p7_model()


def graphed_tower(model: torch.nn.Module, **options: Any) -> Any:
    return encgraph.graphed(model.model.vision_model, mode=RunMode.STATIC, adapter_options=OPTIONS, **options)


def test_registry_and_geometry(model: torch.nn.Module) -> None:
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
    model.model.vision_model = fast
    try:
        with grad_mode(mode):
            got = model.model.get_image_features(pv, local, counts)
    finally:
        model.model.vision_model = fast.unwrap()
    assert type(got) is type(want)
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < TOL
    assert len(got.pooler_output) == len(want.pooler_output)
    for g, w in zip(got.pooler_output, want.pooler_output):
        assert g.shape == w.shape and rel_err(g, w) < TOL
    assert got.hidden_states is None and want.hidden_states is None
    assert got.attentions is None and want.attentions is None
    assert not got.last_hidden_state.requires_grad
    stats = fast.stats
    assert stats["eager_items"] == 0 and stats["stock_calls"] == 0
    assert stats["graph_items"] == len(tiles) + sum(tiles)  # one item per view


def test_tower_calls_equal_the_tower(model: torch.nn.Module) -> None:
    tower = model.model.vision_model
    fast = graphed_tower(model)
    pv, local, _ = step3p7_views([3, 2], GLOBAL_SIZE, STEP_LOCAL, seed=11)
    with torch.no_grad():
        for views, kwargs in ((pv, {}), (local, {"output_hidden_states": False}), (pv, {"return_dict": False})):
            got, want = fast(views, **kwargs), tower(views, **kwargs)
            assert type(got) is type(want)
            got = got if isinstance(got, tuple) else got.to_tuple()
            want = want if isinstance(want, tuple) else want.to_tuple()
            assert len(got) == len(want) == 1
            assert got[0].shape == want[0].shape and rel_err(got[0], want[0]) < TOL
    assert fast.stats["stock_calls"] == 0 and fast.stats["graph_items"] == 2 + 5 + 2  # views: 2 global, 5 crops, 2 global


def test_stock_calls(model: torch.nn.Module) -> None:
    """Another view size (the tower interpolates its table), per-layer outputs: the tower's own forward, counted."""
    tower = model.model.vision_model
    fast = graphed_tower(model)
    odd = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert rel_err(fast(odd).last_hidden_state, tower(odd).last_hidden_state) == 0
        hidden = fast(torch.randn(1, 3, GLOBAL_SIZE, GLOBAL_SIZE), output_hidden_states=True)
    assert len(hidden.hidden_states) == STEP_TINY["num_hidden_layers"] + 1
    assert fast.stats["eager_reasons"] == {"view size 48x48 not captured": 1, "output_hidden_states requested": 1}


def test_concat_mixes_sizes(model: torch.nn.Module) -> None:
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


def test_bad_inputs(model: torch.nn.Module) -> None:
    fast = graphed_tower(model)
    with pytest.raises(InputError, match="expected shape"):
        fast(torch.randn(3, GLOBAL_SIZE, GLOBAL_SIZE))
    with pytest.raises(TypeError, match="pixel_values"):
        fast([1, 2])


def test_no_host_sync() -> None:
    """Both paths' static forwards run on the ``meta`` device, where reading a tensor value on the host raises."""
    from transformers import Step3p7Config, Step3p7Model

    with torch.device("meta"):
        meta = Step3p7Model(Step3p7Config(vision_config=dict(STEP_TINY), text_config=dict(STEP_TEXT)))
    outputs = static_forwards(Step3p7TowerAdapter(meta.vision_model, **OPTIONS), (("global", 32), ("local", 18)), "meta")
    for path, budget in (("global", 32), ("local", 18)):
        (out,) = outputs[path].values()
        assert out.device.type == "meta" and out.shape == (budget, 4 * STEP_TINY["hidden_size"])
