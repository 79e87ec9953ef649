"""Layout rewrites (``encgraph.models.layout``) on the CPU: each is exact (the same outputs as the layer it
replaces), shares the module's weights instead of copying them, follows in-place weight updates, and is undone by
``restore()`` / the adapter's ``unwrap()``."""

from __future__ import annotations

import copy

import pytest
import torch

from encgraph.errors import EncgraphError
from encgraph.models import wrap
from encgraph.models.layout import ALIGN, align_gated_mlp, apply_all, linear_patch_embed



@pytest.fixture(autouse=True)
def _no_grad():
    # Per test, not at import: a module-level set_grad_enabled(False) turned grad off for the whole session.
    with torch.no_grad():
        yield


def gated_mlp(hidden: int = 32, inner: int = 60, bias: bool = True) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    torch.manual_seed(0)
    return Qwen2_5_VLMLP(Qwen2_5_VLVisionConfig(hidden_size=hidden, intermediate_size=inner), bias=bias).eval()


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 rounding of a different summation order (relative to the largest value)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def class_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's own (class) forward, whatever instance forward is installed."""
    return type(module).forward(module, x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inner", [60, 3420 // 19, 9])
def test_gated_mlp_is_exact_and_shares_weights(inner, bias):
    mlp = gated_mlp(inner=inner, bias=bias)
    ref = copy.deepcopy(mlp)
    x = torch.randn(7, 32)
    patch = align_gated_mlp(mlp)
    # The rewrite is engaged only inside an adapter's own forwards: the module is its own between them.
    assert patch is not None and "forward" not in mlp.__dict__
    assert_same(mlp(x), ref(x))
    patch.engage()
    assert "forward" in mlp.__dict__
    padded = -(-inner // ALIGN) * ALIGN
    assert f"{inner} -> {padded}" in patch.what
    assert_same(mlp(x), ref(x))
    # The module's parameters are views of the padded storage: its class forward and state_dict see the same values.
    assert_same(class_forward(mlp, x), ref(x))
    for name, value in ref.state_dict().items():
        assert torch.equal(mlp.state_dict()[name], value), name
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    assert mlp.down_proj.weight.stride() == (padded, 1)
    # In-place updates (what load_state_dict does) reach the padded forward.
    new = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    mlp.load_state_dict(new)
    ref.load_state_dict(new)
    assert_same(mlp(x), ref(x))
    patch.restore()
    patch.restore()  # idempotent
    assert "forward" not in mlp.__dict__
    assert all(p.is_contiguous() for p in mlp.parameters())
    assert mlp.down_proj.weight.shape == (32, inner)
    assert_same(mlp(x), ref(x))


def test_gated_mlp_aligned_is_left_alone():
    mlp = gated_mlp(inner=64)
    assert align_gated_mlp(mlp) is None
    assert "forward" not in mlp.__dict__


def test_gated_mlp_rejects_other_modules():
    with pytest.raises(TypeError, match="expected nn.Linear gate_proj"):
        align_gated_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    mlp = gated_mlp()
    mlp.up_proj = torch.nn.Linear(32, 61)
    with pytest.raises(EncgraphError, match="not a gated MLP of one width"):
        align_gated_mlp(mlp)


def qwen_patch_embed(bias: bool) -> torch.nn.Module:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    torch.manual_seed(0)
    embed = Qwen3VLVisionPatchEmbed(Qwen3VLVisionConfig(hidden_size=40, patch_size=4, temporal_patch_size=2))
    if not bias:
        embed.proj.bias = None
    return embed.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_patch_embed_as_linear_is_exact(bias):
    embed = qwen_patch_embed(bias)
    ref = copy.deepcopy(embed)
    rows = torch.randn(11, 3 * 2 * 4 * 4)
    patch = linear_patch_embed(embed)
    assert patch is not None
    assert_same(embed(rows), ref(rows))
    # The weight is read at each call: a new value (or dtype) is followed.
    embed.proj.weight.mul_(2)
    ref.proj.weight.mul_(2)
    assert_same(embed(rows), ref(rows))
    embed.double()
    assert embed(rows).dtype == torch.float64
    patch.restore()
    assert "forward" not in embed.__dict__


def test_patch_embed_other_projections_are_left_alone():
    embed = qwen_patch_embed(True)
    embed.proj.padding = (1, 0, 0)
    assert linear_patch_embed(embed) is None
    embed = qwen_patch_embed(True)
    embed.proj = torch.nn.Linear(96, 40)
    assert linear_patch_embed(embed) is None
    assert linear_patch_embed(torch.nn.Identity()) is None


def test_apply_all_rolls_back_when_one_fails():
    mlp, embed = gated_mlp(), qwen_patch_embed(True)

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        apply_all([lambda: align_gated_mlp(mlp), lambda: linear_patch_embed(embed), broken])
    assert "forward" not in mlp.__dict__ and "forward" not in embed.__dict__
    assert all(p.is_contiguous() for p in mlp.parameters())


def test_adapter_applies_and_unwrap_restores(qwen_towers):
    torch.manual_seed(0)
    tower = qwen_towers["qwen2_5_vl"]()
    adapter = wrap(tower)
    lines = adapter.layout
    assert len(lines) == 1 + len(tower.blocks)
    assert "patch embedding as one matmul" in lines[0] and "60 -> 64" in lines[1]
    adapter.unwrap()
    assert adapter.layout == []
    assert all("forward" not in m.__dict__ for m in tower.modules())
    assert all(p.is_contiguous() for p in tower.parameters())

    off = wrap(tower, fast_layout=False)
    assert off.layout == []
    assert all("forward" not in m.__dict__ for m in tower.modules())
    off.unwrap()
    with pytest.raises(TypeError, match="fast_layout: expected True or False"):
        wrap(tower, fast_layout="yes")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_other_qwen_families_get_the_patch_embedding_only(qwen_towers, family):
    tower = qwen_towers[family]()
    adapter = wrap(tower)
    assert adapter.layout == [f"{type(tower.patch_embed).__name__}: patch embedding as one matmul"]
    adapter.unwrap()
