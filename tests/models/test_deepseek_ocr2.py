"""DeepSeek-OCR2 two-path adapter on the CPU (tiny random model, fp32): per image, the runner's padded static
forward (``RunMode.STATIC``) equals the model's own ``get_image_features``, with 0..N tiles per image, and with
the local path overflowing its ladder (partial eager) while the global path keeps its static forward.

Geometry: SAM patch 2, global views of 104 px (a 52 x 52 SAM grid, 13 x 13 = 169 > 144 patches after the 4x
downsampling, so the tower picks its 256 large-view queries) and tiles of 32 px (4 x 4 patches: the 144
small-view queries, with the SAM position embedding interpolated as for real 768 px tiles).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tests.models.versions import skip_module_below  # noqa: E402

skip_module_below("5.17", "the DeepSeek-OCR2 adapter")

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.errors import (
    ConfigError,
    InputError,
    InputTypeError,
    UnsupportedModelError,
)
from encgraph.models.deepseek_ocr2 import DeepseekOcr2Adapter, OcrImages, view_tokens
from encgraph.models.registry import wrap

GLOBAL_SIZE = 104
LOCAL_SIZE = 32
TOL = 1e-5


def deepseek_config(
    *, sam_hidden: int = 16, encoder_hidden: int = 16, text_hidden: int = 24, patch_size: int = 2,
    image_size: int = GLOBAL_SIZE, window_size: int = 4,
) -> Any:
    """A small ``DeepseekOcr2Config`` (two SAM layers, one of them global; two query-encoder layers with grouped
    KV heads; a one-layer dense text model); the GPU tests use it with real view sizes."""
    from transformers import DeepseekOcr2Config

    sam = {
        "hidden_size": sam_hidden, "output_channels": sam_hidden // 2, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size, "window_size": window_size,
        "global_attn_indexes": [1], "downsample_channels": [encoder_hidden // 2, encoder_hidden], "mlp_dim": 2 * sam_hidden,
    }
    encoder = {
        "hidden_size": encoder_hidden, "intermediate_size": 2 * encoder_hidden, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 1024,
    }
    text = {
        "hidden_size": text_hidden, "intermediate_size": text_hidden, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "mlp_layer_types": ["dense"],
    }
    return DeepseekOcr2Config(vision_config={"sam_config": sam, "encoder_config": encoder}, text_config=text)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import DeepseekOcr2ForConditionalGeneration

    torch.manual_seed(0)
    m = DeepseekOcr2ForConditionalGeneration(deepseek_config()).eval()
    with torch.no_grad():
        m.model.view_separator.normal_()  # a recognisable separator row
    return m


def make_adapter(model: torch.nn.Module, **options: Any) -> DeepseekOcr2Adapter:
    options = {"max_images": 4, "max_tiles": 4, "global_size": GLOBAL_SIZE, "local_size": LOCAL_SIZE, **options}
    return wrap(model, **options)


def images(tiles: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(len(tiles), 3, GLOBAL_SIZE, GLOBAL_SIZE, generator=gen)
    local = torch.randn(sum(tiles), 3, LOCAL_SIZE, LOCAL_SIZE, generator=gen) if sum(tiles) else None
    return pv, local, tiles


def reference(model: torch.nn.Module, pv: torch.Tensor, local: torch.Tensor | None, tiles: list[int]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.get_image_features(pv, local, tiles).pooler_output)


def assert_items_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = TOL) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"image {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < tol, f"image {i}: relative error {err:.3g}"


def test_geometry_and_registry(model: torch.nn.Module) -> None:
    adapter = make_adapter(model)
    assert isinstance(adapter, DeepseekOcr2Adapter)
    assert (adapter.global_tokens, adapter.local_tokens) == (256, 144)
    assert isinstance(wrap(model.model, global_size=GLOBAL_SIZE, local_size=LOCAL_SIZE), DeepseekOcr2Adapter)
    # The defaults follow the query tables: 16 x 16 and 12 x 12 queries at 4x downsampling and patch 2.
    default = DeepseekOcr2Adapter(model)
    assert default.sizes == {"global": 128, "local": 96}
    assert view_tokens(model.model.vision_tower, 1024) == 256
    cfg = adapter.config
    assert cfg.path("local").allow_empty and not cfg.path("global").allow_empty
    ladders = EncoderGraphRunner(adapter, mode=RunMode.STATIC).ladders
    # The dense default ladder in multiples of one view's tokens.
    assert ladders == {"global": (256, 512, 768, 1024), "local": (0, 144, 288, 432, 576)}


@pytest.mark.parametrize("tiles", [[0], [1], [0, 1, 2, 3], [3, 0, 0, 1], [2, 2]])
def test_static_equals_get_image_features(model: torch.nn.Module, tiles: list[int]) -> None:
    """Every image, 0..3 tiles, equals the model's own per-image features (local rows, global rows, separator)."""
    adapter = make_adapter(model)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = images(tiles, seed=sum(tiles) + len(tiles))
    out = runner(adapter.inputs_from_call(pv, local, counts))
    want = reference(model, pv, local, counts)
    assert [o.shape[0] for o in out] == [144 * t + 256 + 1 for t in tiles]
    assert_items_close(out, want)
    stats = runner.stats
    assert stats["eager_items"] == 0 and stats["graph_items"] == len(tiles)
    # Eager forward of each path gives the same rows.
    sub = adapter.select(adapter.inputs_from_call(pv, local, counts), range(len(tiles)))
    eager = [adapter.forward_eager(p, sub)["features"] for p in ("global", "local")]
    assert eager[0].shape[0] == 256 * len(tiles) and eager[1].shape[0] == 144 * sum(tiles)


