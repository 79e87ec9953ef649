"""Fixed-resolution towers on a GPU (bf16, random weights): capture once, replay fresh random batches of many
sizes, each image equal to eager.

Two references per image:

- the same padded static forward run eagerly (a ``RunMode.STATIC`` runner: same shapes, same kernels): the
  replay must equal it bit for bit;
- the tower's own forward on the unpadded batch (other GEMM shapes, so other kernels): within bf16 tolerance;
  the largest relative error is printed (run with ``-s``) and kept in ``WORST``.

Geometry: SigLIP-so400m (hidden 1152, 16 heads, MLP 4304, patch 14, 384 px: 729 tokens, pooling head) with
4 of its 27 layers; small CLIP and InternVL towers.
"""

from __future__ import annotations

import encgraph
from encgraph.models.own_forward import own_forward

import time
from typing import Any

import pytest
import torch

from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models.fixed import HIDDEN, PixelBatch
from encgraph.models.registry import wrap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = 5e-2
"""Per image, max |replay - HF eager| / max |HF eager| in bf16 (other batch shapes round differently)."""
SIZES = (1, 3, 8, 13, 32, 37)
"""Batch sizes per replay round: exact budgets, padded ones, and more than the largest (two batches)."""
WORST: dict[str, float] = {}


def _build(cls_name: str, config_name: str, **config: Any) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))
    return tower.to(torch.bfloat16).eval()


def siglip_so400m(layers: int = 4) -> torch.nn.Module:
    return _build(
        "SiglipVisionModel", "SiglipVisionConfig", hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers,
        num_attention_heads=16, patch_size=14, image_size=384, vision_use_head=True,
    )


def small_clip() -> torch.nn.Module:
    return _build(
        "CLIPVisionModel", "CLIPVisionConfig", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, patch_size=14, image_size=224,
    )


def small_internvl() -> torch.nn.Module:
    tower = _build(
        "InternVLVisionModel", "InternVLVisionConfig", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, patch_size=[14, 14], image_size=[448, 448], use_qk_norm=True, norm_type="rms_norm",
        use_mean_pooling=False,
    )
    with torch.no_grad():  # zero-initialised by HF
        tower.embeddings.position_embeddings.normal_(std=0.02)
        tower.embeddings.cls_token.normal_(std=0.02)
    return tower


