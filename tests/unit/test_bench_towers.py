"""benches/lib/towers.py: the tower table reads each row's geometry and facts, refuses a name twice, and takes a
new family as one row."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

from benches.lib import cases, outputs  # noqa: E402
from benches.lib.cases import Visual  # noqa: E402
from benches.lib.env import inference  # noqa: E402
from benches.lib.systems import System, TowerBench, pin_varlen  # noqa: E402
from benches.lib.towers import (  # noqa: E402
    CORE_TOWERS, FAMILY_CASES, FAMILY_TOWERS, NEWER_FAMILY_CASES, TINY_PACKED, TOWERS, Facts, Geometry, TowerKind,
    TowerSpec,
)
from tests.unit._helpers import smoke_env  # noqa: E402


GEOMETRY_OF_KIND = {  # (merge, has a fixed side) per kind: what each layout's facts must read
    TowerKind.PACKED: (2, False), TowerKind.PATCHES: (2, False), TowerKind.BATCH1: (2, False),
    TowerKind.IMAGES: (1, False), TowerKind.NAFLEX: (1, False), TowerKind.STRIP: (2, False),
    TowerKind.FIXED: (1, True), TowerKind.PADDED: (3, False), TowerKind.VIEWS: (1, True), TowerKind.MASKED: (1, True),
}


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_every_tower_row_builds_its_geometry(name):
    spec = TOWERS[name]
    if spec.missing() and "needs transformers" in spec.missing():
        pytest.skip(spec.missing())  # a family row on the older transformers of a CI job
    assert spec.missing() is None
    assert spec.cases is None or set(spec.cases) <= set(cases.CASE_NAMES)
    merge, fixed = GEOMETRY_OF_KIND[spec.kind]
    for tiny in (False, True):
        geom = spec.geometry(tiny)
        assert geom.kind is spec.kind and geom.patch > 0 and geom.channels == 3
        assert (geom.image_size is not None) == fixed and geom.merge == merge


def test_the_table_is_the_seed_towers_and_the_families():
    assert set(CORE_TOWERS) | set(FAMILY_TOWERS) == set(TOWERS) and not set(CORE_TOWERS) & set(FAMILY_TOWERS)
    newer = ("paddleocr_vl", "pixtral", "hunyuan_vl", "siglip2", "smolvlm")  # issue 58's: a photo too
    assert all(TOWERS[n].cases == (NEWER_FAMILY_CASES if n in newer else FAMILY_CASES) for n in FAMILY_TOWERS)
    assert all(TOWERS[n].cases is None for n in CORE_TOWERS)  # the scripts' own defaults, unchanged


def test_facts_read_values_names_and_lists():
    config = argparse.Namespace(patch_size=[14, 14], merge_kernel_size=(2, 2), image_size=448)
    facts = Facts(merge="merge_kernel_size", temporal_patch=1, channels=3)
    g = Geometry.of(TowerKind.PACKED, config, facts)
    assert (g.patch, g.merge, g.temporal_patch, g.channels, g.image_size) == (14, 2, 1, 3, None)
    assert g.row_size == 3 * 14 * 14 and g.factor == 28


def test_a_row_for_a_newer_transformers_or_a_missing_class_is_unavailable():
    base = TOWERS["qwen2_5_vl_7b"]
    future = TowerSpec("x", "X", TowerKind.PACKED, model=base.model, config=base.config, full={}, tiny={},
                       transformers="99.0")
    assert "needs transformers >= 99.0" in future.missing()
    absent = TowerSpec("y", "Y", TowerKind.PACKED, model="transformers:NoSuchVisionModel", config=base.config,
                       full={}, tiny={})
    assert "cannot import" in absent.missing()


def test_the_tower_table_refuses_a_name_twice():
    from benches.lib.towers import _table

    with pytest.raises(ValueError, match="twice"):
        _table(TOWERS["qwen2_5_vl_7b"], TOWERS["qwen2_5_vl_7b"])


def test_a_new_family_is_one_row():
    """A row for a family the table does not ship (Qwen3.5's tower, transformers >= 5.24) builds and runs its HF
    forward; systems whose adapter is missing are reported unavailable, not raised."""
    spec = TowerSpec("qwen3_5_row", "Qwen3.5 tower", TowerKind.PACKED,
                     model="transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel",
                     config="transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5VisionConfig",
                     full=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16),
                     tiny=dict(TINY_PACKED, depth=2, num_position_embeddings=64), transformers="5.24")
    if spec.missing():
        pytest.skip(spec.missing())
    with inference():
        bench = TowerBench(spec, smoke_env(), (System.HF_SDPA, System.ADAPTER_EAGER))
        x = bench.inputs([Visual(64, 96), Visual(32, 32, frames=2, kind="video")])
        out = bench.call(System.HF_SDPA, x)()
    assert out["pooler_output"].shape[0] == x.sizes.tokens == 6 + 4  # (1, 4, 6) and (1, 4, 4) patches, merged 2x2
    assert bench.adapter is not None or bench.unavailable[System.ADAPTER_EAGER].startswith("unavailable: no adapter")
    bench.close()


def test_tower_copies_per_system_group():
    """hf_sdpa's tower is never wrapped; defaults gets its own copy, wrapped by graphed() alone."""
    env = smoke_env()
    with inference():
        bench = TowerBench(TOWERS["qwen2_5_vl_7b"], env, (System.HF_SDPA, System.ADAPTER_EAGER, System.DEFAULTS))
        modules = [bench.hf, bench.enc, bench.graphed]
        assert len({id(m) for m in modules}) == 3
        for a, b in zip(bench.hf.parameters(), bench.graphed.parameters()):
            assert a.data_ptr() != b.data_ptr()
        x = bench.inputs([Visual(56, 84), Visual(28, 28)])
        ref = bench.call(System.HF_SDPA, x)()
        got = bench.call(System.DEFAULTS, x)()
        assert outputs.max_rel_diff([got["pooler_output"]], [ref["pooler_output"]]) < 1e-4
        # On a CPU the defaults answer with the tower's own forward (no graphs to gain), counted as such.
        assert bench.stats(System.DEFAULTS)["stock_calls"] == 1 and bench.stats(System.DEFAULTS)["items"] == 0
    bench.close()


def test_defaults_varlen_is_the_defaults_on_a_copy_of_its_own():
    """``defaults_varlen``: graphed(tower) on a copy of its own, pinned to the varlen kernel before its capture;
    its outputs equal the tower's own, as ``defaults``' do."""
    env = smoke_env()
    with inference():
        bench = TowerBench(TOWERS["qwen2_5_vl_7b"], env, (System.HF_SDPA, System.DEFAULTS, System.DEFAULTS_VARLEN))
        assert System.DEFAULTS_VARLEN not in bench.unavailable
        assert bench.defaults(System.DEFAULTS_VARLEN) is not bench.defaults()
        pinned = bench._handles[System.DEFAULTS_VARLEN].runner.adapter
        assert pinned.choose_kernels.__name__ == "choose_varlen" and not pinned.kernel_rows  # nothing measured off CUDA
        x = bench.inputs([Visual(56, 84), Visual(28, 28)])
        ref = bench.call(System.HF_SDPA, x)()
        for system in (System.DEFAULTS, System.DEFAULTS_VARLEN):
            got = bench.call(system, x)()
            assert outputs.max_rel_diff([got["pooler_output"]], [ref["pooler_output"]]) < 1e-4, system
            assert bench.stats(system)["stock_calls"] == 1  # the CPU answers with the tower's own forward
        bench.close()


def test_pin_varlen_keeps_the_measured_choice_and_drops_every_dense_row():
    class Adapter:
        kernel_rows = None

        def choose_kernels(self, known=None):
            self.kernel_rows = {(16, 72, "bf16"): 13000}
            return {"16x72": "crossover"}

    adapter = Adapter()
    assert pin_varlen(adapter) is None
    assert adapter.choose_kernels() == {"16x72": "crossover"}
    # "never" per geometry: None would leave eager forwards on the default rows (attention.SEGMENT_MIN_ROWS)
    assert adapter.kernel_rows == {(16, 72, "bf16"): None}


def test_pin_varlen_refuses_an_adapter_without_a_kernel_choice():
    class NoChoice:
        pass

    assert "chooses no attention kernels" in pin_varlen(NoChoice())


def test_defaults_varlen_is_n_a_for_a_tower_without_a_kernel_choice():
    with inference():
        bench = TowerBench(TOWERS["siglip_so400m_384"], smoke_env(), (System.HF_SDPA, System.DEFAULTS_VARLEN))
        assert "chooses no attention kernels" in bench.unavailable[System.DEFAULTS_VARLEN]
        bench.close()


def test_idefics_tiles_are_the_processors():
    """The MASKED kind's tile count is what Idefics3's image processor cuts (SmolVLM's 384 px tiles, 1536 px longest
    edge), and its masks are full: the processor's tiles are whole."""
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    import transformers

    processor = transformers.Idefics3ImageProcessor(max_image_size={"longest_edge": 384}, size={"longest_edge": 1536})
    geom = TOWERS["smolvlm"].geometry(False)
    for h, w in ((448, 448), (1080, 1920), (300, 200), (2000, 300), (500, 1400)):
        picture = image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))
        out = processor(images=[[picture]], return_tensors="pt")
        assert out["pixel_values"].shape[1] == cases.idefics_tiles(Visual(h, w), geom), (h, w)
        assert bool(out["pixel_attention_mask"].all())


@pytest.mark.parametrize(("name", "patches"), [
    ("paddleocr_vl", 11_844),  # 4000 x 3000 under max_pixels 1536^2 at factor 28: 2,961 tokens of 4 patches
    ("hunyuan_vl", 16_060),  # under 2048^2 at factor 32
    ("pixtral", 3_072),  # longest edge 1024 px: 64 x 48 patches of 16
    ("siglip2", 252),  # at most 256 patches, aspect kept: 14 x 18
    ("smolvlm", 9_477),  # longest edge 4 tiles: 4 x 3 tiles + a global one, 729 patches each
])
def test_the_photo_case_is_sized_at_each_processors_default_maximum(name, patches):
    """``towers.py``'s photo case (issue 58: one photo at the processor's default maximum): packed towers capped by
    ``trace.photo_caps``, the others by their own grids."""
    from benches.lib.trace import photo_caps

    spec = TOWERS[name]
    if spec.missing():
        pytest.skip(spec.missing())
    geom = spec.geometry(False)
    assert photo_caps(name, geom).sizes(cases.PHOTO_CASE.visuals, geom).patches == patches
