"""Capture-time work never fails a valid call (issue 31, point 2): over tiny random configs of the families
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL: patch, merge and temporal sizes, windows, position grids, deepstack layers,
depths; Gemma-4: patch, pooling kernel and position-table sizes; SigLIP, CLIP, InternVL, Llama 4: image and patch
sizes, depths; Step-3.7's tower: image and patch sizes, crops; GLM-4V, Qwen3.5, ERNIE-4.5-VL, Kimi-K2.5,
MiniCPM-V: depths, in their own call conventions) and random inputs the tower itself accepts, the first call of
``graphed(tower)`` equals the tower's own forward (every output field) and never raises:

- with no options (the CPU default);
- with the padded plan asked for (``mode=RunMode.STATIC``) on a few budgets of the default ladder, so that the
  capture's self-check builds the adapter's ``sample_inputs`` at arbitrary sizes: a budget whose check fails
  (an adapter refusing its own sample) is dropped with its reason in ``capture_info``, never raised.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.models.registry import wrap  # noqa: E402
from tests.models.fixtures_multipath import one_thread  # noqa: E402,F401  (autouse: one torch thread)
from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the random-config tests (Gemma-4 and Step-3.7 adapters)")

TOL = 1e-4


@attrs.frozen
class Case:
    """A tower, the arguments of one call the tower accepts, and what it was drawn from (for failure reports).
    ``convention``: a family of ``tests.models.fixtures_families`` whose ``call`` makes the call (GLM-4V's tower
    itself takes a video as its frames), else ``tower(*args, **kwargs)``."""

    family: str
    config: dict[str, Any]
    tower: torch.nn.Module = attrs.field(repr=False)
    args: tuple[Any, ...] = attrs.field(repr=False)
    kwargs: dict[str, Any] = attrs.field(factory=dict, repr=False)
    convention: Any = attrs.field(default=None, repr=False)

    def call(self, module: torch.nn.Module, reference: bool) -> Any:
        if self.convention is not None:
            return self.convention.call(module, *self.args, reference=reference)
        return module(*self.args, **self.kwargs)


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build().eval().requires_grad_(False)


def _qwen_grid(draw: Any, merge: int, temporal: int) -> np.ndarray:
    n = draw(st.integers(1, 3))
    rows = []
    for _ in range(n):
        t = draw(st.integers(1, 2)) if temporal > 1 else 1
        rows.append([t, merge * draw(st.integers(1, 4)), merge * draw(st.integers(1, 4))])
    return np.asarray(rows, np.int64)


@st.composite
def qwen_cases(draw: Any) -> Case:
    family = draw(st.sampled_from(["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]))
    patch, merge, temporal = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    depth = draw(st.integers(1, 3))
    common = dict(depth=depth, patch_size=patch, spatial_merge_size=merge, temporal_patch_size=temporal, num_heads=2)
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as C
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as M

        config = dict(common, embed_dim=16, hidden_size=24, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as C
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as M

        full = draw(st.lists(st.integers(0, depth - 1), max_size=depth, unique=True))
        config = dict(common, hidden_size=16, intermediate_size=draw(st.sampled_from([24, 30])), out_hidden_size=24,
                      window_size=patch * merge * draw(st.integers(1, 3)), fullatt_block_indexes=sorted(full))
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as C
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as M

        deep = draw(st.lists(st.integers(0, depth - 1), max_size=depth, unique=True))
        config = dict(common, hidden_size=16, intermediate_size=32, out_hidden_size=24,
                      num_position_embeddings=draw(st.sampled_from([4, 9, 16, 25])), deepstack_visual_indexes=sorted(deep))
    tower = _seeded(lambda: M._from_config(C(**config)))
    grid = _qwen_grid(draw, merge, temporal)
    width = 3 * temporal * patch * patch
    pixels = torch.randn(int(grid.prod(1).sum()), width, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return Case(family, config, tower, (pixels,), {"grid_thw": torch.from_numpy(grid)})


@st.composite
def gemma_cases(draw: Any) -> Case:
    from tests.models.fixtures_multipath import gemma4_batch, gemma4_tower

    # Kernel 1 is left out: there the tower itself returns no row for an image that fills its rows (transformers
    # 5.24: a 1x1 grid in 1 row gives 0 rows, in 2 rows 1 row), so no drop-in can equal it.
    kernel = draw(st.sampled_from([2, 3]))
    table = draw(st.integers(2 * kernel, 40))
    config = dict(patch_size=draw(st.sampled_from([1, 2])), pooling_kernel_size=kernel, position_embedding_size=table,
                  depth=draw(st.integers(1, 2)))
    tower = gemma4_tower(depth=config["depth"], patch_size=config["patch_size"], pooling_kernel_size=kernel,
                         position_embedding_size=table)
    side = st.integers(1, min(table // kernel, 6)).map(lambda v: v * kernel)
    grids = draw(st.lists(st.tuples(side, side), min_size=1, max_size=3))
    rows = max(w * h for w, h in grids) + draw(st.integers(0, 2)) * kernel * kernel
    pv, pos = gemma4_batch(grids, rows, 3 * config["patch_size"] ** 2, seed=draw(st.integers(0, 99)))
    return Case("gemma4", config, tower, (pv, pos))


@st.composite
def fixed_cases(draw: Any) -> Case:
    from tests.models.fixtures_fixed import tiny_clip, tiny_internvl, tiny_siglip

    family = draw(st.sampled_from(["siglip", "clip", "internvl", "llama4"]))
    patch = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.integers(1, 2))
    if family in ("siglip", "clip"):
        size = patch * draw(st.integers(1, 4)) + draw(st.integers(0, patch - 1))  # the patch convolution floors
        config = dict(image_size=size, patch_size=patch, num_hidden_layers=layers)
        tower = (tiny_siglip if family == "siglip" else tiny_clip)(**config)
    elif family == "internvl":
        size = patch * draw(st.integers(1, 4))
        config = dict(image_size=[size, size], patch_size=[patch, patch], num_hidden_layers=layers)
        tower = tiny_internvl(**config)
    else:
        from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig
        from transformers.models.llama4.modeling_llama4 import Llama4VisionModel

        size = patch * 2 * draw(st.integers(1, 3))  # the pixel shuffle halves an even patch grid
        config = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      image_size=size, patch_size=patch, vision_output_dim=48, projector_input_dim=48,
                      projector_output_dim=48)
        tower = _seeded(lambda: Llama4VisionModel._from_config(Llama4VisionConfig(**config)))
    images = torch.randn(draw(st.integers(1, 5)), 3, size, size, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return Case(family, config, tower, (images,))


@st.composite
def step_cases(draw: Any) -> Case:
    from transformers import Step3p7VisionConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionModel

    patch = draw(st.sampled_from([1, 2]))
    config = dict(hidden_size=16, num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=2, patch_size=patch,
                  image_size=patch * draw(st.integers(2, 8)), intermediate_size=24)
    tower = _seeded(lambda: Step3p7VisionModel._from_config(Step3p7VisionConfig(**config)))
    crops = draw(st.booleans())
    side = 36 * patch if crops else config["image_size"]
    views = torch.randn(draw(st.integers(1, 3)), 3, side, side, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    kwargs = {"output_hidden_states": False} if crops else {}
    return Case("step3p7", config, tower, (views,), kwargs)


FAMILY_TOWERS = {
    # name: (config class, model class, depth key, depths); the other sizes are fixtures_families' tiny ones
    "glm4v": ("transformers.models.glm4v.configuration_glm4v:Glm4vVisionConfig",
              "transformers.models.glm4v.modeling_glm4v:Glm4vVisionModel", "depth", (1, 3)),
    "qwen3_5": ("transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5VisionConfig",
                "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel", "depth", (1, 3)),
    "ernie4_5_vl": ("transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe:Ernie4_5_VLMoeVisionConfig",
                    "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe:"
                    "Ernie4_5_VLMoeVisionTransformerPretrainedModel", "depth", (1, 3)),
    "kimi_k25": ("transformers.models.kimi_k25.configuration_kimi_k25:Kimi_K25VisionConfig",
                 "transformers.models.kimi_k25.modeling_kimi_k25:Kimi_K25VisionModel", "num_hidden_layers", (1, 3)),
    "minicpmv4_6": ("transformers.models.minicpmv4_6.configuration_minicpmv4_6:MiniCPMV4_6VisionConfig",
                    "transformers.models.minicpmv4_6.modeling_minicpmv4_6:MiniCPMV4_6VisionModel", "num_hidden_layers",
                    (2, 3)),  # its merger sits after layer insert_layer_id=1
}


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


@st.composite
def family_cases(draw: Any) -> Case:
    """The families of fixtures_families (GLM-4V, Qwen3.5, ERNIE-4.5-VL, Kimi-K2.5, MiniCPM-V) at a random depth,
    on random mixes of images and videos in their own call convention."""
    from tests.models import fixtures_families as ff

    usable = [n for n in FAMILY_TOWERS if _supported(ff.FAMILIES[n])]
    name = draw(st.sampled_from(usable))
    config_ref, model_ref, depth_key, (lo, hi) = FAMILY_TOWERS[name]
    base = {"glm4v": ff.GLM_VISION, "qwen3_5": ff.QWEN35_VISION, "ernie4_5_vl": ff.ERNIE_VISION,
            "kimi_k25": ff.KIMI_VISION, "minicpmv4_6": ff.MINICPM_VISION}[name]
    config = {**base, depth_key: draw(st.integers(lo, hi))}
    tower = ff._seeded(lambda: _load(model_ref)._from_config(_load(config_ref)(**config)))
    family = ff.FAMILIES[name]
    grid = ff.random_grid(np.random.default_rng(draw(st.integers(0, 99))), draw(st.integers(1, 3)), family, max_side=8)
    return Case(name, config, tower, (family.pixels(grid, seed=draw(st.integers(0, 99))), grid), convention=family)


def _supported(family: Any) -> bool:
    from encgraph.models._hf import _parse, transformers_version

    return _parse(transformers_version() or "0") >= _parse(family.min_transformers)


def tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of an output (a ModelOutput, tuple or list, nested), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    return []


def assert_same(got: Any, want: Any, case: Case) -> None:
    assert type(got) is type(want), case
    g, w = tensors(got), tensors(want)
    assert len(g) == len(w) and g, case
    for a, b in zip(g, w):
        assert a.shape == b.shape, case
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        assert err < TOL, (case, err)


def few_budgets(draw: Any, tower: torch.nn.Module) -> dict[str, list[int]]:
    """Up to three of the smallest budgets of each path's default ladder (the self-check then samples at them)."""
    ladders = encgraph.EncoderGraphRunner(wrap(tower), mode=RunMode.EAGER).ladders
    out = {}
    for path, ladder in ladders.items():
        small = [b for b in ladder if b > 0][:6]
        out[path] = draw(st.lists(st.sampled_from(small), min_size=1, max_size=3, unique=True))
    return out


CASES = st.one_of(qwen_cases(), gemma_cases(), fixed_cases(), step_cases(), family_cases())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=CASES, data=st.data())
def test_first_call_equals_the_tower(case: Case, data: Any) -> None:
    with torch.no_grad():
        want = case.call(case.tower, reference=True)
    for options in ({}, {"mode": RunMode.STATIC, "budgets": few_budgets(data.draw, case.tower)}):
        fast = encgraph.graphed(case.tower, **options)
        try:
            with torch.no_grad():
                # The CPU default is the tower's own forward: called as the tower takes it (GLM-4V: a video as its
                # frames); the padded plan through the adapter, which also takes a video's (t, h, w) row.
                got = case.call(fast, reference=not options)
            assert_same(got, want, case)
            failed = encgraph.graphs(fast).stats["capture"].get("failed", {})
            assert all(isinstance(r, str) and r for f in failed.values() for r in f.values()), failed
        finally:
            encgraph.graphs(fast).unwrap()
