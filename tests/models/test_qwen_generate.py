"""The Hugging Face drop-in on a whole model: a tiny random Qwen2.5-VL (built locally, no download) gives the same
logits and generates the same tokens (greedy) with ``model.model.visual = encgraph.graphed(model.model.visual, mode=RunMode.STATIC)``."""

from __future__ import annotations

from encgraph.capture.records import RunMode
import pytest
import torch

transformers = pytest.importorskip("transformers")

import encgraph  # noqa: E402

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def tiny_model():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=2,
            temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def prompt(image_grid, video_grid):
    """Input ids with one placeholder per merged token of each image, then each video."""
    ids = [5, 6]
    for token, grid in ((IMAGE, image_grid), (VIDEO, video_grid)):
        for n in (grid.prod(-1) // 4).tolist():
            ids += [START] + [token] * n + [END, 7]
    return torch.tensor([ids])


def model_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    image_grid = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 8, 4]])
    video_grid = torch.tensor([[2, 4, 4]])
    ids = prompt(image_grid, video_grid)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=torch.randn(int(image_grid.prod(-1).sum()), 24, generator=g),
        image_grid_thw=image_grid,
        pixel_values_videos=torch.randn(int(video_grid.prod(-1).sum()), 24, generator=g),
        video_grid_thw=video_grid,
    )


def test_drop_in_generates_the_same_tokens():
    model = tiny_model()
    inputs = model_inputs()
    with torch.no_grad():
        ref_logits = model(**inputs).logits
        ref_tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        other_logits = model(**model_inputs(seed=1)).logits
    # The images matter to these logits (else the comparison below would prove nothing).
    assert (other_logits - ref_logits).abs().max() > 1e-3

    visual = model.model.visual
    before = visual.config._attn_implementation
    model.model.visual = encgraph.graphed(visual, budgets=[4, 8, 16], max_items=2, mode=RunMode.STATIC)
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5
    assert tokens.tolist() == ref_tokens.tolist()
    stats = encgraph.graphs(model.model.visual).stats
    assert stats["graph_items"] > 0  # the static (padded) forward ran, not only the eager fallback

    model.model.visual = encgraph.graphs(model.model.visual).unwrap()
    assert model.model.visual is visual and visual.config._attn_implementation == before


def tiny_qwen3_model():
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=2,
            temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(cfg).eval()


def _close(a, b, tol=1e-5):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) < tol


@pytest.mark.parametrize("build", [tiny_model, tiny_qwen3_model], ids=["qwen2_5_vl", "qwen3_vl"])
def test_full_model_call_patterns_with_the_tower_graphed(build):
    # Issue 14 point 6: what transformers' own model tests do with a model, with the tower wrapped by the
    # README's one line: generate with hidden states and a dict result (use_cache passed down to the tower),
    # get_image_features, the model's output_attentions, and a second model built from the same config.
    model = build()
    inputs = model_inputs()
    if build is tiny_qwen3_model:
        # Images only (Qwen3-VL lays a video's frames out with timestamps of its own processor), and what its
        # processor returns beside input_ids (newer transformers need it for M-RoPE): 1 for image tokens.
        ids = prompt(inputs["image_grid_thw"], torch.zeros(0, 3, dtype=torch.long))
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                      image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == IMAGE).long())
    kwargs = dict(max_new_tokens=4, do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref_gen = model.generate(**inputs, **kwargs)
        ref_feat = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        ref_att = model(**inputs, output_attentions=True)
    model.model.visual = encgraph.graphed(model.model.visual, budgets=[4, 8, 16], max_items=2, mode=RunMode.STATIC)
    with torch.no_grad():
        gen = model.generate(**inputs, **kwargs)
        feat = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        att = model(**inputs, output_attentions=True)
    assert gen.sequences.tolist() == ref_gen.sequences.tolist()
    assert len(gen.hidden_states) == len(ref_gen.hidden_states)
    for step, ref_step in zip(gen.hidden_states, ref_gen.hidden_states):
        assert all(_close(a, b) for a, b in zip(step, ref_step))
    assert type(feat) is type(ref_feat)
    for name in ("pooler_output", "last_hidden_state"):
        got, want = getattr(feat, name), getattr(ref_feat, name)
        if isinstance(want, (list, tuple)):
            assert all(_close(torch.cat(list(a)) if isinstance(a, (list, tuple)) else a,
                              torch.cat(list(b)) if isinstance(b, (list, tuple)) else b) for a, b in zip(got, want))
        elif want is not None:
            assert _close(got, want), name
    assert _close(att.logits, ref_att.logits)
    twin = type(model)(model.config)  # the user's config objects are untouched while the tower is wrapped
    assert twin.config.vision_config._attn_implementation == model.config.vision_config._attn_implementation
    assert encgraph.graphs(model.model.visual).stats["graph_items"] > 0
