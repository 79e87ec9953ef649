"""Tiny random-weight fixed-resolution towers (SigLIP, CLIP, InternVL), tiny VLMs around them, and the tests
their test files share (:class:`FixedTowerTests`, which each file subclasses). Plain functions and a mixin, not
pytest fixtures: the test files import them.

Every tower: hidden 32, 4 heads, 2 layers, 32x32 images in 8x8 patches (16 patch tokens), fp32, eval mode,
frozen parameters (as an inference server holds them: plain calls then take the graphs' path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

import encgraph
from encgraph.models.own_forward import own_forward
from encgraph.capture.records import RunMode
from encgraph.errors import ConfigError, ConfigTypeError

HIDDEN, HEADS, LAYERS, SIZE, PATCH = 32, 4, 2, 32, 8
LADDER = (1, 2, 4)
"""Batch sizes of the CPU tests' ladder: batches of 1..9 images need padding, several batches, or both."""


TOL = 1e-5
"""Largest relative error (max abs difference over max abs value, per image) between graphed and the tower."""

_VISION = dict(
    hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
)


def tiny_siglip(**overrides: Any) -> torch.nn.Module:
    """A ``SiglipVisionModel``; ``vision_use_head=True`` (default here) gives it the attention-pooling head."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    options = dict(_VISION, image_size=SIZE, patch_size=PATCH, vision_use_head=True) | overrides
    return SiglipVisionModel(SiglipVisionConfig(**options)).eval().requires_grad_(False)


def tiny_clip(**overrides: Any) -> torch.nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    return CLIPVisionModel(CLIPVisionConfig(**(dict(_VISION, image_size=SIZE, patch_size=PATCH) | overrides))).eval().requires_grad_(False)


def tiny_internvl(**overrides: Any) -> torch.nn.Module:
    """An ``InternVLVisionModel`` with the non-default options on (qk-norm, final layernorm, a mask token)."""
    from transformers import InternVLVisionConfig, InternVLVisionModel

    torch.manual_seed(0)
    options = dict(
        _VISION, image_size=[SIZE, SIZE], patch_size=[PATCH, PATCH], use_qk_norm=True, use_mean_pooling=False,
        layer_scale_init_value=0.5,
    ) | overrides
    model = InternVLVisionModel(InternVLVisionConfig(**options)).eval().requires_grad_(False)
    with torch.no_grad():  # zero-initialised by HF: give them values so that they matter
        model.embeddings.cls_token.normal_()
        model.embeddings.position_embeddings.normal_()
    return model


def images(n: int, seed: int = 0, size: int = SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` random normalized images ``(n, 3, size, size)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=gen).to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_items_close(out: torch.Tensor, ref: torch.Tensor, tol: float = TOL, what: str = "") -> float:
    """Per image (dim 0), relative error below ``tol``; returns the largest."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    worst = 0.0
    for i in range(ref.shape[0]):
        err = rel_err(out[i], ref[i])
        assert err < tol, f"{what} image {i}: relative error {err:.2e} >= {tol:.0e}"
        worst = max(worst, err)
    return worst


def assert_outputs_match(out: Any, ref: Any, tol: float = TOL) -> None:
    """``graphed(tower)(...)`` against ``tower(...)``: same class, same fields, each tensor close per image."""
    assert type(out) is type(ref), f"output type {type(out).__name__} != the tower's {type(ref).__name__}"
    if isinstance(ref, tuple):
        assert len(out) == len(ref)
        pairs = list(zip(out, ref))
    else:
        assert list(out.keys()) == list(ref.keys()), f"fields {list(out.keys())} != {list(ref.keys())}"
        pairs = [(out[k], ref[k]) for k in ref.keys()]
    for a, b in pairs:
        if isinstance(b, tuple):  # hidden_states
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert (x is None) == (y is None)
                if y is not None:
                    assert_items_close(x, y, tol, "hidden_states")
        else:
            assert_items_close(a, b, tol)


