"""timm, open_clip and torchvision modules through ``graphed()`` (issue 55, CPU, STATIC mode: the padded plan a GPU
would replay). They need torchvision, whose PyPI wheels do not import beside the main CI step's CPU torch, so
``.ci/run`` runs this file in a step of its own; elsewhere it skips."""

from __future__ import annotations

import copy

import pytest
import torch

import encgraph
from encgraph.capture.records import RunMode
from encgraph.models.graphed_forward import FIRST_SIGHT, TRAIN_MODE

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

BUDGETS = [1, 2, 4]


def check(module: torch.nn.Module, calls, tol: float = 1e-4) -> dict:
    """Each call (a tensor) equal, item by item, to the module's own forward; returns the stats."""
    reference = copy.deepcopy(module)
    encgraph.graphed(module, mode=RunMode.STATIC, budgets=BUDGETS)
    with torch.no_grad():
        for x in calls:
            got, want = module(x), reference(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    return encgraph.graphs(module).stats


def batch(n: int, h: int = 224, w: int | None = None, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, h, w or h, generator=torch.Generator().manual_seed(seed))


def test_timm_vit_with_dynamic_image_size_gets_one_ladder_per_size():
    torch.manual_seed(0)
    module = timm.create_model("vit_small_patch16_224", pretrained=False, dynamic_img_size=True, depth=2).eval()
    calls = [batch(3), batch(5, seed=1), batch(2, 160), batch(6, 160, seed=2), batch(2, 256, 192), batch(5, 256, 192)]
    stats = check(module, calls)
    # Three sizes, three call shapes: each learned from its first call, replayed from its second.
    assert stats["eager_reasons"] == {FIRST_SIGHT: 3} and stats["graph_items"] == 5 + 6 + 5
    assert len(stats["shapes"]["live"]) == 3


def test_timm_convnext_and_an_empty_batch():
    torch.manual_seed(0)
    module = timm.create_model("convnext_atto", pretrained=False).eval()
    stats = check(module, [batch(2, 64), batch(7, 64, seed=1), batch(0, 64)])
    assert stats["graph_items"] == 7 and stats["eager_reasons"] == {FIRST_SIGHT: 1, "empty batch": 1}


def test_torchvision_resnet_batchnorm_in_train_mode_is_its_own():
    torch.manual_seed(0)
    module = torchvision.models.resnet18(weights=None)  # train mode, as torchvision builds it
    reference = copy.deepcopy(module)
    encgraph.graphed(module, mode=RunMode.STATIC, budgets=BUDGETS)
    x = batch(6, 64)
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x))  # batch statistics over all 6, updated alike
        assert torch.equal(module.bn1.running_mean, reference.bn1.running_mean)
        module.eval(), reference.eval()
        for n in (3, 5):
            y = batch(n, 64, seed=n)
            torch.testing.assert_close(module(y), reference(y), rtol=1e-4, atol=1e-4)
    stats = encgraph.graphs(module).stats
    assert stats["eager_reasons"] == {TRAIN_MODE: 1, FIRST_SIGHT: 1} and stats["graph_items"] == 5


def test_open_clip_visual_tower():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    visual = open_clip.create_model("ViT-B-32", pretrained=None).visual.eval()
    stats = check(visual, [batch(2), batch(3, seed=1)])
    assert stats["graph_items"] == 3
