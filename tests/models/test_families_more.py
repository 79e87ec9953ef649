"""Issue 58 on the CPU: the vision towers of the multimodal models transformers ships that no model adapter serves,
called exactly as their models call them (each model's own ``get_image_features`` / ``get_video_features``, run once
with the tower as it is and once with the tower graphed in place, ``mode=RunMode.STATIC``: the padded plan a GPU
replays). Every field of every output equals the model's own; each family is either answered by graphs (the
any-module path verified it batch-first and split, padded and replayed its calls) or by the tower's own forward,
for the reason the test names.

The families and their calls: :mod:`tests.models.fixtures_more_families`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

pytest.importorskip("transformers")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.models.graphed_forward import FIRST_SIGHT  # noqa: E402
from tests.models.fixtures_more_families import CASES, attribute, build, tower_of  # noqa: E402

TOL = 1e-5
GRAPHED = sorted(name for name, case in CASES.items() if case.served == "graphs")
ANSWERED = sorted(name for name, case in CASES.items() if case.served != "graphs")


def assert_same(got, want, what):
    """Every leaf of two outputs of the same type and structure equal (tensors within ``TOL``)."""
    a, spec_a = pytree.tree_flatten(got)
    b, spec_b = pytree.tree_flatten(want)
    assert type(got) is type(want) and spec_a == spec_b, what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=TOL, atol=TOL, msg=lambda m, i=i: f"{what}, leaf {i}: {m}")
        else:
            assert x == y, (what, i)


def run_model_calls(name):
    """The model's feature calls of every round, with its tower graphed and as it is; the graphed tower's hook."""
    case = CASES[name]
    model = build(case)
    reference = copy.deepcopy(model)
    tower = tower_of(model, case)
    assert encgraph.graphed(tower, mode=RunMode.STATIC, budgets=[1, 2, 4, 8]) is tower
    hook = encgraph.graphs(tower)
    assert not hook.family  # no model adapter: the any-module path
    with torch.no_grad():
        for round_, n in enumerate(case.sizes):
            for fn, kwargs in case.calls(n, round_):
                assert_same(attribute(model, fn)(**kwargs), attribute(reference, fn)(**kwargs), (name, round_, fn))
    return hook


@pytest.mark.parametrize("name", GRAPHED)
def test_batch_first_towers_are_answered_by_graphs_exactly(name):
    stats = run_model_calls(name).stats
    # Each call shape's first call is the tower's own (it teaches the output's structure); every later call replayed.
    assert set(stats["eager_reasons"]) == {FIRST_SIGHT}, stats["eager_reasons"]
    assert stats["graph_items"] > 0
    assert all(shape["stock_reason"] is None for shape in stats["shapes"]["live"])


@pytest.mark.parametrize("name", ANSWERED)
def test_other_towers_are_answered_by_their_own_forward(name):
    """Phi-4-multimodal's tower attends causally when no crop is padded and bidirectionally when one is (its
    attention sets ``is_causal=True``, which SDPA applies only without a mask), so an item's answer depends on its
    batch: the capture's self-check finds it. No split or padded batch may stand in for it: each call is the
    tower's own forward, counted. (Pixtral, PaddleOCR-VL and HunYuan-VL have model adapters:
    tests/models/test_families.py.)"""
    stats = run_model_calls(name).stats
    reasons = set(stats["eager_reasons"]) - {FIRST_SIGHT}
    assert reasons and all(CASES[name].served in r for r in reasons), stats["eager_reasons"]
    assert stats["graph_items"] == 0


@pytest.mark.parametrize("first", ["one image", "two images"])
def test_pixtral_first_seen_with_one_image_is_still_the_towers_own(first, monkeypatch):
    """On the any-module path (its model adapter unregistered here), a call shape first seen with one image looks
    batch-first (Pixtral's output, one sequence of every image's patches, has dim 0 = 1); the capture's self-check
    then finds budgets whose output has another row count, and the shape goes to the tower's own forward as a
    whole, not split per image at the budgets that passed."""
    tf = pytest.importorskip("transformers")
    from encgraph.models import registry

    monkeypatch.delitem(registry._REGISTRY, "PixtralVisionConfig")
    torch.manual_seed(0)
    tower = tf.PixtralVisionModel(tf.PixtralVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                         intermediate_size=64, image_size=32, patch_size=8)).eval()
    reference = copy.deepcopy(tower)
    encgraph.graphed(tower, mode=RunMode.STATIC, budgets=[1, 2, 4])
    sizes = [[[32, 32]], [[32, 32]], [[32, 32], [32, 32]], [[32, 32], [16, 16]], [[32, 32]]]
    if first == "two images":
        sizes = sizes[2:] + sizes[:2]
    with torch.no_grad():
        for i, s in enumerate(sizes):
            x = torch.randn(len(s), 3, 32, 32, generator=torch.Generator().manual_seed(i))
            assert_same(tower(x, image_sizes=torch.tensor(s)), reference(x, image_sizes=torch.tensor(s)), (first, i))
    assert encgraph.graphs(tower).stats["graph_items"] == 0


def test_phi4_sampled_from_a_padded_crop_is_still_the_towers_own():
    """Phi-4's tower attends causally unless a crop of the batch is padded: an item's answer depends on its batch
    mates. The padded self-check agrees with itself whatever the first item is; the split check (the kept items
    together against each alone) finds it, so a later call of full crops is never split or padded."""
    case = CASES["phi4_multimodal"]
    model = build(case)
    reference = copy.deepcopy(model)
    tower = tower_of(model, case)
    encgraph.graphed(tower, mode=RunMode.STATIC, budgets=[1, 2, 4])
    from tests.models.fixtures_more_families import GRID, SIDE

    def call(n, padded, seed):
        mask = torch.ones(n, GRID, GRID, dtype=torch.bool)
        if padded:
            mask[0, GRID // 2:] = False
        return {"img_embeds": torch.randn(n, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed)),
                "attention_mask": mask}

    with torch.no_grad():
        for i, (n, padded) in enumerate([(2, True), (2, True), (3, False), (5, False)]):
            kwargs = call(n, padded, i)
            assert_same(attribute(model, "get_img_features")(**kwargs),
                        attribute(reference, "get_img_features")(**kwargs), i)
    assert encgraph.graphs(tower).stats["graph_items"] == 0