def assert_same_behaviour(call: Callable[[], Any], reference: Callable[[], Any]) -> None:
    """``call()`` answers as ``reference()`` does: the same outputs, or an exception of the same type."""
    with torch.no_grad():
        try:
            want = reference()
        except Exception as exc:
            with pytest.raises(type(exc)):
                call()
            return
        assert_outputs_match(call(), want)


def graphed_tower(tower: torch.nn.Module, mode: RunMode = RunMode.STATIC, **adapter_options: Any) -> Any:
    """``encgraph.graphed`` over the tower's registered adapter, on the test ladder."""
    return encgraph.graphed(tower, budgets=LADDER, mode=mode, adapter_options=adapter_options or None)


# -- tests every family runs
def check_batches(tower: torch.nn.Module, mode: RunMode, sizes: range = range(1, 10)) -> None:
    """Batches of 1..9 images (over the ladder's largest size) equal the tower's own forward, per image."""
    fast = graphed_tower(tower, mode)
    total = 0
    for n in sizes:
        x = images(n, seed=n)
        with torch.no_grad():
            ref = own_forward(tower)(x)
        assert_outputs_match(fast(x), ref)
        total += n
    stats = encgraph.graphs(fast).stats
    assert stats["items"] == total
    assert stats["eager_items" if mode is RunMode.EAGER else "graph_items"] == total


ErrorCase = tuple[Any, dict[str, Any], type, str]
"""Pixels, call keywords, the error class and a message pattern."""


