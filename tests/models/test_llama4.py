"""Llama 4 (``Llama4VisionModel``): ``graphed(tower)`` equals the tower's own forward per tile, on CPU; the tiny
``Llama4ForConditionalGeneration``'s logits and image features are unchanged with its tower graphed."""

from __future__ import annotations

import encgraph

import inspect
from typing import Any

import pytest
import torch

from encgraph.errors import ConfigError
from encgraph.models.llama4 import Llama4VisionAdapter
from tests.models.fixtures_fixed import (
    HEADS,
    LAYERS,
    PATCH,
    SIZE,
    TOL,
    FixedTowerTests,
    assert_items_close,
    assert_outputs_match,
    graphed_tower,
    images,
    rel_err,
)

_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               image_size=SIZE, patch_size=PATCH, vision_output_dim=48, projector_input_dim=48,
               projector_output_dim=48)  # the pixel shuffle's MLP takes 4 x hidden
IMAGE_TOKEN = 60


def tiny_llama4(**overrides: Any) -> torch.nn.Module:
    from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig
    from transformers.models.llama4.modeling_llama4 import Llama4VisionModel

    torch.manual_seed(0)
    return Llama4VisionModel._from_config(Llama4VisionConfig(**(_VISION | overrides))).eval().requires_grad_(False)


class TestLlama4(FixedTowerTests):
    make = staticmethod(tiny_llama4)
    interpolate_kwarg = None

    def test_resized_images_interpolate(self) -> None:
        """The tower's position and rotary tables have one size: another ``image_size`` is refused."""
        with pytest.raises(ConfigError, match="leave image_size unset"):
            graphed_tower(self.make(), image_size=SIZE + 2 * PATCH)

    def test_vlm_drop_in(self) -> None:
        """``get_image_features`` of a tiny ``Llama4ForConditionalGeneration``, and its projection into the text
        model, with the tower replaced by ``graphed(tower)`` (the model's own ``forward`` raises on transformers
        5.24 before it returns: ``MoeCausalLMOutputWithPast`` has no ``image_outputs``)."""
        import transformers as tf

        torch.manual_seed(0)
        text = dict(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, vocab_size=64, head_dim=16, num_local_experts=2)
        model = tf.Llama4ForConditionalGeneration(
            tf.Llama4Config(vision_config=_VISION, text_config=text, image_token_index=IMAGE_TOKEN)
        ).eval()
        pixels = images(5, seed=3)
        # transformers 5.17 requires (and ignores) a feature-selection strategy; 5.24 dropped the parameter.
        extra = ("default",) if "vision_feature_select_strategy" in inspect.signature(model.get_image_features).parameters else ()
        with torch.no_grad():
            ref = model.get_image_features(pixels, *extra)
            ref_projected = model.multi_modal_projector(ref.last_hidden_state)
            tower = model.vision_model
            model.vision_model = graphed_tower(tower)
            features = model.get_image_features(pixels, *extra)
            projected = model.multi_modal_projector(features.last_hidden_state)
        assert encgraph.graphs(model.vision_model).stats["graph_items"] == 5
        assert_outputs_match(features, ref)
        assert rel_err(projected, ref_projected) < TOL
        assert encgraph.graphs(model.vision_model).unwrap() is tower


def test_adapter_is_picked_by_config():
    fast = graphed_tower(tiny_llama4())
    assert isinstance(encgraph.graphs(fast).adapter, Llama4VisionAdapter)
    assert encgraph.graphs(fast).adapter.config.path("default").outputs == ("last_hidden_state",)  # no pooler, as the tower


def test_hidden_states_flag_as_the_tower_reads_it():
    """The tower reads ``output_hidden_states`` as a flag, also positionally: a list still means every layer."""
    tower, x = tiny_llama4(), images(3)
    with torch.no_grad():
        ref = tower(x, None, None, True)
    out = graphed_tower(tower)(x, None, None, [1])
    assert len(out.hidden_states) == len(ref.hidden_states) == LAYERS + 1
    for a, b in zip(out.hidden_states, ref.hidden_states):
        assert_items_close(a, b)


def test_sample_inputs_and_concat():
    fast = graphed_tower(tiny_llama4())
    adapter = encgraph.graphs(fast).adapter
    sample = adapter.sample_inputs("default", 3)
    assert adapter.item_specs(sample) == [adapter.item_specs(sample)[0]] * 3
    assert sample.pixel_values.shape == (3, 3, SIZE, SIZE) and sample.pixel_values.abs().sum() > 0
    both = adapter.concat([sample, adapter.sample_inputs("default", 2)])
    with torch.no_grad():
        got = encgraph.graphs(fast).runner(both)
        want = encgraph.graphs(fast).original_forward(both.pixel_values).last_hidden_state
    assert len(got) == 5
    for i, item in enumerate(got):
        assert_items_close(item["last_hidden_state"], want[i : i + 1])
