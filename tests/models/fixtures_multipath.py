"""Tiny random-weight Gemma-4 and Step-3.7 models and their inputs, built locally (no downloads), for the CPU tests
and, at real geometry, the GPU tests (``tests/gpu/test_multipath_gpu.py``). Plain functions: the test files import
them.

Gemma-4: patch 2 (12 values per patch row), pooling kernel 3, two layers with grouped KV heads, clipped linears
and standardisation with non-trivial buffers. Step-3.7: patch 4, 56 px global views (14 x 14 patches, 16 tokens)
and 40 px crops (10 x 10 patches: the position table is interpolated, 9 tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import pytest
import torch

from benches.lib.towers import TOWERS
from encgraph.models.gemma4_layout import grid_positions

@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread (test modules import this fixture): with other suites on the same two cores, OpenMP
    threads spinning over 32-wide matmuls cost tens of times the work itself (measured: 830 ms vs 16 ms for one
    tiny Gemma-4 forward)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


GRAD_MODES: dict[str, Any] = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "plain": nullcontext}
"""Every grad mode a call may come in (design rule 12)."""


def grad_mode(name: str) -> AbstractContextManager[Any]:
    return GRAD_MODES[name]()


def static_forwards(adapter: Any, cases: Sequence[tuple[str, int]], device: str, items: int = 4) -> dict[str, Any]:
    """Each ``(path, budget)``'s static forward on an all-padding batch in freshly allocated buffers on ``device``,
    as at capture (``meta``: any host read of a tensor value raises)."""
    from encgraph.capture.buffers import PathBuffers

    outputs = {}
    for path, budget in cases:
        specs = {budget: adapter.buffer_specs(path, budget, items, items)}
        views = PathBuffers(path, specs, torch.device(device)).fill(budget, None)
        outputs[path] = adapter.forward_static(path, views, budget)
    return outputs


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max absolute difference over the reference's max absolute value."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def norm_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------- Gemma-4
GEMMA_TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, patch_size=2, pooling_kernel_size=3, position_embedding_size=64, standardize=True,
    use_clipped_linears=True,
)
GEMMA_REAL = TOWERS["gemma4"].full
"""The Gemma-4 vision tower's geometry (the benchmarks' row: its config defaults, standardised); tests choose the
depth."""
GEMMA_TEXT = dict(
    vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, vocab_size_per_layer_input=64, hidden_size_per_layer_input=4,
    layer_types=["full_attention"],
)


def _randomise_gemma_buffers(tower: torch.nn.Module) -> None:
    # Standardisation and clipping buffers initialise to identities (0 / 1 / infinities): give them values that
    # change the result, with clip bounds wide enough to bite only on outliers.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if getattr(tower.config, "standardize", False):
            tower.std_bias.copy_(torch.randn(tower.std_bias.shape, generator=gen))
            tower.std_scale.copy_(torch.rand(tower.std_scale.shape, generator=gen) + 0.5)
        for name, buf in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buf.fill_(-3.0)
            elif name.endswith(("input_max", "output_max")):
                buf.fill_(3.0)


def gemma4_tower(*, depth: int = 2, device: str = "cpu", dtype: torch.dtype = torch.float32, real: bool = False,
                 **overrides: Any) -> torch.nn.Module:
    """A random ``Gemma4VisionModel`` (tiny, or the real geometry with ``real=True``), eval mode."""
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    options = {**(GEMMA_REAL if real else GEMMA_TINY), "num_hidden_layers": depth, **overrides}
    torch.manual_seed(0)
    tower = Gemma4VisionModel._from_config(Gemma4VisionConfig(**options))
    _randomise_gemma_buffers(tower)
    # Frozen, as served: a plain call with trainable parameters asks for autograd (the tower's own forward).
    return tower.to(device=device, dtype=dtype).eval().requires_grad_(False)


def gemma4_model(**vision: Any) -> torch.nn.Module:
    """A random ``Gemma4Model`` (tiny vision tower and text model, no audio), eval mode."""
    from transformers import Gemma4Config, Gemma4Model

    torch.manual_seed(0)
    model = Gemma4Model(Gemma4Config(text_config=GEMMA_TEXT, vision_config={**GEMMA_TINY, **vision}, audio_config=None))
    _randomise_gemma_buffers(model.vision_tower)
    return model.eval().requires_grad_(False)


def gemma4_batch(
    grids: Sequence[tuple[int, int]], rows: int, channels: int, *, seed: int = 0, shuffle: bool = False,
    device: str = "cpu", dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values (B, rows, channels), pixel_position_ids (B, rows, 2))`` as the processor pads them: item ``i``
    a ``grids[i] = (W, H)`` patch grid, then ``(-1, -1)`` rows. ``shuffle`` permutes each item's rows (real and
    padding mixed: the tower's result does not depend on the order). Pixels uniform in [0, 1], padding zero."""
    gen = np.random.default_rng(seed)
    pos = np.full((len(grids), rows, 2), -1, np.int64)
    pv = torch.zeros(len(grids), rows, channels)
    tgen = torch.Generator().manual_seed(seed)
    for i, (w, h) in enumerate(grids):
        pos[i, : w * h] = grid_positions(w, h)
        pv[i, : w * h] = torch.rand(w * h, channels, generator=tgen)
        if shuffle:
            perm = gen.permutation(rows)
            pos[i], pv[i] = pos[i, perm], pv[i, torch.from_numpy(perm)]
    return pv.to(device=device, dtype=dtype), torch.from_numpy(pos).to(device)


def split_rows(rows: torch.Tensor, tokens: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(rows, list(tokens)))


# ---------------------------------------------------------------------------------------------------- Step-3.7
STEP_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=4)
STEP_LOCAL = 40
STEP_REAL = TOWERS["step3p7"].full["vision_config"]
"""Step-3.7's vision tower geometry (the benchmarks' row: hidden 1536, 16 heads, MLP 8960, 728 px views at patch
14); tests pick the depth. Crops are 504 px."""
STEP_TEXT = dict(
    vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=2, num_attention_groups=1, head_dim=12,
    intermediate_size=32, mlp_layer_types=["dense"], max_position_embeddings=512, sliding_window=16,
)
STEP_IMAGE_TOKEN = 5


def step3p7_model(*, depth: int = 2, device: str = "cpu", dtype: torch.dtype = torch.float32, real: bool = False,
                  text_hidden: int = 24) -> torch.nn.Module:
    """A random ``Step3p7ForConditionalGeneration`` (tiny vision tower, or the real geometry), eval mode."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    vision = {**(STEP_REAL if real else STEP_TINY), "num_hidden_layers": depth}
    config = Step3p7Config(
        vision_config=vision, text_config={**STEP_TEXT, "hidden_size": text_hidden}, image_token_id=STEP_IMAGE_TOKEN
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Step3p7ForConditionalGeneration(config)
    return model.to(dtype).eval().requires_grad_(False)


def step3p7_views(
    tiles: Sequence[int], global_size: int, local_size: int, *, seed: int = 0, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """``(pixel_values, pixel_values_local or None, num_local_patches)`` of random normalised views."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pv = torch.randn(len(tiles), 3, global_size, global_size, generator=gen, device=device).to(dtype)
    n = sum(tiles)
    local = torch.randn(n, 3, local_size, local_size, generator=gen, device=device).to(dtype) if n else None
    return pv, local, list(tiles)