def test_partial_eager_local_overflow(model: torch.nn.Module) -> None:
    """An image with more tiles than the local ladder holds runs its local path eagerly; its global view and the
    other images still take the static forward; every image is still equal to the model."""
    adapter = make_adapter(model)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    tiles = [6, 0, 1, 2]
    pv, local, counts = images(tiles, seed=7)
    out = runner(adapter.inputs_from_call(pv, local, torch.tensor(counts)))
    assert_items_close(out, reference(model, pv, local, counts))
    paths = runner.stats["paths"]
    assert paths["local"]["eager_items"] > 0
    assert paths["global"]["eager_items"] == 0 and sum(paths["global"]["replays"].values()) > 0


def test_shim_replaces_get_image_features(model: torch.nn.Module) -> None:
    """The module docstring's shim: the model's output class with pooler_output per image, tuple on request."""
    adapter = make_adapter(model)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = images([2, 0], seed=3)

    def get_image_features(pixel_values, pixel_values_local=None, num_local_patches=None, **kwargs):
        inputs = adapter.inputs_from_call(pixel_values, pixel_values_local, num_local_patches, **kwargs)
        return adapter.output_for_call(runner(inputs), inputs)

    out = get_image_features(pv, local, counts, return_dict=True)
    assert type(out).__name__ == "DeepseekOcr2ModelOutputWithPooling"
    assert_items_close(out.pooler_output, reference(model, pv, local, counts))
    as_tuple = get_image_features(pv, None, None, return_dict=False)
    assert_items_close(list(as_tuple[0]), reference(model, pv, None, [0, 0]))


def test_no_host_sync(model: torch.nn.Module) -> None:
    """Both paths' static forwards run on the ``meta`` device, where reading a tensor value on the host raises."""
    from transformers import DeepseekOcr2Model

    with torch.device("meta"):
        meta_model = DeepseekOcr2Model(deepseek_config())
    adapter = make_adapter(meta_model)
    for path, budget in (("global", 512), ("local", 288)):
        specs = adapter.buffer_specs(path, budget, 4, 4)
        buffers = {n: torch.zeros(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
        out = adapter.forward_static(path, buffers, budget)["features"]
        assert out.device.type == "meta" and out.shape == (budget, 24)


def test_bad_inputs(model: torch.nn.Module) -> None:
    adapter = make_adapter(model)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    pv, local, counts = images([1, 2])
    cases = [
        ((pv, local, [1, 1]), InputError, "sum to 2 tiles"),
        ((pv, local, [3]), InputError, "expected 2 ints"),
        ((pv, local, [1, -1 + 3]), None, None),
        ((pv[:, :, :64], local, counts), InputError, "expected shape"),
        ((pv, local[:, :, :16, :16], counts), InputError, "expected shape"),
        ((pv.to(torch.int64), local, counts), InputTypeError, "floating-point"),
        (([pv], local, counts), InputTypeError, "expected a tensor"),
        ((pv, local, None), InputError, "num_local_patches"),
    ]
    for args, error, match in cases:
        if error is None:
            runner(adapter.inputs_from_call(*args))
            continue
        with pytest.raises(error, match=match):
            runner(adapter.inputs_from_call(*args))
    with pytest.raises(InputTypeError, match="OcrImages"):
        runner((pv, local, counts))
    with pytest.raises(InputTypeError, match="pixel_values"):
        adapter.inputs_from_call(None)
    with pytest.raises(InputError, match="output_hidden_states"):
        adapter.inputs_from_call(pv, local, counts, output_hidden_states=True)
    with pytest.raises(InputTypeError, match="unsupported keyword"):
        adapter.inputs_from_call(pv, local, counts, foo=1)
    with pytest.raises(ConfigError, match="multiples of 144"):
        EncoderGraphRunner(adapter, budgets={"global": [256], "local": [100]}, mode=RunMode.STATIC).capture()
    with pytest.raises(UnsupportedModelError, match="DeepseekOcr2Model"):
        DeepseekOcr2Adapter(model.model.vision_tower)
    assert OcrImages(pv, local, np.array([1, 2])).num_local_patches == (1, 2)
    with pytest.raises(InputError, match="expected 2 ints"):
        runner(OcrImages(pv, local, 3))


def test_graphed_refuses_the_full_model_with_a_pointer_to_the_shim(model):
    import encgraph
    from encgraph.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="shim"):
        encgraph.graphed(model, mode=RunMode.STATIC)