def pixels(tower: torch.nn.Module, n: int, gen: torch.Generator) -> torch.Tensor:
    h, w = (tower.config.image_size,) * 2 if isinstance(tower.config.image_size, int) else tower.config.image_size
    return torch.randn(n, 3, h, w, device="cuda", generator=gen).to(torch.bfloat16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def runners(tower: torch.nn.Module, **options: Any) -> tuple[EncoderGraphRunner, EncoderGraphRunner]:
    """A GRAPH runner (captured here) and a STATIC runner (same plan and padded shapes, run eagerly)."""
    # Plain graphs: replays are checked against the eager static forward on the same kernels (the compiled
    # default is exercised by test_drop_in_returns_the_tower_output).
    # Plain graphs and the greedy plan, as the STATIC reference has (a cost-aware plan may batch images otherwise,
    # and bf16 matmuls of another batch size round otherwise): replays must be bit-exact against it.
    graph = EncoderGraphRunner(wrap(tower, **options), compile=False, costs=False)
    info = graph.capture()
    print(
        f"\n{type(tower).__name__}: {info['graphs']} graphs in {info['seconds']} s, pool "
        f"{info['pool_bytes'] / 2**20:.0f} MiB, buffers {info['buffer_bytes'] / 2**20:.0f} MiB, failed {info['failed']}"
    )
    assert not info["failed"]
    return graph, EncoderGraphRunner(wrap(tower, **options), mode=RunMode.STATIC)


def check_rounds(name: str, tower: torch.nn.Module, rounds: int = 3, **options: Any) -> None:
    """Fresh random batches of every size in SIZES, ``rounds`` times, through one captured runner."""
    graph, static = runners(tower, **options)
    gen = torch.Generator(device="cuda").manual_seed(1)
    worst = 0.0
    hidden = [n for n in graph.adapter.config.path("default").outputs if n.startswith(HIDDEN)]
    for _ in range(rounds):
        for n in SIZES:
            x = pixels(tower, n, gen)
            got, same = graph(PixelBatch(x)), static(PixelBatch(x))
            with torch.no_grad():
                ref = tower(pixel_values=x, output_hidden_states=bool(hidden))
            for i in range(n):
                for key, value in got[i].items():
                    assert torch.isfinite(value).all(), f"{name} size {n} image {i} {key}: non-finite"
                    assert torch.equal(value, same[i][key]), f"{name} size {n} image {i} {key}: replay != static"
                    expected = ref.hidden_states[int(key[len(HIDDEN):])] if key.startswith(HIDDEN) else ref[key]
                    err = rel_err(value[0], expected[i])
                    assert err < BF16_TOL, f"{name} size {n} image {i} {key}: relative error {err:.3e}"
                    worst = max(worst, err)
    WORST[name] = worst
    print(f"{name}: replay == static bit for bit; max relative error vs HF eager {worst:.3e}; {graph.stats['paths']}")
    assert graph.stats["graph_items"] == graph.stats["items"] == rounds * sum(SIZES)


def test_siglip_so400m_replays_equal_eager():
    check_rounds("siglip-so400m", siglip_so400m())


def test_clip_replays_equal_eager_with_llava_hidden_state():
    check_rounds("clip", small_clip(), hidden_states=[-2])


def test_internvl_replays_equal_eager():
    check_rounds("internvl", small_internvl())


def test_drop_in_returns_the_tower_output():

    tower = siglip_so400m(layers=2)
    fast = encgraph.graphed(tower)
    x = pixels(tower, 5, torch.Generator(device="cuda").manual_seed(2))
    with torch.inference_mode():  # the tower's parameters require grad: a plain call would ask for autograd
        out = fast(x)
    with torch.no_grad():
        ref = own_forward(tower)(x)
    assert type(out) is type(ref) and out.last_hidden_state.shape == ref.last_hidden_state.shape
    assert rel_err(out.pooler_output, ref.pooler_output) < BF16_TOL
    assert encgraph.graphs(fast).stats["mode"] == "graph" and encgraph.graphs(fast).stats["graph_items"] == 5


def test_nan_poisoned_pool_and_buffers_do_not_leak():
    tower = siglip_so400m(layers=2)
    graph, static = runners(tower)
    for records in graph.records.values():  # every graph's intermediates in the shared pool become NaN
        for record in records.values():
            for t in record.inputs.values():
                t.fill_(float("nan"))
            record.graph.replay()
            assert torch.isnan(record.outputs["last_hidden_state"]).all()
    gen = torch.Generator(device="cuda").manual_seed(3)
    buffer = graph.buffers["default"].storage["arg0"]
    for n in (1, 3, 5, 7):
        buffer.fill_(float("nan"))  # stale NaN in the pixel rows past the batch, too
        x = pixels(tower, n, gen)
        got, same = graph(PixelBatch(x)), static(PixelBatch(x))
        last = graph.plan(PixelBatch(x)).batches[-1]  # the batch whose rows the buffer holds now
        assert (buffer[len(last.items) : last.budgets["default"]] == 0).all(), "padding rows must be zero images"
        for i in range(n):
            for key, value in got[i].items():
                assert torch.isfinite(value).all() and torch.equal(value, same[i][key])


@pytest.mark.parametrize("make", [siglip_so400m, small_clip, small_internvl], ids=["siglip", "clip", "internvl"])
def test_static_forward_never_syncs(make):
    adapter = wrap(make(), hidden_states=[-2])
    specs = adapter.buffer_specs("default", 4, 4, 4)
    buffers = {k: torch.zeros(s.shape, dtype=s.dtype, device="cuda") for k, s in specs.items()}
    adapter.forward_static("default", buffers, 4)  # warm-up: lazy init may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adapter.forward_static("default", buffers, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_siglip_so400m_replay_vs_eager_time():
    """Not a benchmark (issue 5 has those): a sanity print of call time, graphed vs the tower's eager forward."""

    tower = siglip_so400m(layers=27)
    fast = encgraph.graphed(tower, budgets=[1, 8])
    encgraph.graphs(fast).capture()
    gen = torch.Generator(device="cuda").manual_seed(4)
    for n in (1, 8):
        x = pixels(tower, n, gen)
        timings = {}
        for label, fn in (("graphed", lambda: fast(x)), ("eager", lambda: tower(x))):
            with torch.no_grad():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            timings[label] = (time.perf_counter() - start) / 10 * 1e3
        print(f"\nso400m (27 layers) batch {n}: graphed {timings['graphed']:.2f} ms, eager {timings['eager']:.2f} ms")
        with torch.no_grad():
            assert rel_err(fast(x).last_hidden_state, tower(x).last_hidden_state) < BF16_TOL
