"""Real geometry of the families added after the seed, for the GPU tests: each family's row of the benchmarks'
tower table (``benches.lib.towers.TOWERS``, the one table of the released models' vision configs and their
sources) with what the tests add: the config key of the depth (``layers``, cut to ``test_depth``) and the budget
units of a 448 px image.
"""

from __future__ import annotations

from typing import Any

import attrs

from benches.lib.towers import TOWERS, TowerSpec


@attrs.frozen
class FamilyGeometry:
    """One family's tower at real geometry: its benchmark row (``spec``: classes and ``full`` config kwargs),
    ``layers`` the depth key; ``test_depth`` the depth the GPU tests build (random weights)."""

    name: str
    spec: TowerSpec
    layers: str
    test_depth: int = 8
    tokens_per_448px: int = 256
    """Budget units of one 448 x 448 image (Llama 4: tiles per 336 px tile, 1)."""

    @property
    def label(self) -> str:
        return self.spec.label

    def build(self, depth: int | None = None, dtype: Any = None, **overrides: Any) -> Any:
        """The tower with random weights (seeded) in ``dtype``, on the current default device, eval mode.

        Built in ``dtype`` rather than cast after: ``Module.to(bfloat16)`` would also cast Llama 4's complex rotary
        table to a real one (dropping its imaginary part)."""
        import torch

        kwargs = {**self.spec.full, self.layers: self.test_depth if depth is None else depth, **overrides}
        torch.manual_seed(0)
        config = self.spec.config_class()(**kwargs)
        tower = self.spec.model_class()._from_config(config, dtype=dtype or torch.bfloat16)
        with torch.no_grad():  # zero- or constant-initialised position tables: random values, as trained ones
            for name, param in tower.named_parameters():
                if "position_embedding" in name or "pos_embed" in name:
                    param.normal_(std=0.02)
        return tower.eval().requires_grad_(False)


def _row(name: str, layers: str, bench: str | None = None, **facts: Any) -> FamilyGeometry:
    return FamilyGeometry(name, TOWERS[bench or name], layers, **facts)


GEOMETRY: dict[str, FamilyGeometry] = {g.name: g for g in (
    _row("glm4v", "depth"),
    _row("qwen3_5", "depth", tokens_per_448px=196),  # patch 16: 448 px -> 28 x 28 patches
    _row("ernie4_5_vl", "depth", bench="ernie4_5_vl_moe"),
    _row("kimi_k25", "num_hidden_layers"),
    _row("minicpmv4_6", "num_hidden_layers"),
    _row("paddleocr_vl", "num_hidden_layers", tokens_per_448px=1024),  # budgets count rows: 32 x 32 patches
    _row("pixtral", "num_hidden_layers", tokens_per_448px=784),  # budgets count rows: 28 x 28 patches of 16 px
    _row("hunyuan_vl", "num_hidden_layers", tokens_per_448px=196),  # patch 16: 28 x 28 patches, 196 units
    _row("siglip2", "num_hidden_layers", tokens_per_448px=256),  # rows: the processor's 16 x 16 patches at most
    # SmolVLM2-2.2B (Idefics3-8B's tower at 364 px tiles): budgets count real patch rows; its processor upscales a
    # 448 px image to 1536 px, 4 x 4 tiles of 384 px and a global one: 17 x 729 rows.
    _row("smolvlm", "num_hidden_layers", tokens_per_448px=17 * 729),
    _row("llama4", "num_hidden_layers", tokens_per_448px=1),
)}