class FixedTowerTests:
    """The tests every fixed-resolution tower passes. A family's test file subclasses it as ``Test<Family>``
    (pytest collects the inherited methods there) and sets the class attributes."""

    make: ClassVar[Callable[..., torch.nn.Module]]
    """Builds the tiny tower (keyword overrides go to its config); set with ``staticmethod``."""
    vlm: ClassVar[str]
    """The family name :func:`tiny_vlm` takes."""
    interpolate_kwarg: ClassVar[str | None] = "interpolate_pos_encoding"
    extra_errors: ClassVar[tuple[ErrorCase, ...]] = ()

    @pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
    def test_batches_equal_tower(self, mode: RunMode) -> None:
        check_batches(self.make(), mode)

    def test_return_tuple(self) -> None:
        tower, x = self.make(), images(3)
        with torch.no_grad():
            assert_outputs_match(graphed_tower(tower)(x, return_dict=False), own_forward(tower)(x, return_dict=False))

    def test_hidden_states(self) -> None:
        """Every form of ``output_hidden_states`` the installed transformers reads gives what the tower gives."""
        tower, x = self.make(), images(5, seed=1)
        last = tower.config.num_hidden_layers
        for value in (True, 1, -2, [1], [0, -1], [last], False):
            with torch.no_grad():
                ref, plain = own_forward(tower)(x, output_hidden_states=value), own_forward(tower)(x[:2])
            fast = graphed_tower(tower)  # learns the hidden states from its first call
            assert_outputs_match(fast(x, output_hidden_states=value), ref)
            assert_outputs_match(fast(x[:2]), plain)  # asked for nothing: no hidden_states

    def test_unknown_keyword_like_the_tower(self) -> None:
        """A keyword the tower's own forward swallows is ignored; one it refuses is refused."""
        tower, x = self.make(), images(2)
        fast = graphed_tower(tower)
        try:
            with torch.no_grad():
                want = own_forward(tower)(x, foo=1)
        except TypeError as exc:  # the tower's own refusal, raised by the tower's own forward
            with pytest.raises(TypeError, match=str(exc).split("(")[0][:30]):
                fast(x, foo=1)
        else:
            assert_items_close(fast(x, foo=1).last_hidden_state, want.last_hidden_state)

    def test_hidden_states_captured_once(self) -> None:
        """After the first call the outputs are fixed: hidden states asked for later are answered by the tower's
        own forward (counted); an explicit choice answers "all" with None elsewhere."""
        tower, x = self.make(), images(3)
        fast = graphed_tower(tower)
        fast(x)
        later = fast(x, output_hidden_states=True)
        with torch.no_grad():
            stock = own_forward(tower)(x, output_hidden_states=True)
        assert len(later.hidden_states) == len(stock.hidden_states)
        for got, want in zip(later.hidden_states, stock.hidden_states):
            assert_items_close(got, want)
        assert encgraph.graphs(fast).stats["eager_reasons"] == {"output_hidden_states not captured": 1}
        out = graphed_tower(tower, hidden_states=[-2])(x, output_hidden_states=True)
        with torch.no_grad():
            ref = own_forward(tower)(x, output_hidden_states=True)
        full = len(ref.hidden_states)
        assert [h is None for h in out.hidden_states] == [i != full - 2 for i in range(full)]
        assert_items_close(out.hidden_states[-2], ref.hidden_states[-2])
        assert_items_close(out.last_hidden_state, ref.last_hidden_state)

    def test_no_host_sync(self) -> None:
        """The static forward runs on the ``meta`` device, where reading any tensor value on the host
        (``.item()``, ``.tolist()``, ``nonzero``, a data-dependent branch) raises: nothing in it can sync a GPU."""
        from encgraph.models.registry import wrap

        with torch.device("meta"):
            tower = self.make()
        adapter = wrap(tower, hidden_states="all")
        specs = adapter.buffer_specs("default", 4, 4, 4)
        buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device="meta") for name, spec in specs.items()}
        out = adapter.forward_static("default", buffers, 4)
        assert set(out) == set(adapter.config.path("default").outputs)
        assert all(t.device.type == "meta" and t.shape[0] == 4 for t in out.values())

    def test_input_errors(self) -> None:
        """Images and arguments the graphs do not hold are the tower's own: answered as the tower answers them, or
        refused with the tower's own error; counted, never an error of encgraph's."""
        tower = self.make()
        fast = graphed_tower(tower)
        fast(images(2))  # the graphs exist; later checks must not depend on that
        cases: list[tuple[Any, dict[str, Any]]] = [
            (images(2)[:, :2], {}),
            (images(2, size=SIZE + PATCH), {}),
            (images(2).to(torch.int64), {}),
            (images(2)[0], {}),
            (images(2).numpy(), {}),
            (images(2), {"output_hidden_states": ["a"]}),
            (images(2)[:0], {}),
            (None, {}),
            *((pixels, kwargs) for pixels, kwargs, *_ in self.extra_errors),
        ]
        for pixels, kwargs in cases:
            assert_same_behaviour(lambda: fast(pixels, **kwargs), lambda: own_forward(tower)(pixels, **kwargs))
        assert_same_behaviour(lambda: fast(images(1), pixel_values=images(1)),
                              lambda: own_forward(tower)(images(1), pixel_values=images(1)))
        assert encgraph.graphs(fast).stats["stock_calls"] >= len(cases)

    def test_another_size_with_interpolation_is_answered_by_the_tower(self) -> None:
        """A size the graphs were not built for, with the tower's interpolation switch: the tower answers, counted."""
        if not self.interpolate_kwarg:
            pytest.skip("the tower interpolates by itself")
        tower = self.make()
        fast = graphed_tower(tower)
        x = images(3, size=SIZE + 2 * PATCH)
        with torch.no_grad():
            assert_outputs_match(fast(x, **{self.interpolate_kwarg: True}),
                                 own_forward(tower)(x, **{self.interpolate_kwarg: True}))
        size = SIZE + 2 * PATCH
        assert encgraph.graphs(fast).stats["eager_reasons"] == {f"image size {size}x{size} not captured": 1}

    def test_bad_options(self) -> None:
        tower = self.make()
        cases = [
            ({"image_size": 3}, ConfigError, "at least one patch"),
            ({"image_size": "big"}, ConfigTypeError, "image_size"),
            ({"hidden_states": [LAYERS + 1]}, ConfigError, r"indices in \[-3, 2\]"),
            ({"hidden_states": "last"}, ConfigTypeError, "hidden_states"),
            ({"max_batch": 0}, ConfigError, "max_batch"),
        ]
        for options, error, message in cases:
            with pytest.raises(error, match=message):
                graphed_tower(tower, **options)
        subclass = type("MyTower", (type(tower),), {})  # a user's subclass keeps the tower's output class
        tower.__class__ = subclass
        with torch.no_grad():
            assert_outputs_match(graphed_tower(tower)(images(2)), own_forward(tower)(images(2)))

    def test_resized_images_interpolate(self) -> None:
        """``image_size`` other than the config's: position embeddings interpolate as in the tower."""
        tower, x = self.make(), images(3, size=SIZE + 2 * PATCH)
        call = {self.interpolate_kwarg: True} if self.interpolate_kwarg else {}
        fast = graphed_tower(tower, image_size=SIZE + 2 * PATCH)
        with torch.no_grad():
            assert_outputs_match(fast(x, **call), own_forward(tower)(x, **call))
        if self.interpolate_kwarg:  # without the switch the tower refuses the size: so does the graphed tower
            assert_same_behaviour(lambda: fast(x), lambda: own_forward(tower)(x))

    def test_vlm_drop_in(self) -> None:
        """Logits and image features of a tiny VLM are the same with its tower replaced by ``graphed(tower)``
        (LLaVA reads ``hidden_states[-2]``: it asks True on transformers 5.17, the index -2 on 5.24)."""
        model, per_image = tiny_vlm(self.vlm)
        n = 6
        pixels = images(n, seed=3)
        ids = torch.cat([torch.full((n * per_image,), IMAGE_TOKEN), torch.arange(1, 9)])[None]
        with torch.no_grad():
            ref_logits = model(input_ids=ids, pixel_values=pixels).logits
            ref_features = model.model.get_image_features(pixel_values=pixels).pooler_output
            tower = model.model.vision_tower
            model.model.vision_tower = graphed_tower(tower)
            logits = model(input_ids=ids, pixel_values=pixels).logits
            features = model.model.get_image_features(pixel_values=pixels).pooler_output
        assert encgraph.graphs(model.model.vision_tower).stats["graph_items"] == 2 * n
        for a, b in zip(features, ref_features):
            assert_items_close(a[None], b[None])
        assert rel_err(logits, ref_logits) < TOL
        assert encgraph.graphs(model.model.vision_tower).unwrap() is tower


