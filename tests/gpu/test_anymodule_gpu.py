"""The any-module path on a GPU (issue 55): modules no model adapter knows, wrapped with ``graphed()`` and no
options, bf16, random weights. Each call shape is learned from the module's first answer, captured on its second
call; every replay is compared per item with the module's own forward on fresh random inputs. Also: several call
shapes (least recently used dropped, memory reported), a dtype move, a LoRA layer injected after capture, a
NaN-poisoned pool, timm and open_clip towers where installed."""

from __future__ import annotations

import copy

import pytest
import torch

import encgraph
from encgraph.models.graphed_forward import FIRST_SIGHT
from encgraph.models.own_forward import own_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = 5e-2
"""Norm-relative error per item, bf16 (a padded batch runs other GEMM shapes than the module's call)."""
SIZES = (1, 3, 8, 13, 32, 37, 5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def vit(image: int = 224, layers: int = 4) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                                    intermediate_size=3072, image_size=image, patch_size=16)
    with torch.device("cuda"):
        return transformers.ViTModel(config, add_pooling_layer=True).to(torch.bfloat16).eval()


def check(module: torch.nn.Module, make, sizes=SIZES, field=lambda out: out.last_hidden_state, **options) -> dict:
    """Calls of ``sizes`` items (fresh random inputs each), every item of every output within TOL of the
    module's own forward on the same call; returns the stats."""
    reference = copy.deepcopy(module)
    encgraph.graphed(module, **options)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        for n in sizes:
            args, kwargs = make(n, gen)
            got, want = field(module(*args, **kwargs)), field(reference(*args, **kwargs))
            assert got.shape == want.shape
            for i in range(n):
                assert torch.isfinite(got[i]).all() and rel(got[i], want[i]) < TOL, (n, i, rel(got[i], want[i]))
    return encgraph.graphs(module).stats


def images(side: int = 224):
    return lambda n, gen: ((), {"pixel_values": torch.randn(n, 3, side, side, device="cuda", generator=gen,
                                                            dtype=torch.bfloat16)})


def test_hf_vit_replays_equal_its_forward_per_item():
    stats = check(vit(), images())
    assert stats["eager_reasons"] == {FIRST_SIGHT: 1} and stats["graph_items"] == sum(SIZES[1:])
    capture = stats["capture"]
    assert capture["mode"] == "graph" and capture["graphs"] >= 6 and not capture["failed"], capture
    assert stats["shapes"]["graph_bytes"] > 0
    print(f"\nViT-B/16 x4 layers: capture {capture['seconds']} s, {capture['graphs']} graphs, "
          f"{stats['shapes']['graph_bytes'] / 2**20:.0f} MiB; compile {capture['compile'].get('status')}")


def test_call_shapes_are_bounded_and_dtype_moves_rebuild():
    module = vit(image=224, layers=2)
    reference = copy.deepcopy(module)
    encgraph.graphed(module, max_shapes=2)
    gen = torch.Generator(device="cuda").manual_seed(2)
    sides = (224, 160, 224, 256, 160, 160)  # three shapes through interpolate_pos_encoding, two kept at once
    with torch.inference_mode():
        for side in sides * 2:
            x = torch.randn(4, 3, side, side, device="cuda", generator=gen, dtype=torch.bfloat16)
            got = module(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
            want = reference(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
            assert all(rel(got[i], want[i]) < TOL for i in range(4)), side
        hook = encgraph.graphs(module)
        shapes = hook.stats["shapes"]
        assert len(shapes["live"]) == 2 and shapes["evicted"] >= 1 and shapes["graph_bytes"] > 0
        module.float()
        reference.float()
        for _ in range(3):
            x = torch.randn(3, 3, 224, 224, device="cuda", generator=gen)
            got = module(pixel_values=x).last_hidden_state
            assert got.dtype == torch.float32
            want = reference(pixel_values=x).last_hidden_state
            assert all(rel(got[i], want[i]) < 1e-2 for i in range(3))
    stats = hook.stats
    assert stats["rebuilds"] == {"module moved or cast (.to, .half, .cuda)": 1} and stats["graph_items"] > 0
    print(f"\nshapes: {shapes}")


def test_lora_injected_after_capture_is_held_by_the_new_graphs():
    peft = pytest.importorskip("peft")
    module = vit(layers=2)
    reference = copy.deepcopy(module)
    make = images()
    gen = torch.Generator(device="cuda").manual_seed(3)
    encgraph.graphed(module)
    with torch.inference_mode():
        for _ in range(2):
            module(**make(4, gen)[1])
    config = dict(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # transformers 5.25 ViT names
    torch.manual_seed(5)
    adapted = peft.get_peft_model(module, peft.LoraConfig(**config))
    torch.manual_seed(5)
    adapted_ref = peft.get_peft_model(reference, peft.LoraConfig(**config))
    adapted_ref.load_state_dict(adapted.state_dict())
    with torch.inference_mode():
        for n in (3, 8, 5):
            kwargs = make(n, gen)[1]
            got, want = module(**kwargs).last_hidden_state, adapted_ref.base_model.model(**kwargs).last_hidden_state
            assert all(rel(got[i], want[i]) < TOL for i in range(n))
    stats = encgraph.graphs(module).stats
    assert stats["rebuilds"] == {"parameters, buffers or submodules replaced": 1} and stats["graph_items"] >= 8 + 5


def test_nan_poisoned_pool_does_not_leak_into_items():
    module = vit(layers=2)
    reference = copy.deepcopy(module)
    make = images()
    gen = torch.Generator(device="cuda").manual_seed(4)
    encgraph.graphed(module, compile=False)
    with torch.inference_mode():
        for _ in range(2):
            module(**make(2, gen)[1])
        runner = encgraph.graphs(module).runner
        for record in runner.records["default"].values():  # every graph's intermediates become NaN
            for t in record.inputs.values():
                t.fill_(float("nan"))
            record.graph.replay()
        x = make(6, gen)[1]["pixel_values"]
        poisoned = x.clone()
        poisoned[2] = float("nan")  # one NaN image among its batch mates
        got = module(pixel_values=poisoned).last_hidden_state
        want = reference(pixel_values=x).last_hidden_state
    for i in (0, 1, 3, 4, 5):
        assert torch.isfinite(got[i]).all() and rel(got[i], want[i]) < TOL, i


def test_timm_vit_with_dynamic_image_size():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    module = timm.create_model("vit_small_patch16_224", pretrained=False, dynamic_img_size=True)
    module = module.cuda().to(torch.bfloat16).eval()
    stats = check(module, lambda n, gen: ((torch.randn(n, 3, 224, 224, device="cuda", generator=gen,
                                                       dtype=torch.bfloat16),), {}), field=lambda out: out)
    assert stats["graph_items"] == sum(SIZES[1:])


def test_open_clip_visual_tower():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None)
    visual = model.visual.cuda().to(torch.bfloat16).eval()
    stats = check(visual, lambda n, gen: ((torch.randn(n, 3, 224, 224, device="cuda", generator=gen,
                                                       dtype=torch.bfloat16),), {}), field=lambda out: out)
    assert stats["graph_items"] == sum(SIZES[1:])