# -- tiny VLMs: the drop-in `model.model.vision_tower = encgraph.graphed(model.model.vision_tower)`
_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, head_dim=8,
)
IMAGE_TOKEN = 100


def tiny_vlm(family: str) -> tuple[torch.nn.Module, int]:
    """A tiny VLM around the family's tower and the number of text tokens one image becomes."""
    import transformers as tf

    torch.manual_seed(0)
    vision = _VISION
    if family == "clip":
        config = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**vision, image_size=SIZE, patch_size=PATCH),
            text_config=tf.LlamaConfig(**_TEXT), image_token_index=IMAGE_TOKEN, image_seq_length=16,
        )
        return tf.LlavaForConditionalGeneration(config).eval(), 16
    if family == "siglip":
        config = tf.PaliGemmaConfig(
            vision_config=tf.SiglipVisionConfig(**vision, image_size=SIZE, patch_size=PATCH, projection_dim=32),
            text_config=tf.GemmaConfig(**_TEXT), image_token_index=IMAGE_TOKEN, projection_dim=32,
        )
        return tf.PaliGemmaForConditionalGeneration(config).eval(), 16
    config = tf.InternVLConfig(
        vision_config=tf.InternVLVisionConfig(**vision, image_size=[SIZE, SIZE], patch_size=[PATCH, PATCH]),
        text_config=tf.Qwen2Config(**_TEXT), image_token_id=IMAGE_TOKEN, image_seq_length=4,
    )
    return tf.InternVLForConditionalGeneration(config).eval(), 4
